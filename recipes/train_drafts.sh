#!/usr/bin/env bash
# Reproduces the embedded drafts: target-regenerated data -> DFlash (z-lab, block 16)
# and DSpark (DeepSpec, gamma 15: the same 16-token verify window) drafts, 2 layers,
# trained side by side with one thread each, both warm-started from the target's last
# two layers (--init-from-target; the deepest captured feature, layer 5, is what the
# copied layer 6 reads in the target). Resumable: rerun after an interruption.
set -euo pipefail
TARGET=src/blockspec/assets/target
DFLASH_STEPS=${DFLASH_STEPS:-1900}
DSPARK_STEPS=${DSPARK_STEPS:-1500}
DATA=${DATA:-runs/regen2/train.jsonl}
[ -f "$DATA" ] && [ "$(wc -l < "$DATA")" -ge "${PROMPTS:-4000}" ] || \
blockspec regenerate --prompts runs/corpus --target $TARGET --out "$DATA" \
  --num-prompts ${PROMPTS:-4000} --max-new-tokens 160 --batch-size 32 --seed 0
COMMON="--target $TARGET --data $DATA --num-layers 2 --target-layer-ids 1,3,5 --init-from-target \
  --num-anchors 48 --batch-size 4 --lr 1e-3 --eval-every 250 --eval-examples 16 \
  --eval-new-tokens 64 --seed 0 --threads 1 --resume"   # --resume: a re-run continues a killed one
OMP_NUM_THREADS=1 blockspec train --method dflash --block-size 16 --max-steps $DFLASH_STEPS --out runs/dflash3 $COMMON > runs/dflash3.log 2>&1 &
OMP_NUM_THREADS=1 blockspec train --method dspark --block-size 15 --max-steps $DSPARK_STEPS --markov-rank 64 --markov-head-type vanilla \
  --out runs/dspark3 $COMMON > runs/dspark3.log 2>&1 &
wait
