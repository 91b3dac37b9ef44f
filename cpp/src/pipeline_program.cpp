// Pipeline schedules as action lists: the schedule registry (each schedule's generator and
// memory rule), the one choice of a pipeline's schedule, the validator and its grid (see
// pipeline_program.hpp).
#include "dflop/pipeline_program.hpp"

#include <algorithm>
#include <cctype>
#include <deque>
#include <string>
#include <utility>
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

// The forwards, in order, and backwards of physical stage p.
StageOrder order_at(const PipelineShape& shape, int64_t m, const Place& p) {
  return stage_order(p.first_virtual, shape.stages[size_t(p.segment)],
                     shape.chunks[size_t(p.segment)], p.local, m);
}

// ---------------------------------------------------------------------------------------
// The schedules: what each can run, its generator and its memory rule.

// 1F1B's warm-up (every segment one chunk): the physical stages after this one.
int64_t plain_warmup(const PipelineShape& shape, int64_t m, const Place& p) {
  return std::min(shape.stages[size_t(p.segment)] - 1 - p.local + p.stages_after, m);
}

// Interleaved 1F1B's warm-up (chunks on the last segment only).
int64_t interleaved_warmup(const PipelineShape& shape, int64_t m, const Place& p) {
  const int64_t last = int64_t(shape.stages.size()) - 1;
  const int64_t L = shape.stages[size_t(last)], vl = shape.chunks[size_t(last)];
  if (vl == 1) return plain_warmup(shape, m, p);
  if (p.segment < last) {
    // Earlier segments feed the last one's first stage, which runs `demand` forwards of its
    // first chunk before the first backward of it: its warm-up W0, then one forward per
    // backward until backward (vl - 1) L (the first of chunk 0), in rounds of L x vl forwards
    // of which L are chunk 0's (m is a multiple of L).
    const int64_t below = shape.stages[size_t(p.segment)] - 1 - p.local;
    const int64_t warmup0 = std::min(2 * (L - 1) + (vl - 1) * L, m * vl);
    const int64_t issued = std::min(warmup0 + (vl - 1) * L + 1, m * vl);
    const int64_t demand = issued / (L * vl) * L + std::min(issued % (L * vl), L);
    return std::min(below + (p.stages_after - L) + demand, m);
  }
  return std::min(2 * (L - 1 - p.local) + (vl - 1) * L, m * vl);
}

// `Warmup` forwards, then forward / backward pairs, then the remaining backwards.
template <int64_t (*Warmup)(const PipelineShape&, int64_t, const Place&)>
std::vector<PipelineAction> warmed_up_actions(const PipelineShape& shape, int64_t m,
                                              int64_t stage) {
  const Place p = place_of(shape, stage);
  return one_forward_one_backward(order_at(shape, m, p), Warmup(shape, m, p));
}

// Its warm-up forwards and the first steady forward are held at once.
template <int64_t (*Warmup)(const PipelineShape&, int64_t, const Place&)>
int64_t warmed_up_peak(const PipelineShape& shape, int64_t m, int64_t stage) {
  const Place p = place_of(shape, stage);
  return std::min(Warmup(shape, m, p) + 1, m * shape.chunks[size_t(p.segment)]);
}

std::vector<PipelineAction> gpipe_actions(const PipelineShape& shape, int64_t m, int64_t stage) {
  const Place p = place_of(shape, stage);
  return one_forward_one_backward(order_at(shape, m, p), m * shape.chunks[size_t(p.segment)]);
}

