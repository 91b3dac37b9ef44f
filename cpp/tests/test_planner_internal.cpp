// Planner internals (cpp/src/planner_internal.hpp), called directly: the evaluator on a
// tiny hand-computed case, and the lower bounds never above the simulated step time of the
// layouts they would prune, on a few hundred small random problems.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "dflop/planner.hpp"
#include "planner_internal.hpp"
#include "rng.hpp"

namespace {

using dflop::ClusterParams;
using dflop::Layout;
using dflop::ModuleLayout;
using dflop::ModuleParams;
using dflop::PlannerOptions;
using dflop::PlannerSamples;
using dflop::detail::Context;
using dflop::detail::Evaluator;

// Relative tolerance of "bound <= step time" (the two sum the same terms in another order).
constexpr double kRel = 1e-9;

struct Problem {
  ClusterParams cluster;
  ModuleParams encoder, llm;
  PlannerSamples samples;
  PlannerOptions options;
};

ModuleLayout module_layout(int64_t tp, int64_t pp, int64_t dp, int64_t first_rank,
                           std::vector<int64_t> layers) {
  ModuleLayout m;
  m.tp = tp;
  m.pp = pp;
  m.dp = dp;
  m.first_rank = first_rank;
  m.layers_per_stage = std::move(layers);
  return m;
}

// 2 GPUs (encoder tp = pp = dp = 1, LLM the same), one batch of 2 samples, one sample per
// microbatch, forward = backward, no constants, latency or transfers, TP off:
//   sample 0: encoder 2 s, LLM 4 s;  sample 1: encoder 4 s, LLM 2 s.
Problem tiny_problem() {
  Problem p;
  p.cluster.num_gpus = 2;
  p.cluster.gpus_per_node = 2;
  p.cluster.gpu_memory_bytes = 1e12;
  p.cluster.link_latency_s = 0.0;
  p.encoder.num_layers = 2;
  p.llm.num_layers = 2;
  p.encoder.forward_fraction = 0.5;
  p.llm.forward_fraction = 0.5;
  p.samples.num_batches = 1;
  p.samples.batch_size = 2;
  p.samples.encoder_s = {2.0, 4.0};
  p.samples.llm_s = {4.0, 2.0};
  p.samples.encoder_last_fraction = {0.0, 0.0};
  p.samples.llm_last_fraction = {0.0, 0.0};
  p.samples.encoder_tokens = {10.0, 20.0};
  p.samples.encoder_units = {1, 1};
  p.samples.llm_tokens = {30.0, 40.0};
  p.samples.visual_tokens = {0.0, 0.0};
  p.options.global_batch = 2;
  return p;
}

Layout tiny_layout() {
  Layout l;
  l.encoder = module_layout(1, 1, 1, 0, {2});
  l.llm = module_layout(1, 1, 1, 1, {2});
  l.num_microbatches = 2;
  return l;
}

TEST_CASE(evaluator_matches_a_hand_computed_step) {
  const Problem p = tiny_problem();
  dflop::validate_planner_input(p.cluster, p.encoder, p.llm, p.samples, p.options);
  const Context ctx(p.cluster, p.encoder, p.llm, p.samples, p.options);
  const Evaluator eval(ctx);
  const Layout l = tiny_layout();

  // Per-sample stage seconds: (encoder, LLM) per sample, the whole module on one stage.
  CHECK(eval.sample_stage_costs(l, 0) == (std::vector<double>{2.0, 4.0, 4.0, 2.0}));
  const std::array<double, 2> constants = eval.stage_constants(l);
  CHECK_EQ(constants[0], 0.0);
  CHECK_EQ(constants[1], 0.0);

  // Microbatch 0 = sample 0 (E 1+1, L 2+2), microbatch 1 = sample 1 (E 2+2, L 1+1). 1F1B:
  //   encoder: F0 [0,1] F1 [1,3]           B0 [5,6]       B1 [7,9]
  //   LLM:            F0 [1,3] B0 [3,5] F1 [5,6] B1 [6,7]
  // so the step takes 9 s; 12 busy GPU-seconds of 18: idle 1/3.
  const std::vector<std::vector<int64_t>> given = {{0, 1}};
  bool feasible = false;
  Evaluator::Memory mem;
  const dflop::LayoutScore s = eval.score(l, &feasible, &mem, &given);
  CHECK(feasible);
  CHECK_NEAR(s.mean_step_time_s, 9.0, 1e-12);
  CHECK_NEAR(s.mean_step_time_as_scheduled_s, 9.0, 1e-12);
  CHECK_EQ(s.steps.size(), size_t(1));
  CHECK_NEAR(s.steps[0].idle_fraction, 1.0 / 3.0, 1e-12);
  CHECK_EQ(s.steps[0].stage_compute_s.size(), size_t(2));
  CHECK_NEAR(s.steps[0].stage_compute_s[0], 6.0, 1e-12);
  CHECK_NEAR(s.steps[0].stage_compute_s[1], 6.0, 1e-12);
  CHECK_EQ(s.steps[0].transfer_s, 0.0);

  // The planner's own schedule puts one sample in each microbatch too: the same 9 s.
  const dflop::LayoutScore own = eval.score(l, &feasible, &mem);
  CHECK(feasible);
  CHECK_NEAR(own.mean_step_time_s, 9.0, 1e-12);

  // The first bound: each module's busy time (6 s on one replica) and the path of a mean
  // microbatch (3 s encoder + 3 s LLM); the key equals it without screening.
  CHECK_NEAR(dflop::detail::batch_bound(ctx, l, 0), 6.0, 1e-12);
  CHECK_NEAR(dflop::detail::module_bound(ctx, ctx.llm, l.llm, 2, false, 0.0), 6.0, 1e-12);
  CHECK_NEAR(dflop::detail::module_bound(ctx, ctx.enc, l.encoder, 2, true, 0.0), 6.0, 1e-12);
  CHECK_NEAR(dflop::detail::module_path_mean(ctx, ctx.enc, l.encoder, 2, true).path, 3.0, 1e-12);
  CHECK_NEAR(dflop::detail::module_path_mean(ctx, ctx.llm, l.llm, 2, false).path, 3.0, 1e-12);
  CHECK_EQ(dflop::detail::path_links(ctx, l.encoder.pp, l.llm.pp), 0.0);
  // The replica bound sees the fill and drain the first bound misses; the single-replica
  // simulation is the step itself here.
  const Evaluator::Prepared prepared =
      eval.prepare(l, {eval.bin_sums(l, 0, std::vector<int64_t>{0, 1})});
  CHECK(prepared.feasible);
  CHECK_NEAR(eval.replica_bound(l, prepared.sums[0], dflop::detail::kInf), 9.0, 1e-12);

  // The public entry point agrees.
  const dflop::LayoutScore pub =
      dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l, &given);
  CHECK_EQ(pub.mean_step_time_s, s.mean_step_time_s);
  CHECK_NEAR(pub.lower_bound_s, 6.0, 1e-12);
}

