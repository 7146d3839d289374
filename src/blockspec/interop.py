"""Serving blockspec drafts in vLLM and SGLang: what their loaders read, and the exact launch line.

The facts live in `interop_engines.json` (next to this file), taken from the engines' loaders
at the versions it records. This module turns them into checks of a draft directory
(`check_draft`: would this engine load these files, and load them right?) and into the command
line that serves a draft (`launch_line`). `save_draft` runs the same checks on what it writes,
and a contract test runs them on every layout x head type the writer produces.

Imports only config / errors (models.checkpoint imports this module).
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

from blockspec.config import DEFAULT_CHAIN_DRAFTS, EAGLE3_ARCHITECTURES, DraftConfig, Eagle3Config, TargetConfig, read_json
from blockspec.errors import BlockspecError

TABLE_PATH = Path(__file__).with_name("interop_engines.json")
LOADERS = ("vllm", "sglang")            # the engines whose loaders the table describes
HOSTS = ("cuda", "cpu")
ENGINES = (*LOADERS, "blockspec")
TARGET_PLACEHOLDER = "TARGET"


class EngineCompatibilityWarning(UserWarning):
    """A saved draft that an engine's loader cannot load (or would load wrongly)."""


@functools.cache
def engine_table() -> dict[str, Any]:
    return read_json(TABLE_PATH, "engine table", in_checkpoint=False)


def engine_source(engine: str) -> str:
    """'vllm 0.33.0' style: the engine version the table was taken from."""
    return f"{engine} {engine_table()['engines'][engine]['version']}"


