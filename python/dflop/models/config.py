"""Configurations of dflop's reference multimodal model, and named presets.

Every config is a frozen dataclass that validates itself on construction; a ``ValueError``
names the field to change (``"DecoderConfig.heads=3 must divide hidden=64"``). Derive a
variant with ``dataclasses.replace(config, field=value)``.

Presets (``MODEL_PRESETS``; the parts are in ``VISION_PRESETS`` / ``DECODER_PRESETS``, and
``model_config("VISION+DECODER")`` combines any two of them):

- ``tiny``: CPU tests (32 px images, 8 px patches -> 16 tokens per unit; hidden 64).
- ``small``: CPU profiling, about 6 M parameters.
- ``siglip-400m+llm-0.5b`` / ``siglip-400m+llm-7b``: GPU-sized, shaped like
  LLaVA-OneVision's SigLIP-so400m encoder (384 px, 14 px patches -> 729 tokens per unit)
  with Qwen2-0.5B-like / Qwen2-7B-like decoders.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DECODER_PRESETS",
    "MODEL_PRESETS",
    "VISION_PRESETS",
    "DecoderConfig",
    "ModelConfig",
    "ProjectorConfig",
    "VisionConfig",
    "model_config",
]


def _require_positive(owner: str, **fields: float) -> None:
    for name, value in fields.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name}={value} must be positive")


def _require_divides(owner: str, name: str, value: int, other_name: str, other: int) -> None:
    if other % value != 0:
        raise ValueError(f"{owner}.{name}={value} must divide {other_name}={other}")


@dataclass(frozen=True)
class VisionConfig:
    """A ViT encoder (SigLIP-like): patch embedding, pre-norm transformer blocks, final norm.

    An image unit (a tile or a video frame) of ``image_size_px`` x ``image_size_px`` pixels
    becomes ``tokens_per_unit = (image_size_px // patch_size_px) ** 2`` tokens. As in
    SigLIP (384 px, 14 px patches -> 27 x 27), a remainder of pixels is dropped.
    """

    image_size_px: int
    patch_size_px: int
    hidden: int
    layers: int
    heads: int
    mlp_hidden: int
    channels: int = 3
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        _require_positive(
            "VisionConfig",
            image_size_px=self.image_size_px,
            patch_size_px=self.patch_size_px,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            mlp_hidden=self.mlp_hidden,
            channels=self.channels,
            norm_eps=self.norm_eps,
        )
        if self.patch_size_px > self.image_size_px:
            raise ValueError(
                f"VisionConfig.patch_size_px={self.patch_size_px} must not exceed "
                f"image_size_px={self.image_size_px}"
            )
        _require_divides("VisionConfig", "heads", self.heads, "hidden", self.hidden)

    @property
    def patches_per_side(self) -> int:
        return self.image_size_px // self.patch_size_px

    @property
    def tokens_per_unit(self) -> int:
        """Encoder tokens per visual unit (image tile or video frame)."""
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params_per_layer(self) -> int:
        """Parameters of one transformer block."""
        h, m = self.hidden, self.mlp_hidden
        attention = 4 * (h * h + h)
        mlp = h * m + m + m * h + h
        norms = 2 * 2 * h
        return attention + mlp + norms

    def num_parameters(self) -> int:
        """Parameters of the whole encoder (embeddings, blocks, final norm)."""
        patch = self.channels * self.patch_size_px**2 * self.hidden + self.hidden
        positions = self.tokens_per_unit * self.hidden
        return patch + positions + self.layers * self.params_per_layer() + 2 * self.hidden


@dataclass(frozen=True)
class ProjectorConfig:
    """Two-layer MLP with GELU from ``vision_hidden`` to the decoder's ``hidden``
    (LLaVA's ``mlp2x_gelu``). ``mlp_hidden`` defaults to ``hidden``."""

    vision_hidden: int
    hidden: int
    mlp_hidden: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        _require_positive("ProjectorConfig", vision_hidden=self.vision_hidden, hidden=self.hidden)
        if self.mlp_hidden is not None:
            _require_positive("ProjectorConfig", mlp_hidden=self.mlp_hidden)

    @property
    def intermediate(self) -> int:
        """The width of the MLP's middle layer (``mlp_hidden`` or ``hidden``)."""
        return self.hidden if self.mlp_hidden is None else self.mlp_hidden

    def num_parameters(self) -> int:
        m = self.intermediate
        return self.vision_hidden * m + m + m * self.hidden + self.hidden


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only LLM (Llama/Qwen2-like): RMSNorm, rotary embeddings, grouped-query
    attention with ``kv_heads`` key/value heads, SwiGLU MLP, untied output head.

    ``max_seq_len`` bounds the length of one packed sample (not the packed total).
    ``attention_bias`` adds biases to the q/k/v projections (as Qwen2 does).
    ``image_newline`` appends a learned row (parameter ``image_newline`` of the stage that
    holds the token embedding) after the visual features of every sample that has
    units, as LLaVA-OneVision does after a video's frames: a per-sample operation that
    spans the sample's units, so it runs where all of them are together (the first LLM
    stage) and each visual sample takes ``units * tokens_per_unit + 1`` placeholders
    (``ModelConfig.llm_visual_tokens``).
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention_bias: bool = False
    image_newline: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        _require_positive(
            "DecoderConfig",
            vocab_size=self.vocab_size,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            mlp_hidden=self.mlp_hidden,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
        )
        _require_divides("DecoderConfig", "heads", self.heads, "hidden", self.hidden)
        _require_divides("DecoderConfig", "kv_heads", self.kv_heads, "heads", self.heads)
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"DecoderConfig.heads={self.heads} gives an odd head_dim={self.head_dim} "
                f"(hidden={self.hidden} / heads); rotary embeddings need an even head_dim"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params_per_layer(self) -> int:
        """Parameters of one transformer block."""
        h, d = self.hidden, self.head_dim
        q_out, kv_out = self.heads * d, self.kv_heads * d
        attention = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * h * self.mlp_hidden
        return attention + mlp + 2 * h

    def num_parameters(self) -> int:
        """Parameters of the whole decoder (embedding, blocks, final norm, head)."""
        embed_and_head = 2 * self.vocab_size * self.hidden
        newline = self.hidden if self.image_newline else 0
        return embed_and_head + self.layers * self.params_per_layer() + self.hidden + newline


@dataclass(frozen=True)
class ModelConfig:
    """The three parts of the multimodal model; checks that their widths agree."""

    vision: VisionConfig
    projector: ProjectorConfig
    decoder: DecoderConfig

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        for part in (self.vision, self.projector, self.decoder):
            part.validate()
        if self.projector.vision_hidden != self.vision.hidden:
            raise ValueError(
                f"ProjectorConfig.vision_hidden={self.projector.vision_hidden} must equal "
                f"VisionConfig.hidden={self.vision.hidden}"
            )
        if self.projector.hidden != self.decoder.hidden:
            raise ValueError(
                f"ProjectorConfig.hidden={self.projector.hidden} must equal "
                f"DecoderConfig.hidden={self.decoder.hidden}"
            )

    def llm_visual_tokens(self, encoder_units: Any) -> Any:
        """Placeholder positions the LLM gives a sample of ``encoder_units`` units (an int
        or an integer array): ``units * tokens_per_unit``, plus one newline row per
        visual sample with ``DecoderConfig.image_newline``."""
        visual = encoder_units * self.vision.tokens_per_unit
        if self.decoder.image_newline:
            visual = visual + (encoder_units > 0) * 1
        return visual

    def num_parameters(self) -> int:
        return (
            self.vision.num_parameters()
            + self.projector.num_parameters()
            + self.decoder.num_parameters()
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A JSON-serialisable dict (``from_dict`` reverses it)."""
        return {
            "vision": dataclasses.asdict(self.vision),
            "projector": dataclasses.asdict(self.projector),
            "decoder": dataclasses.asdict(self.decoder),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ModelConfig:
        """Parse ``to_dict``'s output; unknown or missing keys raise ``ValueError``."""
        parts: dict[str, Any] = {}
        for key, cls in (
            ("vision", VisionConfig),
            ("projector", ProjectorConfig),
            ("decoder", DecoderConfig),
        ):
            if key not in data:
                raise ValueError(f"ModelConfig dict is missing the key {key!r}")
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data[key]) - known)
            if unknown:
                raise ValueError(f"{cls.__name__} has no field {unknown[0]!r} (in {key!r})")
            try:
                parts[key] = cls(**data[key])
            except TypeError as err:  # a missing required field
                raise ValueError(f"{cls.__name__} ({key!r}): {err}") from None
        unknown_parts = sorted(set(data) - set(parts))
        if unknown_parts:
            raise ValueError(f"ModelConfig has no part {unknown_parts[0]!r}")
        return ModelConfig(**parts)


