"""What a request emits, in one place for every decoding path: stop tokens, EOS,
`max_new_tokens`, stop strings and incremental detokenisation.

`RequestOutputState.push` takes a round's committed tokens and returns what may
be streamed now; `generate`, the engine and the bench all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from blockspec.config import SamplingParams
from blockspec.decoding.logprobs import TokenLogprob
from blockspec.errors import BlockspecError
from blockspec.metrics import tau


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
    logprobs: list[TokenLogprob] | None = None                # one per token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None


@dataclass
class Delta:
    """What one push lets the request stream: tokens, their text (with a tokenizer),
    and whether the request has finished."""

    tokens: list[int]
    text: str | None
    finished: bool
    logprobs: list[TokenLogprob] | None = None                # of `tokens`, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the request's first delta


class TextTracker:
    """Incremental detokenisation of one request, with stop strings, in bounded work per push.

    Text (and, when stop strings are set, tokens) that could still turn out to be the start of a
    stop string is held back; on a hit, tokens and text are cut where the stop string begins.
    The result is exactly what decoding the whole output every push would give (the rule kept
    in tests/decoding/test_output.py as the reference), at a cost that does not grow with it:

    - decoding: as vLLM / transformers' TextStreamer, only a window of the latest tokens is
      decoded, ids[prefix:], and the text of ids[prefix:read] (final already) is cut off its
      front; the window starts one push back so decoders that treat a first token specially
      (SentencePiece's leading space) decode it as mid-text. `read` advances to the last token
      whose text can no longer change (it does not end in an incomplete UTF-8 character);
    - stop strings: searched only in text that is new or still pending plus the longest stop's
      length before it (a stop lying wholly in text already searched would have been found);
    - held-back tokens: the text length after each unsent token is kept, so cutting tokens at
      a character needs no decoding.
    """

    def __init__(self, tokenizer: Detokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent_tokens = 0
        self.sent_chars = 0
        self.stopped = False            # a stop string ended the text
        self._prefix = 0                # the decoding window starts at this token ...
        self._read = 0                  # ... and the text of ids[:read] is final
        self._prefix_text = ""          # decode(ids[prefix:read])
        self._archive: list[str] = []   # final text before char `_base`: never looked at again
        self._base = 0
        self._recent = ""               # final text from `_base` to the text of ids[:read]
        self._pending = ""              # text of ids[read:] (may change as tokens arrive)
        self._searched = 0              # final text up to here has been searched for stops
        self._lens: list[tuple[int, int]] = []  # (k, len(text of ids[:k])) for unsent tokens k (stops only)

    @property
    def text(self) -> str:
        """The request's text so far (cut at a stop string)."""
        return "".join(self._archive) + self._recent + self._pending

    def push(self, new_ids: list[int], final: bool) -> tuple[list[int], str, bool]:
        """Add tokens; return (token delta, text delta, stop string hit)."""
        if self.stopped:
            return [], "", True
        first_new = len(self.ids) + 1
        self.ids.extend(new_ids)
        window: dict[int, str] = {}
        if new_ids:
            self._pending = self._window_at(window, len(self.ids))[len(self._prefix_text):]
            if self.stops:
                final_len = self._base + len(self._recent) - len(self._prefix_text)
                for k in range(first_new, len(self.ids) + 1):
                    self._lens.append((k, final_len + len(self._window_at(window, k))))
        tail = self._recent + self._pending          # the text from char `_base` on
        cut = self._find_stop(tail)
        if cut is not None:
            keep = self._tokens_within(cut)
            del self.ids[keep:]
            self._lens = [(k, n) for k, n in self._lens if k <= keep]
            tail, final, self.stopped = tail[:cut - self._base], True, True
            self._recent, self._pending = tail, ""
        end = self._base + len(tail)
        if final:
            safe_chars, safe_tokens = end, len(self.ids)
        else:
            safe_chars = end - self.hold
            if tail.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                safe_chars = min(safe_chars, self._base + len(tail.rstrip("\ufffd")))
            safe_chars = max(safe_chars, self.sent_chars)
            safe_tokens = self._tokens_within(safe_chars) if self.stops else len(self.ids)
        tokens = self.ids[self.sent_tokens:safe_tokens]
        delta = tail[self.sent_chars - self._base:safe_chars - self._base]
        self.sent_tokens = max(self.sent_tokens, safe_tokens)
        self.sent_chars = max(self.sent_chars, safe_chars)
        self._lens = [(k, n) for k, n in self._lens if k > self.sent_tokens]
        if not self.stopped:
            self._advance(window)
        self._searched = self._base + len(self._recent)
        self._trim()
        return tokens, delta, cut is not None

    def _window_text(self, k: int) -> str:
        return self.tokenizer.decode(self.ids[self._prefix:k])

    def _window_at(self, window: dict[int, str], k: int) -> str:
        """The window's text up to token k, decoded once per push."""
        if k not in window:
            window[k] = self._window_text(k)
        return window[k]

    def _advance(self, window: dict[int, str]) -> None:
        """Move `read` to the last token whose text is final: the window's text up to it is a prefix
        of the whole window's and does not end in a replacement character, or is followed by more
        text (then whatever it ended with was not the start of a longer character)."""
        whole = window.get(len(self.ids))
        if whole is None or len(self.ids) == self._read:
            return
        stable = None
        if not whole.endswith("\ufffd"):
            stable = len(self.ids)
        else:
            for j in range(len(self.ids) - 1, self._read, -1):
                text_j = self._window_at(window, j)
                if whole.startswith(text_j) and (not text_j.endswith("\ufffd") or len(whole) > len(text_j)):
                    stable = j
                    break
        if stable is None:
            return
        newly_final = window[stable][len(self._prefix_text):]
        self._recent += newly_final
        self._pending = self._pending[len(newly_final):]
        self._prefix, self._read = self._read, stable
        self._prefix_text = self._window_text(self._read)

    def _trim(self) -> None:
        """Archive the final text that neither stop search nor deltas will look at again."""
        keep_from = max(self._base, min(self.sent_chars, self._searched) - self.hold)
        if keep_from > self._base:
            cut = keep_from - self._base
            self._archive.append(self._recent[:cut])
            self._recent, self._base = self._recent[cut:], keep_from

    def _find_stop(self, tail: str) -> int | None:
        """Where the first stop string starts (>= the text already sent), or None."""
        if not self.stops:
            return None
        start = max(self.sent_chars, self._searched) - self.hold
        start = max(start, self._base, 0)
        hits = [i for i in (tail.find(s, start - self._base) for s in self.stops) if i >= 0]
        return max(min(hits) + self._base, self.sent_chars) if hits else None

    def _tokens_within(self, chars: int) -> int:
        """Most tokens (>= those already sent) whose text fits in the first `chars` characters."""
        for k, length in reversed(self._lens):
            if k > self.sent_tokens and length <= chars:
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
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.stats = RequestStats()
        self.text = TextTracker(tokenizer, params.stop) if tokenizer is not None else None
        self._sent = 0                # tokens streamed so far
        self._prompt_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record_round(self, verified: int, accepted: int) -> None:
        self.stats.verified.append(verified)
        self.stats.accepted.append(accepted)

    def push(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> Delta:
        """Append a round's tokens (and their log-probabilities) up to a stop token, the
        length limit or a stop string."""
        kept = []
        for i, tok in enumerate(new):
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            kept.append(tok)
            self.tokens.append(tok)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.text is None:
            return self._delta(kept, None)
        return self._tracked(kept, final=self.finished)

    def _tracked(self, kept: list[int], final: bool) -> Delta:
        tokens, text, hit = self.text.push(kept, final=final)
        if hit:
            self.finish_reason = "stop"
            del self.tokens[len(self.text.ids):]
            if self.logprobs is not None:
                del self.logprobs[len(self.text.ids):]
        return self._delta(tokens, text)

    def _delta(self, tokens: list[int], text: str | None) -> Delta:
        logprobs = None if self.logprobs is None else self.logprobs[self._sent:self._sent + len(tokens)]
        self._sent += len(tokens)
        prompt = None
        if not self._prompt_sent and self.prompt_logprobs is not None:
            prompt, self._prompt_sent = self.prompt_logprobs, True
        return Delta(tokens, text, self.finished, logprobs, prompt)

    def finish(self, reason: str) -> Delta:
        """End the request from outside (cancelled, error): what was held back for stop-string
        matching is released, so the stream carries exactly the completion's tokens and text."""
        self.finish_reason = reason
        if self.text is None:
            return self._delta([], None)
        delta = self._tracked([], final=True)
        self.finish_reason = reason   # a stop string found in the held-back text still ends it as `reason`
        return Delta(delta.tokens, delta.text, True, delta.logprobs, delta.prompt_logprobs)

    def completion(self) -> Completion:
        return Completion(list(self.tokens), self.finish_reason or "length", self.stats,
                          self.text.text if self.text is not None else None, self.logprobs,
                          self.prompt_logprobs)
