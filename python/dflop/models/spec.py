"""The model interface dflop's runtime trains through: one :class:`ModelSpec` per model.

A spec bundles what the runtime needs of a model family (torchtitan's ModelSpec plays the
same role): the layer counts a layout splits, the builder of one rank's pipeline stage, the
number of feature rows a visual unit sends over the bridge, and the model's checkpoint
format. dflop's reference model (:class:`ReferenceSpec`) and the Hugging Face adapters
(:mod:`dflop.models.hf`) are implementations; :func:`~dflop.models.registry.model_spec`
finds one by name.

Stages (the modules :meth:`ModelSpec.build_stage` returns) follow two protocols, so that the
pipeline engine calls only what they declare:

- :class:`EncoderStageModule`: ``forward(x)``; the first stage takes pixels ``[U, C, H, W]``,
  the last returns projected features ``[U * tokens_per_unit, output_size]`` (what the
  bridge carries), the others map ``[U, tokens_per_unit, hidden_size]`` hidden states.
- :class:`LLMStageModule`: ``embed`` and ``merge_visual`` on the first stage (the per-sample
  visual operations of the model, e.g. LLaVA-OneVision's unpadding and newline rows, run
  there, where all of a sample's units have arrived), ``hidden_states`` on every stage and
  ``loss`` (summed next-token cross-entropy within each packed sample, the head on the
  target tokens only, in chunks) on the last. A
  stage with a ``position_ids(text)`` method (Qwen-VL's multimodal rotary positions) gets
  them from the tokens on every stage, passed to ``hidden_states`` and ``loss`` as
  ``position_ids=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dflop.batch.visual import VisualItem

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from dflop.batch.text import TextInputs
    from dflop.data.costs import EncoderConfig, LLMConfig
    from dflop.data.families import FamilySpec
    from dflop.models.config import ModelConfig

__all__ = [
    "EncoderStageModule",
    "LLMStageModule",
    "ModelSpec",
    "ReferenceSpec",
    "StageInfo",
    "StageSlice",
    "VisualItem",
]


class StageInfo(Protocol):
    """What a spec reads of the place of the stage it builds: the module, its layers and
    whether it is the module's first / last stage. A runtime
    :class:`~dflop.runtime.topology.RankInfo` (or one of its chunks) is one;
    :class:`StageSlice` another."""

    @property
    def module(self) -> str: ...

    @property
    def layer_range(self) -> tuple[int, int]: ...

    @property
    def is_first_stage(self) -> bool: ...

    @property
    def is_last_stage(self) -> bool: ...


@dataclass(frozen=True)
class StageSlice:
    """A :class:`StageInfo` of its own: layers ``layer_range`` of ``module`` (``"encoder"``
    or ``"llm"``); by default the whole module as one stage, with its embedding and head."""

    module: str
    layer_range: tuple[int, int]
    is_first_stage: bool = True
    is_last_stage: bool = True


@runtime_checkable
class EncoderStageModule(Protocol):
    """A pipeline stage of the vision encoder (see the module docstring)."""

    tokens_per_unit: int | None
    """Feature rows per visual unit, between encoder stages and over the bridge; None for a
    patch-sequence encoder (Qwen-VL): units of any size, pixels one row per patch, called
    as ``forward(x, unit_grid)`` with the ``[U, 3]`` (t, h, w) patch grid of each unit,
    activations ``[tokens, hidden_size]`` between stages."""
    hidden_size: int
    """Width of the hidden states between encoder stages."""
    output_size: int
    """Width of the projected features the last stage sends over the bridge."""

    def forward(self, x: Tensor) -> Tensor: ...


@runtime_checkable
class LLMStageModule(Protocol):
    """A pipeline stage of the decoder LLM over packed samples (see the module docstring)."""

    hidden_size: int
    visual_newline: bool | None
    """What ``StepPlan.visual_newline`` must say for this model (None: the model counts
    its visual tokens by its own rule, which ``merge_visual`` checks per sample)."""

    def embed(self, token_ids: Tensor) -> Tensor: ...

    def merge_visual(
        self,
        input_embeds: Tensor,
        features: Tensor,
        text: TextInputs,
        rows_per_sample: list[int],
    ) -> Tensor: ...

    def hidden_states(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        """``cu_seqlens``: a CPU int64 tensor (the runtime passes it on the host)."""
        ...

    def loss(
        self, input_embeds: Tensor, cu_seqlens: Tensor, labels: Tensor, *, chunk_tokens: int
    ) -> tuple[Tensor, Tensor]:
        """Summed loss and target count; the head runs on targets only, ``chunk_tokens``
        at a time (:func:`dflop.models.loss.chunked_lm_loss`)."""
        ...


class ModelSpec:
    """What the runtime, the planner and the profiler need of one model (see the module
    docstring). Subclasses set the attributes below and implement :meth:`build_stage` and
    :meth:`architecture`."""

    name: str
    encoder_layers: int
    llm_layers: int
    tokens_per_unit: int
    visual_newline: bool | None
    image_shape: tuple[int, int, int] | None
    """``(channels, height, width)`` of one visual unit's pixels (None for a patch-sequence
    encoder, whose units have no fixed size)."""
    max_seq_len: int
    """The longest packed sequence the LLM takes (its position limit)."""
    token_merge: int = 1
    """Encoder tokens per feature row sent to the LLM (Qwen-VL's 2 x 2 merger: 4)."""
    family: FamilySpec | None = None
    """The model's own shape rules (a Hugging Face model: units and visual tokens exactly
    as its code makes them; training data is fed unscaled), or None for a model trained on
    a data family's shapes scaled onto it (dflop's reference model)."""
    projector_prefixes: tuple[str, ...] = ()
    """Name prefixes of the projector's parameters (they live on the encoder's last stage;
    the rest of an encoder stage is the vision tower)."""

    def parameter_part(self, module: str, name: str) -> str:
        """The part (:data:`dflop.models.trainable.PARTS`) parameter ``name`` of a
        ``module`` stage belongs to."""
        if module == "llm":
            return "llm"
        return "projector" if name.startswith(self.projector_prefixes) else "encoder"

    def build_stage(
        self,
        info: StageInfo,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """The stage holding layers ``info.layer_range`` of ``info.module``, whole: the
        stage declares its tensor-parallel plan (``tensor_parallel_plan()``,
        ``tensor_parallel_sizes()``) and the runtime shards it
        (:func:`dflop.runtime.engine.build_stage`)."""
        raise NotImplementedError

    def architecture(self) -> tuple[EncoderConfig, LLMConfig]:
        """The one architecture description of the model (layers, widths, heads, KV heads,
        vocabulary): the analytic cost model, the planner's memory and communication model
        and the planner core all derive from it."""
        raise NotImplementedError

    def dataset_inputs(self) -> Any:
        """For a model with its own shape rules (``family`` set): the converter of
        LLaVA-format records into its inputs, with ``sample(record, image_folder=,
        where=, lazy=)`` giving a :class:`~dflop.batch.sample.ProcessedSample`
        and ``text_counter()`` the profiler's count of the text it makes."""
        raise NotImplementedError(
            f"{type(self).__name__} trains on a data family's shapes scaled onto the model"
        )

    def profiled_encoder(
        self,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[nn.Module, tuple[int, int, int], int | None]:
        """What the profiler times as the encoder: ``(module, pixel shape of one unit,
        encoder tokens of a profiled unit or None)``. A model with fixed units gives its
        whole encoder and ``None``; a patch-sequence encoder a module running units of a
        nominal size, whose time the cost model scales by each sample's tokens."""
        module = self.whole_module("encoder", seed=seed, device=device, dtype=dtype)
        return module, self.image_shape, None

    def num_layers(self, module: str) -> int:
        """Layers of ``"encoder"`` or ``"llm"`` that a layout splits into stages."""
        if module not in ("encoder", "llm"):
            raise ValueError(f"module={module!r} must be 'encoder' or 'llm'")
        return self.encoder_layers if module == "encoder" else self.llm_layers

    def whole_module(
        self,
        module: str,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """All of ``module`` (``"encoder"`` or ``"llm"``) as one stage, with its embedding
        and head: what the profiler times (the stage protocols are the profiler's call
        signatures)."""
        info = StageSlice(module, (0, self.num_layers(module)))  # validates the name
        return self.build_stage(info, seed=seed, device=device, dtype=dtype)


class ReferenceSpec(ModelSpec):
    """dflop's reference model (:mod:`dflop.models`) for a :class:`ModelConfig`."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.name = "reference"
        self.encoder_layers = config.vision.layers
        self.llm_layers = config.decoder.layers
        self.tokens_per_unit = config.vision.tokens_per_unit
        self.visual_newline = config.decoder.image_newline
        vision = config.vision
        self.image_shape = (vision.channels, vision.image_size_px, vision.image_size_px)
        self.max_seq_len = config.decoder.max_seq_len
        self.projector_prefixes = ("projector.",)

    def architecture(self) -> tuple[EncoderConfig, LLMConfig]:
        from dflop.data.costs import EncoderConfig, LLMConfig

        v, p, d = self.config.vision, self.config.projector, self.config.decoder
        encoder = EncoderConfig(
            name="vision",
            hidden_size=v.hidden,
            num_layers=v.layers,
            intermediate_size=v.mlp_hidden,
            num_heads=v.heads,
            tokens_per_unit=v.tokens_per_unit,
            patch_px=v.patch_size_px,
            projector_hidden_size=p.intermediate,
        )
        llm = LLMConfig(
            name="decoder",
            hidden_size=d.hidden,
            num_layers=d.layers,
            intermediate_size=d.mlp_hidden,
            num_heads=d.heads,
            num_kv_heads=d.kv_heads,
            vocab_size=d.vocab_size,
        )
        return encoder, llm

    def build_stage(
        self,
        info: StageInfo,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """The reference stage with the full model's weights for ``seed`` (name-keyed
        init; every TP rank builds the same full weights and keeps its slice when the
        runtime shards the stage)."""
        from dflop.models.decoder import DecoderStage
        from dflop.models.vision import VisionStage

        first, end = info.layer_range
        kw = {"has_embed": info.is_first_stage, "has_head": info.is_last_stage}
        config = self.config
        if info.module == "encoder":
            stage: nn.Module = VisionStage(
                config.vision, config.projector, first, end, device=device, dtype=dtype, **kw
            )
        else:
            stage = DecoderStage(config.decoder, first, end, device=device, dtype=dtype, **kw)
        stage.init_weights(seed)
        return stage
