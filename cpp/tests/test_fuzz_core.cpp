// Deterministic random-input fuzzer of the core's native entry points, meant to run under
// AddressSanitizer + UndefinedBehaviorSanitizer (see .ci/run): every call gets mostly valid
// inputs (so that the deep code paths run) mixed with malformed ones (NaN, +-inf, -0.0,
// denormals, 1e308, negative and huge counts, empty and mismatched arrays, out-of-range
// indices). Contract checked for every call: it returns, or throws dflop::InvalidArgument
// or dflop::Infeasible (dflop::Interrupted only when the fuzzer's own interrupt check
// fired); any other exception is a failure. On success, cheap invariants that the headers
// document are checked, and where a header documents a model precisely, the result is
// compared with an independent reference (the pipeline simulator, the routing plan,
// pipeline_actions, the pipeline scheduler's step model, split_layers' optimum).
//
// Environment:
//   DFLOP_FUZZ_ITERATIONS     base iteration count N (default kDefaultIterations); each case
//                             runs N x its weight / 4 iterations (printed at its start)
//   DFLOP_FUZZ_SEED           seed (default 1); iteration i of a case draws from a generator
//                             seeded by (seed, case, i) only, so any iteration replays alone
//   DFLOP_FUZZ_ONLY_ITERATION run only this iteration of every selected case; with the case
//                             name as argv[1] it replays one failure:
//                               DFLOP_FUZZ_SEED=1 DFLOP_FUZZ_ONLY_ITERATION=17
//                               ./test_fuzz_core fuzz_balance
//   DFLOP_FUZZ_KNOWN_BUGS=1   also run the inputs that the cases skip: those of the open
//                             known bugs listed below (they then fail) and the merely
//                             expensive ones (combine it with DFLOP_FUZZ_ONLY_ITERATION or
//                             a small DFLOP_FUZZ_ITERATIONS)
//   DFLOP_FUZZ_HANG_S         seconds after which one iteration counts as hung (default 120;
//                             0: no watchdog): the watchdog prints it and aborts
//   DFLOP_FUZZ_VERBOSE=1      print every iteration's input and time
//
// A failure prints the case, the iteration, the seed, the input (as C++-like initializers)
// and the command that replays it.
//
// Bugs this fuzzer found (all fixed: KB1-KB20 in 48d9c9d, KB21-KB22 after; regression cases at the
// end of this file, which also cover the sanitizer-only ones). The oracles now expect the bounds
// the fixes documented, and the fuzzer feeds the inputs that used to hit these bugs again.
//   KB1 balance: a work_budget near INT64_MAX with capacities overflowed the budget
//       arithmetic. Now: budgets above kMaxWorkBudget (2^50) count as 2^50
//       (stats.work_budget = min(budget, 2^50)).
//   KB2 balance: time_limit_s >= ~9.2e9 (or +inf) overflowed the float -> integer
//       conversion of the deadline. Now: time limits >= 1e9 s mean none.
//   KB3 split_units: num_replicas was unbounded. Now: num_replicas <= kMaxSplitReplicas (2^20).
//   KB4 split_units: the unit split's work and memory grew with the total units (overflow,
//       std::length_error). Now: units sum to at most kMaxSplitUnits (2^24).
//   KB5 plan_routing: num_src x num_dst was unbounded. Now: at most kMaxRoutingReplicas
//       (4096) per side.
//   KB6 plan_routing: send_rows sums overflowed (signed). Now: InvalidArgument when a pair's
//       rows overflow int64.
//   KB7 pipeline_actions: num_microbatches was unbounded. Now (also simulate_pipeline): at
//       most kMaxPipelineMicrobatches (10^7).
//   KB8 split_layers: num_stages / num_layers were unbounded. Now: num_layers <=
//       kMaxPlannerLayers (2^16) there and in the planner's modules.
//   KB9 padded_heads: heads + tp - 1 overflowed (also through plan_layouts). Now: heads <=
//       kMaxPlannerHeads (2^20), tp <= kMaxPlannerGpus (2^20).
//   KB10 default_microbatch_choices: p *= 2 overflowed for max_microbatches >= 2^62. Now it
//       stops doubling before the end.
//   KB11 validate_planner_input: num_batches x batch_size wrapped around in size_t. Now:
//       num_batches <= kMaxPlannerBatches (2^16), batch_size <= kMaxPlannerBatchSize (2^24).
//   KB12 plan_layouts: 4 x top_k, 4 x patience and patience x 2048 / batch overflowed. Now:
//       top_k in [1, 2^20], patience in [0, 2^20].
//   KB13 evaluate_layout & co (check_layout): num_microbatches x llm.dp, tp x pp x dp and the
//       sum of layers_per_stage overflowed. Now: tp, pp, dp <= num_gpus, layers_per_stage
//       entries in [1, num_layers], num_microbatches in [1, global_batch].
//   KB14 plan_layouts: num_gpus was unbounded and the search is linear in it. Now: num_gpus
//       <= kMaxPlannerGpus (2^20) (clusters above 64 GPUs are still skipped here as expensive).
//   KB15 validate_planner_input accepted balance_work_budget < -1 (balance() then failed
//       with a message naming neither). Now: validated, the message names it.
//   KB16 pipeline_schedule / simulated_step_time: a stage load overflowing to +inf made the
//       simulation NaN (std::logic_error, or a step of 0). Now: InvalidArgument when the cost
//       column sums + num_microbatches x microbatch_constant_s + 2 x stages x microbatches x
//       link_latency_s exceed 1e200 s (validate_pipeline_schedule_input).
//   KB17 split_units: a piece's cost x num_units / units overflowed for costs near DBL_MAX.
//       Now: priced as cost x (num_units / units).
//   KB18 (documented, not a bug) balance with capacities: a larger work_budget can end
//       worse, or Infeasible where a smaller one found a schedule. balance.hpp now promises
//       "never worse" only without capacities, so fuzz_balance checks it only there.
//   KB19 plan_layouts / evaluate_layout: a batch whose every simulated order took +inf (e.g.
//       link_latency_s = 1e308) kept a default StepBreakdown. Now: the planner's times and
//       sizes must be in [0, 1e100].
//   KB20 plan_layouts with prune = false (or MeanShapeReference) returned the same layout
//       several times when microbatch_choices listed a count twice. Now: one candidate.
//   KB21 plan_layouts / evaluate_layout: the KB19 symptom through a denormal bandwidth
//       (every order of a batch +inf, a default StepBreakdown kept). Now: bandwidths and
//       memory must be finite and >= 1, and the first order's breakdown is always kept.
//   KB22 validate_planner_input accepted any encoder_units, but split_units takes at most
//       kMaxSplitUnits units: plan_layouts failed mid-search with split_units' message.
//       Now: a batch's encoder_units must sum to at most kMaxSplitUnits, named up front.
// Inputs that are merely expensive (huge but legal search budgets, large clusters, layer
// and unit counts) are skipped the same way and counted as "expensive (...)".
#include <cxxabi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "check.hpp"
#include "dflop/balance.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"
#include "dflop/pipeline_schedule.hpp"
#include "dflop/planner.hpp"
#include "dflop/routing.hpp"
#include "dflop/simulator.hpp"

namespace {

// About 6 s for the plain ctest run of this file in a Release build on a 2-core machine
// (measured: 5.5 to 6.1 s for seeds 1 to 3).
constexpr int64_t kDefaultIterations = 4000;
// A case stops after this many failed checks (the first ones tell the story).
constexpr int kMaxFailuresPerCase = 25;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kDenormMin = std::numeric_limits<double>::denorm_min();
constexpr double kDblMin = std::numeric_limits<double>::min();
constexpr double kDblMax = std::numeric_limits<double>::max();

using Ints = std::vector<int64_t>;
using Doubles = std::vector<double>;

// ---------------------------------------------------------------------------------------
// Configuration

struct Config {
  uint64_t seed = 1;
  int64_t iterations = kDefaultIterations;
  int64_t only_iteration = -1;
  bool known_bugs = false;
  bool verbose = false;
  int64_t hang_s = 120;
};

bool parse_u64(const char* text, uint64_t* out) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 0);
  if (errno != 0 || end == text || *end != '\0' || text[0] == '-') return false;
  *out = static_cast<uint64_t>(v);
  return true;
}

bool parse_i64(const char* text, int64_t* out) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 0);
  if (errno != 0 || end == text || *end != '\0') return false;
  *out = static_cast<int64_t>(v);
  return true;
}

const Config& config() {
  static const Config cfg = [] {
    Config c;
    auto text = [](const char* name) -> const char* {
      const char* v = std::getenv(name);
      return v != nullptr && *v != '\0' ? v : nullptr;
    };
    auto read = [&](const char* name, int64_t* out) {
      if (const char* v = text(name)) {
        if (!parse_i64(v, out)) std::printf("warning: ignoring %s=%s (not an integer)\n", name, v);
      }
    };
    if (const char* v = text("DFLOP_FUZZ_SEED")) {
      if (!parse_u64(v, &c.seed)) std::printf("warning: ignoring DFLOP_FUZZ_SEED=%s\n", v);
    }
    read("DFLOP_FUZZ_ITERATIONS", &c.iterations);
    c.iterations = std::max<int64_t>(c.iterations, 0);
    read("DFLOP_FUZZ_ONLY_ITERATION", &c.only_iteration);
    int64_t known = 0;
    read("DFLOP_FUZZ_KNOWN_BUGS", &known);
    c.known_bugs = known != 0;
    int64_t verbose = 0;
    read("DFLOP_FUZZ_VERBOSE", &verbose);
    c.verbose = verbose != 0;
    read("DFLOP_FUZZ_HANG_S", &c.hang_s);
    return c;
  }();
  return cfg;
}

// ---------------------------------------------------------------------------------------
// Random numbers (SplitMix64: fully specified, identical on every platform)

uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (0 for n = 0); the modulo bias is irrelevant here.
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }
  // Uniform in [lo, hi], hi >= lo, hi - lo small.
  int64_t range(int64_t lo, int64_t hi) {
    return hi <= lo ? lo : lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo) + 1));
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  double log_uniform(double lo, double hi) { return lo * std::pow(hi / lo, uniform()); }
  bool chance(double p) { return uniform() < p; }
  template <class T>
  T pick(std::initializer_list<T> values) {
    return *(values.begin() + below(values.size()));
  }
  template <class T>
  const T& pick(const std::vector<T>& values) {
    return values[below(values.size())];
  }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }

 private:
  uint64_t state_;
};

// Malformed and boundary values.
double weird_double(Rng& r) {
  static const double kValues[] = {
      kNaN,   -kNaN, kInf,  -kInf,   -0.0,     0.0, -1.0, -1e-300, kDenormMin, 1e-310, kDblMin,
      1e-300, 1e300, 1e308, kDblMax, -kDblMax, 1.0, 0.5,  0x1p53,  1e18,       1e-12,  2.0};
  return kValues[r.below(sizeof(kValues) / sizeof(kValues[0]))];
}

int64_t weird_int(Rng& r) {
  static const int64_t kValues[] = {0,
                                    1,
                                    -1,
                                    2,
                                    -2,
                                    3,
                                    5,
                                    64,
                                    4097,
                                    std::numeric_limits<int32_t>::max(),
                                    int64_t{std::numeric_limits<int32_t>::max()} + 1,
                                    int64_t{1} << 32,
                                    int64_t{1} << 40,
                                    int64_t{1} << 53,
                                    int64_t{1} << 61,
                                    int64_t{1} << 62,
                                    kI64Max,
                                    kI64Max - 1,
                                    kI64Min,
                                    kI64Min + 1,
                                    -(int64_t{1} << 40)};
  return kValues[r.below(sizeof(kValues) / sizeof(kValues[0]))];
}

// `count` non-negative values from one of several profiles (uniform, heavy-tailed, small
// integers with ties, mostly zeros, all equal, six decades wide, denormal-tiny, huge).
Doubles gen_values(Rng& r, int64_t count) {
  Doubles v(static_cast<size_t>(std::max<int64_t>(count, 0)));
  const int profile = static_cast<int>(r.below(8));
  const double scale = r.chance(0.5) ? 1.0 : r.log_uniform(1e-3, 1e3);
  const double equal = r.uniform(0.1, 2.0) * scale;
  for (double& x : v) {
    switch (profile) {
      case 0:
        x = r.uniform() * scale;
        break;
      case 1: {
        const double e = -std::log(1.0 - r.uniform());
        x = e * e * scale;
        break;
      }
      case 2:
        x = static_cast<double>(r.range(0, 5));
        break;
      case 3:
        x = r.chance(0.7) ? 0.0 : r.uniform() * scale;
        break;
      case 4:
        x = equal;
        break;
      case 5:
        x = r.log_uniform(1e-6, 1e6);
        break;
      case 6:
        x = r.chance(0.5) ? kDenormMin * static_cast<double>(r.range(1, 100))
                          : 1e-300 * r.uniform();
        break;
      default:
        x = r.log_uniform(1e100, 1e150);
        break;
    }
  }
  return v;
}

// Values small enough that sums over a few thousand of them stay far from overflow, so a
// non-finite result would be a bug rather than an overflow the caller asked for.
bool moderate(double v) { return std::isfinite(v) && std::fabs(v) <= 1e15; }
bool moderate(const Doubles& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return moderate(x); });
}

bool nonneg_finite(double v) { return std::isfinite(v) && v >= 0.0; }

// |a - b| <= tol * max(1e-300, |a|, |b|): relative (also for tiny values); equal if infinite,
// never if NaN.
bool rel_near(double a, double b, double tol) {
  if (a == b) return true;
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  const double scale = std::max({1e-300, std::fabs(a), std::fabs(b)});
  return std::fabs(a - b) <= tol * scale;
}

// a + b, saturated (the generators nudge values that may already be extreme).
int64_t add_sat(int64_t a, int64_t b) {
  int64_t r = 0;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return b > 0 ? kI64Max : kI64Min;
}

bool mul_overflows(int64_t a, int64_t b, int64_t* out = nullptr) {
  int64_t r = 0;
  const bool over = __builtin_mul_overflow(a, b, &r);
  if (out != nullptr) *out = r;
  return over;
}

// ---------------------------------------------------------------------------------------
// Printing inputs (as C++-like initializers, so that a failure can be pasted into a case)

std::string num(double v) {
  if (std::isnan(v)) return "kNaN";
  if (std::isinf(v)) return v > 0 ? "kInf" : "-kInf";
  if (v == 0.0 && std::signbit(v)) return "-0.0";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string num(int64_t v) {
  if (v == kI64Max) return "kI64Max";
  if (v == kI64Min) return "kI64Min";
  return std::to_string(v);
}

template <class T>
std::string vec(const std::vector<T>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    if constexpr (std::is_floating_point_v<T>) {
      s += num(static_cast<double>(v[i]));
    } else {
      s += num(static_cast<int64_t>(v[i]));
    }
  }
  return s + "}";
}

std::string type_name(const std::exception& e) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : typeid(e).name();
  std::free(demangled);
  return name;
}

// ---------------------------------------------------------------------------------------
// Watchdog: an iteration running longer than DFLOP_FUZZ_HANG_S is reported and aborted.

class Watchdog {
 public:
  static Watchdog& instance() {
    static Watchdog w;
    return w;
  }
  void start(int64_t limit_s) {
    if (limit_s <= 0 || thread_.joinable()) return;
    limit_s_ = limit_s;
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void arm(std::string label) {
    std::lock_guard<std::mutex> lock(mu_);
    label_ = std::move(label);
    since_ = Clock::now();
    armed_ = true;
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }

 private:
  using Clock = std::chrono::steady_clock;
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(250));
      if (armed_ && Clock::now() - since_ > std::chrono::seconds(limit_s_)) {
        std::printf("HANG: %s has run for more than %" PRId64 " s (DFLOP_FUZZ_HANG_S); aborting\n",
                    label_.c_str(), limit_s_);
        std::fflush(stdout);
        std::abort();
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
  bool stop_ = false, armed_ = false;
  int64_t limit_s_ = 0;
  std::string label_;
  Clock::time_point since_;
};

// ---------------------------------------------------------------------------------------
// The fuzz loop of one case: iterations, outcome counts, failure reports.

enum class Outcome { Returned, Invalid, Infeasible, Interrupted, Failed };

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Returned:
      return "returned";
    case Outcome::Invalid:
      return "InvalidArgument";
    case Outcome::Infeasible:
      return "Infeasible";
    case Outcome::Interrupted:
      return "Interrupted";
    default:
      return "another exception";
  }
}

class Fuzz {
 public:
  // `quarters`: the case runs DFLOP_FUZZ_ITERATIONS x quarters / 4 iterations (its cost).
  Fuzz(const char* name, int64_t quarters) : name_(name), quarters_(quarters) { current_ = this; }
  ~Fuzz() { current_ = nullptr; }
  Fuzz(const Fuzz&) = delete;
  Fuzz& operator=(const Fuzz&) = delete;

  static Fuzz& current() { return *current_; }

  template <class Body>
  void run(Body&& body) {
    const Config& cfg = config();
    int64_t count = cfg.iterations * quarters_ / 4;
    if (cfg.iterations > 0) count = std::max<int64_t>(count, 1);
    int64_t first = 0, last = count;
    if (cfg.only_iteration >= 0) first = cfg.only_iteration, last = cfg.only_iteration + 1;
    std::printf("%s: iterations [%" PRId64 ", %" PRId64 "), DFLOP_FUZZ_SEED=%" PRIu64 "\n", name_,
                first, last, cfg.seed);
    std::fflush(stdout);
    uint64_t name_hash = 1469598103934665603ULL;  // FNV-1a
    for (const char* p = name_; *p != '\0'; ++p)
      name_hash = (name_hash ^ uint8_t(*p)) * 1099511628211ULL;
    const auto started = std::chrono::steady_clock::now();
    for (int64_t it = first; it < last && !stopped_; ++it) {
      iteration_ = it;
      describe_ = nullptr;
      reported_input_ = false;
      Rng rng(mix64(cfg.seed ^ mix64(name_hash ^ mix64(static_cast<uint64_t>(it)))));
      Watchdog::instance().arm(std::string(name_) + " iteration " + std::to_string(it) +
                               " (replay: " + replay() + ")");
      const auto t0 = std::chrono::steady_clock::now();
      body(rng);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      Watchdog::instance().disarm();
      if (cfg.verbose) std::printf("  #%" PRId64 ": %.3f ms\n", it, 1e3 * dt);
      ++ran_;
      if (dt > slowest_s_) slowest_s_ = dt, slowest_it_ = it;
    }
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("%s: %" PRId64 " iterations in %.2f s (%.3f ms each, slowest %.2f ms: #%" PRId64
                ")\n",
                name_, ran_, total, ran_ > 0 ? 1e3 * total / double(ran_) : 0.0, 1e3 * slowest_s_,
                slowest_it_);
    for (const auto& [label, c] : counts_) {
      std::printf("  %-32s %6" PRId64 " returned %6" PRId64 " InvalidArgument %6" PRId64
                  " Infeasible %4" PRId64 " Interrupted %4" PRId64 " other\n",
                  label.c_str(), c[0], c[1], c[2], c[3], c[4]);
    }
    for (const auto& [bug, n] : skipped_) {
      const bool is_bug = bug.rfind("KB", 0) == 0;
      std::printf("  %6" PRId64 " inputs %s %s (%s)\n", n, is_bug ? "hit known bug" : "were",
                  bug.c_str(),
                  config().known_bugs ? "run anyway: DFLOP_FUZZ_KNOWN_BUGS" : "skipped");
    }
    std::fflush(stdout);
  }

  // The current iteration's input, printed with its first failure (DFLOP_FUZZ_VERBOSE: now).
  // `d` may refer to the iteration's locals: it is not called after the iteration.
  void describe(std::function<std::string()> d) {
    describe_ = std::move(d);
    if (config().verbose) {
      std::printf("  #%" PRId64 " input: %s\n", iteration_, describe_().c_str());
      std::fflush(stdout);
    }
  }

  // An input that a case skips (an open known bug "KB...", or "expensive (...)"): counted;
  // returns whether to run it anyway (DFLOP_FUZZ_KNOWN_BUGS).
  bool skip(const char* bug) {
    auto it = std::find_if(skipped_.begin(), skipped_.end(),
                           [&](const auto& e) { return e.first == bug; });
    if (it == skipped_.end()) {
      skipped_.emplace_back(bug, 1);
    } else {
      ++it->second;
    }
    return config().known_bugs;
  }

  void fail(const char* file, int line, const std::string& what) {
    std::ostringstream s;
    s << "[" << name_ << " iteration " << iteration_ << ", DFLOP_FUZZ_SEED=" << config().seed
      << "] " << what;
    ::dflop_test::check(false, file, line, s.str());
    if (!reported_input_) {
      reported_input_ = true;
      std::printf("  input: %s\n  replay: %s\n",
                  describe_ ? describe_().c_str() : "(not described)", replay().c_str());
    }
    if (++failures_ >= kMaxFailuresPerCase && !stopped_) {
      stopped_ = true;
      std::printf("  %s: %d failed checks, stopping this case\n", name_, failures_);
    }
    std::fflush(stdout);
  }

  // Runs f(); counts and returns how it ended. Any exception but InvalidArgument and
  // Infeasible (and Interrupted when `interrupt_fired` says the fuzzer's check fired) fails.
  template <class F>
  Outcome call(const char* label, F&& f, const bool* interrupt_fired = nullptr,
               std::string* what = nullptr) {
    auto& c = counts(label);
    Outcome o = Outcome::Returned;
    std::string message;
    try {
      f();
    } catch (const dflop::InvalidArgument& e) {
      o = Outcome::Invalid;
      message = e.what();
    } catch (const dflop::Infeasible& e) {
      o = Outcome::Infeasible;
      message = e.what();
    } catch (const dflop::Interrupted& e) {
      o = Outcome::Interrupted;
      message = e.what();
      if (interrupt_fired == nullptr || !*interrupt_fired) {
        fail(__FILE__, __LINE__,
             std::string(label) + " threw Interrupted but no interrupt check returned true");
      }
    } catch (const std::exception& e) {
      o = Outcome::Failed;
      message = e.what();
      fail(__FILE__, __LINE__,
           std::string(label) + " threw " + type_name(e) +
               " (only dflop::InvalidArgument / dflop::Infeasible are allowed): " + e.what());
    } catch (...) {
      o = Outcome::Failed;
      fail(__FILE__, __LINE__, std::string(label) + " threw a non-standard exception");
    }
    ++c[static_cast<size_t>(o)];
    if (what != nullptr) *what = message;
    return o;
  }

  int64_t iteration() const { return iteration_; }

 private:
  std::string replay() const {
    return "DFLOP_FUZZ_SEED=" + std::to_string(config().seed) +
           " DFLOP_FUZZ_ONLY_ITERATION=" + std::to_string(iteration_) + " ./test_fuzz_core " +
           name_;
  }
  std::array<int64_t, 5>& counts(const char* label) {
    for (auto& [l, c] : counts_) {
      if (l == label) return c;
    }
    counts_.emplace_back(label, std::array<int64_t, 5>{});
    return counts_.back().second;
  }

  static inline Fuzz* current_ = nullptr;
  const char* name_;
  int64_t quarters_;
  int64_t iteration_ = 0, ran_ = 0, slowest_it_ = 0;
  double slowest_s_ = 0.0;
  bool reported_input_ = false, stopped_ = false;
  int failures_ = 0;
  std::function<std::string()> describe_;
  std::vector<std::pair<std::string, std::array<int64_t, 5>>> counts_;
  std::vector<std::pair<std::string, int64_t>> skipped_;
};

// A check of the current iteration; on failure it reports the input and the replay command.
#define FUZZ_CHECK(cond, msg)                                    \
  do {                                                           \
    if (cond) {                                                  \
      ++::dflop_test::state().checks;                            \
    } else {                                                     \
      std::ostringstream fuzz_msg_;                              \
      fuzz_msg_ << #cond << " -- " << msg;                       \
      Fuzz::current().fail(__FILE__, __LINE__, fuzz_msg_.str()); \
    }                                                            \
  } while (0)

// The same, returning from the enclosing (void) function on failure: for checks that the
// following ones depend on (sizes before indexing).
#define FUZZ_REQUIRE(cond, msg)                                  \
  do {                                                           \
    if (cond) {                                                  \
      ++::dflop_test::state().checks;                            \
    } else {                                                     \
      std::ostringstream fuzz_msg_;                              \
      fuzz_msg_ << #cond << " -- " << msg;                       \
      Fuzz::current().fail(__FILE__, __LINE__, fuzz_msg_.str()); \
      return;                                                    \
    }                                                            \
  } while (0)

// An interrupt check that returns true on its `after`-th call (after < 0: none).
struct Interrupter {
  int64_t after = -1;
  std::shared_ptr<int64_t> calls = std::make_shared<int64_t>(0);
  std::shared_ptr<bool> fired = std::make_shared<bool>(false);
  dflop::InterruptCheck check() const {
    if (after < 0) return nullptr;
    return [calls = calls, fired = fired, after = after] {
      if (++*calls >= after) *fired = true;
      return *fired;
    };
  }
};

