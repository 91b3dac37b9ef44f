// Pipeline schedules as data (the torch.distributed.pipelining idea): a schedule is, per
// physical stage (one rank of a replica's pipeline), the list of actions it runs in order,
// each action a (virtual stage, kind, microbatch). The simulator, the planner's memory
// model and dflop's runtime all take their order from here.
//
// A pipeline is a sequence of segments (modules: the vision encoder, then the LLM). Segment
// g has stages[g] physical stages, each holding chunks[g] model chunks: its layers are cut
// into stages[g] x chunks[g] virtual stages, virtual stage c x stages[g] + p on its physical
// stage p (Megatron-LM's interleaved placement; chunks = 1 is the plain pipeline). Virtual
// stages are numbered along the model, over all segments; data flows from virtual stage v
// to v + 1 (the forward) and back (the gradient).
//
// Kinds: Forward; Backward (input and weight gradient together); or, for schedules that
// split it (zero-bubble), BackwardInput (the input gradient, sent on at once) and
// BackwardWeight (the weight gradient, which nothing waits for). validate_program() checks
// any action list, generated or given.
//
// The pipeline-order registry: every generated pipeline order is one PipelineOrderDef in
// pipeline_order_registry() (pipeline_program.cpp), its name, what it can run, its action
// generator and its memory rule; pipeline_program(), peak_in_flight(),
// parse_pipeline_order() and the Python package's list of pipeline orders all read it. A new
// pipeline order is a new PipelineOrder and one entry there. pipeline_order_for() is the one place
// that picks the schedule dflop runs on a pipeline (the planner, the trainer's scheduler
// and, through the bindings, the Python package and the runtime ask it).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dflop {

enum class PipelineOrder : int8_t {
  OneFOneB = 0,
  GPipe = 1,
  Interleaved1F1B = 2,
  ZeroBubbleH1 = 3
};

// A registered name (case-insensitive: "1f1b", "gpipe", "interleaved-1f1b", "zb-h1"); throws
// InvalidArgument otherwise, listing the names.
PipelineOrder parse_pipeline_order(const std::string& name);
// The registered name; "unknown" for a kind the registry lacks.
const char* pipeline_order_name(PipelineOrder kind);

enum class ActionKind : int8_t { Forward = 0, Backward = 1, BackwardInput = 2, BackwardWeight = 3 };
const char* action_kind_name(ActionKind kind);  // "F", "B", "I", "W"

struct PipelineAction {
  int64_t stage = 0;  // the virtual stage (model chunk) it runs
  ActionKind kind = ActionKind::Forward;
  int64_t microbatch = 0;
  bool operator==(const PipelineAction& o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch;
  }
};

// The segments of a pipeline (see the header comment); equal sizes, each entry >= 1.
struct PipelineShape {
  std::vector<int64_t> stages;
  std::vector<int64_t> chunks;
  // One segment of num_stages stages and one chunk each.
  static PipelineShape plain(int64_t num_stages) { return {{num_stages}, {1}}; }
};

// The most microbatches of one step (a stage lists 2 actions per microbatch and chunk).
constexpr int64_t kMaxPipelineMicrobatches = 10'000'000;
// The most virtual stages of a pipeline (physical stages x chunks, over all segments).
constexpr int64_t kMaxVirtualStages = int64_t{1} << 20;

// Throws InvalidArgument naming the field and segment (sizes, counts >= 1, the totals'
// bounds).
void validate_shape(const PipelineShape& shape);
int64_t num_physical_stages(const PipelineShape& shape);
int64_t num_virtual_stages(const PipelineShape& shape);
// Virtual stage -> the physical stage that runs it.
std::vector<int64_t> virtual_stage_owners(const PipelineShape& shape);

struct PipelineProgram {
  int64_t num_microbatches = 0;
  std::vector<int64_t> owner;                        // per virtual stage: its physical stage
  std::vector<std::vector<PipelineAction>> actions;  // per physical stage, in execution order
};

// The short text of an action: kind, virtual stage, '.', microbatch ("F1.3": the forward
// of virtual stage 1 on microbatch 3), as dflop.scheduling.format_action writes it.
std::string format_action(const PipelineAction& action);

// A generated schedule (see the header comment). The functions are called after
// validate_shape() and the microbatch count's range check.
struct PipelineOrderDef {
  PipelineOrder kind;
  const char* name;  // lower case; parse_pipeline_order() takes it in any case
  // Throws InvalidArgument when the schedule cannot run `shape` with m microbatches.
  void (*check)(const PipelineShape& shape, int64_t m);
  // The generator: physical stage `stage`'s actions, in execution order (after check()).
  std::vector<PipelineAction> (*stage_actions)(const PipelineShape& shape, int64_t m,
                                               int64_t stage);
  // The memory rule: the most (virtual stage, microbatch) activations physical stage
  // `stage` holds at once under the generated list (after check()).
  int64_t (*peak_in_flight)(const PipelineShape& shape, int64_t m, int64_t stage);
  // Whether its backwards are split into BackwardInput and BackwardWeight.
  bool splits_backward = false;
};

