"""``Checkpointer``: when a rank resumes, saves, and stops.

It owns three decisions of the training loop, made the same on every rank:

- **resume**: rank 0 picks the checkpoint (the step ``latest`` names when it verifies,
  else the newest intact one, saying so) and tells every rank, so all resume from the same
  step; the optimizer takes this run's learning rate and weight decay
  (:mod:`dflop.train.resume` said which settings changed);
- **save**: after the last step, every ``checkpoint_every`` steps, and once
  ``checkpoint_every_min`` minutes passed since the last save (rank 0's clock);
- **stop**: a SIGTERM or Ctrl-C that reached any rank is agreed after a step (one
  all-reduce carries it and the clock's save); every rank then stops after that same
  step, with a checkpoint there.

Files and their guarantees: :mod:`dflop.train.checkpoint`.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Checkpointer"]


class Checkpointer:
    """One rank's checkpointing (call every method on every rank: they communicate).

    Args:
        config: the run's :class:`~dflop.train.config.TrainConfig`.
        layout: the run's :class:`~dflop.runtime.topology.RuntimeLayout`.
        comm_device: where the stop flag's all-reduce runs.
        data: the dataset's record fingerprint (saved with every step; None: synthetic).
    """

    def __init__(
        self, config: Any, layout: Any, comm_device: Any, data: dict[str, Any] | None = None
    ) -> None:
        from dflop.runtime import dist

        self.config = config
        self.layout = layout
        self.data = data  # the dataset's fingerprint, saved beside every step
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._comm_device = comm_device
        self._last_save_s = time.monotonic()

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run loading it (checked on every rank)."""
        return {
            "layout": self.layout.to_dict(),
            "model": self.config.model,
            "world_size": self.world_size,
            "seed": self.config.seed,
        }

    def resume(self, stage: Any, optimizer: Any) -> int:
        """Load the checkpoint to resume from into ``stage`` and ``optimizer``; the first
        step to run (0 without one)."""
        from dflop.runtime import dist
        from dflop.train.checkpoint import find_checkpoint, load_checkpoint

        if not self.config.checkpoint_dir:
            return 0
        choice: list[Any] = [None]
        if self.rank == 0:
            found = find_checkpoint(
                self.config.checkpoint_dir, self.world_size, log=lambda m: print(m, flush=True)
            )
            choice = [None if found is None else str(found)]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return 0
        state = load_checkpoint(choice[0], self.rank, self.identity())
        stage.load_state_dict(state["stage"])
        optimizer.load_state_dict(state["optimizer"])
        # The optimizer's state restores the saved run's hyper-parameters; this run's
        # settings apply from its first step (the launcher said which ones changed).
        for group in optimizer.param_groups:
            group["lr"] = self.config.lr
            group["weight_decay"] = self.config.weight_decay
        start_step = int(state["step"]) + 1  # a step index; as many steps are done
        if self.rank == 0:
            left = self.config.steps - start_step
            next_step = (
                f"step {start_step + 1} of {self.config.steps} next"
                if left > 0
                else f"all {self.config.steps} steps done: nothing left to train"
            )
            print(f"resumed from {choice[0]} (after step {start_step}; {next_step})", flush=True)
        return start_step

    def save(self, step: int, stage: Any, optimizer: Any) -> None:
        """Save every rank's stage and optimizer after ``step``."""
        from dflop.runtime import dist
        from dflop.train.checkpoint import save_checkpoint
        from dflop.train.resume import run_settings

        state = {
            "stage": stage.state_dict(),
            "optimizer": optimizer.state_dict(),
            **self.identity(),
        }
        save_checkpoint(
            self.config.checkpoint_dir,
            step,
            self.rank,
            state,
            barrier=dist.barrier,
            world_size=self.world_size,
            settings=run_settings(self.config, self.layout, self.data),
        )

    def end_of_step(self, step: int, stage: Any, optimizer: Any) -> bool:
        """Save if ``step`` is due; True when the run stops after it (a SIGTERM or Ctrl-C
        reached some rank: every rank stops after this same step, with a checkpoint
        there)."""
        config = self.config
        last = step == config.steps - 1
        every = config.checkpoint_every
        due = last or bool(every and (step + 1) % every == 0)
        stop = False
        if not last:
            stop, time_due = self._agreed_flags()
            due = due or time_due or stop
        if config.checkpoint_dir and due:
            self.save(step, stage, optimizer)
            self._last_save_s = time.monotonic()
        return stop

    def _agreed_flags(self) -> tuple[bool, bool]:
        """(a rank was asked to stop, rank 0's clock says a save is due): one all-reduce."""
        import torch

        from dflop.runtime import dist
        from dflop.runtime.launch import StopRequested

        minutes = self.config.checkpoint_every_min
        time_due = (
            self.rank == 0
            and bool(self.config.checkpoint_dir)
            and minutes > 0
            and time.monotonic() - self._last_save_s >= 60.0 * minutes
        )
        flags = torch.tensor(
            [int(StopRequested.requested()), int(time_due)], device=self._comm_device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())
