"""Benchmark the performance model: predicted vs measured time on shapes NOT used for fitting.

Profiles one of dflop's reference model presets (encoder + projector and decoder) with
``dflop.profiling.profile_model`` over the default shape grids, fits a ``PerformanceModel``
(reporting its held-out error on grid shapes), then measures *new* shapes with the same
harness -- encoder microbatches with unit counts outside the grid and decoder
microbatches packing random mixes of sequence lengths -- and compares them with the
model's predictions. Prints a table, the median absolute relative error per component
and overall (targets: <= 10% on CPU with tiny/small models, <= 5% on GPU), and the
command used.

    python benchmarks/bench_perf_model.py                      # small preset on CPU
    python benchmarks/bench_perf_model.py --device cuda --preset siglip-400m+llm-0.5b
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import numpy as np


def _eval_mixes(
    rng: np.random.Generator, num: int, max_tokens: int, min_seq_len: int, grid: set
) -> list[tuple[int, ...]]:
    """Random packed microbatches: 1-6 sequences of random lengths, total <= max_tokens."""
    mixes: list[tuple[int, ...]] = []
    while len(mixes) < num:
        total = int(rng.integers(max_tokens // 6, max_tokens + 1))
        num_seqs = int(rng.integers(1, 7))
        if total < num_seqs * min_seq_len:
            continue
        cuts = np.sort(rng.choice(np.arange(1, total), size=num_seqs - 1, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [total]])).astype(int)
        if lens.min() < min_seq_len:
            continue
        mix = tuple(int(x) for x in lens)
        if mix not in grid and mix not in mixes:
            mixes.append(mix)
    return mixes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--preset", default="small", help="dflop.models preset (default small)")
    parser.add_argument(
        "--dtype", default=None, help="float32 / bfloat16 (default: fp32 on CPU, bf16 on CUDA)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    parser.add_argument(
        "--max-units", type=int, default=None, help="largest encoder microbatch in units"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="largest decoder microbatch in tokens"
    )
    parser.add_argument(
        "--cpu-clock",
        choices=("wall", "thread"),
        default="wall",
        help="CPU timer: wall (perf_counter) or thread (thread CPU time; robust on a shared machine)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-eval", type=int, default=8, help="random decoder mixes to evaluate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="save the fitted PerformanceModel JSON here")
    args = parser.parse_args(argv)

    import torch
    from dflop.models import build_model
    from dflop.profiling import (
        ProfileResult,
        default_seq_len_mixes,
        default_unit_counts,
        fit_performance_model,
        profile_model,
    )

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype_name = args.dtype or ("bfloat16" if on_gpu else "float32")
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(args.threads)
    max_units = args.max_units or (64 if on_gpu else 8)
    max_tokens = args.max_tokens or (16384 if on_gpu else 1024)

    model = build_model(args.preset, seed=args.seed, device=device, dtype=dtype)
    max_tokens = min(max_tokens, model.decoder.config.max_seq_len)
    grid_units = default_unit_counts(max_units)
    grid_mixes = default_seq_len_mixes(max_tokens)
    common = dict(
        device=device, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
        num_threads=args.threads if not on_gpu else None,
        cpu_clock=args.cpu_clock,
    )  # fmt: skip

    rng = np.random.default_rng(args.seed + 1)
    eval_units = sorted(
        {
            u
            for u in (max_units * 5 // 8, max_units * 7 // 8, max_units * 5 // 4)
            if u not in grid_units
        }
        | {max_units * 5 // 4 + 1}
    )
    eval_mixes = _eval_mixes(rng, args.num_eval, max_tokens, 16, set(grid_mixes))

    # Grid and evaluation shapes are measured in the SAME interleaved rounds, so slow drift
    # of a shared machine (other jobs starting / stopping) hits both alike; the model is
    # then fitted on the grid shapes only.
    began = time.perf_counter()
    everything = profile_model(
        model.vision,
        model.decoder,
        unit_counts=grid_units + eval_units,
        seq_len_mixes=grid_mixes + eval_mixes,
        **common,
    )
    profile_s = time.perf_counter() - began
    profile = ProfileResult(
        encoder=everything.encoder[: len(grid_units)],
        decoder=everything.decoder[: len(grid_mixes)],
        tokens_per_unit=everything.tokens_per_unit,
        tensor_parallel_size=everything.tensor_parallel_size,
        metadata=everything.metadata,
    )
    measured = ProfileResult(
        encoder=everything.encoder[len(grid_units) :],
        decoder=everything.decoder[len(grid_mixes) :],
    )
    perf = fit_performance_model(profile, holdout_fraction=0.25, seed=args.seed)
    if args.output:
        perf.save(args.output)

    rows = []
    for m in measured.encoder:
        pred = float(perf.encoder_time_s(m.num_units))
        rows.append(("encoder", f"{m.num_units} units", m.time_s, pred))
    for m in measured.decoder:
        pred = float(perf.llm_time_s(m.num_tokens, m.sum_seq_sq, m.num_targets))
        shape = f"{m.num_tokens} tok = {'+'.join(str(s) for s in m.seq_lens)}"
        rows.append(("llm", shape, m.time_s, pred))

    print(f"command: {command}")
    meta = profile.metadata
    print(
        f"hardware: {meta.get('device_name')} ({meta.get('device_type')}), torch "
        f"{meta.get('torch_version')}, dtype {dtype_name}, threads {meta.get('num_threads')}, "
        f"timer {meta.get('timer')}"
    )
    print(
        f"preset {args.preset}: fitted on {len(grid_units)} encoder + {len(grid_mixes)} decoder "
        f"grid shapes, evaluated on {len(rows)} other shapes, all measured together in "
        f"{profile_s:.1f} s (warmup {args.warmup}, repeats {args.repeats}, medians)"
    )
    print(perf.summary())
    print()
    print("| stage | shape (not in the fitting grid) | measured ms | predicted ms | error |")
    print("|---|---|---:|---:|---:|")
    errors = {"encoder": [], "llm": []}
    for stage, shape, meas, pred in rows:
        err = (pred - meas) / meas
        errors[stage].append(abs(err))
        print(f"| {stage} | {shape} | {meas * 1e3:.1f} | {pred * 1e3:.1f} | {100 * err:+.1f}% |")
    print()
    all_errors = errors["encoder"] + errors["llm"]
    for stage in ("encoder", "llm"):
        if errors[stage]:
            print(
                f"{stage}: median |error| {100 * np.median(errors[stage]):.1f}%, "
                f"max {100 * np.max(errors[stage]):.1f}% over {len(errors[stage])} shapes"
            )
    target = 0.05 if on_gpu else 0.10
    overall = float(np.median(all_errors))
    print(
        f"overall median |error| {100 * overall:.1f}% (target <= {100 * target:.0f}%): "
        f"{'PASS' if overall <= target else 'MISS'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
