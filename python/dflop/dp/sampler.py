"""A batch sampler for torch's DataLoader that balances every step's work over the
data-parallel ranks (DDP, FSDP, ZeRO): the drop-in form of ``dflop.schedule``.

Every rank draws the same global batch (a permutation seeded by ``seed`` and the epoch),
prices its samples, and computes the same deterministic split over the ranks with no
communication: first the ranks' shares (what stalls a step is the slowest rank's whole
share: DDP and FSDP synchronise once, after its last microbatch), then its own share cut
into ``num_microbatches`` microbatches, which it yields in order. A rank whose samples are
heavy (big images, long videos or texts) gets fewer of them. Every rank runs the same
number of microbatches (FSDP needs equal forward counts): when the balanced shares leave
a rank fewer samples than that (a heavy sample, or few samples per rank), the rank keeps
its balanced share and runs *padding* microbatches first, with a loss scale of 0 (FSDP's
collectives run, the gradient does not change; under DDP a loop may skip them): the
dataset's cheapest sample (``padding="sample"``, any collate function takes it; the
step's cheapest with a cost function) or empty (``padding="empty"``, nearly free;
``PackingCollator`` makes a two-token row). Optional per-microbatch
limits on resources (tokens, visual units: a memory budget) keep a long video alone in a
microbatch instead of out of memory.

Loss normalisation: the loss a step should minimise is the global batch's mean per target
token. Each rank's microbatches hold different numbers of target tokens, so divide each
microbatch's summed loss by the global target count and multiply by ``world_size``
(DDP and FSDP average gradients over ranks): :attr:`Microbatch.loss_scale`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.errors import InputTypeError
from dflop.scheduling.balance import InfeasibleError, schedule

__all__ = ["PADDINGS", "BalancedBatchSampler", "Microbatch", "StepInfo"]

PADDINGS = ("sample", "empty", None)
"""``BalancedBatchSampler(padding=)``'s choices."""

CostFunction = Callable[[np.ndarray], Any]
"""Prices samples by index: ``(k,)`` dataset indices -> ``(k,)`` or ``(k, D)`` costs."""


@dataclass(frozen=True)
class StepInfo:
    """The step whose microbatches the sampler is yielding."""

    epoch: int
    step: int
    """Step within the epoch."""
    num_microbatches: int
    """This rank's microbatches in the step (the same on every rank): call the optimizer
    after that many."""
    global_batch: int
    """Samples in the step over all ranks."""
    global_target_tokens: int | None
    """Target (loss) tokens of the whole step, if the sampler was given ``target_tokens``."""
    indices: np.ndarray
    """The step's dataset indices (global batch order)."""
    rank_costs: np.ndarray
    """(world_size, D) every rank's summed cost in the step."""
    microbatches: tuple[tuple[int, ...], ...]
    """This rank's microbatches (dataset indices), in order."""
    num_padding: int = 0
    """How many of this rank's first microbatches are padding (a cheap sample, or empty:
    ``BalancedBatchSampler(padding=)``), run only so that every rank runs
    ``num_microbatches`` forwards (FSDP's collectives); their :attr:`Microbatch.loss_scale`
    is 0. The last microbatch is never padding, so DDP's reduction runs in a real
    backward."""


