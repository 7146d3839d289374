"""Per-round cost of DFlash block speculation on one CUDA GPU (docs/design.md section 1).

A random-weight Qwen3-8B-shaped target (bf16) and a 5-layer DFlash draft
(z-lab layout, block 16 = anchor + 15 drafts, target layers [1, 9, 17, 25, 33])
are built in memory (no checkpoint files). With C tokens of context cached, it
times, at batch 1 and 16:

- T_ar:     one AR step            (`round.verify_and_commit`, no drafts)
- T_draft:  one draft round        (`round.propose`: one block forward + sampling)
- T_verify: one verify + commit    (`round.verify_and_commit` over anchor + 15 drafts)

each as the median of CUDA-event timings after warm-up, caches rolled back
after every call so every sample sees the same context. Random weights accept
nothing, so the speed-up is projected from the cost model:
`speedup(tau) = tau * T_ar / (T_draft + T_verify)` at tau 3.0 and 6.5.

    bash benchmarks/gpu.sh [--batches 1,16] [--context 512] [--iters 20]

Exits with status 2 and one line on stderr when no CUDA GPU is available.
`--smoke` runs tiny shapes on the CPU to test this script (numbers meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import shutil
import statistics
import sys
import time
from typing import Callable, Iterator

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, eos_token_id=151645)
# The published z-lab DFlash draft for Qwen3-8B (docs/design.md section 6), minus the weights.
DFLASH_8B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=16,
                 dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
                 num_target_layers=36, num_hidden_layers=5, hidden_size=4096, intermediate_size=12288,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936)
SMOKE_TARGET = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=511)
SMOKE_DRAFT = dict(DFLASH_8B, block_size=8, dflash_config={"mask_token_id": 510, "target_layer_ids": [1, 3]},
                   num_target_layers=6, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
TAUS = (3.0, 6.5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per row before the timed round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: tests this script only")
    return ap.parse_args(argv)


def nvidia_visible() -> bool:
    """Cheap pre-check: a CUDA GPU needs the driver's device nodes (containers included)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


@contextlib.contextmanager
def default_dtype(dtype) -> Iterator[None]:
    """Build parameters directly in bf16: an fp32 detour would need 32 GB for the 8B target."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def random_init(model, device, dtype):
    """Materialise a meta-device model on `device` with N(0, 0.02) matrices and unit norms."""
    import torch

    from blockspec.models.layers import rope_inv_freq

    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model = model.to(dtype).eval().requires_grad_(False)
    # Non-persistent RoPE buffer: recomputed in float32 after the cast, as load_target does.
    model.rotary.inv_freq = rope_inv_freq(model.config.head_dim, model.config.rope).to(device)
    return model


def build_models(smoke: bool, device, dtype):
    import torch

    from blockspec.config import DraftConfig, TargetConfig
    from blockspec.models.draft import DraftModel
    from blockspec.models.target import TargetModel

    tcfg = TargetConfig.from_dict(SMOKE_TARGET if smoke else QWEN3_8B)
    dcfg = DraftConfig.from_dict(SMOKE_DRAFT if smoke else DFLASH_8B)
    dcfg.check_target(tcfg)
    with default_dtype(dtype), torch.device("meta"):
        target, draft = TargetModel(tcfg), DraftModel(dcfg)
    return random_init(target, device, dtype), random_init(draft, device, dtype)


class Timer:
    """Median seconds of `fn` after warm-up; CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters

    def _once(self, fn: Callable[[], object]) -> float:
        import torch

        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1e3

    def median(self, fn: Callable[[], object], reset: Callable[[], None]) -> float:
        samples = []
        for i in range(self.warmup + self.iters):
            t = self._once(fn)
            reset()
            if i >= self.warmup:
                samples.append(t)
        return statistics.median(samples)