def _vision_from(name: str, image_size_px: int) -> VisionConfig:
    """A reference encoder shaped like ``dflop.data.costs.ENCODER_PRESETS[name]``."""
    from dflop.data.costs import ENCODER_PRESETS

    e = ENCODER_PRESETS[name]
    return VisionConfig(
        image_size_px=image_size_px,
        patch_size_px=e.patch_px,
        hidden=e.hidden_size,
        layers=e.num_layers,
        heads=e.num_heads,
        mlp_hidden=e.intermediate_size,
    )


def _decoder_from(name: str) -> DecoderConfig:
    """A reference decoder shaped like ``dflop.data.costs.LLM_PRESETS[name]`` (Qwen2:
    biased QKV, rope theta 1e6, 32k positions)."""
    from dflop.data.costs import LLM_PRESETS

    m = LLM_PRESETS[name]
    return DecoderConfig(
        vocab_size=m.vocab_size,
        hidden=m.hidden_size,
        layers=m.num_layers,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        mlp_hidden=m.intermediate_size,
        max_seq_len=32768,
        rope_theta=1e6,
        attention_bias=True,
    )


VISION_PRESETS: dict[str, VisionConfig] = {
    "tiny": VisionConfig(
        image_size_px=32, patch_size_px=8, hidden=64, layers=2, heads=4, mlp_hidden=128
    ),
    "small": VisionConfig(
        image_size_px=64, patch_size_px=8, hidden=128, layers=4, heads=4, mlp_hidden=512
    ),
    # SigLIP-so400m-patch14-384 as LLaVA-OneVision runs it (729 tokens per unit; the
    # layers up to its feature layer), from the one architecture description.
    "siglip-400m": _vision_from("siglip-400m", image_size_px=384),
}

