"""CPU decode speed of candidate target sizes (issue 20: the new target must still give a
comfortable CPU demo). Decode speed does not depend on the weights, so each size is a
randomly initialised target (the pretraining recipe's own architecture and init): batch-1
AR `generate`, a 64-token prompt, N new tokens (EOS ignored), median of repeats; sizes
interleaved per repeat. Prints parameters, bf16 size and tokens/s per size.

    python benchmarks/target_size_speed.py [--sizes 256x8,384x10,448x12] [--new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec.bench.metrics import markdown_table
from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.models.target import TargetModel
from blockspec.training.pretrain import PretrainConfig, init_weights, model_config


def build(hidden: int, layers: int) -> TargetModel:
    """The recipe's shape rules: head_dim 64, 3x MLP, KV heads the largest divisor of the heads up to
    heads / 3 (at least 1; 256 keeps the shipped 4/2)."""
    heads = max(1, hidden // 64)
    kv = 2 if hidden == 256 else max(d for d in range(1, max(1, heads // 3) + 1) if heads % d == 0)
    cfg = PretrainConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=64,
                         intermediate_size=3 * hidden)
    torch.manual_seed(0)
    model = TargetModel(model_config(cfg, 8192, 0))
    init_weights(model)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256x8,384x10,448x12")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    models = {s: build(*s) for s in sizes}
    prompt = [5 + (7 * i) % 8000 for i in range(64)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for model in models.values():   # warm-up
        generate(model, [prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    times: dict[tuple[int, int], list[float]] = {s: [] for s in sizes}
    for rep in range(args.repeats):
        for s in sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]:
            t0 = time.perf_counter()
            out = generate(models[s], [prompt], params)
            times[s].append(len(out.completions[0].tokens) / (time.perf_counter() - t0))
    rows = []
    for (hidden, layers), m in models.items():
        n = sum(p.numel() for p in m.parameters())
        rows.append({"size": f"{hidden}x{layers}", "heads/kv": f"{m.config.num_attention_heads}/"
                     f"{m.config.num_key_value_heads}", "params_M": n / 1e6, "bf16_MB": 2 * n / 1e6,
                     "ar_tok_per_s": statistics.median(times[(hidden, layers)])})
    print(f"batch-1 AR on {torch.get_num_threads()} CPU threads, float32, 64-token prompt, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; random weights (speed only)\n")
    print(markdown_table(rows, ["size", "heads/kv", "params_M", "bf16_MB", "ar_tok_per_s"]))


if __name__ == "__main__":
    main()
