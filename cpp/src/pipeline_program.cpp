// Pipeline schedules as action lists: the generators, the memory rule and the validator
// (see pipeline_program.hpp).
#include "dflop/pipeline_program.hpp"

#include <algorithm>
#include <cctype>
#include <deque>
#include <string>
#include <vector>

#include "dflop/errors.hpp"

namespace dflop {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

std::string action_text(const PipelineAction& a) {
  return std::string(action_kind_name(a.kind)) + " of virtual stage " + std::to_string(a.stage) +
         ", microbatch " + std::to_string(a.microbatch);
}

void check_microbatches(int64_t m) {
  require(m >= 1 && m <= kMaxPipelineMicrobatches, "num_microbatches must be in [1, " +
                                                       std::to_string(kMaxPipelineMicrobatches) +
                                                       "], got " + std::to_string(m));
}

bool is_known(ScheduleKind kind) {
  return kind == ScheduleKind::OneFOneB || kind == ScheduleKind::GPipe ||
         kind == ScheduleKind::Interleaved1F1B;
}

// One segment's stage: its forwards in rounds of `round` microbatches, chunk by chunk, and
// its backwards in the same rounds with the chunks reversed.
struct StageOrder {
  std::vector<PipelineAction> forwards, backwards;
};

StageOrder stage_order(int64_t first_virtual, int64_t stages, int64_t chunks, int64_t local,
                       int64_t m) {
  StageOrder out;
  out.forwards.reserve(size_t(m * chunks));
  out.backwards.reserve(size_t(m * chunks));
  for (int64_t begin = 0; begin < m; begin += stages) {
    const int64_t end = std::min(m, begin + stages);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t fwd = first_virtual + c * stages + local;
      const int64_t bwd = first_virtual + (chunks - 1 - c) * stages + local;
      for (int64_t k = begin; k < end; ++k) {
        out.forwards.push_back({fwd, ActionKind::Forward, k});
        out.backwards.push_back({bwd, ActionKind::Backward, k});
      }
    }
  }
  return out;
}

// `warmup` forwards, then forward / backward pairs, then the remaining backwards.
std::vector<PipelineAction> one_forward_one_backward(const StageOrder& order, int64_t warmup) {
  const int64_t n = int64_t(order.forwards.size());
  warmup = std::min(warmup, n);
  std::vector<PipelineAction> out;
  out.reserve(size_t(2 * n));
  for (int64_t i = 0; i < warmup; ++i) out.push_back(order.forwards[size_t(i)]);
  for (int64_t i = 0; i < n - warmup; ++i) {
    out.push_back(order.forwards[size_t(warmup + i)]);
    out.push_back(order.backwards[size_t(i)]);
  }
  for (int64_t i = n - warmup; i < n; ++i) out.push_back(order.backwards[size_t(i)]);
  return out;
}

// Where a physical stage sits: its segment, its index there, the segment's first virtual
// stage, and the physical stages after the segment.
struct Place {
  int64_t segment = 0, local = 0, first_virtual = 0, stages_after = 0;
};

Place place_of(const PipelineShape& shape, int64_t stage) {
  Place p;
  int64_t first_physical = 0;
  for (size_t g = 0; g < shape.stages.size(); ++g) {
    if (stage < first_physical + shape.stages[g]) {
      p.segment = int64_t(g);
      p.local = stage - first_physical;
      for (size_t h = g + 1; h < shape.stages.size(); ++h) p.stages_after += shape.stages[h];
      return p;
    }
    first_physical += shape.stages[g];
    p.first_virtual += shape.stages[g] * shape.chunks[g];
  }
  throw InvalidArgument("stage must be in [0, " + std::to_string(first_physical) + "), got " +
                        std::to_string(stage));
}