def measure_batch(target, draft, batch: int, context: int, timer: Timer) -> dict[str, float]:
    """T_ar, T_draft, T_verify (seconds) at `batch` rows of `context` cached tokens."""
    import torch

    from blockspec.config import SamplingParams
    from blockspec.decoding.sampling import RowSampler
    from blockspec.decoding.round import prefill, propose, verify_and_commit

    device = target.device
    width = draft.config.block_size + 1
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, target.config.vocab_size, (batch, context), generator=gen).tolist()
    cache = target.new_cache(batch, context + width + 1)
    draft_cache = draft.new_cache(batch, context + 2 * width + 1)
    sampler = RowSampler.from_params([SamplingParams(seed=r) for r in range(batch)], device)  # greedy
    with torch.inference_mode():
        anchors = prefill(target, cache, prompts, sampler, draft, draft_cache)
        base, draft_base = cache.lengths.clone(), draft_cache.lengths.clone()

        def rollback() -> None:  # every sample starts from the same cached context
            cache.truncate(base)
            draft_cache.truncate(draft_base)

        proposal = propose(draft, target, draft_cache, anchors, sampler)
        capture = tuple(draft.config.target_layer_ids)

        def verify() -> None:  # verify, commit, and the accepted tokens' features into the draft context
            verdict, features = verify_and_commit(target, cache, anchors, proposal, sampler, capture=capture)
            draft.append_context(draft_cache, features, verdict.accepted + 1)

        out = {
            "ar": timer.median(lambda: verify_and_commit(target, cache, anchors, None, sampler), rollback),
            "draft": timer.median(lambda: propose(draft, target, draft_cache, anchors, sampler), rollback),
            "verify": timer.median(verify, rollback),
        }
    del cache, draft_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def projected(tau: float, t: dict[str, float]) -> float:
    """docs/design.md section 1: per-token latency (T_draft + T_verify) / tau against T_ar."""
    return tau * t["ar"] / (t["draft"] + t["verify"])


def projection_cell(tau: float, t: dict[str, float], max_tau: int) -> str:
    return f"{projected(tau, t):.2f}x" if tau <= max_tau else "n/a (> max tau)"


def report(rows: list[tuple[int, dict[str, float]]], header: str, draft_cfg) -> str:
    """Markdown table of the measured terms and the cost-model projections."""
    g = draft_cfg.num_drafts
    lines = [header, "",
             "| batch | T_ar ms | T_draft ms | T_verify ms | round / T_ar | "
             + " | ".join(f"speedup @ tau {tau}" for tau in TAUS) + " |",
             "|---|---|---|---|---|" + "---|" * len(TAUS)]
    for batch, t in rows:
        ratio = (t["draft"] + t["verify"]) / t["ar"]
        cells = [f"{batch}", f"{t['ar'] * 1e3:.2f}", f"{t['draft'] * 1e3:.2f}", f"{t['verify'] * 1e3:.2f}",
                 f"{ratio:.2f}"] + [projection_cell(tau, t, g + 1) for tau in TAUS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "speedup(tau) = tau * T_ar / (T_draft + T_verify); tau includes the bonus token "
                  f"({draft_cfg.layout} block {draft_cfg.block_size}: {g} drafts, max tau {g + 1})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        print(f"error: --batches must be comma-separated integers, got {args.batches!r}", file=sys.stderr)
        return 2
    if not batches or min(batches) < 1 or args.context < 1 or args.iters < 1 or args.warmup < 0:
        print("error: batches, --context and --iters must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if not args.smoke and not nvidia_visible():  # say so before a slow torch import
        print("error: gpu_bench needs a CUDA GPU, and none is visible (no /dev/nvidia* device, no nvidia-smi)",
              file=sys.stderr)
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("error: gpu_bench needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    t0 = time.perf_counter()
    target, draft = build_models(args.smoke, device, dtype)
    built = time.perf_counter() - t0
    timer = Timer(device, args.warmup, args.iters)
    rows = [(b, measure_batch(target, draft, b, args.context, timer)) for b in batches]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--smoke: numbers meaningless)"
    tc, dc = target.config, draft.config
    header = (f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}; target "
              f"{tc.num_hidden_layers} layers hidden {tc.hidden_size} vocab {tc.vocab_size} (random weights, "
              f"built in {built:.1f}s); DFlash draft {dc.num_hidden_layers} layers, block {dc.block_size} "
              f"({dc.layout}), ids {dc.target_layer_ids}; context {args.context}; median of {args.iters} "
              f"after {args.warmup} warm-up")
    print(report(rows, header, dc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
