// Planner: layer split, microbatch choices, validation, memory infeasibility, and pruning
// returning the same layouts as exhaustive evaluation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "check.hpp"
#include "dflop/errors.hpp"
#include "dflop/planner.hpp"

namespace {

using dflop::ClusterParams;
using dflop::ModuleParams;
using dflop::PlannerOptions;
using dflop::PlannerSamples;

struct Problem {
  ClusterParams cluster;
  ModuleParams encoder, llm;
  PlannerSamples samples;
  PlannerOptions options;
};

// A small deterministic workload: 2 batches of 24 samples, a heavy encoder tail.
Problem make_problem(int64_t num_gpus) {
  Problem p;
  p.cluster.num_gpus = num_gpus;
  p.cluster.gpus_per_node = 4;
  p.cluster.gpu_memory_bytes = 80e9;
  p.encoder = {8, 8, 1024, 12.6e6, 1e6, 4e6, 34.0 * 1024, 0.0, 1e-3};
  p.llm = {16, 16, 2048, 50e6, 64e6, 64e6, 34.0 * 2048, 4.0 * 32000, 2e-3};
  p.samples.num_batches = 2;
  p.samples.batch_size = 24;
  uint64_t state = 12345;
  auto next = [&state]() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return double(state >> 11) / double(1ULL << 53);
  };
  for (int64_t i = 0; i < 48; ++i) {
    const double units = i % 3 == 0 ? 0.0 : 1.0 + double(int64_t(next() * 10));
    const double seq = 200.0 + next() * 3000.0 + units * 100.0;
    p.samples.encoder_s.push_back(units * 0.05);
    p.samples.llm_s.push_back(seq * 1e-4);
    p.samples.encoder_last_fraction.push_back(units > 0 ? 0.05 : 0.0);
    p.samples.llm_last_fraction.push_back(0.1);
    p.samples.encoder_tokens.push_back(units * 729);
    p.samples.encoder_units.push_back(int64_t(units));
    p.samples.llm_tokens.push_back(seq);
    p.samples.visual_tokens.push_back(units * 100.0);
  }
  p.options.global_batch = 24;
  p.options.top_k = 3;
  return p;
}

bool same_module(const dflop::ModuleLayout& a, const dflop::ModuleLayout& b) {
  return a.tp == b.tp && a.pp == b.pp && a.dp == b.dp && a.first_rank == b.first_rank &&
         a.layers_per_stage == b.layers_per_stage && a.recompute == b.recompute;
}

bool same_layout(const dflop::Layout& a, const dflop::Layout& b) {
  return a.colocated == b.colocated && a.num_microbatches == b.num_microbatches &&
         same_module(a.encoder, b.encoder) && same_module(a.llm, b.llm);
}

dflop::PlanResult run(const Problem& p) {
  return dflop::plan_layouts(p.cluster, p.encoder, p.llm, p.samples, p.options);
}

TEST_CASE(split_layers_uniform_and_balanced) {
  CHECK(dflop::split_layers(10, 3, 1.0, 0.0, 0.0, false) == (std::vector<int64_t>{4, 3, 3}));
  CHECK(dflop::split_layers(10, 3, 1.0, 0.0, 2.0, true) == (std::vector<int64_t>{4, 4, 2}));
  // The first stage carries 3 layers' worth of extra load: the best max load is 5.
  const auto first_heavy = dflop::split_layers(10, 3, 1.0, 3.0, 0.0, true);
  CHECK_EQ(first_heavy[0] + first_heavy[1] + first_heavy[2], 10);
  CHECK_EQ(std::max({first_heavy[0] + 3, first_heavy[1], first_heavy[2]}), 5);
  CHECK(dflop::split_layers(5, 5, 1.0, 0.0, 9.0, true) == (std::vector<int64_t>{1, 1, 1, 1, 1}));
  CHECK_THROWS_AS(dflop::split_layers(3, 4, 1.0, 0.0, 0.0, true), dflop::InvalidArgument);
}

TEST_CASE(microbatch_choices) {
  CHECK(dflop::default_microbatch_choices(1) == (std::vector<int64_t>{1}));
  CHECK(dflop::default_microbatch_choices(16) == (std::vector<int64_t>{1, 2, 3, 4, 6, 8, 12, 16}));
  CHECK(dflop::default_microbatch_choices(0).empty());
}

