// The planner's internal interface, shared by its pieces (not installed; the bindings and
// the Python package never see it):
//   planner.cpp           the public entry points of planner.hpp and their validation;
//   planner_model.cpp     the links of the cost model and the per-batch context;
//   planner_evaluate.cpp  Evaluator: schedules, memory, simulator input, scores;
//   planner_bounds.cpp    lower bounds of the step time and the search's keys;
//   planner_search.cpp    the search over layouts (its file comment explains it).
// Declared here so that unit tests can call the evaluator and the bounds directly.
// Plain C++17: no Python, no torch.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "dflop/encoder_split.hpp"
#include "dflop/planner.hpp"
#include "dflop/simulator.hpp"

namespace dflop::detail {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTpAllReducesPerLayer = 4.0;  // 2 forward + 2 backward (Megatron-LM)

// ---------------------------------------------------------------------------------------
// Stages and chunks

// Layers of physical stage s over its chunks (virtual stages c x pp + s).
inline int64_t stage_layers(const ModuleLayout& l, int64_t s) {
  int64_t n = 0;
  for (int64_t c = 0; c < l.virtual_stages; ++c) n += l.layers_per_stage[size_t(c * l.pp + s)];
  return n;
}

// The most layers one chunk of physical stage s holds.
inline int64_t largest_chunk(const ModuleLayout& l, int64_t s) {
  int64_t n = 0;
  for (int64_t c = 0; c < l.virtual_stages; ++c)
    n = std::max(n, l.layers_per_stage[size_t(c * l.pp + s)]);
  return n;
}

// ---------------------------------------------------------------------------------------
// Cost and memory model of one module

// A stage's forward and backward seconds.
struct StageSeconds {
  double forward_s = 0.0, backward_s = 0.0;
  double total() const { return forward_s + backward_s; }
  StageSeconds& operator+=(const StageSeconds& o) {
    forward_s += o.forward_s;
    backward_s += o.backward_s;
    return *this;
  }
};

struct ModuleModel {
  const ModuleParams* p = nullptr;
  const ClusterParams* c = nullptr;
  // Compute multiplier of the per-layer work (padded attention heads; 1 otherwise).
  double body_scale = 1.0;

