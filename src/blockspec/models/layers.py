"""Building blocks shared by the target and the draft: RMSNorm, RoPE, SwiGLU and
the one attention module (its forward is the one attention body; the attention
function and its kernels are in attention.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import RopeConfig
from blockspec.models.attention import KeyMask, attend, attend_cached
from blockspec.models.kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with any weight that broadcasts (e.g. per head [H, 1, D]
    for q_norm and k_norm in one pass). Half precision is normalised in float32 and cast
    back, like the reference implementations."""
    if x.dtype in (torch.float32, torch.float64):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)
        return rms_norm(x, self.weight, self.eps)


def _rope_exponents(head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """arange(0, d, 2) / d in float32, computed as transformers does (its inverse
    frequencies are float32 throughout; matching them keeps logits equal to its own)."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def _yarn_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: NTK-by-parts interpolation."""
    base, dim, factor = rope.theta, head_dim, rope.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32), as transformers' rope init functions.

    For the length-dependent types this is the short-sequence set (dynamic: the plain
    frequencies; longrope: short_factor); `RotaryEmbedding` switches per token."""
    exps = _rope_exponents(head_dim)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
    if rope.rope_type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta ** exps)
    base = rope.theta
    if rope.rope_type == "dynamic":
        # transformers initialises with seq_len = max_position_embeddings (python floats)
        m = rope.max_position_embeddings
        base = base * ((rope.factor * m / m) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exps)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
        # `factor`, short ones kept, and the band in between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rope_attention_scaling(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (yarn's mscale, longrope's)."""
    if rope.rope_type == "yarn":
        if rope.attention_factor is not None:
            return rope.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
        return mscale(rope.factor)
    if rope.rope_type == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding. cos/sin tables are built once per dtype and
    grown on demand, so a decode step only indexes them. The sin table carries
    the rotation's sign (-sin on the first half) so `apply_rope` is three ops.
    Both carry the rope type's attention scaling (yarn), as transformers' do.

    Length-dependent types (dynamic, longrope): transformers recomputes the
    frequencies at every forward from that call's sequence length s (max position
    + 1), and a cached token keeps the rotation of the call that computed it. So
    each token here gets the frequencies of its own s: a prompt run in one call,
    s = the prompt's length; a later token at position p, s = p + 1 (exactly
    transformers' generate with a cache, one token per call; a verified block
    equals decoding it token by token, as lossless verification needs). `seq_len`
    [B, T] gives each token's s (default positions + 1). transformers' module also
    keeps state across calls (a longer earlier sequence leaves enlarged frequencies
    behind for a later mid-length one); that history effect is not reproduced: each
    request runs as on a fresh model."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.attention_scaling = rope_attention_scaling(rope)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table_key: tuple | None = None

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """freqs [..., D/2] float32 -> cos, signed sin [..., D] (scaled, then cast)."""
        sin = freqs.sin()
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():  # (data_ptr cannot be traced; the eager step ran first)
            key = (self.inv_freq.data_ptr(), self.inv_freq.device)
            if key != self._table_key:  # inv_freq replaced (a loader recomputes it) or moved
                self._tables.clear()
                self._table_key = key
        cos_sin = self._tables.get(dtype)
        if cos_sin is None or cos_sin[0].shape[0] < length or cos_sin[0].device != self.inv_freq.device:
            size = max(length, 2 * (cos_sin[0].shape[0] if cos_sin else 1024))
            freqs = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32).unsqueeze(-1) * self.inv_freq
            cos_sin = self._cos_sin(freqs, dtype)
            self._tables[dtype] = cos_sin
        return cos_sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, limit: int | None = None,
                seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (all < limit when given) -> cos, signed sin [B, 1, T, head_dim].
        seq_len [B, T] (or broadcastable): each token's sequence length, read only by
        the length-dependent types (see the class docstring)."""
        if self.rope.length_dependent:
            return self._length_dependent(positions, dtype, positions + 1 if seq_len is None else seq_len)
        cos, sin = self.table(int(positions.max()) + 1 if limit is None else limit, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def _length_dependent(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        rope, dim = self.rope, self.head_dim
        s = seq_len.expand_as(positions).unsqueeze(-1)                       # [B, T, 1]
        exps = _rope_exponents(dim, positions.device)
        if rope.rope_type == "dynamic":
            m = rope.max_position_embeddings
            # transformers' _compute_dynamic_ntk_parameters with a tensor seq_len (float32)
            base = rope.theta * ((rope.factor * s.clamp(min=m) / m) - (rope.factor - 1)) ** (dim / (dim - 2))
            grown = 1.0 / (base ** exps)
            # s <= max_position_embeddings: the module's initial frequencies, unchanged
            inv = torch.where(s > m, grown, self.inv_freq)
        else:  # longrope: long factors once the call's sequence exceeds the original length
            long = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32, device=positions.device)
                          * rope.theta ** exps)
            inv = torch.where(s > rope.original_max_position_embeddings, long, self.inv_freq)
        cos, sin = self._cos_sin(positions.unsqueeze(-1).float() * inv, dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (halves of the head dim)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


# CPU inference runs its GEMMs through oneDNN with weights prepacked once: float32
# (about 1.3x faster at 1 token and 1.3-2x at 4-64 tokens than the plain layout on
# AVX2), and bfloat16 where oneDNN has native bf16 kernels (AVX512-BF16 / AMX: on a
# Zen 4, 1.0-1.7x faster than the plain bf16 GEMM per projection and 1.1-2.4x for the
# lm_head, at 1-256 rows; docs/results.md, benchmarks/linear_kernels.py). The packed bf16
# GEMM gives a row the same bits whatever the row count, as the plain one does (checked
# there and in tests/models/test_layers.py), which bf16 speculative == AR relies on
# (docs/design.md, "Numerics"). It costs one extra copy of each packed weight;
# BLOCKSPEC_PACKED_LINEAR=0 turns it off.
PACKED_LINEAR = os.environ.get("BLOCKSPEC_PACKED_LINEAR", "1") != "0"
_PACK_BATCH_HINT = 64  # oneDNN picks its blocked layout for this many rows; fast from 1 to 256


def _can_pack(w: torch.Tensor) -> bool:
    if not (PACKED_LINEAR and w.device.type == "cpu" and torch.backends.mkldnn.is_available()):
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class FusedLinears:
    """One GEMM for several Linear layers that read the same input.

    Without gradients on the CPU the concatenated weight is built on first use
    (prepacked for oneDNN in float32, and in bfloat16 where it has bf16 kernels) and
    rebuilt if any part changes, tracked by tensor version (so weights must change
    through ops that bump it: torch's fused AdamW does not, which is why the pretraining
    loop uses the plain one); checkpoints keep the separate Hugging Face tensors. On other
    devices no concatenated copy is kept (it would double the attention and MLP
    weights in GPU memory: +8.4 GiB for an 8B model): the layers run one GEMM each.
    With gradients each layer runs on its own so autograd sees the real parameters."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [l.out_features for l in linears]
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None

    def _refresh(self) -> None:
        ls = self.linears
        # Read the parameters from the dict (Module.__getattr__ is slow on the decode path);
        # a new data pointer covers dtype / device moves, the version in-place updates.
        weights = [l._parameters["weight"] for l in ls]
        key = tuple((w.data_ptr(), w._version) for w in weights)
        if key == self.key:
            return
        with torch.no_grad():
            self.weight = ls[0].weight.detach() if len(ls) == 1 else torch.cat([l.weight for l in ls])
            self.bias = None
            if ls[0].bias is not None:
                self.bias = ls[0].bias.detach() if len(ls) == 1 else torch.cat([l.bias for l in ls])
            self.packed = None
            if _can_pack(self.weight):
                try:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_BATCH_HINT)
                except (RuntimeError, AttributeError):  # a torch build without the oneDNN op
                    self.packed = None
        self.key = key

    def pending_copy_bytes(self) -> int:
        """Bytes of the concatenated weight still to be built on first use (only on the CPU)."""
        ls = self.linears
        if len(ls) == 1 or self.weight is not None or ls[0].weight.device.type != "cpu":
            return 0
        return sum(l.weight.numel() * l.weight.element_size() for l in ls)

    def _separate(self, x: torch.Tensor) -> bool:
        """Run the layers one by one: with gradients, or off the CPU (no weight copy)."""
        return torch.is_grad_enabled() or (len(self.linears) > 1 and x.device.type != "cpu")

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs concatenated along the last dim."""
        if self._separate(x):
            return torch.cat([F.linear(x, l.weight, l.bias) for l in self.linears], dim=-1)
        if torch.compiler.is_compiling():  # traced: plain ops, which inductor freezes and packs itself
            ls = self.linears
            bias = torch.cat([l.bias for l in ls]) if ls[0].bias is not None else None
            return F.linear(x, torch.cat([l.weight for l in ls]), bias)
        self._refresh()
        if self.packed is not None and x.dtype == self.packed.dtype:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self._separate(x):
            return [l(x) for l in self.linears]
        return list(self.full(x).split(self.sizes, dim=-1))


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose no-grad forward uses the packed GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._fast = FusedLinears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return self._fast.full(x)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self._gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        return self.down_proj(F.silu(gate) * up)


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's sizes and options (from the target's or the draft's config)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    eps: float = 1e-6


class CacheAccess(NamedTuple):
    """Where a block's K/V go in a KVCache and what its queries read (`Attention.forward`):
    written at `slots` ([B, T], or [N] when `packed`), read up to `upto`; `packed` =
    (rows, cols) [N] of a ragged packed sequence whose widest row has `width` tokens.
    A NamedTuple: one is built per model forward and passed through compiled steps."""

    cache: KVCache
    slots: torch.Tensor
    upto: int
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    width: int = 0


class Attention(nn.Module):
    """One attention layer (HF parameter names), the one attention body of the target's
    decode and packed verification and of the draft's block.

    `layer_idx` is this layer's index into a KVCache (as in HF's modeling_qwen3)."""

    def __init__(self, shape: AttentionShape, layer_idx: int = 0) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
        qkv_bias, o_bias, eps = shape.qkv_bias, shape.o_bias, shape.eps
        self.heads, self.kv_heads, self.head_dim, self.layer_idx = heads, kv_heads, head_dim, layer_idx
        self.q_proj = Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self._qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self._qk_key: tuple | None = None
        self._qk_weight: torch.Tensor | None = None

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, T, heads*D] -> [B, heads, T, D]."""
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.split(self.q_proj(x), self.heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def prepare_k(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k already projected, [B, T, Hkv*D] -> normed + rotated [B, Hkv, T, D]."""
        k = self.split(k, self.kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prepare_k(self.k_proj(x), cos, sin), self.split(self.v_proj(x), self.kv_heads)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of the same input. Without gradients: one fused GEMM, then q and k
        heads normed and rotated together (decode is bound by the number of ops)."""
        if torch.is_grad_enabled():
            return (self.project_q(x, cos, sin), *self.project_kv(x, cos, sin))
        b, t, _ = x.shape
        hq, hkv = self.heads, self.kv_heads
        heads = self._qkv.full(x).view(b, t, hq + 2 * hkv, self.head_dim).transpose(1, 2)
        qk = heads[:, :hq + hkv]
        if self.q_norm is not None:
            qk = rms_norm(qk, self._qk_norm_weight(), self.q_norm.eps)
        qk = apply_rope(qk, cos, sin)
        return qk[:, :hq], qk[:, hq:], heads[:, hq + hkv:]

    def _qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for every query head, then k_norm's for every kv head: [Hq+Hkv, 1, D]."""
        assert self.q_norm is not None and self.k_norm is not None
        wq, wk = self.q_norm.weight, self.k_norm.weight
        if torch.compiler.is_compiling():
            return torch.cat([wq.expand(self.heads, self.head_dim), wk.expand(self.kv_heads, self.head_dim)]).unsqueeze(1)
        key = (wq.data_ptr(), wq._version, wk.data_ptr(), wk._version, wq.dtype)
        if key != self._qk_key:
            d = self.head_dim
            self._qk_weight = torch.cat([wq.detach().expand(self.heads, d), wk.detach().expand(self.kv_heads, d)]
                                        ).unsqueeze(1)
            self._qk_key = key
        return self._qk_weight

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | KeyMask | None = None, kv: CacheAccess | None = None, *,
                context: tuple[torch.Tensor, torch.Tensor] | None = None, causal: bool = False) -> torch.Tensor:
        """x [B, T, hidden] (already normed) -> attention output [B, T, hidden].

        Keys and values, by what is given:
        - `kv` (`CacheAccess`): this block's K/V are written at `kv.slots` [B, T] of every
          row and the queries read the cache's slots [0, kv.upto) under `mask` [B, 1, T, upto]
          or a KeyMask (None: all); a KeyMask with self_causal (rows that were empty) reads
          the block's own K/V instead, causally and without a mask;
        - `kv` with `packed` = (rows, cols) [N]: x [1, N, hidden] is a packed ragged
          sequence whose token i is the cols[i]-th new token of cache row rows[i], written
          at slots [N]; `mask` is per row and `kv.width` its query count W (the widest row);
        - `context` = (k, v) [B, Hkv, S, D]: explicit K/V placed before the block (training);
        - neither: the block attends to itself (causally when `causal`, or under `mask`)."""
        q, k, v = self.project_qkv(x, cos, sin)
        if kv is None:
            if context is not None:
                k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
            return self.output(attend(q, k, v, mask, causal))
        cache, slots, upto, packed, width = kv
        if packed is None:
            cache.write(self.layer_idx, k, v, slots)
            if isinstance(mask, KeyMask) and mask.self_causal:  # empty rows: the cache holds just k, v
                return self.output(attend(q, k, v, mask))
            ck, cv = cache.view(self.layer_idx, upto)
            return self.output(attend_cached(q, ck, cv, mask))
        rows, cols = packed
        cache.write_packed(self.layer_idx, k[0], v[0], rows, slots)
        # Attention reads each row's cache once: queries are scattered to [R, Hq, W, D]
        # for one attention call, and the padding queries' outputs are dropped again.
        q_rows = q.new_zeros(cache.rows, q.shape[1], width, q.shape[3])
        q_rows[rows, :, cols] = q[0].transpose(0, 1)
        ck, cv = cache.view(self.layer_idx, upto)
        out = attend_cached(q_rows, ck, cv, mask)[rows, :, cols]     # [N, Hq, D]
        return self.output(out.transpose(0, 1).unsqueeze(0))