// ---------------------------------------------------------------------------------------
// Random small problems

int64_t pick(dflop::SplitMix64& rng, int64_t lo, int64_t hi) {  // uniform in [lo, hi]
  return lo + int64_t(rng.below(uint64_t(hi - lo + 1)));
}

double uniform(dflop::SplitMix64& rng, double lo, double hi) {
  return lo + (hi - lo) * rng.uniform();
}

ModuleParams random_module(dflop::SplitMix64& rng, int64_t max_layers) {
  static const int64_t kHeads[] = {1, 2, 3, 4, 6, 8};
  ModuleParams m;
  m.num_layers = pick(rng, 1, max_layers);
  m.num_heads = kHeads[rng.below(6)];
  m.hidden_size = pick(rng, 8, 256);
  m.params_per_layer = uniform(rng, 0.0, 1e6);
  m.first_stage_params = uniform(rng, 0.0, 1e6);
  m.last_stage_params = uniform(rng, 0.0, 1e6);
  m.activation_bytes_per_token_layer = uniform(rng, 0.0, 1e4);
  m.head_bytes_per_target_token = uniform(rng, 0.0, 1e4);
  m.microbatch_constant_s = rng.below(2) ? uniform(rng, 0.0, 0.05) : 0.0;
  m.attention_compute_fraction = rng.uniform();
  m.attention_param_fraction = rng.uniform();
  m.attention_activation_fraction = rng.uniform();
  m.forward_fraction = uniform(rng, 0.2, 0.6);
  m.head_chunk_tokens = rng.below(2) ? pick(rng, 1, 64) : 0;
  m.element_bytes = rng.below(2) ? 2.0 : 4.0;
  m.input_bytes_per_token = uniform(rng, 0.0, 100.0);
  return m;
}

