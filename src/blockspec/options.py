"""Command-line options shared by `blockspec` subcommands, each declared once.

Used by the CLI (blockspec.cli), the server (blockspec.serving.server) and the bench
(blockspec.bench); argparse only, so any layer may declare its flags with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

from blockspec.config import METHODS, RULES, EagleTree, read_json
from blockspec.errors import BlockspecError

TARGET_HELP = "HF-format target directory (default: the embedded model)"
DTYPE_HELP = ("auto | float32 | bfloat16 | float16 (default: auto on a GPU, float32 on the CPU). auto = the "
              "checkpoint's dtype (config torch_dtype, else its tensors'); on the CPU bfloat16/float16 matmuls "
              "are several times slower than float32, so the CPU default is float32 (ask for --dtype auto to "
              "keep the checkpoint's)")
DEVICE_HELP = "cpu | cuda | cuda:N | auto (default auto: cuda when available, else cpu)"


def add_target_flag(p: argparse.ArgumentParser, help: str = TARGET_HELP) -> None:
    """--target DIR (default None: the embedded target)."""
    p.add_argument("--target", default=None, help=help)


def add_compile_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--compile: captured static-shape round steps (CUDA graphs on a GPU, torch.compile elsewhere)."""
    p.add_argument("--compile", action="store_true", help=help)


def add_dtype_flag(p: argparse.ArgumentParser, default: str | None = None, help: str = DTYPE_HELP) -> None:
    """--dtype NAME: the dtype the models are loaded in (None: models.checkpoint.resolve_dtype's rule)."""
    p.add_argument("--dtype", default=default, help=help)


def add_device_flag(p: argparse.ArgumentParser) -> None:
    """--device: cpu | cuda | auto (default auto: cuda when available; see models.checkpoint.resolve_device)."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """--dtype / --device / --allow-nonfinite-weights: how models are loaded (see `load_options`)."""
    add_dtype_flag(p)
    add_device_flag(p)
    p.add_argument("--allow-nonfinite-weights", action="store_true",
                   help="load weights that hold NaN / Inf (refused by default: such a checkpoint is corrupt)")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of loading.load_models / load_target / load_draft given by `add_load_flags`."""
    return {"dtype": args.dtype, "device": args.device,
            "allow_nonfinite": getattr(args, "allow_nonfinite_weights", False)}


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    """--chat-template (as vLLM's): replaces the checkpoint's chat template (see loading.load_models)."""
    p.add_argument("--chat-template", default=None,
                   help="chat template to use instead of the checkpoint's: a Jinja file, an inline template, or "
                        "the name of one of the checkpoint's templates (default: its chat_template.jinja, else "
                        "tokenizer_config.json's chat_template)")


def add_rule_flag(p: argparse.ArgumentParser) -> None:
    """--rule: the verification rule when sampling."""
    p.add_argument("--rule", choices=RULES, default="rejection",
                   help="acceptance rule when sampling (both lossless; rejection accepts more)")


def add_adapt_flag(p: argparse.ArgumentParser) -> None:
    """--adapt / --no-adapt: the adaptive drafting policy (decoding/policy.py), on by default."""
    p.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=True,
                   help="speculative methods: draft only when it pays, per temperature band, with the block "
                        "length (and DSpark's verify lengths) chosen from this machine's measured costs (cost "
                        "table measured once and cached) and measured acceptance; --no-adapt: every round "
                        "drafts and verifies the full window (fixed-window measurements)")


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    """--adapt, and what the adaptive policy keeps: --policy-memory / --fresh-policy /
    --remeasure-costs (the `PolicyOptions` fields of `policy_options(args)`)."""
    add_adapt_flag(p)
    p.add_argument("--policy-memory", choices=("off", "process", "disk"), default="process",
                   help="where what the adaptive policy learns (acceptance, measured round costs) is kept for the "
                        "next call with the same models: process (default), disk (also a JSON file next to the "
                        "cost tables, for later runs) or off (every call learns from zero)")
    p.add_argument("--fresh-policy", action="store_true",
                   help="forget what the policy learned before (in this process and on disk) and start from zero")
    p.add_argument("--remeasure-costs", action="store_true",
                   help="measure this machine's verify / draft cost table again instead of reading the cached one")


def policy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `PolicyOptions` keywords given by `add_policy_flags`."""
    return {"adapt": args.adapt, "memory": args.policy_memory, "fresh": args.fresh_policy,
            "remeasure": args.remeasure_costs}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--target / --draft / --method / --block-size / --chat-template / --dtype / --device /
    --allow-nonfinite-weights: the arguments of loading.load_models (`load_options(args)` for the last three)."""
    add_target_flag(p)
    p.add_argument("--draft", default=None, help="draft directory (default: the embedded draft for --method)")
    p.add_argument("--method", choices=METHODS, default="ar")
    p.add_argument("--block-size", type=int, default=None, help="run with a shorter block than trained")
    add_chat_template_flag(p)
    add_load_flags(p)