// Every bin of `assignment` (values in [0, bins)) is used.
bool all_bins_used(const Ints& assignment, int64_t bins) {
  std::vector<char> used(static_cast<size_t>(bins), 0);
  for (int64_t b : assignment) {
    if (b < 0 || b >= bins) return false;
    used[static_cast<size_t>(b)] = 1;
  }
  return std::all_of(used.begin(), used.end(), [](char u) { return u != 0; });
}

// A random assignment of n >= bins samples to bins, every bin used.
Ints random_assignment(Rng& r, int64_t n, int64_t bins) {
  Ints order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  r.shuffle(order);
  Ints a(static_cast<size_t>(n), 0);
  for (int64_t k = 0; k < n; ++k) {
    a[size_t(order[size_t(k)])] = k < bins ? k : static_cast<int64_t>(r.below(uint64_t(bins)));
  }
  return a;
}

}  // namespace

// =======================================================================================
// balance / validate_balance_input

namespace {

struct BalanceCase {
  int64_t n = 0, d = 0;
  Doubles costs;  // n x d when both are positive, else empty
  dflop::BalanceOptions o;
  Interrupter interrupt;
};

std::string describe(const BalanceCase& c) {
  std::ostringstream s;
  s << "balance(n=" << c.n << ", d=" << c.d << ", costs=" << vec(c.costs)
    << ", num_microbatches=" << num(c.o.num_microbatches) << ", dp_size=" << num(c.o.dp_size)
    << ", microbatch_dims=" << vec(c.o.microbatch_dims) << ", capacity=" << vec(c.o.capacity)
    << ", seed=" << c.o.seed << ", work_budget=" << num(c.o.work_budget)
    << ", time_limit_s=" << num(c.o.time_limit_s) << ", interrupt_after=" << c.interrupt.after
    << ")";
  return s.str();
}

// Loads per bin and per microbatch, summed in sample order (as the header defines them).
void balance_loads(const BalanceCase& c, const Ints& a, Doubles* bin, Doubles* mb) {
  const int64_t m = c.o.num_microbatches, p = c.o.dp_size, d = c.d;
  bin->assign(size_t(m * p * d), 0.0);
  mb->assign(size_t(m * d), 0.0);
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t k = 0; k < d; ++k) {
      (*bin)[size_t(a[size_t(i)] * d + k)] += c.costs[size_t(i * d + k)];
      (*mb)[size_t((a[size_t(i)] / p) * d + k)] += c.costs[size_t(i * d + k)];
    }
  }
}

BalanceCase gen_balance(Rng& r) {
  BalanceCase c;
  c.d = r.range(1, 4);
  c.o.num_microbatches = r.range(1, 6);
  c.o.dp_size = r.chance(0.5) ? 1 : r.range(1, 4);
  const int64_t bins = c.o.num_microbatches * c.o.dp_size;
  c.n = bins + r.range(0, r.chance(0.15) ? 100 : 20);
  c.costs = gen_values(r, c.n * c.d);
  for (int64_t k = 0; k < c.d; ++k) {
    if (r.chance(0.3)) c.o.microbatch_dims.push_back(k);
  }
  r.shuffle(c.o.microbatch_dims);
  if (r.chance(0.45)) {
    // Per dimension: none, or a multiple of what the average bin (microbatch) needs.
    std::vector<char> group(size_t(c.d), 0);
    for (int64_t k : c.o.microbatch_dims) group[size_t(k)] = 1;
    for (int64_t k = 0; k < c.d; ++k) {
      double total = 0.0, largest = 0.0;
      for (int64_t i = 0; i < c.n; ++i) {
        total += c.costs[size_t(i * c.d + k)];
        largest = std::max(largest, c.costs[size_t(i * c.d + k)]);
      }
      const double count = double(group[size_t(k)] ? c.o.num_microbatches : bins);
      const double need = std::max(total / count, largest);
      c.o.capacity.push_back(r.chance(0.25) ? kInf : need * r.pick({1.0, 1.05, 1.3, 2.0, 0.9}));
    }
  }
  c.o.seed = r.next();
  const int budget_kind = int(r.below(20));
  c.o.work_budget = budget_kind < 2    ? 0
                    : budget_kind < 13 ? r.range(1, 3000)
                    : budget_kind < 18 ? r.range(3000, 30000)
                                       : -1;
  // Huge budgets end on the search's own stopping rules; keep the problem small then.
  if (r.chance(0.03)) {
    c.o.work_budget = r.pick<int64_t>({int64_t{1} << 40, kI64Max / 64, kI64Max});
    c.n = std::min<int64_t>(c.n, bins + 4);
    c.costs.resize(size_t(c.n * c.d));
  }
  if (r.chance(0.1))
    c.o.time_limit_s = r.pick({0.0, -0.0, 1e-5, -kInf, kNaN, 0.5, 1e9, 1e10, kInf});
  if (r.chance(0.03)) c.interrupt.after = r.range(1, 3);
  return c;
}

void mutate_balance(Rng& r, BalanceCase& c) {
  const int64_t count = r.range(1, 3);
  for (int64_t k = 0; k < count; ++k) {
    switch (r.below(12)) {
      case 0:
      case 1:
        if (!c.costs.empty()) c.costs[r.below(c.costs.size())] = weird_double(r);
        break;
      case 2:  // fewer samples (the buffer stays consistent with n x d)
        c.n = r.range(0, c.n);
        c.costs.resize(c.d > 0 ? size_t(c.n * c.d) : 0);
        break;
      case 3:
        c.d = r.pick<int64_t>({0, -1, kI64Min});
        c.costs.clear();
        break;
      case 4:
        c.o.num_microbatches = weird_int(r);
        break;
      case 5:
        c.o.dp_size = weird_int(r);
        break;
      case 6:
        c.o.microbatch_dims.push_back(r.chance(0.5) ? weird_int(r) : r.range(0, c.d));
        break;
      case 7:
        if (r.chance(0.5) || c.o.capacity.empty()) {
          c.o.capacity.resize(size_t(r.range(0, c.d + 1)), 1.0);
        } else {
          c.o.capacity[r.below(c.o.capacity.size())] = weird_double(r);
        }
        break;
      case 8:
        c.o.work_budget = weird_int(r);
        break;
      case 9:
        c.o.time_limit_s = weird_double(r);
        break;
      case 10:
        c.o.seed = static_cast<uint64_t>(weird_int(r));
        break;
      default:  // all costs equal or all zero
        std::fill(c.costs.begin(), c.costs.end(), r.chance(0.5) ? 0.0 : weird_double(r));
        break;
    }
  }
  // A huge budget searches until its own stopping rules (thousands of perturbations): keep
  // the problem small then, so that one iteration stays short.
  if (c.o.work_budget > 100000 && c.d > 0 && c.n > 12) {
    c.n = 12;
    c.costs.resize(size_t(c.n * c.d));
  }
}

// balance.cpp: time limits from 1e9 s on mean none (KB2).
bool balance_time_limited(double time_limit_s) { return time_limit_s >= 0 && time_limit_s < 1e9; }

void check_balance(const BalanceCase& c, const dflop::BalanceResult& res) {
  const int64_t m = c.o.num_microbatches, p = c.o.dp_size, b = m * p, d = c.d;
  FUZZ_REQUIRE(int64_t(res.assignment.size()) == c.n, "size " << res.assignment.size());
  for (int64_t i = 0; i < c.n; ++i) {
    FUZZ_REQUIRE(res.assignment[size_t(i)] >= 0 && res.assignment[size_t(i)] < b,
                 "assignment[" << i << "]=" << res.assignment[size_t(i)] << ", bins=" << b);
  }
  FUZZ_CHECK(all_bins_used(res.assignment, b), "every bin receives at least one sample");
  FUZZ_REQUIRE(int64_t(res.bin_loads.size()) == b * d, "bin_loads " << res.bin_loads.size());
  FUZZ_REQUIRE(int64_t(res.microbatch_loads.size()) == m * d,
               "microbatch_loads " << res.microbatch_loads.size());
  Doubles bin, mb;
  balance_loads(c, res.assignment, &bin, &mb);
  for (size_t k = 0; k < bin.size(); ++k) {
    FUZZ_CHECK(rel_near(res.bin_loads[k], bin[k], 1e-12),
               "bin_loads[" << k << "]=" << num(res.bin_loads[k]) << " vs " << num(bin[k]));
  }
  for (size_t k = 0; k < mb.size(); ++k) {
    FUZZ_CHECK(
        rel_near(res.microbatch_loads[k], mb[k], 1e-12),
        "microbatch_loads[" << k << "]=" << num(res.microbatch_loads[k]) << " vs " << num(mb[k]));
  }
  std::vector<char> group(size_t(d), 0);
  for (int64_t k : c.o.microbatch_dims) group[size_t(k)] = 1;
  double makespan = 0.0, lower = 0.0;
  for (int64_t k = 0; k < d; ++k) {
    double total = 0.0, largest = 0.0;
    for (int64_t i = 0; i < c.n; ++i) {
      total += c.costs[size_t(i * d + k)];
      largest = std::max(largest, c.costs[size_t(i * d + k)]);
    }
    const bool g = group[size_t(k)] != 0;
    const int64_t slots = g ? m : b;
    lower = std::max({lower, total / double(slots), largest});
    const double cap = c.o.capacity.empty() ? kInf : c.o.capacity[size_t(k)];
    for (int64_t s = 0; s < slots; ++s) {
      const double v = (g ? mb : bin)[size_t(s * d + k)];
      makespan = std::max(makespan, v);
      FUZZ_CHECK(v <= cap * (1 + 1e-9), "capacity[" << k << "]=" << num(cap) << " exceeded by "
                                                    << (g ? "microbatch " : "bin ") << s << " with "
                                                    << num(v));
    }
  }
  FUZZ_CHECK(rel_near(res.makespan, makespan, 1e-12),
             "makespan " << num(res.makespan) << " vs largest load " << num(makespan));
  FUZZ_CHECK(rel_near(res.lower_bound, lower, 1e-12),
             "lower_bound " << num(res.lower_bound) << " vs " << num(lower));
  FUZZ_CHECK(res.makespan >= res.lower_bound * (1 - 1e-9),
             "makespan " << num(res.makespan) << " below lower_bound " << num(res.lower_bound));
  FUZZ_CHECK(std::isfinite(res.makespan) && std::isfinite(res.stats.initial_makespan),
             "makespan " << num(res.makespan) << ", initial " << num(res.stats.initial_makespan));
  // Budgets above kMaxWorkBudget count as kMaxWorkBudget (KB1).
  const int64_t budget =
      std::min(c.o.work_budget >= 0 ? c.o.work_budget : dflop::default_work_budget(c.n, b, d),
               dflop::kMaxWorkBudget);
  FUZZ_CHECK(res.stats.work_budget == budget,
             "stats.work_budget " << res.stats.work_budget << " vs " << budget);
  FUZZ_CHECK(
      res.stats.work_used >= 0 && res.stats.improving_moves >= 0 && res.stats.perturbations >= 0,
      "stats " << res.stats.work_used << " " << res.stats.improving_moves << " "
               << res.stats.perturbations);
  if (balance_time_limited(c.o.time_limit_s) || std::isnan(c.o.time_limit_s)) return;
  FUZZ_CHECK(!res.stats.stopped_by_time_limit, "stopped by a time limit it does not have");
}

TEST_CASE(fuzz_balance) {
  Fuzz fuzz("fuzz_balance", 6);
  fuzz.run([&](Rng& r) {
    BalanceCase c = gen_balance(r);
    if (r.chance(0.35)) mutate_balance(r, c);
    fuzz.describe([&c] { return describe(c); });
    c.o.interrupted = c.interrupt.check();
    const double* costs = c.costs.empty() ? nullptr : c.costs.data();
    std::string v_what, b_what;
    const Outcome v = fuzz.call(
        "validate_balance_input", [&] { dflop::validate_balance_input(costs, c.n, c.d, c.o); },
        nullptr, &v_what);
    dflop::BalanceResult res;
    const Outcome b = fuzz.call(
        "balance", [&] { res = dflop::balance(costs, c.n, c.d, c.o); }, c.interrupt.fired.get(),
        &b_what);
    // balance() validates first: the same error, else it may only find no feasible schedule.
    if (v == Outcome::Invalid || v == Outcome::Infeasible) {
      FUZZ_CHECK(b == v && b_what == v_what,
                 "validate_balance_input: " << outcome_name(v) << " (" << v_what << "), balance: "
                                            << outcome_name(b) << " (" << b_what << ")");
    } else if (v == Outcome::Returned) {
      FUZZ_CHECK(b == Outcome::Returned || b == Outcome::Infeasible || b == Outcome::Interrupted,
                 "validated input, but balance: " << outcome_name(b) << " (" << b_what << ")");
    }
    FUZZ_CHECK((b == Outcome::Interrupted) == *c.interrupt.fired,
               "interrupt check fired: " << *c.interrupt.fired << ", outcome " << outcome_name(b));
    if (b != Outcome::Returned) return;
    check_balance(c, res);
    // Documented: reproducible, and without capacities a larger budget continues the same
    // trajectory, so it is never worse.
    const bool timed = balance_time_limited(c.o.time_limit_s);
    if (timed || c.interrupt.after >= 0 || c.o.work_budget < 0 || c.o.work_budget > 100000) return;
    if (r.chance(0.15)) {
      dflop::BalanceResult res2;
      const Outcome b2 =
          fuzz.call("balance (again)", [&] { res2 = dflop::balance(costs, c.n, c.d, c.o); });
      FUZZ_CHECK(
          b2 == Outcome::Returned && res2.assignment == res.assignment &&
              res2.makespan == res.makespan,
          "not reproducible: makespan " << num(res.makespan) << " then " << num(res2.makespan));
    }
    if (r.chance(0.3)) {
      // With capacities balance.hpp documents that a larger budget need not be better (the
      // repair attempts start where the budget runs out; KB18): nothing to check.
      if (!c.o.capacity.empty()) return;
      BalanceCase more = c;
      more.o.work_budget = c.o.work_budget + 1 + r.range(0, c.o.work_budget + 2000);
      dflop::BalanceResult res2;
      const Outcome b2 = fuzz.call("balance (larger budget)",
                                   [&] { res2 = dflop::balance(costs, c.n, c.d, more.o); });
      FUZZ_CHECK(b2 == Outcome::Returned, "budget " << c.o.work_budget << " found a schedule, "
                                                    << more.o.work_budget << ": "
                                                    << outcome_name(b2));
      if (b2 == Outcome::Returned) {
        FUZZ_CHECK(res2.makespan <= res.makespan * (1 + 1e-9),
                   "budget " << more.o.work_budget << " gives makespan " << num(res2.makespan)
                             << ", worse than " << num(res.makespan) << " with budget "
                             << c.o.work_budget);
      }
    }
  });
}

}  // namespace

// =======================================================================================
// pipeline_schedule / validate_pipeline_schedule_input / simulated_step_time

namespace {

struct ScheduleCase {
  int64_t n = 0, d = 0;
  Doubles costs;
  Ints start;
  dflop::PipelineScheduleOptions o;
  Interrupter interrupt;
  bool expect_reject = false;  // a value the header documents as invalid was injected
};

std::string describe(const ScheduleCase& c) {
  std::ostringstream s;
  const auto& o = c.o;
  s << "pipeline_schedule(n=" << c.n << ", d=" << c.d << ", costs=" << vec(c.costs)
    << ", start=" << vec(c.start) << ", num_microbatches=" << num(o.num_microbatches)
    << ", dp_size=" << num(o.dp_size) << ", microbatch_dims=" << vec(o.microbatch_dims)
    << ", replicas=" << vec(o.replicas) << ", units=" << vec(o.units)
    << ", stages=" << vec(o.stages) << ", forward_fraction=" << vec(o.forward_fraction)
    << ", microbatch_constant_s=" << vec(o.microbatch_constant_s)
    << ", backward_from_stage=" << vec(o.backward_from_stage)
    << ", backward_gate=" << vec(o.backward_gate) << ", link_latency_s=" << num(o.link_latency_s)
    << ", capacity=" << vec(o.capacity) << ", max_growth=" << num(o.max_growth)
    << ", seed=" << o.seed << ", work_budget=" << num(o.work_budget)
    << ", time_limit_s=" << num(o.time_limit_s) << ", interrupt_after=" << c.interrupt.after
    << ", expect_reject=" << c.expect_reject << ")";
  return s.str();
}

int64_t replicas_of(const dflop::PipelineScheduleOptions& o, int64_t c) {
  return o.replicas.empty() ? 1 : o.replicas[size_t(c)];
}

// The load a capacity (and the growth bound) applies to, per bin and dimension: the bin's
// cost sum, or its microbatch's divided by the dimension's replicas (header).
Doubles unit_loads(const ScheduleCase& c, const Ints& a) {
  const int64_t dp = c.o.dp_size, bins = c.o.num_microbatches * dp, d = c.d;
  std::vector<char> mb_dim(size_t(d), 0);
  for (int64_t k : c.o.microbatch_dims) mb_dim[size_t(k)] = 1;
  Doubles bin(size_t(bins * d), 0.0), mb(size_t(c.o.num_microbatches * d), 0.0);
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t k = 0; k < d; ++k) {
      bin[size_t(a[size_t(i)] * d + k)] += c.costs[size_t(i * d + k)];
      mb[size_t(a[size_t(i)] / dp * d + k)] += c.costs[size_t(i * d + k)];
    }
  }
  Doubles out(size_t(bins * d));
  for (int64_t b = 0; b < bins; ++b) {
    for (int64_t k = 0; k < d; ++k) {
      out[size_t(b * d + k)] = mb_dim[size_t(k)]
                                   ? mb[size_t(b / dp * d + k)] / double(replicas_of(c.o, k))
                                   : bin[size_t(b * d + k)];
    }
  }
  return out;
}

// The header's pipeline model of an assignment (microbatch index = execution order),
// simulated with simulate_pipeline() once per data-parallel replica; the slowest counts.
// Inputs must be valid.
double model_step_time(const ScheduleCase& c, const Ints& a, double* max_stage_s = nullptr) {
  const auto& o = c.o;
  const int64_t m = o.num_microbatches, dp = o.dp_size, d = c.d;
  std::vector<char> mb_dim(size_t(d), 0);
  for (int64_t k : o.microbatch_dims) mb_dim[size_t(k)] = 1;
  Ints stage_dim;
  for (int64_t k = 0; k < d; ++k) {
    for (int64_t s = 0; s < o.stages[size_t(k)]; ++s) stage_dim.push_back(k);
  }
  const int64_t S = int64_t(stage_dim.size());
  // Seconds of one stage of module k for microbatch j on replica r.
  auto stage_seconds = [&](int64_t j, int64_t k, int64_t r) {
    double sum = 0.0;
    bool work = false;
    Ints members;
    for (int64_t i = 0; i < c.n; ++i) {
      const int64_t b = a[size_t(i)];
      if (mb_dim[size_t(k)] ? b / dp != j : b != j * dp + r) continue;
      const double cost = c.costs[size_t(i * d + k)];
      sum += cost;
      work = work || cost > 0.0;
      members.push_back(i);
    }
    if (!work) return 0.0;
    const double constant =
        o.microbatch_constant_s.empty() ? 0.0 : o.microbatch_constant_s[size_t(k)];
    const int64_t reps = replicas_of(o, k);
    if (reps > 1) {
      Ints units;
      Doubles costs;
      for (int64_t i : members) {
        units.push_back(o.units[size_t(i)]);
        costs.push_back(c.costs[size_t(i * d + k)]);
      }
      return dflop::split_units(units.data(), costs.data(), int64_t(members.size()), reps)
                 .makespan +
             constant;
    }
    return std::max(0.0, sum) + constant;
  };
  double step = 0.0;
  for (int64_t r = 0; r < dp; ++r) {
    dflop::PipelineSimInput in;
    in.num_stages = S;
    in.num_microbatches = m;
    in.record_events = false;
    in.forward_s.assign(size_t(S * m), 0.0);
    in.backward_s.assign(size_t(S * m), 0.0);
    in.link_latency_s.assign(size_t(S - 1), o.link_latency_s);
    in.link_bandwidth_bytes_per_s.assign(size_t(S - 1), kInf);
    // The regime (header): stage s of module k runs a backward from its
    // backward_from_stage on, and only for a share with work in its gate module.
    std::vector<char> stage_backward(size_t(S), 1);
    for (int64_t s = 0, q = 0; s < S; ++s, ++q) {
      if (s > 0 && stage_dim[size_t(s)] != stage_dim[size_t(s - 1)]) q = 0;
      if (!o.backward_from_stage.empty()) {
        stage_backward[size_t(s)] = q >= o.backward_from_stage[size_t(stage_dim[size_t(s)])];
      }
    }
    if (std::find(stage_backward.begin(), stage_backward.end(), 0) != stage_backward.end()) {
      in.gradient_links.assign(stage_backward.begin(), stage_backward.end() - 1);
    }
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        const double load = stage_seconds(j, k, r);
        const double f = o.forward_fraction[size_t(k)] * load;
        const int64_t gate = o.backward_gate.empty() ? -1 : o.backward_gate[size_t(k)];
        bool gate_open = gate < 0;
        for (int64_t i = 0; i < c.n && !gate_open; ++i) {
          gate_open = a[size_t(i)] == j * dp + r && c.costs[size_t(i * d + gate)] > 0.0;
        }
        for (int64_t s = 0; s < S; ++s) {
          if (stage_dim[size_t(s)] != k) continue;
          in.forward_s[size_t(s * m + j)] = f;
          in.backward_s[size_t(s * m + j)] = stage_backward[size_t(s)] && gate_open ? load - f : 0;
          // What one stage runs of the microbatch (its forward alone without a backward).
          if (max_stage_s != nullptr) {
            *max_stage_s = std::max(*max_stage_s, f + in.backward_s[size_t(s * m + j)]);
          }
        }
      }
    }
    step = std::max(step, dflop::simulate_pipeline(in).step_time_s);
  }
  return step;
}

ScheduleCase gen_schedule(Rng& r) {
  ScheduleCase c;
  auto& o = c.o;
  c.d = r.range(1, 3);
  o.num_microbatches = r.range(1, 5);
  o.dp_size = r.chance(0.5) ? 1 : r.range(1, 3);
  const int64_t bins = o.num_microbatches * o.dp_size;
  c.n = bins + r.range(0, r.chance(0.2) ? 30 : 10);
  c.costs = gen_values(r, c.n * c.d);
  for (int64_t k = 0; k < c.d; ++k) {
    if (r.chance(k == 0 ? 0.5 : 0.25)) o.microbatch_dims.push_back(k);
  }
  if (!o.microbatch_dims.empty() && r.chance(0.5)) {
    o.replicas.assign(size_t(c.d), 1);
    for (int64_t k : o.microbatch_dims) {
      if (r.chance(0.7)) o.replicas[size_t(k)] = r.range(2, 4);
    }
  }
  const bool replicated =
      std::any_of(o.replicas.begin(), o.replicas.end(), [](int64_t x) { return x > 1; });
  if (replicated || r.chance(0.2)) {
    for (int64_t i = 0; i < c.n; ++i) {
      o.units.push_back(r.chance(0.3) ? 0 : r.chance(0.05) ? r.range(7, 200) : r.range(1, 6));
      for (int64_t k = 0; k < c.d && o.units.back() == 0; ++k) {
        if (replicas_of(o, k) > 1) c.costs[size_t(i * c.d + k)] = 0.0;
      }
    }
  }
  for (int64_t k = 0; k < c.d; ++k) {
    o.stages.push_back(r.chance(0.05) ? r.range(8, 64) : r.range(1, 3));
    o.forward_fraction.push_back(r.pick({1.0 / 3.0, 0.0, 1.0, r.uniform()}));
  }
  if (c.d == 1 && r.chance(0.01)) o.stages[0] = 4096;
  if (r.chance(0.3)) {  // a training regime: stages without backward
    for (int64_t k = 0; k < c.d; ++k) {
      o.backward_from_stage.push_back(r.chance(0.5) ? 0 : r.range(0, o.stages[size_t(k)]));
    }
  }
  if (c.d > 1 && r.chance(0.3)) {  // a backward gated by another module's work
    for (int64_t k = 0; k < c.d; ++k) {
      const int64_t g = r.range(0, c.d - 1);
      o.backward_gate.push_back(r.chance(0.5) || g == k ? -1 : g);
    }
  }
  if (r.chance(0.6)) {
    for (int64_t k = 0; k < c.d; ++k) {
      o.microbatch_constant_s.push_back(r.chance(0.5) ? 0.0 : r.uniform(0, 0.1));
    }
  }
  o.link_latency_s = r.chance(0.5) ? 0.0 : r.uniform(0, 0.01);
  o.max_growth = r.pick({1.0, 1.05, 1.5, 4.0, kInf});
  o.seed = r.next();
  const int budget_kind = int(r.below(50));
  o.work_budget = budget_kind < 5    ? 0
                  : budget_kind < 38 ? r.range(1, 3000)
                  : budget_kind < 49 ? r.range(3000, 20000)
                                     : -1;
  if (o.work_budget == -1 && c.n > 12) o.work_budget = 5000;  // the default is >= 1 ms of search
  if (r.chance(0.15)) o.time_limit_s = r.pick({0.0, kInf, 1e-4, 1e300});
  if (r.chance(0.03)) c.interrupt.after = r.range(1, 3);
  // The start: balance()'s schedule, or a random one.
  bool balanced = false;
  if (r.chance(0.5)) {
    dflop::BalanceOptions bo;
    bo.num_microbatches = o.num_microbatches;
    bo.dp_size = o.dp_size;
    bo.microbatch_dims = o.microbatch_dims;
    bo.work_budget = 500;
    bo.seed = r.next();
    try {
      c.start = dflop::balance(c.costs.data(), c.n, c.d, bo).assignment;
      balanced = true;
    } catch (const dflop::InvalidArgument&) {
    }
  }
  if (!balanced) c.start = random_assignment(r, c.n, bins);
  if (r.chance(0.35)) {
    // Capacities at or above the start's loads (below: the start itself is rejected).
    const Doubles loads = unit_loads(c, c.start);
    for (int64_t k = 0; k < c.d; ++k) {
      double worst = 0.0;
      for (int64_t b = 0; b < bins; ++b) worst = std::max(worst, loads[size_t(b * c.d + k)]);
      const double factor = r.pick({1.0, 1.2, 2.0, kInf, 0.9});
      o.capacity.push_back(worst * factor);
    }
  }
  return c;
}

