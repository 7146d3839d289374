"""Conversations for training: rendered with the target's chat template, loss on the assistant's
tokens only (checked token by token against hand-written expectations of real-style templates,
and against transformers' own assistant mask for a `{% generation %}` template); ShareGPT and
`messages` rows give the same examples; bad rows are named."""

from __future__ import annotations

import json

import pytest

from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.conversations import chat_messages, end_of_turn_ids, render_conversation
from blockspec.training.data import collate, load_examples
from chat_helpers import write_chat_tokenizer

CHAT = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4, of course."}]
SHAREGPT = [{"from": "system", "value": "Be nice."}, {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4, of course."}]

# (text, trained) pieces of each family's rendering of CHAT, written from the templates' rules.
EXPECTED = {
    "qwen2.5": [("<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
                ("Hello! How can I help?<|im_end|>", 1),
                ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
                ("4, of course.<|im_end|>", 1), ("\n", 0)],
    # Qwen3 re-renders the final answer (after the last user turn) with an empty think block,
    # which the model does generate; the earlier answer is rendered without one.
    "qwen3": [("<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Hello! How can I help?<|im_end|>", 1),
              ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
              ("<think>\n\n</think>\n\n4, of course.<|im_end|>", 1), ("\n", 0)],
    "mistral": [("<s> [INST] Be nice.\n\nHi [/INST]", 0), (" Hello! How can I help?</s>", 1),
                (" [INST] 2+2? [/INST]", 0), (" 4, of course.</s>", 1)],
}


# A Qwen-style template whose assistant text is marked for transformers' assistant mask.
MARKED = """{%- for message in messages %}
{%- if message.role == "assistant" %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def pieces_to_ids(tok: Tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[bool]]:
    """Byte-level BPE without merges: the chat's ids are the concatenation of its pieces' ids."""
    ids, mask = [], []
    for text, trained in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [bool(trained)] * len(piece)
    return ids, mask


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_loss_only_on_assistant_tokens_token_by_token(tmp_path, family):
    tok = Tokenizer(write_chat_tokenizer(tmp_path, family))
    ids, mask, starts = render_conversation(tok, CHAT, end_of_turn_ids(tmp_path, tok), "t")
    want_ids, want_mask = pieces_to_ids(tok, EXPECTED[family])
    assert ids == want_ids == tok.encode_chat(CHAT, add_generation_prompt=False)
    assert mask == want_mask
    assert starts == [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]


def test_generation_blocks_match_transformers_assistant_mask(tmp_path):
    """A template with {% generation %} blocks: our mask is transformers' own, and equals the
    mask the prefix rule finds on the same template without the blocks."""
    transformers = pytest.importorskip("transformers")
    plain_dir = write_chat_tokenizer(tmp_path / "plain", "qwen2.5")
    marked_dir = write_chat_tokenizer(tmp_path / "marked", "qwen2.5")
    (plain_dir / "chat_template.jinja").write_text(MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    (marked_dir / "chat_template.jinja").write_text(MARKED)
    plain, tok = Tokenizer(plain_dir), Tokenizer(marked_dir)
    ids, mask, _ = render_conversation(tok, CHAT, {tok.eos_token_id}, "t")
    assert (ids, mask) == render_conversation(plain, CHAT, {plain.eos_token_id}, "t")[:2]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(marked_dir / "tokenizer.json"))
    out = hf.apply_chat_template(CHAT, chat_template=MARKED, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == ids and [bool(x) for x in out["assistant_masks"]] == mask
    assert (ids, mask) == pieces_to_ids(tok, EXPECTED["qwen2.5"])   # the same chat as Qwen2.5's template


def test_sharegpt_and_messages_rows_give_the_same_examples(tmp_path):
    tok_dir = write_chat_tokenizer(tmp_path / "tok", "qwen3")
    tok = Tokenizer(tok_dir)
    a, b = tmp_path / "messages.jsonl", tmp_path / "sharegpt.jsonl"
    a.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT[1:3]}) + "\n")
    b.write_text(json.dumps({"conversations": SHAREGPT}) + "\n\n" + json.dumps({"conversations": SHAREGPT[1:3]}) + "\n")
    ea, eb = (load_examples(p, 4096, tok, end_of_turn_ids(tok_dir, tok)) for p in (a, b))
    assert [(e.ids, e.loss_mask, e.response_start) for e in ea] == [(e.ids, e.loss_mask, e.response_start) for e in eb]
    assert len(ea) == 2 and sum(ea[1].loss_mask) < sum(ea[0].loss_mask)
    ids, mask = collate(ea, pad_id=0)
    assert mask[0].tolist() == ea[0].loss_mask and not mask[1, len(ea[1].ids):].any()
    # The evaluation prompt ends where the last answer starts.
    assert ea[0].ids[:ea[0].response_start] == tok.encode_chat(CHAT[:4], add_generation_prompt=True)


def test_untrained_turns_and_cut_sequences(tmp_path):
    tok = Tokenizer(write_chat_tokenizer(tmp_path, "qwen2.5"))
    ends = {tok.eos_token_id}
    _, full, _ = render_conversation(tok, CHAT, ends, "t")
    first_off = [dict(m) for m in CHAT]
    first_off[2]["train"] = False
    ids, mask, starts = render_conversation(tok, first_off, ends, "t")
    assert ids == tok.encode_chat(CHAT, add_generation_prompt=False) and len(starts) == 1
    assert sum(mask) == len(tok.encode("4, of course.<|im_end|>", add_special_tokens=False))
    assert all(full[k] for k in range(len(mask)) if mask[k]) and sum(full) > sum(mask)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    cut = starts[0] + 3   # the second answer keeps 3 tokens
    (example,) = load_examples(path, cut, tok, ends)
    assert example.ids == ids[:cut] and example.loss_mask == full[:cut]
    skipped: list[str] = []   # cut before any answer: nothing to train on, reported
    with pytest.raises(BlockspecError, match="no usable examples"):
        load_examples(path, 5, tok, ends, skipped=skipped)
    assert skipped == [f"{path}:1"]


def test_bad_rows_are_named(tmp_path):
    tok = Tokenizer(write_chat_tokenizer(tmp_path / "tok", "mistral"))
    path = tmp_path / "d.jsonl"
    cases = [({"conversations": [{"from": "robot", "value": "x"}]}, r"d.jsonl:1: conversations\[0\] has from='robot'"),
             ({"messages": [{"content": "x"}]}, r"d.jsonl:1: messages\[0\] needs a string 'role'"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
             ({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
              r"d.jsonl:1: chat template failed"),
             ({"text": "no ids"}, "needs 'prompt_ids' and 'response_ids', or a 'messages'")]
    for row, message in cases:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(BlockspecError, match=message):
            load_examples(path, 64, tok, {tok.eos_token_id})
    path.write_text(json.dumps({"messages": CHAT[1:]}) + "\n")
    with pytest.raises(BlockspecError, match="need the target's tokenizer"):
        load_examples(path, 64)
    path.write_text("{not json\n")
    with pytest.raises(BlockspecError, match=r"d.jsonl:1 is not valid JSON"):
        load_examples(path, 64, tok)
    assert chat_messages({"prompt_ids": [1]}, "w") is None
    assert chat_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]}, "w") == \
        [{"role": "user", "content": "ab"}]
