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
# Results go to $OUT (default ./gpu-check-out), at most 6 files (the device tool brings
# back 8): summary.txt (each step's exit code and seconds), gpu_check_logs.tgz (every
# step's full log, re-packed after each step, so a run cut short still brings them back),
# train.json, perf.json, bench_rows.md and gpu.txt. The script's exit code is the first
# failing step's, or 75 when steps were skipped for time. The steps run in the order of
# what matters most, so that a run cut short by the device's time limit still has the
# important ones.
#
#   BUDGET_S=<seconds of device time the command may use> bash scripts/gpu_check.sh
#
# Set BUDGET_S from the device tool's status (budget_left_s, less the machine's start
# and a margin) when less than a fresh 600 s command is left.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
LOGS=$(mktemp -d /tmp/gpu-check-logs.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
# The whole script stays within BUDGET_S (default 540 s: the device tool's 600 s per
# command): a step gets at most the time left, and is skipped with under 30 s left.
BUDGET_S=${BUDGET_S:-540}
skipped=""
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log it, keep going
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped ($left s of the budget left)" | tee -a "$OUT/summary.txt"
    skipped="$skipped $name"
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  echo "== $name: $*"
  local start=$SECONDS
  # -k: dflop train takes SIGTERM as "stop after this step"; a step that hangs is killed.
  timeout -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$LOGS/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  tar czf "$OUT/gpu_check_logs.tgz" -C "$LOGS" .
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  return "$rc"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

step build 300 python3 -m pip install -v --no-build-isolation --no-deps \
  -C cmake.define.DFLOP_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -e . || exit 1
# One real pack on the GPU: a launch the device refuses would otherwise fall back to
# torch's copies with a warning, and the kernel checks below would pass without kernels.
step kernels_available 60 python3 -c "
import torch
from dflop.runtime import rows
assert rows.cuda_kernels_available(), 'dflop._cuda sees no GPU'
src = torch.arange(12.0, device='cuda').reshape(6, 2)
out = rows.gather_rows(src, [5, 0, 3])
torch.cuda.synchronize()
assert not rows._UNUSABLE_DEVICES, 'the kernel launch was refused'
assert out.tolist() == [[10.0, 11.0], [0.0, 1.0], [6.0, 7.0]], out
print('dflop._cuda OK')"

step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -W error::RuntimeWarning -m gpu \
  tests/unit/runtime/test_rows.py tests/unit/runtime/test_thread_world.py
# dflop train on the one GPU: its 2 ranks (encoder, LLM) as threads (NCCL refuses two
# ranks on one device), each on its own stream, messages on the world's stream; the
# profiler trace of the last 2 steps gives the transfers' overlap with compute, and the
# allocator's peak the memory model's error (one process: both ranks against the sum).
step train_one_gpu 240 python3 -m dflop.cli train --device cuda --launch threads \
  --model small --layout enc_dp=1,llm_pp=1,m=4 --steps 8 --schedule compare \
  --profile-trace /tmp/dflop_train_trace.json --memory-report --json "$OUT/train.json"
step train_trace_measured 60 python3 -c "
import json
report = json.load(open('$OUT/train.json'))
(path, found), = report['transfer_overlap']
print(path, found)
for m in report['memory']:
    print('memory: measured', m['measured_bytes'] / 1e9, 'GB, model', m['predicted_bytes'] / 1e9,
          'GB, error', (m['predicted_bytes'] - m['measured_bytes']) / m['measured_bytes'])
assert found['num_transfers'] > 0 and found['num_kernels'] > 0, 'no GPU transfers or kernels'"
# torch's CUDA sanitizer sees the main thread's ops only (the rows tests); the thread
# world's stream order is tested directly by the GPU tests above.
step torch_cuda_sanitizer 180 env TORCH_CUDA_SANITIZER=1 \
  python3 -m pytest -q -p no:cacheprovider -W error::RuntimeWarning -m gpu tests/unit/runtime/test_rows.py
step bench_rows 120 python3 benchmarks/bench_rows.py --markdown "$OUT/bench_rows.md"
step perf_model 300 python3 benchmarks/bench_perf_model.py --device cuda \
  --preset siglip-400m+llm-0.5b --output "$OUT/perf.json"
# Without torch's caching allocator, so that memcheck sees each tensor's own bounds.
step compute_sanitizer_memcheck 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/runtime/test_rows.py -k equal_torch
step hf_trainer_example 180 python3 examples/hf_trainer_balance.py --epochs 1

if [ -n "$skipped" ]; then
  echo "== not run (out of time):$skipped" | tee -a "$OUT/summary.txt"
  if [ "$status" -eq 0 ]; then status=75; fi
fi
echo "== gpu_check: exit $status (logs in $OUT/gpu_check_logs.tgz)" | tee -a "$OUT/summary.txt"
exit "$status"
