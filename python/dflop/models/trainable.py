"""Which parts of a vision-language model train: :class:`TrainableParts`.

A model has three parts: the vision ``encoder`` (the tower), the ``projector`` (the
adapter into the LLM: LLaVA's MLP, Qwen-VL's patch merger; it sits on the encoder's last
pipeline stage) and the ``llm``. Each part trains in ``full``, is ``frozen``, or (the
tower and the LLM) trains ``lora`` adapters on its frozen linear layers (through PEFT,
``pip install peft``; rank, alpha, dropout and target layers in :class:`LoraSettings`).
What the runtime does with it follows from where gradients must flow:

- a stage with nothing trainable at or before it runs forward only (no autograd graph,
  activations freed at once) and its ``B`` actions compute nothing;
- the bridge carries feature gradients back only when the encoder side trains (the
  projector or the tower);
- a frozen parameter gets no gradient, no optimizer state and no all-reduce.

Presets (:data:`PRESETS`) name the regimes users run: ``full``; ``projector`` (LLaVA's
first stage: only the projector trains); ``frozen-vision`` (the vision tower frozen, as
LLaMA-Factory's ``freeze_vision_tower``); ``lora`` (LoRA on the LLM, the tower frozen,
the projector trained: LLaMA-Factory's and ms-swift's usual VLM fine-tuning). Any other
mix is written part by part: ``"encoder=frozen,projector=full,llm=frozen"`` (parts left
out train in full).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import nn

    from dflop.models.spec import ModelSpec

__all__ = [
    "MODES",
    "PARTS",
    "PRESETS",
    "LoraSettings",
    "TrainableParts",
    "adapter_tensors",
    "add_lora",
    "freeze_stage",
    "merge_lora",
    "write_adapter_config",
]

PARTS: tuple[str, ...] = ("encoder", "projector", "llm")
"""The parts of a model, in pipeline order."""

MODES: tuple[str, ...] = ("full", "frozen", "lora")
"""How a part trains (the projector: full or frozen)."""

DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "out_proj",
    "fc1",
    "fc2",
    "qkv",
    "proj",
)
"""Linear layers LoRA adapts by default, by name: a Qwen2 / Llama decoder layer's
attention and MLP projections, and a ViT block's (SigLIP: ``out_proj``, ``fc1``, ``fc2``;
Qwen-VL's vision blocks: ``qkv``, ``proj``)."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's hyper-parameters (PEFT's ``LoraConfig``): ``rank`` (r), ``alpha``
    (lora_alpha; the update is scaled by alpha / rank), ``dropout`` (lora_dropout) and
    ``targets``, the names of the linear layers adapted inside the layers of a ``lora``
    part (never the embeddings, the LM head or the projector)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSettings.rank={self.rank!r} must be an int >= 1")
        if not self.alpha > 0:
            raise ValueError(f"LoraSettings.alpha={self.alpha!r} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout={self.dropout!r} must be in [0, 1)")
        targets = tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise ValueError(
                f"LoraSettings.targets={self.targets!r} must name linear layers, e.g. q_proj"
            )
        object.__setattr__(self, "targets", tuple(t.strip() for t in targets))


@dataclass(frozen=True)
class TrainableParts:
    """How each part of the model trains (see the module docstring)."""

    encoder: str = "full"
    projector: str = "full"
    llm: str = "full"
    lora: LoraSettings = field(default_factory=LoraSettings, compare=False)
    """The adapters of the ``lora`` parts (not part of the regime's name)."""

    def __post_init__(self) -> None:
        for part in PARTS:
            mode = getattr(self, part)
            if mode not in MODES or (part == "projector" and mode == "lora"):
                allowed = ("full", "frozen") if part == "projector" else MODES
                raise ValueError(
                    f"TrainableParts.{part}={mode!r} must be one of {', '.join(allowed)}"
                )
        if not any(self.trains(part) for part in PARTS):
            raise ValueError(
                "TrainableParts: every part is frozen, so nothing would train; let at least "
                "one of encoder, projector, llm train"
            )

    @classmethod
    def parse(cls, text: str | TrainableParts) -> TrainableParts:
        """A preset name (:data:`PRESETS`) or ``"part=mode,..."``; errors name the
        offending piece."""
        if isinstance(text, TrainableParts):
            return text
        if not isinstance(text, str):
            raise TypeError(f"trainable parts must be a str, got {type(text).__name__}")
        name = text.strip().lower()
        if name in PRESETS:
            return PRESETS[name]
        if "=" not in name:
            raise ValueError(
                f"trainable parts {text!r}: not a preset ({', '.join(PRESETS)}) nor "
                "'part=mode,...' (e.g. 'encoder=frozen')"
            )
        modes: dict[str, str] = {}
        for piece in name.split(","):
            part, _, mode = (s.strip() for s in piece.partition("="))
            if part not in PARTS:
                raise ValueError(
                    f"trainable parts {text!r}: {part!r} is not a part; parts: {', '.join(PARTS)}"
                )
            if part in modes:
                raise ValueError(f"trainable parts {text!r}: {part!r} is given twice")
            modes[part] = mode
        return cls(**modes)

    def __str__(self) -> str:
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return ",".join(f"{part}={getattr(self, part)}" for part in PARTS)

    def mode(self, part: str) -> str:
        """How ``part`` trains: ``full``, ``frozen`` or ``lora``."""
        if part not in PARTS:
            raise ValueError(f"{part!r} is not a part; parts: {', '.join(PARTS)}")
        return getattr(self, part)

    def trains(self, part: str) -> bool:
        """Whether ``part`` has trainable parameters (in full, or its adapters)."""
        return self.mode(part) != "frozen"

    @property
    def uses_lora(self) -> bool:
        return any(self.mode(part) == "lora" for part in PARTS)

    def stage_backward(self, module: str, is_last_stage: bool) -> bool:
        """Whether a stage of ``module`` (``"encoder"`` or ``"llm"``) runs a backward:
        something trains at or before it (an encoder stage: the tower on every stage, the
        projector on the last; an LLM stage: always, since something trains)."""
        if module == "llm":
            return True
        return self.trains("encoder") or (is_last_stage and self.trains("projector"))

    @property
    def bridge_gradients(self) -> bool:
        """Whether feature gradients go back from the LLM to the encoder."""
        return self.stage_backward("encoder", is_last_stage=True)


PRESETS: dict[str, TrainableParts] = {
    "full": TrainableParts(),
    "projector": TrainableParts(encoder="frozen", projector="full", llm="frozen"),
    "frozen-vision": TrainableParts(encoder="frozen", projector="full", llm="full"),
    "lora": TrainableParts(encoder="frozen", projector="full", llm="lora"),
}
"""Named regimes: everything trains; LLaVA's stage 1 (the projector only); the vision
tower frozen (projector and LLM train); LoRA on the LLM with the tower frozen (the
projector trains)."""


def freeze_stage(
    stage: nn.Module, spec: ModelSpec, module: str, parts: TrainableParts, seed: int = 0
) -> int:
    """Prepare ``stage``'s parameters for ``parts`` (``module``: ``"encoder"`` or
    ``"llm"``): turn off ``requires_grad`` on the frozen parts' and the ``lora`` parts'
    weights, and give the ``lora`` parts' target layers trainable adapters initialised
    from ``seed`` (:func:`add_lora`); returns how many parameter tensors it froze."""
    frozen = 0
    for name, param in stage.named_parameters():
        if parts.mode(spec.parameter_part(module, name)) != "full":
            param.requires_grad_(False)
            frozen += 1
    add_lora(stage, parts, lambda name: spec.parameter_part(module, name), seed)
    return frozen


def lora_targets(
    model: nn.Module, parts: TrainableParts, part_of: Callable[[str], str]
) -> list[str]:
    """The names of ``model``'s linear layers that a ``lora`` part adapts: those inside a
    ``lora`` part (``part_of(parameter name)``) whose own name is one of
    ``parts.lora.targets``."""
    from torch import nn

    names = []
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear) or name.rsplit(".", 1)[-1] not in parts.lora.targets:
            continue
        if parts.mode(part_of(f"{name}.weight")) == "lora":
            names.append(name)
    return names


