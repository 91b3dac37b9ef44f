"""Inputs of the planner: the cluster, the per-module parameters, the search settings.

Cost model (per GPU; the C++ core in ``cpp/include/dflop/planner.hpp`` is the reference):

- The performance model gives each sample's training time (forward + backward) of the
  whole encoder and the whole LLM on one GPU. A per-sample fraction of it runs on the
  module's last stage only (LM head, projector: from the FLOP counts of the configs); the
  rest is spread evenly over the layers. Forward is 1/3 of it, backward 2/3.
- Tensor parallelism t: compute / (t * eff(t)) with ``eff(t) = 1 / (1 + tp_gemm_loss *
  log2 t)``, plus 4 activation all-reduces per layer (Megatron-LM) of ``tokens * hidden *
  2`` bytes at ring cost ``2 (t-1)/t * bytes / intra-node bandwidth``, and their latency
  once per microbatch. t divides gpus_per_node and the module's first rank, so TP groups
  never cross a node.
- Encoder DP replicas share each microbatch by visual unit with the runtime's own split
  (:func:`dflop.runtime.routing.split_units`, the core's ``split_units``): a microbatch's
  encoder stage time is its slowest replica's, its activations the largest replica's
  (``PlannerConfig.encoder_split`` selects whole samples or the unreachable even split
  instead, for ablations).
- Pipeline transfers: ``tokens * hidden * 2 / t`` bytes between stages, ``visual tokens *
  LLM hidden * 2`` bytes from the encoder to the LLM; intra-node bandwidth when both ends
  share a node. Gradient all-reduce per stage: ``2 (dp-1)/dp * 2 bytes * params / t`` over
  the DP group's bandwidth (inter-node when it spans nodes), after the last backward.

Memory model (per GPU of a stage): ``16`` bytes per parameter for Adam (bf16 mixed
precision or fp32; with ZeRO-1, Megatron's distributed optimizer, ``4 + 12 / dp`` and
``8 + 8 / dp``), the layers' and the last stage's parameters over t, the embeddings whole
(replicated, as the runtime's tensor-parallel plans hold them), plus activations of
``min(S - s, m)`` microbatches in flight at stage s of the 1F1B pipeline of S = pp_enc +
pp_llm stages: ``tokens * layers * activation bytes per token and layer / t`` (34 x hidden
in bf16 with FlashAttention and sequence parallelism, Korthikanti et al. 2022, or what the
profiler measured), for the largest bin of the sampled batches, plus on the LLM's last
stage the LM head's working set while a microbatch computes its loss: ``min(targets,
loss_chunk_tokens) x vocab x logit bytes / t`` (the runtime's chunked loss on the target
tokens, :mod:`dflop.models.loss`; vocabulary-parallel); plus ``memory_reserve_bytes``.

Padded heads (colocated layouts): the encoder inside the LLM's first stage runs at the
LLM's tp; where tp does not divide its heads (InternViT-6B: 25), they are padded to a
multiple of tp with dummy heads, as NVLM does in Megatron-LM (25 -> 32 at TP=8). The
padded heads cost like real ones: with ``scale = padded / actual`` heads, the encoder's
per-layer compute, layer parameters and activations grow by ``1 + fraction * (scale - 1)``
with the ``attention_*_fraction`` of :class:`PlannerModule`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from dflop.data.costs import EncoderConfig, LLMConfig
from dflop.errors import InputTypeError
from dflop.models.trainable import TrainableParts

__all__ = [
    "PASSTHROUGH_ACTIVATION_FRACTION",
    "WEIGHT_GRAD_FRACTION",
    "ClusterSpec",
    "PlannerConfig",
    "PlannerModule",
    "full_training_forward_fraction",
    "lora_params_per_layer",
    "planner_modules",
    "regime_forward_fraction",
    "with_trainable",
]

ACTIVATION_BYTES_PER_HIDDEN = 34.0
"""Activation bytes per token, layer and hidden unit (bf16, FlashAttention, SP)."""

DEFAULT_LOSS_CHUNK_TOKENS = 1024
"""The runtime's default chunk of the LM head and loss (``dflop.models.loss``; repeated
here so that the planner imports without torch; a test keeps them equal)."""


def logit_bytes(element_bytes: int) -> float:
    """Bytes per logit the chunked loss holds at its peak (``dflop.models.loss``): the
    chunk's float32 logits (exponentiated in place), plus their copy in the head's dtype
    when that is not float32 (the head's output, then the gradient fed to its GEMMs)."""
    return 4.0 + (0.0 if element_bytes == 4 else float(element_bytes))


def _check_int(cls: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{cls}.{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{cls}.{name}={value} must be >= {minimum}")


def _check_number(cls: str, name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise InputTypeError(f"{cls}.{name}={value!r} must be a number")
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{cls}.{name}={value!r} must be finite and {'>' if positive else '>='} 0")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous GPU cluster.

    Attributes:
        num_gpus: GPUs in total (>= 2: the encoder and the LLM get one each at least).
        gpus_per_node: GPUs per node (tensor parallelism stays inside a node).
        gpu_memory_bytes: memory per GPU.
        intra_node_bandwidth_bytes_per_s: per-GPU NVLink-class bandwidth.
        inter_node_bandwidth_bytes_per_s: per-GPU network bandwidth between nodes.
        link_latency_s: latency of a point-to-point transfer or collective.
        tp_gemm_loss: tensor-parallel GEMM efficiency loss, ``eff(t) = 1 / (1 + loss *
            log2 t)``.
        memory_reserve_bytes: memory per GPU kept free (CUDA context, fragmentation).
    """

    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80e9
    intra_node_bandwidth_bytes_per_s: float = 300e9
    inter_node_bandwidth_bytes_per_s: float = 25e9
    link_latency_s: float = 5e-6
    tp_gemm_loss: float = 0.05
    memory_reserve_bytes: float = 2e9

    def __post_init__(self) -> None:
        _check_int("ClusterSpec", "num_gpus", self.num_gpus, 2)
        _check_int("ClusterSpec", "gpus_per_node", self.gpus_per_node, 1)
        for name in (
            "gpu_memory_bytes",
            "intra_node_bandwidth_bytes_per_s",
            "inter_node_bandwidth_bytes_per_s",
        ):
            _check_number("ClusterSpec", name, getattr(self, name), positive=True)
        for name in ("link_latency_s", "tp_gemm_loss", "memory_reserve_bytes"):
            _check_number("ClusterSpec", name, getattr(self, name), positive=False)
        if self.memory_reserve_bytes >= self.gpu_memory_bytes:
            raise ValueError(
                f"ClusterSpec.memory_reserve_bytes={self.memory_reserve_bytes:g} must be below "
                f"gpu_memory_bytes={self.gpu_memory_bytes:g}"
            )

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterSpec:
        return cls(**data)


WEIGHT_GRAD_FRACTION = 0.5
"""The weight gradients' share of a layer's backward (one of its two GEMMs per weight; the
simulator's ``weight_grad_fraction``): what a frozen layer that passes gradients on skips,
unless the model profiler measured it."""


@dataclass(frozen=True)
class PlannerModule:
    """What the planner needs of one module (encoder + projector, or the LLM).

    Attributes:
        num_layers, num_heads, hidden_size: architecture (tp must divide num_heads).
        params_per_layer: parameters of one layer.
        first_stage_params: parameters only the first stage holds (embeddings).
        last_stage_params: parameters only the last stage holds (LM head, projector).
        activation_bytes_per_token_layer: activation bytes kept per token and layer at
            t = 1 for the backward pass.
        head_bytes_per_target_token: the LLM's last stage: the LM head's working set per
            target row at t = 1 (vocabulary x :func:`logit_bytes`), held while a
            microbatch computes its loss.
        head_chunk_tokens: target rows the runtime's chunked loss computes at a time (0:
            all of a microbatch's at once).
        input_bytes_per_token: the first stage's input per token (the encoder's pixels,
            ``EncoderConfig.input_bytes_per_token``), which the runtime reads for all of a
            step's microbatches before the step starts.
        element_bytes: bytes of a weight, gradient or activation element (2: bf16 mixed
            precision; 4: fp32, what ``dflop train`` runs).
        microbatch_constant_s: per-microbatch constant time of the whole module.
        attention_compute_fraction, attention_param_fraction,
        attention_activation_fraction: shares of the per-layer compute, of
            ``params_per_layer`` and of ``activation_bytes_per_token_layer`` that grow with
            the number of attention heads (used when a colocated encoder's heads are padded
            to a multiple of tp); 1.0 (all of it) unless known.
        forward_fraction: forward share of a stage's forward + backward time when
            everything trains (1/3: the backward costs twice the forward); the trainer
            passes its measured share, converted to full training.
        body_backward_factor, last_backward_factor: the training regime (which parts
            train, :func:`with_trainable`): the share of a full training backward that
            runs on the layers (with the first stage's parameters) and on the last
            stage's part (LM head / projector): 1 trains them, ``1 -``
            :data:`WEIGHT_GRAD_FRACTION` passes gradients through frozen weights, 0 runs
            no backward (then the layers keep no activations).
        body_trainable_fraction, last_trainable_fraction: the shares of those parameters
            that train (hold gradients and optimizer state and are all-reduced).
        kept_activation_fraction: the share of ``activation_bytes_per_token_layer`` the
            layers keep for their backward under the regime (1: trained; frozen layers
            that pass gradients on keep less).
        input_grad_fraction: the input gradient's share of a trained layer's backward
            (the rest, its weight gradients, is what a zero-bubble order's ``W`` runs):
            what a frozen layer that passes gradients on runs, the profile's measured
            pass-through factor, else ``1 -`` :data:`WEIGHT_GRAD_FRACTION`.
        weight_grad_bytes_per_token_layer: what a zero-bubble order's ``I`` pass keeps
            for its ``W`` per token and layer at t = 1 while the layers train: the
            gradient reaching each trained weight's node (a linear layer's output, a
            norm's), as :mod:`dflop.runtime.split_backward` records it.
        weight_grad_sharded_fraction: the share of it tensor parallelism shards (the
            column-parallel outputs; row-parallel outputs and norms are whole per rank).
    """

    num_layers: int
    num_heads: int
    hidden_size: int
    params_per_layer: float
    first_stage_params: float = 0.0
    last_stage_params: float = 0.0
    activation_bytes_per_token_layer: float = 0.0
    head_bytes_per_target_token: float = 0.0
    head_chunk_tokens: int = 0
    element_bytes: int = 2
    input_bytes_per_token: float = 0.0
    microbatch_constant_s: float = 0.0
    attention_compute_fraction: float = 1.0
    attention_param_fraction: float = 1.0
    attention_activation_fraction: float = 1.0
    forward_fraction: float = 1.0 / 3.0
    body_backward_factor: float = 1.0
    last_backward_factor: float = 1.0
    body_trainable_fraction: float = 1.0
    last_trainable_fraction: float = 1.0
    kept_activation_fraction: float = 1.0
    input_grad_fraction: float = 1.0 - WEIGHT_GRAD_FRACTION
    weight_grad_bytes_per_token_layer: float = 0.0
    weight_grad_sharded_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "hidden_size"):
            _check_int("PlannerModule", name, getattr(self, name), 1)
        for name in (
            "params_per_layer",
            "first_stage_params",
            "last_stage_params",
            "activation_bytes_per_token_layer",
            "head_bytes_per_target_token",
            "input_bytes_per_token",
            "microbatch_constant_s",
            "weight_grad_bytes_per_token_layer",
        ):
            _check_number("PlannerModule", name, getattr(self, name), positive=False)
        _check_int("PlannerModule", "head_chunk_tokens", self.head_chunk_tokens, 0)
        _check_int("PlannerModule", "element_bytes", self.element_bytes, 1)
        if self.element_bytes > 8:
            raise ValueError(f"PlannerModule.element_bytes={self.element_bytes} must be <= 8")
        for name in (
            "attention_compute_fraction",
            "attention_param_fraction",
            "attention_activation_fraction",
            "forward_fraction",
            "body_backward_factor",
            "last_backward_factor",
            "body_trainable_fraction",
            "last_trainable_fraction",
            "kept_activation_fraction",
            "input_grad_fraction",
            "weight_grad_sharded_fraction",
        ):
            _check_number("PlannerModule", name, getattr(self, name), positive=False)
            if getattr(self, name) > 1.0:
                raise ValueError(f"PlannerModule.{name}={getattr(self, name)!r} must be <= 1")

    @property
    def forward_share(self) -> float:
        """The forward share of the layers' time under the regime (what a run measures):
        ``forward_fraction`` of full training, over the backward that runs."""
        return _forward_share(self.forward_fraction, self.body_backward_factor)

    @property
    def weight_share(self) -> float:
        """The weight gradients' share of a stage's backward under the regime (what a
        zero-bubble order's ``W`` runs; the layers', else the last stage's part's): of a
        trained part ``1 - input_grad_fraction``, of one passing gradients through frozen
        weights none. A stage whose input takes no gradient runs all of it in ``W``."""

        def share(factor: float) -> float:
            return max(0.0, factor - self.input_grad_fraction) / factor if factor > 0 else 0.0

        if self.body_backward_factor > 0.0:
            return share(self.body_backward_factor)
        return share(self.last_backward_factor)

    @property
    def backward_stages(self) -> str:
        """Which of the module's stages run a backward under the regime: "all", "last"
        (a trained head or projector behind frozen layers) or "none"."""
        if self.body_backward_factor > 0.0:
            return "all"
        return "last" if self.last_backward_factor > 0.0 else "none"

    @property
    def backward_needs_visual(self) -> bool:
        """Whether the module's layers run a backward only to pass gradients back to a
        trained part before it (nothing of its own trains): an LLM under a trained
        projector runs none for a microbatch share without visual rows."""
        return (
            self.body_backward_factor > 0.0
            and self.body_trainable_fraction == 0.0
            and self.last_trainable_fraction == 0.0
        )

    @property
    def num_params(self) -> float:
        return (
            self.params_per_layer * self.num_layers
            + self.first_stage_params
            + (self.last_stage_params)
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def planner_modules(
    encoder: EncoderConfig,
    llm: LLMConfig,
    microbatch_constant_s: Any = (0.0, 0.0),
    *,
    element_bytes: int = 2,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    activation_bytes: tuple[float | None, float | None] = (None, None),
) -> tuple[PlannerModule, PlannerModule]:
    """(encoder, LLM) :class:`PlannerModule` from the configs (parameter counts of a ViT with
    a 2-layer MLP projector and of a GQA/SwiGLU decoder with an untied LM head), for
    training in ``element_bytes`` (2: bf16 mixed precision, 4: fp32) with the runtime's
    chunked loss of ``loss_chunk_tokens`` rows. ``activation_bytes``: measured activation
    bytes per token and layer of (encoder, LLM) (a profile's), used instead of the
    formula (34 x hidden x element_bytes / 2) where given."""
    _check_int("planner_modules", "element_bytes", element_bytes, 1)
    _check_int("planner_modules", "loss_chunk_tokens", loss_chunk_tokens, 0)
    scale = element_bytes / 2.0  # the activation formula counts bf16 bytes
    constants = np.asarray(microbatch_constant_s, dtype=np.float64).reshape(-1)
    if constants.shape != (2,):
        raise ValueError(
            f"microbatch_constant_s must have 2 values (encoder, LLM), got {constants.shape}"
        )
    h = encoder.hidden_size
    p_in = encoder.projector_input_size or h
    p_hid = encoder.projector_hidden_size or llm.hidden_size
    # Head-dependent parts of a ViT layer (for padded heads): per token, the QKV and output
    # projections (8 h^2 FLOPs) and the attention core (4 h t over a tile of t tokens) of
    # 8 h^2 + 4 h I + 4 h t; the QKV / output weights and QKV biases (4 h^2 + 3 h) of the
    # layer's parameters; Q, K, V and the attention output (8 of 34 bytes x h per token).
    t = float(encoder.tokens_per_unit)
    attention_flops = 8.0 * h * h + 4.0 * h * t
    layer_params = float(4 * h * h + 2 * h * encoder.intermediate_size + 9 * h)
    enc = PlannerModule(
        num_layers=encoder.num_layers,
        num_heads=encoder.num_heads,
        hidden_size=h,
        # qkv + out (4 h^2), MLP (2 h I), biases and two norms.
        params_per_layer=layer_params,
        # Patch embedding and (a ViT's, SigLIP's) learned position table.
        first_stage_params=float(
            encoder.pixels_per_token * h + encoder.learned_positions * encoder.tokens_per_unit * h
        ),
        last_stage_params=float(p_in * p_hid + p_hid * llm.hidden_size),
        activation_bytes_per_token_layer=(
            ACTIVATION_BYTES_PER_HIDDEN * h * scale
            if activation_bytes[0] is None
            else float(activation_bytes[0])
        ),
        element_bytes=element_bytes,
        input_bytes_per_token=float(encoder.input_bytes_per_token),
        microbatch_constant_s=float(constants[0]),
        attention_compute_fraction=attention_flops
        / (attention_flops + 4.0 * h * encoder.intermediate_size),
        attention_param_fraction=float(4 * h * h + 3 * h) / layer_params,
        attention_activation_fraction=8.0 / ACTIVATION_BYTES_PER_HIDDEN,
        # q, k, v, fc1 outputs (column-parallel); out, fc2 outputs and two norms (whole).
        **_weight_grads(3 * h + encoder.intermediate_size, 4 * h, element_bytes),
    )
    g = llm.hidden_size
    d = llm.resolved_head_dim
    llm_spec = PlannerModule(
        num_layers=llm.num_layers,
        num_heads=llm.num_heads,
        hidden_size=g,
        params_per_layer=float(
            g * d * (llm.num_heads + 2 * llm.num_kv_heads)
            + llm.num_heads * d * g
            + 3 * g * llm.intermediate_size
            + 2 * g
        ),
        first_stage_params=float(llm.vocab_size * g),
        last_stage_params=float(llm.vocab_size * g),
        activation_bytes_per_token_layer=(
            ACTIVATION_BYTES_PER_HIDDEN * g * scale
            if activation_bytes[1] is None
            else float(activation_bytes[1])
        ),
        head_bytes_per_target_token=logit_bytes(element_bytes) * llm.vocab_size,
        head_chunk_tokens=loss_chunk_tokens,
        element_bytes=element_bytes,
        microbatch_constant_s=float(constants[1]),
        # q, k, v, gate, up outputs (column-parallel); o, down outputs and two norms (whole).
        **_weight_grads(
            d * (llm.num_heads + 2 * llm.num_kv_heads) + 2 * llm.intermediate_size,
            4 * g,
            element_bytes,
        ),
    )
    return enc, llm_spec


def _weight_grads(sharded: int, whole: int, element_bytes: int) -> dict[str, float]:
    """The PlannerModule fields of what a layer's ``I`` pass keeps for its ``W``: per
    token, ``sharded`` elements that tensor parallelism splits and ``whole`` that it does
    not."""
    total = float(sharded + whole)
    return {
        "weight_grad_bytes_per_token_layer": total * element_bytes,
        "weight_grad_sharded_fraction": sharded / total,
    }


PLACEMENTS: tuple[str, ...] = ("any", "disaggregated", "colocated")
"""Where a plan may put the encoder: anywhere, on GPUs of its own, or inside the LLM's
first stage (:func:`placement_candidates`)."""


def placement_candidates(placement: str) -> dict[str, bool]:
    """``PlannerConfig``'s candidate switches for a placement of :data:`PLACEMENTS`."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} must be one of {', '.join(PLACEMENTS)}")
    return {
        "colocated_candidates": placement != "disaggregated",
        "disaggregated_candidates": placement != "colocated",
    }


@dataclass(frozen=True)
class PlannerConfig:
    """Search settings.

    Attributes:
        num_batches: global batches sampled from the distribution and simulated per
            candidate (the score is the mean step time).
        seed: seed of the sampled batches (batch b uses ``seed + b``) and of the balance.
        top_k: layouts kept (with ``zero_bubble``, up to ``top_k`` of each order).
        prune: skip candidates whose lower bound exceeds the k-th best simulated time
            (the result equals exhaustive evaluation).
        order_microbatches: try a few microbatch orders per step and keep the fastest.
        zero_bubble: score the kept layouts and the best others simulated under 1F1B
            (4 x ``top_k``; encoder and LLM disaggregated, one chunk per LLM stage) under
            the zero-bubble order ZB-H1 too, where its lower bound can still win, and run
            it where it is faster and fits in memory (the gradients ``W`` waits for
            included); its W share of each backward comes from the modules'
            ``input_grad_fraction``. The result keeps the 1F1B ``top_k`` too, so a plan
            with it is never slower than one without. Off by default: the split backward
            costs the runtime a walk of each step's autograd graph, which the model does
            not price (small next to GPU layers, not next to tiny CPU ones).
        balanced_layer_split: split layers to balance stages (the LM head / projector on
            the last stage counts); False: uniform split.
        zero1: shard the optimizer states over DP (Megatron's distributed optimizer).
        max_tp: largest tensor-parallel degree (None: gpus_per_node).
        microbatch_choices: microbatch counts to try (None: 1, 2, 3, 4, 6, 8, 12, ...).
        balance_time_budget_ms: scheduler effort per balance (None: default by size).
        baseline: also search the data-blind Megatron-LM-style baseline.
        reference: also run the reference's mean-shape optimizer.
        num_threads: threads that evaluate candidates (None: one per hardware thread); the
            result and the search statistics do not depend on it.
        encoder_split: how encoder DP replicas share a microbatch in the model: "unit"
            (the runtime's split by visual unit), "sample" (whole samples) or "even" (each
            replica a dp-th of the microbatch's load: an idealisation no runtime reaches).
            The last two are ablations: plans for training use "unit".
        forward_fraction: the forward share of a stage's time under full training,
            (encoder, LLM); None: what the model profiler measured
            (``PerformanceModel.forward_fraction``), else 1/3 by the FLOP count; a
            calibration run (``dflop plan --local``) measures it too.
        screen_factor: prune also by this fraction of a schedule-free estimate of the step
            (0: lower bounds only: the result equals the exhaustive search).
        patience: stop the pruned search once this many candidates in a row (more for
            batches under 2,048 samples) were scheduled without improving the k-th best
            (0: none); Plan.stats reports ``stopped_by_patience`` and ``num_unexplored``.
        encoder_max_tp: the encoder's largest tp (None: max_tp).
        encoder_gpus: allowed encoder GPU counts of disaggregated layouts (None: any),
            e.g. to compare ratios or to fit a deployment.
        runtime_schedule: score the kept layouts (``top_k``) with the schedules dflop's
            trainer computes for its steps (``dflop.pipeline_schedule``) and re-rank them,
            so that a plan predicts what the runtime executes; the search itself ranks
            candidates with the cheaper balanced schedule and microbatch orders.
        element_bytes: bytes of a weight, gradient or activation element: 2 (bf16 mixed
            precision, the GPU clusters the planner plans for) or 4 (fp32: what ``dflop
            train`` runs; its local plans say so).
        loss_chunk_tokens: the runtime's chunked loss: target rows per chunk of the LM
            head (``TrainConfig.loss_chunk_tokens``), which bounds its logits memory.
        virtual_stage_choices: the LLM's model chunks per stage to try (1: 1F1B; v > 1:
            interleaved 1F1B with v virtual stages per stage, where llm pp >= 2, pp x v <=
            the LLM's layers and the microbatch count is a multiple of pp). Must hold 1.
            With more than ``(1,)`` the 1F1B-only search's top_k is re-scored too, so
            allowing interleaving never loses that plan (its search ranks interleaved
            layouts with the balanced schedule, which flatters them against what the
            trainer's scheduler makes of them). Default ``(1,)`` (off): measured, it wins
            about 2% where few microbatches feed a deep LLM pipeline and nothing in the
            paper's settings, for up to twice the planning time (bench_plan).
        colocated_candidates: also score colocated layouts (the encoder inside the first
            LLM stage, Megatron-style; dflop's runtime runs them as
            ``RuntimeLayout(colocated=True)``) with dflop's balanced schedule, so that the
            data-blind baseline's own placement is always a candidate. Only those whose
            TP degree divides the encoder's heads (the runtime does not pad them).
        disaggregated_candidates: score layouts with the encoder on GPUs of its own (off
            with ``colocated_candidates`` on: the colocated placement only).
        trainable: which parts train (a :class:`~dflop.models.trainable.TrainableParts`
            preset such as ``"frozen-vision"``, or ``"encoder=frozen,..."``); the plan
            prices what that regime runs and holds (:func:`with_trainable`).
        lora_rank: the LoRA adapters' rank of a regime with ``lora`` parts (their
            parameters, :func:`lora_params_per_layer`).
    """

    num_batches: int = 4
    seed: int = 0
    top_k: int = 5
    prune: bool = True
    order_microbatches: bool = True
    zero_bubble: bool = False
    balanced_layer_split: bool = True
    zero1: bool = True
    max_tp: int | None = None
    microbatch_choices: tuple[int, ...] | None = None
    balance_time_budget_ms: float | None = None
    baseline: bool = True
    reference: bool = False
    num_threads: int | None = None
    encoder_split: str = "unit"
    colocated_candidates: bool = True
    disaggregated_candidates: bool = True
    screen_factor: float = 0.9
    patience: int = 1000
    encoder_max_tp: int | None = None
    encoder_gpus: tuple[int, ...] | None = None
    runtime_schedule: bool = True
    forward_fraction: tuple[float, float] | None = None
    virtual_stage_choices: tuple[int, ...] = (1,)
    element_bytes: int = 2
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
    trainable: str = "full"
    lora_rank: int = 16

    def __post_init__(self) -> None:
        try:
            parts = TrainableParts.parse(self.trainable)
        except (TypeError, ValueError) as e:
            raise ValueError(f"PlannerConfig.trainable: {e}") from None
        object.__setattr__(self, "trainable", str(parts))
        if not (self.colocated_candidates or self.disaggregated_candidates):
            raise ValueError(
                "PlannerConfig.colocated_candidates and disaggregated_candidates are both "
                "False: no layout would be a candidate; turn one on"
            )
        _check_int("PlannerConfig", "lora_rank", self.lora_rank, 1)
        _check_int("PlannerConfig", "num_batches", self.num_batches, 1)
        _check_int("PlannerConfig", "seed", self.seed, 0)
        _check_int("PlannerConfig", "top_k", self.top_k, 1)
        if self.element_bytes not in (2, 4):
            raise ValueError(
                f"PlannerConfig.element_bytes={self.element_bytes!r} must be 2 (bf16) or 4 (fp32)"
            )
        _check_int("PlannerConfig", "loss_chunk_tokens", self.loss_chunk_tokens, 1)
        if self.max_tp is not None:
            _check_int("PlannerConfig", "max_tp", self.max_tp, 1)
        if self.num_threads is not None:
            _check_int("PlannerConfig", "num_threads", self.num_threads, 1)
        if self.microbatch_choices is not None:
            for k, m in enumerate(self.microbatch_choices):
                _check_int("PlannerConfig", f"microbatch_choices[{k}]", m, 1)
        _check_number("PlannerConfig", "screen_factor", self.screen_factor, positive=False)
        if self.screen_factor > 1.0:
            raise ValueError(
                f"PlannerConfig.screen_factor={self.screen_factor!r} must be in [0, 1]"
            )
        _check_int("PlannerConfig", "patience", self.patience, 0)
        if self.encoder_max_tp is not None:
            _check_int("PlannerConfig", "encoder_max_tp", self.encoder_max_tp, 1)
        if self.encoder_gpus is not None:
            for k, v in enumerate(self.encoder_gpus):
                _check_int("PlannerConfig", f"encoder_gpus[{k}]", v, 1)
        for k, v in enumerate(self.virtual_stage_choices):
            _check_int("PlannerConfig", f"virtual_stage_choices[{k}]", v, 1)
        if 1 not in self.virtual_stage_choices:
            raise ValueError(
                f"PlannerConfig.virtual_stage_choices={self.virtual_stage_choices!r} must hold "
                "1 (the plain 1F1B pipeline)"
            )
        if self.forward_fraction is not None:
            fractions = tuple(self.forward_fraction)
            if len(fractions) != 2 or not all(
                isinstance(f, (int, float)) and 0.0 <= f <= 1.0 for f in fractions
            ):
                raise ValueError(
                    "PlannerConfig.forward_fraction must be None or two numbers in [0, 1] "
                    f"(encoder, LLM), got {self.forward_fraction!r}"
                )
            object.__setattr__(self, "forward_fraction", tuple(float(f) for f in fractions))
        if self.encoder_split not in ("unit", "sample", "even"):
            raise ValueError(
                f"PlannerConfig.encoder_split={self.encoder_split!r} must be 'unit', 'sample' "
                "or 'even'"
            )
        if self.balance_time_budget_ms is not None:
            _check_number(
                "PlannerConfig",
                "balance_time_budget_ms",
                self.balance_time_budget_ms,
                positive=False,
            )


PASSTHROUGH_ACTIVATION_FRACTION = 2.0 / 3.0
"""The share of a layer's activations a frozen layer that passes gradients on keeps, unless
the model profiler measured it: a frozen linear layer needs its weight, not its input, for
the input gradient. Counted for a SwiGLU decoder layer with FlashAttention (bf16, bytes per
token): trained 12 h + 6 I (norm inputs, the QKV and MLP inputs, q / k / v / out, the
gate and up outputs, the down projection's input); passing gradients on 8 h + 4 I; with
I = 2.7 h about two thirds."""


@dataclass(frozen=True)
class _Passthrough:
    """What a frozen layer that passes gradients on runs and keeps, per module."""

    backward: tuple[float, float] = (1.0 - WEIGHT_GRAD_FRACTION,) * 2
    activations: tuple[float, float] = (PASSTHROUGH_ACTIVATION_FRACTION,) * 2

    @classmethod
    def of(cls, measured: dict[str, Any] | None) -> _Passthrough:
        """From a performance model's ``passthrough_factors`` (None, or a None entry: the
        defaults)."""
        default = cls()
        measured = measured or {}
        backward, activations = measured.get("backward"), measured.get("activations")
        return cls(
            default.backward if backward is None else tuple(float(v) for v in backward),
            default.activations if activations is None else tuple(float(v) for v in activations),
        )


def lora_params_per_layer(encoder: EncoderConfig, llm: LLMConfig, rank: int) -> tuple[int, int]:
    """(encoder, LLM) LoRA adapter parameters per layer at ``rank`` on the default targets
    (:data:`~dflop.models.trainable.DEFAULT_LORA_TARGETS`): rank x (inputs + outputs) of
    each adapted linear layer. A ViT block: q, k, v, out (h -> h each), fc1 and fc2; a
    decoder layer: q, k, v, o, gate, up and down."""
    h, i = encoder.hidden_size, encoder.intermediate_size
    vit = 4 * 2 * h + 2 * (h + i)
    g, m = llm.hidden_size, llm.intermediate_size
    kv = llm.num_kv_heads * (llm.head_dim or g // llm.num_heads)
    q = llm.num_heads * (llm.head_dim or g // llm.num_heads)
    decoder = (g + q) + 2 * (g + kv) + (q + g) + 2 * (g + m) + (m + g)
    return rank * vit, rank * decoder


def _regime(
    trainable: str | TrainableParts,
    measured: dict[str, Any] | None = None,
    lora_share: tuple[float, float] = (0.0, 0.0),
) -> dict[str, dict[str, float]]:
    """Per module (``"encoder"``, ``"llm"``), the :class:`PlannerModule` regime fields;
    ``lora_share``: a LoRA part's adapter parameters over its layers' (adapters
    included)."""
    parts = TrainableParts.parse(trainable)
    through = _Passthrough.of(measured)

    def layers(part: str, k: int, gradients_pass: bool) -> dict[str, float]:
        return {**_layers(part, k, gradients_pass), "input_grad_fraction": through.backward[k]}

    def _layers(part: str, k: int, gradients_pass: bool) -> dict[str, float]:
        # LoRA: the frozen layers pass gradients on (the adapters' own backward is
        # rank-sized: not counted) and keep their inputs, which the adapters' A needs.
        mode = parts.mode(part)
        if mode == "full":
            return {"body_backward_factor": 1.0, "body_trainable_fraction": 1.0,
                    "kept_activation_fraction": 1.0}  # fmt: skip
        if mode == "lora":
            return {"body_backward_factor": through.backward[k],
                    "body_trainable_fraction": lora_share[k],
                    "kept_activation_fraction": 1.0}  # fmt: skip
        return {"body_backward_factor": through.backward[k] if gradients_pass else 0.0,
                "body_trainable_fraction": 0.0,
                "kept_activation_fraction": through.activations[k]}  # fmt: skip

    tower_trains = parts.trains("encoder")
    projector = parts.mode("projector") == "full"
    lm_full = parts.mode("llm") == "full"
    # Something trains at or before every LLM stage (TrainableParts refuses all frozen).
    llm_head = 1.0 if lm_full else through.backward[1]
    return {
        "encoder": {
            **layers("encoder", 0, False),
            "last_backward_factor": 1.0
            if projector
            else (through.backward[0] if tower_trains else 0.0),
            "last_trainable_fraction": float(projector),
        },
        "llm": {
            **layers("llm", 1, True),
            "last_backward_factor": llm_head,
            "last_trainable_fraction": float(lm_full),
        },
    }


def with_trainable(
    encoder: PlannerModule,
    llm: PlannerModule,
    trainable: str | TrainableParts,
    passthrough: dict[str, Any] | None = None,
    lora_params: tuple[float, float] = (0.0, 0.0),
) -> tuple[PlannerModule, PlannerModule]:
    """(encoder, LLM) priced for a training regime (:class:`TrainableParts` or its name):
    a frozen part's weights get no gradients, optimizer state or all-reduce; its backward
    runs only where a trained part before it needs the gradient (then without the weight
    gradients, keeping fewer activations), as dflop's engine runs it
    (``TrainableParts.stage_backward``). ``passthrough``: a performance model's measured
    ``passthrough_factors`` (what such a backward costs and keeps), else the defaults
    (:data:`WEIGHT_GRAD_FRACTION`, :data:`PASSTHROUGH_ACTIVATION_FRACTION`). A ``lora``
    part: its layers pass gradients on, keep their inputs and carry ``lora_params``
    (encoder, LLM; :func:`lora_params_per_layer`) trainable adapter parameters each."""
    parts = TrainableParts.parse(trainable)
    modules = [encoder, llm]
    shares = [0.0, 0.0]
    for k, part in enumerate(("encoder", "llm")):
        if parts.mode(part) == "lora":
            extra = float(lora_params[k])
            total = modules[k].params_per_layer + extra
            modules[k] = replace(modules[k], params_per_layer=total)
            shares[k] = extra / total if total > 0 else 0.0
    regime = _regime(parts, passthrough, (shares[0], shares[1]))
    return replace(modules[0], **regime["encoder"]), replace(modules[1], **regime["llm"])


def regime_forward_fraction(
    forward_fraction: tuple[float, float],
    trainable: str | TrainableParts,
    passthrough: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """(encoder, LLM) forward shares of each module's time under a regime, from their
    shares under full training: what a run of that regime measures (and what its
    scheduler's pipeline model uses), from what the planner's model uses. A module whose
    layers run no backward: 1. ``passthrough``: as for :func:`with_trainable`."""
    regime = _regime(trainable, passthrough)
    encoder, llm = (
        _forward_share(f, regime[module]["body_backward_factor"])
        for f, module in zip(forward_fraction, ("encoder", "llm"))
    )
    return encoder, llm


def _forward_share(forward_fraction: float, body_backward_factor: float) -> float:
    """The forward's share of a module's time when its layers run ``body_backward_factor``
    of the full backward (1 where they run none)."""
    total = forward_fraction + (1.0 - forward_fraction) * body_backward_factor
    return 1.0 if total <= 0.0 else forward_fraction / total


def full_training_forward_fraction(
    shares: tuple[float, float],
    trainable: str | TrainableParts,
    default: tuple[float, float],
    passthrough: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """The inverse of :func:`regime_forward_fraction`: (encoder, LLM) full-training shares
    from shares measured under the regime; ``default``'s where a module's layers run no
    backward (the measurement says nothing about one)."""
    regime = _regime(trainable, passthrough)
    out = []
    for share, module, fallback in zip(shares, ("encoder", "llm"), default):
        b = regime[module]["body_backward_factor"]
        denominator = share * b + 1.0 - share
        out.append(share * b / denominator if b > 0.0 and denominator > 0.0 else fallback)
    return out[0], out[1]
