// Pipeline programs: the generated orders (hand-checked), the validator, the memory rule
// against the generated lists, and the simulator on interleaved and split-backward
// programs.
#include <string>
#include <vector>

#include "check.hpp"
#include "dflop/errors.hpp"
#include "dflop/pipeline_program.hpp"
#include "dflop/simulator.hpp"

namespace {

using dflop::ActionKind;
using dflop::PipelineAction;
using dflop::PipelineOrder;
using dflop::PipelineProgram;
using dflop::PipelineShape;

// "F0.1" = forward of virtual stage 0, microbatch 1.
std::string text(const std::vector<PipelineAction>& actions) {
  std::string s;
  for (const auto& a : actions) {
    if (!s.empty()) s += ' ';
    s += dflop::action_kind_name(a.kind) + std::to_string(a.stage) + "." +
         std::to_string(a.microbatch);
  }
  return s;
}

// Stage 1 waits for forward 1, which stage 0 sends only after backward 0, which stage 1
// runs after forward 1 (two stages, two microbatches).
void deadlocked(PipelineProgram& q) {
  q.actions[0] = {{0, ActionKind::Forward, 0},
                  {0, ActionKind::Backward, 0},
                  {0, ActionKind::Forward, 1},
                  {0, ActionKind::Backward, 1}};
  q.actions[1] = {{1, ActionKind::Forward, 1},
                  {1, ActionKind::Forward, 0},
                  {1, ActionKind::Backward, 0},
                  {1, ActionKind::Backward, 1}};
}

TEST_CASE(interleaved_order) {
  // Two stages, two chunks, four microbatches: virtual stages 0, 2 on stage 0 and 1, 3 on
  // stage 1. Stage 0 warms up with 2 (P - 1) + (v - 1) P = 4 forwards, stage 1 with 2.
  const PipelineProgram p = dflop::pipeline_program(PipelineOrder::Interleaved1F1B, {{2}, {2}}, 4);
  CHECK(p.owner == std::vector<int64_t>({0, 1, 0, 1}));
  CHECK_EQ(text(p.actions[0]),
           std::string("F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 "
                       "B0.2 B0.3"));
  CHECK_EQ(text(p.actions[1]),
           std::string("F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 "
                       "B1.2 B1.3"));
  // An encoder segment of one stage before it runs 1F1B, warmed up by the forwards of
  // chunk 0 that the LLM's first stage runs before its first backward of chunk 0: all 4.
  const PipelineProgram q =
      dflop::pipeline_program(PipelineOrder::Interleaved1F1B, {{1, 2}, {1, 2}}, 4);
  CHECK(q.owner == std::vector<int64_t>({0, 1, 2, 1, 2}));
  CHECK_EQ(text(q.actions[0]), std::string("F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3"));
  dflop::validate_program(q);
  // The plain 1F1B of one segment is unchanged.
  CHECK_EQ(text(dflop::pipeline_actions(PipelineOrder::OneFOneB, 4, 6, 1)),
           std::string("F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 F1.5 B1.3 B1.4 B1.5"));
}

// Every generated program is valid and runs to the end, and the memory rule equals the
// peak counted along its lists.
TEST_CASE(generated_programs_are_valid) {
  int64_t checked = 0;
  for (int kind_index = 0; kind_index < 4; ++kind_index) {
    const auto kind = static_cast<PipelineOrder>(kind_index);
    const bool one_chunk = kind == PipelineOrder::OneFOneB || kind == PipelineOrder::ZeroBubbleH1;
    for (int64_t first = 0; first <= 3; ++first) {  // 0: no encoder segment
      for (int64_t last = 1; last <= 5; ++last) {   // the LLM's stages
        for (int64_t chunks = 1; chunks <= 4; ++chunks) {
          if (one_chunk && chunks > 1) continue;
          PipelineShape shape{{last}, {chunks}};
          if (first > 0) shape = {{first, last}, {1, chunks}};
          const bool interleaved = kind == PipelineOrder::Interleaved1F1B && chunks > 1;
          for (int64_t m = interleaved ? last : 1; m <= 4 * last + 2; m += interleaved ? last : 1) {
            const PipelineProgram p = dflop::pipeline_program(kind, shape, m);
            try {
              dflop::validate_program(p);
            } catch (const dflop::InvalidArgument& e) {
              CHECK_MSG(false, "kind " << kind_index << " first " << first << " last " << last
                                       << " chunks " << chunks << " m " << m << ": " << e.what());
              continue;
            }
            for (size_t s = 0; s < p.actions.size(); ++s) {
              CHECK_EQ(dflop::peak_in_flight(kind, shape, m, int64_t(s)),
                       dflop::peak_in_flight(p.actions[s]));
            }
            ++checked;
          }
        }
      }
    }
  }
  CHECK(checked > 500);
}

TEST_CASE(validator_names_the_problem) {
  PipelineProgram p = dflop::pipeline_program(PipelineOrder::OneFOneB, PipelineShape::plain(2), 2);
  auto broken = [&](auto edit, const std::string& needle, int line) {
    PipelineProgram q = p;
    edit(q);
    (void)line;
    CHECK_THROWS_WITH(dflop::validate_program(q), dflop::InvalidArgument, needle);
  };
  broken([](PipelineProgram& q) { q.actions[0][0].stage = 1; }, "runs on stage 1", __LINE__);
  broken([](PipelineProgram& q) { q.actions[1].pop_back(); }, "fewer than", __LINE__);
  broken([](PipelineProgram& q) { q.actions[1][3] = q.actions[1][2]; }, "listed twice", __LINE__);
  broken([](PipelineProgram& q) { q.actions[0][0].microbatch = 7; }, "microbatch is not in",
         __LINE__);
  broken([](PipelineProgram& q) { q.owner[1] = 5; }, "owner[1]=5", __LINE__);
  broken([](PipelineProgram& q) { std::swap(q.actions[1][0], q.actions[1][1]); },
         "needs its forward before it", __LINE__);
  broken(deadlocked, "deadlocks: stage 0 waits at action 1 (B of virtual stage 0, microbatch 0)",
         __LINE__);
  broken(
      [](PipelineProgram& q) {
        q.actions[1] = {{1, ActionKind::Forward, 0},
                        {1, ActionKind::BackwardWeight, 0},
                        {1, ActionKind::BackwardInput, 0},
                        {1, ActionKind::Forward, 1},
                        {1, ActionKind::Backward, 1}};
      },
      "needs its I before it", __LINE__);
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::OneFOneB, {{2}, {2}}, 4),
                    dflop::InvalidArgument, "1f1b runs one chunk per stage");
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::Interleaved1F1B, {{2, 2}, {2, 2}}, 4),
                    dflop::InvalidArgument, "interleaves the last segment only");
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::Interleaved1F1B, {{4}, {2}}, 6),
                    dflop::InvalidArgument, "a multiple of the last segment's stages (4), got 6");
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::GPipe, {{2, 0}, {1, 1}}, 3),
                    dflop::InvalidArgument, "shape.stages[1] must be in [1");
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::GPipe, {{2}, {1, 1}}, 3),
                    dflop::InvalidArgument, "shape.chunks has 2 entries");
  CHECK_THROWS_WITH(dflop::pipeline_program(PipelineOrder::ZeroBubbleH1, {{1, 2}, {1, 2}}, 4),
                    dflop::InvalidArgument, "zb-h1 runs one chunk per stage");
  CHECK_THROWS_WITH(dflop::parse_pipeline_order("zb-h2"), dflop::InvalidArgument,
                    "interleaved-1f1b");
  CHECK(dflop::parse_pipeline_order("Interleaved-1F1B") == PipelineOrder::Interleaved1F1B);
}