def add_lora(
    stage: nn.Module, parts: TrainableParts, part_of: Callable[[str], str], seed: int = 0
) -> int:
    """Give the ``lora`` parts' target layers of ``stage`` (a stage, or a whole model:
    ``part_of`` maps a parameter name to its part) LoRA adapters (PEFT's, named
    ``<layer>.lora_A.default.weight`` / ``lora_B``); only the adapters of those parts
    train. Initialised as PEFT does (A Kaiming-uniform, B zero: the update starts at
    zero), A from a generator seeded by ``seed`` and the layer's name, so every replica of
    a stage, and any pipeline split or tensor-parallel size, starts from the same
    adapters; on a tensor-parallel stage each adapter is then sharded like the layer it
    adapts (:func:`_shard_lora_adapters`). Returns the
    number of adapted layers."""
    targets = lora_targets(stage, parts, part_of)
    if not targets:
        return 0
    import torch

    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError(
            f"--trainable {parts} trains LoRA adapters, which needs PEFT: pip install peft "
            "(or the dflop[hf] extra)"
        ) from None
    trainable = {name for name, p in stage.named_parameters() if p.requires_grad}
    config = LoraConfig(
        r=parts.lora.rank,
        lora_alpha=parts.lora.alpha,
        lora_dropout=parts.lora.dropout,
        target_modules=targets,
        bias="none",
    )
    inject_adapter_in_model(config, stage)
    for name in targets:
        lora_a = stage.get_submodule(name).lora_A["default"].weight
        # The model's own name of the layer: without an interleaved stage's chunk index.
        key = re.sub(r"^\d+\.", "", name)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        init = torch.empty(lora_a.shape, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            lora_a.copy_(init)
        _shard_lora_adapters(stage.get_submodule(name), name)
    # PEFT leaves only adapters trainable: give back the full parts' weights.
    for name, param in stage.named_parameters():
        param.requires_grad_("lora_" in name or name in trainable)
    return len(targets)


def _shard_lora_adapters(layer: nn.Module, name: str) -> None:
    """Shard the LoRA adapters of ``layer`` (a PEFT LoRA layer named ``name`` whose
    ``base_layer`` :func:`~dflop.runtime.tensor_parallel.apply_tensor_parallel` sharded
    and marked with its ``tensor_parallel_style``) so that their update adds to the base
    layer's local output: a column-parallel base gets a column-parallel
    ``lora_B`` (``lora_A`` replicated), a row-parallel base a row-parallel ``lora_A``
    (``lora_B`` replicated). The adapters must hold the same full weights on every TP
    rank (each keeps its slice). A replicated base leaves them as they are.

    Raises:
        ValueError: a vocabulary-parallel base (the LM head), or LoRA dropout, whose masks
            would differ between the TP ranks.
    """
    base = layer.base_layer
    kind = getattr(base, "tensor_parallel_style", None)
    if kind is None:
        return
    if kind == "vocab":
        raise ValueError(
            f"LoRA on {name}: a vocabulary-parallel layer takes no adapters under tensor "
            "parallelism; leave it out of the LoRA targets"
        )
    import torch
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = base.weight.device_mesh
    for adapter, dropout in layer.lora_dropout.items():
        if not isinstance(dropout, torch.nn.Identity):
            raise ValueError(
                f"LoRA on {name}: LoRA dropout under tensor parallelism is not supported "
                "(each TP rank would draw its own mask); set the LoRA dropout to 0"
            )
        if kind == "colwise":
            parallelize_module(layer.lora_B[adapter], mesh, ColwiseParallel(), src_data_rank=None)
        else:
            parallelize_module(layer.lora_A[adapter], mesh, RowwiseParallel(), src_data_rank=None)


def merge_lora(state: dict[str, Any], lora: LoraSettings) -> dict[str, Any]:
    """A stage's ``state_dict`` with its LoRA adapters merged into the weights they adapt
    (``W + alpha / rank x B A``, as PEFT's ``merge_and_unload``) under the model's own names
    (``<layer>.weight``); a state without adapters comes back as it is."""
    scale = lora.alpha / lora.rank
    out = {}
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        layer, sep, rest = name.partition(".base_layer.")
        if not sep:
            out[name] = value
            continue
        if rest == "weight":
            a, b = (state[f"{layer}.lora_{m}.default.weight"] for m in ("A", "B"))
            value = value + scale * (b.to(value.dtype) @ a.to(value.dtype))
        out[f"{layer}.{rest}"] = value
    return out


def adapter_tensors(
    state: dict[str, Any], parts: TrainableParts, part_of: Callable[[str], str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """What a PEFT adapter folder holds of a stage's ``state_dict``: ``(tensors under
    PEFT's file keys, adapted layers, modules trained in full)``. PEFT saves
    ``base_model.model.<layer>.lora_A.weight`` for an adapter and
    ``base_model.model.<name>`` for a parameter of its ``modules_to_save`` (here: the
    modules of the parts trained in full, e.g. the projector of ``--trainable lora``)."""
    tensors, layers, modules = {}, [], set()
    for name, value in state.items():
        for matrix in ("A", "B"):
            marker = f".lora_{matrix}.default."
            if marker in name:
                tensors["base_model.model." + name.replace(marker, f".lora_{matrix}.")] = value
                if matrix == "A":
                    layers.append(name.split(marker)[0])
                break
        else:
            plain = name.replace(".base_layer.", ".")
            if parts.mode(part_of(plain)) == "full":
                tensors["base_model.model." + plain] = value
                modules.add(plain.rsplit(".", 1)[0])
    return tensors, layers, sorted(modules)


def write_adapter_config(
    folder: str,
    parts: TrainableParts,
    layers: list[str],
    modules: list[str],
    base_model: str | None,
) -> None:
    """``adapter_config.json`` of a PEFT LoRA adapter folder (``PeftModel.from_pretrained``
    reads it with ``adapter_model.safetensors``)."""
    from peft import LoraConfig

    LoraConfig(
        r=parts.lora.rank,
        lora_alpha=parts.lora.alpha,
        lora_dropout=parts.lora.dropout,
        target_modules=sorted(layers),
        modules_to_save=modules or None,
        bias="none",
        base_model_name_or_path=base_model,
    ).save_pretrained(folder)
