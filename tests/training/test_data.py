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


def test_a_corpus_of_only_short_files_is_refused_not_looped_over(tmp_path, corpus):
    """Every file shorter than a prompt window: the draw used to loop forever (calibrate hung)."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n" for i in range(5)))
    with pytest.raises(BlockspecError, match="no file in .* is longer than 80 tokens"):
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


# -- training examples, epochs, the mask token ------------------------------------------------

from blockspec.training.data import (EpochBatches, collate, default_mask_token_id, load_examples,  # noqa: E402
                                     resolve_mask_token_id)


def test_prompt_ids_rows_still_load_and_collate(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6]}) + "\n"
                    + json.dumps({"prompt_ids": [1, 2], "response_ids": [7]}) + "\n"      # one response token: skipped
                    + json.dumps({"prompt_ids": [9], "response_ids": [8, 7]}) + "\n")
    skipped: list[str] = []
    a, b = load_examples(path, 5, skipped=skipped)
    assert (a.ids, a.response_start, b.ids) == ([1, 2, 3, 4, 5], 3, [9, 8, 7]) and skipped == [f"{path}:2"]
    ids, mask = collate([a, b], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [9, 8, 7, 0, 0]]
    assert mask.tolist() == [[False, False, False, True, True], [False, True, True, False, False]]
    with pytest.raises(BlockspecError, match="outside the target's vocabulary"):
        load_examples(path, 5, vocab_size=8)


@pytest.mark.parametrize("group", [True, False])
def test_epochs_see_every_example_once_in_a_seeded_order(group):
    lengths = [random.Random(i).randrange(5, 500) for i in range(103)]
    g = 8
    order = EpochBatches(lengths, g, seed=1, group_by_length=group)
    assert order.steps_per_epoch == 13
    for epoch in range(3):
        seen = [i for s in range(epoch * 13, (epoch + 1) * 13) for i in order.batch(s)]
        assert sorted(seen) == list(range(103))                        # every example, once
        assert all(len(order.batch(s)) == g for s in range(epoch * 13, epoch * 13 + 12))
    again = EpochBatches(lengths, g, seed=1, group_by_length=group)
    assert [again.batch(s) for s in (30, 2, 14)] == [order.batch(s) for s in (30, 2, 14)]   # the step alone
    assert order.epoch_batches(0) != order.epoch_batches(1)
    assert EpochBatches(lengths, g, seed=2, group_by_length=group).epoch_batches(0) != order.epoch_batches(0)
    if group:   # batches hold similar lengths: far less padding than a plain shuffle
        def padding(batches):
            return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)
        assert padding(order.epoch_batches(0)) < 0.5 * padding(
            EpochBatches(lengths, g, seed=1, group_by_length=False).epoch_batches(0))


def test_ranks_split_each_global_batch():
    order = EpochBatches([10] * 10, 4, seed=3)   # batches of 4, 4, 2
    for step in range(3):
        parts = [order.batch(step, rank, 4) for rank in range(4)]
        if step < 2:
            assert sorted(sum(parts, [])) == sorted(order.epoch_batches(0)[step])
        else:   # 2 examples for 4 ranks: topped up with the epoch's first, no rank without data
            assert all(len(p) == 1 for p in parts)
            assert [p[0] for p in parts[:2]] == order.epoch_batches(0)[2]
    with pytest.raises(BlockspecError):
        EpochBatches([], 4)


def _tokenizer_with_added_tokens(path, words: int, added: list[str], mask: bool = False) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers
    tok = HF(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in added])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": added[0]}
    if mask:
        config["mask_token"] = added[-1]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(path)


def test_mask_token_default_is_the_first_row_past_the_special_tokens(tmp_path):
    # As Qwen3: 151643 words + 26 added special tokens = 151669 ids; the drafts use 151669.
    tok = _tokenizer_with_added_tokens(tmp_path / "a", 50, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.vocab_size == 53 and tok.mask_token_id is None
    assert default_mask_token_id(tok, 64) == 53 == resolve_mask_token_id(-1, tok, 64)
    assert resolve_mask_token_id(60, tok, 64) == 60
    with pytest.raises(BlockspecError, match="every embedding row"):
        resolve_mask_token_id(-1, tok, 53)
    with pytest.raises(BlockspecError, match="outside the target's embedding"):
        resolve_mask_token_id(64, tok, 64)
    with pytest.raises(BlockspecError, match=">= 0"):
        resolve_mask_token_id(-5, tok, 64)
    own = _tokenizer_with_added_tokens(tmp_path / "b", 50, ["<|endoftext|>", "<|mask|>"], mask=True)
    assert resolve_mask_token_id(-1, own, 64) == own.mask_token_id == 51   # the tokenizer's own mask token