def _get(raw: dict[str, Any], dotted: str) -> Any:
    """raw["a"]["b"] for "a.b" (None when any part is missing)."""
    value: Any = raw
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _expected_tensors(cfg: DraftConfig, fmt: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Names the engine's loader builds for this config -> the shape it builds (None: not checked).
    Confidence tensors are left out: both loaders treat them separately (see _check_confidence)."""
    table = engine_table()
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    names: dict[str, tuple[int, ...] | None] = {}
    for template in table["backbone_tensors"]:
        for i in (range(cfg.num_hidden_layers) if "{i}" in template else [0]):
            names[template.format(i=i)] = None
    names["fc.weight"] = (h, len(cfg.target_layer_ids) * h)
    if r > 0:
        # The head the config names; an engine that cannot build it (a head type it lacks, or
        # heads on a z-lab block) is reported once, by check_draft, not again per tensor.
        for name in table["markov_tensors"][cfg.markov_head_type]:
            names[name] = None
        names["markov_head.markov_w1.weight"] = (v, r)
        names["markov_head.markov_w2.weight"] = (v, r)
    return names


def _engine_with_markov(raw: dict[str, Any], fmt: dict[str, Any], markov_rank: int) -> bool:
    """Whether the engine builds the confidence head over [h; w1[prev]] for this config."""
    value = raw.get("confidence_head_with_markov", _get(raw, "dflash_config.confidence_head_with_markov"))
    if value is not None:
        return bool(value)
    default = fmt["confidence_head_with_markov_default"]
    return markov_rank > 0 if default == "markov_rank > 0" else bool(default)


@dataclass
class Report:
    """What an engine makes of a draft: `problems` stop it loading (or load it wrongly);
    `unused` are parts it loads but does not use (or drops)."""

    problems: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def check_draft(raw: dict[str, Any], tensors: dict[str, tuple[int, ...]] | None, engine: str) -> Report:
    """Check a draft's config.json (`raw`) and tensor shapes against `engine`'s loader
    (interop_engines.json). `tensors` None checks the config only."""
    if engine not in LOADERS:
        raise BlockspecError(f"unknown engine {engine!r} (engines with a recorded loader: {', '.join(LOADERS)})")
    cfg = DraftConfig.from_dict(raw)
    fmt = engine_table()["formats"][engine][cfg.layout]
    src = engine_source(engine)
    report = Report()
    bad = report.problems.append
    if cfg.layout == "zlab" and cfg.is_dspark:
        bad(f"{src} loads DSpark heads only in the DeepSpec layout (block_size = gamma); this z-lab layout "
            "draft's Markov / confidence head is unknown to its DFlash loader")
    archs = raw.get("architectures") or []
    if fmt["architectures"] is not None and (not archs or archs[0] not in fmt["architectures"]):
        bad(f"{src} expects architectures {fmt['architectures']}, the config has {archs}")
    if fmt.get("model_type") and raw.get("model_type") != fmt["model_type"]:
        bad(f"{src} expects model_type {fmt['model_type']!r}, the config has {raw.get('model_type')!r}")
    for options in fmt["required_keys"]:
        if all(_get(raw, key) is None for key in options):
            bad(f"{src} reads {' or '.join(options)}, which config.json lacks")
    for key in fmt["forbidden_keys"]:
        if _get(raw, key) is not None:
            bad(f"config.json has {key}, which {src} reads differently from blockspec")
    allowed = fmt["layer_types"] if isinstance(fmt["layer_types"], list) else [fmt["layer_types"]]
    if any(t not in allowed for t in cfg.layer_types):
        bad(f"{src} needs every draft layer to be {' or '.join(allowed)}, the config has {list(cfg.layer_types)}")
    elif cfg.is_windowed and not (raw.get("use_sliding_window") and raw.get("sliding_window") == cfg.sliding_window):
        bad(f"{src} reads the window through transformers' Qwen3Config, which drops sliding_window "
            "unless use_sliding_window is true")
    if fmt["heads"]:
        if cfg.markov_rank < fmt["markov_rank_min"]:
            bad(f"{src} requires a Markov head (markov_rank >= {fmt['markov_rank_min']}); this draft has none")
        elif cfg.markov_head_type not in fmt["markov_head_types"]:
            bad(f"{src} builds only the {' / '.join(fmt['markov_head_types'])} Markov head; the "
                f"{cfg.markov_head_type!r} head's tensors fail to load (no module or parameter of that name)")
        _check_confidence(raw, cfg, fmt, tensors, src, report)
    if cfg.confidence_temperatures is not None:
        report.unused.append(f"{src} does not read confidence_temperatures (blockspec's calibration)")
    if tensors is not None:
        expected = _expected_tensors(cfg, fmt)
        optional = set(engine_table()["optional_tensors"]) | set(engine_table()["confidence_tensors"])
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected) - optional)
        if missing:
            bad(f"{src} loads tensors the checkpoint lacks: {', '.join(missing[:6])}")
        if unexpected:
            bad(f"{src} has no parameter for tensors {', '.join(unexpected[:6])}")
        for name, shape in expected.items():
            if shape is not None and name in tensors and tuple(tensors[name]) != shape:
                bad(f"{src} builds {name} with shape {list(shape)}, the checkpoint holds {list(tensors[name])}")
    return report


def _check_confidence(raw: dict[str, Any], cfg: DraftConfig, fmt: dict[str, Any],
                      tensors: dict[str, tuple[int, ...]] | None, src: str, report: Report) -> None:
    names = engine_table()["confidence_tensors"]
    present = tensors is not None and all(n in tensors for n in names)
    if not cfg.enable_confidence_head:
        if fmt.get("confidence_head_required"):
            report.unused.append(f"{src} (the loader read for the table) builds a confidence head for DSpark "
                                 "drafts unless its ragged verification is static, and then refuses a "
                                 "checkpoint without confidence weights; this draft has none")
        return
    if tensors is not None and not present:
        report.unused.append(f"the config enables a confidence head but the checkpoint lacks {', '.join(names)}")
    if "confidence_used_only_with" in fmt:
        report.unused.append(f"{src} uses the confidence head only with adaptive verification "
                             f"(\"{fmt['confidence_used_only_with']}\": true in --speculative-config; "
                             "launch-line --scheduled adds it)")
    with_markov = _engine_with_markov(raw, fmt, cfg.markov_rank)
    if present and tensors is not None:
        shape = (1, cfg.hidden_size + (cfg.markov_rank if with_markov else 0))
        if tuple(tensors[names[0]]) != shape:
            report.problems.append(
                f"{src} builds {names[0]} with shape {list(shape)} (confidence_head_with_markov "
                f"{'true' if with_markov else 'false'}), the checkpoint holds {list(tensors[names[0]])}")


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a draft directory, from the safetensors headers."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index, "draft index").get("weight_map") or {}
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise BlockspecError(f"draft: no model.safetensors or model.safetensors.index.json in {directory}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise BlockspecError(f"draft: cannot read {file}: {exc}") from None
    return shapes


def mask_token_of(target_dir: Path, mask_token_id: int) -> str | None:
    """The string the target tokenizer gives `mask_token_id` (None without a tokenizer.json)."""
    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return HFTokenizer.from_file(str(path)).id_to_token(mask_token_id)
    except Exception as exc:  # the Rust library raises its own exception type
        raise BlockspecError(f"tokenizer: cannot read {path}: {exc}") from None


def save_problems(raw: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """One line per engine problem of a draft being saved (save_draft warns with these)."""
    return [problem for engine in LOADERS for problem in check_draft(raw, tensors, engine).problems]


@dataclass
class LaunchLine:
    argv: list[str]
    env: dict[str, str]
    notes: list[str]
    problems: list[str]

    def shell(self) -> str:
        """The line to paste into a shell."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(env + [shlex.join(self.argv)])


def launch_line(draft: str | Path, engine: str, target: str | Path | None = None,
                scheduled: bool = False, host: str = "cuda") -> LaunchLine:
    """The command that serves `draft` (a directory) with `engine` (vllm | sglang | blockspec).

    With `target` (a directory) the pair is checked (hidden size, vocabulary, layers) and the
    mask token's string is compared with the target tokenizer's; without it, vLLM and SGLang
    lines carry the placeholder TARGET. `scheduled` asks for confidence-based verification
    (blockspec --scheduled, vLLM adaptive verification). `host` ("cuda" | "cpu"): the machine
    the engine runs on; on a CPU host vLLM's line is the one its CPU build starts (the OpenAI
    server module: the wheel's `vllm serve` fails, and flash_attn is CUDA-only)."""
    if engine not in ENGINES:
        raise BlockspecError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if host not in HOSTS:
        raise BlockspecError(f"unknown host {host!r} (choose from {', '.join(HOSTS)})")
    draft_dir = Path(draft)
    if not draft_dir.is_dir():
        raise BlockspecError(f"draft: {draft_dir} is not a directory")
    raw = read_json(draft_dir / "config.json", "draft config")
    if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or []):
        return _eagle3_launch_line(draft_dir, raw, engine, target, scheduled, host)
    cfg = DraftConfig.from_dict(raw, where=str(draft_dir / "config.json"))
    if scheduled and not cfg.enable_confidence_head:
        raise BlockspecError("--scheduled needs a draft with a confidence head (enable_confidence_head)")
    notes: list[str] = []
    problems: list[str] = []
    if target is not None:
        cfg.check_target(TargetConfig.load(Path(target)))
        mask = mask_token_of(Path(target), cfg.mask_token_id)
        if cfg.mask_token is not None and mask is not None and mask != cfg.mask_token and engine == "sglang":
            problems.append(f"the config names mask_token {cfg.mask_token!r} but the target tokenizer maps "
                            f"id {cfg.mask_token_id} to {mask!r}; SGLang checks the two agree")
    elif engine != "blockspec":
        notes.append(f"replace {TARGET_PLACEHOLDER} with the target model this draft was trained for "
                     "(pass --target DIR to check the pair)")
    target_arg = str(target) if target is not None else TARGET_PLACEHOLDER
    method = "dspark" if cfg.is_dspark else "dflash"
    if engine == "blockspec":
        argv = ["blockspec", "serve", *(["--target", str(target)] if target is not None else []),
                "--draft", str(draft_dir), "--method", method, *(["--scheduled"] if scheduled else [])]
        if target is None:
            notes.append("without --target, blockspec serve pairs the draft with the embedded target")
        return LaunchLine(argv, {}, notes, problems)
    report = check_draft(raw, tensor_shapes(draft_dir), engine)
    problems += report.problems
    notes += report.unused
    fmt = engine_table()["formats"][engine][cfg.layout]
    window = cfg.block_size - 1 if fmt["window"]["equals"] == "block_size - 1" else (
        cfg.block_size + 1 if fmt["window"]["equals"] == "block_size + 1" else cfg.block_size)
    if engine == "vllm":
        spec: dict[str, Any] = {"method": fmt["method"], "model": str(draft_dir), "num_speculative_tokens": window}
        if scheduled:
            spec[fmt["confidence_used_only_with"]] = True
        if host == "cpu":
            cpu = engine_table()["command_lines"]["vllm_cpu"]
            if fmt["method"] == "dspark":
                problems.append(cpu["dspark"])
            argv = [*cpu["program"], "--model", target_arg, "--speculative-config", json.dumps(spec)]
            notes.append(f"the CPU form, run-tested with {cpu['tested_version']} (benchmarks/vllm_peer.py)")
        else:
            flags = engine_table()["command_lines"]["vllm"]["dflash_extra_flags"] if fmt["method"] == "dflash" else []
            argv = ["vllm", "serve", target_arg, "--speculative-config", json.dumps(spec), *flags]
    else:
        argv = ["python", "-m", "sglang.launch_server", "--model-path", target_arg,
                "--speculative-algorithm", fmt["method"], "--speculative-draft-model-path", str(draft_dir),
                "--speculative-num-draft-tokens", str(window)]
        if scheduled:
            notes.append("SGLang's use of the confidence head is set by its ragged-verification mode, "
                         "not by a launch flag recorded here")
    env = dict(fmt["env"])
    if cfg.is_windowed and len(set(cfg.layer_types)) > 1:   # mixed sliding / full draft layers
        env.update(fmt.get("mixed_layer_types_env", {}))
    return LaunchLine(argv, env, notes, problems)