  // eff(t) and comm_per_token_layer(t) for t < tables' size (the hot loops call them often).
  std::vector<double> eff_table, comm_table;
  void fill_tables(int64_t max_t) {
    eff_table.clear();
    comm_table.clear();
    for (int64_t t = 0; t <= max_t; ++t) {
      eff_table.push_back(t >= 1 ? compute_eff(t) : 0.0);
      comm_table.push_back(compute_comm(t));
    }
  }
  double compute_eff(int64_t t) const {
    return 1.0 / (1.0 + c->tp_gemm_loss * std::log2(double(t)));
  }
  double eff(int64_t t) const {
    return t >= 1 && size_t(t) < eff_table.size() ? eff_table[size_t(t)] : compute_eff(t);
  }
  // Seconds of TP communication per token and layer at degree t.
  double comm_per_token_layer(int64_t t) const {
    return t >= 0 && size_t(t) < comm_table.size() ? comm_table[size_t(t)] : compute_comm(t);
  }
  double compute_comm(int64_t t) const {
    if (t <= 1) return 0.0;
    return kTpAllReducesPerLayer * 2.0 * double(t - 1) / double(t) * double(p->hidden_size) *
           p->element_bytes / c->intra_node_bandwidth_bytes_per_s;
  }
  // Whether a stage's layers run a backward, and whether the stage runs one at all (its
  // layers, or on the last stage the last stage's part): planner.hpp, "Training regime".
  bool layers_backward() const { return p->body_backward_factor > 0.0; }
  bool runs_backward(bool is_last) const {
    return layers_backward() || (is_last && p->last_backward_factor > 0.0);
  }
  // Forward and backward seconds of a stage on summed samples: body (spread over layers),
  // last (last-stage-only) and tokens; n layers on the stage. Under full training the
  // forward is f x the total. With full activation recomputation the forward runs again in
  // the backward: 4/3 of the compute where the layers run a backward.
  StageSeconds stage_seconds(int64_t t, bool recompute, int64_t n, bool is_last, double body,
                             double last, double tokens) const {
    const double f = p->forward_fraction;
    const double speed = double(t) * eff(t) / (recompute && layers_backward() ? 4.0 / 3.0 : 1.0);
    const double body_s = body * body_scale * double(n) / double(p->num_layers) / speed;
    const double last_s = is_last ? last / speed : 0.0;
    const double comm = tokens * double(n) * comm_per_token_layer(t);
    return {f * (body_s + last_s + comm),
            (1.0 - f) * (p->body_backward_factor * body_s + p->last_backward_factor * last_s +
                         (layers_backward() ? comm : 0.0))};
  }
  // The weight gradients' share of a stage's backward (what a zero-bubble order's W runs):
  // of a trained part, 1 - input_grad_fraction; of one that passes gradients through
  // frozen weights (its backward is the input gradient), none. The layers' where they run
  // a backward, else the last stage's part's. A stage whose input takes no gradient runs
  // all of its backward in W (Evaluator::sim_input).
  double weight_share(bool is_last) const {
    const double in = p->input_grad_fraction;
    auto share = [in](double factor) {
      return factor > 0.0 ? std::max(0.0, factor - in) / factor : 0.0;
    };
    if (layers_backward()) return share(p->body_backward_factor);
    return is_last ? share(p->last_backward_factor) : 0.0;
  }
  // The seconds a split backward's W adds on the LLM's last stage: it remakes the chunked
  // LM head's logits once more (dflop.models.loss: I computes the hidden gradient, W the
  // head's weight gradient, each from the logits), one forward of the last stage's part,
  // where that part trains. `last`: the part's seconds, as stage_seconds takes them.
  double head_remake_seconds(int64_t t, double last) const {
    if (p->last_trainable_fraction == 0.0 || p->last_backward_factor == 0.0) return 0.0;
    return stage_seconds(t, false, 0, true, 0.0, last, 0.0).forward_s;
  }
  double stage_time(int64_t t, bool recompute, int64_t n, bool is_last, double body, double last,
                    double tokens) const {
    return stage_seconds(t, recompute, n, is_last, body, last, tokens).total();
  }
  // When none of the module's parameters train, its backward only carries gradients back
  // to the visual features (the LLM of LLaVA's stage 1): a microbatch without visual rows
  // runs none, on any stage (as the runtime's engine does).
  bool backward_needs_visual() const {
    return layers_backward() && p->body_trainable_fraction == 0.0 &&
           p->last_trainable_fraction == 0.0;
  }
  // A lower bound of the stage's seconds on summed samples `all` (body, last, tokens), of
  // which `visual` are the samples with visual rows: every sample's forward and, where the
  // backward needs visual rows, at least those samples' backward (a microbatch with visual
  // rows runs it on all its samples).
  double stage_time_bound(int64_t t, bool recompute, int64_t n, bool is_last,
                          const std::array<double, 3>& all,
                          const std::array<double, 3>& visual) const {
    const StageSeconds a = stage_seconds(t, recompute, n, is_last, all[0], all[1], all[2]);
    if (!backward_needs_visual()) return a.total();
    return a.forward_s +
           stage_seconds(t, recompute, n, is_last, visual[0], visual[1], visual[2]).backward_s;
  }
  // The per-microbatch constant every microbatch pays (the backward share only where a
  // microbatch without visual rows runs a backward too).
  double stage_constant_bound(int64_t t, int64_t n, bool is_last) const {
    const StageSeconds k = stage_constant_seconds(t, n, is_last);
    return backward_needs_visual() ? k.forward_s : k.total();
  }
  // The per-microbatch constant of a stage of n layers (its backward share only where the
  // stage runs a backward).
  StageSeconds stage_constant_seconds(int64_t t, int64_t n, bool is_last) const {
    const double k = p->microbatch_constant_s * double(n) / double(p->num_layers) +
                     (t > 1 ? double(n) * kTpAllReducesPerLayer * c->link_latency_s : 0.0);
    const double f = p->forward_fraction;
    return {f * k, runs_backward(is_last) ? (1.0 - f) * k : 0.0};
  }
  double stage_constant(int64_t t, int64_t n, bool is_last) const {
    return stage_constant_seconds(t, n, is_last).total();
  }
  // Parameters one GPU of stage s holds: the layers' and the last stage's (the LM head,
  // vocabulary-parallel; the projector) sharded over tp, the first stage's (embeddings)
  // replicated on every TP rank, as the runtime's tensor-parallel plans do.
  double gpu_params(const ModuleLayout& l, int64_t s) const {
    return (p->params_per_layer * double(stage_layers(l, s)) +
            (s == l.pp - 1 ? p->last_stage_params : 0.0)) /
               double(l.tp) +
           (s == 0 ? p->first_stage_params : 0.0);
  }
  // The trainable ones of gpu_params (planner.hpp, "Training regime").
  double gpu_trainable_params(const ModuleLayout& l, int64_t s) const {
    return (p->params_per_layer * double(stage_layers(l, s)) * p->body_trainable_fraction +
            (s == l.pp - 1 ? p->last_stage_params * p->last_trainable_fraction : 0.0)) /
               double(l.tp) +
           (s == 0 ? p->first_stage_params * p->body_trainable_fraction : 0.0);
  }
  // The whole module's on one GPU of tp t (a colocated encoder), all or the trainable ones.
  double gpu_all_params(int64_t t, bool trainable_only = false) const {
    const double body = trainable_only ? p->body_trainable_fraction : 1.0;
    const double last = trainable_only ? p->last_trainable_fraction : 1.0;
    return (p->params_per_layer * double(p->num_layers) * body + p->last_stage_params * last) /
               double(t) +
           p->first_stage_params * body;
  }
  // Model states on a GPU of `params` parameters of which `trainable` train: every weight
  // (element_bytes); a trainable one's gradient (element_bytes) and Adam's 16 - 2 x
  // element_bytes bytes (bf16: fp32 master, m, v; fp32: m, v), sharded over dp with zero1.
  double state_bytes(double params, double trainable, int64_t dp, bool zero1) const {
    const double optimizer = 16.0 - 2.0 * p->element_bytes;
    return params * p->element_bytes +
           trainable * (p->element_bytes + (zero1 ? optimizer / double(dp) : optimizer));
  }
  // Activation bytes that microbatches of `tokens` tokens in all keep per GPU on a stage of
  // n layers between their forward and backward: every layer's (full recomputation: each
  // layer's input only); none where the layers run no backward.
  double activation_bytes(int64_t t, bool recompute, int64_t n, double tokens) const {
    if (!layers_backward()) return 0.0;
    const double per_layer =
        recompute ? p->element_bytes * double(p->hidden_size)
                  : p->activation_bytes_per_token_layer * p->kept_activation_fraction;
    return tokens * double(n) * per_layer / double(t);
  }
  // What a zero-bubble order's I passes keep for their W passes, for microbatches of
  // `tokens` tokens in all, on a stage of n layers (dflop.runtime.split_backward records the
  // gradient reaching each trained weight's node: a linear layer's output, a norm's). A
  // stage whose input takes no gradient keeps its output's gradient (its W runs the whole
  // backward); frozen layers keep none.
  double weight_grad_bytes(int64_t t, int64_t n, double tokens, bool input_grad) const {
    if (!input_grad) return tokens * double(p->hidden_size) * p->element_bytes;
    if (!layers_backward() || p->body_trainable_fraction == 0.0) return 0.0;
    const double f = p->weight_grad_sharded_fraction;
    return tokens * double(n) * p->weight_grad_bytes_per_token_layer * (f / double(t) + 1.0 - f);
  }
  // One layer's activations of one microbatch of `tokens` tokens, held transiently: the
  // layer the backward remakes (full recomputation: what the regime keeps of it) or the
  // layer a forward-only stage runs (its activations are freed as it goes). The gradients a
  // backward op makes are not counted: measured at the start of the backward (where CPU peaks
  // fell), they are a fraction of one layer's activations, within the model's error.
  double recompute_bytes(int64_t t, bool recompute, double tokens) const {
    if (!layers_backward()) return forward_layer_bytes(t, tokens);
    return recompute ? tokens * p->activation_bytes_per_token_layer * p->kept_activation_fraction /
                           double(t)
                     : 0.0;
  }
  // One layer's activations of a forward that keeps none (freed as it goes).
  double forward_layer_bytes(int64_t t, double tokens) const {
    return tokens * p->activation_bytes_per_token_layer / double(t);
  }
  // The first stage's inputs of a step of `tokens` tokens per GPU, read before it starts
  // (prefetched; each microbatch's then kept for its backward, which the activations count
  // too: a bound above by the in-flight ones'). Every TP rank holds them whole.
  double input_bytes(double tokens) const { return tokens * p->input_bytes_per_token; }
  // The LM head's working set on the last stage while a microbatch of `targets` target
  // tokens computes its loss: one chunk's logits (all targets' without chunking), each
  // TP rank its vocabulary slice. Transient: one microbatch's at a time.
  double head_bytes(int64_t t, double targets) const {
    const double rows =
        p->head_chunk_tokens > 0 ? std::min(targets, double(p->head_chunk_tokens)) : targets;
    return rows * p->head_bytes_per_target_token / double(t);
  }
};

inline int64_t node_of(int64_t rank, int64_t gpn) { return rank / gpn; }

// Bandwidth of a module's DP group at stage s (rank order: tp fastest, then dp, then pp).
double dp_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s);

