"""dflop's pipeline engine: one training step (forward + backward) over encoder stages
then LLM stages, under 1F1B, GPipe or interleaved 1F1B, with a different tensor shape in
every microbatch.

Each rank runs exactly its stage's actions of ``pipeline_program(order,
layout.pipeline_stages, m)`` (the program the simulator and the planner model). With LLM
virtual stages (``llm.virtual_stages = v > 1``, the interleaved schedule) an LLM rank holds
v model chunks (:class:`StageChunks`; chunk c of stage p is virtual stage c * pp + p) and
an action names the chunk it runs; the last LLM stage's chunk c sends its output to the
first LLM stage's chunk c + 1. A given program (``PipelineEngine(program=...)``, e.g. one
loaded from a file) runs instead of the generated one. Actions run from a table: ``F``
(forward), ``B`` (full backward), and the split backward of zero-bubble orders, ``I``
(the input gradient, sent on at once) and ``W`` (the weight gradients, later;
:mod:`dflop.runtime.split_backward`); anything else is refused before a step starts, on
every rank (:func:`check_executable`). Per action:

- forward of microbatch j: receive the stage input (pixels from the batch source on the
  first encoder stage, read for the whole step before its clock starts, as a data
  loader's prefetch would, after which all ranks start the clock together; hidden states from the previous stage of the same replica; on the
  first LLM stage, token embeddings merged with the visual features that the bridge
  brings from the encoder replicas), run the stage, send the output on (or, on the last
  LLM stage, compute ``sum_loss / global target tokens``);
- backward of microbatch j: receive the output's gradient (or start from the loss), run
  ``torch.autograd.backward``, send the input's gradient back (over the bridge for the
  visual features).

Every message shape comes from the :class:`~dflop.runtime.step_data.StepPlan`, which all
ranks derive from the same Schedule: no shape handshake. A microbatch share with nothing
in it (an encoder replica with no images, e.g. in a text-only microbatch; an empty LLM
bin) computes nothing and sends nothing stage-to-stage, since both ends read the same
plan; bridge ranks still call the communicator, which skips zero-row pairs (and, in debug
mode, still exchanges their headers). ``debug=True`` sends a small header before every
stage-to-stage tensor and raises :class:`ShapeMismatchError` naming both ranks when the
plans disagree, instead of corrupting or hanging.

Sends are non-blocking (``isend``) and awaited at the end of the step: 1F1B needs that
(a stage posts forward j+1 while its successor is still sending the gradient of j).
On gloo (and in a thread world), receives are posted one action ahead: before computing action i, a rank posts
the receive that action i + 1 will wait for (in action order), so the message lands while
it computes instead of after (a late gloo receive costs a round trip of the peers'
transport threads, milliseconds on busy CPU cores). Not on NCCL, which runs a pair's
sends and receives in issue order on one stream: a receive posted early would sit in
front of the send its peer is waiting for. Debug mode receives at the point of use, so
that its header checks stay in order.
After the last backward, gradients are summed over the module's DP group; since every
microbatch loss is already divided by the global target count, the result equals the
single-process gradient of (sum of all losses / global target tokens).

torch.distributed.pipelining fixes shapes at the first microbatch, hence this engine.
Tensor parallelism (tp > 1, :mod:`dflop.runtime.tensor_parallel`): every TP rank of a
stage holds the same replicated activations, so stage-to-stage messages go from TP rank t
to TP rank t of the neighbouring stage as with tp=1. Only TP rank 0 of the bridge stages
is in the bridge group: it sends the features / receives their gradients alone, and on
the receiving side broadcasts what arrived to the rest of its TP group. The loss is
counted on TP rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from dflop._deprecated import warn_renamed
from dflop.batch.text import TextInputs
from dflop.errors import InputTypeError, bounded_repr
from dflop.models.config import ModelConfig
from dflop.models.decoder import IGNORE_INDEX
from dflop.models.loss import DEFAULT_LOSS_CHUNK_TOKENS
from dflop.models.registry import model_spec
from dflop.models.spec import EncoderStageModule, LLMStageModule, ModelSpec, StageSlice
from dflop.models.trainable import TrainableParts
from dflop.runtime import dist, p2p
from dflop.runtime.bridge import BridgeCommunicator
from dflop.runtime.colocated import ColocatedStage
from dflop.runtime.recompute import apply_recompute
from dflop.runtime.split_backward import WeightGradients, backward_input, backward_weight
from dflop.runtime.step_data import EncoderShare, LLMShare, MicrobatchPlan, StepPlan
from dflop.runtime.tensor_parallel import apply_tensor_parallel, local_tensor
from dflop.runtime.topology import RankInfo, RuntimeLayout, Topology, chunk_infos
from dflop.scheduling.actions import (
    PipelineAction,
    PipelineProgram,
    pipeline_program,
    validate_program,
    virtual_stage_owners,
)

__all__ = [
    "ActionTiming",
    "BatchSource",
    "PipelineEngine",
    "ShapeMismatchError",
    "StageChunks",
    "StepResult",
    "UnsupportedActionError",
    "build_stage",
    "check_executable",
]

FORWARD, BACKWARD = "forward", "backward"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"

# The engine's action table: kind -> (the timing's name, the PipelineEngine method that
# runs it). A kind not here is refused before a step starts (check_executable).
_ACTION_RUNNERS: dict[str, tuple[str, str]] = {
    "F": (FORWARD, "_run_forward"),
    "B": (BACKWARD, "_run_backward"),
    "I": (BACKWARD_INPUT, "_run_backward_input"),
    "W": (BACKWARD_WEIGHT, "_run_backward_weight"),
}
_KIND_OF_TIMING = {timing: kind for kind, (timing, _) in _ACTION_RUNNERS.items()}


class UnsupportedActionError(ValueError):
    """A pipeline program holds an action the engine cannot run (see
    :func:`check_executable`)."""


def check_executable(program: PipelineProgram) -> None:
    """Refuse a program with an action the engine does not run, before anything runs.

    Every rank checks the whole program (not only its own stage), so that all ranks refuse
    the same program instead of some waiting for a peer that refused.

    Raises:
        UnsupportedActionError: naming the first such action's stage, index and kind.
    """
    for s, actions in enumerate(program.actions):
        for i, action in enumerate(actions):
            if action[1] not in _ACTION_RUNNERS:
                raise UnsupportedActionError(
                    f"pipeline program stage {s}, action {i} has kind "
                    f"{bounded_repr(action[1], 40)}, not an action kind the runtime executes "
                    "(F, B, I, W)"
                )


class ShapeMismatchError(RuntimeError):
    """Two ranks disagree on a message's shape (their StepPlans differ)."""


