// Pipeline-aware schedule refinement (see the header for the model). Search:
// 1. the start (e.g. balance()'s assignment) in index order;
// 2. the best of a few constructive microbatch orders: as given; Johnson's two-machine
//    flow-shop rule on (first module, last module) paces; lightest first module first and
//    lightest last module last;
// 3. randomised first-improvement local search over three neighbourhoods: swap two
//    microbatches' positions, move a sample to another bin, swap two samples of different
//    bins. A candidate is kept when the simulated step shrinks, or stays equal while the
//    sum over microbatches of the slowest stage's load shrinks (that sum is the steady
//    state of the pipeline; it guides the search across the plateaus of the step time).
//    When as many consecutive candidates have failed as the neighbourhoods hold (a local
//    optimum), it restarts from the best state found, kicked by a few random swaps
//    (iterated local search). It runs until its work budget or time limit.
#include "dflop/pipeline_schedule.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "dflop/balance.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"
#include "format.hpp"
#include "replica_simulator.hpp"
#include "rng.hpp"

namespace dflop {
namespace {

// Model chunks per stage of dimension c (options.chunks, or 1).
int64_t chunks_of(const PipelineScheduleOptions& o, int64_t c) {
  return o.chunks.empty() ? 1 : o.chunks[size_t(c)];
}

// The program every replica runs: options.order, or pipeline_order_for() its modules'
// stages and chunks.
PipelineProgram program_of(const PipelineScheduleOptions& o) {
  PipelineShape shape{o.stages, std::vector<int64_t>(o.stages.size(), 1)};
  for (size_t c = 0; c < o.stages.size(); ++c) shape.chunks[c] = chunks_of(o, int64_t(c));
  const PipelineOrder kind =
      o.order.empty() ? pipeline_order_for(shape) : parse_pipeline_order(o.order);
  return pipeline_program(kind, shape, o.num_microbatches);
}

bool splits_backward(const PipelineProgram& program) {
  for (const auto& actions : program.actions) {
    for (const PipelineAction& a : actions) {
      if (a.kind == ActionKind::BackwardWeight) return true;
    }
  }
  return false;
}

// Simulated actions per millisecond on one current x86 core (2 stages, 24 microbatches).
constexpr double kWorkUnitsPerMs = 60000.0;
// Work between two reads of the clock under a time limit (about a quarter millisecond).
constexpr int64_t kWorkPerClockCheck = 15000;
// The largest step (seconds) a simulation accepts: far above any real one, far below
// where sums overflow.
constexpr double kMaxStepSeconds = 1e200;
// A capacity check allows this relative excess (loads are sums in different orders).
constexpr double kCapacityTolerance = 1e-9;
constexpr int64_t kMaxStages = 4096;
// Stage x microbatch pairs one simulation holds (its buffers grow with them).
constexpr int64_t kMaxStageMicrobatches = int64_t{1} << 23;

std::string fmt(double v) { return detail::format_number(v); }

template <class T>
void check_length(const char* name, const std::vector<T>& values, int64_t d) {
  if (static_cast<int64_t>(values.size()) != d) {
    throw InvalidArgument(std::string(name) + " has " + std::to_string(values.size()) +
                          " entries, expected one per cost dimension (" + std::to_string(d) + ")");
  }
}

// One value per dimension, each in [0, 1] (`fraction`) or finite and >= 0.
void check_per_dimension(const char* name, const std::vector<double>& values, int64_t d,
                         bool fraction) {
  check_length(name, values, d);
  for (size_t c = 0; c < values.size(); ++c) {
    const double v = values[c];
    const bool ok = fraction ? v >= 0.0 && v <= 1.0 : std::isfinite(v) && v >= 0.0;
    if (!ok) {
      throw InvalidArgument(std::string(name) + "[" + std::to_string(c) + "] must be " +
                            (fraction ? "in [0, 1]" : "finite and >= 0") + ", got " + fmt(v));
    }
  }
}

BalanceOptions balance_options(const PipelineScheduleOptions& o) {
  BalanceOptions b;
  b.num_microbatches = o.num_microbatches;
  b.dp_size = o.dp_size;
  b.microbatch_dims = o.microbatch_dims;
  b.capacity = o.capacity;
  return b;
}

int64_t replicas_of(const PipelineScheduleOptions& o, int64_t c) {
  return o.replicas.empty() ? 1 : o.replicas[c];
}

struct Objective {
  double step_s;
  double pace_s;  // sum over microbatches of the slowest stage load
  bool better_than(const Objective& other) const {
    return step_s < other.step_s || (step_s == other.step_s && pace_s < other.pace_s);
  }
};

class Search {
 public:
  Search(const double* costs, int64_t n, int64_t d, const std::vector<int64_t>& start,
         const PipelineScheduleOptions& o)
      : costs_(costs),
        n_(n),
        d_(d),
        m_(o.num_microbatches),
        dp_(o.dp_size),
        b_(o.num_microbatches * o.dp_size),
        forward_fraction_(o.forward_fraction),
        constant_(o.microbatch_constant_s.empty() ? std::vector<double>(d, 0.0)
                                                  : o.microbatch_constant_s),
        is_mb_dim_(d, 0),
        assignment_(start),
        order_(o.num_microbatches),
        bin_load_(b_ * d, 0.0),
        mb_load_(m_ * d, 0.0),
        bin_nonzero_(b_ * d, 0),
        mb_nonzero_(m_ * d, 0),
        count_(b_, 0),
        replicas_(d, 1),
        units_(o.units),
        sim_(program_of(o)),
        rng_(o.seed ^ 0x5DEECE66DULL) {
    for (int64_t c : o.microbatch_dims) is_mb_dim_[c] = 1;
    for (int64_t c = 0; c < d; ++c) {
      // Virtual stages in model order: chunk by chunk, each 1 / chunks of a stage's work.
      const int64_t chunks = chunks_of(o, c);
      const int64_t first_backward =
          o.backward_from_stage.empty() ? 0 : o.backward_from_stage[size_t(c)];
      for (int64_t k = 0; k < o.stages[c] * chunks; ++k) {
        stage_dim_.push_back(c);
        stage_share_.push_back(1.0 / double(chunks));
        stage_backward_.push_back(k >= first_backward ? 1 : 0);
      }
      gate_.push_back(o.backward_gate.empty() ? -1 : o.backward_gate[size_t(c)]);
      // A gated backward differs per replica's share.
      const bool per_replica = !is_mb_dim_[c] || gate_.back() >= 0;
      if (per_replica) replicas_differ_ = replicas_differ_ || dp_ > 1;
      replicas_[c] = replicas_of(o, c);
      if (replicas_[c] > 1) split_dims_.push_back(c);
    }
    if (!split_dims_.empty()) {
      members_.assign(m_, {});
      split_s_.assign(m_ * d, 0.0);
      dirty_.assign(m_, 1);
    }
    num_stages_ = static_cast<int64_t>(stage_dim_.size());
    latency_.assign(num_stages_ > 1 ? num_stages_ - 1 : 0, o.link_latency_s);
    // A stage that runs no backward is sent no gradient (as the planner's simulation).
    gradient_links_.assign(stage_backward_.begin(), stage_backward_.end() - 1);
    cut_links_ =
        std::find(gradient_links_.begin(), gradient_links_.end(), 0) != gradient_links_.end();
    forward_.assign(num_stages_ * m_, 0.0);
    backward_.assign(num_stages_ * m_, 0.0);
    if (splits_backward(sim_.program())) {
      // The W share of each virtual stage's backward: all of it where the input takes no
      // gradient (the first stage, or one after a stage that runs no backward).
      for (int64_t s = 0; s < num_stages_; ++s) {
        const int64_t c = stage_dim_[s];
        const bool input_grad = s > 0 && stage_backward_[s - 1];
        weight_share_.push_back(!input_grad                 ? 1.0
                                : o.weight_fraction.empty() ? 0.5
                                                            : o.weight_fraction[size_t(c)]);
      }
      // A split W that remakes something on a module's last stage (the chunked LM head's
      // logits) runs that extra there.
      weight_extra_.assign(num_stages_, 0.0);
      if (!o.last_stage_weight_extra.empty()) {
        for (int64_t s = 0; s < num_stages_; ++s) {
          if (s + 1 == num_stages_ || stage_dim_[s + 1] != stage_dim_[s]) {
            weight_extra_[s] = o.last_stage_weight_extra[size_t(stage_dim_[s])];
          }
        }
      }
      weight_.assign(num_stages_ * m_, 0.0);
    }
    std::iota(order_.begin(), order_.end(), int64_t{0});
    for (int64_t i = 0; i < n; ++i) add(i, assignment_[i], +1.0);
    // Growth bound relative to the start's makespan, and the hard capacities.
    cap_.assign(d, std::numeric_limits<double>::infinity());
    for (int64_t c = 0; c < d; ++c) {
      double makespan = 0.0;
      for (int64_t b = 0; b < b_; ++b) makespan = std::max(makespan, unit_load(b, c));
      double cap = o.max_growth * makespan;
      if (!o.capacity.empty()) cap = std::min(cap, o.capacity[c]);
      cap_[c] = std::max(cap, makespan);  // the start itself always fits
    }
  }

