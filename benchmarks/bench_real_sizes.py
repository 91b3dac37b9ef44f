"""Real vocabularies and long samples, through the CLI: the plan's step and the memory
model against what ``dflop train`` measures on this machine.

1. ``hf``: tiny LLaVA-OneVision and Qwen2-VL at the real vocabulary (151,936) on a
   generated LLaVA-format dataset of real files reaching 18k tokens
   (``tests/real_sizes.py``: anyres images of every size, multi-image, 40-frame videos,
   text-only, long documents; not tuned to anything dflop does), ``dflop train --model
   hf:DIR --data recipe.yaml --nproc 2 --memory-report`` with no layout, memory or length
   flag. Reported: the plan's uncorrected model on the run's steps against the measured
   mean step, the plan's own mean over its batches, and every rank's measured peak memory
   against the memory model's prediction for its stage on the same steps.
2. ``reference``: dflop's reference model (``tiny``, and ``small`` over 3 processes with
   an LLM of 2 stages), the same memory comparison.
3. ``loss``: the LM head and loss at the real vocabulary, in one process: the peak memory
   above the weights (torch's profiler) of the chunked loss (1,024 target tokens a chunk)
   against the unchunked cross-entropy, for 512 to 8,192 target tokens (the unchunked one
   up to 2,048: 8,192 would hold 15 GB), and their time.

    python benchmarks/bench_real_sizes.py                         # prints the tables
    python benchmarks/bench_real_sizes.py --markdown benchmarks/README.md

The processes share 2 cores: measure on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from real_sizes import make_dataset  # noqa: E402

VOCAB = 151_936


def _train(out: Path, name: str, *args: str) -> dict:
    path = out / f"{name}.json"
    argv = [sys.executable, "-m", "dflop.cli", "train", *args, "--quiet", "--memory-report",
            "--json", str(path)]  # fmt: skip
    print("$", " ".join(argv[2:]), flush=True)
    with open(out / f"{name}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name}: dflop train failed ({done.returncode}); see {out / name}.log")
    return json.loads(path.read_text())


def _memory_rows(name: str, report: dict) -> list[str]:
    rows = []
    for m in sorted(report["memory"], key=lambda m: m["rank"]):
        measured, predicted = m["measured_bytes"], m["predicted_bytes"]
        rows.append(
            f"| {name} | {m['rank']} | {m['stage']} | {measured / 1e6:.1f} | "
            f"{predicted / 1e6:.1f} | {(predicted - measured) / measured:+.1%} |"
        )
    return rows


def _loss_rows() -> list[str]:
    """Peak memory and time of the head + loss, chunked and not, by target tokens."""
    import torch
    import torch.nn.functional as F
    from dflop.models.loss import chunked_lm_loss
    from dflop.profiling.memory import measure_peak_bytes

    torch.manual_seed(0)
    hidden = 64
    head = torch.nn.Linear(hidden, VOCAB, bias=False)
    rows = []
    for targets in (512, 2048, 8192):
        x = torch.randn(targets, hidden, requires_grad=True)
        labels = torch.randint(0, VOCAB, (targets,))
        found = {}
        for name, chunked in (("chunked", True), ("unchunked", False)):
            if not chunked and targets > 2048:
                found[name] = None
                continue

            def step(chunked: bool = chunked, x: Any = x, labels: Any = labels) -> None:
                if chunked:
                    loss = chunked_lm_loss(x, head, labels, 1024)
                else:
                    loss = F.cross_entropy(head(x).float(), labels, reduction="sum")
                loss.backward()

            head.zero_grad()
            x.grad = None
            begin = time.perf_counter()
            peak = measure_peak_bytes(step).added_bytes
            found[name] = (peak, time.perf_counter() - begin)
        chunked_peak, chunked_s = found["chunked"]
        plain = found["unchunked"]
        rows.append(
            f"| {targets:,} | {chunked_peak / 1e6:,.0f} | "
            + (f"{plain[0] / 1e6:,.0f} | {plain[0] / chunked_peak:.1f}x" if plain else "- | -")
            + f" | {chunked_s:.2f} | "
            + (f"{plain[1]:.2f}" if plain else "-")
            + " |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/dflop-real-sizes")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--markdown", default=None, help="update this README's table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    from dflop.models.hf.tiny import save_tiny_llava_onevision, save_tiny_qwen_vl

    recipe = make_dataset(str(out / "data"))
    models = {
        "tiny LLaVA-OneVision": save_tiny_llava_onevision(str(out / "ov"), vocab_size=VOCAB),
        "tiny Qwen2-VL": save_tiny_qwen_vl(str(out / "qwen"), vocab_size=VOCAB),
    }
    step_rows, memory_rows = [], []
    for name, folder in models.items():
        report = _train(
            out, name.split()[-1], "--model", f"hf:{folder}", "--data", recipe,
            "--nproc", "2", "--steps", str(args.steps), "--global-batch", "8",
        )  # fmt: skip
        d = report["summary"]["dflop"]
        step_rows.append(
            f"| {name} | {d['num_steps']} | {d['step_time_s']:.2f} | "
            f"{d['plan_model_step_time_s']:.2f} | {d['plan_prediction_error']:.1%} | "
            f"{report['planned_step_time_s']:.2f} | {d['prediction_error']:.1%} |"
        )
        memory_rows += _memory_rows(name, report)
    for name, extra in (
        ("reference tiny", ("--preset", "tiny", "--nproc", "2")),
        ("reference small, LLM pp 2", ("--preset", "small", "--layout", "enc_dp=1,llm_pp=2,m=4")),
    ):
        report = _train(out, name.replace(" ", "_").replace(",", ""), *extra,
                        "--steps", str(args.steps), "--global-batch", "16")  # fmt: skip
        memory_rows += _memory_rows(name, report)
    loss_rows = _loss_rows()
    minutes = (time.perf_counter() - start) / 60
    head = (
        f"Command: `python benchmarks/bench_real_sizes.py --markdown benchmarks/README.md` "
        f"({datetime.date.today()}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} logical cores; gloo; {args.steps} steps, the first not measured; "
        f"total {minutes:.1f} min)."
    )
    text = "\n".join(
        [
            head,
            "",
            "Plan and runtime at the real vocabulary on data reaching 18k tokens, no flag "
            "(target: the plan's model within 25% of the measured step):",
            "",
            "| model | steps | measured step (s) | plan's model on these steps (s) | error | "
            "plan's mean over its batches (s) | per-step simulator error |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *step_rows,
            "",
            "Peak memory per rank over the last 2 steps: measured (CPU: torch's profiler over "
            "the live tensors) against the memory model for those steps (target: within 25%):",
            "",
            "| run | rank | stage | measured (MB) | predicted (MB) | predicted vs measured |",
            "|---|---:|---:|---:|---:|---:|",
            *memory_rows,
            "",
            f"The LM head and loss at a vocabulary of {VOCAB:,} (hidden 64, one process, "
            "CPU): peak memory above the weights and time of forward + backward, chunked "
            "(1,024 target tokens a chunk, logits remade in the backward) against the "
            "unchunked cross-entropy:",
            "",
            "| target tokens | chunked peak (MB) | unchunked peak (MB) | unchunked / chunked "
            "| chunked s | unchunked s |",
            "|---:|---:|---:|---:|---:|---:|",
            *loss_rows,
        ]
    )
    print(text)
    if args.markdown:
        path = Path(args.markdown)
        doc = path.read_text()
        begin, end = "<!-- bench_real_sizes:start -->", "<!-- bench_real_sizes:end -->"
        if begin in doc:
            doc = doc[: doc.index(begin) + len(begin)] + "\n" + text + "\n" + doc[doc.index(end) :]
            path.write_text(doc)


if __name__ == "__main__":
    main()
