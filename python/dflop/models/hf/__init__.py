"""Hugging Face ``transformers`` models under dflop's runtime (optional extra ``dflop[hf]``).

``model_spec("hf:PATH")`` (or :func:`hf_model_spec`) reads ``PATH/config.json`` and returns
the family's :class:`~dflop.models.spec.ModelSpec`; the weights come from ``PATH``'s
safetensors when present, else from a random init for the run's seed. Nothing is ever
downloaded. Families: LLaVA-OneVision (``llava_onevision``), Qwen2-VL (``qwen2_vl``),
Qwen2.5-VL (``qwen2_5_vl``) and InternVL 2.5 / 3 (``internvl``), one folder each (``models/hf/<family>/``), found by
``config.model_type`` through :mod:`dflop.models.hf.registry`
(:func:`register_family` adds one).
"""

from __future__ import annotations

from typing import Any

from dflop.models.hf.registry import model_types, register_family, spec_class
from dflop.models.spec import ModelSpec

__all__ = ["HF_FAMILIES", "hf_model_spec", "register_family", "spec_from_config"]


def __getattr__(name: str) -> Any:
    if name == "HF_FAMILIES":
        # ``config.model_type`` values dflop has an adapter for (the registry's, now).
        return model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def spec_from_config(config: Any, checkpoint_dir: str | None = None) -> ModelSpec:
    """The spec of a transformers config object (e.g. a tiny one built in a test), by its
    ``model_type`` (a ValueError naming the supported ones when no family adapts it)."""
    model_type = getattr(config, "model_type", None)
    return spec_class(model_type)(config, checkpoint_dir)


def hf_model_spec(path: str) -> ModelSpec:
    """The spec of the model in the local folder ``path`` (``config.json``, optional
    safetensors weights)."""
    from dflop.models.hf.common import load_config

    return spec_from_config(load_config(path), checkpoint_dir=path)
