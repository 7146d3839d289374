"""The `blockspec` command line: thin, parses flags and calls the package API.

Every BlockspecError is printed as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

from blockspec.errors import BlockspecError


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (--field-name), typed by its default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)


def dataclass_from_args(cls: type, args: argparse.Namespace, config_file: str | None = None) -> Any:
    """Defaults < JSON config file < flags given on the command line."""
    values: dict[str, Any] = {}
    if config_file:
        from blockspec.config import read_json
        data = read_json(Path(config_file), "config file")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise BlockspecError(f"config file {config_file}: unknown keys {sorted(unknown)}")
        values.update(data)
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default or f.name not in values:
            values[f.name] = value
    return cls(**values)


def cmd_pretrain(args: argparse.Namespace) -> None:
    from blockspec.training.pretrain import PretrainConfig, pretrain
    print(json.dumps(pretrain(dataclass_from_args(PretrainConfig, args, args.config))))


def cmd_corpus(args: argparse.Namespace) -> None:
    from blockspec.training.corpus import build_corpus, train_tokenizer
    manifest = build_corpus(Path(args.out), val_percent=args.val_percent)
    print(json.dumps({k: v for k, v in manifest.items() if k != "file_list"}))
    if args.tokenizer_out:
        train_tokenizer(Path(args.out), Path(args.tokenizer_out), args.vocab_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="Block speculative decoding (DFlash / DSpark).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("corpus", help="build the offline Python code corpus (+ BPE tokenizer)")
    p.add_argument("--out", default="runs/corpus")
    p.add_argument("--val-percent", type=int, default=2)
    p.add_argument("--tokenizer-out", default="runs/tokenizer")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=cmd_corpus)

    from blockspec.training.pretrain import PretrainConfig
    p = sub.add_parser("pretrain", help="pretrain a small target model on the code corpus")
    p.add_argument("--config", default=None, help="JSON file of PretrainConfig fields")
    add_dataclass_flags(p, PretrainConfig)
    p.set_defaults(func=cmd_pretrain)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
