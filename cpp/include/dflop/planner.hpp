// Data-aware 3D-parallelism planner: choose (tp, pp, dp) for a vision encoder and a
// decoder LLM on disjoint GPU sets, the layer split and the number of microbatches, by
// simulating training steps on global batches sampled from the data.
//
// Cost model (everything per GPU, seconds; documented once here, used by every layout):
// - Per-sample training time (forward + backward) of the WHOLE module on ONE GPU comes in
//   (a measured or analytic performance model). A fraction `last_fraction` of it belongs
//   to the module's last stage only (the LM head for the LLM, the projector for the
//   encoder); the rest is spread evenly over the layers. Forward = 1/3, backward = 2/3
//   (training FLOPs = 3 x forward).
// - Tensor parallelism of degree t: compute / (t x eff(t)), eff(t) = 1 / (1 + gemm_loss x
//   log2 t) (smaller GEMMs run less efficiently), plus per layer 4 activation all-reduces
//   (2 forward, 2 backward; Megatron-LM's column/row split) of tokens x hidden x element bytes,
//   ring cost 2(t-1)/t x bytes / intra-node bandwidth, plus their latency once per
//   microbatch. TP groups never cross a node: t divides gpus_per_node and every module's
//   first rank is a multiple of t.
// - Encoder DP replicas share each microbatch by visual unit, with the runtime's own split
//   (split_units in encoder_split.hpp, on the samples' encoder costs, microbatch members in
//   ascending order as the runtime passes them): a replica's stage time is that of the
//   pieces it holds (each piece a share units / sample units of its sample's body, last
//   and tokens), plus the module's microbatch constant if it holds any; the microbatch's
//   encoder stage time is its slowest replica's (every LLM replica waits for the features
//   of its samples, which come from several encoder replicas), and its activations are
//   the largest replica's. PlannerOptions::encoder_split selects whole-sample placement
//   or the old idealised even split instead (ablations; the even split is not what any
//   runtime can execute).
// - Point-to-point: activations tokens x hidden x element bytes / t (sequence-parallel
//   shards, one link per TP rank); encoder -> LLM features: visual tokens x LLM hidden x
//   element bytes. (ModuleParams::element_bytes: 2 for bf16, 4 for fp32.)
//   Intra-node bandwidth when both stages share a node, inter-node otherwise.
// - Gradient all-reduce per stage (ring over the module's DP group): 2(dp-1)/dp x element bytes x
//   params on the GPU / bandwidth (inter-node when the DP group spans nodes), not
//   overlapped with the backward pass (as the simulator assumes).
// Memory model (bytes per GPU of a stage):
// - Model states, Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, m, v) = 16
//   bytes/param in mixed precision, 4 + 4 + 8 (m, v) = 16 in fp32 (element_bytes 4); with
//   zero1 the optimizer bytes are sharded over the DP group (Megatron's distributed
//   optimizer): 4 + 12 / dp (bf16), 8 + 8 / dp (fp32). A GPU holds its stage's layers and
//   last-stage parameters (LM head: vocabulary-parallel; projector) over t and the
//   first-stage ones (embeddings) whole: the runtime's tensor-parallel plans replicate them.
// - Activations: stage s keeps, at its peak, the pipeline schedule's peak_in_flight()
//   (pipeline_program.hpp) microbatch-chunks' activations: 1F1B stage s of an S-stage
//   pipeline min(S - s, m), an interleaved LLM stage p of P with v chunks
//   min(2 (P - 1 - p) + (v - 1) P + 1, m v) chunks of its largest chunk's layers (the
//   encoder's stages before it more); a microbatch keeps tokens x layers on the stage (or
//   chunk) x activation bytes per token-layer / t (34 x hidden with FlashAttention and sequence
//   parallelism, Korthikanti et al. 2022), using the largest bin of the sampled batches. The
//   search tries each module with and without full activation recomputation (see
//   ModuleLayout::recompute).
// - The LM head (LLM's last stage): the runtime computes the head and the loss on the target
//   tokens only, head_chunk_tokens rows at a time (dflop.models.loss), so while a microbatch
//   computes its loss the stage holds min(targets of the largest bin, head_chunk_tokens) x
//   head_bytes_per_target_token / t (vocabulary-parallel head) more, once: transient, one
//   microbatch's at a time.
// Training regime (which parts train: dflop.models.trainable): each module's layers (with
// the first stage's parameters) and its last stage's part (LM head / projector) carry a
// backward factor b, the share of a full training backward that runs (1: the weights train;
// 1 - the weight gradients' share, 0.5: frozen weights pass gradients on to a trained part
// before them; 0: frozen with nothing trained before, no backward at all), and a trainable
// share of their parameters (1 full, 0 frozen). A stage's forward is f x compute (f =
// forward_fraction, of full training), its backward (1 - f) x compute x b; the TP
// all-reduces and the microbatch constant split by f the same way, their backward share
// only where the stage runs a backward; recomputation only where the layers run one. The
// layers keep kept_activation_fraction of their activations per token and layer. Only
// trainable parameters hold gradients and optimizer state (frozen ones: their weights) and
// are all-reduced. Layers that run no backward keep no activations: their stage holds one
// layer's working set of one microbatch at a time.
// Padded attention heads (colocated layouts only): the encoder inside the LLM's first stage
// runs at the LLM's tp, which need not divide the encoder's heads (InternViT-6B: 25). A
// Megatron-LM user then does what NVLM does (Megatron-LM examples/multimodal/nvlm/
// internvit.py: 7 dummy zero heads, 25 -> 32 for TP=8): pad the heads to ceil(H / t) x t;
// Megatron's LLaVA model gives a colocated encoder no TP of its own (its
// --encoder-tensor-model-parallel-size only applies to an encoder on its own pipeline
// stage). The padded heads cost what real ones do: with scale = padded / actual heads, the
// encoder's per-layer compute x (1 + attention_compute_fraction x (scale - 1)), its layer
// parameters x (1 + attention_param_fraction x (scale - 1)), its activations per token and
// layer x (1 + attention_activation_fraction x (scale - 1)); the projector and the TP
// all-reduces (hidden-sized) are unchanged. The LLM's tp still divides the LLM's heads.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"
#include "dflop/simulator.hpp"