void mutate_schedule(Rng& r, ScheduleCase& c) {
  auto& o = c.o;
  const int64_t bins = o.num_microbatches * o.dp_size;
  const int64_t count = r.range(1, 3);
  for (int64_t m = 0; m < count; ++m) {
    const size_t k = size_t(r.below(uint64_t(std::max<int64_t>(c.d, 1))));
    switch (r.below(19)) {
      case 0:
        if (!c.costs.empty()) c.costs[r.below(c.costs.size())] = weird_double(r);
        break;
      case 17: {  // around the step bound (1e200 s, KB16)
        const double v = r.pick({1e199, 4e199, 1e200, 2e200, 1e201, 1e150});
        switch (r.below(3)) {
          case 0:
            if (!c.costs.empty()) c.costs[r.below(c.costs.size())] = v;
            break;
          case 1:
            if (k < o.microbatch_constant_s.size()) o.microbatch_constant_s[k] = v;
            break;
          default:
            o.link_latency_s = v / 64;
            break;
        }
        break;
      }
      case 1:
        if (k < o.stages.size()) {
          o.stages[k] = r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({0, -1, 4096, 4097});
        }
        break;
      case 2:
        if (r.chance(0.5) || o.stages.empty()) {
          o.stages.push_back(1);
        } else {
          o.stages.pop_back();
        }
        break;
      case 3:
        if (k < o.forward_fraction.size()) {
          o.forward_fraction[k] =
              r.chance(0.5) ? weird_double(r) : r.pick({-1e-9, 1.0 + 1e-9, -0.0});
        }
        break;
      case 4:
        o.forward_fraction.push_back(0.5);
        break;
      case 5:
        if (!o.microbatch_constant_s.empty() && k < o.microbatch_constant_s.size() &&
            r.chance(0.7)) {
          o.microbatch_constant_s[k] = weird_double(r);
        } else {
          o.microbatch_constant_s.assign(size_t(c.d + 1), 0.0);
        }
        break;
      case 6:
        o.link_latency_s = weird_double(r);
        break;
      case 7:
        o.max_growth = r.chance(0.5) ? weird_double(r) : r.pick({1.0 - 1e-12, 1.0, 1e308});
        break;
      case 8:
        if (o.replicas.empty() || r.chance(0.3)) {
          o.replicas.assign(size_t(c.d + r.range(0, 1)), 1);
        } else if (k < o.replicas.size()) {
          // Huge replica counts reach split_units (KB3): at most 64 here.
          o.replicas[k] = r.chance(0.5) ? std::min<int64_t>(weird_int(r), 64) : r.range(0, 3);
        }
        break;
      case 9:
        if (!o.units.empty()) {
          if (r.chance(0.3)) {
            o.units.pop_back();
          } else {
            o.units[r.below(o.units.size())] = r.chance(0.5) ? -1 : 0;
          }
        }
        break;
      case 10:
        if (r.chance(0.3)) {
          c.start.resize(size_t(std::max<int64_t>(c.n + r.pick<int64_t>({-1, 1}), 0)), 0);
        } else if (!c.start.empty()) {
          c.start[r.below(c.start.size())] =
              r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({-1, bins});
        }
        break;
      case 11:
        if (bins >= 2) {  // empty bin 0
          for (int64_t& b : c.start) {
            if (b == 0) b = 1;
          }
        }
        break;
      case 12:
        if (r.chance(0.5) || o.capacity.empty()) {
          o.capacity.assign(size_t(r.range(0, c.d + 1)), kInf);
        } else {
          o.capacity[r.below(o.capacity.size())] = weird_double(r);
        }
        break;
      case 13:
        o.time_limit_s = weird_double(r);
        break;
      case 14:
        o.work_budget = weird_int(r);
        break;
      case 15:
        if (r.chance(0.5)) {
          o.num_microbatches = weird_int(r);
        } else {
          o.dp_size = weird_int(r);
        }
        break;
      case 16:
        if (r.chance(0.5)) {
          o.backward_from_stage.assign(size_t(c.d + r.range(0, 1)), 0);
          if (!o.backward_from_stage.empty() && r.chance(0.7)) {
            o.backward_from_stage[r.below(o.backward_from_stage.size())] =
                r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({-1, 5, 65});
          }
        } else {
          o.backward_gate.assign(size_t(c.d + r.range(0, 1)), -1);
          if (!o.backward_gate.empty() && r.chance(0.7)) {
            o.backward_gate[r.below(o.backward_gate.size())] =
                r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({-2, 0, c.d});
          }
        }
        break;
      default:
        o.microbatch_dims.push_back(r.chance(0.5) ? weird_int(r) : r.range(0, c.d));
        break;
    }
  }
  // The search runs until its budget or time limit: a huge budget gets a short time limit.
  if (o.work_budget > 1000000 && !(o.time_limit_s >= 0.0 && o.time_limit_s <= 0.01)) {
    o.time_limit_s = 0.002;
  }
}

// The bound validate_pipeline_schedule_input puts on a step (KB16): the cost column sums +
// num_microbatches x microbatch_constant_s + 2 x stages x microbatches x link_latency_s,
// summed as pipeline_schedule.cpp does; 0 where the input is malformed in a way that the
// validation rejects first (or where the bound is not defined).
double schedule_step_bound(const ScheduleCase& c) {
  const auto& o = c.o;
  if (c.d < 1 || int64_t(c.costs.size()) != c.n * c.d || int64_t(o.stages.size()) != c.d)
    return 0.0;
  if (o.num_microbatches < 1 || o.num_microbatches > 4096) return 0.0;
  if (!o.microbatch_constant_s.empty() && int64_t(o.microbatch_constant_s.size()) != c.d)
    return 0.0;
  if (!(std::isfinite(o.link_latency_s) && o.link_latency_s >= 0.0)) return 0.0;
  int64_t total_stages = 0;
  for (int64_t s : o.stages) {
    if (s < 1 || s > 4096) return 0.0;
    total_stages += s;
  }
  for (double x : c.costs) {
    if (!nonneg_finite(x)) return 0.0;
  }
  for (double x : o.microbatch_constant_s) {
    if (!nonneg_finite(x)) return 0.0;
  }
  const double m = double(o.num_microbatches);
  double bound = 2.0 * double(total_stages) * m * o.link_latency_s;
  for (int64_t k = 0; k < c.d; ++k) {
    double column = 0.0;
    for (int64_t i = 0; i < c.n; ++i) column += c.costs[size_t(i * c.d + k)];
    bound +=
        column + m * (o.microbatch_constant_s.empty() ? 0.0 : o.microbatch_constant_s[size_t(k)]);
  }
  return bound;
}
constexpr double kMaxStepSeconds = 1e200;

// Whether the input breaks a rule that pipeline_schedule.hpp documents (so validation must
// reject it): per-dimension lengths and ranges, replicas and units, the start assignment
// and its capacities. False where the header says nothing (the caller then only checks the
// exception type).
bool schedule_documented_invalid(const ScheduleCase& c) {
  const auto& o = c.o;
  const int64_t d = c.d;
  if (d < 1 || int64_t(c.costs.size()) != c.n * d) return false;
  if (int64_t(o.stages.size()) != d || int64_t(o.forward_fraction.size()) != d) return true;
  for (int64_t k = 0; k < d; ++k) {
    const double f = o.forward_fraction[size_t(k)];
    if (o.stages[size_t(k)] < 1 || !(f >= 0.0 && f <= 1.0)) return true;
  }
  if (!o.microbatch_constant_s.empty()) {
    if (int64_t(o.microbatch_constant_s.size()) != d) return true;
    for (double v : o.microbatch_constant_s) {
      if (std::isnan(v) || v < 0.0) return true;
    }
  }
  if (std::isnan(o.link_latency_s) || o.link_latency_s < 0.0) return true;
  if (!o.backward_from_stage.empty()) {
    if (int64_t(o.backward_from_stage.size()) != d) return true;
    for (int64_t k = 0; k < d; ++k) {
      const int64_t v = o.backward_from_stage[size_t(k)];
      if (v < 0 || v > o.stages[size_t(k)]) return true;
    }
  }
  if (!o.backward_gate.empty()) {
    if (int64_t(o.backward_gate.size()) != d) return true;
    for (int64_t k = 0; k < d; ++k) {
      const int64_t g = o.backward_gate[size_t(k)];
      if (g != -1 && (g < 0 || g >= d || g == k)) return true;
    }
  }
  if (!(o.max_growth >= 1.0)) return true;
  std::vector<char> mb_dim(size_t(d), 0);
  bool dims_ok = true;
  for (int64_t k : o.microbatch_dims) {
    if (k < 0 || k >= d || mb_dim[size_t(k)]) {
      dims_ok = false;
      continue;
    }
    mb_dim[size_t(k)] = 1;
  }
  bool replicated = false;
  if (!o.replicas.empty()) {
    if (int64_t(o.replicas.size()) != d) return true;
    for (int64_t k = 0; k < d; ++k) {
      const int64_t x = o.replicas[size_t(k)];
      if (x < 1 || (x > 1 && !mb_dim[size_t(k)])) return true;
      replicated = replicated || x > 1;
    }
  }
  if (replicated) {
    if (int64_t(o.units.size()) != c.n) return true;
    for (int64_t i = 0; i < c.n; ++i) {
      if (o.units[size_t(i)] < 0) return true;
      for (int64_t k = 0; k < d; ++k) {
        if (o.replicas[size_t(k)] > 1 && o.units[size_t(i)] == 0 &&
            c.costs[size_t(i * d + k)] > 0.0)
          return true;
      }
    }
  }
  // A step that could overflow (KB16).
  if (!(schedule_step_bound(c) <= kMaxStepSeconds * (1 + 1e-12))) return true;
  const int64_t m = o.num_microbatches, dp = o.dp_size;
  if (m < 1 || dp < 1 || m > 4096 || dp > 4096) return false;
  const int64_t bins = m * dp;
  if (int64_t(c.start.size()) != c.n) return true;
  if (!all_bins_used(c.start, bins)) return true;
  if (o.capacity.empty() || !dims_ok) return false;
  if (int64_t(o.capacity.size()) != d) return true;
  if (!moderate(c.costs)) return false;
  const Doubles loads = unit_loads(c, c.start);
  for (int64_t b = 0; b < bins; ++b) {
    for (int64_t k = 0; k < d; ++k) {
      if (loads[size_t(b * d + k)] > o.capacity[size_t(k)] * (1 + 1e-6)) return true;
    }
  }
  return false;
}

void check_schedule(const ScheduleCase& c, const dflop::PipelineScheduleResult& res,
                    double start_step, Outcome start_outcome) {
  const auto& o = c.o;
  const int64_t bins = o.num_microbatches * o.dp_size, d = c.d;
  FUZZ_REQUIRE(int64_t(res.assignment.size()) == c.n, "size " << res.assignment.size());
  FUZZ_REQUIRE(all_bins_used(res.assignment, bins),
               "every bin stays non-empty, values in [0, " << bins << "): " << vec(res.assignment));
  const auto& st = res.stats;
  FUZZ_CHECK(
      res.step_time_s <= st.start_step_time_s * (1 + 1e-12),
      "slower than the start: " << num(res.step_time_s) << " vs " << num(st.start_step_time_s));
  FUZZ_CHECK(res.step_time_s <= st.ordered_step_time_s * (1 + 1e-12) &&
                 st.ordered_step_time_s <= st.start_step_time_s * (1 + 1e-12),
             "step " << num(res.step_time_s) << ", ordered " << num(st.ordered_step_time_s)
                     << ", start " << num(st.start_step_time_s));
  if (start_outcome == Outcome::Returned) {
    FUZZ_CHECK(rel_near(st.start_step_time_s, start_step, 1e-12),
               "stats.start_step_time_s " << num(st.start_step_time_s)
                                          << " vs simulated_step_time(start) " << num(start_step));
  }
  // The result's microbatch indices are the execution order: simulating it gives its step.
  double again = 0.0;
  const Outcome a = Fuzz::current().call("simulated_step_time(result)", [&] {
    again = dflop::simulated_step_time(c.costs.data(), c.n, d, res.assignment, o);
  });
  FUZZ_CHECK(a == Outcome::Returned, outcome_name(a));
  if (a == Outcome::Returned) {
    FUZZ_CHECK(rel_near(again, res.step_time_s, 1e-9),
               "step_time_s " << num(res.step_time_s) << " but simulated_step_time(result) "
                              << num(again));
  }
  // Accepted inputs keep every step below the validated bound (KB16): finite.
  FUZZ_CHECK(std::isfinite(res.step_time_s) && res.step_time_s >= 0.0,
             "step_time_s " << num(res.step_time_s));
  // Hard capacities and the growth bound (max_growth x the start's makespan).
  const Doubles before = unit_loads(c, c.start), after = unit_loads(c, res.assignment);
  for (int64_t k = 0; k < d; ++k) {
    double start_makespan = 0.0, total = 0.0;
    for (int64_t b = 0; b < bins; ++b) {
      start_makespan = std::max(start_makespan, before[size_t(b * d + k)]);
    }
    for (int64_t i = 0; i < c.n; ++i) total += c.costs[size_t(i * d + k)];
    double bound = start_makespan > 0.0 ? o.max_growth * start_makespan : 0.0;
    if (!o.capacity.empty()) bound = std::min(bound, o.capacity[size_t(k)]);
    bound = std::max(bound, start_makespan);
    for (int64_t b = 0; b < bins; ++b) {
      const double v = after[size_t(b * d + k)];
      FUZZ_CHECK(v <= bound * (1 + 1e-9) + 1e-12 * total,
                 "dimension " << k << " bin " << b << " load " << num(v) << " over the bound "
                              << num(bound) << " (start makespan " << num(start_makespan) << ")");
    }
  }
  if (o.work_budget >= 0) {
    FUZZ_CHECK(st.work_budget == o.work_budget, "stats.work_budget " << st.work_budget);
    FUZZ_CHECK(st.work_used <= o.work_budget || st.evaluations <= 3,
               "work_used " << st.work_used << " > budget " << o.work_budget << " after "
                            << st.evaluations << " evaluations");
  }
  FUZZ_CHECK(st.evaluations >= 1 && st.improving_moves >= 0 && st.perturbations >= 0,
             "stats " << st.evaluations << " " << st.improving_moves << " " << st.perturbations);
}

TEST_CASE(fuzz_pipeline_schedule) {
  Fuzz fuzz("fuzz_pipeline_schedule", 8);
  fuzz.run([&](Rng& r) {
    ScheduleCase c = gen_schedule(r);
    if (r.chance(0.35)) mutate_schedule(r, c);
    c.expect_reject = schedule_documented_invalid(c);
    fuzz.describe([&c] { return describe(c); });
    c.o.interrupted = c.interrupt.check();
    const double* costs = c.costs.empty() ? nullptr : c.costs.data();
    std::string v_what, p_what;
    const Outcome v = fuzz.call(
        "validate_pipeline_schedule_input",
        [&] { dflop::validate_pipeline_schedule_input(costs, c.n, c.d, c.start, c.o); }, nullptr,
        &v_what);
    if (c.expect_reject) {
      FUZZ_CHECK(v == Outcome::Invalid || v == Outcome::Infeasible,
                 "documented-invalid input: " << outcome_name(v));
    }
    dflop::PipelineScheduleResult res;
    const Outcome p = fuzz.call(
        "pipeline_schedule", [&] { res = dflop::pipeline_schedule(costs, c.n, c.d, c.start, c.o); },
        c.interrupt.fired.get(), &p_what);
    if (v == Outcome::Returned) {
      FUZZ_CHECK(
          p == Outcome::Returned || p == Outcome::Interrupted,
          "validated input, but pipeline_schedule: " << outcome_name(p) << " (" << p_what << ")");
    } else if (v != Outcome::Failed) {
      FUZZ_CHECK(p == v && p_what == v_what,
                 "validate: " << outcome_name(v) << " (" << v_what << "), pipeline_schedule: "
                              << outcome_name(p) << " (" << p_what << ")");
    }
    FUZZ_CHECK((p == Outcome::Interrupted) == *c.interrupt.fired,
               "interrupt fired: " << *c.interrupt.fired << ", outcome " << outcome_name(p));
    // The start's step (simulated_step_time ignores the capacities).
    double start_step = 0.0;
    const Outcome s = fuzz.call("simulated_step_time", [&] {
      start_step = dflop::simulated_step_time(costs, c.n, c.d, c.start, c.o);
    });
    if (v == Outcome::Returned) FUZZ_CHECK(s == Outcome::Returned, outcome_name(s));
    if (p != Outcome::Returned) return;
    check_schedule(c, res, start_step, s);
    if (c.o.time_limit_s < 0 && c.interrupt.after < 0 && r.chance(0.1)) {
      dflop::PipelineScheduleResult res2;
      const Outcome p2 = fuzz.call("pipeline_schedule (again)", [&] {
        res2 = dflop::pipeline_schedule(costs, c.n, c.d, c.start, c.o);
      });
      FUZZ_CHECK(p2 == Outcome::Returned && res2.assignment == res.assignment &&
                     res2.step_time_s == res.step_time_s,
                 "not reproducible: " << num(res.step_time_s) << " then " << num(res2.step_time_s));
    }
  });
}

// simulated_step_time on random assignments against the header's model (simulate_pipeline
// per replica, split_units for replicated dimensions).
TEST_CASE(fuzz_simulated_step_time) {
  Fuzz fuzz("fuzz_simulated_step_time", 4);
  fuzz.run([&](Rng& r) {
    ScheduleCase c = gen_schedule(r);
    c.o.capacity.clear();  // ignored by simulated_step_time
    c.start = random_assignment(r, c.n, c.o.num_microbatches * c.o.dp_size);
    if (r.chance(0.3)) mutate_schedule(r, c);
    c.o.capacity.clear();
    c.expect_reject = schedule_documented_invalid(c);
    fuzz.describe([&c] { return describe(c); });
    const double* costs = c.costs.empty() ? nullptr : c.costs.data();
    double step = 0.0;
    const Outcome s = fuzz.call("simulated_step_time", [&] {
      step = dflop::simulated_step_time(costs, c.n, c.d, c.start, c.o);
    });
    if (c.expect_reject) {
      FUZZ_CHECK(s == Outcome::Invalid || s == Outcome::Infeasible,
                 "documented-invalid input: " << outcome_name(s));
    }
    if (s != Outcome::Returned) return;
    double model = 0.0, max_stage = 0.0;
    const Outcome m = fuzz.call("model (simulate_pipeline)",
                                [&] { model = model_step_time(c, c.start, &max_stage); });
    // A step holds every stage's forward and backward of every microbatch.
    FUZZ_CHECK(step >= max_stage * (1 - 1e-12),
               "step " << num(step) << " shorter than one stage's microbatch " << num(max_stage));
    FUZZ_CHECK(m == Outcome::Returned, "the model of a valid input: " << outcome_name(m));
    if (m == Outcome::Returned) {
      FUZZ_CHECK(rel_near(step, model, 1e-12),
                 "simulated_step_time " << num(step) << " vs the header's model " << num(model));
    }
    // Accepted inputs keep every step below the validated bound (KB16): finite.
    FUZZ_CHECK(step >= 0.0 && std::isfinite(step), num(step));
  });
}

}  // namespace

// =======================================================================================
// plan_routing

namespace {

struct RoutingCase {
  Ints src, dst, rows;
  int64_t n = 0, num_src = 1, num_dst = 1;
};

std::string describe(const RoutingCase& c) {
  std::ostringstream s;
  s << "plan_routing(src_replica=" << vec(c.src) << ", dst_replica=" << vec(c.dst)
    << ", rows=" << vec(c.rows) << ", num_samples=" << num(c.n) << ", num_src=" << num(c.num_src)
    << ", num_dst=" << num(c.num_dst) << ")";
  return s.str();
}

// The header's validity rule (n < 0 counts as invalid too): replicas per side in [1,
// kMaxRoutingReplicas] (KB5), replicas in range, rows >= 0, no pair's rows overflowing
// int64 (KB6).
bool routing_valid(const RoutingCase& c) {
  if (c.n < 0 || c.num_src < 1 || c.num_dst < 1 || c.num_src > dflop::kMaxRoutingReplicas ||
      c.num_dst > dflop::kMaxRoutingReplicas)
    return false;
  for (int64_t i = 0; i < c.n; ++i) {
    const size_t k = size_t(i);
    if (c.src[k] < 0 || c.src[k] >= c.num_src || c.dst[k] < 0 || c.dst[k] >= c.num_dst ||
        c.rows[k] < 0)
      return false;
  }
  std::vector<std::pair<int64_t, int64_t>> rows;  // (pair, rows), summed per pair
  for (int64_t i = 0; i < c.n; ++i)
    rows.push_back({c.src[size_t(i)] * c.num_dst + c.dst[size_t(i)], c.rows[size_t(i)]});
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < rows.size();) {
    int64_t sum = 0;
    size_t j = i;
    for (; j < rows.size() && rows[j].first == rows[i].first; ++j) {
      if (__builtin_add_overflow(sum, rows[j].second, &sum)) return false;
    }
    i = j;
  }
  return true;
}

RoutingCase gen_routing(Rng& r) {
  RoutingCase c;
  c.num_src = r.chance(0.1) ? r.range(5, 64) : r.range(1, 4);
  c.num_dst = r.chance(0.1) ? r.range(5, 64) : r.range(1, 4);
  c.n = r.chance(0.1) ? 0 : r.range(1, r.chance(0.1) ? 200 : 30);
  const int rows_kind = int(r.below(4));
  for (int64_t i = 0; i < c.n; ++i) {
    c.src.push_back(r.range(0, c.num_src - 1));
    c.dst.push_back(r.range(0, c.num_dst - 1));
    c.rows.push_back(rows_kind == 0   ? 0
                     : rows_kind == 1 ? r.range(0, 1000)
                     : rows_kind == 2 ? r.range(0, int64_t{1} << 40)
                                      : r.range(1, 8));
  }
  return c;
}

void mutate_routing(Rng& r, RoutingCase& c) {
  const int64_t count = r.range(1, 3);
  for (int64_t m = 0; m < count; ++m) {
    const size_t i = size_t(r.below(uint64_t(std::max<int64_t>(c.n, 1))));
    switch (r.below(7)) {
      case 0:  // at the bound (KB5) only when the other side is small (S x D work)
        c.num_src = r.chance(0.4)                      ? weird_int(r)
                    : r.chance(0.3) && c.num_dst <= 64 ? r.pick<int64_t>({4095, 4096, 4097})
                                                       : r.range(-1, 1);
        break;
      case 1:
        c.num_dst = r.chance(0.4)                      ? weird_int(r)
                    : r.chance(0.3) && c.num_src <= 64 ? r.pick<int64_t>({4095, 4096, 4097})
                                                       : r.range(-1, 1);
        break;
      case 2:
        if (i < c.src.size()) c.src[i] = r.chance(0.5) ? weird_int(r) : c.num_src;
        break;
      case 3:
        if (i < c.dst.size()) c.dst[i] = r.chance(0.5) ? weird_int(r) : c.num_dst;
        break;
      case 4:
        if (i < c.rows.size()) c.rows[i] = weird_int(r);
        break;
      case 5:  // fewer samples than the arrays hold, or a negative count
        c.n = r.chance(0.8) ? r.range(0, c.n) : r.pick<int64_t>({-1, kI64Min});
        break;
      default:
        if (i < c.rows.size()) c.rows[i] = kI64Max - r.range(0, 3);
        break;
    }
  }
}

