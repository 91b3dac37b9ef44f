// Planner: the search over layouts.
//
// The model is documented in planner.hpp; this file explains the search.
//
// Exhaustive (prune = false): every memory-feasible candidate is balanced and simulated.
//
// Pruned (the default, DataAware and DataBlindColocated): every candidate gets, without a
// schedule, (1) a lower bound on its mean simulated step: per stage, its share of the
// batch's load over the DP replicas, or the largest item one replica must hold, plus m
// microbatch constants and its gradient all-reduce; and the mean path of a microbatch
// through all stages (module_path_part), which sees deep pipelines with few microbatches;
// (2) a pruning key, the bound or screen_factor x a uniform estimate of the step (fill +
// steady state + drain of m typical microbatches) if larger: not a bound, but an estimate
// that the near-best layouts' scores exceed (uneven microbatches only slow a pipeline down,
// except where reordering exploits them, which the planner's few orders rarely do); and (3)
// an evaluation order, a pessimistic estimate that ranks the best layouts first.
// Disaggregated candidates are grouped in blocks (encoder GPU count, m) whose keys and
// orders are bounded below by those of the per-module minima (every term grows with each
// module's), so blocks that cannot matter are never enumerated pair by pair. An incumbent
// comes from the candidates first in order; then, in order, every candidate whose key can
// still beat the k-th best is balanced one batch at a time and given a second bound from
// its schedule (Evaluator::replica_bound: critical paths of the simulation, then single
// replicas simulated alone) and simulated in full only when that bound does not exceed the
// k-th best. The search stops once `patience` candidates in a row left the k-th best
// unchanged (the near-best plateau of a large cluster holds thousands of layouts within a
// few percent of each other); what it left is counted. On clusters small enough for the
// exhaustive search the two agree (tests, bench_plan --validate). Schedules depend on a
// layout only through a few fields (Evaluator::schedule_key) and are balanced once per key
// and batch. Candidates are evaluated in fixed-size waves on several threads and merged in
// order, so the result and the statistics do not depend on the number of threads.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "dflop/planner.hpp"
#include "planner_internal.hpp"

