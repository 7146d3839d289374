"""Shared statistics for the lossless-sampling tests: the exact distribution of the
first three generated tokens (enumerated) and a pooled chi-square test."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.decoding.sampling import RowSampler, warp


def exact_first_three(target, params: SamplingParams, prompt: list[int], vocab: int) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the warped target, flattened [V**3]."""
    sampler = RowSampler.from_params([params])
    seqs = [prompt + list(p) for p in itertools.product(range(vocab), repeat=2)]
    with torch.no_grad():
        logits = target(torch.tensor(seqs)).logits[:, len(prompt) - 1:]  # all prefixes in one batch
    probs = torch.cat([warp(logits[i:i + 1], sampler) for i in range(len(seqs))])  # [V*V, 3, V]
    p1 = probs[0, 0].view(-1, 1, 1)
    p2 = probs[::vocab, 1].view(vocab, vocab, 1)
    p3 = probs[:, 2].view(vocab, vocab, vocab)
    return (p1 * p2 * p3).flatten()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of counts against probs, cells with expected count < 5 pooled."""
    stats = pytest.importorskip("scipy.stats")
    probs = probs.flatten()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy() * float(obs.sum() / exp[keep].sum())).pvalue)


def first_three_counts(token_lists, vocab: int) -> torch.Tensor:
    """How often each (t1, t2, t3) was generated, flattened [V**3] as `exact_first_three`."""
    counts = torch.zeros(vocab ** 3)
    for a, b, c in (tokens[:3] for tokens in token_lists):
        counts[(a * vocab + b) * vocab + c] += 1
    return counts


def sampled_first_three(target, draft, params: SamplingParams, prompt: list[int], vocab: int, n: int
                        ) -> tuple[float, float]:
    """Generate three tokens for `prompt` n times (seeds 0..n-1, fixed windows) with `draft`:
    (the chi-square p-value of their joint counts against the target's exact distribution,
    the run's tau, so a caller can check the rule rather than the fallback made the tokens)."""
    from blockspec import PolicyOptions
    from blockspec.decoding.generate import generate

    rows = [SamplingParams(temperature=params.temperature, top_k=params.top_k, max_new_tokens=3, seed=i,
                           ignore_eos=True) for i in range(n)]
    out = generate(target, [prompt] * n, rows, draft=draft, policy=PolicyOptions(adapt=False))
    counts = first_three_counts([c.tokens for c in out.completions], vocab)
    return chi_square_p(counts, exact_first_three(target, params, prompt, vocab)), out.tau