// The gradient all-reduce of stage s: its trainable parameters plus `extra_params`
// (trainable ones too: a colocated encoder's).
double allreduce_time(const ClusterParams& c, const ModuleModel& mm, const ModuleLayout& l,
                      int64_t s, double extra_params);

// Bandwidth between stage s and s + 1 of a module (worst replica).
double stage_link_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s);

// Bandwidth from a module's last stage to its first (interleaved chunks wrap around; worst
// replica).
double wrap_link_bandwidth(const ClusterParams& c, const ModuleLayout& l);

double encoder_llm_bandwidth(const ClusterParams& c, const ModuleLayout& enc,
                             const ModuleLayout& llm);

// ---------------------------------------------------------------------------------------
// Per-batch sums used by the bounds

struct BatchSums {
  double enc_body = 0, enc_last = 0, enc_tokens = 0;
  double llm_body = 0, llm_last = 0, llm_tokens = 0, llm_targets = 0;
  double max_enc_tokens = 0, max_llm_tokens = 0, max_llm_targets = 0;
  // Largest single sample's (body, last, tokens) per module, by its total time at t = 1.
  std::array<double, 3> max_enc{0, 0, 0}, max_llm{0, 0, 0};
  // The encoder's largest single visual unit, by time, and the most tokens of one unit.
  std::array<double, 3> max_enc_unit{0, 0, 0};
  double max_enc_unit_tokens = 0;
  bool has_visual = false;
  // The LLM's (body, last, tokens) summed over the samples with visual rows, and whether
  // max_llm is such a sample (ModuleModel::backward_needs_visual).
  std::array<double, 3> llm_visual{0, 0, 0};
  bool max_llm_visual = false;
  // The LLM's (body, last, tokens) of all samples.
  std::array<double, 3> llm_all() const { return {llm_body, llm_last, llm_tokens}; }
};

