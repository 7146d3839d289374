"""The inference GEMM path (fused, oneDNN-prepacked on CPU float32) against plain F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.models import layers
from blockspec.models.layers import FusedLinears, Linear


@pytest.mark.parametrize("rows", [1, 3, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linears_match_separate_layers(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    parts = [Linear(48, n, bias=bias) for n in (32, 16, 16)]
    fused = FusedLinears(*parts)
    x = torch.randn(2, rows, 48)
    with torch.no_grad():
        got = fused(x)
    for out, lin in zip(got, parts):
        assert out.shape == (2, rows, lin.out_features)
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_packed_weight_follows_in_place_updates() -> None:
    torch.manual_seed(0)
    lin = Linear(16, 8, bias=False)
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2.0)   # bumps the tensor version: the packed copy must be rebuilt
        after = lin(x)
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-5)


def test_grad_path_uses_real_parameters() -> None:
    lin = Linear(8, 4)
    lin(torch.randn(3, 8)).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_packing_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "PACKED_LINEAR", False)
    lin = Linear(8, 4)
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert lin._fast.packed is None


def test_packing_used_on_cpu_float32() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    lin = Linear(8, 4)
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert lin._fast.packed is not None
    lin64 = Linear(8, 4).double()
    with torch.no_grad():
        lin64(torch.randn(2, 8, dtype=torch.float64))
    assert lin64._fast.packed is None   # float64 keeps the exact reference GEMM


def test_bf16_packing_where_onednn_has_bf16_kernels_and_rows_keep_their_bits() -> None:
    """A bf16 Linear packs its weight where oneDNN has native bf16 kernels, and a row's output
    bits do not depend on how many rows share the GEMM (bf16 speculative == AR relies on it)."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("no oneDNN bf16 kernels on this CPU: bf16 keeps the plain GEMM")
    torch.manual_seed(0)
    lin = Linear(96, 200, bias=False).bfloat16()
    x = torch.randn(70, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        alone = lin(x[:1])
        assert lin._fast.packed is not None and lin._fast.packed.dtype == torch.bfloat16
        torch.testing.assert_close(alone.float(), F.linear(x[:1], lin.weight).float(), rtol=1e-2, atol=1e-2)
        for rows in (2, 5, 16, 17, 64, 70):
            assert torch.equal(lin(x[:rows])[:1], alone), rows


# -- RoPE scaling and the sliding-window mask against transformers -----------------------

ROPE_CASES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False, "mscale": 0.7, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
    {"rope_type": "longrope", "original_max_position_embeddings": 64,
     "short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [1.0 + i for i in range(16)]},
]


def _hf_rope(params: dict):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=256,
                                   rope_parameters={"rope_theta": 50000.0, **params})
    return cfg, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg), ROPE_INIT_FUNCTIONS


@pytest.mark.parametrize("params", ROPE_CASES, ids=lambda p: p["rope_type"])
def test_rope_matches_transformers(params: dict) -> None:
    """Inverse frequencies, attention scaling and cos/sin (sign folded into sin) equal
    transformers' for every supported type, including past max_position_embeddings
    for the length-dependent ones (one call over the whole sequence)."""
    from blockspec.config import RopeConfig

    hf_cfg, hf_rope, _ = _hf_rope(params)
    raw = {"max_position_embeddings": 256, "rope_parameters": {"rope_theta": 50000.0, **params}}
    rope = RopeConfig.from_hf(raw, "test")
    ours = layers.RotaryEmbedding(32, rope)
    assert ours.attention_scaling == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert torch.equal(ours.inv_freq, hf_rope.inv_freq)
    for length in (40, 300):  # within, and past, max_position_embeddings
        pos = torch.arange(length).unsqueeze(0)
        hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos)
        cos, signed_sin = ours(pos, torch.float32, seq_len=torch.tensor([[length]]))
        torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=1e-6)
        half = 16
        torch.testing.assert_close(signed_sin[:, 0, :, half:], hf_sin[..., half:], rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[:, 0, :, :half], -hf_sin[..., :half], rtol=0, atol=1e-6)


def test_length_dependent_rope_uses_each_tokens_own_length() -> None:
    """dynamic: a token's frequencies come from its own sequence length; up to
    max_position_embeddings they are the plain ones."""
    from blockspec.config import RopeConfig

    rope = RopeConfig(rope_type="dynamic", factor=2.0, max_position_embeddings=16)
    emb = layers.RotaryEmbedding(8, rope)
    plain = layers.RotaryEmbedding(8, RopeConfig())
    pos = torch.arange(30).unsqueeze(0)
    cos, _ = emb(pos, torch.float32)                          # seq_len = position + 1
    ref, _ = plain(pos, torch.float32)
    assert torch.equal(cos[..., :16, :], ref[..., :16, :]) and not torch.allclose(cos[..., 16:, :], ref[..., 16:, :])
    one_call, _ = emb(pos, torch.float32, seq_len=torch.tensor([[30]]))
    last, _ = emb(pos[:, -1:], torch.float32)                # the last token alone: same length, same rotation
    torch.testing.assert_close(one_call[..., -1:, :], last)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_mask_is_transformers_overlay(window: int) -> None:
    """key j visible to query i iff j <= i and j > i - window; a given mask is narrowed."""
    from blockspec.models.kv_cache import sliding_window_mask

    q = torch.tensor([[0, 2, 5, 9]])
    got = sliding_window_mask(None, q, 10, window)[0, 0]
    for t, i in enumerate(q[0].tolist()):
        assert got[t].tolist() == [i - window < j <= i for j in range(10)]
    custom = torch.rand(1, 1, 4, 10) > 0.5                 # a given mask keeps its own causality
    band = torch.arange(10).view(1, 10) > q[0].view(4, 1) - window
    assert torch.equal(sliding_window_mask(custom, q, 10, window), custom & band)


def test_fused_linears_keep_no_weight_copy_off_the_cpu():
    """Off the CPU (meta here, CUDA in use) fused QKV / gate-up run one GEMM per layer and
    never build a concatenated copy of the weights; on the CPU they do, once, and both
    give the separate layers' outputs."""
    from blockspec.models.layers import Attention, AttentionShape

    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        attn = Attention(AttentionShape(32, 4, 2, 8, qkv_bias=True, qk_norm=True)).to(device)
        x = torch.randn(2, 3, 32, device=device)
        with torch.no_grad():
            fused = attn._qkv.full(x)
            parts = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        assert fused.shape == (2, 3, 64)
        if device == "meta":
            assert attn._qkv.weight is None and attn._qkv.pending_copy_bytes() == 0
        else:
            assert attn._qkv.weight is not None and attn._qkv.pending_copy_bytes() == 0
            torch.testing.assert_close(fused, torch.cat(parts, dim=-1))
