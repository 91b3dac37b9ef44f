"""Per-step metrics from the ranks' measured actions, and the run's summary.

Every rank reports, per step and schedule mode, a :class:`RankRecord`: its executed
actions with start/end times (seconds from its step start; the ranks start together,
right after the schedule broadcast). Rank 0 turns them into a :class:`StepMetrics`:

- ``step_time_s``: the slowest rank's step (the step ends when every rank is done);
- ``busy_share[s]``: forward + backward seconds of global stage ``s`` over the step time,
  averaged over its ranks; ``idle_share``: idle rank-seconds over all rank-seconds
  (``1 - busy``: pipeline bubbles, waits for imbalanced microbatches, all-reduces);
- throughput: global batch samples and LLM tokens (packed positions) per second, and
  TFLOP/s and MFU as torchtitan counts them: the model's training FLOPs of the step (3x
  the forward of encoder, projector and LLM, whatever the regime trains) over the step
  time, and over the ranks' summed peak where the peak is known (stated, or a known GPU;
  none on CPU).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "TrainReport",
    "MetricsFile",
    "ModeSummary",
    "RankRecord",
    "StepLog",
    "StepMetrics",
    "TensorBoardLogger",
    "WandbLogger",
    "check_loggers",
    "metrics_jsonl_path",
    "peak_flops",
    "step_metrics",
    "summarise",
]


def metrics_jsonl_path(config: Any) -> str | None:
    """Where a run's per-step JSON lines go: ``metrics_jsonl``, else ``metrics.jsonl`` in
    the run's output folder (``TrainConfig.output_folder``); "" turns them off."""
    import os

    if config.metrics_jsonl is not None:
        return config.metrics_jsonl or None
    return os.path.join(config.output_folder, "metrics.jsonl")


_SCALARS = (
    "loss",
    "grad_norm",
    "step_time_s",
    "predicted_step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_s",
    "mfu",
    "idle_share",
)
"""What the loggers plot per step and mode (as ``MODE/NAME``; an unknown value is left out)."""


def _scalars(row: StepMetrics) -> dict[str, float]:
    values = {name: getattr(row, name) for name in _SCALARS}
    return {f"{row.mode}/{k}": float(v) for k, v in values.items() if math.isfinite(v)}


class TensorBoardLogger:
    """Event files in ``OUTPUT/tensorboard`` (``tensorboard --logdir OUTPUT/tensorboard``)."""

    name = "TensorBoard"

    def __init__(self, config: Any) -> None:
        import os

        from torch.utils.tensorboard import SummaryWriter

        self.folder = os.path.join(config.output_folder, "tensorboard")
        self._writer = SummaryWriter(self.folder)

    def log(self, row: StepMetrics) -> None:
        for tag, value in _scalars(row).items():
            self._writer.add_scalar(tag, value, row.step + 1)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run in ``config.wandb_project``, its files in ``OUTPUT/wandb``;
    ``wandb_mode="offline"`` keeps everything on this machine (``wandb sync`` uploads it)."""

    name = "W&B"

    def __init__(self, config: Any) -> None:
        import dataclasses
        import os

        import wandb

        self.folder = os.path.join(config.output_folder, "wandb")
        os.makedirs(self.folder, exist_ok=True)
        settings = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
        self._run = wandb.init(
            project=config.wandb_project,
            dir=config.output_folder,
            mode=config.wandb_mode or os.environ.get("WANDB_MODE") or "online",
            config=settings,
        )

    def log(self, row: StepMetrics) -> None:
        self._run.log(_scalars(row), step=row.step + 1)

    def close(self) -> None:
        self._run.finish()


LOGGER_CLASSES = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}

WANDB_CONNECT_TIMEOUT_S = 5.0
"""How long the check before a run waits to reach the W&B server."""


def check_loggers(config: Any) -> None:
    """Before any process starts: W&B's online mode needs an API key and its server, else
    the run would fail (or hang for minutes) only after profiling and starting the ranks.
    Raises ValueError in one line naming what is missing and the offline mode."""
    import netrc
    import os
    import socket
    from urllib.parse import urlparse

    if "wandb" not in config.loggers:
        return
    mode = config.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    if mode != "online":
        return
    offline = "--wandb-mode offline keeps the run on this machine ('wandb sync' uploads it later)"
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        with contextlib.suppress(OSError, netrc.NetrcParseError):
            key = (netrc.netrc().authenticators(host) or (None, None, None))[2]
    if not key:
        raise ValueError(
            f"--log wandb: W&B's online mode needs an API key for {host} (WANDB_API_KEY, or "
            f"'wandb login') and none is set; {offline}"
        )
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=WANDB_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise ValueError(
            f"--log wandb: cannot reach the W&B server {host}:{port} ({error}); {offline}"
        ) from None


@dataclass(frozen=True)
class RankRecord:
    """One rank's measured step (picklable; gathered to rank 0)."""

    rank: int
    module: str
    dp_rank: int
    global_stage: int
    step_time_s: float
    busy_s: float
    actions: tuple[tuple[str, int, float, float], ...]
    """(kind "forward"/"backward", microbatch, start_s, end_s) in execution order."""
    encoder_forward_s: tuple[tuple[int, float], ...] = ()
    """A colocated first stage's (microbatch, seconds of its forward in the encoder)."""


