"""Chat prompts where they are used: `blockspec generate --chat`, the server's /v1/chat/completions
and `regenerate` on `messages` rows all send the model the ids transformers' apply_chat_template
gives (one BOS, the template's EOS after assistant turns); a hostile template stops each of them
with a one-line error before anything runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from blockspec import cli
from blockspec.engine.engine import Engine
from blockspec.models.checkpoint import load_target
from blockspec.models.tokenizer import Tokenizer
from chat_helpers import CHATS, FAMILIES, write_chat_tokenizer
from conftest import write_tiny_target_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serving_harness import KEY, MODEL, serve_args, start  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


def chat_target(directory: Path, family: str) -> Path:
    """A tiny random target whose tokenizer is the family's byte-level one (vocab = bytes + specials)."""
    vocab = 256 + len(FAMILIES[family][1])
    write_tiny_target_dir(directory, vocab=vocab)
    write_chat_tokenizer(directory, family)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = chat_target(tmp_path_factory.mktemp("llama"), "llama3.1")
    return d, PreTrainedTokenizerFast.from_pretrained(str(d))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    d = chat_target(tmp_path_factory.mktemp("mistral"), "mistral")
    return d, PreTrainedTokenizerFast.from_pretrained(str(d))


def hf_chat_ids(hf, messages) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def capture_prompts(monkeypatch) -> list[list[int]]:
    seen: list[list[int]] = []
    real = cli.generate

    def spy(target, prompts, *args, **kwargs):
        seen.extend(list(p) for p in prompts)
        return real(target, prompts, *args, **kwargs)
    monkeypatch.setattr(cli, "generate", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cli_generate_chat_and_plain_prompts(request, monkeypatch, capsys, family):
    directory, hf = request.getfixturevalue(family)
    seen = capture_prompts(monkeypatch)
    base = ["--target", str(directory), "--max-new-tokens", "3", "--no-stats", "--device", "cpu"]
    assert cli.main(["generate", "Hello there é€", "--chat", *base]) == 0
    assert cli.main(["generate", "def f(x):", *base]) == 0
    chat = [{"role": "user", "content": "Hello there é€"}]
    assert seen == [hf_chat_ids(hf, chat), hf("def f(x):")["input_ids"]]
    bos = hf.convert_tokens_to_ids(FAMILIES["llama3.1" if family == "llama" else "mistral"][2])
    assert [p.count(bos) for p in seen] == [1, 1]
    capsys.readouterr()


def test_cli_chat_template_flag(llama, tmp_path, monkeypatch):
    directory, _ = llama
    seen = capture_prompts(monkeypatch)
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:")
    assert cli.main(["generate", "hi", "--chat", "--chat-template", str(template), "--target", str(directory),
                     "--max-new-tokens", "2", "--no-stats", "--device", "cpu"]) == 0
    tok = Tokenizer(directory)
    assert seen == [[tok.bos_token_id] + tok.encode("Q: hi\nA:", add_special_tokens=False)]


def test_server_chat_endpoint_sends_transformers_ids(mistral):
    directory, hf = mistral
    prompts: list[list[int]] = []

    class Recording(Engine):
        def submit(self, prompt_ids, params=None, **kwargs):
            prompts.append(list(prompt_ids))
            return super().submit(prompt_ids, params, **kwargs)

    tok = Tokenizer(directory)
    engine = Recording(load_target(directory, dtype="float32"), None, "ar", max_running=2, max_model_len=256,
                       tokenizer=tok)
    ctx, url = start(engine, tok)
    try:
        chats = [CHATS["system"], CHATS["multi"], CHATS["thinking"]]
        for messages in chats:
            r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "messages": messages, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(prompts[-1])
        bad = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60,   # raise_exception -> 400
                         json={"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]})
        assert bad.status_code == 400 and "must alternate" in bad.json()["error"]["message"]
    finally:
        ctx.__exit__(None, None, None)
    assert prompts == [hf_chat_ids(hf, m) for m in chats]
    assert "</s>" in hf.decode(prompts[1])   # Mistral closes the assistant turn with EOS


def test_serve_flags_pass_the_chat_template(llama, tmp_path):
    from blockspec.serving.server import build_engine
    directory, _ = llama
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}!")
    engine, tokenizer, _ = build_engine(serve_args("--target", str(directory), "--chat-template", str(template),
                                                   "--max-model-len", "128", "--device", "cpu"))
    assert tokenizer.apply_chat_template(CHATS["single"]) == "Hello there, how are you?!"


def test_regenerate_renders_messages_rows_like_transformers(llama, tmp_path):
    directory, hf = llama
    rows = [{"messages": CHATS["system"]}, {"prompt": "import os"}, {"messages": CHATS["multi"]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    assert cli.main(["regenerate", "--prompts", str(prompts), "--out", str(out), "--target", str(directory),
                     "--max-new-tokens", "2", "--num-prompts", "3", "--device", "cpu"]) == 0
    got = [json.loads(line)["prompt_ids"] for line in out.read_text().splitlines()]
    assert got == [hf_chat_ids(hf, CHATS["system"]), hf("import os")["input_ids"], hf_chat_ids(hf, CHATS["multi"])]


def test_hostile_template_stops_every_path_before_it_runs(llama, tmp_path, capsys):
    directory, _ = llama
    marker = tmp_path / "pwned"
    hostile = tmp_path / "evil"
    chat_target(hostile, "qwen2.5")
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ lipsum.__globals__['os'].system('touch " + str(marker) + "') }}"
    (hostile / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": CHATS["single"]}) + "\n")
    argvs = [["generate", "hi", "--chat", "--target", str(hostile), "--device", "cpu"],
             ["regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", str(hostile),
              "--device", "cpu"],
             ["serve", "--target", str(hostile), "--device", "cpu"],
             ["generate", "hi", "--chat", "--target", str(directory), "--chat-template", config["chat_template"],
              "--device", "cpu"]]
    for argv in argvs:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "reaches for Python internals" in err and err.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "o.jsonl").exists()
