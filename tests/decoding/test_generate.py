"""Greedy speculative output == AR greedy output, for every method, layout, block
size and batch mix; and the KV cache's rollback."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.decoding.sampling import RowSampler
from blockspec.decoding.prefill import ContextSink, padding_groups, prefill
from blockspec.decoding.round import Forwards, Proposal, WrappedForwards
from blockspec.errors import BlockspecError
from blockspec import GenerateOptions, PolicyOptions
from conftest import make_draft, oracle_tokens

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
DRAFTS = [
    ("zlab", 0, "vanilla", False),
    ("deepspec", 0, "vanilla", False),
    ("deepspec", 4, "vanilla", True),
    ("deepspec", 4, "gated", True),
    ("deepspec", 4, "rnn", True),
]


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("layout, rank, kind, confidence", DRAFTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_random_draft_greedy_equals_ar(target64, ar_reference, block_size, layout, rank, kind, confidence, batch):
    draft = make_draft(target64, layout, block_size, markov_rank=rank, markov_type=kind, confidence=confidence)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[2]]
    expected = ar_reference[:batch] if batch > 1 else [ar_reference[2]]
    out = generate(target64, prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), draft=draft)
    assert [c.tokens for c in out.completions] == expected


class OracleForwards(WrappedForwards):
    """Forwards whose proposal drafts the target's own greedy continuation (found by
    matching position + anchor against the reference), corrupting some slots,
    so that long accepted runs, partial runs and full rejections all occur."""

    def __init__(self, inner: Forwards, reference: list[list[int]], corrupt_every: int) -> None:
        super().__init__(inner)
        self.reference, self.corrupt_every, self.calls = reference, corrupt_every, itertools.count(1)

    def propose(self, draft, target, draft_cache, anchors, sampler, block=None, *rest):
        proposal = self.inner.propose(draft, target, draft_cache, anchors, sampler, block, *rest)
        tokens = oracle_tokens(proposal.tokens, draft_cache, anchors, self.reference, self.calls, self.corrupt_every,
                               target.config.vocab_size)
        probs = torch.nn.functional.one_hot(tokens, target.config.vocab_size).double()
        return Proposal(tokens, probs, proposal.confidence)


@pytest.mark.parametrize("layout, rank, kind, confidence", [DRAFTS[0], DRAFTS[2]])
@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_drafts_long_runs_and_stop_inside_run(monkeypatch, target64, ar_reference, layout, rank, kind,
                                                      confidence, block_size):
    full = [p + a for p, a in zip(PROMPTS, ar_reference)]
    oracle = GenerateOptions(forwards=lambda inner: OracleForwards(inner, full, corrupt_every=3))
    draft = make_draft(target64, layout, block_size, markov_rank=rank, markov_type=kind, confidence=confidence)
    # Fixed windows: every round drafts, so the oracle's long runs are what is tested.
    out = generate(target64, PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True), draft=draft,
                   policy=PolicyOptions(adapt=False), options=oracle)
    assert [c.tokens for c in out.completions] == ar_reference
    assert out.tau > 2.0  # long accepted runs really happened
    # A stop token that occurs mid-continuation truncates inside an accepted run.
    stop = ar_reference[0][9]
    cut = [ref[:ref.index(stop)] if stop in ref else ref for ref in ar_reference]
    out = generate(target64, PROMPTS, SamplingParams(max_new_tokens=24, stop_token_ids=[stop], ignore_eos=True),
                   draft=draft, policy=PolicyOptions(adapt=False), options=oracle)
    assert [c.tokens for c in out.completions] == cut
    assert [c.finish_reason for c in out.completions][0] == "stop"
    # max_new_tokens inside an accepted run
    out = generate(target64, PROMPTS, SamplingParams(max_new_tokens=7, ignore_eos=True), draft=draft,
                   policy=PolicyOptions(adapt=False), options=oracle)
    assert [c.tokens for c in out.completions] == [ref[:7] for ref in ar_reference]


@pytest.mark.parametrize("layout, rank, kind, confidence", [DRAFTS[0], DRAFTS[2]])
@pytest.mark.parametrize("types", [("sliding_attention",), ("full_attention", "sliding_attention")])
def test_windowed_drafts_greedy_equals_ar(target64, ar_reference, layout, rank, kind, confidence, types):
    """Issue 34: sliding-window drafts (a window of 3, so the ring wraps) are lossless, with
    oracle runs (rollback after long accepted runs) and with their own random proposals."""
    draft = make_draft(target64, layout, 4, markov_rank=rank, markov_type=kind, confidence=confidence,
                       layers=len(types), layer_types=types, sliding_window=3)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    out = generate(target64, PROMPTS, sp, draft=draft, policy=PolicyOptions(adapt=False))
    assert [c.tokens for c in out.completions] == ar_reference
    full = [p + a for p, a in zip(PROMPTS, ar_reference)]
    oracle = GenerateOptions(forwards=lambda inner: OracleForwards(inner, full, corrupt_every=3))
    out = generate(target64, PROMPTS, sp, draft=draft, policy=PolicyOptions(adapt=False), options=oracle)
    assert [c.tokens for c in out.completions] == ar_reference and out.tau > 2.0
    with pytest.raises(BlockspecError, match="sliding-window drafts"):
        generate(target64, PROMPTS, sp, draft=draft, options=GenerateOptions(compile=True))


def test_eos_stops_and_is_not_emitted(target64, ar_reference):
    eos = ar_reference[1][5]
    config = target64.config
    target64.config = dataclasses.replace(config, eos_token_id=[eos])
    try:
        out = generate(target64, [PROMPTS[1]], SamplingParams(max_new_tokens=24))
    finally:
        target64.config = config
    assert out.completions[0].tokens == ar_reference[1][:ar_reference[1].index(eos)]
    assert out.completions[0].finish_reason == "stop"


def test_kv_rollback_then_reappend_matches_fresh_forward(target64):
    seq = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    cache = target64.new_cache(1, 32)
    target64(seq[:, :6], cache)
    target64(torch.tensor([[7, 7, 7]]), cache)  # a rejected draft
    cache.truncate(torch.tensor([6]))
    tail = target64(seq[:, 6:], cache).logits
    fresh = target64(seq).logits[:, 6:]
    assert torch.allclose(tail, fresh, atol=1e-10)


def test_bad_inputs(target64):
    with pytest.raises(BlockspecError, match="supports 256"):
        generate(target64, [[1] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(BlockspecError, match="empty"):
        generate(target64, [[]], SamplingParams())
    with pytest.raises(BlockspecError, match="needs a draft"):
        generate(target64, [[1]], SamplingParams(), method="dflash")
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(BlockspecError):
            SamplingParams(**bad)


def test_ar_sampling_is_seeded_and_batch_independent(target64):
    sp = SamplingParams(temperature=0.9, top_k=10, seed=7, max_new_tokens=10, ignore_eos=True)
    alone = generate(target64, [PROMPTS[0]], sp).completions[0].tokens
    other = SamplingParams(temperature=1.0, seed=1, max_new_tokens=5, ignore_eos=True)
    mixed = generate(target64, [PROMPTS[1], PROMPTS[0]], [other, sp]).completions[1].tokens
    assert alone == mixed and len(alone) == 10


def test_padding_groups_bound_the_padding():
    assert padding_groups([]) == []
    assert padding_groups([5, 5, 5]) == [(0, 3)]
    assert padding_groups([10, 100, 100, 10]) == [(0, 1), (1, 3), (3, 4)]
    assert padding_groups([8, 10, 9, 50], max_padding=0.25) == [(0, 3), (3, 4)]
    lengths = [3, 40, 7, 7, 8, 120, 30, 31, 29, 2]
    groups = padding_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(b == c for (_, b), (c, _) in zip(groups, groups[1:]))     # contiguous, covering
    for a, b in groups:
        if b - a > 1:
            assert max(lengths[a:b]) * (b - a) <= 1.25 * sum(lengths[a:b])


def test_grouped_prefill_equals_prefill_one_by_one(target64):
    """Prompts of very different lengths run in groups; each row's cache, draft context
    and sampled first token equal running that prompt alone."""
    draft = make_draft(target64, "zlab", 4).double()
    prompts = [[1, 2, 3], list(range(5, 45)), [6, 7, 8, 9], list(range(3, 33)), [9] * 2]
    assert len(padding_groups([len(p) for p in prompts])) > 1
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(len(prompts))]
    cache, dcache = target64.new_cache(len(prompts), 64), draft.new_cache(len(prompts), 80)
    anchors = prefill(target64, cache, prompts, RowSampler.from_params(params), ContextSink(draft, dcache)).anchors
    for r, (prompt, p) in enumerate(zip(prompts, params)):
        one, done = target64.new_cache(1, 64), draft.new_cache(1, 80)
        alone = prefill(target64, one, [prompt], RowSampler.from_params([p]), ContextSink(draft, done)).anchors
        assert int(alone[0]) == int(anchors[r])
        n, dn = int(one.lengths[0]), int(done.lengths[0])
        assert int(cache.lengths[r]) == n and int(dcache.lengths[r]) == dn
        assert torch.allclose(cache.k[:, r, :, :n], one.k[:, 0, :, :n]) and torch.allclose(
            cache.v[:, r, :, :n], one.v[:, 0, :, :n])
        assert torch.allclose(dcache.k[:, r, :, :dn], done.k[:, 0, :, :dn])


def test_measuring_the_cost_table_is_setup_time_not_decoding_time(target64, tmp_path, monkeypatch):
    """The first speculative call measures the cost table: `Timing.policy_s` holds it, apart
    from prefill / draft / verify (the CLI starts its clock after building the policy)."""
    import time

    from blockspec.decoding import table_cache

    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(table_cache, "_MEMO", {})
    real = table_cache.profile_cost_table

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)
    monkeypatch.setattr(table_cache, "profile_cost_table", slow)
    draft = make_draft(target64, "zlab", 4)
    out = generate(target64, [PROMPTS[0]], SamplingParams(max_new_tokens=4, ignore_eos=True), draft=draft)
    t = out.timing
    assert t.policy_s >= 0.3 and t.prefill_s + t.draft_s + t.verify_s < t.policy_s
    again = generate(target64, [PROMPTS[0]], SamplingParams(max_new_tokens=4, ignore_eos=True), draft=draft)
    assert again.timing.policy_s < 0.3                      # cached: nothing measured