namespace dflop {
namespace {

using detail::batch_bound;
using detail::batch_key;
using detail::BatchSums;
using detail::BinSums;
using detail::candidate_keys;
using detail::colocated_bound;
using detail::Context;
using detail::Evaluator;
using detail::Keys;
using detail::kInf;
using detail::min_parts;
using detail::module_bound;
using detail::module_path_mean;
using detail::ModuleModel;
using detail::PathPart;
using detail::total_stages;

// Relative margin of the second bound's pruning test (see Search::evaluate_wave).
constexpr double kBoundSlack = 1e-9;

// ---------------------------------------------------------------------------------------
// Layout helpers

// The tie key: fewer pipeline stages, fewer chunks, less TP, fewer microbatches, fewer
// encoder GPUs, then the degrees themselves. Independent of the enumeration order.
using TieKey = std::array<int64_t, 12>;
TieKey tie_key(const Layout& l) {
  const int64_t v = l.colocated ? 0 : l.encoder.tp * l.encoder.pp * l.encoder.dp;
  return {total_stages(l),
          l.llm.virtual_stages,
          l.encoder.tp + l.llm.tp,
          l.num_microbatches,
          v,
          l.encoder.tp,
          l.encoder.pp,
          l.llm.tp,
          l.llm.pp,
          l.colocated ? 1 : 0,
          l.encoder.recompute ? 1 : 0,
          l.llm.recompute ? 1 : 0};
}

bool better(double a_time, const Layout& a, double b_time, const Layout& b) {
  if (a_time != b_time) return a_time < b_time;
  return tie_key(a) < tie_key(b);
}

// Parallel degrees of a module on `gpus` GPUs starting at first_rank.
struct Degrees {
  int64_t tp, pp, dp;
};
std::vector<Degrees> module_degrees(const ClusterParams& c, const ModuleParams& p, int64_t gpus,
                                    int64_t first_rank, int64_t max_tp) {
  std::vector<Degrees> out;
  for (int64_t tp = 1; tp <= std::min(max_tp, gpus); ++tp) {
    if (c.gpus_per_node % tp || p.num_heads % tp || gpus % tp || first_rank % tp) continue;
    const int64_t rest = gpus / tp;
    for (int64_t pp = 1; pp <= std::min(rest, p.num_layers); ++pp) {
      if (rest % pp) continue;
      out.push_back({tp, pp, rest / pp});
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Search

struct Candidate {
  double bound;  // the search's key: the lower bound, or the screened estimate if larger
  double lower_bound;
  double order;  // prune mode: when it is evaluated (Search explains)
  Layout layout;
};

bool candidate_less(const Candidate& a, const Candidate& b) {
  return better(a.bound, a.layout, b.bound, b.layout);
}

bool order_less(const Candidate& a, const Candidate& b) {
  return better(a.order, a.layout, b.order, b.layout);
}

// `colocated_recompute`: set for a colocated LLM layout (the encoder joins its first stage).
ModuleLayout make_module(const ModuleModel& mm, const Degrees& d, int64_t first_rank, bool balanced,
                         const Context& ctx, std::optional<bool> colocated_recompute = std::nullopt,
                         int64_t virtual_stages = 1) {
  ModuleLayout l;
  l.tp = d.tp;
  l.pp = d.pp;
  l.dp = d.dp;
  l.first_rank = first_rank;
  l.virtual_stages = virtual_stages;
  // Per-layer vs last-stage-only load of the average sample, for the balanced split.
  double body = 0, last = 0;
  const bool is_encoder = &mm == &ctx.enc;
  for (const BatchSums& s : ctx.sums) {
    body += is_encoder ? s.enc_body : s.llm_body;
    last += is_encoder ? s.enc_last : s.llm_last;
  }
  double first = 0;
  if (colocated_recompute) {
    // The encoder's time at this tp, in the LLM's unit (time at t = 1 before TP scaling).
    const ModuleModel& ce = ctx.colocated_enc(d.tp);
    double enc = 0;
    for (const BatchSums& s : ctx.sums) enc += s.enc_body * ce.body_scale + s.enc_last;
    first = enc * (*colocated_recompute ? 4.0 / 3.0 : 1.0) * ctx.llm.eff(d.tp) / ce.eff(d.tp);
  }
  l.layers_per_stage = split_layers(mm.p->num_layers, d.pp * virtual_stages,
                                    body / double(mm.p->num_layers), first, last, balanced);
  return l;
}

class Search {
 public:
  Search(const Context& ctx) : ctx_(ctx), eval_(ctx) {
    num_threads_ = ctx.o.num_threads > 0
                       ? ctx.o.num_threads
                       : std::max<int64_t>(1, std::thread::hardware_concurrency());
  }

  PlanResult run() {
    const PlannerOptions& o = ctx_.o;
    if (o.strategy == PlanStrategy::MeanShapeReference || !o.prune) {
      enumerate();
      std::sort(cands_.begin(), cands_.end(), candidate_less);
      if (o.strategy == PlanStrategy::MeanShapeReference) {
        // The reference ranks by its estimate; we report the simulated time of its choice
        // (and of the next ones when top_k > 1), walking down the estimate ranking past
        // layouts that fail the exact memory check.
        for (const Candidate& c : cands_) {
          if (int64_t(best_.size()) >= o.top_k) break;
          evaluate_wave({&c}, false);
        }
      } else {
        evaluate_sorted(cands_, nullptr, false);
      }
    } else {
      run_pruned();
    }
    if (o.zero_bubble && o.strategy == PlanStrategy::DataAware) try_zero_bubble();
    PlanResult result;
    result.stats = stats_;
    result.best = best_;
    if (best_.empty()) result.shortfall = shortfall_;
    return result;
  }

 private:
  // Candidates evaluated together (in parallel); fixed, so that the statistics do not
  // depend on the number of threads.
  static constexpr size_t kWaveSize = 32;
  // Schedules kept for layouts that share them (first in, first out).
  static constexpr size_t kScheduleCacheBytes = size_t(64) << 20;
  // Layouts simulated under 1F1B that try_zero_bubble also tries, per kept layout.
  static constexpr int64_t kZeroBubblePool = 4;

  double kth_best() const {
    if (int64_t(best_.size()) < ctx_.o.top_k) return kInf;
    return best_.back().mean_step_time_s;
  }

  void note_shortfall(const Evaluator::Memory& mem) {
    if (!shortfall_.found || mem.peak < shortfall_.needed_bytes) {
      shortfall_ = {true, mem.peak, mem.encoder, mem.stage};
    }
  }

  // Evaluates sorted candidates in waves of kWaveSize. With `prune`: stops at the first
  // bound above the k-th best, and skips (counting them as pruned) candidates whose
  // replica bound exceeds the k-th best at the start of their wave; `done` collects what
  // was evaluated and is skipped. Evaluating a wave at once may simulate a candidate that
  // one-at-a-time evaluation would have pruned after an earlier one of the same wave
  // lowered the k-th best; its time exceeds its bound, hence the new k-th best, so the
  // result is the same.
  void evaluate_sorted(const std::vector<Candidate>& cands, std::set<TieKey>* done, bool prune) {
    size_t i = 0;
    while (i < cands.size()) {
      const double kth = kth_best();
      std::vector<const Candidate*> wave;
      while (i < cands.size() && wave.size() < kWaveSize) {
        const Candidate& c = cands[i];
        if (prune && c.bound > kth) {
          i = cands.size();
          break;
        }
        ++i;
        if (done && !done->insert(tie_key(c.layout)).second) continue;
        wave.push_back(&c);
      }
      if (!wave.empty()) evaluate_wave(wave, prune);
    }
  }

  // The pruned search (see the file comment): an incumbent from the candidates first in
  // evaluation order, then rounds over everything whose key can still beat the k-th best,
  // in evaluation order, until `patience` schedules in a row leave the k-th best as it was.
  void run_pruned() {
    const PlannerOptions& o = ctx_.o;
    build_blocks();
    pass_ = Pass::Incumbent;
    enumerate();
    std::sort(cands_.begin(), cands_.end(), order_less);
    std::set<TieKey> done;
    evaluate_ordered(cands_, &done, 0);
    pass_ = Pass::Collect;
    const Candidate* floor = nullptr;
    Candidate last;
    for (;;) {
      threshold_ = kth_best();
      floor_ = floor;
      overflowed_ = false;
      cands_.clear();
      enumerate();
      std::sort(cands_.begin(), cands_.end(), order_less);
      // Small batches schedule fast: their patience grows as the global batch shrinks
      // below 2,048 samples, so small clusters are searched to the end.
      const int64_t patience =
          o.patience * std::max<int64_t>(1, int64_t(2048) / std::max<int64_t>(1, ctx_.n));
      const size_t stopped_at = evaluate_ordered(cands_, &done, patience);
      if (stopped_at < cands_.size()) {
        stats_.stopped_by_patience = true;
        const double kth = kth_best();
        for (size_t i = stopped_at; i < cands_.size(); ++i) {
          if (cands_[i].bound <= kth && !done.count(tie_key(cands_[i].layout))) {
            ++stats_.num_unexplored;
          }
        }
        break;
      }
      if (!overflowed_ || cands_.empty()) break;
      last = cands_.back();  // everything up to it has been evaluated: start after it
      floor = &last;
    }
    // Everything neither scored, nor over memory, nor left unexplored was pruned (by a
    // block's or its own key, or by the replica bound).
    stats_.num_pruned = stats_.num_candidates - stats_.num_simulated - stats_.num_memory_rejected -
                        stats_.num_unexplored;
  }

  // Evaluates candidates sorted by evaluation order in waves of kWaveSize, skipping those
  // whose key exceeds the k-th best at the start of their wave (pruned) and those in `done`.
  // With `patience` > 0, stops once that many candidates in a row were scheduled without
  // lowering the k-th best; returns the position it stopped at (cands.size(): the end).
  size_t evaluate_ordered(const std::vector<Candidate>& cands, std::set<TieKey>* done,
                          int64_t patience) {
    size_t i = 0;
    int64_t unimproved = 0;
    while (i < cands.size()) {
      const double kth = kth_best();
      std::vector<const Candidate*> wave;
      while (i < cands.size() && wave.size() < kWaveSize) {
        const Candidate& c = cands[i++];
        if (c.bound > kth) continue;
        if (!done->insert(tie_key(c.layout)).second) continue;
        wave.push_back(&c);
      }
      if (wave.empty()) continue;
      evaluate_wave(wave, true);
      unimproved = kth_best() < kth ? 0 : unimproved + int64_t(wave.size());
      if (patience > 0 && unimproved >= patience) return i;
    }
    return cands.size();
  }

  // Scores a wave of candidates in parallel: one task per group of candidates that share
  // schedules (so that each schedule is balanced once), results merged in the wave's order.
  // With `prune` (and an incumbent), a candidate is balanced and bounded one batch at a
  // time: after each batch, its bound is the mean over batches of the replica bound
  // (Evaluator::replica_bound) for the batches scheduled so far and the first bound for the
  // others; once it exceeds the k-th best at the start of the wave, the candidate is pruned
  // without balancing the remaining batches or simulating every replica.
  void evaluate_wave(const std::vector<const Candidate*>& wave, bool prune) {
    if (ctx_.o.interrupted && ctx_.o.interrupted()) throw Interrupted("interrupted");
    const int64_t B = ctx_.x.num_batches;
    const double kth = kth_best();
    const bool bound =
        prune && ctx_.o.strategy != PlanStrategy::MeanShapeReference && std::isfinite(kth);
    // Strictly above the k-th best, with a margin far above rounding (the bounds and the
    // score sum in different orders), so that a candidate that ties is never pruned.
    const double cut = kth * (1.0 + kBoundSlack);
    std::vector<Evaluator::ScheduleKey> keys;
    std::vector<std::vector<size_t>> groups;
    for (size_t j = 0; j < wave.size(); ++j) {
      const Evaluator::ScheduleKey key = Evaluator::schedule_key(wave[j]->layout);
      const size_t g = size_t(std::find(keys.begin(), keys.end(), key) - keys.begin());
      if (g == keys.size()) {
        keys.push_back(key);
        groups.emplace_back();
      }
      groups[g].push_back(j);
    }
    struct Outcome {
      Evaluator::Memory mem;
      bool feasible = false, pruned = false;
      LayoutScore score;
    };
    std::vector<Outcome> out(wave.size());
    std::vector<std::map<int64_t, std::vector<int64_t>>> fresh(groups.size());
    parallel_for(int64_t(groups.size()), [&](int64_t g) {
      auto& local = fresh[size_t(g)];
      // The cache is only read while tasks run; new schedules go to `local`.
      auto schedule = [&](const Layout& l, int64_t b) -> const std::vector<int64_t>& {
        const auto it = schedule_cache_.find({keys[size_t(g)], b});
        if (it != schedule_cache_.end()) return it->second;
        auto lit = local.find(b);
        if (lit == local.end()) lit = local.emplace(b, eval_.assign(l, b)).first;
        return lit->second;
      };
      for (size_t j : groups[size_t(g)]) {
        const Layout& l = wave[j]->layout;
        Outcome& o = out[j];
        std::vector<double> first(static_cast<size_t>(B), 0.0);
        if (bound) {
          for (int64_t b = 0; b < B; ++b) first[size_t(b)] = batch_key(ctx_, l, b);
        }
        std::vector<BinSums> sums;
        double done = 0;  // replica bounds of the batches scheduled so far
        for (int64_t b = 0; b < B && !o.pruned; ++b) {
          sums.push_back(eval_.bin_sums(l, b, schedule(l, b)));
          if (!bound) continue;
          double rest = 0;
          for (int64_t r = b + 1; r < B; ++r) rest += first[size_t(r)];
          done += eval_.replica_bound(l, sums.back(), cut * double(B) - done - rest);
          o.pruned = (done + rest) / double(B) > cut;
        }
        if (o.pruned) continue;
        const Evaluator::Prepared p = eval_.prepare(l, std::move(sums));
        o.mem = p.mem;
        o.feasible = p.feasible;
        if (p.feasible) o.score = eval_.finish(l, p);
      }
    });
    for (size_t g = 0; g < groups.size(); ++g) {
      stats_.num_balanced += int64_t(fresh[g].size());
      for (auto& [b, assignment] : fresh[g]) cache_schedule({keys[g], b}, std::move(assignment));
    }
    for (size_t j = 0; j < wave.size(); ++j) {
      Outcome& o = out[j];
      ++stats_.num_scheduled;
      if (o.pruned) {
        ++stats_.num_pruned_after_schedule;
      } else if (!o.feasible) {
        ++stats_.num_memory_rejected;
        ++exact_rejected_;
        note_shortfall(o.mem);
      } else {
        insert(*wave[j], std::move(o.score));
      }
    }
  }

  using CacheKey = std::pair<Evaluator::ScheduleKey, int64_t>;  // (layout key, batch)
  void cache_schedule(const CacheKey& key, std::vector<int64_t> assignment) {
    const size_t bytes = assignment.size() * sizeof(int64_t);
    while (!cache_order_.empty() && cache_bytes_ + bytes > kScheduleCacheBytes) {
      const auto it = schedule_cache_.find(cache_order_.front());
      cache_bytes_ -= it->second.size() * sizeof(int64_t);
      schedule_cache_.erase(it);
      cache_order_.pop_front();
    }
    cache_bytes_ += bytes;
    cache_order_.push_back(key);
    schedule_cache_.emplace(key, std::move(assignment));
  }

  // Runs fn(0), ..., fn(n - 1) on up to num_threads threads; rethrows the first error.
  template <class F>
  void parallel_for(int64_t n, F&& fn) const {
    const int64_t threads = std::min<int64_t>(num_threads_, n);
    if (threads <= 1) {
      for (int64_t j = 0; j < n; ++j) fn(j);
      return;
    }
    std::atomic<int64_t> next{0};
    std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
    auto work = [&](int64_t t) {
      try {
        for (int64_t j = next++; j < n; j = next++) fn(j);
      } catch (...) {
        errors[size_t(t)] = std::current_exception();
        next = n;
      }
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& th : pool) th.join();
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  // The layouts that can run ZB-H1 (disaggregated, one chunk per LLM stage) among the
  // kept ones and the zb_pool_ (the best simulated under 1F1B beyond them: a layout whose
  // 1F1B step ranks lower can gain more from ZB-H1), each scored under it with the same
  // schedules where its ZB-H1 lower bound can still beat the k-th best, and kept under
  // ZB-H1 where that is faster and fits. The result: the best top_k of those, and the
  // 1F1B top_k besides (at most 2 top_k), so that re-scoring them as the runtime runs them
  // (choose_layouts) can never lose the plan the search without ZB-H1 makes.
  void try_zero_bubble() {
    const std::vector<LayoutScore> plain = best_;
    std::vector<LayoutScore> all = best_;
    std::set<TieKey> seen;
    for (const LayoutScore& s : best_) seen.insert(tie_key(s.layout));
    for (LayoutScore& s : zb_pool_) {
      if (seen.insert(tie_key(s.layout)).second) all.push_back(std::move(s));
    }
    zb_pool_.clear();
    auto by_time = [](const LayoutScore& a, const LayoutScore& b) {
      return better(a.mean_step_time_s, a.layout, b.mean_step_time_s, b.layout);
    };
    std::stable_sort(all.begin(), all.end(), by_time);
    auto kth = [&] {
      std::vector<double> times;
      for (const LayoutScore& s : all) times.push_back(s.mean_step_time_s);
      const size_t k = size_t(std::min<int64_t>(ctx_.o.top_k, int64_t(times.size())));
      std::nth_element(times.begin(), times.begin() + (k - 1), times.end());
      return times[k - 1];
    };
    for (LayoutScore& kept : all) {
      const Layout& l = kept.layout;
      if (l.colocated || l.llm.virtual_stages > 1 || l.order) continue;
      Layout z = l;
      z.order = PipelineOrder::ZeroBubbleH1;
      double bound = 0;
      for (int64_t b = 0; b < ctx_.x.num_batches; ++b) bound += batch_bound(ctx_, z, b);
      bound /= double(ctx_.x.num_batches);
      if (!(bound < std::min(kept.mean_step_time_s, kth()))) continue;
      bool feasible = false;
      LayoutScore score = eval_.score(z, &feasible, nullptr, nullptr);
      ++stats_.num_simulated;
      if (!feasible || !(score.mean_step_time_s < kept.mean_step_time_s)) continue;
      score.lower_bound_s = bound;
      kept = std::move(score);
    }
    std::stable_sort(all.begin(), all.end(), by_time);
    if (int64_t(all.size()) > ctx_.o.top_k) all.resize(size_t(ctx_.o.top_k));
    std::set<std::pair<TieKey, int>> kept;
    for (const LayoutScore& s : all) kept.insert({tie_key(s.layout), s.layout.order ? 1 : 0});
    for (const LayoutScore& s : plain) {
      if (!kept.count({tie_key(s.layout), 0})) all.push_back(s);
    }
    std::stable_sort(all.begin(), all.end(), by_time);
    best_ = std::move(all);
  }

  void insert(const Candidate& c, LayoutScore score) {
    ++stats_.num_simulated;
    score.lower_bound_s = ctx_.o.strategy == PlanStrategy::MeanShapeReference ? 0.0 : c.lower_bound;
    if (ctx_.o.strategy == PlanStrategy::MeanShapeReference) score.estimate_s = c.bound;
    if (ctx_.o.zero_bubble && ctx_.o.strategy == PlanStrategy::DataAware) keep_for_zb(score);
    best_.push_back(std::move(score));
    // The reference keeps its own ranking (by its estimate: candidates arrive in that
    // order), so that best[0] is its choice whatever top_k; re-sorting by simulated time
    // would let it pick among its top_k by simulation, which it does not do.
    if (ctx_.o.strategy == PlanStrategy::MeanShapeReference) return;
    std::sort(best_.begin(), best_.end(), [](const LayoutScore& a, const LayoutScore& b) {
      return better(a.mean_step_time_s, a.layout, b.mean_step_time_s, b.layout);
    });
    if (int64_t(best_.size()) > ctx_.o.top_k) best_.pop_back();
  }

  // The zero-bubble pool: the kZeroBubblePool x top_k best simulated layouts (try_zero_bubble).
  void keep_for_zb(const LayoutScore& score) {
    const size_t cap = size_t(kZeroBubblePool * ctx_.o.top_k);
    // A heap ordered by `better`: its front is the slowest kept.
    auto faster = [](const LayoutScore& a, const LayoutScore& b) {
      return better(a.mean_step_time_s, a.layout, b.mean_step_time_s, b.layout);
    };
    if (zb_pool_.size() < cap) {
      zb_pool_.push_back(score);
      std::push_heap(zb_pool_.begin(), zb_pool_.end(), faster);
    } else if (faster(score, zb_pool_.front())) {
      std::pop_heap(zb_pool_.begin(), zb_pool_.end(), faster);
      zb_pool_.back() = score;
      std::push_heap(zb_pool_.begin(), zb_pool_.end(), faster);
    }
  }

  // Offers a candidate to the current pass: All keeps it; Incumbent keeps the heap_size()
  // first in evaluation order; Collect keeps, of those whose key can beat the threshold
  // and which come after the floor (evaluated in an earlier round), the collect_size()
  // first in evaluation order (overflowed_: some were dropped for a later round).
  void consider(double key, double lower_bound, double order, const Layout& l) {
    if (counting()) ++stats_.num_bounded;
    Candidate c{key, lower_bound, order, l};
    if (pass_ == Pass::All) {
      cands_.push_back(std::move(c));
      return;
    }
    if (pass_ == Pass::Collect) {
      if (key > threshold_ || (floor_ != nullptr && !order_less(*floor_, c))) return;
    }
    const size_t cap = pass_ == Pass::Incumbent ? heap_size() : collect_size();
    if (cands_.size() < cap) {
      cands_.push_back(std::move(c));
      std::push_heap(cands_.begin(), cands_.end(), order_less);
    } else if (order_less(c, cands_.front())) {
      std::pop_heap(cands_.begin(), cands_.end(), order_less);
      cands_.back() = std::move(c);
      std::push_heap(cands_.begin(), cands_.end(), order_less);
      overflowed_ = true;
    } else {
      overflowed_ = true;
    }
  }
  // Whether a candidate ordered `order` (or later) may still enter the current pass.
  bool admits(double order) const {
    if (pass_ == Pass::All) return true;
    const size_t cap = pass_ == Pass::Incumbent ? heap_size() : collect_size();
    return cands_.size() < cap || order <= cands_.front().order;
  }
  // Statistics count what the first enumeration sees.
  bool counting() const { return pass_ != Pass::Collect; }
  size_t heap_size() const { return size_t(std::max<int64_t>(4 * ctx_.o.top_k, 32)); }
  size_t collect_size() const { return size_t(std::max<int64_t>(4 * ctx_.o.patience, 4096)); }

  // Checks memory with the smallest possible bins; returns false (and counts) if over.
  bool fits(const Layout& l) { return fits(eval_.memory_lower_bound(l)); }
  bool fits(const Evaluator::Memory& mem) {
    if (mem.peak <= ctx_.c.gpu_memory_bytes) return true;
    if (counting()) ++stats_.num_memory_rejected;
    note_shortfall(mem);
    return false;
  }

  std::vector<int64_t> microbatch_choices(int64_t dp) const {
    const int64_t max_m = ctx_.n / dp;
    std::vector<int64_t> out;
    if (ctx_.o.microbatch_choices.empty()) {
      out = default_microbatch_choices(max_m);
    } else {
      for (int64_t m : ctx_.o.microbatch_choices) {
        if (m >= 1 && m <= max_m) out.push_back(m);
      }
      std::sort(out.begin(), out.end());  // a repeated choice is one candidate
      out.erase(std::unique(out.begin(), out.end()), out.end());
    }
    return out;
  }

  void enumerate() {
    if (ctx_.o.strategy == PlanStrategy::DataBlindColocated ||
        (ctx_.o.strategy == PlanStrategy::DataAware && ctx_.o.colocated_candidates)) {
      enumerate_colocated();
    }
    if (ctx_.o.strategy != PlanStrategy::DataBlindColocated && ctx_.o.disaggregated_candidates) {
      enumerate_disaggregated();
    }
  }

  int64_t max_tp() const {
    return ctx_.o.max_tp > 0 ? std::min(ctx_.o.max_tp, ctx_.c.gpus_per_node) : ctx_.c.gpus_per_node;
  }
  int64_t encoder_max_tp() const {
    return ctx_.o.encoder_max_tp > 0 ? std::min(ctx_.o.encoder_max_tp, max_tp()) : max_tp();
  }
  bool encoder_gpus_allowed(int64_t v) const {
    const auto& allowed = ctx_.o.encoder_gpu_choices;
    return allowed.empty() || std::find(allowed.begin(), allowed.end(), v) != allowed.end();
  }

  void enumerate_colocated() {
    const int64_t N = ctx_.c.num_gpus;
    for (const auto& [d, recompute] :
         with_recompute(module_degrees(ctx_.c, *ctx_.llm.p, N, 0, max_tp()), ctx_.llm)) {
      // dflop's colocated candidates run in its runtime, which shards the encoder's heads
      // over the LLM's TP group without padding.
      if (ctx_.o.strategy == PlanStrategy::DataAware && ctx_.enc.p->num_heads % d.tp != 0) {
        continue;
      }
      Layout l;
      l.colocated = true;
      // The data-blind baseline splits layers uniformly (Megatron-LM); dflop balances
      // them with the encoder's load on the first stage.
      l.llm = make_module(ctx_.llm, d, 0,
                          ctx_.o.strategy == PlanStrategy::DataAware && ctx_.o.balanced_layer_split,
                          ctx_, recompute);
      l.llm.recompute = recompute;
      l.encoder.tp = d.tp;
      l.encoder.recompute = recompute;
      l.encoder.layers_per_stage = {ctx_.enc.p->num_layers};
      for (int64_t m : microbatch_choices(d.dp)) {
        l.num_microbatches = m;
        if (counting()) ++stats_.num_candidates;
        const double bound = colocated_bound(ctx_, l);
        if (pass_ == Pass::Collect && bound > threshold_) continue;
        if (!fits(l)) continue;
        consider(bound, bound, bound, l);
      }
    }
  }

  // The encoder layouts on v GPUs and the LLM layouts on the other N - v.
  void module_layouts(int64_t v, std::vector<ModuleLayout>* encs,
                      std::vector<ModuleLayout>* llms) const {
    const int64_t N = ctx_.c.num_gpus;
    const bool balanced = ctx_.o.balanced_layer_split;
    if (!encoder_gpus_allowed(v)) return;
    for (const auto& [d, recompute] :
         with_recompute(module_degrees(ctx_.c, *ctx_.enc.p, v, 0, encoder_max_tp()), ctx_.enc)) {
      encs->push_back(make_module(ctx_.enc, d, 0, balanced, ctx_));
      encs->back().recompute = recompute;
    }
    if (encs->empty()) return;
    const bool interleave = ctx_.o.strategy == PlanStrategy::DataAware;
    for (const auto& [d, recompute] :
         with_recompute(module_degrees(ctx_.c, *ctx_.llm.p, N - v, v, max_tp()), ctx_.llm)) {
      for (int64_t chunks : ctx_.o.virtual_stage_choices) {
        // Interleaving needs >= 2 stages and a layer per chunk (DataAware only).
        if (chunks > 1 && (!interleave || d.pp < 2 || d.pp * chunks > ctx_.llm.p->num_layers))
          continue;
        llms->push_back(make_module(ctx_.llm, d, v, balanced, ctx_, std::nullopt, chunks));
        llms->back().recompute = recompute;
      }
    }
  }

  // The microbatch counts an LLM layout can run (interleaved: multiples of its stages).
  std::vector<int64_t> llm_microbatch_choices(const ModuleLayout& g) const {
    std::vector<int64_t> out = microbatch_choices(g.dp);
    if (g.virtual_stages > 1) {
      out.erase(std::remove_if(out.begin(), out.end(), [&](int64_t m) { return m % g.pp != 0; }),
                out.end());
    }
    return out;
  }

  // Prune mode: the disaggregated candidates grouped in blocks of one encoder GPU count v
  // and one microbatch count m, each with lower bounds of its candidates' keys and orders
  // (from the per-module minima of their terms) and its size, sorted by order. Blocks whose
  // order bound cannot enter a full pass, or whose key bound exceeds the threshold, are
  // never enumerated pair by pair.
  struct Block {
    double order, key;
    int64_t v, m;
  };
  void build_blocks() {
    blocks_.clear();
    if (ctx_.o.strategy != PlanStrategy::DataAware) return;
    const int64_t N = ctx_.c.num_gpus;
    const double links = path_links(ctx_, 1, 1);  // the fewest stages: one each
    for (int64_t v = 1; v < N; ++v) {
      std::vector<ModuleLayout> encs, llms;
      module_layouts(v, &encs, &llms);
      if (encs.empty() || llms.empty()) continue;
      std::map<int64_t, std::pair<double, PathPart>> llm_min;  // m -> minima; count below
      std::map<int64_t, int64_t> llm_count;
      for (const ModuleLayout& g : llms) {
        for (int64_t m : llm_microbatch_choices(g)) {
          const double busy = module_bound(ctx_, ctx_.llm, g, m, false, 0.0);
          const PathPart part = module_path_mean(ctx_, ctx_.llm, g, m, false);
          auto [it, fresh] = llm_min.try_emplace(m, busy, part);
          if (!fresh)
            it->second = {std::min(it->second.first, busy), min_parts(it->second.second, part)};
          ++llm_count[m];
        }
      }
      for (const auto& [m, llm] : llm_min) {
        double enc_busy = kInf;
        PathPart enc;
        for (size_t ei = 0; ei < encs.size(); ++ei) {
          const double busy = module_bound(ctx_, ctx_.enc, encs[ei], m, true, 0.0);
          const PathPart part = module_path_mean(ctx_, ctx_.enc, encs[ei], m, true);
          enc_busy = std::min(enc_busy, busy);
          enc = ei == 0 ? part : min_parts(enc, part);
        }
        const Keys k = candidate_keys(ctx_, enc_busy, enc, llm.first, llm.second, links, m);
        blocks_.push_back({k.order, k.key, v, m});
        stats_.num_candidates += int64_t(encs.size()) * llm_count[m];
      }
    }
    std::sort(blocks_.begin(), blocks_.end(), [](const Block& a, const Block& b) {
      return std::tie(a.order, a.v, a.m) < std::tie(b.order, b.v, b.m);
    });
  }

  void enumerate_disaggregated() {
    if (pass_ == Pass::All) {
      for (int64_t v = 1; v < ctx_.c.num_gpus; ++v) enumerate_block(v, 0);
      return;
    }
    for (const Block& b : blocks_) {
      if (!admits(b.order)) break;  // later blocks come later in order still
      if (pass_ == Pass::Collect && b.key > threshold_) continue;
      enumerate_block(b.v, b.m);
    }
  }

  // The candidates with v encoder GPUs and m microbatches (m = 0: every m).
  void enumerate_block(int64_t v, int64_t only_m) {
    const bool reference = ctx_.o.strategy == PlanStrategy::MeanShapeReference;
    std::vector<ModuleLayout> encs, llms;
    module_layouts(v, &encs, &llms);
    if (encs.empty()) return;
    // Everything here is per module (and m): the bounds, and the memory lower bound's two
    // parts; a Layout is built only for candidates that are kept.
    std::map<std::pair<size_t, int64_t>, std::pair<double, PathPart>> enc_terms;  // (e, m)
    Layout l;
    for (const ModuleLayout& g : llms) {
      for (int64_t m : llm_microbatch_choices(g)) {
        if (only_m != 0 && m != only_m) continue;
        const double llm_busy = reference ? 0.0 : module_bound(ctx_, ctx_.llm, g, m, false, 0.0);
        const PathPart llm_part =
            reference ? PathPart{} : module_path_mean(ctx_, ctx_.llm, g, m, false);
        const Evaluator::InFlightTokens llm_tokens = eval_.llm_tokens_lower_bound(m, g.dp);
        const double llm_targets = eval_.llm_targets_lower_bound(m, g.dp);
        // The search's orders (pipeline_order_for) keep an LLM stage's activations
        // whatever the encoder's stages before it.
        l.encoder = ModuleLayout{};
        l.llm = g;
        l.num_microbatches = m;
        const Evaluator::Memory llm_mem = eval_.llm_memory(l, llm_tokens, llm_targets, {});
        for (size_t ei = 0; ei < encs.size(); ++ei) {
          const ModuleLayout& e = encs[ei];
          if (pass_ == Pass::All) ++stats_.num_candidates;
          Keys k{};
          if (reference) {
            l.encoder = e;
            l.llm = g;
            l.num_microbatches = m;
            k.bound = k.key = k.order = eval_.mean_shape_estimate(l);
          } else {
            auto it = enc_terms.find({ei, m});
            if (it == enc_terms.end()) {
              const double busy = module_bound(ctx_, ctx_.enc, e, m, true, 0.0);
              const PathPart part = module_path_mean(ctx_, ctx_.enc, e, m, true);
              it = enc_terms.emplace(std::make_pair(ei, m), std::make_pair(busy, part)).first;
            }
            const double links = path_links(ctx_, e.pp, g.pp);
            k = candidate_keys(ctx_, it->second.first, it->second.second, llm_busy, llm_part, links,
                               m);
            if (pass_ == Pass::Collect && k.key > threshold_) continue;
            if (!admits(k.order)) continue;
          }
          const Evaluator::InFlightTokens enc_tokens =
              eval_.enc_tokens_lower_bound(m, g.dp, false, e.dp);
          l.encoder = e;
          l.llm = g;
          l.num_microbatches = m;
          if (!fits(eval_.combine(eval_.encoder_memory(l, enc_tokens), llm_mem))) continue;
          consider(k.key, k.bound, k.order, l);
        }
      }
    }
  }

  // Every degree with and without full activation recomputation.
  // Each degree without and with recomputation (only without where the module's layers run
  // no backward: there is nothing to recompute).
  static std::vector<std::pair<Degrees, bool>> with_recompute(const std::vector<Degrees>& ds,
                                                              const ModuleModel& mm) {
    std::vector<std::pair<Degrees, bool>> out;
    for (bool recompute : {false, true}) {
      if (recompute && !mm.layers_backward()) break;
      for (const Degrees& d : ds) out.emplace_back(d, recompute);
    }
    return out;
  }

  const Context& ctx_;
  Evaluator eval_;
  std::vector<Candidate> cands_;
  std::vector<LayoutScore> best_;
  std::vector<LayoutScore> zb_pool_;  // with zero_bubble: see keep_for_zb
  PlannerStats stats_;
  MemoryShortfall shortfall_;
  // The pass enumerate() feeds (consider()): every candidate, the incumbent's, or a
  // collection round of the pruned search.
  enum class Pass { All, Incumbent, Collect };
  Pass pass_ = Pass::All;
  std::vector<Block> blocks_;
  double threshold_ = kInf;
  const Candidate* floor_ = nullptr;
  bool overflowed_ = false;
  int64_t exact_rejected_ = 0;
  std::map<CacheKey, std::vector<int64_t>> schedule_cache_;
  std::deque<CacheKey> cache_order_;
  size_t cache_bytes_ = 0;
  int64_t num_threads_ = 1;
};

}  // namespace

namespace detail {

PlanResult search_layouts(const Context& ctx) {
  Search search(ctx);
  return search.run();
}

}  // namespace detail
}  // namespace dflop
