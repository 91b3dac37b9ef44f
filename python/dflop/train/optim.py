"""The optimizer of a stage whose parameters are all frozen (:class:`FrozenStageOptimizer`).

``torch.optim.AdamW`` refuses an empty parameter list. A frozen stage (the vision tower
of ``--trainable frozen-vision`` on a pipeline of several encoder stages, say) has nothing
to step and no state to keep; this object says so to the training loop and the
checkpoints, which treat it like any other optimizer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FrozenStageOptimizer"]


class FrozenStageOptimizer:
    """No parameters, no state: :meth:`step` does nothing, a checkpoint holds an empty
    state, and loading one that holds state is refused (the stage trained before)."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}

    def step(self) -> None:
        pass  # nothing trains on this stage

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("state") or state_dict.get("param_groups"):
            raise ValueError(
                "the checkpoint holds optimizer state for this stage, whose parameters are "
                "all frozen in this run: it was trained with other trainable parts"
            )
