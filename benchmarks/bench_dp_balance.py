"""Per-step balancing for data-parallel training (``dflop.dp.BalancedBatchSampler``) against
torch's DistributedSampler, in simulation at 64 to 1,024 ranks.

Each step every rank trains its share of one global batch (8 samples per rank, 2
microbatches each); a step waits for its slowest rank at the gradient all-reduce. Samples
are the embedded synthetic mix (LLaVA-OneVision shape rules) and a second, video-heavy mix
(40% videos, 20% text: **skewed on purpose**, to show what a long-tailed mix does), priced
by the analytic cost model of siglip-400m + llm-7b on one GPU (compute seconds per sample,
forward + backward). DistributedSampler: the same global batch (the same permutation)
split by position into equal counts. Reported per setting: rank imbalance (max / mean
compute per step, mean over steps) and the step's compute time (the slowest rank's), the
ratio of the two methods measured on the same batches.

    python benchmarks/bench_dp_balance.py [--steps 20] [--markdown benchmarks/README.md]

Measured part (``--no-measure`` skips it): real gloo ranks on this CPU, 2 and 4 under DDP
(both mixes) and 2 under FSDP2, dflop's reference ``small`` model, the mix scaled onto it
(``ShapeScaler``); and the Hugging Face LLaVA-OneVision (tiny, scaled to 4 M parameters)
on generated LLaVA-format records with PNG files, packed by ``PackingCollator``, under DDP
and FSDP2. Costs: a quick profile of the same model on this machine (``CostModel``). Every step runs both splits of the same global batch on the same weights:
per-rank compute (forward + backward) and the step's wall time from a barrier to the end
of the gradients' reduction, which waits for the slowest rank. DDP: one flat all-reduce
after the last backward (its bucketed overlap is left out, the same for both); FSDP2: its
own all-gathers per forward and reduce-scatter after the last backward.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
from dflop.data import AnalyticCostModel, synthetic_shapes
from dflop.dp import BalancedBatchSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

RANKS = (64, 256, 1024)
PER_RANK, MICROBATCHES = 8, 2
MIXES = {
    "embedded mix": None,
    "video-heavy mix (skewed on purpose)": {
        "single_image": 0.3,
        "multi_image": 0.1,
        "video": 0.4,
        "text": 0.2,
    },
}


def run(ranks: int, mix, steps: int) -> dict:
    global_batch = ranks * PER_RANK
    shapes = synthetic_shapes(global_batch * steps, seed=ranks, mix=mix)
    costs = AnalyticCostModel("siglip-400m", "llm-7b").costs(shapes).sum(axis=1)
    sampler = BalancedBatchSampler(
        costs, global_batch, MICROBATCHES, rank=0, world_size=ranks, seed=0
    )
    out = {"dflop": [], "distributed": [], "dflop_step": [], "distributed_step": [], "s": 0.0}
    for step in range(steps):
        start = time.perf_counter()
        info = sampler.plan_step(0, step)  # both methods split its global batch
        out["s"] += time.perf_counter() - start
        per_rank = info.rank_costs[:, 0]
        even = costs[info.indices].reshape(ranks, PER_RANK).sum(axis=1)
        for name, loads in (("dflop", per_rank), ("distributed", even)):
            out[name].append(loads.max() / loads.mean())
            out[f"{name}_step"].append(loads.max())
    return {k: (float(np.mean(v)) if isinstance(v, list) else v / steps) for k, v in out.items()}


FEW_RANKS = (8, 128)
FEW_PER_RANK = (2, 4, 8)
FEW_MICROBATCHES = (2, 4)
FEW_MIXES = {
    "embedded mix": None,
    "text-heavy mix": {"single_image": 0.2, "multi_image": 0.0, "video": 0.0, "text": 0.8},
}


def few_per_rank(ranks: int, per_rank: int, microbatches: int, mix, steps: int) -> dict:
    """The sampler's slowest rank over dflop.schedule's (the same global batch split into
    ``ranks`` shares with no count to meet: the free optimum), padded (the default) and
    unpadded (one joint schedule when a share is too small), mean and worst over steps."""
    import dflop

    global_batch = ranks * per_rank
    shapes = synthetic_shapes(global_batch * steps, seed=7 * ranks + per_rank, mix=mix)
    costs = AnalyticCostModel("siglip-400m", "llm-7b").costs(shapes).sum(axis=1)
    out = {"steps_with_short_shares": 0}
    for step in range(steps):
        indices = np.arange(step * global_batch, (step + 1) * global_batch)
        free = dflop.schedule(costs[indices], 1, ranks, seed=step).assignment
        out["steps_with_short_shares"] += int(np.bincount(free).min() < microbatches)
    for pad in ("sample", "empty", None):
        sampler = BalancedBatchSampler(
            costs, global_batch, microbatches, rank=0, world_size=ranks, seed=0,
            padding=pad, check_ranks=False, shuffle=False,
        )  # fmt: skip
        ratios = []
        for step in range(steps):
            info = sampler.plan_step(0, step)  # the sampler's seed for step s is s
            free = dflop.schedule(costs[info.indices], 1, ranks, seed=step).makespan
            ratios.append(info.rank_costs[:, 0].max() / free)
        out[pad or "joint"] = (float(np.mean(ratios)), float(np.max(ratios)))
    return out


def _wrap(model, wrapper: str):
    """DDP, or FSDP2 (``fully_shard`` on the root: the model calls its parts' pieces
    directly, not their forward, so only the root's hooks see every use)."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def _reference_workload(steps: int, global_batch: int, perf_path: str, mix):
    """dflop's reference ``small`` model on the mix's synthetic shapes, priced by the
    parent's quick profile: (model, costs, target tokens, summed loss of sample ids)."""
    from dflop.models import build_model, model_config
    from dflop.profiling import CostModel, PerformanceModel
    from dflop.runtime.synthetic_batch import ShapeScaler, SyntheticBatch

    config = model_config("small")
    shapes = ShapeScaler.for_model(config).scale(
        synthetic_shapes(global_batch * steps, seed=1, mix=MIXES[mix])
    )
    costs = CostModel(PerformanceModel.load(perf_path)).costs(shapes).sum(axis=1)
    batch = SyntheticBatch(shapes, config, seed=0)

    def sum_loss(model, ids):
        return model(**batch.model_inputs(np.asarray(ids)))[0]

    return build_model(config, seed=0), costs, batch.target_tokens(), sum_loss


def bench_llava_config():
    """The tiny LLaVA-OneVision scaled up to 4 M parameters (4 + 4 layers, text hidden 256),
    so that a sample's compute is more than Python's overhead."""
    from dflop.models.hf.tiny import tiny_llava_onevision_config

    config = tiny_llava_onevision_config(vision_layers=4, text_layers=4)
    text, vision = config.text_config, config.vision_config
    text.hidden_size, text.intermediate_size, text.head_dim = 256, 768, 64
    text.num_attention_heads, text.num_key_value_heads = 4, 2
    vision.hidden_size, vision.intermediate_size, vision.num_attention_heads = 128, 384, 4
    config._attn_implementation = "sdpa"
    return config


def write_records(folder: str, num_samples: int, seed: int = 0) -> str:
    """LLaVA-format records with real image files (PNG, 16-200 px a side: 1 to 10 anyres
    crops of the tiny model), 25% text-only, lognormal text lengths; not tuned to show an
    effect. Returns the JSON's path."""
    import json

    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)

    def text(median_words: float) -> str:
        words = int(np.clip(rng.lognormal(np.log(median_words), 0.9), 2, 150))
        return " ".join(f"w{int(v)}" for v in rng.integers(0, 10_000, words))

    records = []
    for i in range(num_samples):
        turns = [{"from": "human", "value": text(8)}, {"from": "gpt", "value": text(20)}]
        record = {"id": str(i), "conversations": turns}
        if rng.random() < 0.75:
            name = f"{i}.png"
            width, height = (int(v) for v in rng.integers(16, 201, 2))
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, "images", name))
            record["image"] = name
            turns[0]["value"] = "<image>\n" + turns[0]["value"]
        records.append(record)
    path = os.path.join(folder, "records.json")
    with open(path, "w") as f:
        json.dump(records, f)
    return path


