"""InternVL (``config.model_type`` ``internvl``: InternVL 2.5 / 3 in transformers' layout,
``InternVLForConditionalGeneration``): the family's folder.

* ``config.py``: what the config and its image processor say about shapes
  (:func:`family_from_config`, the dynamic-tiling rules; no torch, no transformers);
* ``spec.py``: the spec and its pipeline stages (``InternVLSpec``);
* ``records.py``: LLaVA-format records as the model's inputs (``InternVLRecords``);
* ``tiny.py``: the tiny test model (``tiny_internvl_config``, ``save_tiny_internvl``).

:data:`FAMILY` is the family's registration (:mod:`dflop.models.hf.registry`).
"""

from __future__ import annotations

from typing import Any

from dflop.models.hf.family import HFFamily
from dflop.models.hf.internvl.config import family_from_config

__all__ = ["FAMILY", "family_from_config"]


def _spec_class(model_type: str) -> type:
    from dflop.models.hf.internvl.spec import InternVLSpec

    return InternVLSpec


def _records_class(model_type: str) -> type:
    from dflop.models.hf.internvl.records import InternVLRecords

    return InternVLRecords


def _tiny_config(model_type: str, **sizes: Any) -> Any:
    from dflop.models.hf.internvl.tiny import tiny_internvl_config

    return tiny_internvl_config(**sizes)


def _save_tiny(folder: str, model_type: str, **options: Any) -> str:
    from dflop.models.hf.internvl.tiny import save_tiny_internvl

    return save_tiny_internvl(folder, **options)


FAMILY = HFFamily(
    name="internvl",
    model_types=("internvl",),
    spec_class=_spec_class,
    records_class=_records_class,
    tiny_config=_tiny_config,
    save_tiny=_save_tiny,
    title="InternVL 2.5 / 3",
)
