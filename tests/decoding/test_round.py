"""The one round's parameters and observers: per-row random streams, the early stop
on the policy's survival, stop strings in `generate`, round observers and
acceptance."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.engine.engine import Engine
from blockspec.decoding.generate import generate
from blockspec.decoding.planner import plan
from blockspec.decoding.policy import ConfidenceCalibration
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.round import propose
from blockspec.decoding.sampling import RowSampler, verify, warp
from blockspec.errors import BlockspecError
from blockspec import GenerateOptions, PolicyOptions
from conftest import make_draft

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13]]


def test_a_rows_draws_do_not_depend_on_how_far_its_neighbours_verify():
    """Row 0's verdict and its generator's next draw are the same whether row 1
    verifies five drafts or none (each row draws for its own positions only)."""
    gen = torch.Generator().manual_seed(0)
    vocab, g = 7, 5
    logits = torch.randn(2, g + 1, vocab, generator=gen, dtype=torch.float64)
    drafts = torch.randint(0, vocab, (2, g), generator=gen)
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.8, seed=4)]
    probs = warp(torch.randn(2, g, vocab, generator=gen, dtype=torch.float64),
                 RowSampler.from_params(params))
    results = []
    for neighbour in (5, 0, 2):
        sampler = RowSampler.from_params(params)
        w = max(2, neighbour)   # the batch verifies up to its widest row, as the packed round does
        verdict = verify(logits[:, :w + 1], drafts[:, :w], probs[:, :w], sampler, torch.tensor([2, neighbour]))
        results.append((int(verdict.accepted[0]), int(verdict.bonus[0]),
                        float(torch.rand(1, generator=sampler.generators[0]))))
    assert results[0] == results[1] == results[2]


def test_early_stop_uses_the_survival_the_planner_uses(target64):
    """With recalibration that raises the confidences, drafting stops no earlier than the
    planner would admit: the planned lengths of the early-stopped proposal equal those of
    the full one, and the proposal carries both the raw and the planned confidences."""
    draft = make_draft(target64, "deepspec", 8, markov_rank=8, confidence=True)
    table = CostTable([1, 8, 64], [1.0, 1.1, 3.0])
    calib = ConfidenceCalibration(draft.config.num_drafts)
    calib.accepted += 30.0      # the head under-rates acceptance by about 3x
    calib.expected += 10.0
    gen = torch.Generator().manual_seed(0)
    floor, longer = 0.3, 0
    for trial in range(12):
        rows = 1 + trial % 3
        cache = draft.new_cache(rows, 64)
        feats = torch.randn(rows, 5, len(draft.config.target_layer_ids) * target64.config.hidden_size,
                            generator=gen, dtype=torch.float64)
        draft.append_context(cache, feats, 5)
        anchors = torch.randint(0, target64.config.vocab_size, (rows,), generator=gen)
        sampler = RowSampler.from_params([SamplingParams()] * rows)
        with torch.no_grad():
            full = propose(draft, target64, cache, anchors, sampler, confidence_map=calib.apply)
            short = propose(draft, target64, cache, anchors, sampler, stop_below=floor, confidence_map=calib.apply)
            raw_only = propose(draft, target64, cache, anchors, sampler, stop_below=floor)
        g = short.tokens.shape[1]
        torch.testing.assert_close(short.confidence, calib.apply(short.raw_confidence))
        torch.testing.assert_close(short.raw_confidence, full.raw_confidence[:, :g])
        assert torch.equal(plan(short.confidence.cumprod(1), table, 0.0, floor),
                           plan(full.confidence.cumprod(1), table, 0.0, floor))
        longer += g > raw_only.tokens.shape[1]
    assert longer > 0   # the raw survival would have stopped drafting too early


class CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) * (1 + i % 2) for i in ids)


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_generate_honours_stop_strings_like_the_engine(target64, method):
    tok = CharTokenizer()
    draft = make_draft(target64, "zlab", 4) if method == "dflash" else None
    plain = generate(target64, [PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True), draft=draft)
    text = tok.decode(plain.completions[0].tokens)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop=["zzzz", text[9:12]])
    out = generate(target64, [PROMPTS[0]], params, draft=draft, options=GenerateOptions(tokenizer=tok)).completions[0]
    engine = Engine(target64, draft, method, max_running=1, max_model_len=64, tokenizer=tok)
    ref = engine.generate([PROMPTS[0]], params)[0]
    assert out.finish_reason == ref.finish_reason == "stop"
    assert out.text == ref.text == text[:text.find(text[9:12])]
    assert out.tokens == ref.tokens
    with pytest.raises(BlockspecError, match="tokenizer"):
        generate(target64, [PROMPTS[0]], params, draft=draft)


def test_observers_see_every_round(target64):
    draft = make_draft(target64, "deepspec", 4, markov_rank=4, confidence=True)
    seen = []

    class Observer:
        def on_round(self, outcome, requests):
            seen.append((list(requests), list(outcome.accepted), outcome.raw_confidence.shape))

    params = SamplingParams(max_new_tokens=17, ignore_eos=True)
    out = generate(target64, PROMPTS, params, draft=draft, policy=PolicyOptions(adapt=False),
                   options=GenerateOptions(observer=Observer()))
    assert len(seen) == out.timing.rounds
    assert [a for requests, acc, _ in seen for r, a in zip(requests, acc) if r == 1] == \
        out.completions[1].stats.accepted
    assert all(shape == (len(requests), draft.config.num_drafts) for requests, _, shape in seen)


def test_padded_proposals_keep_the_confidences_the_gate_learns_from():
    """Issue 28: the same 2 drafting rows learn the same survival in a 2-row batch and in a
    4-row batch where the other 2 rows take AR steps (padding used to drop the confidences,
    so survival past the verified slots read 0 and DSpark's gate stopped drafting)."""
    from blockspec.decoding.policy import measured_survival
    from blockspec.decoding.round import Proposal, pad_rows
    tokens = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    confidence = torch.full((2, 5), 0.9)
    proposal = Proposal(tokens, None, confidence, confidence.clone())
    verified, accepted = [2, 2], [2, 1]
    alone = measured_survival(5, proposal.confidence, verified, accepted)
    padded = pad_rows(proposal, 4)
    assert padded.confidence is not None and torch.equal(padded.confidence[:2], confidence)
    assert torch.equal(padded.confidence[2:], torch.zeros(2, 5))
    in_batch = measured_survival(5, padded.confidence[:2], verified, accepted)
    assert in_batch == alone
    assert in_batch[0] == pytest.approx([1, 1, 0.9, 0.81, 0.729])
    assert in_batch[1] == [1, 0, 0, 0, 0]