int64_t gpipe_peak(const PipelineShape& shape, int64_t m, int64_t stage) {
  return m * shape.chunks[size_t(place_of(shape, stage).segment)];
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's warm-up, with each
// backward split into I (the input gradient, sent on at once) and W (the weight gradient).
// Physical stage s runs its W passes `s` microbatches behind its I passes in the steady
// state, so that every stage holds min(S, m) microbatches (the first stage's 1F1B peak,
// the pipeline's peak unchanged); in the cool-down each I is followed by the oldest W
// left, which fills the wait for the next gradient. With equal F, I and W times the
// bubble is a third of 1F1B's: (S - 1) x (F + I - W).
std::vector<PipelineAction> zero_bubble_h1_actions(const PipelineShape& shape, int64_t m,
                                                   int64_t stage) {
  const Place p = place_of(shape, stage);
  const StageOrder order = order_at(shape, m, p);
  const int64_t warmup = plain_warmup(shape, m, p);
  auto split = [&](int64_t i, ActionKind kind) {
    PipelineAction a = order.backwards[size_t(i)];
    a.kind = kind;
    return a;
  };
  std::vector<PipelineAction> out;
  out.reserve(size_t(3 * m));
  for (int64_t i = 0; i < warmup; ++i) out.push_back(order.forwards[size_t(i)]);
  int64_t weights_done = 0;
  for (int64_t i = 0; i < m - warmup; ++i) {
    out.push_back(order.forwards[size_t(warmup + i)]);
    out.push_back(split(i, ActionKind::BackwardInput));
    if (i >= stage) out.push_back(split(weights_done++, ActionKind::BackwardWeight));
  }
  for (int64_t i = m - warmup; i < m; ++i) {
    out.push_back(split(i, ActionKind::BackwardInput));
    if (weights_done <= i) out.push_back(split(weights_done++, ActionKind::BackwardWeight));
  }
  while (weights_done < m) out.push_back(split(weights_done++, ActionKind::BackwardWeight));
  return out;
}

int64_t zero_bubble_h1_peak(const PipelineShape& shape, int64_t m, int64_t) {
  return std::min(num_physical_stages(shape), m);
}

void runs_anything(const PipelineShape&, int64_t) {}

void require_one_chunk(const PipelineShape& shape, const char* order) {
  for (size_t g = 0; g < shape.stages.size(); ++g) {
    require(shape.chunks[g] == 1, "shape.chunks[" + std::to_string(g) +
                                      "]=" + std::to_string(shape.chunks[g]) + ": " + order +
                                      " runs one chunk per stage (use interleaved-1f1b for more)");
  }
}

void runs_one_chunk(const PipelineShape& shape, int64_t) { require_one_chunk(shape, "1f1b"); }

void runs_one_chunk_zb(const PipelineShape& shape, int64_t) { require_one_chunk(shape, "zb-h1"); }

void runs_interleaved(const PipelineShape& shape, int64_t m) {
  const size_t last = shape.stages.size() - 1;
  for (size_t g = 0; g < last; ++g) {
    require(shape.chunks[g] == 1,
            "shape.chunks[" + std::to_string(g) + "]=" + std::to_string(shape.chunks[g]) +
                ": interleaved-1f1b interleaves the last segment only (the LLM); earlier "
                "segments take chunks = 1");
  }
  if (shape.chunks[last] > 1) {
    // As in Megatron-LM: with a short last round, the order deadlocks.
    require(m % shape.stages[last] == 0,
            "interleaved-1f1b needs num_microbatches to be a multiple of the last segment's "
            "stages (" +
                std::to_string(shape.stages[last]) + "), got " + std::to_string(m));
  }
}

void check_program_args(const PipelineOrderDef& def, const PipelineShape& shape, int64_t m) {
  validate_shape(shape);
  check_microbatches(m);
  def.check(shape, m);
}

// ---------------------------------------------------------------------------------------
// The grid of program_grid()

std::string padded(std::string text, size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

std::string trimmed(std::string line) {
  while (!line.empty() && line.back() == ' ') line.pop_back();
  return line;
}

}  // namespace

// The pipeline-order registry: one entry per generated pipeline order (see the header).
const std::vector<PipelineOrderDef>& pipeline_order_registry() {
  static const std::vector<PipelineOrderDef> registry = {
      {PipelineOrder::OneFOneB, "1f1b", runs_one_chunk, warmed_up_actions<plain_warmup>,
       warmed_up_peak<plain_warmup>},
      {PipelineOrder::GPipe, "gpipe", runs_anything, gpipe_actions, gpipe_peak},
      {PipelineOrder::Interleaved1F1B, "interleaved-1f1b", runs_interleaved,
       warmed_up_actions<interleaved_warmup>, warmed_up_peak<interleaved_warmup>},
      {PipelineOrder::ZeroBubbleH1, "zb-h1", runs_one_chunk_zb, zero_bubble_h1_actions,
       zero_bubble_h1_peak, true},
  };
  return registry;
}

const PipelineOrderDef& pipeline_order_def(PipelineOrder kind) {
  for (const PipelineOrderDef& def : pipeline_order_registry()) {
    if (def.kind == kind) return def;
  }
  throw InvalidArgument("pipeline order " + std::to_string(int(kind)) + " is not a PipelineOrder");
}

// The one choice of a pipeline's schedule.
PipelineOrder pipeline_order_for(const PipelineShape& shape) {
  validate_shape(shape);
  for (int64_t c : shape.chunks) {
    if (c > 1) return PipelineOrder::Interleaved1F1B;
  }
  return PipelineOrder::OneFOneB;
}

PipelineOrder parse_pipeline_order(const std::string& name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const auto& registry = pipeline_order_registry();
  std::string names;
  for (size_t i = 0; i < registry.size(); ++i) {
    if (lower == registry[i].name) return registry[i].kind;
    names += (i == 0 ? "" : i + 1 == registry.size() ? " or " : ", ");
    names += std::string("\"") + registry[i].name + "\"";
  }
  throw InvalidArgument("pipeline order must be " + names + ", got \"" + name + "\"");
}

const char* pipeline_order_name(PipelineOrder kind) {
  for (const PipelineOrderDef& def : pipeline_order_registry()) {
    if (def.kind == kind) return def.name;
  }
  return "unknown";
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

std::string format_action(const PipelineAction& a) {
  return std::string(action_kind_name(a.kind)) + std::to_string(a.stage) + "." +
         std::to_string(a.microbatch);
}

PipelineProgram pipeline_program(PipelineOrder kind, const PipelineShape& shape, int64_t m) {
  const PipelineOrderDef& def = pipeline_order_def(kind);
  check_program_args(def, shape, m);
  PipelineProgram program;
  program.num_microbatches = m;
  program.owner = virtual_stage_owners(shape);
  const int64_t S = num_physical_stages(shape);
  program.actions.reserve(size_t(S));
  for (int64_t s = 0; s < S; ++s) program.actions.push_back(def.stage_actions(shape, m, s));
  return program;
}

int64_t peak_in_flight(PipelineOrder kind, const PipelineShape& shape, int64_t m, int64_t stage) {
  const PipelineOrderDef& def = pipeline_order_def(kind);
  check_program_args(def, shape, m);
  return def.peak_in_flight(shape, m, stage);
}

int64_t peak_in_flight(const std::vector<PipelineAction>& actions) {
  int64_t now = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    if (a.kind == ActionKind::Forward) peak = std::max(peak, ++now);
    if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) --now;
  }
  return peak;
}

