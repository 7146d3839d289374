#!/usr/bin/env bash
# GPU figures of issue 18 in one run (benchmarks/gpu_bench.py): a random-weight
# Qwen3-8B-shaped target with the 5-layer z-lab DFlash draft and a DSpark draft, bf16,
# contexts 512 and 4096: AR decode against transformers (static cache + compile), round
# costs (T_draft, T_verify(16), T_ar at batch 1, 8, 32; projected speedup at tau 6.49
# and 3), engine throughput vs concurrency with simulated tau 6.5, peak GPU memory.
# Sized for 6 minutes on one H200: each section has a time budget (round costs 70 s, the
# captured engine 110 s, AR vs transformers 150 s, of a global 330 s: gpu_bench.py) and
# starts nothing past it; a section that fails says so in one line and the next one runs.
# Hard limit 360 s (timeout's SIGTERM: the report says it was stopped). The Markdown is
# rewritten after every line to --out (default: $OUT/gpu_bench.md where $OUT is set),
# so a stopped run leaves what it measured.
#
#   bash benchmarks/gpu.sh [--out FILE] [--contexts 512,4096] [--batches 1,8,32] ...
#   python benchmarks/record.py "GPU: issue 18 figures" -- bash benchmarks/gpu.sh
#   bash benchmarks/gpu.sh --smoke     # every section on the CPU at tiny shapes (numbers meaningless)
#
# Exits with status 2 and one line on stderr where no CUDA GPU is available.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"   # the H200 image has python3 only
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
smoke=0
for a in "$@"; do [ "$a" = "--smoke" ] && smoke=1; done
if [ "$smoke" = 0 ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "error: benchmarks/gpu.sh needs a CUDA GPU and none is visible (no /dev/nvidia* device, no nvidia-smi); --smoke rehearses it on the CPU" >&2
  exit 2
fi
out=()
if [ -n "${OUT:-}" ] && [[ " $* " != *" --out "* ]]; then out=(--out "$OUT/gpu_bench.md"); fi
export PYTHONUNBUFFERED=1
exec timeout --kill-after=10 360 "$PY" benchmarks/gpu_bench.py "$@" "${out[@]}"