// The registry: one entry per PipelineOrder, in order; the names parse back; pipeline_program
// and the memory rule are the entries' generator and rule; pipeline_order_for is the one choice.
TEST_CASE(pipeline_order_registry) {
  const auto& registry = dflop::pipeline_order_registry();
  CHECK_EQ(registry.size(), size_t(4));
  for (size_t i = 0; i < registry.size(); ++i) {
    const dflop::PipelineOrderDef& def = registry[i];
    CHECK_EQ(int(def.kind), int(i));
    CHECK(&dflop::pipeline_order_def(def.kind) == &def);
    CHECK(dflop::parse_pipeline_order(def.name) == def.kind);
    CHECK_EQ(std::string(dflop::pipeline_order_name(def.kind)), std::string(def.name));
    const bool one_chunk =
        def.kind == PipelineOrder::OneFOneB || def.kind == PipelineOrder::ZeroBubbleH1;
    const PipelineShape shape =
        one_chunk ? PipelineShape{{2, 3}, {1, 1}} : PipelineShape{{2, 3}, {1, 2}};
    const PipelineProgram p = dflop::pipeline_program(def.kind, shape, 6);
    for (int64_t s = 0; s < 5; ++s) {
      CHECK(p.actions[size_t(s)] == def.stage_actions(shape, 6, s));
      CHECK_EQ(dflop::peak_in_flight(def.kind, shape, 6, s), def.peak_in_flight(shape, 6, s));
    }
  }
  CHECK_THROWS_WITH(dflop::pipeline_order_def(static_cast<PipelineOrder>(7)),
                    dflop::InvalidArgument, "pipeline order 7 is not a PipelineOrder");
  CHECK_THROWS_WITH(
      dflop::parse_pipeline_order("zb"), dflop::InvalidArgument,
      "pipeline order must be \"1f1b\", \"gpipe\", \"interleaved-1f1b\" or \"zb-h1\", got \"zb\"");
  CHECK_EQ(std::string(dflop::pipeline_order_name(static_cast<PipelineOrder>(7))),
           std::string("unknown"));
  CHECK(dflop::pipeline_order_for(PipelineShape::plain(4)) == PipelineOrder::OneFOneB);
  CHECK(dflop::pipeline_order_for({{2, 3}, {1, 1}}) == PipelineOrder::OneFOneB);
  CHECK(dflop::pipeline_order_for({{2, 3}, {1, 2}}) == PipelineOrder::Interleaved1F1B);
  CHECK(dflop::pipeline_order_for({{3}, {4}}) == PipelineOrder::Interleaved1F1B);
  CHECK_THROWS_WITH(dflop::pipeline_order_for({{2}, {1, 1}}), dflop::InvalidArgument,
                    "shape.chunks has 2 entries");
}

