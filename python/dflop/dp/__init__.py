"""dflop in your own data-parallel training loop (DDP, FSDP, ZeRO): per-step balancing of
the ranks' microbatches as a DataLoader batch sampler (:class:`BalancedBatchSampler`)."""

from dflop.dp.sampler import BalancedBatchSampler, Microbatch, StepInfo

__all__ = ["BalancedBatchSampler", "Microbatch", "StepInfo"]
