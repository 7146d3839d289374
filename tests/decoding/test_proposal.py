"""EAGLE-3 chain proposals through the one round: greedy output equals AR (ragged rows,
every chain length, fixed and adaptive policies); every chain the round drafts equals a
fresh recomputation from the committed sequence, also after long accepted runs and
rejections (the draft's KV rollback and its context's token pairing); sampled output
follows the target's distribution at temperature 1 with a draft vocabulary smaller than
the target's (q = 0 outside it)."""

from __future__ import annotations

import itertools

import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from blockspec import GenerateOptions, PolicyOptions
from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.decoding.proposal import Proposal
from blockspec.decoding.round import Forwards, WrappedForwards
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import Eagle3Drafter
from conftest import RAGGED_PROMPTS as PROMPTS
from conftest import make_draft, make_eagle3, make_target
from lossless_stats import sampled_first_three

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_chain_greedy_equals_ar(target64, ar_reference, k, batch):
    draft = Eagle3Drafter.pair(make_eagle3(target64), target64, k)
    prompts, expected = (PROMPTS, ar_reference) if batch > 1 else ([PROMPTS[2]], [ar_reference[2]])
    for policy in (PolicyOptions(adapt=False), None):   # fixed chains, then the adaptive policy
        out = generate(target64, prompts, GREEDY, draft=draft, policy=policy)
        assert [c.tokens for c in out.completions] == expected


class RecomputedChains(WrappedForwards):
    """Checks every chain against `Eagle3Draft.chain` over a fresh cache (the committed
    sequence's target features, one forward), then replaces the drafts by the target's own
    continuation with every third proposal corrupted, so that long accepted runs, partial
    runs and rejections all roll the draft's cache back."""

    def __init__(self, inner: Forwards, target, full: list[list[int]], emitted: dict[int, list[int]]) -> None:
        super().__init__(inner)
        self.target, self.full, self.emitted, self.calls, self.checked = target, full, emitted, itertools.count(1), 0

    def draft_chain(self, draft, draft_cache, sampler, g):
        proposal = self.inner.draft_chain(draft, draft_cache, sampler, g)
        if draft_cache.rows == len(self.full):   # no row has left: row r is prompt r
            for r in range(draft_cache.rows):
                seq = torch.tensor([PROMPTS[r] + self.emitted[r]])
                n = seq.shape[1] - 1   # committed positions; the last token is the anchor
                assert int(draft_cache.lengths[r]) == n
                layers = tuple(draft.config.target_layer_ids)
                feats = self.target(seq[:, :n], capture=layers, output="features").features
                fresh = draft.model.new_cache(1, n + g + 1)
                expected, _ = draft.model.chain(fresh, feats, seq[:, 1:], torch.tensor([n]), g, self.target.embed_tokens)
                assert torch.equal(proposal.tokens[r], expected[0]), f"row {r} at {n} positions"
                self.checked += 1
        tokens = proposal.tokens.clone()
        for r in range(tokens.shape[0]):
            p = int(draft_cache.lengths[r]) + 1
            for seq in self.full:
                if len(seq) > p and seq[:p] == (PROMPTS[r] + self.emitted[r])[:p]:
                    cont = seq[p:p + g]
                    tokens[r, :len(cont)] = torch.tensor(cont)
                    break
            if next(self.calls) % 3 == 0:
                tokens[r, g // 2] = (tokens[r, g // 2] + 1) % self.target.config.vocab_size
        return Proposal(tokens, None, None)


def test_every_chain_equals_a_fresh_recomputation(target64, ar_reference):
    draft = Eagle3Drafter.pair(make_eagle3(target64), target64, 5)
    emitted: dict[int, list[int]] = {r: [] for r in range(len(PROMPTS))}
    full = [p + ref for p, ref in zip(PROMPTS, ar_reference)]
    wrapped: list[RecomputedChains] = []

    def wrap(inner):
        wrapped.append(RecomputedChains(inner, target64, full, emitted))
        return wrapped[0]
    options = GenerateOptions(forwards=wrap, on_tokens=lambda r, toks: emitted[r].extend(toks))
    out = generate(target64, PROMPTS, GREEDY, draft=draft, policy=PolicyOptions(adapt=False), options=options)
    assert [c.tokens for c in out.completions] == ar_reference
    assert out.tau > 2.5 and wrapped[0].checked >= 9   # long runs accepted, and chains checked after them


VOCAB, N, ALPHA = 12, 12000, 1e-3
PROMPT = [3, 5, 7, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["T1", "T0.7-k5"])
def test_sampled_chains_follow_target_distribution(params):
    target = make_target(seed=3, vocab=VOCAB, dtype=torch.float64)
    # 8 of the 12 tokens: the draft never proposes the other 4, whose whole target mass
    # then comes from the residual.
    draft = Eagle3Drafter.pair(make_eagle3(target, draft_vocab=8, seed=5), target, 3)
    p_value, tau = sampled_first_three(target, draft, params, PROMPT, VOCAB, N)
    assert tau > 1.1   # drafts were accepted: the rule, not the fallback, made the tokens
    assert p_value > ALPHA


def test_methods_refuse_the_other_kind_of_draft(target64):
    eagle3 = Eagle3Drafter.pair(make_eagle3(target64), target64, 2)
    with pytest.raises(BlockspecError, match="cannot run this draft"):
        generate(target64, [PROMPTS[0]], GREEDY, draft=eagle3, method="dflash")
    with pytest.raises(BlockspecError, match="cannot run this draft"):
        generate(target64, [PROMPTS[0]], GREEDY, draft=make_draft(target64), method="eagle3")
    with pytest.raises(BlockspecError, match="compile"):
        generate(target64, [PROMPTS[0]], GREEDY, draft=eagle3, options=GenerateOptions(compile=True))
