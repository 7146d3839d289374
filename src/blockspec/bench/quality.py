"""Quality of the text a benchmark decoded: degeneracy and, for code prompts, whether the
completion parses with a function body (docs/design.md section 11).

A looping target makes tau meaningless (a draft predicts a loop easily), so every
bench row carries these next to tau.

- Degeneracy (``rep8``): the share of generated tokens that sit inside a repeated
  8-gram of the same completion.  A token at position ``i`` is inside a repeated
  n-gram when some n-token window ``tokens[j:j+n]`` with ``j <= i < j+n`` occurs at
  least twice in that completion (occurrences may overlap).  A completion shorter
  than n has no window, so none of its tokens counts.  Over many completions the
  share is token-weighted: covered tokens / generated tokens.
- Code quality: the completion is cut where the function ends (the usual HumanEval
  stop sequences at column 0), appended to the prompt and given to ``ast.parse``;
  "with a body" additionally needs the prompt's function (``entry_point``) to hold a
  statement besides its docstring and ``pass`` (an empty body parses too, so the
  parse rate alone flatters a weak model).

Pure Python: no model, no tokenizer (callers decode).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["REPEAT_N", "LOOP_SHARE", "STOPS", "repeated_mask", "repeated_count", "degeneracy", "cut_function",
           "has_body", "parses_with_body", "code_quality"]

REPEAT_N = 8          # the n of "inside a repeated n-gram"
LOOP_SHARE = 0.5      # a completion with more than this share covered counts as a loop

# The usual HumanEval stop sequences: anything at column 0 after the body ends the function.
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")


def repeated_mask(tokens: Sequence[int], n: int = REPEAT_N) -> list[bool]:
    """Per position: whether it lies inside an n-token window that occurs at least twice."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    windows = [tuple(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]
    counts = Counter(windows)
    # Difference array: +1 where a repeated window starts, -1 just past its end.
    edges = [0] * (len(tokens) + 1)
    for j, w in enumerate(windows):
        if counts[w] >= 2:
            edges[j] += 1
            edges[j + n] -= 1
    mask, depth = [], 0
    for i in range(len(tokens)):
        depth += edges[i]
        mask.append(depth > 0)
    return mask


def repeated_count(tokens: Sequence[int], n: int = REPEAT_N) -> int:
    """How many tokens of one completion lie inside a repeated n-gram of it."""
    return sum(repeated_mask(tokens, n))


def degeneracy(completions: Sequence[Sequence[int]], n: int = REPEAT_N) -> dict[str, Any]:
    """Token-weighted repeated-n-gram share over completions, and the share of completions
    that are mostly loop (covered share > LOOP_SHARE). Shares are None with nothing generated
    (never a made-up 0)."""
    covered = [repeated_count(c, n) for c in completions]
    tokens = sum(len(c) for c in completions)
    nonempty = [(k, len(c)) for k, c in zip(covered, completions) if c]
    return {
        "n": n, "completions": len(completions), "tokens": tokens, "repeated_tokens": sum(covered),
        "share": sum(covered) / tokens if tokens else None,
        "looping_completions": sum(k / m > LOOP_SHARE for k, m in nonempty),
        "looping_share": sum(k / m > LOOP_SHARE for k, m in nonempty) / len(nonempty) if nonempty else None,
    }


def cut_function(completion: str) -> str:
    """The completion up to the first stop sequence (the end of the prompt's function)."""
    ends = [completion.find(s) for s in STOPS if s in completion]
    return completion[:min(ends)] if ends else completion


def has_body(tree: ast.Module, name: str) -> bool:
    """Whether function `name` has a statement besides its docstring and `pass`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return any(not (isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                        and isinstance(s.value.value, str))) for s in node.body)
    return False


def parses_with_body(prompt: str, completion: str, entry_point: str) -> tuple[bool, bool]:
    """(parses, parses with a body) of `prompt` + the completion cut at the function's end."""
    try:
        tree = ast.parse(prompt + cut_function(completion))
    except (SyntaxError, ValueError):   # ValueError: a NUL byte in the source
        return False, False
    return True, has_body(tree, entry_point)


def code_quality(prompts: Sequence[str], completions: Sequence[str],
                 entry_points: Sequence[str | None]) -> dict[str, Any] | None:
    """Parse and parse-with-body rates over the prompts that name a function (None when none does)."""
    scored = [parses_with_body(p, c, e) for p, c, e in zip(prompts, completions, entry_points, strict=True)
              if e is not None]
    if not scored:
        return None
    return {"scored": len(scored), "parsed": sum(p for p, _ in scored), "with_body": sum(b for _, b in scored),
            "parse_rate": sum(p for p, _ in scored) / len(scored),
            "body_rate": sum(b for _, b in scored) / len(scored)}
