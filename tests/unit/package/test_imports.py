"""Imports go one way: the layers of the ``dflop`` package and the check that keeps them.

:data:`LAYERS` is the one place the layer order is written down. Each entry is a layer of
*units* (a unit is a subpackage of ``dflop`` or a module directly in it; ``"dflop"`` is the
package's own ``__init__``, the facade that re-exports the scheduler), lowest first. A
module may import

* any module of its own unit, and
* any module of a unit in a LOWER layer;

never a unit of a higher layer, nor another unit of its own layer: units side by side
(e.g. the planner and the runtime) stay independent of each other. On top of that, no two
modules may import each other, directly or around a circle, even within one unit.

Every import counts: at module level, inside functions (the usual way to hide a circle),
under ``if TYPE_CHECKING:``, relative or absolute, and ``importlib.import_module`` of a
constant ``dflop.`` name. Only written imports count: that importing ``dflop.x.y`` first
runs ``dflop/__init__`` and ``dflop/x/__init__`` is Python's doing, not a dependency of
the importer. A new subpackage or top-level module fails the test until it is placed in
:data:`LAYERS`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO_DIR

PACKAGE_DIR = REPO_DIR / "python" / "dflop"

LAYERS: tuple[tuple[str, ...], ...] = (
    # the native core (its stubs), the deprecated aliases, the error types
    ("_core", "_cuda", "_deprecated", "errors"),
    # reading and writing files safely
    ("safe_io", "output"),
    # sample shapes, datasets, model-family shape rules, analytic costs; timelines
    ("data", "timeline"),
    # the types a batch is made of (shared by models and runtime); the balancer and the
    # pipeline programs
    ("batch", "scheduling"),
    # the package facade (``dflop.schedule`` ..., ``dflop.__version__``); the pipeline
    # simulator
    ("dflop", "simulator"),
    # the models (reference and Hugging Face) and their specs; the performance model
    ("models", "profiling"),
    # the layout planner beside the runtime: neither imports the other
    ("planner", "runtime"),
    # training (dflop train) beside the drop-in balancer for plain DP loops
    ("train", "dp"),
    # the CLI's subcommands, then the CLI
    ("commands",),
    ("cli",),
)
"""The layers of ``dflop``, lowest first (see the module docstring for the rule)."""


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (module names) at ``where`` (file:line)."""

    source: str
    target: str
    where: str


def discover_modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every module of the package: ``*.py``, and the ``*.pyi``
    stubs of extension modules (``dflop._core``)."""
    modules: dict[str, Path] = {}
    for suffix in ("*.py", "*.pyi"):
        for path in sorted(package_dir.rglob(suffix)):
            if "__pycache__" in path.parts:
                continue
            parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules.setdefault(".".join(parts), path)
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` loads: itself, or its longest prefix that is a module (an
    attribute of a module or package)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _dynamic_target(node: ast.Call) -> str | None:
    """The constant part of ``importlib.import_module("...")`` / ``import_module(f"...")``:
    the whole name, or an f-string's leading constant up to its last dot."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        head = arg.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value.rpartition(".")[0] or None
    return None


def import_edges(modules: dict[str, Path], package: str) -> list[Edge]:
    """Every import between the package's modules, wherever it is written."""
    edges: dict[tuple[str, str], Edge] = {}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        shown = path.relative_to(REPO_DIR) if path.is_relative_to(REPO_DIR) else path
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = own_package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            elif isinstance(node, ast.Call):
                dynamic = _dynamic_target(node)
                targets = [dynamic] if dynamic else []
            for target in targets:
                if target.split(".")[0] != package:
                    continue
                resolved = _resolve(target, modules)
                if resolved is None or resolved == name:
                    continue
                where = f"{shown}:{node.lineno}"
                edges.setdefault((name, resolved), Edge(name, resolved, where))
    return sorted(edges.values(), key=lambda e: (e.source, e.target))


