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

import itertools

import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from blockspec.config import SamplingParams
from blockspec.decoding import speculate
from blockspec.decoding.generate import generate
from blockspec.decoding.sampling import RowSampler, Verdict, warp
from conftest import make_draft, make_target

VOCAB, N, ALPHA = 12, 12000, 1e-3
PROMPT = [3, 5, 7, 2]


@pytest.fixture(scope="module")
def target():
    return make_target(seed=3, vocab=VOCAB, dtype=torch.float64)


def exact_distribution(target, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the warped target, as a [V, V, V] tensor."""
    sampler = RowSampler.from_params([params])
    seqs = [PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=2)]
    with torch.no_grad():
        logits = target(torch.tensor(seqs)).logits  # all prefixes in one batch
    n = len(PROMPT)
    rows = [warp(logits[i:i + 1, n - 1:n + 2], sampler)[0] for i in range(len(seqs))]
    p1 = rows[0][0]
    p2 = torch.stack([rows[a * VOCAB][1] for a in range(VOCAB)])                      # [t1, t2]
    p3 = torch.stack([rows[a * VOCAB + b][2] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return p1.view(-1, 1, 1) * p2.view(VOCAB, VOCAB, 1) * p3


def empirical_counts(target, draft, params: SamplingParams, rule: str = "rejection") -> torch.Tensor:
    rows = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           max_new_tokens=3, seed=i, ignore_eos=True) for i in range(N)]
    out = generate(target, [PROMPT] * N, rows, draft=draft, rule=rule)
    counts = torch.zeros(VOCAB ** 3)
    for c in out.completions:
        a, b, d = c.tokens
        counts[(a * VOCAB + b) * VOCAB + d] += 1
    return counts


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    return float(scipy_stats.chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp[keep].sum().item()).pvalue)


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
    assert chi_square_p(counts, exact_distribution(target, params)) > ALPHA


def test_sample_and_match_is_lossless(target):
    params = SamplingParams(temperature=1.0)
    counts = empirical_counts(target, make_draft(target, "zlab", 4, seed=5), params, rule="match")
    assert chi_square_p(counts, exact_distribution(target, params)) > ALPHA


def test_lossy_verifier_is_detected(target, monkeypatch):
    """Power check: accepting every draft gives the draft's distribution, and the test must see it."""
    def accept_all(target_logits, drafts, draft_probs, sampler, num_drafts=None, rule="rejection"):
        g = drafts.shape[1]
        bonus = torch.multinomial(warp(target_logits[:, g], sampler), 1, generator=sampler.generators[0])[:, 0]
        return Verdict(torch.full((drafts.shape[0],), g), bonus)

    monkeypatch.setattr(speculate, "verify", accept_all)
    params = SamplingParams(temperature=1.0)
    counts = empirical_counts(target, make_draft(target, "zlab", 4, seed=5), params)
    assert chi_square_p(counts, exact_distribution(target, params)) < ALPHA
