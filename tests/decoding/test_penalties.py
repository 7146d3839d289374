"""Penalties, logit_bias and min_p change the target's distribution itself, before
verification, so speculation stays exact: greedy output under penalties equals a plain
per-token reference loop for AR, DFlash and DSpark (drafts accepted and rejected), and
sampled output follows the exact penalised distribution (chi-square, as
test_lossless_sampling.py, with power shown on a verifier that ignores the penalties)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from blockspec import GenerateOptions, PolicyOptions
from blockspec.config import SamplingParams
from blockspec.engine.engine import Engine
from blockspec.decoding.generate import generate
from blockspec.decoding.penalties import LogitAdjust
from blockspec.errors import BlockspecError
from conftest import make_draft, make_target
from lossless_stats import chi_square_p
from test_generate import OracleForwards

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13], [3, 3, 3]]
PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(presence_penalty=1.2, frequency_penalty=0.7),
    dict(logit_bias={5: 4.0, 9: -100.0}, repetition_penalty=0.8),
    dict(frequency_penalty=-0.5, presence_penalty=0.3, repetition_penalty=1.2, logit_bias={2: 1.0}),
]


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The reference, token by token: bias, repetition (prompt and output), frequency, presence."""
    x = logits.clone().double()
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def greedy_reference(target, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    while len(out) < p.max_new_tokens:
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(penalised(logits, prompt, out, p).argmax()))
    return out


def test_adjust_follows_the_drafts_position_by_position(target64):
    params = [SamplingParams(**PENALTIES[3]), SamplingParams(), SamplingParams(**PENALTIES[0])]
    histories = [([1, 2], [3, 3, 4]), ([5], [6]), ([7], [])]
    adjust = LogitAdjust.build(params, histories, 64, "cpu")
    logits = torch.randn(3, 4, 64, dtype=torch.float64)
    drafts = torch.tensor([[3, 8, 8], [1, 2, 3], [7, 7, 9]])
    out = adjust.apply(logits, drafts)
    assert torch.equal(out[1], logits[1])   # an unpenalised row is untouched
    for r in (0, 2):
        for j in range(4):
            want = penalised(logits[r, j], histories[r][0], histories[r][1] + drafts[r, :j].tolist(), params[r])
            torch.testing.assert_close(out[r, j], want)
    assert adjust.select([2, 1]).rows.tolist() == [0]


@pytest.mark.parametrize("method", ["ar", "dflash", "dspark"])
def test_greedy_under_penalties_equals_the_reference(target64, method, monkeypatch):
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True, **PENALTIES[i]) for i in range(len(PROMPTS))]
    expected = [greedy_reference(target64, p, sp) for p, sp in zip(PROMPTS, params)]
    draft, oracle = None, None
    engine = Engine(target64, None, "ar", max_running=4, max_model_len=64, policy=PolicyOptions(adapt=False))
    if method != "ar":
        draft = (make_draft(target64, "zlab", 4) if method == "dflash" else
                 make_draft(target64, "deepspec", 3, markov_rank=4, markov_type="gated", confidence=True))
        engine = Engine(target64, draft, method, max_running=4, max_model_len=64, policy=PolicyOptions(adapt=False))
        # Drafts of the penalised continuation itself, some corrupted: long runs accepted, some rejected.
        full = [p + e for p, e in zip(PROMPTS, expected)]
        oracle = GenerateOptions(forwards=lambda inner: OracleForwards(inner, full, 3))
        engine.forwards = oracle.forwards(engine.forwards)
    out = engine.generate(PROMPTS, params)
    assert [c.tokens for c in out] == expected
    if draft is not None:
        assert sum(sum(c.stats.accepted) for c in out) >= 10
    # generate() (the CLI's path) applies them the same way
    assert [c.tokens for c in generate(target64, PROMPTS, params, draft=draft, policy=PolicyOptions(adapt=False),
                                       options=oracle).completions] == expected


def test_bad_values_are_refused():
    for bad in (dict(presence_penalty=2.5), dict(repetition_penalty=0), dict(min_p=1.5),
                dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101.0}), dict(logprobs=21)):
        with pytest.raises(BlockspecError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(BlockspecError, match="logit_bias"):
        SamplingParams(logit_bias={70: 1.0}).check_vocab(64)


# -- sampling: the exact penalised distribution ----------------------------------------------

VOCAB, N, ALPHA = 12, 12000, 1e-3
PROMPT = [3, 5, 7, 2]
SAMPLED = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.6, presence_penalty=0.4,
                         frequency_penalty=0.3, logit_bias={4: 1.5, 6: -2.0}, max_new_tokens=3, ignore_eos=True)


def exact_penalised_first_three(target, p: SamplingParams) -> torch.Tensor:
    def dist(logits, output):
        x = penalised(logits, PROMPT, output, p) / p.temperature
        probs = torch.softmax(x, -1)
        probs = probs * (probs >= p.min_p * probs.max())
        return probs / probs.sum()
    seqs = [PROMPT + list(s) for s in itertools.product(range(VOCAB), repeat=2)]
    with torch.inference_mode():
        logits = target(torch.tensor(seqs)).logits[:, len(PROMPT) - 1:]
    out = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    p1 = dist(logits[0, 0], [])
    for i, (a, b) in enumerate(itertools.product(range(VOCAB), repeat=2)):
        out[a, b] = p1[a] * dist(logits[i, 1], [a])[b] * dist(logits[i, 2], [a, b])
    return out.flatten()


def sampled_counts(target, draft) -> torch.Tensor:
    rows = [SamplingParams(**{**SAMPLED.__dict__, "seed": i}) for i in range(N)]
    counts = torch.zeros(VOCAB ** 3)
    for c in generate(target, [PROMPT] * N, rows, draft=draft, policy=PolicyOptions(adapt=False)).completions:
        a, b, d = c.tokens
        counts[(a * VOCAB + b) * VOCAB + d] += 1
    return counts


@pytest.fixture(scope="module")
def small_target():
    return make_target(seed=3, vocab=VOCAB, dtype=torch.float64)


def test_sampling_under_penalties_is_lossless(small_target):
    counts = sampled_counts(small_target, make_draft(small_target, "zlab", 4, seed=5))
    assert chi_square_p(counts, exact_penalised_first_three(small_target, SAMPLED)) > ALPHA


def test_ignoring_the_drafts_in_the_penalties_is_detected(small_target, monkeypatch):
    """Power: penalising every verified position as if no draft had been emitted is lossy."""
    real = LogitAdjust.apply

    def without_drafts(self, logits, drafts=None):
        return torch.cat([real(self, logits[:, j:j + 1]) for j in range(logits.shape[1])], dim=1)
    monkeypatch.setattr(LogitAdjust, "apply", without_drafts)
    counts = sampled_counts(small_target, make_draft(small_target, "zlab", 4, seed=5))
    assert chi_square_p(counts, exact_penalised_first_three(small_target, SAMPLED)) < ALPHA