Problem random_problem(dflop::SplitMix64& rng) {
  static const int64_t kGpn[] = {1, 2, 4};
  Problem p;
  p.cluster.gpus_per_node = kGpn[rng.below(3)];
  p.cluster.num_gpus = pick(rng, 2, 8);
  p.cluster.gpu_memory_bytes = rng.below(6) ? 1e12 : uniform(rng, 1e6, 1e9);
  p.cluster.intra_node_bandwidth_bytes_per_s = uniform(rng, 1e9, 1e11);
  p.cluster.inter_node_bandwidth_bytes_per_s = uniform(rng, 1e8, 1e10);
  p.cluster.link_latency_s = rng.below(2) ? uniform(rng, 0.0, 1e-3) : 0.0;
  p.cluster.tp_gemm_loss = uniform(rng, 0.0, 0.2);
  p.encoder = random_module(rng, 4);
  p.llm = random_module(rng, 8);
  PlannerSamples& x = p.samples;
  x.num_batches = pick(rng, 1, 3);
  x.batch_size = pick(rng, 1, 10);
  for (int64_t i = 0; i < x.num_batches * x.batch_size; ++i) {
    const int64_t units = rng.below(4) ? pick(rng, 1, 4) : 0;
    x.encoder_units.push_back(units);
    x.encoder_s.push_back(units > 0 ? uniform(rng, 0.0, 1.0) : 0.0);
    x.encoder_last_fraction.push_back(uniform(rng, 0.0, 0.3));
    x.encoder_tokens.push_back(double(units) * uniform(rng, 1.0, 500.0));
    x.llm_s.push_back(uniform(rng, 0.01, 1.0));
    x.llm_last_fraction.push_back(uniform(rng, 0.0, 0.3));
    x.llm_tokens.push_back(uniform(rng, 1.0, 2000.0));
    x.visual_tokens.push_back(double(units) * uniform(rng, 0.0, 100.0));
  }
  PlannerOptions& o = p.options;
  o.global_batch = x.batch_size;
  o.strategy = dflop::PlanStrategy(rng.below(3));
  o.encoder_split = dflop::EncoderSplit(rng.below(3));
  o.order_microbatches = rng.below(2) == 1;
  o.zero1 = rng.below(2) == 1;
  o.seed = rng.next();
  o.screen_factor = 0.0;
  return p;
}

struct Degrees {
  int64_t tp, pp, dp;
};

// (tp, pp, dp) of a module on `gpus` GPUs from first_rank, with dp <= max_dp.
std::vector<Degrees> degrees(const ClusterParams& c, const ModuleParams& p, int64_t gpus,
                             int64_t first_rank, int64_t max_dp) {
  std::vector<Degrees> out;
  for (int64_t tp = 1; tp <= gpus; ++tp) {
    if (c.gpus_per_node % tp || p.num_heads % tp || gpus % tp || first_rank % tp) continue;
    for (int64_t pp = 1; pp <= std::min(gpus / tp, p.num_layers); ++pp) {
      if ((gpus / tp) % pp || gpus / tp / pp > max_dp) continue;
      out.push_back({tp, pp, gpus / tp / pp});
    }
  }
  return out;
}

std::vector<int64_t> random_split(dflop::SplitMix64& rng, int64_t layers, int64_t stages) {
  return dflop::split_layers(layers, stages, uniform(rng, 0.0, 1.0), 0.0, uniform(rng, 0.0, 2.0),
                             rng.below(2) == 1);
}