int64_t peak_pending_weight(PipelineOrder kind, const PipelineShape& shape, int64_t m,
                            int64_t stage) {
  const PipelineOrderDef& def = pipeline_order_def(kind);
  check_program_args(def, shape, m);
  if (!def.splits_backward) return 0;
  if (stage < 0 || stage >= num_physical_stages(shape)) {
    throw InvalidArgument("stage must be in [0, " + std::to_string(num_physical_stages(shape)) +
                          "), got " + std::to_string(stage));
  }
  return peak_pending_weight(def.stage_actions(shape, m, stage));
}

int64_t peak_pending_weight(const std::vector<PipelineAction>& actions) {
  int64_t now = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    if (a.kind == ActionKind::BackwardInput) peak = std::max(peak, ++now);
    if (a.kind == ActionKind::BackwardWeight) --now;
  }
  return peak;
}

std::string program_grid(const PipelineProgram& program,
                         const std::vector<std::pair<int64_t, int64_t>>& marks,
                         int64_t focus_stage) {
  const int64_t S = int64_t(program.actions.size());
  if (S == 0) return "(the program has no stages)";
  const int64_t focus = std::clamp(marks.empty() ? focus_stage : marks[0].first, int64_t{0}, S - 1);
  const int64_t focus_slot = marks.empty() ? 0 : std::max<int64_t>(marks[0].second, 0);
  int64_t row0 = 0, row1 = S;
  if (S > kGridRows) {
    row0 = std::clamp(focus - kGridRows / 2, int64_t{0}, S - kGridRows);
    row1 = row0 + kGridRows;
  }
  int64_t longest = 0;
  for (int64_t s = row0; s < row1; ++s) {
    longest = std::max(longest, int64_t(program.actions[size_t(s)].size()));
  }
  int64_t col0 = 0, col1 = longest;
  if (longest > kGridColumns) {
    col0 = std::clamp(focus_slot - kGridColumns / 2, int64_t{0}, longest - kGridColumns);
    col1 = col0 + kGridColumns;
  }
  auto marked = [&](int64_t s, int64_t i) {
    return std::find(marks.begin(), marks.end(), std::pair<int64_t, int64_t>{s, i}) != marks.end();
  };
  // Cells first, to size the columns.
  std::vector<std::vector<std::string>> cells(size_t(row1 - row0));
  size_t width = std::to_string(std::max<int64_t>(col1 - 1, 0)).size();
  for (int64_t s = row0; s < row1; ++s) {
    const auto& list = program.actions[size_t(s)];
    for (int64_t i = col0; i < std::min(col1, int64_t(list.size())); ++i) {
      std::string cell = format_action(list[size_t(i)]);
      if (marked(s, i)) cell = ">" + cell + "<";
      width = std::max(width, cell.size());
      cells[size_t(s - row0)].push_back(std::move(cell));
    }
  }
  const size_t label = ("stage " + std::to_string(row1 - 1)).size();
  std::string out =
      "the program, a row per physical stage and a column per time slot (the stage's action "
      "index)" +
      std::string(marks.empty() ? "" : "; >X<: the failing action") + ":\n";
  std::string header = padded("slot", label) + (col0 > 0 ? "  ..." : "");
  for (int64_t i = col0; i < col1; ++i) header += "  " + padded(std::to_string(i), width);
  out += trimmed(header) + "\n";
  if (row0 > 0) out += "(stages 0 to " + std::to_string(row0 - 1) + " not shown)\n";
  for (int64_t s = row0; s < row1; ++s) {
    const auto& list = program.actions[size_t(s)];
    std::string line = padded("stage " + std::to_string(s), label) + (col0 > 0 ? "  ..." : "");
    for (const std::string& cell : cells[size_t(s - row0)]) line += "  " + padded(cell, width);
    if (list.empty()) line += "  (no actions)";
    if (int64_t(list.size()) > col1) {
      line += "  ... (" + std::to_string(int64_t(list.size()) - col1) + " more)";
    }
    out += trimmed(line) + "\n";
  }
  if (row1 < S) {
    out += "(stages " + std::to_string(row1) + " to " + std::to_string(S - 1) + " not shown)\n";
  }
  out.pop_back();  // the last newline
  return out;
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
  // A problem of action i of stage s: the message, then the grid with it marked.
  auto fail = [&](int64_t s, size_t i, const std::string& problem) {
    const PipelineAction& a = program.actions[size_t(s)][i];
    throw InvalidArgument("stage " + std::to_string(s) + ", action " + std::to_string(i) + " (" +
                          action_text(a) + "): " + problem + "\n" +
                          program_grid(program, {{s, int64_t(i)}}));
  };
  // Per (virtual stage, microbatch): 1 forward, 2 backward, 4 input grad, 8 weight grad.
  std::vector<uint8_t> seen(size_t(V * m), 0);
  for (int64_t s = 0; s < S; ++s) {
    const auto& list = program.actions[size_t(s)];
    for (size_t i = 0; i < list.size(); ++i) {
      const PipelineAction& a = list[i];
      if (int(a.kind) < 0 || int(a.kind) > 3) {
        throw InvalidArgument("stage " + std::to_string(s) + ", action " + std::to_string(i) +
                              ": kind " + std::to_string(int(a.kind)) + " is not an ActionKind");
      }
      if (a.stage < 0 || a.stage >= V) {
        fail(s, i, "the virtual stage is not in [0, " + std::to_string(V) + ")");
      }
      if (a.microbatch < 0 || a.microbatch >= m) {
        fail(s, i, "the microbatch is not in [0, " + std::to_string(m) + ")");
      }
      if (program.owner[size_t(a.stage)] != s) {
        fail(s, i,
             "virtual stage " + std::to_string(a.stage) + " runs on stage " +
                 std::to_string(program.owner[size_t(a.stage)]));
      }
      uint8_t& state = seen[size_t(a.stage * m + a.microbatch)];
      const uint8_t bit = uint8_t(1u << int(a.kind));
      if (state & bit) fail(s, i, "listed twice");
      const bool has_forward = state & 1u;
      switch (a.kind) {
        case ActionKind::Forward:
          break;
        case ActionKind::Backward:
          if (!has_forward || (state & 12u)) {
            fail(s, i, "needs its forward before it and no split backward (I / W)");
          }
          break;
        case ActionKind::BackwardInput:
          if (!has_forward || (state & 2u)) fail(s, i, "needs its forward before it and no B");
          break;
        case ActionKind::BackwardWeight:
          if (!(state & 4u)) fail(s, i, "needs its I before it");
          break;
      }
      state |= bit;
    }
  }
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t k = 0; k < m; ++k) {
      const uint8_t state = seen[size_t(v * m + k)];
      const bool complete = (state & 1u) && ((state & 2u) || ((state & 4u) && (state & 8u)));
      if (!complete) {
        throw InvalidArgument("virtual stage " + std::to_string(v) + ", microbatch " +
                              std::to_string(k) +
                              " lacks its forward and backward (F, then B or I and W)\n" +
                              program_grid(program, {}, program.owner[size_t(v)]));
      }
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
  std::vector<std::pair<int64_t, int64_t>> waiting;  // every stuck stage's next action
  for (int64_t s = 0; s < S; ++s) {
    if (next[size_t(s)] < program.actions[size_t(s)].size()) {
      waiting.emplace_back(s, int64_t(next[size_t(s)]));
    }
  }
  if (waiting.empty()) return;
  const auto [s, i] = waiting.front();
  throw InvalidArgument("the program deadlocks: stage " + std::to_string(s) + " waits at action " +
                        std::to_string(i) + " (" +
                        action_text(program.actions[size_t(s)][size_t(i)]) +
                        ") for an input that is never sent" +
                        (waiting.size() > 1 ? " (>X<: every waiting stage's next action)" : "") +
                        "\n" + program_grid(program, waiting));
}

std::vector<PipelineAction> pipeline_actions(PipelineOrder kind, int64_t num_stages,
                                             int64_t num_microbatches, int64_t stage) {
  require(num_stages >= 1 && num_stages <= kMaxVirtualStages,
          "num_stages must be in [1, " + std::to_string(kMaxVirtualStages) + "], got " +
              std::to_string(num_stages));
  check_microbatches(num_microbatches);
  require(stage >= 0 && stage < num_stages,
          "stage must be in [0, " + std::to_string(num_stages) + "), got " + std::to_string(stage));
  const PipelineOrderDef& def = pipeline_order_def(kind);
  const PipelineShape shape = PipelineShape::plain(num_stages);
  def.check(shape, num_microbatches);
  return def.stage_actions(shape, num_microbatches, stage);
}

}  // namespace dflop
