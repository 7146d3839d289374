"""Minimal reproduction of why vLLM's CPU build accepts fewer DFlash drafts than the reference
(issue 29), for a vLLM maintainer: qwen3_dflash.py normalises the context keys of all draft
layers in one `ops.rms_norm` call over a [layers, tokens, kv_heads, head_dim] stack with a
stacked [layers, head_dim] k_norm weight (`_normalize_context_k`); the CPU kernel reads that
weight as one [head_dim] vector, i.e. layer 0's k_norm for every layer. Run with vLLM's Python:

    .venv-vllm/bin/python benchmarks/vllm_rmsnorm_repro.py
"""
import torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
L, n, h, d = 4, 5, 2, 64
x = torch.randn(L, n, h, d)
w = torch.randn(L, d)                        # one k_norm weight per layer, as qwen3_dflash stacks them
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
ref0 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[0]
print("max |out - per-layer reference|:", (out - ref).abs().max().item())
print("max |out - layer-0 weight everywhere|:", (out - ref0).abs().max().item())
