"""DSpark heads: the drafting loop's fused logits step equals base + the head's bias."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from blockspec.models.draft import DraftModel
from blockspec.models.heads import MarkovHead
from conftest import make_draft, make_target


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_add_to_equals_base_plus_step_bias(kind):
    torch.manual_seed(0)
    head = MarkovHead(vocab=50, hidden=16, rank=8, kind=kind)
    torch.nn.init.normal_(head.markov_w2.weight)   # zero at init: make the bias visible
    base, prev, h = torch.randn(3, 50), torch.tensor([1, 7, 49]), torch.randn(3, 16)
    state = head.initial_state(3, h)
    with torch.inference_mode():
        bias, want_state = head.step(prev, h, state)
        logits, got_state = head.add_to(base, prev, h, state)
    torch.testing.assert_close(logits, base + bias)
    assert (got_state is None) == (want_state is None)
    if got_state is not None:
        torch.testing.assert_close(got_state, want_state)
    assert logits.abs().sub(base.abs()).abs().max() > 0.1   # the bias really changed the logits


@pytest.mark.parametrize("with_markov", [True, False])
def test_split_confidence_equals_the_heads_projection(with_markov):
    """Drafting computes the confidence logit as a hidden-state part plus a looked-up
    previous-token part; it equals the head's own projection of [h; w1[prev]], slot by
    slot as for the whole block, with per-slot temperatures."""
    target = make_target()
    draft: DraftModel = make_draft(target, "deepspec", 5, markov_rank=4, confidence=True)
    if not with_markov:   # a head over the hidden state alone (confidence_head_with_markov false)
        draft.confidence_head.proj = torch.nn.Linear(draft.config.hidden_size, 1)
    torch.manual_seed(3)
    torch.nn.init.normal_(draft.confidence_head.proj.weight)
    draft = draft.with_config(replace(draft.config, confidence_temperatures=[0.5, 1.0, 2.0, 1.5, 0.8]))
    h, prev = torch.randn(3, 5, draft.config.hidden_size), torch.randint(0, target.config.vocab_size, (3, 5))
    embed = draft.markov_head.markov_w1(prev) if with_markov else None
    temps = torch.tensor(draft.config.confidence_temperatures)
    proj = draft.confidence_head.proj
    want = torch.sigmoid(proj(h if embed is None else torch.cat([h, embed], dim=-1)).squeeze(-1) / temps)
    torch.testing.assert_close(draft.confidence_logit(h, prev), draft.confidence_head.logit(h, embed))
    torch.testing.assert_close(torch.sigmoid(draft.confidence_logit(h, prev) / temps), want)
    with torch.inference_mode():
        got = draft.confidence(h, prev)
        h_term, prev_term = draft.confidence_terms(h)
        one = draft.confidence_from(h_term[:, 2:3], prev_term, prev[:, 2:3], first_slot=2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(one, got[:, 2:3])
    assert (prev_term is None) == (not with_markov)