// A validation error carries the stage x time grid with the failing action marked, bounded
// for a large program.
TEST_CASE(validation_error_shows_the_grid) {
  CHECK_EQ(dflop::format_action({1, ActionKind::Forward, 3}), std::string("F1.3"));
  CHECK_EQ(dflop::format_action({12, ActionKind::BackwardWeight, 0}), std::string("W12.0"));
  const PipelineProgram p =
      dflop::pipeline_program(PipelineOrder::OneFOneB, PipelineShape::plain(2), 2);
  CHECK_EQ(dflop::program_grid(p, {{1, 1}}),
           std::string("the program, a row per physical stage and a column per time slot (the "
                       "stage's action index); >X<: the failing action:\n"
                       "slot     0       1       2       3\n"
                       "stage 0  F0.0    F0.1    B0.0    B0.1\n"
                       "stage 1  F1.0    >B1.0<  F1.1    B1.1"));
  PipelineProgram q = p;
  std::swap(q.actions[1][0], q.actions[1][1]);
  CHECK_THROWS_WITH(dflop::validate_program(q), dflop::InvalidArgument,
                    "stage 1, action 0 (B of virtual stage 1, microbatch 0): needs its forward "
                    "before it and no split backward (I / W)\n");
  CHECK_THROWS_WITH(dflop::validate_program(q), dflop::InvalidArgument, "stage 1  >B1.0<  F1.0");
  // A deadlock marks every waiting stage's next action.
  q = p;
  deadlocked(q);
  CHECK_THROWS_WITH(dflop::validate_program(q), dflop::InvalidArgument,
                    "stage 0  F0.0    >B0.0<  F0.1");
  CHECK_THROWS_WITH(dflop::validate_program(q), dflop::InvalidArgument, "stage 1  >F1.1<  F1.0");
  // 40 stages x 120 actions, broken at stage 30, action 61: a window of 16 x 12 around it.
  PipelineProgram big =
      dflop::pipeline_program(PipelineOrder::OneFOneB, PipelineShape::plain(40), 60);
  big.actions[30][61].microbatch = 99;
  std::string message;
  try {
    dflop::validate_program(big);
  } catch (const dflop::InvalidArgument& e) {
    message = e.what();
  }
  CHECK(message.find("stage 30, action 61") == 0);
  CHECK(message.find(">" + dflop::format_action(big.actions[30][61]) + "<") != std::string::npos);
  CHECK(message.find("(stages 0 to 21 not shown)") != std::string::npos);
  CHECK(message.find("(stages 38 to 39 not shown)") != std::string::npos);
  CHECK(message.find("stage 37") != std::string::npos);
  CHECK(message.find("stage 21 ") == std::string::npos);
  CHECK(message.find("slot      ...  55") != std::string::npos);
  CHECK(message.find("... (53 more)") != std::string::npos);
  CHECK(message.size() < 3000);
}

