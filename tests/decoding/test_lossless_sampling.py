"""Sampling is lossless: the first 3 generated tokens follow the exact target
distribution, whatever the draft proposes.

The test: a target with a 12-token vocabulary, so the 1728 possible 3-token
continuations can be enumerated and their exact probabilities computed from
the warped target distributions. N = 12000 seeded rows are generated in one
batch; cells with expected count < 5 are pooled, and a chi-square
goodness-of-fit test rejects at alpha = 1e-3 (false-alarm rate 0.1% per case).
Power is shown, not assumed: the same test on a deliberately lossy verifier
(accept every draft) must reject.
"""

from __future__ import annotations


import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from blockspec.config import SamplingParams
from blockspec import GenerateOptions
from blockspec.decoding.round import WrappedForwards
from blockspec.decoding.generate import generate
from blockspec.decoding.sampling import Verdict, warp
from lossless_stats import chi_square_p, exact_first_three
from conftest import make_draft, make_target

VOCAB, N, ALPHA = 12, 12000, 1e-3
PROMPT = [3, 5, 7, 2]


@pytest.fixture(scope="module")
def target():
    return make_target(seed=3, vocab=VOCAB, dtype=torch.float64)


def empirical_counts(target, draft, params: SamplingParams, rule: str = "rejection",
                     options: GenerateOptions | None = None) -> torch.Tensor:
    rows = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           max_new_tokens=3, seed=i, ignore_eos=True) for i in range(N)]
    out = generate(target, [PROMPT] * N, rows, draft=draft, rule=rule, options=options)
    counts = torch.zeros(VOCAB ** 3)
    for c in out.completions:
        a, b, d = c.tokens
        counts[(a * VOCAB + b) * VOCAB + d] += 1
    return counts


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.8),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_sampled_tokens_follow_target_distribution(target, params, method):
    if method == "dflash":
        draft = make_draft(target, "zlab", 4, seed=5)
    else:
        draft = make_draft(target, "deepspec", 3, seed=5, markov_rank=4, markov_type="gated", confidence=True)
    counts = empirical_counts(target, draft, params)
    assert chi_square_p(counts, exact_first_three(target, params, PROMPT, VOCAB)) > ALPHA


def test_sample_and_match_is_lossless(target):
    params = SamplingParams(temperature=1.0)
    counts = empirical_counts(target, make_draft(target, "zlab", 4, seed=5), params, rule="match")
    assert chi_square_p(counts, exact_first_three(target, params, PROMPT, VOCAB)) > ALPHA


def test_lossy_verifier_is_detected(target, monkeypatch):
    """Power check: accepting every draft gives the draft's distribution, and the test must see it."""
    class AcceptAll(WrappedForwards):
        def verdict(self, target_logits, drafts, draft_probs, sampler, num_drafts, rule):
            g = drafts.shape[1]
            bonus = torch.multinomial(warp(target_logits[:, g], sampler), 1, generator=sampler.generators[0])[:, 0]
            return Verdict(torch.full((drafts.shape[0],), g), bonus)

    params = SamplingParams(temperature=1.0)
    counts = empirical_counts(target, make_draft(target, "zlab", 4, seed=5), params,
                              options=GenerateOptions(forwards=AcceptAll))
    assert chi_square_p(counts, exact_first_three(target, params, PROMPT, VOCAB)) < ALPHA
