#!/usr/bin/env bash
# A WSD decay branch of issue 35's campaign: the main run's latest state (weights, optimizer
# moments, step S) continues in its own directory with the learning rate decaying linearly to
# the floor over DECAY steps (max_steps S + DECAY), while the main run keeps its constant phase.
# What it gives: the validation loss the target would have if the campaign ended now, and an
# exportable target (runs/decay/best, bf16 + tokenizer) to evaluate or ship.
#
#   [OUT=runs/decay] [FORCE=1] bash recipes/campaign_decay.sh [DECAY=150] [extra pretrain flags]   # e.g. --precision bfloat16 --compile
#
# Run it with the main run paused (kill -STOP its pid; -CONT after) or stopped: both at full
# speed on 2 cores would halve each. The branch reads the main run's tokenized corpus (symlinks)
# and never writes to runs/campaign. Measured (docs/results.md, "a WSD decay branch from the
# campaign's step 1500"): 150 decay steps took validation loss from 2.844 to 2.659.
set -euo pipefail
cd "$(dirname "$0")/.."
BS=${BS:-.venv/bin/blockspec}
MAIN=${MAIN:-runs/campaign}
OUT=${OUT:-runs/decay}
DECAY=${1:-150}; shift || true
[[ "$DECAY" =~ ^[1-9][0-9]*$ ]] || { echo "error: DECAY must be a positive step count, got '$DECAY'" >&2; exit 2; }
# the branch's output is often the target being evaluated or shipped: never replace it silently
[ ! -e "$OUT" ] || [ "${FORCE:-0}" = 1 ] || { echo "error: $OUT exists (set OUT=another directory, or FORCE=1 to replace it)" >&2; exit 2; }
[ -f "$MAIN/state/meta.json" ] || { echo "error: no campaign state under $MAIN/state (run recipes/pretrain_campaign.sh)" >&2; exit 2; }
START=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["step"])' "$MAIN/state/meta.json")
rm -rf "$OUT" && mkdir -p "$OUT"
cp -r "$MAIN/state" "$OUT/state"
for f in "$MAIN"/*_tokens.safetensors; do ln -s "$(realpath "$f")" "$OUT/$(basename "$f")"; done
echo "decay branch: steps $START-$((START + DECAY)) from $MAIN/state -> $OUT" >&2
exec $BS pretrain --config recipes/campaign/pretrain.json --out "$OUT" --max-steps $((START + DECAY)) \
  --decay-steps "$DECAY" "$@"
