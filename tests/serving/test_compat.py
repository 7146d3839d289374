"""vLLM / SGLang command lines carried over to `blockspec serve`: a `vllm serve MODEL
--speculative-config ...` line and a `sglang.launch_server --model-path ...` line start
the server; keys that only tune vLLM's engine are accepted with a warning; an unsupported
flag is named."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest

from blockspec.errors import BlockspecError
from blockspec.config import EagleTree, GenerationDefaults, SamplingParams
from blockspec.serving.server import build_engine, resolve_speculation, warn_ignored
from serving_harness import serve_args, write_models
from test_api import _up, free_port, wait_for


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tuple(map(str, write_models(tmp_path_factory.mktemp("models"))))


def vllm_line(target: str, draft: str) -> list[str]:
    config = {"method": "dflash", "model": draft, "num_speculative_tokens": 2,
              "attention_backend": "flash_attn", "disable_padded_drafter_batch": True}
    return [target, "--speculative-config", json.dumps(config), "--max-num-seqs", "4",
            "--gpu-memory-utilization", "0.5", "--max-model-len", "64"]


def sglang_line(target: str, draft: str) -> list[str]:
    return ["--model-path", target, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft,
            "--speculative-num-draft-tokens", "3", "--mem-fraction-static", "0.5", "--max-running-requests", "4",
            "--context-length", "64"]


@pytest.mark.parametrize("line", [vllm_line, sglang_line], ids=["vllm", "sglang"])
def test_command_lines_build_the_same_engine(dirs, line, caplog):
    with caplog.at_level(logging.WARNING):
        engine, _, name = build_engine(serve_args(*line(*dirs)))
    assert (engine.method, engine.draft.config.num_drafts, engine.draft.config.block_size) == ("dflash", 2, 3)
    assert (engine.rows, engine.max_model_len, name) == (4, 64, dirs[0])
    assert engine.memory_plan.source.startswith("0.5 x ")
    if line is vllm_line:
        assert "attention_backend, disable_padded_drafter_batch only tune vLLM's engine; ignored" in caplog.text


def test_conflicts_and_unsupported_keys(dirs, capsys):
    target, draft = dirs
    with pytest.raises(BlockspecError, match="conflicting target models"):
        build_engine(serve_args(target, "--model-path", draft))
    with pytest.raises(BlockspecError, match="conflicting draft counts"):
        resolve_speculation(serve_args("--draft", draft, "--speculative-num-draft-tokens", "4", "--speculative-config",
                                       '{"num_speculative_tokens": 2}'))
    with pytest.raises(BlockspecError, match="not both"):
        build_engine(serve_args(target, "--kv-memory-gb", "1", "--gpu-memory-utilization", "0.5"))
    with pytest.raises(SystemExit) as exc:
        serve_args("--speculative-config", '{"method": "dflash", "speculative_token_tree": "[(0,)]"}')
    assert exc.value.code == 2 and "speculative_token_tree" in capsys.readouterr().err
    for flags in (["--kv-cache-dtype", "fp8"], ["--seed", "1"]):   # ignoring them would change results
        with pytest.raises(SystemExit) as exc:
            serve_args(target, *flags)
        assert exc.value.code == 2 and flags[0] in capsys.readouterr().err   # the one flag, named


def test_common_vllm_and_sglang_flags_are_accepted_with_a_warning(dirs, caplog, tmp_path):
    target, draft = dirs
    ignored = ["--attention-backend", "FLASH_ATTN", "--trust-remote-code", "--enable-prefix-caching",
               "--tensor-parallel-size", "2", "--enforce-eager", "--disable-log-requests"]
    args = serve_args(*vllm_line(target, draft), *ignored, "--disable-log-stats", "--generation-config", "vllm")
    with caplog.at_level(logging.WARNING):
        warn_ignored(args)
        build_engine(args)
    for flag in ("--attention-backend", "--trust-remote-code", "--enable-prefix-caching", "--tensor-parallel-size",
                 "--enforce-eager", "--disable-log-requests"):
        assert f"{flag} is accepted for compatibility and ignored" in caplog.text
    caplog.clear()
    warn_ignored(serve_args(target, "--tp-size", "1"))
    assert "ignored" not in caplog.text   # one device asked for: nothing to warn about
    assert args.generation_defaults == GenerationDefaults() and args.disable_log_stats
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    args = serve_args(target, "--generation-config", str(tmp_path))
    build_engine(args)
    assert (args.generation_defaults.temperature, args.generation_defaults.top_k) == (0.3, 7)
    with pytest.raises(BlockspecError, match="--generation-config"):
        build_engine(serve_args(target, "--generation-config", str(tmp_path / "none")))


@pytest.mark.slow
@pytest.mark.parametrize("line", [vllm_line, sglang_line], ids=["vllm", "sglang"])
def test_command_lines_start_the_server(dirs, line):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.cli", "serve", *line(*dirs), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _up(url, proc), timeout=240)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 64
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w1 w2", "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        page = httpx.get(f"{url}/metrics").text
        assert 'blockspec:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in page
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.communicate()[1]
    assert "KV plan: 4 slots x 64 positions" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def eagle3_dir(dirs, tmp_path_factory):
    """An EAGLE-3 draft for the tiny target, written in the LlamaForCausalLMEagle3 layout."""
    from blockspec.models.checkpoint import load_target, save_eagle3
    from conftest import make_eagle3
    path = tmp_path_factory.mktemp("eagle3") / "draft"
    save_eagle3(make_eagle3(load_target(dirs[0], dtype="float32")), path)
    return str(path)


def test_sglang_tree_flags_build_a_tree_engine(dirs, eagle3_dir):
    """SGLang's EAGLE tree spelling serves a tree (fixed policy); what cannot be, refused in one line."""
    tree = ["--model-path", dirs[0], "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", eagle3_dir,
            "--speculative-eagle-topk", "3", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "7",
            "--context-length", "64", "--kv-memory-gb", "0.01"]
    engine, _, _ = build_engine(serve_args(*tree, "--no-adapt"))
    assert engine.draft.config.tree == EagleTree(3, 3, 7) and engine.draft.config.num_drafts == 6
    out = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [len(c.tokens) for c in out] == [8, 8] and engine.metrics()["drafting_rounds"] > 0
    for extra, message in [([], "--no-adapt"), (["--no-adapt", "--speculative-config", '{"num_speculative_tokens": 3}'],
                                                 "drop num_speculative_tokens"),
                           (["--no-adapt", "--block-size", "4"], "drop --block-size")]:
        with pytest.raises(BlockspecError, match=message):
            build_engine(serve_args(*tree, *extra))
    with pytest.raises(BlockspecError, match="--speculative-num-draft-tokens too"):
        build_engine(serve_args(*tree[:10], "--context-length", "64", "--no-adapt"))


