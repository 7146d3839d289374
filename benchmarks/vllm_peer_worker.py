"""The vLLM half of benchmarks/vllm_peer.py, run by the vLLM venv's Python (it imports only
vllm, torch and the standard library; blockspec is not importable there by design).

    .venv-vllm/bin/python benchmarks/vllm_peer_worker.py JOB.json

JOB: {"target", "draft", "window", "prompts": [[ids]], "max_new_tokens", "dtype", "method",
"max_batch", "patch_rmsnorm", "prefix_caching"}: one engine per process (a second LLM in one process finds
vLLM's distributed state torn down by the first). The worker builds the engine, prints one JSON
line {"ready": vllm version}, then serves cells: each stdin line {"batch": B} runs every prompt
in batches of B and answers one JSON line with the tokens of each prompt, the wall time and the
spec-decode counters of that cell (vLLM's own metrics: drafts, draft tokens, accepted tokens,
accepted per position). So the driver can interleave vLLM's cells with blockspec's, repeat by
repeat. Everything else vLLM prints goes to stderr.

`patch_rmsnorm`: replace qwen3_dflash's grouped context-K RMSNorm (one `ops.rms_norm` call over the
[layers, tokens, heads, head_dim] stack with a [layers, head_dim] weight, which the CPU kernel reads
as layer 0's weight for every layer) by one call per layer: the fix that makes vLLM's DFlash
acceptance match the reference (docs/results.md, issue 29).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.model_executor.models import qwen3_dflash  # noqa: E402

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def per_layer_k_norm(self, all_k: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


def spec_counters(llm: LLM) -> dict:
    found: dict = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
        elif metric.name == PER_POS:
            found["accepted_per_pos"] = list(metric.values)
    return found


def delta(after: dict, before: dict) -> dict:
    out = {k: v - before.get(k, 0) for k, v in after.items() if not isinstance(v, list)}
    if "accepted_per_pos" in after:
        old = before.get("accepted_per_pos") or [0] * len(after["accepted_per_pos"])
        out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], old)]
    return out


def run_cell(llm: LLM, prompts: list[list[int]], batch: int, max_new_tokens: int) -> tuple[list, float]:
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens, time.perf_counter() - start


def main() -> None:
    job = json.load(open(sys.argv[1]))
    out = sys.stdout
    sys.stdout = sys.stderr   # vLLM's own prints must not mix with the answers
    if job.get("patch_rmsnorm"):
        qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer_k_norm
    spec = ({"method": "dflash", "model": job["draft"], "num_speculative_tokens": job["window"]}
            if job["method"] == "dflash" else None)
    # Prefix caching off unless asked: every cell runs the same prompts, so from the second cell (and
    # repeat) on vLLM would serve their prefill from its cache while blockspec's `generate` computes it.
    llm = LLM(model=job["target"], speculative_config=spec, dtype=job["dtype"], max_model_len=1024,
              enforce_eager=True, seed=0, disable_log_stats=False, max_num_seqs=max(16, job["max_batch"]),
              enable_prefix_caching=bool(job.get("prefix_caching")))
    run_cell(llm, job["prompts"][:2], 2, 8)   # warm-up
    print(json.dumps({"ready": vllm.__version__}), file=out, flush=True)
    for line in sys.stdin:
        batch = json.loads(line)["batch"]
        before = spec_counters(llm)
        tokens, seconds = run_cell(llm, job["prompts"], batch, job["max_new_tokens"])
        print(json.dumps({"tokens": tokens, "seconds": seconds, "counters": delta(spec_counters(llm), before)}),
              file=out, flush=True)


if __name__ == "__main__":
    main()
