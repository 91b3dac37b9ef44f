// Batch balancing: a vector-LPT constructive start followed by an iterated local search
// (best-improvement moves and swaps out of the critical bin, random perturbations with
// undo when they do not pay off). Work is counted, not timed, so results are reproducible.
#include "dflop/balance.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "dflop/errors.hpp"
#include "format.hpp"
#include "rng.hpp"

namespace dflop {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Relative slack for "strictly below the makespan" and for capacity checks, so that
// rounding in incrementally kept sums never decides a comparison.
constexpr double kRelEps = 1e-12;
// Relative tolerance of capacity checks: loads are kept incrementally, so they may drift
// from the exact sums by a few ulps per update.
constexpr double kCapRelTol = 1e-9;
// Work units per millisecond for work_budget_for_ms: about one core of a current x86 server
// (measured with benchmarks/bench_schedule.py; D = 2).
constexpr double kWorkUnitsPerMs = 75000.0;
// Time limits from here on (about 30 years) mean none (and would overflow the clock).
constexpr double kNoTimeLimitS = 1e9;
// Work units between polls of the InterruptCheck (a fraction of a millisecond).
constexpr int64_t kWorkPerInterruptPoll = 15000;
// The search stops once the makespan is this close to the lower bound (relative): far
// below the accuracy of any cost model, and it saves the rest of the budget.
constexpr double kGapTolerance = 1e-6;
// Partner bins examined per critical bin; bounds the cost of one search step at large B.
constexpr int64_t kMaxPartners = 48;
// Once an improving op is found, partners scanned before taking the best found so far.
constexpr int64_t kPartnersAfterFound = 1;
// Improving moves between refreshes of the partner ranking (an O(B) step).
constexpr int64_t kMovesPerPartnerRefresh = 8;
// Perturbations in a row without a better makespan before the search gives up.
constexpr int64_t kMaxFruitlessPerturbations = 4000;

std::string fmt(double v) { return detail::format_number(v); }

// Array-backed tournament tree returning the index with the smallest key (lowest index
// on ties), with O(log n) updates.
class MinTree {
 public:
  explicit MinTree(int64_t n) : n_(n) {
    size_ = 1;
    while (size_ < n) size_ <<= 1;
    key_.assign(2 * size_, kInf);
    idx_.assign(2 * size_, -1);
    for (int64_t i = 0; i < n; ++i) {
      key_[size_ + i] = 0.0;
      idx_[size_ + i] = i;
    }
    for (int64_t node = size_ - 1; node >= 1; --node) pull(node);
  }
  void set(int64_t i, double key) {
    int64_t node = size_ + i;
    key_[node] = key;
    for (node >>= 1; node >= 1; node >>= 1) pull(node);
  }
  int64_t argmin() const { return idx_[1]; }
  // Index with the smallest key in [lo, hi) (lowest index on ties), in O(log n).
  int64_t argmin_range(int64_t lo, int64_t hi) const {
    double best_key = kInf;
    int64_t best = lo;
    auto consider = [&](int64_t node) {
      if (key_[node] < best_key || (key_[node] == best_key && idx_[node] < best))
        best_key = key_[node], best = idx_[node];
    };
    for (int64_t l = lo + size_, r = hi + size_; l < r; l >>= 1, r >>= 1) {
      if (l & 1) consider(l++);
      if (r & 1) consider(--r);
    }
    return best;
  }
  int64_t size() const { return n_; }

 private:
  void pull(int64_t node) {
    const int64_t l = 2 * node, r = 2 * node + 1;
    const bool left = key_[l] <= key_[r];
    key_[node] = left ? key_[l] : key_[r];
    idx_[node] = left ? idx_[l] : idx_[r];
  }
  int64_t n_, size_;
  std::vector<double> key_;
  std::vector<int64_t> idx_;
};

// Item indices by decreasing largest share of a finite, positive bound (row-major n x d
// values; ties in index order): first-fit decreasing's order.
std::vector<int64_t> by_decreasing_share(const double* x, int64_t n, int64_t d,
                                         const std::vector<double>& bounds) {
  std::vector<double> key(n, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < d; ++k)
      if (std::isfinite(bounds[k]) && bounds[k] > 0)
        key[i] = std::max(key[i], x[i * d + k] / bounds[k]);
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return key[a] > key[b]; });
  return order;
}

struct Problem {
  const double* costs;
  int64_t n, d, m, p, b;
  std::vector<char> is_group;  // per dim: load summed per microbatch
  std::vector<char> is_limit;  // per dim: a limit only (never balanced, not in the makespan)
  std::vector<double> cap;     // per dim, +inf where unbounded
  bool has_caps = false;       // some capacity is finite
  std::vector<double> total;   // per dim
  double lower_bound = 0.0;
  double overflow_base = 0.0;  // every value above this is a capacity violation
  double c(int64_t i, int64_t k) const { return costs[i * d + k]; }
  // How a message names dimension k: a limit column by its own index.
  std::string cap_name(int64_t k) const {
    const int64_t first_limit = d - std::count(is_limit.begin(), is_limit.end(), 1);
    return k >= first_limit ? "limits[" + std::to_string(k - first_limit) + "]"
                            : "capacity[" + std::to_string(k) + "]";
  }
};

