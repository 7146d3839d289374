"""The buffered draft context (decoding/context.py): a long AR stretch keeps a bounded
buffer and never feeds the draft; drafting again rebuilds the context from the recent window."""

from __future__ import annotations

import pytest
import torch

from blockspec.decoding.context import SETTLE_ROUNDS, PendingContext
from blockspec.errors import BlockspecError
from conftest import make_draft, make_target


def setup(rows: int = 3, capacity: int = 16):
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, "zlab", 4, dtype=torch.float64)
    cache = draft.new_cache(rows, 256)
    feat = len(draft.config.target_layer_ids) * draft.config.hidden_size
    return draft, cache, PendingContext(draft, cache, capacity), feat


def test_a_long_ar_stretch_keeps_a_bounded_buffer_and_never_feeds_the_draft(monkeypatch):
    draft, cache, pending, feat = setup()
    cache.lengths[:] = torch.tensor([5, 7, 9])             # the prompts' context (prefill)
    appended = []
    real = draft.append_context
    monkeypatch.setattr(draft, "append_context", lambda *a: (appended.append(a[1].shape), real(*a)))
    torch.manual_seed(0)
    stream = torch.randn(3, 500, feat, dtype=torch.float64)
    for t in range(500):                                    # 500 AR rounds: one feature per row each
        pending.add(stream[:, t:t + 1], torch.ones(3, dtype=torch.long))
        assert int(pending.lengths.max()) <= pending.capacity
    assert appended == [] and pending.buf.shape == (3, 16, feat)   # nothing reached the draft
    assert cache.lengths.tolist() == [5, 7, 9] and pending.cut.all()
    n = int(pending.lengths[0])
    assert pending.keep <= n < pending.capacity - draft.config.num_drafts
    assert torch.equal(pending.buf[:, :n], stream[:, 500 - n:])    # exactly the latest features, in order
    pending.flush(2)                                        # rows 0 and 1 draft again
    assert cache.lengths.tolist() == [n, n, 9] and pending.cut.tolist() == [False, False, True]
    # Their draft context is the recent window at positions 0..n-1, as if appended to an empty cache.
    fresh = draft.new_cache(2, 256)
    real(fresh, stream[:2, 500 - n:], n)
    assert cache.k[:, :2, :, :n].abs().sum() > 0
    for layer in range(len(draft.layers)):
        assert torch.equal(cache.k[layer, :2, :, :n], fresh.k[layer, :, :, :n])


def test_a_short_stretch_still_appends_the_whole_buffer_in_order():
    draft, cache, pending, feat = setup(rows=2)
    cache.lengths[:] = torch.tensor([4, 6])
    stream = torch.randn(2, 5, feat, dtype=torch.float64)
    for t in range(5):
        pending.add(stream[:, t:t + 1], torch.ones(2, dtype=torch.long))
    pending.flush(2)
    assert cache.lengths.tolist() == [9, 11] and not pending.cut.any()


def test_rows_moved_by_the_engine_keep_their_cut_mark():
    draft, cache, pending, feat = setup(rows=3)
    for _ in range(14):                                     # rows 0 and 1 run a long AR stretch
        pending.add(torch.randn(2, 1, feat, dtype=torch.float64), torch.ones(2, dtype=torch.long))
    assert pending.cut.tolist() == [True, True, False]
    pending.swap(1, 2)
    assert pending.cut.tolist() == [True, False, True]
    pending.move_rows([2], [1])
    assert pending.cut.tolist() == [True, True, False]
    pending.clear(0, 1)
    assert pending.cut.tolist() == [False, True, False]


def test_a_keep_window_that_cannot_fit_is_refused():
    draft, cache, _, _ = setup()
    with pytest.raises(BlockspecError, match="keep"):
        PendingContext(draft, cache, 16, keep=16 - draft.config.num_drafts)


def test_seeded_prompts_enter_the_draft_context_when_their_rows_first_draft(monkeypatch):
    """Prompts wait (`seed`) and reach the draft, before the rounds' buffered features and
    exactly as an eager append would put them, only when their rows draft."""
    draft, cache, pending, feat = setup(rows=3)
    torch.manual_seed(0)
    prompts = torch.randn(3, 6, feat, dtype=torch.float64)
    lengths = torch.tensor([6, 4, 5])
    rounds = torch.randn(3, 2, feat, dtype=torch.float64)
    pending.seed(0, prompts, lengths)
    for t in range(2):
        pending.add(rounds[:, t:t + 1], torch.ones(3, dtype=torch.long))
    assert cache.lengths.tolist() == [0, 0, 0]              # nothing ran the draft yet
    pending.flush(2)                                        # rows 0 and 1 draft
    assert cache.lengths.tolist() == [8, 6, 0] and pending.prompts[2] is not None
    eager = draft.new_cache(2, 256)
    draft.append_context(eager, prompts[:2], lengths[:2])
    draft.append_context(eager, rounds[:2], 2)
    for layer in range(len(draft.layers)):
        for r, n in enumerate([8, 6]):
            torch.testing.assert_close(cache.k[layer, r, :, :n], eager.k[layer, r, :, :n], rtol=0, atol=1e-12)
            torch.testing.assert_close(cache.v[layer, r, :, :n], eager.v[layer, r, :, :n], rtol=0, atol=1e-12)
    with pytest.raises(BlockspecError, match="empty row"):
        pending.seed(0, prompts[:1], lengths[:1])           # row 0 already has context