def add_eagle_shape_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """SGLang's EAGLE draft-shape flags (`eagle_shape` reads them): --speculative-eagle-topk,
    --speculative-num-steps, --speculative-num-draft-tokens."""
    p.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="SGLang EAGLE: children per expanded node and nodes expanded per level; above 1 an EAGLE-3 "
                        "draft tree (--no-adapt; needs the two flags below), 1 = a chain")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="SGLang EAGLE: draft levels per round (a chain: its drafts)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="SGLang: tokens verified per round including the anchor (a chain: drafts + 1; a tree: its "
                        "best-scored nodes + 1)")


def eagle_shape(method: str, block_size: int | None, topk: int | None, num_steps: int | None,
                num_draft_tokens: int | None) -> tuple[int | None, EagleTree | None]:
    """(block size, tree) of an EAGLE-3 draft from --block-size and SGLang's flags
    (`add_eagle_shape_flags`), as SGLang reads them: topk above 1 is a tree of num_steps
    levels verifying num_draft_tokens (both needed); topk 1 or none, a chain of num_steps
    drafts (num_draft_tokens = num_steps + 1, the block size: the anchor included). Flags
    that disagree, or that shape another method's draft, are refused."""
    sglang = {"--speculative-eagle-topk": topk, "--speculative-num-steps": num_steps,
              "--speculative-num-draft-tokens": num_draft_tokens}
    given = [flag for flag, value in sglang.items() if value is not None]
    if not given:
        return block_size, None
    if method != "eagle3":
        raise BlockspecError(f"{', '.join(given)} shape EAGLE-3 drafts (--method eagle3), not method {method}")
    if topk is not None and topk < 1:
        raise BlockspecError(f"--speculative-eagle-topk must be a positive integer, got {topk}")
    if topk is not None and topk > 1:
        if num_steps is None or num_draft_tokens is None:
            raise BlockspecError(f"--speculative-eagle-topk {topk} drafts a tree: give its --speculative-num-steps "
                                 "and --speculative-num-draft-tokens too")
        if block_size is not None:
            raise BlockspecError("a tree's size is --speculative-num-draft-tokens; drop --block-size")
        return None, EagleTree(topk, num_steps, num_draft_tokens)
    sizes = {"--block-size": block_size, "--speculative-num-steps + 1": None if num_steps is None else num_steps + 1,
             "--speculative-num-draft-tokens": num_draft_tokens}
    given_sizes = {flag: size for flag, size in sizes.items() if size is not None}
    if len(set(given_sizes.values())) > 1:
        listed = ", ".join(f"{flag} = {size}" for flag, size in given_sizes.items())
        raise BlockspecError(f"conflicting chain lengths: {listed}")
    size = next(iter(given_sizes.values()), None)
    if size is not None and size < 2:
        raise BlockspecError(f"a chain verifies the anchor and at least one draft: a block of 2 or more, got {size}")
    return size, None


def field_comments(cls: type) -> dict[str, str]:
    """Each field's trailing `# comment` in the dataclass's source: its documentation, in one place."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):   # no source shipped: flags without help text
        return {}
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s+(\w+):[^\n#]*#([^\n]*)$", source, re.M)}


GIVEN = "flags_given"   # Namespace attribute: the dests of the dataclass flags on the command line


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {dest})


class _StoreGiven(argparse.Action):
    """Stores the value and notes that the flag was given, so a flag equal to its default
    still overrides a --config file (`--precision float32` over a file's "auto")."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _BoolGiven(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (--field-name), typed by its default, documented by its comment."""
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = comments.get(f.name, "")
        help_text = f"{text} (default: {default!r})" if text else f"default: {default!r}"
        if isinstance(default, bool):
            parser.add_argument(flag, action=_BoolGiven, default=default, help=text or None)
        elif default is None:
            parser.add_argument(flag, action=_StoreGiven, default=None, help=help_text)
        else:
            parser.add_argument(flag, action=_StoreGiven, type=type(default), default=default,
                                help=help_text.replace("%", "%%"))


def dataclass_from_args(cls: type, args: argparse.Namespace, config_file: str | None = None) -> Any:
    """Defaults < JSON config file < flags given on the command line (even when a given value
    equals the default)."""
    values: dict[str, Any] = {}
    if config_file:
        data = read_json(Path(config_file), "config file", in_checkpoint=False)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise BlockspecError(f"config file {config_file}: unknown keys {sorted(unknown)}")
        values.update(data)
    given = getattr(args, GIVEN, frozenset())
    for f in dataclasses.fields(cls):
        if f.name in given or f.name not in values:
            values[f.name] = getattr(args, f.name)
    return cls(**values)
