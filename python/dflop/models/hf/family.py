"""The registration of a Hugging Face model family (:class:`HFFamily`).

A family is one folder, ``models/hf/<family>/``, whose ``__init__`` declares its
registration once, ``FAMILY = HFFamily(...)``; :mod:`dflop.models.hf.registry` lists the
folders and looks families up by ``config.model_type``. The registration names the
family's parts through small functions that import them on first use, so importing dflop
imports neither transformers nor a family's model code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HFFamily"]


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face model family: the ``config.model_type`` values it adapts and where
    its parts are.

    Attributes:
        name: the family, as its folder under ``models/hf`` (e.g. ``"qwen2_vl"``).
        model_types: the transformers ``config.model_type`` values it adapts (e.g.
            ``("qwen2_vl", "qwen2_5_vl")``), each in one family only.
        spec_class: ``model_type -> class``: the :class:`~dflop.models.spec.ModelSpec`
            class of a model type, called as ``cls(config, checkpoint_dir)``.
        records_class: ``model_type -> class``: the converter of LLaVA-format records
            into the model's inputs (a :class:`~dflop.models.hf.records.RecordInputs`;
            the spec's ``dataset_inputs()`` builds one).
        tiny_config: ``(model_type, **sizes) -> config``: a tiny transformers config of
            the model type (CPU tests, examples).
        save_tiny: ``(folder, model_type, *, seed=0, weights=True, **sizes) -> folder``:
            a local model folder of the tiny config (``config.json``, the processors'
            configs and, with ``weights``, safetensors).
        title: the family's name for people (e.g. ``"Qwen2-VL / Qwen2.5-VL"``).
    """

    name: str
    model_types: tuple[str, ...]
    spec_class: Callable[[str], type]
    records_class: Callable[[str], type]
    tiny_config: Callable[..., Any]
    save_tiny: Callable[..., str]
    title: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HFFamily.name={self.name!r} must be a non-empty string")
        types = self.model_types
        if (
            not isinstance(types, tuple)
            or not types
            or not all(isinstance(t, str) and t for t in types)
        ):
            raise ValueError(
                f"HFFamily {self.name!r}: model_types={types!r} must be a non-empty tuple of "
                "model type names"
            )
        if len(set(types)) != len(types):
            raise ValueError(f"HFFamily {self.name!r}: model_types={types!r} repeats a name")
        for part in ("spec_class", "records_class", "tiny_config", "save_tiny"):
            if not callable(getattr(self, part)):
                raise ValueError(f"HFFamily {self.name!r}: {part} must be callable")