class Solver {
 public:
  Solver(const Problem& pr, uint64_t seed, int64_t budget, double time_limit_s,
         const InterruptCheck& interrupted)
      : pr_(pr), rng_(seed), budget_(budget), interrupt_(interrupted, kWorkPerInterruptPoll) {
    if (time_limit_s >= 0 && time_limit_s < kNoTimeLimitS) {  // beyond: no limit
      has_deadline_ = true;
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(time_limit_s));
    }
  }

  BalanceResult run() {
    const int64_t budget = budget_;
    BalanceResult res;
    res.stats.work_budget = budget;
    // With capacities, three starts in turn, each only if the one before ended over a
    // capacity: (1) the balanced start built within the capacities, half the budget (and
    // the rest once it fits); (2) a first-fit-decreasing packing, so a bin count that FFD
    // fills is never reported infeasible, half the budget; (3) balance ignoring the
    // capacities, then repair. A call does at most 2x its budget's work (plus FFD's one
    // O(N B D) pass), feasible or not.
    if (pr_.has_caps) budget_ = budget / 2;
    construct();
    res.stats.initial_makespan = makespan();
    search();
    if (pr_.has_caps) fall_back_within_capacities(res, budget);
    finish(res);
    return res;
  }

 private:
  // Starts (1)'s rest, (2) and (3) of run(), each only if the one before ended over a
  // capacity.
  void fall_back_within_capacities(BalanceResult& res, int64_t budget) {
    if (makespan() < pr_.overflow_base) {
      budget_ = budget;
      search();
    } else if (first_fit_decreasing()) {
      res.stats.seeded_by_first_fit = true;
      budget_ = work_ + budget / 2;
      search();
    } else {
      enforce_caps_ = false;
      construct();
      budget_ = work_ + budget / 2;
      search();
      enforce_caps_ = true;
      budget_ = work_ + budget / 4;
      search();
    }
  }

  // ---- state -------------------------------------------------------------------------
  const Problem& pr_;
  SplitMix64 rng_;
  int64_t budget_;
  int64_t work_ = 0;
  using Clock = std::chrono::steady_clock;
  bool has_deadline_ = false, deadline_passed_ = false;
  Clock::time_point deadline_;
  InterruptPoller interrupt_;
  int64_t improving_moves_ = 0, perturbations_ = 0;
  std::vector<int64_t> bin_of_;
  std::vector<std::vector<int64_t>> members_;
  std::vector<int64_t> pos_;  // index of an item inside members_[bin_of_[item]]
  std::vector<double> bin_load_, group_load_;
  // Undo log of (item, previous bin) for reverting a perturbation.
  bool has_group_dims_ = false;
  bool stale_partners_ = true;
  bool enforce_caps_ = true;
  bool logging_ = false;
  std::vector<std::pair<int64_t, int64_t>> undo_;

  // The work budget, or the optional wall-clock deadline once it has passed.
  bool out_of_budget() {
    if (work_ >= budget_) return true;
    interrupt_.poll(work_);
    if (has_deadline_ && !deadline_passed_) deadline_passed_ = Clock::now() >= deadline_;
    return deadline_passed_;
  }

  int64_t group(int64_t bin) const { return bin / pr_.p; }
  double load(int64_t bin, int64_t k) const {
    return pr_.is_group[k] ? group_load_[group(bin) * pr_.d + k] : bin_load_[bin * pr_.d + k];
  }
  // A load as the search sees it: itself, or above overflow_base when over capacity, so
  // that repairing capacity always comes before shortening the makespan.
  double value(double v, int64_t k) const {
    const double cap = pr_.cap[k];
    const double within = pr_.is_limit[k] ? 0.0 : v;  // a limit counts only when broken
    if (!enforce_caps_ || v <= cap * (1 + kCapRelTol)) return within;
    return pr_.overflow_base + (v - cap);
  }
  double height(int64_t bin) const {
    double h = 0.0;
    for (int64_t k = 0; k < pr_.d; ++k) h = std::max(h, value(load(bin, k), k));
    return h;
  }
  double makespan() const {
    double h = 0.0;
    for (int64_t b = 0; b < pr_.b; ++b) h = std::max(h, height(b));
    return h;
  }

  void place(int64_t i, int64_t bin) {
    bin_of_[i] = bin;
    pos_[i] = static_cast<int64_t>(members_[bin].size());
    members_[bin].push_back(i);
    for (int64_t k = 0; k < pr_.d; ++k) {
      bin_load_[bin * pr_.d + k] += pr_.c(i, k);
      group_load_[group(bin) * pr_.d + k] += pr_.c(i, k);
    }
  }
  void unplace(int64_t i) {
    const int64_t bin = bin_of_[i];
    auto& mem = members_[bin];
    const int64_t last = mem.back();
    mem[pos_[i]] = last;
    pos_[last] = pos_[i];
    mem.pop_back();
    for (int64_t k = 0; k < pr_.d; ++k) {
      bin_load_[bin * pr_.d + k] -= pr_.c(i, k);
      group_load_[group(bin) * pr_.d + k] -= pr_.c(i, k);
    }
  }
  void relocate(int64_t i, int64_t bin) {
    if (logging_) undo_.emplace_back(i, bin_of_[i]);
    unplace(i);
    place(i, bin);
  }

  // ---- constructive start: vector LPT ------------------------------------------------
  // Items in decreasing normalised size, each into the bin where its normalised height is
  // smallest. Candidate bins come from min-trees (one per dimension and one combined), so
  // a step costs O(D log B) instead of O(B D).
  // Loads are compared in absolute terms (the makespan is absolute): a dimension with
  // little total load is only balanced as far as it can become the largest.
  double norm(double v) const { return pr_.lower_bound > 0 ? v / pr_.lower_bound : 0.0; }
  // Normalised height of `bin` if item i were added; lexicographic (max, sum).
  std::pair<double, double> score(int64_t bin, int64_t i) const {
    double mx = 0.0, sum = 0.0;
    for (int64_t k = 0; k < pr_.d; ++k) {
      const double after = load(bin, k) + pr_.c(i, k);
      const double v = value(after, k);
      if (pr_.is_limit[k]) {
        if (v >= pr_.overflow_base) mx = std::max(mx, v);
        continue;
      }
      const double nv = v >= pr_.overflow_base ? v : norm(after);
      mx = std::max(mx, nv);
      sum += norm(after);
    }
    return {mx, sum};
  }
  double bin_key(int64_t bin, int64_t only_dim) const {  // per-bin dims only
    double key = 0.0;
    for (int64_t k = 0; k < pr_.d; ++k)
      if (!pr_.is_group[k] && !pr_.is_limit[k] && (only_dim < 0 || only_dim == k))
        key = std::max(key, norm(bin_load_[bin * pr_.d + k]));
    return key;
  }
  double group_key(int64_t g, int64_t only_dim) const {  // microbatch dims only
    double key = 0.0;
    for (int64_t k = 0; k < pr_.d; ++k)
      if (pr_.is_group[k] && !pr_.is_limit[k] && (only_dim < 0 || only_dim == k))
        key = std::max(key, norm(group_load_[g * pr_.d + k]));
    return key;
  }

  void reset() {
    const int64_t n = pr_.n, d = pr_.d, b = pr_.b;
    for (int64_t k = 0; k < d; ++k) has_group_dims_ = has_group_dims_ || pr_.is_group[k];
    bin_of_.assign(n, -1);
    pos_.assign(n, -1);
    members_.assign(b, {});
    bin_load_.assign(b * d, 0.0);
    group_load_.assign(pr_.m * d, 0.0);
  }

  // ---- first-fit decreasing: a packing within the capacities -------------------------
  // Items by decreasing largest share of a capacity, each into the first bin it fits;
  // then every empty bin takes an item that fits it from a bin holding two or more.
  // Returns false (state undefined) when an item fits no bin.
  bool fits(int64_t bin, int64_t i) const {
    for (int64_t k = 0; k < pr_.d; ++k)
      if (load(bin, k) + pr_.c(i, k) > pr_.cap[k] * (1 + kCapRelTol)) return false;
    return true;
  }
  bool first_fit_decreasing() {
    const int64_t n = pr_.n, d = pr_.d, b = pr_.b;
    reset();
    for (int64_t i : by_decreasing_share(pr_.costs, n, d, pr_.cap)) {
      int64_t bin = 0;
      while (bin < b && !fits(bin, i)) ++bin;
      work_ += (bin + 1) * d;
      if (bin == b) return false;
      place(i, bin);
    }
    for (int64_t empty = 0; empty < b; ++empty) {
      if (!members_[empty].empty()) continue;
      bool filled = false;
      for (int64_t donor = 0; donor < b && !filled; ++donor) {
        if (members_[donor].size() < 2) continue;
        for (int64_t j : std::vector<int64_t>(members_[donor])) {
          unplace(j);
          if (fits(empty, j)) {
            place(j, empty);
            filled = true;
            break;
          }
          place(j, donor);
        }
        work_ += static_cast<int64_t>(members_[donor].size()) * d;
      }
      if (!filled) return false;
    }
    return true;
  }

  void construct() {
    const int64_t n = pr_.n, d = pr_.d, b = pr_.b;
    reset();

    std::vector<double> size_key(n), size_sum(n);
    for (int64_t i = 0; i < n; ++i) {
      double mx = 0.0, sum = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        if (pr_.is_limit[k]) continue;
        mx = std::max(mx, norm(pr_.c(i, k)));
        sum += norm(pr_.c(i, k));
      }
      size_key[i] = mx;
      size_sum[i] = sum;
    }
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
      if (size_key[a] != size_key[c]) return size_key[a] > size_key[c];
      if (size_sum[a] != size_sum[c]) return size_sum[a] > size_sum[c];
      return a < c;
    });

    // Trees: combined + per dimension, separately for per-bin and microbatch dims.
    std::vector<int64_t> bin_dims, group_dims;
    for (int64_t k = 0; k < d; ++k)
      if (!pr_.is_limit[k]) (pr_.is_group[k] ? group_dims : bin_dims).push_back(k);
    std::vector<MinTree> bin_trees, group_trees;
    std::vector<int64_t> bin_tree_dim, group_tree_dim;
    if (!bin_dims.empty()) {
      bin_trees.emplace_back(b);
      bin_tree_dim.push_back(-1);
      if (bin_dims.size() > 1)
        for (int64_t k : bin_dims) bin_trees.emplace_back(b), bin_tree_dim.push_back(k);
    }
    if (!group_dims.empty()) {
      group_trees.emplace_back(pr_.m);
      group_tree_dim.push_back(-1);
      if (group_dims.size() > 1)
        for (int64_t k : group_dims) group_trees.emplace_back(pr_.m), group_tree_dim.push_back(k);
    }

    int64_t next_empty = 0, num_empty = b;
    // Once only as many items remain as bins are empty, each must open an empty bin. With
    // microbatch dims the empty bins differ by their group's load: pick the lightest group
    // that still has one (all empty bins of a group are alike).
    std::vector<int64_t> empty_in_group(pr_.m, pr_.p), next_empty_in_group(pr_.m, 0);
    MinTree open_groups(pr_.m);
    std::vector<int64_t> candidates;
    for (int64_t pos = 0; pos < n; ++pos) {
      const int64_t i = order[pos];
      const int64_t remaining = n - pos;
      int64_t chosen = next_empty < b ? next_empty : 0;
      while (next_empty < b && !members_[next_empty].empty()) ++next_empty;
      if (remaining <= num_empty) {
        const int64_t g = open_groups.argmin();
        int64_t& k = next_empty_in_group[g];
        while (!members_[g * pr_.p + k].empty()) ++k;
        chosen = g * pr_.p + k;
      } else {
        candidates.clear();
        for (auto& t : bin_trees) candidates.push_back(t.argmin());
        for (auto& t : group_trees) {
          // The lightest microbatch's lightest bin (by per-bin dims; bin_trees[0] is keyed
          // by all of them).
          const int64_t g = t.argmin();
          candidates.push_back(bin_trees.empty()
                                   ? g * pr_.p
                                   : bin_trees[0].argmin_range(g * pr_.p, (g + 1) * pr_.p));
        }
        if (next_empty < b) candidates.push_back(next_empty);
        std::pair<double, double> best_score{kInf, kInf};
        for (int64_t bin : candidates) {
          const auto s = score(bin, i);
          if (s < best_score || (s == best_score && bin < chosen)) best_score = s, chosen = bin;
        }
        if (best_score.first >= pr_.overflow_base) {  // capacity: look at every bin
          for (int64_t bin = 0; bin < b; ++bin) {
            const auto s = score(bin, i);
            if (s < best_score) best_score = s, chosen = bin;
          }
        }
      }
      const int64_t g_chosen = group(chosen);
      if (members_[chosen].empty()) --num_empty, --empty_in_group[g_chosen];
      place(i, chosen);
      open_groups.set(g_chosen, empty_in_group[g_chosen] > 0 ? group_key(g_chosen, -1) : kInf);
      for (size_t t = 0; t < bin_trees.size(); ++t)
        bin_trees[t].set(chosen, bin_key(chosen, bin_tree_dim[t]));
      for (size_t t = 0; t < group_trees.size(); ++t)
        group_trees[t].set(group(chosen), group_key(group(chosen), group_tree_dim[t]));
    }
  }

  // ---- improving search --------------------------------------------------------------
  struct Op {
    int64_t i = -1, j = -1;  // j < 0: move i to `to`; else swap i and j
    int64_t to = -1;
    double worst = kInf;  // largest new value among the slots the op touches
  };

  // Largest new value among the slots touched by moving item i from bin x to bin y and
  // item j (if any) from y to x; `stop` allows an early exit once it cannot win.
  double evaluate(int64_t x, int64_t y, int64_t i, int64_t j, double stop) const {
    const int64_t d = pr_.d;
    const bool same_group = group(x) == group(y);
    double worst = 0.0;
    for (int64_t k = 0; k < d; ++k) {
      const double delta = pr_.c(i, k) - (j >= 0 ? pr_.c(j, k) : 0.0);
      double lx, ly;
      if (pr_.is_group[k]) {
        if (same_group) continue;
        lx = group_load_[group(x) * d + k];
        ly = group_load_[group(y) * d + k];
      } else {
        lx = bin_load_[x * d + k];
        ly = bin_load_[y * d + k];
      }
      worst = std::max(worst, std::max(value(lx - delta, k), value(ly + delta, k)));
      if (worst >= stop) return worst;
    }
    return worst;
  }

  // Best op that takes load out of the critical slot of bin `a` with every touched slot
  // ending strictly below `limit`. Sources: bin a itself if one of its per-bin dims is
  // critical, else every bin of its microbatch (then partners lie outside it).
  Op best_op(int64_t a, double limit, const std::vector<int64_t>& partners_by_height) {
    bool bin_critical = false;
    for (int64_t k = 0; k < pr_.d; ++k)
      if (!pr_.is_group[k] && value(load(a, k), k) >= limit) bin_critical = true;
    const int64_t ga = group(a);
    Op best;
    best.worst = limit;
    auto scan_source = [&](int64_t x) {
      const auto& from = members_[x];
      int64_t partners = 0;
      for (int64_t y : partners_by_height) {
        if (y == x || (!bin_critical && group(y) == ga)) continue;
        if (++partners > kMaxPartners || (best.i >= 0 && partners > kPartnersAfterFound)) break;
        const auto& to = members_[y];
        for (int64_t i : from) {
          if (from.size() > 1) {
            const double w = evaluate(x, y, i, -1, best.worst);
            if (w < best.worst) best = {i, -1, y, w};
          }
          for (int64_t j : to) {
            const double w = evaluate(x, y, i, j, best.worst);
            if (w < best.worst) best = {i, j, y, w};
          }
        }
        work_ += static_cast<int64_t>(from.size() * (to.size() + 1));
      }
    };
    if (bin_critical) {
      scan_source(a);
    } else {
      for (int64_t x = ga * pr_.p; x < (ga + 1) * pr_.p; ++x) scan_source(x);
    }
    return best;
  }

  void apply(const Op& op) {
    const int64_t from = bin_of_[op.i];
    relocate(op.i, op.to);
    if (op.j >= 0) relocate(op.j, from);
  }

  // Bins by increasing height; partners are taken from the front.
  // Bins by increasing height (h); partners are taken from the front. Enough are kept for
  // the widest scan: sources of a critical microbatch skip the p bins of their own group.
  void partners_by_height(const std::vector<double>& h, std::vector<int64_t>& out) {
    const int64_t b = pr_.b;
    out.resize(b);
    std::iota(out.begin(), out.end(), 0);
    auto by_height = [&](int64_t x, int64_t y) { return h[x] != h[y] ? h[x] < h[y] : x < y; };
    const int64_t keep = std::min<int64_t>(b, kMaxPartners + 1 + (has_group_dims_ ? pr_.p : 0));
    std::nth_element(out.begin(), out.begin() + (keep - 1), out.end(), by_height);
    std::sort(out.begin(), out.begin() + keep, by_height);
    out.resize(keep);
    work_ += b / 2 + keep * 4;
  }

  // Descends to a local optimum: repeatedly relieves a critical bin. Returns the makespan.
  double descend() {
    std::vector<int64_t> partners, critical;
    std::vector<double> h(pr_.b);
    int64_t moves_since_refresh = 0;
    stale_partners_ = true;
    while (true) {
      double mk = 0.0;
      for (int64_t bin = 0; bin < pr_.b; ++bin) mk = std::max(mk, h[bin] = height(bin));
      work_ += pr_.b * pr_.d / 2 + 1;
      if (mk <= pr_.lower_bound * (1 + kGapTolerance) || out_of_budget()) return mk;
      const double limit = mk * (1 - kRelEps);
      critical.clear();
      for (int64_t bin = 0; bin < pr_.b; ++bin)
        if (h[bin] >= limit) critical.push_back(bin);
      // The partner list only orders the search (every op is checked against the current
      // loads), so a slightly stale one is fine: refresh it every few moves, and always
      // before concluding that no op improves.
      bool improved = false;
      for (int attempt = 0; attempt < 2 && !improved; ++attempt) {
        if (stale_partners_ || moves_since_refresh >= kMovesPerPartnerRefresh) {
          partners_by_height(h, partners);
          stale_partners_ = false;
          moves_since_refresh = 0;
        } else if (attempt == 1) {
          break;
        }
        for (int64_t a : critical) {
          const Op op = best_op(a, limit, partners);
          if (op.i >= 0) {
            apply(op);
            ++improving_moves_;
            ++moves_since_refresh;
            improved = true;
            break;
          }
          if (out_of_budget()) return mk;
        }
        if (!improved) stale_partners_ = true;
      }
      if (!improved) return mk;
    }
  }

  // Random swap (or move) between a critical bin and a random other bin, keeping every
  // bin non-empty and never creating a capacity violation.
  void perturb(double mk) {
    const double limit = mk * (1 - kRelEps);
    std::vector<int64_t> critical;
    for (int64_t bin = 0; bin < pr_.b; ++bin)
      if (height(bin) >= limit) critical.push_back(bin);
    const int64_t steps = 1 + static_cast<int64_t>(rng_.below(2));
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t x = critical[rng_.below(critical.size())];
      int64_t y = static_cast<int64_t>(rng_.below(pr_.b - 1));
      if (y >= x) ++y;
      const auto& from = members_[x];
      const auto& to = members_[y];
      const int64_t i = from[rng_.below(from.size())];
      const int64_t j = to[rng_.below(to.size())];
      // Never create a capacity violation; while repairing one, never make it worse.
      if (evaluate(x, y, i, j, kInf) >= std::max(pr_.overflow_base, mk)) continue;
      apply({i, j, y, 0.0});
    }
  }

  void undo_log() {
    logging_ = false;
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) relocate(it->first, it->second);
    undo_.clear();
  }

  void search() {
    if (pr_.b < 2) return;
    double best = descend();
    int64_t fruitless = 0;
    while (true) {
      if (out_of_budget() || fruitless >= kMaxFruitlessPerturbations) break;
      if (best <= pr_.lower_bound * (1 + kGapTolerance)) break;
      undo_.clear();
      logging_ = true;
      perturb(best);
      const double mk = descend();
      logging_ = false;
      ++perturbations_;
      if (mk < best * (1 - kRelEps)) {
        best = mk;
        fruitless = 0;
      } else {
        ++fruitless;
        if (mk > best * (1 + kRelEps)) undo_log();  // worse: back to the best
      }
      undo_.clear();
    }
  }

  void finish(BalanceResult& res) {
    const int64_t n = pr_.n, d = pr_.d;
    res.assignment = bin_of_;
    // Recompute the loads from scratch in item order: exact and reproducible sums.
    res.bin_loads.assign(pr_.b * d, 0.0);
    res.microbatch_loads.assign(pr_.m * d, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < d; ++k) {
        res.bin_loads[bin_of_[i] * d + k] += pr_.c(i, k);
        res.microbatch_loads[group(bin_of_[i]) * d + k] += pr_.c(i, k);
      }
    double mk = 0.0;
    for (int64_t k = 0; k < d; ++k) {
      const bool g = pr_.is_group[k];
      const auto& loads = g ? res.microbatch_loads : res.bin_loads;
      const int64_t count = g ? pr_.m : pr_.b;
      for (int64_t s = 0; s < count; ++s) {
        const double v = loads[s * d + k];
        if (!pr_.is_limit[k]) mk = std::max(mk, v);
        if (v > pr_.cap[k] * (1 + kCapRelTol)) {
          throw Infeasible(
              "no schedule within " + pr_.cap_name(k) + "=" + fmt(pr_.cap[k]) +
              " found within the search budget (first-fit decreasing did not fit it either): "
              "the best one puts " +
              fmt(v) + " on " + (g ? "microbatch " : "bin ") + std::to_string(s) + " of " +
              std::to_string(count) + " (the total is " + fmt(pr_.total[k]) + ", " +
              fmt(pr_.total[k] / count) + " per " + (g ? "microbatch" : "bin") +
              " on average); raise the limit, the number of microbatches or the time budget");
        }
      }
    }
    res.makespan = mk;
    res.lower_bound = pr_.lower_bound;
    res.stats.work_used = work_;
    res.stats.improving_moves = improving_moves_;
    res.stats.perturbations = perturbations_;
    res.stats.stopped_by_time_limit = deadline_passed_;
  }
};

