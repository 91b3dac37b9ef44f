"""dflop in your own data-parallel training loop (DDP, FSDP, ZeRO): per-step balancing of
the ranks' microbatches as a DataLoader batch sampler (:class:`BalancedBatchSampler`), and
a padding-free collator (:class:`PackingCollator`, needs torch) so that a microbatch costs
what the balancer priced."""

from typing import Any

from dflop.dp.sampler import BalancedBatchSampler, Microbatch, StepInfo

__all__ = ["BalancedBatchSampler", "Microbatch", "PackingCollator", "StepInfo"]


def __getattr__(name: str) -> Any:  # torch is optional: import the collator on first use
    if name == "PackingCollator":
        from dflop.dp.collate import PackingCollator

        return PackingCollator
    raise AttributeError(f"module 'dflop.dp' has no attribute {name!r}")