  int64_t cost_per_evaluation() const {
    // A candidate re-splits the (at most two) microbatches it changed: ~2 n / m samples.
    const int64_t splits = split_dims_.empty() ? 0 : 2 * (n_ / m_ + 1);
    return (replicas_differ_ ? dp_ : 1) * 2 * num_stages_ * m_ + splits;
  }

  Objective evaluate() {
    refresh_splits();
    const int64_t replicas = replicas_differ_ ? dp_ : 1;
    double step_s = 0.0;
    for (int64_t r = 0; r < replicas; ++r) {
      for (int64_t p = 0; p < m_; ++p) {
        const int64_t j = order_[p];
        for (int64_t s = 0; s < num_stages_; ++s) {
          const int64_t c = stage_dim_[s];
          const double load = stage_load(j, c, r) * stage_share_[s];
          forward_[s * m_ + p] = forward_fraction_[c] * load;
          backward_[s * m_ + p] = runs_backward(s, j, r) ? load - forward_[s * m_ + p] : 0.0;
          if (!weight_.empty()) {
            const double b = backward_[s * m_ + p];
            const double work = std::max(0.0, stage_load(j, c, r) - constant_[c]);
            const double extra = b > 0.0 ? weight_extra_[s] * work : 0.0;
            weight_[s * m_ + p] = weight_share_[s] * b + extra;
            backward_[s * m_ + p] = b + extra;
          }
        }
      }
      step_s = std::max(step_s, sim_.run(forward_.data(), backward_.data(), latency_.data(),
                                         cut_links_ ? gradient_links_.data() : nullptr,
                                         weight_.empty() ? nullptr : weight_.data()));
    }
    double pace_s = 0.0;
    for (int64_t j = 0; j < m_; ++j) {
      double slowest = 0.0;
      for (int64_t c = 0; c < d_; ++c) {
        for (int64_t r = 0; r < (is_mb_dim_[c] ? 1 : dp_); ++r) {
          slowest = std::max(slowest, stage_load(j, c, r));
        }
      }
      pace_s += slowest;
    }
    ++evaluations_;
    return {step_s, pace_s};
  }

