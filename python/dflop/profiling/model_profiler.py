"""Model profiler: measure forward+backward time and peak memory, fit a PerformanceModel.

``profile_model(vision, decoder, ...)`` times one training step without the optimizer
(forward, loss, ``backward()``) of

* the encoder (+ projector) over numbers of visual units per microbatch: the module is
  called as ``vision(pixel_values[U, C, H, W]) -> [U * tokens_per_unit, hidden]`` and the
  backward pass is driven by a random output gradient (as the LLM's gradient arrives in
  a pipeline);
* the decoder over packed microbatches *and mixes* of sequence lengths: several mixes
  share the same total number of tokens but differ in ``sum(seq^2)``, which makes the
  attention term identifiable; and the mixes differ in their share of target tokens (the
  last ``target_fractions[i % len]`` of every sequence of mix ``i`` are labelled, as an
  answer is; a mix of more than 1,024 tokens gets the targets of a 1,024-token one), which
  makes the LM head's term identifiable: the runtime runs the head and
  the loss on the target tokens only. The decoder is called as ``decoder.loss(input_embeds[T,
  hidden], cu_seqlens[num_seqs + 1], labels[T], chunk_tokens=...) -> (sum_loss,
  num_target_tokens)`` when it has a ``loss`` method (``chunk_tokens`` when it takes one:
  the runtime's chunked loss), else as ``decoder(input_embeds, cu_seqlens) -> logits[T,
  vocab]`` with a cross-entropy loss on the labelled positions. ``input_embeds`` requires
  grad (the encoder needs it).

Any module with these call signatures can be profiled (dflop's reference ``VisionTower``
and ``Decoder``, or a user's). Measurements: warm-up runs per shape, then ``repeats``
interleaved rounds over all shapes in a shuffled (seeded) order, so slow drift of a noisy
machine spreads over all shapes instead of biasing some; the median is kept. Time comes
from CUDA events on GPU and ``time.perf_counter`` on CPU.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during the step minus what was
allocated before it, plus the module's own weights. On CPU there is no allocator peak to
read, so it is *estimated* as weights + gradients + the inputs + every tensor autograd
saves for the backward pass (recorded with ``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded). That is the memory held at the
forward/backward boundary, where training peaks; transient workspace is not included.

Frozen parts (``profile_model(frozen_shapes=...)``): on an evenly spread subset of the
shapes (``frozen_shapes`` of each module's grid, default 8) two more variants
are timed, interleaved in the same rounds as the training step (same warm-up, repeats and
median): the *forward* alone under ``torch.no_grad()`` (a frozen stage with nothing
trained before it), and the *pass-through* step: forward+backward with every parameter's
``requires_grad`` off and the module's input requiring grad (the decoder's input
embeddings; the encoder's pixels, a detached copy sharing their storage), so autograd
computes the input gradient only and saves only what that needs (a frozen linear layer
keeps its weight, not its input): a frozen stage with a trained part before it. Its saved
activation bytes are measured as the training step's are (``saved_tensors_hooks``, on
every device; parameters and inputs excluded). ``requires_grad`` flags are restored
after every frozen run (the modules are the caller's), and gradients are dropped as for
the training step. A module whose output does not depend on a gradient-requiring input
(checked once, forward only) gets no pass-through measurement (``metadata[...]
["frozen"]`` says why). ``fit_performance_model`` turns these into
``PerformanceModel.forward_fraction``, ``passthrough_backward_factor`` and
``passthrough_activation_fraction``.

Tensor parallelism: on GPUs the caller passes modules already sharded for
``tensor_parallel_size`` ranks (run under torchrun) and the degree is recorded in the
result; on CPU only ``tensor_parallel_size=1`` is supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dflop.errors import InputTypeError
from dflop.profiling.perf_model import (
    FitReport,
    PerformanceModel,
    _jsonable,
    default_metadata,
    fit_encoder_time,
    fit_llm_time,
    fit_memory,
)

if TYPE_CHECKING:  # torch is imported lazily: dflop.profiling must import without it
    import torch

__all__ = [
    "DEFAULT_TARGET_FRACTIONS",
    "DecoderMeasurement",
    "EncoderMeasurement",
    "ProfileResult",
    "default_seq_len_mixes",
    "default_unit_counts",
    "fit_performance_model",
    "profile_model",
    "merge_profiles",
]

RESULT_FORMAT_NAME = "dflop.model_profile"
RESULT_FORMAT_VERSION = 1

DEFAULT_TARGET_FRACTIONS = (1 / 2, 1 / 8, 1 / 32)
"""Shares of a profiled sequence that are targets, cycled over the mixes: real
multimodal data has 2-15% of its tokens as targets, text-only data up to half."""

DEFAULT_FROZEN_SHAPES = 8
"""Shapes per module the frozen variants are measured on by default (``profile_model``'s
``frozen_shapes``): the shares are ratios, near-constant over the shapes, so a spread
subset pins them down at a fraction of the grid's cost."""

TARGET_TOKENS_SCALE = 1024
"""Mixes longer than this get the targets of a mix of this many tokens (see
``_target_lens``)."""


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderMeasurement:
    """One encoder microbatch shape: median time of forward+backward and peak memory.

    The frozen variants (None where not measured; see ``DecoderMeasurement``):
    ``forward_time_s``, ``passthrough_time_s``, ``saved_bytes`` (autograd's saved
    activations of the training step) and ``passthrough_saved_bytes``.
    """

    num_units: int
    time_s: float
    times_s: tuple[float, ...]
    peak_bytes: float
    forward_time_s: float | None = None
    passthrough_time_s: float | None = None
    saved_bytes: float | None = None
    passthrough_saved_bytes: float | None = None


