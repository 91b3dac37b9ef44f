"""Finding a model's :class:`~dflop.models.spec.ModelSpec` by name: :func:`model_spec`.

Above the interface (:mod:`dflop.models.spec`) and its implementations (the reference
model's :class:`~dflop.models.spec.ReferenceSpec`, the Hugging Face adapters of
:mod:`dflop.models.hf`), which import the interface and never this lookup.
"""

from __future__ import annotations

from dflop.errors import InputTypeError
from dflop.models.config import ModelConfig, model_config
from dflop.models.hf import hf_model_spec
from dflop.models.spec import ModelSpec, ReferenceSpec

__all__ = ["model_spec"]


def model_spec(model: ModelSpec | ModelConfig | str) -> ModelSpec:
    """The spec of ``model``: a spec (returned as is), a reference :class:`ModelConfig`, a
    reference preset name (``"tiny"``), or ``"hf:PATH"``, a local folder with a Hugging Face
    ``config.json`` (weights are read from it when present; needs ``dflop[hf]``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, ModelConfig):
        return ReferenceSpec(model)
    if isinstance(model, str) and model.startswith("hf:"):
        return hf_model_spec(model[3:])
    if isinstance(model, str):
        return ReferenceSpec(model_config(model))
    raise InputTypeError(
        f"model must be a ModelSpec, a ModelConfig, a preset name or 'hf:PATH', got "
        f"{type(model).__name__}"
    )