  PipelineScheduleResult run(int64_t work_budget, double time_limit_s,
                             const InterruptCheck& interrupted) {
    using Clock = std::chrono::steady_clock;
    const auto started = Clock::now();
    InterruptPoller interrupt(interrupted, kWorkPerClockCheck);
    PipelineScheduleResult out;
    Objective current = evaluate();
    out.stats.start_step_time_s = current.step_s;
    choose_order(current);
    out.stats.ordered_step_time_s = current.step_s;
    Objective best = current;
    std::vector<int64_t> best_assignment = assignment_, best_order = order_;

    const int64_t per_eval = cost_per_evaluation();
    const int64_t order_swaps = m_ * (m_ - 1) / 2;
    const int64_t moves = b_ > 1 ? n_ * (b_ - 1) : 0;
    const int64_t swaps = b_ > 1 ? n_ * (n_ - 1) / 2 : 0;
    // Consecutive failed candidates after which the state counts as a local optimum.
    const int64_t stall = order_swaps + moves + swaps;
    int64_t failures = 0, attempts = 0, next_clock_check = 0;
    // A simulated candidate costs its actions; one rejected unsimulated (it would empty a
    // bin or break a bound) costs one unit, so the budget bounds every loop.
    auto work = [&] { return evaluations_ * per_eval + attempts; };
    while (stall > 0 && work() + 1 + per_eval <= work_budget) {
      ++attempts;
      interrupt.poll(work());
      if (time_limit_s >= 0 && work() >= next_clock_check) {
        next_clock_check = work() + kWorkPerClockCheck;
        if (std::chrono::duration<double>(Clock::now() - started).count() > time_limit_s) {
          out.stats.stopped_by_time_limit = true;
          break;
        }
      }
      if (failures >= stall) {
        // A local optimum: keep it if it is the best, then kick the best one and search
        // on from there (iterated local search).
        if (current.better_than(best)) {
          best = current;
          best_assignment = assignment_;
          best_order = order_;
        }
        set_state(best_assignment, best_order);
        perturb();
        current = evaluate();
        failures = 0;
        ++out.stats.perturbations;
        continue;
      }
      Objective trial{};
      if (try_candidate(current, trial, order_swaps > 0, moves > 0)) {
        current = trial;
        failures = 0;
        ++out.stats.improving_moves;
      } else {
        ++failures;
      }
    }
    if (current.better_than(best)) {
      best = current;
      best_assignment = assignment_;
      best_order = order_;
    }
    set_state(best_assignment, best_order);

    // Renumber the microbatches in execution order.
    std::vector<int64_t> position(m_);
    for (int64_t p = 0; p < m_; ++p) position[order_[p]] = p;
    out.assignment.resize(n_);
    for (int64_t i = 0; i < n_; ++i) {
      const int64_t b = assignment_[i];
      out.assignment[i] = position[b / dp_] * dp_ + b % dp_;
    }
    out.step_time_s = best.step_s;
    out.stats.evaluations = evaluations_;
    out.stats.work_used = work();
    out.stats.work_budget = work_budget;
    return out;
  }