dflop::PipelineSimInput uniform_input(PipelineOrder kind, const PipelineShape& shape, int64_t m,
                                      double forward_s, double backward_s) {
  dflop::PipelineSimInput in;
  in.order = kind;
  in.shape = shape;
  in.num_stages = dflop::num_physical_stages(shape);
  in.num_microbatches = m;
  const int64_t V = dflop::num_virtual_stages(shape);
  in.forward_s.assign(size_t(V * m), forward_s);
  in.backward_s.assign(size_t(V * m), backward_s);
  in.link_latency_s.assign(size_t(V - 1), 0.0);
  in.link_bandwidth_bytes_per_s.assign(size_t(V - 1), 1e300);
  return in;
}

TEST_CASE(interleaving_shrinks_the_bubble) {
  // P = 4 stages, m = 8 microbatches, a stage's work per microbatch 3 s (forward 1 s,
  // backward 2 s). 1F1B: (m + P - 1) x 3 = 33 s. Interleaved with v = 2 chunks of half
  // the work each: the bubble shrinks to (P - 1) / v: (m + 1.5) x 3 = 28.5 s.
  const auto plain = uniform_input(PipelineOrder::OneFOneB, PipelineShape::plain(4), 8, 1.0, 2.0);
  CHECK_NEAR(dflop::simulate_pipeline(plain).step_time_s, 33.0, 1e-9);
  const auto inter = uniform_input(PipelineOrder::Interleaved1F1B, {{4}, {2}}, 8, 0.5, 1.0);
  const auto res = dflop::simulate_pipeline(inter);
  CHECK_NEAR(res.step_time_s, 28.5, 1e-9);
  for (double busy : res.busy_s) CHECK_NEAR(busy, 24.0, 1e-9);
  // Sends from the last stage to the first (the wrap to chunk 1) are events too.
  int wraps = 0;
  for (const auto& e : res.events) {
    if (e.kind == dflop::EventKind::Send && e.stage == 3 && e.peer_stage == 0) ++wraps;
  }
  CHECK_EQ(wraps, 8);
}

TEST_CASE(split_backward_program) {
  // A zero-bubble-style program: the input gradient goes back at once, the weight
  // gradients run at the end. Forward 1 s, backward 2 s split 1 + 1.
  dflop::PipelineSimInput in =
      uniform_input(PipelineOrder::OneFOneB, PipelineShape::plain(2), 2, 1.0, 2.0);
  using K = ActionKind;
  in.actions = {{{0, K::Forward, 0},
                 {0, K::Forward, 1},
                 {0, K::BackwardInput, 0},
                 {0, K::BackwardInput, 1},
                 {0, K::BackwardWeight, 0},
                 {0, K::BackwardWeight, 1}},
                {{1, K::Forward, 0},
                 {1, K::BackwardInput, 0},
                 {1, K::Forward, 1},
                 {1, K::BackwardInput, 1},
                 {1, K::BackwardWeight, 0},
                 {1, K::BackwardWeight, 1}}};
  const auto res = dflop::simulate_pipeline(in);
  // Stage 1: F0 1-2, I0 2-3, F1 3-4, I1 4-5, W0 5-6, W1 6-7. Stage 0: F0 0-1, F1 1-2,
  // I0 3-4 (waits for stage 1's I0), I1 5-6, W0 6-7, W1 7-8.
  CHECK_NEAR(res.step_time_s, 8.0, 1e-9);
  CHECK_NEAR(res.busy_s[0], 6.0, 1e-9);
  in.actions[1].pop_back();
  CHECK_THROWS_WITH(dflop::simulate_pipeline(in), dflop::InvalidArgument,
                    "virtual stage 1, microbatch 1 lacks its forward and backward");
}

