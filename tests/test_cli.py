"""The command line's parser, and the layering rule that nothing imports the CLI."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from blockspec import cli
from blockspec.config import EagleTree
from blockspec.errors import BlockspecError
from blockspec.options import dataclass_from_args, eagle_shape
from blockspec.training.pretrain import PretrainConfig

SRC = Path(cli.__file__).resolve().parent
COMMANDS = ["generate", "convert", "profile", "calibrate", "corpus", "regenerate", "train", "bench", "serve",
            "pretrain", "launch-line"]


def test_every_subcommand_is_registered():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)


def test_model_flags_defaults():
    args = cli.build_parser().parse_args(["generate", "hi"])
    # dtype None: auto on a GPU, float32 on the CPU; sampling flags None: generation_config.json's, then built-ins.
    assert (args.target, args.draft, args.method, args.block_size, args.dtype, args.device) == \
        (None, None, "ar", None, None, "auto")
    assert args.rule == "rejection" and args.max_new_tokens is None and args.temperature is None and args.stats
    assert not args.allow_nonfinite_weights
    args = cli.build_parser().parse_args(["generate", "hi", "--method", "dspark", "--block-size", "3",
                                          "--dtype", "bfloat16", "--rule", "match"])
    assert (args.method, args.block_size, args.dtype, args.rule) == ("dspark", 3, "bfloat16", "match")


def test_serve_method_defaults_to_none():
    args = cli.build_parser().parse_args(["serve"])
    assert args.method is None and args.dtype is None and args.device == "auto" and args.port == 8000


@pytest.mark.parametrize("argv, expected", [
    (["convert", "--draft", "d", "--out", "o"], {"dtype": "bfloat16", "target": None}),
    (["profile"], {"dtype": None, "device": "auto", "target": None, "draft": None, "out": "cost_table.json"}),
    (["regenerate", "--prompts", "p", "--out", "o"], {"dtype": None, "device": "auto", "seed": 0}),
    (["calibrate", "--draft", "d", "--prompts", "p"], {"target": None, "seed": 123, "num_prompts": 64,
                                                       "dtype": None, "device": "auto"}),
    (["train"], {"device": "auto", "dtype": ""}),
])
def test_per_command_defaults(argv, expected):
    args = cli.build_parser().parse_args(argv)
    assert {k: getattr(args, k) for k in expected} == expected


def test_errors_exit_2(tmp_path, capsys):
    assert cli.main(["generate", "x", "--target", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_nothing_imports_the_cli():
    importers = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "blockspec.cli" for n in names):
                importers.append(str(path.relative_to(SRC)))
    assert importers == []


def test_version(capsys):
    from blockspec import __version__
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"blockspec {__version__}"


def test_calibrate_writes_a_new_draft_unless_in_place(tmp_path, capsys):
    from blockspec.models.checkpoint import save_draft
    from conftest import make_draft, write_tiny_target_dir

    target = write_tiny_target_dir(tmp_path / "target")
    save_draft(make_draft(target, "deepspec", 3, markov_rank=4, confidence=True), tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(8)))
    before = (tmp_path / "draft" / "config.json").read_text()
    argv = ["calibrate", "--draft", str(tmp_path / "draft"), "--target", str(tmp_path / "target"), "--prompts",
            str(prompts), "--num-prompts", "8", "--max-new-tokens", "6", "--force"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["saved"] and report["out"] == str(tmp_path / "draft-calibrated")
    assert (tmp_path / "draft" / "config.json").read_text() == before   # the given draft is untouched
    written = json.loads((tmp_path / "draft-calibrated" / "config.json").read_text())
    assert written["confidence_temperatures"] == report["temperatures"]
    assert cli.main(argv) == 2 and "exists" in capsys.readouterr().err   # never overwritten silently
    assert cli.main([*argv, "--in-place"]) == 0
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["confidence_temperatures"]


def test_profile_creates_the_output_directory(tmp_path, capsys):
    from conftest import write_tiny_target_dir

    write_tiny_target_dir(tmp_path / "target")
    out = tmp_path / "runs" / "cost_table.json"   # the README's path, in a fresh directory
    assert cli.main(["profile", "--target", str(tmp_path / "target"), "--out", str(out), "--tokens", "1,2",
                     "--rows", "2", "--context", "8", "--repeats", "1"]) == 0
    assert out.is_file()


def test_flags_given_override_the_config_file_even_at_their_default(tmp_path):
    """`pretrain --config C --precision float32` where C says "auto": the flag wins although
    float32 is also the dataclass default (it used to be dropped, and a campaign probed bf16 for
    minutes on a CPU where bf16 GEMMs are 11x slower)."""
    conf = tmp_path / "c.json"
    conf.write_text('{"precision": "auto", "lr": 0.002, "compile": true}')
    args = cli.build_parser().parse_args(["pretrain", "--config", str(conf), "--precision", "float32",
                                          "--no-compile"])
    cfg = dataclass_from_args(PretrainConfig, args, args.config)
    assert (cfg.precision, cfg.compile, cfg.lr) == ("float32", False, 0.002)
    args = cli.build_parser().parse_args(["pretrain", "--config", str(conf), "--seq-len", "64"])
    cfg = dataclass_from_args(PretrainConfig, args, args.config)
    assert (cfg.precision, cfg.compile, cfg.seq_len, cfg.batch_size) == ("auto", True, 64, 8)


def test_profile_refresh_measures_the_cached_tables_again(tmp_path, monkeypatch, capsys):
    from blockspec.decoding import table_cache

    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(table_cache, "_MEMO", {})
    assert cli.main(["profile", "--refresh"]) == 2 and "--draft" in capsys.readouterr().err
    assert cli.main(["profile", "--refresh", "--draft", "embedded", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    first = Path(report["refreshed"][0])
    assert report["rows"] == [1] and first.is_file() and "measured in" in out.err
    assert 0 < report["seconds"]["1"] < 60   # what the first use costs, printed for the record (goal: 10 s)
    before = first.stat().st_mtime_ns
    assert cli.main(["profile", "--refresh", "--draft", "embedded", "--device", "cpu"]) == 0   # again: re-measured
    assert json.loads(capsys.readouterr().out)["refreshed"] == [str(first)] and first.stat().st_mtime_ns > before


def test_policy_flags_of_generate_serve_and_bench():
    parser = cli.build_parser()
    for argv in (["generate", "hi"], ["serve"], ["bench"]):
        args = parser.parse_args(argv)
        assert args.remeasure_costs is False
    args = parser.parse_args(["generate", "hi", "--policy-memory", "disk", "--fresh-policy", "--remeasure-costs"])
    assert (args.policy_memory, args.fresh_policy, args.remeasure_costs) == ("disk", True, True)
    assert parser.parse_args(["serve", "--policy-memory", "off"]).policy_memory == "off"


def test_eagle_shape_reads_sglang_flags_as_sglang_does():
    """topk above 1: a tree of num_steps levels verifying num_draft_tokens; topk 1 (or none): a
    chain whose block is num_steps + 1 = num_draft_tokens; every disagreement is one line."""
    assert eagle_shape("eagle3", None, 4, 5, 12) == (None, EagleTree(4, 5, 12))
    assert eagle_shape("eagle3", None, 1, 5, None) == (6, None)
    assert eagle_shape("eagle3", None, None, None, 8) == (8, None)
    assert eagle_shape("eagle3", 6, None, 5, 6) == (6, None)
    assert eagle_shape("dflash", 8, None, None, None) == (8, None)
    for args, message in [(("eagle3", 6, None, 3, None), "conflicting chain lengths"),
                          (("eagle3", None, 4, 5, None), "--speculative-num-draft-tokens too"),
                          (("eagle3", 6, 4, 5, 12), "drop --block-size"),
                          (("dflash", None, 4, 5, 12), "method eagle3"),
                          (("eagle3", None, 0, 5, 12), "positive integer"),
                          (("eagle3", None, None, None, 1), "2 or more"),
                          (("eagle3", None, 2, 2, 8), "num_draft_tokens counts the anchor")]:
        with pytest.raises(BlockspecError, match=re.escape(message)):
            eagle_shape(*args)


def test_generate_drafts_a_tree_from_sglang_flags(capsys):
    """`blockspec generate --method eagle3 --speculative-eagle-topk 4 ...` prints AR's greedy
    text and samples; without --no-adapt, or sampling with --rule match, it stops with one
    line and exit 2."""
    common = ["generate", "def fib(n):", "--max-new-tokens", "12", "--no-stats"]
    tree = ["--method", "eagle3", "--speculative-eagle-topk", "4", "--speculative-num-steps", "3",
            "--speculative-num-draft-tokens", "8"]
    assert cli.main(common) == 0
    ar = capsys.readouterr().out
    assert cli.main(common + tree + ["--no-adapt"]) == 0
    assert capsys.readouterr().out == ar
    assert cli.main(common + tree + ["--no-adapt", "--temperature", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("def fib(n):")
    for extra, message in (([], "--no-adapt"), (["--no-adapt", "--temperature", "1", "--rule", "match"],
                                                "--rule match runs chains only")):
        assert cli.main(common + tree + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