namespace dflop {

// What the planner is scoring.
enum class PlanStrategy : int8_t {
  // dflop: disjoint encoder/LLM GPUs (what dflop's runtime executes; colocated layouts only
  // with PlannerOptions::colocated_candidates), balanced layer split, per-step balance,
  // microbatch ordering, scored by simulation.
  DataAware = 0,
  // Megatron-LM-style data-blind baseline: one (tp, pp, dp) over all GPUs, the encoder in
  // the first pipeline stage (its heads padded to a multiple of tp where needed), uniform
  // layers, equal-count microbatches in dataset order; the best such layout by the same
  // simulation.
  DataBlindColocated = 1,
  // The reference's optimizer: disjoint GPUs, layout chosen by its closed-form estimate
  // (m + S - 1) x slowest stage on MEAN sample shapes (no all-reduce, no transfers), then
  // balanced per bin every step (no microbatch ordering); reported by simulation.
  MeanShapeReference = 2,
};

// How the encoder's DP replicas share a microbatch in the model (see the header comment).
enum class EncoderSplit : int8_t {
  Unit = 0,    // the runtime's: split_units by visual unit
  Sample = 1,  // whole samples (split_units with SplitGranularity::Sample): ablation
  Even = 2,    // the microbatch's load / dp on every replica: an unreachable idealisation
};

struct ClusterParams {
  int64_t num_gpus = 8;
  int64_t gpus_per_node = 8;
  double gpu_memory_bytes = 80e9;
  double intra_node_bandwidth_bytes_per_s = 300e9;
  double inter_node_bandwidth_bytes_per_s = 25e9;
  double link_latency_s = 5e-6;       // point-to-point and per collective
  double tp_gemm_loss = 0.05;         // eff(t) = 1 / (1 + tp_gemm_loss x log2 t)
  double memory_reserve_bytes = 0.0;  // per GPU, kept free (CUDA context, fragmentation)
};

struct ModuleParams {
  int64_t num_layers = 1;
  int64_t num_heads = 1;
  int64_t hidden_size = 1;
  double params_per_layer = 0.0;
  double first_stage_params = 0.0;                // embeddings / patch embedding
  double last_stage_params = 0.0;                 // LM head / projector
  double activation_bytes_per_token_layer = 0.0;  // at t = 1
  // The LM head's working set (logits and their gradient) per target row at t = 1, on the
  // LLM's last stage (see head_chunk_tokens).
  double head_bytes_per_target_token = 0.0;
  double microbatch_constant_s = 0.0;  // per microbatch, whole module, one GPU
  // Shares that grow with padded attention heads (see "Padded attention heads"): of the
  // per-layer compute (QKV / output projections and the attention core), of
  // params_per_layer, of activation_bytes_per_token_layer. 1 (everything grows) unless known.
  double attention_compute_fraction = 1.0;
  double attention_param_fraction = 1.0;
  double attention_activation_fraction = 1.0;
  // Forward share of a stage's forward + backward time (training = 3 x forward: 1/3).
  double forward_fraction = 1.0 / 3.0;
  // The chunked loss's target rows per chunk (0: every target of a microbatch at once).
  int64_t head_chunk_tokens = 0;
  // Bytes of one weight, gradient or activation element (2: bf16 mixed precision; 4: fp32).
  double element_bytes = 2.0;
  // The first stage's input per token (the encoder's pixels), which the runtime reads for
  // every microbatch of a step before the step starts.
  double input_bytes_per_token = 0.0;
  // Which parts train (see "Training regime" above): the share of a full training backward
  // that runs on the layers (with the first stage's parameters) and on the last stage's
  // part (LM head / projector), and the shares of their parameters that train.
  double body_backward_factor = 1.0;
  double last_backward_factor = 1.0;
  double body_trainable_fraction = 1.0;
  double last_trainable_fraction = 1.0;
  // The share of activation_bytes_per_token_layer the layers keep for their backward under
  // the regime (1: trained; frozen layers that pass gradients on keep less: a frozen
  // linear layer needs its weight, not its input, for the input gradient).
  double kept_activation_fraction = 1.0;
  // The input gradient's share of a trained layer's backward (the rest: its weight
  // gradients, which a zero-bubble order's W runs). What a frozen layer that passes
  // gradients on runs (the model profiler's pass-through backward factor), 0.5 unless
  // measured.
  double input_grad_fraction = 0.5;
  // What a zero-bubble order's I pass keeps for its W per token and layer at t = 1 (the
  // gradients that reach each trained weight's node: a linear layer's output gradient, a
  // norm's), while the layers train, and the share of it that tensor parallelism shards
  // (column-parallel outputs; row-parallel outputs and norms are whole on every rank).
  double weight_grad_bytes_per_token_layer = 0.0;
  double weight_grad_sharded_fraction = 1.0;
};

// Per-sample inputs of num_batches sampled global batches of batch_size samples each,
// row-major (batch, sample).
struct PlannerSamples {
  int64_t num_batches = 0;
  int64_t batch_size = 0;
  std::vector<double> encoder_s;              // whole encoder + projector on one GPU, fwd + bwd
  std::vector<double> llm_s;                  // whole LLM on one GPU, fwd + bwd
  std::vector<double> encoder_last_fraction;  // of encoder_s on its last stage
  std::vector<double> llm_last_fraction;      // of llm_s on its last stage
  std::vector<double> encoder_tokens;         // units x tokens per unit
  std::vector<int64_t> encoder_units;         // visual units (0: text-only)
  std::vector<double> llm_tokens;             // sequence length
  std::vector<double> visual_tokens;          // features the encoder hands the LLM
  std::vector<double> llm_target_tokens;      // loss tokens (the head's rows); empty: every token

