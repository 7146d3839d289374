#!/usr/bin/env bash
# The EAGLE-3 draft for the embedded target, trained like the shipped DFlash draft so the
# two compare on equal terms (issue 32): the same target-regenerated data (the GPU
# recipe's runs/gpu/regen/train.jsonl, 24480 examples; or the carried first 4000 of
# recipes/train_drafts.sh), the same captured layers (1, 3, 5), the same three-stage
# schedule and wall-time budgets on one GPU as dflash4 -> dflash4b -> dflash4c
# (recipes/train_drafts_gpu.sh: 270 s at lr 1e-3, 190 s at 5e-4 seed 1, 125 s at 3e-4
# seed 2, each fitted by --time-budget-s), then HumanEval side by side with the shipped
# drafts. EAGLE-3 specifics: one decoder layer (no warm start: it has no target-shaped
# counterpart), the training-time test unrolled over 7 steps (EAGLE-3's), a draft
# vocabulary of the 2048 most frequent trained tokens (a quarter of the 8192, near
# Qwen3's 32000 / 151936).
# Phases (default: all, in order): stage1 stage2 stage3 bench. Inputs as
# recipes/train_drafts_gpu.sh's (`prepare` on the CPU machine writes .gpu/):
#   (device tool) OUT=$OUT bash recipes/train_eagle3_gpu.sh      # carry: .gpu
# DEVICE=cpu with small S1 / S2 / S3 / BENCH_LIMIT rehearses the whole script.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CARRY=${CARRY:-.gpu}
OUT=$(mkdir -p "${OUT:-runs/gpu_out}" && cd "${OUT:-runs/gpu_out}" && pwd)
DEVICE=${DEVICE:-cuda}
W=${WORK:-runs/gpu}
S1=${S1:-270}; S2=${S2:-190}; S3=${S3:-125}
BATCH=${BATCH:-32}
THREADS=${THREADS:-0}
BENCH_S=${BENCH_S:-300}
BENCH_LIMIT=${BENCH_LIMIT:-164}
DATA=${DATA:-$W/regen/train.jsonl}
bs() { $PY -c 'import sys; from blockspec.cli import main; sys.exit(main())' "$@"; }
mkdir -p "$OUT" "$W/regen"
[ -s "$DATA" ] || zcat "$CARRY/regen2_train.jsonl.gz" > "$DATA"   # the CPU recipe's 4000 when no GPU regen ran
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$W/eagle3_phases.log"; }
pack() { (cd "$W" && tar -cf "$OUT/eagle3_logs.tar" --ignore-failed-read eagle3_phases.log ./eagle3*.log \
  ./eagle3*/log.jsonl ./eagle3*/train_config.json 2>/dev/null)
  [ -f "$W/$1/draft/config.json" ] && tar -cf "$OUT/$1.tar" -C "$W" "$1/draft" "$1/train_config.json"; }

TARGET=src/blockspec/assets/target
COMMON=(--method eagle3 --target "$TARGET" --data "$DATA" --num-layers 1 --target-layer-ids 1,3,5
        --ttt-steps 7 --draft-vocab-size 2048 --batch-size "$BATCH" --max-steps 100000 --eval-every 500
        --eval-examples 16 --eval-new-tokens 64 --device "$DEVICE" --threads "$THREADS")
PHASES=${*:-stage1 stage2 stage3 bench}
has() { [[ " $PHASES " == *" $1 "* ]]; }
# stage: name, seconds, lr, seed, [the run it continues]
stage() {
  stamp "$1: ${2}s at lr $3, seed $4${5:+, from $5}"
  bs train "${COMMON[@]}" --time-budget-s "$2" --lr "$3" --seed "$4" ${5:+--init-from "$W/$5/draft"} \
    --out "$W/$1" > "$W/$1.log" 2>&1
  stamp "$1 done"
  pack "$1"
}
has stage1 && stage eagle3a "$S1" 1e-3 0
has stage2 && stage eagle3b "$S2" 5e-4 1 eagle3a
has stage3 && stage eagle3c "$S3" 3e-4 2 eagle3b
if has bench; then
  A=src/blockspec/assets
  for t in 0 1; do
    stamp "bench T=$t: ar, eagle3, dflash, dspark"
    timeout "$BENCH_S" $PY -c 'import sys; from blockspec.cli import main; sys.exit(main())' bench \
      --datasets "$CARRY/humaneval.jsonl" --methods ar,eagle3,dflash,dspark --eagle3-draft "$W/eagle3c/draft" \
      --dflash-draft $A/dflash --dspark-draft $A/dspark --temperatures $t --max-new-tokens 128 \
      --limit "$BENCH_LIMIT" --device "$DEVICE" --out "$W/bench_eagle3_t$t" --no-progress > "$W/eagle3_bench_t$t.log" 2>&1
    [ -d "$W/bench_eagle3_t$t" ] && tar -cf "$OUT/bench_eagle3_t$t.tar" -C "$W" "bench_eagle3_t$t"
  done
fi
stamp "all done"
