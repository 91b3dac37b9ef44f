// Planner: enumeration of layouts, cheap lower bounds, scoring by balance + simulation.
// This file: the public entry points of planner.hpp and the validation of their input;
// planner_internal.hpp lists the other pieces, planner_search.cpp explains the search.
#include "dflop/planner.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dflop/encoder_split.hpp"
#include "dflop/errors.hpp"
#include "dflop/simulator.hpp"
#include "format.hpp"
#include "planner_internal.hpp"

namespace dflop {
namespace {

using detail::batch_bound;
using detail::BinSums;
using detail::Context;
using detail::EncoderReplicas;
using detail::Evaluator;
using detail::kInf;

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
      {"weight_grad_bytes_per_token_layer", p.weight_grad_bytes_per_token_layer},
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
      {"attention_activation_fraction", p.attention_activation_fraction},
      {"body_backward_factor", p.body_backward_factor},
      {"last_backward_factor", p.last_backward_factor},
      {"body_trainable_fraction", p.body_trainable_fraction},
      {"last_trainable_fraction", p.last_trainable_fraction},
      {"kept_activation_fraction", p.kept_activation_fraction},
      {"input_grad_fraction", p.input_grad_fraction},
      {"weight_grad_sharded_fraction", p.weight_grad_sharded_fraction}};
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
  if (l.order) {
    // The order must run the layout's pipeline (e.g. zb-h1 takes one chunk per stage).
    const PipelineShape shape =
        l.colocated ? PipelineShape::plain(l.llm.pp)
                    : PipelineShape{{l.encoder.pp, l.llm.pp}, {1, l.llm.virtual_stages}};
    try {
      pipeline_order_def(*l.order).check(shape, l.num_microbatches);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("order=") + pipeline_order_name(*l.order) + ": " +
                            e.what());
    }
  }
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
  return detail::search_layouts(ctx);
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
  require(o.memory_replica >= -1 && o.memory_replica < l.llm.dp,
          "options.memory_replica must be -1 (the largest replica) or an LLM DP replica in [0, " +
              std::to_string(l.llm.dp) + "), got " + std::to_string(o.memory_replica));
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
StepModel make_step(const Evaluator& eval, const Layout& l, int64_t b, std::vector<int64_t> bins) {
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
    out.num_encoder_replicas = e.dp;
    out.encoder_forward_s.assign(size_t(e.dp * e.pp * m), 0.0);
    out.encoder_backward_s.assign(size_t(e.dp * e.pp * m), 0.0);
    const auto members = Evaluator::microbatch_members(bins, m, l.llm.dp);
    for (int64_t k = 0; k < m; ++k) {
      const EncoderReplicas reps = eval.encoder_replicas(l, b, members[size_t(k)], sums, k);
      for (int64_t r = 0; r < e.dp; ++r) {
        for (int64_t st = 0; st < e.pp; ++st) {
          const size_t at = size_t(r * e.pp + st), i = size_t((r * e.pp + st) * m + k);
          out.encoder_forward_s[i] = reps.forward_s[at];
          out.encoder_backward_s[i] = reps.stage_s[at] - reps.forward_s[at];
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
  StepModel out = make_step(eval, l, batch, std::move(bins));
  out.microbatch_order = chosen;
  return out;
}

StageCosts stage_costs(const ClusterParams& c, const ModuleParams& enc, const ModuleParams& llm,
                       const PlannerSamples& x, const PlannerOptions& o, const Layout& l,
                       int64_t batch) {
  validate_planner_input(c, enc, llm, x, o);
  check_layout(c, enc, llm, o, l);
  require(
      batch >= 0 && batch < x.num_batches,
      "batch must be in [0, " + std::to_string(x.num_batches) + "), got " + std::to_string(batch));
  const Context ctx(c, enc, llm, x, o);
  const Evaluator eval(ctx);
  StageCosts out;
  out.costs = eval.sample_stage_costs(l, batch);
  out.constants = eval.stage_constants(l);
  out.last_stage_weight_extra = eval.last_stage_weight_extra(l, batch, out.costs);
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
  return make_step(eval, l, batch, assignment);
}

}  // namespace dflop