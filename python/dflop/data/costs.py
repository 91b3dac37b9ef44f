"""Analytic FLOP-based cost model: sample shapes -> per-sample stage times.

A stand-in for measured performance models (a later issue fits those from profiling):
it counts the matrix FLOPs of a ViT encoder + projector and of a decoder LLM and divides
by an achieved throughput (``gpu_flops * mfu``).

FLOP counts (a multiply-add is 2 FLOPs; training = ``train_flops_factor`` (3) x forward,
the backward pass costing twice the forward):

Encoder (per unit = one tile or frame of ``t`` tokens, hidden ``h``, MLP width ``I``, ``L``
layers), attention is bidirectional *within each unit*::

    patch embedding   2 * t * h * 3 * patch_px^2 * frames_per_patch
    linear            L * t * (2 * 4 * h^2 + 2 * 2 * h * I)   # qkv + out, fc1 + fc2
    attention         L * 4 * t^2 * h                          # QK^T and AV
    projector         p * 2 * (p_in * p_hid + p_hid * llm_h)   # p = t * projector_token_ratio

LLM (per sample of ``s = visual + text`` tokens of which ``a`` are targets, hidden ``h``,
``n_q``/``n_kv`` heads of size ``d``, SwiGLU width ``I``, vocabulary ``V``); packed samples
do not attend across samples, so the quadratic term is per sample; the LM head runs on the
target tokens only (what dflop's runtime computes, :mod:`dflop.models.loss`)::

    linear      s * L * (2 * h * d * (n_q + 2 * n_kv) + 2 * n_q * d * h + 2 * 3 * h * I)
    attention   L * 4 * n_q * d * s^2 * causal_fraction       # 0.5: causal masking skipped
    head        a * 2 * h * V

Costs are additive per sample; a microbatch's stage time is the sum of its samples'
costs plus a per-microbatch constant (kernel launches, pipeline hand-off, optimizer-free
fixed work), exposed separately as :attr:`AnalyticCostModel.microbatch_constant_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from dflop.data.families import get_family
from dflop.data.shapes import SampleShapes
from dflop.data.synthetic import MixSpec, synthetic_shapes
from dflop.errors import InputTypeError

__all__ = [
    "A100_BF16_FLOPS",
    "ENCODER_PRESETS",
    "LLM_PRESETS",
    "AnalyticCostModel",
    "EncoderConfig",
    "LLMConfig",
    "SampleCostModel",
    "synthetic_costs",
]

A100_BF16_FLOPS = 312e12
"""Dense BF16 tensor-core peak of an A100 (FLOP/s), the default ``gpu_flops``."""


def _check_positive_ints(obj: object, names: tuple[str, ...]) -> None:
    cls = type(obj).__name__
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InputTypeError(f"{cls}.{name}={value!r} must be an int")
        if value < 1:
            raise ValueError(f"{cls}.{name}={value} must be >= 1")


PIXEL_BYTES = 4
"""Bytes of a pixel value as the runtime's batch sources deliver them (float32)."""