// A random layout that check_layout accepts; false if none was drawn.
bool random_layout(dflop::SplitMix64& rng, const Problem& p, Layout* out) {
  const ClusterParams& c = p.cluster;
  const int64_t N = c.num_gpus, batch = p.samples.batch_size;
  Layout l;
  l.colocated = rng.below(3) == 0;
  if (l.colocated) {
    const std::vector<Degrees> ds = degrees(c, p.llm, N, 0, batch);
    if (ds.empty()) return false;
    const Degrees d = ds[rng.below(ds.size())];
    l.llm = module_layout(d.tp, d.pp, d.dp, 0, random_split(rng, p.llm.num_layers, d.pp));
    l.llm.recompute = rng.below(2) == 1;
    l.encoder = module_layout(d.tp, 1, 1, 0, {p.encoder.num_layers});
    l.num_microbatches = pick(rng, 1, batch / d.dp);
  } else {
    const int64_t v = pick(rng, 1, N - 1);
    const std::vector<Degrees> es = degrees(c, p.encoder, v, 0, N);
    const std::vector<Degrees> gs = degrees(c, p.llm, N - v, v, batch);
    if (es.empty() || gs.empty()) return false;
    const Degrees e = es[rng.below(es.size())], g = gs[rng.below(gs.size())];
    l.encoder = module_layout(e.tp, e.pp, e.dp, 0, random_split(rng, p.encoder.num_layers, e.pp));
    l.encoder.recompute = rng.below(2) == 1;
    const int64_t max_m = batch / g.dp;
    int64_t chunks = 1;
    if (g.pp >= 2 && max_m >= g.pp && p.llm.num_layers >= 2 * g.pp && rng.below(4)) chunks = 2;
    l.llm = module_layout(g.tp, g.pp, g.dp, v, random_split(rng, p.llm.num_layers, g.pp * chunks));
    l.llm.virtual_stages = chunks;
    l.llm.recompute = rng.below(2) == 1;
    l.num_microbatches = chunks > 1 ? g.pp * pick(rng, 1, max_m / g.pp) : pick(rng, 1, max_m);
  }
  *out = l;
  return true;
}