@dataclass(frozen=True)
class Microbatch:
    """Where a DataLoader batch sits in its step (from :meth:`BalancedBatchSampler.batches`)."""

    step: StepInfo
    index: int
    """Its position among this rank's microbatches of the step."""
    world_size: int

    @property
    def is_last(self) -> bool:
        """The step's last microbatch on this rank: synchronise gradients, then step."""
        return self.index == self.step.num_microbatches - 1

    @property
    def is_padding(self) -> bool:
        """A padding microbatch (see :attr:`StepInfo.num_padding`). Under FSDP run it
        (forward and backward under ``gradient_sync``, ``loss_scale`` 0); under DDP it may
        be skipped. Count nothing of it."""
        return self.index < self.step.num_padding

    @property
    def loss_scale(self) -> float:
        """Multiply the microbatch's SUMMED token loss by this: after DDP's / FSDP's
        averaging over ranks, the step's gradient is that of the global batch's mean loss
        per target token (``world_size / global target tokens``; needs ``target_tokens``);
        0 for a padding microbatch."""
        if self.step.global_target_tokens is None:
            raise ValueError("loss_scale needs the sampler's target_tokens")
        if self.is_padding:
            return 0.0
        return self.world_size / max(self.step.global_target_tokens, 1)

    @contextlib.contextmanager
    def gradient_sync(self, model: Any) -> Iterator[None]:
        """Run the microbatch's forward and backward in this context: gradients are
        reduced over the ranks only after the step's last microbatch (accumulated locally
        before it; DDP decides in the forward, so the forward must be inside too).

        ``model``: a ``DistributedDataParallel`` or FSDP1 module (``no_sync()``), an FSDP2
        ``fully_shard`` module (``set_requires_gradient_sync``); anything else runs
        as is (e.g. one process)."""
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
            model.set_requires_gradient_sync(self.is_last)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        elif hasattr(model, "no_sync") and not self.is_last:  # DDP, FSDP1
            with model.no_sync():
                yield
        else:
            yield


