"""`blockspec bench` on the command line: the parser (each option declared once) and its handler."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockspec import embedded
from blockspec.bench.arms import METHODS
from blockspec.config import DRAFT_METHODS
from blockspec.bench.report import render_markdown
from blockspec.bench.run import BenchOptions, run_bench
from blockspec.errors import BlockspecError
from blockspec.options import add_adapt_flag, add_device_flag, add_dtype_flag, add_rule_flag, add_target_flag

__all__ = ["add_bench_parser", "cmd_bench"]


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `blockspec bench` on the CLI's subparsers (called from cli.build_parser)."""
    p = subparsers.add_parser("bench", help="benchmark AR / transformers / DFlash / DSpark / EAGLE-3: tau, speed-up, "
                                            "calibration (JSON + Markdown + plots)")
    add_target_flag(p)
    p.add_argument("--dflash-draft", default=None,
                   help="DFlash draft directory (default: the embedded one, with the embedded target and no draft given)")
    p.add_argument("--dspark-draft", default=None,
                   help="DSpark draft directory (default: the embedded one, with the embedded target and no draft given)")
    p.add_argument("--eagle3-draft", default=None,
                   help="EAGLE-3 draft directory (LlamaForCausalLMEagle3 layout, as vLLM / SGLang read it; default: "
                        "the embedded one, with the embedded target and no draft given)")
    p.add_argument("--datasets", type=_csv(str), default=["humaneval", "heldout"],
                   help="comma-separated: humaneval, heldout, heldout:CORPUS_DIR, PATH.jsonl")
    p.add_argument("--methods", type=_csv(str), default=None,
                   help=f"comma-separated from {', '.join(METHODS)} (default: ar + methods with a draft)")
    p.add_argument("--temperatures", type=_csv(float), default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per dataset")
    p.add_argument("--every", type=int, default=1, metavar="K",
                   help="every K-th prompt of each dataset, from the first, before --limit "
                        "(e.g. --every 4 --limit 40: 40 HumanEval prompts spread over all 164)")
    p.add_argument("--block-sizes", type=_csv(int), default=None,
                   help="draft block sizes to sweep, in each draft's layout convention (default: as trained)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (median)")
    p.add_argument("--out", default="runs/bench",
                   help="output directory for results.json / results.md / PNGs (default: runs/bench under the "
                        "working directory; partial results are kept there on Ctrl-C)")
    p.add_argument("--simulate-accept", type=float, default=None, metavar="TAU",
                   help="force mean tokens/round = TAU (timing of random-weight models; output NOT lossless)")
    add_dtype_flag(p)
    add_device_flag(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    add_rule_flag(p)
    add_adapt_flag(p)
    p.add_argument("--also-fixed", action="store_true",
                   help="also run every speculative method with fixed full windows, next to the adaptive arms")
    p.add_argument("--cost-table", default=None, help="cost table JSON for dspark-scheduled (default: profile now)")
    p.add_argument("--remeasure-costs", action="store_true",
                   help="the adaptive arms measure this machine's cached cost table again (before any timing)")
    p.add_argument("--concurrency", type=_csv(int), default=None,
                   help="also measure engine throughput at these concurrency levels, e.g. 1,4,16")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_bench)
    return p


def _draft_dirs(args: argparse.Namespace) -> dict[str, Path | None]:
    """The drafts given; with none given and the embedded target, the embedded drafts (an
    embedded draft never joins another target or a draft the user chose)."""
    out: dict[str, Path | None] = {}
    chosen = bool(args.target) or any(getattr(args, f"{key}_draft") for key in DRAFT_METHODS)
    for key in DRAFT_METHODS:
        given = getattr(args, f"{key}_draft")
        if given or chosen:
            out[key] = Path(given) if given else None
        else:
            try:
                out[key] = embedded.default_draft(key)
            except BlockspecError:
                out[key] = None
    return out


def cmd_bench(args: argparse.Namespace) -> None:
    """`blockspec bench`: run, then print the Markdown table to stdout."""
    target = Path(args.target) if args.target else embedded.default_target()
    policies = (("adaptive",) if args.adapt else ()) + (("fixed",) if args.also_fixed or not args.adapt else ())
    options = BenchOptions(methods=args.methods, temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                           limit=args.limit, block_sizes=args.block_sizes, repeats=args.repeats, out_dir=args.out,
                           simulate_accept=args.simulate_accept, dtype=args.dtype, device=args.device,
                           seed=args.seed, ignore_eos=args.ignore_eos, rule=args.rule, cost_table=args.cost_table,
                           concurrency=args.concurrency, progress=args.progress, every=args.every, policies=policies,
                           remeasure_costs=args.remeasure_costs)
    results = run_bench(target, _draft_dirs(args), args.datasets, options)
    sys.stdout.write(render_markdown(results) + "\n")
    print(f"wrote {Path(args.out) / 'results.json'}, {Path(args.out) / 'results.md'} and "
          f"{len(results['plots'])} plot(s)", file=sys.stderr)
