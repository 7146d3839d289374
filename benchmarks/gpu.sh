#!/usr/bin/env bash
# Per-round cost of DFlash block speculation on one CUDA GPU: T_draft / T_verify vs
# one AR step for a random-weight Qwen3-8B-shaped target, at batch 1 and 16, plus the
# projected speed-up at tau 3.0 and 6.5. Finishes in well under 8 minutes on an H200
# (hard limit: 480 s).
#
#   bash benchmarks/gpu.sh [--batches 1,16] [--context 512] [--iters 20]
#
# Exits with status 2 and one line on stderr where no CUDA GPU is available.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "${PYTHON:-python}" benchmarks/gpu_bench.py "$@"