void check_routing(const RoutingCase& c, const dflop::RoutingPlan& p) {
  const int64_t S = c.num_src, D = c.num_dst, n = c.n;
  FUZZ_CHECK(p.num_samples == n && p.num_src == S && p.num_dst == D,
             p.num_samples << " " << p.num_src << " " << p.num_dst);
  FUZZ_REQUIRE(int64_t(p.send_rows.size()) == S * D, "send_rows " << p.send_rows.size());
  FUZZ_REQUIRE(int64_t(p.pair_offsets.size()) == S * D + 1,
               "pair_offsets " << p.pair_offsets.size());
  FUZZ_REQUIRE(int64_t(p.pair_samples.size()) == n, "pair_samples " << p.pair_samples.size());
  FUZZ_REQUIRE(int64_t(p.send_offsets.size()) == S + 1, "send_offsets " << p.send_offsets.size());
  FUZZ_REQUIRE(int64_t(p.send_order.size()) == n, "send_order " << p.send_order.size());
  FUZZ_REQUIRE(int64_t(p.recv_offsets.size()) == D + 1, "recv_offsets " << p.recv_offsets.size());
  FUZZ_REQUIRE(int64_t(p.recv_order.size()) == n, "recv_order " << p.recv_order.size());
  for (const Ints* offsets : {&p.pair_offsets, &p.send_offsets, &p.recv_offsets}) {
    FUZZ_REQUIRE(offsets->front() == 0 && offsets->back() == n, vec(*offsets));
    FUZZ_REQUIRE(std::is_sorted(offsets->begin(), offsets->end()),
                 "not monotone: " << vec(*offsets));
  }
  // The documented orders: samples grouped by (src, dst) pair in ascending index order;
  // a source sends its pairs in destination order (so send_order is pair_samples); a
  // destination receives in ascending index order. O(S x D + n log n): the replica counts
  // reach kMaxRoutingReplicas.
  Ints by_pair(static_cast<size_t>(n)), by_dst(static_cast<size_t>(n));
  std::iota(by_pair.begin(), by_pair.end(), int64_t{0});
  std::iota(by_dst.begin(), by_dst.end(), int64_t{0});
  auto pair_of = [&](int64_t i) { return c.src[size_t(i)] * D + c.dst[size_t(i)]; };
  std::stable_sort(by_pair.begin(), by_pair.end(),
                   [&](int64_t a, int64_t b) { return pair_of(a) < pair_of(b); });
  std::stable_sort(by_dst.begin(), by_dst.end(),
                   [&](int64_t a, int64_t b) { return c.dst[size_t(a)] < c.dst[size_t(b)]; });
  Ints pair_offsets(size_t(S * D + 1), 0), send_offsets(size_t(S + 1), 0),
      recv_offsets(size_t(D + 1), 0), send_rows(size_t(S * D), 0);
  for (int64_t i = 0; i < n; ++i) {
    ++pair_offsets[size_t(pair_of(i) + 1)];
    ++send_offsets[size_t(c.src[size_t(i)] + 1)];
    ++recv_offsets[size_t(c.dst[size_t(i)] + 1)];
    send_rows[size_t(pair_of(i))] += c.rows[size_t(i)];  // valid: no overflow
  }
  std::partial_sum(pair_offsets.begin(), pair_offsets.end(), pair_offsets.begin());
  std::partial_sum(send_offsets.begin(), send_offsets.end(), send_offsets.begin());
  std::partial_sum(recv_offsets.begin(), recv_offsets.end(), recv_offsets.begin());
  FUZZ_CHECK(p.send_rows == send_rows, "send_rows differ from the pairs' row sums");
  FUZZ_CHECK(p.pair_offsets == pair_offsets, "pair_offsets differ");
  FUZZ_CHECK(p.pair_samples == by_pair,
             "pair_samples " << vec(p.pair_samples) << " vs " << vec(by_pair));
  FUZZ_CHECK(p.send_offsets == send_offsets,
             "send_offsets " << vec(p.send_offsets) << " vs " << vec(send_offsets));
  FUZZ_CHECK(p.send_order == by_pair, "send_order " << vec(p.send_order) << " vs " << vec(by_pair));
  FUZZ_CHECK(p.recv_offsets == recv_offsets, "recv_offsets differ");
  FUZZ_CHECK(p.recv_order == by_dst, "recv_order " << vec(p.recv_order) << " vs " << vec(by_dst));
}

TEST_CASE(fuzz_plan_routing) {
  Fuzz fuzz("fuzz_plan_routing", 16);
  fuzz.run([&](Rng& r) {
    RoutingCase c = gen_routing(r);
    if (r.chance(0.4)) mutate_routing(r, c);
    fuzz.describe([&c] { return describe(c); });
    const bool valid = routing_valid(c);
    dflop::RoutingPlan plan;
    const Outcome o = fuzz.call("plan_routing", [&] {
      plan =
          dflop::plan_routing(c.src.data(), c.dst.data(), c.rows.data(), c.n, c.num_src, c.num_dst);
    });
    FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
               (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
    if (o == Outcome::Returned) check_routing(c, plan);
  });
}

}  // namespace

// =======================================================================================
// split_units

namespace {

struct SplitCase {
  Ints units;
  Doubles costs;
  int64_t n = 0, replicas = 1;
  dflop::SplitGranularity granularity = dflop::SplitGranularity::Unit;
  double unit_cost = -1.0;  // >= 0: every costly sample costs units x unit_cost exactly
};

std::string describe(const SplitCase& c) {
  std::ostringstream s;
  s << "split_units(units=" << vec(c.units) << ", costs=" << vec(c.costs)
    << ", num_samples=" << num(c.n) << ", num_replicas=" << num(c.replicas)
    << ", granularity=" << int(c.granularity) << ")";
  return s.str();
}

// The header's rule: num_replicas in [1, kMaxSplitReplicas] (KB3), units >= 0 summing to
// at most kMaxSplitUnits (KB4), costs finite and >= 0, no cost without units.
bool split_valid(const SplitCase& c) {
  if (c.n < 0 || c.replicas < 1 || c.replicas > dflop::kMaxSplitReplicas) return false;
  if (c.granularity != dflop::SplitGranularity::Unit &&
      c.granularity != dflop::SplitGranularity::Sample)
    return false;
  int64_t total = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    const int64_t u = c.units[size_t(i)];
    const double x = c.costs[size_t(i)];
    if (u < 0 || !nonneg_finite(x) || (u == 0 && x > 0.0)) return false;
    if (u > dflop::kMaxSplitUnits - total) return false;
    total += u;
  }
  return true;
}

SplitCase gen_split(Rng& r) {
  SplitCase c;
  c.n = r.chance(0.1) ? r.range(20, 80) : r.range(0, 20);
  c.replicas = r.chance(0.1) ? r.range(7, 64) : r.range(1, 6);
  c.granularity = r.chance(0.7) ? dflop::SplitGranularity::Unit : dflop::SplitGranularity::Sample;
  const bool equal = r.chance(0.5);
  if (equal) c.unit_cost = r.chance(0.1) ? 1.0 : r.log_uniform(1e-3, 10.0);
  const Doubles raw = gen_values(r, c.n);
  for (int64_t i = 0; i < c.n; ++i) {
    const int64_t u = r.chance(0.25) ? 0 : r.chance(0.05) ? r.range(9, 300) : r.range(1, 8);
    c.units.push_back(u);
    c.costs.push_back(u == 0 || r.chance(0.1) ? 0.0
                      : equal                 ? double(u) * c.unit_cost
                                              : raw[size_t(i)]);
  }
  return c;
}

void mutate_split(Rng& r, SplitCase& c) {
  c.unit_cost = -1.0;
  const int64_t count = r.range(1, 3);
  for (int64_t m = 0; m < count; ++m) {
    const size_t i = size_t(r.below(uint64_t(std::max<int64_t>(c.n, 1))));
    switch (r.below(6)) {
      case 0:  // the bound (KB3); a valid count that large costs O(replicas): rarely
        c.replicas = r.chance(0.4)    ? weird_int(r)
                     : r.chance(0.3)  ? dflop::kMaxSplitReplicas + 1
                     : r.chance(0.01) ? dflop::kMaxSplitReplicas
                                      : r.range(-1, 1);
        break;
      case 1:  // the total bound (KB4); valid totals that large cost O(units / replicas): rarely
        if (i < c.units.size()) {
          c.units[i] = r.chance(0.4)    ? weird_int(r)
                       : r.chance(0.3)  ? dflop::kMaxSplitUnits + r.range(0, 1)
                       : r.chance(0.01) ? dflop::kMaxSplitUnits - r.range(100, 1000)
                                        : r.range(-1, 0);
        }
        break;
      case 2:
        if (i < c.costs.size()) c.costs[i] = weird_double(r);
        break;
      case 3:
        c.granularity = static_cast<dflop::SplitGranularity>(r.pick<int>({2, -1, 127, 0, 1}));
        break;
      case 4:
        c.n = r.chance(0.8) ? r.range(0, c.n) : r.pick<int64_t>({-1, kI64Min});
        break;
      default:  // zero cost with units (free samples), or cost without units
        if (i < c.costs.size()) c.costs[i] = r.chance(0.5) ? 0.0 : 1.0;
        break;
    }
  }
}

// Plain LPT of whole samples (costliest first, ties by index, onto the least loaded
// replica, ties by index): the bound the header promises the unit split never exceeds.
double lpt_makespan(const SplitCase& c) {
  Ints order;
  for (int64_t i = 0; i < c.n; ++i) {
    if (c.costs[size_t(i)] > 0.0) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return c.costs[size_t(a)] > c.costs[size_t(b)]; });
  Doubles load(size_t(std::min<int64_t>(c.replicas, std::max<int64_t>(int64_t(order.size()), 1))),
               0.0);
  double worst = 0.0;
  for (int64_t i : order) {
    const size_t r = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += c.costs[size_t(i)];
    worst = std::max(worst, load[r]);
  }
  return worst;
}

void check_split(const SplitCase& c, const dflop::UnitSplit& s) {
  const int64_t R = c.replicas, n = c.n;
  FUZZ_CHECK(s.num_replicas == R, s.num_replicas);
  const size_t pieces = s.sample.size();
  FUZZ_REQUIRE(
      s.first_unit.size() == pieces && s.num_units.size() == pieces && s.replica.size() == pieces,
      "piece arrays of different lengths");
  FUZZ_REQUIRE(int64_t(s.replica_cost.size()) == R && int64_t(s.replica_units.size()) == R,
               "replica arrays " << s.replica_cost.size() << " " << s.replica_units.size());
  Ints next(size_t(n), 0), replica_units(size_t(R), 0);
  Doubles replica_cost(size_t(R), 0.0);
  for (size_t p = 0; p < pieces; ++p) {
    const int64_t i = s.sample[p];
    FUZZ_REQUIRE(i >= 0 && i < n, "piece " << p << " sample " << i);
    FUZZ_REQUIRE(s.replica[p] >= 0 && s.replica[p] < R,
                 "piece " << p << " replica " << s.replica[p]);
    FUZZ_REQUIRE(s.num_units[p] >= 1, "piece " << p << " has " << s.num_units[p] << " units");
    if (p > 0) {
      FUZZ_REQUIRE(
          std::make_pair(s.sample[p - 1], s.first_unit[p - 1]) < std::make_pair(i, s.first_unit[p]),
          "pieces not ordered by (sample, first_unit) at " << p);
    }
    FUZZ_REQUIRE(s.first_unit[p] == next[size_t(i)], "sample " << i << ": piece starts at unit "
                                                               << s.first_unit[p] << ", expected "
                                                               << next[size_t(i)]);
    next[size_t(i)] += s.num_units[p];
    replica_units[size_t(s.replica[p])] += s.num_units[p];
    // The header's price of a piece: cost x (num_units / units) (no overflow, KB17).
    replica_cost[size_t(s.replica[p])] +=
        c.costs[size_t(i)] * (double(s.num_units[p]) / double(c.units[size_t(i)]));
    if (c.granularity == dflop::SplitGranularity::Sample) {
      FUZZ_CHECK(s.first_unit[p] == 0 && s.num_units[p] == c.units[size_t(i)],
                 "sample granularity cut sample " << i);
    }
  }
  double total = 0.0, largest_unit = 0.0, largest_sample = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    FUZZ_CHECK(next[size_t(i)] == c.units[size_t(i)], "sample " << i << ": " << next[size_t(i)]
                                                                << " of " << c.units[size_t(i)]
                                                                << " units covered");
    if (c.units[size_t(i)] > 0) {
      total += c.costs[size_t(i)];
      largest_unit = std::max(largest_unit, c.costs[size_t(i)] / double(c.units[size_t(i)]));
      largest_sample = std::max(largest_sample, c.costs[size_t(i)]);
    }
  }
  double makespan = 0.0;
  for (int64_t r = 0; r < R; ++r) {
    FUZZ_CHECK(s.replica_units[size_t(r)] == replica_units[size_t(r)],
               "replica_units[" << r << "]=" << s.replica_units[size_t(r)] << " vs "
                                << replica_units[size_t(r)]);
    FUZZ_CHECK(rel_near(s.replica_cost[size_t(r)], replica_cost[size_t(r)], 1e-9),
               "replica_cost[" << r << "]=" << num(s.replica_cost[size_t(r)]) << " vs "
                               << num(replica_cost[size_t(r)]));
    makespan = std::max(makespan, s.replica_cost[size_t(r)]);
  }
  FUZZ_CHECK(s.makespan == makespan, "makespan " << num(s.makespan) << " vs " << num(makespan));
  if (std::isfinite(total)) {  // no replica holds more than everything
    FUZZ_CHECK(s.makespan <= total * (1 + 1e-9) + 1e-300,
               "makespan " << num(s.makespan) << " above the total cost " << num(total));
  }
  if (!moderate(c.costs)) return;
  const bool unit = c.granularity == dflop::SplitGranularity::Unit;
  const double lower = std::max(total / double(R), unit ? largest_unit : largest_sample);
  FUZZ_CHECK(s.makespan >= lower * (1 - 1e-9) - 1e-300,
             "makespan " << num(s.makespan) << " below the lower bound " << num(lower));
  if (!unit) return;
  const double lpt = lpt_makespan(c);
  FUZZ_CHECK(s.makespan <= lpt * (1 + 1e-9) + 1e-300,
             "unit split " << num(s.makespan) << " worse than whole-sample LPT " << num(lpt));
  if (c.unit_cost > 0.0) {  // equal unit costs: c x ceil(U / R), the optimum
    int64_t costly_units = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (c.costs[size_t(i)] > 0.0) costly_units += c.units[size_t(i)];
    }
    const double optimum = c.unit_cost * double((costly_units + R - 1) / R);
    FUZZ_CHECK(s.makespan <= optimum * (1 + 1e-9) + 1e-300,
               "equal unit costs " << num(c.unit_cost) << ": makespan " << num(s.makespan)
                                   << " above the optimum " << num(optimum));
  }
}

TEST_CASE(fuzz_split_units) {
  Fuzz fuzz("fuzz_split_units", 12);
  fuzz.run([&](Rng& r) {
    SplitCase c = gen_split(r);
    if (r.chance(0.35)) mutate_split(r, c);
    fuzz.describe([&c] { return describe(c); });
    const bool valid = split_valid(c);
    dflop::UnitSplit s;
    const Outcome o = fuzz.call("split_units", [&] {
      s = dflop::split_units(c.units.data(), c.costs.data(), c.n, c.replicas, c.granularity);
    });
    FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
               (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
    if (o != Outcome::Returned) return;
    check_split(c, s);
    if (r.chance(0.1)) {
      const dflop::UnitSplit again =
          dflop::split_units(c.units.data(), c.costs.data(), c.n, c.replicas, c.granularity);
      FUZZ_CHECK(again.sample == s.sample && again.first_unit == s.first_unit &&
                     again.num_units == s.num_units && again.replica == s.replica,
                 "not deterministic");
    }
  });
}

}  // namespace

// =======================================================================================
// pipeline_actions, parse_pipeline_order, simulate_pipeline

