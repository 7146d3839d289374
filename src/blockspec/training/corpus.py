"""The offline Python code corpus and its BPE tokenizer.

The corpus is the standard library of the running interpreter (tests included):
always available offline, no third-party code that evaluation uses. Files are
listed in sorted order, split train / validation by a hash of their path, and
recorded with a content hash so a run can be reproduced or checked.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from blockspec.errors import BlockspecError

EOS, PAD, MASK, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|mask|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, PAD, MASK, IM_START, IM_END]
MAX_FILE_BYTES = 400_000  # a few generated data tables dwarf everything else
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_files(root: Path | None = None) -> tuple[Path, list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file())
    return root, files


def is_validation(relpath: str, val_percent: int) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100 < val_percent


def build_corpus(out_dir: Path, root: Path | None = None, val_percent: int = 2) -> dict:
    """Write train.jsonl / val.jsonl ({"path", "text"} per file) and manifest.json."""
    root, files = stdlib_files(root)
    if not files:
        raise BlockspecError(f"no Python files found under {root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    counts = {"train": 0, "val": 0}
    sizes = {"train": 0, "val": 0}
    listing = []
    with open(out_dir / "train.jsonl", "w") as train, open(out_dir / "val.jsonl", "w") as val:
        for path in files:
            raw = path.read_bytes()
            if len(raw) > MAX_FILE_BYTES:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a handful of test files are deliberately mis-encoded
            rel = path.relative_to(root).as_posix()
            split = "val" if is_validation(rel, val_percent) else "train"
            (val if split == "val" else train).write(json.dumps({"path": rel, "text": text}) + "\n")
            digest.update(rel.encode() + b"\0" + raw)
            counts[split] += 1
            sizes[split] += len(raw)
            listing.append([rel, split])
    manifest = {
        "source": f"CPython {sys.version.split()[0]} standard library ({root})",
        "sha256": digest.hexdigest(), "files": counts, "bytes": sizes, "val_percent": val_percent,
        "max_file_bytes": MAX_FILE_BYTES, "file_list": listing,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def iter_texts(jsonl: Path):
    with open(jsonl) as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int = 8192) -> None:
    """Byte-level BPE on the training split; writes tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: only `corpus` trains one

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(iter_texts(corpus_dir / "train.jsonl"), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
        "mask_token": MASK, "bos_token": None, "unk_token": None, "add_bos_token": False,
        "model_max_length": 1024, "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
