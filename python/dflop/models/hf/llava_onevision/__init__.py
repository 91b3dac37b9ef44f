"""LLaVA-OneVision (``config.model_type`` ``llava_onevision``): the family's folder.

* ``config.py``: what the config says about shapes (:func:`family_from_config`, the anyres
  rules; no torch, no transformers);
* ``spec.py``: the spec and its pipeline stages (``LlavaOnevisionSpec``);
* ``records.py``: LLaVA-format records as the model's inputs (``LlavaOnevisionRecords``);
* ``tiny.py``: the tiny test model (``tiny_llava_onevision_config``,
  ``save_tiny_llava_onevision``).

:data:`FAMILY` is the family's registration (:mod:`dflop.models.hf.registry`).
"""

from __future__ import annotations

from typing import Any

from dflop.models.hf.family import HFFamily
from dflop.models.hf.llava_onevision.config import family_from_config

__all__ = ["FAMILY", "family_from_config"]


def _spec_class(model_type: str) -> type:
    from dflop.models.hf.llava_onevision.spec import LlavaOnevisionSpec

    return LlavaOnevisionSpec


def _records_class(model_type: str) -> type:
    from dflop.models.hf.llava_onevision.records import LlavaOnevisionRecords

    return LlavaOnevisionRecords


def _tiny_config(model_type: str, **sizes: Any) -> Any:
    from dflop.models.hf.llava_onevision.tiny import tiny_llava_onevision_config

    return tiny_llava_onevision_config(**sizes)


def _save_tiny(folder: str, model_type: str, **options: Any) -> str:
    from dflop.models.hf.llava_onevision.tiny import save_tiny_llava_onevision

    return save_tiny_llava_onevision(folder, **options)


FAMILY = HFFamily(
    name="llava_onevision",
    model_types=("llava_onevision",),
    spec_class=_spec_class,
    records_class=_records_class,
    tiny_config=_tiny_config,
    save_tiny=_save_tiny,
    title="LLaVA-OneVision",
)
