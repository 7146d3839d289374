"""Acceptance against context length on a target / draft pair (issue 34): greedy, fixed full
windows, `blockspec bench`'s rounds grouped by the anchor's position (bench/context.py). Prints
only acceptance (tau, per-slot), never timings, so it may be recorded on a busy machine:

    python benchmarks/record.py "Acceptance by context length" -- \
        python benchmarks/acceptance_by_context.py --limit 16 --max-new-tokens 320 --window 64

Default: the embedded (shipped) pair on held-out code prompts (file heads of up to 200 lines,
4000 characters: the longest the shipped 1024-position target can continue), those between
--min-prompt tokens and what leaves room for the new tokens. `--window W` adds the same
draft run with every layer sliding over W positions at inference only (non-causal, as it was
trained; it was not trained with a window), to show what cutting the context costs.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

from blockspec import Tokenizer, embedded
from blockspec.bench.context import save_windowed_copy
from blockspec.bench.datasets import heldout_code
from blockspec.bench.metrics import markdown_table
from blockspec.bench.report import CONTEXT_COLUMNS, context_rows
from blockspec.bench.run import BenchOptions, run_bench
from blockspec.config import TargetConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded one)")
    p.add_argument("--draft", default=None, help="DFlash draft directory (default: the embedded one)")
    p.add_argument("--min-prompt", type=int, default=256, help="shortest prompt kept (tokens)")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--window", type=int, default=0, help="also run the draft with sliding layers of this window")
    args = p.parse_args()
    target = Path(args.target) if args.target else embedded.default_target()
    draft = Path(args.draft) if args.draft else embedded.default_draft("dflash")
    length = TargetConfig.load(target).max_position_embeddings
    tokenizer = Tokenizer(target)
    longest = length - args.max_new_tokens - 32   # room for the new tokens and a block
    prompts = [p for p in heldout_code(head_lines=200, max_chars=4000)
               if args.min_prompt <= len(tokenizer.encode(p.text)) <= longest][:args.limit]
    print(f"target `{target}` (max_position_embeddings {length}: no context past that is reachable, so "
          f"the 2k-8k and 8k+ buckets stay empty), draft `{draft}`; {len(prompts)} held-out code prompts of "
          f"{args.min_prompt}..{longest} tokens, {args.max_new_tokens} new tokens, greedy, fixed full windows "
          f"(every round drafts the whole block){', ignore_eos' if args.ignore_eos else ''}. Acceptance only "
          "(no timings).\n")
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {"full": draft}
        if args.window:
            drafts[f"window {args.window} (inference only)"] = save_windowed_copy(draft, args.window, Path(tmp) / "w")
        for name, path in drafts.items():
            options = BenchOptions(methods=["dflash"], temperatures=[0.0], max_new_tokens=args.max_new_tokens,
                                   limit=args.limit, out_dir=Path(tmp) / "out", ignore_eos=args.ignore_eos,
                                   policies=("fixed",), progress=False)
            with contextlib.redirect_stdout(sys.stderr):   # its per-row lines carry timings
                results = run_bench(target, {"dflash": path}, {"heldout-long": prompts}, options)
            rows = context_rows(results["rows"])
            for r in rows:
                r["method"] = f"{r['method']}, {name}"
            print(markdown_table(rows, CONTEXT_COLUMNS) + "\n")
            spec = next(r for r in results["rows"] if r["drafts"])
            print(f"Degeneracy of what it decoded ({name}): rep8 {spec['rep8']:.3f}, looping {spec['looping']:.3f} "
                  "(a high rep8 means tau measures a loop).\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
