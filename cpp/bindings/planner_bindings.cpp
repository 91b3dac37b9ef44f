// Planner bindings: the Python side (dflop.planner) passes plain dicts of numbers and
// 1-D float64 arrays, read strictly (DictReader), and gets dicts back; the values are
// validated once, in the core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dflop/planner.hpp"

namespace py = pybind11;

namespace dflop::bindings {
namespace {

using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Reads one dict of arguments strictly: a required key that is missing, a value of the
// wrong type and a key nobody reads (a misspelt optional one) are ValueErrors naming the
// dict and the key, instead of being cast errors or silently ignored.
class DictReader {
 public:
  DictReader(const py::dict& d, std::string where) : d_(d), where_(std::move(where)) {}

  template <typename T>
  T get(const char* key) {
    known_.emplace_back(key);
    if (!d_.contains(key)) throw py::value_error(where_ + " is missing \"" + key + "\"");
    return cast<T>(key);
  }

  // Leaves *out as it is when the key is absent or None.
  template <typename T>
  void opt(const char* key, T* out) {
    known_.emplace_back(key);
    if (d_.contains(key) && !d_[key].is_none()) *out = cast<T>(key);
  }

  // Call after the last get/opt.
  void finish() const {
    for (const auto& item : d_) {
      const std::string key = py::str(item.first);
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string known;
      for (const auto& k : known_) known += (known.empty() ? "" : ", ") + k;
      throw py::value_error(where_ + " has unknown key \"" + key + "\" (known: " + known + ")");
    }
  }

 private:
  template <typename T>
  T cast(const char* key) const {
    try {
      return d_[key].cast<T>();
    } catch (const py::cast_error&) {
      throw py::value_error(where_ + "[\"" + key + "\"] has the wrong type: " +
                            std::string(py::str(py::type::of(d_[key]).attr("__name__"))));
    }
  }

