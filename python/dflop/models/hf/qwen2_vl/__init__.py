"""Qwen2-VL and Qwen2.5-VL (``config.model_type`` ``qwen2_vl``, ``qwen2_5_vl``): the
family's folder.

* ``config.py``: what the config and its processors say about shapes
  (:func:`family_from_config`, the native rules; :func:`video_pixels`);
* ``spec.py``: the specs and their pipeline stages (``Qwen2VLSpec``, ``Qwen25VLSpec``);
* ``records.py``: LLaVA-format records as the models' inputs (``QwenVLRecords``);
* ``tiny.py``: the tiny test models (``tiny_qwen2_vl_config``,
  ``tiny_qwen2_5_vl_config``, ``save_tiny_qwen_vl``).

:data:`FAMILY` is the family's registration (:mod:`dflop.models.hf.registry`).
"""

from __future__ import annotations

from typing import Any

from dflop.models.hf.family import HFFamily
from dflop.models.hf.qwen2_vl.config import family_from_config, video_pixels

__all__ = ["FAMILY", "family_from_config", "video_pixels"]


def _spec_class(model_type: str) -> type:
    from dflop.models.hf.qwen2_vl.spec import Qwen2VLSpec, Qwen25VLSpec

    return {"qwen2_vl": Qwen2VLSpec, "qwen2_5_vl": Qwen25VLSpec}[model_type]


def _records_class(model_type: str) -> type:
    from dflop.models.hf.qwen2_vl.records import QwenVLRecords

    return QwenVLRecords


def _tiny_config(model_type: str, **sizes: Any) -> Any:
    from dflop.models.hf.qwen2_vl.tiny import tiny_qwen2_5_vl_config, tiny_qwen2_vl_config

    make = {"qwen2_vl": tiny_qwen2_vl_config, "qwen2_5_vl": tiny_qwen2_5_vl_config}
    return make[model_type](**sizes)


def _save_tiny(folder: str, model_type: str, **options: Any) -> str:
    from dflop.models.hf.qwen2_vl.tiny import save_tiny_qwen_vl

    return save_tiny_qwen_vl(folder, family=model_type, **options)


FAMILY = HFFamily(
    name="qwen2_vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    spec_class=_spec_class,
    records_class=_records_class,
    tiny_config=_tiny_config,
    save_tiny=_save_tiny,
    title="Qwen2-VL / Qwen2.5-VL",
)
