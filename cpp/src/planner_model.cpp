// Planner: the links of the cost model (bandwidths, all-reduces) and the per-batch
// context every piece works on. The model is documented in planner.hpp; the pieces are
// listed in planner_internal.hpp.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dflop/planner.hpp"
#include "planner_internal.hpp"

namespace dflop::detail {

double dp_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s) {
  const int64_t first = l.first_rank + s * l.tp * l.dp;
  const int64_t last = first + (l.dp - 1) * l.tp;
  return node_of(first, c.gpus_per_node) == node_of(last, c.gpus_per_node)
             ? c.intra_node_bandwidth_bytes_per_s
             : c.inter_node_bandwidth_bytes_per_s;
}

double allreduce_time(const ClusterParams& c, const ModuleModel& mm, const ModuleLayout& l,
                      int64_t s, double extra_params) {
  const double params = mm.gpu_trainable_params(l, s) + extra_params;
  if (l.dp <= 1 || params <= 0.0) return 0.0;  // frozen parameters are not all-reduced
  const double bytes = mm.p->element_bytes * params;
  return 2.0 * double(l.dp - 1) / double(l.dp) * bytes / dp_bandwidth(c, l, s) + c.link_latency_s;
}

double stage_link_bandwidth(const ClusterParams& c, const ModuleLayout& l, int64_t s) {
  for (int64_t d = 0; d < l.dp; ++d) {
    const int64_t a = l.first_rank + s * l.tp * l.dp + d * l.tp;
    if (node_of(a, c.gpus_per_node) != node_of(a + l.tp * l.dp, c.gpus_per_node)) {
      return c.inter_node_bandwidth_bytes_per_s;
    }
  }
  return c.intra_node_bandwidth_bytes_per_s;
}

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

Context::Context(const ClusterParams& cluster, const ModuleParams& e, const ModuleParams& l,
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
      // Visual rows, as the bins count them (BinSums::visual): a bin holding this sample
      // runs the LLM's backward even where only visual rows need one.
      const bool visual_rows = x.visual_tokens[k] > 0;
      if (visual_rows) {
        s.llm_visual[0] += lb;
        s.llm_visual[1] += ll;
        s.llm_visual[2] += x.llm_tokens[k];
      }
      if (x.llm_s[k] > best_l) {
        best_l = x.llm_s[k];
        s.max_llm = {lb, ll, x.llm_tokens[k]};
        s.max_llm_visual = visual_rows;
      }
    }
  }
}

}  // namespace dflop::detail
