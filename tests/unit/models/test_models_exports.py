"""``dflop.models`` loads its names on first use (the CLI starts without torch): every
exported name resolves to its module's object, a wrong one is an AttributeError."""

from __future__ import annotations

import importlib

import dflop.models as models
import pytest


def test_every_lazy_name_resolves_and_dir_lists_it() -> None:
    for module, names in models._EXPORTS.items():  # noqa: SLF001
        for name in names:
            if module != "config":
                pytest.importorskip("torch")
            value = getattr(models, name)
            assert value is getattr(importlib.import_module(f"dflop.models.{module}"), name)
            assert name in dir(models)
    with pytest.raises(AttributeError, match="'dflop.models' has no attribute 'Nope'"):
        models.Nope  # noqa: B018