Problem make_problem(const double* costs, int64_t n, int64_t d, const BalanceOptions& o) {
  Problem pr;
  pr.costs = costs;
  pr.n = n;
  pr.d = d;
  pr.m = o.num_microbatches;
  pr.p = o.dp_size;
  pr.b = o.num_microbatches * o.dp_size;
  pr.is_group.assign(d, 0);
  for (int64_t k : o.microbatch_dims) pr.is_group[k] = 1;
  pr.cap = o.capacity.empty() ? std::vector<double>(d, kInf) : o.capacity;
  pr.is_limit.assign(d, 0);
  for (int64_t k = d - o.num_limit_dims; k < d; ++k) pr.is_limit[k] = 1;
  for (double c : pr.cap) pr.has_caps = pr.has_caps || std::isfinite(c);
  pr.total.assign(d, 0.0);
  std::vector<double> largest(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < d; ++k) {
      pr.total[k] += costs[i * d + k];
      largest[k] = std::max(largest[k], costs[i * d + k]);
    }
  double sum_total = 0.0;
  for (int64_t k = 0; k < d; ++k) {
    if (pr.is_limit[k]) continue;
    const double count = static_cast<double>(pr.is_group[k] ? pr.m : pr.b);
    pr.lower_bound = std::max({pr.lower_bound, pr.total[k] / count, largest[k]});
    sum_total += pr.total[k];
  }
  pr.overflow_base = 2.0 * sum_total + 1.0;
  return pr;
}

}  // namespace

