"""Summary of a built corpus (`blockspec corpus`): totals, files dropped by reason, and per
package its version, licence, split and kept files / bytes; with `--tokens RUN` also the token
counts of the run's tokenized splits (pretraining caches them next to its state).

    python benchmarks/corpus_summary.py [--corpus runs/corpus2] [--tokens runs/campaign] [--top 25]
        [--first-target-tokenizer src/blockspec/assets/target]   # + the first target's corpus, tokenized
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors import safe_open

from blockspec.bench.metrics import markdown_table
from blockspec.training.corpus import MAX_FILE_BYTES, is_validation, stdlib_files


def first_target_tokens(tokenizer_dir: Path) -> int:
    """Tokens of the first embedded target's training split: every stdlib file (tests included)
    outside the 2% validation hash, up to MAX_FILE_BYTES, UTF-8, one EOS each."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    root, files = stdlib_files()
    texts = []
    for path in files:
        raw = path.read_bytes()
        if is_validation(path.relative_to(root).as_posix(), 2) or len(raw) > MAX_FILE_BYTES:
            continue
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return sum(len(e.ids) + 1 for e in tok.encode_batch(texts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="runs/corpus2")
    ap.add_argument("--tokens", default=None, help="a pretraining run directory with *_tokens.safetensors")
    ap.add_argument("--top", type=int, default=25, help="packages listed by kept bytes (the rest summed)")
    ap.add_argument("--first-target-tokenizer", default=None,
                    help="tokenize the first target's corpus with this tokenizer and print the ratio")
    args = ap.parse_args()
    m = json.loads((Path(args.corpus) / "manifest.json").read_text())
    print(f"source: {m['source']}; sha256 {m['sha256'][:16]}...\n")
    print(f"kept: train {m['files']['train']:,} files / {m['bytes']['train']:,} bytes, "
          f"validation {m['files']['val']:,} files / {m['bytes']['val']:,} bytes")
    print("dropped: " + ", ".join(f"{k} {v:,}" for k, v in sorted(m["dropped"].items(), key=lambda kv: -kv[1])))
    if args.tokens:
        for path in sorted(Path(args.tokens).glob("*_tokens.safetensors")):
            with safe_open(str(path), "pt") as f:
                n = f.get_slice("tokens").get_shape()[0]
            print(f"tokens ({path.name.removesuffix('_tokens.safetensors')}): {n:,}")
            if path.name == "train_tokens.safetensors" and args.first_target_tokenizer:
                old = first_target_tokens(Path(args.first_target_tokenizer))
                print(f"tokens (the first target's training split, same tokenizer): {old:,}; ratio {n / old:.2f}x")
    packages = sorted(m["packages"], key=lambda p: -p["kept_bytes"])
    rows = [{"package": p["name"], "version": p["version"], "license": p["license"][:40], "split": p["split"],
             "files": p["kept_files"], "MB": p["kept_bytes"] / 1e6,
             "dropped": ", ".join(f"{k} {v}" for k, v in sorted(p["dropped"].items()))} for p in packages[:args.top]]
    rest = packages[args.top:]
    if rest:
        rows.append({"package": f"({len(rest)} more)", "version": "", "license": "", "split": "",
                     "files": sum(p["kept_files"] for p in rest), "MB": sum(p["kept_bytes"] for p in rest) / 1e6,
                     "dropped": ""})
    held = [p["name"] for p in m["packages"] if p["split"] == "val"]
    print(f"\npackages held out whole for validation: {', '.join(held)}\n")
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