struct Context {
  const ClusterParams& c;
  const PlannerSamples& x;
  const PlannerOptions& o;
  ModuleModel enc, llm;
  std::vector<BatchSums> sums;
  int64_t n = 0;  // samples per batch

  Context(const ClusterParams& cluster, const ModuleParams& e, const ModuleParams& l,
          const PlannerSamples& samples, const PlannerOptions& options);
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // The encoder inside a colocated layout's first stage at the LLM's tp (heads padded).
  const ModuleModel& colocated_enc(int64_t t) const {
    return t >= 1 && size_t(t) < enc_colocated_.size() && enc_colocated_[size_t(t)].p
               ? enc_colocated_[size_t(t)]
               : enc;
  }

 private:
  std::vector<ModuleParams> enc_padded_params_;  // not resized after construction
  std::vector<ModuleModel> enc_colocated_;
};

// ---------------------------------------------------------------------------------------
// Layout helpers

inline int64_t total_stages(const Layout& l) {
  return l.colocated ? l.llm.pp : l.encoder.pp + l.llm.pp;
}

// The pipeline a replica runs: the encoder's stages (none when colocated), then the LLM's.
inline PipelineShape layout_shape(const Layout& l) {
  return l.colocated ? PipelineShape::plain(l.llm.pp)
                     : PipelineShape{{l.encoder.pp, l.llm.pp}, {1, l.llm.virtual_stages}};
}