namespace {

using dflop::PipelineAction;
using dflop::PipelineOrder;

// The header's second formulation of 1F1B ("run a forward while forwards remain and fewer
// than S - stage microbatches are in flight, else the oldest backward"), and GPipe.
// A plain pipeline's action of `stage` (its only virtual stage).
PipelineAction plain_action(int64_t stage, bool is_forward, int64_t k) {
  return {stage, is_forward ? dflop::ActionKind::Forward : dflop::ActionKind::Backward, k};
}
bool is_fwd(const PipelineAction& a) { return a.kind == dflop::ActionKind::Forward; }

std::vector<PipelineAction> reference_actions(PipelineOrder kind, int64_t S, int64_t m,
                                              int64_t stage) {
  std::vector<PipelineAction> out;
  if (kind == PipelineOrder::GPipe) {
    for (int64_t k = 0; k < m; ++k) out.push_back(plain_action(stage, true, k));
    for (int64_t k = 0; k < m; ++k) out.push_back(plain_action(stage, false, k));
    return out;
  }
  int64_t forwards = 0, backwards = 0;
  while (backwards < m) {
    if (forwards < m && forwards - backwards < S - stage) {
      out.push_back(plain_action(stage, true, forwards++));
    } else {
      out.push_back(plain_action(stage, false, backwards++));
    }
  }
  return out;
}

std::string actions_text(const std::vector<PipelineAction>& a) {
  std::string s;
  for (const auto& x : a) s += (is_fwd(x) ? " F" : " B") + std::to_string(x.microbatch);
  return s;
}

TEST_CASE(fuzz_pipeline_actions) {
  Fuzz fuzz("fuzz_pipeline_actions", 16);
  fuzz.run([&](Rng& r) {
    auto kind = r.chance(0.5) ? PipelineOrder::OneFOneB : PipelineOrder::GPipe;
    int64_t S = r.range(1, 10), m = r.chance(0.1) ? r.range(13, 300) : r.range(1, 12);
    int64_t stage = r.range(0, S - 1);
    if (r.chance(0.3)) {
      switch (r.below(4)) {
        case 0:
          S = weird_int(r);
          break;
        case 1:  // the bound (KB7): 10^7 itself is valid but costs 2 x 10^7 actions: not here
          m = r.chance(0.5)   ? weird_int(r)
              : r.chance(0.5) ? dflop::kMaxPipelineMicrobatches + r.range(1, 2)
                              : r.range(-1, 0);
          break;
        case 2:
          stage = r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({-1, S});
          break;
        default:
          kind = static_cast<PipelineOrder>(r.pick<int>({4, -1, 127}));
          break;
      }
    }
    fuzz.describe([=] {
      return "pipeline_actions(kind=" + std::to_string(int(kind)) + ", num_stages=" + num(S) +
             ", num_microbatches=" + num(m) + ", stage=" + num(stage) + ")";
    });
    const bool valid = S >= 1 && S <= dflop::kMaxVirtualStages && m >= 1 &&
                       m <= dflop::kMaxPipelineMicrobatches && stage >= 0 && stage < S &&
                       int(kind) >= 0 && int(kind) <= 2;
    std::vector<PipelineAction> got;
    const Outcome o =
        fuzz.call("pipeline_actions", [&] { got = dflop::pipeline_actions(kind, S, m, stage); });
    FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
               (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
    if (o != Outcome::Returned) return;
    const auto expected = reference_actions(kind, S, m, stage);
    bool same = got.size() == expected.size();
    for (size_t i = 0; same && i < got.size(); ++i) {
      same = got[i] == expected[i];
    }
    FUZZ_CHECK(same, "got" << actions_text(got) << ", documented" << actions_text(expected));
    // The first formulation: w = min(S - 1 - stage, m) warm-up forwards, steady pairs,
    // cool-down backwards.
    if (kind != PipelineOrder::GPipe) {
      const int64_t w = std::min(S - 1 - stage, m);
      std::vector<PipelineAction> first;
      for (int64_t k = 0; k < w; ++k) first.push_back(plain_action(stage, true, k));
      for (int64_t i = 0; i < m - w; ++i)
        first.push_back(plain_action(stage, true, w + i)),
            first.push_back(plain_action(stage, false, i));
      for (int64_t k = m - w; k < m; ++k) first.push_back(plain_action(stage, false, k));
      FUZZ_CHECK(actions_text(first) == actions_text(expected),
                 "the header's two 1F1B formulations differ:" << actions_text(first) << " vs"
                                                              << actions_text(expected));
    }
  });
}

TEST_CASE(fuzz_parse_schedule_kind) {
  Fuzz fuzz("fuzz_parse_schedule_kind", 8);
  fuzz.run([&](Rng& r) {
    std::string name;
    switch (r.below(4)) {
      case 0:  // the two names in random case
        name = r.chance(0.5) ? "1f1b" : "gpipe";
        for (char& ch : name) {
          if (r.chance(0.5)) ch = char(std::toupper(static_cast<unsigned char>(ch)));
        }
        break;
      case 1: {  // near misses
        name = r.pick<std::string>({"1f1b", "gpipe", "GPipe", "1F1B"});
        const int edit = int(r.below(4));
        if (edit == 0) name += r.pick<std::string>({" ", "\n", std::string(1, '\0'), "x"});
        if (edit == 1) name = r.pick<std::string>({" ", "\t", "x"}) + name;
        if (edit == 2 && !name.empty()) name.erase(r.below(name.size()), 1);
        if (edit == 3) name[r.below(name.size())] = char(r.range(-128, 127));
        break;
      }
      case 2: {  // random bytes
        const int64_t len = r.range(0, 12);
        for (int64_t i = 0; i < len; ++i) name += char(r.range(-128, 127));
        break;
      }
      default:
        name = r.pick<std::string>({"", "1f1b\xc3\xa9", "GPIPE", "1F1B", "ｇｐｉｐｅ", "gpipe\xff",
                                    std::string(1000, 'g'), "1f1b1f1b", "interleaved"});
        break;
    }
    fuzz.describe([=] {
      return "parse_pipeline_order(\"" + name + "\") (" + std::to_string(name.size()) + " bytes)";
    });
    std::string lower = name;
    for (char& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    PipelineOrder kind = PipelineOrder::OneFOneB;
    const Outcome o =
        fuzz.call("parse_pipeline_order", [&] { kind = dflop::parse_pipeline_order(name); });
    if (lower == "1f1b" || lower == "gpipe") {
      FUZZ_CHECK(o == Outcome::Returned, outcome_name(o));
      if (o == Outcome::Returned) {
        FUZZ_CHECK(kind == (lower == "1f1b" ? PipelineOrder::OneFOneB : PipelineOrder::GPipe),
                   int(kind));
        FUZZ_CHECK(dflop::pipeline_order_name(kind) == lower, dflop::pipeline_order_name(kind));
      }
    } else {
      FUZZ_CHECK(o == Outcome::Invalid, outcome_name(o));
    }
  });
}

// ---- simulate_pipeline against an independent implementation of the header's model -----

struct SimCase {
  dflop::PipelineSimInput in;
};

std::string describe(const SimCase& c) {
  const auto& in = c.in;
  std::ostringstream s;
  s << "simulate_pipeline(num_replicas=" << num(in.num_replicas)
    << ", num_stages=" << num(in.num_stages) << ", num_microbatches=" << num(in.num_microbatches)
    << ", schedule=" << int(in.order) << ", forward_s=" << vec(in.forward_s)
    << ", backward_s=" << vec(in.backward_s) << ", link_latency_s=" << vec(in.link_latency_s)
    << ", link_bandwidth_bytes_per_s=" << vec(in.link_bandwidth_bytes_per_s)
    << ", activation_bytes=" << vec(in.activation_bytes) << ", allreduce_s=" << vec(in.allreduce_s)
    << ", gradient_links=[";
  for (size_t l = 0; l < in.gradient_links.size(); ++l) {
    s << (l ? ", " : "") << int(in.gradient_links[l]);
  }
  s << "], record_events=" << in.record_events << ")";
  return s.str();
}

bool all_nonneg_finite(const Doubles& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return nonneg_finite(x); });
}

// The header's validity rules.
bool sim_valid(const dflop::PipelineSimInput& in) {
  const int64_t R = in.num_replicas, S = in.num_stages, m = in.num_microbatches;
  if (R < 1 || S < 1 || S > dflop::kMaxVirtualStages || m < 1 ||
      m > dflop::kMaxPipelineMicrobatches)
    return false;
  if (int(in.order) < 0 || int(in.order) > 2) return false;
  int64_t rs = 0, cells = 0, links = 0;
  if (mul_overflows(R, S, &rs) || mul_overflows(rs, m, &cells)) return false;
  if (int64_t(in.forward_s.size()) != cells || int64_t(in.backward_s.size()) != cells) return false;
  if (!all_nonneg_finite(in.forward_s) || !all_nonneg_finite(in.backward_s)) return false;
  if (int64_t(in.link_latency_s.size()) != S - 1 || !all_nonneg_finite(in.link_latency_s))
    return false;
  if (int64_t(in.link_bandwidth_bytes_per_s.size()) != S - 1) return false;
  for (double b : in.link_bandwidth_bytes_per_s) {
    if (!(b > 0.0)) return false;
  }
  if (!in.activation_bytes.empty()) {
    if (mul_overflows(R * (S - 1), m, &links) || int64_t(in.activation_bytes.size()) != links ||
        !all_nonneg_finite(in.activation_bytes))
      return false;
  }
  if (!in.allreduce_s.empty() &&
      (int64_t(in.allreduce_s.size()) != S || !all_nonneg_finite(in.allreduce_s)))
    return false;
  if (!in.gradient_links.empty()) {
    if (int64_t(in.gradient_links.size()) != S - 1) return false;
    for (uint8_t g : in.gradient_links) {
      if (g > 1) return false;
    }
  }
  return true;
}

struct RefSim {
  Doubles compute_end, busy;
  double step = 0.0;
  std::vector<dflop::SimEvent> events;
  bool deadlock = false;
};

// The step as the header describes it, stage by stage in passes until nothing moves (no
// worklist, no shared code with the core).
RefSim reference_simulate(const dflop::PipelineSimInput& in) {
  const int64_t R = in.num_replicas, S = in.num_stages, m = in.num_microbatches;
  RefSim out;
  out.compute_end.assign(size_t(R * S), 0.0);
  out.busy.assign(size_t(R * S), 0.0);
  std::vector<std::vector<PipelineAction>> orders;
  for (int64_t s = 0; s < S; ++s) orders.push_back(reference_actions(in.order, S, m, s));
  using dflop::EventKind;
  for (int64_t r = 0; r < R; ++r) {
    Doubles fwd_arrival(size_t(S * m), 0.0), bwd_arrival(size_t(S * m), 0.0);
    std::vector<char> fwd_known(size_t(S * m), 0), bwd_known(size_t(S * m), 0);
    Doubles free_s(size_t(S), 0.0), link_fwd(size_t(S), 0.0), link_bwd(size_t(S), 0.0);
    std::vector<size_t> next(size_t(S), 0);
    auto grad_link = [&](int64_t link) {
      return in.gradient_links.empty() || in.gradient_links[size_t(link)] == 1;
    };
    auto send = [&](int64_t from, int64_t to, int64_t k, double ready) {
      const int64_t link = std::min(from, to);
      const double bytes = in.activation_bytes.empty()
                               ? 0.0
                               : in.activation_bytes[size_t((r * (S - 1) + link) * m + k)];
      const double transfer =
          bytes == 0.0 ? 0.0 : bytes / in.link_bandwidth_bytes_per_s[size_t(link)];
      double& link_free = (to > from ? link_fwd : link_bwd)[size_t(link)];
      const double start = std::max(ready, link_free);
      link_free = start + transfer;
      const double arrival = link_free + in.link_latency_s[size_t(link)];
      out.events.push_back({r, from, EventKind::Send, k, to, start, arrival, from});
      return arrival;
    };
    for (bool moved = true; moved;) {
      moved = false;
      for (int64_t s = 0; s < S; ++s) {
        const auto& order = orders[size_t(s)];
        while (next[size_t(s)] < order.size()) {
          const PipelineAction a = order[next[size_t(s)]];
          const size_t sk = size_t(s * m + a.microbatch);
          double input = 0.0;
          if (is_fwd(a) && s > 0) {
            if (!fwd_known[sk]) break;
            input = fwd_arrival[sk];
          }
          if (!is_fwd(a) && s < S - 1 && grad_link(s)) {
            if (!bwd_known[sk]) break;
            input = bwd_arrival[sk];
          }
          const size_t cell = size_t((r * S + s) * m + a.microbatch);
          const double duration = is_fwd(a) ? in.forward_s[cell] : in.backward_s[cell];
          const double start = std::max(free_s[size_t(s)], input);
          const double end = start + duration;
          free_s[size_t(s)] = end;
          out.busy[size_t(r * S + s)] += duration;
          out.events.push_back({r, s, is_fwd(a) ? EventKind::Forward : EventKind::Backward,
                                a.microbatch, -1, start, end, s});
          ++next[size_t(s)];
          moved = true;
          if (is_fwd(a) && s < S - 1) {
            const size_t to = size_t((s + 1) * m + a.microbatch);
            fwd_arrival[to] = send(s, s + 1, a.microbatch, end);
            fwd_known[to] = 1;
          } else if (!is_fwd(a) && s > 0 && grad_link(s - 1)) {
            const size_t to = size_t((s - 1) * m + a.microbatch);
            bwd_arrival[to] = send(s, s - 1, a.microbatch, end);
            bwd_known[to] = 1;
          }
        }
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      if (next[size_t(s)] != orders[size_t(s)].size()) out.deadlock = true;
      out.compute_end[size_t(r * S + s)] = free_s[size_t(s)];
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    double start = 0.0;
    for (int64_t r = 0; r < R; ++r) start = std::max(start, out.compute_end[size_t(r * S + s)]);
    double end = start;
    if (!in.allreduce_s.empty()) {
      end = start + in.allreduce_s[size_t(s)];
      for (int64_t r = 0; r < R; ++r) {
        out.events.push_back({r, s, dflop::EventKind::AllReduce, -1, -1, start, end});
      }
    }
    out.step = std::max(out.step, end);
  }
  auto key = [](const dflop::SimEvent& e) {
    return std::make_tuple(e.start_s, e.replica, e.stage, int(e.kind), e.microbatch, e.peer_stage);
  };
  std::sort(out.events.begin(), out.events.end(),
            [&](const auto& a, const auto& b) { return key(a) < key(b); });
  return out;
}

SimCase gen_sim(Rng& r) {
  SimCase c;
  auto& in = c.in;
  in.num_replicas = r.range(1, 3);
  in.num_stages = r.range(1, 6);
  in.num_microbatches = r.chance(0.1) ? r.range(9, 40) : r.range(1, 8);
  in.order = r.chance(0.5) ? PipelineOrder::OneFOneB : PipelineOrder::GPipe;
  const int64_t R = in.num_replicas, S = in.num_stages, m = in.num_microbatches;
  in.forward_s = gen_values(r, R * S * m);
  in.backward_s = gen_values(r, R * S * m);
  for (int64_t l = 0; l + 1 < S; ++l) {
    in.link_latency_s.push_back(r.chance(0.4) ? 0.0 : r.uniform(0, 1e-3));
    in.link_bandwidth_bytes_per_s.push_back(r.pick({kInf, 1e9, 3e11, r.uniform(1.0, 100.0)}));
  }
  if (r.chance(0.6)) {
    in.activation_bytes = gen_values(r, R * (S - 1) * m);
    const double scale = r.pick({1.0, 1e6, 1e9});
    for (double& b : in.activation_bytes) b *= scale;
  }
  if (r.chance(0.5)) in.allreduce_s = gen_values(r, S);
  in.record_events = r.chance(0.8);
  if (r.chance(0.3)) {  // some boundaries send no gradient back (frozen stages)
    for (int64_t l = 0; l + 1 < S; ++l) in.gradient_links.push_back(r.chance(0.5) ? 1 : 0);
  }
  return c;
}

void mutate_sim(Rng& r, SimCase& c) {
  auto& in = c.in;
  auto poke = [&](Doubles& v) {
    if (!v.empty()) v[r.below(v.size())] = weird_double(r);
  };
  const int64_t count = r.range(1, 3);
  for (int64_t k = 0; k < count; ++k) {
    switch (r.below(13)) {
      case 0:
        in.num_replicas =
            r.chance(0.5) ? weird_int(r) : add_sat(in.num_replicas, r.pick<int64_t>({-1, 1}));
        break;
      case 1:
        in.num_stages =
            r.chance(0.5) ? weird_int(r) : add_sat(in.num_stages, r.pick<int64_t>({-1, 1}));
        break;
      case 2:
        in.num_microbatches =
            r.chance(0.5) ? weird_int(r) : add_sat(in.num_microbatches, r.pick<int64_t>({-1, 1}));
        break;
      case 3:
        in.order = static_cast<PipelineOrder>(r.pick<int>({2, -1, 127}));
        break;
      case 4:
        poke(r.chance(0.5) ? in.forward_s : in.backward_s);
        break;
      case 5:
        poke(in.link_latency_s);
        break;
      case 6:
        if (!in.link_bandwidth_bytes_per_s.empty()) {
          in.link_bandwidth_bytes_per_s[r.below(in.link_bandwidth_bytes_per_s.size())] =
              r.chance(0.5) ? weird_double(r) : r.pick({0.0, -0.0, kDenormMin, -kInf});
        }
        break;
      case 7:
        poke(in.activation_bytes);
        break;
      case 8:
        poke(in.allreduce_s);
        break;
      case 9: {  // a length off by one, or emptied
        Doubles* v = r.pick<Doubles*>({&in.forward_s, &in.backward_s, &in.link_latency_s,
                                       &in.link_bandwidth_bytes_per_s, &in.activation_bytes,
                                       &in.allreduce_s});
        if (r.chance(0.3)) {
          v->clear();
        } else if (r.chance(0.5) || v->empty()) {
          v->push_back(1.0);
        } else {
          v->pop_back();
        }
        break;
      }
      case 10:  // zero durations everywhere (ties in the event order)
        std::fill(in.forward_s.begin(), in.forward_s.end(), 0.0);
        std::fill(in.backward_s.begin(), in.backward_s.end(), 0.0);
        break;
      case 11:  // gradient_links: a length off by one, or a value other than 0 / 1
        if (r.chance(0.5) || in.gradient_links.empty()) {
          in.gradient_links.push_back(r.chance(0.5) ? 0 : 1);
        } else if (r.chance(0.5)) {
          in.gradient_links.pop_back();
        } else {
          in.gradient_links[r.below(in.gradient_links.size())] = r.pick<uint8_t>({2, 255});
        }
        break;
      default:
        in.record_events = !in.record_events;
        break;
    }
  }
}

void check_sim(const dflop::PipelineSimInput& in, const dflop::PipelineSimResult& res) {
  const int64_t R = in.num_replicas, S = in.num_stages, m = in.num_microbatches;
  const size_t grid = size_t(R * S);
  FUZZ_REQUIRE(
      res.compute_end_s.size() == grid && res.busy_s.size() == grid && res.idle_s.size() == grid,
      "result arrays " << res.compute_end_s.size() << " " << res.busy_s.size() << " "
                       << res.idle_s.size() << ", expected " << grid);
  const RefSim ref = reference_simulate(in);
  FUZZ_REQUIRE(!ref.deadlock, "the reference deadlocked (the action orders are wrong)");
  FUZZ_CHECK(rel_near(res.step_time_s, ref.step, 1e-12),
             "step_time_s " << num(res.step_time_s) << ", reference " << num(ref.step));
  double step = 0.0;
  for (int64_t s = 0; s < S; ++s) {
    double end = 0.0;
    for (int64_t r = 0; r < R; ++r) end = std::max(end, res.compute_end_s[size_t(r * S + s)]);
    step = std::max(step, end + (in.allreduce_s.empty() ? 0.0 : in.allreduce_s[size_t(s)]));
  }
  FUZZ_CHECK(res.step_time_s == step, "step_time_s " << num(res.step_time_s)
                                                     << " vs max over stages of last backward + "
                                                     << "all-reduce " << num(step));
  for (size_t i = 0; i < grid; ++i) {
    FUZZ_CHECK(rel_near(res.compute_end_s[i], ref.compute_end[i], 1e-12),
               "compute_end_s[" << i << "]=" << num(res.compute_end_s[i]) << ", reference "
                                << num(ref.compute_end[i]));
    FUZZ_CHECK(rel_near(res.busy_s[i], ref.busy[i], 1e-12),
               "busy_s[" << i << "]=" << num(res.busy_s[i]) << ", reference " << num(ref.busy[i]));
    FUZZ_CHECK(res.step_time_s >= res.compute_end_s[i],
               "step " << num(res.step_time_s) << " before compute_end_s[" << i << "]");
    FUZZ_CHECK(res.idle_s[i] == res.step_time_s - res.busy_s[i], "idle_s[" << i << "]");
  }
  const bool moderate_input =
      moderate(in.forward_s) && moderate(in.backward_s) && moderate(in.link_latency_s) &&
      moderate(in.allreduce_s) && moderate(in.activation_bytes) &&
      std::all_of(in.link_bandwidth_bytes_per_s.begin(), in.link_bandwidth_bytes_per_s.end(),
                  [](double b) { return b >= 1e-3; });
  if (moderate_input) {
    FUZZ_CHECK(std::isfinite(res.step_time_s), num(res.step_time_s));
  }
  if (!in.record_events) {
    FUZZ_CHECK(res.events.empty(), res.events.size() << " events recorded");
    return;
  }
  int64_t no_grad_links = 0;
  for (uint8_t g : in.gradient_links) no_grad_links += g == 0;
  const size_t expected = size_t(2 * R * S * m + 2 * R * (S - 1) * m - R * no_grad_links * m) +
                          (in.allreduce_s.empty() ? 0 : grid);
  FUZZ_REQUIRE(
      res.events.size() == expected && ref.events.size() == expected,
      res.events.size() << " events, reference " << ref.events.size() << ", expected " << expected);
  for (size_t i = 0; i < expected; ++i) {
    const auto& a = res.events[i];
    const auto& b = ref.events[i];
    FUZZ_REQUIRE(a.replica == b.replica && a.stage == b.stage && a.kind == b.kind &&
                     a.microbatch == b.microbatch && a.peer_stage == b.peer_stage &&
                     rel_near(a.start_s, b.start_s, 1e-12) && rel_near(a.end_s, b.end_s, 1e-12),
                 "event " << i << ": (r" << a.replica << " s" << a.stage << " kind " << int(a.kind)
                          << " mb " << a.microbatch << " peer " << a.peer_stage << " "
                          << num(a.start_s) << ".." << num(a.end_s) << "), reference (r"
                          << b.replica << " s" << b.stage << " kind " << int(b.kind) << " mb "
                          << b.microbatch << " peer " << b.peer_stage << " " << num(b.start_s)
                          << ".." << num(b.end_s) << ")");
  }
}

TEST_CASE(fuzz_simulate_pipeline) {
  Fuzz fuzz("fuzz_simulate_pipeline", 12);
  fuzz.run([&](Rng& r) {
    SimCase c = gen_sim(r);
    if (r.chance(0.35)) mutate_sim(r, c);
    fuzz.describe([&c] { return describe(c); });
    const bool valid = sim_valid(c.in);
    dflop::PipelineSimResult res;
    const Outcome o = fuzz.call("simulate_pipeline", [&] { res = dflop::simulate_pipeline(c.in); });
    FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
               (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
    const Outcome v =
        fuzz.call("validate_pipeline_input", [&] { dflop::validate_pipeline_input(c.in); });
    FUZZ_CHECK(v == (valid ? Outcome::Returned : Outcome::Invalid),
               (valid ? "valid" : "invalid") << " input: " << outcome_name(v));
    if (o == Outcome::Returned) check_sim(c.in, res);
  });
}

}  // namespace

// =======================================================================================
// Planner: split_layers, padded_heads, default_microbatch_choices

namespace {

TEST_CASE(fuzz_planner_helpers) {
  Fuzz fuzz("fuzz_planner_helpers", 16);
  fuzz.run([&](Rng& r) {
    // split_layers: brute-force optimum for small sizes.
    int64_t L = r.range(1, 14), S = r.range(1, std::min<int64_t>(L, 5));
    double per_layer = r.pick({1.0, r.uniform(0.1, 3.0), 0.0});
    double first = r.chance(0.5) ? 0.0 : r.uniform(0, 5);
    double last = r.chance(0.3) ? 0.0 : r.uniform(0, 5);
    const bool balanced = r.chance(0.7);
    if (r.chance(0.3)) {
      switch (r.below(5)) {
        case 0:  // the bound (KB8); the balanced split is O(L x S), S <= 5 here
          L = r.chance(0.5) ? weird_int(r) : dflop::kMaxPlannerLayers + r.range(-1, 1);
          break;
        case 1:
          S = r.chance(0.5) ? weird_int(r) : L + 1;
          break;
        case 2:
          per_layer = weird_double(r);
          break;
        case 3:
          first = weird_double(r);
          break;
        default:
          last = weird_double(r);
          break;
      }
    }
    int64_t heads = r.range(1, 64), tp = r.range(1, 16), max_m = r.range(-2, 100);
    if (r.chance(0.2)) {
      heads = r.chance(0.7) ? weird_int(r) : dflop::kMaxPlannerHeads + r.range(-1, 1);
    }
    if (r.chance(0.2)) tp = r.chance(0.7) ? weird_int(r) : dflop::kMaxPlannerGpus + r.range(-1, 1);
    if (r.chance(0.2)) max_m = weird_int(r);
    fuzz.describe([=] {
      return "split_layers(" + num(L) + ", " + num(S) + ", " + num(per_layer) + ", " + num(first) +
             ", " + num(last) + ", " + (balanced ? "true" : "false") + "); padded_heads(" +
             num(heads) + ", " + num(tp) + "); default_microbatch_choices(" + num(max_m) + ")";
    });
    {
      Ints got;
      const Outcome o = fuzz.call("split_layers", [&] {
        got = dflop::split_layers(L, S, per_layer, first, last, balanced);
      });
      const bool valid = L >= 1 && L <= dflop::kMaxPlannerLayers && S >= 1 && S <= L;
      FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
                 (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
      if (o == Outcome::Returned && int64_t(got.size()) == S) {
        FUZZ_CHECK(std::accumulate(got.begin(), got.end(), int64_t{0}) == L, vec(got));
        FUZZ_CHECK(std::all_of(got.begin(), got.end(), [](int64_t x) { return x >= 1; }), vec(got));
        Ints uniform(size_t(S), L / S);
        for (int64_t s = 0; s < L % S; ++s) ++uniform[size_t(s)];
        if (!balanced || S == 1 || !(per_layer > 0)) {
          FUZZ_CHECK(got == uniform, vec(got) << " vs uniform " << vec(uniform));
        } else if (first == 0.0 && per_layer > 0 && std::isfinite(per_layer) && last >= 0 &&
                   std::isfinite(last) && L <= 14) {
          // Documented optimal for min-max with one extra on the last stage.
          auto load = [&](const Ints& split) {
            double worst = 0.0;
            for (int64_t s = 0; s < S; ++s) {
              worst =
                  std::max(worst, double(split[size_t(s)]) * per_layer + (s == S - 1 ? last : 0.0));
            }
            return worst;
          };
          double best = kInf;
          Ints split(size_t(S), 1);
          std::function<void(int64_t, int64_t)> enumerate = [&](int64_t s, int64_t left) {
            if (s == S - 1) {
              split[size_t(s)] = left;
              best = std::min(best, load(split));
              return;
            }
            for (int64_t x = 1; x <= left - (S - 1 - s); ++x) {
              split[size_t(s)] = x;
              enumerate(s + 1, left - x);
            }
          };
          enumerate(0, L);
          FUZZ_CHECK(load(got) <= best * (1 + 1e-12),
                     "balanced split " << vec(got) << " has max load " << num(load(got))
                                       << ", the optimum is " << num(best));
        }
      } else if (o == Outcome::Returned) {
        FUZZ_CHECK(int64_t(got.size()) == S, got.size() << " stages, expected " << S);
      }
    }
    {
      int64_t padded = 0;
      const Outcome o = fuzz.call("padded_heads", [&] { padded = dflop::padded_heads(heads, tp); });
      const bool valid =
          heads >= 1 && heads <= dflop::kMaxPlannerHeads && tp >= 1 && tp <= dflop::kMaxPlannerGpus;
      FUZZ_CHECK(o == (valid ? Outcome::Returned : Outcome::Invalid),
                 (valid ? "valid" : "invalid") << " input: " << outcome_name(o));
      if (o == Outcome::Returned) {
        FUZZ_CHECK(padded >= heads && padded % tp == 0 && padded - heads < tp,
                   "padded_heads(" << heads << ", " << tp << ") = " << padded);
      }
    }
    Ints choices;
    const Outcome o = fuzz.call("default_microbatch_choices",
                                [&] { choices = dflop::default_microbatch_choices(max_m); });
    FUZZ_CHECK(o == Outcome::Returned, outcome_name(o));
    if (o != Outcome::Returned) return;
    // 1, 2, 3, 4, 6, 8, 12, 16, ... up to max_m, and max_m itself.
    Ints expected;
    for (int64_t p = 1; max_m >= 1 && p <= max_m; p *= 2) {
      expected.push_back(p);
      if (p >= 2 && p <= max_m - p / 2) expected.push_back(p + p / 2);
      if (p > max_m / 2) break;
    }
    if (max_m >= 1) expected.push_back(max_m);
    std::sort(expected.begin(), expected.end());
    expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
    FUZZ_CHECK(choices == expected, vec(choices) << " vs " << vec(expected));
  });
}

}  // namespace

// =======================================================================================
// Planner: plan_layouts, evaluate_layout, build_step, stage_costs, step_from_assignment

namespace {

struct PlannerCase {
  dflop::ClusterParams cluster;
  dflop::ModuleParams enc, llm;
  dflop::PlannerSamples x;
  dflop::PlannerOptions o;
  Interrupter interrupt;
};

std::string describe(const dflop::ModuleParams& p) {
  std::ostringstream s;
  s << "{" << num(p.num_layers) << ", " << num(p.num_heads) << ", " << num(p.hidden_size) << ", "
    << num(p.params_per_layer) << ", " << num(p.first_stage_params) << ", "
    << num(p.last_stage_params) << ", " << num(p.activation_bytes_per_token_layer) << ", "
    << num(p.head_bytes_per_target_token) << ", " << num(p.head_chunk_tokens) << ", "
    << num(p.microbatch_constant_s) << ", " << num(p.attention_compute_fraction) << ", "
    << num(p.attention_param_fraction) << ", " << num(p.attention_activation_fraction) << ", "
    << num(p.forward_fraction) << "}";
  return s.str();
}

std::string describe(const dflop::ModuleLayout& l) {
  std::ostringstream s;
  s << "{tp=" << num(l.tp) << ", pp=" << num(l.pp) << ", dp=" << num(l.dp)
    << ", first_rank=" << num(l.first_rank) << ", layers_per_stage=" << vec(l.layers_per_stage)
    << ", recompute=" << l.recompute << ", virtual_stages=" << num(l.virtual_stages) << "}";
  return s.str();
}

std::string describe(const dflop::Layout& l) {
  return std::string("Layout{colocated=") + (l.colocated ? "1" : "0") +
         ", encoder=" + describe(l.encoder) + ", llm=" + describe(l.llm) +
         ", num_microbatches=" + num(l.num_microbatches) + "}";
}

std::string describe(const PlannerCase& c) {
  std::ostringstream s;
  const auto& cl = c.cluster;
  const auto& o = c.o;
  s << "cluster{" << num(cl.num_gpus) << ", " << num(cl.gpus_per_node) << ", "
    << num(cl.gpu_memory_bytes) << ", " << num(cl.intra_node_bandwidth_bytes_per_s) << ", "
    << num(cl.inter_node_bandwidth_bytes_per_s) << ", " << num(cl.link_latency_s) << ", "
    << num(cl.tp_gemm_loss) << ", " << num(cl.memory_reserve_bytes) << "}, encoder"
    << describe(c.enc) << ", llm" << describe(c.llm)
    << ", samples{num_batches=" << num(c.x.num_batches) << ", batch_size=" << num(c.x.batch_size)
    << ", encoder_s=" << vec(c.x.encoder_s) << ", llm_s=" << vec(c.x.llm_s)
    << ", encoder_last_fraction=" << vec(c.x.encoder_last_fraction)
    << ", llm_last_fraction=" << vec(c.x.llm_last_fraction)
    << ", encoder_tokens=" << vec(c.x.encoder_tokens)
    << ", encoder_units=" << vec(c.x.encoder_units) << ", llm_tokens=" << vec(c.x.llm_tokens)
    << ", visual_tokens=" << vec(c.x.visual_tokens) << "}, options{strategy=" << int(o.strategy)
    << ", global_batch=" << num(o.global_batch) << ", prune=" << o.prune
    << ", top_k=" << num(o.top_k) << ", order_microbatches=" << o.order_microbatches
    << ", balanced_layer_split=" << o.balanced_layer_split << ", zero1=" << o.zero1
    << ", max_tp=" << num(o.max_tp) << ", microbatch_choices=" << vec(o.microbatch_choices)
    << ", balance_work_budget=" << num(o.balance_work_budget) << ", seed=" << o.seed
    << ", num_threads=" << num(o.num_threads) << ", encoder_split=" << int(o.encoder_split)
    << ", colocated_candidates=" << o.colocated_candidates
    << ", screen_factor=" << num(o.screen_factor) << ", patience=" << num(o.patience)
    << ", encoder_max_tp=" << num(o.encoder_max_tp)
    << ", encoder_gpu_choices=" << vec(o.encoder_gpu_choices)
    << ", virtual_stage_choices=" << vec(o.virtual_stage_choices)
    << ", interrupt_after=" << c.interrupt.after << "}";
  return s.str();
}

dflop::ModuleParams gen_module(Rng& r, bool encoder) {
  dflop::ModuleParams p;
  p.num_layers = encoder ? r.range(1, 12) : r.range(1, 16);
  p.num_heads =
      encoder ? r.pick<int64_t>({1, 5, 8, 12, 16, 25}) : r.pick<int64_t>({1, 2, 4, 8, 16, 32, 40});
  p.hidden_size = r.pick<int64_t>({64, 256, 1024, 2048, 4096});
  p.params_per_layer = r.log_uniform(1e5, 1e8);
  p.first_stage_params = r.chance(0.3) ? 0.0 : r.log_uniform(1e5, 1e8);
  p.last_stage_params = r.chance(0.3) ? 0.0 : r.log_uniform(1e5, 1e8);
  p.activation_bytes_per_token_layer =
      34.0 * double(p.hidden_size) * (r.chance(0.2) ? r.uniform() : 1.0);
  p.head_bytes_per_target_token = encoder || r.chance(0.3) ? 0.0 : 8.0 * 32000;
  p.head_chunk_tokens = r.pick<int64_t>({0, 64, 1024});
  p.microbatch_constant_s = r.chance(0.3) ? 0.0 : r.uniform(0, 3e-3);
  p.attention_compute_fraction = r.chance(0.5) ? 1.0 : r.uniform();
  p.attention_param_fraction = r.chance(0.5) ? 1.0 : r.uniform();
  p.attention_activation_fraction = r.chance(0.5) ? 1.0 : r.uniform();
  p.forward_fraction = r.chance(0.6) ? 1.0 / 3.0 : r.pick({0.0, 1.0, r.uniform()});
  return p;
}

// A training regime as dflop.planner.with_trainable sets it: the tower, the projector and
// the LLM each train or are frozen (not all frozen); a frozen part runs half the backward
// where a trained part before it needs the gradient, none otherwise.
void set_regime(Rng& r, dflop::ModuleParams& enc, dflop::ModuleParams& llm) {
  bool tower = r.chance(0.5), projector = r.chance(0.5), lm = r.chance(0.5);
  if (!tower && !projector && !lm) lm = true;
  auto factor = [](bool trains, bool passes) { return trains ? 1.0 : passes ? 0.5 : 0.0; };
  enc.body_backward_factor = factor(tower, false);
  enc.last_backward_factor = factor(projector, tower);
  enc.body_trainable_fraction = tower ? 1.0 : 0.0;
  enc.last_trainable_fraction = projector ? 1.0 : 0.0;
  llm.body_backward_factor = llm.last_backward_factor = factor(lm, true);
  llm.body_trainable_fraction = llm.last_trainable_fraction = lm ? 1.0 : 0.0;
  if (!lm) llm.kept_activation_fraction = r.uniform(0.2, 1.0);
}

PlannerCase gen_planner(Rng& r) {
  PlannerCase c;
  auto& cl = c.cluster;
  cl.gpus_per_node = r.pick<int64_t>({1, 2, 4, 8, 3});
  cl.num_gpus = r.chance(0.1) ? r.range(9, 32) : r.range(2, 8);
  cl.gpu_memory_bytes = r.pick({80e9, 40e9, 8e9, 1e9, 1e13});
  cl.intra_node_bandwidth_bytes_per_s = r.log_uniform(5e10, 1e12);
  cl.inter_node_bandwidth_bytes_per_s = r.log_uniform(5e9, 1e11);
  cl.link_latency_s = r.chance(0.2) ? 0.0 : r.uniform(0, 2e-5);
  cl.tp_gemm_loss = r.chance(0.2) ? 0.0 : r.uniform(0, 0.15);
  cl.memory_reserve_bytes = r.chance(0.2) ? 2e9 : 0.0;
  c.enc = gen_module(r, true);
  c.llm = gen_module(r, false);
  if (r.chance(0.3)) set_regime(r, c.enc, c.llm);
  auto& x = c.x;
  x.num_batches = r.chance(0.1) ? 3 : r.range(1, 2);
  x.batch_size = r.chance(0.1) ? r.range(17, 64) : r.range(1, 16);
  const bool equal_units = r.chance(0.6);
  const double unit_s = r.log_uniform(0.005, 0.1);
  const double tokens_per_unit = r.pick({729.0, 256.0, 1.0});
  const bool targets = r.chance(0.5);
  for (int64_t i = 0; i < x.num_batches * x.batch_size; ++i) {
    const int64_t units = r.chance(1.0 / 3.0) ? 0
                          : r.chance(0.03)    ? r.range(11, 400)
                                              : r.range(1, 10);
    const double seq = r.uniform(100, 4000) + double(units) * 100.0;
    x.encoder_units.push_back(units);
    x.encoder_s.push_back(units == 0 || r.chance(0.05) ? 0.0
                          : equal_units                ? double(units) * unit_s
                                                       : r.uniform(0.0, 0.5));
    x.encoder_last_fraction.push_back(r.chance(0.2) ? 0.0 : r.uniform(0, 0.2));
    x.llm_s.push_back(r.chance(0.03) ? 0.0 : seq * 1e-4);
    x.llm_last_fraction.push_back(r.uniform(0, 0.3));
    x.encoder_tokens.push_back(double(units) * tokens_per_unit);
    x.llm_tokens.push_back(seq);
    x.visual_tokens.push_back(double(units) * 100.0);
    if (targets) x.llm_target_tokens.push_back(r.uniform(0.0, 0.3) * seq);
  }
  auto& o = c.o;
  const int strategy = int(r.below(20));
  o.strategy = strategy < 12   ? dflop::PlanStrategy::DataAware
               : strategy < 17 ? dflop::PlanStrategy::DataBlindColocated
                               : dflop::PlanStrategy::MeanShapeReference;
  o.global_batch = x.batch_size;
  o.prune = r.chance(0.85);
  o.top_k = r.chance(0.05) ? 100 : r.range(1, 5);
  o.order_microbatches = r.chance(0.8);
  o.balanced_layer_split = r.chance(0.8);
  o.zero1 = r.chance(0.7);
  o.max_tp = r.chance(0.7) ? 0 : r.range(1, 8);
  if (r.chance(0.25)) {
    for (int64_t k = r.range(1, 3); k > 0; --k)
      o.microbatch_choices.push_back(r.range(1, x.batch_size));
  }
  o.balance_work_budget = r.chance(0.07) ? 0 : r.range(1, 1500);
  if (r.chance(0.02) && x.batch_size <= 8) o.balance_work_budget = -1;
  o.seed = r.next();
  o.num_threads = r.chance(0.85) ? 1 : 2;
  const int split = int(r.below(20));
  o.encoder_split = split < 14   ? dflop::EncoderSplit::Unit
                    : split < 17 ? dflop::EncoderSplit::Sample
                                 : dflop::EncoderSplit::Even;
  o.colocated_candidates = r.chance(0.25);
  o.screen_factor = r.pick({0.9, 0.0, 1.0, r.uniform()});
  o.patience = r.pick<int64_t>({1000, 0, 1, 7});
  o.encoder_max_tp = r.chance(0.8) ? 0 : r.range(1, 8);
  if (r.chance(0.15)) {
    for (int64_t k = r.range(1, 3); k > 0; --k)
      o.encoder_gpu_choices.push_back(r.range(1, cl.num_gpus - 1));
  }
  // Interleaved 1F1B candidates (LLM virtual stages) half of the time.
  if (r.chance(0.5)) {
    o.virtual_stage_choices =
        r.chance(0.7) ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 1, 2};
  }
  if (r.chance(0.03)) c.interrupt.after = r.range(1, 3);
  return c;
}

// The planner's largest time or size (planner.cpp: check_finite_nonneg and the samples'
// non-fraction columns; KB19).
constexpr double kMaxPlannerValue = 1e100;

// Whether a mutated input breaks a documented rule (global_batch, sample columns, negative
// seconds / counts, fractions, the planner.hpp bounds): validation must reject it.
bool planner_documented_invalid(const PlannerCase& c) {
  const auto& x = c.x;
  const auto& cl = c.cluster;
  if (c.o.global_batch != x.batch_size) return true;
  if (x.num_batches < 1 || x.batch_size < 1) return true;
  if (x.num_batches > dflop::kMaxPlannerBatches || x.batch_size > dflop::kMaxPlannerBatchSize)
    return true;  // KB11
  if (cl.num_gpus < 2 || cl.gpus_per_node < 1) return true;
  if (cl.num_gpus > dflop::kMaxPlannerGpus) return true;  // KB14
  for (double v : {cl.gpu_memory_bytes, cl.intra_node_bandwidth_bytes_per_s,
                   cl.inter_node_bandwidth_bytes_per_s}) {
    if (!(std::isfinite(v) && v >= 1.0)) return true;  // KB21: >= 1, not just > 0
  }
  for (double v : {cl.link_latency_s, cl.tp_gemm_loss, cl.memory_reserve_bytes}) {
    if (!(v >= 0.0 && v <= kMaxPlannerValue)) return true;
  }
  for (const auto* p : {&c.enc, &c.llm}) {
    if (p->num_layers < 1 || p->num_heads < 1 || p->hidden_size < 1) return true;
    if (p->head_chunk_tokens < 0) return true;
    if (p->num_layers > dflop::kMaxPlannerLayers || p->num_heads > dflop::kMaxPlannerHeads)
      return true;  // KB8, KB9
    for (double v : {p->params_per_layer, p->first_stage_params, p->last_stage_params,
                     p->activation_bytes_per_token_layer, p->head_bytes_per_target_token,
                     p->microbatch_constant_s}) {
      if (!(v >= 0.0 && v <= kMaxPlannerValue)) return true;
    }
    for (double v : {p->attention_compute_fraction, p->attention_param_fraction,
                     p->attention_activation_fraction, p->forward_fraction}) {
      if (!(v >= 0.0 && v <= 1.0)) return true;
    }
  }
  if (c.o.top_k < 1 || c.o.num_threads < 0 || c.o.patience < 0 || c.o.max_tp < 0 ||
      c.o.encoder_max_tp < 0)
    return true;
  if (c.o.top_k > dflop::kMaxPlannerGpus || c.o.patience > dflop::kMaxPlannerGpus)
    return true;                                                            // KB12
  if (c.o.balance_work_budget < -1) return true;                            // KB15
  const uint64_t total = uint64_t(x.num_batches) * uint64_t(x.batch_size);  // <= 2^40
  for (const Doubles* v :
       {&x.encoder_s, &x.llm_s, &x.encoder_last_fraction, &x.llm_last_fraction, &x.encoder_tokens,
        &x.llm_tokens, &x.visual_tokens, &x.llm_target_tokens}) {
    if (v == &x.llm_target_tokens && v->empty()) continue;  // optional
    if (v->size() != total) return true;
    for (double e : *v) {
      if (!(e >= 0.0 && e <= kMaxPlannerValue)) return true;
    }
  }
  for (const Doubles* v : {&x.encoder_last_fraction, &x.llm_last_fraction}) {
    for (double e : *v) {
      if (e > 1.0) return true;
    }
  }
  if (x.encoder_units.size() != total) return true;
  for (int64_t u : x.encoder_units) {
    if (u < 0) return true;
  }
  for (int64_t b = 0; b < x.num_batches; ++b) {  // KB22: a batch's units, split_units' bound
    int64_t sum = 0;
    for (int64_t i = 0; i < x.batch_size; ++i) {
      const int64_t u = x.encoder_units[size_t(b * x.batch_size + i)];
      if (__builtin_add_overflow(sum, u, &sum)) sum = kI64Max;
    }
    if (sum > dflop::kMaxSplitUnits) return true;
  }
  return false;
}

// Inputs the planner cases skip: those too expensive to fuzz
// (not bugs: the planner's cost grows with them; inputs past the planner.hpp bounds are
// rejected at once, so only valid sizes are skipped).
const char* planner_skip(const PlannerCase& c) {
  const auto& x = c.x;
  for (int64_t u : x.encoder_units) {  // split_units is O(units / replicas)
    if (u > (int64_t{1} << 20)) return "expensive (encoder_units)";
  }
  if (c.cluster.num_gpus > 64 && c.cluster.num_gpus <= dflop::kMaxPlannerGpus)
    return "expensive (num_gpus)";
  for (const auto* p : {&c.enc, &c.llm}) {
    if (p->num_layers > 4096 && p->num_layers <= dflop::kMaxPlannerLayers)
      return "expensive (num_layers)";
  }
  if (c.o.balance_work_budget > 20000) return "expensive (balance_work_budget)";
  return nullptr;
}

void mutate_planner(Rng& r, PlannerCase& c) {
  auto& cl = c.cluster;
  auto& x = c.x;
  auto& o = c.o;
  auto column = [&]() -> Doubles& {
    return *r.pick<Doubles*>({&x.encoder_s, &x.llm_s, &x.encoder_last_fraction,
                              &x.llm_last_fraction, &x.encoder_tokens, &x.llm_tokens,
                              &x.visual_tokens});
  };
  const int64_t count = r.range(1, 2);
  for (int64_t k = 0; k < count; ++k) {
    dflop::ModuleParams& p = r.chance(0.5) ? c.enc : c.llm;
    switch (r.below(20)) {
      case 0:
        cl.num_gpus = r.chance(0.5) ? weird_int(r) : r.range(-1, 2);
        break;
      case 1:
        cl.gpus_per_node = r.chance(0.5) ? weird_int(r) : r.range(-1, 16);
        break;
      case 2: {
        double* f = r.pick<double*>({&cl.gpu_memory_bytes, &cl.intra_node_bandwidth_bytes_per_s,
                                     &cl.inter_node_bandwidth_bytes_per_s, &cl.link_latency_s,
                                     &cl.tp_gemm_loss, &cl.memory_reserve_bytes});
        *f = weird_double(r);
        break;
      }
      case 3: {
        int64_t* f = r.pick<int64_t*>({&p.num_layers, &p.num_heads, &p.hidden_size});
        *f = r.chance(0.4) ? weird_int(r)
             : r.chance(0.3)
                 ? r.pick<int64_t>({dflop::kMaxPlannerLayers + 1, dflop::kMaxPlannerHeads,
                                    dflop::kMaxPlannerHeads + 1})
                 : r.range(-1, 40);
        break;
      }
      case 4: {
        double* f = r.pick<double*>({&p.params_per_layer, &p.first_stage_params,
                                     &p.last_stage_params, &p.activation_bytes_per_token_layer,
                                     &p.head_bytes_per_target_token, &p.microbatch_constant_s});
        *f = weird_double(r);
        break;
      }
      case 5: {
        double* f = r.pick<double*>({&p.attention_compute_fraction, &p.attention_param_fraction,
                                     &p.attention_activation_fraction, &p.forward_fraction});
        *f = r.chance(0.5) ? weird_double(r) : r.pick({0.0, 1.0, 1.0 + 1e-12});
        break;
      }
      case 6: {
        Doubles& v = column();
        if (!v.empty()) v[r.below(v.size())] = weird_double(r);
        break;
      }
      case 7:
        if (r.chance(0.5)) {
          column().push_back(0.0);
        } else {
          x.encoder_units.pop_back();
        }
        break;
      case 8:
        if (!x.encoder_units.empty()) {
          const size_t i = r.below(x.encoder_units.size());
          x.encoder_units[i] = r.chance(0.5) ? weird_int(r) : r.range(-1, 0);
        }
        break;
      case 9:
        if (r.chance(0.5)) {
          x.num_batches =
              r.chance(0.5) ? weird_int(r) : add_sat(x.num_batches, r.pick<int64_t>({-1, 1}));
        } else {
          x.batch_size =
              r.chance(0.5) ? weird_int(r) : add_sat(x.batch_size, r.pick<int64_t>({-1, 1}));
        }
        break;
      case 10:
        o.global_batch = r.chance(0.5) ? weird_int(r) : add_sat(o.global_batch, 1);
        break;
      case 11:
        o.top_k = r.chance(0.4)   ? weird_int(r)
                  : r.chance(0.3) ? dflop::kMaxPlannerGpus + r.range(0, 1)
                                  : r.range(-1, 1);
        break;
      case 12:
        if (r.chance(0.5)) {
          o.max_tp = weird_int(r);
        } else {
          o.encoder_max_tp = weird_int(r);
        }
        break;
      case 13:
        o.num_threads = r.chance(0.5) ? r.pick<int64_t>({-1, 0, 3, 64}) : weird_int(r);
        break;
      case 14:
        if (r.chance(0.5)) {
          o.strategy = static_cast<dflop::PlanStrategy>(r.pick<int>({3, -1, 127}));
        } else {
          o.encoder_split = static_cast<dflop::EncoderSplit>(r.pick<int>({3, -1, 127}));
        }
        break;
      case 15:
        o.screen_factor = weird_double(r);
        break;
      case 16:
        o.patience = r.chance(0.7) ? weird_int(r) : dflop::kMaxPlannerGpus + r.range(0, 1);
        break;
      case 17:
        if (r.chance(0.5)) {
          o.microbatch_choices.push_back(weird_int(r));
        } else {
          o.encoder_gpu_choices.push_back(r.chance(0.5) ? weird_int(r) : cl.num_gpus);
        }
        break;
      case 18:
        o.balance_work_budget = r.chance(0.5) ? weird_int(r) : r.pick<int64_t>({-2, -1, 0});
        break;
      default:  // extreme magnitudes: valid, or just past the planner's bounds
        if (r.chance(0.5)) {
          *r.pick<double*>({&cl.intra_node_bandwidth_bytes_per_s,
                            &cl.inter_node_bandwidth_bytes_per_s, &cl.gpu_memory_bytes}) =
              r.pick({kDenormMin, 1e-300, 1e300, kDblMax});
        } else {
          Doubles& v = column();
          double* f = r.pick<double*>({&cl.tp_gemm_loss, &cl.link_latency_s, &p.params_per_layer,
                                       &p.microbatch_constant_s,
                                       v.empty() ? &cl.link_latency_s : &v[r.below(v.size())]});
          *f = r.pick({kDenormMin, 1e-300, 1e100, std::nextafter(1e100, kInf), 1e300});
        }
        break;
    }
  }
}

bool planner_moderate(const PlannerCase& c) {
  const auto& cl = c.cluster;
  const auto& x = c.x;
  if (!(cl.intra_node_bandwidth_bytes_per_s >= 1.0 && cl.inter_node_bandwidth_bytes_per_s >= 1.0 &&
        cl.tp_gemm_loss <= 1e3 && moderate(cl.gpu_memory_bytes) && moderate(cl.link_latency_s) &&
        moderate(cl.memory_reserve_bytes)))
    return false;
  for (const auto* p : {&c.enc, &c.llm}) {
    if (p->hidden_size > (int64_t{1} << 40)) return false;
    for (double v : {p->params_per_layer, p->first_stage_params, p->last_stage_params,
                     p->activation_bytes_per_token_layer, p->head_bytes_per_target_token,
                     p->microbatch_constant_s}) {
      if (!moderate(v)) return false;
    }
  }
  return moderate(x.encoder_s) && moderate(x.llm_s) && moderate(x.encoder_tokens) &&
         moderate(x.llm_tokens) && moderate(x.visual_tokens) && moderate(x.llm_target_tokens);
}

// Layout rules the header documents (planner.hpp's model and ModuleLayout / Layout).
std::string layout_problem(const PlannerCase& c, const dflop::Layout& l) {
  const auto& cl = c.cluster;
  std::ostringstream s;
  // tp x pp x dp (-1 if it overflows).
  auto gpus = [](const dflop::ModuleLayout& m) {
    int64_t x = 0;
    return mul_overflows(m.tp, m.pp, &x) || mul_overflows(x, m.dp, &x) ? -1 : x;
  };
  auto module = [&](const char* name, const dflop::ModuleParams& p, const dflop::ModuleLayout& m,
                    bool heads_divide) {
    if (m.tp < 1 || m.pp < 1 || m.dp < 1) s << name << ": degrees < 1; ";
    if (m.tp > cl.num_gpus || m.pp > cl.num_gpus || m.dp > cl.num_gpus)
      s << name << ": a degree above num_gpus; ";  // KB13
    if (m.tp >= 1 &&
        (cl.gpus_per_node < 1 || cl.gpus_per_node % m.tp != 0 || m.first_rank % m.tp != 0))
      s << name << ": a TP group crosses a node; ";
    if (heads_divide && m.tp >= 1 && p.num_heads % m.tp != 0)
      s << name << ": tp does not divide heads; ";
    int64_t entries = 0;
    if (m.virtual_stages < 1 || mul_overflows(m.pp, m.virtual_stages, &entries) ||
        int64_t(m.layers_per_stage.size()) != entries)
      s << name << ": layers_per_stage size; ";
    if (m.virtual_stages > 1 &&
        (l.colocated || m.pp < 2 || &m == &l.encoder || l.num_microbatches % m.pp != 0))
      s << name << ": virtual stages where interleaving cannot run; ";
    int64_t sum = 0;
    bool over = false;
    for (int64_t x : m.layers_per_stage) over = over || __builtin_add_overflow(sum, x, &sum);
    if (over || sum != p.num_layers) s << name << ": layers do not sum to num_layers; ";
    if (std::any_of(m.layers_per_stage.begin(), m.layers_per_stage.end(),
                    [](int64_t x) { return x < 1; }))
      s << name << ": an empty stage; ";
    if (std::any_of(m.layers_per_stage.begin(), m.layers_per_stage.end(),
                    [&](int64_t x) { return x > p.num_layers; }))
      s << name << ": a stage with more than num_layers; ";  // KB13
  };
  module("llm", c.llm, l.llm, true);
  int64_t bins = 0;
  if (l.num_microbatches < 1 || l.num_microbatches > c.o.global_batch ||
      mul_overflows(l.num_microbatches, l.llm.dp, &bins) || bins > c.o.global_batch)
    s << "num_microbatches x dp > global_batch; ";
  const int64_t llm_gpus = gpus(l.llm);
  if (l.colocated) {
    if (llm_gpus != cl.num_gpus || l.llm.first_rank != 0)
      s << "colocated layout does not cover the cluster; ";
  } else {
    module("encoder", c.enc, l.encoder, true);
    const int64_t v = gpus(l.encoder);
    int64_t all = 0;
    if (v < 0 || llm_gpus < 0 || l.encoder.first_rank != 0 || l.llm.first_rank != v ||
        __builtin_add_overflow(v, llm_gpus, &all) || all != cl.num_gpus)
      s << "encoder and LLM ranks do not cover the cluster; ";
  }
  return s.str();
}

// One scored layout: its documented invariants.
void check_score(const PlannerCase& c, const dflop::LayoutScore& s, bool moderate_input,
                 const char* what) {
  const std::string problem = layout_problem(c, s.layout);
  FUZZ_CHECK(problem.empty(), what << ": " << problem << describe(s.layout));
  FUZZ_CHECK(s.peak_memory_bytes <= c.cluster.gpu_memory_bytes,
             what << ": peak memory " << num(s.peak_memory_bytes) << " over "
                  << num(c.cluster.gpu_memory_bytes));
  FUZZ_REQUIRE(int64_t(s.steps.size()) == c.x.num_batches,
               what << ": " << s.steps.size() << " steps");
  const int64_t stages =
      s.layout.colocated ? s.layout.llm.pp : s.layout.encoder.pp + s.layout.llm.pp;
  double total = 0.0;
  for (const auto& step : s.steps) {
    total += step.step_time_s;
    FUZZ_CHECK(int64_t(step.stage_compute_s.size()) == stages &&
                   int64_t(step.stage_allreduce_s.size()) == stages,
               what << ": stage arrays " << step.stage_compute_s.size() << " "
                    << step.stage_allreduce_s.size() << ", stages " << stages);
    if (moderate_input) {
      FUZZ_CHECK(std::isfinite(step.step_time_s) && step.step_time_s >= 0.0, num(step.step_time_s));
      FUZZ_CHECK(step.idle_fraction >= -1e-9 && step.idle_fraction <= 1.0 + 1e-9,
                 what << ": idle_fraction " << num(step.idle_fraction));
    }
  }
  FUZZ_CHECK(rel_near(s.mean_step_time_s, total / double(c.x.num_batches), 1e-12),
             what << ": mean_step_time_s " << num(s.mean_step_time_s) << " vs the steps' mean "
                  << num(total / double(c.x.num_batches)));
  FUZZ_CHECK(s.mean_step_time_as_scheduled_s >= s.mean_step_time_s * (1 - 1e-12),
             what << ": as scheduled " << num(s.mean_step_time_as_scheduled_s) << " < best order "
                  << num(s.mean_step_time_s));
  if (moderate_input) {
    FUZZ_CHECK(s.mean_step_time_s >= s.lower_bound_s * (1 - 1e-9),
               what << ": mean_step_time_s " << num(s.mean_step_time_s) << " below lower_bound_s "
                    << num(s.lower_bound_s) << " for " << describe(s.layout));
  }
}

// The step model of a layout and batch: shapes and the encoder split.
void check_step(const PlannerCase& c, const dflop::Layout& l, int64_t batch,
                const dflop::StepModel& st, const char* what) {
  const int64_t m = l.num_microbatches, dp = l.llm.dp;
  const int64_t stages = l.colocated ? l.llm.pp : l.encoder.pp + l.llm.pp;
  FUZZ_CHECK(
      st.sim.num_replicas == dp && st.sim.num_stages == stages && st.sim.num_microbatches == m,
      what << ": sim " << st.sim.num_replicas << " x " << st.sim.num_stages << " x "
           << st.sim.num_microbatches);
  FUZZ_REQUIRE(
      int64_t(st.assignment.size()) == c.x.batch_size && all_bins_used(st.assignment, m * dp),
      what << ": assignment " << vec(st.assignment));
  Ints order = st.microbatch_order;
  std::sort(order.begin(), order.end());
  Ints identity(static_cast<size_t>(m));
  std::iota(identity.begin(), identity.end(), int64_t{0});
  FUZZ_CHECK(order == identity, what << ": microbatch_order " << vec(st.microbatch_order));
  FUZZ_CHECK(st.num_encoder_stages == (l.colocated ? 0 : l.encoder.pp), st.num_encoder_stages);
  if (l.colocated) return;
  const int64_t e_dp = l.encoder.dp, e_pp = l.encoder.pp;
  FUZZ_CHECK(st.num_encoder_replicas == e_dp, st.num_encoder_replicas);
  FUZZ_CHECK(int64_t(st.encoder_forward_s.size()) == e_dp * e_pp * m &&
                 int64_t(st.encoder_backward_s.size()) == e_dp * e_pp * m,
             what << ": encoder arrays " << st.encoder_forward_s.size());
  const size_t pieces = st.piece_sample.size();
  FUZZ_REQUIRE(st.piece_microbatch.size() == pieces && st.piece_first_unit.size() == pieces &&
                   st.piece_num_units.size() == pieces && st.piece_replica.size() == pieces,
               what << ": piece arrays");
  if (c.o.encoder_split == dflop::EncoderSplit::Even) return;
  // Every visual sample's units, once, in its own microbatch, by an encoder replica.
  Ints covered(size_t(c.x.batch_size), 0);
  for (size_t p = 0; p < pieces; ++p) {
    const int64_t i = st.piece_sample[p];
    FUZZ_REQUIRE(i >= 0 && i < c.x.batch_size, what << ": piece sample " << i);
    FUZZ_CHECK(st.piece_microbatch[p] == st.assignment[size_t(i)] / dp,
               what << ": piece of sample " << i << " in microbatch " << st.piece_microbatch[p]);
    FUZZ_CHECK(st.piece_replica[p] >= 0 && st.piece_replica[p] < e_dp,
               what << ": piece replica " << st.piece_replica[p]);
    FUZZ_CHECK(st.piece_first_unit[p] == covered[size_t(i)],
               what << ": piece of sample " << i << " starts at " << st.piece_first_unit[p]
                    << ", expected " << covered[size_t(i)]);
    covered[size_t(i)] += st.piece_num_units[p];
  }
  for (int64_t i = 0; i < c.x.batch_size; ++i) {
    const int64_t units = c.x.encoder_units[size_t(batch * c.x.batch_size + i)];
    FUZZ_CHECK(covered[size_t(i)] == units, what << ": sample " << i << " has " << units
                                                 << " units, pieces cover " << covered[size_t(i)]);
  }
}

void planner_follow_ups(Rng& r, const PlannerCase& c, const dflop::LayoutScore& best,
                        bool moderate_input) {
  Fuzz& fuzz = Fuzz::current();
  const dflop::Layout& l = best.layout;
  // The same layout scored alone: the same schedules, the same simulation.
  dflop::LayoutScore alone;
  const Outcome e = fuzz.call("evaluate_layout(best)", [&] {
    alone = dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l);
  });
  FUZZ_CHECK(e == Outcome::Returned, "a layout plan_layouts returned: " << outcome_name(e));
  if (e == Outcome::Returned) {
    check_score(c, alone, moderate_input, "evaluate_layout(best)");
    FUZZ_CHECK(rel_near(alone.mean_step_time_s, best.mean_step_time_s, 1e-9),
               "evaluate_layout " << num(alone.mean_step_time_s) << " vs plan_layouts "
                                  << num(best.mean_step_time_s) << " for " << describe(l));
  }
  // build_step of every batch reproduces the step the score took; its assignments, given
  // back to evaluate_layout, reproduce the score.
  std::vector<Ints> assignments;
  for (int64_t b = 0; b < c.x.num_batches; ++b) {
    dflop::StepModel st;
    const Outcome o = fuzz.call("build_step(best)", [&] {
      st = dflop::build_step(c.cluster, c.enc, c.llm, c.x, c.o, l, b);
    });
    FUZZ_CHECK(o == Outcome::Returned, outcome_name(o));
    if (o != Outcome::Returned) return;
    check_step(c, l, b, st, "build_step(best)");
    double t = 0.0;
    const Outcome s = fuzz.call("simulate_pipeline(build_step)",
                                [&] { t = dflop::simulate_pipeline(st.sim).step_time_s; });
    FUZZ_CHECK(s == Outcome::Returned, outcome_name(s));
    if (s == Outcome::Returned && size_t(b) < best.steps.size() &&
        std::isfinite(best.mean_step_time_s)) {
      FUZZ_CHECK(rel_near(t, best.steps[size_t(b)].step_time_s, 1e-9),
                 "batch " << b << ": build_step simulates " << num(t) << ", the score took "
                          << num(best.steps[size_t(b)].step_time_s));
    }
    if (r.chance(0.5)) {
      dflop::StepModel again;
      const Outcome a = fuzz.call("step_from_assignment(best)", [&] {
        again = dflop::step_from_assignment(c.cluster, c.enc, c.llm, c.x, c.o, l, b, st.assignment);
      });
      FUZZ_CHECK(a == Outcome::Returned, outcome_name(a));
      if (a == Outcome::Returned) {
        FUZZ_CHECK(again.sim.forward_s == st.sim.forward_s &&
                       again.sim.backward_s == st.sim.backward_s &&
                       again.sim.activation_bytes == st.sim.activation_bytes &&
                       again.sim.gradient_links == st.sim.gradient_links,
                   "step_from_assignment(build_step's assignment) differs from build_step");
      }
    }
    if (!l.colocated) {
      dflop::StageCosts sc;
      const Outcome k = fuzz.call("stage_costs(best)", [&] {
        sc = dflop::stage_costs(c.cluster, c.enc, c.llm, c.x, c.o, l, b);
      });
      FUZZ_CHECK(k == Outcome::Returned, outcome_name(k));
      if (k == Outcome::Returned) {
        FUZZ_CHECK(int64_t(sc.costs.size()) == 2 * c.x.batch_size, sc.costs.size());
        if (moderate_input) {
          FUZZ_CHECK(all_nonneg_finite(sc.costs) && nonneg_finite(sc.constants[0]) &&
                         nonneg_finite(sc.constants[1]),
                     "stage costs " << vec(sc.costs));
        }
      }
    }
    assignments.push_back(st.assignment);
  }
  dflop::LayoutScore given;
  const Outcome g = fuzz.call("evaluate_layout(best, assignments)", [&] {
    given = dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l, &assignments);
  });
  FUZZ_CHECK(g == Outcome::Returned, outcome_name(g));
  if (g == Outcome::Returned) {
    FUZZ_CHECK(rel_near(given.mean_step_time_s, best.mean_step_time_s, 1e-9),
               "evaluate_layout(build_step's schedules) " << num(given.mean_step_time_s) << " vs "
                                                          << num(best.mean_step_time_s));
  }
}

bool same_layout(const dflop::Layout& a, const dflop::Layout& b) {
  auto same = [](const dflop::ModuleLayout& x, const dflop::ModuleLayout& y) {
    return x.tp == y.tp && x.pp == y.pp && x.dp == y.dp && x.first_rank == y.first_rank &&
           x.layers_per_stage == y.layers_per_stage && x.recompute == y.recompute &&
           x.virtual_stages == y.virtual_stages;
  };
  return a.colocated == b.colocated && a.num_microbatches == b.num_microbatches &&
         same(a.llm, b.llm) && (a.colocated || same(a.encoder, b.encoder)) &&
         (!a.colocated || a.encoder.recompute == b.encoder.recompute);
}

void check_plan(const PlannerCase& c, const dflop::PlanResult& res, bool moderate_input) {
  const auto& o = c.o;
  FUZZ_CHECK(int64_t(res.best.size()) <= o.top_k, res.best.size() << " > top_k");
  for (size_t i = 0; i < res.best.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      FUZZ_CHECK(!same_layout(res.best[i].layout, res.best[j].layout),
                 "best[" << j << "] and best[" << i << "] are the same layout "
                         << describe(res.best[i].layout));
    }
  }
  const bool reference = o.strategy == dflop::PlanStrategy::MeanShapeReference;
  for (size_t i = 0; i < res.best.size(); ++i) {
    const auto& s = res.best[i];
    const auto& l = s.layout;
    check_score(c, s, moderate_input, "plan_layouts");
    if (o.strategy == dflop::PlanStrategy::DataBlindColocated)
      FUZZ_CHECK(l.colocated, "data-blind");
    if (reference || (o.strategy == dflop::PlanStrategy::DataAware && !o.colocated_candidates))
      FUZZ_CHECK(!l.colocated, "a colocated layout without colocated candidates");
    if (o.max_tp > 0) FUZZ_CHECK(l.llm.tp <= o.max_tp && l.encoder.tp <= o.max_tp, "max_tp");
    if (!l.colocated) {
      const int64_t v = l.encoder.tp * l.encoder.pp * l.encoder.dp;
      if (o.encoder_max_tp > 0) FUZZ_CHECK(l.encoder.tp <= o.encoder_max_tp, "encoder_max_tp");
      if (!o.encoder_gpu_choices.empty()) {
        FUZZ_CHECK(std::find(o.encoder_gpu_choices.begin(), o.encoder_gpu_choices.end(), v) !=
                       o.encoder_gpu_choices.end(),
                   "encoder GPUs " << v << " not in encoder_gpu_choices");
      }
    }
    if (!o.microbatch_choices.empty()) {
      FUZZ_CHECK(std::find(o.microbatch_choices.begin(), o.microbatch_choices.end(),
                           l.num_microbatches) != o.microbatch_choices.end(),
                 "num_microbatches " << l.num_microbatches << " not in microbatch_choices");
    }
    if (reference) {
      FUZZ_CHECK(s.lower_bound_s == 0.0 && s.estimate_s >= 0.0, "reference bound/estimate");
      if (i > 0) FUZZ_CHECK(s.estimate_s >= res.best[i - 1].estimate_s, "not ordered by estimate");
    } else {
      FUZZ_CHECK(s.estimate_s == 0.0, "estimate_s " << num(s.estimate_s));
      if (i > 0) {
        FUZZ_CHECK(s.mean_step_time_s >= res.best[i - 1].mean_step_time_s,
                   "best not ordered: " << num(res.best[i - 1].mean_step_time_s) << " then "
                                        << num(s.mean_step_time_s));
      }
    }
    if (!o.order_microbatches || o.strategy != dflop::PlanStrategy::DataAware) {
      for (const auto& step : s.steps) {
        FUZZ_CHECK(step.order == dflop::MicrobatchOrder::AsScheduled, "order " << int(step.order));
      }
    }
  }
  const auto& st = res.stats;
  FUZZ_CHECK(st.num_candidates >= 0 && st.num_memory_rejected >= 0 && st.num_bounded >= 0 &&
                 st.num_simulated >= int64_t(res.best.size()) && st.num_pruned >= 0 &&
                 st.num_scheduled >= 0 && st.num_balanced >= 0 &&
                 st.num_pruned_after_schedule >= 0 && st.num_unexplored >= 0,
             "stats " << st.num_candidates << " " << st.num_memory_rejected << " " << st.num_bounded
                      << " " << st.num_simulated << " " << st.num_pruned << " " << st.num_scheduled
                      << " " << st.num_balanced << " " << st.num_pruned_after_schedule << " "
                      << st.num_unexplored);
  // patience 0: no limit; what is left unexplored is counted only when patience stopped it.
  if (o.patience == 0) FUZZ_CHECK(!st.stopped_by_patience, "stopped by patience 0");
  if (!st.stopped_by_patience) FUZZ_CHECK(st.num_unexplored == 0, st.num_unexplored);
  if (res.best.empty() && res.shortfall.found && moderate_input) {
    FUZZ_CHECK(res.shortfall.needed_bytes > c.cluster.gpu_memory_bytes,
               "shortfall " << num(res.shortfall.needed_bytes) << " fits in "
                            << num(c.cluster.gpu_memory_bytes));
  }
}

TEST_CASE(fuzz_plan_layouts) {
  Fuzz fuzz("fuzz_plan_layouts", 2);
  fuzz.run([&](Rng& r) {
    PlannerCase c = gen_planner(r);
    if (r.chance(0.3)) mutate_planner(r, c);
    fuzz.describe([&c] { return describe(c); });
    if (const char* why = planner_skip(c)) {
      if (!fuzz.skip(why)) return;
    }
    c.o.interrupted = c.interrupt.check();
    const bool reject = planner_documented_invalid(c);
    const bool moderate_input = !reject && planner_moderate(c);
    dflop::PlanResult res;
    std::string what;
    const Outcome o = fuzz.call(
        "plan_layouts", [&] { res = dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); },
        c.interrupt.fired.get(), &what);
    const Outcome v = fuzz.call("validate_planner_input", [&] {
      dflop::validate_planner_input(c.cluster, c.enc, c.llm, c.x, c.o);
    });
    if (reject) FUZZ_CHECK(v == Outcome::Invalid, "documented-invalid input: " << outcome_name(v));
    if (v == Outcome::Invalid) FUZZ_CHECK(o == Outcome::Invalid, outcome_name(o));
    if (v == Outcome::Returned && moderate_input) {
      FUZZ_CHECK(o == Outcome::Returned || o == Outcome::Interrupted,
                 "validated input, but plan_layouts: " << outcome_name(o) << " (" << what << ")");
    }
    FUZZ_CHECK((o == Outcome::Interrupted) == *c.interrupt.fired,
               "interrupt fired: " << *c.interrupt.fired << ", outcome " << outcome_name(o));
    if (o != Outcome::Returned) return;
    check_plan(c, res, moderate_input);
    if (!res.best.empty() && r.chance(0.5)) planner_follow_ups(r, c, res.best[0], moderate_input);
    if (c.interrupt.after >= 0 || c.o.strategy == dflop::PlanStrategy::MeanShapeReference) return;
    // Documented: screen_factor 0 (and no patience limit) makes the pruned search return what
    // the exhaustive one does; the result and statistics do not depend on num_threads.
    if (r.chance(0.08) && c.o.prune && c.cluster.num_gpus <= 8 && c.x.batch_size <= 12) {
      PlannerCase a = c, b = c;
      a.o.screen_factor = 0.0;
      a.o.patience = 0;
      b.o.prune = false;
      dflop::PlanResult pruned, full;
      const Outcome pa = fuzz.call("plan_layouts (screen 0, patience 0)", [&] {
        pruned = dflop::plan_layouts(a.cluster, a.enc, a.llm, a.x, a.o);
      });
      const Outcome pb = fuzz.call("plan_layouts (exhaustive)", [&] {
        full = dflop::plan_layouts(b.cluster, b.enc, b.llm, b.x, b.o);
      });
      FUZZ_CHECK(pa == Outcome::Returned && pb == Outcome::Returned,
                 outcome_name(pa) << ", " << outcome_name(pb));
      bool same = pruned.best.size() == full.best.size();
      for (size_t i = 0; same && i < full.best.size(); ++i) {
        same = pruned.best[i].mean_step_time_s == full.best[i].mean_step_time_s &&
               same_layout(pruned.best[i].layout, full.best[i].layout);
      }
      if (!same && config().verbose) {
        for (const auto* res_ : {&pruned, &full}) {
          std::printf("  %s:\n", res_ == &pruned ? "pruned" : "exhaustive");
          for (const auto& sc : res_->best) {
            std::printf("    %.17g lb %.17g %s\n", sc.mean_step_time_s, sc.lower_bound_s,
                        describe(sc.layout).c_str());
          }
        }
      }
      FUZZ_CHECK(same, "prune (screen_factor 0, patience 0) found "
                           << pruned.best.size() << " layouts, exhaustive " << full.best.size()
                           << ": " << (pruned.best.empty() ? 0.0 : pruned.best[0].mean_step_time_s)
                           << " vs " << (full.best.empty() ? 0.0 : full.best[0].mean_step_time_s));
    } else if (r.chance(0.05)) {
      PlannerCase t = c;
      t.o.num_threads = c.o.num_threads == 1 ? 2 : 1;
      dflop::PlanResult other;
      const Outcome po = fuzz.call("plan_layouts (other num_threads)", [&] {
        other = dflop::plan_layouts(t.cluster, t.enc, t.llm, t.x, t.o);
      });
      FUZZ_CHECK(po == Outcome::Returned, outcome_name(po));
      bool same = other.best.size() == res.best.size() &&
                  other.stats.num_simulated == res.stats.num_simulated &&
                  other.stats.num_pruned == res.stats.num_pruned &&
                  other.stats.num_balanced == res.stats.num_balanced;
      for (size_t i = 0; same && i < res.best.size(); ++i) {
        same = other.best[i].mean_step_time_s == res.best[i].mean_step_time_s &&
               same_layout(other.best[i].layout, res.best[i].layout);
      }
      FUZZ_CHECK(same, "num_threads changes the result");
    }
  });
}

