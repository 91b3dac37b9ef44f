// Planner: enumeration of layouts, cheap lower bounds, scoring by balance + simulation.
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
#include "dflop/planner.hpp"

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

#include "dflop/balance.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"
#include "dflop/simulator.hpp"
#include "format.hpp"

namespace dflop {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTpAllReducesPerLayer = 4.0;  // 2 forward + 2 backward (Megatron-LM)
// Relative margin of the second bound's pruning test (see Search::evaluate_wave).
constexpr double kBoundSlack = 1e-9;

std::string fmt(double v) { return detail::format_number(v, 6); }

// ---------------------------------------------------------------------------------------
// Validation

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

// Times, sizes and counts above this are no real input and would overflow the step model.
constexpr double kMaxPlannerValue = 1e100;

void check_finite_nonneg(const char* name, double v) {
  require(v >= 0.0 && v <= kMaxPlannerValue,
          std::string(name) + " must be in [0, 1e100], got " + fmt(v));
}

void check_positive(const char* name, double v) {
  require(std::isfinite(v) && v >= 1.0,
          std::string(name) + " must be finite and >= 1, got " + fmt(v));
}

void check_module(const char* module, const ModuleParams& p) {
  const std::string m(module);
  require(p.num_layers >= 1 && p.num_layers <= kMaxPlannerLayers,
          m + ".num_layers must be in [1, " + std::to_string(kMaxPlannerLayers) + "], got " +
              std::to_string(p.num_layers));
  require(p.num_heads >= 1 && p.num_heads <= kMaxPlannerHeads,
          m + ".num_heads must be in [1, " + std::to_string(kMaxPlannerHeads) + "], got " +
              std::to_string(p.num_heads));
  require(p.hidden_size >= 1,
          m + ".hidden_size must be >= 1, got " + std::to_string(p.hidden_size));
  const std::pair<const char*, double> fields[] = {
      {"params_per_layer", p.params_per_layer},
      {"first_stage_params", p.first_stage_params},
      {"last_stage_params", p.last_stage_params},
      {"activation_bytes_per_token_layer", p.activation_bytes_per_token_layer},
      {"head_bytes_per_target_token", p.head_bytes_per_target_token},
      {"input_bytes_per_token", p.input_bytes_per_token},
      {"microbatch_constant_s", p.microbatch_constant_s}};
  for (const auto& [name, value] : fields) check_finite_nonneg((m + "." + name).c_str(), value);
  require(std::isfinite(p.element_bytes) && p.element_bytes >= 1.0 && p.element_bytes <= 8.0,
          m + ".element_bytes must be in [1, 8], got " + fmt(p.element_bytes));
  require(p.head_chunk_tokens >= 0,
          m + ".head_chunk_tokens must be >= 0, got " + std::to_string(p.head_chunk_tokens));
  const std::pair<const char*, double> fractions[] = {
      {"attention_compute_fraction", p.attention_compute_fraction},
      {"attention_param_fraction", p.attention_param_fraction},
      {"attention_activation_fraction", p.attention_activation_fraction}};
  for (const auto& [name, value] : fractions) {
    require(std::isfinite(value) && value >= 0.0 && value <= 1.0,
            m + "." + name + " must be in [0, 1], got " + fmt(value));
  }
  require(
      std::isfinite(p.forward_fraction) && p.forward_fraction >= 0.0 && p.forward_fraction <= 1.0,
      m + ".forward_fraction must be in [0, 1], got " + fmt(p.forward_fraction));
}

void check_column(const char* name, const std::vector<double>& v, size_t expected, bool fraction) {
  require(v.size() == expected, std::string("samples.") + name + " has " +
                                    std::to_string(v.size()) + " values, expected " +
                                    std::to_string(expected));
  for (size_t i = 0; i < v.size(); ++i) {
    const bool ok = v[i] >= 0.0 && v[i] <= (fraction ? 1.0 : kMaxPlannerValue);
    if (!ok) {
      throw InvalidArgument(std::string("samples.") + name + "[" + std::to_string(i) +
                            "] must be in [0, " + (fraction ? "1" : "1e100") + "], got " +
                            fmt(v[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Stages and chunks

// Layers of physical stage s over its chunks (virtual stages c x pp + s).
int64_t stage_layers(const ModuleLayout& l, int64_t s) {
  int64_t n = 0;
  for (int64_t c = 0; c < l.virtual_stages; ++c) n += l.layers_per_stage[size_t(c * l.pp + s)];
  return n;
}

// The most layers one chunk of physical stage s holds.
int64_t largest_chunk(const ModuleLayout& l, int64_t s) {
  int64_t n = 0;
  for (int64_t c = 0; c < l.virtual_stages; ++c)
    n = std::max(n, l.layers_per_stage[size_t(c * l.pp + s)]);
  return n;
}

// The schedule a layout runs: interleaved 1F1B with LLM chunks, else 1F1B.
ScheduleKind schedule_of(const ModuleLayout& llm) {
  return llm.virtual_stages > 1 ? ScheduleKind::Interleaved1F1B : ScheduleKind::OneFOneB;
}

// ---------------------------------------------------------------------------------------
// Cost and memory model of one module

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
  // Stage time of summed samples: body (spread over layers), last (last-stage-only) and
  // tokens; n layers on the stage.
  // With full activation recomputation the forward runs twice: 4/3 of the compute.
  double stage_time(int64_t t, bool recompute, int64_t n, bool is_last, double body, double last,
                    double tokens) const {
    const double compute =
        (body * body_scale * double(n) / double(p->num_layers) + (is_last ? last : 0.0)) /
        (double(t) * eff(t)) * (recompute ? 4.0 / 3.0 : 1.0);
    return compute + tokens * double(n) * comm_per_token_layer(t);
  }
  double stage_constant(int64_t t, int64_t n) const {
    return p->microbatch_constant_s * double(n) / double(p->num_layers) +
           (t > 1 ? double(n) * kTpAllReducesPerLayer * c->link_latency_s : 0.0);
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
  // The whole module's on one GPU of tp t (a colocated encoder).
  double gpu_all_params(int64_t t) const {
    return (p->params_per_layer * double(p->num_layers) + p->last_stage_params) / double(t) +
           p->first_stage_params;
  }
  // Model states of `params` on a GPU: weights and gradients (element_bytes each) and Adam's
  // 16 - 2 x element_bytes bytes (bf16: fp32 master, m, v; fp32: m, v), sharded over dp
  // with zero1.
  double state_bytes(double params, int64_t dp, bool zero1) const {
    const double weights = 2.0 * p->element_bytes, optimizer = 16.0 - weights;
    return params * (weights + (zero1 ? optimizer / double(dp) : optimizer));
  }
  // Activation bytes that microbatches of `tokens` tokens in all keep per GPU on a stage of
  // n layers between their forward and backward: every layer's (full recomputation: each
  // layer's input only).
  double activation_bytes(int64_t t, bool recompute, int64_t n, double tokens) const {
    const double per_layer =
        recompute ? p->element_bytes * double(p->hidden_size) : p->activation_bytes_per_token_layer;
    return tokens * double(n) * per_layer / double(t);
  }
  // With full recomputation, the one layer the backward remakes at a time holds its
  // activations again (of one microbatch of `tokens` tokens). The gradients a backward op
  // makes are not counted: measured at the start of the backward (where CPU peaks fell),
  // they are a fraction of one layer's activations, within the model's error.
  double recompute_bytes(int64_t t, bool recompute, double tokens) const {
    return recompute ? tokens * p->activation_bytes_per_token_layer / double(t) : 0.0;
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

int64_t node_of(int64_t rank, int64_t gpn) { return rank / gpn; }

// Bandwidth of a module's DP group at stage s (rank order: tp fastest, then dp, then pp).
double dp_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s) {
  const int64_t first = l.first_rank + s * l.tp * l.dp;
  const int64_t last = first + (l.dp - 1) * l.tp;
  return node_of(first, c.gpus_per_node) == node_of(last, c.gpus_per_node)
             ? c.intra_node_bandwidth_bytes_per_s
             : c.inter_node_bandwidth_bytes_per_s;
}

double allreduce_time(const ClusterParams& c, const ModuleModel& mm, const ModuleLayout& l,
                      int64_t s, double extra_params) {
  if (l.dp <= 1) return 0.0;
  const double bytes = mm.p->element_bytes * (mm.gpu_params(l, s) + extra_params);
  return 2.0 * double(l.dp - 1) / double(l.dp) * bytes / dp_bandwidth(c, l, s) + c.link_latency_s;
}

// Bandwidth between stage s and s + 1 of a module (worst replica).
double stage_link_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s) {
  for (int64_t d = 0; d < l.dp; ++d) {
    const int64_t a = l.first_rank + s * l.tp * l.dp + d * l.tp;
    if (node_of(a, c.gpus_per_node) != node_of(a + l.tp * l.dp, c.gpus_per_node)) {
      return c.inter_node_bandwidth_bytes_per_s;
    }
  }
  return c.intra_node_bandwidth_bytes_per_s;
}

// Bandwidth from a module's last stage to its first (interleaved chunks wrap around; worst
// replica).
double wrap_link_bandwidth(const ClusterParams& c, const ModuleLayout& l) {
  for (int64_t d = 0; d < l.dp; ++d) {
    const int64_t first = l.first_rank + d * l.tp;
    const int64_t last = first + (l.pp - 1) * l.tp * l.dp;
    if (node_of(first, c.gpus_per_node) != node_of(last, c.gpus_per_node)) {
      return c.inter_node_bandwidth_bytes_per_s;
    }
  }
  return c.intra_node_bandwidth_bytes_per_s;
}

double encoder_llm_bandwidth(const ClusterParams& c, const ModuleLayout& enc,
                             const ModuleLayout& llm) {
  const int64_t enc_first = enc.first_rank + (enc.pp - 1) * enc.tp * enc.dp;
  const int64_t enc_last = enc_first + enc.tp * enc.dp - 1;
  const int64_t llm_last = llm.first_rank + llm.tp * llm.dp - 1;
  const int64_t gpn = c.gpus_per_node;
  return node_of(enc_first, gpn) == node_of(llm_last, gpn) &&
                 node_of(enc_last, gpn) == node_of(llm.first_rank, gpn)
             ? c.intra_node_bandwidth_bytes_per_s
             : c.inter_node_bandwidth_bytes_per_s;
}

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
};

struct Context {
  const ClusterParams& c;
  const PlannerSamples& x;
  const PlannerOptions& o;
  ModuleModel enc, llm;
  std::vector<BatchSums> sums;
  int64_t n = 0;  // samples per batch

  Context(const ClusterParams& cluster, const ModuleParams& e, const ModuleParams& l,
          const PlannerSamples& samples, const PlannerOptions& options)
      : c(cluster), x(samples), o(options) {
    enc.p = &e;
    enc.c = &cluster;
    llm.p = &l;
    llm.c = &cluster;
    const int64_t max_t = std::min<int64_t>(cluster.gpus_per_node, 1024);
    enc.fill_tables(max_t);
    llm.fill_tables(max_t);
    // The encoder of a colocated layout at each TP degree t dividing gpus_per_node, with its
    // heads padded to a multiple of t (planner.hpp, "Padded attention heads").
    enc_padded_params_.assign(size_t(max_t + 1), e);
    enc_colocated_.assign(size_t(max_t + 1), ModuleModel{});  // p == nullptr: not padded
    for (int64_t t = 1; t <= max_t; ++t) {
      if (cluster.gpus_per_node % t || e.num_heads % t == 0) continue;
      const double grow = double(padded_heads(e.num_heads, t)) / double(e.num_heads) - 1.0;
      ModuleParams& q = enc_padded_params_[size_t(t)];
      q.num_heads = padded_heads(e.num_heads, t);
      q.params_per_layer *= 1.0 + e.attention_param_fraction * grow;
      q.activation_bytes_per_token_layer *= 1.0 + e.attention_activation_fraction * grow;
      ModuleModel& mm = enc_colocated_[size_t(t)];
      mm = enc;
      mm.p = &q;
      mm.body_scale = 1.0 + e.attention_compute_fraction * grow;
    }
    n = samples.batch_size;
    sums.resize(size_t(samples.num_batches));
    for (int64_t b = 0; b < samples.num_batches; ++b) {
      BatchSums& s = sums[size_t(b)];
      double best_e = -1, best_l = -1, best_unit = -1;
      for (int64_t i = b * n; i < (b + 1) * n; ++i) {
        const size_t k = size_t(i);
        const double eb = x.encoder_s[k] * (1 - x.encoder_last_fraction[k]);
        const double el = x.encoder_s[k] * x.encoder_last_fraction[k];
        const double lb = x.llm_s[k] * (1 - x.llm_last_fraction[k]);
        const double ll = x.llm_s[k] * x.llm_last_fraction[k];
        s.enc_body += eb;
        s.enc_last += el;
        s.enc_tokens += x.encoder_tokens[k];
        s.llm_body += lb;
        s.llm_last += ll;
        s.llm_tokens += x.llm_tokens[k];
        s.llm_targets += x.target_tokens(k);
        s.max_enc_tokens = std::max(s.max_enc_tokens, x.encoder_tokens[k]);
        s.max_llm_tokens = std::max(s.max_llm_tokens, x.llm_tokens[k]);
        s.max_llm_targets = std::max(s.max_llm_targets, x.target_tokens(k));
        if (x.encoder_s[k] > best_e) {
          best_e = x.encoder_s[k];
          s.max_enc = {eb, el, x.encoder_tokens[k]};
        }
        if (x.encoder_units[k] > 0) {
          const double u = double(x.encoder_units[k]);
          s.has_visual = true;
          s.max_enc_unit_tokens = std::max(s.max_enc_unit_tokens, x.encoder_tokens[k] / u);
          if (x.encoder_s[k] / u > best_unit) {
            best_unit = x.encoder_s[k] / u;
            s.max_enc_unit = {eb / u, el / u, x.encoder_tokens[k] / u};
          }
        }
        if (x.llm_s[k] > best_l) {
          best_l = x.llm_s[k];
          s.max_llm = {lb, ll, x.llm_tokens[k]};
        }
      }
    }
  }
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

int64_t total_stages(const Layout& l) { return l.colocated ? l.llm.pp : l.encoder.pp + l.llm.pp; }

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
// Scoring one layout

// Virtual stages of a simulator input (its arrays' second axis).
int64_t virtual_stages_of(const PipelineSimInput& in) {
  return int64_t(in.forward_s.size()) / (in.num_replicas * in.num_microbatches);
}

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
  void resize(size_t bins) {
    for (auto* v : {&enc_body, &enc_last, &enc_tokens, &llm_body, &llm_last, &llm_tokens, &visual,
                    &llm_targets})
      v->assign(bins, 0.0);
  }
};

// The encoder's replicas on one microbatch: every replica's seconds per stage, its tokens.
struct EncoderReplicas {
  std::vector<double> stage_s;  // dp x pp, row-major: incl. the constant where it has work
  std::vector<double> tokens;   // dp
  UnitSplit split;              // Unit / Sample: the pieces (sample = position in members)
};

class Evaluator {
 public:
  explicit Evaluator(const Context& ctx) : ctx_(ctx) {}

  // Per-sample seconds of an average stage of each module under layout l, batch b: (n, 2)
  // row-major. Column 0: a disaggregated encoder's stage on one replica (its replicas share
  // microbatches by unit), or a colocated layout's first stage (the encoder plus its LLM
  // layers); column 1: an average LLM stage.
  std::vector<double> sample_stage_costs(const Layout& l, int64_t b) const {
    const int64_t n = ctx_.n;
    const ModuleLayout &e = l.encoder, &g = l.llm;
    std::vector<double> costs(size_t(2 * n));
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = size_t(b * n + i);
      const auto& x = ctx_.x;
      const double enc =
          ctx_.enc.stage_time(e.tp, e.recompute, ctx_.enc.p->num_layers, true,
                              x.encoder_s[k] * (1 - x.encoder_last_fraction[k]),
                              x.encoder_s[k] * x.encoder_last_fraction[k], x.encoder_tokens[k]);
      const double lm = ctx_.llm.stage_time(g.tp, g.recompute, ctx_.llm.p->num_layers, true,
                                            x.llm_s[k] * (1 - x.llm_last_fraction[k]),
                                            x.llm_s[k] * x.llm_last_fraction[k], x.llm_tokens[k]);
      if (l.colocated) {
        // Both columns are per bin (every replica runs its own encoder).
        const double first = double(stage_layers(g, 0)) / double(ctx_.llm.p->num_layers);
        const ModuleModel& ce = ctx_.colocated_enc(g.tp);
        const double enc_here =
            ce.stage_time(g.tp, g.recompute, ce.p->num_layers, true,
                          x.encoder_s[k] * (1 - x.encoder_last_fraction[k]),
                          x.encoder_s[k] * x.encoder_last_fraction[k], x.encoder_tokens[k]);
        costs[size_t(2 * i)] = enc_here + lm * first;
      } else {
        costs[size_t(2 * i)] = enc / double(e.pp);
      }
      costs[size_t(2 * i + 1)] = lm / double(g.pp);
    }
    return costs;
  }

  // The per-microbatch constant of an average stage of each module (disaggregated).
  std::array<double, 2> stage_constants(const Layout& l) const {
    const ModuleLayout &e = l.encoder, &g = l.llm;
    return {ctx_.enc.stage_constant(e.tp, ctx_.enc.p->num_layers) / double(e.pp),
            ctx_.llm.stage_constant(g.tp, ctx_.llm.p->num_layers) / double(g.pp)};
  }

  // The schedule of batch b: bin of each sample (bin = microbatch x dp + rank).
  std::vector<int64_t> assign(const Layout& l, int64_t b) const {
    const int64_t n = ctx_.n, m = l.num_microbatches, dp = l.llm.dp;
    std::vector<int64_t> bins(static_cast<size_t>(n), 0);
    if (l.colocated && ctx_.o.strategy == PlanStrategy::DataBlindColocated) {
      // Data-blind: dataset order, equal-count microbatches, each split evenly over ranks
      // (the same rule as dflop.data_blind_schedule).
      std::vector<int64_t> count(static_cast<size_t>(m), 0), seen(size_t(m), 0);
      for (int64_t i = 0; i < n; ++i) ++count[size_t(i * m / n)];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t mb = i * m / n;
        const int64_t rank = seen[size_t(mb)]++ * dp / count[size_t(mb)];
        bins[size_t(i)] = mb * dp + rank;
      }
      return bins;
    }
    // Per-sample time of an average stage of each module, so that the balance's min-max
    // targets the pipeline's bottleneck in seconds; a disaggregated encoder's per replica.
    std::vector<double> costs = sample_stage_costs(l, b);
    if (!l.colocated) {
      for (int64_t i = 0; i < n; ++i) costs[size_t(2 * i)] /= double(l.encoder.dp);
    }
    BalanceOptions bo;
    bo.num_microbatches = m;
    bo.dp_size = dp;
    if (!l.colocated) bo.microbatch_dims = {0};
    bo.seed = ctx_.o.seed + uint64_t(b);
    bo.work_budget = ctx_.o.balance_work_budget;
    return balance(costs.data(), n, 2, bo).assignment;
  }

  BinSums bin_sums(const Layout& l, int64_t b, const std::vector<int64_t>& bins) const {
    BinSums s;
    const int64_t m = l.num_microbatches, dp = l.llm.dp;
    s.resize(size_t(m * dp));
    const auto& x = ctx_.x;
    for (int64_t i = 0; i < ctx_.n; ++i) {
      const size_t k = size_t(b * ctx_.n + i), bin = size_t(bins[size_t(i)]);
      s.enc_body[bin] += x.encoder_s[k] * (1 - x.encoder_last_fraction[k]);
      s.enc_last[bin] += x.encoder_s[k] * x.encoder_last_fraction[k];
      s.enc_tokens[bin] += x.encoder_tokens[k];
      s.llm_body[bin] += x.llm_s[k] * (1 - x.llm_last_fraction[k]);
      s.llm_last[bin] += x.llm_s[k] * x.llm_last_fraction[k];
      s.llm_tokens[bin] += x.llm_tokens[k];
      s.llm_targets[bin] += x.target_tokens(k);
      s.visual[bin] += x.visual_tokens[k];
    }
    if (l.colocated) return s;
    const ModuleLayout& e = l.encoder;
    s.enc_stage_s.assign(size_t(m * e.pp), 0.0);
    s.enc_max_tokens.assign(size_t(m), 0.0);
    s.enc_busy_s.assign(size_t(e.pp), 0.0);
    const std::vector<std::vector<int64_t>> members = microbatch_members(bins, m, dp);
    for (int64_t k = 0; k < m; ++k) {
      const EncoderReplicas reps = encoder_replicas(l, b, members[size_t(k)], s, k);
      for (int64_t r = 0; r < e.dp; ++r) {
        s.enc_max_tokens[size_t(k)] = std::max(s.enc_max_tokens[size_t(k)], reps.tokens[size_t(r)]);
        for (int64_t st = 0; st < e.pp; ++st) {
          const double t = reps.stage_s[size_t(r * e.pp + st)];
          double& slowest = s.enc_stage_s[size_t(k * e.pp + st)];
          slowest = std::max(slowest, t);
          s.enc_busy_s[size_t(st)] += t;
        }
      }
    }
    return s;
  }

  // The samples (indices in the batch) of each microbatch, ascending: the order in which
  // the runtime hands a microbatch to split_units.
  static std::vector<std::vector<int64_t>> microbatch_members(const std::vector<int64_t>& bins,
                                                              int64_t m, int64_t dp) {
    std::vector<std::vector<int64_t>> out(static_cast<size_t>(m));
    for (size_t i = 0; i < bins.size(); ++i) out[size_t(bins[i] / dp)].push_back(int64_t(i));
    return out;
  }

  // The encoder replicas' work on microbatch k (members ascending) of batch b under the
  // layout's encoder split. `sums` holds the microbatch's per-bin encoder sums (Even only).
  EncoderReplicas encoder_replicas(const Layout& l, int64_t b, const std::vector<int64_t>& members,
                                   const BinSums& sums, int64_t k) const {
    const ModuleLayout& e = l.encoder;
    const auto& x = ctx_.x;
    EncoderReplicas out;
    std::vector<double> body(size_t(e.dp), 0.0), last(size_t(e.dp), 0.0);
    std::vector<char> has_work(size_t(e.dp), 0);
    out.tokens.assign(size_t(e.dp), 0.0);
    if (ctx_.o.encoder_split == EncoderSplit::Even) {
      double total_body = 0, total_last = 0, total_tokens = 0;
      for (int64_t r = 0; r < l.llm.dp; ++r) {
        const size_t bin = size_t(k * l.llm.dp + r);
        total_body += sums.enc_body[bin];
        total_last += sums.enc_last[bin];
        total_tokens += sums.enc_tokens[bin];
      }
      std::fill(body.begin(), body.end(), total_body / double(e.dp));
      std::fill(last.begin(), last.end(), total_last / double(e.dp));
      std::fill(out.tokens.begin(), out.tokens.end(), total_tokens / double(e.dp));
      std::fill(has_work.begin(), has_work.end(), char(total_tokens > 0 || total_body > 0));
    } else {
      std::vector<int64_t> units(members.size());
      std::vector<double> costs(members.size());
      for (size_t p = 0; p < members.size(); ++p) {
        const size_t i = size_t(b * ctx_.n + members[p]);
        units[p] = x.encoder_units[i];
        costs[p] = x.encoder_s[i];
      }
      out.split =
          split_units(units.data(), costs.data(), int64_t(members.size()), e.dp,
                      ctx_.o.encoder_split == EncoderSplit::Sample ? SplitGranularity::Sample
                                                                   : SplitGranularity::Unit);
      const UnitSplit& sp = out.split;
      for (size_t q = 0; q < sp.sample.size(); ++q) {
        const size_t i = size_t(b * ctx_.n + members[size_t(sp.sample[q])]);
        const double share = double(sp.num_units[q]) / double(x.encoder_units[i]);
        const size_t r = size_t(sp.replica[q]);
        body[r] += share * x.encoder_s[i] * (1 - x.encoder_last_fraction[i]);
        last[r] += share * x.encoder_s[i] * x.encoder_last_fraction[i];
        out.tokens[r] += share * x.encoder_tokens[i];
        has_work[r] = 1;
      }
    }
    out.stage_s.assign(size_t(e.dp * e.pp), 0.0);
    for (int64_t r = 0; r < e.dp; ++r) {
      if (!has_work[size_t(r)]) continue;  // an empty share computes nothing
      for (int64_t st = 0; st < e.pp; ++st) {
        const int64_t nl = e.layers_per_stage[size_t(st)];
        out.stage_s[size_t(r * e.pp + st)] =
            ctx_.enc.stage_time(e.tp, e.recompute, nl, st == e.pp - 1, body[size_t(r)],
                                last[size_t(r)], out.tokens[size_t(r)]) +
            ctx_.enc.stage_constant(e.tp, nl);
      }
    }
    return out;
  }

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
                const InFlightTokens& enc_tokens) const {
    const Memory enc =
        l.colocated ? Memory{} : encoder_memory(l.encoder, l.llm, l.num_microbatches, enc_tokens);
    return combine(enc, llm_memory(l.llm, l.colocated, l.num_microbatches, llm_tokens,
                                   llm_bin_targets, enc_tokens));
  }
  // The peak over the encoder's stages (disaggregated: the LLM's stages g follow them).
  Memory encoder_memory(const ModuleLayout& e, const ModuleLayout& g, int64_t m,
                        const InFlightTokens& enc_tokens) const {
    Memory out;
    const PipelineShape shape{{e.pp, g.pp}, {1, g.virtual_stages}};
    for (int64_t s = 0; s < e.pp; ++s) {
      const int64_t n = e.layers_per_stage[size_t(s)];
      const int64_t in_flight = peak_in_flight(schedule_of(g), shape, m, s);
      const double bytes =
          ctx_.enc.state_bytes(ctx_.enc.gpu_params(e, s), e.dp, ctx_.o.zero1) +
          ctx_.enc.activation_bytes(e.tp, e.recompute, n, enc_tokens.at(in_flight)) +
          ctx_.enc.recompute_bytes(e.tp, e.recompute, enc_tokens.at(1)) +
          (s == 0 ? ctx_.enc.input_bytes(enc_tokens.at(m)) : 0.0);
      out.stage_bytes.push_back(bytes);
      if (bytes > out.peak) out.set_peak(bytes, true, s);
    }
    return out;
  }
  // The peak over the LLM's stages (colocated: the encoder's on the first).
  Memory llm_memory(const ModuleLayout& g, bool colocated, int64_t m,
                    const InFlightTokens& llm_tokens, double llm_bin_targets,
                    const InFlightTokens& enc_tokens) const {
    Memory out;
    const bool zero1 = ctx_.o.zero1;
    const PipelineShape shape{{g.pp}, {g.virtual_stages}};
    for (int64_t s = 0; s < g.pp; ++s) {
      // The activations of one microbatch on one chunk (the stage itself without chunks).
      const int64_t n = largest_chunk(g, s);
      const int64_t in_flight = peak_in_flight(schedule_of(g), shape, m, s);
      double bytes = ctx_.llm.state_bytes(ctx_.llm.gpu_params(g, s), g.dp, zero1) +
                     ctx_.llm.activation_bytes(g.tp, g.recompute, n, llm_tokens.at(in_flight));
      // One transient at a time on top of what is held: a remade layer or (last stage,
      // all layers' activations still held) the head's chunk.
      double working = ctx_.llm.recompute_bytes(g.tp, g.recompute, llm_tokens.at(1));
      if (s == g.pp - 1) working = std::max(working, ctx_.llm.head_bytes(g.tp, llm_bin_targets));
      bool is_enc = false;
      if (colocated && s == 0) {
        const ModuleModel& ce = ctx_.colocated_enc(g.tp);
        const double enc_bytes =
            ce.state_bytes(ce.gpu_all_params(g.tp), g.dp, zero1) +
            ce.activation_bytes(g.tp, g.recompute, ce.p->num_layers, enc_tokens.at(in_flight)) +
            ce.input_bytes(enc_tokens.at(m));
        working = std::max(working, ce.recompute_bytes(g.tp, g.recompute, enc_tokens.at(1)));
        is_enc = enc_bytes > bytes;
        bytes += enc_bytes;
      }
      bytes += working;
      out.stage_bytes.push_back(bytes);
      if (bytes > out.peak) out.set_peak(bytes, is_enc, s);
    }
    return out;
  }
  // Peak over all stages: the encoder's first, ties to the earlier stage; plus the reserve.
  Memory combine(const Memory& enc, const Memory& llm) const {
    Memory out = llm.peak > enc.peak ? llm : enc;
    out.peak += ctx_.c.memory_reserve_bytes;
    out.stage_bytes = enc.stage_bytes;
    out.stage_bytes.insert(out.stage_bytes.end(), llm.stage_bytes.begin(), llm.stage_bytes.end());
    return out;
  }

  // The fewest tokens any schedule could put in flight on an LLM GPU / encoder GPU
  // (disaggregated: per microbatch over encoder_dp GPUs; colocated: per bin): some GPU
  // holds an average microbatch or more, and some the largest sample (unit).
  InFlightTokens llm_tokens_lower_bound(int64_t m, int64_t dp) const {
    InFlightTokens out;
    const double bins = double(m * dp);
    for (const BatchSums& s : ctx_.sums) {
      out.average = std::max(out.average, s.llm_tokens / bins);
      out.single = std::max(out.single, s.max_llm_tokens);
    }
    return out;
  }
  // The same for the largest bin's target tokens.
  double llm_targets_lower_bound(int64_t m, int64_t dp) const {
    double targets = 0;
    const double bins = double(m * dp);
    for (const BatchSums& s : ctx_.sums) {
      targets = std::max(targets, std::max(s.llm_targets / bins, s.max_llm_targets));
    }
    return targets;
  }
  // Disaggregated: some microbatch holds >= total / m, so some replica >= total / (m dp);
  // and some replica holds the largest unit (Unit), sample (Sample) or its dp-th (Even).
  InFlightTokens enc_tokens_lower_bound(int64_t m, int64_t llm_dp, bool colocated,
                                        int64_t encoder_dp) const {
    InFlightTokens out;
    const double bins = double(m * llm_dp);
    for (const BatchSums& s : ctx_.sums) {
      if (colocated) {
        out.average = std::max(out.average, s.enc_tokens / bins);
        out.single = std::max(out.single, s.max_enc_tokens);
        continue;
      }
      double largest = s.max_enc_unit_tokens;
      if (ctx_.o.encoder_split == EncoderSplit::Sample) largest = s.max_enc_tokens;
      if (ctx_.o.encoder_split == EncoderSplit::Even)
        largest = s.max_enc_tokens / double(encoder_dp);
      out.average = std::max(out.average, s.enc_tokens / double(m) / double(encoder_dp));
      out.single = std::max(out.single, largest);
    }
    return out;
  }

  // Memory with the smallest bins any schedule could give (for pruning before balance).
  Memory memory_lower_bound(const Layout& l) const {
    const int64_t m = l.num_microbatches;
    return memory(l, llm_tokens_lower_bound(m, l.llm.dp), llm_targets_lower_bound(m, l.llm.dp),
                  enc_tokens_lower_bound(m, l.llm.dp, l.colocated, l.encoder.dp));
  }

  // Simulator input of batch b given the bin sums and a microbatch order. Disaggregated:
  // segments (encoder pp, LLM pp) with the LLM's chunks; arrays over virtual stages.
  PipelineSimInput sim_input(const Layout& l, const BinSums& s, const std::vector<int64_t>& order,
                             bool record_events) const {
    const ModuleLayout &e = l.encoder, &g = l.llm;
    const int64_t m = l.num_microbatches, R = g.dp, S = total_stages(l);
    const int64_t E = l.colocated ? 0 : e.pp, v = g.virtual_stages, V = E + g.pp * v;
    PipelineSimInput in;
    in.num_replicas = R;
    in.num_stages = S;
    in.num_microbatches = m;
    in.record_events = record_events;
    in.schedule = schedule_of(g);
    in.shape = l.colocated ? PipelineShape::plain(S) : PipelineShape{{E, g.pp}, {1, v}};
    const size_t cells = size_t(R * V * m);
    in.forward_s.assign(cells, 0.0);
    in.backward_s.assign(cells, 0.0);
    in.link_latency_s.assign(size_t(V - 1), ctx_.c.link_latency_s);
    in.link_bandwidth_bytes_per_s.assign(size_t(V - 1), 0.0);
    in.activation_bytes.assign(size_t(R * (V - 1) * m), 0.0);
    in.allreduce_s.assign(size_t(S), 0.0);
    auto put = [&](int64_t r, int64_t vs, int64_t k, double seconds) {
      const size_t i = size_t((r * V + vs) * m + k);
      const double f = vs < E ? ctx_.enc.p->forward_fraction : ctx_.llm.p->forward_fraction;
      in.forward_s[i] = seconds * f;
      in.backward_s[i] = seconds * (1.0 - f);
    };
    auto bytes_at = [&](int64_t r, int64_t boundary, int64_t k) -> double& {
      return in.activation_bytes[size_t((r * (V - 1) + boundary) * m + k)];
    };
    const double enc_h = double(ctx_.enc.p->hidden_size), llm_h = double(ctx_.llm.p->hidden_size);
    const double enc_bytes = ctx_.enc.p->element_bytes, llm_bytes = ctx_.llm.p->element_bytes;
    for (int64_t k = 0; k < m; ++k) {
      const int64_t mb = order[size_t(k)];
      if (!l.colocated) {
        // Every LLM replica waits for the encoder's slowest replica (encoder_replicas).
        for (int64_t st = 0; st < E; ++st) {
          const double t = s.enc_stage_s[size_t(mb * E + st)];
          for (int64_t r = 0; r < R; ++r) put(r, st, k, t);
          if (st < E - 1) {
            for (int64_t r = 0; r < R; ++r) {
              bytes_at(r, st, k) = s.enc_max_tokens[size_t(mb)] * enc_h * enc_bytes / double(e.tp);
            }
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          bytes_at(r, E - 1, k) = s.visual[size_t(mb * R + r)] * llm_h * llm_bytes;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const size_t bin = size_t(mb * R + r);
        for (int64_t c = 0; c < v; ++c) {
          for (int64_t st = 0; st < g.pp; ++st) {
            const int64_t vs = c * g.pp + st, nl = g.layers_per_stage[size_t(vs)];
            const bool is_last = vs == g.pp * v - 1;
            double t = ctx_.llm.stage_time(g.tp, g.recompute, nl, is_last, s.llm_body[bin],
                                           s.llm_last[bin], s.llm_tokens[bin]) +
                       ctx_.llm.stage_constant(g.tp, nl);
            if (l.colocated && st == 0) {
              const ModuleModel& ce = ctx_.colocated_enc(g.tp);
              t += ce.stage_time(g.tp, g.recompute, ce.p->num_layers, true, s.enc_body[bin],
                                 s.enc_last[bin], s.enc_tokens[bin]) +
                   ce.stage_constant(g.tp, ce.p->num_layers);
            }
            put(r, E + vs, k, t);
            if (!is_last)
              bytes_at(r, E + vs, k) = s.llm_tokens[bin] * llm_h * llm_bytes / double(g.tp);
          }
        }
      }
    }
    for (int64_t st = 0; st + 1 < E; ++st) {
      in.link_bandwidth_bytes_per_s[size_t(st)] = stage_link_bandwidth(ctx_.c, e, st);
    }
    if (!l.colocated) {
      in.link_bandwidth_bytes_per_s[size_t(E - 1)] = encoder_llm_bandwidth(ctx_.c, e, g);
      for (int64_t st = 0; st < E; ++st) {
        in.allreduce_s[size_t(st)] = allreduce_time(ctx_.c, ctx_.enc, e, st, 0.0);
      }
    }
    for (int64_t vs = 0; vs + 1 < g.pp * v; ++vs) {
      const int64_t st = vs % g.pp;  // the wrap from the last stage to the first: chunk c + 1
      in.link_bandwidth_bytes_per_s[size_t(E + vs)] =
          st + 1 < g.pp ? stage_link_bandwidth(ctx_.c, g, st) : wrap_link_bandwidth(ctx_.c, g);
    }
    for (int64_t st = 0; st < g.pp; ++st) {
      const double extra =
          (l.colocated && st == 0) ? ctx_.colocated_enc(g.tp).gpu_all_params(g.tp) : 0.0;
      in.allreduce_s[size_t(E + st)] = allreduce_time(ctx_.c, ctx_.llm, g, st, extra);
    }
    return in;
  }

  // Microbatch orderings (position -> microbatch) to try.
  std::vector<std::pair<MicrobatchOrder, std::vector<int64_t>>> orders(
      const Layout& l, const PipelineSimInput& base) const {
    const int64_t m = l.num_microbatches, R = base.num_replicas, S = virtual_stages_of(base);
    std::vector<int64_t> identity(static_cast<size_t>(m));
    std::iota(identity.begin(), identity.end(), 0);
    std::vector<std::pair<MicrobatchOrder, std::vector<int64_t>>> out;
    out.emplace_back(MicrobatchOrder::AsScheduled, identity);
    if (!ctx_.o.order_microbatches || m < 3 || ctx_.o.strategy != PlanStrategy::DataAware) {
      return out;
    }
    // Length of a microbatch: its slowest replica's time summed over stages.
    std::vector<double> length(static_cast<size_t>(m), 0.0);
    for (int64_t k = 0; k < m; ++k) {
      for (int64_t r = 0; r < R; ++r) {
        double sum = 0;
        for (int64_t st = 0; st < S; ++st) {
          const size_t i = size_t((r * S + st) * m + k);
          sum += base.forward_s[i] + base.backward_s[i];
        }
        length[size_t(k)] = std::max(length[size_t(k)], sum);
      }
    }
    std::vector<int64_t> asc = identity;
    std::stable_sort(asc.begin(), asc.end(),
                     [&](int64_t a, int64_t b) { return length[size_t(a)] < length[size_t(b)]; });
    std::vector<int64_t> desc(asc.rbegin(), asc.rend());
    std::vector<int64_t> ends(static_cast<size_t>(m));
    int64_t front = 0, back = m - 1;
    for (int64_t i = 0; i < m; ++i) ends[size_t(i % 2 == 0 ? front++ : back--)] = asc[size_t(i)];
    out.emplace_back(MicrobatchOrder::LongestFirst, desc);
    out.emplace_back(MicrobatchOrder::ShortestFirst, asc);
    out.emplace_back(MicrobatchOrder::ShortEnds, ends);
    return out;
  }

  // Reorders a simulator input built with the identity order (cheaper than rebuilding).
  static PipelineSimInput permuted(const PipelineSimInput& in, const std::vector<int64_t>& order) {
    PipelineSimInput out = in;
    const int64_t R = in.num_replicas, S = virtual_stages_of(in), m = in.num_microbatches;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t st = 0; st < S; ++st) {
        for (int64_t k = 0; k < m; ++k) {
          const size_t to = size_t((r * S + st) * m + k);
          const size_t from = size_t((r * S + st) * m + order[size_t(k)]);
          out.forward_s[to] = in.forward_s[from];
          out.backward_s[to] = in.backward_s[from];
        }
      }
      for (int64_t st = 0; st + 1 < S; ++st) {
        for (int64_t k = 0; k < m; ++k) {
          out.activation_bytes[size_t((r * (S - 1) + st) * m + k)] =
              in.activation_bytes[size_t((r * (S - 1) + st) * m + order[size_t(k)])];
        }
      }
    }
    return out;
  }

  StepBreakdown breakdown(const Layout& l, const BinSums& sums, const PipelineSimInput& in,
                          const PipelineSimResult& res, MicrobatchOrder order) const {
    StepBreakdown out;
    out.step_time_s = res.step_time_s;
    out.order = order;
    const int64_t R = in.num_replicas, S = in.num_stages, m = in.num_microbatches;
    const int64_t E = l.colocated ? 0 : l.encoder.pp;
    out.stage_compute_s.assign(size_t(S), 0.0);
    double busy_gpu_s = 0.0;
    for (int64_t st = 0; st < S; ++st) {
      if (st < E) {
        // Encoder stage: what its replicas compute (the simulation's encoder stages hold
        // the slowest replica's time), tp GPUs each.
        out.stage_compute_s[size_t(st)] = sums.enc_busy_s[size_t(st)] / double(l.encoder.dp);
        busy_gpu_s += sums.enc_busy_s[size_t(st)] * double(l.encoder.tp);
        continue;
      }
      double sum = 0;
      for (int64_t r = 0; r < R; ++r) sum += res.busy_s[size_t(r * S + st)];
      out.stage_compute_s[size_t(st)] = sum / double(R);
      busy_gpu_s += sum * double(l.llm.tp);  // tp GPUs per LLM replica
    }
    out.stage_allreduce_s = in.allreduce_s;
    const double gpus = double(ctx_.c.num_gpus);
    out.idle_fraction = res.step_time_s > 0 ? 1.0 - busy_gpu_s / (res.step_time_s * gpus) : 0.0;
    if (E > 0) {
      const double bw = in.link_bandwidth_bytes_per_s[size_t(E - 1)];
      const int64_t V = virtual_stages_of(in);
      for (int64_t k = 0; k < m; ++k) {
        double bytes = 0;
        for (int64_t r = 0; r < R; ++r)
          bytes += in.activation_bytes[size_t((r * (V - 1) + E - 1) * m + k)];
        out.transfer_s += bytes / double(R) / bw;
      }
    }
    return out;
  }

  // assign()'s costs, options and seed depend on the layout only through these fields, so
  // two layouts with the same key get the same schedules: the search balances once per key.
  using ScheduleKey = std::array<int64_t, 9>;
  static ScheduleKey schedule_key(const Layout& l) {
    const ModuleLayout &e = l.encoder, &g = l.llm;
    if (l.colocated) {
      return {1,    l.num_microbatches,    g.dp, g.tp, g.recompute ? 1 : 0,
              g.pp, g.layers_per_stage[0], 0,    0};
    }
    return {0,    l.num_microbatches,  g.dp,       g.tp, g.recompute ? 1 : 0, g.pp,
            e.tp, e.recompute ? 1 : 0, e.pp * e.dp};
  }

  // A layout's schedules as bin sums (one per sampled batch), with the exact memory check.
  struct Prepared {
    std::vector<BinSums> sums;  // per batch
    Memory mem;
    bool feasible = false;
  };
  Prepared prepare(const Layout& l, std::vector<BinSums> sums) const {
    Prepared out;
    out.sums = std::move(sums);
    InFlightTokens llm_tokens, enc_tokens;
    double llm_targets = 0;
    const int64_t m = l.num_microbatches, dp = l.llm.dp;
    std::vector<double> llm_gpu(static_cast<size_t>(m)), enc_gpu(static_cast<size_t>(m));
    for (const BinSums& s : out.sums) {
      for (const double t : s.llm_targets) llm_targets = std::max(llm_targets, t);
      for (int64_t r = 0; r < dp; ++r) {  // an LLM replica's microbatches: bins k dp + r
        for (int64_t k = 0; k < m; ++k) {
          llm_gpu[size_t(k)] = s.llm_tokens[size_t(k * dp + r)];
          enc_gpu[size_t(k)] = l.colocated ? s.enc_tokens[size_t(k * dp + r)] : 0.0;
        }
        llm_tokens.add(llm_gpu);
        if (l.colocated) enc_tokens.add(enc_gpu);
      }
      if (!l.colocated) enc_tokens.add(s.enc_max_tokens);  // the largest replica's, each
    }
    out.mem = memory(l, llm_tokens, llm_targets, enc_tokens);
    out.feasible = out.mem.peak <= ctx_.c.gpu_memory_bytes;
    return out;
  }

  // One replica of a simulator input built with the identity order, reordered.
  static PipelineSimInput replica_input(const PipelineSimInput& in, int64_t r,
                                        const std::vector<int64_t>& order) {
    const int64_t S = virtual_stages_of(in), m = in.num_microbatches;
    PipelineSimInput out;
    out.num_replicas = 1;
    out.num_stages = in.num_stages;
    out.num_microbatches = m;
    out.schedule = in.schedule;
    out.shape = in.shape;
    out.record_events = false;
    out.link_latency_s = in.link_latency_s;
    out.link_bandwidth_bytes_per_s = in.link_bandwidth_bytes_per_s;
    out.allreduce_s = in.allreduce_s;
    out.forward_s.resize(size_t(S * m));
    out.backward_s.resize(size_t(S * m));
    for (int64_t st = 0; st < S; ++st) {
      for (int64_t k = 0; k < m; ++k) {
        const size_t from = size_t((r * S + st) * m + order[size_t(k)]);
        out.forward_s[size_t(st * m + k)] = in.forward_s[from];
        out.backward_s[size_t(st * m + k)] = in.backward_s[from];
      }
    }
    if (!in.activation_bytes.empty()) {
      out.activation_bytes.resize(size_t((S - 1) * m));
      for (int64_t st = 0; st + 1 < S; ++st) {
        for (int64_t k = 0; k < m; ++k) {
          out.activation_bytes[size_t(st * m + k)] =
              in.activation_bytes[size_t((r * (S - 1) + st) * m + order[size_t(k)])];
        }
      }
    }
    return out;
  }

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
  double replica_bound(const Layout& l, const BinSums& sums, double enough) const {
    const int64_t m = l.num_microbatches;
    std::vector<int64_t> identity(static_cast<size_t>(m));
    std::iota(identity.begin(), identity.end(), 0);
    const PipelineSimInput base = sim_input(l, sums, identity, false);
    // Physical stages S run virtual stages V (the LLM's chunks); each stage's first action
    // is the forward of its first chunk, its last the backward of that chunk.
    const int64_t R = base.num_replicas, S = base.num_stages, V = virtual_stages_of(base);
    const std::vector<int64_t> owner = virtual_stage_owners(input_shape(base));
    std::vector<int64_t> first_chunk(static_cast<size_t>(S), -1);
    for (int64_t u = V - 1; u >= 0; --u) first_chunk[size_t(owner[size_t(u)])] = u;
    std::vector<double> busy(static_cast<size_t>(R * S), 0.0);
    int64_t most_work = 0, busiest = 0;
    double best_work = -1, best_stage = -1;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t u = 0; u < V; ++u) {
        double& stage = busy[size_t(r * S + owner[size_t(u)])];
        for (int64_t k = 0; k < m; ++k) {
          const size_t i = size_t((r * V + u) * m + k);
          stage += base.forward_s[i] + base.backward_s[i];
        }
      }
      double work = 0, stage_max = 0;
      for (int64_t st = 0; st < S; ++st) {
        work += busy[size_t(r * S + st)];
        stage_max = std::max(stage_max, busy[size_t(r * S + st)]);
      }
      if (work > best_work) best_work = work, most_work = r;
      if (stage_max > best_stage) best_stage = stage_max, busiest = r;
    }
    auto transfer = [&](int64_t r, int64_t link, int64_t k) {
      const double bytes = base.activation_bytes.empty()
                               ? 0.0
                               : base.activation_bytes[size_t((r * (V - 1) + link) * m + k)];
      return bytes / base.link_bandwidth_bytes_per_s[size_t(link)] +
             base.link_latency_s[size_t(link)];
    };
    auto allreduce = [&](int64_t st) {
      return base.allreduce_s.empty() ? 0.0 : base.allreduce_s[size_t(st)];
    };
    const auto all = orders(l, base);
    std::vector<double> paths(all.size(), 0.0);
    double bound = kInf;
    for (size_t o = 0; o < all.size(); ++o) {
      const int64_t first = all[o].second.front(), last = all[o].second.back();
      for (int64_t r = 0; r < R; ++r) {
        // fill[u]: microbatch `first`'s forwards and sends up to virtual stage u.
        double fill = 0;
        std::vector<double> fill_at(static_cast<size_t>(V), 0.0);
        for (int64_t u = 0; u < V; ++u) {
          fill_at[size_t(u)] = fill;
          if (u + 1 < V) {
            fill += base.forward_s[size_t((r * V + u) * m + first)] + transfer(r, u, first);
          }
        }
        for (int64_t st = 0; st < S; ++st) {
          const int64_t u0 = first_chunk[size_t(st)];
          const double end = fill_at[size_t(u0)] + busy[size_t(r * S + st)];
          double tail = allreduce(st), drain = 0;
          for (int64_t down = u0 - 1; down >= 0; --down) {
            drain += transfer(r, down, last) + base.backward_s[size_t((r * V + down) * m + last)];
            tail = std::max(tail, drain + allreduce(owner[size_t(down)]));
          }
          paths[o] = std::max(paths[o], end + tail);
        }
      }
      bound = std::min(bound, paths[o]);
    }
    if (bound > enough) return bound;
    for (const int64_t r : {most_work, busiest}) {
      bound = kInf;
      for (size_t o = 0; o < all.size(); ++o) {
        const double t = simulate_pipeline(replica_input(base, r, all[o].second)).step_time_s;
        paths[o] = std::max(paths[o], t);
        bound = std::min(bound, paths[o]);
      }
      if (bound > enough || busiest == most_work) break;
    }
    return bound;
  }

  // Full score of prepared (memory-feasible) schedules. `as_given`: the microbatches run
  // in the order of their indices (a schedule from elsewhere), no other order is tried.
  LayoutScore finish(const Layout& l, const Prepared& p, bool as_given = false) const {
    LayoutScore out;
    out.layout = l;
    out.peak_memory_bytes = p.mem.peak;
    out.stage_memory_bytes = p.mem.stage_bytes;
    const int64_t B = ctx_.x.num_batches, m = l.num_microbatches;
    std::vector<int64_t> identity(static_cast<size_t>(m));
    std::iota(identity.begin(), identity.end(), 0);
    double total = 0, total_plain = 0, idle = 0;
    for (int64_t b = 0; b < B; ++b) {
      const PipelineSimInput base = sim_input(l, p.sums[size_t(b)], identity, false);
      double best = kInf;
      StepBreakdown best_breakdown;
      double plain = 0;
      auto tried = orders(l, base);
      if (as_given) tried.resize(1);  // AsScheduled comes first
      for (const auto& [kind, order] : tried) {
        const PipelineSimInput in =
            kind == MicrobatchOrder::AsScheduled ? base : permuted(base, order);
        const PipelineSimResult res = simulate_pipeline(in);
        if (kind == MicrobatchOrder::AsScheduled) plain = res.step_time_s;
        // The first order always counts: a batch every order of which takes +inf (or
        // NaN) seconds still gets its breakdown.
        if (res.step_time_s < best || kind == MicrobatchOrder::AsScheduled) {
          best = res.step_time_s;
          best_breakdown = breakdown(l, p.sums[size_t(b)], in, res, kind);
        }
      }
      total += best;
      total_plain += plain;
      idle += best_breakdown.idle_fraction;
      out.steps.push_back(std::move(best_breakdown));
    }
    out.mean_step_time_s = total / double(B);
    out.mean_step_time_as_scheduled_s = total_plain / double(B);
    out.mean_idle_fraction = idle / double(B);
    return out;
  }

  // Full score; `feasible` false when the exact memory check fails (score unset then).
  // `given`: the schedule of every batch (bins), instead of the planner's own.
  LayoutScore score(const Layout& l, bool* feasible, Memory* mem_out,
                    const std::vector<std::vector<int64_t>>* given = nullptr) const {
    std::vector<BinSums> sums;
    for (int64_t b = 0; b < ctx_.x.num_batches; ++b) {
      sums.push_back(bin_sums(l, b, given ? (*given)[size_t(b)] : assign(l, b)));
    }
    const Prepared p = prepare(l, std::move(sums));
    if (mem_out) *mem_out = p.mem;
    *feasible = p.feasible;
    if (!p.feasible) {
      LayoutScore out;
      out.layout = l;
      out.peak_memory_bytes = p.mem.peak;
      out.stage_memory_bytes = p.mem.stage_bytes;
      return out;
    }
    return finish(l, p, given != nullptr);
  }

  // Mean-shape estimate of the reference's optimizer: every bin holds global_batch / bins
  // mean samples; (m + S - 1) x the slowest stage's microbatch time.
  double mean_shape_estimate(const Layout& l) const {
    double enc_body = 0, enc_last = 0, enc_tok = 0, llm_body = 0, llm_last = 0, llm_tok = 0;
    for (const BatchSums& s : ctx_.sums) {
      enc_body += s.enc_body;
      enc_last += s.enc_last;
      enc_tok += s.enc_tokens;
      llm_body += s.llm_body;
      llm_last += s.llm_last;
      llm_tok += s.llm_tokens;
    }
    const double samples = double(ctx_.n * ctx_.x.num_batches);
    const double per_mb = double(ctx_.n) / double(l.num_microbatches);  // samples per microbatch
    // The slowest stage of a module whose replicas each get a mean microbatch.
    const auto slowest_stage = [&](const auto& model, const ModuleLayout& m, double body,
                                   double last, double tokens) {
      const double f = per_mb / double(m.dp) / samples;
      double slowest = 0;
      for (int64_t st = 0; st < m.pp; ++st) {
        const int64_t nl = stage_layers(m, st);
        slowest = std::max(slowest, model.stage_time(m.tp, m.recompute, nl, st == m.pp - 1,
                                                     body * f, last * f, tokens * f) +
                                        model.stage_constant(m.tp, nl));
      }
      return slowest;
    };
    const double slowest = std::max(slowest_stage(ctx_.enc, l.encoder, enc_body, enc_last, enc_tok),
                                    slowest_stage(ctx_.llm, l.llm, llm_body, llm_last, llm_tok));
    return double(l.num_microbatches + total_stages(l) - 1) * slowest;
  }

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
                                                             bool is_encoder) {
  const EncoderSplit split = ctx.o.encoder_split;
  const auto& big = !is_encoder                   ? s.max_llm
                    : split == EncoderSplit::Unit ? s.max_enc_unit
                                                  : s.max_enc;
  return {big, is_encoder && split == EncoderSplit::Even ? double(l.dp) : 1.0};
}

double module_batch_bound(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder, double extra_allreduce_params,
                          const BatchSums& s) {
  const double body = is_encoder ? s.enc_body : s.llm_body;
  const double last = is_encoder ? s.enc_last : s.llm_last;
  const double tokens = is_encoder ? s.enc_tokens : s.llm_tokens;
  const auto& [big, item_share] = largest_item(ctx, s, l, is_encoder);
  // Every LLM bin holds a sample, so each of the m microbatches pays the constant; an
  // encoder replica pays it only for microbatches it has units of (at least one if any).
  const double constants = !is_encoder ? double(m) : (s.has_visual ? 1.0 : 0.0);
  double worst = 0;
  for (int64_t st = 0; st < l.pp; ++st) {
    const int64_t nl = stage_layers(l, st);
    const bool is_last = st == l.pp - 1;
    const double share =
        mm.stage_time(l.tp, l.recompute, nl, is_last, body, last, tokens) / double(l.dp);
    const double item =
        mm.stage_time(l.tp, l.recompute, nl, is_last, big[0], big[1], big[2]) / item_share;
    const double busy = std::max(share, item) + constants * mm.stage_constant(l.tp, nl);
    worst = std::max(
        worst, busy + allreduce_time(ctx.c, mm, l, st, st == 0 ? extra_allreduce_params : 0.0));
  }
  return worst;
}

double module_bound(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l, int64_t m,
                    bool is_encoder, double extra_allreduce_params) {
  double total = 0;
  for (const BatchSums& s : ctx.sums) {
    total += module_batch_bound(ctx, mm, l, m, is_encoder, extra_allreduce_params, s);
  }
  return total / double(ctx.sums.size());
}

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

PathPart module_path_part(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder, const BatchSums& s) {
  const double body = is_encoder ? s.enc_body : s.llm_body;
  const double last = is_encoder ? s.enc_last : s.llm_last;
  const double tokens = is_encoder ? s.enc_tokens : s.llm_tokens;
  const double constants = !is_encoder ? 1.0 : (s.has_visual ? 1.0 / double(m) : 0.0);
  const auto& [big, item_share] = largest_item(ctx, s, l, is_encoder);
  PathPart out;
  out.path = is_encoder ? allreduce_time(ctx.c, mm, l, 0, 0.0) : 0.0;
  out.estimate_path = out.order_path = out.path;
  for (int64_t st = 0; st < l.pp; ++st) {
    const int64_t nl = stage_layers(l, st);
    const bool is_last = st == l.pp - 1;
    const double share = mm.stage_time(l.tp, l.recompute, nl, is_last, body, last, tokens) /
                         (double(l.dp) * double(m));
    const double item =
        mm.stage_time(l.tp, l.recompute, nl, is_last, big[0], big[1], big[2]) / item_share;
    const double constant = mm.stage_constant(l.tp, nl);
    const double typical = share + (s.has_visual || !is_encoder ? constant : 0.0);
    out.path += share + constants * constant;
    out.estimate_path += typical;
    const double busy = std::max(double(m) * share, item) + double(m) * (typical - share);
    out.excess = std::max(out.excess, busy - typical);
    const double heavy = typical + std::max(0.0, item - share);
    out.order_path += heavy;
    out.order_slowest = std::max(out.order_slowest, heavy);
  }
  if (l.virtual_stages > 1) {
    // Interleaving cuts the fill and drain of a pipeline of m identical microbatches from
    // (P - 1) to (P - 1) / v stage times: (m + (P - 1) / v) t = path x (1 + (P - 1) / v) / P
    // + (m - 1) t. The estimates follow; the bound (path) does not change.
    const double f = (1.0 + double(l.pp - 1) / double(l.virtual_stages)) / double(l.pp);
    out.estimate_path *= f;
    out.order_path *= f;
  }
  return out;
}

PathPart module_path_mean(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder) {
  PathPart total;
  for (const BatchSums& s : ctx.sums) {
    const PathPart part = module_path_part(ctx, mm, l, m, is_encoder, s);
    total.path += part.path;
    total.estimate_path += part.estimate_path;
    total.excess += part.excess;
    total.order_path += part.order_path;
    total.order_slowest += part.order_slowest;
  }
  const double n = double(ctx.sums.size());
  return {total.path / n, total.estimate_path / n, total.excess / n, total.order_path / n,
          total.order_slowest / n};
}

// Elementwise minimum (a lower bound of every term over a set of layouts).
PathPart min_parts(const PathPart& a, const PathPart& b) {
  return {std::min(a.path, b.path), std::min(a.estimate_path, b.estimate_path),
          std::min(a.excess, b.excess), std::min(a.order_path, b.order_path),
          std::min(a.order_slowest, b.order_slowest)};
}

// The links of the path: S - 1 forward and S - 1 backward transfers.
double path_links(const Context& ctx, const Layout& l) {
  return 2.0 * double(l.encoder.pp + l.llm.pp - 1) * ctx.c.link_latency_s;
}

// The screening estimate (not a bound) of a 1F1B step: a typical microbatch's path (the
// pipeline's fill and drain) plus the busiest stage's work beyond that microbatch. For m
// identical microbatches it is exact: path + (m - 1) x the slowest stage.
double uniform_estimate(const PathPart& enc, const PathPart& llm, double links) {
  return enc.estimate_path + llm.estimate_path + links + std::max(enc.excess, llm.excess);
}

// The evaluation order's estimate: the 1F1B step of m microbatches each as slow as
// `order_slowest` says.
double order_estimate(const PathPart& enc, const PathPart& llm, double links, int64_t m) {
  return enc.order_path + llm.order_path + links +
         double(m - 1) * std::max(enc.order_slowest, llm.order_slowest);
}

// A disaggregated candidate's keys from its modules' terms (means over the batches):
// the lower bound, the pruning key (the bound, or the screened estimate if larger) and the
// evaluation order. Every term grows with each module term, so the keys of per-module
// minima bound the keys of every pair of a block from below.
struct Keys {
  double bound, key, order;
};
Keys candidate_keys(const Context& ctx, double enc_busy, const PathPart& enc, double llm_busy,
                    const PathPart& llm, double links, int64_t m) {
  Keys k;
  k.bound = std::max({llm_busy, enc_busy, enc.path + llm.path + links});
  k.key = std::max(k.bound, ctx.o.screen_factor * uniform_estimate(enc, llm, links));
  k.order = std::max(k.key, order_estimate(enc, llm, links, m));
  return k;
}

// Colocated: the encoder's load sits on the LLM's first stage of every replica. One batch.
double colocated_batch_bound(const Context& ctx, const Layout& l, const BatchSums& s) {
  const ModuleLayout& g = l.llm;
  const int64_t m = l.num_microbatches;
  double worst = 0;
  for (int64_t st = 0; st < g.pp; ++st) {
    const int64_t nl = stage_layers(g, st);
    const bool is_last = st == g.pp - 1;
    double share =
        ctx.llm.stage_time(g.tp, g.recompute, nl, is_last, s.llm_body, s.llm_last, s.llm_tokens);
    double c = ctx.llm.stage_constant(g.tp, nl);
    const ModuleModel& ce = ctx.colocated_enc(g.tp);
    if (st == 0) {
      share += ce.stage_time(g.tp, g.recompute, ce.p->num_layers, true, s.enc_body, s.enc_last,
                             s.enc_tokens);
      c += ce.stage_constant(g.tp, ce.p->num_layers);
    }
    const double busy = share / double(g.dp) + double(m) * c;
    const double extra = st == 0 ? ce.gpu_all_params(g.tp) : 0.0;
    worst = std::max(worst, busy + allreduce_time(ctx.c, ctx.llm, g, st, extra));
  }
  return worst;
}

double colocated_bound(const Context& ctx, const Layout& l) {
  double total = 0;
  for (const BatchSums& s : ctx.sums) total += colocated_batch_bound(ctx, l, s);
  return total / double(ctx.sums.size());
}

// The first bound of one batch's step time (the candidate's bound is at most their mean).
double batch_bound(const Context& ctx, const Layout& l, int64_t b) {
  const BatchSums& s = ctx.sums[size_t(b)];
  if (l.colocated) return colocated_batch_bound(ctx, l, s);
  const int64_t m = l.num_microbatches;
  const double path = module_path_part(ctx, ctx.enc, l.encoder, m, true, s).path +
                      module_path_part(ctx, ctx.llm, l.llm, m, false, s).path + path_links(ctx, l);
  return std::max({module_batch_bound(ctx, ctx.llm, l.llm, m, false, 0.0, s),
                   module_batch_bound(ctx, ctx.enc, l.encoder, m, true, 0.0, s), path});
}

// The search's key of one batch: the bound, or the screened estimate if larger.
double batch_key(const Context& ctx, const Layout& l, int64_t b) {
  const double bound = batch_bound(ctx, l, b);
  if (l.colocated || ctx.o.screen_factor <= 0.0) return bound;
  const BatchSums& s = ctx.sums[size_t(b)];
  const int64_t m = l.num_microbatches;
  const double estimate =
      uniform_estimate(module_path_part(ctx, ctx.enc, l.encoder, m, true, s),
                       module_path_part(ctx, ctx.llm, l.llm, m, false, s), path_links(ctx, l));
  return std::max(bound, ctx.o.screen_factor * estimate);
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

  void insert(const Candidate& c, LayoutScore score) {
    ++stats_.num_simulated;
    score.lower_bound_s = ctx_.o.strategy == PlanStrategy::MeanShapeReference ? 0.0 : c.lower_bound;
    if (ctx_.o.strategy == PlanStrategy::MeanShapeReference) score.estimate_s = c.bound;
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
    if (ctx_.o.strategy != PlanStrategy::DataBlindColocated) enumerate_disaggregated();
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
         with_recompute(module_degrees(ctx_.c, *ctx_.llm.p, N, 0, max_tp()))) {
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
         with_recompute(module_degrees(ctx_.c, *ctx_.enc.p, v, 0, encoder_max_tp()))) {
      encs->push_back(make_module(ctx_.enc, d, 0, balanced, ctx_));
      encs->back().recompute = recompute;
    }
    if (encs->empty()) return;
    const bool interleave = ctx_.o.strategy == PlanStrategy::DataAware;
    for (const auto& [d, recompute] :
         with_recompute(module_degrees(ctx_.c, *ctx_.llm.p, N - v, v, max_tp()))) {
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
    const double links = 2.0 * ctx_.c.link_latency_s;  // the fewest stages: one each
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
        const Evaluator::Memory llm_mem =
            eval_.llm_memory(g, false, m, llm_tokens, llm_targets, {});
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
            const double links = 2.0 * double(e.pp + g.pp - 1) * ctx_.c.link_latency_s;
            k = candidate_keys(ctx_, it->second.first, it->second.second, llm_busy, llm_part, links,
                               m);
            if (pass_ == Pass::Collect && k.key > threshold_) continue;
            if (!admits(k.order)) continue;
          }
          const Evaluator::InFlightTokens enc_tokens =
              eval_.enc_tokens_lower_bound(m, g.dp, false, e.dp);
          if (!fits(eval_.combine(eval_.encoder_memory(e, g, m, enc_tokens), llm_mem))) {
            continue;
          }
          l.encoder = e;
          l.llm = g;
          l.num_microbatches = m;
          consider(k.key, k.bound, k.order, l);
        }
      }
    }
  }

  // Every degree with and without full activation recomputation.
  static std::vector<std::pair<Degrees, bool>> with_recompute(const std::vector<Degrees>& ds) {
    std::vector<std::pair<Degrees, bool>> out;
    for (bool recompute : {false, true}) {
      for (const Degrees& d : ds) out.emplace_back(d, recompute);
    }
    return out;
  }

  const Context& ctx_;
  Evaluator eval_;
  std::vector<Candidate> cands_;
  std::vector<LayoutScore> best_;
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

