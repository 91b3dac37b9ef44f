"""Balancing DP ranks' microbatches with ``dflop.schedule()`` in a plain DDP training loop.

For users with their own training loop: no dflop runtime, just torch DDP. Every step,

1. every rank draws the SAME global batch (here: synthetic shapes seeded by the step; in
   your loop: the same sampler state on every rank) and prices its samples, e.g. with a
   ``dflop.profiling.CostModel`` or, as here, by a simple token count;
2. ``dflop.schedule(costs, num_microbatches, dp_size=world_size)`` assigns the samples to
   ``num_microbatches x world_size`` bins so that the slowest rank finishes as early as
   possible; the result is deterministic, so every rank computes the same schedule with no
   communication (pass no ``time_limit_s``);
3. each rank trains on ``schedule.microbatches(rank)`` only, accumulating gradients
   (``no_sync()`` until its last microbatch). The loss of a microbatch is divided by the
   global batch's target tokens and multiplied by ``world_size``, because DDP averages
   gradients over ranks: the result is the gradient of the global mean loss.

Run (2 local processes on CPU, gloo):

    python examples/ddp_balance.py --steps 5

or under torchrun: ``torchrun --nproc-per-node 2 examples/ddp_balance.py``. Each step
prints every rank's compute time with dflop's schedule and with the data-blind split
(``dflop.data_blind_schedule``) of the same batch, measured on the same weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import dflop
import numpy as np
import torch
import torch.distributed as dist
from dflop.data import synthetic_shapes
from dflop.models import build_model, model_config
from dflop.runtime.synthetic_batch import ShapeScaler, SyntheticBatch
from torch.nn.parallel import DistributedDataParallel


def sample_costs(shapes) -> np.ndarray:
    """(N, 1) cost per sample: encoder tokens plus LLM tokens (a FLOP-like proxy; a
    ``CostModel(perf).costs(shapes)`` gives measured seconds instead)."""
    return (shapes.encoder_tokens + shapes.seq_len).astype(np.float64)[:, None]


def train_on(model, batch, microbatches, num_targets: int, world_size: int) -> float:
    """Forward + backward of this rank's microbatches; returns the compute seconds."""
    start = time.perf_counter()
    for i, ids in enumerate(microbatches):
        last = i == len(microbatches) - 1
        context = model.no_sync() if not last else _null()
        with context:
            sum_loss, _ = model(**batch.model_inputs(ids))
            (sum_loss * world_size / num_targets).backward()
    return time.perf_counter() - start


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # spawned below: join the local group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = model_config("tiny")
    scaler = ShapeScaler.for_model(config)
    model = DistributedDataParallel(build_model(config, seed=0), find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        shapes = scaler.scale(synthetic_shapes(args.global_batch, seed=step))  # same on all ranks
        batch = SyntheticBatch(shapes, config, seed=step)
        num_targets = int(batch.target_tokens().sum())
        costs = sample_costs(shapes)
        balanced = dflop.schedule(costs, args.num_microbatches, dp_size=world_size, seed=step)
        blind = dflop.data_blind_schedule(costs, args.num_microbatches, dp_size=world_size)
        times = {}
        for name, s in (("blind", blind), ("dflop", balanced)):  # dflop's gradients are kept
            optimizer.zero_grad(set_to_none=True)
            seconds = torch.tensor(
                [train_on(model, batch, s.microbatches(rank), num_targets, world_size)]
            )
            gathered = [torch.zeros(1) for _ in range(world_size)]
            dist.all_gather(gathered, seconds)
            times[name] = [float(t) for t in gathered]
        optimizer.step()
        if rank == 0:
            print(
                f"step {step}: per-rank compute s, dflop {_fmt(times['dflop'])} (slowest "
                f"{max(times['dflop']):.3f}) | data-blind {_fmt(times['blind'])} (slowest "
                f"{max(times['blind']):.3f}) | predicted max bin: dflop {balanced.makespan:.0f}"
                f" vs blind {blind.makespan:.0f} tokens",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    args = p.parse_args()
    if not args.port:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        worker(dist.get_rank(), dist.get_world_size(), args)
    else:
        torch.multiprocessing.spawn(worker, args=(args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
