"""Every field of a plan file checked before anything uses it.

:func:`check_plan` is what :meth:`dflop.planner.Plan.from_dict` (and so
:meth:`~dflop.planner.Plan.load`, ``dflop train --plan``, ``dflop simulate`` and
``dflop inspect``) runs first on the parsed JSON: types, ranges and consistency, in the
rules the planner's core applies to a layout (``check_layout`` in ``cpp/src/planner.cpp``):

- ``global_batch`` in [1, :data:`MAX_PLAN_GLOBAL_BATCH`]; every layout's equal to it;
  ``inputs.global_batch`` (when recorded) too.
- ``cluster``: a :class:`~dflop.planner.ClusterSpec` (``num_gpus`` in [2,
  :data:`MAX_PLAN_GPUS`]); every layout uses exactly its GPUs: the encoder on ranks [0, V),
  the LLM on [V, num_gpus) (a colocated layout: the LLM on all of them from rank 0).
- Per module: ``tp``, ``pp``, ``dp`` >= 1, ``tp`` dividing ``gpus_per_node``,
  ``first_rank`` and (but for a colocated encoder, whose heads are padded) the module's
  ``num_heads`` in ``inputs`` when recorded; ``layers_per_stage`` has ``pp x
  virtual_stages`` entries >= 1 (summing to the module's ``num_layers`` in ``inputs``
  when recorded); ``layer_ranges``, ``num_gpus`` and ``stage_ranks`` (when present) are
  those that ``layers_per_stage`` and the sizes give: ranges contiguous from 0 and
  covering the layers.
- ``num_microbatches`` in [1, global_batch], ``num_microbatches x llm.dp <=
  global_batch``; interleaving (``llm.virtual_stages > 1``) only disaggregated, with
  ``llm.pp >= 2`` and ``num_microbatches`` a multiple of ``llm.pp``.
- The prediction: finite, non-negative numbers; per-stage lists with one entry per
  physical stage; one step time per sampled batch (``inputs.num_batches``).
- Each recorded step (``steps``, one per sampled batch): ``assignment`` of
  ``global_batch`` bins in [0, num_microbatches x llm.dp), ``microbatch_order`` a
  permutation, every array of the shape the layout gives and of finite non-negative
  values, the encoder pieces in range.

A violation raises :class:`PlanError` (a ``ValueError``) of one line naming the field's
path, its value (at most :data:`MAX_SHOWN` characters) and the rule, e.g.
``layouts[0].encoder.layer_ranges[0]=[-5, 2] must be [0, 2] (...)``;
:meth:`~dflop.planner.Plan.load` prefixes the file.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NoReturn

import numpy as np

from dflop.scheduling.actions import PIPELINE_ORDERS

__all__ = [
    "MAX_PLAN_BATCHES",
    "MAX_PLAN_FILE_BYTES",
    "MAX_PLAN_GLOBAL_BATCH",
    "MAX_PLAN_GPUS",
    "MAX_PLAN_LAYERS",
    "MAX_SHOWN",
    "PlanError",
    "check_plan",
    "show",
]

MAX_PLAN_GLOBAL_BATCH = 1 << 24
"""The largest ``global_batch`` a plan may hold (16,777,216): the planner core's
``kMaxPlannerBatchSize``, the most it plans."""

MAX_PLAN_GPUS = 1 << 20
"""The largest ``cluster.num_gpus`` (and tp, pp, dp): the core's ``kMaxPlannerGpus``."""

MAX_PLAN_LAYERS = 1 << 16
"""The most layers per module: the core's ``kMaxPlannerLayers``."""

MAX_PLAN_BATCHES = 1 << 16
"""The most sampled batches: the core's ``kMaxPlannerBatches``."""

MAX_PLAN_LAYOUTS = 1 << 16
"""The most layouts a plan may list (the planner keeps ``top_k`` of them)."""

MAX_PLAN_FILE_BYTES = 64 << 20
"""The largest plan file read (64 MiB): a plan of 64k-sample batches is a few MB; a larger
file is not read into memory."""

MAX_PLAN_WIDTH = 1 << 17
"""The largest hidden, intermediate, head or patch size in a plan's model configs
(131,072: released models use at most about 30,000)."""

MAX_PLAN_VOCAB = 1 << 22
"""The largest vocabulary in a plan's LLM config (4,194,304: released ones are < 300,000)."""

MAX_SHOWN = 200
"""An error message shows at most this many characters of a value."""

_MAX_INT64 = (1 << 63) - 1


class PlanError(ValueError):
    """A plan field breaks a rule; the message names the field's path, value and rule."""


class _Full(Exception):
    pass


class _Text(str):
    """A description shown as it is (not quoted) in place of a value."""