// The one choice of a layout's pipeline order: its own, else pipeline_order_for().
inline PipelineOrder layout_order(const Layout& l) {
  return l.order ? *l.order : pipeline_order_for(layout_shape(l));
}

// ---------------------------------------------------------------------------------------
// Scoring one layout

// One schedule of one batch as the simulation needs it.
struct BinSums {
  // Per bin: the LLM's loads and visual rows, and (colocated layouts) the encoder's.
  std::vector<double> enc_body, enc_last, enc_tokens, llm_body, llm_last, llm_tokens, visual,
      llm_targets;
  // Disaggregated layouts, per microbatch k (schedule order) and encoder stage st: the
  // slowest encoder replica's seconds incl. the microbatch constant (0 if no replica has
  // work), at enc_stage_s[k * pp + st]; the largest replica's encoder tokens; and per stage
  // the encoder's compute seconds summed over replicas and microbatches (for idle shares).
  std::vector<double> enc_stage_s, enc_max_tokens, enc_busy_s;
  std::vector<double> enc_stage_forward_s;  // the forward share of enc_stage_s
  void resize(size_t bins) {
    for (auto* v : {&enc_body, &enc_last, &enc_tokens, &llm_body, &llm_last, &llm_tokens, &visual,
                    &llm_targets})
      v->assign(bins, 0.0);
  }
};

// The encoder's replicas on one microbatch: every replica's seconds per stage, its tokens.
struct EncoderReplicas {
  std::vector<double> stage_s;    // dp x pp, row-major: incl. the constant where it has work
  std::vector<double> forward_s;  // dp x pp: the forward share of stage_s
  std::vector<double> tokens;     // dp
  UnitSplit split;                // Unit / Sample: the pieces (sample = position in members)
};

class Evaluator {
 public:
  explicit Evaluator(const Context& ctx) : ctx_(ctx) {}

  // Per-sample seconds of an average stage of each module under layout l, batch b: (n, 2)
  // row-major. Column 0: a disaggregated encoder's stage on one replica (its replicas share
  // microbatches by unit), or a colocated layout's first stage (the encoder plus its LLM
  // layers); column 1: an average LLM stage.
  std::vector<double> sample_stage_costs(const Layout& l, int64_t b) const;

  // The per-microbatch constant of an average stage of each module (disaggregated).
  std::array<double, 2> stage_constants(const Layout& l) const;

  // StageCosts::last_stage_weight_extra of batch b, whose sample_stage_costs are `costs`.
  std::array<double, 2> last_stage_weight_extra(const Layout& l, int64_t b,
                                                const std::vector<double>& costs) const;

  // The schedule of batch b: bin of each sample (bin = microbatch x dp + rank).
  std::vector<int64_t> assign(const Layout& l, int64_t b) const;

  BinSums bin_sums(const Layout& l, int64_t b, const std::vector<int64_t>& bins) const;

  // The samples (indices in the batch) of each microbatch, ascending: the order in which
  // the runtime hands a microbatch to split_units.
  static std::vector<std::vector<int64_t>> microbatch_members(const std::vector<int64_t>& bins,
                                                              int64_t m, int64_t dp);