def find_cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """Per group of modules that import each other around circles (a strongly connected
    component, Tarjan): its modules and one shortest circle through the first of them."""
    graph: dict[str, list[Edge]] = defaultdict(list)
    for edge in edges:
        graph[edge.source].append(edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth: the package's import depth
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted({e.source for e in edges} | {e.target for e in edges}):
        if node not in index:
            visit(node)

    cycles = []
    for group in groups:  # a shortest circle through the group's first module (BFS)
        start = min(group)
        came: dict[str, Edge] = {}
        frontier = [start]
        closing: Edge | None = None
        while frontier and closing is None:
            following = []
            for node in frontier:
                for edge in graph[node]:
                    if edge.target == start:
                        closing = edge
                        break
                    if edge.target in group and edge.target not in came:
                        came[edge.target] = edge
                        following.append(edge.target)
                if closing is not None:
                    break
            frontier = following
        path = [closing]
        while path[0].source != start:
            path.insert(0, came[path[0].source])
        cycles.append((sorted(group), path))
    return cycles


def unit_of(module: str) -> str:
    """The unit of a module: its subpackage (or top-level module) of ``dflop``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(edges: list[Edge], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import of a unit of the same or a higher layer (or of an unplaced unit)."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    problems = []
    for edge in edges:
        source, target = unit_of(edge.source), unit_of(edge.target)
        if source == target:
            continue
        if source not in level or target not in level:
            missing = source if source not in level else target
            problems.append(f"{edge.where}: unit {missing!r} is in no layer of LAYERS")
            continue
        if level[target] >= level[source]:
            how = "upward" if level[target] > level[source] else "sideways (same layer)"
            problems.append(
                f"{edge.where}: {edge.source} (layer {level[source]}, {source}) imports "
                f"{edge.target} (layer {level[target]}, {target}): {how}"
            )
    return problems


def _format_cycle(group: list[str], cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].source, *(edge.target for edge in cycle)])
    lines = [names, *(f"    {e.source} -> {e.target} at {e.where}" for e in cycle)]
    if len(group) > len(cycle):
        lines.append(f"    (one circle of a group of {len(group)}: {', '.join(group)})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ tests


def _dflop_edges() -> tuple[dict[str, Path], list[Edge]]:
    modules = discover_modules(PACKAGE_DIR, "dflop")
    return modules, import_edges(modules, "dflop")


def test_every_unit_is_in_exactly_one_layer():
    modules, _ = _dflop_edges()
    listed = [unit for layer in LAYERS for unit in layer]
    assert len(listed) == len(set(listed)), f"a unit is listed twice in LAYERS: {listed}"
    units = {unit_of(m) for m in modules}
    assert not units - set(listed), f"place these units in LAYERS: {sorted(units - set(listed))}"
    assert not set(listed) - units, f"LAYERS names missing units: {sorted(set(listed) - units)}"


def test_no_import_cycles():
    _, edges = _dflop_edges()
    cycles = find_cycles(edges)
    assert not cycles, "import cycles between modules:\n" + "\n".join(
        _format_cycle(*c) for c in cycles
    )


def test_imports_go_down_the_layers():
    _, edges = _dflop_edges()
    problems = layer_violations(edges, LAYERS)
    assert not problems, (
        "imports against LAYERS (tests/unit/package/test_imports.py):\n" + "\n".join(problems)
    )


def test_the_graph_sees_hidden_imports():
    """Function-level, TYPE_CHECKING, relative and importlib imports are all edges."""
    _, edges = _dflop_edges()
    pairs = {(e.source, e.target) for e in edges}
    assert (
        "dflop.cli",
        "dflop.commands",
    ) in pairs  # importlib.import_module(f"dflop.commands.{n}")
    assert ("dflop.scheduling.balance", "dflop._core") in pairs  # from dflop import _core
    assert ("dflop.dp", "dflop.dp.collate") in pairs  # in a function (torch on first use)


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """The checker itself, on a made-up package: a circle hidden in a function and a
    TYPE_CHECKING import of a higher layer are both reported."""
    pkg = tmp_path / "fake"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from fake.low import b\n",
        "low/b.py": "from . import a\n",
        "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.high.d import D\n",
        "high/__init__.py": "",
        "high/d.py": "from fake.low import b\nclass D: ...\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    modules = discover_modules(pkg, "fake")
    edges = import_edges(modules, "fake")
    cycles = find_cycles(edges)
    assert [[e.source for e in c] for _, c in cycles] == [["fake.low.a", "fake.low.b"]]
    problems = layer_violations(edges, (("fake",), ("low",), ("high",)))
    assert len(problems) == 1 and "fake.low.c (layer 1, low) imports fake.high.d" in problems[0]
    assert "upward" in problems[0]
    sideways = layer_violations(edges, (("fake",), ("low", "high")))
    assert len(sideways) == 2 and all("sideways" in p for p in sideways)