// ---- random (mostly valid) layouts for evaluate_layout & co ----------------------------

bool random_module(Rng& r, const dflop::ClusterParams& cl, const dflop::ModuleParams& p,
                   int64_t gpus, int64_t first_rank, bool heads_divide, dflop::ModuleLayout* out) {
  std::vector<std::array<int64_t, 3>> degrees;
  if (gpus < 1 || gpus > 64 || cl.gpus_per_node < 1 || p.num_layers < 1 || p.num_heads < 1)
    return false;
  for (int64_t tp = 1; tp <= gpus; ++tp) {
    if (cl.gpus_per_node % tp || gpus % tp || first_rank % tp || (heads_divide && p.num_heads % tp))
      continue;
    const int64_t rest = gpus / tp;
    for (int64_t pp = 1; pp <= std::min(rest, p.num_layers); ++pp) {
      if (rest % pp == 0) degrees.push_back({tp, pp, rest / pp});
    }
  }
  if (degrees.empty()) return false;
  const auto d = r.pick(degrees);
  out->tp = d[0];
  out->pp = d[1];
  out->dp = d[2];
  out->first_rank = first_rank;
  // A random composition of num_layers into pp stages of >= 1 layers.
  Ints cuts;
  while (int64_t(cuts.size()) < d[1] - 1) {  // pp - 1 distinct cuts in [1, num_layers)
    const int64_t k = r.range(1, p.num_layers - 1);
    if (std::find(cuts.begin(), cuts.end(), k) == cuts.end()) cuts.push_back(k);
  }
  std::sort(cuts.begin(), cuts.end());
  out->layers_per_stage.clear();
  int64_t prev = 0;
  for (int64_t cut : cuts) out->layers_per_stage.push_back(cut - prev), prev = cut;
  out->layers_per_stage.push_back(p.num_layers - prev);
  out->recompute = r.chance(0.3);
  return true;
}

