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
    print(f"snapshot of step {meta['step']} ({meta['tokens']:,} tokens) -> {dest}")
    for row in meta["history"]:
        print("step", *row)


if __name__ == "__main__":
    main()
