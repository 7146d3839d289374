"""Sliding-window drafts at inference (models/window_cache.py, DraftModel.block_hidden): the
ring keeps only W + block - 1 positions, the block equals a dense masked reference built from
the definition (docs/design.md section 3.2) across rounds, ragged appends and ring wraps, and a
window covering the whole context is the full draft bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.window_cache import WindowedKVCache
from conftest import make_draft, make_target
from host_reads import HostReads

F, S = "full_attention", "sliding_attention"


@pytest.fixture(scope="module")
def target():
    return make_target()


def windowed(target, types, window, causal=None, block=4, seed=1) -> DraftModel:
    base = make_draft(target, "zlab", block, seed=seed, layers=len(types))
    draft = DraftModel(dataclasses.replace(base.config, layer_types=types, sliding_window=window, causal=causal))
    draft.load_state_dict(base.state_dict())
    return draft.eval().requires_grad_(False)


def reference_block(draft: DraftModel, feats: list[torch.Tensor], block_ids: torch.Tensor, embed) -> torch.Tensor:
    """The block by definition: every context position's K/V (training forward), and per layer
    query q = L_r + t sees context j when j > q - W, block slot u when L_r + u > q - W and
    (u <= t if causal)."""
    cfg = draft.config
    rows, width = block_ids.shape
    longest = max(f.shape[0] for f in feats)
    ctx = torch.zeros(rows, longest, feats[0].shape[1])
    for r, f in enumerate(feats):
        ctx[r, :f.shape[0]] = f
    lengths = [f.shape[0] for f in feats]
    masks = []
    for i in range(cfg.num_hidden_layers):
        window, causal = cfg.layer_window(i), cfg.layer_causal(i)
        m = torch.zeros(rows, 1, width, longest + width, dtype=torch.bool)
        for r, n in enumerate(lengths):
            for t in range(width):
                q = n + t
                for j in range(n):
                    m[r, 0, t, j] = window is None or j > q - window
                for u in range(width):
                    m[r, 0, t, longest + u] = (window is None or n + u > q - window) and (not causal or u <= t)
        masks.append(m)
    positions = torch.tensor(lengths).view(-1, 1) + torch.arange(width)
    return draft(ctx, block_ids, positions, masks, embed)


def run_rounds(draft, target, rounds, seed=0, rows=2):
    """Ragged appends (prefill, then 1..block accepted per round) and a block forward after each:
    (block hidden states, what the reference gives, the cache)."""
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    dim = len(cfg.target_layer_ids) * cfg.hidden_size
    cache = draft.new_cache(rows, 200)
    feats = [torch.empty(0, dim) for _ in range(rows)]
    got, want = [], []
    counts = torch.tensor([9, 3][:rows])
    for step in range(rounds):
        width = int(counts.max())
        new = torch.randn(rows, width, dim, generator=g)
        draft.append_context(cache, new, counts)
        feats = [torch.cat([f, new[r, :counts[r]]]) for r, f in enumerate(feats)]
        block = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
        got.append(draft.block_hidden(block, cache, target.embed_tokens))
        want.append(reference_block(draft, feats, block, target.embed_tokens))
        counts = torch.randint(1, cfg.block_size + 1, (rows,), generator=g)
    return got, want, cache


@pytest.mark.parametrize("types, window, causal", [
    ((S,), 3, None), ((F, S, S), 5, None), ((S, F), 6, False), ((S, S), 1, None), ((F, F), None, True)])
def test_windowed_block_equals_the_dense_reference(target, types, window, causal):
    if window is not None:
        draft = windowed(target, types, window, causal)
    else:   # causal full layers (the causal override alone)
        base = make_draft(target, "zlab", 4, layers=2)
        draft = DraftModel(dataclasses.replace(base.config, causal=True))
        draft.load_state_dict(base.state_dict())
        draft.eval()
    got, want, cache = run_rounds(draft, target, rounds=8)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if window is not None:   # the ring wrapped: the rows are longer than it
        assert isinstance(cache, WindowedKVCache) and int(cache.lengths.min()) > cache.span


def test_a_window_covering_the_context_is_the_full_draft_bit_exact(target):
    full = make_draft(target, "zlab", 4, layers=2)
    wide = windowed(target, (S, S), 1000, causal=False)
    a, _, _ = run_rounds(full, target, rounds=6)
    b, _, cache = run_rounds(wide, target, rounds=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for rows in (1,):   # one row takes the no-mask path
        a1, _, _ = run_rounds(full, target, rounds=3, rows=rows)
        b1, _, _ = run_rounds(wide, target, rounds=3, rows=rows)
        assert all(torch.equal(x, y) for x, y in zip(a1, b1))


def test_the_ring_keeps_only_the_window(target):
    draft = windowed(target, (F, S, S), 8)
    cache = draft.new_cache(3, 4096)
    full = make_draft(target, "zlab", 4, layers=3).new_cache(3, 4096)
    assert isinstance(full, KVCache) and cache.span == 8 + 4 - 1
    per_layer = full.nbytes // 3
    assert cache.nbytes == per_layer + 2 * per_layer * cache.span // 4096


def test_row_moves_and_swaps_keep_the_ring(target):
    draft = windowed(target, (F, S), 3)
    got, _, cache = run_rounds(draft, target, rounds=5, rows=2)
    block = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(5))
    before = draft.block_hidden(block, cache, target.embed_tokens)
    cache.swap_rows(0, 1)
    swapped = draft.block_hidden(block.flip(0), cache, target.embed_tokens)
    assert torch.equal(before.flip(0), swapped)
    cache.move_rows([0], [1])
    moved = draft.block_hidden(block[1:], cache.slice_rows(1, 2), target.embed_tokens)   # row 1 is row 1 again
    torch.testing.assert_close(moved[0], before[1], rtol=1e-5, atol=1e-5)


def test_the_ring_write_reads_nothing_on_the_host(target):
    """The ring write is static-shape index arithmetic: no value read, no nonzero, no boolean
    mask index (each would stall a GPU once per layer and break a captured step)."""
    draft = windowed(target, (F, S, S), 3)
    cache = draft.new_cache(3, 64)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 2, 9, 8, generator=g)
    slots = cache.positions(9)
    with HostReads() as mode:
        for layer in range(3):
            cache.write(layer, k, v, slots, torch.tensor([9, 0, 2]))   # an append of ragged rows
            cache.write(layer, k[:, :, :4], v[:, :, :4], slots[:, :4])   # a block: every column real
    assert mode.reads == []


def test_the_ring_holds_the_dense_window_through_wraps_and_rollbacks(target):
    """After every append (ragged, empty rows, wider than the ring, so several columns share a
    slot) the ring holds, as the dense definition gives them, each row's new positions and
    the W - 1 before them; a block's scratch (rolled back: the next append commits fewer
    positions than the block wrote) overwrites only what no later window reads, so after it
    the last W - 1 context positions, the next anchor's window, are intact."""
    draft = windowed(target, (S, F), 3)
    cfg = draft.config
    window = cfg.sliding_window
    cache = draft.new_cache(3, 200)
    span = cache.span
    g = torch.Generator().manual_seed(7)
    dim = len(cfg.target_layer_ids) * cfg.hidden_size
    feats = [torch.empty(0, dim) for _ in range(3)]

    def check(depth: list[int]):
        """Ring slots of positions L - depth[r] .. L - 1 of each row against the definition."""
        ring_k, ring_v = cache.view(0, 10_000)
        held = cache.key_positions(cache.lengths - 1, 10_000)
        checked = 0
        for r, f in enumerate(feats):
            n = f.shape[0]
            if n == 0:
                continue
            (want_k, want_v), _ = draft.context_kv(f.unsqueeze(0), torch.arange(n).unsqueeze(0))
            for slot in range(span):
                pos = int(held[r, slot])
                if max(0, n - min(depth[r], span)) <= pos:
                    torch.testing.assert_close(ring_k[r, :, slot], want_k[0, :, pos], rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(ring_v[r, :, slot], want_v[0, :, pos], rtol=1e-6, atol=1e-6)
                    checked += 1
        assert checked >= window - 1

    for step, counts in enumerate(([13, 0, 5], [1, 4, 0], [4, 2, 3], [0, 1, 14], [2, 4, 1], [3, 3, 3], [1, 0, 2])):
        new = torch.randn(3, max(counts), dim, generator=g)
        draft.append_context(cache, new, torch.tensor(counts))
        feats = [torch.cat([f, new[r, :counts[r]]]) for r, f in enumerate(feats)]
        check([span if step == 0 else c + window - 1 for c in counts])   # no scratch yet before the first
        block = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=g)
        torch.testing.assert_close(draft.block_hidden(block, cache, target.embed_tokens),
                                   reference_block(draft, feats, block, target.embed_tokens), rtol=1e-5, atol=1e-5)
        check([window - 1] * 3)
    assert int(cache.lengths.min()) > 2 * span   # every row wrapped, one of them within one append