def _hf_workload(records_path: str):
    """Hugging Face LLaVA-OneVision (:func:`bench_llava_config`) on the records, each
    microbatch packed into one row (``PackingCollator``), priced by dflop's quick profile
    of the same model on rank 0 (broadcast: every rank must use the same costs)."""
    import json

    import torch
    import torch.distributed as dist
    import transformers
    from dflop.dp import PackingCollator
    from dflop.models.hf import spec_from_config
    from dflop.profiling import CostModel
    from dflop.runtime.processed_batch import ProcessedBatch
    from dflop.train.planning import quick_profile

    config = bench_llava_config()
    spec = spec_from_config(config)
    inputs = spec.dataset_inputs()
    with open(records_path) as f:
        records = json.load(f)
    folder = os.path.join(os.path.dirname(records_path), "images")
    samples = [
        inputs.sample(r, image_folder=folder, where=f"record {i}") for i, r in enumerate(records)
    ]
    fields = [inputs.model_fields(sample) for sample in samples]  # decoded before timing
    batch = ProcessedBatch(samples, spec.tokens_per_unit)
    costs = [None]
    if dist.get_rank() == 0:
        costs[0] = CostModel(quick_profile(spec, repeats=1)).costs(batch.shapes).sum(axis=1)
    dist.broadcast_object_list(costs, src=0)
    targets = batch.target_tokens()
    collate = PackingCollator()

    def sum_loss(model, ids):
        return model(**collate([fields[i] for i in ids])).loss * int(targets[list(ids)].sum())

    torch.manual_seed(0)
    model = transformers.LlavaOnevisionForConditionalGeneration(config)
    return model, costs[0], targets, sum_loss


