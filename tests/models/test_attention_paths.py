"""Attention kernels (models/attention.py): the mask-free paths equal the masked one.

The flex_attention path is what CUDA runs (compiled); here it runs eagerly on the CPU
(BLOCKSPEC_ATTENTION=flex) against SDPA with the dense boolean masks. Its block
structure, which only the compiled kernel reads, is checked tile by tile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.models import attention
from blockspec.models.attention import backend_for, dense_limit_mask, limit_block_mask
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel
from conftest import make_draft, make_target

ATOL = 3e-5   # fp32 rounding through 4 layers (float64 agrees to 1e-13); plus a relative 1e-5 (`_close`)
LENGTHS = [5, 9, 2]          # ragged rows (the window config's window is 6: some keys leave it)
CONFIGS = {
    "qwen3-gqa": {},
    "llama-mha": {"model_type": "llama", "num_key_value_heads": 4},
    "qwen2-window": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 6,
                     "max_window_layers": 1},
}


def _prompts(lengths: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, 60, (n,), generator=g)
    return ids, torch.tensor(lengths)


def _prefilled(target: TargetModel, lengths: list[int] = LENGTHS) -> KVCache:
    cache = target.new_cache(len(lengths), 40)
    ids, n = _prompts(lengths)
    target(ids, cache, num_new=n)
    return cache


def _clone(cache: KVCache) -> KVCache:
    copy = object.__new__(KVCache)
    copy.k, copy.v, copy.lengths, copy.capacity = cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.capacity
    return copy


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= ATOL + 1e-5 * b.abs()).all())


def _same_cache(a: KVCache, b: KVCache) -> None:
    assert torch.equal(a.lengths, b.lengths)
    for r, n in enumerate(a.lengths.tolist()):
        assert _close(a.k[:, r, :, :n], b.k[:, r, :, :n])
        assert _close(a.v[:, r, :, :n], b.v[:, r, :, :n])


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor | None, bool]]:
    """Every SDPA call's (attn_mask, is_causal)."""
    calls: list[tuple[torch.Tensor | None, bool]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


# -- the block mask, tile by tile -----------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len,kv_len", [(1, 300), (7, 200), (130, 400), (300, 700)])
def test_block_mask_tiles_match_the_dense_mask(causal: bool, q_len: int, kv_len: int) -> None:
    """Full tiles are wholly visible, skipped tiles wholly hidden, partial tiles mixed or
    at a row's edge: the compiled kernel, which skips mask_mod on full tiles, sees the mask."""
    g = torch.Generator().manual_seed(q_len)
    room = kv_len - (q_len if causal else 0)
    first = torch.randint(1, room + 1, (5,), generator=g)
    first[0], first[1] = 1, room                      # a row at each extreme
    block = limit_block_mask(first, q_len, kv_len, causal)
    dense = dense_limit_mask(first, q_len, kv_len, causal).expand(-1, -1, q_len, -1)
    n = attention.FLEX_BLOCK
    for r in range(first.shape[0]):
        for qt in range(-(-q_len // n)):
            full = set(block.full_kv_indices[r, 0, qt, :int(block.full_kv_num_blocks[r, 0, qt])].tolist())
            part = set(block.kv_indices[r, 0, qt, :int(block.kv_num_blocks[r, 0, qt])].tolist())
            assert not full & part
            for kt in range(-(-kv_len // n)):
                tile = dense[r, 0, qt * n:(qt + 1) * n, kt * n:(kt + 1) * n]
                if kt in full:
                    assert tile.all()
                elif kt in part:
                    assert tile.any()
                else:
                    assert not tile.any()


@pytest.mark.parametrize("causal", [True, False])
def test_flex_equals_sdpa_with_the_dense_mask(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, w, 16, generator=g) for h, w in ((4, 5), (2, 150), (2, 150)))
    first = torch.tensor([1, 70, 145]) if causal else torch.tensor([3, 100, 150])
    got = attention.attend(q, k, v, attention.KeyMask(block=limit_block_mask(first, 5, 150, causal)))
    want = attention.attend(q, k, v, dense_limit_mask(first, 5, 150, causal))
    assert _close(got, want)


@pytest.mark.slow
def test_compiled_flex_reads_the_tiles_right() -> None:
    """The compiled kernel (what CUDA runs) skips mask_mod on full tiles and skips empty
    ones; inductor's CPU flex template does the same, so it checks the tiles here."""
    compiled = torch.compile(attention.flex_attention)
    g = torch.Generator().manual_seed(5)
    for q_len, causal in ((16, True), (1, True), (4, False)):
        q, k, v = (torch.randn(4, h, w, 16, generator=g) for h, w in ((4, q_len), (2, 400), (2, 400)))
        first = torch.tensor([1, 127, 200, 400 - q_len + (1 if causal else q_len)])
        got = compiled(q, k, v, block_mask=limit_block_mask(first, q_len, 400, causal), enable_gqa=True)
        want = attention.attend(q, k, v, dense_limit_mask(first, q_len, 400, causal))
        assert _close(got, want)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOCKSPEC_ATTENTION", raising=False)
    assert backend_for(torch.device("cpu")) == "sdpa"
    assert backend_for(torch.device("cuda")) == "flex"
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "flex")
    assert backend_for(torch.device("cpu")) == "flex"
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "fast")
    with pytest.raises(ValueError, match="BLOCKSPEC_ATTENTION"):
        backend_for(torch.device("cpu"))


# -- the model's paths ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_into_empty_rows_is_causal_without_a_mask(name: str, sdpa_calls) -> None:
    """Ragged right-padded prompts into an empty cache: is_causal, no mask (window layers
    keep their band mask) = the masked forward, logits, features and cache."""
    target = make_target(**CONFIGS[name])
    ids, n = _prompts(LENGTHS)
    fast, masked = target.new_cache(3, 40), target.new_cache(3, 40)
    capture = (0, 2)
    got = target(ids, fast, num_new=n, capture=capture)
    free = [c for c in sdpa_calls if c[0] is None and c[1]]
    window_layers = len(target.config.window_layers)
    assert len(free) == len(target.layers) - window_layers and len(sdpa_calls) == len(target.layers)
    want = target(ids, masked, num_new=n, capture=capture,
                  mask=dense_limit_mask(torch.ones(3, dtype=torch.long), ids.shape[1], ids.shape[1], True))
    for r, m in enumerate(LENGTHS):
        assert _close(got.logits[r, :m], want.logits[r, :m])
        assert _close(got.features[r, :m], want.features[r, :m])
    _same_cache(fast, masked)


def _run_both(monkeypatch: pytest.MonkeyPatch, fn) -> tuple:
    """fn() under the flex backend (no dense mask) and under SDPA with dense masks."""
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "flex")
    flex = fn()
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "sdpa")
    return flex, fn()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("width", [1, 4])