// Every lower bound the search prunes with, against the evaluator's simulated step time of
// the same layout: per batch (the first bound and the replica bound), over the batches (the
// per-module bounds and the path), and the memory lower bound against the exact memory.
TEST_CASE(bounds_never_exceed_the_simulated_step) {
  int64_t scored = 0, colocated = 0, infeasible = 0, interleaved = 0, floor_above_exact = 0;
  for (uint64_t seed = 1; seed <= 500; ++seed) {
    dflop::SplitMix64 rng(seed * 0x9E3779B97F4A7C15ULL);
    const Problem p = random_problem(rng);
    Layout l;
    if (!random_layout(rng, p, &l)) continue;
    const std::string where = "seed " + std::to_string(seed);
    CHECK_NOTHROW(dflop::validate_planner_input(p.cluster, p.encoder, p.llm, p.samples, p.options));
    const Context ctx(p.cluster, p.encoder, p.llm, p.samples, p.options);
    const Evaluator eval(ctx);
    const int64_t B = p.samples.num_batches, m = l.num_microbatches;

    std::vector<dflop::detail::BinSums> sums;
    for (int64_t b = 0; b < B; ++b) sums.push_back(eval.bin_sums(l, b, eval.assign(l, b)));
    const Evaluator::Prepared prepared = eval.prepare(l, sums);
    // The memory floor the search rejects layouts with before balancing them. Interleaved
    // LLMs: peak_in_flight counts (chunk, microbatch) pairs, up to m x chunks; the floor
    // takes k x an average microbatch for k of them, the exact check at most the sum of all
    // m microbatches (InFlightTokens::at clamps k to m), so the floor can exceed it.
    const Evaluator::Memory floor = eval.memory_lower_bound(l);
    if (l.llm.virtual_stages > 1) {
      floor_above_exact += floor.peak > prepared.mem.peak * (1 + kRel);
    } else {
      CHECK_MSG(floor.peak <= prepared.mem.peak * (1 + kRel), where);
    }
    bool feasible = false;
    Evaluator::Memory mem;
    const dflop::LayoutScore s = eval.score(l, &feasible, &mem);
    CHECK_EQ(feasible, prepared.feasible);
    CHECK_EQ(mem.peak, prepared.mem.peak);
    if (!feasible) {
      ++infeasible;
      continue;
    }
    ++scored;
    colocated += l.colocated;
    interleaved += l.llm.virtual_stages > 1;
    CHECK_EQ(s.mean_step_time_s, eval.finish(l, prepared).mean_step_time_s);

    double first_sum = 0;
    for (int64_t b = 0; b < B; ++b) {
      const double step = s.steps[size_t(b)].step_time_s;
      const double first = dflop::detail::batch_bound(ctx, l, b);
      first_sum += first;
      CHECK_MSG(first <= step * (1 + kRel), where + " batch " + std::to_string(b) + ": bound " +
                                                std::to_string(first) + " > step " +
                                                std::to_string(step));
      // Without screening the search's key is the bound itself.
      CHECK_EQ(dflop::detail::batch_key(ctx, l, b), first);
      // The second bound, with and without the simulated replicas.
      const double replica = eval.replica_bound(l, prepared.sums[size_t(b)], dflop::detail::kInf);
      CHECK_MSG(replica <= step * (1 + kRel), where + " batch " + std::to_string(b) +
                                                  ": replica bound " + std::to_string(replica) +
                                                  " > step " + std::to_string(step));
      const double paths = eval.replica_bound(l, prepared.sums[size_t(b)], -1.0);
      CHECK_MSG(paths <= step * (1 + kRel), where);
    }
    const double mean = s.mean_step_time_s;
    CHECK_MSG(first_sum / double(B) <= mean * (1 + kRel), where);
    if (l.colocated) {
      CHECK_MSG(dflop::detail::colocated_bound(ctx, l) <= mean * (1 + kRel), where);
      continue;
    }
    // The candidate's bound as the search builds it from per-module terms.
    const double llm_busy = dflop::detail::module_bound(ctx, ctx.llm, l.llm, m, false, 0.0);
    const double enc_busy = dflop::detail::module_bound(ctx, ctx.enc, l.encoder, m, true, 0.0);
    const dflop::detail::PathPart enc =
        dflop::detail::module_path_mean(ctx, ctx.enc, l.encoder, m, true);
    const dflop::detail::PathPart llm =
        dflop::detail::module_path_mean(ctx, ctx.llm, l.llm, m, false);
    const dflop::detail::Keys k =
        dflop::detail::candidate_keys(ctx, enc_busy, enc, llm_busy, llm,
                                      dflop::detail::path_links(ctx, l.encoder.pp, l.llm.pp), m);
    CHECK_MSG(k.bound <= mean * (1 + kRel), where + ": candidate bound " + std::to_string(k.bound) +
                                                " > mean step " + std::to_string(mean));
    CHECK_EQ(k.key, k.bound);  // screen_factor = 0
    CHECK_GE(k.order, k.key);
    // The per-module minima bound every member of a block from below.
    const dflop::detail::PathPart lower = dflop::detail::min_parts(enc, llm);
    CHECK_LE(lower.path, std::min(enc.path, llm.path));
  }
  // The property must have been exercised on enough layouts of every kind.
  KNOWN_BUG(floor_above_exact == 0,
            "interleaved LLM layouts: Evaluator::memory_lower_bound above the exact memory "
            "check (InFlightTokens::at clamps peak_in_flight's (chunk, microbatch) pairs to m)");
  CHECK_GE(scored, 250);
  CHECK_GE(colocated, 20);
  CHECK_GE(interleaved, 5);
  CHECK_GE(infeasible, 1);
  std::printf(
      "bounds: %lld layouts scored (%lld colocated, %lld interleaved), %lld infeasible; "
      "memory floor above the exact check on %lld interleaved\n",
      (long long)scored, (long long)colocated, (long long)interleaved, (long long)infeasible,
      (long long)floor_above_exact);
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