// The warm-up forwards of a physical stage under 1F1B / interleaved 1F1B.
int64_t warmup_of(ScheduleKind kind, const PipelineShape& shape, int64_t m, const Place& p) {
  const int64_t last = int64_t(shape.stages.size()) - 1;
  const int64_t P = shape.stages[size_t(p.segment)], v = shape.chunks[size_t(p.segment)];
  if (kind == ScheduleKind::OneFOneB || p.segment < last) {
    const int64_t below = P - 1 - p.local;
    if (kind == ScheduleKind::OneFOneB || shape.chunks[size_t(last)] == 1) {
      return std::min(below + p.stages_after, m);
    }
    // Earlier segments feed the last one's first stage, which runs `demand` forwards of its
    // first chunk before the first backward of it: its warm-up W0, then one forward per
    // backward until backward (vl - 1) L (the first of chunk 0), in rounds of L x vl forwards
    // of which L are chunk 0's (m is a multiple of L).
    const int64_t L = shape.stages[size_t(last)], vl = shape.chunks[size_t(last)];
    const int64_t warmup0 = std::min(2 * (L - 1) + (vl - 1) * L, m * vl);
    const int64_t issued = std::min(warmup0 + (vl - 1) * L + 1, m * vl);
    const int64_t demand = issued / (L * vl) * L + std::min(issued % (L * vl), L);
    return std::min(below + (p.stages_after - L) + demand, m);
  }
  if (v == 1) return std::min(P - 1 - p.local, m);
  return std::min(2 * (P - 1 - p.local) + (v - 1) * P, m * v);
}

void check_program_args(ScheduleKind kind, const PipelineShape& shape, int64_t m) {
  require(is_known(kind), "schedule kind " + std::to_string(int(kind)) + " is not a ScheduleKind");
  validate_shape(shape);
  check_microbatches(m);
  const size_t last = shape.stages.size() - 1;
  for (size_t g = 0; g < shape.stages.size(); ++g) {
    if (shape.chunks[g] == 1) continue;
    require(kind != ScheduleKind::OneFOneB,
            "shape.chunks[" + std::to_string(g) + "]=" + std::to_string(shape.chunks[g]) +
                ": 1f1b runs one chunk per stage (use interleaved-1f1b for more)");
    require(kind != ScheduleKind::Interleaved1F1B || g == last,
            "shape.chunks[" + std::to_string(g) + "]=" + std::to_string(shape.chunks[g]) +
                ": interleaved-1f1b interleaves the last segment only (the LLM); earlier "
                "segments take chunks = 1");
  }
  if (kind == ScheduleKind::Interleaved1F1B && shape.chunks[last] > 1) {
    // As in Megatron-LM: with a short last round, the order deadlocks.
    require(m % shape.stages[last] == 0,
            "interleaved-1f1b needs num_microbatches to be a multiple of the last segment's "
            "stages (" +
                std::to_string(shape.stages[last]) + "), got " + std::to_string(m));
  }
}

}  // namespace

ScheduleKind parse_schedule_kind(const std::string& name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "1f1b") return ScheduleKind::OneFOneB;
  if (lower == "gpipe") return ScheduleKind::GPipe;
  if (lower == "interleaved-1f1b") return ScheduleKind::Interleaved1F1B;
  throw InvalidArgument("schedule must be \"1f1b\", \"gpipe\" or \"interleaved-1f1b\", got \"" +
                        name + "\"");
}

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe:
      return "gpipe";
    case ScheduleKind::Interleaved1F1B:
      return "interleaved-1f1b";
    default:
      return "1f1b";
  }
}

const char* action_kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward:
      return "F";
    case ActionKind::Backward:
      return "B";
    case ActionKind::BackwardInput:
      return "I";
    case ActionKind::BackwardWeight:
      return "W";
  }
  return "?";
}

void validate_shape(const PipelineShape& shape) {
  require(!shape.stages.empty(), "shape.stages must have at least one segment");
  require(shape.stages.size() == shape.chunks.size(),
          "shape.chunks has " + std::to_string(shape.chunks.size()) +
              " entries, expected one per segment (" + std::to_string(shape.stages.size()) + ")");
  int64_t virtual_stages = 0;
  for (size_t g = 0; g < shape.stages.size(); ++g) {
    for (const auto& [name, v] :
         {std::pair{"stages", shape.stages[g]}, {"chunks", shape.chunks[g]}}) {
      require(v >= 1 && v <= kMaxVirtualStages,
              std::string("shape.") + name + "[" + std::to_string(g) + "] must be in [1, " +
                  std::to_string(kMaxVirtualStages) + "], got " + std::to_string(v));
    }
    virtual_stages += shape.stages[g] * shape.chunks[g];
    require(virtual_stages <= kMaxVirtualStages,
            "the shape has more than " + std::to_string(kMaxVirtualStages) +
                " virtual stages (stages x chunks over its segments)");
  }
}

int64_t num_physical_stages(const PipelineShape& shape) {
  int64_t n = 0;
  for (int64_t s : shape.stages) n += s;
  return n;
}

int64_t num_virtual_stages(const PipelineShape& shape) {
  int64_t n = 0;
  for (size_t g = 0; g < shape.stages.size(); ++g) n += shape.stages[g] * shape.chunks[g];
  return n;
}

