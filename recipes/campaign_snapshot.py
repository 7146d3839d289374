"""Write the campaign's committable checkpoint: runs/campaign/state -> recipes/campaign/state
(bf16 weights + meta.json: step, tokens, schedule, corpus hash, validation history; no optimizer)
and print the validation curve recorded so far.

    python recipes/campaign_snapshot.py [--run runs/campaign] [--dest recipes/campaign/state]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from blockspec.training.pretrain import snapshot_state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/campaign")
    ap.add_argument("--dest", default="recipes/campaign/state")
    args = ap.parse_args()
    dest = Path(args.dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    meta = snapshot_state(Path(args.run) / "state", tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"snapshot of step {meta['step']} ({meta['tokens']:,} tokens, {meta['elapsed'] / 3600:.2f} h of "
          f"training in all) -> {dest}\n")
    print("| step | tokens | val_loss (held-out packages + stdlib) | val_stdlib_loss (the first target's 2.64) |")
    print("|---|---|---|---|")
    per_step = meta["config"]["batch_size"] * meta["config"]["seq_len"] * meta["config"]["grad_accum"]
    for step, *losses in meta["history"]:
        print(f"| {step} | {step * per_step:,} | " + " | ".join(f"{x:.4f}" for x in losses) + " |")
    print("\nevents:")
    for event in meta["events"]:
        extra = {k: v for k, v in event.items() if k not in ("step", "event", "withdrawn_history")}
        print(f"- step {event['step']}: {event['event']}" + (f" {extra}" if extra else ""))


if __name__ == "__main__":
    main()
