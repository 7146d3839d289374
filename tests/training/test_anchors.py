"""The packed training forward equals the inference-time draft forward (the mask is exact)."""

from __future__ import annotations

import pytest
import torch

from blockspec.training.anchors import pack_blocks, sample_anchors
from conftest import make_draft, make_target


S, F = "sliding_attention", "full_attention"
WINDOWS = [dict(layers=2, layer_types=(S, F), sliding_window=3),          # issue 34: mixed layers
           dict(layers=2, layer_types=(S, S), sliding_window=5, causal=False),
           dict(layers=1, layer_types=(S,), sliding_window=1)]


@pytest.mark.parametrize("layout, block, attention", [("zlab", 4, {}), ("deepspec", 3, {}), ("zlab", 8, {}),
                                                      ("zlab", 4, WINDOWS[0]), ("deepspec", 3, WINDOWS[1]),
                                                      ("zlab", 4, WINDOWS[2])])
def test_packed_forward_equals_inference_forward(layout, block, attention):
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, layout, block, dtype=torch.float64, **attention)
    cfg = draft.config
    ids = torch.randint(0, 60, (2, 30))
    loss_mask = torch.zeros(2, 30, dtype=torch.bool)
    loss_mask[0, 8:] = True
    loss_mask[1, 5:25] = True
    with torch.no_grad():
        feats = target(ids, capture=tuple(cfg.target_layer_ids)).features
        anchors, valid = sample_anchors(loss_mask, cfg.num_drafts, 6, torch.Generator().manual_seed(0))
        kinds = tuple((cfg.layer_window(i), cfg.layer_causal(i)) for i in range(cfg.num_hidden_layers))
        packed = pack_blocks(ids, anchors, valid, cfg.block_size, cfg.mask_token_id, layers=kinds)
        hidden = draft(feats, packed.block_ids, packed.positions, packed.mask, target.embed_tokens)
        hidden = hidden.view(2, anchors.shape[1], cfg.block_size, -1)
        checked = 0
        for r in range(2):
            for i in range(anchors.shape[1]):
                if not valid[r, i]:
                    continue
                a = int(anchors[r, i])
                cache = draft.new_cache(1, 64)
                if a > 0:
                    draft.append_context(cache, feats[r:r + 1, :a], a)
                block = torch.full((1, cfg.block_size), cfg.mask_token_id)
                block[0, 0] = ids[r, a]
                ref = draft.block_hidden(block, cache, target.embed_tokens)[0]
                assert torch.allclose(hidden[r, i], ref, atol=1e-10)
                checked += 1
    assert checked >= 8


def test_anchor_sampling_respects_response_window():
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 2:9] = True      # only a short response
    anchors, valid = sample_anchors(mask, 4, 50, torch.Generator().manual_seed(1))
    for r in range(3):
        for a, ok in zip(anchors[r].tolist(), valid[r].tolist()):
            if ok:
                assert mask[r, a + 1:a + 5].all() and a + 4 < 20
    assert valid[0].sum() == 20 - 4 - 4   # anchors 4..15
    assert valid[1].sum() == 4   # anchors 1..4
    assert valid[2].sum() == 0


def test_fused_context_kv_equals_per_layer():
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, "zlab", 4, layers=3, dtype=torch.float64)
    feats = torch.randn(2, 7, len(draft.config.target_layer_ids) * 32, dtype=torch.float64)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():  # the fused GEMM is the inference path
        fused = draft.context_kv(feats, pos, fused=True)
    for (k1, v1), (k2, v2) in zip(fused, draft.context_kv(feats, pos, fused=False)):
        assert torch.allclose(k1, k2, atol=1e-12) and torch.allclose(v1, v2, atol=1e-12)


@pytest.mark.parametrize("window, causal", [(3, True), (5, False), (None, True), (1, True)])
def test_windowed_training_mask_is_the_definition(window, causal):
    """Each block sees its own last context positions only: slot u of anchor a sees context j
    when a + u - window < j < a, its own slot v when a + v > a + u - window and (causal) v <= u;
    no other block; a padded block only its own slot (built here key by key)."""
    b, t, s = 2, 20, 4
    ids = torch.randint(0, 60, (b, t))
    anchors = torch.tensor([[2, 9, 15], [4, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    plain = pack_blocks(ids, anchors, valid, s, 62).mask
    got = pack_blocks(ids, anchors, valid, s, 62, layers=((None, False), (window, causal))).mask
    assert isinstance(got, list) and torch.equal(got[0], plain)
    n = anchors.shape[1] * s
    want = torch.zeros(b, 1, n, t + n, dtype=torch.bool)
    for r in range(b):
        for i in range(anchors.shape[1]):
            a = int(anchors[r, i])
            for u in range(s):
                q = i * s + u
                if not valid[r, i]:
                    want[r, 0, q, t + q] = True
                    continue
                for j in range(a):
                    want[r, 0, q, j] = window is None or j > a + u - window
                for v in range(s):
                    want[r, 0, q, t + i * s + v] = (window is None or v > u - window) and (not causal or v <= u)
    assert torch.equal(got[1], want)
