// Planner: lower bounds of a layout's step time without a schedule, and the search's
// pruning keys and evaluation order (declared in planner_internal.hpp; planner_search.cpp
// explains how the search uses them).
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "planner_internal.hpp"

namespace dflop::detail {

namespace {

// The module's loads of a batch (body, last, tokens): all samples', and those of the
// samples whose backward it surely runs (the LLM: ModuleModel::backward_needs_visual).
struct Loads {
  std::array<double, 3> all, backward;
};

Loads batch_loads(const BatchSums& s, bool is_encoder) {
  if (is_encoder) {
    const std::array<double, 3> all{s.enc_body, s.enc_last, s.enc_tokens};
    return {all, all};
  }
  return {s.llm_all(), s.llm_visual};
}

Loads item_loads(const BatchSums& s, const std::array<double, 3>& big, bool is_encoder) {
  const bool backward = is_encoder || s.max_llm_visual;
  return {big, backward ? big : std::array<double, 3>{0, 0, 0}};
}

}  // namespace

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
  const Loads loads = batch_loads(s, is_encoder);
  const auto& [big, item_share] = largest_item(ctx, s, l, is_encoder);
  const Loads item_load = item_loads(s, big, is_encoder);
  // Every LLM bin holds a sample, so each of the m microbatches pays the constant; an
  // encoder replica pays it only for microbatches it has units of (at least one if any).
  const double constants = !is_encoder ? double(m) : (s.has_visual ? 1.0 : 0.0);
  double worst = 0;
  for (int64_t st = 0; st < l.pp; ++st) {
    const int64_t nl = stage_layers(l, st);
    const bool is_last = st == l.pp - 1;
    const double share =
        mm.stage_time_bound(l.tp, l.recompute, nl, is_last, loads.all, loads.backward) /
        double(l.dp);
    const double item =
        mm.stage_time_bound(l.tp, l.recompute, nl, is_last, item_load.all, item_load.backward) /
        item_share;
    const double busy =
        std::max(share, item) + constants * mm.stage_constant_bound(l.tp, nl, is_last);
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

PathPart module_path_part(const Context& ctx, const ModuleModel& mm, const ModuleLayout& l,
                          int64_t m, bool is_encoder, const BatchSums& s, bool split) {
  const Loads loads = batch_loads(s, is_encoder);
  const double constants = !is_encoder ? 1.0 : (s.has_visual ? 1.0 / double(m) : 0.0);
  const auto& [big, item_share] = largest_item(ctx, s, l, is_encoder);
  const Loads item_load = item_loads(s, big, is_encoder);
  PathPart out;
  out.path = is_encoder ? allreduce_time(ctx.c, mm, l, 0, 0.0) : 0.0;
  out.estimate_path = out.order_path = out.path;
  for (int64_t st = 0; st < l.pp; ++st) {
    const int64_t nl = stage_layers(l, st);
    const bool is_last = st == l.pp - 1;
    const double share =
        mm.stage_time_bound(l.tp, l.recompute, nl, is_last, loads.all, loads.backward) /
        (double(l.dp) * double(m));
    const double item =
        mm.stage_time_bound(l.tp, l.recompute, nl, is_last, item_load.all, item_load.backward) /
        item_share;
    const double constant = mm.stage_constant_bound(l.tp, nl, is_last);
    const double typical = share + (s.has_visual || !is_encoder ? constant : 0.0);
    double on_path = 1.0;
    if (split) {
      // At most (1 - forward_fraction) of a stage's time is backward (less where parts are
      // frozen); of it the W share, all where the stage's input takes no gradient.
      const bool input_grad =
          st > 0 ? mm.layers_backward() : !is_encoder && ctx.enc.runs_backward(true);
      const double w = input_grad ? mm.weight_share(is_last) : 1.0;
      on_path = 1.0 - (1.0 - mm.p->forward_fraction) * w;
    }
    out.path += (share + constants * constant) * on_path;
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

PathPart min_parts(const PathPart& a, const PathPart& b) {
  return {std::min(a.path, b.path), std::min(a.estimate_path, b.estimate_path),
          std::min(a.excess, b.excess), std::min(a.order_path, b.order_path),
          std::min(a.order_slowest, b.order_slowest)};
}

double path_links(const Context& ctx, int64_t E, int64_t P) {
  // Backward transfers only over the links that carry gradients: a stage that runs no
  // backward (frozen, nothing trained before it) is sent none.
  const int64_t backward = (E - 1) * int64_t(ctx.enc.runs_backward(false)) +
                           int64_t(ctx.enc.runs_backward(true)) +
                           (P - 1) * int64_t(ctx.llm.runs_backward(false));
  return double(E + P - 1 + backward) * ctx.c.link_latency_s;
}

double uniform_estimate(const PathPart& enc, const PathPart& llm, double links) {
  return enc.estimate_path + llm.estimate_path + links + std::max(enc.excess, llm.excess);
}

double order_estimate(const PathPart& enc, const PathPart& llm, double links, int64_t m) {
  return enc.order_path + llm.order_path + links +
         double(m - 1) * std::max(enc.order_slowest, llm.order_slowest);
}

Keys candidate_keys(const Context& ctx, double enc_busy, const PathPart& enc, double llm_busy,
                    const PathPart& llm, double links, int64_t m) {
  Keys k;
  k.bound = std::max({llm_busy, enc_busy, enc.path + llm.path + links});
  k.key = std::max(k.bound, ctx.o.screen_factor * uniform_estimate(enc, llm, links));
  k.order = std::max(k.key, order_estimate(enc, llm, links, m));
  return k;
}

double colocated_batch_bound(const Context& ctx, const Layout& l, const BatchSums& s) {
  const ModuleLayout& g = l.llm;
  const int64_t m = l.num_microbatches;
  double worst = 0;
  for (int64_t st = 0; st < g.pp; ++st) {
    const int64_t nl = stage_layers(g, st);
    const bool is_last = st == g.pp - 1;
    double share =
        ctx.llm.stage_time_bound(g.tp, g.recompute, nl, is_last, s.llm_all(), s.llm_visual);
    double c = ctx.llm.stage_constant_bound(g.tp, nl, is_last);
    const ModuleModel& ce = ctx.colocated_enc(g.tp);
    if (st == 0) {
      share += ce.stage_time(g.tp, g.recompute, ce.p->num_layers, true, s.enc_body, s.enc_last,
                             s.enc_tokens);
      c += ce.stage_constant(g.tp, ce.p->num_layers, true);
    }
    const double busy = share / double(g.dp) + double(m) * c;
    const double extra = st == 0 ? ce.gpu_all_params(g.tp, true) : 0.0;
    worst = std::max(worst, busy + allreduce_time(ctx.c, ctx.llm, g, st, extra));
  }
  return worst;
}

double colocated_bound(const Context& ctx, const Layout& l) {
  double total = 0;
  for (const BatchSums& s : ctx.sums) total += colocated_batch_bound(ctx, l, s);
  return total / double(ctx.sums.size());
}

double batch_bound(const Context& ctx, const Layout& l, int64_t b) {
  const BatchSums& s = ctx.sums[size_t(b)];
  if (l.colocated) return colocated_batch_bound(ctx, l, s);
  const int64_t m = l.num_microbatches;
  const bool split = pipeline_order_def(layout_order(l)).splits_backward;
  const double path = module_path_part(ctx, ctx.enc, l.encoder, m, true, s, split).path +
                      module_path_part(ctx, ctx.llm, l.llm, m, false, s, split).path +
                      path_links(ctx, l.encoder.pp, l.llm.pp);
  return std::max({module_batch_bound(ctx, ctx.llm, l.llm, m, false, 0.0, s),
                   module_batch_bound(ctx, ctx.enc, l.encoder, m, true, 0.0, s), path});
}

double batch_key(const Context& ctx, const Layout& l, int64_t b) {
  const double bound = batch_bound(ctx, l, b);
  if (l.colocated || ctx.o.screen_factor <= 0.0) return bound;
  const BatchSums& s = ctx.sums[size_t(b)];
  const int64_t m = l.num_microbatches;
  const double estimate = uniform_estimate(module_path_part(ctx, ctx.enc, l.encoder, m, true, s),
                                           module_path_part(ctx, ctx.llm, l.llm, m, false, s),
                                           path_links(ctx, l.encoder.pp, l.llm.pp));
  return std::max(bound, ctx.o.screen_factor * estimate);
}

}  // namespace dflop::detail
