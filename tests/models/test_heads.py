"""DSpark heads: the drafting loop's fused logits step equals base + the head's bias."""

from __future__ import annotations

import pytest
import torch

from blockspec.models.heads import MarkovHead


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
