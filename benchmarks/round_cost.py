"""Cost of one speculative round on the embedded target at batch 1: one draft
forward (+ sampling), one verify forward over the window, one AR step — measured
in the same run, interleaved, medians over repeats. Block layout: z-lab (block B
includes the anchor, window B).

    python benchmarks/round_cost.py [--target DIR] [--draft DIR] [--context 256] [--repeats 30]
    python benchmarks/round_cost.py --target-shape 384x12 --draft-layers 1,2   # candidate shapes, random weights
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec import embedded, load_draft, load_target
from blockspec.config import DraftConfig, SamplingParams
from blockspec.decoding.sampling import RowSampler
from blockspec.decoding.prefill import ContextSink, prefill
from blockspec.decoding.round import propose, verify_and_commit
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from blockspec.training.pretrain import PretrainConfig, init_weights, model_config


def random_target(shape: str) -> TargetModel:
    """A random target of the pretraining recipe's shape rules (head_dim 64, 3x MLP, 2 KV heads):
    weights do not change the timing."""
    hidden, layers = (int(x) for x in shape.split("x"))
    cfg = PretrainConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, num_kv_heads=2,
                         head_dim=64, intermediate_size=3 * hidden, max_position_embeddings=4096)
    model = TargetModel(model_config(cfg, 8192, 0))
    init_weights(model)
    return model.eval().requires_grad_(False)


def build_draft(target, path: str | None, block: int, layers: int = 1) -> DraftModel:
    if path:
        return load_draft(path, target=target).with_block_size(block)
    tc = target.config  # weights do not change the timing: a random draft of the given depth
    n = tc.num_hidden_layers
    cfg = DraftConfig(layout="zlab", block_size=block, mask_token_id=2,
                      target_layer_ids=sorted({1, n // 2, n - 2}),
                      num_target_layers=n, hidden_size=tc.hidden_size,
                      intermediate_size=tc.intermediate_size, num_hidden_layers=layers,
                      num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                      head_dim=tc.head_dim, vocab_size=tc.vocab_size)
    return DraftModel(cfg).eval().requires_grad_(False)


@torch.inference_mode()
def measure(target, draft, context: int, repeats: int) -> dict[str, float]:
    sampler = RowSampler.from_params([SamplingParams()])
    prompt = torch.randint(5, target.config.vocab_size, (context,)).tolist()
    cap = context + 64
    cache, dcache = target.new_cache(1, cap), draft.new_cache(1, cap + 32)
    anchors = prefill(target, cache, [prompt], sampler, ContextSink(draft, dcache)).anchors
    t_draft, t_verify, t_ar = [], [], []
    for _ in range(repeats):
        start_t, start_d = cache.lengths.clone(), dcache.lengths.clone()
        t0 = time.perf_counter()
        proposal = propose(draft, target, dcache, anchors, sampler)
        t1 = time.perf_counter()
        verdict, features = verify_and_commit(target, cache, anchors, proposal, sampler,
                                              capture=tuple(draft.config.target_layer_ids))
        draft.append_context(dcache, features, verdict.accepted + 1)   # the commit's draft context
        t2 = time.perf_counter()
        cache.truncate(start_t)
        dcache.truncate(start_d)
        target(anchors.unsqueeze(1), cache)       # one AR step at the same context length
        t3 = time.perf_counter()
        cache.truncate(start_t)
        t_draft.append(t1 - t0)
        t_verify.append(t2 - t1)
        t_ar.append(t3 - t2)
    med = statistics.median
    return {"draft_ms": med(t_draft) * 1e3, "verify_ms": med(t_verify) * 1e3, "ar_ms": med(t_ar) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None, help="a trained z-lab draft (default: random of the shipped shape)")
    ap.add_argument("--target-shape", default=None, help="HIDDENxLAYERS: a random target of that shape")
    ap.add_argument("--draft-layers", default="1", help="random drafts of these depths (comma list)")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = random_target(args.target_shape) if args.target_shape else \
        load_target(args.target or embedded.default_target())
    depths = [None] if args.draft else [int(x) for x in args.draft_layers.split(",")]
    tc = target.config
    print(f"batch 1, target {tc.hidden_size}x{tc.num_hidden_layers}, context {args.context} tokens, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    print("| draft layers | block | T_draft ms | T_verify ms | T_ar ms | T_draft/T_ar | T_verify/T_ar | "
          "(T_draft+T_verify)/T_ar |")
    print("|---|---|---|---|---|---|---|---|")
    for depth in depths:
        for block in (int(b) for b in args.blocks.split(",")):
            draft = build_draft(target, args.draft, block, depth or 1)
            r = measure(target, draft, args.context, args.repeats)
            d, v, a = r["draft_ms"], r["verify_ms"], r["ar_ms"]
            print(f"| {draft.config.num_hidden_layers} | {block} | {d:.2f} | {v:.2f} | {a:.2f} | {d / a:.2f} | "
                  f"{v / a:.2f} | {(d + v) / a:.2f} |")


if __name__ == "__main__":
    main()
