#!/usr/bin/env bash
# The GPU checks (issue "GPU path"), one prepared run on a machine with one CUDA GPU, within
# BUDGET_S seconds (below). Uses the machine's own python3 and torch (no downloads): builds
# dflop with its CUDA part, runs the GPU-marked tests plain, under torch's CUDA sanitizer
# and under compute-sanitizer's memcheck, trains with dflop train on the GPU (both stages
# on it, a profiler trace: transfer/compute overlap), benchmarks the pack kernels, runs
# the Hugging Face Trainer example (BalancedTrainer + PackingCollator) on the GPU, and
# profiles + fits the performance model on the GPU (held-out error, target <= 5%).
# torch's CUDA sanitizer sees torch's ops around the kernels, not the kernels (raw-pointer
# launches); the kernels' stream order is tested directly (a side stream behind a sleeping
# current stream), and memcheck catches out-of-bounds accesses.
# Logs and results go to $OUT (default ./gpu-check-out). Each step reports its exit code;
# the script's is the first failing one. The steps run in the order of what matters most,
# so that a run cut short by the device's time limit still has the important ones.
#
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
# The whole script stays within BUDGET_S (default 540 s: the device tool's 600 s per
# command): a step gets at most the time left, and is skipped with under 30 s left.
BUDGET_S=${BUDGET_S:-540}
skipped=""
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, keep going
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped ($left s of the budget left)"
    skipped="$skipped $name"
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  return "$rc"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

step build 300 python3 -m pip install -v --no-build-isolation --no-deps \
  -C cmake.define.DFLOP_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -e . || exit 1
step kernels_available 60 python3 -c "
from dflop.runtime import rows
assert rows.cuda_kernels_available(), 'dflop._cuda sees no GPU'
print('dflop._cuda OK')" || exit 1

step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rows.py \
  tests/test_thread_world.py
# dflop train on the one GPU: its 2 ranks (encoder, LLM) as threads (NCCL refuses two
# ranks on one device), each on its own stream, messages on the world's stream; the
# profiler trace of the last 2 steps gives the transfers' overlap with compute.
step train_one_gpu 240 dflop train --device cuda --launch threads --model small \
  --layout enc_dp=1,llm_pp=1,m=4 --steps 8 --schedule compare \
  --profile-trace /tmp/dflop_train_trace.json --json "$OUT/train.json"
step train_trace_measured 60 python3 -c "
import json
(path, found), = json.load(open('$OUT/train.json'))['transfer_overlap']
print(path, found)
assert found['num_transfers'] > 0 and found['num_kernels'] > 0, 'no GPU transfers or kernels'"
# torch's CUDA sanitizer sees the main thread's ops only (the rows tests); the thread
# world's stream order is tested directly by the GPU tests above.
step torch_cuda_sanitizer 180 env TORCH_CUDA_SANITIZER=1 \
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rows.py
step perf_model 300 python3 benchmarks/bench_perf_model.py --device cuda \
  --preset siglip-400m+llm-0.5b --output "$OUT/perf.json"
step compute_sanitizer_memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rows.py -k equal_torch
step bench_rows 120 python3 benchmarks/bench_rows.py --markdown "$OUT/bench_rows.md"
step hf_trainer_example 180 python3 examples/hf_trainer_balance.py --epochs 1

if [ -n "$skipped" ]; then
  echo "== not run (out of time):$skipped"
  if [ "$status" -eq 0 ]; then status=75; fi
fi
echo "== gpu_check: exit $status (logs in $OUT)"
exit "$status"
