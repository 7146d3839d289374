"""The OpenAI response side: choices of /v1/completions and /v1/chat/completions, whole
or as stream deltas, with log-probabilities in each endpoint's own form (vLLM's):

- completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}; with echo the prompt's come first, its first token's None;
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from blockspec.decoding.logprobs import TokenLogprob

FLOOR = -9999.0   # vLLM's stand-in for -inf: JSON has no infinity


def finite(value: float) -> float:
    return max(value, FLOOR)


class CompletionShape:
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text

    def choice(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    delta = choice

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    def logprobs(self, ids: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
        """The legacy form for tokens `ids` (entries aligned; None: the prompt's first token);
        text offsets start at `offset` (the text already streamed)."""
        out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token, entry in zip(ids, entries):
            text = self.token_text(token)
            out["text_offset"].append(offset)
            out["tokens"].append(text)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for alt, value in (*entry.top, (entry.token, entry.logprob)):   # vLLM adds the chosen token
                top.setdefault(self.token_text(alt), finite(value))         # most likely first: keep the max
            out["token_logprobs"].append(finite(entry.logprob))
            out["top_logprobs"].append(top)
        return out


class ChatShape:
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text

    def choice(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def delta(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}

    def opening(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def entry(self, token: int, value: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": finite(value), "bytes": list(text.encode("utf-8"))}

    def logprobs(self, ids: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
        return {"content": [{**self.entry(e.token, e.logprob), "top_logprobs": [self.entry(t, v) for t, v in e.top]}
                            for e in entries if e is not None]}


Shape = CompletionShape | ChatShape


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