def test_a_tree_server_that_could_serve_nothing_fails_at_startup(dirs, eagle3_dir, tmp_path, monkeypatch):
    """A tree with a generation config whose repetition_penalty every request inherits would
    refuse every request: refused at startup. --compile and a planning policy are refused
    before the models load, each naming its own cause."""
    tree = ["--model-path", dirs[0], "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", eagle3_dir,
            "--speculative-eagle-topk", "2", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4",
            "--context-length", "64", "--kv-memory-gb", "0.01", "--no-adapt"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    with pytest.raises(BlockspecError, match="repetition_penalty 1.1.*--generation-config vllm"):
        build_engine(serve_args(*tree, "--generation-config", str(tmp_path)))
    engine, _, _ = build_engine(serve_args(*tree, "--generation-config", "vllm"))
    assert engine.draft.config.tree == EagleTree(2, 2, 4)

    def no_load(*args, **kwargs):
        raise AssertionError("the models were loaded before the flags were checked")
    monkeypatch.setattr("blockspec.serving.server.load_models", no_load)
    with pytest.raises(BlockspecError, match="drop --compile"):
        build_engine(serve_args(*tree, "--compile"))
    with pytest.raises(BlockspecError, match="without --scheduled / --draft-gate"):
        build_engine(serve_args(*tree, "--scheduled"))


@pytest.mark.parametrize("line", [
    lambda t, d: [t, "--speculative-config", json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": 3}),
                  "--max-model-len", "64", "--kv-memory-gb", "0.01"],
    lambda t, d: ["--model-path", t, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", d,
                  "--speculative-num-draft-tokens", "4", "--context-length", "64", "--kv-memory-gb", "0.01"],
    lambda t, d: ["--target", t, "--draft", d, "--block-size", "4", "--max-model-len", "64", "--kv-memory-gb", "0.01"],
], ids=["vllm", "sglang", "blockspec"])
def test_eagle3_command_lines_build_a_chain_engine(dirs, eagle3_dir, line):
    engine, _, _ = build_engine(serve_args(*line(dirs[0], eagle3_dir)))
    assert (engine.method, engine.draft.config.num_drafts, engine.draft.config.block_size) == ("eagle3", 3, 4)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].tokens
