"""dflop's training runtime on torch.distributed: topology (which rank holds which part
of the encoder and the LLM, and their process groups), the routing plan and the
inter-model communicator (encoder features to the LLM replicas, gradients back), and
launching (local processes or torchrun).

The layout and routing parts are pure Python/C++ and import without torch; the
communicator needs torch (imported on first use of its names).
"""

from __future__ import annotations

from typing import Any

from dflop.runtime.launch import (
    DEFAULT_TIMEOUT_S,
    ProcessInfo,
    SpawnError,
    init_from_env,
    spawn_local,
    spawn_threads,
)
from dflop.runtime.routing import RoutingPlan, UnitSplit, plan_routing, split_units
from dflop.runtime.topology import (
    ModuleLayout,
    RankInfo,
    RuntimeLayout,
    Topology,
    rank_info,
    uniform_layer_ranges,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BridgeCommunicator",
    "ModuleLayout",
    "PendingTransfer",
    "ProcessInfo",
    "RankInfo",
    "RoutingPlan",
    "RuntimeLayout",
    "SpawnError",
    "Topology",
    "UnitSplit",
    "init_from_env",
    "plan_routing",
    "rank_info",
    "spawn_local",
    "spawn_threads",
    "split_units",
    "uniform_layer_ranges",
]

_LAZY = {"BridgeCommunicator", "PendingTransfer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from dflop.runtime import bridge

        return getattr(bridge, name)
    raise AttributeError(f"module 'dflop.runtime' has no attribute {name!r}")