def _measured_rank(
    rank: int, world_size: int, steps: int, global_batch: int, data: str, wrapper: str, mix
):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if mix == HF_MIX:
        model, costs, targets, sum_loss = _hf_workload(data)
    else:
        model, costs, targets, sum_loss = _reference_workload(steps, global_batch, data, mix)
    sampler = BalancedBatchSampler(
        costs, global_batch, MICROBATCHES, seed=0, target_tokens=targets, shuffle=False
    )
    model = _wrap(model, wrapper)
    rows = []
    for step in range(steps):
        info = sampler.plan_step(0, step)
        per_rank = global_batch // world_size
        mine = info.indices[rank * per_rank : (rank + 1) * per_rank]
        even = [mine[k::MICROBATCHES] for k in range(MICROBATCHES)]  # DistributedSampler
        scale = world_size / max(info.global_target_tokens, 1)
        row = {}
        for name, parts in (("distributed", even), ("dflop", info.microbatches)):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            if wrapper == "ddp":
                with model.no_sync():  # compute alone, then the gradients' all-reduce
                    for ids in parts:
                        (sum_loss(model, ids) * scale).backward()
                compute = time.perf_counter() - start
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)  # waits for the slowest rank, as DDP's does
            else:  # FSDP: all-gathers in every forward; the last backward reduce-scatters
                for k, ids in enumerate(parts):
                    model.set_requires_gradient_sync(k == len(parts) - 1)
                    (sum_loss(model, ids) * scale).backward()
                compute = time.perf_counter() - start
            wall = torch.tensor([compute, time.perf_counter() - start])
            gathered = [torch.zeros(2) for _ in range(world_size)]
            dist.all_gather(gathered, wall)
            values = torch.stack(gathered).numpy()
            row[name] = (values[:, 0], float(values[:, 1].max()))
        rows.append(row)
    return rows if rank == 0 else None


def measured(ranks: int, steps: int, global_batch: int, wrapper: str, mix: str) -> dict:
    """dflop against the equal split on ``ranks`` real CPU ranks (gloo)."""
    import tempfile

    from dflop.models import model_config
    from dflop.runtime import spawn_local
    from dflop.train.planning import quick_profile

    with tempfile.TemporaryDirectory() as folder:
        if mix == HF_MIX:
            data = write_records(folder, global_batch * steps)
        else:
            data = os.path.join(folder, "perf.json")
            quick_profile(model_config("small"), repeats=1).save(data)
        rows = spawn_local(
            _measured_rank,
            ranks,
            args=(steps, global_batch, data, wrapper, mix),
            timeout_s=1800.0,
            num_threads=1,
        )[0]
    out = {}
    for name in ("dflop", "distributed"):
        computes = [row[name][0] for row in rows[1:]]  # step 0 warms up
        out[name] = float(np.mean([c.max() / c.mean() for c in computes]))
        out[f"{name}_step"] = float(np.median([row[name][1] for row in rows[1:]]))
    return out