void check_layout(const ClusterParams& c, const ModuleParams& enc, const ModuleParams& llm,
                  const PlannerOptions& o, const Layout& l) {
  auto check_module_layout = [&](const char* name, const ModuleParams& p, const ModuleLayout& m) {
    const std::string n(name);
    require(m.tp >= 1 && m.pp >= 1 && m.dp >= 1, n + ": tp, pp, dp must be >= 1");
    require(m.tp <= c.num_gpus && m.pp <= c.num_gpus && m.dp <= c.num_gpus,
            n + ": tp, pp, dp must be <= num_gpus=" + std::to_string(c.num_gpus));
    require(c.gpus_per_node % m.tp == 0 && p.num_heads % m.tp == 0,
            n + ".tp=" + std::to_string(m.tp) + " must divide gpus_per_node and num_heads");
    require(m.first_rank % m.tp == 0, n + ".first_rank must be a multiple of tp");
    require(
        m.virtual_stages >= 1 && m.virtual_stages <= p.num_layers,
        n + ".virtual_stages must be in [1, num_layers], got " + std::to_string(m.virtual_stages));
    require(int64_t(m.layers_per_stage.size()) == m.pp * m.virtual_stages,
            n + ".layers_per_stage must have pp x virtual_stages entries");
    int64_t sum = 0;
    for (int64_t x : m.layers_per_stage) {
      require(x >= 1 && x <= p.num_layers,
              n + ".layers_per_stage entries must be in [1, num_layers]");
      sum += x;  // at most pp (<= num_gpus) entries of at most kMaxPlannerLayers each
    }
    require(sum == p.num_layers,
            n + ".layers_per_stage must sum to num_layers=" + std::to_string(p.num_layers));
  };
  check_module_layout("llm", llm, l.llm);
  require(l.encoder.virtual_stages == 1,
          "encoder.virtual_stages must be 1 (only the LLM is interleaved)");
  require(l.num_microbatches >= 1 && l.num_microbatches <= o.global_batch,
          "num_microbatches must be in [1, global_batch]");
  if (l.llm.virtual_stages > 1) {
    require(!l.colocated && l.llm.pp >= 2,
            "llm.virtual_stages > 1 needs a disaggregated layout with llm.pp >= 2");
    require(l.num_microbatches % l.llm.pp == 0,
            "llm.virtual_stages > 1 (interleaved 1F1B) needs num_microbatches to be a multiple "
            "of llm.pp=" +
                std::to_string(l.llm.pp));
  }
  require(l.num_microbatches * l.llm.dp <= o.global_batch,
          "num_microbatches x llm.dp must be <= global_batch (one sample per bin at least)");
  if (l.colocated) {
    require(l.llm.first_rank == 0 && l.llm.tp * l.llm.pp * l.llm.dp == c.num_gpus,
            "a colocated layout must use all num_gpus from rank 0");
    // The encoder's heads are padded to a multiple of llm.tp where it does not divide them.
  } else {
    check_module_layout("encoder", enc, l.encoder);
    const int64_t v = l.encoder.tp * l.encoder.pp * l.encoder.dp;
    require(l.encoder.first_rank == 0 && l.llm.first_rank == v &&
                v + l.llm.tp * l.llm.pp * l.llm.dp == c.num_gpus,
            "encoder ranks [0, V) and LLM ranks [V, num_gpus) must cover the cluster");
  }
}

}  // namespace

