"""Attention kernels on this machine (models/attention.py, issue 18 part A), on the shipped
target, float32, interleaved, medians:

1. prefill into empty rows: SDPA is_causal without a mask vs the dense causal mask;
2. cached forwards of 8 ragged rows (decode W = 1, verify W = 16): SDPA with the limit mask
   vs flex_attention run eagerly (what BLOCKSPEC_ATTENTION=flex does off CUDA);
3. the attention op alone: compiled flex_attention (block mask from the lengths) vs SDPA
   with the mask, and the first compiled call (skipped with --no-compile);
4. chunked prefill: one prompt as chunks of --chunk tokens vs one forward (per-token cost).

    python benchmarks/attention_kernels.py [--repeats 5] [--chunk 512] [--no-compile] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from blockspec import embedded, load_target
from blockspec.models.attention import dense_limit_mask, limit_block_mask
from blockspec.models.target import TargetModel


def medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn, the fns interleaved (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def prefill_rows(target: TargetModel, shapes: list[tuple[int, int]], repeats: int) -> None:
    print("| prefill rows x tokens | is_causal, no mask (ms) | dense causal mask (ms) | ratio |")
    print("|---|---|---|---|")
    vocab = target.config.vocab_size
    for rows, t in shapes:
        ids = torch.randint(1, vocab, (rows, t))
        n = torch.full((rows,), t)
        mask = dense_limit_mask(torch.ones(rows, dtype=torch.long), t, t, True)
        caches = [target.new_cache(rows, t), target.new_cache(rows, t)]

        def run(i: int, m: torch.Tensor | None) -> None:
            caches[i].reset()
            target(ids, caches[i], num_new=n, mask=m)

        r = medians({"free": lambda: run(0, None), "mask": lambda: run(1, mask)}, repeats)
        print(f"| {rows} x {t} | {r['free'] * 1e3:.1f} | {r['mask'] * 1e3:.1f} | {r['mask'] / r['free']:.2f} |")


def cached_rows(target: TargetModel, ctx: int, widths: list[int], repeats: int) -> None:
    print("\n| cached forward, 8 ragged rows | SDPA + limit mask (ms) | eager flex_attention (ms) |")
    print("|---|---|---|")
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for w in widths:
        cache = target.new_cache(8, ctx + w)
        target(torch.randint(1, vocab, (8, ctx), generator=g), cache,
               num_new=torch.randint(ctx // 2, ctx + 1, (8,), generator=g))
        lengths = cache.lengths.clone()
        block = torch.randint(1, vocab, (8, w), generator=g)

        def step(backend: str) -> None:
            os.environ["BLOCKSPEC_ATTENTION"] = backend
            target(block, cache)
            cache.lengths.copy_(lengths)

        r = medians({b: (lambda b=b: step(b)) for b in ("sdpa", "flex")}, repeats)
        os.environ.pop("BLOCKSPEC_ATTENTION", None)
        print(f"| W = {w}, ~{ctx} keys | {r['sdpa'] * 1e3:.1f} | {r['flex'] * 1e3:.1f} |")


def compiled_op(target: TargetModel, keys: int, widths: list[int], repeats: int) -> None:
    cfg = target.config
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    print(f"\n| attention op, 8 rows x {keys} keys, {heads}/{kv} heads x {d} | first compiled call (s) "
          "| compiled flex (ms) | SDPA + mask (ms) | max diff |")
    print("|---|---|---|---|---|")
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention)
    g = torch.Generator().manual_seed(1)
    for w in widths:
        q = torch.randn(8, heads, w, d, generator=g)
        k, v = torch.randn(8, kv, keys, d, generator=g), torch.randn(8, kv, keys, d, generator=g)
        first = torch.randint(keys // 2, keys - w + 1, (8,), generator=g) + 1
        block, mask = limit_block_mask(first, w, keys, True), dense_limit_mask(first, w, keys, True)
        t0 = time.perf_counter()
        got = flex(q, k, v, block_mask=block, enable_gqa=True)
        compile_s = time.perf_counter() - t0
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        r = medians({"flex": lambda: flex(q, k, v, block_mask=block, enable_gqa=True),
                     "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)},
                    repeats * 4)
        print(f"| W = {w} | {compile_s:.1f} | {r['flex'] * 1e3:.3f} | {r['sdpa'] * 1e3:.3f} "
              f"| {(got - want).abs().max().item():.1e} |")


def chunked(target: TargetModel, total: int, chunk: int, repeats: int) -> None:
    ids = torch.randint(1, target.config.vocab_size, (1, total))
    cache = target.new_cache(1, total)

    def whole() -> None:
        cache.reset()
        target(ids, cache)

    def chunks() -> None:
        cache.reset()
        for start in range(0, total, chunk):
            target(ids[:, start:start + chunk], cache)

    def first_chunk() -> None:
        cache.reset()
        target(ids[:, :chunk], cache)

    r = medians({"whole": whole, "chunks": chunks, "one": first_chunk}, repeats)
    print(f"\n| prompt of {total} tokens | one forward | chunks of {chunk} | one chunk (a step's stall) |")
    print("|---|---|---|---|")
    print(f"| total (ms) | {r['whole'] * 1e3:.1f} | {r['chunks'] * 1e3:.1f} | {r['one'] * 1e3:.1f} |")
    print(f"| per token (ms) | {r['whole'] * 1e3 / total:.3f} | {r['chunks'] * 1e3 / total:.3f} "
          f"| {r['one'] * 1e3 / chunk:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled flex_attention rows")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (a rehearsal)")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = load_target(embedded.default_target())
    cfg = target.config
    print(f"target: {cfg.hidden_size} x {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} heads x {cfg.head_dim}, float32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}\n")
    small = args.smoke
    repeats = 1 if small else args.repeats
    with torch.inference_mode():
        prefill_rows(target, [(2, 64)] if small else [(1, 512), (4, 512), (1, 2048)], repeats)
        cached_rows(target, 64 if small else 1024, [1, 4] if small else [1, 16], repeats)
        chunked(target, 128 if small else 2048, 32 if small else args.chunk, repeats)
        if not args.no_compile:
            compiled_op(target, 200 if small else 1088, [1] if small else [1, 16], repeats)


if __name__ == "__main__":
    main()