@dataclass(frozen=True)
class StepMetrics:
    """One step of one schedule mode (rank 0's view)."""

    step: int
    mode: str
    loss: float
    step_time_s: float
    idle_share: float
    idle_s: float
    """Idle rank-seconds summed over ranks."""
    busy_share: tuple[float, ...]
    """Per global stage (encoder stages first)."""
    samples_per_s: float
    tokens_per_s: float
    predicted_step_time_s: float = math.nan
    """The simulator's prediction from the cost model before the step (nan: none)."""
    schedule_ratio: float = math.nan
    """The schedule's makespan / lower bound."""
    grad_norm: float = math.nan
    """Global gradient norm before clipping (every parameter of every stage once)."""
    plan_model_step_time_s: float = math.nan
    """The step as the plan's model (uncorrected) predicts it (nan: none, or not the
    dflop schedule)."""
    tflops_per_s: float = math.nan
    """The step's model training FLOPs over its time, in TFLOP/s (all ranks together)."""
    mfu: float = math.nan
    """``tflops_per_s`` over the ranks' summed peak (nan: no peak known, e.g. on CPU)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["busy_share"] = list(self.busy_share)
        return out


def step_metrics(
    step: int,
    mode: str,
    loss: float,
    records: list[RankRecord],
    num_samples: int,
    num_tokens: int,
    *,
    predicted_step_time_s: float = math.nan,
    schedule_ratio: float = math.nan,
    grad_norm: float = math.nan,
    plan_model_step_time_s: float = math.nan,
    step_flops: float = math.nan,
    peak_flops: float | None = None,
) -> StepMetrics:
    """``step_flops``: the step's model training FLOPs; ``peak_flops``: every rank's peak
    FLOP/s summed (None: unknown)."""
    step_time_s = max(r.step_time_s for r in records)
    num_stages = max(r.global_stage for r in records) + 1
    busy: list[list[float]] = [[] for _ in range(num_stages)]
    for r in records:
        busy[r.global_stage].append(r.busy_s / step_time_s if step_time_s > 0 else 0.0)
    idle_s = sum(step_time_s - r.busy_s for r in records)
    total = step_time_s * len(records)
    return StepMetrics(
        step=step,
        mode=mode,
        loss=loss,
        step_time_s=step_time_s,
        idle_share=idle_s / total if total > 0 else 0.0,
        idle_s=idle_s,
        busy_share=tuple(float(np.mean(b)) if b else 0.0 for b in busy),
        samples_per_s=num_samples / step_time_s if step_time_s > 0 else 0.0,
        tokens_per_s=num_tokens / step_time_s if step_time_s > 0 else 0.0,
        predicted_step_time_s=predicted_step_time_s,
        schedule_ratio=schedule_ratio,
        grad_norm=grad_norm,
        plan_model_step_time_s=plan_model_step_time_s,
        tflops_per_s=step_flops / step_time_s / 1e12 if step_time_s > 0 else math.nan,
        mfu=step_flops / step_time_s / peak_flops if peak_flops and step_time_s > 0 else math.nan,
    )


PEAK_TFLOPS: dict[str, float] = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense BF16 tensor-core peaks (TFLOP/s) of GPUs whose name holds the key."""


