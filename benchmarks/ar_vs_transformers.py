"""AR decode tokens/s: blockspec's native target vs transformers' generate, same
checkpoint, same run, interleaved. Prints a Markdown table.

    python benchmarks/ar_vs_transformers.py [--target DIR] [--new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_target


def time_native(model, prompts, new_tokens):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = generate(model, prompts, params)
    return out.new_tokens / (time.perf_counter() - t0)


def time_hf(model, prompts, new_tokens, pad_id):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding, as generate expects
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = args.target or str(embedded.default_target())
    native = load_target(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = Tokenizer(path)
    base = ["def fib(n):", "import os\nimport sys\n\n\ndef main(argv):", "class Stack:\n    def __init__(self):"]
    rows = []
    for batch in (1, 8):
        prompts = [tok.encode(base[i % len(base)]) for i in range(batch)]
        nat, ref = [], []
        for _ in range(args.repeats):  # interleaved so drift hits both equally
            nat.append(time_native(native, prompts, args.new_tokens))
            ref.append(time_hf(hf, prompts, args.new_tokens, tok.pad_token_id or 0))
        n, h = sorted(nat)[len(nat) // 2], sorted(ref)[len(ref) // 2]
        rows.append((batch, n, h))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, new tokens {args.new_tokens}, median of {args.repeats}")
    print("| batch | blockspec tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|")
    for batch, n, h in rows:
        print(f"| {batch} | {n:.1f} | {h:.1f} | {n / h:.2f}x |")


if __name__ == "__main__":
    main()