dflop::Layout gen_layout(Rng& r, const PlannerCase& c) {
  dflop::Layout l;
  const int64_t N = c.cluster.num_gpus;
  l.colocated =
      c.o.strategy == dflop::PlanStrategy::DataBlindColocated ? r.chance(0.9) : r.chance(0.3);
  if (l.colocated) {
    random_module(r, c.cluster, c.llm, N, 0, true, &l.llm);
    l.encoder.tp = l.llm.tp;
    l.encoder.layers_per_stage = {c.enc.num_layers};
  } else if (N >= 2 && N <= 64) {
    const int64_t v = r.range(1, N - 1);
    random_module(r, c.cluster, c.enc, v, 0, true, &l.encoder);
    random_module(r, c.cluster, c.llm, N - v, v, true, &l.llm);
  }
  const int64_t max_m = l.llm.dp >= 1 ? c.x.batch_size / l.llm.dp : 1;
  l.num_microbatches = max_m >= 1 ? r.range(1, max_m) : 1;
  return l;
}

void mutate_layout(Rng& r, dflop::Layout& l) {
  dflop::ModuleLayout& m = r.chance(0.5) ? l.llm : l.encoder;
  switch (r.below(6)) {
    case 0:
      *r.pick<int64_t*>({&m.tp, &m.pp, &m.dp}) = r.chance(0.5) ? weird_int(r) : r.range(0, 3);
      break;
    case 1:
      m.first_rank = r.chance(0.5) ? weird_int(r) : add_sat(m.first_rank, 1);
      break;
    case 2:
      if (!m.layers_per_stage.empty() && r.chance(0.6)) {
        m.layers_per_stage[r.below(m.layers_per_stage.size())] =
            r.chance(0.5) ? weird_int(r) : r.range(-1, 2);
      } else if (r.chance(0.5)) {
        m.layers_per_stage.push_back(1);
      } else if (!m.layers_per_stage.empty()) {
        m.layers_per_stage.pop_back();
      }
      break;
    case 3:
      l.num_microbatches =
          r.chance(0.5) ? weird_int(r) : add_sat(l.num_microbatches, r.pick<int64_t>({-1, 1}));
      break;
    case 4:
      l.colocated = !l.colocated;
      break;
    default:
      m.recompute = !m.recompute;
      break;
  }
}

TEST_CASE(fuzz_evaluate_layout) {
  Fuzz fuzz("fuzz_evaluate_layout", 4);
  fuzz.run([&](Rng& r) {
    PlannerCase c = gen_planner(r);
    if (r.chance(0.15)) mutate_planner(r, c);
    dflop::Layout l = gen_layout(r, c);
    if (r.chance(0.3)) mutate_layout(r, l);
    int64_t batch = r.range(0, std::clamp<int64_t>(c.x.num_batches, 1, 64) - 1);
    if (r.chance(0.05)) batch = r.chance(0.5) ? weird_int(r) : c.x.num_batches;
    // Given schedules: random ones, sometimes malformed.
    std::vector<Ints> assignments;
    const bool give = r.chance(0.3) && c.x.batch_size <= 1024 && l.llm.dp >= 1 &&
                      l.llm.dp <= 1024 && l.num_microbatches >= 1 &&
                      l.num_microbatches <= c.x.batch_size &&
                      l.num_microbatches * l.llm.dp <= c.x.batch_size && c.x.num_batches >= 1 &&
                      c.x.num_batches <= 4;
    if (give) {
      for (int64_t b = 0; b < c.x.num_batches; ++b) {
        assignments.push_back(random_assignment(r, c.x.batch_size, l.num_microbatches * l.llm.dp));
      }
      if (r.chance(0.2)) {
        Ints& a = assignments[r.below(assignments.size())];
        if (r.chance(0.5) || a.empty()) {
          a.push_back(0);
        } else {
          a[r.below(a.size())] = weird_int(r);
        }
      }
    }
    fuzz.describe(
        [&c, &l, batch] { return describe(c) + ", " + describe(l) + ", batch=" + num(batch); });
    if (const char* why = planner_skip(c)) {
      if (!fuzz.skip(why)) return;
    }
    const bool moderate_input = !planner_documented_invalid(c) && planner_moderate(c);
    const std::string problem = layout_problem(c, l);
    dflop::LayoutScore score;
    const Outcome e = fuzz.call("evaluate_layout", [&] {
      score = dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l,
                                     give ? &assignments : nullptr);
    });
    if (!problem.empty()) {
      FUZZ_CHECK(e == Outcome::Invalid,
                 "layout against the documented rules (" << problem << "): " << outcome_name(e));
    }
    if (e == Outcome::Returned) check_score(c, score, moderate_input, "evaluate_layout");
    if (problem.empty() && moderate_input && !give) {
      FUZZ_CHECK(e == Outcome::Returned || e == Outcome::Infeasible || e == Outcome::Invalid,
                 outcome_name(e));
    }
    dflop::StepModel st;
    const Outcome b = fuzz.call(
        "build_step", [&] { st = dflop::build_step(c.cluster, c.enc, c.llm, c.x, c.o, l, batch); });
    if (!problem.empty()) FUZZ_CHECK(b == Outcome::Invalid, outcome_name(b));
    if (b == Outcome::Returned) {
      check_step(c, l, batch, st, "build_step");
      double t = 0.0;
      const Outcome s = fuzz.call("simulate_pipeline(build_step)",
                                  [&] { t = dflop::simulate_pipeline(st.sim).step_time_s; });
      FUZZ_CHECK(s == Outcome::Returned, outcome_name(s));
      if (s == Outcome::Returned && e == Outcome::Returned && !give &&
          size_t(batch) < score.steps.size() && std::isfinite(score.mean_step_time_s)) {
        FUZZ_CHECK(rel_near(t, score.steps[size_t(batch)].step_time_s, 1e-9),
                   "build_step simulates " << num(t) << ", evaluate_layout's step "
                                           << num(score.steps[size_t(batch)].step_time_s));
      }
      if (moderate_input && s == Outcome::Returned) FUZZ_CHECK(std::isfinite(t), num(t));
    }
    dflop::StageCosts sc;
    const Outcome k = fuzz.call("stage_costs", [&] {
      sc = dflop::stage_costs(c.cluster, c.enc, c.llm, c.x, c.o, l, batch);
    });
    if (k == Outcome::Returned) {
      FUZZ_CHECK(int64_t(sc.costs.size()) == 2 * c.x.batch_size, sc.costs.size());
      if (moderate_input) FUZZ_CHECK(all_nonneg_finite(sc.costs), vec(sc.costs));
    }
    if (give) {
      dflop::StepModel given;
      const Outcome g = fuzz.call("step_from_assignment", [&] {
        given = dflop::step_from_assignment(
            c.cluster, c.enc, c.llm, c.x, c.o, l, batch,
            assignments[size_t(std::clamp<int64_t>(batch, 0, int64_t(assignments.size()) - 1))]);
      });
      if (g == Outcome::Returned) check_step(c, l, batch, given, "step_from_assignment");
    }
  });
}

}  // namespace