class BatchSource(Protocol):
    """Where a rank gets the tensors of the samples it computes (see ``SyntheticBatch``)."""

    def pixel_values(
        self,
        sample_ids: np.ndarray,
        first_unit: np.ndarray | None = None,
        num_units: np.ndarray | None = None,
    ) -> Tensor:
        """``[U, C, H, W]``: the visual units of ``sample_ids``, in that order (only units
        ``[first_unit[k], first_unit[k] + num_units[k])`` of sample k when given)."""
        ...

    def text_inputs(self, sample_ids: np.ndarray) -> TextInputs:
        """Packed tokens, placeholder mask and labels of ``sample_ids``, in that order."""
        ...


def unit_grid(batch: Any, share: EncoderShare) -> Tensor:
    """``[U, 3]`` (t, h, w) patch grid of each unit of an encoder share (a patch-sequence
    encoder's batch source gives them: ``batch.unit_grid(ids, first_unit, num_units)``)."""
    source = getattr(batch, "batch", batch)  # the prefetching wrapper's source
    get = getattr(source, "unit_grid", None)
    if get is None:
        raise InputTypeError(
            f"{type(source).__name__} has no unit_grid(): a patch-sequence encoder "
            "(tokens_per_unit=None) needs each unit's patch grid"
        )
    return get(share.sample_ids, share.first_unit, share.num_units)


@dataclass(frozen=True)
class ActionTiming:
    """One executed action; times in seconds from the start of the step."""

    kind: str
    """``"forward"``, ``"backward"``, or a split backward's ``"backward_input"`` /
    ``"backward_weight"``."""
    microbatch: int
    start_s: float
    """When its inputs had arrived and compute began."""
    end_s: float
    wait_s: float
    """Seconds before ``start_s`` spent waiting for its inputs (receives)."""
    virtual_stage: int = -1
    """The virtual stage (model chunk) it ran."""
    encoder_s: float = 0.0
    """Of a colocated first stage's forward: the seconds its encoder took (the rest is
    the LLM's layers; the backward runs both in one autograd pass)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepResult:
    """The outcome of one step on one rank."""

    loss_sum: float
    """Summed token losses of the whole global batch (all ranks: all-reduced)."""
    num_target_tokens: int
    """Target tokens of the whole global batch (the loss normaliser)."""
    timings: tuple[ActionTiming, ...]
    """This rank's actions, in execution order."""
    step_time_s: float
    """From the first action to the end of the gradient all-reduce."""
    busy_s: float
    """Forward + backward compute seconds (waits for inputs excluded)."""
    idle_s: float
    """``step_time_s - busy_s``: bubbles, waits, all-reduce."""
    global_stage: int
    backward_passes: int = 0
    """Autograd backward passes this rank ran (none on a forward-only stage: nothing
    trainable at or before it)."""

    @property
    def loss(self) -> float:
        """Mean loss per target token over the global batch."""
        return self.loss_sum / max(self.num_target_tokens, 1)

    @property
    def actions(self) -> list[PipelineAction]:
        """Executed actions in order (compare with ``pipeline_program``'s)."""
        return [
            PipelineAction(t.virtual_stage, _KIND_OF_TIMING[t.kind], t.microbatch)
            for t in self.timings
        ]


class StageChunks(nn.ModuleList):
    """The model chunks of one rank of an interleaved pipeline, in model order (chunk c is
    virtual stage ``c * pp + pp_rank`` of its module). Parameters, ``state_dict`` and
    gradients cover every chunk."""

    def model_state_dict(self) -> dict[str, Tensor]:
        """The chunks' state dicts merged under the model's own names (each chunk holds
        different layers, so no name repeats): what one stage's ``state_dict`` gives."""
        merged: dict[str, Tensor] = {}
        for chunk in self:
            merged.update(chunk.state_dict())
        return merged

    def tied_parameter(self) -> Tensor | None:
        """The chunk holding the token embedding's or the tied head's copy (first chunk of
        the first stage, last chunk of the last stage), as the stage protocol gives it."""
        for chunk in (self[0], self[-1]):
            tied = getattr(chunk, "tied_parameter", None)
            param = tied() if callable(tied) else None
            if param is not None:
                return param
        return None