int64_t padded_heads(int64_t heads, int64_t tp) {
  require(heads >= 1 && tp >= 1 && heads <= kMaxPlannerHeads && tp <= kMaxPlannerGpus,
          "padded_heads: heads must be in [1, " + std::to_string(kMaxPlannerHeads) +
              "] and tp in [1, " + std::to_string(kMaxPlannerGpus) + "]");
  return (heads + tp - 1) / tp * tp;
}

std::vector<int64_t> default_microbatch_choices(int64_t max_microbatches) {
  std::vector<int64_t> out;
  // 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ...: about x1.4 per step.
  for (int64_t p = 1; p <= max_microbatches; p *= 2) {
    out.push_back(p);
    if (p >= 2 && p + p / 2 <= max_microbatches) out.push_back(p + p / 2);
    if (p > max_microbatches / 2) break;  // p * 2 would pass the end (or overflow)
  }
  if (max_microbatches >= 1 && (out.empty() || out.back() != max_microbatches)) {
    // Also the largest count (one sample per bin): it can beat the rounded steps.
    out.push_back(max_microbatches);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int64_t> split_layers(int64_t num_layers, int64_t num_stages, double per_layer,
                                  double first_stage_extra, double last_stage_extra,
                                  bool balanced) {
  require(num_layers >= 1 && num_layers <= kMaxPlannerLayers,
          "num_layers must be in [1, " + std::to_string(kMaxPlannerLayers) + "], got " +
              std::to_string(num_layers));
  require(num_stages >= 1 && num_stages <= num_layers,
          "num_stages must be in [1, num_layers=" + std::to_string(num_layers) + "], got " +
              std::to_string(num_stages));
  std::vector<int64_t> out(static_cast<size_t>(num_stages), num_layers / num_stages);
  for (int64_t s = 0; s < num_layers % num_stages; ++s) ++out[size_t(s)];
  if (!balanced || num_stages == 1 || !(per_layer > 0)) return out;
  // Water-filling: give each next layer to the stage whose load after it is smallest
  // (ties: the earliest stage); optimal for min-max with one extra on the last stage.
  std::fill(out.begin(), out.end(), 1);
  auto load = [&](int64_t s, int64_t layers) {
    return double(layers) * per_layer + (s == 0 ? first_stage_extra : 0.0) +
           (s == num_stages - 1 ? last_stage_extra : 0.0);
  };
  for (int64_t k = num_stages; k < num_layers; ++k) {
    int64_t best = 0;
    for (int64_t s = 1; s < num_stages; ++s) {
      if (load(s, out[size_t(s)] + 1) < load(best, out[size_t(best)] + 1)) best = s;
    }
    ++out[size_t(best)];
  }
  return out;
}

void validate_planner_input(const ClusterParams& c, const ModuleParams& enc,
                            const ModuleParams& llm, const PlannerSamples& x,
                            const PlannerOptions& o) {
  require(c.num_gpus >= 2 && c.num_gpus <= kMaxPlannerGpus,
          "cluster.num_gpus must be in [2, " + std::to_string(kMaxPlannerGpus) +
              "] (the encoder and the LLM need one GPU each), got " + std::to_string(c.num_gpus));
  require(c.gpus_per_node >= 1,
          "cluster.gpus_per_node must be >= 1, got " + std::to_string(c.gpus_per_node));
  check_positive("cluster.gpu_memory_bytes", c.gpu_memory_bytes);
  check_positive("cluster.intra_node_bandwidth_bytes_per_s", c.intra_node_bandwidth_bytes_per_s);
  check_positive("cluster.inter_node_bandwidth_bytes_per_s", c.inter_node_bandwidth_bytes_per_s);
  check_finite_nonneg("cluster.link_latency_s", c.link_latency_s);
  check_finite_nonneg("cluster.tp_gemm_loss", c.tp_gemm_loss);
  check_finite_nonneg("cluster.memory_reserve_bytes", c.memory_reserve_bytes);
  check_module("encoder", enc);
  check_module("llm", llm);
  require(x.num_batches >= 1 && x.num_batches <= kMaxPlannerBatches,
          "samples.num_batches must be in [1, " + std::to_string(kMaxPlannerBatches) + "], got " +
              std::to_string(x.num_batches));
  require(x.batch_size >= 1 && x.batch_size <= kMaxPlannerBatchSize,
          "samples.batch_size must be in [1, " + std::to_string(kMaxPlannerBatchSize) + "], got " +
              std::to_string(x.batch_size));
  require(o.global_batch == x.batch_size, "global_batch=" + std::to_string(o.global_batch) +
                                              " must equal the sampled batch size " +
                                              std::to_string(x.batch_size));
  require(o.top_k >= 1 && o.top_k <= kMaxPlannerGpus, "top_k must be in [1, " +
                                                          std::to_string(kMaxPlannerGpus) +
                                                          "], got " + std::to_string(o.top_k));
  require(o.balance_work_budget >= -1,
          "balance_work_budget must be >= 0 (or -1: the default by size), got " +
              std::to_string(o.balance_work_budget));
  require(o.max_tp >= 0, "max_tp must be >= 0, got " + std::to_string(o.max_tp));
  require(o.num_threads >= 0, "num_threads must be >= 0, got " + std::to_string(o.num_threads));
  require(int(o.strategy) >= 0 && int(o.strategy) <= 2, "strategy is not a PlanStrategy");
  require(int(o.encoder_split) >= 0 && int(o.encoder_split) <= 2,
          "encoder_split is not an EncoderSplit");
  require(std::isfinite(o.screen_factor) && o.screen_factor >= 0.0 && o.screen_factor <= 1.0,
          "screen_factor must be in [0, 1], got " + fmt(o.screen_factor));
  require(o.patience >= 0 && o.patience <= kMaxPlannerGpus,
          "patience must be in [0, " + std::to_string(kMaxPlannerGpus) + "], got " +
              std::to_string(o.patience));
  require(o.encoder_max_tp >= 0,
          "encoder_max_tp must be >= 0, got " + std::to_string(o.encoder_max_tp));
  for (size_t i = 0; i < o.encoder_gpu_choices.size(); ++i) {
    require(o.encoder_gpu_choices[i] >= 1 && o.encoder_gpu_choices[i] < c.num_gpus,
            "encoder_gpu_choices[" + std::to_string(i) + "] must be in [1, num_gpus), got " +
                std::to_string(o.encoder_gpu_choices[i]));
  }
  std::set<int64_t> chunk_choices;
  for (size_t i = 0; i < o.virtual_stage_choices.size(); ++i) {
    const int64_t v = o.virtual_stage_choices[i];
    require(v >= 1 && v <= kMaxPlannerLayers,
            "virtual_stage_choices[" + std::to_string(i) + "] must be in [1, " +
                std::to_string(kMaxPlannerLayers) + "], got " + std::to_string(v));
    require(chunk_choices.insert(v).second, "virtual_stage_choices[" + std::to_string(i) +
                                                "]=" + std::to_string(v) + " is repeated");
  }
  require(chunk_choices.count(1) == 1,
          "virtual_stage_choices must hold 1 (the plain 1F1B pipeline)");
  for (size_t i = 0; i < o.microbatch_choices.size(); ++i) {
    require(o.microbatch_choices[i] >= 1, "microbatch_choices[" + std::to_string(i) +
                                              "] must be >= 1, got " +
                                              std::to_string(o.microbatch_choices[i]));
  }
  const size_t total = size_t(x.num_batches) * size_t(x.batch_size);
  check_column("encoder_s", x.encoder_s, total, false);
  check_column("llm_s", x.llm_s, total, false);
  check_column("encoder_last_fraction", x.encoder_last_fraction, total, true);
  check_column("llm_last_fraction", x.llm_last_fraction, total, true);
  check_column("encoder_tokens", x.encoder_tokens, total, false);
  require(x.encoder_units.size() == total, "samples.encoder_units has " +
                                               std::to_string(x.encoder_units.size()) +
                                               " values, expected " + std::to_string(total));
  int64_t batch_units = 0;  // a microbatch's units are split by split_units: bounded
  for (size_t i = 0; i < total; ++i) {
    require(x.encoder_units[i] >= 0, "samples.encoder_units[" + std::to_string(i) +
                                         "] must be >= 0, got " +
                                         std::to_string(x.encoder_units[i]));
    if (i % size_t(x.batch_size) == 0) batch_units = 0;
    require(x.encoder_units[i] <= kMaxSplitUnits - batch_units,
            "samples.encoder_units of batch " + std::to_string(i / size_t(x.batch_size)) +
                " sum to more than " + std::to_string(kMaxSplitUnits) + " at encoder_units[" +
                std::to_string(i) + "]=" + std::to_string(x.encoder_units[i]));
    batch_units += x.encoder_units[i];
    require(x.encoder_units[i] > 0 || x.encoder_s[i] == 0.0,
            "samples.encoder_s[" + std::to_string(i) + "]=" + fmt(x.encoder_s[i]) +
                " is encoder time for a sample with encoder_units[" + std::to_string(i) +
                "]=0 (a text-only sample costs the encoder nothing)");
  }
  check_column("llm_tokens", x.llm_tokens, total, false);
  check_column("visual_tokens", x.visual_tokens, total, false);
  if (!x.llm_target_tokens.empty()) {
    check_column("llm_target_tokens", x.llm_target_tokens, total, false);
  }
}

PlanResult plan_layouts(const ClusterParams& c, const ModuleParams& enc, const ModuleParams& llm,
                        const PlannerSamples& x, const PlannerOptions& o) {
  validate_planner_input(c, enc, llm, x, o);
  const Context ctx(c, enc, llm, x, o);
  Search search(ctx);
  return search.run();
}

namespace {

// Throws InvalidArgument unless `assignment` gives every sample of a batch a bin of `l` and
// leaves no bin empty.
void check_assignment(const PlannerSamples& x, const Layout& l,
                      const std::vector<int64_t>& assignment, const std::string& name) {
  const int64_t bins = l.num_microbatches * l.llm.dp;
  require(int64_t(assignment.size()) == x.batch_size,
          name + " has " + std::to_string(assignment.size()) + " entries, expected " +
              std::to_string(x.batch_size) + " (one per sample)");
  std::vector<int64_t> count(static_cast<size_t>(bins), 0);
  for (size_t i = 0; i < assignment.size(); ++i) {
    require(assignment[i] >= 0 && assignment[i] < bins,
            name + "[" + std::to_string(i) + "]=" + std::to_string(assignment[i]) +
                " is out of range [0, " + std::to_string(bins) + ")");
    ++count[size_t(assignment[i])];
  }
  for (int64_t b = 0; b < bins; ++b) {
    require(count[size_t(b)] > 0, "bin " + std::to_string(b) + " of " + name + " is empty");
  }
}

}  // namespace

LayoutScore evaluate_layout(const ClusterParams& c, const ModuleParams& enc,
                            const ModuleParams& llm, const PlannerSamples& x,
                            const PlannerOptions& o, const Layout& l,
                            const std::vector<std::vector<int64_t>>* assignments) {
  validate_planner_input(c, enc, llm, x, o);
  check_layout(c, enc, llm, o, l);
  if (assignments) {
    require(int64_t(assignments->size()) == x.num_batches,
            "assignments has " + std::to_string(assignments->size()) + " schedules, expected " +
                std::to_string(x.num_batches) + " (one per sampled batch)");
    for (size_t b = 0; b < assignments->size(); ++b) {
      check_assignment(x, l, (*assignments)[b], "assignments[" + std::to_string(b) + "]");
    }
  }
  const Context ctx(c, enc, llm, x, o);
  Evaluator eval(ctx);
  bool feasible = false;
  Evaluator::Memory mem;
  LayoutScore score = eval.score(l, &feasible, &mem, assignments);
  if (!feasible) {
    throw Infeasible("layout needs " + fmt(mem.peak / 1e9) + " GB on " +
                     (mem.encoder ? "encoder" : "LLM") + " stage " + std::to_string(mem.stage) +
                     ", more than gpu_memory_bytes = " + fmt(c.gpu_memory_bytes / 1e9) + " GB");
  }
  double bound = 0;
  for (int64_t b = 0; b < x.num_batches; ++b) bound += batch_bound(ctx, l, b);
  score.lower_bound_s = bound / double(x.num_batches);
  return score;
}

namespace {

// The step of batch b under the given bins (microbatch indices = execution order).
StepModel make_step(const Context& ctx, const Evaluator& eval, const Layout& l, int64_t b,
                    std::vector<int64_t> bins) {
  StepModel out;
  const int64_t m = l.num_microbatches;
  std::vector<int64_t> identity(static_cast<size_t>(m));
  std::iota(identity.begin(), identity.end(), 0);
  const BinSums sums = eval.bin_sums(l, b, bins);
  out.sim = eval.sim_input(l, sums, identity, true);
  out.microbatch_order = identity;
  out.num_encoder_stages = l.colocated ? 0 : l.encoder.pp;
  if (!l.colocated) {
    const ModuleLayout& e = l.encoder;
    const double f = ctx.enc.p->forward_fraction;
    out.num_encoder_replicas = e.dp;
    out.encoder_forward_s.assign(size_t(e.dp * e.pp * m), 0.0);
    out.encoder_backward_s.assign(size_t(e.dp * e.pp * m), 0.0);
    const auto members = Evaluator::microbatch_members(bins, m, l.llm.dp);
    for (int64_t k = 0; k < m; ++k) {
      const EncoderReplicas reps = eval.encoder_replicas(l, b, members[size_t(k)], sums, k);
      for (int64_t r = 0; r < e.dp; ++r) {
        for (int64_t st = 0; st < e.pp; ++st) {
          const double t = reps.stage_s[size_t(r * e.pp + st)];
          const size_t i = size_t((r * e.pp + st) * m + k);
          out.encoder_forward_s[i] = t * f;
          out.encoder_backward_s[i] = t * (1.0 - f);
        }
      }
      const UnitSplit& sp = reps.split;
      for (size_t q = 0; q < sp.sample.size(); ++q) {
        out.piece_microbatch.push_back(k);
        out.piece_sample.push_back(members[size_t(k)][size_t(sp.sample[q])]);
        out.piece_first_unit.push_back(sp.first_unit[q]);
        out.piece_num_units.push_back(sp.num_units[q]);
        out.piece_replica.push_back(sp.replica[q]);
      }
    }
  }
  out.assignment = std::move(bins);
  return out;
}

}  // namespace

StepModel build_step(const ClusterParams& c, const ModuleParams& enc, const ModuleParams& llm,
                     const PlannerSamples& x, const PlannerOptions& o, const Layout& l,
                     int64_t batch) {
  validate_planner_input(c, enc, llm, x, o);
  check_layout(c, enc, llm, o, l);
  require(
      batch >= 0 && batch < x.num_batches,
      "batch must be in [0, " + std::to_string(x.num_batches) + "), got " + std::to_string(batch));
  const Context ctx(c, enc, llm, x, o);
  Evaluator eval(ctx);
  std::vector<int64_t> bins = eval.assign(l, batch);
  const BinSums sums = eval.bin_sums(l, batch, bins);
  std::vector<int64_t> identity(static_cast<size_t>(l.num_microbatches));
  std::iota(identity.begin(), identity.end(), 0);
  const PipelineSimInput base = eval.sim_input(l, sums, identity, false);
  // The order the score took: the first of the fastest (Evaluator::finish).
  double best = kInf;
  std::vector<int64_t> chosen = identity;
  for (const auto& [kind, order] : eval.orders(l, base)) {
    const PipelineSimInput in =
        kind == MicrobatchOrder::AsScheduled ? base : Evaluator::permuted(base, order);
    const double t = simulate_pipeline(in).step_time_s;
    if (t < best) {
      best = t;
      chosen = order;
    }
  }
  // Renumber bins so that microbatch k of the step is the k-th in the chosen order.
  std::vector<int64_t> position(static_cast<size_t>(l.num_microbatches));
  for (size_t k = 0; k < chosen.size(); ++k) position[size_t(chosen[k])] = int64_t(k);
  const int64_t dp = l.llm.dp;
  for (auto& b : bins) b = position[size_t(b / dp)] * dp + b % dp;
  StepModel out = make_step(ctx, eval, l, batch, std::move(bins));
  out.microbatch_order = chosen;
  return out;
}

StageCosts stage_costs(const ClusterParams& c, const ModuleParams& enc, const ModuleParams& llm,
                       const PlannerSamples& x, const PlannerOptions& o, const Layout& l,
                       int64_t batch) {
  validate_planner_input(c, enc, llm, x, o);
  check_layout(c, enc, llm, o, l);
  require(!l.colocated,
          "stage_costs needs a disaggregated layout (the encoder on GPUs of its own)");
  require(
      batch >= 0 && batch < x.num_batches,
      "batch must be in [0, " + std::to_string(x.num_batches) + "), got " + std::to_string(batch));
  const Context ctx(c, enc, llm, x, o);
  const Evaluator eval(ctx);
  StageCosts out;
  out.costs = eval.sample_stage_costs(l, batch);
  out.constants = eval.stage_constants(l);
  return out;
}

StepModel step_from_assignment(const ClusterParams& c, const ModuleParams& enc,
                               const ModuleParams& llm, const PlannerSamples& x,
                               const PlannerOptions& o, const Layout& l, int64_t batch,
                               const std::vector<int64_t>& assignment) {
  validate_planner_input(c, enc, llm, x, o);
  check_layout(c, enc, llm, o, l);
  require(
      batch >= 0 && batch < x.num_batches,
      "batch must be in [0, " + std::to_string(x.num_batches) + "), got " + std::to_string(batch));
  check_assignment(x, l, assignment, "assignment");
  const Context ctx(c, enc, llm, x, o);
  Evaluator eval(ctx);
  return make_step(ctx, eval, l, batch, assignment);
}

}  // namespace dflop