  // The encoder replicas' work on microbatch k (members ascending) of batch b under the
  // layout's encoder split. `sums` holds the microbatch's per-bin encoder sums (Even only).
  EncoderReplicas encoder_replicas(const Layout& l, int64_t b, const std::vector<int64_t>& members,
                                   const BinSums& sums, int64_t k) const;

  // Peak memory per GPU over all stages, given the largest LLM bin's tokens and target
  // tokens, the largest encoder tokens per encoder GPU per microbatch (disaggregated) or
  // per bin (colocated).
  struct Memory {
    double peak = 0.0;
    bool encoder = false;
    int64_t stage = 0;
    std::vector<double> stage_bytes;  // per stage (the encoder's, then the LLM's), no reserve
    void set_peak(double bytes, bool in_encoder, int64_t at) {
      peak = bytes;
      encoder = in_encoder;
      stage = at;
    }
  };
  // Tokens that k microbatches in flight on one GPU hold together, for k = 1, 2, ...: the
  // k largest of a GPU's microbatches (the largest over GPUs and batches), or, as a lower
  // bound before scheduling, max(k x an average one, the largest sample).
  struct InFlightTokens {
    std::vector<double> top;  // top[k - 1]: the k largest's sum; empty: the bound below
    double average = 0.0, single = 0.0;
    // The largest microbatch whose forward keeps nothing (a frozen LLM's without visual
    // rows under a trained projector): one layer's activations at a time.
    double forward_only = 0.0;
    double at(int64_t k) const {
      if (top.empty()) return std::max(double(k) * average, single);
      return top[size_t(std::min<int64_t>(std::max<int64_t>(k, 1), int64_t(top.size())) - 1)];
    }
    // Folds in one GPU's microbatch tokens.
    void add(std::vector<double> tokens) {
      std::sort(tokens.begin(), tokens.end(), std::greater<double>());
      if (top.size() < tokens.size()) top.resize(tokens.size(), top.empty() ? 0.0 : top.back());
      double sum = 0.0;
      for (size_t k = 0; k < top.size(); ++k) {
        if (k < tokens.size()) sum += tokens[k];
        top[k] = std::max(top[k], sum);
      }
    }
  };
  Memory memory(const Layout& l, const InFlightTokens& llm_tokens, double llm_bin_targets,
                const InFlightTokens& enc_tokens) const;
  // The peak over the encoder's stages (disaggregated: the LLM's stages follow them).
  Memory encoder_memory(const Layout& l, const InFlightTokens& enc_tokens) const;
  // The peak over the LLM's stages (colocated: the encoder's on the first).
  Memory llm_memory(const Layout& l, const InFlightTokens& llm_tokens, double llm_bin_targets,
                    const InFlightTokens& enc_tokens) const;
  // Peak over all stages: the encoder's first, ties to the earlier stage; plus the reserve.
  Memory combine(const Memory& enc, const Memory& llm) const;
  // What physical stage `stage` (of module model mm, tp-way, n layers) keeps for its
  // pending W passes under the layout's order (0 unless it splits its backwards).
  double pending_weight_bytes(const ModuleModel& mm, const Layout& l, int64_t stage, bool is_last,
                              bool input_grad, int64_t tp, int64_t n,
                              const InFlightTokens& tokens) const;

  // The fewest tokens any schedule could put in flight on an LLM GPU / encoder GPU
  // (disaggregated: per microbatch over encoder_dp GPUs; colocated: per bin): some GPU
  // holds an average microbatch or more, and some the largest sample (unit).
  InFlightTokens llm_tokens_lower_bound(int64_t m, int64_t dp) const;
  // The same for the largest bin's target tokens.
  double llm_targets_lower_bound(int64_t m, int64_t dp) const;
  // Disaggregated: some microbatch holds >= total / m, so some replica >= total / (m dp);
  // and some replica holds the largest unit (Unit), sample (Sample) or its dp-th (Even).
  InFlightTokens enc_tokens_lower_bound(int64_t m, int64_t llm_dp, bool colocated,
                                        int64_t encoder_dp) const;

