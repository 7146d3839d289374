"""Degeneracy (repeated-n-gram share) and code quality (parses with a body) on hand-built inputs."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from blockspec.bench import quality
from blockspec.bench.quality import (code_quality, cut_function, degeneracy, has_body, parses_with_body,
                                     repeated_count, repeated_mask)


def brute_mask(tokens, n):
    """The definition, literally: i is covered when a window containing it occurs twice."""
    windows = [tuple(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]
    return [any(windows.count(windows[j]) >= 2 for j in range(max(0, i - n + 1), min(i, len(windows) - 1) + 1))
            for i in range(len(tokens))]


def test_no_repeat_is_zero():
    assert repeated_count(list(range(50))) == 0
    assert degeneracy([list(range(50)), list(range(100, 140))])["share"] == 0.0


def test_a_loop_is_nearly_all():
    loop = [1, 2, 3, 4, 5] * 30
    assert repeated_count(loop) == len(loop)              # a period-5 loop: every token is in a repeated 8-gram
    prefixed = list(range(100, 110)) + loop               # 10 fresh tokens, then the loop
    d = degeneracy([prefixed])
    assert d["repeated_tokens"] == len(loop) and d["share"] == pytest.approx(150 / 160)
    assert d["looping_completions"] == 1 and d["looping_share"] == 1.0


def test_exact_counts_on_small_cases():
    # one 8-gram occurring twice, separated by a unique token: both copies (16 tokens) count, the separator not
    a = list(range(8))
    assert repeated_mask(a + [99] + a) == [True] * 8 + [False] + [True] * 8
    # overlapping occurrences: nine equal tokens hold the same 8-gram at 0 and 1 -> all nine count
    assert repeated_count([7] * 9) == 9 and repeated_count([7] * 8) == 0
    # n=3 on a short case: "1 2 3" twice, with the tail 4 5 unique
    assert repeated_mask([1, 2, 3, 1, 2, 3, 4, 5], n=3) == [True] * 6 + [False, False]
    # a repeat shorter than n does not count
    assert repeated_count([1, 2, 3, 1, 2, 3], n=4) == 0
    # shorter than one window: nothing to repeat
    assert repeated_mask([1, 1, 1], n=8) == [False] * 3


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_definition_on_random_sequences(seed):
    import random
    rng = random.Random(seed)
    for _ in range(20):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        n = rng.randrange(1, 6)
        assert repeated_mask(tokens, n) == brute_mask(tokens, n)


def test_degeneracy_is_token_weighted_and_none_when_empty():
    d = degeneracy([[5] * 20, list(range(60))])          # 20 covered of 80
    assert d["share"] == pytest.approx(0.25) and d["looping_completions"] == 1
    assert d["looping_share"] == pytest.approx(0.5) and d["tokens"] == 80
    assert degeneracy([])["share"] is None and degeneracy([[]])["share"] is None
    assert degeneracy([[]])["looping_share"] is None
    with pytest.raises(ValueError):
        repeated_mask([1, 2], n=0)


PROMPT = 'def add(a, b):\n    """Add two numbers."""'


def test_cut_function_stops_at_the_next_top_level_statement():
    assert cut_function("\n    return a + b\n\ndef other():\n    pass") == "\n    return a + b\n"
    assert cut_function("\n    return a + b\nprint(add(1, 2))") == "\n    return a + b"
    assert cut_function("\n    return a") == "\n    return a"


def test_parses_with_body():
    assert parses_with_body(PROMPT, "\n    return a + b\n\ndef junk(:", "add") == (True, True)
    assert parses_with_body(PROMPT, "\n    pass\n", "add") == (True, False)          # parses, but no body
    assert parses_with_body(PROMPT, '\n    """more doc"""', "add") == (True, False)
    assert parses_with_body(PROMPT, "\n    return (a +", "add") == (False, False)
    assert parses_with_body(PROMPT, "\n    return a\x00", "add") == (False, False)    # NUL: ValueError, not a crash
    assert parses_with_body(PROMPT, "\n    return a + b", "missing") == (True, False)
    assert has_body(ast.parse("async def f():\n    await g()"), "f")


def test_code_quality_scores_only_prompts_with_an_entry_point():
    q = code_quality([PROMPT, PROMPT, "free text"], ["\n    return a + b", "\n    pass", "anything"],
                     ["add", "add", None])
    assert q == {"scored": 2, "parsed": 2, "with_body": 1, "parse_rate": 1.0, "body_rate": 0.5}
    assert code_quality(["x"], ["y"], [None]) is None
    with pytest.raises(ValueError):
        code_quality([PROMPT], [], ["add"])                                         # misaligned inputs


def test_target_quality_benchmark_scores_with_the_library():
    """benchmarks/target_quality.py must not keep its own copy of the scoring."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "target_quality.py"
    spec = importlib.util.spec_from_file_location("target_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parses_with_body is quality.parses_with_body and module.degeneracy is quality.degeneracy
    assert not hasattr(module, "has_body") and not hasattr(module, "STOPS")
