"""Which attention kernel a forward's queries use, and what each kernel needs to know.

Every cached forward appends a block of W tokens per row after that row's length
L[r]; what a query may see is a per-row key-length limit (docs/design.md section 2,
"Attention kernels"):

- fresh rows (every L[r] = 0, right-padded prompts): the block attends to itself
  causally. SDPA with `is_causal=True` and no mask (flash kernel on CUDA, the fused
  CPU kernel on the CPU); padding queries see only padding and real keys before
  them, and their outputs are never read.
- appended to a cache (decode W = 1, verify, packed verify, a later prefill chunk):
  query t of row r sees slots <= L[r] + t; the draft's block sees slots < L[r] + W.
  On CUDA: `flex_attention` (compiled) with a block mask built from the lengths
  alone, so no [rows x W x context] tensor exists and key blocks past a row's
  length are skipped (a short row no longer pays for the longest). Elsewhere:
  SDPA with a boolean mask, which for W = 1 and the draft block is only a
  key-length mask [R, 1, 1, K]. On the CPU, SDPA with the mask is the fused
  kernel already: eager flex_attention materialises every score (2.5-4.4x slower
  per cached forward of the first embedded target), and compiled flex saves 10-20% of
  the op (0.42 vs 0.53 ms at W = 1, 3.4 vs 3.8 ms at W = 16, 8 rows x 1088 keys),
  a few % of the forward, after 6-10 s of compiling per shape (docs/results.md,
  benchmarks/attention_kernels.py).
- sliding-window layers keep a dense mask whenever a key can leave the window.
- half precision (bf16 / fp16) on the CPU, a cached forward of at most
  EXACT_MAX_QUERIES queries per row (decode, verify, packed verify, the draft's
  block): `float64_attention`, so that a token's attention output does not depend
  on how many queries or keys share the forward (docs/design.md, "Numerics").

BLOCKSPEC_ATTENTION=sdpa|flex overrides the per-device choice (tests run the flex
path on the CPU, eagerly, against the masked one); sdpa also turns the float64
path off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BACKENDS = ("auto", "sdpa", "flex")
FLEX_BLOCK = 128  # flex_attention's default tile (queries and keys)


def backend_for(device: torch.device) -> str:
    """"flex" or "sdpa" for tensors on `device` (BLOCKSPEC_ATTENTION, read per call so
    tests and benchmarks can switch it)."""
    choice = os.environ.get("BLOCKSPEC_ATTENTION", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"BLOCKSPEC_ATTENTION must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return choice


@dataclass(frozen=True)
class KeyMask:
    """What one layer's queries may see, in the form its kernel takes. Exactly one of:
    `dense` bool [B, 1, T, K] (True = may attend; SDPA), `block` (flex_attention),
    `self_causal` (keys are the block's own, causal: SDPA is_causal), or nothing
    (every key)."""
    dense: torch.Tensor | None = None
    block: BlockMask | None = None
    self_causal: bool = False


ALL_KEYS = KeyMask()

_compiled_flex: Callable | None = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: BlockMask) -> torch.Tensor:
    """flex_attention, compiled on CUDA (its eager form materialises every score, which
    defeats the point there; on the CPU the eager form is only for tests)."""
    global _compiled_flex
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | KeyMask | None = None, causal: bool = False) -> torch.Tensor:
    """The one attention function: q [B,H,T,D], k/v [B,Hkv,S,D]. mask: a bool tensor
    [B,1,T,S] (True = may attend), a KeyMask, or None (all keys, or causal when
    `causal`). GQA without copying K/V (enable_gqa)."""
    if isinstance(mask, KeyMask):
        if mask.block is not None:
            return _flex(q, k, v, mask.block)
        causal, mask = mask.self_causal, mask.dense
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


# A verify forward is at most a few dozen tokens per row; longer cached forwards (later
# prefill chunks) keep SDPA: the float64 scores would be [rows x heads x T x K] doubles.
EXACT_MAX_QUERIES = 64


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention in float64 for half-precision q [B,H,T,D], k/v [B,Hkv,S,D], mask a bool
    [B,1,T or 1,S] (True = may attend) or None: the result, cast back, is the same whether a
    query runs alone (decode) or beside others (verify) and however many masked keys follow.

    Why: SDPA's CPU kernel (and float32 GEMMs) order their float32 sums by the shapes of the
    call (query tiles, key tails, gemv at one row), so a bf16 token's attention output could
    differ by one bf16 ulp between the decode step and the verify forward, enough to flip a
    near-tied greedy argmax. Products of bf16 / fp16 values are exact in float64 and their
    sums over head_dim exact for any realistic range, so the scores carry no order; softmax
    and P@V keep errors near 2^-50, far below the cast back to half precision (2^-9).
    The cache stays in the model's dtype and is converted here, per layer and step: a
    float64 cache (converting only the new keys) made a batch-16 bf16 decode step slower on
    a 2-core Zen 4, since the step then reads four times the bytes from memory."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv  # query head h reads kv head h // g (enable_gqa's grouping)
    scores = torch.matmul(q.reshape(b, hkv, g * t, d).double(), k.double().transpose(-1, -2)) * (d ** -0.5)
    if mask is not None:
        keys = scores.shape[-1]
        scores = scores.view(b, hkv, g, t, keys).masked_fill(~mask.unsqueeze(2), float("-inf"))
        scores = scores.view(b, hkv, g * t, keys)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.double())
    return out.view(b, hq, t, d).to(q.dtype)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | KeyMask | None
                  ) -> torch.Tensor:
    """`attend` for queries appended to a KV cache (k/v: the cache's slots [0, upto)):
    `float64_attention` for at most EXACT_MAX_QUERIES half-precision queries per row on the
    CPU (unless BLOCKSPEC_ATTENTION=sdpa), else `attend`."""
    dense = mask.dense if isinstance(mask, KeyMask) else mask
    kernel_mask = isinstance(mask, KeyMask) and (mask.block is not None or mask.self_causal)
    if (q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" and not kernel_mask
            and q.shape[2] <= EXACT_MAX_QUERIES and os.environ.get("BLOCKSPEC_ATTENTION", "auto") == "auto"):
        return float64_attention(q, k, v, dense)
    return attend(q, k, v, mask)


def limit_block_mask(first_limit: torch.Tensor, q_len: int, kv_len: int, causal: bool) -> BlockMask:
    """Block mask where query t of row r sees keys j < first_limit[r] + (t if causal else 0),
    built from the limits alone ([R] tensors; nothing of size rows x queries x keys).

    Per (row, query tile): key tiles wholly visible to every query of the tile are
    "full" (no mask_mod call), the tiles up to the last visible key are partial,
    and the rest are skipped."""
    dev, n = first_limit.device, FLEX_BLOCK
    rows = first_limit.shape[0]
    nq, nkv = -(-q_len // n), -(-kv_len // n)
    q_first = torch.arange(nq, device=dev) * n
    q_last = torch.clamp(q_first + n, max=q_len) - 1
    if not causal:  # every query of a tile has the row's limit
        q_first, q_last = torch.zeros_like(q_first), torch.zeros_like(q_last)
    lo = first_limit.view(rows, 1) + q_first   # keys < lo: seen by every query of the tile  [R, nq]
    hi = first_limit.view(rows, 1) + q_last    # keys < hi: seen by some
    full = torch.clamp(lo // n, 0, nkv)
    partial = torch.clamp((hi + n - 1) // n, 0, nkv) - full
    tiles = torch.arange(nkv, device=dev)
    limit = first_limit.view(rows)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv < limit[b] + (q if causal else 0)

    return BlockMask.from_kv_blocks(
        partial.to(torch.int32).view(rows, 1, nq),
        torch.clamp(full.unsqueeze(-1) + tiles, max=nkv - 1).to(torch.int32).view(rows, 1, nq, nkv),
        full.to(torch.int32).view(rows, 1, nq),
        tiles.to(torch.int32).expand(rows, 1, nq, nkv),
        BLOCK_SIZE=n, mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def dense_limit_mask(first_limit: torch.Tensor, q_len: int, kv_len: int, causal: bool) -> torch.Tensor:
    """The same constraint as `limit_block_mask` as a bool tensor: [R, 1, T, K] when
    causal, else [R, 1, 1, K] (a key-length mask, broadcast over the queries)."""
    key = torch.arange(kv_len, device=first_limit.device).view(1, 1, kv_len)
    limit = first_limit.view(-1, 1, 1)
    if causal:
        limit = limit + torch.arange(q_len, device=first_limit.device).view(1, q_len, 1)
    return (key < limit).unsqueeze(1)


def limit_mask(first_limit: torch.Tensor, q_len: int, kv_len: int, causal: bool) -> KeyMask:
    """Query t of row r sees keys < first_limit[r] (+ t when causal), in the kernel's form
    (`backend_for`)."""
    if backend_for(first_limit.device) == "flex":
        return KeyMask(block=limit_block_mask(first_limit, q_len, kv_len, causal))
    return KeyMask(dense=dense_limit_mask(first_limit, q_len, kv_len, causal))


def band_mask(key_pos: torch.Tensor, first: torch.Tensor, width: int, window: int | None,
              causal: bool) -> KeyMask:
    """A draft block of `width` queries at positions first[r] + t over keys at positions
    key_pos [R or 1, K] (negative: an empty slot): query q sees key position j when
    0 <= j < first[r] + width, j > q - window (a sliding layer; None: no window) and j <= q
    when `causal` (docs/design.md section 3.2). A dense [R, 1, T, K] mask."""
    q = (first.view(-1, 1) + torch.arange(width, device=first.device)).unsqueeze(-1)   # [R, T, 1]
    j = key_pos.unsqueeze(1)                                                           # [R, 1, K]
    seen = (j >= 0) & (j < first.view(-1, 1, 1) + width)
    if window is not None:
        seen = seen & (j > q - window)
    if causal:
        seen = seen & (j <= q)
    return KeyMask(dense=seen.unsqueeze(1))


def tree_mask(lengths: torch.Tensor, sees: torch.Tensor, upto: int) -> torch.Tensor:
    """A draft tree's queries over a cache: every row's committed slots [0, lengths[r]) plus
    the tree's own slots lengths[r] + j that `sees` [R, T, W] marks (its ancestors and
    itself). A dense [R, 1, T, upto] bool mask (True = may attend)."""
    rows, queries, width = sees.shape
    rel = torch.arange(upto, device=lengths.device).unsqueeze(0) - lengths.unsqueeze(1)   # [R, upto]
    in_tree = (rel >= 0) & (rel < width)
    tree_keys = sees.gather(2, rel.clamp(0, width - 1).unsqueeze(1).expand(rows, queries, upto))
    return ((rel < 0).unsqueeze(1) | (in_tree.unsqueeze(1) & tree_keys)).unsqueeze(1)


def append_mask(lengths: torch.Tensor, width: int, upto: int, fresh: bool) -> KeyMask:
    """Keys of `width` tokens appended causally after rows of `lengths` [R]: query t of row r
    sees slots <= lengths[r] + t of [0, upto). fresh (every row was empty): the block attends
    to itself (SDPA is_causal, no mask; padding queries of right-padded rows are never read);
    one row's one token sees its whole cache; else a per-row limit (`limit_mask`)."""
    if fresh:
        return KeyMask(self_causal=True)
    if lengths.shape[0] == 1 and width == 1:
        return ALL_KEYS
    return limit_mask(lengths + 1, width, upto, causal=True)
