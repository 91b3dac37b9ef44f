"""Hugging Face ``transformers`` models under dflop's runtime (optional extra ``dflop[hf]``).

``model_spec("hf:PATH")`` (or :func:`hf_model_spec`) reads ``PATH/config.json`` and returns
the family's :class:`~dflop.models.spec.ModelSpec`; the weights come from ``PATH``'s
safetensors when present, else from a random init for the run's seed. Nothing is ever
downloaded. Families: LLaVA-OneVision (``llava_onevision``), Qwen2-VL (``qwen2_vl``), Qwen2.5-VL (``qwen2_5_vl``).
"""

from __future__ import annotations

from typing import Any

from dflop.models.spec import ModelSpec

__all__ = ["HF_FAMILIES", "hf_model_spec", "spec_from_config"]

HF_FAMILIES = ("llava_onevision", "qwen2_vl", "qwen2_5_vl")
"""``config.model_type`` values dflop has an adapter for."""


def spec_from_config(config: Any, checkpoint_dir: str | None = None) -> ModelSpec:
    """The spec of a transformers config object (e.g. a tiny one built in a test)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "llava_onevision":
        from dflop.models.hf.llava_onevision import LlavaOnevisionSpec

        return LlavaOnevisionSpec(config, checkpoint_dir)
    if model_type == "qwen2_vl":
        from dflop.models.hf.qwen2_vl import Qwen2VLSpec

        return Qwen2VLSpec(config, checkpoint_dir)
    if model_type == "qwen2_5_vl":
        from dflop.models.hf.qwen2_vl import Qwen25VLSpec

        return Qwen25VLSpec(config, checkpoint_dir)
    raise ValueError(
        f"config.model_type={model_type!r} has no dflop adapter; supported: "
        f"{', '.join(HF_FAMILIES)}"
    )


def hf_model_spec(path: str) -> ModelSpec:
    """The spec of the model in the local folder ``path`` (``config.json``, optional
    safetensors weights)."""
    from dflop.models.hf.common import load_config

    return spec_from_config(load_config(path), checkpoint_dir=path)
