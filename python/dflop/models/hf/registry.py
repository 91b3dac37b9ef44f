"""The Hugging Face families dflop has an adapter for, by ``config.model_type``.

:data:`BUILTIN_FAMILIES` lists the family folders (``models/hf/<family>/``), one line
each; each folder's ``__init__`` declares its :class:`~dflop.models.hf.family.HFFamily`
(``FAMILY``). Adding a family is its folder plus its line here
(``python/dflop/models/README.md`` has the checklist). Everything that picks a family by
model type goes through this lookup: :func:`dflop.models.hf.spec_from_config`,
:data:`dflop.models.hf.HF_FAMILIES`, the tiny models of :mod:`dflop.models.hf.tiny` and
:func:`records_class`. (:mod:`dflop.models.registry`, one level up, maps
``model_spec("hf:PATH")`` and the presets to a spec; it reaches this one through
:func:`dflop.models.hf.hf_model_spec`.)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from dflop.models.hf.family import HFFamily

__all__ = [
    "BUILTIN_FAMILIES",
    "HFFamily",
    "families",
    "family_for",
    "model_types",
    "records_class",
    "register_family",
    "spec_class",
    "unregister_family",
]

_FAMILIES: dict[str, HFFamily] = {}
"""The registered families by name, in registration order."""
_BY_MODEL_TYPE: dict[str, HFFamily] = {}


def register_family(family: HFFamily) -> HFFamily:
    """Add ``family`` (returned as is). Raises ValueError when its name or one of its
    model types is registered already."""
    if not isinstance(family, HFFamily):
        raise TypeError(f"register_family takes an HFFamily, got {type(family).__name__}")
    if family.name in _FAMILIES:
        raise ValueError(f"a Hugging Face family named {family.name!r} is registered already")
    for model_type in family.model_types:
        owner = _BY_MODEL_TYPE.get(model_type)
        if owner is not None:
            raise ValueError(
                f"family {family.name!r}: model type {model_type!r} belongs to family "
                f"{owner.name!r} already"
            )
    _FAMILIES[family.name] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def unregister_family(name: str) -> HFFamily:
    """Remove the family called ``name`` (e.g. one a test registered); returns it."""
    family = _FAMILIES.pop(name, None)
    if family is None:
        raise ValueError(f"no Hugging Face family named {name!r} is registered")
    for model_type in family.model_types:
        del _BY_MODEL_TYPE[model_type]
    return family


def families() -> tuple[HFFamily, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES.values())


def model_types() -> tuple[str, ...]:
    """Every ``config.model_type`` with an adapter, family by family."""
    return tuple(t for family in _FAMILIES.values() for t in family.model_types)


def family_for(model_type: Any) -> HFFamily:
    """The family adapting ``model_type``; a ValueError naming it and the supported ones
    when none does."""
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"config.model_type={model_type!r} has no dflop adapter; supported: "
            f"{', '.join(model_types())}"
        )
    return family


def spec_class(model_type: Any) -> type:
    """The :class:`~dflop.models.spec.ModelSpec` class of ``model_type``."""
    return family_for(model_type).spec_class(model_type)


def records_class(model_type: Any) -> type:
    """The record converter class (:class:`~dflop.models.hf.records.RecordInputs`) of
    ``model_type``."""
    return family_for(model_type).records_class(model_type)


# The family folders, one line each.
BUILTIN_FAMILIES: tuple[HFFamily, ...] = (
    import_module("dflop.models.hf.llava_onevision").FAMILY,
    import_module("dflop.models.hf.qwen2_vl").FAMILY,
    import_module("dflop.models.hf.internvl").FAMILY,
)

for _family in BUILTIN_FAMILIES:
    register_family(_family)