 private:
  // One random candidate (a swap of two microbatch positions, a move of a sample to
  // another bin, or a swap of two samples of different bins, each kind equally often),
  // kept if better than `current` (then `trial` holds its objective), else undone.
  bool try_candidate(const Objective& current, Objective& trial, bool can_reorder, bool can_move) {
    const uint64_t pick = rng_.below(3);
    if (pick == 0) {
      if (!can_reorder) return false;
      const int64_t p = static_cast<int64_t>(rng_.below(m_));
      int64_t q = static_cast<int64_t>(rng_.below(m_ - 1));
      if (q >= p) ++q;
      std::swap(order_[p], order_[q]);
      trial = evaluate();
      if (trial.better_than(current)) return true;
      std::swap(order_[p], order_[q]);
      return false;
    }
    if (!can_move) return false;
    const int64_t i = static_cast<int64_t>(rng_.below(n_));
    const int64_t from = assignment_[i];
    if (pick == 1) {
      int64_t to = static_cast<int64_t>(rng_.below(b_ - 1));
      if (to >= from) ++to;
      if (count_[from] < 2) return false;  // a bin never empties
      move(i, to);
      if (fits(to)) {
        trial = evaluate();
        if (trial.better_than(current)) return true;
      }
      move(i, from);
      return false;
    }
    int64_t k = static_cast<int64_t>(rng_.below(n_ - 1));
    if (k >= i) ++k;
    const int64_t other = assignment_[k];
    if (other == from) return false;
    move(i, other);
    move(k, from);
    if (fits(from) && fits(other)) {
      trial = evaluate();
      if (trial.better_than(current)) return true;
    }
    move(k, other);
    move(i, from);
    return false;
  }

  // A few random changes accepted whatever they cost: two sample swaps that keep the
  // bounds, and one swap of microbatch positions.
  void perturb() {
    for (int kick = 0; kick < 2 && b_ > 1; ++kick) {
      const int64_t i = static_cast<int64_t>(rng_.below(n_));
      const int64_t k = static_cast<int64_t>(rng_.below(n_));
      const int64_t bi = assignment_[i], bk = assignment_[k];
      if (bi == bk) continue;
      move(i, bk);
      move(k, bi);
      if (!fits(bi) || !fits(bk)) {
        move(k, bk);
        move(i, bi);
      }
    }
    if (m_ > 1) {
      const int64_t p = static_cast<int64_t>(rng_.below(m_));
      const int64_t q = static_cast<int64_t>(rng_.below(m_));
      std::swap(order_[p], order_[q]);
    }
  }

  // Loads recomputed from scratch (no rounding residue carried over).
  void set_state(const std::vector<int64_t>& assignment, const std::vector<int64_t>& order) {
    std::fill(bin_load_.begin(), bin_load_.end(), 0.0);
    std::fill(mb_load_.begin(), mb_load_.end(), 0.0);
    std::fill(bin_nonzero_.begin(), bin_nonzero_.end(), 0);
    std::fill(mb_nonzero_.begin(), mb_nonzero_.end(), 0);
    std::fill(count_.begin(), count_.end(), 0);
    for (auto& m : members_) m.clear();
    std::fill(dirty_.begin(), dirty_.end(), 1);
    assignment_ = assignment;
    order_ = order;
    for (int64_t i = 0; i < n_; ++i) add(i, assignment_[i], +1.0);
  }

  // Re-splits every microbatch whose members changed (replicated dimensions only).
  void refresh_splits() {
    for (int64_t j = 0; j < static_cast<int64_t>(dirty_.size()); ++j) {
      if (!dirty_[j]) continue;
      dirty_[j] = 0;
      const std::vector<int64_t>& members = members_[j];
      split_units_.resize(members.size());
      split_costs_.resize(members.size());
      for (size_t p = 0; p < members.size(); ++p) split_units_[p] = units_[members[p]];
      for (const int64_t c : split_dims_) {
        for (size_t p = 0; p < members.size(); ++p) split_costs_[p] = costs_[members[p] * d_ + c];
        split_s_[j * d_ + c] = split_units(split_units_.data(), split_costs_.data(),
                                           static_cast<int64_t>(members.size()), replicas_[c])
                                   .makespan;
      }
    }
  }