  const py::dict& d_;
  std::string where_;
  std::vector<std::string> known_;
};

ClusterParams to_cluster(const py::dict& d) {
  ClusterParams c;
  DictReader r(d, "cluster");
  c.num_gpus = r.get<int64_t>("num_gpus");
  c.gpus_per_node = r.get<int64_t>("gpus_per_node");
  c.gpu_memory_bytes = r.get<double>("gpu_memory_bytes");
  c.intra_node_bandwidth_bytes_per_s = r.get<double>("intra_node_bandwidth_bytes_per_s");
  c.inter_node_bandwidth_bytes_per_s = r.get<double>("inter_node_bandwidth_bytes_per_s");
  r.opt("link_latency_s", &c.link_latency_s);
  r.opt("tp_gemm_loss", &c.tp_gemm_loss);
  r.opt("memory_reserve_bytes", &c.memory_reserve_bytes);
  r.finish();
  return c;
}

ModuleParams to_module(const py::dict& d, const char* w) {
  ModuleParams p;
  DictReader r(d, w);
  p.num_layers = r.get<int64_t>("num_layers");
  p.num_heads = r.get<int64_t>("num_heads");
  p.hidden_size = r.get<int64_t>("hidden_size");
  p.params_per_layer = r.get<double>("params_per_layer");
  r.opt("first_stage_params", &p.first_stage_params);
  r.opt("last_stage_params", &p.last_stage_params);
  p.activation_bytes_per_token_layer = r.get<double>("activation_bytes_per_token_layer");
  r.opt("head_bytes_per_target_token", &p.head_bytes_per_target_token);
  r.opt("head_chunk_tokens", &p.head_chunk_tokens);
  r.opt("element_bytes", &p.element_bytes);
  r.opt("input_bytes_per_token", &p.input_bytes_per_token);
  r.opt("microbatch_constant_s", &p.microbatch_constant_s);
  r.opt("attention_compute_fraction", &p.attention_compute_fraction);
  r.opt("attention_param_fraction", &p.attention_param_fraction);
  r.opt("attention_activation_fraction", &p.attention_activation_fraction);
  r.opt("forward_fraction", &p.forward_fraction);
  r.opt("body_backward_factor", &p.body_backward_factor);
  r.opt("last_backward_factor", &p.last_backward_factor);
  r.opt("body_trainable_fraction", &p.body_trainable_fraction);
  r.opt("last_trainable_fraction", &p.last_trainable_fraction);
  r.opt("kept_activation_fraction", &p.kept_activation_fraction);
  r.opt("input_grad_fraction", &p.input_grad_fraction);
  r.opt("weight_grad_bytes_per_token_layer", &p.weight_grad_bytes_per_token_layer);
  r.opt("weight_grad_sharded_fraction", &p.weight_grad_sharded_fraction);
  r.finish();
  return p;
}

std::vector<double> column(DictReader& r, const char* key) {
  const auto a = r.get<DoubleArray>(key);
  return std::vector<double>(a.data(), a.data() + a.size());
}

PlannerSamples to_samples(const py::dict& d) {
  PlannerSamples x;
  DictReader r(d, "samples");
  x.num_batches = r.get<int64_t>("num_batches");
  x.batch_size = r.get<int64_t>("batch_size");
  x.encoder_s = column(r, "encoder_s");
  x.llm_s = column(r, "llm_s");
  x.encoder_last_fraction = column(r, "encoder_last_fraction");
  x.llm_last_fraction = column(r, "llm_last_fraction");
  x.encoder_tokens = column(r, "encoder_tokens");
  const auto units = r.get<IntArray>("encoder_units");
  x.encoder_units.assign(units.data(), units.data() + units.size());
  x.llm_tokens = column(r, "llm_tokens");
  x.visual_tokens = column(r, "visual_tokens");
  DoubleArray targets;  // optional: without it, every token is a target
  r.opt("llm_target_tokens", &targets);
  x.llm_target_tokens.assign(targets.data(), targets.data() + targets.size());
  r.finish();
  return x;
}

PlannerOptions to_options(const py::dict& d) {
  PlannerOptions o;
  DictReader r(d, "options");
  const auto strategy = r.get<std::string>("strategy");
  if (strategy == "data_aware") {
    o.strategy = PlanStrategy::DataAware;
  } else if (strategy == "data_blind") {
    o.strategy = PlanStrategy::DataBlindColocated;
  } else if (strategy == "mean_shape") {
    o.strategy = PlanStrategy::MeanShapeReference;
  } else {
    throw py::value_error(
        "strategy must be \"data_aware\", \"data_blind\" or \"mean_shape\", got \"" + strategy +
        "\"");
  }
  o.global_batch = r.get<int64_t>("global_batch");
  r.opt("prune", &o.prune);
  r.opt("top_k", &o.top_k);
  r.opt("order_microbatches", &o.order_microbatches);
  r.opt("zero_bubble", &o.zero_bubble);
  r.opt("balanced_layer_split", &o.balanced_layer_split);
  r.opt("zero1", &o.zero1);
  r.opt("memory_replica", &o.memory_replica);
  r.opt("max_tp", &o.max_tp);
  r.opt("microbatch_choices", &o.microbatch_choices);
  r.opt("balance_work_budget", &o.balance_work_budget);
  r.opt("seed", &o.seed);
  r.opt("num_threads", &o.num_threads);
  r.opt("colocated_candidates", &o.colocated_candidates);
  r.opt("disaggregated_candidates", &o.disaggregated_candidates);
  r.opt("screen_factor", &o.screen_factor);
  r.opt("patience", &o.patience);
  r.opt("encoder_max_tp", &o.encoder_max_tp);
  r.opt("encoder_gpu_choices", &o.encoder_gpu_choices);
  r.opt("virtual_stage_choices", &o.virtual_stage_choices);
  std::string split = "unit";
  r.opt("encoder_split", &split);
  if (split == "unit") {
    o.encoder_split = EncoderSplit::Unit;
  } else if (split == "sample") {
    o.encoder_split = EncoderSplit::Sample;
  } else if (split == "even") {
    o.encoder_split = EncoderSplit::Even;
  } else {
    throw py::value_error("encoder_split must be \"unit\", \"sample\" or \"even\", got \"" + split +
                          "\"");
  }
  r.finish();
  return o;
}

ModuleLayout to_module_layout(const py::dict& d, const char* w) {
  ModuleLayout m;
  DictReader r(d, w);
  m.tp = r.get<int64_t>("tp");
  m.pp = r.get<int64_t>("pp");
  m.dp = r.get<int64_t>("dp");
  m.first_rank = r.get<int64_t>("first_rank");
  m.layers_per_stage = r.get<std::vector<int64_t>>("layers_per_stage");
  r.opt("recompute", &m.recompute);
  r.opt("virtual_stages", &m.virtual_stages);
  r.finish();
  return m;
}

Layout to_layout(const py::dict& d) {
  Layout l;
  DictReader r(d, "layout");
  l.colocated = r.get<bool>("colocated");
  l.encoder = to_module_layout(r.get<py::dict>("encoder"), "layout.encoder");
  l.llm = to_module_layout(r.get<py::dict>("llm"), "layout.llm");
  l.num_microbatches = r.get<int64_t>("num_microbatches");
  std::string order;  // none or absent: pipeline_order_for()'s
  r.opt("order", &order);
  if (!order.empty()) l.order = parse_pipeline_order(order);
  r.finish();
  return l;
}

py::dict from_module_layout(const ModuleLayout& m) {
  py::dict d;
  d["tp"] = m.tp;
  d["pp"] = m.pp;
  d["dp"] = m.dp;
  d["first_rank"] = m.first_rank;
  d["layers_per_stage"] = m.layers_per_stage;
  d["recompute"] = m.recompute;
  d["virtual_stages"] = m.virtual_stages;
  return d;
}

const char* order_name(MicrobatchOrder o) {
  switch (o) {
    case MicrobatchOrder::LongestFirst:
      return "longest_first";
    case MicrobatchOrder::ShortestFirst:
      return "shortest_first";
    case MicrobatchOrder::ShortEnds:
      return "short_ends";
    default:
      return "as_scheduled";
  }
}

py::dict from_score(const LayoutScore& s) {
  py::dict layout;
  layout["colocated"] = s.layout.colocated;
  layout["encoder"] = from_module_layout(s.layout.encoder);
  layout["llm"] = from_module_layout(s.layout.llm);
  layout["num_microbatches"] = s.layout.num_microbatches;
  layout["order"] =
      s.layout.order ? py::object(py::str(pipeline_order_name(*s.layout.order))) : py::none();
  py::list steps;
  for (const StepBreakdown& b : s.steps) {
    py::dict step;
    step["step_time_s"] = b.step_time_s;
    step["idle_fraction"] = b.idle_fraction;
    step["stage_compute_s"] = b.stage_compute_s;
    step["stage_allreduce_s"] = b.stage_allreduce_s;
    step["transfer_s"] = b.transfer_s;
    step["order"] = order_name(b.order);
    steps.append(step);
  }
  py::dict d;
  d["layout"] = layout;
  d["mean_step_time_s"] = s.mean_step_time_s;
  d["lower_bound_s"] = s.lower_bound_s;
  d["estimate_s"] = s.estimate_s;
  d["mean_idle_fraction"] = s.mean_idle_fraction;
  d["mean_step_time_as_scheduled_s"] = s.mean_step_time_as_scheduled_s;
  d["peak_memory_bytes"] = s.peak_memory_bytes;
  d["stage_memory_bytes"] = s.stage_memory_bytes;
  d["steps"] = steps;
  return d;
}

py::dict plan_layouts_py(const py::dict& cluster, const py::dict& encoder, const py::dict& llm,
                         const py::dict& samples, const py::dict& options) {
  const ClusterParams c = to_cluster(cluster);
  const ModuleParams e = to_module(encoder, "encoder"), l = to_module(llm, "llm");
  const PlannerSamples x = to_samples(samples);
  PlannerOptions o = to_options(options);
  o.interrupted = python_signal_check();
  PlanResult r;
  {
    py::gil_scoped_release release;
    r = plan_layouts(c, e, l, x, o);
  }
  py::list best;
  for (const LayoutScore& s : r.best) best.append(from_score(s));
  py::dict stats;
  stats["num_candidates"] = r.stats.num_candidates;
  stats["num_memory_rejected"] = r.stats.num_memory_rejected;
  stats["num_bounded"] = r.stats.num_bounded;
  stats["num_simulated"] = r.stats.num_simulated;
  stats["num_pruned"] = r.stats.num_pruned;
  stats["num_scheduled"] = r.stats.num_scheduled;
  stats["num_balanced"] = r.stats.num_balanced;
  stats["num_pruned_after_schedule"] = r.stats.num_pruned_after_schedule;
  stats["stopped_by_patience"] = r.stats.stopped_by_patience;
  stats["num_unexplored"] = r.stats.num_unexplored;
  py::dict shortfall;
  shortfall["found"] = r.shortfall.found;
  shortfall["needed_bytes"] = r.shortfall.needed_bytes;
  shortfall["module"] = r.shortfall.encoder ? "encoder" : "llm";
  shortfall["stage"] = r.shortfall.stage;
  py::dict out;
  out["best"] = best;
  out["stats"] = stats;
  out["shortfall"] = shortfall;
  return out;
}

// The arguments of every call about one layout, converted (and checked) once.
struct LayoutArgs {
  LayoutArgs(const py::dict& cluster, const py::dict& encoder, const py::dict& llm,
             const py::dict& samples, const py::dict& options, const py::dict& layout)
      : c(to_cluster(cluster)),
        e(to_module(encoder, "encoder")),
        l(to_module(llm, "llm")),
        x(to_samples(samples)),
        o(to_options(options)),
        lay(to_layout(layout)) {}
  ClusterParams c;
  ModuleParams e, l;
  PlannerSamples x;
  PlannerOptions o;
  Layout lay;
};

py::dict evaluate_layout_py(const py::dict& cluster, const py::dict& encoder, const py::dict& llm,
                            const py::dict& samples, const py::dict& options,
                            const py::dict& layout, const py::object& assignments) {
  const LayoutArgs a(cluster, encoder, llm, samples, options, layout);
  std::vector<std::vector<int64_t>> given;
  if (!assignments.is_none()) {
    for (const py::handle item : assignments) {
      const IntArray bins = py::cast<IntArray>(item);
      if (bins.ndim() != 1) throw py::value_error("every assignment must be 1-D");
      given.emplace_back(bins.data(), bins.data() + bins.size());
    }
  }
  LayoutScore s;
  {
    py::gil_scoped_release release;
    s = evaluate_layout(a.c, a.e, a.l, a.x, a.o, a.lay, assignments.is_none() ? nullptr : &given);
  }
  return from_score(s);
}

py::dict from_step(const StepModel& step) {
  const auto& in = step.sim;
  const py::ssize_t R = in.num_replicas, m = in.num_microbatches;
  // Arrays over virtual stages (the LLM's chunks); allreduce_s over physical stages.
  const py::ssize_t S = static_cast<py::ssize_t>(in.forward_s.size()) / (R * m);
  auto arr3 = [](const std::vector<double>& v, py::ssize_t a, py::ssize_t b, py::ssize_t c) {
    py::array_t<double> out({a, b, c});
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
  };
  auto ints = [](const std::vector<int64_t>& v) {
    py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
  };
  const py::ssize_t E = step.num_encoder_stages, V = step.num_encoder_replicas;
  py::dict out;
  out["forward_s"] = arr3(in.forward_s, R, S, m);
  out["backward_s"] = arr3(in.backward_s, R, S, m);
  if (!in.weight_s.empty()) out["weight_s"] = arr3(in.weight_s, R, S, m);
  out["activation_bytes"] = arr3(in.activation_bytes, R, S - 1, m);
  out["link_latency_s"] = in.link_latency_s;
  out["link_bandwidth_bytes_per_s"] = in.link_bandwidth_bytes_per_s;
  out["allreduce_s"] = in.allreduce_s;
  out["gradient_links"] = std::vector<int64_t>(in.gradient_links.begin(), in.gradient_links.end());
  out["schedule"] = pipeline_order_name(in.order);
  out["stages"] = in.shape.stages;
  out["chunks"] = in.shape.chunks;
  out["assignment"] = ints(step.assignment);
  out["microbatch_order"] = ints(step.microbatch_order);
  out["num_encoder_stages"] = step.num_encoder_stages;
  out["num_encoder_replicas"] = step.num_encoder_replicas;
  out["encoder_forward_s"] = arr3(step.encoder_forward_s, V, E, V ? m : 0);
  out["encoder_backward_s"] = arr3(step.encoder_backward_s, V, E, V ? m : 0);
  py::dict pieces;
  pieces["microbatch"] = ints(step.piece_microbatch);
  pieces["sample"] = ints(step.piece_sample);
  pieces["first_unit"] = ints(step.piece_first_unit);
  pieces["num_units"] = ints(step.piece_num_units);
  pieces["replica"] = ints(step.piece_replica);
  out["pieces"] = pieces;
  return out;
}

py::dict build_step_py(const py::dict& cluster, const py::dict& encoder, const py::dict& llm,
                       const py::dict& samples, const py::dict& options, const py::dict& layout,
                       int64_t batch) {
  const LayoutArgs a(cluster, encoder, llm, samples, options, layout);
  StepModel step;
  {
    py::gil_scoped_release release;
    step = build_step(a.c, a.e, a.l, a.x, a.o, a.lay, batch);
  }
  return from_step(step);
}

py::dict step_from_assignment_py(const py::dict& cluster, const py::dict& encoder,
                                 const py::dict& llm, const py::dict& samples,
                                 const py::dict& options, const py::dict& layout, int64_t batch,
                                 const IntArray& assignment) {
  const LayoutArgs a(cluster, encoder, llm, samples, options, layout);
  if (assignment.ndim() != 1) throw py::value_error("assignment must be 1-D");
  const std::vector<int64_t> bins(assignment.data(), assignment.data() + assignment.size());
  StepModel step;
  {
    py::gil_scoped_release release;
    step = step_from_assignment(a.c, a.e, a.l, a.x, a.o, a.lay, batch, bins);
  }
  return from_step(step);
}

py::dict stage_costs_py(const py::dict& cluster, const py::dict& encoder, const py::dict& llm,
                        const py::dict& samples, const py::dict& options, const py::dict& layout,
                        int64_t batch) {
  const LayoutArgs a(cluster, encoder, llm, samples, options, layout);
  StageCosts sc;
  {
    py::gil_scoped_release release;
    sc = stage_costs(a.c, a.e, a.l, a.x, a.o, a.lay, batch);
  }
  py::array_t<double> costs({static_cast<py::ssize_t>(sc.costs.size() / 2), py::ssize_t{2}});
  std::copy(sc.costs.begin(), sc.costs.end(), costs.mutable_data());
  py::dict out;
  out["costs"] = costs;
  out["constants"] = py::make_tuple(sc.constants[0], sc.constants[1]);
  out["last_stage_weight_extra"] =
      py::make_tuple(sc.last_stage_weight_extra[0], sc.last_stage_weight_extra[1]);
  return out;
}

}  // namespace

void register_planner(py::module_& m) {
  m.def("plan_layouts", &plan_layouts_py, py::arg("cluster"), py::arg("encoder"), py::arg("llm"),
        py::arg("samples"), py::arg("options"),
        "Search parallel layouts; returns {best, stats, shortfall}. See dflop.planner.");
  m.def("evaluate_layout", &evaluate_layout_py, py::arg("cluster"), py::arg("encoder"),
        py::arg("llm"), py::arg("samples"), py::arg("options"), py::arg("layout"),
        py::arg("assignments") = py::none(),
        "Score one layout by simulation over the sampled batches (with the planner's "
        "schedules, or the given ones: one assignment per batch).");
  m.def("build_step", &build_step_py, py::arg("cluster"), py::arg("encoder"), py::arg("llm"),
        py::arg("samples"), py::arg("options"), py::arg("layout"), py::arg("batch"),
        "Simulator input, schedule, encoder split and per-replica encoder times of one "
        "sampled batch under a layout.");
  m.def("step_from_assignment", &step_from_assignment_py, py::arg("cluster"), py::arg("encoder"),
        py::arg("llm"), py::arg("samples"), py::arg("options"), py::arg("layout"), py::arg("batch"),
        py::arg("assignment"),
        "The planner's step model of one sampled batch under a given schedule.");
  m.def("stage_costs", &stage_costs_py, py::arg("cluster"), py::arg("encoder"), py::arg("llm"),
        py::arg("samples"), py::arg("options"), py::arg("layout"), py::arg("batch"),
        "Per-sample seconds of an average stage of each module and the stages' constants, "
        "as a runtime's scheduler should see one sampled batch under a disaggregated layout.");
  m.def("split_layers", &split_layers, py::arg("num_layers"), py::arg("num_stages"),
        py::arg("per_layer"), py::arg("first_stage_extra"), py::arg("last_stage_extra"),
        py::arg("balanced"));
  m.def("default_microbatch_choices", &default_microbatch_choices, py::arg("max_microbatches"));
  m.def("padded_heads", &padded_heads, py::arg("heads"), py::arg("tp"),
        "Attention heads after padding to a multiple of tp.");
}

}  // namespace dflop::bindings
