#!/usr/bin/env bash
# Draft training on one CUDA GPU, in phases sized for short device leases (one call
# runs at most 10 minutes). Phases, named on the command line (default: all, in order):
#   regen     the target continues 40k corpus prefixes greedily (160 new tokens), for
#             REGEN_S seconds; the first 4000 lines are recipes/train_drafts.sh's data
#             (same prompts, seed 0), carried in, so only the rest is generated here.
#   train     four drafts side by side on that data, each fitted to TRAIN_S seconds
#             (`--time-budget-s`; the step count it chose is in each log): dflash2 /
#             dspark2 continue the drafts in $INIT2 (on 2026-11-29: the 2-layer drafts
#             shipped at commit c0689ef, since replaced); dflash4 / dspark4 are 4-layer
#             drafts warm-started from the target's last four layers.
#   more1     the 4-layer drafts, two processes: MORE1_S (190) s more at lr 5e-4, seed 1 (-> *4b)
#   more2     and MORE2_S (125) s more at lr 3e-4, seed 2 (-> *4c, the shipped 4-layer drafts)
#   bench     HumanEval (164 prompts, greedy, 128 new tokens, batch 1) on the GPU: AR vs
#             the DFlash and DSpark drafts with the best final held-out tau.
# As run for the shipped drafts (2026-11-29, H200): `regen train bench` in one call (the
# bench was cut off by BENCH_S=110 at BENCH_LIMIT=60), then `more1`, then `more2`, each
# in its own call on the same machine. What is worth keeping lands in $OUT as at most
# 8 files (tars), phase by phase, so a call cut short still returns what finished.
# Inputs come from $CARRY, written on the CPU machine before the lease:
#   bash recipes/train_drafts_gpu.sh prepare      # writes .gpu/ (git-ignored)
#   (device tool) OUT=$OUT bash recipes/train_drafts_gpu.sh regen train   # carry: .gpu
# DEVICE=cpu with small PROMPTS / TRAIN_S / BENCH_LIMIT rehearses the whole script.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CARRY=${CARRY:-.gpu}
if [ "${1:-}" = prepare ]; then
  mkdir -p "$CARRY"
  gzip -c runs/corpus/train.jsonl > "$CARRY/corpus_train.jsonl.gz"
  gzip -c runs/regen2/train.jsonl > "$CARRY/regen2_train.jsonl.gz"
  $PY -c 'import json; from blockspec.bench.datasets import humaneval
print("\n".join(json.dumps({"id": p.id, "prompt": p.text}) for p in humaneval()))' > "$CARRY/humaneval.jsonl"
  exit 0
