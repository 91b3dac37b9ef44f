// Planner: scoring one layout (Evaluator, declared in planner_internal.hpp): the schedule
// of every sampled batch (balance), the exact memory check, the simulator input, the
// microbatch orders tried, the replica bound and the full score.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <numeric>
#include <utility>
#include <vector>

#include "dflop/balance.hpp"
#include "dflop/encoder_split.hpp"
#include "dflop/pipeline_program.hpp"
#include "dflop/simulator.hpp"
#include "planner_internal.hpp"

namespace dflop::detail {
namespace {

// Virtual stages of a simulator input (its arrays' second axis).
int64_t virtual_stages_of(const PipelineSimInput& in) {
  return int64_t(in.forward_s.size()) / (in.num_replicas * in.num_microbatches);
}

}  // namespace

std::vector<double> Evaluator::sample_stage_costs(const Layout& l, int64_t b) const {
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

std::array<double, 2> Evaluator::stage_constants(const Layout& l) const {
  const ModuleLayout &e = l.encoder, &g = l.llm;
  return {ctx_.enc.stage_constant(e.tp, ctx_.enc.p->num_layers, true) / double(e.pp),
          ctx_.llm.stage_constant(g.tp, ctx_.llm.p->num_layers, true) / double(g.pp)};
}

std::array<double, 2> Evaluator::last_stage_weight_extra(const Layout& l, int64_t b,
                                                         const std::vector<double>& costs) const {
  double remake_s = 0.0, llm_s = 0.0;
  for (int64_t i = 0; i < ctx_.n; ++i) {
    const size_t k = size_t(b * ctx_.n + i);
    remake_s +=
        ctx_.llm.head_remake_seconds(l.llm.tp, ctx_.x.llm_s[k] * ctx_.x.llm_last_fraction[k]);
    llm_s += costs[size_t(2 * i + 1)];
  }
  return {0.0, llm_s > 0.0 ? remake_s / llm_s : 0.0};
}

std::vector<int64_t> Evaluator::assign(const Layout& l, int64_t b) const {
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

BinSums Evaluator::bin_sums(const Layout& l, int64_t b, const std::vector<int64_t>& bins) const {
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
  s.enc_stage_forward_s.assign(size_t(m * e.pp), 0.0);
  s.enc_max_tokens.assign(size_t(m), 0.0);
  s.enc_busy_s.assign(size_t(e.pp), 0.0);
  const std::vector<std::vector<int64_t>> members = microbatch_members(bins, m, dp);
  for (int64_t k = 0; k < m; ++k) {
    const EncoderReplicas reps = encoder_replicas(l, b, members[size_t(k)], s, k);
    for (int64_t r = 0; r < e.dp; ++r) {
      s.enc_max_tokens[size_t(k)] = std::max(s.enc_max_tokens[size_t(k)], reps.tokens[size_t(r)]);
      for (int64_t st = 0; st < e.pp; ++st) {
        const size_t at = size_t(r * e.pp + st), i = size_t(k * e.pp + st);
        const double t = reps.stage_s[at];
        if (t > s.enc_stage_s[i]) {
          s.enc_stage_s[i] = t;
          s.enc_stage_forward_s[i] = reps.forward_s[at];
        }
        s.enc_busy_s[size_t(st)] += t;
      }
    }
  }
  return s;
}

std::vector<std::vector<int64_t>> Evaluator::microbatch_members(const std::vector<int64_t>& bins,
                                                                int64_t m, int64_t dp) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(m));
  for (size_t i = 0; i < bins.size(); ++i) out[size_t(bins[i] / dp)].push_back(int64_t(i));
  return out;
}

EncoderReplicas Evaluator::encoder_replicas(const Layout& l, int64_t b,
                                            const std::vector<int64_t>& members,
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
    out.split = split_units(units.data(), costs.data(), int64_t(members.size()), e.dp,
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
  out.forward_s.assign(size_t(e.dp * e.pp), 0.0);
  for (int64_t r = 0; r < e.dp; ++r) {
    if (!has_work[size_t(r)]) continue;  // an empty share computes nothing
    for (int64_t st = 0; st < e.pp; ++st) {
      const int64_t nl = e.layers_per_stage[size_t(st)];
      const bool is_last = st == e.pp - 1;
      StageSeconds t = ctx_.enc.stage_seconds(e.tp, e.recompute, nl, is_last, body[size_t(r)],
                                              last[size_t(r)], out.tokens[size_t(r)]);
      t += ctx_.enc.stage_constant_seconds(e.tp, nl, is_last);
      out.stage_s[size_t(r * e.pp + st)] = t.total();
      out.forward_s[size_t(r * e.pp + st)] = t.forward_s;
    }
  }
  return out;
}

Evaluator::Memory Evaluator::memory(const Layout& l, const InFlightTokens& llm_tokens,
                                    double llm_bin_targets,
                                    const InFlightTokens& enc_tokens) const {
  const Memory enc = l.colocated ? Memory{} : encoder_memory(l, enc_tokens);
  return combine(enc, llm_memory(l, llm_tokens, llm_bin_targets, enc_tokens));
}

Evaluator::Memory Evaluator::encoder_memory(const Layout& l,
                                            const InFlightTokens& enc_tokens) const {
  Memory out;
  const ModuleLayout& e = l.encoder;
  const int64_t m = l.num_microbatches;
  const PipelineShape shape = layout_shape(l);
  for (int64_t s = 0; s < e.pp; ++s) {
    const int64_t n = e.layers_per_stage[size_t(s)];
    const int64_t in_flight = peak_in_flight(layout_order(l), shape, m, s);
    const double bytes =
        ctx_.enc.state_bytes(ctx_.enc.gpu_params(e, s), ctx_.enc.gpu_trainable_params(e, s), e.dp,
                             ctx_.o.zero1) +
        ctx_.enc.activation_bytes(e.tp, e.recompute, n, enc_tokens.at(in_flight)) +
        ctx_.enc.recompute_bytes(e.tp, e.recompute, enc_tokens.at(1)) +
        (s == 0 ? ctx_.enc.input_bytes(enc_tokens.at(m)) : 0.0) +
        pending_weight_bytes(ctx_.enc, l, s, s == e.pp - 1, s > 0 && ctx_.enc.runs_backward(false),
                             e.tp, n, enc_tokens);
    out.stage_bytes.push_back(bytes);
    if (bytes > out.peak) out.set_peak(bytes, true, s);
  }
  return out;
}

Evaluator::Memory Evaluator::llm_memory(const Layout& l, const InFlightTokens& llm_tokens,
                                        double llm_bin_targets,
                                        const InFlightTokens& enc_tokens) const {
  Memory out;
  const ModuleLayout& g = l.llm;
  const bool colocated = l.colocated;
  const int64_t m = l.num_microbatches;
  const bool zero1 = ctx_.o.zero1;
  // The LLM's stages follow the encoder's in the replica's pipeline.
  const PipelineShape shape = layout_shape(l);
  const int64_t first = colocated ? 0 : l.encoder.pp;
  for (int64_t s = 0; s < g.pp; ++s) {
    // The activations of one microbatch on one chunk (the stage itself without chunks).
    const int64_t n = largest_chunk(g, s);
    const int64_t in_flight = peak_in_flight(layout_order(l), shape, m, first + s);
    const bool input_grad =
        s > 0 ? ctx_.llm.runs_backward(false) : !colocated && ctx_.enc.runs_backward(true);
    double bytes = ctx_.llm.state_bytes(ctx_.llm.gpu_params(g, s),
                                        ctx_.llm.gpu_trainable_params(g, s), g.dp, zero1) +
                   ctx_.llm.activation_bytes(g.tp, g.recompute, n, llm_tokens.at(in_flight)) +
                   pending_weight_bytes(ctx_.llm, l, first + s, s == g.pp - 1, input_grad, g.tp, n,
                                        llm_tokens);
    // One transient at a time on top of what is held: a remade layer or (last stage,
    // all layers' activations still held) the head's chunk.
    double working = std::max(ctx_.llm.recompute_bytes(g.tp, g.recompute, llm_tokens.at(1)),
                              ctx_.llm.forward_layer_bytes(g.tp, llm_tokens.forward_only));
    if (s == g.pp - 1) working = std::max(working, ctx_.llm.head_bytes(g.tp, llm_bin_targets));
    bool is_enc = false;
    if (colocated && s == 0) {
      const ModuleModel& ce = ctx_.colocated_enc(g.tp);
      const double enc_bytes =
          ce.state_bytes(ce.gpu_all_params(g.tp), ce.gpu_all_params(g.tp, true), g.dp, zero1) +
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

double Evaluator::pending_weight_bytes(const ModuleModel& mm, const Layout& l, int64_t stage,
                                       bool is_last, bool input_grad, int64_t tp, int64_t n,
                                       const InFlightTokens& tokens) const {
  // The search's orders never split: skip generating a stage's actions on its hot path.
  const PipelineOrder order = layout_order(l);
  if (!pipeline_order_def(order).splits_backward || !mm.runs_backward(is_last)) return 0.0;
  const int64_t pending = peak_pending_weight(order, layout_shape(l), l.num_microbatches, stage);
  return pending == 0 ? 0.0 : mm.weight_grad_bytes(tp, n, tokens.at(pending), input_grad);
}

Evaluator::Memory Evaluator::combine(const Memory& enc, const Memory& llm) const {
  Memory out = llm.peak > enc.peak ? llm : enc;
  out.peak += ctx_.c.memory_reserve_bytes;
  out.stage_bytes = enc.stage_bytes;
  out.stage_bytes.insert(out.stage_bytes.end(), llm.stage_bytes.begin(), llm.stage_bytes.end());
  return out;
}

Evaluator::InFlightTokens Evaluator::llm_tokens_lower_bound(int64_t m, int64_t dp) const {
  InFlightTokens out;
  const double bins = double(m * dp);
  // Where only microbatches with visual rows keep activations, they keep at least every
  // visual sample's tokens (and no single sample is known to be kept).
  const bool gated = ctx_.llm.backward_needs_visual();
  for (const BatchSums& s : ctx_.sums) {
    out.average = std::max(out.average, (gated ? s.llm_visual[2] : s.llm_tokens) / bins);
    if (!gated) out.single = std::max(out.single, s.max_llm_tokens);
  }
  return out;
}

double Evaluator::llm_targets_lower_bound(int64_t m, int64_t dp) const {
  double targets = 0;
  const double bins = double(m * dp);
  for (const BatchSums& s : ctx_.sums) {
    targets = std::max(targets, std::max(s.llm_targets / bins, s.max_llm_targets));
  }
  return targets;
}

Evaluator::InFlightTokens Evaluator::enc_tokens_lower_bound(int64_t m, int64_t llm_dp,
                                                            bool colocated,
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
    if (ctx_.o.encoder_split == EncoderSplit::Even) largest = s.max_enc_tokens / double(encoder_dp);
    out.average = std::max(out.average, s.enc_tokens / double(m) / double(encoder_dp));
    out.single = std::max(out.single, largest);
  }
  return out;
}

Evaluator::Memory Evaluator::memory_lower_bound(const Layout& l) const {
  const int64_t m = l.num_microbatches;
  return memory(l, llm_tokens_lower_bound(m, l.llm.dp), llm_targets_lower_bound(m, l.llm.dp),
                enc_tokens_lower_bound(m, l.llm.dp, l.colocated, l.encoder.dp));
}

PipelineSimInput Evaluator::sim_input(const Layout& l, const BinSums& s,
                                      const std::vector<int64_t>& order, bool record_events) const {
  const ModuleLayout &e = l.encoder, &g = l.llm;
  const int64_t m = l.num_microbatches, R = g.dp, S = total_stages(l);
  const int64_t E = l.colocated ? 0 : e.pp, v = g.virtual_stages, V = E + g.pp * v;
  PipelineSimInput in;
  in.num_replicas = R;
  in.num_stages = S;
  in.num_microbatches = m;
  in.record_events = record_events;
  in.shape = layout_shape(l);
  in.order = layout_order(l);
  const size_t cells = size_t(R * V * m);
  in.forward_s.assign(cells, 0.0);
  in.backward_s.assign(cells, 0.0);
  in.link_latency_s.assign(size_t(V - 1), ctx_.c.link_latency_s);
  in.link_bandwidth_bytes_per_s.assign(size_t(V - 1), 0.0);
  in.activation_bytes.assign(size_t(R * (V - 1) * m), 0.0);
  in.allreduce_s.assign(size_t(S), 0.0);
  auto put = [&](int64_t r, int64_t vs, int64_t k, const StageSeconds& t) {
    const size_t i = size_t((r * V + vs) * m + k);
    in.forward_s[i] = t.forward_s;
    in.backward_s[i] = t.backward_s;
  };
  auto bytes_at = [&](int64_t r, int64_t boundary, int64_t k) -> double& {
    return in.activation_bytes[size_t((r * (V - 1) + boundary) * m + k)];
  };
  const bool split = pipeline_order_def(in.order).splits_backward;
  // Per cell: seconds of backward_s that only W runs (the LM head's remade logits).
  std::vector<double> weight_only_s(split ? cells : 0, 0.0);
  const double enc_h = double(ctx_.enc.p->hidden_size), llm_h = double(ctx_.llm.p->hidden_size);
  const double enc_bytes = ctx_.enc.p->element_bytes, llm_bytes = ctx_.llm.p->element_bytes;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t mb = order[size_t(k)];
    if (!l.colocated) {
      // Every LLM replica waits for the encoder's slowest replica (encoder_replicas).
      for (int64_t st = 0; st < E; ++st) {
        const size_t at = size_t(mb * E + st);
        const StageSeconds t{s.enc_stage_forward_s[at],
                             s.enc_stage_s[at] - s.enc_stage_forward_s[at]};
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
          StageSeconds t = ctx_.llm.stage_seconds(g.tp, g.recompute, nl, is_last, s.llm_body[bin],
                                                  s.llm_last[bin], s.llm_tokens[bin]);
          t += ctx_.llm.stage_constant_seconds(g.tp, nl, is_last);
          if (ctx_.llm.backward_needs_visual() && s.visual[bin] == 0) t.backward_s = 0.0;
          if (split && is_last && t.backward_s > 0.0) {
            const double remake = ctx_.llm.head_remake_seconds(g.tp, s.llm_last[bin]);
            t.backward_s += remake;
            weight_only_s[size_t((r * V + E + vs) * m + k)] = remake;
          }
          if (l.colocated && st == 0) {
            const ModuleModel& ce = ctx_.colocated_enc(g.tp);
            t += ce.stage_seconds(g.tp, g.recompute, ce.p->num_layers, true, s.enc_body[bin],
                                  s.enc_last[bin], s.enc_tokens[bin]);
            t += ce.stage_constant_seconds(g.tp, ce.p->num_layers, true);
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
        (l.colocated && st == 0) ? ctx_.colocated_enc(g.tp).gpu_all_params(g.tp, true) : 0.0;
    in.allreduce_s[size_t(E + st)] = allreduce_time(ctx_.c, ctx_.llm, g, st, extra);
  }
  // A stage that runs no backward (frozen, nothing trained before it) is sent no
  // gradient: its B actions need only its own forwards.
  std::vector<uint8_t> links(size_t(V - 1), 1);
  bool any_cut = false;
  for (int64_t vs = 0; vs + 1 < V; ++vs) {
    const bool backward = vs < E ? ctx_.enc.runs_backward(vs == E - 1)
                                 : ctx_.llm.runs_backward(vs - E == g.pp * v - 1);
    links[size_t(vs)] = backward ? 1 : 0;
    any_cut = any_cut || !backward;
  }
  if (split) {
    // The W share of each backward: all of it where the stage's input takes no gradient
    // (the first stage, or one after a stage that runs no backward), as the runtime runs;
    // plus what only W runs.
    in.weight_s.assign(cells, 0.0);
    for (int64_t vs = 0; vs < V; ++vs) {
      const bool input_grad = vs > 0 && links[size_t(vs - 1)];
      const double share = !input_grad ? 1.0
                           : vs < E    ? ctx_.enc.weight_share(vs == E - 1)
                                       : ctx_.llm.weight_share(vs - E == g.pp * v - 1);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t k = 0; k < m; ++k) {
          const size_t i = size_t((r * V + vs) * m + k);
          in.weight_s[i] = share * (in.backward_s[i] - weight_only_s[i]) + weight_only_s[i];
        }
      }
    }
  }
  if (any_cut) in.gradient_links = std::move(links);
  return in;
}

std::vector<std::pair<MicrobatchOrder, std::vector<int64_t>>> Evaluator::orders(
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

PipelineSimInput Evaluator::permuted(const PipelineSimInput& in,
                                     const std::vector<int64_t>& order) {
  PipelineSimInput out = in;
  const int64_t R = in.num_replicas, S = virtual_stages_of(in), m = in.num_microbatches;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t st = 0; st < S; ++st) {
      for (int64_t k = 0; k < m; ++k) {
        const size_t to = size_t((r * S + st) * m + k);
        const size_t from = size_t((r * S + st) * m + order[size_t(k)]);
        out.forward_s[to] = in.forward_s[from];
        out.backward_s[to] = in.backward_s[from];
        if (!in.weight_s.empty()) out.weight_s[to] = in.weight_s[from];
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

StepBreakdown Evaluator::breakdown(const Layout& l, const BinSums& sums, const PipelineSimInput& in,
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

Evaluator::ScheduleKey Evaluator::schedule_key(const Layout& l) {
  const ModuleLayout &e = l.encoder, &g = l.llm;
  if (l.colocated) {
    return {1,    l.num_microbatches,    g.dp, g.tp, g.recompute ? 1 : 0,
            g.pp, g.layers_per_stage[0], 0,    0};
  }
  return {0,    l.num_microbatches,  g.dp,       g.tp, g.recompute ? 1 : 0, g.pp,
          e.tp, e.recompute ? 1 : 0, e.pp * e.dp};
}

Evaluator::Prepared Evaluator::prepare(const Layout& l, std::vector<BinSums> sums) const {
  Prepared out;
  out.sums = std::move(sums);
  InFlightTokens llm_tokens, enc_tokens;
  double llm_targets = 0;
  const int64_t m = l.num_microbatches, dp = l.llm.dp;
  // A frozen LLM under a trained projector keeps nothing of a microbatch without visual
  // rows (it runs no backward for it).
  const bool gated = ctx_.llm.backward_needs_visual();
  std::vector<double> llm_gpu(static_cast<size_t>(m)), enc_gpu(static_cast<size_t>(m));
  for (const BinSums& s : out.sums) {
    for (int64_t r = 0; r < dp; ++r) {  // an LLM replica's microbatches: bins k dp + r
      if (ctx_.o.memory_replica >= 0 && r != ctx_.o.memory_replica) continue;
      for (int64_t k = 0; k < m; ++k) {
        const size_t bin = size_t(k * dp + r);
        llm_targets = std::max(llm_targets, s.llm_targets[bin]);
        const bool kept = !gated || s.visual[bin] != 0;
        llm_gpu[size_t(k)] = kept ? s.llm_tokens[bin] : 0.0;
        if (!kept) llm_tokens.forward_only = std::max(llm_tokens.forward_only, s.llm_tokens[bin]);
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

PipelineSimInput Evaluator::replica_input(const PipelineSimInput& in, int64_t r,
                                          const std::vector<int64_t>& order) {
  const int64_t S = virtual_stages_of(in), m = in.num_microbatches;
  PipelineSimInput out;
  out.num_replicas = 1;
  out.num_stages = in.num_stages;
  out.num_microbatches = m;
  out.order = in.order;
  out.shape = in.shape;
  out.record_events = false;
  out.link_latency_s = in.link_latency_s;
  out.link_bandwidth_bytes_per_s = in.link_bandwidth_bytes_per_s;
  out.allreduce_s = in.allreduce_s;
  out.gradient_links = in.gradient_links;
  out.forward_s.resize(size_t(S * m));
  out.backward_s.resize(size_t(S * m));
  if (!in.weight_s.empty()) out.weight_s.resize(size_t(S * m));
  for (int64_t st = 0; st < S; ++st) {
    for (int64_t k = 0; k < m; ++k) {
      const size_t from = size_t((r * S + st) * m + order[size_t(k)]);
      out.forward_s[size_t(st * m + k)] = in.forward_s[from];
      out.backward_s[size_t(st * m + k)] = in.backward_s[from];
      if (!in.weight_s.empty()) out.weight_s[size_t(st * m + k)] = in.weight_s[from];
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

double Evaluator::replica_bound(const Layout& l, const BinSums& sums, double enough) const {
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
  auto gradient_link = [&](int64_t link) {
    return base.gradient_links.empty() || base.gradient_links[size_t(link)] != 0;
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
        // Down to the first boundary that carries no gradient (the stages before it run
        // no backward that waits for one). A split backward may end with weight
        // gradients after the last input gradient went down: no drain is certain.
        for (int64_t down = u0 - 1; down >= 0 && gradient_link(down) && base.weight_s.empty();
             --down) {
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

LayoutScore Evaluator::finish(const Layout& l, const Prepared& p, bool as_given) const {
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

LayoutScore Evaluator::score(const Layout& l, bool* feasible, Memory* mem_out,
                             const std::vector<std::vector<int64_t>>* given) const {
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

double Evaluator::mean_shape_estimate(const Layout& l) const {
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
  const auto slowest_stage = [&](const auto& model, const ModuleLayout& m, double body, double last,
                                 double tokens) {
    const double f = per_mb / double(m.dp) / samples;
    double slowest = 0;
    for (int64_t st = 0; st < m.pp; ++st) {
      const int64_t nl = stage_layers(m, st);
      slowest = std::max(slowest, model.stage_time(m.tp, m.recompute, nl, st == m.pp - 1, body * f,
                                                   last * f, tokens * f) +
                                      model.stage_constant(m.tp, nl, st == m.pp - 1));
    }
    return slowest;
  };
  const double slowest = std::max(slowest_stage(ctx_.enc, l.encoder, enc_body, enc_last, enc_tok),
                                  slowest_stage(ctx_.llm, l.llm, llm_body, llm_last, llm_tok));
  return double(l.num_microbatches + total_stages(l) - 1) * slowest;
}

}  // namespace dflop::detail
