"""What is left of a planned step's idle time, lever by lever (bench_plan's levers table).

- :func:`finer_encoder_step`: an optimistic bound on decoupled encoder microbatches (issue
  29, lever 2): each LLM microbatch's encoder work split into ``factor`` encoder
  microbatches that the encoder runs one after another and the bridge delivers as they
  finish; the LLM microbatch starts when its last part arrives, and the encoder's
  backward of each part needs that LLM microbatch's gradient. Simulated by dflop's own
  simulator on the step the planner recorded (:class:`dflop.planner.StepAudit`) with the
  program expanded: every encoder action of microbatch k becomes ``factor`` actions on
  ``factor * k + i``, each a ``1 / factor`` share of the work and the bytes; every LLM
  action keeps microbatch k's times on ``factor * k + factor - 1`` and runs zero-second
  actions on the others (forwards before it, backwards after it, so that the encoder's
  backward of a part waits for microbatch k's gradient). Optimistic: no extra per-pass
  constant and a perfect split of the units. ``factor=1`` reproduces the recorded step.
- :func:`limits`: the layout's lower bound, its busiest GPU's compute and all-reduce, and
  its mean GPU compute (the step at zero idle).
"""

from __future__ import annotations

import numpy as np
from dflop.planner import LayoutPlan, StepAudit
from dflop.scheduling.actions import (
    PipelineAction,
    PipelineProgram,
    pipeline_order_for,
    pipeline_program,
)
from dflop.simulator import simulate_pipeline


def _regrouped_actions(program: PipelineProgram, encoder_stages: int, factor: int):
    lists = []
    for stage, actions in enumerate(program.actions):
        out: list[PipelineAction] = []
        for a in actions:
            parts = [factor * a.microbatch + i for i in range(factor)]
            if stage >= encoder_stages and not a.is_forward:
                parts = parts[-1:] + parts[:-1]  # the real backward first, then the empty ones
            out += [PipelineAction(a.stage, a.kind, k) for k in parts]
        lists.append(tuple(out))
    return PipelineProgram(factor * program.num_microbatches, program.owner, tuple(lists))


def _regrouped(values: np.ndarray, encoder_cells: int, factor: int) -> np.ndarray:
    """(R, X, m) -> (R, X, factor m): the first ``encoder_cells`` rows shared evenly over
    the parts, the rest on each group's last part."""
    r, x, m = values.shape
    out = np.zeros((r, x, factor * m))
    for i in range(factor):
        out[:, :encoder_cells, i::factor] = values[:, :encoder_cells, :] / factor
    out[:, encoder_cells:, factor - 1 :: factor] = values[:, encoder_cells:, :]
    return out


def finer_encoder_step(audit: StepAudit, factor: int) -> float:
    """Simulated step seconds of ``audit``'s step with each LLM microbatch's encoder work
    run as ``factor`` encoder microbatches (see the module docstring)."""
    forward, backward = audit.simulator_input()
    replicas, virtual, m = forward.shape
    encoder = audit.num_encoder_stages
    llm_stages = audit.llm_forward_s.shape[1] // audit.llm_chunks
    stages, chunks = [encoder, llm_stages], [1, audit.llm_chunks]
    base = pipeline_program(
        audit.order or pipeline_order_for((stages, chunks)), stages, m, chunks=chunks
    )
    links = virtual - 1
    weight = audit.weight_s.reshape(replicas, virtual, m) if audit.weight_s.size else None
    bytes_ = audit.activation_bytes.reshape(replicas, links, m)
    return simulate_pipeline(
        _regrouped(forward, encoder, factor),
        _regrouped(backward, encoder, factor),
        program=_regrouped_actions(base, encoder, factor),
        stages=stages,
        chunks=chunks,
        weight_s=None if weight is None else _regrouped(weight, encoder, factor),
        link_latency_s=audit.link_latency_s.reshape(links),
        # Boundary encoder - 1 carries each part's features: shared like the encoder's cells.
        activation_bytes=_regrouped(bytes_, encoder, factor),
        link_bandwidth_bytes_per_s=audit.link_bandwidth_bytes_per_s.reshape(links),
        allreduce_s=audit.allreduce_s,
        gradient_links=audit.gradient_links if audit.gradient_links.size else None,
        record_events=False,
    ).step_time_s


def best_finer_encoder(layout: LayoutPlan, factors=(2, 4, 8)) -> tuple[float, int]:
    """(mean step seconds, factor) of the best ``factor`` over the layout's recorded steps.
    Checks first that ``factor=1`` reproduces them (the expansion is the identity there)."""
    recorded = np.mean([a.step_time_s for a in layout.steps])
    same = np.mean([finer_encoder_step(a, 1) for a in layout.steps])
    if not np.isclose(same, recorded, rtol=1e-9):
        raise AssertionError(f"the regrouped program at factor 1 gives {same}, not {recorded}")
    if not layout.encoder.pp or layout.colocated:
        return float(recorded), 1
    best = (float(recorded), 1)
    for factor in factors:
        step = float(np.mean([finer_encoder_step(a, factor) for a in layout.steps]))
        best = min(best, (step, factor))
    return best


def limits(layout: LayoutPlan) -> dict[str, float]:
    """The layout's lower bound; its busiest stage's compute and that stage's all-reduce
    (seconds per GPU); and the mean GPU compute over all its GPUs (its step at zero idle).
    Stage compute is the prediction's mean over replicas and sampled batches."""
    p = layout.prediction
    encoder = 0 if layout.colocated else layout.encoder.pp
    gpus = [layout.encoder.tp * layout.encoder.dp] * encoder
    gpus += [layout.llm.tp * layout.llm.dp] * (len(p.stage_compute_s) - encoder)
    compute = np.asarray(p.stage_compute_s)
    busiest = int(compute.argmax())
    return {
        "lower_bound_s": p.lower_bound_s,
        "busiest_compute_s": float(compute[busiest]),
        "busiest_allreduce_s": float(p.stage_allreduce_s[busiest]),
        "mean_compute_s": float((compute * np.asarray(gpus)).sum() / sum(gpus)),
    }
