"""dflop's per-step balancing in the Hugging Face Trainer (``pip install dflop[hf]`` plus
``accelerate``): :class:`BalancedTrainer`.

The Trainer draws ``per_device_train_batch_size x world_size x
gradient_accumulation_steps`` samples per optimizer step; :class:`BalancedTrainer` hands
them to :class:`~dflop.dp.BalancedBatchSampler` instead of cutting them into equal
counts: each rank gets its balanced share as ``gradient_accumulation_steps``
microbatches of varying size. The Trainer passes a rank-aware batch sampler through its
``BatchRebalanceSampler`` path (accelerate does not re-shard it), and normalises the loss
by the step's target tokens over all ranks (``average_tokens_across_devices``, on by
default), which is what the balanced microbatches need: every rank's microbatches hold
different numbers of tokens. Pass ``data_collator=dflop.dp.PackingCollator()`` where the
model supports packed rows, so that a microbatch costs what the balancer priced.

Launchers: ``torchrun`` and ``accelerate launch`` (DDP; tested on CPU with gloo,
``examples/hf_trainer_balance.py``). FSDP through the Trainer: accelerate enables it on
GPUs only (on CPU it would silently fall back to DDP; :class:`BalancedTrainer` raises
instead), so it is untested here; the sampler gives every rank the same number of
microbatches, which FSDP's collectives need.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer
from transformers.trainer_pt_utils import BatchRebalanceSampler

from dflop.dp.sampler import BalancedBatchSampler

__all__ = ["BalancedTrainer"]


class _TrainerBatchSampler(BatchRebalanceSampler):
    """A :class:`BalancedBatchSampler` in the Trainer's rank-aware batch-sampler slot."""

    def __init__(self, sampler: BalancedBatchSampler) -> None:  # noqa: D107 (no super: wraps)
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class BalancedTrainer(Trainer):
    """A :class:`transformers.Trainer` whose training batches are balanced over the
    data-parallel ranks by dflop every step.

    Args:
        sample_costs: per training sample, its price (an ``(N,)`` or ``(N, D)`` array, or a
            function of dataset indices with ``N = len(train_dataset)``): see
            :class:`~dflop.dp.BalancedBatchSampler`.
        resources, limits: optional per-microbatch memory budget (e.g. tokens).
        *args, **kwargs: the Trainer's.
    """

    def __init__(
        self,
        *args: Any,
        sample_costs: Any,
        resources: Any = None,
        limits: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.fsdp and not (self.is_fsdp_enabled or self.is_fsdp_xla_enabled):
            # accelerate turns FSDP on only on accelerators; on CPU it would silently
            # train with DDP (full replicas) instead.
            raise ValueError(
                "TrainingArguments.fsdp is set but accelerate runs without FSDP here (it "
                "enables FSDP on GPUs only; on CPU it falls back to DDP): unset fsdp, or "
                "train on GPUs"
            )
        self.sample_costs = sample_costs
        self.resources = resources
        self.limits = limits

    def balanced_sampler(self) -> BalancedBatchSampler:
        """The sampler of this run's training data (the same on every rank)."""
        args = self.args
        steps = args.gradient_accumulation_steps
        return BalancedBatchSampler(
            self.sample_costs,
            args.per_device_train_batch_size * args.world_size * steps,
            steps,
            rank=args.process_index,
            world_size=args.world_size,
            num_samples=len(self.train_dataset),
            seed=args.seed,
            drop_last=args.dataloader_drop_last,
            resources=self.resources,
            limits=self.limits,
            # The Trainer's loop has no notion of an empty (padding) microbatch.
            padding=None,
        )

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return _TrainerBatchSampler(self.balanced_sampler())