def test_a_prompt_longer_than_the_prompt_capacity_enters_the_draft_context_at_once():
    """An engine budgets `prompt_capacity` waiting features per row: a longer prompt is
    appended at prefill (as an eager append would), a shorter one waits as a copy (the
    batch's features are not kept alive)."""
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, "zlab", 4, dtype=torch.float64)
    cache = draft.new_cache(3, 256)
    pending = PendingContext(draft, cache, 16, prompt_capacity=5)
    feat = len(draft.config.target_layer_ids) * draft.config.hidden_size
    torch.manual_seed(0)
    prompts = torch.randn(2, 8, feat, dtype=torch.float64)
    pending.seed(1, prompts, torch.tensor([8, 5]))          # rows 1 (too long) and 2 (fits)
    assert cache.lengths.tolist() == [0, 8, 0]
    assert pending.prompts[1] is None and torch.equal(pending.prompts[2][0], prompts[1, :5])
    assert pending.prompts[2][0].untyped_storage().data_ptr() != prompts.untyped_storage().data_ptr()
    eager = draft.new_cache(1, 256)
    draft.append_context(eager, prompts[:1], 8)
    torch.testing.assert_close(cache.k[:, 1, :, :8], eager.k[:, 0, :, :8], rtol=0, atol=0)
    pending.flush(3)
    assert cache.lengths.tolist() == [0, 8, 5] and pending.prompts == [None, None, None]


def test_finished_rows_leave_without_running_the_draft(monkeypatch):
    draft, cache, pending, feat = setup(rows=3)
    appended = []
    monkeypatch.setattr(draft, "append_context", lambda *a: appended.append(a))
    prompts = torch.randn(3, 5, feat, dtype=torch.float64)
    pending.seed(0, prompts, torch.tensor([5, 3, 4]))
    pending.add(torch.randn(3, 1, feat, dtype=torch.float64), torch.ones(3, dtype=torch.long))
    pending.keep_rows([2, 0])                               # row 1 finished: rows 2, 0 become 0, 1
    assert appended == []
    assert [p[0].shape[0] for p in pending.prompts[:2]] == [4, 5] and pending.prompts[2] is None
    assert torch.equal(pending.prompts[0][0], prompts[2, :4])
    assert pending.lengths.tolist() == [1, 1, 0]


def test_ar_rounds_are_written_together_and_read_as_if_written_each_round():
    """An AR round's features are kept as they come and written a few rounds at a time (one
    copy, not a write and its bookkeeping per round); every read, move or multi-token add
    sees them in place, in order."""
    draft, cache, pending, feat = setup(capacity=64)
    every = pending._settle_every
    assert every == min(SETTLE_ROUNDS, draft.config.num_drafts + 1)
    torch.manual_seed(1)
    stream = torch.randn(3, 40, feat, dtype=torch.float64)
    ones = torch.ones(3, dtype=torch.long)
    for t in range(every - 1):
        pending.add(stream[:, t:t + 1], ones)
    assert pending._lengths.tolist() == [0, 0, 0] and len(pending._ar) == every - 1   # kept, not written
    pending.add(stream[:, every - 1:every], ones)
    assert pending._lengths.tolist() == [every] * 3 and pending._ar == []              # written together
    for t in range(every, every + 3):
        pending.add(stream[:, t:t + 1], ones)
    n = every + 3
    pending.add(stream[:, n:n + 3], torch.tensor([2, 1, 3]))   # a drafting round's ragged add sees them first
    assert pending.lengths.tolist() == [n + 2, n + 1, n + 3]
    for row, length in enumerate([n + 2, n + 1, n + 3]):
        assert torch.equal(pending.buf[row, :length], stream[row, :length])
    pending.add(stream[:, 0:1], ones)
    pending.swap(0, 2)                                          # a move writes them first too
    assert pending.lengths.tolist() == [n + 4, n + 2, n + 3]
    assert torch.equal(pending.buf[0, n + 3], stream[2, 0]) and torch.equal(pending.buf[2, n + 2], stream[0, 0])
