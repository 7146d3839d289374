"""Training data: corpus prompts are reproducible, and a larger draw extends a smaller one
(so a regeneration run can resume a smaller run's file with the same seed)."""

from __future__ import annotations

import json
import random

import pytest

from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.data import load_prompts
from conftest import write_tiny_target_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_tiny_target_dir(root / "target")
    rng = random.Random(3)
    with open(root / "train.jsonl", "w") as f:
        for n in range(12):   # files of 60-200 words; some too short to give a prompt
            words = [f"w{rng.randrange(60)}" for _ in range(rng.choice([40, 60, 120, 200]))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return root


def test_corpus_prompts_are_reproducible_and_extend(corpus):
    tok = Tokenizer(corpus / "target")
    small = load_prompts(str(corpus), tok, 20, seed=5, max_tokens=40)
    large = load_prompts(str(corpus), tok, 60, seed=5, max_tokens=40)
    assert large[:20] == small and len(large) == 60
    assert load_prompts(str(corpus), tok, 20, seed=6, max_tokens=40) != small
    assert all(16 <= len(p) <= 40 for p in large)


def test_corpus_without_train_split_is_refused(tmp_path, corpus):
    with pytest.raises(BlockspecError, match="train.jsonl"):
        load_prompts(str(tmp_path), Tokenizer(corpus / "target"), 4)


def test_jsonl_prompts_keep_bos_when_cut_and_chat_rows_get_no_second_one(tmp_path):
    from chat_helpers import CHATS, write_chat_tokenizer
    tok = Tokenizer(write_chat_tokenizer(tmp_path / "tok", "mistral"))
    bos = tok.bos_token_id
    rows = [{"prompt": "x" * 50}, {"messages": CHATS["single"]}, {"messages": [{"role": "user"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    long, chat = load_prompts(str(path), tok, 2, max_tokens=20)
    assert long == [bos] + tok.encode("x" * 50)[-19:] and len(long) == 20   # the end, after its BOS
    full = tok.encode_chat(CHATS["single"])
    assert full.count(bos) == 1 and len(full) > 20 and chat == [bos] + full[-19:]
    assert load_prompts(str(path), tok, 2, max_tokens=len(full))[1] == full
    path.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(BlockspecError, match=r"p.jsonl:1: chat template failed"):
        load_prompts(str(path), tok, 1)