class BalancedBatchSampler:
    """Yields this rank's microbatches (lists of dataset indices) of every step, balanced
    over the data-parallel ranks by ``dflop.schedule``; pass it as a DataLoader's
    ``batch_sampler``.

    Args:
        costs: the price of each sample: an ``(N,)`` or ``(N, D)`` array over the dataset
            (seconds from a ``dflop.profiling.CostModel`` or the analytic model over the
            shapes of ``dflop.data.profile_dataset``, or any proxy such as tokens), or a
            function of ``(k,)`` dataset indices returning their costs; every rank must
            compute the same numbers. ``N`` is the dataset's size (for a function, pass
            ``num_samples``).
        global_batch: samples per step over all ranks.
        num_microbatches: microbatches per rank per step (gradient accumulation).
        rank, world_size: this rank and the number of data-parallel ranks (default:
            torch.distributed's, else 0 and 1).
        num_samples: the dataset's size when ``costs`` is a function.
        seed: the permutation's and the balancer's seed (same on every rank).
        shuffle: permute the dataset every epoch (else: dataset order).
        drop_last: drop a last global batch smaller than ``global_batch``. Else every
            sample is trained once per epoch: the remainder runs as a smaller last step
            (with fewer microbatches if needed), or, with fewer samples than
            ``world_size`` (some rank would have nothing), joins the step before it.
        resources, limits: an ``(N, K)`` array of what each sample occupies (tokens,
            visual units) and ``K`` upper bounds on a microbatch's sum (a memory budget);
            a sample over a limit alone is an error naming it.
        target_tokens: ``(N,)`` target tokens per sample, for :attr:`step_info`'s global
            count and :meth:`loss_scale`.
        time_budget_ms: the balancer's search effort (deterministic; default by size).
        check_ranks: when torch.distributed is initialised with ``world_size`` ranks,
            compare once per epoch, at the start of iteration, that every rank prices the
            samples alike (an array's every cost; a function's for the step it starts at)
            and is at the same step; a difference raises ``ValueError`` naming the rank
            instead of training overlapping shares. It is a collective (on NCCL: after
            ``torch.cuda.set_device``): every rank must iterate the sampler; turn it off
            to iterate it on one rank alone (e.g. to log the batches).
        padding: what a rank whose balanced share has fewer samples than
            ``num_microbatches`` runs first to make up the count (:attr:`StepInfo.
            num_padding`, loss scale 0), so the ranks keep their balanced totals:
            ``"sample"`` (default) a cheap sample (any collate function takes it; its cost
            is priced in: the dataset's cheapest with a cost array, the step's with a
            cost function), ``"empty"`` an empty index list (nearly
            free, the ranks' totals are ``dflop.schedule``'s; the collate function must
            take ``[]``, as ``PackingCollator`` does). None: such a step is one joint
            schedule of every rank's microbatches (no padding, for a loop that cannot
            skip a microbatch's loss, such as the Hugging Face Trainer's; the ranks'
            totals are less even).

    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch at a step boundary;
    ``set_epoch(e)`` starts epoch e (as with DistributedSampler). Iterate the DataLoader
    through :meth:`batches` to know each batch's step, position and loss scale: a
    DataLoader with workers draws index lists ahead of the batches it returns.
    """

    def __init__(
        self,
        costs: np.ndarray | CostFunction,
        global_batch: int,
        num_microbatches: int = 1,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_samples: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        resources: Any = None,
        limits: Sequence[float] | None = None,
        target_tokens: Any = None,
        time_budget_ms: float | None = None,
        check_ranks: bool = True,
        padding: str | None = "sample",
    ) -> None:
        rank, world_size = _rank_and_world(rank, world_size)
        self.check_ranks = bool(check_ranks)
        if padding not in PADDINGS:
            raise ValueError(f"padding={padding!r}: give one of 'sample', 'empty' or None")
        self.padding = padding
        self.rank, self.world_size = rank, world_size
        self.global_batch = _positive("global_batch", global_batch)
        self.num_microbatches = _positive("num_microbatches", num_microbatches)
        if self.global_batch < self.num_microbatches * world_size:
            raise ValueError(
                f"global_batch={global_batch} is smaller than num_microbatches x world_size = "
                f"{self.num_microbatches * world_size}: every microbatch needs a sample"
            )
        if callable(costs):
            if num_samples is None:
                raise InputTypeError("costs is a function: pass num_samples (the dataset size)")
            self._cost_fn: CostFunction | None = costs
            self._costs = None
            self.num_samples = _positive("num_samples", num_samples)
        else:
            self._cost_fn = None
            self._costs = _cost_array("costs", costs, np.arange(_rows(costs)))
            self.num_samples = self._costs.shape[0]
            if num_samples is not None and num_samples != self.num_samples:
                raise ValueError(f"num_samples={num_samples} but costs has {self.num_samples} rows")
        if self.num_samples < world_size and not drop_last:
            raise ValueError(
                f"num_samples={self.num_samples} is fewer than world_size={world_size}: some "
                "rank would get no sample in an epoch (drop_last=True trains none)"
            )
        self._resources, self._limits = _resources(resources, limits, self.num_samples)
        self._pad_index: int | None = None  # padding="sample" with a cost array
        self._targets = None
        if target_tokens is not None:
            self._targets = np.asarray(target_tokens)
            if self._targets.shape != (self.num_samples,) or self._targets.dtype.kind not in "iu":
                raise ValueError(
                    f"target_tokens must be an integer array of shape ({self.num_samples},), "
                    f"got {self._targets.dtype} {self._targets.shape}"
                )
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.time_budget_ms = time_budget_ms
        self.epoch = 0
        self._step = 0  # the next step to yield within the epoch
        self.step_info: StepInfo | None = None
        """The step the sampler planned last (with DataLoader workers, ahead of training:
        use :meth:`batches`)."""
        self._consumed: tuple[int, int] | None = None  # (epoch, next step) trained through
        # What __iter__ yielded and the DataLoader has not returned yet, in order (bounded:
        # iterated without batches(), nothing pops it; workers read far less ahead).
        self._yielded: collections.deque[tuple[StepInfo, int]] = collections.deque(maxlen=1 << 16)

    # ------------------------------------------------------------------ epochs and state

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step (a new permutation when shuffling)."""
        self.epoch = int(epoch)
        self._step = 0
        self._consumed = None

    def state_dict(self) -> dict[str, int]:
        """Where training is: the epoch and the next step (a step boundary). Under
        :meth:`batches`, the step after the last one whose batches it returned (workers may
        have drawn more); else the step after the last one the sampler planned."""
        epoch, step = self._consumed if self._consumed is not None else (self.epoch, self._step)
        if step >= self.steps_per_epoch():
            epoch, step = epoch + 1, 0
        return {"epoch": epoch, "step": step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where :meth:`state_dict` was taken (every rank loads the same state)."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(
                f"the state was saved with seed={state['seed']}, this sampler has seed="
                f"{self.seed}: resuming would draw different batches"
            )
        self.epoch, self._step = int(state["epoch"]), int(state["step"])
        self._consumed = None

    def _epoch_shape(self) -> tuple[int, int]:
        """(steps of ``global_batch`` samples, samples of the last step after them: 0 if
        none). Without ``drop_last`` every sample has a step: a remainder too small to give
        each rank one joins the step before it."""
        full, rest = divmod(self.num_samples, self.global_batch)
        if rest == 0 or self.drop_last:
            return full, 0
        if rest >= self.world_size or full == 0:  # full == 0: num_samples >= world_size
            return full, rest
        return full - 1, self.global_batch + rest

    def _step_slice(self, step: int) -> slice:
        """The positions of step ``step``'s samples in the epoch's order."""
        full, last = self._epoch_shape()
        start = step * self.global_batch
        return slice(start, start + (self.global_batch if step < full else last))

    def steps_per_epoch(self) -> int:
        full, last = self._epoch_shape()
        return full + (1 if last else 0)

    def __len__(self) -> int:
        """This rank's microbatches in a whole epoch."""
        full, last = self._epoch_shape()
        return full * self.num_microbatches + (self._microbatches_for(last) if last else 0)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[list[int]]:
        order = self._permutation(self.epoch)
        if self.check_ranks:
            self._check_same_on_every_rank(order)
        while self._step < self.steps_per_epoch():
            info = self.plan_step(self.epoch, self._step, order)
            self.step_info = info
            self._step += 1  # a checkpoint taken during this step resumes after it
            for k, microbatch in enumerate(info.microbatches):
                self._yielded.append((info, k))
                yield list(microbatch)
        self.epoch += 1
        self._step = 0

    def plan_step(self, epoch: int, step: int, order: np.ndarray | None = None) -> StepInfo:
        """The schedule of step ``step`` of epoch ``epoch`` (pure: the same on every rank)."""
        order = self._permutation(epoch) if order is None else order
        indices = order[self._step_slice(step)]
        num_microbatches = self._microbatches_for(len(indices))
        costs = self._step_costs(indices)
        used = None if self._resources is None else self._resources[indices]

        def bounded(rows: Any = slice(None), per: int = 1) -> dict[str, Any]:
            """The limits of ``per`` microbatches over the samples ``rows``, if any."""
            if used is None:
                return {}
            return {"resources": used[rows], "limits": [v * per for v in self._limits]}

        seed = self.seed + 7919 * epoch + step
        kw = {"seed": seed, "time_budget_ms": self.time_budget_ms}
        # The ranks' shares (a share holds num_microbatches microbatches' resources).
        shares = schedule(costs, 1, self.world_size, **bounded(per=num_microbatches), **kw)
        sizes = np.bincount(shares.assignment, minlength=self.world_size)
        num_padding = 0
        try:
            if self.padding is None and sizes.min() < num_microbatches:
                raise InfeasibleError("a share is smaller than num_microbatches")
            # Every rank must take the same branch: with limits a cut can fail, so each
            # rank cuts every share (without limits only its own: a cut cannot fail).
            ranks = range(self.world_size) if used is not None else [self.rank]
            cuts = {
                r: _cut(costs[shares.bin(r)], num_microbatches, bounded(shares.bin(r)), kw)
                for r in ranks
            }
            mine = shares.bin(self.rank)
            microbatches = [indices[mine[p]] for p in cuts[self.rank]]
            # A share smaller than num_microbatches: padding microbatches first (loss
            # scale 0), so the last one is real: a cheap sample (priced in) or empty (a
            # dummy row's cost, not priced).
            padding = np.maximum(num_microbatches - sizes, 0)
            num_padding = int(padding[self.rank])
            rank_costs = shares.loads
            pad = np.zeros(0, dtype=np.int64)
            if self.padding == "sample":
                pad_index, pad_cost = self._padding_sample(indices, costs)
                pad = np.array([pad_index])
                rank_costs = rank_costs + np.outer(padding, pad_cost)
            microbatches = [pad] * num_padding + microbatches
        except InfeasibleError:
            # A share's cut cannot meet the limits (or is too small to cut, unpadded). The
            # shares are the same everywhere, so every rank falls back together, to one
            # joint schedule.
            joint = schedule(costs, num_microbatches, self.world_size, **bounded(), **kw)
            microbatches = [indices[p] for p in joint.microbatches(self.rank)]
            loads = joint.loads.reshape(num_microbatches, self.world_size, -1)
            rank_costs = loads.sum(axis=0)
        targets = None if self._targets is None else int(self._targets[indices].sum())
        return StepInfo(
            epoch,
            step,
            num_microbatches,
            len(indices),
            targets,
            indices,
            np.array(rank_costs, dtype=np.float64),
            tuple(tuple(int(i) for i in mb) for mb in microbatches),
            num_padding,
        )

    def batches(self, loader: Any) -> Iterator[tuple[Any, Microbatch]]:
        """``(batch, Microbatch)`` for every batch of ``loader`` (a DataLoader over this
        sampler, which returns batches in the order the sampler yields them, with or
        without workers)."""
        self._yielded.clear()
        if self.padding == "empty" and _is_default_collate(getattr(loader, "collate_fn", None)):
            raise ValueError(
                "BalancedBatchSampler(padding='empty') yields empty microbatches, which "
                "torch's default collate function cannot take: pass collate_fn="
                "PackingCollator() (or one that takes []), or use padding='sample'"
            )
        for batch in loader:
            if not self._yielded:
                raise ValueError("the loader returned a batch this sampler did not yield")
            info, index = self._yielded.popleft()
            microbatch = Microbatch(info, index, self.world_size)
            if microbatch.is_last:
                self._consumed = (info.epoch, info.step + 1)
            yield batch, microbatch

    # ------------------------------------------------------------------ helpers

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def _microbatches_for(self, size: int) -> int:
        return min(self.num_microbatches, size // self.world_size)

    def _check_same_on_every_rank(self, order: np.ndarray) -> None:
        """Ranks that price the samples differently (each profiled its own cost model) or
        resume from different states would train overlapping shares without any error:
        compare a digest of everything the split depends on, once per epoch."""
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() != self.world_size:
            return  # a data-parallel group inside a larger job: the caller's to check
        # An array's every cost; a function's for the step it starts at (pricing them all
        # could be expensive; that step's costs are computed for training anyway).
        costs = (
            self._costs
            if self._cost_fn is None
            else self._step_costs(order[self._step_slice(self._step)])
        )
        digest = hashlib.blake2b(digest_size=16)
        for part in (costs, self._resources, self._limits, self._targets):
            if part is not None:
                digest.update(np.ascontiguousarray(part).tobytes())
        settings = (self.num_samples, self.global_batch, self.num_microbatches, self.seed,
                    self.shuffle, self.drop_last, self.epoch, self._step)  # fmt: skip
        digest.update(repr(settings).encode())
        digest.update(repr(self.padding).encode())
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (digest.hexdigest(), settings))
        differing = [r for r, d in enumerate(digests) if d[0] != digests[0][0]]
        if differing:
            r = differing[0]
            what = (
                f"settings (num_samples, global_batch, num_microbatches, seed, shuffle, "
                f"drop_last, epoch, step) {digests[r][1]} vs {digests[0][1]}"
                if digests[r][1] != digests[0][1]
                else "costs, resources, limits or target_tokens"
            )
            raise ValueError(
                f"BalancedBatchSampler: rank {r} differs from rank 0 in its {what}; every "
                "rank must compute the same split (price the samples once, e.g. on rank 0, "
                "and broadcast the costs or load them from one file; load the same state "
                "on every rank), else ranks train overlapping shares. check_ranks=False "
                "turns this check off."
            )

    def _padding_sample(self, indices: np.ndarray, costs: np.ndarray) -> tuple[int, np.ndarray]:
        """The sample a padding microbatch runs (``padding="sample"``) and its cost row:
        with a cost array, the dataset's cheapest (found once; often a few tokens of text,
        so padding costs next to nothing); with a cost function, the step's cheapest
        (pricing the whole dataset could take long)."""
        if self._cost_fn is not None:
            cheapest = int(np.argmin(costs.sum(axis=1)))
            return int(indices[cheapest]), costs[cheapest]
        if self._pad_index is None:  # every sample fits the limits alone (checked)
            self._pad_index = int(np.argmin(self._costs.sum(axis=1)))
        return self._pad_index, self._costs[self._pad_index]

    def _step_costs(self, indices: np.ndarray) -> np.ndarray:
        if self._cost_fn is None:
            return self._costs[indices]
        return _cost_array("costs", self._cost_fn(indices.copy()), indices)


