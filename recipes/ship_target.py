"""Copy a pretraining run's best checkpoint into the package and write its RECIPE.md from the
run's own records (no hand-typed figures).

    python recipes/ship_target.py --run runs/decay2910 --corpus runs/corpus2 \
        --earlier recipes/campaign/state/meta.json runs/campaign/log.jsonl --history "..."

`--earlier` adds validation points from before the run (a campaign state's `meta.json` history,
or the log.jsonl of the run it branched from) to the loss curve; `--history` is a paragraph on
how the run was made (which runs, which machines), written into the recipe as given.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DEST = Path(__file__).resolve().parents[1] / "src" / "blockspec" / "assets" / "target"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def validation_points(path: Path) -> dict[int, float]:
    """step -> validation loss, from a pretraining log.jsonl or a campaign state's meta.json."""
    if path.name == "meta.json":
        return {int(row[0]): float(row[1]) for row in json.loads(path.read_text())["history"]}
    rows = [json.loads(line) for line in path.open()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def data_text(manifest: dict) -> str:
    """The corpus paragraph, from its manifest."""
    text = (f"{manifest['source']}: {manifest['files']['train']:,} training files ({manifest['bytes']['train']:,} "
            f"bytes) and {manifest['files']['val']:,} validation files ({manifest['bytes']['val']:,} bytes); files "
            f"over {manifest['max_file_bytes']:,} bytes or not UTF-8 skipped. Corpus sha256: `{manifest['sha256']}`.")
    if "packages" in manifest:
        dropped = ", ".join(f"{n:,} {why.replace('_', ' ')}" for why, n in manifest["dropped"].items())
        licences = sorted({p["license"] for p in manifest["packages"]})
        text += (f"\nValidation: {manifest['val_package_percent']}% of the packages whole, and "
                 f"{manifest['val_percent']}% of the standard library's files by a hash of the path. Files dropped: "
                 f"{dropped} (near duplicates at Jaccard {manifest['near_duplicate_jaccard']}). "
                 f"{len(manifest['packages'])} sources, licences: {', '.join(licences)} (each package's in the "
                 "corpus manifest).")
    return text


def recipe_text(info: dict, manifest: dict, curve: dict[int, float], size_mb: float, history: str) -> str:
    cfg = info["config"]
    stdlib = f"\n| standard-library validation loss | {info['val_stdlib_loss']:.4f} |" if "val_stdlib_loss" in info else ""
    rows = "\n".join(f"| {step} | {loss:.4f} |" for step, loss in sorted(curve.items()))
    return f"""# Embedded target: recipe

A Qwen3-architecture Python code model trained by blockspec's own pretraining recipe
(`blockspec pretrain`) on CPUs. Hugging Face format (`Qwen3ForCausalLM`), {cfg['num_layers']} layers x
{cfg['hidden_size']} hidden, bf16 weights ({size_mb:.1f} MB), byte-level BPE tokenizer with 8192 tokens and
the special tokens `<|endoftext|>` (EOS, id 0), `<|pad|>` (1), `<|mask|>` (2, the drafts'
`mask_token_id`), `<|im_start|>` (3), `<|im_end|>` (4).

## Result (written by recipes/ship_target.py from the run's records)

| what | value |
|---|---|
| parameters | {info['params']:,} (tied embeddings) |
| validation loss of the shipped checkpoint (nats/token) | {info['val_loss']:.4f} |{stdlib}
| validation perplexity | {info['val_ppl']:.2f} |
| step of the shipped checkpoint | {info['step']} |
| tokens trained | {info['tokens']:,} |
| training time (s, wall, incl. evaluation, all runs) | {info['train_time_s']} |

Validation loss over the training:

| step | val loss |
|---|---|
{rows}

## Data

{data_text(manifest)}

## How it was made

{history or "One `blockspec pretrain` run with the config below."}

Config of the run that wrote the shipped checkpoint (seed {cfg['seed']}):

```json
{json.dumps(cfg, indent=2)}
```

Batches are drawn from the token stream by (seed, step), so a resumed run sees the same data as
an uninterrupted one. To continue training from the shipped weights (weights only, fresh
optimizer): `blockspec pretrain --init-from src/blockspec/assets/target --out runs/pretrain-more ...`.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True, help="pretraining run directory (best/, log.jsonl)")
    ap.add_argument("--corpus", type=Path, required=True, help="the corpus directory (manifest.json)")
    ap.add_argument("--earlier", type=Path, nargs="*", default=[],
                    help="validation points from before the run: a campaign meta.json or an earlier log.jsonl")
    ap.add_argument("--history", default="", help="a paragraph on how the run was made")
    args = ap.parse_args()
    best = args.run / "best"
    info = json.loads((best / "train_info.json").read_text())
    manifest = json.loads((args.corpus / "manifest.json").read_text())
    curve: dict[int, float] = {}
    for source in [*args.earlier, args.run / "log.jsonl"]:
        curve.update(validation_points(source))
    DEST.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(best / name, DEST / name)
    size_mb = (DEST / "model.safetensors").stat().st_size / 1e6
    (DEST / "RECIPE.md").write_text(recipe_text(info, manifest, curve, size_mb, args.history))
    print(f"shipped {info['val_loss']:.4f} val loss, {size_mb:.1f} MB -> {DEST}")


if __name__ == "__main__":
    main()