void validate_balance_input(const double* costs, int64_t n, int64_t d, const BalanceOptions& o) {
  if (d < 1)
    throw InvalidArgument("costs must have at least one column (D >= 1), got D=" +
                          std::to_string(d));
  if (o.num_microbatches < 1)
    throw InvalidArgument("num_microbatches must be >= 1, got " +
                          std::to_string(o.num_microbatches));
  if (o.dp_size < 1)
    throw InvalidArgument("dp_size must be >= 1, got " + std::to_string(o.dp_size));
  if (o.num_microbatches > std::numeric_limits<int32_t>::max() / o.dp_size)
    throw InvalidArgument("num_microbatches x dp_size is too large: " +
                          std::to_string(o.num_microbatches) + " x " + std::to_string(o.dp_size));
  const int64_t b = o.num_microbatches * o.dp_size;
  if (n < b)
    throw InvalidArgument("costs has " + std::to_string(n) +
                          " samples but num_microbatches x dp_size = " + std::to_string(b) +
                          " bins; every bin needs at least one sample");
  std::vector<char> seen(d, 0);
  for (size_t idx = 0; idx < o.microbatch_dims.size(); ++idx) {
    const int64_t k = o.microbatch_dims[idx];
    const std::string where = "microbatch_dims[" + std::to_string(idx) + "]=" + std::to_string(k);
    if (k < 0 || k >= d)
      throw InvalidArgument(where + " is out of range for D=" + std::to_string(d));
    if (seen[k]) throw InvalidArgument(where + " is listed twice");
    seen[k] = 1;
  }
  if (o.num_limit_dims < 0 || o.num_limit_dims >= d)
    throw InvalidArgument("num_limit_dims=" + std::to_string(o.num_limit_dims) +
                          " must be in [0, D) with D=" + std::to_string(d) +
                          ": at least one column is balanced");
  if (o.num_limit_dims > 0 && o.capacity.empty())
    throw InvalidArgument("num_limit_dims=" + std::to_string(o.num_limit_dims) +
                          " needs capacity (the limits' bounds)");
  if (!o.capacity.empty() && static_cast<int64_t>(o.capacity.size()) != d)
    throw InvalidArgument("capacity has length " + std::to_string(o.capacity.size()) +
                          " but costs has D=" + std::to_string(d) + " columns");
  for (size_t k = 0; k < o.capacity.size(); ++k) {
    const double v = o.capacity[k];
    if (std::isnan(v) || v < 0)
      throw InvalidArgument("capacity[" + std::to_string(k) + "]=" + fmt(v) +
                            " must be a non-negative number (use inf for no bound)");
  }
  if (o.work_budget < -1)
    throw InvalidArgument("work_budget must be >= 0 (or -1: the default by size), got " +
                          std::to_string(o.work_budget));
  std::vector<double> total(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < d; ++k) {
      const double v = costs[i * d + k];
      total[k] += v;
      if (std::isfinite(v) && v >= 0) continue;
      const std::string where =
          "costs[" + std::to_string(i) + ", " + std::to_string(k) + "]=" + fmt(v);
      if (std::isnan(v)) throw InvalidArgument(where + " is NaN; costs must be finite and >= 0");
      if (std::isinf(v))
        throw InvalidArgument(where + " is infinite; costs must be finite and >= 0");
      throw InvalidArgument(where + " is negative; costs must be finite and >= 0");
    }
  // The search adds loads of all dimensions together; keep that finite with room to spare.
  double sum_total = 0.0;
  for (int64_t k = 0; k < d; ++k) sum_total += total[k];
  if (!std::isfinite(4.0 * sum_total + 1.0))
    throw InvalidArgument("costs are too large: their sum overflows a double (" + fmt(sum_total) +
                          "); express them in a smaller unit (e.g. seconds)");
  if (o.capacity.empty()) return;
  // Cheap proofs of infeasibility: a single item over a bound, or a total over count x bound.
  std::vector<char> is_group(d, 0);
  for (int64_t k : o.microbatch_dims) is_group[k] = 1;
  const int64_t first_limit = d - o.num_limit_dims;
  // A limit column is named as the caller passed it: resources[i, j] against limits[j].
  auto cell = [&](int64_t i, int64_t k) {
    return k >= first_limit
               ? "resources[" + std::to_string(i) + ", " + std::to_string(k - first_limit) + "]"
               : "costs[" + std::to_string(i) + ", " + std::to_string(k) + "]";
  };
  auto bound = [&](int64_t k) {
    return k >= first_limit ? "limits[" + std::to_string(k - first_limit) + "]"
                            : "capacity[" + std::to_string(k) + "]";
  };
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < d; ++k) {
      const double v = costs[i * d + k];
      if (v > o.capacity[k] * (1 + kCapRelTol))
        throw Infeasible("sample " + std::to_string(i) + " has " + cell(i, k) + "=" + fmt(v) +
                         " above " + bound(k) + "=" + fmt(o.capacity[k]) + "; no " +
                         (is_group[k] ? "microbatch" : "bin") + " can hold it");
    }
  for (int64_t k = 0; k < d; ++k) {
    const int64_t count = is_group[k] ? o.num_microbatches : b;
    if (total[k] > o.capacity[k] * static_cast<double>(count) * (1 + kCapRelTol))
      throw Infeasible(bound(k) + "=" + fmt(o.capacity[k]) + " is too small: " +
                       (k >= first_limit ? "resources column " + std::to_string(k - first_limit)
                                         : "dimension " + std::to_string(k)) +
                       " totals " + fmt(total[k]) + ", which needs at least " +
                       fmt(total[k] / count) + " per " + (is_group[k] ? "microbatch" : "bin") +
                       " over " + std::to_string(count) +
                       (is_group[k] ? " microbatches" : " bins"));
  }
}

