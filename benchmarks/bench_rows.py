"""The bridge's pack / unpack (``dflop.runtime.rows``) against torch's ``index_select`` /
``index_copy_`` on the same rows, indices and stream, measured in the same run.

Shapes are the bridge's: features of a microbatch's visual tokens (rows) by the LLM's
hidden size, a random permutation as the routing order (every row to one place). Both
sides include uploading the host index (the routing plan lives on the host). On a GPU
with ``dflop._cuda``: CUDA-event times, median of the repeats, and the bytes moved (read
+ written) per second. On CPU both run torch's op (dflop adds its host-side index
check): the ratios are noise around 1.

    python benchmarks/bench_rows.py [--markdown benchmarks/README.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
import torch
from dflop.runtime import rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402

SHAPES = [  # (rows, hidden, dtype): a microbatch's visual rows into an LLM
    (5832, 3584, torch.bfloat16),  # 8 images x 729 tokens, Qwen2-7B hidden
    (23328, 1152, torch.bfloat16),  # 32 images x 729 tokens, SigLIP width
    (2048, 4096, torch.float32),
    (4096, 1001, torch.float16),  # an odd row width: 2,002-byte rows
]


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return float(np.median(times))


def _compare(src: torch.Tensor, order: np.ndarray, repeats: int) -> list[str]:
    """Table rows of pack and unpack of ``src``'s rows in ``order``, torch vs dflop."""
    device, out = src.device, torch.empty_like(src)
    moved_bytes = 2 * src.numel() * src.element_size()
    ops = {
        "pack": (
            lambda: torch.index_select(src, 0, torch.from_numpy(order).to(device), out=out),
            lambda: rows.gather_rows(src, order, out),
        ),
        "unpack": (
            lambda: out.index_copy_(0, torch.from_numpy(order).to(device), src),
            lambda: rows.scatter_rows(src, order, out),
        ),
    }
    lines = []
    for name, (base, ours) in ops.items():
        t_torch, t_dflop = _time(base, device, repeats), _time(ours, device, repeats)
        lines.append(
            f"| {name} | {src.shape[0]:,} x {src.shape[1]} {str(src.dtype).replace('torch.', '')}"
            f" | {1e3 * t_torch:.3f} | {1e3 * t_dflop:.3f} | {moved_bytes / t_torch / 1e9:.0f} | "
            f"{moved_bytes / t_dflop / 1e9:.0f} | {t_torch / t_dflop:.2f}x |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def run(device: torch.device, repeats: int) -> list[str]:
    rng = np.random.default_rng(0)
    lines = []
    for num_rows, hidden, dtype in SHAPES:
        src = torch.randn(num_rows, hidden, device=device).to(dtype)
        lines += _compare(src, rng.permutation(num_rows), repeats)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown", default=None, help="rewrite this README section")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and rows.cuda_kernels_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else f"CPU ({baselines.machine_info()})"
    body = "\n".join(
        [
            "Command: `python benchmarks/bench_rows.py --markdown benchmarks/README.md`",
            "",
            f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"{where}; torch {torch.__version__}; median of {args.repeats}; "
            + ("dflop._cuda kernels" if cuda else "no GPU: both sides run torch's path"),
            "",
            "| op | rows x hidden dtype | torch ms | dflop ms | torch GB/s | dflop GB/s | "
            "torch / dflop |",
            "|---|---|---:|---:|---:|---:|---:|",
            *run(device, args.repeats),
        ]
    )
    print(body)
    if args.markdown:
        baselines.write_section(args.markdown, "bench_rows", body, "## `bench_rows.py`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