HF_MIX = "HF LLaVA-OneVision, LLaVA records with image files"
MEASURED = [  # (ranks, wrapper, workload)
    (2, "ddp", "embedded mix"),
    (2, "ddp", "video-heavy mix (skewed on purpose)"),
    (4, "ddp", "embedded mix"),
    (2, "fsdp", "embedded mix"),
    (2, "ddp", HF_MIX),
    (2, "fsdp", HF_MIX),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    parser.add_argument(
        "--no-measure", dest="measure", action="store_false", help="simulation only"
    )
    parser.add_argument("--measure-steps", type=int, default=12)
    parser.add_argument("--few-only", action="store_true", help="only the few-per-rank table")
    args = parser.parse_args(argv)
    few = [
        "Command: `python benchmarks/bench_dp_balance.py --few-only --markdown "
        "benchmarks/README.md` (the full run writes this table too)",
        "",
        "Few samples per rank (simulated, the same costs): the sampler's slowest rank over "
        "`dflop.schedule`'s for the same global batch with no microbatch count to meet (the "
        "free optimum, 1.000 = as good), mean and worst over the steps. A rank whose "
        "balanced share has fewer samples than microbatches runs padding microbatches (loss scale 0): `sample` (the default) the dataset's cheapest "
        "sample, priced in; `empty` empty microbatches (`padding='empty'`, a "
        "two-token row under `PackingCollator`, not priced); `joint` (`padding=None`, the "
        "Hugging Face Trainer's; before this, the only way): such a step is one joint "
        "schedule of every rank's microbatches. Costs: analytic siglip-400m + llm-7b; "
        "the text-heavy mix is 80% text, 20% single images (chosen to make short shares "
        "common).",
        "",
        "| ranks | samples per rank | microbatches | mix | steps with a short share | "
        "sample: mean / worst | empty: mean / worst | joint: mean / worst |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for ranks in FEW_RANKS:
        for per_rank in FEW_PER_RANK:
            for microbatches in FEW_MICROBATCHES:
                if microbatches > per_rank:
                    continue
                for name, mix in FEW_MIXES.items():
                    r = few_per_rank(ranks, per_rank, microbatches, mix, args.steps)
                    few.append(
                        f"| {ranks} | {per_rank} | {microbatches} | {name} | "
                        f"{r['steps_with_short_shares']} of {args.steps} | "
                        f"{r['sample'][0]:.4f} / {r['sample'][1]:.4f} | "
                        f"{r['empty'][0]:.4f} / {r['empty'][1]:.4f} | "
                        f"{r['joint'][0]:.4f} / {r['joint'][1]:.4f} |"
                    )
                    print(few[-1], file=sys.stderr, flush=True)
    print("\n".join(few))
    if args.markdown:
        baselines.write_section(
            args.markdown, "bench_dp_balance_few", "\n".join(few), "### Few samples per rank"
        )
    if args.few_only:
        return 0
    lines = [
        "Command: `python benchmarks/bench_dp_balance.py --markdown benchmarks/README.md`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{baselines.machine_info()}; {args.steps} steps per setting, {PER_RANK} samples and "
        f"{MICROBATCHES} microbatches per rank per step; simulated (analytic costs of "
        "siglip-400m + llm-7b); the video-heavy mix is skewed on purpose.",
        "",
        "| ranks | mix | imbalance, dflop | imbalance, DistributedSampler | step compute s, "
        "dflop | step compute s, DistributedSampler | DistributedSampler / dflop | "
        "dflop schedule ms per step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in RANKS:
        for name, mix in MIXES.items():
            r = run(ranks, mix, args.steps)
            lines.append(
                f"| {ranks:,} | {name} | {r['dflop']:.3f} | {r['distributed']:.3f} | "
                f"{r['dflop_step']:.2f} | {r['distributed_step']:.2f} | "
                f"{r['distributed_step'] / r['dflop_step']:.2f}x | {1e3 * r['s']:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    if args.measure:
        lines += [
            "",
            "Measured on this CPU (gloo, one thread per rank), 8 samples and "
            f"{MICROBATCHES} microbatches per rank per step, {args.measure_steps - 1} steps "
            "after a warm-up, both splits of every batch on the same weights. Mixes: dflop's "
            "reference `small` model on the synthetic mixes scaled onto it; "
            f"'{HF_MIX}': the Hugging Face model (tiny LLaVA-OneVision scaled to 4 M "
            "parameters) on generated LLaVA-format records with PNG files (16-200 px, 25% "
            "text-only; not tuned), each microbatch packed by `PackingCollator`. Costs: "
            "dflop's quick profile of the same model on this machine (`CostModel`). DDP: "
            "compute, then one all-reduce; FSDP2 (`fully_shard`): all-gathers in every "
            "forward tie the ranks together, so its compute imbalance reads near 1 for both "
            "and the step time is what differs. 4 ranks share the 2 cores (2 per core): "
            "their times include that contention, alike for both methods.",
            "",
            "| ranks | wrapper | mix | imbalance, dflop | imbalance, DistributedSampler | "
            "median step s, dflop | median step s, DistributedSampler | "
            "DistributedSampler / dflop |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for ranks, wrapper, mix_name in MEASURED:
            r = measured(ranks, args.measure_steps, 8 * ranks, wrapper, mix_name)
            lines.append(
                f"| {ranks} | {wrapper.upper()} | {mix_name} | {r['dflop']:.3f} | "
                f"{r['distributed']:.3f} | {r['dflop_step']:.3f} | "
                f"{r['distributed_step']:.3f} | {r['distributed_step'] / r['dflop_step']:.2f}x |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    lines += [
        "",
        "Imbalance = the slowest rank's compute over the mean rank's in a step (1.00 = "
        "perfect; target <= 1.05). Step compute = the slowest rank's seconds (the all-reduce "
        "and what follows are the same for both). Every rank computes the schedule itself "
        "(the same result, no communication); its time is the last column.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_dp_balance", body, "## `bench_dp_balance.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
