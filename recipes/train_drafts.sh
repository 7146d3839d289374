#!/usr/bin/env bash
# Reproduces the embedded drafts: target-regenerated data -> DFlash (z-lab, block 16)
# and DSpark (DeepSpec, gamma 15: the same 16-token verify window) drafts, trained
# side by side with one thread each. Resumable: rerun after an interruption.
set -euo pipefail
TARGET=src/blockspec/assets/target
STEPS=${STEPS:-400}
blockspec regenerate --prompts runs/corpus --target $TARGET --out runs/regen/train.jsonl \
  --num-prompts ${PROMPTS:-1600} --max-new-tokens 160 --batch-size 32 --seed 0
COMMON="--target $TARGET --data runs/regen/train.jsonl --num-layers 1 --target-layer-ids 1,4,6 \
  --num-anchors 48 --batch-size 4 --max-steps $STEPS --lr 1e-3 --eval-every 100 --eval-examples 16 \
  --eval-new-tokens 64 --seed 0 --threads 1"
OMP_NUM_THREADS=1 blockspec train --method dflash --block-size 16 --out runs/dflash $COMMON > runs/dflash.log 2>&1 &
OMP_NUM_THREADS=1 blockspec train --method dspark --block-size 15 --markov-rank 64 --markov-head-type vanilla \
  --out runs/dspark $COMMON > runs/dspark.log 2>&1 &
wait