std::vector<int64_t> virtual_stage_owners(const PipelineShape& shape) {
  validate_shape(shape);
  std::vector<int64_t> owner;
  owner.reserve(size_t(num_virtual_stages(shape)));
  int64_t first_physical = 0;
  for (size_t g = 0; g < shape.stages.size(); ++g) {
    for (int64_t c = 0; c < shape.chunks[g]; ++c) {
      for (int64_t p = 0; p < shape.stages[g]; ++p) owner.push_back(first_physical + p);
    }
    first_physical += shape.stages[g];
  }
  return owner;
}

PipelineProgram pipeline_program(ScheduleKind kind, const PipelineShape& shape, int64_t m) {
  check_program_args(kind, shape, m);
  PipelineProgram program;
  program.num_microbatches = m;
  program.owner = virtual_stage_owners(shape);
  const int64_t S = num_physical_stages(shape);
  program.actions.reserve(size_t(S));
  for (int64_t s = 0; s < S; ++s) {
    const Place p = place_of(shape, s);
    const int64_t P = shape.stages[size_t(p.segment)], v = shape.chunks[size_t(p.segment)];
    const StageOrder order = stage_order(p.first_virtual, P, v, p.local, m);
    const int64_t warmup = kind == ScheduleKind::GPipe ? m * v : warmup_of(kind, shape, m, p);
    program.actions.push_back(one_forward_one_backward(order, warmup));
  }
  return program;
}

int64_t peak_in_flight(ScheduleKind kind, const PipelineShape& shape, int64_t m, int64_t stage) {
  check_program_args(kind, shape, m);
  const Place p = place_of(shape, stage);
  const int64_t total = m * shape.chunks[size_t(p.segment)];
  if (kind == ScheduleKind::GPipe) return total;
  return std::min(warmup_of(kind, shape, m, p) + 1, total);
}

int64_t peak_in_flight(const std::vector<PipelineAction>& actions) {
  int64_t now = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    if (a.kind == ActionKind::Forward) peak = std::max(peak, ++now);
    if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) --now;
  }
  return peak;
}

