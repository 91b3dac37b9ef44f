"""Type stub of the private native core. Use the dflop package instead."""

from collections.abc import Sequence
from typing import Any

import numpy as np

class InfeasibleError(ValueError): ...

def balance(
    costs: np.ndarray,
    *,
    num_microbatches: int,
    dp_size: int,
    microbatch_dims: Sequence[int],
    capacity: Sequence[float] | None,
    seed: int,
    time_budget_ms: float | None,
    time_limit_s: float | None = None,
    num_limit_dims: int = 0,
    work_budget: int | None = None,
) -> dict[str, Any]: ...
def first_fit_decreasing_bins(resources: np.ndarray, limits: Sequence[float]) -> int: ...
def default_work_budget(num_items: int, num_bins: int, num_dims: int) -> int: ...
def work_budget_for_ms(time_budget_ms: float) -> int: ...

# Pipeline-aware refinement (dflop.pipeline_schedule).
def pipeline_schedule(
    costs: np.ndarray,
    *,
    start_assignment: Sequence[int],
    num_microbatches: int,
    dp_size: int,
    microbatch_dims: Sequence[int],
    stages: Sequence[int],
    forward_fraction: Sequence[float],
    microbatch_constant_s: Sequence[float],
    link_latency_s: float,
    capacity: Sequence[float] | None,
    max_growth: float,
    seed: int,
    time_budget_ms: float | None,
    time_limit_s: float | None,
    replicas: Sequence[int] = ...,
    units: Sequence[int] = ...,
    chunks: Sequence[int] = ...,
    backward_from_stage: Sequence[int] = ...,
    backward_gate: Sequence[int] = ...,
    order: str = "",
    weight_fraction: Sequence[float] = ...,
    last_stage_weight_extra: Sequence[float] = ...,
) -> dict[str, Any]: ...
def simulated_step_time(
    costs: np.ndarray,
    *,
    assignment: Sequence[int],
    num_microbatches: int,
    dp_size: int,
    microbatch_dims: Sequence[int],
    stages: Sequence[int],
    forward_fraction: Sequence[float],
    microbatch_constant_s: Sequence[float],
    link_latency_s: float,
    replicas: Sequence[int] = ...,
    units: Sequence[int] = ...,
    chunks: Sequence[int] = ...,
    backward_from_stage: Sequence[int] = ...,
    backward_gate: Sequence[int] = ...,
    order: str = "",
    weight_fraction: Sequence[float] = ...,
    last_stage_weight_extra: Sequence[float] = ...,
) -> float: ...
def pipeline_work_budget_for_ms(time_budget_ms: float) -> int: ...

# Pipeline simulator (dflop.simulator).
def simulate_pipeline(
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    order: str,
    link_latency_s: np.ndarray,
    link_bandwidth_bytes_per_s: np.ndarray,
    activation_bytes: np.ndarray | None,
    allreduce_s: np.ndarray | None,
    record_events: bool = True,
    stages: list[int] = ...,
    chunks: list[int] = ...,
    actions: list[np.ndarray] | None = None,
    weight_grad_fraction: float = 0.5,
    gradient_links: np.ndarray | None = None,
    weight_s: np.ndarray | None = None,
) -> dict[str, Any]: ...
def pipeline_program(
    order: str, stages: list[int], chunks: list[int], num_microbatches: int
) -> tuple[list[int], list[np.ndarray]]: ...
def validate_program(
    owner: list[int], actions: list[np.ndarray], num_microbatches: int
) -> None: ...
def peak_in_flight(
    order: str, stages: list[int], chunks: list[int], num_microbatches: int, stage: int
) -> int: ...
def pipeline_order_names() -> list[str]: ...
def pipeline_order_for(stages: list[int], chunks: list[int]) -> str: ...
def program_grid(
    owner: list[int],
    actions: list[np.ndarray],
    num_microbatches: int,
    marks: list[tuple[int, int]],
) -> str: ...

# Planner (dflop.planner): dicts of numbers in, dicts out; see cpp/include/dflop/planner.hpp.
def plan_layouts(
    cluster: dict[str, Any],
    encoder: dict[str, Any],
    llm: dict[str, Any],
    samples: dict[str, Any],
    options: dict[str, Any],
) -> dict[str, Any]: ...
def evaluate_layout(
    cluster: dict[str, Any],
    encoder: dict[str, Any],
    llm: dict[str, Any],
    samples: dict[str, Any],
    options: dict[str, Any],
    layout: dict[str, Any],
    assignments: list[np.ndarray] | None = None,
) -> dict[str, Any]: ...
def build_step(
    cluster: dict[str, Any],
    encoder: dict[str, Any],
    llm: dict[str, Any],
    samples: dict[str, Any],
    options: dict[str, Any],
    layout: dict[str, Any],
    batch: int,
) -> dict[str, Any]: ...
def step_from_assignment(
    cluster: dict[str, Any],
    encoder: dict[str, Any],
    llm: dict[str, Any],
    samples: dict[str, Any],
    options: dict[str, Any],
    layout: dict[str, Any],
    batch: int,
    assignment: np.ndarray,
) -> dict[str, Any]: ...
def stage_costs(
    cluster: dict[str, Any],
    encoder: dict[str, Any],
    llm: dict[str, Any],
    samples: dict[str, Any],
    options: dict[str, Any],
    layout: dict[str, Any],
    batch: int,
) -> dict[str, Any]: ...
def split_layers(
    num_layers: int,
    num_stages: int,
    per_layer: float,
    first_stage_extra: float,
    last_stage_extra: float,
    balanced: bool,
) -> list[int]: ...
def default_microbatch_choices(max_microbatches: int) -> list[int]: ...

# Inter-model routing (dflop.runtime.routing).
def plan_routing(
    src_replica: np.ndarray,
    dst_replica: np.ndarray,
    rows: np.ndarray,
    num_src: int,
    num_dst: int,
) -> dict[str, np.ndarray]: ...
def split_units(
    units: np.ndarray, costs: np.ndarray, num_replicas: int, granularity: str = "unit"
) -> dict[str, Any]: ...

# Pack / unpack indices of the bridge (dflop.runtime.rows).
def check_row_index(index: np.ndarray, rows: int, *, unique: bool, name: str) -> None: ...