@dataclass(frozen=True)
class EncoderConfig:
    """A ViT vision encoder plus its 2-layer MLP projector into the LLM.

    Attributes:
        name: preset name or a free label.
        hidden_size: ViT width.
        num_layers: ViT layers that run (layers after the feature layer are skipped).
        intermediate_size: ViT MLP width.
        num_heads: attention heads (must divide ``hidden_size``).
        tokens_per_unit: patch tokens per tile/frame at the native resolution
            (informational; costs use each sample's ``SampleShapes.tokens_per_unit``).
        patch_px: patch side in pixels (patch-embedding FLOPs, pixel bytes).
        frames_per_patch: frames one patch spans (1; Qwen2-VL's 3D patches span 2, an
            image repeated over them).
        learned_positions: a learned position table of ``tokens_per_unit`` rows (ViT,
            SigLIP); False for rotary positions (Qwen2-VL's ViT).
        projector_input_size: width the projector reads (``hidden_size``; ``4 *
            hidden_size`` after InternVL's pixel shuffle).
        projector_token_ratio: projector tokens per encoder token (1.0; 0.25 after pixel
            shuffle).
        projector_hidden_size: projector's inner width; ``None`` means the LLM's hidden
            size (LLaVA ``mlp2x_gelu``, InternVL ``mlp1``).
        default_family: the model family (:func:`dflop.data.get_family`) this encoder is
            used with, for :func:`synthetic_costs`.
    """

    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    tokens_per_unit: int
    patch_px: int = 14
    projector_input_size: int | None = None
    projector_token_ratio: float = 1.0
    projector_hidden_size: int | None = None
    default_family: str = "llava-ov"
    frames_per_patch: int = 1
    learned_positions: bool = True

    def __post_init__(self) -> None:
        _check_positive_ints(
            self,
            (
                "hidden_size",
                "num_layers",
                "intermediate_size",
                "num_heads",
                "tokens_per_unit",
                "patch_px",
                "frames_per_patch",
            ),
        )
        for name in ("projector_input_size", "projector_hidden_size"):
            if getattr(self, name) is not None:
                _check_positive_ints(self, (name,))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"EncoderConfig.num_heads={self.num_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        ratio = self.projector_token_ratio
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 < ratio <= 1):
            raise ValueError(f"EncoderConfig.projector_token_ratio={ratio!r} must be in (0, 1]")
        get_family(self.default_family)

    @property
    def pixels_per_token(self) -> int:
        """Pixel values one patch token reads (3 channels x patch^2 x frames)."""
        return 3 * self.patch_px**2 * self.frames_per_patch

    @property
    def input_bytes_per_token(self) -> int:
        """Bytes of those pixel values as the runtime's batch sources deliver them
        (float32, :data:`PIXEL_BYTES` each)."""
        return PIXEL_BYTES * self.pixels_per_token

    def forward_flops(
        self, encoder_units: np.ndarray, tokens_per_unit: np.ndarray, llm_hidden_size: int
    ) -> np.ndarray:
        """Forward FLOPs (float64) of encoder + projector for each sample."""
        units = np.asarray(encoder_units, dtype=np.float64)
        t = np.asarray(tokens_per_unit, dtype=np.float64)
        h = float(self.hidden_size)
        per_token = 2.0 * h * self.pixels_per_token + self.num_layers * (
            8.0 * h * h + 4.0 * h * self.intermediate_size
        )
        p_in = float(self.projector_input_size or self.hidden_size)
        p_hid = float(self.projector_hidden_size or llm_hidden_size)
        projector_per_token = (
            self.projector_token_ratio * 2.0 * (p_in * p_hid + p_hid * llm_hidden_size)
        )
        attention_per_unit = self.num_layers * 4.0 * h * t * t
        return units * (t * (per_token + projector_per_token) + attention_per_unit)


