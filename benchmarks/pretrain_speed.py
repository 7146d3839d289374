"""Pretraining step speed on this machine: float32 vs bf16 autocast, eager vs torch.compile,
for one target shape (the pretraining loop's own train_step, fused AdamW, random tokens).
Variants interleaved per repeat; tokens/s is the median over repeats of `--steps` timed steps
(after one warm-up step per variant, which for compiled variants includes compiling).

    python benchmarks/pretrain_speed.py [--shape 384x12] [--batch 8] [--seq 1024] [--steps 3] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from blockspec.bench.metrics import markdown_table
from blockspec.training.pretrain import PretrainConfig, init_weights, make_optimizer, model_config, train_step
from blockspec.models.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="384x12", help="HIDDENxLAYERS (head_dim 64, 3x MLP, 2 KV heads)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="float32,bfloat16,float32+compile,bfloat16+compile")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, layers = (int(x) for x in args.shape.split("x"))
    cfg = PretrainConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, num_kv_heads=2,
                         head_dim=64, intermediate_size=3 * hidden, max_position_embeddings=args.seq,
                         seq_len=args.seq, batch_size=args.batch)
    torch.manual_seed(0)
    base = TargetModel(model_config(cfg, 8192, 0))
    init_weights(base)
    stream = torch.randint(5, 8192, (2_000_000,), dtype=torch.int32)
    device = torch.device("cpu")
    runs, compile_s = {}, {}
    for name in args.variants.split(","):
        model = copy.deepcopy(base).train()
        step_model = torch.compile(model) if name.endswith("+compile") else model
        runs[name] = (step_model, make_optimizer(model, cfg), name.startswith("bfloat16"))
        t0 = time.perf_counter()
        train_step(*runs[name][:2], stream, cfg, 0, device, runs[name][2])
        compile_s[name] = time.perf_counter() - t0
    speeds: dict[str, list[float]] = {n: [] for n in runs}
    names = list(runs)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            model, opt, bf16 = runs[name]
            t0 = time.perf_counter()
            for s in range(args.steps):
                train_step(model, opt, stream, cfg, 1 + rep * args.steps + s, device, bf16)
            speeds[name].append(args.batch * args.seq * args.steps / (time.perf_counter() - t0))
    n_params = sum(p.numel() for p in base.parameters())
    print(f"pretraining step, {args.shape} ({n_params / 1e6:.1f}M parameters), batch {args.batch} x {args.seq} "
          f"tokens, {torch.get_num_threads()} CPU threads; median of {args.repeats} x {args.steps} steps, "
          f"interleaved\n")
    ref = statistics.median(speeds[names[0]])
    rows = [{"variant": n, "tokens_per_s": statistics.median(v), "vs_" + names[0]: statistics.median(v) / ref,
             "first_step_s": compile_s[n]} for n, v in speeds.items()]
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
