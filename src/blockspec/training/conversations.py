"""Conversations for drafter training: the common JSONL shapes, rendered with the target's chat
template, with the loss on the assistant's tokens only.

Rows hold OpenAI-style `messages` ([{role, content}]) or ShareGPT `conversations`
([{from, value}], from = human / gpt / system ...). A whole conversation is rendered once (the
text the target would see at its last turn) and every assistant turn in it is trained on.

Where each assistant turn lies in the rendered text (its character span), most robust first:
1. the template marks assistant text with `{% generation %}` (transformers' assistant mask):
   its spans, exactly;
2. prefixes rendered one turn at a time: turn i starts where the prompt for it (the messages
   before it, with the generation prompt) ends, and ends where the chat rendered up to it ends
   (whitespace the template writes after its end-of-turn token is not trained: the model
   stops at that token and never generates it);
3. templates that re-render the last assistant turn differently from an earlier one (Qwen3
   adds an empty <think> block only to the final turn) keep step 2's start, and the turn ends
   with the first end-of-turn token (the tokenizer's / generation config's EOS ids) after it.
A turn none of these can locate is an error naming the row, never a guessed mask.

A message with `"train": false` stays in the context but is not trained on (regenerate's
`--turns last` marks the dataset's own earlier answers this way).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Iterable

from blockspec.config import GenerationDefaults, TargetConfig
from blockspec.errors import BlockspecError
from blockspec.models import chat_template as templates
from blockspec.models.tokenizer import Tokenizer

# ShareGPT `from` values -> chat roles (ShareGPT V3, Vicuna, OpenHermes, UltraChat-style exports).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
# Keys blockspec adds to a message; stripped before rendering (templates never see them).
_OWN_KEYS = ("train",)


def _content(value: Any, where: str) -> Any:
    """A message's content: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise BlockspecError(f"{where}: message content must be a string or a list of text parts")


def chat_messages(row: Any, where: str) -> list[dict[str, Any]] | None:
    """The row's conversation as [{role, content, ...}], from `messages` or ShareGPT
    `conversations`; None when the row has neither (a `prompt_ids` row, a plain prompt)."""
    if not isinstance(row, dict):
        raise BlockspecError(f"{where}: each line must be a JSON object")
    if "messages" in row:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw:
            raise BlockspecError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        messages = []
        for n, m in enumerate(raw):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BlockspecError(f"{where}: messages[{n}] needs a string 'role'")
            messages.append({**m, "content": _content(m.get("content"), f"{where}: messages[{n}]")})
        return messages
    if "conversations" in row:
        raw = row["conversations"]
        if not isinstance(raw, list) or not raw:
            raise BlockspecError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
        messages = []
        for n, turn in enumerate(raw):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or "value" not in turn:
                raise BlockspecError(f"{where}: conversations[{n}] needs string 'from' and 'value'")
            role = SHAREGPT_ROLES.get(turn["from"].lower())
            if role is None:
                raise BlockspecError(f"{where}: conversations[{n}] has from={turn['from']!r}; known: "
                                     f"{sorted(SHAREGPT_ROLES)}")
            message = {"role": role, "content": _content(turn["value"], f"{where}: conversations[{n}]")}
            if turn.get("train") is False:
                message["train"] = False
            messages.append(message)
        return messages
    return None


def end_of_turn_ids(target_dir: str | Path | None, tokenizer: Tokenizer) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS, the target config's and its
    generation_config.json's eos_token_id (Qwen3: <|im_end|>; Llama-3: <|eot_id|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if target_dir is not None:
        directory = Path(target_dir)
        if (directory / "config.json").is_file():
            ids.update(TargetConfig.load(directory).eos_token_id)
        ids.update(GenerationDefaults.load(directory).eos_token_id)
    return ids


class _Renderer:
    """Renders one conversation (and its prefixes) with the tokenizer's default template."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.template = templates.pick(tokenizer.chat_templates, tools)

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool,
                 spans: bool = False) -> tuple[str, list[tuple[int, int]]]:
        clean = [{k: v for k, v in m.items() if k not in _OWN_KEYS} for m in messages]
        return templates.render_with_spans(self.template, clean, add_generation_prompt=generation_prompt,
                                           special_tokens=self.tokenizer.special_tokens, tools=self.tools,
                                           assistant_spans=spans)


def assistant_spans(tokenizer: Tokenizer, messages: list[dict[str, Any]], end_ids: Iterable[int],
                    where: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span [start, end) of each trained assistant
    turn), by the rules in the module docstring."""
    render = _Renderer(tokenizer, tools)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained = [i for i in turns if messages[i].get("train", True) is not False]
    try:
        if templates.has_generation_blocks(render.template):
            text, marked = render(messages, False, spans=True)
            if len(marked) != len(turns):
                raise BlockspecError(f"the template's {{% generation %}} blocks ({len(marked)}) do not match "
                                     f"the {len(turns)} assistant turns")
            return text, [span for i, span in zip(turns, marked) if i in trained]
        text, _ = render(messages, False)
        ends = [tokenizer.backend.id_to_token(t) for t in sorted(end_ids)]
        ends = [e for e in ends if e]
        spans = []
        for i in trained:
            if i == 0:   # an answer with nothing before it has no prompt: context, never trained
                continue
            prompt, _ = render(messages[:i], True)
            if not text.startswith(prompt):
                raise BlockspecError(f"the template renders the prompt of message {i} differently inside the "
                                     "whole chat, so its answer cannot be located (use a template with "
                                     "{% generation %} blocks)")
            start = len(prompt)
            upto, _ = render(messages[:i + 1], False)
            if text.startswith(upto):
                end = max(start, len(upto.rstrip()))   # an empty answer trains nothing
            else:   # the template re-renders a final turn: the turn ends with its end-of-turn token
                found = [(p, len(e)) for e in ends if (p := text.find(e, start)) >= 0]
                if not found:
                    raise BlockspecError(f"cannot find where assistant message {i} ends: the template renders it "
                                         f"differently as the last turn and no end-of-turn token {ends} follows it")
                pos, size = min(found)
                end = pos + size
            if end > start:
                spans.append((start, end))
    except BlockspecError as exc:
        raise BlockspecError(f"{where}: {exc}") from None
    return text, spans


def render_conversation(tokenizer: Tokenizer, messages: list[dict[str, Any]], end_ids: Iterable[int],
                        where: str, tools: list[dict[str, Any]] | None = None
                        ) -> tuple[list[int], list[bool], list[int]]:
    """(token ids of the rendered chat, loss mask: True on assistant tokens, the token index where
    each trained turn starts). Ids are what `Tokenizer.encode_chat` gives (no special tokens added:
    the template wrote them); a token is trained when any of its characters lies in a turn's span
    (transformers' rule for its assistant mask)."""
    text, spans = assistant_spans(tokenizer, messages, end_ids, where, tools)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    firsts, lasts = [a for a, _ in enc.offsets], [b for _, b in enc.offsets]
    ordered = all(x <= y for x, y in zip(firsts, firsts[1:])) and all(x <= y for x, y in zip(lasts, lasts[1:]))
    mask = [False] * len(enc.ids)
    starts = []
    for start, end in spans:
        if ordered:   # offsets rise with the token index: the tokens overlapping [start, end) are a range
            lo, hi = bisect.bisect_right(lasts, start), bisect.bisect_left(firsts, end)
            inside = range(lo, max(lo, hi))
        else:
            inside = [k for k, (a, b) in enumerate(enc.offsets) if a < end and b > start]
        for k in inside:
            mask[k] = True
        if len(inside):
            starts.append(inside[0])
    return list(enc.ids), mask, starts
