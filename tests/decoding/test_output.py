"""decoding.output.TextTracker: incremental detokenisation and stop strings.

The reference is the rule the tracker had before it became incremental (decode the whole output
every push, search the whole unsent text, re-decode prefixes to cut tokens): on random token
streams the incremental tracker must give the same deltas, push for push, and the same final
text and tokens, while its work per push stays bounded however long the output grows.
"""

from __future__ import annotations

import random

import pytest

from blockspec import embedded
from blockspec.decoding.output import TextTracker
from blockspec.models.tokenizer import Tokenizer


class WholeTextTracker:
    """The whole-text rule (the tracker before it was incremental), kept verbatim as the reference."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent_tokens = 0
        self.sent_chars = 0

    def push(self, new_ids, final):
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
            if text.endswith("\ufffd"):
                safe_chars = min(safe_chars, len(text.rstrip("\ufffd")))
            safe_chars = max(safe_chars, self.sent_chars)
            safe_tokens = self._tokens_within(safe_chars) if self.stops else len(self.ids)
        tokens = self.ids[self.sent_tokens:safe_tokens]
        delta = text[self.sent_chars:safe_chars]
        self.sent_tokens = max(self.sent_tokens, safe_tokens)
        self.sent_chars = max(self.sent_chars, safe_chars)
        return tokens, delta, cut is not None

    def _find_stop(self, text):
        start = max(0, self.sent_chars - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return max(min(hits), self.sent_chars) if hits else None

    def _tokens_within(self, chars):
        for k in range(len(self.ids), self.sent_tokens, -1):
            if len(self.tokenizer.decode(self.ids[:k])) <= chars:
                return k
        return self.sent_tokens


class CharTokenizer:
    """Token i decodes to one or two letters, so stop strings can start mid-token."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) * (1 + i % 2) for i in ids)


class ByteTokenizer:
    """Tokens are byte strings, some of them fragments of multi-byte characters; decoding
    replaces what is not valid UTF-8 (as byte-level BPE decoders do)."""

    PIECES = [b"a", b"b", b" ", b"ab", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xf0\x9f", b"\x98\x80",
              b"\xe2", b"\x82\xac", b"\xff", b"\x80", "é".encode(), "€x".encode(), b"\n", b"ba"]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


class Counting:
    """Counts what the tracker asks its tokenizer to decode."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.ids = inner, 0, 0

    def decode(self, ids):
        self.calls += 1
        self.ids += len(ids)
        return self.inner.decode(ids)


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer(embedded.default_target())


def run(tracker, stream, final_at_end=True):
    out = []
    for i, chunk in enumerate(stream):
        out.append(tracker.push(chunk, final=final_at_end and i == len(stream) - 1))
        if out[-1][2]:
            break
    return out


def random_case(rng: random.Random, tokenizer, vocab: int):
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    stream, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 5)
        stream.append(ids[i:i + n])
        i += n
    text = tokenizer.decode(ids)
    stops = []
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.7 and len(text) > 2:  # often a piece of the text, so it hits
            a = rng.randrange(len(text) - 1)
            stops.append(text[a:a + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice("abé€\n ") for _ in range(rng.randint(1, 4))))
    return stream, stops


@pytest.mark.parametrize("name", ["chars", "bytes", "bpe"])
def test_random_streams_match_the_whole_text_rule(name, bpe):
    tokenizer, vocab = {"chars": (CharTokenizer(), 40), "bytes": (ByteTokenizer(), len(ByteTokenizer.PIECES)),
                        "bpe": (bpe, bpe.vocab_size)}[name]
    rng = random.Random(1234)
    hits = 0
    for case in range(400):
        stream, stops = random_case(rng, tokenizer, vocab)
        final_at_end = case % 4 != 0
        ref, new = WholeTextTracker(tokenizer, stops), TextTracker(tokenizer, stops)
        expected, got = run(ref, stream, final_at_end), run(new, stream, final_at_end)
        assert got == expected, (name, case, stream, stops)
        assert new.text == ref.text and new.ids == ref.ids
        hits += any(hit for _, _, hit in got)
    assert hits > 50  # the stop-string path was exercised, not only the plain one


def test_text_is_held_back_by_the_longest_stop_and_cut_where_it_begins():
    tok = CharTokenizer()                    # token 0 -> "a", 1 -> "bb", 2 -> "c"
    tracker = TextTracker(tok, ["bbc"])      # holds back 2 characters
    assert tracker.push([1], final=False) == ([], "", False)
    assert tracker.push([0], final=False) == ([], "b", False)
    assert tracker.push([0, 0], final=False) == ([1, 0], "ba", False)
    assert tracker.push([1, 2], final=False) == ([0, 0], "aa", True)   # "bbaaabbc": cut at "bbc"
    assert tracker.text == "bbaaa" and tracker.ids == [1, 0, 0, 0]
    assert tracker.push([0], final=True) == ([], "", True)             # nothing after a stop string


def test_incomplete_utf8_is_held_until_the_character_completes():
    tok = ByteTokenizer()
    tracker = TextTracker(tok, [])
    assert tracker.push([0, 6], final=False) == ([0, 6], "a", False)   # "a" + first bytes of "€"
    assert tracker.push([7], final=False) == ([7], "€", False)
    assert tracker.push([10], final=True) == ([10], "\ufffd", False)   # a stream ending mid-character
    assert tracker.text == "a€\ufffd"


def make_stream(tokenizer, n_tokens: int, seed: int = 0) -> list[list[int]]:
    text = "".join(f"def f{i}(x):\n    return x * {i} + 'é€'\n" for i in range(400))
    ids = tokenizer.encode(text)[:n_tokens]
    assert len(ids) == n_tokens
    rng = random.Random(seed)
    stream, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 8)
        stream.append(ids[i:i + n])
        i += n
    return stream


LONG_STOPS = [f"<<no such stop string number {i:02d} in this text at all>>" for i in range(16)]


@pytest.mark.parametrize("stops", [[], LONG_STOPS], ids=["no-stops", "16-long-stops"])
def test_work_per_push_is_flat_in_output_length(bpe, stops):
    counting = Counting(bpe)
    tracker = TextTracker(counting, stops)
    per_push = []
    for chunk in make_stream(bpe, 2000):
        calls, ids = counting.calls, counting.ids
        tracker.push(chunk, final=False)
        per_push.append((counting.calls - calls, counting.ids - ids))
    early, late = per_push[:50], per_push[-50:]
    # Each push decodes at most one window per new token (+2), each window at most a few pushes of
    # tokens: bounded by the push size (<= 8), never by the 2,000 tokens before it.
    assert max(c for c, _ in per_push) <= 8 + 2
    assert max(n for _, n in per_push) <= 8 * 40
    assert max(n for _, n in late) <= 2 * max(n for _, n in early)
    assert tracker.text == bpe.decode(tracker.ids)


def test_the_whole_text_rule_is_not_flat(bpe):
    """The reference's cost grows with the output: what the test above rules out can be seen."""
    counting = Counting(bpe)
    tracker = WholeTextTracker(counting, LONG_STOPS)
    per_push = []
    for chunk in make_stream(bpe, 600):
        ids = counting.ids
        tracker.push(chunk, final=False)
        per_push.append(counting.ids - ids)
    assert max(per_push[-20:]) > 4 * max(per_push[:20])