DECODER_PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(
        vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, mlp_hidden=128, max_seq_len=4096
    ),
    "small": DecoderConfig(
        vocab_size=4096,
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        mlp_hidden=704,
        max_seq_len=8192,
    ),
    # Qwen2-0.5B and Qwen2-7B (untied heads), from the one architecture description.
    "llm-0.5b": _decoder_from("qwen2-0.5b"),
    "llm-7b": _decoder_from("llm-7b"),
}


def _combine(vision: str, decoder: str) -> ModelConfig:
    v, d = VISION_PRESETS[vision], DECODER_PRESETS[decoder]
    return ModelConfig(v, ProjectorConfig(vision_hidden=v.hidden, hidden=d.hidden), d)


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": _combine("tiny", "tiny"),
    "small": _combine("small", "small"),
    "siglip-400m+llm-0.5b": _combine("siglip-400m", "llm-0.5b"),
    "siglip-400m+llm-7b": _combine("siglip-400m", "llm-7b"),
}


def model_config(name: str) -> ModelConfig:
    """The preset ``name`` from ``MODEL_PRESETS``, or ``"VISION+DECODER"`` combining any
    ``VISION_PRESETS`` entry with any ``DECODER_PRESETS`` entry (e.g. ``"tiny+small"``)."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    vision, plus, decoder = name.partition("+")
    if plus and vision in VISION_PRESETS and decoder in DECODER_PRESETS:
        return _combine(vision, decoder)
    raise ValueError(
        f"unknown model preset {name!r}: use one of {sorted(MODEL_PRESETS)} or "
        f"'VISION+DECODER' with VISION in {sorted(VISION_PRESETS)} and DECODER in "
        f"{sorted(DECODER_PRESETS)}"
    )