def test_decode_and_verify_ragged_rows(monkeypatch: pytest.MonkeyPatch, name: str, width: int) -> None:
    target = make_target(**CONFIGS[name])
    base = _prefilled(target)
    block = torch.randint(1, 60, (3, width), generator=torch.Generator().manual_seed(1))
    spied: list[object] = []
    real_flex = attention.flex_attention
    monkeypatch.setattr(attention, "flex_attention",
                        lambda *a, **kw: spied.append(kw["block_mask"]) or real_flex(*a, **kw))

    def run() -> tuple[torch.Tensor, KVCache]:
        cache = _clone(base)
        return target(block, cache, capture=(1,)).logits, cache

    (got, got_cache), (want, want_cache) = _run_both(monkeypatch, run)
    full_layers = len(target.layers) - len(target.config.window_layers)
    assert len(spied) == full_layers            # the full-attention layers went through flex
    assert _close(got, want)
    _same_cache(got_cache, want_cache)
    ids, _ = _prompts(LENGTHS)                  # each row alone, unpadded and cache-free
    for r, n in enumerate(LENGTHS):
        alone = target(torch.cat([ids[r, :n], block[r]]).unsqueeze(0)).logits[0, n:]
        assert _close(got[r], alone)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_verify_ragged_counts(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    target = make_target(**CONFIGS[name])
    base = _prefilled(target)
    counts = torch.tensor([3, 1, 5])
    tokens = torch.randint(1, 60, (int(counts.sum()),), generator=torch.Generator().manual_seed(2))

    def run() -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        cache = _clone(base)
        out = target.forward_packed(tokens, counts, cache, capture=(0, 3))
        return out.logits, out.features, cache

    (lg, fg, cg), (lw, fw, cw) = _run_both(monkeypatch, run)
    assert _close(lg, lw) and _close(fg, fw)
    _same_cache(cg, cw)
    ids, _ = _prompts(LENGTHS)                  # each row alone, unpadded and cache-free
    starts = torch.cumsum(counts, 0) - counts
    for r, n in enumerate(LENGTHS):
        new = tokens[starts[r]:starts[r] + counts[r]]
        alone = target(torch.cat([ids[r, :n], new]).unsqueeze(0)).logits[0, n:]
        assert _close(lg[0, starts[r]:starts[r] + counts[r]], alone)


@pytest.mark.parametrize("rows", [1, 3])
def test_draft_block_ragged_context(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    target = make_target()
    draft = make_draft(target, block_size=4)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(rows, 9, 2 * target.config.hidden_size, generator=g)
    base = draft.new_cache(rows, 40)
    draft.append_context(base, feats, torch.tensor([9, 4, 6][:rows]))
    block = torch.randint(1, 60, (rows, 4), generator=g)

    def run() -> torch.Tensor:
        return draft.block_hidden(block, _clone(base), target.embed_tokens)

    got, want = _run_both(monkeypatch, run)
    assert _close(got, want)
    # and against an explicit key-length mask computed by hand
    for r in range(rows):
        alone = _clone(base)
        alone.k, alone.v = alone.k[:, r:r + 1].clone(), alone.v[:, r:r + 1].clone()
        alone.lengths = alone.lengths[r:r + 1].clone()
        assert _close(draft.block_hidden(block[r:r + 1], alone, target.embed_tokens)[0], want[r])


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_generate_is_unchanged_by_the_backend(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    target = make_target()
    draft = make_draft(target, block_size=4) if method != "ar" else None
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 1, 6, 2, 9, 4, 4, 7]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        out = generate(target, prompts, params, draft=draft, method=method)
        return [c.tokens for c in out.completions]

    flex, sdpa = _run_both(monkeypatch, run)
    assert flex == sdpa


# -- half precision: a token's numbers do not depend on the forward it is in ------------------

def test_float64_attention_is_independent_of_the_forward_shape() -> None:
    """bf16 queries of a 16-token block (causal limit mask over the block's keys) equal each
    query run alone over exactly its visible keys, bit for bit, and stay within bf16 rounding
    of float64 SDPA. (SDPA's CPU kernel in bf16 differed here in 151 of 37120 outputs.)"""
    g = torch.Generator().manual_seed(0)
    mismatches = 0
    for context, width in ((5, 16), (100, 3), (307, 16)):
        q, k, v = (torch.randn(1, h, n, 64, generator=g).bfloat16()
                   for h, n in ((4, width), (2, context + width), (2, context + width)))
        mask = dense_limit_mask(torch.tensor([context + 1]), width, context + width, causal=True)
        block = attention.attend_cached(q, k, v, attention.KeyMask(dense=mask))
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        assert (block.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
        for j in range(width):
            keys = context + j + 1
            alone = attention.attend_cached(q[:, :, j:j + 1], k[:, :, :keys], v[:, :, :keys], attention.ALL_KEYS)
            mismatches += int((alone != block[:, :, j:j + 1]).sum())
    assert mismatches == 0


def test_sdpa_override_turns_the_float64_path_off(monkeypatch: pytest.MonkeyPatch, sdpa_calls) -> None:
    q, k, v = (torch.randn(1, h, n, 8).bfloat16() for h, n in ((4, 2), (2, 9), (2, 9)))
    attention.attend_cached(q, k, v, None)
    assert sdpa_calls == []
    monkeypatch.setenv("BLOCKSPEC_ATTENTION", "sdpa")
    attention.attend_cached(q, k, v, None)
    assert len(sdpa_calls) == 1
    attention.attend_cached(q.float(), k.float(), v.float(), None)   # float32: SDPA whatever the setting
    monkeypatch.delenv("BLOCKSPEC_ATTENTION")
    attention.attend_cached(q.float(), k.float(), v.float(), None)
    assert len(sdpa_calls) == 3


def test_bf16_verify_forward_equals_the_decode_steps() -> None:
    """The lossless promise in bf16: logits of tokens verified in one forward (dense and
    packed, rows of different lengths) equal those of decoding them one step at a time, bit for
    bit. Before float64_attention the two parted by a bf16 ulp in some attention outputs."""
    target = make_target(dtype=torch.bfloat16, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, layers=3, max_position_embeddings=512)
    lengths, width = [300, 170], 16
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 60, (n,), generator=g) for n in lengths]
    block = torch.randint(1, 60, (2, width), generator=g)
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
    with torch.no_grad():
        cache = target.new_cache(2, 400)
        target(ids, cache, num_new=torch.tensor(lengths))
        start = cache.lengths.clone()
        steps = torch.cat([target.decode_step(block[:, t], cache) for t in range(width)], dim=1)
        for r in range(2):   # one row at a time: the 1-row decode step takes no mask
            cache.truncate(start)
            single = cache.slice_rows(r, r + 1)
            alone = torch.cat([target.decode_step(block[r:r + 1, t], single) for t in range(width)], dim=1)
            assert torch.equal(alone[0], steps[r])
        cache.truncate(start)
        assert torch.equal(target(block, cache).logits, steps)
        cache.truncate(start)
        counts = torch.tensor([width, 9])
        packed = target.forward_packed(torch.cat([block[0], block[1, :9]]), counts, cache).logits[0]
        assert torch.equal(packed, torch.cat([steps[0], steps[1, :9]]))