TEST_CASE(pruning_equals_exhaustive) {
  for (int64_t gpus : {4, 8, 12}) {
    Problem p = make_problem(gpus);
    const auto pruned = run(p);
    p.options.prune = false;
    const auto full = run(p);
    CHECK_EQ(pruned.best.size(), full.best.size());
    for (size_t i = 0; i < pruned.best.size() && i < full.best.size(); ++i) {
      CHECK_EQ(pruned.best[i].mean_step_time_s, full.best[i].mean_step_time_s);
      CHECK_EQ(pruned.best[i].layout.llm.tp, full.best[i].layout.llm.tp);
      CHECK_EQ(pruned.best[i].layout.llm.pp, full.best[i].layout.llm.pp);
      CHECK_EQ(pruned.best[i].layout.num_microbatches, full.best[i].layout.num_microbatches);
      CHECK(pruned.best[i].mean_step_time_s >= pruned.best[i].lower_bound_s * (1 - 1e-12));
    }
    CHECK(pruned.stats.num_simulated <= full.stats.num_simulated);
    // Layouts sharing schedules are balanced once; pruning balances no more than that.
    CHECK(pruned.stats.num_balanced <= full.stats.num_balanced);
    CHECK(full.stats.num_balanced <= full.stats.num_scheduled * p.samples.num_batches);
  }
}

// The layout, every time, and the statistics do not depend on the number of threads; a
// larger batch so that waves hold several schedule groups.
TEST_CASE(threads_do_not_change_the_result) {
  for (bool prune : {true, false}) {
    Problem p = make_problem(16);
    p.options.prune = prune;
    p.options.num_threads = 1;
    const auto one = run(p);
    p.options.num_threads = 3;
    const auto three = run(p);
    CHECK_EQ(one.best.size(), three.best.size());
    for (size_t i = 0; i < one.best.size() && i < three.best.size(); ++i) {
      CHECK_EQ(one.best[i].mean_step_time_s, three.best[i].mean_step_time_s);
      CHECK_EQ(one.best[i].mean_idle_fraction, three.best[i].mean_idle_fraction);
      CHECK(same_layout(one.best[i].layout, three.best[i].layout));
    }
    CHECK_EQ(one.stats.num_simulated, three.stats.num_simulated);
    CHECK_EQ(one.stats.num_pruned, three.stats.num_pruned);
    CHECK_EQ(one.stats.num_balanced, three.stats.num_balanced);
    CHECK_EQ(one.stats.num_pruned_after_schedule, three.stats.num_pruned_after_schedule);
    CHECK(one.stats.num_scheduled >= one.stats.num_simulated);
  }
}

TEST_CASE(an_interrupt_check_stops_the_search) {
  Problem p = make_problem(16);
  int polls = 0;
  p.options.interrupted = [&polls] { return ++polls >= 2; };
  CHECK_THROWS_AS(run(p), dflop::Interrupted);
  CHECK_EQ(polls, 2);
  p.options.interrupted = [] { return false; };
  const auto checked = run(p);
  p.options.interrupted = nullptr;
  const auto plain = run(p);
  CHECK_EQ(checked.best.size(), plain.best.size());
  CHECK(same_layout(checked.best[0].layout, plain.best[0].layout));
}

TEST_CASE(layouts_respect_constraints) {
  const Problem p = make_problem(12);
  const auto result = run(p);
  CHECK(!result.best.empty());
  for (const auto& s : result.best) {
    const auto& l = s.layout;
    const int64_t llm_gpus = l.llm.tp * l.llm.pp * l.llm.dp;
    if (l.colocated) {
      CHECK_EQ(llm_gpus, 12);
    } else {
      const int64_t enc_gpus = l.encoder.tp * l.encoder.pp * l.encoder.dp;
      CHECK_EQ(enc_gpus + llm_gpus, 12);
      CHECK_EQ(l.llm.first_rank, enc_gpus);
      CHECK_EQ(l.llm.first_rank % l.llm.tp, 0);
      CHECK_EQ(p.cluster.gpus_per_node % l.encoder.tp, 0);
    }
    CHECK_EQ(p.cluster.gpus_per_node % l.llm.tp, 0);
    CHECK(l.num_microbatches * l.llm.dp <= p.options.global_batch);
    CHECK(s.peak_memory_bytes <= p.cluster.gpu_memory_bytes);
  }
}

