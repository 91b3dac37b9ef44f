// Pipeline-aware refinement of a balanced schedule: choose which samples share a
// microbatch, and the order the microbatches run in, so that the SIMULATED step of the
// module pipeline (encoder stages, then LLM stages, under 1F1B) is as short as possible.
//
// Why balance() alone is not enough: it minimises each dimension's largest microbatch load
// separately, but a pipeline in which the encoder feeds the LLM runs, in steady state, at
// the pace of the slower module in every microbatch, so a step is about
//   fill + sum_j max_c load(j, c) + drain.
// Two schedules with the same per-dimension makespan can differ a lot: one that puts two
// encoder-heavy samples (images) in one microbatch and two LLM-heavy ones (long texts) in
// another idles both modules. The refinement starts from the balanced schedule and keeps
// every microbatch's load within max_growth x the balanced makespan (and the capacities),
// so the memory bound that the balance guaranteed is kept.
//
// Model: dimension c of the costs is module c of the pipeline, in order; module c has
// stages[c] consecutive stages and each of them takes cost(i, c) seconds for sample i (the
// module's work split evenly over its stages) plus microbatch_constant_s[c] per microbatch
// that has work for it (cost sum > 0: an encoder does nothing for a text-only microbatch);
// a fraction forward_fraction[c] of it is the forward. Links add link_latency_s per
// transfer. The step is simulated with simulate_pipeline()'s semantics (1F1B, or
// interleaved 1F1B where the last module has chunks), once per
// data-parallel replica (bin b = microbatch b / dp_size on replica b % dp_size;
// microbatch_dims are shared by all replicas of a microbatch, as in balance()); the
// slowest replica counts. A microbatch dimension c with replicas[c] > 1 is a module whose
// replicas[c] data-parallel replicas share each microbatch BY VISUAL UNIT, as the runtime
// executes it: its stage time is the slowest replica's under split_units() (sample i has
// units[i] units of cost(i, c) / units[i] each; encoder_split.hpp), and its capacity and
// growth bound apply to the microbatch's cost sum / replicas[c].
#pragma once

#include <cstdint>
#include <vector>

#include "dflop/errors.hpp"