def _is_default_collate(collate_fn: Any) -> bool:
    try:
        from torch.utils.data import default_collate
    except ImportError:
        return False
    return collate_fn is default_collate


def _cut(costs: np.ndarray, num_microbatches: int, bounded: dict, kw: dict) -> list[np.ndarray]:
    """A rank's share cut into ``num_microbatches`` balanced microbatches (row indices of
    ``costs``, in run order); a share with fewer samples, one sample per microbatch.
    ``bounded``: the share's ``resources`` and ``limits`` (or nothing)."""
    if len(costs) <= num_microbatches:
        if bounded:  # a sample alone over a limit cannot run at all
            schedule(costs, len(costs), 1, **bounded, **kw)
        return [np.array([i]) for i in range(len(costs))]
    cut = schedule(costs, num_microbatches, 1, **bounded, **kw)
    return [np.asarray(p) for p in cut.microbatches(0)]


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
        except ImportError:
            initialised = False
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
    world_size = _positive("world_size", world_size)
    rank = _int("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range [0, world_size={world_size})")
    return rank, world_size


def _int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _positive(name: str, value: Any) -> int:
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _rows(costs: Any) -> int:
    array = np.asarray(costs)
    if array.ndim not in (1, 2):
        raise ValueError(f"costs must be (N,) or (N, D), got shape {array.shape}")
    return array.shape[0]


