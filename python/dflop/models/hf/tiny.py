"""Tiny models of the supported Hugging Face families: CPU tests, the end-to-end examples
and profiling on a laptop. Same architecture as the real models, a few thousand times
smaller (32 px tiles of 8 px patches; hidden sizes of 32 and 64).

:func:`tiny_config` and :func:`save_tiny` take a ``config.model_type`` and reach the
family's own builder (``models/hf/<family>/tiny.py``) through
:mod:`dflop.models.hf.registry`; the other functions are the first families' names for
them, kept for their callers (a new family needs none).
"""

from __future__ import annotations

from typing import Any

from dflop.models.hf.registry import family_for

__all__ = [
    "save_tiny",
    "save_tiny_llava_onevision",
    "save_tiny_qwen_vl",
    "tiny_config",
    "tiny_llava_onevision_config",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen2_vl_config",
]


def tiny_config(model_type: str, **sizes: Any) -> Any:
    """A tiny transformers config of ``model_type`` (``sizes``: the family builder's
    options, e.g. ``text_layers=1``)."""
    return family_for(model_type).tiny_config(model_type, **sizes)


def save_tiny(folder: str, model_type: str, **options: Any) -> str:
    """A local model folder of :func:`tiny_config` (``config.json``, the processors'
    configs and, unless ``weights=False``, safetensors of the model built after
    ``torch.manual_seed(seed)``); returns ``folder``. Train it with ``dflop train --model
    hf:FOLDER``."""
    return family_for(model_type).save_tiny(folder, model_type, **options)


def tiny_llava_onevision_config(**sizes: Any) -> Any:
    """``tiny_config("llava_onevision", **sizes)``: SigLIP (32 px, 8 px patches: 16 tokens
    per unit, hidden 32), Qwen2 (hidden 64, 4 heads, 2 KV heads), anyres grids up to
    ``max_grid`` x ``max_grid`` crops (3), ``anyres_max_<max_crops>`` (4); see
    :func:`dflop.models.hf.llava_onevision.tiny.tiny_llava_onevision_config`."""
    return tiny_config("llava_onevision", **sizes)


def save_tiny_llava_onevision(folder: str, **options: Any) -> str:
    """``save_tiny(folder, "llava_onevision", **options)``."""
    return save_tiny(folder, "llava_onevision", **options)


def tiny_qwen2_vl_config(**sizes: Any) -> Any:
    """``tiny_config("qwen2_vl", **sizes)``; see
    :func:`dflop.models.hf.qwen2_vl.tiny.tiny_qwen2_vl_config`."""
    return tiny_config("qwen2_vl", **sizes)


def tiny_qwen2_5_vl_config(**sizes: Any) -> Any:
    """``tiny_config("qwen2_5_vl", **sizes)``; see
    :func:`dflop.models.hf.qwen2_vl.tiny.tiny_qwen2_5_vl_config`."""
    return tiny_config("qwen2_5_vl", **sizes)


def save_tiny_qwen_vl(folder: str, *, family: str = "qwen2_vl", **options: Any) -> str:
    """``save_tiny(folder, family, **options)`` with ``family`` ``"qwen2_vl"`` or
    ``"qwen2_5_vl"``; see :func:`dflop.models.hf.qwen2_vl.tiny.save_tiny_qwen_vl`."""
    return save_tiny(folder, family, **options)