@dataclass(frozen=True)
class DecoderMeasurement:
    """One packed decoder microbatch: its sequence lengths, median time, peak memory and
    target tokens (None: a profile written before targets were varied, every position
    with a next token was one).

    The frozen variants, None where not measured (a shape outside the frozen subset, a
    profile written before they were measured; the bytes: memory not measured):
    ``forward_time_s`` the median forward under ``torch.no_grad()``,
    ``passthrough_time_s`` the median forward+backward with the parameters frozen and the
    input requiring grad, ``saved_bytes`` / ``passthrough_saved_bytes`` the bytes autograd
    saved for the backward of the training / pass-through step (parameters and inputs
    excluded).
    """

    seq_lens: tuple[int, ...]
    time_s: float
    times_s: tuple[float, ...]
    peak_bytes: float
    target_lens: tuple[int, ...] | None = None
    forward_time_s: float | None = None
    passthrough_time_s: float | None = None
    saved_bytes: float | None = None
    passthrough_saved_bytes: float | None = None

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))

    @property
    def num_targets(self) -> int:
        if self.target_lens is None:
            return int(sum(s - 1 for s in self.seq_lens))
        return int(sum(self.target_lens))

    @property
    def sum_seq_sq(self) -> int:
        return int(sum(s * s for s in self.seq_lens))