TEST_CASE(memory_infeasible_reports_shortfall) {
  Problem p = make_problem(4);
  p.cluster.gpu_memory_bytes = 1e9;
  const auto result = run(p);
  CHECK(result.best.empty());
  CHECK(result.shortfall.found);
  CHECK(result.shortfall.needed_bytes > 1e9);
  CHECK(result.stats.num_memory_rejected > 0);
}

TEST_CASE(baselines_run) {
  Problem p = make_problem(8);
  p.options.strategy = dflop::PlanStrategy::DataBlindColocated;
  const auto blind = run(p);
  CHECK(!blind.best.empty());
  for (const auto& s : blind.best) CHECK(s.layout.colocated);
  p.options.strategy = dflop::PlanStrategy::MeanShapeReference;
  p.options.top_k = 1;
  const auto ref = run(p);
  CHECK_EQ(ref.best.size(), size_t{1});
  CHECK(ref.best[0].estimate_s > 0.0);
  p.options.strategy = dflop::PlanStrategy::DataAware;
  p.options.top_k = 1;
  CHECK(p.options.colocated_candidates && p.options.disaggregated_candidates);  // defaults
  const auto dflop_best = run(p);
  p.options.colocated_candidates = false;
  const auto disaggregated = run(p);
  CHECK(!disaggregated.best[0].layout.colocated);
  // With colocated candidates (the default) the data-aware search covers the baseline's
  // placement: where its TP degree divides the encoder's heads, its very layout.
  CHECK(dflop_best.best[0].mean_step_time_s <= disaggregated.best[0].mean_step_time_s);
  if (p.encoder.num_heads % blind.best[0].layout.llm.tp == 0) {
    CHECK(dflop_best.best[0].mean_step_time_s <= blind.best[0].mean_step_time_s);
  }
  // Colocated only: every candidate colocated, at a TP degree dividing the heads.
  p.options.colocated_candidates = true;
  p.options.disaggregated_candidates = false;
  p.options.top_k = 3;
  const auto colocated = run(p);
  CHECK(!colocated.best.empty());
  for (const auto& s : colocated.best) {
    CHECK(s.layout.colocated);
    CHECK_EQ(p.encoder.num_heads % s.layout.llm.tp, int64_t{0});
  }
}

TEST_CASE(colocated_encoder_heads_are_padded) {
  CHECK_EQ(dflop::padded_heads(25, 8), int64_t{32});
  CHECK_EQ(dflop::padded_heads(25, 1), int64_t{25});
  CHECK_EQ(dflop::padded_heads(16, 4), int64_t{16});
  // An encoder with 5 heads: only tp = 1 divides them, but the colocated baseline may run
  // it at tp = 2 or 4 with padded heads (6, 8), paying for them.
  Problem p = make_problem(8);
  p.encoder.num_heads = 5;
  p.encoder.attention_compute_fraction = 0.4;
  p.encoder.attention_param_fraction = 0.3;
  p.encoder.attention_activation_fraction = 0.25;
  p.options.strategy = dflop::PlanStrategy::DataBlindColocated;
  p.options.top_k = 100;
  const auto blind = run(p);
  bool padded_tp = false;
  for (const auto& s : blind.best) padded_tp = padded_tp || s.layout.llm.tp > 1;
  CHECK(padded_tp);
  // The same layout costs more with 5 heads padded to 8 than with 8 real heads, by the
  // documented scaling: compute x (1 + 0.4 x 0.6), params x (1 + 0.3 x 0.6), ...
  dflop::Layout l;
  l.colocated = true;
  l.llm = {4, 2, 1, 0, {8, 8}, false};
  l.encoder.tp = 4;
  l.encoder.layers_per_stage = {8};
  l.num_microbatches = 4;
  const auto padded = dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l);
  Problem q = p;
  q.encoder.num_heads = 8;
  const auto plain = dflop::evaluate_layout(q.cluster, q.encoder, q.llm, q.samples, q.options, l);
  CHECK(padded.mean_step_time_s > plain.mean_step_time_s);
  CHECK(padded.peak_memory_bytes > plain.peak_memory_bytes);
  // No attention share: padding is free.
  q = p;
  q.encoder.attention_compute_fraction = 0.0;
  q.encoder.attention_param_fraction = 0.0;
  q.encoder.attention_activation_fraction = 0.0;
  const auto free_pad =
      dflop::evaluate_layout(q.cluster, q.encoder, q.llm, q.samples, q.options, l);
  CHECK_EQ(free_pad.mean_step_time_s, plain.mean_step_time_s);
  CHECK_EQ(free_pad.peak_memory_bytes, plain.peak_memory_bytes);
  // The encoder's model states grow by 0.3 x 0.6 of its layer parameters (over tp = 4).
  const double extra_states = 16.0 * 0.3 * 0.6 * p.encoder.params_per_layer * 8 / 4;
  CHECK(std::abs(padded.peak_memory_bytes - plain.peak_memory_bytes) >= 0.5 * extra_states);
  q = p;
  q.encoder.attention_param_fraction = 1.5;
  CHECK_THROWS_AS(run(q), dflop::InvalidArgument);
}

