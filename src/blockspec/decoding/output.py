"""What a request emits, in one place for every decoding path: stop tokens, EOS,
`max_new_tokens`, stop strings and incremental detokenisation.

`RequestOutputState.push` takes a round's committed tokens and returns what may
be streamed now; `generate`, the engine and the bench all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from blockspec.config import SamplingParams
from blockspec.decoding.acceptance import tau
from blockspec.errors import BlockspecError


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class RequestStats:
    """Per-request record of every round: drafts verified and drafts accepted."""

    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        return tau(sum(self.accepted), self.rounds, empty=0.0)


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str          # "stop" | "length" | "cancelled" | "error"
    stats: RequestStats
    text: str | None = None


@dataclass
class Delta:
    """What one push lets the request stream: tokens, their text (with a tokenizer),
    and whether the request has finished."""

    tokens: list[int]
    text: str | None
    finished: bool


class TextTracker:
    """Incremental detokenisation of one request, with stop strings.

    Text (and, when stop strings are set, tokens) that could still turn out to
    be the start of a stop string is held back; on a hit, tokens and text are
    cut where the stop string begins."""

    def __init__(self, tokenizer: Detokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""          # the request's text so far (cut at a stop string)
        self.sent_tokens = 0
        self.sent_chars = 0

    def push(self, new_ids: list[int], final: bool) -> tuple[list[int], str, bool]:
        """Add tokens; return (token delta, text delta, stop string hit)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        cut = self._find_stop(text)
        if cut is not None:
            del self.ids[self._tokens_within(cut):]
            text, final = text[:cut], True
        self.text = text
        if final:
            safe_chars, safe_tokens = len(text), len(self.ids)
        else:
            safe_chars = len(text) - self.hold
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                safe_chars = min(safe_chars, len(text.rstrip("\ufffd")))
            safe_chars = max(safe_chars, self.sent_chars)
            safe_tokens = self._tokens_within(safe_chars) if self.stops else len(self.ids)
        tokens = self.ids[self.sent_tokens:safe_tokens]
        delta = text[self.sent_chars:safe_chars]
        self.sent_tokens = max(self.sent_tokens, safe_tokens)
        self.sent_chars = max(self.sent_chars, safe_chars)
        return tokens, delta, cut is not None

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.sent_chars - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return max(min(hits), self.sent_chars) if hits else None

    def _tokens_within(self, chars: int) -> int:
        """Most tokens (>= those already sent) whose text fits in the first `chars` characters."""
        for k in range(len(self.ids), self.sent_tokens, -1):
            if len(self.tokenizer.decode(self.ids[:k])) <= chars:
                return k
        return self.sent_tokens


class RequestOutputState:
    """Everything one request has emitted, and why it stopped.

    Stop tokens (the request's own, plus the model's EOS unless ignore_eos) end it
    without being emitted; max_new_tokens ends it with "length"; with a tokenizer,
    stop strings end it with "stop" and cut the tokens and text where the stop
    string begins (held-back text is released when it cannot start one)."""

    def __init__(self, params: SamplingParams, eos_ids: list[int], tokenizer: Detokenizer | None = None) -> None:
        if params.stop and tokenizer is None:
            raise BlockspecError("stop strings need a tokenizer (pass tokenizer=) or use stop_token_ids")
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stats = RequestStats()
        self.text = TextTracker(tokenizer, params.stop) if tokenizer is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record_round(self, verified: int, accepted: int) -> None:
        self.stats.verified.append(verified)
        self.stats.accepted.append(accepted)

    def push(self, new: list[int]) -> Delta:
        """Append a round's tokens up to a stop token, the length limit or a stop string."""
        kept = []
        for tok in new:
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            kept.append(tok)
            self.tokens.append(tok)
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.text is None:
            return Delta(kept, None, self.finished)
        kept, text, hit = self.text.push(kept, final=self.finished)
        if hit:
            self.finish_reason = "stop"
            del self.tokens[len(self.text.ids):]
        return Delta(kept, text, self.finished)

    def finish(self, reason: str) -> None:
        """End the request from outside (cancelled, error)."""
        self.finish_reason = reason

    def completion(self) -> Completion:
        return Completion(list(self.tokens), self.finish_reason or "length", self.stats,
                          self.text.text if self.text is not None else None)