def _eagle3_launch_line(draft_dir: Path, raw: dict[str, Any], engine: str, target: str | Path | None,
                        scheduled: bool, host: str) -> LaunchLine:
    """launch_line for an EAGLE-3 draft: chains of DEFAULT_CHAIN_DRAFTS drafts (the
    training-time test's depth), top-1 (no tree) in SGLang, as blockspec runs them."""
    cfg = Eagle3Config.from_dict(raw, where=str(draft_dir / "config.json"))
    if scheduled:
        raise BlockspecError("--scheduled needs a draft with a confidence head; EAGLE-3 drafts have none")
    notes: list[str] = []
    if target is not None:
        cfg.check_target(TargetConfig.load(Path(target)))
    elif engine != "blockspec":
        notes.append(f"replace {TARGET_PLACEHOLDER} with the target model this draft was trained for "
                     "(pass --target DIR to check the pair)")
    target_arg = str(target) if target is not None else TARGET_PLACEHOLDER
    k = DEFAULT_CHAIN_DRAFTS
    if engine == "blockspec":
        argv = ["blockspec", "serve", *(["--target", str(target)] if target is not None else []),
                "--draft", str(draft_dir), "--method", "eagle3"]
        if target is None:
            notes.append("without --target, blockspec serve pairs the draft with the embedded target")
    elif engine == "vllm":
        spec = json.dumps({"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k})
        if host == "cpu":
            argv = [*engine_table()["command_lines"]["vllm_cpu"]["program"], "--model", target_arg,
                    "--speculative-config", spec]
            notes.append("the CPU form; EAGLE-3 in vLLM's CPU build is not run-tested here")
        else:
            argv = ["vllm", "serve", target_arg, "--speculative-config", spec]
    else:
        argv = ["python", "-m", "sglang.launch_server", "--model-path", target_arg, "--speculative-algorithm",
                "EAGLE3", "--speculative-draft-model-path", str(draft_dir), "--speculative-num-steps", str(k),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]
    return LaunchLine(argv, {}, notes, [])
