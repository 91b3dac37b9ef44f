"""Which parts of a vision-language model train: :class:`TrainableParts`.

A model has three parts: the vision ``encoder`` (the tower), the ``projector`` (the
adapter into the LLM: LLaVA's MLP, Qwen-VL's patch merger; it sits on the encoder's last
pipeline stage) and the ``llm``. Each part trains in ``full`` or is ``frozen``. What the
runtime does with it follows from where gradients must flow:

- a stage with nothing trainable at or before it runs forward only (no autograd graph,
  activations freed at once) and its ``B`` actions compute nothing;
- the bridge carries feature gradients back only when the encoder side trains (the
  projector or the tower);
- a frozen parameter gets no gradient, no optimizer state and no all-reduce.

Presets (:data:`PRESETS`) name the regimes users run: ``full``; ``projector`` (LLaVA's
first stage: only the projector trains); ``frozen-vision`` (the vision tower frozen, as
LLaMA-Factory's ``freeze_vision_tower``). Any other mix is written part by part:
``"encoder=frozen,projector=full,llm=frozen"`` (parts left out train in full).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from dflop.models.spec import ModelSpec

__all__ = ["MODES", "PARTS", "PRESETS", "TrainableParts", "freeze_stage"]

PARTS: tuple[str, ...] = ("encoder", "projector", "llm")
"""The parts of a model, in pipeline order."""

MODES: tuple[str, ...] = ("full", "frozen")
"""How a part trains."""


@dataclass(frozen=True)
class TrainableParts:
    """How each part of the model trains (see the module docstring)."""

    encoder: str = "full"
    projector: str = "full"
    llm: str = "full"

    def __post_init__(self) -> None:
        for f in fields(self):
            mode = getattr(self, f.name)
            if mode not in MODES:
                raise ValueError(
                    f"TrainableParts.{f.name}={mode!r} must be one of {', '.join(MODES)}"
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

    def trains(self, part: str) -> bool:
        """Whether ``part`` has trainable parameters."""
        if part not in PARTS:
            raise ValueError(f"{part!r} is not a part; parts: {', '.join(PARTS)}")
        return getattr(self, part) != "frozen"

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
}
"""Named regimes: everything trains; LLaVA's stage 1 (the projector only); the vision
tower frozen (projector and LLM train)."""


def freeze_stage(stage: nn.Module, spec: ModelSpec, module: str, parts: TrainableParts) -> int:
    """Turn off ``requires_grad`` on ``stage``'s parameters of frozen parts (``module``:
    ``"encoder"`` or ``"llm"``); returns how many parameter tensors it froze."""
    frozen = 0
    for name, param in stage.named_parameters():
        if not parts.trains(spec.parameter_part(module, name)):
            param.requires_grad_(False)
            frozen += 1
    return frozen
