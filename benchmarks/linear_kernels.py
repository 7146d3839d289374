"""The CPU linear layers' GEMM kernels side by side: the plain layout (F.linear) vs oneDNN
with the weight prepacked once (what models/layers.py runs without gradients), in float32
and bfloat16, at the embedded target's shapes, for the row counts of decode and verify.
Interleaved, medians of the repeats. Also checks what bf16 speculative == AR relies on
(docs/design.md, "Numerics"): a row's output bits do not depend on how many rows share
the GEMM (1 to 256).

    python benchmarks/linear_kernels.py [--rows 1,16,64,256] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from blockspec import embedded
from blockspec.config import TargetConfig
from blockspec.models.layers import _PACK_BATCH_HINT as PACK_HINT   # the layout the models pack for


def shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of the embedded target's GEMMs: fused qkv, o_proj, fused gate/up, down, lm_head."""
    c = TargetConfig.load(embedded.default_target())
    d, h = c.head_dim, c.hidden_size
    return {"qkv": ((c.num_attention_heads + 2 * c.num_key_value_heads) * d, h), "o": (h, c.num_attention_heads * d),
            "gate_up": (2 * c.intermediate_size, h), "down": (h, c.intermediate_size), "lm_head": (c.vocab_size, h)}


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])
    print(f"linear GEMMs of the embedded target, {args.threads} threads; microseconds per call, median of "
          f"{args.repeats} interleaved repeats of {args.calls} calls; oneDNN bf16 kernels: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print("| gemm (out x in) | rows | " + " | ".join(f"{str(dt)[6:]} plain | {str(dt)[6:]} packed | speedup"
                                                     for dt in dtypes) + " |")
    print("|---|---|" + "---|---|---|" * len(dtypes))
    invariant: dict[str, bool] = {}
    for name, (n, k) in shapes().items():
        for m in rows:
            cells = []
            for dt in dtypes:
                w, x = torch.randn(n, k, dtype=dt) / k ** 0.5, torch.randn(m, k, dtype=dt)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)
                plain = lambda: F.linear(x, w)  # noqa: E731
                fast = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
                runs: dict[str, list[float]] = {"plain": [], "packed": []}
                plain(), fast()
                for _ in range(args.repeats):
                    runs["plain"].append(timed(plain, args.calls))
                    runs["packed"].append(timed(fast, args.calls))
                p, q = statistics.median(runs["plain"]), statistics.median(runs["packed"])
                cells.append(f"{p:.1f} | {q:.1f} | {p / q:.2f}x")
                if dt == torch.bfloat16:
                    one = torch.ops.mkldnn._linear_pointwise(x[:1], packed, None, "none", [], "")
                    many = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                    invariant[f"{name} x{m}"] = torch.equal(one[0], many[0])
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(cells) + " |", flush=True)
    if invariant:
        same = sum(invariant.values())
        print(f"\nbf16 packed GEMM, row 0's bits alone vs beside the other rows: equal in {same}/{len(invariant)} cases"
              + ("" if same == len(invariant) else f" (differ: {', '.join(k for k, v in invariant.items() if not v)})"))


if __name__ == "__main__":
    main()