  // Memory with the smallest bins any schedule could give (for pruning before balance).
  Memory memory_lower_bound(const Layout& l) const;

  // Simulator input of batch b given the bin sums and a microbatch order. Disaggregated:
  // segments (encoder pp, LLM pp) with the LLM's chunks; arrays over virtual stages.
  PipelineSimInput sim_input(const Layout& l, const BinSums& s, const std::vector<int64_t>& order,
                             bool record_events) const;

  // Microbatch orderings (position -> microbatch) to try.
  std::vector<std::pair<MicrobatchOrder, std::vector<int64_t>>> orders(
      const Layout& l, const PipelineSimInput& base) const;

  // Reorders a simulator input built with the identity order (cheaper than rebuilding).
  static PipelineSimInput permuted(const PipelineSimInput& in, const std::vector<int64_t>& order);

  StepBreakdown breakdown(const Layout& l, const BinSums& sums, const PipelineSimInput& in,
                          const PipelineSimResult& res, MicrobatchOrder order) const;

  // assign()'s costs, options and seed depend on the layout only through these fields, so
  // two layouts with the same key get the same schedules: the search balances once per key.
  using ScheduleKey = std::array<int64_t, 9>;
  static ScheduleKey schedule_key(const Layout& l);

  // A layout's schedules as bin sums (one per sampled batch), with the exact memory check.
  struct Prepared {
    std::vector<BinSums> sums;  // per batch
    Memory mem;
    bool feasible = false;
  };
  Prepared prepare(const Layout& l, std::vector<BinSums> sums) const;

  // One replica of a simulator input built with the identity order, reordered.
  static PipelineSimInput replica_input(const PipelineSimInput& in, int64_t r,
                                        const std::vector<int64_t>& order);

  // Lower bound on one batch's step time in score() (the smallest over the orders it
  // tries) from its schedule, at a fraction of the cost. Each order's step time is at least,
  // for every replica and stage s, the time along one path of the simulation: microbatch
  // 0's forwards and sends up to s (s's first action), all of s's actions, then microbatch
  // m-1's backwards and sends down to a stage s' <= s (s's last action is the backward of
  // m-1) and s''s all-reduce. When that is not above `enough`: replicas are independent
  // until the all-reduce, so the step time of an order is also at least the step time of
  // one replica simulated alone; the replica with the most work, then (if still not above)
  // the one with the busiest stage. These bounds see pipeline fill and drain, and the
  // simulated ones also microbatches whose bottleneck alternates between the encoder and
  // the LLM, which the first bound does not.
  double replica_bound(const Layout& l, const BinSums& sums, double enough) const;

  // Full score of prepared (memory-feasible) schedules. `as_given`: the microbatches run
  // in the order of their indices (a schedule from elsewhere), no other order is tried.
  LayoutScore finish(const Layout& l, const Prepared& p, bool as_given = false) const;

  // Full score; `feasible` false when the exact memory check fails (score unset then).
  // `given`: the schedule of every batch (bins), instead of the planner's own.
  LayoutScore score(const Layout& l, bool* feasible, Memory* mem_out,
                    const std::vector<std::vector<int64_t>>* given = nullptr) const;

  // Mean-shape estimate of the reference's optimizer: every bin holds global_batch / bins
  // mean samples; (m + S - 1) x the slowest stage's microbatch time.
  double mean_shape_estimate(const Layout& l) const;

 private:
  const Context& ctx_;
};

// ---------------------------------------------------------------------------------------
// Lower bounds per module (mean over batches of the slowest stage's bound)

// Stage s of a module cannot finish before: its replica's share of the batch's load (the
// busiest replica carries at least the mean, and at least the largest sample) plus m
// microbatch constants, then its all-reduce. One batch.
// The largest piece of work one replica must hold: the LLM's largest sample; the encoder's
// largest unit (its replicas share microbatches by unit), sample, or dp-th of a sample
// (Even). As (body, last, tokens) and the divisor of that piece.
std::pair<const std::array<double, 3>&, double> largest_item(const Context& ctx, const BatchSums& s,
                                                             const ModuleLayout& l,
                                                             bool is_encoder);