TEST_CASE(the_lm_head_holds_one_chunk_of_the_targets_logits) {
  // One encoder GPU, one LLM GPU (pp = 1, so its stage is the last): the LM head's working
  // set is min(largest bin's targets, chunk) rows of head_bytes_per_target_token, once.
  Problem p = make_problem(2);
  p.options.global_batch = 24;
  dflop::Layout l;
  l.encoder = {1, 1, 1, 0, {8}, false};
  l.llm = {1, 1, 1, 1, {16}, false};
  l.num_microbatches = 4;
  p.samples.llm_target_tokens.assign(p.samples.llm_tokens.size(), 0.0);
  p.llm.head_bytes_per_target_token = 1e6;
  const auto none = dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l);
  for (size_t k = 0; k < p.samples.llm_tokens.size(); ++k) {
    p.samples.llm_target_tokens[k] = std::floor(p.samples.llm_tokens[k] / 10.0);
  }
  p.llm.head_chunk_tokens = 0;  // no chunking: every target of the bin at once
  const auto whole = dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l);
  p.llm.head_chunk_tokens = 64;
  const auto chunked = dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l);
  CHECK_EQ(chunked.peak_memory_bytes - none.peak_memory_bytes, 64 * 1e6);
  CHECK(whole.peak_memory_bytes - none.peak_memory_bytes > 200 * 1e6);  // bins of >= 200
  // Timing does not depend on where memory goes; without targets the head costs nothing.
  CHECK_EQ(chunked.mean_step_time_s, none.mean_step_time_s);
  // Element bytes in [1, 8]; a chunk of >= 0 rows.
  p.llm.element_bytes = 0.5;
  CHECK_THROWS_AS(run(p), dflop::InvalidArgument);
  p.llm.head_chunk_tokens = -1;
  p.llm.element_bytes = 4.0;
  CHECK_THROWS_AS(run(p), dflop::InvalidArgument);
}