def peak_flops(device: Any, stated_tflops: float | None) -> float | None:
    """One rank's peak FLOP/s: the stated one, else a known GPU's (:data:`PEAK_TFLOPS`);
    None where none is known (a CPU: no peak is invented)."""
    if stated_tflops:
        return stated_tflops * 1e12
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in PEAK_TFLOPS.items() if key in name), None)


def measured_microbatch_times(
    records: list[RankRecord],
    num_microbatches: int,
    encoder_dp: int,
    llm_dp: int,
    encoder_forward_share: float = 1.0 / 3.0,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Measured forward + backward seconds per microbatch and replica.

    Returns ``(encoder_s (m, encoder_dp), llm_s (m, llm_dp), forward_fraction)``: the time
    of microbatch j on a replica is summed over that replica's stages (an encoder replica
    computes its pieces of the microbatch: what the cost model prices for those units).
    ``forward_fraction`` per module: forward seconds over forward + backward seconds.
    A colocated first stage times its encoder's forward apart (``encoder_forward_s``);
    its backward runs in the stage's one autograd pass, so the encoder's share of it is
    taken from ``encoder_forward_share`` (its forward over forward + backward; at most
    the stage's whole backward of that microbatch), the rest counted as the LLM's.
    """
    encoder = np.zeros((num_microbatches, encoder_dp))
    llm = np.zeros((num_microbatches, llm_dp))
    forward = {"encoder": 0.0, "llm": 0.0}
    total = {"encoder": 0.0, "llm": 0.0}
    for r in records:
        backward = np.zeros(num_microbatches)  # this rank's backward seconds per microbatch
        for kind, j, start_s, end_s in r.actions:
            duration = end_s - start_s
            if r.module == "encoder":
                encoder[j, r.dp_rank] += duration
            else:
                llm[j, r.dp_rank] += duration
            total[r.module] += duration
            if kind == "forward":
                forward[r.module] += duration
            else:
                backward[j] += duration
        for j, forward_s in r.encoder_forward_s:  # a colocated first stage: move it over
            share = forward_s * (1.0 / encoder_forward_share - 1.0)
            encoder_s = forward_s + min(share, backward[j])
            encoder[j, r.dp_rank] += encoder_s
            llm[j, r.dp_rank] = max(0.0, llm[j, r.dp_rank] - encoder_s)
            total["llm"] -= encoder_s
            forward["llm"] -= forward_s
            total["encoder"] += encoder_s
            forward["encoder"] += forward_s
    fraction = {k: forward[k] / total[k] if total[k] > 0 else 1.0 / 3.0 for k in total}
    return encoder, llm, fraction


# The engine's timing names -> dflop.timeline's event kinds.
_TIMELINE_KIND = {
    "forward": "fwd",
    "backward": "bwd",
    "backward_input": "bwd_input",
    "backward_weight": "bwd_weight",
}


def timeline_records(records: list[RankRecord], offset_s: float) -> list[dict[str, Any]]:
    """Events for :func:`dflop.timeline.make_events`: pid = the rank's DP replica, tid =
    its global stage; times shifted by ``offset_s`` (to lay several steps end to end)."""
    out = []
    for r in records:
        for kind, j, start_s, end_s in r.actions:
            out.append(
                {
                    "replica": r.dp_rank,
                    "stage": r.global_stage,
                    "kind": _TIMELINE_KIND[kind],
                    "microbatch": j,
                    "start_s": start_s + offset_s,
                    "end_s": end_s + offset_s,
                }
            )
    return out


@dataclass(frozen=True)
class ModeSummary:
    """Means over the measured steps of one mode (the first ``warmup`` steps excluded)."""

    mode: str
    num_steps: int
    step_time_s: float
    idle_share: float
    idle_s: float
    samples_per_s: float
    tokens_per_s: float
    busy_share: tuple[float, ...]
    predicted_step_time_s: float
    final_loss: float
    extra: dict[str, Any] = field(default_factory=dict)
    plan_model_step_time_s: float = math.nan
    """Mean of the steps as the plan's uncorrected model predicts them."""

    @property
    def prediction_error(self) -> float:
        """|predicted - measured| / measured of the mean step time (nan without predictions)."""
        return _relative_error(self.predicted_step_time_s, self.step_time_s)

    @property
    def plan_prediction_error(self) -> float:
        """:attr:`prediction_error` of the plan's model on these steps."""
        return _relative_error(self.plan_model_step_time_s, self.step_time_s)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["busy_share"] = list(self.busy_share)
        out["prediction_error"] = self.prediction_error
        out["plan_prediction_error"] = self.plan_prediction_error
        return out


def _relative_error(predicted_s: float, measured_s: float) -> float:
    if math.isnan(predicted_s) or measured_s <= 0:
        return math.nan
    return abs(predicted_s - measured_s) / measured_s


def _nan_mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


def summarise(metrics: list[StepMetrics], mode: str, warmup: int = 1) -> ModeSummary:
    """Mean of ``mode``'s steps after the first ``warmup`` (when enough steps remain)."""
    rows = [m for m in metrics if m.mode == mode]
    if len(rows) > warmup:
        rows = rows[warmup:]
    if not rows:
        raise ValueError(f"no measured steps of mode {mode!r}")
    total_time = sum(m.step_time_s for m in rows)
    return ModeSummary(
        mode=mode,
        num_steps=len(rows),
        step_time_s=total_time / len(rows),
        idle_share=float(np.mean([m.idle_share for m in rows])),
        idle_s=float(np.mean([m.idle_s for m in rows])),
        samples_per_s=sum(m.samples_per_s * m.step_time_s for m in rows) / total_time,
        tokens_per_s=sum(m.tokens_per_s * m.step_time_s for m in rows) / total_time,
        busy_share=tuple(float(v) for v in np.mean([m.busy_share for m in rows], axis=0)),
        predicted_step_time_s=_nan_mean([m.predicted_step_time_s for m in rows]),
        final_loss=rows[-1].loss,
        plan_model_step_time_s=_nan_mean([m.plan_model_step_time_s for m in rows]),
    )


def format_step(m: StepMetrics, num_steps: int) -> str:
    busy = " ".join(f"s{s} {100 * b:.0f}%" for s, b in enumerate(m.busy_share))
    predicted = ""
    if not math.isnan(m.predicted_step_time_s):
        predicted = f" (sim {m.predicted_step_time_s:.3f} s)"
    flops = "" if math.isnan(m.tflops_per_s) else f" | {m.tflops_per_s:.3g} TFLOP/s"
    if not math.isnan(m.mfu):
        flops += f" MFU {100 * m.mfu:.1f}%"
    return (
        f"step {m.step + 1:>4}/{num_steps} [{m.mode:>5}] loss {m.loss:.4f} "
        f"(grad norm {m.grad_norm:.3g}) | "
        f"{m.step_time_s:.3f} s{predicted} | {m.samples_per_s:.1f} samples/s | "
        f"{m.tokens_per_s:,.0f} tok/s{flops} | busy {busy} | idle {100 * m.idle_share:.0f}%"
    )


class MetricsFile:
    """``metrics.jsonl``, written by one run at a time, in whole lines.

    - Each line is one ``write`` of a complete line to the end of the file; a write that
      fails (a full disk) is cut back to the last whole line and the file is given up
      with one warning: logging never stops the training.
    - The run holds an exclusive lock on it while it writes; a second run whose metrics
      would go to a held file writes its own, ``NAME.RUN_ID.jsonl``, and says so.
    - A resumed run (``start_step`` k > 0) first cuts what follows its checkpoint: a last
      line a killed run left unfinished, and the steps after step k that the killed run
      logged (they were not kept: the resumed run trains them again). A fresh run finding
      a non-empty file keeps it under another name (``NAME.before-TIME.jsonl``) and starts
      a new one.
    """

    def __init__(self, path: str, run_id: str, start_step: int) -> None:
        import fcntl
        import os

        self.run_id = run_id
        self.notes: list[str] = []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            stem, ext = os.path.splitext(path)
            busy, path = path, f"{stem}.{run_id}{ext or '.jsonl'}"
            self.notes.append(f"{busy} is being written by another run; this run writes {path}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path, self._fd = path, fd
        if os.fstat(fd).st_size:
            if start_step > 0:
                self._cut_after(start_step)
            else:
                self._keep_earlier()

    def _cut_after(self, steps_done: int) -> None:
        """Keep the whole lines of steps <= ``steps_done`` (what the checkpoint holds)."""
        import json
        import os

        with open(self.path, "rb") as f:
            text = f.read()
        kept, cut = [], 0
        for line in text.split(b"\n"):
            if not line:
                continue
            try:
                step = json.loads(line).get("step")
            except ValueError:  # a line a killed run left unfinished
                cut += 1
                continue
            if isinstance(step, int) and step > steps_done:
                cut += 1
                continue
            kept.append(line + b"\n")
        if cut:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, b"".join(kept))
            self.notes.append(
                f"{self.path}: cut {cut} line(s) after step {steps_done}, where this run "
                "resumes (written by the run it continues after its checkpoint, or unfinished)"
            )

    def _keep_earlier(self) -> None:
        """A fresh run starts its own file; an earlier run's stays, renamed."""
        import fcntl
        import os
        import time

        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(os.fstat(self._fd).st_mtime))
        stem, ext = os.path.splitext(self.path)
        kept = f"{stem}.before-{stamp}{ext or '.jsonl'}"
        while os.path.exists(kept):
            kept = f"{stem}.before-{stamp}-{os.urandom(2).hex()}{ext or '.jsonl'}"
        os.rename(self.path, kept)  # this run's lock stays on it until its own file is held
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(self._fd)
        self._fd = fd
        self.notes.append(f"{self.path} held an earlier run's lines: kept as {kept}")

    def write(self, fields: dict[str, Any]) -> bool:
        """Append one line; False (the file given up, with a warning) if it failed."""
        import json
        import os

        if self._fd is None:
            return False
        line = (json.dumps(fields) + "\n").encode("utf-8")
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"wrote {written} of {len(line)} bytes")
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)  # no half line
            step = fields.get("step")  # counted from 1, as the progress line counts
            kept = (
                "no line of it was written"
                if step == 1
                else f"its lines before step {step} are whole"
                if isinstance(step, int)
                else "its earlier lines are whole"
            )
            print(
                f"warning: metrics: writing {self.path} failed ({error}); the run goes on "
                f"without it ({kept})",
                flush=True,
            )
            self.close()
            return False
        return True

    def close(self) -> None:
        import os

        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _new_run_id() -> str:
    import os
    import time

    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.urandom(3).hex()}"