@dataclass(frozen=True)
class LLMConfig:
    """A decoder-only LLM (GQA attention, SwiGLU MLP, untied LM head).

    Attributes:
        name: preset name or a free label.
        hidden_size, num_layers, intermediate_size: model width, depth, MLP width.
        num_heads: query heads; ``num_kv_heads`` must divide it.
        num_kv_heads: key/value heads (grouped-query attention).
        vocab_size: LM-head width (logits are computed for the target tokens).
        head_dim: per-head size; ``None`` means ``hidden_size // num_heads``.
        causal_fraction: fraction of the ``s^2`` score matrix computed (0.5: causal
            masking with FlashAttention-style block skipping; 1.0: dense).
    """

    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    causal_fraction: float = 0.5

    def __post_init__(self) -> None:
        _check_positive_ints(
            self,
            (
                "hidden_size",
                "num_layers",
                "intermediate_size",
                "num_heads",
                "num_kv_heads",
                "vocab_size",
            ),
        )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LLMConfig.num_heads={self.num_heads} must divide "
                    f"hidden_size={self.hidden_size} (or set head_dim)"
                )
        else:
            _check_positive_ints(self, ("head_dim",))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LLMConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        frac = self.causal_fraction
        if not (isinstance(frac, (int, float)) and math.isfinite(frac) and 0 < frac <= 1):
            raise ValueError(f"LLMConfig.causal_fraction={frac!r} must be in (0, 1]")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of the layers' GEMMs (projections, MLP; not the head)."""
        h = float(self.hidden_size)
        d = float(self.resolved_head_dim)
        attn_proj = (
            2.0 * h * d * (self.num_heads + 2 * self.num_kv_heads) + 2.0 * self.num_heads * d * h
        )
        mlp = 6.0 * h * self.intermediate_size
        return self.num_layers * (attn_proj + mlp)

    @property
    def head_flops_per_target(self) -> float:
        """Forward FLOPs of the LM head per target token (``2 h V``)."""
        return 2.0 * self.hidden_size * self.vocab_size

    def forward_flops_parts(self, seq_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward ``(linear, attention)`` FLOPs (float64) of the layers of samples of
        ``seq_len`` tokens (the head apart: :attr:`head_flops_per_target`)."""
        s = np.asarray(seq_len, dtype=np.float64)
        linear = s * self.linear_flops_per_token
        attention = (
            self.num_layers
            * 4.0
            * self.num_heads
            * self.resolved_head_dim
            * self.causal_fraction
            * s
            * s
        )
        return linear, attention

    def forward_flops(
        self, seq_len: np.ndarray, target_tokens: np.ndarray | None = None
    ) -> np.ndarray:
        """Forward FLOPs (float64) of samples of ``seq_len`` tokens with the head on
        ``target_tokens`` of them (None: on every token, as in pre-training)."""
        linear, attention = self.forward_flops_parts(seq_len)
        targets = seq_len if target_tokens is None else target_tokens
        return linear + attention + self.head_flops_per_target * np.asarray(targets, np.float64)


ENCODER_PRESETS: dict[str, EncoderConfig] = {
    # SigLIP so400m-patch14-384 as LLaVA-OneVision uses it (penultimate layer: 26 of 27).
    "siglip-400m": EncoderConfig(
        name="siglip-400m",
        hidden_size=1152,
        num_layers=26,
        intermediate_size=4304,
        num_heads=16,
        tokens_per_unit=729,
        patch_px=14,
        default_family="llava-ov",
    ),
    # InternViT-6B-448px-V1.5 as InternVL-Chat-V1.5 uses it (45 of 48 layers), pixel
    # shuffle 0.5 before the projector.
    "vit-6b": EncoderConfig(
        name="vit-6b",
        hidden_size=3200,
        num_layers=45,
        intermediate_size=12800,
        num_heads=25,
        tokens_per_unit=1025,  # 32 x 32 patches + CLS (dropped after the encoder)
        patch_px=14,
        projector_input_size=12800,
        projector_token_ratio=0.25,
        default_family="internvl",
    ),
    # InternViT-300M-448px (InternVL2 small models).
    "vit-300m": EncoderConfig(
        name="vit-300m",
        hidden_size=1024,
        num_layers=24,
        intermediate_size=4096,
        num_heads=16,
        tokens_per_unit=1025,  # 32 x 32 patches + CLS (dropped after the encoder)
        patch_px=14,
        projector_input_size=4096,
        projector_token_ratio=0.25,
        default_family="internvl",
    ),
}
"""Vision encoders by name."""

LLM_PRESETS: dict[str, LLMConfig] = {
    "qwen2-0.5b": LLMConfig("qwen2-0.5b", 896, 24, 4864, 14, 2, 151936),  # Qwen2-0.5B
    "llm-7b": LLMConfig("llm-7b", 3584, 28, 18944, 28, 4, 152064),  # Qwen2-7B
    "llm-8b": LLMConfig("llm-8b", 4096, 32, 14336, 32, 8, 128256),  # Llama-3-8B
    "llm-32b": LLMConfig("llm-32b", 5120, 64, 27648, 40, 8, 152064),  # Qwen2.5-32B
    "llm-72b": LLMConfig("llm-72b", 8192, 80, 29568, 64, 8, 152064),  # Qwen2-72B
}
"""Decoder LLMs by name (real architectures' shapes)."""


def _resolve(kind: str, value: object, presets: dict) -> object:
    if isinstance(value, str):
        try:
            return presets[value]
        except KeyError:
            raise ValueError(
                f"unknown {kind} preset {value!r}; known: {', '.join(sorted(presets))}"
            ) from None
    return value


def _check_rate(name: str, value: object, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0 and (upper is None or value <= upper)):
        bound = f" and <= {upper}" if upper is not None else ""
        raise ValueError(f"{name}={value!r} must be finite, > 0{bound}")
    return value


@runtime_checkable
class SampleCostModel(Protocol):
    """What prices samples for the scheduler, the planner and the simulator: per-sample
    seconds of each module plus per-microbatch constants. Implemented by
    :class:`AnalyticCostModel` (FLOP counts at an assumed rate) and
    :class:`dflop.profiling.CostModel` (a measured ``PerformanceModel``, corrected online
    from measured microbatches); a ``PerformanceModel`` itself is only the fitted
    coefficients (data that a ``CostModel`` prices with)."""

    def costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N, 2) seconds per sample: (encoder + projector, LLM); additive per sample."""
        ...

    def head_costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N,) seconds of the LLM column that are its LM head and loss (on the sample's
        target tokens): the part that runs on the LLM's last pipeline stage only."""
        ...

    @property
    def microbatch_constant_s(self) -> np.ndarray:
        """(2,) seconds added once per microbatch: (encoder, LLM)."""
        ...

    def activation_bytes_per_token_layer(
        self, encoder: EncoderConfig, llm: LLMConfig
    ) -> tuple[float | None, float | None]:
        """Measured activation bytes per token and layer of (encoder, LLM) for the
        planner's memory model, or None where it has no measurement (the planner then
        uses its formula)."""
        ...


class AnalyticCostModel:
    """Per-sample stage costs in seconds from FLOP counts.

    Args:
        encoder: an :class:`EncoderConfig` or an ``ENCODER_PRESETS`` name.
        llm: an :class:`LLMConfig` or an ``LLM_PRESETS`` name.
        gpu_flops: peak FLOP/s of one GPU (default: A100 dense BF16).
        mfu: achieved fraction of ``gpu_flops`` for the LLM (and the encoder unless
            ``encoder_mfu`` is given).
        encoder_mfu: achieved fraction for encoder + projector (small tiles run less
            efficiently than long sequences); ``None`` means ``mfu``.
        train_flops_factor: training FLOPs / forward FLOPs (3: backward = 2x forward).
        encoder_microbatch_overhead_s, llm_microbatch_overhead_s: per-microbatch constant
            times (not part of :meth:`costs`).
    """

    def __init__(
        self,
        encoder: EncoderConfig | str = "siglip-400m",
        llm: LLMConfig | str = "llm-7b",
        *,
        gpu_flops: float = A100_BF16_FLOPS,
        mfu: float = 0.4,
        encoder_mfu: float | None = None,
        train_flops_factor: float = 3.0,
        encoder_microbatch_overhead_s: float = 2e-3,
        llm_microbatch_overhead_s: float = 5e-3,
    ) -> None:
        encoder_cfg = _resolve("encoder", encoder, ENCODER_PRESETS)
        llm_cfg = _resolve("llm", llm, LLM_PRESETS)
        if not isinstance(encoder_cfg, EncoderConfig):
            raise InputTypeError(
                f"encoder must be an EncoderConfig or preset name, got {type(encoder).__name__}"
            )
        if not isinstance(llm_cfg, LLMConfig):
            raise InputTypeError(
                f"llm must be an LLMConfig or preset name, got {type(llm).__name__}"
            )
        self.encoder: EncoderConfig = encoder_cfg
        self.llm: LLMConfig = llm_cfg
        self.gpu_flops = _check_rate("gpu_flops", gpu_flops)
        self.mfu = _check_rate("mfu", mfu, 1.0)
        self.encoder_mfu = (
            self.mfu if encoder_mfu is None else _check_rate("encoder_mfu", encoder_mfu, 1.0)
        )
        self.train_flops_factor = _check_rate("train_flops_factor", train_flops_factor)
        overheads = []
        for name, value in (
            ("encoder_microbatch_overhead_s", encoder_microbatch_overhead_s),
            ("llm_microbatch_overhead_s", llm_microbatch_overhead_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise InputTypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be finite and >= 0")
            overheads.append(float(value))
        self._microbatch_constant_s = np.array(overheads, dtype=np.float64)
        self._microbatch_constant_s.setflags(write=False)

    def __repr__(self) -> str:
        return (
            f"AnalyticCostModel(encoder={self.encoder.name!r}, llm={self.llm.name!r}, "
            f"gpu_flops={self.gpu_flops:.3g}, mfu={self.mfu}, encoder_mfu={self.encoder_mfu})"
        )

    @property
    def microbatch_constant_s(self) -> np.ndarray:
        """(2,) read-only seconds added once per microbatch: (encoder, LLM)."""
        return self._microbatch_constant_s

    @staticmethod
    def _check_shapes(shapes: object) -> SampleShapes:
        if not isinstance(shapes, SampleShapes):
            raise InputTypeError(f"shapes must be a SampleShapes, got {type(shapes).__name__}")
        return shapes

    def flops(self, shapes: SampleShapes) -> np.ndarray:
        """(N, 2) float64 training FLOPs per sample: (encoder + projector, LLM)."""
        shapes = self._check_shapes(shapes)
        out = np.empty((len(shapes), 2), dtype=np.float64)
        out[:, 0] = self.encoder.forward_flops(
            shapes.encoder_units, shapes.tokens_per_unit, self.llm.hidden_size
        )
        out[:, 1] = self.llm.forward_flops(shapes.seq_len, shapes.target_tokens)
        out *= self.train_flops_factor
        return out

    def costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N, 2) float64 seconds per sample: column 0 encoder + projector, column 1 LLM.

        Additive per sample; add :attr:`microbatch_constant_s` once per microbatch.
        """
        out = self.flops(shapes)
        out[:, 0] /= self.gpu_flops * self.encoder_mfu
        out[:, 1] /= self.gpu_flops * self.mfu
        return out

    def head_costs(self, shapes: SampleShapes) -> np.ndarray:
        """(N,) seconds of the LLM column that are the LM head (on the target tokens)."""
        shapes = self._check_shapes(shapes)
        flops = self.llm.head_flops_per_target * shapes.target_tokens.astype(np.float64)
        return flops * self.train_flops_factor / (self.gpu_flops * self.mfu)

    def activation_bytes_per_token_layer(
        self, encoder: EncoderConfig, llm: LLMConfig
    ) -> tuple[float | None, float | None]:
        """None, None: FLOP counts measure no memory (the planner's formula applies)."""
        return None, None

    def microbatch_time_s(self, shapes: SampleShapes) -> np.ndarray:
        """(2,) seconds of one microbatch made of ``shapes``: summed costs + the constant."""
        return self.costs(shapes).sum(axis=0) + self._microbatch_constant_s


def synthetic_costs(
    num_samples: int,
    seed: int = 0,
    encoder: EncoderConfig | str = "siglip-400m",
    llm: LLMConfig | str = "llm-7b",
    *,
    family: str | None = None,
    mix: MixSpec | None = None,
    gpu_flops: float = A100_BF16_FLOPS,
    mfu: float = 0.4,
) -> np.ndarray:
    """(N, 2) float64 per-sample seconds (encoder, LLM) of the embedded synthetic workload.

    Shapes come from :func:`dflop.data.synthetic_shapes` (``family`` defaults to the
    encoder's ``default_family``), costs from :class:`AnalyticCostModel`.
    """
    model = AnalyticCostModel(encoder, llm, gpu_flops=gpu_flops, mfu=mfu)
    shapes = synthetic_shapes(
        num_samples,
        seed=seed,
        family=model.encoder.default_family if family is None else family,
        mix=mix,
    )
    return model.costs(shapes)
