"""The OpenAI response side: a request's choices (one engine request each) and their
answers, choices of /v1/completions and /v1/chat/completions, whole
or as stream deltas, with log-probabilities in each endpoint's own form (vLLM's):

- completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}; with echo the prompt's come first, its first token's None;
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from blockspec.config import SamplingParams
from blockspec.engine.handles import RequestHandle, RequestOutput
from blockspec.decoding.logprobs import TokenLogprob
from blockspec.serving.protocol import ApiError

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


# -- one request's choices ------------------------------------------------------------

@dataclass
class Choice:
    """One choice of a request (a prompt x one of its n samples): one engine request."""

    index: int
    id: str
    prompt: list[int]
    params: SamplingParams
    echo: str | None = None        # the prompt's text, returned before the completion (echo)
    discard: bool = False          # max_tokens=0: the one token the engine generates is not returned
    handle: RequestHandle | None = None


@dataclass
class Ask:
    """What an endpoint asks of `Service.generate`: its prompts and how its fields map."""

    prompts: list[list[int]]
    shape: Shape
    prompt_param: str                     # the request field errors about the prompt name
    max_param: str                        # ... and about the token budget
    requested: int | None                 # the budget asked for (None: the rest of the context)
    logprobs: int | None = None           # alternatives per emitted token (None: no logprobs)
    prompt_logprobs: int | None = None    # ... per prompt token (echo)
    echoes: list[str] | None = None       # each prompt's text, returned before its completion
    names: dict[str, str] = field(default_factory=dict)   # SamplingParams field -> request field


@dataclass
class Job:
    """One admitted request."""

    id: str
    created: int
    prompt_tokens: int
    stream: bool
    include_usage: bool
    shape: Shape
    choices: list[Choice]
    logprobs: bool                 # the response carries log-probabilities


@dataclass
class ChoiceResult:
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: str | None


def check_finish(reason: str | None) -> str:
    """Engine finish reasons a client can see; anything else is the server's failure."""
    if reason in ("stop", "length"):
        return reason
    if reason == "cancelled":
        raise ApiError(503, "the request was cancelled: the server is shutting down")
    raise ApiError(500, "the engine failed while generating; see the server log")


def choice_piece(job: Job, c: Choice, text: str, tokens: list[int], logprobs: list[TokenLogprob] | None,
                 prompt_logprobs: list[TokenLogprob | None] | None, first: bool, offset: int = 0
                 ) -> tuple[str, dict[str, Any] | None, int]:
    """(text, logprobs in the endpoint's form, tokens counted) of a choice's output or delta:
    the echoed prompt first (with its logprobs), nothing of a max_tokens=0 completion."""
    ids: list[int] = []
    entries: list[TokenLogprob | None] = []
    if c.discard:
        text, tokens = "", []
    if first and c.echo is not None:
        text = c.echo + text
        if prompt_logprobs is not None:
            ids, entries = list(c.prompt), list(prompt_logprobs)
    if job.logprobs:
        ids += tokens
        entries += (logprobs or [])[:len(tokens)]
    return text, job.shape.logprobs(ids, entries, offset) if job.logprobs else None, len(tokens)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """The choices' deltas as they arrive, interleaved."""
    queue: asyncio.Queue[tuple[Choice, RequestOutput | None]] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for out in c.handle:
                queue.put_nowait((c, out))
        finally:
            queue.put_nowait((c, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield c, out
    finally:
        for task in tasks:
            task.cancel()


async def collect_output(handle: RequestHandle) -> ChoiceResult:
    """A request's whole output, from its stream of deltas."""
    res = ChoiceResult("", [], [], None, None)
    parts = []
    async for out in handle:
        parts.append(out.text or "")
        res.tokens += out.token_ids
        res.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        res.finish_reason = out.finish_reason
    res.text = "".join(parts)
    return res
