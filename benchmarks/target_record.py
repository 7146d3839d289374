"""Print the embedded target's training record (validation loss / perplexity, tokens,
wall time) from the pretraining run's own train_info.json, as a Markdown table.

    python benchmarks/target_record.py [--run runs/pretrain]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/pretrain")
    info = json.loads((Path(ap.parse_args().run) / "best" / "train_info.json").read_text())
    print("| validation loss (nats/token) | validation perplexity | tokens trained | training wall time (s) "
          "| steps | parameters |")
    print("|---|---|---|---|---|---|")
    print(f"| {info['val_loss']:.4f} | {info['val_ppl']:.2f} | {info['tokens']:,} | {info['train_time_s']} "
          f"| {info['step']} | {info['params']:,} |")


if __name__ == "__main__":
    main()