def build_stage(
    model: ModelSpec | ModelConfig | str,
    info: RankInfo,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    tp_group: Any = None,
    tp_size: int = 1,
    layout: RuntimeLayout | None = None,
) -> nn.Module:
    """This rank's part of ``model`` (a :class:`~dflop.models.spec.ModelSpec`, a reference
    ``ModelConfig`` or anything :func:`~dflop.models.registry.model_spec` takes): an encoder
    stage on encoder ranks (pixels in on the first stage, projected features out on the
    last), an LLM stage on LLM ranks (token embedding on the first stage, head on the
    last). The reference model's stages get the full model's weights for ``seed``
    (name-keyed init) and, with ``tp_size > 1``, every stage is sharded over ``tp_group``
    by the plan it declares (``Topology.tp_group``; see
    :func:`dflop.runtime.tensor_parallel.apply_tensor_parallel`).
    With ``layout``, a module whose layout has ``recompute`` runs its blocks under
    activation checkpointing (:func:`~dflop.runtime.recompute.apply_recompute`).
    A rank of a module with virtual stages (``info.num_chunks > 1``) gets a
    :class:`StageChunks` of one stage per chunk; that needs ``layout`` (the
    :class:`~dflop.runtime.topology.RuntimeLayout`). The first LLM stage of a colocated
    layout (``info.holds_encoder``) gets a :class:`~dflop.runtime.colocated.ColocatedStage`:
    the whole encoder (tensor-parallel over the same group) and its LLM layers."""
    spec = model_spec(model)

    def sharded(place: RankInfo) -> nn.Module:
        stage = spec.build_stage(place, seed=seed, device=device, dtype=dtype)
        if tp_size > 1:  # every TP rank built the same full weights; each keeps its slice
            stage = apply_tensor_parallel(stage, tp_group, tp_size=tp_size)
        if layout is not None and layout.module(place.module).recompute:
            apply_recompute(stage)
        return stage

    if info.num_chunks == 1 and info.holds_encoder:
        encoder = sharded(StageSlice("encoder", (0, spec.encoder_layers)))
        return ColocatedStage(encoder, sharded(info))
    if info.num_chunks == 1:
        return sharded(info)
    if layout is None:
        raise InputTypeError(
            f"rank {info.rank} holds {info.num_chunks} model chunks: pass build_stage the "
            "RuntimeLayout (layout=...)"
        )
    return StageChunks(sharded(chunk) for chunk in chunk_infos(layout, info.rank))


class _Clock:
    """Timestamps: ``perf_counter`` on CPU; CUDA events on GPU (resolved at step end, so
    timing adds no host synchronisation inside the step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.origin = self.mark()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamp: Any) -> float:
        """Seconds from the clock's origin to ``stamp`` (call after a synchronisation)."""
        if not self.cuda:
            return stamp - self.origin
        return self.origin.elapsed_time(stamp) / 1000.0


@dataclass
class _Sent:
    """An ``isend`` in flight; holds its tensor so the buffer outlives the transfer."""

    work: Any
    tensor: Tensor

    def wait(self) -> None:
        self.work.wait()


