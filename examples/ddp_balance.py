"""Balancing DP ranks' microbatches with ``dflop.dp.BalancedBatchSampler`` in a plain DDP
(or FSDP2) training loop of your own: no dflop runtime, just torch.

1. Price every sample of the dataset once (here: a token count over synthetic shapes; a
   ``dflop.profiling.CostModel`` over ``dflop.data.profile_dataset``'s shapes gives
   measured seconds).
2. The sampler, as a DataLoader's ``batch_sampler``: every rank draws the same global batch
   each step and takes its balanced share as ``--num-microbatches`` microbatches (the same
   computation on every rank, no communication).
3. Train each microbatch under ``mb.gradient_sync(model)`` (gradients reduced after the
   last one) with its summed loss times ``mb.loss_scale``: the gradient of the global
   batch's mean loss.

Run (2 local processes on CPU, gloo):

    python examples/ddp_balance.py --steps 5 [--fsdp]

or under torchrun: ``torchrun --nproc-per-node 2 examples/ddp_balance.py``. Each step
prints every rank's compute time with dflop's split and with an equal-count split of the
same global batch (what DistributedSampler does), measured on the same weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from dflop.data import synthetic_shapes
from dflop.dp import BalancedBatchSampler, Microbatch
from dflop.models import build_model, model_config
from dflop.runtime.synthetic_batch import ShapeScaler, SyntheticBatch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader


def sample_costs(shapes) -> np.ndarray:
    """Cost per sample: encoder tokens plus LLM tokens (a FLOP-like proxy)."""
    return (shapes.encoder_tokens + shapes.seq_len).astype(np.float64)


def train_on(model, batch, microbatches, step, world_size: int) -> float:
    """Forward + backward of one split's microbatches; returns the compute seconds."""
    start = time.perf_counter()
    for k, ids in enumerate(microbatches):
        mb = Microbatch(step, k, world_size)  # the step's k-th: its sync and loss scale
        with mb.gradient_sync(model):
            sum_loss, _ = model(**batch.model_inputs(np.asarray(ids)))
            # A text-only microbatch leaves the vision tower out of the graph, and DDP
            # reduces every parameter's gradient: a zero term keeps them all in (as
            # LLaVA-style trainers do) instead of find_unused_parameters' walk of the graph.
            sum_loss = sum_loss + 0.0 * sum(p.sum() for p in model.parameters())
            (sum_loss * mb.loss_scale).backward()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # spawned below: join the local group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
    torch.set_num_threads(1)
    config = model_config("tiny")
    shapes = ShapeScaler.for_model(config).scale(
        synthetic_shapes(args.global_batch * args.steps, seed=0)
    )
    dataset = SyntheticBatch(shapes, config, seed=0)  # sample i = row i
    sampler = BalancedBatchSampler(
        sample_costs(shapes), args.global_batch, args.num_microbatches,
        target_tokens=dataset.target_tokens(), seed=0,
    )  # fmt: skip
    loader = DataLoader(range(len(shapes)), batch_sampler=sampler, collate_fn=list)
    model = build_model(config, seed=0)
    model = fully_shard(model) if args.fsdp else DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    microbatches = []
    for ids, mb in sampler.batches(loader):
        microbatches.append(ids)
        if not mb.is_last:
            continue
        # The step's whole share is known: time it against the equal-count split of the
        # same global batch (DistributedSampler's), both on the same weights.
        info = mb.step
        share = np.array_split(info.indices, world_size)[rank]
        equal = [share[k :: args.num_microbatches] for k in range(args.num_microbatches)]
        times = {}
        for name, split in (("equal", equal), ("dflop", microbatches)):  # dflop's grads kept
            optimizer.zero_grad(set_to_none=True)
            seconds = torch.tensor([train_on(model, dataset, split, info, world_size)])
            gathered = [torch.zeros(1) for _ in range(world_size)]
            dist.all_gather(gathered, seconds)
            times[name] = [float(t) for t in gathered]
        optimizer.step()
        microbatches = []
        if rank == 0:
            print(
                f"step {info.step}: per-rank compute s, dflop {_fmt(times['dflop'])} (slowest "
                f"{max(times['dflop']):.3f}) | equal split {_fmt(times['equal'])} (slowest "
                f"{max(times['equal']):.3f})",
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
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
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