double module_batch_bound(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder, double extra_allreduce_params,
                          const BatchSums& s);

double module_bound(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l, int64_t m,
                    bool is_encoder, double extra_allreduce_params);

// A module's part of the path bound, and of the screening estimate (Search explains both).
// Every microbatch runs forward through all stages and back, one stage after another, so
// the step is at least the longest such path, which is at least the mean over
// microbatches: the module's per-replica share of the batch over m on every stage (an LLM
// replica: at least the mean replica's; the encoder: every replica waits for the slowest
// encoder replica, which holds at least the mean), plus the stage constants (every LLM
// microbatch pays them; the encoder's, at least once in m). The encoder's part also carries
// the all-reduce of global stage 0, which starts after its last backward, i.e. after some
// path ended. It catches what the busy bound cannot: few microbatches on deep pipelines.
// For the screening estimate, `estimate_path` is the same path with every stage constant
// (a typical microbatch), and `excess` the largest, over the module's stages, of the
// stage's busy time (as in the busy bound: the mean share of m microbatches, or the
// largest item one replica must hold, whichever is larger) minus one typical microbatch.
// For the search's evaluation order, `order_path` / `order_slowest` take every microbatch
// at least as slow as the largest item (pessimistic; right when bins hold few samples).
struct PathPart {
  double path = 0.0, estimate_path = 0.0, excess = 0.0;
  double order_path = 0.0, order_slowest = 0.0;
};

// split: under an order that splits backwards (zero bubble), whose path holds no stage's
// weight gradients (each stage's share shrinks by its W's largest possible part).
PathPart module_path_part(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder, const BatchSums& s, bool split = false);

PathPart module_path_mean(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder);

// Elementwise minimum (a lower bound of every term over a set of layouts).
PathPart min_parts(const PathPart& a, const PathPart& b);

// The links of the path of a disaggregated layout: S - 1 forward transfers and a backward
// one over each link that carries gradients.
double path_links(const Context& ctx, int64_t encoder_pp, int64_t llm_pp);

// The screening estimate (not a bound) of a 1F1B step: a typical microbatch's path (the
// pipeline's fill and drain) plus the busiest stage's work beyond that microbatch. For m
// identical microbatches it is exact: path + (m - 1) x the slowest stage.
double uniform_estimate(const PathPart& enc, const PathPart& llm, double links);

// The evaluation order's estimate: the 1F1B step of m microbatches each as slow as
// `order_slowest` says.
double order_estimate(const PathPart& enc, const PathPart& llm, double links, int64_t m);

// A disaggregated candidate's keys from its modules' terms (means over the batches):
// the lower bound, the pruning key (the bound, or the screened estimate if larger) and the
// evaluation order. Every term grows with each module term, so the keys of per-module
// minima bound the keys of every pair of a block from below.
struct Keys {
  double bound, key, order;
};
Keys candidate_keys(const Context& ctx, double enc_busy, const PathPart& enc, double llm_busy,
                    const PathPart& llm, double links, int64_t m);

// Colocated: the encoder's load sits on the LLM's first stage of every replica. One batch.
double colocated_batch_bound(const Context& ctx, const Layout& l, const BatchSums& s);

double colocated_bound(const Context& ctx, const Layout& l);

// The first bound of one batch's step time (the candidate's bound is at most their mean).
double batch_bound(const Context& ctx, const Layout& l, int64_t b);

// The search's key of one batch: the bound, or the screened estimate if larger.
double batch_key(const Context& ctx, const Layout& l, int64_t b);

// ---------------------------------------------------------------------------------------
// Search

// The search over layouts (planner_search.cpp): plan_layouts() after validation.
PlanResult search_layouts(const Context& ctx);

}  // namespace dflop::detail