  // Seconds of module c's stage for microbatch j on replica r: the constant only where
  // the module has work (an encoder skips a text-only microbatch).
  // Whether the module has work is counted, not read off the load: sums updated by
  // adding and subtracting leave rounding residue where they should be zero.
  // A replicated dimension takes its slowest replica's share (refresh_splits).
  // Whether virtual stage s runs microbatch j's backward on replica r.
  bool runs_backward(int64_t s, int64_t j, int64_t r) const {
    if (!stage_backward_[s]) return false;
    const int64_t gate = gate_[stage_dim_[s]];
    return gate < 0 || bin_nonzero_[(j * dp_ + r) * d_ + gate] > 0;
  }

  double stage_load(int64_t j, int64_t c, int64_t r) const {
    const int64_t at = is_mb_dim_[c] ? j * d_ + c : (j * dp_ + r) * d_ + c;
    const bool has_work = is_mb_dim_[c] ? mb_nonzero_[at] > 0 : bin_nonzero_[at] > 0;
    if (!has_work) return 0.0;
    if (replicas_[c] > 1) return split_s_[at] + constant_[c];
    return std::max(0.0, is_mb_dim_[c] ? mb_load_[at] : bin_load_[at]) + constant_[c];
  }

  // The load a capacity bounds: the bin's, or its microbatch's for microbatch dims (per
  // replica for a replicated one).
  double unit_load(int64_t b, int64_t c) const {
    return is_mb_dim_[c] ? mb_load_[(b / dp_) * d_ + c] / static_cast<double>(replicas_[c])
                         : bin_load_[b * d_ + c];
  }

  bool fits(int64_t b) const {
    for (int64_t c = 0; c < d_; ++c) {
      if (unit_load(b, c) > cap_[c] * (1 + kCapacityTolerance)) return false;
    }
    return true;
  }

  void add(int64_t i, int64_t b, double sign) {
    const int64_t step = sign > 0 ? 1 : -1;
    for (int64_t c = 0; c < d_; ++c) {
      const double cost = costs_[i * d_ + c];
      bin_load_[b * d_ + c] += sign * cost;
      mb_load_[(b / dp_) * d_ + c] += sign * cost;
      if (cost > 0.0) {
        bin_nonzero_[b * d_ + c] += step;
        mb_nonzero_[(b / dp_) * d_ + c] += step;
      }
    }
    count_[b] += step;
    if (!split_dims_.empty()) {  // keep the microbatch's members ascending
      std::vector<int64_t>& m = members_[b / dp_];
      const auto at = std::lower_bound(m.begin(), m.end(), i);
      if (step > 0) {
        m.insert(at, i);
      } else {
        m.erase(at);
      }
      dirty_[b / dp_] = 1;
    }
  }

  void move(int64_t i, int64_t to) {
    add(i, assignment_[i], -1.0);
    add(i, to, +1.0);
    assignment_[i] = to;
  }

  // Slowest replica's load of module c in microbatch j.
  double pace(int64_t j, int64_t c) const {
    double v = 0.0;
    for (int64_t r = 0; r < (is_mb_dim_[c] ? 1 : dp_); ++r) v = std::max(v, stage_load(j, c, r));
    return v;
  }

  void choose_order(Objective& best) {
    if (m_ < 2) return;
    refresh_splits();
    std::vector<double> first(m_), last(m_);
    for (int64_t j = 0; j < m_; ++j) {
      first[j] = pace(j, 0);
      last[j] = pace(j, d_ - 1);
    }
    std::vector<std::vector<int64_t>> candidates;
    // Lightest first-module microbatch first (the later stages wait for it), lightest
    // last-module microbatch last (the earlier stages wait for its backward).
    std::vector<int64_t> ends(order_);
    const auto lightest_first = std::min_element(
        ends.begin(), ends.end(), [&](int64_t x, int64_t y) { return first[x] < first[y]; });
    std::iter_swap(ends.begin(), lightest_first);
    const auto lightest_last = std::min_element(
        ends.begin() + 1, ends.end(), [&](int64_t x, int64_t y) { return last[x] < last[y]; });
    std::iter_swap(ends.end() - 1, lightest_last);
    candidates.push_back(ends);
    if (d_ >= 2) {  // Johnson: first < last by increasing first, then by decreasing last
      std::vector<int64_t> head, tail;
      for (int64_t j = 0; j < m_; ++j) (first[j] < last[j] ? head : tail).push_back(j);
      std::stable_sort(head.begin(), head.end(),
                       [&](int64_t x, int64_t y) { return first[x] < first[y]; });
      std::stable_sort(tail.begin(), tail.end(),
                       [&](int64_t x, int64_t y) { return last[x] > last[y]; });
      head.insert(head.end(), tail.begin(), tail.end());
      candidates.push_back(head);
    }
    std::vector<int64_t> kept(order_);
    for (const auto& candidate : candidates) {
      order_ = candidate;
      const Objective trial = evaluate();
      if (trial.better_than(best)) {
        best = trial;
        kept = candidate;
      }
    }
    order_ = kept;
  }

