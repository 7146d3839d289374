"""Copy trained drafts into the package and write each RECIPE.md from the run's own
records (train_config.json, log.jsonl): no hand-typed figures.

    python recipes/ship_drafts.py [--runs runs] [--suffix 3] [--data runs/regen2/train.jsonl]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "blockspec" / "assets"


def ship(run: Path, name: str, data: Path, history: str = "", suffix: str = "3") -> None:
    cfg = json.loads((run / "train_config.json").read_text())
    log = [json.loads(line) for line in open(run / "log.jsonl")]
    evals = [(r["step"], r["eval"]["tau"]) for r in log if "eval" in r]
    dest = ASSETS / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run / "draft", dest)
    draft_cfg = json.loads((dest / "config.json").read_text())
    size_mb = sum(f.stat().st_size for f in dest.glob("*.safetensors")) / 1e6
    n_examples = sum(1 for _ in open(data))
    last = log[-1]
    layout = "z-lab DFlash (`DFlashDraftModel`)" if name == "dflash" else "DeepSpec DSpark (`Qwen3DSparkModel`)"
    curve = "\n".join(f"| {s} | {t:.3f} |" for s, t in evals)
    text = f"""# Embedded {name} draft: recipe

{layout} layout, trained by `blockspec train` for the embedded target
(`../target`). block_size {draft_cfg['block_size']}, {draft_cfg['num_hidden_layers']} layer(s),
target_layer_ids {draft_cfg.get('dflash_config', draft_cfg).get('target_layer_ids')}, {size_mb:.1f} MB of bf16 weights.

## Training record (from the run's log)

| what | value |
|---|---|
| steps | {last['step']} |
| wall time (s) | {last['time_s']} |
| final loss | {last['loss']} |
| training examples (target-regenerated) | {n_examples} |

Held-out greedy tau during training (16 held-out prompts, 64 new tokens, tau includes the bonus token):

| step | tau |
|---|---|
{curve}

## Commands

```bash
bash recipes/train_drafts.sh     # regenerate data with the target, then train both drafts
python recipes/ship_drafts.py    # copies runs/{{dflash,dspark}}{suffix}/draft here and writes this file
```

{history}

Exact training config (seed {cfg['seed']}; `max_steps` as of the last (re)start):

```json
{json.dumps(cfg, indent=2)}
```

Data: `blockspec regenerate --prompts runs/corpus ...` (see recipes/train_drafts.sh): random
code prefixes from the corpus' training split, continued greedily by the target
(160 new tokens each); the first {cfg['eval_examples']} examples are held out for the tau above.
Warm start (`init_from_target`): draft layer i starts as a copy of target layer
L-n+i (the last n layers), `fc` passes the deepest captured feature through.
"""
    (dest / "RECIPE.md").write_text(text)
    print(f"shipped {name}: {size_mb:.1f} MB, last tau {evals[-1][1] if evals else 'n/a'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--suffix", default="3", help="run directories are RUNS/{dflash,dspark}SUFFIX")
    ap.add_argument("--data", default="runs/regen2/train.jsonl")
    ap.add_argument("--history", default="", help="how the run was started / resumed (written into RECIPE.md)")
    args = ap.parse_args()
    for name in ("dflash", "dspark"):
        ship(Path(args.runs) / f"{name}{args.suffix}", name, Path(args.data), args.history, args.suffix)


if __name__ == "__main__":
    main()