def _cost_array(name: str, value: Any, indices: np.ndarray) -> np.ndarray:
    """(k, D) float64 costs of the samples ``indices``; bad values name the sample."""
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind not in "iuf":
        raise InputTypeError(f"{name} must be numeric, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[0] != len(indices):
        raise ValueError(
            f"{name} must give one row per sample ({len(indices)}), got shape {np.shape(value)}"
        )
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 0)).all(axis=1))
    if bad.size:
        row = bad[0]
        raise ValueError(
            f"{name} of sample {int(indices[row])} is {array[row].tolist()}: costs must be "
            "finite and >= 0"
        )
    return array


def _resources(
    resources: Any, limits: Sequence[float] | None, num_samples: int
) -> tuple[np.ndarray | None, list[float] | None]:
    if resources is None and limits is None:
        return None, None
    if resources is None or limits is None:
        raise ValueError("resources and limits go together: what each sample uses, and the bounds")
    used = _cost_array("resources", resources, np.arange(num_samples))
    bounds = [float(v) for v in limits]
    if len(bounds) != used.shape[1]:
        raise ValueError(f"limits has {len(bounds)} entries, resources {used.shape[1]} columns")
    for k, bound in enumerate(bounds):
        if not bound > 0:
            raise ValueError(f"limits[{k}]={bound} must be > 0")
        over = np.flatnonzero(used[:, k] > bound)
        if over.size:
            raise ValueError(
                f"sample {int(over[0])} alone needs {used[over[0], k]:g} of resource {k}, "
                f"more than limits[{k}]={bound:g}: no microbatch can hold it"
            )
    return used, bounds