class _Prefetched:
    """A rank's inputs of one step, read from the batch source before the step's clock
    starts, as a data loader's prefetch would: rendering or decoding them is then not on
    the pipeline's critical path. Pixels of an encoder share's pieces, or text of an LLM
    share's samples."""

    def __init__(
        self,
        batch: BatchSource,
        encoder_shares: list[EncoderShare],
        llm_shares: list[LLMShare],
        *,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.device = device
        self._pixels = {_piece_key(s): self._read_pixels(s) for s in encoder_shares}
        release = getattr(batch, "release_pixels", None)
        if release is not None:  # the pieces are copies: the source's decoded ones go
            release()
        self._text = {_key(s.sample_ids): batch.text_inputs(s.sample_ids) for s in llm_shares}

    def _read_pixels(self, share: EncoderShare) -> Tensor:
        pixels = self.batch.pixel_values(share.sample_ids, share.first_unit, share.num_units)
        return pixels.to(self.device)

    def pixel_values(self, share: EncoderShare) -> Tensor:
        found = self._pixels.pop(_piece_key(share), None)  # used once: free it early
        return found if found is not None else self._read_pixels(share)

    def text_inputs(self, sample_ids: np.ndarray) -> TextInputs:
        found = self._text.get(_key(sample_ids))
        return found if found is not None else self.batch.text_inputs(sample_ids)


def _key(sample_ids: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in sample_ids)


def _piece_key(share: EncoderShare) -> tuple[tuple[int, ...], ...]:
    return (_key(share.sample_ids), _key(share.first_unit), _key(share.num_units))


_Chunk = tuple[nn.Module, RankInfo]
"""One model chunk of a rank: its module and its :class:`RankInfo` (neighbours, flags)."""


@dataclass
class _Receiving:
    """A stage-to-stage receive in flight; ``wait()`` returns the filled buffer."""

    work: Any
    buffer: Tensor
    requires_grad: bool

    def wait(self) -> Tensor:
        self.work.wait()
        return self.buffer.requires_grad_(self.requires_grad)


@dataclass
class _InFlight:
    """What a forward keeps for its backward."""

    stage_input: Tensor | None = None
    """The received input (requires grad) whose gradient goes back to the previous stage."""
    visual_features: Tensor | None = None
    """First LLM stage: the bridged features (requires grad); their gradient goes back."""
    output: Tensor | None = None
    """The tensor to differentiate (stage output, or the normalised loss on the last stage)."""


class PipelineEngine:
    """Runs training steps of one rank's stage; see the module docstring.

    Args:
        topology: this rank's :class:`Topology` (``Topology.create`` on every rank).
        stage: this rank's stage (:func:`build_stage`): an ``EncoderStageModule`` on
            encoder ranks, an ``LLMStageModule`` on LLM ranks (a :class:`StageChunks` of
            them with virtual stages), already on ``device``.
        order: the pipeline order, ``"1f1b"``, ``"gpipe"``, ``"interleaved-1f1b"`` or
            ``"zb-h1"``, as in
            ``pipeline_program``; default: ``layout.pipeline_order``
            (:func:`dflop.scheduling.pipeline_order_for`).
        program: a :class:`~dflop.scheduling.PipelineProgram` to run instead of a
            generated pipeline order (e.g. :func:`dflop.scheduling.load_program`'s), over the
            layout's virtual stages and ``layout.num_microbatches``; validated here. Not
            with ``order``.
        debug: send a shape header before every stage-to-stage tensor (and ask the bridge
            to do the same) to report plan mismatches clearly.
        device: where activations live; default: the stage's parameters' device.
        synchronized_start: a barrier of all ranks before the step's clock starts, so that
            step times measure the pipeline, not how late a rank arrived.
        loss_chunk_tokens: the last LLM stage's head and loss run on this many target
            tokens at a time (:func:`dflop.models.loss.chunked_lm_loss`).
        schedule: deprecated name of ``order``.
    """

    def __init__(
        self,
        topology: Topology,
        stage: nn.Module,
        *,
        order: str | None = None,
        program: PipelineProgram | None = None,
        debug: bool = False,
        device: torch.device | str | None = None,
        synchronized_start: bool = True,
        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        trainable: TrainableParts | None = None,
        schedule: str | None = None,
    ) -> None:
        if schedule is not None:
            warn_renamed("PipelineEngine(schedule=...)", "PipelineEngine(order=...)")
            order = schedule
        info = topology.info
        layout = topology.layout
        self.tp_size = layout.module(info.module).tp
        expect = EncoderStageModule if info.module == "encoder" else LLMStageModule
        modules = list(stage) if isinstance(stage, StageChunks) else [stage]
        if len(modules) != info.num_chunks:
            raise ValueError(
                f"rank {info.rank} holds {info.num_chunks} model chunks, the stage has "
                f"{len(modules)} (build it with build_stage(..., layout=layout))"
            )
        for module in modules:
            if not isinstance(module, expect):
                raise InputTypeError(
                    f"rank {info.rank} is an {info.module} rank: stage must be a {expect.__name__}"
                    + (" (or a StageChunks of them)" if info.num_chunks > 1 else "")
                )
        self.topology = topology
        self.info = info
        self.layout = layout
        self.stage = stage
        self.loss_chunk_tokens = int(loss_chunk_tokens)
        # Virtual stage -> (the chunk's module, its RankInfo: neighbours, first / last).
        self._chunks = {
            ci.virtual_stage: (module, ci)
            for module, ci in zip(modules, chunk_infos(layout, info.rank))
        }
        # Where gradients flow (frozen parts): which chunks run a backward, and which
        # need their input's gradient (the previous stage runs a backward).
        self.trainable = TrainableParts() if trainable is None else trainable
        self._runs_backward = {
            v: self.trainable.stage_backward(ci.module, ci.is_last_stage)
            for v, (_, ci) in self._chunks.items()
        }
        self._input_grad = {v: self._input_grad_at(ci) for v, (_, ci) in self._chunks.items()}
        # Split backwards: the trainable parameters per chunk, and what each I left for
        # its W, by (virtual stage, microbatch).
        self._params = {
            v: [p for p in module.parameters() if p.requires_grad]
            for v, (module, _) in self._chunks.items()
        }
        self._weight_work: dict[tuple[int, int], WeightGradients | None] = {}
        self._programs: dict[int, tuple[PipelineAction, ...]] = {}
        self.program = program
        if program is None:
            self.order: str | None = layout.pipeline_order if order is None else order
        else:
            self.order = None
            if order is not None:
                raise ValueError("PipelineEngine takes a pipeline order or a program, not both")
            self._programs[layout.num_microbatches] = self._checked(program)
        if info.num_chunks > 1 and dist.get_backend() == "nccl":
            # NCCL matches a pair's sends and receives in issue order on one stream; the
            # wrap-around messages (last stage -> first) need batched send / receive pairs
            # to be safe there, which this engine does not issue yet.
            raise ValueError(
                "interleaved 1F1B (llm.virtual_stages > 1) runs on gloo only for now; use "
                "llm_v=1 with NCCL"
            )
        self.debug = debug
        self.synchronized_start = synchronized_start
        param = next(stage.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        self.is_encoder = info.module == "encoder"
        self._token_positions = not self.is_encoder and callable(
            getattr(modules[0], "position_ids", None)
        )
        self.bridge: BridgeCommunicator | None = None
        if info.is_bridge_sender or info.is_bridge_receiver:
            hidden = modules[-1].output_size if self.is_encoder else modules[0].hidden_size
            self.bridge = BridgeCommunicator(
                topology, hidden, self.dtype, device=self.device, debug=debug
            )
        self._pending: list[Any] = []  # sends in flight (waited for at the end of the step)
        # Receives posted ahead of their action, by (is_forward, virtual stage, microbatch).
        self._posted: dict[tuple[bool, int, int], Any] = {}
        self._post_ahead = not debug and dist.get_backend() != "nccl"

    def _carries_gradient(self, ci: RankInfo, mb: MicrobatchPlan) -> bool:
        """Whether chunk ``ci``'s backward of ``mb`` has a gradient to compute: always,
        except on a frozen LLM for a share without visual rows (its gradient would reach
        no trainable parameter: such a microbatch runs no LLM backward on any stage)."""
        if ci.module != "llm" or self.trainable.mode("llm") != "frozen":
            return True
        return mb.llm[self.info.dp_rank].visual_rows > 0

    def _input_grad_at(self, ci: RankInfo) -> bool:
        if ci.module == "llm" and ci.is_first_stage:
            return self.trainable.bridge_gradients
        if ci.module == "llm":
            return True
        # the previous encoder stage is not the last: it trains only with the tower
        return not ci.is_first_stage and self.trainable.trains("encoder")

    # ------------------------------------------------------------------ step

    def run_step(self, plan: StepPlan, batch: BatchSource) -> StepResult:
        """One step over ``plan``'s microbatches: forward + backward of every microbatch in
        ``pipeline_actions`` order, then the DP gradient all-reduce. Gradients are reset
        first, so after the call ``p.grad`` holds this step's gradients (no optimizer step).
        """
        if plan.num_microbatches != self.layout.num_microbatches:
            raise ValueError(
                f"the StepPlan has {plan.num_microbatches} microbatches, the layout "
                f"{self.layout.num_microbatches}"
            )
        if not self.is_encoder and self.info.is_first_stage:
            expected = self._chunks[self.info.virtual_stage][0].visual_newline
            if expected is not None and plan.visual_newline != expected:
                raise ValueError(
                    f"the StepPlan has visual_newline={plan.visual_newline} but the model's "
                    f"stage says {expected}: build the plan with the spec's visual_newline "
                    "(config.decoder.image_newline for the reference model)"
                )
        # The whole program is checked (every action runnable) before anything runs.
        actions = self._actions(plan.num_microbatches)
        self.stage.zero_grad(set_to_none=True)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._backward_passes = 0
        encoder_shares, llm_shares = self._input_shares(plan)
        batch = _Prefetched(batch, encoder_shares, llm_shares, device=self.device)
        if self.synchronized_start:
            # Every rank starts the step's clock together: work a rank does before the
            # step (reading inputs, rank 0's scheduling and bookkeeping) is not charged to
            # the step of the ranks that would otherwise wait for it inside their clock.
            dist.barrier()
        clock = self.clock = _Clock(self.device)
        stamps: list[tuple[str, int, Any, Any, Any, int, Any]] = []
        self._encoder_spans: dict[tuple[int, int], tuple[Any, Any]] = {}
        in_flight: dict[tuple[int, int], _InFlight] = {}
        self._posted.clear()  # nothing left over from a step that failed
        self._weight_work.clear()
        for i, (v, kind, j) in enumerate(actions):
            mb = plan.microbatches[j]
            chunk = self._chunks[v]
            timing, method = _ACTION_RUNNERS[kind]
            if self._post_ahead:
                for ahead in actions[i : i + 2]:  # this action's receive first, then the next
                    self._post(ahead, plan.microbatches[ahead.microbatch])
            arrive = clock.mark()
            start = getattr(self, method)(chunk, mb, plan, batch, in_flight, (v, j))
            # start is None for an empty share: it waited for nothing and computed nothing.
            start = arrive if start is None else start
            stamps.append(
                (timing, j, arrive, start, clock.mark(), v, self._encoder_spans.pop((v, j), None))
            )
        self._wait_sends()
        self._all_reduce_grads()
        self._sum_tied_grads()
        loss_sum = self._global_loss_sum()
        end = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize(self.device)
        return self._result(plan, clock, stamps, end, loss_sum)

    def _actions(self, num_microbatches: int) -> tuple[PipelineAction, ...]:
        """This rank's actions of the layout's pipeline program (cached per count), the
        whole program checked runnable (:func:`check_executable`)."""
        if num_microbatches not in self._programs:
            stages, chunks = self.layout.pipeline_stages
            program = pipeline_program(self.order, stages, num_microbatches, chunks=chunks)
            check_executable(program)
            self._programs[num_microbatches] = program.actions[self.info.global_stage]
        return self._programs[num_microbatches]

    def _checked(self, program: PipelineProgram) -> tuple[PipelineAction, ...]:
        """This rank's actions of a given program: every action runnable
        (:func:`check_executable`), the program valid, over the layout's virtual stages and
        microbatch count."""
        if not isinstance(program, PipelineProgram):
            raise InputTypeError(f"program must be a PipelineProgram, got {type(program).__name__}")
        check_executable(program)
        validate_program(program)
        owners = virtual_stage_owners(*self.layout.pipeline_stages)
        if tuple(program.owner) != owners:
            raise ValueError(
                f"the program's owners {list(program.owner)} are not the layout's virtual "
                f"stages' {list(owners)} (stages, chunks = {self.layout.pipeline_stages})"
            )
        if program.num_microbatches != self.layout.num_microbatches:
            raise ValueError(
                f"the program has {program.num_microbatches} microbatches, the layout "
                f"{self.layout.num_microbatches}"
            )
        return program.actions[self.info.global_stage]

    # ------------------------------------------------------------------ the action table

    def _run_forward(
        self,
        chunk: _Chunk,
        mb: MicrobatchPlan,
        plan: StepPlan,
        batch: _Prefetched,
        in_flight: dict[tuple[int, int], _InFlight],
        key: tuple[int, int],
    ) -> Any:
        """Action ``F``: returns the clock mark at which compute began (None: nothing)."""
        if self.is_encoder:
            in_flight[key], start = self._encoder_forward(chunk, mb, batch)
        else:
            in_flight[key], start = self._llm_forward(chunk, mb, plan, batch)
        return start

    def _run_backward(
        self,
        chunk: _Chunk,
        mb: MicrobatchPlan,
        plan: StepPlan,
        batch: _Prefetched,
        in_flight: dict[tuple[int, int], _InFlight],
        key: tuple[int, int],
    ) -> Any:
        """Action ``B`` (the full backward)."""
        return self._backward(chunk, mb, in_flight.pop(key))

    def _run_backward_input(
        self,
        chunk: _Chunk,
        mb: MicrobatchPlan,
        plan: StepPlan,
        batch: _Prefetched,
        in_flight: dict[tuple[int, int], _InFlight],
        key: tuple[int, int],
    ) -> Any:
        """Action ``I``: the input gradients, sent on; the weight gradients wait for ``W``."""
        return self._backward(chunk, mb, in_flight.pop(key), split_key=key)

    def _run_backward_weight(
        self,
        chunk: _Chunk,
        mb: MicrobatchPlan,
        plan: StepPlan,
        batch: _Prefetched,
        in_flight: dict[tuple[int, int], _InFlight],
        key: tuple[int, int],
    ) -> Any:
        """Action ``W``: the weight gradients that the ``I`` of ``key`` left."""
        work = self._weight_work.pop(key)
        if work is None:
            return None
        start = self.clock.mark()
        backward_weight(work)
        return start

    def _result(
        self, plan: StepPlan, clock: _Clock, stamps: list, end: Any, loss_sum: float
    ) -> StepResult:
        timings = tuple(
            ActionTiming(
                kind,
                j,
                clock.seconds(start),
                clock.seconds(stop),
                clock.seconds(start) - clock.seconds(arrive),
                v,
                0.0 if span is None else clock.seconds(span[1]) - clock.seconds(span[0]),
            )
            for kind, j, arrive, start, stop, v, span in stamps
        )
        step_time_s = clock.seconds(end)
        busy_s = sum(t.duration_s for t in timings)
        return StepResult(
            loss_sum=loss_sum,
            num_target_tokens=plan.num_target_tokens,
            timings=timings,
            step_time_s=step_time_s,
            busy_s=busy_s,
            idle_s=step_time_s - busy_s,
            global_stage=self.info.global_stage,
            backward_passes=self._backward_passes,
        )

    # ------------------------------------------------------------------ forward

    def _encoder_forward(
        self, chunk: _Chunk, mb: MicrobatchPlan, batch: _Prefetched
    ) -> tuple[_InFlight, Any]:
        """Returns the saved state and the clock mark at which compute began."""
        stage, ci = chunk
        share = mb.encoder[self.info.dp_rank]
        state = _InFlight()
        if share.is_empty:
            # No images for this replica: nothing to receive or run. The bridge is still
            # called (with zero rows) so that its debug headers stay in step.
            if self.bridge is not None:
                self._bridge_send_features(mb, self._empty_rows())
            return state, None
        patches = stage.tokens_per_unit is None  # a patch-sequence encoder
        if ci.is_first_stage:
            x = self._pixels(batch, share, mb, patches)
        else:
            x = state.stage_input = self._received(True, ci, mb)
        start = self.clock.mark()
        # A stage with nothing trainable at or before it keeps no autograd graph.
        with torch.set_grad_enabled(self._runs_backward[ci.virtual_stage]):
            state.output = stage(x, unit_grid(batch, share)) if patches else stage(x)
        if ci.is_last_stage:  # projected features [rows, llm hidden]: over the bridge
            if self.bridge is not None:  # TP rank 0 (the other TP ranks hold the same rows)
                self._bridge_send_features(mb, state.output.detach())
        else:
            self._send(state.output.detach(), ci, mb.index, kind=p2p.FORWARD)
        return state, start

    def _pixels(
        self, batch: _Prefetched, share: EncoderShare, mb: MicrobatchPlan, patches: bool
    ) -> Tensor:
        """The pixels of an encoder share, checked against the StepPlan."""
        x = batch.pixel_values(share)
        rows, what = (share.tokens, "patch rows") if patches else (share.units, "units")
        if x.shape[0] != rows:
            raise ValueError(
                f"microbatch {mb.index}: the batch source gave {x.shape[0]} {what} for "
                f"{rows} in the StepPlan"
            )
        return x

    def _encode_own(self, stage: ColocatedStage, mb: MicrobatchPlan, batch: _Prefetched) -> Tensor:
        """A colocated first stage's features of its share's images: the encoder runs here,
        in the autograd graph (where the encoder or the projector trains), so this stage's
        backward carries their gradients."""
        share = mb.encoder[self.info.dp_rank]
        patches = stage.tokens_per_unit is None
        x = self._pixels(batch, share, mb, patches)
        with torch.set_grad_enabled(self.trainable.bridge_gradients):
            features = stage.encode(x, unit_grid(batch, share)) if patches else stage.encode(x)
        if features.shape[0] != share.feature_rows:
            raise ShapeMismatchError(
                f"rank {self.info.rank}, microbatch {mb.index}: the encoder gave "
                f"{features.shape[0]} feature rows, the StepPlan says {share.feature_rows}"
            )
        return features

    def _llm_forward(
        self, chunk: _Chunk, mb: MicrobatchPlan, plan: StepPlan, batch: BatchSource
    ) -> tuple[_InFlight, Any]:
        stage, ci = chunk
        share = mb.llm[self.info.dp_rank]
        state = _InFlight()
        features = None
        if ci.is_first_stage and not ci.holds_encoder:
            # Called even for zero rows, to keep the bridge's debug headers in step.
            if self.bridge is not None:  # TP rank 0
                features = self._received(True, ci, mb)
            if self.tp_size > 1 and share.visual_rows > 0:
                shape = (share.visual_rows, stage.hidden_size)
                features = self._tp_broadcast(features, shape)
        if share.is_empty:  # an empty bin: nothing to run
            return state, None
        text = None
        if ci.is_first_stage or ci.is_last_stage or self._token_positions:
            text = batch.text_inputs(share.sample_ids)
            self._check_text(mb, share.cu_seqlens, text)
        # On the host: stages read the lengths there (a GPU copy would cost every forward a
        # synchronisation) and move to the device what they compute with.
        cu_seqlens = torch.from_numpy(np.array(share.cu_seqlens))
        # A model whose rotary positions come from the tokens (Qwen-VL's mRoPE) gets them
        # on every stage.
        extra = (
            {"position_ids": stage.position_ids(text).to(self.device)}
            if self._token_positions
            else {}
        )
        if ci.is_first_stage:
            start = self.clock.mark()
            if ci.holds_encoder and share.visual_rows > 0:
                features = self._encode_own(stage, mb, batch)
                self._encoder_spans[(ci.virtual_stage, mb.index)] = (start, self.clock.mark())
            x = stage.embed(text.token_ids.to(self.device))
            if share.visual_rows > 0:
                features = features.to(self.device)
                if not ci.holds_encoder:  # a leaf whose gradient goes back over the bridge
                    features.requires_grad_(self._input_grad[ci.virtual_stage])
                    state.visual_features = features
                # Per-sample visual operations (newline rows, unpadding, pooling) run here,
                # where all of a sample's units have arrived from the encoder replicas.
                rows = share.sample_visual_rows.tolist()
                x = stage.merge_visual(x, features, text, rows)
        else:
            x = state.stage_input = self._received(True, ci, mb)
            start = self.clock.mark()
        if not ci.is_last_stage:
            state.output = stage.hidden_states(x, cu_seqlens, **extra)
            self._send(state.output.detach(), ci, mb.index, kind=p2p.FORWARD)
            return state, start
        labels = text.labels.masked_fill(text.image_token_mask, IGNORE_INDEX).to(self.device)
        sum_loss, num_targets = stage.loss(
            x, cu_seqlens, labels, chunk_tokens=self.loss_chunk_tokens, **extra
        )
        if self.debug and int(num_targets) != share.target_tokens:
            raise ShapeMismatchError(
                f"rank {self.info.rank}, microbatch {mb.index}: {int(num_targets)} target "
                f"tokens, the StepPlan says {share.target_tokens}"
            )
        if self.info.tp_rank == 0:  # every TP rank computes the same loss: count it once
            self._loss_sum += sum_loss.detach().double()
        # Normalise by the GLOBAL target count: summing the gradients of all microbatches
        # and replicas then gives the gradient of the mean loss of the global batch.
        state.output = sum_loss / plan.num_target_tokens
        return state, start

    def _check_text(self, mb: MicrobatchPlan, cu_seqlens: np.ndarray, text: TextInputs) -> None:
        if text.cu_seqlens.tolist() != cu_seqlens.tolist():
            raise ValueError(
                f"rank {self.info.rank}, microbatch {mb.index}: the batch source's sequence "
                f"lengths {text.cu_seqlens.tolist()} differ from the StepPlan's "
                f"{cu_seqlens.tolist()} (build both from the same shapes)"
            )

    # ------------------------------------------------------------------ backward

    def _backward(
        self,
        chunk: _Chunk,
        mb: MicrobatchPlan,
        state: _InFlight,
        split_key: tuple[int, int] | None = None,
    ) -> Any:
        """A full backward, or with ``split_key`` the ``I`` half of a split one (its ``W``
        work kept under that key). Returns the clock mark at which compute began (None:
        nothing to compute)."""
        _, ci = chunk
        start = None
        if split_key is not None:
            self._weight_work[split_key] = None  # unless a backward runs below
        if not self._runs_backward[ci.virtual_stage]:
            return None  # a forward-only stage: no gradient comes, none goes back
        if self.is_encoder and ci.is_last_stage:
            # Called even for an empty share, to keep the bridge's debug headers in step.
            grad = None
            if self.bridge is not None:  # TP rank 0
                grad = self._received(False, ci, mb)
            if self.tp_size > 1 and state.output is not None:
                grad = self._tp_broadcast(grad, tuple(state.output.shape))
        if state.output is not None:  # else an empty share: its forward did nothing either
            if self.is_encoder and ci.is_last_stage:
                grad = grad.to(self.device)
            elif ci.is_last_stage or not self._carries_gradient(ci, mb):
                grad = None  # the loss is a scalar: backward starts from 1; or none
            else:
                grad = self._received(False, ci, mb)
            start = self.clock.mark()
            # Frozen parts: e.g. a text-only microbatch on a frozen LLM's first stage has
            # nothing to differentiate.
            if state.output.requires_grad and split_key is not None:
                inputs = [t for t in (state.stage_input, state.visual_features) if t is not None]
                self._weight_work[split_key] = backward_input(
                    state.output, grad, inputs, self._params[ci.virtual_stage]
                )
                self._backward_passes += 1
            elif state.output.requires_grad:
                torch.autograd.backward(state.output, grad)
                self._backward_passes += 1
            if state.stage_input is not None and state.stage_input.requires_grad:
                self._send(state.stage_input.grad, ci, mb.index, kind=p2p.BACKWARD)
        if (
            not self.is_encoder
            and ci.is_first_stage
            and self.bridge is not None
            and self._input_grad[ci.virtual_stage]
        ):
            features = state.visual_features
            grad = self._empty_rows() if features is None else features.grad
            self._pending.append(self.bridge.send_grads(mb.index, mb.routing, grad, wait=False))
        return start

    def _bridge_send_features(self, mb: MicrobatchPlan, features: Tensor) -> None:
        self._pending.append(self.bridge.send_features(mb.index, mb.routing, features, wait=False))

    def _tp_broadcast(self, tensor: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        """TP rank 0's ``tensor`` (bridge data) on every rank of the TP group; the other
        ranks pass None and allocate ``shape`` (from the StepPlan)."""
        if tensor is None:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            tensor = tensor.to(self.device, self.dtype).contiguous()
        dist.broadcast(tensor, self.topology.tp_ranks[0], group=self.topology.tp_group)
        return tensor

    def _empty_rows(self) -> Tensor:
        return torch.empty(0, self.bridge.hidden_size, dtype=self.dtype, device=self.device)

    def _input_shares(self, plan: StepPlan) -> tuple[list[EncoderShare], list[LLMShare]]:
        """The microbatch shares this rank reads from the batch source: pixels of its
        pieces on the first encoder stage, tokens and labels on first and last LLM stages
        (and on every LLM stage of a model whose positions come from the tokens)."""
        info = self.info
        if self.is_encoder:
            if not info.is_first_stage:
                return [], []
            shares = [mb.encoder[info.dp_rank] for mb in plan.microbatches]
            return [s for s in shares if not s.is_empty], []
        if not (info.is_first_stage or info.is_last_stage or self._token_positions):
            return [], []
        shares = [mb.llm[info.dp_rank] for mb in plan.microbatches]
        # A colocated first stage encodes its own share's images.
        own = [mb.encoder[info.dp_rank] for mb in plan.microbatches] if info.holds_encoder else []
        return [s for s in own if not s.is_empty], [s for s in shares if not s.is_empty]

    # ------------------------------------------------------------------ receives

    def _post(self, action: PipelineAction, mb: MicrobatchPlan) -> None:
        """Post the receive that ``action`` will wait for, if any (a ``W`` waits for none:
        its ``I`` took the gradient)."""
        if action.kind == "W":
            return
        key = (action.is_forward, action.stage, mb.index)
        if key not in self._posted:
            handle = self._receive(action.is_forward, self._chunks[action.stage][1], mb)
            if handle is not None:
                self._posted[key] = handle

    def _received(self, is_forward: bool, ci: RankInfo, mb: MicrobatchPlan) -> Tensor:
        """The input of chunk ``ci``'s action on ``mb``: its posted receive, or one posted
        now."""
        handle = self._posted.pop((is_forward, ci.virtual_stage, mb.index), None)
        if handle is None:
            handle = self._receive(is_forward, ci, mb)
        return handle.wait()

    def _receive(self, is_forward: bool, ci: RankInfo, mb: MicrobatchPlan) -> Any:
        """A handle (``.wait()`` -> tensor) on the message chunk ``ci``'s action on ``mb``
        consumes, or None if it consumes none. Shapes come from the StepPlan."""
        info = self.info
        stage = self._chunks[ci.virtual_stage][0]
        if not is_forward and not (
            self._runs_backward[ci.virtual_stage] and self._carries_gradient(ci, mb)
        ):
            return None
        if self.is_encoder:
            share = mb.encoder[info.dp_rank]
            if not is_forward and ci.is_last_stage:
                if self.bridge is None:  # TP rank > 0: the gradient comes by broadcast
                    return None
                return self.bridge.recv_grads(mb.index, mb.routing, as_tensor=True, wait=False)
            if share.is_empty or (is_forward and ci.is_first_stage):
                return None
            shape: tuple[int, ...] = (
                (share.tokens, stage.hidden_size)
                if stage.tokens_per_unit is None
                else (share.units, stage.tokens_per_unit, stage.hidden_size)
            )
        else:
            share = mb.llm[info.dp_rank]
            if is_forward and ci.is_first_stage:
                if self.bridge is None:
                    return None
                return self.bridge.recv_features(mb.index, mb.routing, as_tensor=True, wait=False)
            if share.is_empty or (not is_forward and ci.is_last_stage):
                return None
            shape = (share.tokens, stage.hidden_size)
        kind = p2p.FORWARD if is_forward else p2p.BACKWARD
        src = ci.prev_rank if is_forward else ci.next_rank
        requires_grad = (
            is_forward and self._input_grad[ci.virtual_stage] and self._carries_gradient(ci, mb)
        )
        return self._recv(shape, src, mb.index, kind, chunk=ci.chunk, requires_grad=requires_grad)

    # ------------------------------------------------------------------ p2p within a module

    def _tag(self, microbatch: int, kind: int, *, chunk: int, header: bool = False) -> int:
        return p2p.message_tag(
            microbatch, kind, header, chunk=chunk, num_chunks=self.info.num_chunks
        )

    def _send(self, tensor: Tensor, ci: RankInfo, microbatch: int, kind: int) -> None:
        """Send chunk ``ci``'s output (FORWARD) or its input's gradient (BACKWARD) to the
        neighbouring chunk, which may sit on the same rank pair in another round."""
        forward = kind == p2p.FORWARD
        dst = ci.next_rank if forward else ci.prev_rank
        chunk = ci.next_chunk if forward else ci.prev_chunk  # the receiving chunk
        tensor = tensor.contiguous()
        if self.debug:
            header = p2p.debug_header(
                microbatch, kind, tuple(tensor.shape), tensor.dtype, self.device
            )
            tag = self._tag(microbatch, kind, chunk=chunk, header=True)
            self._pending.append(_Sent(dist.isend(header, dst, tag=tag), header))
        work = dist.isend(tensor, dst, tag=self._tag(microbatch, kind, chunk=chunk))
        self._pending.append(_Sent(work, tensor))

    def _recv(
        self,
        shape: Sequence[int],
        src: int,
        microbatch: int,
        kind: int,
        *,
        chunk: int,
        requires_grad: bool,
    ) -> _Receiving:
        if self.debug:
            self._check_header(tuple(shape), src, microbatch, kind, chunk)
        buffer = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        work = dist.irecv(buffer, src, tag=self._tag(microbatch, kind, chunk=chunk))
        return _Receiving(work, buffer, requires_grad=requires_grad)

    def _check_header(
        self, shape: tuple[int, ...], src: int, microbatch: int, kind: int, chunk: int
    ) -> None:
        got = torch.empty(p2p.HEADER_LEN, dtype=torch.int64, device=self.device)
        tag = self._tag(microbatch, kind, chunk=chunk, header=True)
        dist.irecv(got, src, tag=tag).wait()
        problem = p2p.header_mismatch(got, p2p.debug_header(microbatch, kind, shape, self.dtype))
        if problem is not None:
            what = "activation" if kind == p2p.FORWARD else "gradient"
            raise ShapeMismatchError(
                f"rank {self.info.rank} expected the {what} of microbatch {microbatch} from "
                f"rank {src} with shape {shape}, but rank {src} sent a different one "
                f"({problem}): the ranks' StepPlans differ (build them from the same "
                "Schedule, shapes and layout on every rank)"
            )

    def _wait_sends(self) -> None:
        for handle in self._pending:
            handle.wait()
        self._pending.clear()

    # ------------------------------------------------------------------ collectives

    def _all_reduce_grads(self) -> None:
        """Sum gradients over the module's DP replicas, as one flat buffer (one collective).
        A replica that computed nothing this step contributes zeros, so every replica
        calls the collective with the same buffer size."""
        if len(self.topology.dp_ranks) == 1:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        if not params:  # a frozen stage (the same on every replica of its group)
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_tensor(p.grad) for p in params]  # a DTensor's local shard
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.topology.dp_group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def _sum_tied_grads(self) -> None:
        """A head tied to the token embedding lives on the first and the last LLM stage:
        sum the two copies' gradients so both take the same step (the gradient of the
        one tied parameter)."""
        tied = getattr(self.stage, "tied_parameter", None)
        param = tied() if callable(tied) else None
        group = self.topology.embedding_group
        if param is None or group is None or not param.requires_grad:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)

    def _global_loss_sum(self) -> float:
        """The global batch's loss sum on every rank (only last LLM stages contribute)."""
        total = self._loss_sum.clone()
        dist.all_reduce(total)
        return float(total.item())