namespace dflop {

struct PipelineScheduleOptions {
  int64_t num_microbatches = 1;
  int64_t dp_size = 1;
  std::vector<int64_t> microbatch_dims;
  // Empty (all 1), or per dimension: replicas sharing each microbatch by unit (> 1 only for
  // microbatch dims). Needs `units`.
  std::vector<int64_t> replicas;
  // Empty, or per sample: its visual units (a sample with cost in a replicated dimension
  // needs units > 0).
  std::vector<int64_t> units;
  // One entry per dimension (module), in pipeline order.
  std::vector<int64_t> stages;  // >= 1 each
  // Empty (all 1), or per dimension: model chunks per stage. > 1 only for the last
  // dimension, whose stages then run interleaved 1F1B (pipeline_program.hpp; num_microbatches
  // a multiple of its stages), each chunk taking 1 / chunks of a stage's time.
  std::vector<int64_t> chunks;
  std::vector<double> forward_fraction;       // in [0, 1] each
  std::vector<double> microbatch_constant_s;  // >= 0 each; empty = zeros
  // Empty (all 0), or per dimension: the first of its stages x chunks virtual stages that
  // runs a backward (stages x chunks: none). A stage before it runs forward only and is
  // sent no gradient (a frozen encoder; a frozen tower under a trained projector: only
  // the last stage), as dflop's runtime executes it.
  std::vector<int64_t> backward_from_stage;
  // Empty (all -1), or per dimension: -1, or another dimension g: this dimension's stages
  // run a backward only for a replica's share with a sample of cost > 0 in g (a frozen
  // LLM passes gradients back only for microbatches with visual rows).
  std::vector<int64_t> backward_gate;
  // The pipeline order every replica runs (a registered name, e.g. "zb-h1"); empty:
  // pipeline_order_for() the stages and chunks.
  std::string order;
  // Empty (0.5 each), or per dimension in [0, 1]: the share of its stages' backward that
  // is weight gradients, which a zero-bubble order's W runs (its I the rest). A stage
  // whose input takes no gradient (the first, or one behind a stage that runs no
  // backward) runs all of it in W, as dflop's runtime does.
  std::vector<double> weight_fraction;
  // Empty (0 each), or per dimension >= 0: seconds a split order's W adds on the
  // dimension's last virtual stage, as a fraction of the microbatch's cost sum in that
  // dimension (dflop's chunked LM head remakes its logits there: the planner's
  // StageCosts::last_stage_weight_extra), where that stage runs a backward.
  std::vector<double> last_stage_weight_extra;
  double link_latency_s = 0.0;  // >= 0
  // Empty, or one hard upper bound per dimension on a bin's (microbatch's) cost sum.
  std::vector<double> capacity;
  // No bin's (microbatch's) cost sum may exceed max_growth x the starting schedule's
  // makespan of that dimension. >= 1; +inf = no bound beyond the capacities.
  double max_growth = 1.05;
  uint64_t seed = 0;
  // Search effort in simulated actions (one candidate costs about 2 x stages x
  // microbatches x simulated replicas; one rejected without simulating costs 1).
  // Deterministic, like balance()'s work budget. The start and the constructive orders
  // are always simulated (so work_used may exceed a tiny budget). -1 = default by size.
  int64_t work_budget = -1;
  // Optional wall-clock limit in seconds (negative = none); see BalanceOptions.
  double time_limit_s = -1.0;
  // Optional cooperative interruption (see InterruptCheck).
  InterruptCheck interrupted;
};

struct PipelineScheduleStats {
  double start_step_time_s = 0.0;    // the starting assignment, microbatches in index order
  double ordered_step_time_s = 0.0;  // after choosing the best constructive order
  int64_t evaluations = 0;           // simulated candidates
  int64_t work_used = 0;
  int64_t work_budget = 0;
  int64_t improving_moves = 0;
  int64_t perturbations = 0;  // restarts of the local search from a kicked best state
  bool stopped_by_time_limit = false;
};

struct PipelineScheduleResult {
  // Bin of each sample; microbatch indices are the execution order.
  std::vector<int64_t> assignment;
  double step_time_s = 0.0;  // simulated
  PipelineScheduleStats stats;
};

// Checks every argument (names the argument, index and value) and the starting
// assignment: one bin per sample in [0, num_microbatches x dp_size), no empty bin, within
// the capacities. Throws InvalidArgument, or Infeasible where balance() would.
// Inputs whose step could overflow are refused: the column sums of the costs plus
// num_microbatches x microbatch_constant_s, plus 2 x stages x num_microbatches x
// link_latency_s, must stay <= 1e200 s.
void validate_pipeline_schedule_input(const double* costs, int64_t num_items, int64_t num_dims,
                                      const std::vector<int64_t>& start_assignment,
                                      const PipelineScheduleOptions& options);

// Validates, then refines `start_assignment` (e.g. balance()'s). The result is never
// slower than the start in index order, and every bin stays non-empty.
PipelineScheduleResult pipeline_schedule(const double* costs, int64_t num_items, int64_t num_dims,
                                         const std::vector<int64_t>& start_assignment,
                                         const PipelineScheduleOptions& options);

// Simulated step (seconds) of an assignment whose microbatch indices are the execution
// order, under the options' pipeline model. Validates like pipeline_schedule().
double simulated_step_time(const double* costs, int64_t num_items, int64_t num_dims,
                           const std::vector<int64_t>& assignment,
                           const PipelineScheduleOptions& options);

// Work units (simulated actions) per millisecond, for converting a time budget.
int64_t pipeline_work_budget_for_ms(double time_budget_ms);

}  // namespace dflop