def show(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr``-like text of a parsed JSON value, cut to ``limit`` characters (built
    piece by piece: a list of ten million numbers costs no more than a short one)."""
    out: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        out.append(text)
        size += len(text)
        if size > limit:
            raise _Full

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            put("[")
            for i, item in enumerate(v):
                if i:
                    put(", ")
                walk(item)
            put("]")
        elif isinstance(v, dict):
            put("{")
            for i, (key, item) in enumerate(v.items()):
                put(", " if i else "")
                walk(key)
                put(": ")
                walk(item)
            put("}")
        elif isinstance(v, _Text):
            put(str(v))
        elif isinstance(v, str):
            put(repr(v[: limit + 1]))
        elif isinstance(v, np.ndarray):
            walk(v.ravel()[: limit + 1].tolist() if v.ndim == 1 else v[: limit + 1].tolist())
        else:
            try:
                put(repr(v))
            except ValueError:  # an int too long for str()
                put(f"<{type(v).__name__} too large to show>")

    with contextlib.suppress(_Full, RecursionError):
        walk(value)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(path: str, value: Any, rule: str) -> NoReturn:
    raise PlanError(f"{path}={show(value)} {rule}")


def _missing(path: str) -> NoReturn:
    raise PlanError(f"{path} is missing")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dict(
    path: str, value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``value`` as a JSON object with ``required`` keys and no others but ``optional``."""
    if not isinstance(value, dict):
        _fail(path, value, "must be a JSON object")
    for key in required:
        if key not in value:
            _missing(_join(path, key))
    known = set(required) | set(optional)
    for key in value:
        if key not in known:
            where = path or "the plan"
            raise PlanError(
                f"{where} has an unknown field {show(key)} (known: {', '.join(sorted(known))})"
            )
    return value


def _int(path: str, value: Any, low: int, high: int = _MAX_INT64) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _fail(path, value, "must be an integer")
    if not low <= value <= high:
        _fail(path, value, f"must be in [{low:,}, {high:,}]")
    return int(value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        _fail(path, value, "must be true or false")
    return bool(value)


def _str(path: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        _fail(path, value, "must be a string")
    if choices is not None and value not in choices:
        _fail(path, value, f"must be one of {', '.join(map(repr, choices))}")
    return value


def _number(
    path: str, value: Any, *, positive: bool = False, at_most: float | None = None
) -> float:
    """A finite number >= 0 (> 0 with ``positive``; <= ``at_most`` when given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(path, value, "must be a number")
    try:
        number = float(value)
    except OverflowError:
        _fail(path, value, "must be a finite number")
    if not math.isfinite(number):
        _fail(path, value, "must be a finite number")
    if number < 0 or (positive and number == 0):
        _fail(path, value, "must be > 0" if positive else "must be >= 0")
    if at_most is not None and number > at_most:
        _fail(path, value, f"must be <= {at_most:g}")
    return number


def _array(path: str, value: Any, kind: str, shape: tuple[int, ...] | None) -> np.ndarray:
    """A (nested) JSON list as an array of ``kind`` ("f": finite numbers >= 0, "i":
    integers) of ``shape`` (None: 1-D of any length); an empty list fits any shape of
    size 0. Returns the array."""
    if not isinstance(value, list):
        _fail(path, value, "must be a list")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError):
        _fail(path, value, "must be a rectangular array of numbers")
    expected = "(n,)" if shape is None else str(shape)
    if array.size == 0 and (shape is None or math.prod(shape) == 0):
        return array.reshape(shape if shape is not None else (0,)).astype(
            np.float64 if kind == "f" else np.int64
        )
    if shape is None:
        if array.ndim != 1:
            _fail(path, value, f"must be a 1-D list, got shape {array.shape}")
    elif array.shape != shape:
        _fail(path, value, f"must have shape {expected} (from the layout), got {array.shape}")
    if kind == "i":
        if array.dtype.kind not in "iu" or array.dtype == np.bool_:
            _fail(path, value, "must hold integers")
        return array.astype(np.int64)
    if array.dtype.kind not in "iuf" or array.dtype == np.bool_:
        _fail(path, value, "must hold numbers")
    floats = array.astype(np.float64)
    bad = ~(np.isfinite(floats) & (floats >= 0))
    if bad.any():
        index = np.unravel_index(int(np.argmax(bad)), floats.shape)
        where = path + "".join(f"[{i}]" for i in index)
        _fail(where, floats[index].item(), "must be finite and >= 0")
    return floats


def _index(path: str, array: np.ndarray, low: int, high: int, rule: str) -> None:
    """Every entry of the int ``array`` in [low, high)."""
    bad = (array < low) | (array >= high)
    if bad.any():
        i = int(np.argmax(bad))
        _fail(f"{path}[{i}]", int(array[i]), f"must be in [{low}, {high}) ({rule})")


# ---------------------------------------------------------------------------- plan

_PLAN_REQUIRED = ("format", "version", "global_batch", "cluster", "layouts")
_PLAN_OPTIONAL = ("inputs", "baseline", "reference", "stats", "planning_time_s")

_CLUSTER_REQUIRED = ("num_gpus",)
_CLUSTER_OPTIONAL = (
    "gpus_per_node",
    "gpu_memory_bytes",
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "link_latency_s",
    "tp_gemm_loss",
    "memory_reserve_bytes",
)


def check_plan(data: Any, *, plan_format: str, max_version: int) -> None:
    """Raise :class:`PlanError` at the first field of the parsed plan JSON ``data`` that
    breaks a rule (see the module's docstring); return None when all hold."""
    if not isinstance(data, dict):
        _fail("the plan", data, "must be a JSON object")
    if data.get("format") != plan_format:
        _fail("format", data.get("format"), f"must be {plan_format!r} (not a dflop plan)")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        _fail("version", version, f"must be an integer in [1, {max_version}]")
    if version > max_version:
        raise PlanError(
            f"plan version {version} is not supported (this dflop reads 1..{max_version})"
        )
    layouts = data.get("layouts")
    if layouts is not None and not isinstance(layouts, list):
        _fail("layouts", layouts, "must be a list")
    if not layouts:  # the planner raises instead of planning nothing
        raise PlanError("the plan holds no layout (layouts is empty or missing)")
    if len(layouts) > MAX_PLAN_LAYOUTS:
        _fail(
            "layouts", _Text(f"<{len(layouts)} layouts>"), f"must hold at most {MAX_PLAN_LAYOUTS}"
        )
    _dict("", data, _PLAN_REQUIRED, _PLAN_OPTIONAL)
    global_batch = _int("global_batch", data["global_batch"], 1, MAX_PLAN_GLOBAL_BATCH)
    cluster = _check_cluster(data["cluster"])
    inputs = _check_inputs(data.get("inputs", {}), global_batch)
    if "stats" in data and not isinstance(data["stats"], dict):
        _fail("stats", data["stats"], "must be a JSON object")
    if "planning_time_s" in data:
        _number("planning_time_s", data["planning_time_s"])
    context = _Context(global_batch, cluster, inputs)
    for i, layout in enumerate(layouts):
        _check_layout(f"layouts[{i}]", layout, context)
    for name in ("baseline", "reference"):
        if data.get(name) is not None:
            _check_layout(name, data[name], context)


class _Context:
    """What every layout is checked against."""

    def __init__(self, global_batch: int, cluster: dict[str, Any], inputs: dict[str, Any]):
        self.global_batch = global_batch
        self.num_gpus = int(cluster["num_gpus"])
        self.gpus_per_node = int(cluster.get("gpus_per_node", 8))
        self.num_batches = inputs.get("num_batches")
        self.num_layers: dict[str, int] = {}
        self.num_heads: dict[str, int] = {}
        for module in ("encoder", "llm"):
            config = inputs.get(module)
            if isinstance(config, dict):  # checked by _check_configs: a valid config
                if "num_layers" in config:
                    self.num_layers[module] = config["num_layers"]
                if isinstance(config.get("num_heads"), int):
                    self.num_heads[module] = config["num_heads"]


def _check_cluster(value: Any) -> dict[str, Any]:
    from dflop.planner.model import ClusterSpec

    cluster = _dict("cluster", value, _CLUSTER_REQUIRED, _CLUSTER_OPTIONAL)
    _int("cluster.num_gpus", cluster["num_gpus"], 2, MAX_PLAN_GPUS)
    if "gpus_per_node" in cluster:
        _int("cluster.gpus_per_node", cluster["gpus_per_node"], 1, MAX_PLAN_GPUS)
    for key in ("gpu_memory_bytes", "intra_node_bandwidth_bytes_per_s"):
        if key in cluster:
            _number(f"cluster.{key}", cluster[key], positive=True)
    if "inter_node_bandwidth_bytes_per_s" in cluster:
        _number(
            "cluster.inter_node_bandwidth_bytes_per_s",
            cluster["inter_node_bandwidth_bytes_per_s"],
            positive=True,
        )
    for key in ("link_latency_s", "tp_gemm_loss", "memory_reserve_bytes"):
        if key in cluster:
            _number(f"cluster.{key}", cluster[key])
    try:
        ClusterSpec(**cluster)  # its own cross-field rules (the reserve below the memory)
    except (TypeError, ValueError) as error:
        raise PlanError(f"cluster: {error}") from None
    return cluster


_INPUT_STRINGS = (
    "model",
    "perf",
    "shapes",
    "preset",
    "data",
    "image_folder",
    "video_folder",
    "family",
)


def _check_inputs(value: Any, global_batch: int) -> dict[str, Any]:
    """The recorded inputs (free-form, but the fields dflop reads back are checked)."""
    if not isinstance(value, dict):
        _fail("inputs", value, "must be a JSON object")
    inputs = value
    for key in _INPUT_STRINGS:
        if inputs.get(key) is not None:
            _str(f"inputs.{key}", inputs[key])
    if "local" in inputs:
        _bool("inputs.local", inputs["local"])
    if "zero1" in inputs:
        _bool("inputs.zero1", inputs["zero1"])
    if "num_batches" in inputs:
        _int("inputs.num_batches", inputs["num_batches"], 1, MAX_PLAN_BATCHES)
    if "seed" in inputs:
        _int("inputs.seed", inputs["seed"], 0, (1 << 64) - 1)
    if "element_bytes" in inputs:
        _int("inputs.element_bytes", inputs["element_bytes"], 1, 16)
    if "loss_chunk_tokens" in inputs:
        _int("inputs.loss_chunk_tokens", inputs["loss_chunk_tokens"], 1, (1 << 31) - 1)
    if "global_batch" in inputs and inputs["global_batch"] != global_batch:
        _fail(
            "global_batch",
            global_batch,
            f"must equal inputs.global_batch={show(inputs['global_batch'])} (the batch size "
            "the plan was made for)",
        )
    if "gpu_flops" in inputs:
        _number("inputs.gpu_flops", inputs["gpu_flops"], positive=True)
    if "mfu" in inputs:
        _number("inputs.mfu", inputs["mfu"], positive=True, at_most=1.0)
    if "forward_fraction" in inputs:
        fractions = inputs["forward_fraction"]
        if not isinstance(fractions, list) or len(fractions) != 2:
            _fail("inputs.forward_fraction", fractions, "must be [encoder share, LLM share]")
        for k, share in enumerate(fractions):
            share = _number(f"inputs.forward_fraction[{k}]", share, positive=True)
            if share >= 1:
                _fail(f"inputs.forward_fraction[{k}]", share, "must be in (0, 1)")
    for key in ("mix", "scaler"):
        if inputs.get(key) is not None and not isinstance(inputs[key], dict):
            _fail(f"inputs.{key}", inputs[key], "must be a JSON object or null")
    _check_configs(inputs)
    model = inputs.get("performance_model")
    if model is not None:
        if not isinstance(model, dict):
            _fail("inputs.performance_model", model, "must be a JSON object or null")
        from dflop.profiling.perf_model import PerformanceModel

        try:
            PerformanceModel.from_dict(model)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            what = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise PlanError(f"inputs.performance_model: {_one_line(what)}") from None
    return inputs


def _check_configs(inputs: dict[str, Any]) -> None:
    """``inputs.encoder`` / ``inputs.llm``: a preset name or a config (what ``dflop
    simulate`` rebuilds a layout's batches with)."""
    from dflop.data.costs import EncoderConfig, LLMConfig

    for key, cls in (("encoder", EncoderConfig), ("llm", LLMConfig)):
        config = inputs.get(key)
        if config is None or isinstance(config, str):
            continue
        if not isinstance(config, dict):
            _fail(f"inputs.{key}", config, "must be a preset name or a config object")
        if "num_layers" in config:
            _int(f"inputs.{key}.num_layers", config["num_layers"], 1, MAX_PLAN_LAYERS)
        for name, value in config.items():  # sizes in the range of any real model
            if name != "num_layers" and isinstance(value, int) and not isinstance(value, bool):
                high = MAX_PLAN_VOCAB if name == "vocab_size" else MAX_PLAN_WIDTH
                _int(f"inputs.{key}.{name}", value, 0, high)
        try:
            cls(**config)
        except (TypeError, ValueError) as error:
            raise PlanError(f"inputs.{key}: {_one_line(str(error))}") from None


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 2 * MAX_SHOWN else text[: 2 * MAX_SHOWN - 3] + "..."


# ---------------------------------------------------------------------------- layouts

_LAYOUT_REQUIRED = ("encoder", "llm", "num_microbatches", "global_batch", "prediction")
_LAYOUT_OPTIONAL = ("colocated", "scheduler", "schedule", "steps", "order")  # schedule: older
_MODULE_REQUIRED = ("tp", "pp", "dp", "first_rank", "layers_per_stage")
_MODULE_OPTIONAL = (
    "num_gpus",
    "colocated",
    "recompute",
    "padded_heads",
    "virtual_stages",
    "layer_ranges",
    "stage_ranks",
)


def _check_layout(path: str, value: Any, context: _Context) -> None:
    layout = _dict(path, value, _LAYOUT_REQUIRED, _LAYOUT_OPTIONAL)
    colocated = _bool(f"{path}.colocated", layout.get("colocated", False))
    for key in ("scheduler", "schedule"):
        _str(f"{path}.{key}", layout.get(key, "balanced"), ("balanced", "data_blind"))
    if layout.get("order") is not None:
        _str(f"{path}.order", layout["order"], PIPELINE_ORDERS)
    batch = _int(f"{path}.global_batch", layout["global_batch"], 1, MAX_PLAN_GLOBAL_BATCH)
    if batch != context.global_batch:
        _fail(
            f"{path}.global_batch",
            layout["global_batch"],
            f"must equal the plan's global_batch={context.global_batch}",
        )
    encoder = _check_module(f"{path}.encoder", layout["encoder"], "encoder", context)
    llm = _check_module(f"{path}.llm", layout["llm"], "llm", context)
    global_batch = context.global_batch
    m = _int(f"{path}.num_microbatches", layout["num_microbatches"], 1, global_batch)
    if m * llm["dp"] > global_batch:
        _fail(
            f"{path}.num_microbatches",
            m,
            f"x llm.dp={llm['dp']} must be <= global_batch={global_batch} (a sample per "
            "microbatch and replica at least)",
        )
    if encoder["virtual_stages"] != 1:
        _fail(
            f"{path}.encoder.virtual_stages",
            encoder["virtual_stages"],
            "must be 1 (only the LLM is interleaved)",
        )
    if llm["virtual_stages"] > 1:
        if colocated or llm["pp"] < 2:
            _fail(
                f"{path}.llm.virtual_stages",
                llm["virtual_stages"],
                "> 1 needs a disaggregated layout with llm.pp >= 2",
            )
        if m % llm["pp"]:
            _fail(
                f"{path}.num_microbatches",
                m,
                f"must be a multiple of llm.pp={llm['pp']} (interleaved 1F1B)",
            )
    num_gpus = context.num_gpus
    llm_gpus = llm["tp"] * llm["pp"] * llm["dp"]
    if encoder["colocated"] != colocated:
        _fail(
            f"{path}.encoder.colocated",
            encoder["colocated"],
            f"must equal the layout's colocated={str(colocated).lower()}",
        )
    if llm["colocated"]:
        _fail(f"{path}.llm.colocated", True, "must be false (the LLM always has GPUs)")
    if colocated:
        if llm["first_rank"] != 0:
            _fail(f"{path}.llm.first_rank", llm["first_rank"], "must be 0 (a colocated layout)")
        if llm_gpus != num_gpus:
            _fail(
                f"{path}.llm",
                _Text(f"tp={llm['tp']} x pp={llm['pp']} x dp={llm['dp']} = {llm_gpus} GPUs"),
                f"must use the cluster's num_gpus={num_gpus} (a colocated layout)",
            )
    else:
        encoder_gpus = encoder["tp"] * encoder["pp"] * encoder["dp"]
        if encoder["first_rank"] != 0:
            _fail(f"{path}.encoder.first_rank", encoder["first_rank"], "must be 0")
        if llm["first_rank"] != encoder_gpus:
            _fail(
                f"{path}.llm.first_rank",
                llm["first_rank"],
                f"must be {encoder_gpus} (right after the encoder's ranks)",
            )
        if encoder_gpus + llm_gpus != num_gpus:
            _fail(
                "cluster.num_gpus",
                num_gpus,
                f"must equal the world size of {path}: {encoder_gpus} encoder + {llm_gpus} "
                f"LLM ranks = {encoder_gpus + llm_gpus}",
            )
    _check_derived(f"{path}.encoder", encoder)
    _check_derived(f"{path}.llm", llm)
    stages = llm["pp"] + (0 if colocated else encoder["pp"])
    num_steps = _check_prediction(f"{path}.prediction", layout["prediction"], stages, context)
    steps = layout.get("steps", [])
    if not isinstance(steps, list):
        _fail(f"{path}.steps", steps, "must be a list")
    if steps and len(steps) != num_steps:
        _fail(
            f"{path}.steps",
            _Text(f"<{len(steps)} steps>"),
            f"must hold one step per sampled batch ({num_steps}, as "
            f"{path}.prediction.step_times_s)",
        )
    for k, step in enumerate(steps):
        _check_step(f"{path}.steps[{k}]", step, encoder, llm, colocated, m, global_batch)


def _check_module(path: str, value: Any, name: str, context: _Context) -> dict[str, Any]:
    """One module's layout; returns its sizes (with defaults filled in)."""
    module = _dict(path, value, _MODULE_REQUIRED, _MODULE_OPTIONAL)
    out: dict[str, Any] = {}
    for key in ("tp", "pp", "dp"):
        out[key] = _int(f"{path}.{key}", module[key], 1, MAX_PLAN_GPUS)
    out["first_rank"] = _int(f"{path}.first_rank", module["first_rank"], 0, MAX_PLAN_GPUS - 1)
    out["colocated"] = _bool(f"{path}.colocated", module.get("colocated", False))
    _bool(f"{path}.recompute", module.get("recompute", False))
    _int(f"{path}.padded_heads", module.get("padded_heads", 0), 0, 1 << 20)
    chunks = _int(f"{path}.virtual_stages", module.get("virtual_stages", 1), 1, MAX_PLAN_LAYERS)
    out["virtual_stages"] = chunks
    tp = out["tp"]
    if context.gpus_per_node % tp:
        _fail(
            f"{path}.tp",
            tp,
            f"must divide cluster.gpus_per_node={context.gpus_per_node} (a TP group stays in "
            "a node)",
        )
    if out["first_rank"] % tp:
        _fail(f"{path}.first_rank", out["first_rank"], f"must be a multiple of tp={tp}")
    heads = context.num_heads.get(name)
    if heads is not None and heads % tp and not out["colocated"]:  # colocated: padded
        _fail(f"{path}.tp", tp, f"must divide inputs.{name}.num_heads={heads}")
    layers = module["layers_per_stage"]
    virtual = out["pp"] * chunks
    if not isinstance(layers, list) or len(layers) != virtual:
        _fail(
            f"{path}.layers_per_stage",
            layers,
            f"must list pp x virtual_stages = {virtual} layer counts",
        )
    for s, count in enumerate(layers):
        _int(f"{path}.layers_per_stage[{s}]", count, 1, MAX_PLAN_LAYERS)
    total = sum(layers)
    out["layers_per_stage"] = layers
    expected = context.num_layers.get(name)
    if expected is not None and total != expected:
        _fail(
            f"{path}.layers_per_stage",
            layers,
            f"must sum to inputs.{name}.num_layers={expected} (they sum to {total})",
        )
    out["module"] = module
    return out


def _check_derived(path: str, out: dict[str, Any]) -> None:
    """The fields a module's sizes determine (``num_gpus``, ``layer_ranges``,
    ``stage_ranks``), when the file holds them: checked after the layout's rank rules,
    so that a wrong size is named rather than what follows from it."""
    module, layers, tp = out["module"], out["layers_per_stage"], out["tp"]
    virtual, total = len(layers), sum(layers)
    colocated = out["colocated"]
    if "num_gpus" in module:
        gpus = 0 if colocated else tp * out["pp"] * out["dp"]
        if module["num_gpus"] != gpus:
            _fail(
                f"{path}.num_gpus",
                module["num_gpus"],
                f"must be {gpus} ({'colocated' if colocated else 'tp x pp x dp'})",
            )
    if "layer_ranges" in module:
        ranges = module["layer_ranges"]
        if not isinstance(ranges, list) or len(ranges) != virtual:
            _fail(f"{path}.layer_ranges", ranges, f"must list {virtual} [start, end) ranges")
        start = 0
        for s, (count, pair) in enumerate(zip(layers, ranges)):
            if pair != [start, start + count]:
                _fail(
                    f"{path}.layer_ranges[{s}]",
                    pair,
                    f"must be {[start, start + count]} (contiguous from 0 over the "
                    f"{total} layers, as layers_per_stage gives)",
                )
            start += count
    if "stage_ranks" in module:
        ranks = module["stage_ranks"]
        if colocated:
            if ranks != []:
                _fail(f"{path}.stage_ranks", ranks, "must be [] (a colocated encoder)")
        else:
            first, pp, dp = out["first_rank"], out["pp"], out["dp"]
            if not isinstance(ranks, list) or len(ranks) != pp:
                _fail(f"{path}.stage_ranks", ranks, f"must list pp={pp} stages")
            for s in range(pp):
                want = [[first + s * tp * dp + d * tp + t for t in range(tp)] for d in range(dp)]
                if ranks[s] != want:
                    _fail(
                        f"{path}.stage_ranks[{s}]",
                        ranks[s],
                        f"must be {show(want)} (first_rank + stage x tp x dp + replica x tp "
                        "+ tp rank)",
                    )


_PREDICTION_REQUIRED = (
    "step_time_s",
    "throughput_samples_per_s",
    "idle_fraction",
    "lower_bound_s",
    "step_time_as_scheduled_s",
    "stage_compute_s",
    "stage_allreduce_s",
    "stage_bubble_s",
    "transfer_s",
    "peak_memory_bytes",
    "step_times_s",
)
_PREDICTION_OPTIONAL = ("microbatch_orders", "estimate_s", "stage_memory_bytes")
_ORDERS = ("as_scheduled", "longest_first", "shortest_first", "short_ends")


def _check_prediction(path: str, value: Any, stages: int, context: _Context) -> int:
    """The prediction; returns its number of sampled batches."""
    prediction = _dict(path, value, _PREDICTION_REQUIRED, _PREDICTION_OPTIONAL)
    for key in (
        "step_time_s",
        "throughput_samples_per_s",
        "lower_bound_s",
        "step_time_as_scheduled_s",
        "transfer_s",
        "peak_memory_bytes",
        "estimate_s",
    ):
        if key in prediction:
            _number(f"{path}.{key}", prediction[key])
    idle = prediction["idle_fraction"]  # a share, up to rounding
    if (
        isinstance(idle, bool)
        or not isinstance(idle, (int, float))
        or not -1e-9 <= idle <= 1 + 1e-9
    ):
        _fail(f"{path}.idle_fraction", idle, "must be a number in [0, 1]")
    for key in ("stage_compute_s", "stage_allreduce_s"):
        _array(f"{path}.{key}", prediction[key], "f", (stages,))
    bubble = prediction["stage_bubble_s"]
    if not isinstance(bubble, list) or len(bubble) != stages:
        _fail(f"{path}.stage_bubble_s", bubble, f"must list {stages} stages' times")
    for s, seconds in enumerate(bubble):  # step time - compute - all-reduce: may round < 0
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            _fail(f"{path}.stage_bubble_s[{s}]", seconds, "must be a number")
        if not math.isfinite(seconds):
            _fail(f"{path}.stage_bubble_s[{s}]", seconds, "must be finite")
    memory = prediction.get("stage_memory_bytes", [])
    if memory != []:
        _array(f"{path}.stage_memory_bytes", memory, "f", (stages,))
    times = _array(f"{path}.step_times_s", prediction["step_times_s"], "f", None)
    batches = len(times)
    if batches == 0:
        _fail(f"{path}.step_times_s", [], "must hold a step time per sampled batch")
    if context.num_batches is not None and batches != context.num_batches:
        _fail(
            f"{path}.step_times_s",
            _Text(f"<{batches} step times>"),
            f"must hold one per sampled batch (inputs.num_batches={context.num_batches})",
        )
    orders = prediction.get("microbatch_orders", [])
    if not isinstance(orders, list) or len(orders) not in (0, batches):
        _fail(f"{path}.microbatch_orders", orders, f"must list {batches} orders (or none)")
    for k, order in enumerate(orders):
        _str(f"{path}.microbatch_orders[{k}]", order, _ORDERS)
    return batches


_STEP_REQUIRED = (
    "step_time_s",
    "assignment",
    "microbatch_order",
    "encoder_forward_s",
    "encoder_backward_s",
    "llm_forward_s",
    "llm_backward_s",
    "pieces",
    "activation_bytes",
    "link_latency_s",
    "link_bandwidth_bytes_per_s",
    "allreduce_s",
)
_STEP_OPTIONAL = ("samples", "llm_chunks", "gradient_links", "order", "weight_s")
_PIECES = ("microbatch", "sample", "first_unit", "num_units", "replica")
_SAMPLES = ("encoder_units", "encoder_s", "llm_s")


def _check_step(
    path: str,
    value: Any,
    encoder: dict[str, Any],
    llm: dict[str, Any],
    colocated: bool,
    m: int,
    global_batch: int,
) -> None:
    step = _dict(path, value, _STEP_REQUIRED, _STEP_OPTIONAL)
    _number(f"{path}.step_time_s", step["step_time_s"])
    replicas, chunks = llm["dp"], llm["virtual_stages"]
    chunk_count = _int(f"{path}.llm_chunks", step.get("llm_chunks", 1), 1, MAX_PLAN_LAYERS)
    if chunk_count != chunks:
        _fail(f"{path}.llm_chunks", chunk_count, f"must equal llm.virtual_stages={chunks}")
    # The recorded step's sizes first: a changed layout field is named, not every array
    # that no longer fits it.
    recorded = step["assignment"]
    if isinstance(recorded, list) and recorded and len(recorded) != global_batch:
        _fail(
            "global_batch",
            global_batch,
            f"must equal the batch size of the recorded steps ({len(recorded)} samples in "
            f"{path}.assignment)",
        )
    recorded = step["microbatch_order"]
    if isinstance(recorded, list) and recorded and len(recorded) != m:
        _fail(
            f"{path.rsplit('.steps[', 1)[0]}.num_microbatches",
            m,
            f"must equal the recorded steps' microbatch count ({len(recorded)} in "
            f"{path}.microbatch_order)",
        )
    bins = m * replicas
    assignment = _array(f"{path}.assignment", step["assignment"], "i", (global_batch,))
    _index(
        f"{path}.assignment",
        assignment,
        0,
        bins,
        f"num_microbatches={m} x llm.dp={replicas} bins",
    )
    order = _array(f"{path}.microbatch_order", step["microbatch_order"], "i", (m,))
    if not np.array_equal(np.sort(order), np.arange(m)):
        _fail(
            f"{path}.microbatch_order",
            step["microbatch_order"],
            f"must be a permutation of 0..{m - 1}",
        )
    encoder_stages = 0 if colocated else encoder["pp"]
    llm_virtual = llm["pp"] * chunks
    for key in ("llm_forward_s", "llm_backward_s"):
        _array(f"{path}.{key}", step[key], "f", (replicas, llm_virtual, m))
    encoder_shape = (0, 0, 0) if colocated else (encoder["dp"], encoder_stages, m)
    for key in ("encoder_forward_s", "encoder_backward_s"):
        _array(f"{path}.{key}", step[key], "f", encoder_shape)
    links = encoder_stages + llm_virtual - 1
    _array(f"{path}.activation_bytes", step["activation_bytes"], "f", (replicas, links, m))
    _array(f"{path}.link_latency_s", step["link_latency_s"], "f", (links,))
    bandwidth = step["link_bandwidth_bytes_per_s"]
    if not isinstance(bandwidth, list) or len(bandwidth) != links:
        _fail(f"{path}.link_bandwidth_bytes_per_s", bandwidth, f"must list {links} links")
    for k, rate in enumerate(bandwidth):  # inf: a free link
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            _fail(f"{path}.link_bandwidth_bytes_per_s[{k}]", rate, "must be a number > 0")
    _array(f"{path}.allreduce_s", step["allreduce_s"], "f", (encoder_stages + llm["pp"],))
    if step.get("order") is not None:
        _str(f"{path}.order", step["order"], PIPELINE_ORDERS)
    if step.get("weight_s"):  # absent or empty: no split backward
        weight = _array(
            f"{path}.weight_s", step["weight_s"], "f", (replicas, encoder_stages + llm_virtual, m)
        )
        if (weight < 0).any():
            _fail(f"{path}.weight_s", float(weight.min()), "must be >= 0")
    if step.get("gradient_links"):  # absent or empty: every link carries gradients
        cut = _array(f"{path}.gradient_links", step["gradient_links"], "i", (links,))
        if ((cut != 0) & (cut != 1)).any():
            k = int(np.argmax((cut != 0) & (cut != 1)))
            _fail(f"{path}.gradient_links[{k}]", int(cut[k]), "must be 0 or 1")
    samples = step.get("samples", {})
    units = None
    if not isinstance(samples, dict):
        _fail(f"{path}.samples", samples, "must be a JSON object")
    for key in samples:
        if key not in _SAMPLES:
            raise PlanError(
                f"{path}.samples has an unknown field {show(key)} (known: {', '.join(_SAMPLES)})"
            )
        kind = "i" if key == "encoder_units" else "f"
        array = _array(f"{path}.samples.{key}", samples[key], kind, (global_batch,))
        if key == "encoder_units":
            _index(f"{path}.samples.encoder_units", array, 0, 1 << 40, "a unit count")
            units = array
    pieces = _dict(f"{path}.pieces", step["pieces"], _PIECES)
    columns = {k: _array(f"{path}.pieces.{k}", pieces[k], "i", None) for k in _PIECES}
    count = len(columns["microbatch"])
    for key, column in columns.items():
        if len(column) != count:
            _fail(
                f"{path}.pieces.{key}",
                _Text(f"<{len(column)} entries>"),
                f"must have as many entries as pieces.microbatch ({count})",
            )
    _index(f"{path}.pieces.microbatch", columns["microbatch"], 0, m, f"num_microbatches={m}")
    _index(f"{path}.pieces.sample", columns["sample"], 0, global_batch, "a sample of the batch")
    _index(f"{path}.pieces.first_unit", columns["first_unit"], 0, 1 << 40, "a unit index")
    _index(f"{path}.pieces.num_units", columns["num_units"], 1, 1 << 40, "a unit count")
    if colocated:  # the encoder runs in the LLM's first stage: no replicas of its own
        return
    _index(
        f"{path}.pieces.replica",
        columns["replica"],
        0,
        encoder["dp"],
        f"encoder.dp={encoder['dp']} replicas",
    )
    if units is not None:
        end = columns["first_unit"] + columns["num_units"]
        over = end > units[columns["sample"]]
        if over.any():
            i = int(np.argmax(over))
            _fail(
                f"{path}.pieces.num_units[{i}]",
                int(columns["num_units"][i]),
                f"overruns sample {int(columns['sample'][i])}'s "
                f"{int(units[columns['sample'][i]])} units",
            )