void validate_program(const PipelineProgram& program) {
  const int64_t m = program.num_microbatches;
  check_microbatches(m);
  const int64_t V = int64_t(program.owner.size());
  const int64_t S = int64_t(program.actions.size());
  require(S >= 1, "the program has no stages");
  require(V >= 1 && V <= kMaxVirtualStages, "the program's owner list must have 1 to " +
                                                std::to_string(kMaxVirtualStages) +
                                                " virtual stages, got " + std::to_string(V));
  for (int64_t v = 0; v < V; ++v) {
    const int64_t o = program.owner[size_t(v)];
    require(o >= 0 && o < S, "owner[" + std::to_string(v) + "]=" + std::to_string(o) +
                                 " is not a stage in [0, " + std::to_string(S) + ")");
  }
  int64_t total = 0;
  for (const auto& list : program.actions) total += int64_t(list.size());
  // Every (virtual stage, microbatch) needs at least a forward and a backward.
  require(V <= total / 2 / m, "the program has " + std::to_string(total) +
                                  " actions, fewer than the 2 x " + std::to_string(V) +
                                  " virtual stages x " + std::to_string(m) +
                                  " microbatches it needs");
  // Per (virtual stage, microbatch): 1 forward, 2 backward, 4 input grad, 8 weight grad.
  std::vector<uint8_t> seen(size_t(V * m), 0);
  for (int64_t s = 0; s < S; ++s) {
    const auto& list = program.actions[size_t(s)];
    for (size_t i = 0; i < list.size(); ++i) {
      const PipelineAction& a = list[i];
      const std::string where = "stage " + std::to_string(s) + ", action " + std::to_string(i);
      require(int(a.kind) >= 0 && int(a.kind) <= 3,
              where + ": kind " + std::to_string(int(a.kind)) + " is not an ActionKind");
      require(a.stage >= 0 && a.stage < V, where + " (" + action_text(a) +
                                               "): the virtual stage is not in [0, " +
                                               std::to_string(V) + ")");
      require(a.microbatch >= 0 && a.microbatch < m, where + " (" + action_text(a) +
                                                         "): the microbatch is not in [0, " +
                                                         std::to_string(m) + ")");
      require(program.owner[size_t(a.stage)] == s,
              where + " (" + action_text(a) + "): virtual stage " + std::to_string(a.stage) +
                  " runs on stage " + std::to_string(program.owner[size_t(a.stage)]));
      uint8_t& state = seen[size_t(a.stage * m + a.microbatch)];
      const uint8_t bit = uint8_t(1u << int(a.kind));
      require(!(state & bit), where + " (" + action_text(a) + "): listed twice");
      const bool has_forward = state & 1u;
      switch (a.kind) {
        case ActionKind::Forward:
          break;
        case ActionKind::Backward:
          require(has_forward && !(state & 12u),
                  where + " (" + action_text(a) +
                      "): needs its forward before it and no split backward (I / W)");
          break;
        case ActionKind::BackwardInput:
          require(has_forward && !(state & 2u),
                  where + " (" + action_text(a) + "): needs its forward before it and no B");
          break;
        case ActionKind::BackwardWeight:
          require(state & 4u, where + " (" + action_text(a) + "): needs its I before it");
          break;
      }
      state |= bit;
    }
  }
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t k = 0; k < m; ++k) {
      const uint8_t state = seen[size_t(v * m + k)];
      const bool complete = (state & 1u) && ((state & 2u) || ((state & 4u) && (state & 8u)));
      require(complete, "virtual stage " + std::to_string(v) + ", microbatch " + std::to_string(k) +
                            " lacks its forward and backward (F, then B or I and W)");
    }
  }
  // Runs to the end: advance every stage as far as its inputs allow (the simulator's
  // worklist with every action taking no time).
  std::vector<uint8_t> forward_done(size_t(V * m), 0), grad_done(size_t(V * m), 0);
  std::vector<size_t> next(size_t(S), 0);
  std::vector<char> queued(size_t(S), 1);
  std::deque<int64_t> work;
  for (int64_t s = 0; s < S; ++s) work.push_back(s);
  auto wake = [&](int64_t stage) {
    if (!queued[size_t(stage)]) {
      queued[size_t(stage)] = 1;
      work.push_back(stage);
    }
  };
  while (!work.empty()) {
    const int64_t s = work.front();
    work.pop_front();
    queued[size_t(s)] = 0;
    const auto& list = program.actions[size_t(s)];
    while (next[size_t(s)] < list.size()) {
      const PipelineAction& a = list[next[size_t(s)]];
      const size_t cell = size_t(a.stage * m + a.microbatch);
      const bool is_forward = a.kind == ActionKind::Forward;
      const bool sends_grad = a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput;
      if (is_forward && a.stage > 0 && !forward_done[cell - size_t(m)]) break;
      if (sends_grad && a.stage < V - 1 && !grad_done[cell + size_t(m)]) break;
      ++next[size_t(s)];
      if (is_forward) {
        forward_done[cell] = 1;
        if (a.stage < V - 1) wake(program.owner[size_t(a.stage + 1)]);
      } else if (sends_grad) {
        grad_done[cell] = 1;
        if (a.stage > 0) wake(program.owner[size_t(a.stage - 1)]);
      }
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    const auto& list = program.actions[size_t(s)];
    if (next[size_t(s)] == list.size()) continue;
    const PipelineAction& a = list[next[size_t(s)]];
    throw InvalidArgument("the program deadlocks: stage " + std::to_string(s) +
                          " waits at action " + std::to_string(next[size_t(s)]) + " (" +
                          action_text(a) + ") for an input that is never sent");
  }
}

std::vector<PipelineAction> pipeline_actions(ScheduleKind kind, int64_t num_stages,
                                             int64_t num_microbatches, int64_t stage) {
  require(num_stages >= 1 && num_stages <= kMaxVirtualStages,
          "num_stages must be in [1, " + std::to_string(kMaxVirtualStages) + "], got " +
              std::to_string(num_stages));
  check_microbatches(num_microbatches);
  require(stage >= 0 && stage < num_stages,
          "stage must be in [0, " + std::to_string(num_stages) + "), got " + std::to_string(stage));
  require(is_known(kind), "schedule kind " + std::to_string(int(kind)) + " is not a ScheduleKind");
  const PipelineShape shape = PipelineShape::plain(num_stages);
  const Place p = place_of(shape, stage);
  const StageOrder order = stage_order(0, num_stages, 1, stage, num_microbatches);
  const int64_t warmup =
      kind == ScheduleKind::GPipe ? num_microbatches : warmup_of(kind, shape, num_microbatches, p);
  return one_forward_one_backward(order, warmup);
}

}  // namespace dflop