TEST_CASE(memory_holds_the_largest_microbatches_in_flight) {
  // Encoder (pp 1) then LLM (pp 1): the encoder's stage keeps 2 microbatches in flight,
  // the LLM's 1. With every sample its own microbatch, the encoder stage holds the two
  // largest samples' activations (not twice the largest), the LLM stage the largest and
  // the head's logits.
  Problem p = make_problem(2);
  dflop::Layout l;
  l.encoder = {1, 1, 1, 0, {8}, false};
  l.llm = {1, 1, 1, 1, {16}, false};
  l.num_microbatches = 24;
  std::vector<std::vector<int64_t>> bins(2);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 24; ++i) bins[size_t(b)].push_back(i);
  }
  const auto score =
      dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l, &bins);
  double top2 = 0, enc_top1 = 0, top1 = 0;  // the two largest of either batch; the largest
  for (int64_t b = 0; b < 2; ++b) {
    std::vector<double> e(p.samples.encoder_tokens.begin() + b * 24,
                          p.samples.encoder_tokens.begin() + (b + 1) * 24);
    std::sort(e.rbegin(), e.rend());
    top2 = std::max(top2, e[0] + e[1]);
    enc_top1 = std::max(enc_top1, e[0]);
    for (int64_t i = 0; i < 24; ++i)
      top1 = std::max(top1, p.samples.llm_tokens[size_t(b * 24 + i)]);
  }
  const auto& q = p.encoder;
  const double enc_states =
      16.0 * (q.params_per_layer * 8 + q.first_stage_params + q.last_stage_params);
  const double enc_expected = enc_states + top2 * 8 * q.activation_bytes_per_token_layer;
  CHECK_EQ(score.stage_memory_bytes.size(), size_t{2});
  CHECK(std::abs(score.stage_memory_bytes[0] - enc_expected) <= 1e-9 * enc_expected);
  const auto& g = p.llm;
  const double llm_expected =
      16.0 * (g.params_per_layer * 16 + g.first_stage_params + g.last_stage_params) +
      top1 * 16 * g.activation_bytes_per_token_layer +
      top1 * g.head_bytes_per_target_token;  // no target column: every token a target
  CHECK(std::abs(score.stage_memory_bytes[1] - llm_expected) <= 1e-9 * llm_expected);
  // The encoder's first stage holds the pixels of all its microbatches of a step (read
  // before it starts): the batch with the most encoder tokens.
  double step_tokens = 0;
  for (int64_t b = 0; b < 2; ++b) {
    step_tokens = std::max(step_tokens,
                           std::accumulate(p.samples.encoder_tokens.begin() + b * 24,
                                           p.samples.encoder_tokens.begin() + (b + 1) * 24, 0.0));
  }
  p.encoder.input_bytes_per_token = 1000.0;
  const auto with_inputs =
      dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l, &bins);
  const double enc_inputs = with_inputs.stage_memory_bytes[0] - score.stage_memory_bytes[0];
  CHECK(std::abs(enc_inputs - 1000.0 * step_tokens) <= 1e-9 * enc_inputs);
  CHECK_EQ(with_inputs.stage_memory_bytes[1], score.stage_memory_bytes[1]);
  // Full recomputation: each layer's input (element_bytes x hidden per token) in flight,
  // and the one layer the backward remakes, of the largest microbatch.
  l.encoder.recompute = true;
  const auto remade =
      dflop::evaluate_layout(p.cluster, p.encoder, p.llm, p.samples, p.options, l, &bins);
  const double enc_remade = enc_states + 1000.0 * step_tokens +
                            top2 * 8 * q.element_bytes * double(q.hidden_size) +
                            enc_top1 * q.activation_bytes_per_token_layer;
  CHECK(std::abs(remade.stage_memory_bytes[0] - enc_remade) <= 1e-9 * enc_remade);
}

TEST_CASE(validation_names_the_problem) {
  Problem p = make_problem(8);
  p.options.global_batch = 10;
  CHECK_THROWS_AS(run(p), dflop::InvalidArgument);
  p = make_problem(8);
  p.samples.llm_s[3] = -1.0;
  CHECK_THROWS_AS(run(p), dflop::InvalidArgument);
  p = make_problem(8);
  p.cluster.num_gpus = 1;
  CHECK_THROWS_AS(run(p), dflop::InvalidArgument);
  p = make_problem(8);
  p.options.screen_factor = 1.5;
  CHECK_THROWS_WITH(run(p), dflop::InvalidArgument, "screen_factor");
  p = make_problem(8);
  p.options.patience = -1;
  CHECK_THROWS_WITH(run(p), dflop::InvalidArgument, "patience");
  p = make_problem(8);
  p.samples.encoder_units[5] = 0;  // encoder time without units
  CHECK_THROWS_WITH(run(p), dflop::InvalidArgument, "encoder_units[5]=0");
}

// Screening off, patience off, and the exhaustive search give the same layouts; screening
// and patience on keep every candidate's key above its lower bound.
TEST_CASE(screening_and_patience_keep_the_best) {
  for (int64_t gpus : {8, 12}) {
    Problem p = make_problem(gpus);
    p.options.prune = false;
    const auto full = run(p);
    p.options.prune = true;
    for (double screen : {0.0, 0.9}) {
      for (int64_t patience : {0, 1000}) {
        p.options.screen_factor = screen;
        p.options.patience = patience;
        const auto got = run(p);
        CHECK_EQ(got.best.size(), full.best.size());
        CHECK(!got.stats.stopped_by_patience);
        CHECK_EQ(got.stats.num_unexplored, 0);
        for (size_t i = 0; i < got.best.size() && i < full.best.size(); ++i) {
          CHECK_EQ(got.best[i].mean_step_time_s, full.best[i].mean_step_time_s);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