  const double* costs_;
  int64_t n_, d_, m_, dp_, b_;
  std::vector<double> forward_fraction_, constant_;
  // Split backwards: per stage (W's share, W's extra per unit of load); per cell.
  std::vector<double> weight_share_, weight_extra_, weight_;
  std::vector<char> is_mb_dim_;
  std::vector<int64_t> stage_dim_;       // per virtual stage: its dimension (module)
  std::vector<double> stage_share_;      // per virtual stage: its share of a stage's load
  std::vector<uint8_t> stage_backward_;  // per virtual stage: whether it runs a backward
  std::vector<uint8_t> gradient_links_;  // per boundary: whether a gradient crosses it
  bool cut_links_ = false;
  std::vector<int64_t> gate_;  // per dimension: backward_gate
  int64_t num_stages_ = 0;
  bool replicas_differ_ = false;
  std::vector<int64_t> assignment_, order_;
  std::vector<double> bin_load_, mb_load_;
  std::vector<int64_t> bin_nonzero_, mb_nonzero_;  // samples with work, per (bin, dim)
  std::vector<int64_t> count_;
  // Replicated dimensions (replicas_[c] > 1): each microbatch's members (ascending), its
  // split's makespan per dimension, and whether the members changed since it was split.
  std::vector<int64_t> replicas_, split_dims_;
  const std::vector<int64_t>& units_;
  std::vector<std::vector<int64_t>> members_;
  std::vector<double> split_s_, split_costs_;
  std::vector<int64_t> split_units_;
  std::vector<char> dirty_;
  std::vector<double> cap_, latency_, forward_, backward_;
  detail::ReplicaSimulator sim_;
  SplitMix64 rng_;
  int64_t evaluations_ = 0;
};

int64_t default_work_budget(int64_t num_items, int64_t cost_per_evaluation) {
  // About 200 candidates per sample, between 1 ms and 50 ms of search.
  const double units = 200.0 * static_cast<double>(num_items) * cost_per_evaluation;
  return static_cast<int64_t>(std::clamp(units, 1.0 * kWorkUnitsPerMs, 50.0 * kWorkUnitsPerMs));
}

}  // namespace

void validate_pipeline_schedule_input(const double* costs, int64_t n, int64_t d,
                                      const std::vector<int64_t>& start,
                                      const PipelineScheduleOptions& o) {
  if (!o.replicas.empty() && static_cast<int64_t>(o.replicas.size()) == d &&
      std::any_of(o.replicas.begin(), o.replicas.end(), [](int64_t r) { return r > 1; })) {
    // Balance's view: a replicated dimension's cost per replica.
    std::vector<double> scaled(costs, costs + n * d);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < d; ++c)
        scaled[i * d + c] /= static_cast<double>(std::max<int64_t>(1, o.replicas[c]));
    }
    validate_balance_input(scaled.data(), n, d, balance_options(o));
  } else {
    validate_balance_input(costs, n, d, balance_options(o));
  }
  check_length("stages", o.stages, d);
  if (!o.chunks.empty()) check_length("chunks", o.chunks, d);
  int64_t total_stages = 0;  // virtual stages: stages x chunks
  for (size_t c = 0; c < o.stages.size(); ++c) {
    if (o.stages[c] < 1 || o.stages[c] > kMaxStages) {
      throw InvalidArgument("stages[" + std::to_string(c) + "] must be in [1, " +
                            std::to_string(kMaxStages) + "], got " + std::to_string(o.stages[c]));
    }
    const int64_t chunks = chunks_of(o, int64_t(c));
    if (chunks < 1 || chunks > kMaxStages) {
      throw InvalidArgument("chunks[" + std::to_string(c) + "] must be in [1, " +
                            std::to_string(kMaxStages) + "], got " + std::to_string(chunks));
    }
    if (chunks > 1 && c + 1 != o.stages.size()) {
      throw InvalidArgument("chunks[" + std::to_string(c) + "]=" + std::to_string(chunks) +
                            ": only the last module (the LLM) is interleaved");
    }
    if (chunks > 1 && o.num_microbatches % o.stages[c] != 0) {
      throw InvalidArgument("chunks[" + std::to_string(c) + "]=" + std::to_string(chunks) +
                            " (interleaved 1F1B) needs num_microbatches to be a multiple of "
                            "stages[" +
                            std::to_string(c) + "]=" + std::to_string(o.stages[c]) + ", got " +
                            std::to_string(o.num_microbatches));
    }
    if (o.stages[c] > kMaxStages / chunks) {
      throw InvalidArgument("stages x chunks of dimension " + std::to_string(c) + " is more than " +
                            std::to_string(kMaxStages));
    }
    total_stages += o.stages[c] * chunks;
  }
  if (total_stages > kMaxStages) {
    throw InvalidArgument("stages sum to " + std::to_string(total_stages) + ", more than " +
                          std::to_string(kMaxStages));
  }
  if (total_stages * o.num_microbatches > kMaxStageMicrobatches) {
    throw InvalidArgument("stages (" + std::to_string(total_stages) +
                          " in all) x num_microbatches (" + std::to_string(o.num_microbatches) +
                          ") is more than the " + std::to_string(kMaxStageMicrobatches) +
                          " stage-microbatch pairs one simulation may hold");
  }
  if (o.work_budget < -1) {
    throw InvalidArgument("work_budget must be >= 0 (or -1: default), got " +
                          std::to_string(o.work_budget));
  }
  if (std::isnan(o.time_limit_s)) {
    throw InvalidArgument("time_limit_s must be a number (negative: none), got nan");
  }
  check_per_dimension("forward_fraction", o.forward_fraction, d, true);
  if (!o.backward_from_stage.empty()) {
    check_length("backward_from_stage", o.backward_from_stage, d);
    for (int64_t c = 0; c < d; ++c) {
      const int64_t v = o.backward_from_stage[size_t(c)];
      const int64_t virtual_stages = o.stages[c] * chunks_of(o, c);
      if (v < 0 || v > virtual_stages) {
        throw InvalidArgument("backward_from_stage[" + std::to_string(c) + "] must be in [0, " +
                              std::to_string(virtual_stages) + "] (its stages x chunks), got " +
                              std::to_string(v));
      }
    }
  }
  if (!o.weight_fraction.empty())
    check_per_dimension("weight_fraction", o.weight_fraction, d, true);
  if (!o.last_stage_weight_extra.empty()) {
    check_per_dimension("last_stage_weight_extra", o.last_stage_weight_extra, d, false);
  }
  if (!o.order.empty()) program_of(o);  // a registered order that runs these stages
  if (!o.backward_gate.empty()) {
    check_length("backward_gate", o.backward_gate, d);
    for (int64_t c = 0; c < d; ++c) {
      const int64_t g = o.backward_gate[size_t(c)];
      if (g != -1 && (g < 0 || g >= d || g == c)) {
        throw InvalidArgument("backward_gate[" + std::to_string(c) +
                              "] must be -1 or another dimension in [0, " + std::to_string(d) +
                              "), got " + std::to_string(g));
      }
    }
  }
  if (!o.microbatch_constant_s.empty()) {
    check_per_dimension("microbatch_constant_s", o.microbatch_constant_s, d, false);
  }
  if (!(std::isfinite(o.link_latency_s) && o.link_latency_s >= 0.0)) {
    throw InvalidArgument("link_latency_s must be finite and >= 0, got " + fmt(o.link_latency_s));
  }
  // No simulated step may overflow: every stage's loads, constants and links of a step
  // add up to at most this (it would turn times into inf - inf = nan).
  double step_bound = 2.0 * double(total_stages) * double(o.num_microbatches) * o.link_latency_s;
  for (int64_t c = 0; c < d; ++c) {
    double column = 0.0;
    for (int64_t i = 0; i < n; ++i) column += costs[i * d + c];
    const double constant = o.microbatch_constant_s.empty() ? 0.0 : o.microbatch_constant_s[c];
    step_bound += column + double(o.num_microbatches) * constant;
  }
  if (!(step_bound <= kMaxStepSeconds)) {
    throw InvalidArgument("costs, microbatch_constant_s and link_latency_s add up to " +
                          fmt(step_bound) + " s per step, more than " + fmt(kMaxStepSeconds) +
                          " (the simulation would overflow)");
  }
  if (!o.replicas.empty()) {
    check_length("replicas", o.replicas, d);
    std::vector<char> mb_dim(d, 0);
    for (int64_t c : o.microbatch_dims) mb_dim[c] = 1;
    bool any = false;
    for (int64_t c = 0; c < d; ++c) {
      const int64_t r = o.replicas[c];
      if (r < 1) {
        throw InvalidArgument("replicas[" + std::to_string(c) + "] must be >= 1, got " +
                              std::to_string(r));
      }
      if (r > 1 && !mb_dim[c]) {
        throw InvalidArgument("replicas[" + std::to_string(c) + "]=" + std::to_string(r) +
                              " > 1 needs dimension " + std::to_string(c) +
                              " in microbatch_dims (its replicas share each microbatch)");
      }
      any = any || r > 1;
    }
    if (any) {
      if (static_cast<int64_t>(o.units.size()) != n) {
        throw InvalidArgument("units has " + std::to_string(o.units.size()) +
                              " entries, expected one per sample (" + std::to_string(n) +
                              ") for the replicated dimensions");
      }
      for (int64_t i = 0; i < n; ++i) {
        if (o.units[i] < 0) {
          throw InvalidArgument("units[" + std::to_string(i) + "]=" + std::to_string(o.units[i]) +
                                " must be >= 0");
        }
        for (int64_t c = 0; c < d; ++c) {
          if (o.replicas[c] > 1 && o.units[i] == 0 && costs[i * d + c] > 0.0) {
            throw InvalidArgument("costs[" + std::to_string(i) + ", " + std::to_string(c) +
                                  "]=" + fmt(costs[i * d + c]) + " but units[" + std::to_string(i) +
                                  "]=0: a replicated dimension's work needs visual units");
          }
        }
      }
    }
  }
  if (!(o.max_growth >= 1.0)) {
    throw InvalidArgument("max_growth must be >= 1 (inf allowed), got " + fmt(o.max_growth));
  }
  const int64_t bins = o.num_microbatches * o.dp_size;
  if (static_cast<int64_t>(start.size()) != n) {
    throw InvalidArgument("assignment has " + std::to_string(start.size()) +
                          " entries, expected one per sample (" + std::to_string(n) + ")");
  }
  std::vector<int64_t> count(bins, 0);
  std::vector<double> load(bins * d, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = start[i];
    if (b < 0 || b >= bins) {
      throw InvalidArgument("assignment[" + std::to_string(i) + "] = " + std::to_string(b) +
                            " is not a bin in [0, " + std::to_string(bins) + ")");
    }
    ++count[b];
    for (int64_t c = 0; c < d; ++c) load[b * d + c] += costs[i * d + c];
  }
  for (int64_t b = 0; b < bins; ++b) {
    if (count[b] == 0) {
      throw InvalidArgument("assignment leaves bin " + std::to_string(b) +
                            " empty (every bin needs a sample)");
    }
  }
  if (o.capacity.empty()) return;
  std::vector<char> is_mb_dim(d, 0);
  for (int64_t c : o.microbatch_dims) is_mb_dim[c] = 1;
  for (int64_t b = 0; b < bins; ++b) {
    for (int64_t c = 0; c < d; ++c) {
      double v = load[b * d + c];
      if (is_mb_dim[c]) {  // the whole microbatch's load (per replica)
        v = 0.0;
        const int64_t j = b / o.dp_size;
        for (int64_t r = 0; r < o.dp_size; ++r) v += load[(j * o.dp_size + r) * d + c];
        v /= static_cast<double>(replicas_of(o, c));
      }
      if (v > o.capacity[c] * (1 + kCapacityTolerance)) {
        throw InvalidArgument("assignment puts " + fmt(v) + " of dimension " + std::to_string(c) +
                              " in bin " + std::to_string(b) + ", over capacity[" +
                              std::to_string(c) + "] = " + fmt(o.capacity[c]));
      }
    }
  }
}