fi
OUT=$(mkdir -p "${OUT:-runs/gpu_out}" && cd "${OUT:-runs/gpu_out}" && pwd)
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-40000}
REGEN_S=${REGEN_S:-100}
TRAIN_S=${TRAIN_S:-270}
BENCH_S=${BENCH_S:-120}
BENCH_LIMIT=${BENCH_LIMIT:-164}
THREADS=${THREADS:-0}
BATCH=${BATCH:-32}          # per process; a CPU rehearsal wants less (four processes share the RAM)
MORE1_S=${MORE1_S:-190}
MORE2_S=${MORE2_S:-125}
INIT2=${INIT2:-src/blockspec/assets}
W=${WORK:-runs/gpu}
bs() { $PY -c 'import sys; from blockspec.cli import main; sys.exit(main())' "$@"; }
mkdir -p "$OUT" "$W/corpus" "$W/regen"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$W/phases.log"; }
# Logs and every stage's records (ship_drafts.py traces a draft's stages through them).
pack_logs() { (cd "$W" && tar -cf "$OUT/logs.tar" --ignore-failed-read phases.log env.txt regen.log ./*.log \
  ./*/log.jsonl ./*/train_config.json 2>/dev/null); }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "python", platform.python_version())'
  nproc; } > "$W/env.txt" 2>&1

PHASES=${*:-regen train more1 more2 bench}
has() { [[ " $PHASES " == *" $1 "* ]]; }

if has regen; then
stamp "regenerate: up to $PROMPTS prompts, ${REGEN_S}s"
zcat "$CARRY/corpus_train.jsonl.gz" > "$W/corpus/train.jsonl"
[ -s "$W/regen/train.jsonl" ] || zcat "$CARRY/regen2_train.jsonl.gz" > "$W/regen/train.jsonl"
timeout "$REGEN_S" $PY -c 'import sys; from blockspec.cli import main; sys.exit(main())' regenerate \
  --prompts "$W/corpus" --out "$W/regen/train.jsonl" --num-prompts "$PROMPTS" --max-new-tokens 160 \
  --batch-size 512 --seed 0 --device "$DEVICE" > "$W/regen.log" 2>&1
# A kill mid-write can leave a partial last line: keep whole lines only.
n=$(wc -l < "$W/regen/train.jsonl"); head -n "$n" "$W/regen/train.jsonl" > "$W/regen/whole.jsonl"
mv "$W/regen/whole.jsonl" "$W/regen/train.jsonl"
stamp "regenerate done: $n examples"
gzip -c "$W/regen/train.jsonl" > "$W/regen_train.jsonl.gz"
[ "$(stat -c %s "$W/regen_train.jsonl.gz")" -lt 16000000 ] && cp "$W/regen_train.jsonl.gz" "$OUT/"
pack_logs
fi

TARGET=src/blockspec/assets/target
COMMON=(--target "$TARGET" --data "$W/regen/train.jsonl" --num-anchors 48 --batch-size "$BATCH" --max-steps 100000
        --eval-every 500 --eval-examples 16 --eval-new-tokens 64 --seed 0 --device "$DEVICE"
        --time-budget-s "$TRAIN_S" --threads "$THREADS")
FOUR=(--num-layers 4 --target-layer-ids 1,3,5 --init-from-target --lr 1e-3)
ship() { for r in "$@"; do [ -f "$W/$r/draft/config.json" ] && tar -cf "$OUT/$r.tar" -C "$W" "$r/draft" "$r/train_config.json"; done; }
if has train; then
stamp "train 4 drafts, ${TRAIN_S}s each"
bs train --method dflash --init-from "$INIT2/dflash" --lr 5e-4 --out "$W/dflash2" "${COMMON[@]}" > "$W/dflash2.log" 2>&1 &
bs train --method dspark --init-from "$INIT2/dspark" --lr 5e-4 --out "$W/dspark2" "${COMMON[@]}" > "$W/dspark2.log" 2>&1 &
bs train --method dflash --block-size 16 "${FOUR[@]}" --out "$W/dflash4" "${COMMON[@]}" > "$W/dflash4.log" 2>&1 &
bs train --method dspark --block-size 15 --markov-rank 64 --markov-head-type vanilla "${FOUR[@]}" \
  --out "$W/dspark4" "${COMMON[@]}" > "$W/dspark4.log" 2>&1 &
wait
ship dflash2 dspark2
stamp "train done"
pack_logs
fi

# Further stages of the 4-layer drafts: from to seconds lr seed [ship]
more() {
  stamp "continue $1 -> $2: ${3}s at lr $4, seed $5"
  for m in dflash dspark; do
    bs train --method $m "${COMMON[@]}" --init-from "$W/$m$1/draft" --lr "$4" --seed "$5" --out "$W/$m$2" \
      --time-budget-s "$3" > "$W/$m$2.log" 2>&1 &
  done
  wait
  [ "${6:-}" = ship ] && ship "dflash$2" "dspark$2"   # at most 8 files come back: final drafts only
  stamp "continue done"
  pack_logs
}
has more1 && more 4 4b "$MORE1_S" 5e-4 1
has more2 && more 4b 4c "$MORE2_S" 3e-4 2 ship

if has bench; then
# The draft of each method with the best final held-out tau goes to the GPU bench.
best() { $PY - "$W" "$1" <<'EOF'
import json, sys
from pathlib import Path
runs = []
for run in sorted(Path(sys.argv[1]).glob(sys.argv[2] + "[0-9]*")):
    evals = [json.loads(line)["eval"]["tau"] for line in open(run / "log.jsonl") if '"eval"' in line] \
        if (run / "log.jsonl").is_file() and (run / "draft").is_dir() else []
    if evals:
        runs.append((evals[-1], str(run / "draft")))
print(max(runs)[1] if runs else "")
EOF
}
DF=$(best dflash); DS=$(best dspark)
stamp "bench: dflash=$DF dspark=$DS"
if [ -n "$DF" ] && [ -n "$DS" ]; then
  timeout "$BENCH_S" $PY -c 'import sys; from blockspec.cli import main; sys.exit(main())' bench \
    --datasets "$CARRY/humaneval.jsonl" --methods ar,dflash,dspark --dflash-draft "$DF" --dspark-draft "$DS" \
    --temperatures 0 --max-new-tokens 128 --limit "$BENCH_LIMIT" --device "$DEVICE" --out "$W/bench" \
    --no-progress > "$W/bench.log" 2>&1
  [ -d "$W/bench" ] && tar -cf "$OUT/bench.tar" -C "$W" bench
fi
stamp "bench done"
fi
stamp "all done"
pack_logs