  double target_tokens(size_t k) const {
    return llm_target_tokens.empty() ? llm_tokens[k] : llm_target_tokens[k];
  }
};

// Bounds of the planner's inputs: far above any real model and cluster, small enough that
// no size computation overflows and the search stays bounded.
constexpr int64_t kMaxPlannerGpus = int64_t{1} << 20;       // num_gpus, tp/pp/dp, top_k, patience
constexpr int64_t kMaxPlannerLayers = int64_t{1} << 16;     // num_layers per module
constexpr int64_t kMaxPlannerHeads = int64_t{1} << 20;      // num_heads per module
constexpr int64_t kMaxPlannerBatches = int64_t{1} << 16;    // sampled batches
constexpr int64_t kMaxPlannerBatchSize = int64_t{1} << 24;  // samples per batch
// Also: a batch's encoder_units sum to at most kMaxSplitUnits (encoder_split.hpp); times,
// sizes and counts are in [0, 1e100]; memory and bandwidths are finite and >= 1.

struct PlannerOptions {
  PlanStrategy strategy = PlanStrategy::DataAware;
  int64_t global_batch = 0;  // must equal PlannerSamples::batch_size
  bool prune = true;         // false: simulate every memory-feasible candidate
  int64_t top_k = 5;
  bool order_microbatches = true;  // DataAware: best of a few orderings per step
  // DataAware: each kept layout (disaggregated, one chunk per LLM stage) is scored under
  // ZB-H1 too and runs it where that is faster and fits in memory (the search itself
  // ranks the orders pipeline_order_for() gives).
  bool zero_bubble = false;
  bool balanced_layer_split = true;  // DataAware: min-max layer split (else uniform)
  bool zero1 = true;
  // evaluate_layout: the LLM stages' memory (a colocated encoder's with them) on this LLM
  // DP replica's microbatches alone, as that replica's ranks hold it; -1: the largest
  // replica's (what every rank of a stage must fit).
  int64_t memory_replica = -1;
  int64_t max_tp = 0;  // 0: gpus_per_node
  // Microbatches per DP rank to try; empty = 1, 2, 3, 4, 6, 8, 12, 16, ... (x1.5 / x4/3
  // steps) up to global_batch / dp.
  std::vector<int64_t> microbatch_choices;
  int64_t balance_work_budget = -1;  // per balance call; -1 = dflop::default_work_budget
  uint64_t seed = 0;
  // Threads that evaluate candidates; 0 = one per hardware thread. The result and the
  // statistics do not depend on it.
  int64_t num_threads = 0;
  EncoderSplit encoder_split = EncoderSplit::Unit;
  // DataAware: also score colocated layouts (the encoder in the first LLM stage, run by
  // dflop's runtime as RuntimeLayout(colocated=True)) with the balanced schedule, so that the
  // baseline's own placement is always a candidate. Only those whose TP degree divides the
  // encoder's heads: the runtime does not pad heads (the data-blind baseline does).
  bool colocated_candidates = true;
  // DataAware / MeanShape: score disaggregated layouts (the encoder on GPUs of its own).
  // Off with colocated_candidates on: the colocated placement only.
  bool disaggregated_candidates = true;
  // Screening (prune only): a disaggregated candidate is also skipped once screen_factor x
  // its uniform estimate (the 1F1B step of m identical mean microbatches: fill, steady
  // state, drain; not a bound: uneven microbatches can beat it, rarely by much) exceeds
  // the k-th best. 0: lower bounds only, the result equals prune = false. The estimate
  // sees pipeline fill and drain, which no schedule-free lower bound can, and keeps
  // planning near-linear in the cluster size.
  double screen_factor = 0.9;
  // Optional cooperative interruption, polled between waves of candidates (see
  // InterruptCheck).
  InterruptCheck interrupted;
  // Pruned search: stop once this many candidates in a row (times 2,048 / global_batch when
  // the batch is smaller: cheaper schedules) were scheduled (balanced and bounded or
  // scored) without improving the k-th best; what is left unscheduled is counted in
  // PlannerStats::num_unexplored. Candidates are taken in the order of an estimate that
  // ranks the best early in practice; small clusters are searched to the end, while on
  // thousands of GPUs, where the near-best plateau holds many thousands of layouts within
  // a few percent of each other, it keeps planning near-linear. 0: no limit.
  int64_t patience = 1000;
  // Restrictions of the disaggregated layouts (analyses, or a deployment's constraints):
  // the encoder's largest tp (0: max_tp) and its allowed GPU counts (empty: any).
  int64_t encoder_max_tp = 0;
  std::vector<int64_t> encoder_gpu_choices;
  // DataAware: the LLM's chunks per stage to try (ModuleLayout::virtual_stages; 1 = plain
  // 1F1B, v > 1 = interleaved 1F1B where pp >= 2, pp x v <= num_layers and m is a multiple
  // of pp). Must hold 1; default {1}: off.
  std::vector<int64_t> virtual_stage_choices = {1};
};

struct ModuleLayout {
  int64_t tp = 1, pp = 1, dp = 1;
  int64_t first_rank = 0;
  // pp x virtual_stages entries (virtual stage c x pp + p is chunk c of stage p), each >= 1,
  // sum = num_layers.
  std::vector<int64_t> layers_per_stage;
  // Full activation recomputation: compute x 4/3, activations = each layer's bf16 input
  // plus one layer's working set. Colocated layouts use the LLM's flag for both modules.
  bool recompute = false;
  // Model chunks per stage: 1, or (the LLM of a disaggregated layout, pp >= 2) v > 1 for the
  // interleaved 1F1B schedule (pipeline_program.hpp), whose microbatch count must then be a
  // multiple of pp.
  int64_t virtual_stages = 1;
};

struct Layout {
  bool colocated = false;  // true: the encoder runs inside the LLM's first stage
  ModuleLayout encoder;    // colocated: tp = llm.tp, pp = dp = 1 (not a GPU set of its own);
                           // heads padded to a multiple of tp when tp does not divide them
  ModuleLayout llm;
  int64_t num_microbatches = 1;
  // The pipeline order; none: pipeline_order_for() the layout's stages and chunks.
  std::optional<PipelineOrder> order;
};

// Microbatch orderings tried per step (DataAware with order_microbatches).
enum class MicrobatchOrder : int8_t {
  AsScheduled = 0,
  LongestFirst = 1,
  ShortestFirst = 2,
  ShortEnds = 3,  // short microbatches first and last, long ones in the middle
};

struct StepBreakdown {
  double step_time_s = 0.0;
  double idle_fraction = 0.0;           // idle GPU-seconds over all GPUs / (step x GPUs)
  std::vector<double> stage_compute_s;  // per combined stage, mean over that module's replicas
  std::vector<double> stage_allreduce_s;
  double transfer_s = 0.0;  // encoder -> LLM feature transfer, sum over microbatches
  MicrobatchOrder order = MicrobatchOrder::AsScheduled;
};

struct LayoutScore {
  Layout layout;
  double mean_step_time_s = 0.0;
  double lower_bound_s = 0.0;
  double estimate_s = 0.0;  // MeanShapeReference: the formula's estimate; else 0
  double mean_idle_fraction = 0.0;
  double mean_step_time_as_scheduled_s = 0.0;  // without microbatch ordering
  double peak_memory_bytes = 0.0;              // over stages of both modules, with the reserve
  // Per stage, the encoder's then the LLM's (colocated: the LLM's), without the reserve.
  std::vector<double> stage_memory_bytes;
  std::vector<StepBreakdown> steps;  // one per sampled batch
};

struct PlannerStats {
  int64_t num_candidates = 0;             // layouts enumerated (incl. microbatch counts)
  int64_t num_memory_rejected = 0;        // over memory (model states or activations)
  int64_t num_bounded = 0;                // lower bound computed
  int64_t num_simulated = 0;              // fully scored
  int64_t num_pruned = 0;                 // skipped because a bound exceeded the k-th best
  int64_t num_scheduled = 0;              // schedules built or reused (the second bound or a score)
  int64_t num_balanced = 0;               // layouts balanced (the others reused their schedules)
  int64_t num_pruned_after_schedule = 0;  // of num_pruned: by the replica bound
  bool stopped_by_patience = false;       // PlannerOptions::patience ended the search
  int64_t num_unexplored = 0;  // then: candidates whose key could still beat the k-th best
};

// Smallest memory need found when no layout fits, for the error message.
struct MemoryShortfall {
  bool found = false;
  double needed_bytes = 0.0;  // the smallest peak memory per GPU over all layouts
  bool encoder = false;       // which module's stage holds that peak
  int64_t stage = 0;
};

struct PlanResult {
  std::vector<LayoutScore> best;  // up to top_k, best first (MeanShapeReference: by estimate)
  PlannerStats stats;
  MemoryShortfall shortfall;  // filled when best is empty
};

// Checks every argument; throws InvalidArgument naming the first problem.
void validate_planner_input(const ClusterParams& cluster, const ModuleParams& encoder,
                            const ModuleParams& llm, const PlannerSamples& samples,
                            const PlannerOptions& options);

// Searches the layouts of options.strategy; with options.prune, lower bounds skip layouts
// that cannot enter the top_k and the result equals prune = false (planner_search.cpp
// explains the search). Returns an empty `best` (and the memory shortfall) when no layout
// fits in memory.
PlanResult plan_layouts(const ClusterParams& cluster, const ModuleParams& encoder,
                        const ModuleParams& llm, const PlannerSamples& samples,
                        const PlannerOptions& options);

// Scores one given layout (strategy decides the schedule: data-blind split for a
// colocated layout, balance otherwise; or `assignments`, one schedule per sampled batch
// whose microbatch indices are the execution order, e.g. the runtime's own scheduler's);
// throws Infeasible if it does not fit in memory, InvalidArgument for a bad assignment.
LayoutScore evaluate_layout(const ClusterParams& cluster, const ModuleParams& encoder,
                            const ModuleParams& llm, const PlannerSamples& samples,
                            const PlannerOptions& options, const Layout& layout,
                            const std::vector<std::vector<int64_t>>* assignments = nullptr);

// One sampled batch of a layout as the planner scores it, with everything needed to audit
// or re-simulate it.
struct StepModel {
  // replicas = LLM dp, physical stages = encoder pp + LLM pp, segments (encoder, LLM) with
  // the LLM's virtual stages as chunks; arrays over virtual stages.
  PipelineSimInput sim;
  std::vector<int64_t> assignment;        // bin of each sample (microbatch = execution order)
  std::vector<int64_t> microbatch_order;  // position -> microbatch of the balanced schedule
  int64_t num_encoder_stages = 0;
  // Disaggregated layouts: the forward / backward seconds of every encoder replica, stage and
  // microbatch (encoder dp x encoder pp x m, row-major; 0 where the replica has nothing);
  // sim's encoder stages hold, per microbatch, the slowest replica's.
  int64_t num_encoder_replicas = 0;
  std::vector<double> encoder_forward_s, encoder_backward_s;
  // The encoder split of every microbatch as pieces: microbatch (execution order), sample
  // (index in the batch), first unit, units, encoder replica; by microbatch, then as
  // split_units orders them (sample, first unit).
  std::vector<int64_t> piece_microbatch, piece_sample, piece_first_unit, piece_num_units,
      piece_replica;
};
// The planner's step of sampled batch `batch`: its schedule (balanced, then the fastest of
// the microbatch orders tried), split and simulator input.
StepModel build_step(const ClusterParams& cluster, const ModuleParams& encoder,
                     const ModuleParams& llm, const PlannerSamples& samples,
                     const PlannerOptions& options, const Layout& layout, int64_t batch);
// The same model for a GIVEN assignment (bin b = microbatch b / llm.dp on LLM replica b % dp;
// microbatch indices are the execution order): what a runtime that executes that schedule
// should take, by the planner's cost model. Throws InvalidArgument for a bad assignment.
StepModel step_from_assignment(const ClusterParams& cluster, const ModuleParams& encoder,
                               const ModuleParams& llm, const PlannerSamples& samples,
                               const PlannerOptions& options, const Layout& layout, int64_t batch,
                               const std::vector<int64_t>& assignment);

// What a runtime's scheduler should see of sampled batch `batch` under a layout, by the
// planner's model: per-sample seconds of an average stage of each module (n x 2, row-major;
// the encoder's on one replica, since its replicas share microbatches by unit; a colocated
// layout's first column is its first stage's, encoder and LLM layers, per bin, as the
// planner balances it) and each module's per-microbatch constant of an average stage.
struct StageCosts {
  std::vector<double> costs;
  std::array<double, 2> constants{};
  // Per module: what a split order's W adds on its last stage, as a fraction of the
  // microbatch's cost sum (the LLM: the chunked head's remade logits, where the head trains;
  // the ratio of the batch's sums, since the costs are an average stage's).
  std::array<double, 2> last_stage_weight_extra{};
};
StageCosts stage_costs(const ClusterParams& cluster, const ModuleParams& encoder,
                       const ModuleParams& llm, const PlannerSamples& samples,
                       const PlannerOptions& options, const Layout& layout, int64_t batch);

// Attention heads after padding to a multiple of tp (heads itself when tp divides them).
int64_t padded_heads(int64_t heads, int64_t tp);

// Layer counts per stage: uniform (the remainder to the first stages), or min-max over
// stages of (layers x per_layer + first_stage_extra on the first stage + last_stage_extra
// on the last stage), each stage >= 1.
std::vector<int64_t> split_layers(int64_t num_layers, int64_t num_stages, double per_layer,
                                  double first_stage_extra, double last_stage_extra, bool balanced);

// The microbatch counts tried for dp ranks: see PlannerOptions::microbatch_choices.
std::vector<int64_t> default_microbatch_choices(int64_t max_microbatches);

}  // namespace dflop