@dataclass
class ProfileResult:
    """Raw measurements of ``profile_model``; ``fit_performance_model`` turns them into a
    ``PerformanceModel``. ``metadata`` describes hardware, dtype, torch, model configs."""

    encoder: list[EncoderMeasurement] = field(default_factory=list)
    decoder: list[DecoderMeasurement] = field(default_factory=list)
    tokens_per_unit: int = 0
    tensor_parallel_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT_NAME,
            "format_version": RESULT_FORMAT_VERSION,
            "tokens_per_unit": self.tokens_per_unit,
            "tensor_parallel_size": self.tensor_parallel_size,
            "encoder": [_jsonable(dataclasses.asdict(m)) for m in self.encoder],
            "decoder": [_jsonable(dataclasses.asdict(m)) for m in self.decoder],
            "metadata": _jsonable(self.metadata),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ProfileResult:
        if data.get("format") != RESULT_FORMAT_NAME:
            raise ValueError(
                f"not a dflop model profile: field 'format' is {data.get('format')!r}, "
                f"expected {RESULT_FORMAT_NAME!r}"
            )
        try:
            encoder = [
                EncoderMeasurement(
                    num_units=int(m["num_units"]),
                    time_s=float(m["time_s"]),
                    times_s=tuple(float(t) for t in m["times_s"]),
                    peak_bytes=_float_or_nan(m["peak_bytes"]),
                    **_frozen_fields(m),
                )
                for m in data.get("encoder", [])
            ]
            decoder = [
                DecoderMeasurement(
                    seq_lens=tuple(int(s) for s in m["seq_lens"]),
                    time_s=float(m["time_s"]),
                    times_s=tuple(float(t) for t in m["times_s"]),
                    peak_bytes=_float_or_nan(m["peak_bytes"]),
                    target_lens=(
                        None
                        if m.get("target_lens") is None
                        else tuple(int(t) for t in m["target_lens"])
                    ),
                    **_frozen_fields(m),
                )
                for m in data.get("decoder", [])
            ]
        except KeyError as err:
            raise ValueError(f"model profile measurement lacks field {err.args[0]!r}") from None
        return ProfileResult(
            encoder=encoder,
            decoder=decoder,
            tokens_per_unit=int(data.get("tokens_per_unit", 0)),
            tensor_parallel_size=int(data.get("tensor_parallel_size", 1)),
            metadata=dict(data.get("metadata") or {}),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> ProfileResult:
        with open(os.fspath(path), encoding="utf-8") as f:
            return ProfileResult.from_dict(json.load(f))


def merge_profiles(
    parts: Sequence[ProfileResult],
    encoder_order: Sequence[Sequence[int]],
    decoder_order: Sequence[Sequence[int]],
) -> ProfileResult:
    """One profile from ``parts``, each measured (in its own process, on the same model)
    on its share of one grid of shapes: ``encoder_order[k][j]`` / ``decoder_order[k][j]``
    is the grid position of part ``k``'s ``j``-th encoder / decoder measurement. The
    measurements come back in grid order; the metadata is the first part's, each module's
    from the first part that measured it, with the frozen variants' shape counts summed
    over the parts and ``metadata["processes"]`` the number of parts."""
    if not parts or len(encoder_order) != len(parts) or len(decoder_order) != len(parts):
        raise ValueError("merge_profiles needs one encoder and one decoder order per part")
    encoder: dict[int, EncoderMeasurement] = {}
    decoder: dict[int, DecoderMeasurement] = {}
    for part, enc, dec in zip(parts, encoder_order, decoder_order):
        if len(enc) != len(part.encoder) or len(dec) != len(part.decoder):
            raise ValueError("an order's length differs from its part's measurements")
        encoder.update(zip(enc, part.encoder))
        decoder.update(zip(dec, part.decoder))
    metadata = dict(parts[0].metadata)
    for module in ("vision", "decoder"):
        described = [p.metadata[module] for p in parts if module in p.metadata]
        if described:
            frozen = dict(described[0].get("frozen") or {})
            for key in ("forward_shapes", "passthrough_shapes"):
                frozen[key] = sum(int((d.get("frozen") or {}).get(key) or 0) for d in described)
            metadata[module] = {**described[0], "frozen": frozen}
    metadata["processes"] = len(parts)
    with_encoder = [p for p in parts if p.encoder]
    return ProfileResult(
        encoder=[encoder[i] for i in sorted(encoder)],
        decoder=[decoder[i] for i in sorted(decoder)],
        tokens_per_unit=with_encoder[0].tokens_per_unit if with_encoder else 0,
        tensor_parallel_size=parts[0].tensor_parallel_size,
        metadata=metadata,
    )


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


_FROZEN_MEASUREMENT_FIELDS = (
    "forward_time_s",
    "passthrough_time_s",
    "saved_bytes",
    "passthrough_saved_bytes",
)


def _frozen_fields(m: dict[str, Any]) -> dict[str, float | None]:
    """A measurement's frozen-variant fields from JSON (absent: None)."""
    return {
        name: None if m.get(name) is None else float(m[name]) for name in _FROZEN_MEASUREMENT_FIELDS
    }


# --------------------------------------------------------------------------------------
# Default shape grids
# --------------------------------------------------------------------------------------


def default_unit_counts(max_units: int = 16) -> list[int]:
    """Units per encoder microbatch: 1, 2, 3, 4, 6, 8, 12, 16, ... up to ``max_units``.

    Spread over the whole range so both the slope and the intercept are pinned down.
    """
    if int(max_units) < 2:
        raise ValueError(f"max_units must be >= 2, got {max_units}")
    counts: set[int] = {1, int(max_units)}
    value = 1.0
    while value < max_units:
        counts.add(int(round(value)))
        counts.add(int(round(value * 1.5)))
        value *= 2
    return sorted(c for c in counts if 1 <= c <= max_units)


def default_seq_len_mixes(
    max_tokens: int = 2048, *, num_totals: int = 4, min_seq_len: int = 32
) -> list[tuple[int, ...]]:
    """Packed decoder microbatches that identify ``a*tokens + b*sum(seq^2) + c``.

    For each total ``T`` in ``max_tokens / 2^k`` (``k < num_totals``), several mixes of the
    same total: one sequence, two halves, ``3T/4 + T/4``, four quarters, eight eighths
    (mixes with sequences shorter than ``min_seq_len`` are skipped). Equal totals with
    different ``sum(seq^2)`` separate the attention term from the linear one; different
    totals separate the constant.
    """
    if int(max_tokens) < 2 * min_seq_len:
        raise ValueError(
            f"max_tokens must be >= 2 * min_seq_len ({2 * min_seq_len}), got {max_tokens}"
        )
    if int(num_totals) < 1:
        raise ValueError(f"num_totals must be >= 1, got {num_totals}")
    mixes: list[tuple[int, ...]] = []
    for k in range(num_totals):
        total = int(max_tokens) >> k
        if total < min_seq_len:
            break
        candidates = [
            (total,),
            (total // 2, total - total // 2),
            (3 * total // 4, total - 3 * total // 4),
            tuple([total // 4] * 3 + [total - 3 * (total // 4)]),
            tuple([total // 8] * 7 + [total - 7 * (total // 8)]),
        ]
        for mix in candidates:
            if min(mix) >= min_seq_len and mix not in mixes:
                mixes.append(mix)
    return mixes


# --------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------


def _module_dtype_device(module: Any, what: str) -> tuple[torch.dtype, torch.device]:
    import torch

    for p in module.parameters():
        return p.dtype, p.device
    for b in module.buffers():
        if b.is_floating_point():
            return b.dtype, b.device
    return torch.get_default_dtype(), torch.device("cpu")


def _param_bytes(module: Any) -> int:
    return int(sum(p.numel() * p.element_size() for p in module.parameters()))


def _grad_bytes(module: Any) -> int:
    return int(sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad))


def _zero_grad(module: Any) -> None:
    for p in module.parameters():
        p.grad = None


def _config_of(module: Any) -> Any:
    for name in ("config", "vision_config", "decoder_config"):
        config = getattr(module, name, None)
        if config is not None:
            return config
    return None


def _describe_module(module: Any) -> dict[str, Any]:
    description: dict[str, Any] = {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "num_parameters": int(sum(p.numel() for p in module.parameters())),
    }
    for name in ("config", "vision_config", "projector_config", "decoder_config"):
        config = getattr(module, name, None)
        if config is not None and dataclasses.is_dataclass(config):
            description[name] = dataclasses.asdict(config)
    return description


def _hardware_metadata(device: torch.device) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "device": str(device),
        "device_type": device.type,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "num_threads": torch.get_num_threads(),
    }
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    meta["cpu_name"] = cpu_name
    meta["num_cpus"] = os.cpu_count()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        meta["device_name"] = props.name
        meta["device_memory_bytes"] = int(props.total_memory)
        meta["cuda_version"] = torch.version.cuda
    else:
        meta["device_name"] = cpu_name
    return meta


class _Timer:
    """Times a callable: CUDA events on GPU; on CPU ``time.perf_counter`` (``cpu_clock=
    "wall"``) or ``time.thread_time`` (``cpu_clock="thread"``)."""

    def __init__(self, device: torch.device, cpu_clock: str = "wall") -> None:
        self.device = device
        self.clock = time.thread_time if cpu_clock == "thread" else time.perf_counter

    def __call__(self, fn: Callable[[], None]) -> float:
        import torch

        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = self.clock()
        fn()
        return self.clock() - begin


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """``(key, bytes)`` of a tensor's storage: its address, or for a tensor without one
    (sparse, a wrapper subclass) the object's id and its elements' bytes."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), int(storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor), int(tensor.numel() * tensor.element_size())


def _storage_keys(tensors: Any) -> set[int]:
    import torch

    return {_storage_key(t)[0] for t in tensors if isinstance(t, torch.Tensor)}


def _saved_activation_bytes(fn: Callable[[], None], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    import torch

    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key, nbytes = _storage_key(tensor)
        if key not in seen and key not in exclude:
            seen.add(key)
            total += int(nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def _measure_peak_bytes(
    step: Callable[..., None],
    make_inputs: Callable[[], tuple[Any, ...]],
    module: Any,
    device: torch.device,
) -> tuple[float, float]:
    """``(peak memory, saved activation bytes)`` of one ``step(*make_inputs())`` (see the
    module docstring): on CUDA the allocator's peak, on CPU the estimate; the saved bytes
    from ``saved_tensors_hooks`` on both, parameters and inputs excluded."""
    import torch

    _zero_grad(module)
    param_ptrs = _storage_keys(module.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        inputs = make_inputs()
        input_ptrs = _storage_keys(inputs)
        torch.cuda.reset_peak_memory_stats(device)
        saved = _saved_activation_bytes(_bind(step, inputs), param_ptrs | input_ptrs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        _zero_grad(module)
        return float(peak - baseline + _param_bytes(module)), float(saved)
    inputs = make_inputs()
    input_bytes = sum(t.numel() * t.element_size() for t in inputs if hasattr(t, "numel"))
    input_ptrs = _storage_keys(inputs)
    saved = _saved_activation_bytes(_bind(step, inputs), param_ptrs | input_ptrs)
    _zero_grad(module)
    peak = _param_bytes(module) + _grad_bytes(module) + input_bytes + saved
    return float(peak), float(saved)


def _bind(step: Callable[..., Any], inputs: tuple[Any, ...]) -> Callable[[], Any]:
    return lambda: step(*inputs)


@contextlib.contextmanager
def _frozen(module: Any) -> Iterator[None]:
    """Every parameter of ``module`` with ``requires_grad`` off; the flags restored."""
    params = list(module.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def _with_input_grad(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with the first floating-point tensor (the module's input: pixels,
    input embeddings) requiring grad: itself if it does, else a detached alias."""
    import torch

    out = list(inputs)
    for i, t in enumerate(out):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            if not t.requires_grad:
                out[i] = t.detach().requires_grad_(True)
            break
    return tuple(out)


@dataclass
class _Timings:
    """What ``_Grid.run`` measured, indexed like its shapes: the training step's times,
    peak and saved bytes (nan: not measured), and the frozen variants' (None: that shape
    was not in the frozen subset); ``frozen_note`` says why pass-through was skipped."""

    times: list[list[float]]
    peaks: list[float]
    saved: list[float | None]
    forward: list[list[float] | None]
    passthrough: list[list[float] | None]
    passthrough_saved: list[float | None]
    frozen_note: str | None = None

    def frozen_fields(self, i: int) -> dict[str, float | None]:
        """Measurement fields of the frozen variants of shape ``i``."""
        fwd, pt = self.forward[i], self.passthrough[i]
        return {
            "forward_time_s": None if fwd is None else float(np.median(fwd)),
            "passthrough_time_s": None if pt is None else float(np.median(pt)),
            "saved_bytes": self.saved[i],
            "passthrough_saved_bytes": self.passthrough_saved[i],
        }


@dataclass(frozen=True)
class _Grid:
    """How every shape is measured: device, warm-up and timed rounds, the generators of
    the measurement order and of the inputs, memory, and the CPU clock."""

    device: torch.device
    warmup: int
    repeats: int
    rng: np.random.Generator
    generator: torch.Generator
    measure_memory: bool
    cpu_clock: str
    frozen_shapes: int | None = None

    def frozen_subset(self, num_shapes: int) -> list[int]:
        """Indices of the shapes the frozen variants are measured on: ``frozen_shapes``
        spread evenly over the grid, its first and last included (None: all)."""
        if self.frozen_shapes is None or self.frozen_shapes >= num_shapes:
            return list(range(num_shapes))
        if self.frozen_shapes <= 0:
            return []
        spread = np.linspace(0, num_shapes - 1, self.frozen_shapes)
        return sorted({int(round(float(x))) for x in spread})

    def run(
        self,
        shapes: Sequence[Any],
        make_inputs: Callable[[Any], tuple[Any, ...]],
        forward: Callable[..., Any],
        backward: Callable[..., None],
        module: Any,
    ) -> _Timings:
        """Times the training step ``backward(forward(*inputs), *inputs)`` of every shape
        (``inputs = make_inputs(shape)``) and, on the frozen subset, the forward alone and
        the pass-through step, all interleaved in the same shuffled rounds."""
        import torch

        timer = _Timer(self.device, self.cpu_clock)

        def train(*args: Any) -> None:
            for t in args:  # an input's gradient of the previous run
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.grad = None
            backward(forward(*args), *args)

        def infer(*args: Any) -> None:
            with torch.no_grad():
                forward(*args)

        num = len(shapes)
        inputs = [make_inputs(shape) for shape in shapes]
        subset = self.frozen_subset(num)
        note = None
        passthrough_inputs = {i: _with_input_grad(inputs[i]) for i in subset}
        if subset:
            with _frozen(module), torch.enable_grad():
                passes_gradient = bool(
                    getattr(forward(*passthrough_inputs[subset[0]]), "requires_grad", False)
                )
            if not passes_gradient:
                note = (
                    "pass-through not measured: with the parameters frozen, the output does "
                    "not depend on an input that requires grad"
                )
        kinds = ("forward",) if note else ("forward", "passthrough")
        jobs = [(i, "train") for i in range(num)] + [(i, k) for i in subset for k in kinds]

        def run_job(i: int, kind: str, clock: Callable[[Callable[[], None]], Any]) -> Any:
            _zero_grad(module)
            if kind == "train":
                return clock(_bind(train, inputs[i]))
            if kind == "forward":
                return clock(_bind(infer, inputs[i]))
            with _frozen(module):
                return clock(_bind(train, passthrough_inputs[i]))

        for i, kind in jobs:
            for _ in range(self.warmup):
                run_job(i, kind, lambda fn: fn())
        measured: dict[tuple[int, str], list[float]] = {job: [] for job in jobs}
        for _ in range(self.repeats):
            for j in self.rng.permutation(len(jobs)):
                measured[jobs[j]].append(run_job(*jobs[j], timer))
        _zero_grad(module)
        inputs.clear()  # frees them before the memory runs
        passthrough_inputs.clear()
        timings = _Timings(
            times=[measured[(i, "train")] for i in range(num)],
            peaks=[math.nan] * num,
            saved=[None] * num,
            forward=[measured.get((i, "forward")) for i in range(num)],
            passthrough=[measured.get((i, "passthrough")) for i in range(num)],
            passthrough_saved=[None] * num,
            frozen_note=note,
        )
        if self.measure_memory:
            for i, shape in enumerate(shapes):
                timings.peaks[i], timings.saved[i] = _measure_peak_bytes(
                    train, lambda s=shape: make_inputs(s), module, self.device
                )
            if "passthrough" in kinds:
                for i in subset:
                    with _frozen(module):
                        _, timings.passthrough_saved[i] = _measure_peak_bytes(
                            train,
                            lambda s=shapes[i]: _with_input_grad(make_inputs(s)),
                            module,
                            self.device,
                        )
        return timings


def _frozen_metadata(timings: _Timings) -> dict[str, Any]:
    """How many shapes the frozen variants were measured on (and why not, if not)."""
    return {
        "forward_shapes": sum(t is not None for t in timings.forward),
        "passthrough_shapes": sum(t is not None for t in timings.passthrough),
        "note": timings.frozen_note,
    }


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _image_shape_of(vision: Any) -> tuple[int, int, int] | None:
    config = _config_of(vision)
    channels = getattr(config, "channels", None)
    size = getattr(config, "image_size_px", None)
    if channels is not None and size is not None:
        return int(channels), int(size), int(size)
    return None


def _decoder_vocab_size(decoder: Any) -> int | None:
    config = _config_of(decoder)
    vocab = getattr(config, "vocab_size", None)
    return int(vocab) if vocab is not None else None


def _check_positive_ints(name: str, values: Sequence[Any]) -> list[int]:
    out = []
    for i, value in enumerate(values):
        if int(value) != value or int(value) < 1:
            raise ValueError(f"{name}[{i}] must be a positive integer, got {value!r}")
        out.append(int(value))
    return out


# --------------------------------------------------------------------------------------
# profile_model
# --------------------------------------------------------------------------------------


def profile_model(
    vision: Any,
    decoder: Any,
    *,
    device: str | torch.device = "cpu",
    unit_counts: Sequence[int] | None = None,
    seq_len_mixes: Sequence[Sequence[int]] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    image_shape: tuple[int, int, int] | None = None,
    vocab_size: int | None = None,
    num_threads: int | None = None,
    measure_memory: bool = True,
    cpu_clock: str = "wall",
    target_fractions: Sequence[float] = DEFAULT_TARGET_FRACTIONS,
    loss_chunk_tokens: int | None = None,
    frozen_shapes: int | None = DEFAULT_FROZEN_SHAPES,
) -> ProfileResult:
    """Time forward+backward and measure peak memory of an encoder and a decoder, and
    what frozen parts run (the forward alone; the pass-through step).

    Args:
        vision: encoder(+projector) module, ``vision(pixel_values[U, C, H, W]) ->
            [U * tokens_per_unit, hidden]``; ``None`` skips the encoder. Moved to ``device``.
        decoder: decoder module (see the module docstring for how it is called); ``None``
            skips the decoder. Moved to ``device``.
        device: ``"cpu"`` or ``"cuda[:i]"``.
        unit_counts: units per encoder microbatch (default ``default_unit_counts(8)`` on
            CPU, ``default_unit_counts(64)`` on CUDA).
        seq_len_mixes: packed decoder microbatches, each a list of sequence lengths
            (default ``default_seq_len_mixes(max_tokens)`` with ``max_tokens`` 1024 on CPU,
            16384 on CUDA, capped by the decoder config's ``max_seq_len``).
        warmup: untimed runs per shape before measuring (>= 0).
        repeats: timed runs per shape (>= 1); the median is kept.
        seed: seeds inputs and the measurement order.
        tensor_parallel_size: tp degree of the (already sharded) modules; 1 on CPU.
        image_shape: ``(C, H, W)`` of one unit; inferred from the module's config
            (``channels``, ``image_size_px``) when omitted.
        vocab_size: label range for the decoder loss; inferred from its config or by a
            one-token probe when omitted.
        num_threads: torch intra-op threads while profiling (CPU); restored afterwards.
        measure_memory: also measure peak memory per shape.
        cpu_clock: CPU only: ``"wall"`` (``time.perf_counter``, the default) or
            ``"thread"`` (``time.thread_time``: CPU time of the calling thread, which on a
            shared, oversubscribed machine excludes the time other processes held the
            core; needs ``num_threads=1``, as torch then runs forward and backward on the
            calling thread).
        target_fractions: shares of each sequence that are target tokens, cycled over
            the mixes (each in (0, 1]; at least one target and one prompt token per
            sequence): different shares separate the LM head's term from the body's.
        loss_chunk_tokens: the chunk of the runtime's chunked loss, passed to
            ``decoder.loss`` as ``chunk_tokens`` when it takes one (None: its default).
        frozen_shapes: per module, on how many of its shapes (spread evenly over the
            grid, first and last included) the frozen variants are measured: the forward
            under ``torch.no_grad()`` and the pass-through step (module docstring).
            Default :data:`DEFAULT_FROZEN_SHAPES`; None: all; 0: none. Measured on every
            shape they about double the profiling time (a forward is ~1/3 of a step, a
            pass-through 2/3 or more); the fitted shares are medians of per-shape ratios,
            which a few shapes pin down, so by default only a subset is measured (on
            the default CPU grids, 6 encoder and 19 decoder shapes, the whole profile
            takes ~1.5x as long as without them).

    Returns:
        A ``ProfileResult``; feed it to ``fit_performance_model``.
    """
    import torch

    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False")
    if int(tensor_parallel_size) < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if device.type == "cpu" and tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs GPUs; on CPU only 1 is supported"
        )
    if int(warmup) < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if vision is None and decoder is None:
        raise ValueError("vision and decoder are both None: nothing to profile")
    for name, module in (("vision", vision), ("decoder", decoder)):
        if module is not None and not isinstance(module, torch.nn.Module):
            raise InputTypeError(f"{name} must be a torch.nn.Module, got {type(module).__name__}")

    on_gpu = device.type == "cuda"
    if unit_counts is None:
        unit_counts = default_unit_counts(64 if on_gpu else 8)
    units = _check_positive_ints("unit_counts", unit_counts)
    if seq_len_mixes is None:
        max_tokens = 16384 if on_gpu else 1024
        max_seq_len = getattr(_config_of(decoder), "max_seq_len", None)
        if max_seq_len is not None:
            max_tokens = min(max_tokens, int(max_seq_len))
        seq_len_mixes = default_seq_len_mixes(max_tokens)
    mixes_in = seq_len_mixes
    mixes = [
        tuple(_check_positive_ints(f"seq_len_mixes[{i}]", mix)) for i, mix in enumerate(mixes_in)
    ]
    for i, mix in enumerate(mixes):
        if not mix:
            raise ValueError(f"seq_len_mixes[{i}] is empty")
    fractions = [float(f) for f in target_fractions]
    if not fractions or not all(0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"target_fractions={target_fractions!r} must be shares in (0, 1]")
    if loss_chunk_tokens is not None and int(loss_chunk_tokens) < 1:
        raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens!r} must be >= 1")
    if frozen_shapes is not None and (
        isinstance(frozen_shapes, bool) or int(frozen_shapes) != frozen_shapes or frozen_shapes < 0
    ):
        raise ValueError(f"frozen_shapes={frozen_shapes!r} must be None or an integer >= 0")
    if vision is not None and not units:
        raise ValueError("unit_counts is empty")
    if decoder is not None and not mixes:
        raise ValueError("seq_len_mixes is empty")

    if cpu_clock not in ("wall", "thread"):
        raise ValueError(f"cpu_clock must be 'wall' or 'thread', got {cpu_clock!r}")
    if cpu_clock == "thread" and device.type == "cpu":
        threads = torch.get_num_threads() if num_threads is None else int(num_threads)
        if threads != 1:
            raise ValueError(
                f"cpu_clock='thread' needs num_threads=1 (torch would use {threads} threads, "
                "whose work the calling thread's clock does not see)"
            )
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        if int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(int(num_threads))
    grid = _Grid(
        device=device,
        warmup=int(warmup),
        repeats=int(repeats),
        rng=np.random.default_rng(seed),
        generator=torch.Generator(device="cpu").manual_seed(int(seed)),
        measure_memory=bool(measure_memory),
        cpu_clock=cpu_clock,
        frozen_shapes=None if frozen_shapes is None else int(frozen_shapes),
    )
    metadata: dict[str, Any] = {
        **default_metadata(),
        **_hardware_metadata(device),
        "tensor_parallel_size": int(tensor_parallel_size),
        "warmup": int(warmup),
        "repeats": int(repeats),
        "seed": int(seed),
        "frozen_shapes": None if frozen_shapes is None else int(frozen_shapes),
        "timer": (
            "cuda_events"
            if device.type == "cuda"
            else "time.thread_time"
            if cpu_clock == "thread"
            else "time.perf_counter"
        ),
        "memory_method": (
            "none"
            if not measure_memory
            else "cuda.max_memory_allocated"
            if device.type == "cuda"
            else "estimate: weights + grads + inputs + autograd saved tensors"
        ),
    }
    result = ProfileResult(tensor_parallel_size=int(tensor_parallel_size), metadata=metadata)
    try:
        cuda_devices = []
        if device.type == "cuda":
            cuda_devices = [
                device.index if device.index is not None else torch.cuda.current_device()
            ]
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(int(seed))
            if vision is not None:
                _profile_vision(vision, units, image_shape, grid, result)
            if decoder is not None:
                shapes = [
                    (mix, _target_lens(mix, fractions[i % len(fractions)]))
                    for i, mix in enumerate(mixes)
                ]
                _profile_decoder(decoder, shapes, vocab_size, loss_chunk_tokens, grid, result)
    finally:
        if num_threads is not None:
            torch.set_num_threads(previous_threads)
    return result


def _profile_vision(
    vision: Any,
    units: list[int],
    image_shape: tuple[int, int, int] | None,
    grid: _Grid,
    result: ProfileResult,
) -> None:
    import torch

    device, generator = grid.device, grid.generator

    vision.to(device)
    vision.train()
    dtype, _ = _module_dtype_device(vision, "vision")
    shape = image_shape if image_shape is not None else _image_shape_of(vision)
    if shape is None:
        raise ValueError(
            "image_shape is required: the vision module has no config with "
            "'channels' and 'image_size_px'"
        )
    if len(shape) != 3 or any(int(s) < 1 for s in shape):
        raise ValueError(f"image_shape must be (channels, height, width) > 0, got {shape!r}")

    with torch.no_grad():
        probe = vision(torch.zeros((1, *shape), dtype=dtype, device=device))
    if probe.dim() != 2:
        raise ValueError(
            "vision(pixel_values[U, C, H, W]) must return [U * tokens_per_unit, hidden], "
            f"got shape {tuple(probe.shape)}"
        )
    tokens_per_unit, hidden = int(probe.shape[0]), int(probe.shape[1])
    out_dtype = probe.dtype
    del probe

    def make_inputs(num_units: int) -> tuple[Any, ...]:
        pixels = torch.randn((num_units, *shape), generator=generator, dtype=torch.float32)
        grad = torch.randn((num_units * tokens_per_unit, hidden), generator=generator)
        return (
            pixels.to(device=device, dtype=dtype),
            grad.to(device=device, dtype=out_dtype),
        )

    def forward(pixels: Any, grad_out: Any) -> Any:
        return vision(pixels)

    def backward(out: Any, pixels: Any, grad_out: Any) -> None:
        out.backward(grad_out)

    timings = grid.run(units, make_inputs, forward, backward, vision)
    result.tokens_per_unit = tokens_per_unit
    result.encoder = [
        EncoderMeasurement(
            num_units=u,
            time_s=float(np.median(t)),
            times_s=tuple(t),
            peak_bytes=p,
            **timings.frozen_fields(i),
        )
        for i, (u, t, p) in enumerate(zip(units, timings.times, timings.peaks))
    ]
    result.metadata["vision"] = {
        **_describe_module(vision),
        "dtype": _dtype_name(dtype),
        "image_shape": list(shape),
        "tokens_per_unit": tokens_per_unit,
        "output_hidden": hidden,
        "frozen": _frozen_metadata(timings),
    }
    result.metadata.setdefault("dtype", _dtype_name(dtype))


def _target_lens(mix: tuple[int, ...], fraction: float) -> tuple[int, ...]:
    """Targets of each sequence: ``fraction`` of its length, of at most
    :data:`TARGET_TOKENS_SCALE` tokens of the mix (a long mix gets the targets of one of
    that size, spread over its sequences: the head's cost is per target, not per token,
    and long mixes are there for the attention term), within ``[1, length - 1]`` (a
    one-token sequence has none)."""
    scale = min(1.0, TARGET_TOKENS_SCALE / max(sum(mix), 1))
    return tuple(max(0, min(s - 1, max(1, round(fraction * scale * s)))) for s in mix)


def _profile_decoder(
    decoder: Any,
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    vocab_size: int | None,
    chunk_tokens: int | None,
    grid: _Grid,
    result: ProfileResult,
) -> None:
    import torch
    import torch.nn.functional as F

    device, generator = grid.device, grid.generator

    decoder.to(device)
    decoder.train()
    dtype, _ = _module_dtype_device(decoder, "decoder")
    if not hasattr(decoder, "embed"):
        raise InputTypeError(
            "decoder must have an embed(token_ids) method (to infer the hidden size)"
        )
    with torch.no_grad():
        probe = decoder.embed(torch.zeros(1, dtype=torch.long, device=device))
        hidden = int(probe.shape[-1])
        if vocab_size is None:
            vocab_size = _decoder_vocab_size(decoder)
        if vocab_size is None:
            cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
            vocab_size = int(decoder(probe.reshape(1, hidden), cu).shape[-1])
    if int(vocab_size) < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    has_loss = callable(getattr(decoder, "loss", None))
    loss_kwargs: dict[str, Any] = {}
    takes_chunk = has_loss and "chunk_tokens" in inspect.signature(decoder.loss).parameters
    if takes_chunk and chunk_tokens is not None:
        loss_kwargs["chunk_tokens"] = int(chunk_tokens)

    def make_inputs(shape: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[Any, ...]:
        mix, target_lens = shape
        total = sum(mix)
        embeds = torch.randn((total, hidden), generator=generator) * 0.02
        ids = torch.randint(0, int(vocab_size), (total,), generator=generator)
        labels = torch.full((total,), -100, dtype=torch.long)
        end = 0
        for length, targets in zip(mix, target_lens):  # the last `targets` of each: answers
            end += length
            labels[end - targets : end] = ids[end - targets : end]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(mix)]), dtype=torch.int32)
        embeds = embeds.to(device=device, dtype=dtype).requires_grad_(True)
        return embeds, cu.to(device), labels.to(device)

    def forward(embeds: Any, cu_seqlens: Any, labels: Any) -> Any:
        if has_loss:
            sum_loss, num_targets = decoder.loss(embeds, cu_seqlens, labels, **loss_kwargs)
            # stays on the device: no host sync between forward and backward
            count = torch.as_tensor(num_targets, device=sum_loss.device)
            return sum_loss / count.clamp(min=1).to(sum_loss.dtype)
        logits = decoder(embeds, cu_seqlens)
        return F.cross_entropy(logits.float(), labels, ignore_index=-100)

    def backward(loss: Any, *inputs: Any) -> None:
        loss.backward()

    timings = grid.run(shapes, make_inputs, forward, backward, decoder)
    result.decoder = [
        DecoderMeasurement(
            seq_lens=tuple(m),
            time_s=float(np.median(t)),
            times_s=tuple(t),
            peak_bytes=p,
            target_lens=tuple(a),
            **timings.frozen_fields(i),
        )
        for i, ((m, a), t, p) in enumerate(zip(shapes, timings.times, timings.peaks))
    ]
    result.metadata["decoder"] = {
        **_describe_module(decoder),
        "dtype": _dtype_name(dtype),
        "hidden": hidden,
        "vocab_size": int(vocab_size),
        "loss": "decoder.loss" if has_loss else "cross_entropy(decoder(...))",
        "loss_chunk_tokens": loss_kwargs.get("chunk_tokens"),
        "frozen": _frozen_metadata(timings),
    }
    result.metadata.setdefault("dtype", _dtype_name(dtype))


# --------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------


def fit_performance_model(
    result: ProfileResult, holdout_fraction: float = 0.25, *, seed: int = 0
) -> PerformanceModel:
    """Fit a ``PerformanceModel`` to profiled measurements.

    A seeded random ``holdout_fraction`` of each component's shapes is left out of the
    fit and used to report the held-out error (``encoder_fit`` / ``llm_fit``); the
    coefficients come from the other shapes only. A component that was not profiled gets
    zero coefficients and an empty report.

    The frozen parts' shares (see ``PerformanceModel``) are, per module, the median over
    the shapes where the frozen variants were measured (all of them, no hold-out) of

    * ``forward_fraction``: ``forward_time_s / time_s``;
    * ``passthrough_backward_factor``: ``(passthrough_time_s - forward_time_s) / (time_s -
      forward_time_s)`` (shapes whose backward took no measurable time left out);
    * ``passthrough_activation_fraction``: ``passthrough_saved_bytes / saved_bytes``
      (shapes saving nothing left out);

    each clipped to [0, 1] (timing noise can push a ratio past its bounds). A median of
    ratios: robust to a noisy shape, and the shares are near-constant over the shapes.
    Each share is an ``(encoder, llm)`` pair, so it is None unless both modules have it.
    """
    if not isinstance(result, ProfileResult):
        raise InputTypeError(f"result must be a ProfileResult, got {type(result).__name__}")
    from dflop.profiling.perf_model import (
        EncoderTimeCoefficients,
        LLMTimeCoefficients,
        MemoryCoefficients,
    )

    encoder = EncoderTimeCoefficients(0.0, 0.0)
    encoder_fit = FitReport.empty()
    encoder_memory = MemoryCoefficients(0.0, 0.0)
    if result.encoder:
        units = np.array([m.num_units for m in result.encoder], dtype=np.float64)
        times = np.array([m.time_s for m in result.encoder])
        encoder, encoder_fit = fit_encoder_time(
            units, times, holdout_fraction=holdout_fraction, seed=seed
        )
        peaks = np.array([m.peak_bytes for m in result.encoder])
        if np.all(np.isfinite(peaks)):
            encoder_memory = fit_memory(units, peaks)

    llm = LLMTimeCoefficients(0.0, 0.0, 0.0)
    llm_fit = FitReport.empty()
    llm_memory = MemoryCoefficients(0.0, 0.0)
    if result.decoder:
        tokens = np.array([m.num_tokens for m in result.decoder], dtype=np.float64)
        sq = np.array([m.sum_seq_sq for m in result.decoder], dtype=np.float64)
        targets = np.array([m.num_targets for m in result.decoder], dtype=np.float64)
        times = np.array([m.time_s for m in result.decoder])
        # The head's own term needs targets that vary apart from the tokens (a profile
        # whose every position was a target leaves the head in per_token_s).
        varied = any(m.target_lens is not None for m in result.decoder)
        llm, llm_fit = fit_llm_time(
            tokens,
            sq,
            times,
            num_targets=targets if varied else None,
            holdout_fraction=holdout_fraction,
            seed=seed,
        )
        peaks = np.array([m.peak_bytes for m in result.decoder])
        if np.all(np.isfinite(peaks)):
            llm_memory = fit_memory(tokens, peaks)

    metadata = dict(result.metadata)
    metadata["memory_measured"] = {
        "encoder": bool(result.encoder)
        and bool(np.all(np.isfinite([m.peak_bytes for m in result.encoder]))),
        "llm": bool(result.decoder)
        and bool(np.all(np.isfinite([m.peak_bytes for m in result.decoder]))),
    }
    if result.decoder and not any(m.target_lens is not None for m in result.decoder):
        metadata["head_per_token"] = True
    metadata["fit"] = {
        "holdout_fraction": holdout_fraction,
        "seed": seed,
        "objective": "relative NNLS",
    }
    shares = [_frozen_shares(result.encoder), _frozen_shares(result.decoder)]
    pairs: list[tuple[float, float] | None] = []
    for k in range(3):
        encoder_share, llm_share = shares[0][k], shares[1][k]
        both = encoder_share is not None and llm_share is not None
        pairs.append((encoder_share, llm_share) if both else None)  # type: ignore[arg-type]
    return PerformanceModel(
        encoder=encoder,
        llm=llm,
        encoder_memory=encoder_memory,
        llm_memory=llm_memory,
        tensor_parallel_size=result.tensor_parallel_size,
        tokens_per_unit=result.tokens_per_unit,
        encoder_fit=encoder_fit,
        llm_fit=llm_fit,
        metadata=metadata,
        forward_fraction=pairs[0],
        passthrough_backward_factor=pairs[1],
        passthrough_activation_fraction=pairs[2],
    )


def _frozen_shares(
    measurements: Sequence[EncoderMeasurement | DecoderMeasurement],
) -> tuple[float | None, float | None, float | None]:
    """One module's (forward fraction, pass-through backward factor, pass-through
    activation fraction): medians of per-shape ratios, clipped to [0, 1] (None: no shape
    to take it from)."""
    forward, backward, activations = [], [], []
    for m in measurements:
        full, fwd, through = m.time_s, m.forward_time_s, m.passthrough_time_s
        if fwd is not None and full > 0:
            forward.append(fwd / full)
            if through is not None and full > fwd:
                backward.append((through - fwd) / (full - fwd))
        saved, saved_through = m.saved_bytes, m.passthrough_saved_bytes
        if saved is not None and saved_through is not None and saved > 0 and math.isfinite(saved):
            activations.append(saved_through / saved)

    def share(ratios: list[float]) -> float | None:
        return float(np.clip(np.median(ratios), 0.0, 1.0)) if ratios else None

    return share(forward), share(backward), share(activations)
