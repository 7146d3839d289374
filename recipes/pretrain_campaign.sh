#!/usr/bin/env bash
# Issue 35's target pretraining campaign, run after run on whatever machine a working period gets.
#
#   nohup nice bash recipes/pretrain_campaign.sh --stop-after-s 7200 > runs/campaign.log 2>&1 &
#   ... (a SIGTERM or the time limit ends it with its state saved) ...
#   python recipes/campaign_snapshot.py      # before the period ends: bf16 snapshot -> recipes/campaign/state
#
# Phases: corpus (stdlib + installed distributions, the shipped tokenizer) -> pretrain. The run
# continues from runs/campaign/state when this machine has it (weights, optimizer moments),
# else from the committed snapshot recipes/campaign/state (bf16 weights, step, schedule; the
# optimizer restarts from zero and the lr re-warms). The data position is the step, so the
# data order continues where the last run stopped. The configuration is recipes/campaign/pretrain.json;
# extra flags override it (e.g. --max-steps when the campaign is extended: the WSD schedule's
# constant phase makes that harmless until the decay starts).
set -euo pipefail
cd "$(dirname "$0")/.."
BS=${BS:-.venv/bin/blockspec}
[ -f runs/corpus2/manifest.json ] || $BS corpus --out runs/corpus2 --tokenizer-out "" > runs/corpus2.json
RESUME=()
[ -f recipes/campaign/state/meta.json ] && RESUME=(--resume-from recipes/campaign/state)
exec $BS pretrain --config recipes/campaign/pretrain.json "${RESUME[@]}" "$@"