class StepLog:
    """Rank 0's record of a run: every step's metrics, the last ``trace_steps`` steps'
    rank records per mode (the timeline), the per-step lines and the progress bar (a
    terminal only). A logger that fails is given up with one warning: the training goes
    on (:class:`MetricsFile` for ``metrics.jsonl``)."""

    def __init__(self, config: Any, start_step: int) -> None:
        import collections
        import sys

        self.config = config
        self.run_id = _new_run_id()
        self.metrics: list[StepMetrics] = []
        # One JSON line per step and mode (rank 0 writes); see MetricsFile.
        self.jsonl_path = metrics_jsonl_path(config)
        self._jsonl: MetricsFile | None = None
        if self.jsonl_path is not None:
            self._jsonl = MetricsFile(self.jsonl_path, self.run_id, start_step)
            self.jsonl_path = self._jsonl.path
            for note in self._jsonl.notes:
                print(f"metrics: {note}", flush=True)
            peak = (
                f"MFU against {config.peak_tflops:g} TFLOP/s per device"
                if config.peak_tflops
                else "MFU against a known GPU's peak (none on CPU; --peak-tflops states one)"
            )
            print(
                f"metrics: one JSON line per step in {self.jsonl_path} (run {self.run_id}); {peak}",
                flush=True,
            )
        self._loggers = [LOGGER_CLASSES[name](config) for name in config.loggers]
        for logger in self._loggers:
            print(f"metrics: {logger.name} files in {logger.folder}", flush=True)
        self._recent = {mode: collections.deque(maxlen=config.trace_steps) for mode in config.modes}
        self._bar = None
        if config.progress and sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(
                    total=config.steps, initial=start_step, unit="step", dynamic_ncols=True
                )

    def add(self, row: StepMetrics, records: list[RankRecord]) -> None:
        """One mode's step: kept, and printed every ``log_every`` steps and at the end."""
        self.metrics.append(row)
        self._recent[row.mode].append((records, row.step_time_s))
        if self._jsonl is not None:
            import time

            # NaN is not JSON: an unknown value is null.
            fields = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                      for k, v in row.to_dict().items()}  # fmt: skip
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            line = {**fields, "step": row.step + 1, "run_id": self.run_id, "time": stamp}
            if not self._jsonl.write(line):
                self._jsonl = None
        for logger in list(self._loggers):
            try:
                logger.log(row)
            except Exception as error:  # noqa: BLE001 - a logger never stops the training
                self._give_up(logger, error)
        every = self.config.log_every
        if not every or ((row.step + 1) % every and row.step != self.config.steps - 1):
            return
        line = format_step(row, self.config.steps)
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def step_done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def timelines(self) -> dict[str, list[dict[str, Any]]]:
        """Per mode: the event records of the last steps, laid end to end."""
        out = {}
        for mode, steps in self._recent.items():
            events: list[dict[str, Any]] = []
            offset_s = 0.0
            for records, step_time_s in steps:
                events.extend(timeline_records(records, offset_s))
                offset_s += step_time_s
            out[mode] = events
        return out

    def _give_up(self, logger: Any, error: BaseException) -> None:
        self._loggers.remove(logger)
        print(
            f"warning: metrics: {logger.name} failed ({type(error).__name__}: {error}); the "
            f"run goes on without it (metrics.jsonl and the other loggers are unaffected)",
            flush=True,
        )
        with contextlib.suppress(Exception):  # already given up
            logger.close()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for logger in list(self._loggers):
            try:
                logger.close()
            except Exception as error:  # noqa: BLE001 - the run's results are kept
                self._give_up(logger, error)
        self._loggers = []
        if self._bar is not None:
            self._bar.close()


@dataclass
class TrainReport:
    """What rank 0 returns: every step's metrics and the timelines of the last steps
    (here, free of torch: the launcher that receives it never imports torch)."""

    config: dict[str, Any]
    layout: dict[str, Any]
    metrics: list[StepMetrics]
    timelines: dict[str, list[dict[str, Any]]]
    """Per mode: event records of the last ``trace_steps`` steps, laid end to end."""
    start_step: int
    performance_model: dict[str, Any] | None = None
    """The cost model's corrected coefficients at the end."""
    stats: dict[str, Any] = field(default_factory=dict)
    planned_step_time_s: float = math.nan
    """The plan's predicted step time for the layout (set by the launcher; nan: none)."""
