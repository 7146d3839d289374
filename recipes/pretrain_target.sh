#!/usr/bin/env bash
# Reproduces the embedded target: corpus -> tokenizer -> pretraining -> export.
# Resumable: rerun the same command after an interruption (state in runs/pretrain/state).
set -euo pipefail
blockspec corpus --out runs/corpus --tokenizer-out runs/tokenizer --vocab-size 8192
blockspec pretrain --out runs/pretrain --seed 1234 --hidden-size 256 --num-layers 8 --num-heads 4 \
  --num-kv-heads 2 --head-dim 64 --intermediate-size 768 --seq-len 768 --batch-size 8 \
  --lr 1.5e-3 --warmup-steps 50 --max-steps 1100 --eval-every 100 "$@"
# Second phase of the shipped run: the same run resumed to 1400 steps (see RECIPE.md).
blockspec pretrain --out runs/pretrain --seed 1234 --hidden-size 256 --num-layers 8 --num-heads 4 \
  --num-kv-heads 2 --head-dim 64 --intermediate-size 768 --seq-len 768 --batch-size 8 \
  --lr 1.5e-3 --warmup-steps 50 --max-steps 1400 --eval-every 100 "$@"