TEST_CASE(zero_bubble_h1) {
  // Stage 1 of 4, 6 microbatches: 1F1B's two warm-up forwards, then F, I and (one
  // microbatch behind) W, then the cool-down's I passes each followed by the oldest W.
  CHECK_EQ(text(dflop::pipeline_actions(PipelineOrder::ZeroBubbleH1, 4, 6, 1)),
           std::string("F1.0 F1.1 F1.2 I1.0 F1.3 I1.1 W1.0 F1.4 I1.2 W1.1 F1.5 I1.3 W1.2 "
                       "I1.4 W1.3 I1.5 W1.4 W1.5"));
  CHECK_EQ(text(dflop::pipeline_actions(PipelineOrder::ZeroBubbleH1, 4, 6, 3)),
           std::string("F3.0 I3.0 F3.1 I3.1 F3.2 I3.2 F3.3 I3.3 W3.0 F3.4 I3.4 W3.1 F3.5 I3.5 "
                       "W3.2 W3.3 W3.4 W3.5"));
  // Every stage holds min(S, m): 4 (1F1B: 4, 3, 2, 1).
  for (int64_t s = 0; s < 4; ++s) {
    CHECK_EQ(dflop::peak_in_flight(PipelineOrder::ZeroBubbleH1, PipelineShape::plain(4), 6, s),
             int64_t(4));
  }
  // Stage s keeps s + 1 microbatches' W inputs at once (its W lags s behind its I, as the
  // lists above show); none under an order that does not split its backwards.
  for (int64_t s = 0; s < 4; ++s) {
    const PipelineShape shape = PipelineShape::plain(4);
    CHECK_EQ(dflop::peak_pending_weight(PipelineOrder::ZeroBubbleH1, shape, 6, s), s + 1);
    // With 2 microbatches (stages 0-1: I0 W0 I1 W1; stages 2-3: both I before a W).
    CHECK_EQ(dflop::peak_pending_weight(PipelineOrder::ZeroBubbleH1, shape, 2, s),
             int64_t(s >= 2 ? 2 : 1));
    CHECK_EQ(dflop::peak_pending_weight(PipelineOrder::OneFOneB, shape, 6, s), int64_t(0));
  }
  CHECK_THROWS_WITH(
      dflop::peak_pending_weight(PipelineOrder::ZeroBubbleH1, PipelineShape::plain(4), 6, 4),
      dflop::InvalidArgument, "stage must be in [0, 4), got 4");
  // F = I = W = 1 s, 4 stages, 8 microbatches: 1F1B takes (m + S - 1) x 3 = 33 s, ZB-H1
  // 3 m + (S - 1) = 27 s (a third of the bubble), over an encoder segment too.
  for (const PipelineShape& shape : {PipelineShape::plain(4), PipelineShape{{1, 3}, {1, 1}}}) {
    auto in = uniform_input(PipelineOrder::ZeroBubbleH1, shape, 8, 1.0, 2.0);
    const auto res = dflop::simulate_pipeline(in);
    CHECK_NEAR(res.step_time_s, 27.0, 1e-9);
    for (double busy : res.busy_s) CHECK_NEAR(busy, 24.0, 1e-9);
    in.order = PipelineOrder::OneFOneB;
    CHECK_NEAR(dflop::simulate_pipeline(in).step_time_s, 33.0, 1e-9);
  }
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