// Every generated pipeline order, in enum order.
const std::vector<PipelineOrderDef>& pipeline_order_registry();
// The entry of `kind`; throws InvalidArgument for a kind the registry lacks.
const PipelineOrderDef& pipeline_order_def(PipelineOrder kind);

// The schedule dflop runs on a pipeline of this shape: interleaved 1F1B when a segment has
// chunks > 1 (the LLM's virtual stages), else 1F1B. Throws InvalidArgument for a bad shape.
PipelineOrder pipeline_order_for(const PipelineShape& shape);

// The generated schedules (m = num_microbatches):
// - GPipe: every forward, then every backward. With chunks, forwards in rounds of the
//   segment's stage count of microbatches, chunk by chunk (as the interleaved order), and
//   backwards in the same rounds with the chunks reversed.
// - 1F1B (every chunks entry 1; Megatron-LM's non-interleaved schedule): stage s of S
//   runs w = min(S - 1 - s, m) warm-up forwards F0..F(w-1), then the pairs F(w+i), B(i),
//   then the remaining backwards: at most S - s microbatches in flight.
// - Interleaved 1F1B (chunks > 1 on the last segment only; Megatron-LM's interleaved
//   schedule): a stage p of the last segment (P stages, v chunks) runs its forwards in the
//   GPipe-with-chunks order and its backwards in the reversed-chunk order, with
//   min(2 (P - 1 - p) + (v - 1) P, m v) warm-up forwards, then one forward / one backward
//   pairs, then the remaining backwards; requires m to be a multiple of P (as Megatron-LM
//   does: with a short last round of microbatches this order deadlocks). Stages of earlier
//   segments run 1F1B with the warm-up of the stages after them plus the forwards the last
//   segment's first stage runs on its first chunk before its first backward of it.
// - ZB-H1 (every chunks entry 1; the zero-bubble schedule of Qi et al. that keeps 1F1B's
//   peak): 1F1B's warm-up, then F(w + i), I(i) and, from i = s on, W(i - s) (stage s of S,
//   its W passes s microbatches behind its I passes), then the remaining I passes, each
//   followed by the oldest W left, then the remaining W passes. Every stage holds
//   min(S, m) microbatches; with equal F, I and W times the bubble is (S - 1) x F, a third
//   of 1F1B's.
// Throws InvalidArgument for a bad shape, m outside [1, kMaxPipelineMicrobatches], chunks
// where the schedule takes none, or an interleaved schedule with m not a multiple of the
// last segment's stages.
PipelineProgram pipeline_program(PipelineOrder kind, const PipelineShape& shape,
                                 int64_t num_microbatches);

// The memory rule: the most (virtual stage, microbatch) activations physical stage `stage`
// holds at once under the generated schedule (a forward keeps its activations until its
// Backward, or its BackwardWeight, ends). 1F1B: min(S - stage, m); GPipe: m x chunks;
// interleaved: its warm-up + 1 (capped at m x chunks); ZB-H1: min(S, m). Equals
// peak_in_flight(actions) of pipeline_program()'s list (tested).
int64_t peak_in_flight(PipelineOrder kind, const PipelineShape& shape, int64_t num_microbatches,
                       int64_t stage);
// The same, counted along any action list (Forward +1, Backward or BackwardWeight -1).
int64_t peak_in_flight(const std::vector<PipelineAction>& actions);
// The most microbatches whose BackwardInput ran and BackwardWeight did not yet, at once, on
// physical stage `stage` of the generated schedule (0 for orders that do not split their
// backwards): what it keeps for its W passes besides their activations.
int64_t peak_pending_weight(PipelineOrder kind, const PipelineShape& shape,
                            int64_t num_microbatches, int64_t stage);
// The same, counted along any action list (BackwardInput +1, BackwardWeight -1).
int64_t peak_pending_weight(const std::vector<PipelineAction>& actions);

// Checks a program: owners in range; every action on its virtual stage's owner with a
// microbatch in range; per (virtual stage, microbatch) one Forward and either one Backward
// or one BackwardInput and one BackwardWeight, in that order on its stage; and that it runs
// to the end (no stage waits for an action that waits for it). Throws InvalidArgument
// naming the physical stage, the action's index and the action, followed (for a problem
// of the action lists) by program_grid() with the failing action (a deadlock: every
// waiting stage's) marked.
void validate_program(const PipelineProgram& program);

// The most rows (stages) and columns (time slots) program_grid() shows.
constexpr int64_t kGridRows = 16;
constexpr int64_t kGridColumns = 12;

// The program as a stage x time grid for messages: a row per physical stage, a column per
// time slot (the stage's action index, in execution order), cells format_action(); the
// actions at `marks` ((stage, index) pairs) shown as >F1.3<. At most kGridRows rows and
// kGridColumns columns, a window around the first mark (or `focus_stage` without marks),
// with what lies outside it counted.
std::string program_grid(const PipelineProgram& program,
                         const std::vector<std::pair<int64_t, int64_t>>& marks,
                         int64_t focus_stage = 0);

// The action list of one stage of a plain (one segment, one chunk) pipeline.
std::vector<PipelineAction> pipeline_actions(PipelineOrder kind, int64_t num_stages,
                                             int64_t num_microbatches, int64_t stage);

}  // namespace dflop
