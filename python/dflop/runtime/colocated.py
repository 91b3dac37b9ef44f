"""The first LLM stage of a colocated layout: the encoder inside it.

In a colocated layout (``RuntimeLayout.colocated``: Megatron-LM's placement, which the
data-blind baseline runs) the encoder has no ranks of its own: each rank of the LLM's
first stage runs the vision tower and projector on the images of its own microbatches,
then the LLM's first layers. :class:`ColocatedStage` is that rank's module: both parts as
submodules (so the optimizer, the DP all-reduce and dflop's checkpoints cover the encoder
with the stage), the LLM stage protocol by delegation, and :meth:`ColocatedStage.encode`.
The features stay in the autograd graph, so the stage's backward reaches the encoder.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["ColocatedStage", "stage_parts"]


class ColocatedStage(nn.Module):
    """The encoder (every layer, with the projector) and the LLM's first stage, as one
    stage module (see the module docstring).

    Args:
        encoder: the whole encoder as one stage (an ``EncoderStageModule``, first and
            last stage, already tensor-parallel where the layout asks).
        llm: the LLM's first stage (an ``LLMStageModule``).
    """

    def __init__(self, encoder: nn.Module, llm: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.llm = llm
        self.hidden_size = llm.hidden_size
        self.visual_newline = llm.visual_newline
        self.tokens_per_unit = encoder.tokens_per_unit
        position_ids = getattr(llm, "position_ids", None)
        if callable(position_ids):  # the engine looks for it on the stage
            self.position_ids = position_ids

    def encode(self, pixels: Tensor, unit_grid: Tensor | None = None) -> Tensor:
        """Projected features ``[rows, hidden_size]`` of ``pixels`` (a patch-sequence
        encoder also takes each unit's patch grid)."""
        return self.encoder(pixels) if unit_grid is None else self.encoder(pixels, unit_grid)

    def embed(self, token_ids: Tensor) -> Tensor:
        return self.llm.embed(token_ids)

    def merge_visual(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.llm.merge_visual(*args, **kwargs)

    def hidden_states(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.llm.hidden_states(*args, **kwargs)

    def loss(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The LLM's loss (a one-stage LLM: its first stage is its last)."""
        return self.llm.loss(*args, **kwargs)

    def tied_parameter(self) -> Tensor | None:
        tied = getattr(self.llm, "tied_parameter", None)
        return tied() if callable(tied) else None

    def model_state_dict(self) -> dict[str, Tensor]:
        """Both parts' state dicts under the model's own names (the encoder's and the
        LLM's stage names never meet), as the stages of a disaggregated layout give them."""
        return {**self.encoder.state_dict(), **self.llm.state_dict()}


def stage_parts(stage: nn.Module, module: str) -> list[tuple[str, nn.Module]]:
    """``(module name, module)`` of each model part a rank's stage holds: the encoder and
    the LLM for a :class:`ColocatedStage`, else ``stage`` as ``module``."""
    if isinstance(stage, ColocatedStage):
        return [("encoder", stage.encoder), ("llm", stage.llm)]
    return [(module, stage)]
