"""Data-aware 3D-parallelism planner: ``dflop.planner.plan()``.

Given a performance model (anything with ``.costs(shapes) -> (N, 2)`` seconds of the
whole encoder / whole LLM on one GPU and ``.microbatch_constant_s``), a shape
distribution (anything with ``.sample(n, seed) -> SampleShapes``; default: the embedded
synthetic mix), the model configs, a :class:`ClusterSpec` and the global batch size, the
planner searches disjoint GPU sets for the encoder and the LLM, a (tp, pp, dp) for each,
the layer split and the number of microbatches, and scores every candidate by simulating
steps on sampled global batches, each balanced by the scheduler's C++ core and run
through the pipeline simulator. The result is a :class:`Plan` (JSON, versioned) with the
best layouts, a predicted step-time breakdown and the data-blind Megatron-LM-style
baseline. The cost and memory models are documented in ``cpp/include/dflop/planner.hpp``
and summarised in :mod:`dflop.planner.model`.
"""

from dflop._deprecated import attribute_aliases
from dflop.planner.inputs import PlannerInputs, prepare_inputs
from dflop.planner.model import (
    ClusterSpec,
    PlannerConfig,
    PlannerModule,
    full_training_forward_fraction,
    planner_modules,
    regime_forward_fraction,
    with_trainable,
)
from dflop.planner.result import (
    PLAN_FORMAT,
    PLAN_VERSION,
    LayoutPlan,
    ModulePlan,
    Plan,
    StepPrediction,
)
from dflop.planner.search import (
    InfeasibleClusterError,
    audited,
    choose_layouts,
    evaluate_layout,
    plan,
    runtime_scored,
    search_layouts,
    simulate_layout,
)
from dflop.planner.steps import StepAudit, StepPredictor

# Renamed (docs/concepts.md › Glossary): ModuleSpec read like the models' ModelSpec.
__getattr__ = attribute_aliases(
    __name__,
    {"ModuleSpec": "PlannerModule", "module_specs": "planner_modules"},
    lambda new: globals()[new],
)

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "ClusterSpec",
    "InfeasibleClusterError",
    "LayoutPlan",
    "ModulePlan",
    "PlannerModule",
    "Plan",
    "PlannerConfig",
    "PlannerInputs",
    "StepAudit",
    "StepPrediction",
    "StepPredictor",
    "audited",
    "choose_layouts",
    "evaluate_layout",
    "full_training_forward_fraction",
    "planner_modules",
    "plan",
    "prepare_inputs",
    "regime_forward_fraction",
    "search_layouts",
    "runtime_scored",
    "simulate_layout",
    "with_trainable",
]
