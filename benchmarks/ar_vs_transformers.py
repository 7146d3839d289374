"""AR decode tokens/s: blockspec's native target vs transformers' generate, same
checkpoint, same run, interleaved. Prints a Markdown table.

Native arms: eager, and (unless --no-compile) the torch.compile'd decode step
(`generate(..., options=GenerateOptions(compile=True))`); its one-off compile is done before timing and
reported separately.

    python benchmarks/ar_vs_transformers.py [--target DIR] [--new-tokens 128] [--repeats 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from blockspec import GenerateOptions, SamplingParams, Tokenizer, embedded, generate, load_target


def time_native(model, prompts, new_tokens, compile=False):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = generate(model, prompts, params, options=GenerateOptions(compile=compile))
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
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled native arm")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = args.target or str(embedded.default_target())
    native = load_target(path)
    compiled = None if args.no_compile else load_target(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = Tokenizer(path)
    base = ["def fib(n):", "import os\nimport sys\n\n\ndef main(argv):", "class Stack:\n    def __init__(self):"]
    rows = []
    compile_s = {}
    for batch in (1, 8):
        prompts = [tok.encode(base[i % len(base)]) for i in range(batch)]
        if compiled is not None:  # compile (once per batch size) outside the timed runs
            t0 = time.perf_counter()
            time_native(compiled, prompts, args.new_tokens, compile=True)
            compile_s[batch] = time.perf_counter() - t0
        nat, comp, ref = [], [], []
        for _ in range(args.repeats):  # interleaved so drift hits every arm equally
            nat.append(time_native(native, prompts, args.new_tokens))
            if compiled is not None:
                comp.append(time_native(compiled, prompts, args.new_tokens, compile=True))
            ref.append(time_hf(hf, prompts, args.new_tokens, tok.pad_token_id or 0))
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
        rows.append((batch, med(nat), med(comp), med(ref)))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, float32, new tokens {args.new_tokens}, median of {args.repeats}")
    print("| batch | blockspec eager tok/s | blockspec compiled tok/s | transformers tok/s "
          "| eager / transformers | compiled / transformers |")
    print("|---|---|---|---|---|---|")
    for batch, n, c, h in rows:
        print(f"| {batch} | {n:.1f} | {c:.1f} | {h:.1f} | {n / h:.2f}x | {c / h:.2f}x |")
    if compile_s:
        print("\ncompiled arm: first call (compile + 128 tokens) took "
              + ", ".join(f"{s:.0f} s at batch {b}" for b, s in compile_s.items()))


if __name__ == "__main__":
    main()
