#!/usr/bin/env bash
# Reproduces the CPU-trained drafts of the embedded target on target-regenerated data:
#   dflash  DFlash (z-lab, block 16), 2 layers   -> runs/dflash3  (shipped at c0689ef)
#   dspark  DSpark (DeepSpec, gamma 15: the same 16-token verify window), 2 layers -> runs/dspark3
#           (both warm-started from the target's last two layers (--init-from-target; the
#           deepest captured feature, layer 5, is what the copied layer 6 reads in the target))
#   eagle3  EAGLE-3, 1 layer, 7-step training-time test, draft vocabulary 2048 (as
#           recipes/train_eagle3_gpu.sh), random init, EAGLE3_S seconds -> runs/eagle3
#   eagle3b its second stage: EAGLE3B_S more seconds from EAGLE3_INIT (default runs/eagle3/draft;
#           the shipped draft continued src/blockspec/assets/eagle3, the shipped copy of it), lr 5e-4,
#           seed 1 -> runs/eagle3b (shipped; EAGLE3B_S = the DFlash draft's 5652 s less stage 1's 1944 s)
# Usage: bash recipes/train_drafts.sh [dflash] [dspark] [eagle3] [eagle3b]   (default: dflash dspark)
# The named drafts train side by side with one thread each, on the same data and
# evaluation. Resumable: rerun after an interruption.
# Another target (issue 35's campaign, e.g. a decay branch's runs/decay/best): TARGET=DIR, its
# captured layers IDS (three, evenly spaced from 1 to L-3 for L layers: 1,5,9 for 12), TEMPS
# (regeneration temperatures, each with its own seed, interleaved into DATA; issue 35 asks
# for "0 0.7 1.0"), RUNS (where the drafts and data go) and the step / second budgets:
#   TARGET=runs/decay/best IDS=1,5,9 TEMPS="0 0.7 1.0" RUNS=runs/pair35 bash recipes/train_drafts.sh dflash dspark
# DFLASH_INIT / DSPARK_INIT: continue that saved draft (e.g. the last candidate's, for a target
# continued from the one it was trained for) instead of the warm start from the target's layers.
# TRAIN_FLAGS go to every run, e.g. "--bf16 --time-budget-s 3600" (bf16 autocast where the CPU
# has bf16 matrix instructions; the step counts fitted to an hour after timing the first steps).
# runs/corpus is the stdlib corpus the target was pretrained on (sha256 08fdebec..., in
# ../src/blockspec/assets/target/RECIPE.md): `blockspec corpus` as of that commit (tests
# included; today's `blockspec corpus --no-packages` also drops tests and duplicates, so its
# prefixes differ). Rebuilt from that commit's code (same sha256 under CPython 3.11.7):
#   git worktree add /tmp/c083a4b c083a4b && PYTHONPATH=/tmp/c083a4b/src python -c \
#     'from pathlib import Path; from blockspec.training.corpus import build_corpus; print(build_corpus(Path("runs/corpus"))["sha256"])'
set -euo pipefail
TARGET=${TARGET:-src/blockspec/assets/target}
IDS=${IDS:-1,3,5}
TEMPS=${TEMPS:-0}
RUNS=${RUNS:-runs}
CORPUS=${CORPUS:-runs/corpus}
DFLASH_STEPS=${DFLASH_STEPS:-1900}
DSPARK_STEPS=${DSPARK_STEPS:-1500}
EAGLE3_S=${EAGLE3_S:-2640}
EAGLE3B_S=${EAGLE3B_S:-3700}
EAGLE3_INIT=${EAGLE3_INIT:-$RUNS/eagle3/draft}
PROMPTS=${PROMPTS:-4000}
DATA=${DATA:-$RUNS/regen2/train.jsonl}
for method in ${*:-dflash dspark}; do   # before the (long) regeneration, not after it
  case $method in dflash|dspark|eagle3|eagle3b) ;; *) echo "error: unknown draft $method (dflash, dspark, eagle3, eagle3b)" >&2; exit 2 ;; esac
done
mkdir -p "$(dirname "$DATA")"
if [ "$TEMPS" = 0 ]; then   # greedy regenerations only: the shipped drafts' data
  [ -f "$DATA" ] && [ "$(wc -l < "$DATA")" -ge "$PROMPTS" ] || \
  blockspec regenerate --prompts "$CORPUS" --target "$TARGET" --out "$DATA" \
    --num-prompts "$PROMPTS" --max-new-tokens 160 --batch-size 32 --seed 0
elif [ ! -s "$DATA" ]; then   # one file per temperature (seed i: other corpus windows), interleaved
  i=0; parts=()
  for T in $TEMPS; do
    part="${DATA%.jsonl}_t$T.jsonl"
    [ -f "$part" ] && [ "$(wc -l < "$part")" -ge "$PROMPTS" ] || \
    blockspec regenerate --prompts "$CORPUS" --target "$TARGET" --out "$part" --num-prompts "$PROMPTS" \
      --max-new-tokens 160 --batch-size 32 --temperature "$T" --seed $i
    parts+=("$part"); i=$((i + 1))
  done
  paste -d '\n' "${parts[@]}" | grep -v '^$' > "$DATA.tmp" && mv "$DATA.tmp" "$DATA"
fi
COMMON="--target $TARGET --data $DATA --target-layer-ids $IDS --batch-size 4 --lr 1e-3 \
  --eval-examples 16 --eval-new-tokens 64 --seed 0 --threads 1 --resume"   # --resume: a re-run continues a killed one
BLOCK="--num-layers 2 --num-anchors 48 --eval-every 250"
EAGLE3="--method eagle3 --num-layers 1 --ttt-steps 7 --draft-vocab-size 2048 --device cpu --max-steps 100000"
start_of() {   # a draft's initial weights: a saved draft to continue, else the target's last layers
  if [ -n "$1" ]; then echo "--init-from $1"; else echo "--init-from-target"; fi
}
mkdir -p "$RUNS"
pids=(); runs=()
train() {   # run name, then its own flags
  local run=$1; shift
  # The run's own flags after COMMON's (the last of a repeated flag wins), TRAIN_FLAGS last of all.
  OMP_NUM_THREADS=1 blockspec train $COMMON "$@" --out "$RUNS/$run" ${TRAIN_FLAGS:-} > "$RUNS/$run.log" 2>&1 &
  pids+=($!); runs+=("$run")
}
for method in ${*:-dflash dspark}; do
  case $method in
    dflash) train dflash3 --method dflash --block-size 16 --max-steps $DFLASH_STEPS $BLOCK $(start_of "${DFLASH_INIT:-}") ;;
    dspark) train dspark3 --method dspark --block-size 15 --max-steps $DSPARK_STEPS --markov-rank 64 \
              --markov-head-type vanilla $BLOCK $(start_of "${DSPARK_INIT:-}") ;;
    eagle3) train eagle3 $EAGLE3 --time-budget-s $EAGLE3_S --eval-every 75 ;;
    eagle3b) train eagle3b $EAGLE3 --init-from "$EAGLE3_INIT" --lr 5e-4 --seed 1 --time-budget-s $EAGLE3B_S \
              --eval-every 100 ;;
  esac
done
failed=0   # wait for each run by pid: a bare `wait` would report success whatever they returned
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "error: draft run ${runs[$i]} failed; see $RUNS/${runs[$i]}.log" >&2; failed=1; }
done
exit $failed
