"""Copy the best pretraining checkpoint into the package and write its RECIPE.md
from the run's own records (no hand-typed figures).

    python recipes/ship_target.py [--run runs/pretrain] [--corpus runs/corpus]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DEST = Path(__file__).resolve().parents[1] / "src" / "blockspec" / "assets" / "target"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/pretrain")
    ap.add_argument("--corpus", default="runs/corpus")
    args = ap.parse_args()
    best = Path(args.run) / "best"
    info = json.loads((best / "train_info.json").read_text())
    manifest = json.loads((Path(args.corpus) / "manifest.json").read_text())
    log = [json.loads(line) for line in open(Path(args.run) / "log.jsonl")]
    DEST.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(best / name, DEST / name)
    cfg = info["config"]
    vals = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    curve = "\n".join(f"| {s} | {v:.4f} |" for s, v in dict(vals).items())
    size_mb = (DEST / "model.safetensors").stat().st_size / 1e6
    text = f"""# Embedded target: recipe

A Qwen3-architecture Python code model trained by blockspec's own pretraining
recipe on 2 CPU cores. Hugging Face format (`Qwen3ForCausalLM`), bf16 weights
({size_mb:.1f} MB), byte-level BPE tokenizer with 8192 tokens and the special
tokens `<|endoftext|>` (EOS, id 0), `<|pad|>` (1), `<|mask|>` (2, the drafts'
`mask_token_id`), `<|im_start|>` (3), `<|im_end|>` (4).

## Result (written by recipes/ship_target.py from the run's records)

| what | value |
|---|---|
| parameters | {info['params']:,} (tied embeddings) |
| best validation loss (nats/token) | {info['val_loss']:.4f} |
| validation perplexity | {info['val_ppl']:.2f} |
| step of the best checkpoint | {info['step']} |
| tokens trained | {info['tokens']:,} |
| training time (s, wall, incl. evaluation) | {info['train_time_s']} |

Validation loss over the run:

| step | val loss |
|---|---|
{curve}

## Data

{manifest['source']}: {manifest['files']['train']} training files ({manifest['bytes']['train']:,} bytes) and
{manifest['files']['val']} validation files ({manifest['bytes']['val']:,} bytes), split by a hash of the
file path ({manifest['val_percent']}% validation), files over {manifest['max_file_bytes']:,} bytes or not
UTF-8 skipped. Corpus sha256: `{manifest['sha256']}` (the file list is in the run's
`runs/corpus/manifest.json`).

## Commands

```bash
bash recipes/pretrain_target.sh        # corpus -> tokenizer -> pretrain (resumable)
python recipes/ship_target.py          # copies runs/pretrain/best here and writes this file
```

Pretraining config of the shipped run (seed {cfg['seed']}):

```json
{json.dumps(cfg, indent=2)}
```

The run was started with `--max-steps 800 --eval-every 50`, restarted from its
own state at step 100 with `--max-steps 1300 --eval-every 100`, and at step 200
with `--max-steps 1100`, to fit the session's time (the cosine schedule was still
at its peak at both restarts). After finishing 1100 steps it was resumed from its
own state (weights + optimizer) with `--max-steps 1400` (the command in
`recipes/pretrain_target.sh`): the schedule is a function of (step, max_steps), so
the learning rate went from its 1100-step floor (1.5e-4) back to 3.0e-4 and decayed
again to 1.5e-4 over the last 300 steps.
Batches are drawn from the token stream with a generator seeded by
(seed, step), so a resumed run sees the same data as an uninterrupted one.

To continue training from the shipped weights (weights only, fresh optimizer):
`blockspec pretrain --init-from src/blockspec/assets/target --out runs/pretrain-more ...`.
On a CUDA GPU the same command trains there (add `--bf16`, larger sizes).
"""
    (DEST / "RECIPE.md").write_text(text)
    print(f"shipped {info['val_loss']:.4f} val loss, {size_mb:.1f} MB -> {DEST}")


if __name__ == "__main__":
    main()
