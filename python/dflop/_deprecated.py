"""Old public names, kept for one release (0.x) as deprecated aliases of their new ones.

Renamed so that each word has one meaning (docs/concepts.md › Glossary). Importing an old module
path or reading an old attribute works and warns once with a :class:`DeprecationWarning`
that names the new one. ``dflop.planner.plan`` is not aliased as a module: it is the
planner's function (the module that held the plan's types is now
:mod:`dflop.planner.result`), and an alias module would replace the function on the
package when imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

MODULES: Mapping[str, str] = {
    "dflop.runtime.comm": "dflop.runtime.dist",
    "dflop.runtime.communicator": "dflop.runtime.bridge",
    "dflop.runtime.pipeline": "dflop.runtime.engine",
    "dflop.scheduling.pipeline": "dflop.scheduling.pipeline_schedule",
}
"""Old module path -> new module path."""


def warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warn_renamed(spec.name, self._new)
        return importlib.import_module(self._new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module is already executed


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install_module_aliases() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def attribute_aliases(
    module_name: str, aliases: Mapping[str, str], resolve: Callable[[str], Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``aliases`` (old -> new) as
    ``resolve(new)``, with a warning."""

    def __getattr__(name: str) -> Any:
        new = aliases.get(name)
        if new is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warn_renamed(f"{module_name}.{name}", f"{module_name}.{new}")
        return resolve(new)

    return __getattr__