// =======================================================================================
// Regression cases of the bugs this fuzzer found, minimised (see KB1..KB22 at the top). KB1
// to KB20 are fixed: the cases check the fixed behaviour (KB1, KB2, KB6, KB9, KB10, KB12,
// KB13 used to be signed-overflow / float-to-integer UB that only the sanitizers caught);
// KB21 and KB22 were found in the fixed core and are fixed too.

namespace {

// How a call ended: "returned", the exception's type, "InvalidArgument", ...
template <class F>
std::string ending(F&& f) {
  try {
    f();
    return "returned";
  } catch (const dflop::InvalidArgument&) {
    return "InvalidArgument";
  } catch (const dflop::Infeasible&) {
    return "Infeasible";
  } catch (const std::exception& e) {
    std::printf("  (threw %s: %s)\n", type_name(e).c_str(), e.what());
    return type_name(e);
  }
}

const std::string kReturned = "returned";
const std::string kInvalid = "InvalidArgument";

// KB1: a work_budget near INT64_MAX with capacities overflowed the budget arithmetic; now it
// counts as kMaxWorkBudget (and the search still ends on its own stopping rules).
TEST_CASE(regression_balance_huge_work_budget_with_capacities) {
  const Doubles costs{3, 4, 1, 3, 5, 1, 4, 0, 0, 2, 2, 0};  // 6 samples x 2 dims
  for (const int64_t budget : {kI64Max, kI64Max / 64, dflop::kMaxWorkBudget + 1}) {
    dflop::BalanceOptions o;
    o.num_microbatches = 2;
    o.capacity = {9, 5};
    o.seed = 1;
    o.work_budget = budget;
    dflop::BalanceResult res;
    const std::string e = ending([&] { res = dflop::balance(costs.data(), 6, 2, o); });
    CHECK(e == kReturned || e == "Infeasible");
    if (e == kReturned) CHECK_EQ(res.stats.work_budget, dflop::kMaxWorkBudget);
  }
}

// KB2: time_limit_s >= ~9.2e9 (or +inf) overflowed the deadline's float -> integer
// conversion; now limits from 1e9 s on mean none: the same result as without a limit.
TEST_CASE(regression_balance_huge_time_limit) {
  const Doubles costs{3, 4, 1, 3, 5, 1, 4, 0, 0, 2, 2, 0};
  dflop::BalanceOptions o;
  o.num_microbatches = 3;
  o.seed = 7;
  o.work_budget = 2000;
  const dflop::BalanceResult plain = dflop::balance(costs.data(), 6, 2, o);
  for (const double limit : {1e9, 1e10, 1e300, kDblMax, kInf}) {
    o.time_limit_s = limit;
    dflop::BalanceResult res;
    const std::string e = ending([&] { res = dflop::balance(costs.data(), 6, 2, o); });
    CHECK_EQ(e, kReturned);
    if (e != kReturned) continue;
    CHECK(!res.stats.stopped_by_time_limit);
    CHECK(res.assignment == plain.assignment);
  }
}

// KB3: num_replicas was unbounded (2^61: std::length_error; INT64_MAX: signed overflow).
TEST_CASE(regression_split_units_huge_replica_count) {
  for (const int64_t r : {int64_t{1} << 61, kI64Max, dflop::kMaxSplitReplicas + 1}) {
    CHECK_EQ(ending([=] { dflop::split_units(nullptr, nullptr, 0, r); }), kInvalid);
  }
  const Ints units{3};
  const Doubles costs{1.5};
  dflop::UnitSplit s;
  CHECK_EQ(ending([&] {
             s = dflop::split_units(units.data(), costs.data(), 1, dflop::kMaxSplitReplicas);
           }),
           kReturned);
  CHECK_EQ(int64_t(s.replica_cost.size()), dflop::kMaxSplitReplicas);
  CHECK_EQ(s.makespan, 0.5);
}

// KB4: the unit split's work and memory grew with the total units (std::length_error for
// {2^60, 1, 1}); now the units sum to at most kMaxSplitUnits.
TEST_CASE(regression_split_units_huge_unit_count) {
  const Ints units{int64_t{1} << 60, 1, 1};
  const Doubles costs{0x1p60, 1.0, 1.0};  // equal unit costs
  CHECK_EQ(ending([&] { dflop::split_units(units.data(), costs.data(), 3, 2); }), kInvalid);
  const Ints over{dflop::kMaxSplitUnits, 1};
  const Doubles over_costs{1.0, 1.0};
  CHECK_EQ(ending([&] { dflop::split_units(over.data(), over_costs.data(), 2, 2); }), kInvalid);
  const Ints at{dflop::kMaxSplitUnits / 2, dflop::kMaxSplitUnits / 2};
  const Doubles at_costs{0x1p23, 0x1p23};  // unit cost 1: the optimum is 2^24 / 4
  dflop::UnitSplit s;
  CHECK_EQ(ending([&] { s = dflop::split_units(at.data(), at_costs.data(), 2, 4); }), kReturned);
  CHECK_EQ(s.makespan, 0x1p22);
}

// KB5: num_src x num_dst was unbounded.
TEST_CASE(regression_plan_routing_huge_replica_count) {
  for (const int64_t r : {int64_t{1} << 61, kI64Max, dflop::kMaxRoutingReplicas + 1}) {
    CHECK_EQ(ending([=] { dflop::plan_routing(nullptr, nullptr, nullptr, 0, r, 1); }), kInvalid);
    CHECK_EQ(ending([=] { dflop::plan_routing(nullptr, nullptr, nullptr, 0, 1, r); }), kInvalid);
  }
  const Ints src{dflop::kMaxRoutingReplicas - 1}, dst{0}, rows{5};
  dflop::RoutingPlan p;
  CHECK_EQ(ending([&] {
             p = dflop::plan_routing(src.data(), dst.data(), rows.data(), 1,
                                     dflop::kMaxRoutingReplicas, 2);
           }),
           kReturned);
  CHECK_EQ(p.send_rows[size_t(2 * (dflop::kMaxRoutingReplicas - 1))], int64_t{5});
}

// KB6: send_rows sums overflowed (signed overflow, a sanitizer report).
TEST_CASE(regression_plan_routing_row_sum_overflow) {
  const Ints src{0, 0}, dst{0, 0}, rows{kI64Max, 1};
  std::string what;
  try {
    dflop::plan_routing(src.data(), dst.data(), rows.data(), 2, 1, 1);
  } catch (const dflop::InvalidArgument& e) {
    what = e.what();
  }
  CHECK(dflop_test::contains(what, "overflow"));
  // The same rows on different pairs do not add up.
  const Ints dst2{0, 1};
  dflop::RoutingPlan p;
  CHECK_EQ(ending([&] { p = dflop::plan_routing(src.data(), dst2.data(), rows.data(), 2, 1, 2); }),
           kReturned);
  CHECK(p.send_rows == Ints({kI64Max, 1}));
}

// KB7: the result has 2 m actions, m was unbounded.
TEST_CASE(regression_pipeline_actions_huge_microbatch_count) {
  for (const int64_t m : {int64_t{1} << 61, kI64Max, dflop::kMaxPipelineMicrobatches + 1}) {
    CHECK_EQ(ending([=] { dflop::pipeline_actions(dflop::PipelineOrder::OneFOneB, 1, m, 0); }),
             kInvalid);
    dflop::PipelineSimInput in;
    in.num_microbatches = m;
    CHECK_EQ(ending([&] { dflop::simulate_pipeline(in); }), kInvalid);
  }
}

// KB8: split_layers allocated num_stages entries, unbounded.
TEST_CASE(regression_split_layers_huge_stage_count) {
  for (const int64_t n : {int64_t{1} << 61, dflop::kMaxPlannerLayers + 1}) {
    CHECK_EQ(ending([=] { dflop::split_layers(n, n, 1.0, 0.0, 0.0, false); }), kInvalid);
    CHECK_EQ(ending([=] { dflop::split_layers(n, 2, 1.0, 0.0, 0.0, true); }), kInvalid);
  }
  Ints split;
  CHECK_EQ(ending([&] {
             split = dflop::split_layers(dflop::kMaxPlannerLayers, 4, 1.0, 0.0, 0.0, true);
           }),
           kReturned);
  CHECK(split == Ints(4, dflop::kMaxPlannerLayers / 4));
}

// KB9: heads + tp - 1 overflowed (signed overflow, a sanitizer report).
TEST_CASE(regression_padded_heads_overflow) {
  CHECK_EQ(ending([] { dflop::padded_heads(kI64Max, 2); }), kInvalid);
  CHECK_EQ(ending([] { dflop::padded_heads(2, kI64Max); }), kInvalid);
  CHECK_EQ(ending([] { dflop::padded_heads(dflop::kMaxPlannerHeads + 1, 1); }), kInvalid);
  CHECK_EQ(ending([] { dflop::padded_heads(1, dflop::kMaxPlannerGpus + 1); }), kInvalid);
  CHECK_EQ(dflop::padded_heads(dflop::kMaxPlannerHeads, dflop::kMaxPlannerGpus),
           dflop::kMaxPlannerGpus);
  CHECK_EQ(dflop::padded_heads(25, 8), int64_t{32});
}

// KB10: p *= 2 overflowed for max_microbatches >= 2^62 (a sanitizer report).
TEST_CASE(regression_default_microbatch_choices_huge) {
  for (const int64_t max_m : {kI64Max, int64_t{1} << 62, (int64_t{1} << 62) + 1}) {
    const Ints choices = dflop::default_microbatch_choices(max_m);
    CHECK(!choices.empty() && choices.front() == 1 && choices.back() == max_m);
    CHECK(std::is_sorted(choices.begin(), choices.end()));
    CHECK(std::adjacent_find(choices.begin(), choices.end()) == choices.end());
  }
}

// A small planner problem (as in test_planner.cpp): 4 GPUs, one batch of 6 samples.
PlannerCase small_planner_problem() {
  PlannerCase c;
  c.cluster.num_gpus = 4;
  c.cluster.gpus_per_node = 4;
  c.enc = {4, 8, 1024, 12.6e6, 1e6, 4e6, 34.0 * 1024, 0.0, 1e-3};
  c.llm = {8, 16, 2048, 50e6, 64e6, 64e6, 34.0 * 2048, 4.0 * 32000, 2e-3};
  c.x.num_batches = 1;
  c.x.batch_size = 6;
  for (int64_t i = 0; i < 6; ++i) {
    const double units = i % 3 == 0 ? 0.0 : double(1 + i);
    const double seq = 300.0 + 200.0 * double(i) + units * 100.0;
    c.x.encoder_s.push_back(units * 0.05);
    c.x.llm_s.push_back(seq * 1e-4);
    c.x.encoder_last_fraction.push_back(units > 0 ? 0.05 : 0.0);
    c.x.llm_last_fraction.push_back(0.1);
    c.x.encoder_tokens.push_back(units * 729);
    c.x.encoder_units.push_back(int64_t(units));
    c.x.llm_tokens.push_back(seq);
    c.x.visual_tokens.push_back(units * 100.0);
  }
  c.o.global_batch = 6;
  c.o.top_k = 3;
  c.o.num_threads = 1;
  c.o.balance_work_budget = 2000;
  return c;
}

// A disaggregated layout of small_planner_problem(): encoder on GPU 0, LLM in 3 stages.
dflop::Layout small_planner_layout() {
  dflop::Layout l;
  l.encoder = {1, 1, 1, 0, {4}, false};
  l.llm = {1, 3, 1, 1, {3, 3, 2}, false};
  l.num_microbatches = 2;
  return l;
}

std::string validate(const PlannerCase& c) {
  return ending([&] { dflop::validate_planner_input(c.cluster, c.enc, c.llm, c.x, c.o); });
}

// KB9 through the planner: encoder.num_heads near INT64_MAX.
TEST_CASE(regression_planner_huge_head_count) {
  PlannerCase c = small_planner_problem();
  c.enc.num_heads = kI64Max;
  CHECK_EQ(validate(c), kInvalid);
  CHECK_EQ(ending([&] { dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }), kInvalid);
  c.enc.num_heads = dflop::kMaxPlannerHeads + 1;
  CHECK_EQ(validate(c), kInvalid);
  c.enc.num_heads = dflop::kMaxPlannerHeads;
  CHECK_EQ(validate(c), kReturned);
}

// KB11: num_batches x batch_size wrapped around in size_t: (2^62 + 1) x 4 = 4 (mod 2^64), so
// four samples passed validation.
TEST_CASE(regression_planner_sample_count_wraps) {
  PlannerCase c = small_planner_problem();
  c.x.num_batches = (int64_t{1} << 62) + 1;
  c.x.batch_size = 4;
  c.o.global_batch = 4;
  for (Doubles* v : {&c.x.encoder_s, &c.x.llm_s, &c.x.encoder_last_fraction, &c.x.llm_last_fraction,
                     &c.x.encoder_tokens, &c.x.llm_tokens, &c.x.visual_tokens}) {
    v->resize(4);
  }
  c.x.encoder_units.resize(4);
  CHECK_EQ(ending([&] { dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }), kInvalid);
  c.x.num_batches = dflop::kMaxPlannerBatches + 1;
  CHECK_EQ(validate(c), kInvalid);
  c.x.num_batches = 1;
  c.x.batch_size = c.o.global_batch = dflop::kMaxPlannerBatchSize + 1;
  CHECK_EQ(validate(c), kInvalid);
}

// KB12: 4 x top_k, 4 x patience and patience x 2048 / batch overflowed (signed overflow, a
// sanitizer report).
TEST_CASE(regression_planner_huge_top_k_and_patience) {
  PlannerCase c = small_planner_problem();
  for (const int64_t k : {kI64Max, dflop::kMaxPlannerGpus + 1}) {
    c.o.top_k = k;
    CHECK_EQ(ending([&] { dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }), kInvalid);
    c.o.top_k = 3;
    c.o.patience = k;
    CHECK_EQ(ending([&] { dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }), kInvalid);
    c.o.patience = 1000;
  }
  c.o.top_k = dflop::kMaxPlannerGpus;
  c.o.patience = dflop::kMaxPlannerGpus;
  dflop::PlanResult res;
  CHECK_EQ(ending([&] { res = dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }),
           kReturned);
  CHECK(!res.best.empty());
}

// KB13: num_microbatches x llm.dp, tp x pp x dp and the sum of layers_per_stage overflowed
// in check_layout (signed overflow, a sanitizer report).
TEST_CASE(regression_planner_layout_overflow) {
  const PlannerCase c = small_planner_problem();
  auto evaluate = [&](const dflop::Layout& l) {
    return ending([&] { dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l); });
  };
  CHECK_EQ(evaluate(small_planner_layout()), kReturned);
  dflop::Layout l = small_planner_layout();
  l.num_microbatches = kI64Max;
  CHECK_EQ(evaluate(l), kInvalid);
  l = small_planner_layout();
  l.llm.dp = int64_t{1} << 62;
  l.num_microbatches = 4;
  CHECK_EQ(evaluate(l), kInvalid);
  l = small_planner_layout();
  l.llm.tp = l.llm.pp = l.llm.dp = int64_t{1} << 22;
  CHECK_EQ(evaluate(l), kInvalid);
  l = small_planner_layout();
  l.llm.layers_per_stage = {kI64Max, kI64Max, 10};  // wraps around to 8
  CHECK_EQ(evaluate(l), kInvalid);
}

// KB14: num_gpus was unbounded (the search is linear in it: 2^40 GPUs ran for a month).
TEST_CASE(regression_planner_huge_cluster) {
  PlannerCase c = small_planner_problem();
  c.cluster.num_gpus = int64_t{1} << 40;
  CHECK_EQ(ending([&] { dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o); }), kInvalid);
}

// KB15: balance_work_budget < -1 was not validated; balance() rejected it later with a
// message that named neither the option nor the value.
TEST_CASE(regression_planner_balance_work_budget_not_validated) {
  PlannerCase c = small_planner_problem();
  c.o.balance_work_budget = -2;
  CHECK_EQ(validate(c), kInvalid);
  std::string what;
  try {
    dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o);
  } catch (const dflop::InvalidArgument& err) {
    what = err.what();
  }
  CHECK(dflop_test::contains(what, "balance_work_budget"));
}

// KB16: a stage load that overflows to +inf (cost 1e307 + microbatch constant 1.7e308)
// made backward = inf - inf = NaN, which the simulator took for "not arrived" (a step of 0,
// or std::logic_error). Now such steps (beyond 1e200 s) are rejected.
TEST_CASE(regression_pipeline_stage_load_overflow) {
  dflop::PipelineScheduleOptions o;
  o.forward_fraction = {0.5};
  o.microbatch_constant_s = {1.7e308};
  const Doubles costs{1e307};
  const Ints start{0};
  o.stages = {1};
  CHECK_EQ(ending([&] { dflop::simulated_step_time(costs.data(), 1, 1, start, o); }), kInvalid);
  o.stages = {2};
  CHECK_EQ(ending([&] { dflop::simulated_step_time(costs.data(), 1, 1, start, o); }), kInvalid);
  CHECK_EQ(ending([&] { dflop::pipeline_schedule(costs.data(), 1, 1, start, o); }), kInvalid);
  // Just past the bound through the links: 2 x 2 stages x 1 microbatch x 3e199 s.
  o.microbatch_constant_s = {0.0};
  const Doubles one{1.0};
  o.link_latency_s = 3e199;
  CHECK_EQ(ending([&] { dflop::simulated_step_time(one.data(), 1, 1, start, o); }), kInvalid);
  // Within it: a finite step (2 stages of 1e199 each, one link).
  o.link_latency_s = 0.0;
  const Doubles big{1e199};
  double step = 0.0;
  CHECK_EQ(ending([&] { step = dflop::simulated_step_time(big.data(), 1, 1, start, o); }),
           kReturned);
  CHECK(std::isfinite(step) && step >= 2e199);
}

// KB17: piece costs computed as cost x num_units / units overflowed.
TEST_CASE(regression_split_units_cost_near_dbl_max) {
  const Ints units{2};
  const Doubles costs{1e308};
  const dflop::UnitSplit s = dflop::split_units(units.data(), costs.data(), 1, 1);
  CHECK_EQ(s.makespan, 1e308);
  const Doubles max{kDblMax};
  const dflop::UnitSplit two = dflop::split_units(units.data(), max.data(), 1, 2);
  CHECK_EQ(two.makespan, kDblMax / 2);
}

// KB18 (documented): without capacities a larger work_budget continues the same trajectory,
// so it is never worse; with capacities balance.hpp says it need not be (the repair
// attempts start where the budget runs out): these two inputs end worse, or Infeasible,
// with the larger budget. Only the documented half is checked.
TEST_CASE(regression_balance_larger_budget_with_capacities) {
  const Doubles costs{3, 4, 1, 3, 5, 1, 4, 0, 0, 2, 2, 0};  // 6 samples x 2 dims
  dflop::BalanceOptions o;
  o.num_microbatches = 2;
  o.capacity = {9, 5};
  o.seed = 1;
  o.work_budget = 27;
  CHECK_EQ(dflop::balance(costs.data(), 6, 2, o).makespan, 8.0);
  o.work_budget = 179;
  const std::string e = ending([&] { dflop::balance(costs.data(), 6, 2, o); });
  CHECK(e == kReturned || e == "Infeasible");  // Infeasible at 48d9c9d: allowed
  o.capacity.clear();
  double previous = kInf;
  for (const int64_t budget : {27, 179, 2000}) {
    o.work_budget = budget;
    const double makespan = dflop::balance(costs.data(), 6, 2, o).makespan;
    CHECK(makespan <= previous);
    previous = makespan;
  }
  const Doubles costs5{5, 3, 3, 3, 1, 1, 5, 0, 0, 5};  // 5 samples x 2 dims
  dflop::BalanceOptions q;
  q.num_microbatches = 3;
  q.seed = 3;
  q.work_budget = 4;
  const double four = dflop::balance(costs5.data(), 5, 2, q).makespan;
  q.work_budget = 15;
  CHECK(dflop::balance(costs5.data(), 5, 2, q).makespan <= four);
}

// KB19: every order of the batch simulated to +inf (link_latency_s = 1e308 was accepted), so
// the step kept a default StepBreakdown while the mean was +inf. Now times and sizes are
// at most 1e100, and there the step is finite.
TEST_CASE(regression_planner_infinite_step_has_empty_breakdown) {
  PlannerCase c = small_planner_problem();
  const dflop::Layout l = small_planner_layout();
  c.cluster.link_latency_s = 1e308;
  CHECK_EQ(validate(c), kInvalid);
  CHECK_EQ(ending([&] { dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l); }), kInvalid);
  c.cluster.link_latency_s = 1e100;
  dflop::LayoutScore s;
  CHECK_EQ(ending([&] { s = dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, l); }),
           kReturned);
  CHECK(s.steps.size() == 1 && std::isfinite(s.mean_step_time_s));
  if (s.steps.size() != 1) return;
  CHECK_EQ(s.steps[0].stage_compute_s.size(), size_t{4});
  CHECK_EQ(s.steps[0].step_time_s, s.mean_step_time_s);
}

// KB20: the exhaustive search enumerated a microbatch count listed twice twice.
TEST_CASE(regression_planner_duplicate_microbatch_choices) {
  PlannerCase c = small_planner_problem();
  c.o.microbatch_choices = {2, 2};
  for (const auto strategy :
       {dflop::PlanStrategy::DataAware, dflop::PlanStrategy::MeanShapeReference}) {
    c.o.strategy = strategy;
    c.o.prune = strategy != dflop::PlanStrategy::DataAware;
    const auto res = dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o);
    bool distinct = true;
    for (size_t i = 0; i < res.best.size(); ++i) {
      for (size_t j = 0; j < i; ++j)
        distinct = distinct && !same_layout(res.best[i].layout, res.best[j].layout);
    }
    CHECK(!res.best.empty());
    CHECK(distinct);
  }
}

// KB21 (fixed): a bandwidth as small as the validation allowed (> 0: a denormal) made every
// simulated order of a batch +inf, and Search::finish kept a default StepBreakdown. Now
// bandwidths must be >= 1 byte/s, and the first order's breakdown is always kept.
TEST_CASE(regression_planner_tiny_bandwidth_empty_breakdown) {
  PlannerCase c = small_planner_problem();
  c.cluster.intra_node_bandwidth_bytes_per_s = kDenormMin;
  dflop::LayoutScore s;
  const std::string e = ending([&] {
    s = dflop::evaluate_layout(c.cluster, c.enc, c.llm, c.x, c.o, small_planner_layout());
  });
  CHECK(e == kInvalid);  // bandwidths must be >= 1 byte/s now
}

// KB22 (fixed): validate_planner_input accepted any encoder_units >= 0, but split_units takes
// at most kMaxSplitUnits units per microbatch, so plan_layouts & co throw split_units'
// InvalidArgument ("units sum to more than 16777216 at units[1]=...") in the middle of the
// search: it names neither samples.encoder_units nor the batch, and evaluate_layout of a
// layout whose microbatches stay below the bound would work.
TEST_CASE(regression_planner_encoder_units_past_split_bound) {
  PlannerCase c = small_planner_problem();
  c.x.encoder_units[1] = dflop::kMaxSplitUnits + 1;
  const std::string v = validate(c);
  std::string what;
  try {
    dflop::plan_layouts(c.cluster, c.enc, c.llm, c.x, c.o);
  } catch (const dflop::InvalidArgument& err) {
    what = err.what();
  }
  CHECK(v == kInvalid && dflop_test::contains(what, "samples.encoder_units of batch 0"));
}

}  // namespace

int main(int argc, char** argv) {
  const Config& cfg = config();
  std::printf("test_fuzz_core: DFLOP_FUZZ_SEED=%" PRIu64 " DFLOP_FUZZ_ITERATIONS=%" PRId64
              " DFLOP_FUZZ_ONLY_ITERATION=%" PRId64
              " DFLOP_FUZZ_KNOWN_BUGS=%d DFLOP_FUZZ_HANG_S=%" PRId64 "\n",
              cfg.seed, cfg.iterations, cfg.only_iteration, cfg.known_bugs ? 1 : 0, cfg.hang_s);
  std::fflush(stdout);
  Watchdog::instance().start(cfg.hang_s);
  const int rc = dflop_test::run_all(argc, argv);
  Watchdog::instance().stop();
  return rc;
}
