// The encoder's per-microbatch split by visual unit (see the header for the algorithm).
#include "dflop/encoder_split.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dflop/errors.hpp"
#include "format.hpp"

namespace dflop {
namespace {

// Relative slack of a capacity test: loads are sums of doubles, so a replica filled to
// exactly M in one summation order must not count as over M in another.
constexpr double kSlack = 1e-9;
// Relative slack for "strictly better" in the whole-sample local search: an exchange that
// only reorders the same summands must not count as an improvement (it would cycle).
constexpr double kRelEps = 1e-12;

struct Visual {
  int64_t sample;
  int64_t units;
  double cost;       // all of its units
  double unit_cost;  // cost / units
};

struct Piece {
  int64_t sample, first_unit, num_units, replica;
};

[[noreturn]] void invalid(const std::string& what) { throw InvalidArgument(what); }

std::string num(double v) { return detail::format_number(v); }

// Units of cost c (at most `wanted`) that fit into `room` under capacity M.
int64_t fitting_units(double room, double c, double capacity, int64_t wanted) {
  if (!(c > 0.0)) return wanted;
  const double fit = (room + kSlack * capacity) / c;
  if (!(fit >= 1.0)) return 0;
  return fit >= static_cast<double>(wanted) ? wanted : static_cast<int64_t>(std::floor(fit));
}

// Whether every unit costs the same, up to rounding (costs computed as c x units and
// divided back).
bool equal_unit_costs(const std::vector<Visual>& visual) {
  if (visual.empty()) return true;
  double lo = visual.front().unit_cost, hi = lo;
  for (const Visual& v : visual) {
    lo = std::min(lo, v.unit_cost);
    hi = std::max(hi, v.unit_cost);
  }
  return hi - lo <= 1e-12 * hi;
}

// Next fit in `order` at capacity M: replica 0 takes units until the next one would exceed
// M, then replica 1, ... Returns false if R replicas do not suffice; else the largest load.
bool next_fit(const std::vector<Visual>& order, int64_t R, double M, std::vector<Piece>* out,
              double* achieved) {
  int64_t r = 0;
  double load = 0.0, worst = 0.0;
  for (const Visual& v : order) {
    int64_t next = 0;
    while (next < v.units) {
      const int64_t take = fitting_units(M - load, v.unit_cost, M, v.units - next);
      if (take == 0) {
        if (++r == R) return false;
        load = 0.0;
        continue;
      }
      if (out != nullptr) out->push_back({v.sample, next, take, r});
      load += static_cast<double>(take) * v.unit_cost;
      worst = std::max(worst, load);
      next += take;
    }
  }
  *achieved = worst;
  return true;
}

// The smallest capacity at which next fit in `order` places everything (header, step 1).
double target_capacity(const std::vector<Visual>& order, int64_t R) {
  double total = 0.0, largest_unit = 0.0;
  for (const Visual& v : order) {
    total += v.cost;
    largest_unit = std::max(largest_unit, v.unit_cost);
  }
  double achieved = 0.0;
  // Feasibility grows with M; next fit succeeds at total / R + largest unit (every replica
  // but the last is filled above total / R), so bisect between that and the lower bound.
  double lo = std::max(total / static_cast<double>(R), largest_unit);
  double hi = total / static_cast<double>(R) + largest_unit;
  if (!next_fit(order, R, hi, nullptr, &achieved)) hi = total;  // rounding: one replica
  for (int it = 0; it < 64 && hi - lo > 1e-12 * hi; ++it) {
    const double mid = 0.5 * (lo + hi);
    if (next_fit(order, R, mid, nullptr, &achieved)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  next_fit(order, R, hi, nullptr, &achieved);
  return achieved;
}

// Best fit of whole samples, then pouring of the rest (header, steps 2-3). False if units
// are left over.
bool whole_then_pour(const std::vector<Visual>& by_cost, int64_t R, double M,
                     std::vector<Piece>* out) {
  std::vector<double> load(static_cast<size_t>(R), 0.0);
  std::set<std::pair<double, int64_t>> open;  // (load, replica)
  for (int64_t r = 0; r < R; ++r) open.insert({0.0, r});
  auto place = [&](int64_t r, double cost) {
    open.erase({load[r], r});
    load[r] += cost;
    open.insert({load[r], r});
  };
  std::vector<const Visual*> rest;
  for (const Visual& v : by_cost) {
    // The fullest replica that still takes the whole sample.
    auto it = open.upper_bound({M * (1.0 + kSlack) - v.cost, std::numeric_limits<int64_t>::max()});
    if (it == open.begin()) {
      rest.push_back(&v);
      continue;
    }
    --it;
    const int64_t r = it->second;
    out->push_back({v.sample, 0, v.units, r});
    place(r, v.cost);
  }
  for (const Visual* v : rest) {
    int64_t next = 0;
    while (next < v->units) {
      const int64_t r = open.begin()->second;  // the most room
      const int64_t take = fitting_units(M - load[r], v->unit_cost, M, v->units - next);
      if (take == 0) return false;
      out->push_back({v->sample, next, take, r});
      place(r, static_cast<double>(take) * v->unit_cost);
      next += take;
    }
  }
  return true;
}

// Equal unit costs (the usual case: every tile or frame of the model costs the same): the
// same steps in whole units, exactly (no floating-point ties): M = ceil(U / R) units, which
// is optimal, then whole samples by LPT if that reaches M, else best fit and pouring. The
// K = min(R, U) replicas suffice and are always enough here (K x M >= U).
void split_equal_units(const std::vector<Visual>& by_cost, int64_t R, std::vector<Piece>* out) {
  int64_t total = 0;
  for (const Visual& v : by_cost) total += v.units;
  const int64_t K = std::min(R, total);
  const int64_t M = (total + R - 1) / R;
  // 1. LPT: least loaded replica first (ties: lower index).
  std::vector<std::pair<int64_t, int64_t>> heap;  // (load, replica), a min-heap
  heap.reserve(static_cast<size_t>(K));
  for (int64_t r = 0; r < K; ++r) heap.emplace_back(0, r);
  const auto greater = std::greater<std::pair<int64_t, int64_t>>();
  int64_t worst = 0;
  for (const Visual& v : by_cost) {
    std::pop_heap(heap.begin(), heap.end(), greater);
    auto& [load, r] = heap.back();
    out->push_back({v.sample, 0, v.units, r});
    load += v.units;
    worst = std::max(worst, load);
    std::push_heap(heap.begin(), heap.end(), greater);
  }
  if (worst <= M) return;
  out->clear();
  // 2. Best fit of whole samples: the fullest replica that still takes the sample.
  std::vector<std::vector<int64_t>> level(static_cast<size_t>(M + 1));  // replicas by load
  for (int64_t r = K - 1; r >= 0; --r) level[0].push_back(r);
  auto move = [&](int64_t from, int64_t to) {
    const int64_t r = level[from].back();
    level[from].pop_back();
    level[to].push_back(r);
    return r;
  };
  std::vector<const Visual*> rest;
  for (const Visual& v : by_cost) {
    int64_t l = M - v.units;
    while (l >= 0 && level[l].empty()) --l;
    if (l < 0) {
      rest.push_back(&v);
      continue;
    }
    out->push_back({v.sample, 0, v.units, move(l, l + v.units)});
  }
  // 3. Pour the rest into the replicas with the most room, in unit order.
  for (const Visual* v : rest) {
    int64_t next = 0, l = 0;
    while (next < v->units) {
      while (level[l].empty()) ++l;  // some replica has room: K x M >= U
      const int64_t take = std::min(v->units - next, M - l);
      out->push_back({v->sample, next, take, move(l, l + take)});
      next += take;
    }
  }
}

// Plain LPT of whole samples (costliest first onto the least loaded replica, ties by
// replica index) into `out`; returns its makespan.
double lpt_makespan(const std::vector<Visual>& by_cost, int64_t R, std::vector<Piece>* out) {
  std::set<std::pair<double, int64_t>> open;  // (load, replica)
  for (int64_t r = 0; r < R; ++r) open.insert({0.0, r});
  double worst = 0.0;
  for (const Visual& v : by_cost) {
    const auto [load, r] = *open.begin();
    open.erase(open.begin());
    open.insert({load + v.cost, r});
    worst = std::max(worst, load + v.cost);
    out->push_back({v.sample, 0, v.units, r});
  }
  return worst;
}

// Whole samples: LPT (costliest first onto the least loaded replica; ties: fewer samples,
// then lower index), then moves and swaps out of the costliest replica while they lower
// the larger of the two loads. Each accepted step lowers the sorted load vector
// lexicographically, so it terminates; the cap only bounds large microbatches.
std::vector<int64_t> whole_samples(const std::vector<Visual>& by_cost, int64_t R) {
  const size_t n = by_cost.size();
  std::vector<int64_t> replica(n, 0), count(static_cast<size_t>(R), 0);
  std::vector<double> load(static_cast<size_t>(R), 0.0);
  for (size_t k = 0; k < n; ++k) {
    int64_t best = 0;
    for (int64_t r = 1; r < R; ++r) {
      if (load[r] < load[best] || (load[r] == load[best] && count[r] < count[best])) best = r;
    }
    replica[k] = best;
    load[best] += by_cost[k].cost;
    ++count[best];
  }
  if (R == 1) return replica;
  const int64_t max_steps = 4 * static_cast<int64_t>(n) + 16;
  for (int64_t step = 0; step < max_steps; ++step) {
    const int64_t top = std::max_element(load.begin(), load.end()) - load.begin();
    const double top_load = load[top];
    double best_pair_max = top_load * (1.0 - kRelEps);
    int64_t best_a = -1, best_b = -1, best_r = -1;  // best_b = -1: a move
    for (size_t a = 0; a < n; ++a) {
      if (replica[a] != top) continue;
      const double ca = by_cost[a].cost;
      for (int64_t r = 0; r < R; ++r) {
        if (r == top) continue;
        const double moved = std::max(top_load - ca, load[r] + ca);
        if (moved < best_pair_max)
          best_pair_max = moved, best_a = int64_t(a), best_b = -1, best_r = r;
      }
      for (size_t b = 0; b < n; ++b) {
        const int64_t r = replica[b];
        if (r == top || by_cost[b].cost >= ca) continue;
        const double delta = ca - by_cost[b].cost;
        const double swapped = std::max(top_load - delta, load[r] + delta);
        if (swapped < best_pair_max)
          best_pair_max = swapped, best_a = int64_t(a), best_b = int64_t(b), best_r = r;
      }
    }
    if (best_a < 0) break;
    load[top] -= by_cost[best_a].cost;
    load[best_r] += by_cost[best_a].cost;
    replica[best_a] = best_r;
    if (best_b >= 0) {
      load[best_r] -= by_cost[best_b].cost;
      load[top] += by_cost[best_b].cost;
      replica[best_b] = top;
    }
  }
  return replica;
}

}  // namespace

UnitSplit split_units(const int64_t* units, const double* costs, int64_t num_samples,
                      int64_t num_replicas, SplitGranularity granularity) {
  if (num_samples < 0) invalid("num_samples must be >= 0, got " + std::to_string(num_samples));
  if (num_replicas < 1 || num_replicas > kMaxSplitReplicas)
    invalid("num_replicas must be in [1, " + std::to_string(kMaxSplitReplicas) + "], got " +
            std::to_string(num_replicas));
  if (granularity != SplitGranularity::Unit && granularity != SplitGranularity::Sample)
    invalid("granularity must be Unit or Sample");
  std::vector<Visual> visual;
  int64_t total_units = 0;
  for (int64_t i = 0; i < num_samples; ++i) {
    if (units[i] < 0)
      invalid("units[" + std::to_string(i) + "]=" + std::to_string(units[i]) + " must be >= 0");
    if (!(costs[i] >= 0.0) || !std::isfinite(costs[i]))
      invalid("costs[" + std::to_string(i) + "]=" + num(costs[i]) + " must be finite and >= 0");
    if (units[i] == 0 && costs[i] > 0.0)
      invalid("costs[" + std::to_string(i) + "]=" + num(costs[i]) +
              " is encoder work for a sample with units[" + std::to_string(i) +
              "]=0 (a text-only sample costs the encoder nothing)");
    if (units[i] > kMaxSplitUnits - total_units)
      invalid("units sum to more than " + std::to_string(kMaxSplitUnits) + " at units[" +
              std::to_string(i) + "]=" + std::to_string(units[i]));
    total_units += units[i];
    if (units[i] > 0)
      visual.push_back({i, units[i], costs[i], costs[i] / static_cast<double>(units[i])});
  }
  const int64_t R = num_replicas;
  std::vector<Piece> pieces;
  std::vector<Visual> costly, free_ones;
  for (const Visual& v : visual) (v.cost > 0.0 ? costly : free_ones).push_back(v);
  // Costliest first, ties by index (by_cost), and by unit cost for next fit (canonical).
  std::vector<Visual> by_cost = costly, canonical = costly;
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [](const Visual& a, const Visual& b) { return a.cost > b.cost; });
  std::stable_sort(canonical.begin(), canonical.end(),
                   [](const Visual& a, const Visual& b) { return a.unit_cost > b.unit_cost; });
  if (R == 1 || costly.empty()) {
    for (const Visual& v : costly) pieces.push_back({v.sample, 0, v.units, 0});
  } else if (granularity == SplitGranularity::Sample) {
    const int64_t K = std::min<int64_t>(R, static_cast<int64_t>(by_cost.size()));
    const std::vector<int64_t> replica = whole_samples(by_cost, K);
    for (size_t k = 0; k < by_cost.size(); ++k)
      pieces.push_back({by_cost[k].sample, 0, by_cost[k].units, replica[k]});
  } else if (equal_unit_costs(costly)) {
    split_equal_units(by_cost, R, &pieces);
  } else {
    const double M = target_capacity(canonical, R);
    // No placement uses more replicas than there are units: the others stay empty.
    int64_t costly_units = 0;
    for (const Visual& v : costly) costly_units += v.units;
    const int64_t K = std::min(R, costly_units);
    if (lpt_makespan(by_cost, K, &pieces) <= M * (1.0 + kSlack)) {
      // Whole samples already reach M: nothing to split.
    } else if (pieces.clear(), !whole_then_pour(by_cost, K, M, &pieces)) {
      pieces.clear();
      double achieved = 0.0;
      next_fit(canonical, R, M, &pieces, &achieved);
    }
  }
  UnitSplit out;
  out.num_replicas = R;
  out.replica_cost.assign(static_cast<size_t>(R), 0.0);
  out.replica_units.assign(static_cast<size_t>(R), 0);
  for (const Piece& p : pieces) out.replica_units[p.replica] += p.num_units;
  // Zero-cost samples with units: whole, to the replica with the fewest units.
  for (const Visual& v : free_ones) {
    const int64_t r = std::min_element(out.replica_units.begin(), out.replica_units.end()) -
                      out.replica_units.begin();
    pieces.push_back({v.sample, 0, v.units, r});
    out.replica_units[r] += v.units;
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.sample != b.sample ? a.sample < b.sample : a.first_unit < b.first_unit;
  });
  for (const Piece& p : pieces) {
    out.sample.push_back(p.sample);
    out.first_unit.push_back(p.first_unit);
    out.num_units.push_back(p.num_units);
    out.replica.push_back(p.replica);
    // The fraction first: cost x units could overflow for costs near the double range.
    out.replica_cost[p.replica] +=
        costs[p.sample] * (static_cast<double>(p.num_units) / static_cast<double>(units[p.sample]));
  }
  for (const double c : out.replica_cost) out.makespan = std::max(out.makespan, c);
  return out;
}

}  // namespace dflop
