"""Broken or hostile checkpoints and data files through the CLI: every one is a single
`error:` line and exit 2, never a traceback and never a model that silently generates nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from blockspec.cli import main
from blockspec.models.checkpoint import save_draft
from conftest import make_draft, write_pattern_data, write_tiny_target_dir


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    target = write_tiny_target_dir(root / "target")
    save_draft(make_draft(target, "zlab", block_size=4), root / "draft")
    write_tiny_target_dir(root / "small", vocab=32)
    return root


@pytest.fixture
def dirs(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path, dirs_exist_ok=True)
    return tmp_path


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def generate(target: Path, *extra: str) -> list[str]:
    return ["generate", "w1 w2", "--target", str(target), "--method", "ar", "--max-new-tokens", "2",
            "--device", "cpu", *extra]


def set_config(directory: Path, text: str | None = None, **changes) -> None:
    path = directory / "config.json"
    if text is None:
        raw = json.loads(path.read_text())
        raw.update(changes)
        text = json.dumps(raw)
    path.write_text(text)


def _symlink_loop(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "a.safetensors"}}))
    (d / "a.safetensors").symlink_to(d / "b.safetensors")
    (d / "b.safetensors").symlink_to(d / "a.safetensors")


def _raw_config(transform):
    def damage(d: Path) -> None:
        set_config(d, transform((d / "config.json").read_text()))
    return damage


def _huge_config(d: Path) -> None:
    with open(d / "config.json", "r+b") as f:   # sparse: 8 GiB on paper, nothing on disk
        f.truncate(8 << 30)


def _side_file_outside(name: str):
    def damage(d: Path) -> None:
        outside = d.parent / f"outside-{name}"
        outside.write_text("{% for m in messages %}{{ m.content }}{% endfor %}" if name.endswith("jinja") else "{}")
        (d / name).unlink(missing_ok=True)
        (d / name).symlink_to(outside)
    return damage


def _tokenizer_too_big_for_the_model(d: Path) -> None:
    shutil.copy(d / "tokenizer.json", d.parent / "small" / "tokenizer.json")


TARGET_DAMAGE = {
    "shard-symlink-loop": (_symlink_loop, "cannot resolve"),
    "rope-factor-infinity": (lambda d: set_config(d, rope_scaling={"rope_type": "linear", "factor": float("inf")}),
                             "rope factor must be a finite number"),
    "rope-1e999": (_raw_config(lambda t: t.rstrip()[:-1] + ', "rope_scaling": {"rope_type": "yarn", "factor": 1e999}}'),
                   "finite"),
    "eps-string": (lambda d: set_config(d, rms_norm_eps="abc"), "'rms_norm_eps' must be a positive finite number"),
    "eps-list": (lambda d: set_config(d, rms_norm_eps=[1]), "'rms_norm_eps'"),
    "eps-nan": (lambda d: set_config(d, rms_norm_eps=float("nan")), "'rms_norm_eps'"),
    "eps-negative": (lambda d: set_config(d, rms_norm_eps=-1e-6), "'rms_norm_eps'"),
    "config-deep": (lambda d: set_config(d, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    "config-8gib": (_huge_config, "over the 67108864-byte limit"),
    "template-outside": (_side_file_outside("chat_template.jinja"), "outside the checkpoint directory"),
    "tokenizer-config-outside": (_side_file_outside("tokenizer_config.json"), "outside the checkpoint directory"),
    "tokenizer-outside": (_side_file_outside("tokenizer.json"), "outside the checkpoint directory"),
}


@pytest.mark.parametrize("case", list(TARGET_DAMAGE))
def test_a_broken_target_is_one_line_exit_2(dirs, capsys, case):
    damage, message = TARGET_DAMAGE[case]
    damage(dirs / "target")
    assert message in one_line_error(generate(dirs / "target"), capsys)


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_refused_at_load(dirs, capsys):
    _tokenizer_too_big_for_the_model(dirs / "target")
    err = one_line_error(generate(dirs / "small"), capsys)
    assert "token ids up to 63" in err and "holds 32" in err


@pytest.mark.parametrize("layer_ids", [[], "x", [True], [-1]])
def test_bad_draft_target_layer_ids_are_one_line_exit_2(dirs, capsys, layer_ids):
    raw = json.loads((dirs / "draft" / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = layer_ids
    (dirs / "draft" / "config.json").write_text(json.dumps(raw))
    err = one_line_error(generate(dirs / "target", "--method", "dflash", "--draft", str(dirs / "draft")), capsys)
    assert "target_layer_ids" in err


def test_non_utf8_training_data_is_one_line_naming_the_line(dirs, capsys):
    data = dirs / "data.jsonl"
    write_pattern_data(data, n=8)
    with open(data, "ab") as f:
        f.write(b'{"text": "\xff\xfe"}\n')
    err = one_line_error(["train", "--method", "dflash", "--target", str(dirs / "target"), "--data", str(data),
                          "--out", str(dirs / "run"), "--max-steps", "1", "--threads", "1"], capsys)
    assert f"{data}:9 is not UTF-8" in err


def test_a_draft_config_over_the_size_cap_is_refused(dirs, capsys):
    os.truncate(dirs / "draft" / "config.json", 100 << 20)
    err = one_line_error(generate(dirs / "target", "--method", "dflash", "--draft", str(dirs / "draft")), capsys)
    assert "byte limit" in err


def test_generate_chat_with_a_giant_template_is_one_line_exit_2(dirs, capsys):
    """{{ 'x' * 10**9 }}: stopped by the render worker's memory cap, not the machine's."""
    template = dirs / "giant.jinja"
    template.write_text("{{ 'x' * 10**9 }}")
    err = one_line_error(generate(dirs / "target", "--chat", "--chat-template", str(template)), capsys)
    assert "chat template failed" in err and str(template) in err
