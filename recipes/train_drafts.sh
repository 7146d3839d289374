#!/usr/bin/env bash
# CPU drafts for a target on its own regenerations (by default the embedded target, on its
# corpus' prefixes at temperatures 0, 0.7 and 1.0, as the shipped drafts' first stage was made):
#   dflash  DFlash (z-lab, block 16), 2 layers   -> $RUNS/dflash3
#   dspark  DSpark (DeepSpec, gamma 15: the same 16-token verify window), 2 layers -> $RUNS/dspark3
#           (both warm-started from the target's last two layers (--init-from-target), or
#           continuing DFLASH_INIT / DSPARK_INIT)
#   eagle3  EAGLE-3, 1 layer, 7-step training-time test, draft vocabulary 2048 (as
#           recipes/train_eagle3_gpu.sh), random init, EAGLE3_S seconds -> $RUNS/eagle3
#   eagle3b its second stage: EAGLE3B_S more seconds from EAGLE3_INIT (default $RUNS/eagle3/draft),
#           lr 5e-4, seed 1 -> $RUNS/eagle3b
# Usage: bash recipes/train_drafts.sh [dflash] [dspark] [eagle3] [eagle3b]   (default: dflash dspark)
# The named drafts train side by side with one thread each, on the same data and
# evaluation. Resumable: rerun after an interruption. The shipped drafts' later stages (each
# continuing the last, with the exact flags) are in recipes/campaign/pair36/README.md.
# Another target: TARGET=DIR, its captured layers IDS (three, evenly spaced from 1 to L-3 for
# L layers: 1,5,9 for 12), TEMPS (regeneration temperatures, each with its own seed,
# interleaved into DATA; "0" alone: greedy data, one file), CORPUS (the prefixes' source),
# RUNS (where the drafts and data go) and the step / second budgets, e.g.
#   TARGET=runs/decay/best RUNS=runs/pair37 bash recipes/train_drafts.sh dflash dspark
# DFLASH_INIT / DSPARK_INIT: continue that saved draft (e.g. the last candidate's, for a target
# continued from the one it was trained for) instead of the warm start from the target's layers.
# TRAIN_FLAGS go to every run, e.g. "--bf16 --time-budget-s 3600" (bf16 autocast where the CPU
# has bf16 matrix instructions; the step counts fitted to an hour after timing the first steps).
# runs/corpus2 is the embedded target's pretraining corpus (`blockspec corpus --out runs/corpus2
# --tokenizer-out ""`, sha256 in ../src/blockspec/assets/target/RECIPE.md). The first embedded
# pair's drafts (greedy data from the stdlib corpus, captured layers 1,3,5) are this script's
# defaults at c0689ef.
set -euo pipefail
TARGET=${TARGET:-src/blockspec/assets/target}
IDS=${IDS:-1,5,9}
TEMPS=${TEMPS:-"0 0.7 1.0"}
RUNS=${RUNS:-runs}
CORPUS=${CORPUS:-runs/corpus2}
DFLASH_STEPS=${DFLASH_STEPS:-1900}
DSPARK_STEPS=${DSPARK_STEPS:-1500}
EAGLE3_S=${EAGLE3_S:-2640}
EAGLE3B_S=${EAGLE3B_S:-3700}
EAGLE3_INIT=${EAGLE3_INIT:-$RUNS/eagle3/draft}
PROMPTS=${PROMPTS:-3000}
DATA=${DATA:-$RUNS/regen2/train.jsonl}
for method in ${*:-dflash dspark}; do   # before the (long) regeneration, not after it
  case $method in dflash|dspark|eagle3|eagle3b) ;; *) echo "error: unknown draft $method (dflash, dspark, eagle3, eagle3b)" >&2; exit 2 ;; esac
done
mkdir -p "$(dirname "$DATA")"
if [ "$TEMPS" = 0 ]; then   # greedy regenerations only
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
