"""The planner's inputs, shared by the search (:mod:`dflop.planner.search`) and the step model
(:mod:`dflop.planner.steps`): the sampled global batches priced by a cost model
(:class:`PlannerInputs`, :func:`prepare_inputs`, :func:`single_batch_inputs`), the native
core's options for a :class:`~dflop.planner.model.PlannerConfig` (:func:`core_options`) and
the per-sample record of one batch an audit keeps (:func:`sample_record`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflop import _core
from dflop.data.costs import EncoderConfig, LLMConfig, SampleCostModel
from dflop.data.shapes import SampleShapes
from dflop.errors import InputTypeError
from dflop.planner.model import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    PlannerConfig,
    PlannerModule,
    lora_params_per_layer,
    planner_modules,
    with_trainable,
)

__all__ = [
    "PlannerInputs",
    "core_options",
    "prepare_inputs",
    "sample_record",
    "single_batch_inputs",
]


class _SyntheticShapes:
    """The embedded synthetic mix as a distribution: ``sample(n, seed)`` draws fresh shapes."""

    def __init__(self, family: str) -> None:
        self.family = family

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        from dflop.data.synthetic import synthetic_shapes

        return synthetic_shapes(num_samples, seed=seed, family=self.family)


class _Bootstrap:
    """A fixed SampleShapes as a distribution (uniform draws with replacement)."""

    def __init__(self, shapes: SampleShapes) -> None:
        if len(shapes) == 0:
            raise ValueError("shapes is empty: nothing to sample batches from")
        self.shapes = shapes

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        rng = np.random.default_rng(seed)
        return self.shapes.take(rng.integers(0, len(self.shapes), size=num_samples))


@dataclass(frozen=True)
class PlannerInputs:
    """Everything the native search reads: module specs and the sampled batches."""

    encoder: PlannerModule
    llm: PlannerModule
    samples: dict[str, Any]
    """Columns of ``num_batches x global_batch`` samples (see the core's PlannerSamples)."""
    global_batch: int
    num_batches: int

    @property
    def forward_fraction(self) -> tuple[float, float]:
        """The (encoder, LLM) forward shares of full training these inputs price."""
        return (self.encoder.forward_fraction, self.llm.forward_fraction)


def _last_stage_fractions(
    shapes: SampleShapes,
    encoder: EncoderConfig,
    llm: LLMConfig,
    llm_costs: np.ndarray,
    head_costs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample share of each module's time that runs on its last stage only: the
    projector's share of the encoder's FLOPs; the LM head's of the LLM's cost, as the cost
    model prices it (the head on the sample's target tokens)."""
    enc_total = encoder.forward_flops(shapes.encoder_units, shapes.tokens_per_unit, llm.hidden_size)
    p_in = float(encoder.projector_input_size or encoder.hidden_size)
    p_hid = float(encoder.projector_hidden_size or llm.hidden_size)
    projector = (
        shapes.encoder_tokens.astype(np.float64)
        * encoder.projector_token_ratio
        * 2.0
        * (p_in * p_hid + p_hid * llm.hidden_size)
    )
    enc_fraction = np.divide(
        projector, enc_total, out=np.zeros_like(enc_total), where=enc_total > 0
    )
    llm_fraction = np.divide(
        head_costs, llm_costs, out=np.zeros_like(llm_costs), where=llm_costs > 0
    )
    return np.clip(enc_fraction, 0.0, 1.0), np.clip(llm_fraction, 0.0, 1.0)


def _as_distribution(shapes: Any, family: str) -> Any:
    if shapes is None or (isinstance(shapes, str) and shapes == "synthetic"):
        return _SyntheticShapes(family)
    if isinstance(shapes, SampleShapes):
        return _Bootstrap(shapes)
    if not callable(getattr(shapes, "sample", None)):
        raise InputTypeError(
            "shapes must be None/'synthetic', a SampleShapes, or have .sample(n, seed) or "
            ".shapes(step), got "
            f"{type(shapes).__name__}"
        )
    return shapes


def _batches(
    shapes: Any, family: str, global_batch: int, num_batches: int, seed: int
) -> list[SampleShapes]:
    """The planner's global batches: steps 0 .. num_batches - 1 of a run's own steps
    (``shapes.shapes(step)``), else draws from the distribution (batch b with seed
    ``seed + b``)."""
    steps = getattr(shapes, "shapes", None)
    if not isinstance(shapes, SampleShapes) and callable(steps):
        batches = [steps(b) for b in range(num_batches)]
        for b, batch in enumerate(batches):
            if not isinstance(batch, SampleShapes) or len(batch) != global_batch:
                got = len(batch) if isinstance(batch, SampleShapes) else type(batch).__name__
                raise ValueError(
                    f"shapes.shapes({b}) gave {got}, expected a SampleShapes of global_batch="
                    f"{global_batch} samples"
                )
        return batches
    distribution = _as_distribution(shapes, family)
    return [distribution.sample(global_batch, seed=seed + b) for b in range(num_batches)]


def prepare_inputs(
    performance_model: SampleCostModel,
    encoder: EncoderConfig,
    llm: LLMConfig,
    *,
    global_batch: int,
    shapes: Any = None,
    num_batches: int = 4,
    seed: int = 0,
    forward_fraction: tuple[float, float] | None = None,
    element_bytes: int = 2,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    trainable: str = "full",
    lora_rank: int = 16,
) -> PlannerInputs:
    """Sample ``num_batches`` global batches (batch b with seed ``seed + b``; of a run's
    steps, see :func:`plan`: step b) and compute their per-sample costs with
    ``performance_model``; ``forward_fraction`` (encoder, LLM) is the modules' forward
    share of a stage's time under full training (None: the profiler's measured one where
    the performance model has it, else 1/3); ``element_bytes``,
    ``loss_chunk_tokens``, ``trainable`` and ``lora_rank`` are the training's precision,
    chunked loss and regime (:class:`PlannerConfig`)."""
    if not isinstance(encoder, EncoderConfig):
        raise InputTypeError(f"encoder must be an EncoderConfig, got {type(encoder).__name__}")
    if not isinstance(llm, LLMConfig):
        raise InputTypeError(f"llm must be an LLMConfig, got {type(llm).__name__}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)):
        raise InputTypeError(f"global_batch must be an int, got {type(global_batch).__name__}")
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch} must be >= 1")
    missing = [
        name
        for name in (
            "costs",
            "head_costs",
            "microbatch_constant_s",
            "activation_bytes_per_token_layer",
        )
        if not hasattr(performance_model, name)
    ]
    if missing:
        raise InputTypeError(
            "performance_model must be a SampleCostModel (.costs(shapes), "
            ".head_costs(shapes), .microbatch_constant_s, "
            ".activation_bytes_per_token_layer(encoder, llm)); "
            f"{type(performance_model).__name__} lacks {', '.join(missing)}"
        )
    batch = SampleShapes.concat(
        _batches(shapes, encoder.default_family, int(global_batch), int(num_batches), int(seed))
    )
    if len(batch) != num_batches * global_batch:
        raise ValueError(
            f"the distribution returned {len(batch)} samples for {num_batches} batches of "
            f"{global_batch}"
        )
    return _inputs(
        performance_model,
        encoder,
        llm,
        batch,
        int(num_batches),
        int(global_batch),
        forward_fraction,
        element_bytes,
        loss_chunk_tokens,
        trainable,
        lora_rank,
    )


def single_batch_inputs(
    performance_model: SampleCostModel,
    encoder: EncoderConfig,
    llm: LLMConfig,
    shapes: SampleShapes,
    forward_fraction: tuple[float, float] | None = None,
    element_bytes: int = 2,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    trainable: str = "full",
    lora_rank: int = 16,
) -> PlannerInputs:
    """The planner's inputs for one given global batch (what the trainer runs)."""
    return _inputs(
        performance_model,
        encoder,
        llm,
        shapes,
        1,
        len(shapes),
        forward_fraction,
        element_bytes,
        loss_chunk_tokens,
        trainable,
        lora_rank,
    )


def _inputs(
    performance_model: SampleCostModel,
    encoder: EncoderConfig,
    llm: LLMConfig,
    batch: SampleShapes,
    num_batches: int,
    global_batch: int,
    forward_fraction: tuple[float, float] | None = None,
    element_bytes: int = 2,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    trainable: str = "full",
    lora_rank: int = 16,
) -> PlannerInputs:
    costs = np.asarray(performance_model.costs(batch), dtype=np.float64)
    if costs.shape != (len(batch), 2):
        raise ValueError(f"performance_model.costs returned shape {costs.shape}, expected (N, 2)")
    head = np.asarray(performance_model.head_costs(batch), dtype=np.float64)
    enc_fraction, llm_fraction = _last_stage_fractions(batch, encoder, llm, costs[:, 1], head)
    enc_spec, llm_spec = planner_modules(
        encoder,
        llm,
        performance_model.microbatch_constant_s,
        element_bytes=element_bytes,
        loss_chunk_tokens=loss_chunk_tokens,
        activation_bytes=performance_model.activation_bytes_per_token_layer(encoder, llm),
    )
    passthrough = getattr(performance_model, "passthrough_factors", None)  # measured
    if forward_fraction is None and passthrough is not None:
        forward_fraction = passthrough.get("forward_fraction")
    if forward_fraction is not None:
        enc_spec = replace(enc_spec, forward_fraction=float(forward_fraction[0]))
        llm_spec = replace(llm_spec, forward_fraction=float(forward_fraction[1]))
    lora = lora_params_per_layer(encoder, llm, lora_rank)
    enc_spec, llm_spec = with_trainable(enc_spec, llm_spec, trainable, passthrough, lora)
    samples = {
        "num_batches": int(num_batches),
        "batch_size": int(global_batch),
        "encoder_s": np.ascontiguousarray(costs[:, 0]),
        "llm_s": np.ascontiguousarray(costs[:, 1]),
        "encoder_last_fraction": enc_fraction,
        "llm_last_fraction": llm_fraction,
        "encoder_tokens": batch.encoder_tokens.astype(np.float64),
        "encoder_units": batch.encoder_units.astype(np.int64),
        "llm_tokens": batch.seq_len.astype(np.float64),
        "visual_tokens": batch.llm_visual_tokens.astype(np.float64),
        "llm_target_tokens": batch.target_tokens.astype(np.float64),
    }
    return PlannerInputs(enc_spec, llm_spec, samples, int(global_batch), int(num_batches))


def core_options(config: PlannerConfig, strategy: str, global_batch: int, top_k: int) -> dict:
    """The native search's options dict for ``config``, a scheduling ``strategy``, the global
    batch and how many layouts to keep."""
    budget = None
    if config.balance_time_budget_ms is not None:
        budget = int(_core.work_budget_for_ms(float(config.balance_time_budget_ms)))
    return {
        "strategy": strategy,
        "global_batch": global_batch,
        "prune": config.prune,
        "top_k": top_k,
        "order_microbatches": config.order_microbatches,
        "zero_bubble": config.zero_bubble,
        "balanced_layer_split": config.balanced_layer_split,
        "zero1": config.zero1,
        "max_tp": config.max_tp or 0,
        "microbatch_choices": list(config.microbatch_choices or []),
        "balance_work_budget": -1 if budget is None else budget,
        "seed": config.seed,
        "num_threads": config.num_threads or 0,
        "encoder_split": config.encoder_split,
        "colocated_candidates": config.colocated_candidates,
        "disaggregated_candidates": config.disaggregated_candidates,
        "screen_factor": config.screen_factor,
        "patience": config.patience,
        "encoder_max_tp": config.encoder_max_tp or 0,
        "encoder_gpu_choices": list(config.encoder_gpus or []),
        "virtual_stage_choices": list(config.virtual_stage_choices),
    }


def sample_record(samples: dict[str, Any], batch: int, size: int) -> dict[str, np.ndarray]:
    """The per-sample inputs of one sampled batch worth keeping in an audit."""
    part = slice(batch * size, (batch + 1) * size)
    return {k: np.asarray(samples[k][part]) for k in ("encoder_units", "encoder_s", "llm_s")}