PipelineScheduleResult pipeline_schedule(const double* costs, int64_t n, int64_t d,
                                         const std::vector<int64_t>& start,
                                         const PipelineScheduleOptions& o) {
  validate_pipeline_schedule_input(costs, n, d, start, o);
  Search search(costs, n, d, start, o);
  const int64_t budget =
      o.work_budget >= 0 ? o.work_budget : default_work_budget(n, search.cost_per_evaluation());
  return search.run(budget, o.time_limit_s, o.interrupted);
}

double simulated_step_time(const double* costs, int64_t n, int64_t d,
                           const std::vector<int64_t>& assignment,
                           const PipelineScheduleOptions& o) {
  PipelineScheduleOptions unbounded = o;
  unbounded.capacity.clear();  // a step time exists for any assignment
  validate_pipeline_schedule_input(costs, n, d, assignment, unbounded);
  Search search(costs, n, d, assignment, unbounded);
  return search.evaluate().step_s;
}

int64_t pipeline_work_budget_for_ms(double time_budget_ms) {
  if (!(time_budget_ms >= 0) || !std::isfinite(time_budget_ms)) {
    throw InvalidArgument("time_budget_ms must be a finite number >= 0, got " +
                          fmt(time_budget_ms));
  }
  return static_cast<int64_t>(std::min(time_budget_ms * kWorkUnitsPerMs, 1e18));
}

}  // namespace dflop