int64_t first_fit_decreasing_bins(const double* used, int64_t n, int64_t k,
                                  const std::vector<double>& limits) {
  if (k < 1 || static_cast<int64_t>(limits.size()) != k)
    throw InvalidArgument("limits has " + std::to_string(limits.size()) + " values for " +
                          std::to_string(k) + " resource columns");
  for (int64_t j = 0; j < k; ++j)
    if (std::isnan(limits[j]) || limits[j] < 0)
      throw InvalidArgument("limits[" + std::to_string(j) + "]=" + fmt(limits[j]) +
                            " must be a number >= 0 (inf: no bound)");
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const double v = used[i * k + j];
      if (!std::isfinite(v) || v < 0)
        throw InvalidArgument("resources[" + std::to_string(i) + ", " + std::to_string(j) +
                              "]=" + fmt(v) + " must be finite and >= 0");
      if (v > limits[j] * (1 + kCapRelTol))
        throw Infeasible("sample " + std::to_string(i) + " has resources[" + std::to_string(i) +
                         ", " + std::to_string(j) + "]=" + fmt(v) + " above limits[" +
                         std::to_string(j) + "]=" + fmt(limits[j]) + "; no bin can hold it");
    }
  std::vector<double> loads;  // bins x k
  int64_t bins = 0;
  for (int64_t i : by_decreasing_share(used, n, k, limits)) {
    int64_t bin = 0;
    for (; bin < bins; ++bin) {
      bool fits = true;
      for (int64_t j = 0; j < k && fits; ++j)
        fits = loads[bin * k + j] + used[i * k + j] <= limits[j] * (1 + kCapRelTol);
      if (fits) break;
    }
    if (bin == bins) loads.resize(++bins * k, 0.0);
    for (int64_t j = 0; j < k; ++j) loads[bin * k + j] += used[i * k + j];
  }
  return bins;
}

int64_t default_work_budget(int64_t num_items, int64_t num_bins, int64_t num_dims) {
  (void)num_bins;
  // About 1 us of search per sample (0.2 ms to 100 ms at D = 2): on the synthetic
  // workload this is well past the point of diminishing returns (benchmarks/README.md).
  const double units =
      200.0 * static_cast<double>(num_items) / static_cast<double>(std::max<int64_t>(num_dims, 1));
  return static_cast<int64_t>(std::clamp(units, 0.2 * kWorkUnitsPerMs, 100.0 * kWorkUnitsPerMs));
}

int64_t work_budget_for_ms(double time_budget_ms) {
  if (!(time_budget_ms >= 0) || !std::isfinite(time_budget_ms))
    throw InvalidArgument("time_budget_ms must be a finite number >= 0, got " +
                          fmt(time_budget_ms));
  // Clamp: far beyond any useful search (balance() caps budgets at kMaxWorkBudget).
  return static_cast<int64_t>(std::min(time_budget_ms * kWorkUnitsPerMs, double(kMaxWorkBudget)));
}

BalanceResult balance(const double* costs, int64_t n, int64_t d, const BalanceOptions& o) {
  validate_balance_input(costs, n, d, o);
  const Problem pr = make_problem(costs, n, d, o);
  // Capped, so that the extensions of an infeasible search cannot overflow.
  const int64_t budget = std::min(
      o.work_budget >= 0 ? o.work_budget : default_work_budget(n, pr.b, d), kMaxWorkBudget);
  Solver solver(pr, o.seed, budget, o.time_limit_s, o.interrupted);
  return solver.run();
}

}  // namespace dflop
