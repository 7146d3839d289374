"""Acceptance against context length on a target / draft pair (issue 34): greedy, fixed full
windows, `blockspec bench`'s rounds grouped by the anchor's position (bench/context.py). Prints
only acceptance (tau, per-slot) and bytes, never timings, so it may be recorded on a busy machine:

    python benchmarks/record.py "Acceptance by context length" -- \
        python benchmarks/acceptance_by_context.py --limit 16 --max-new-tokens 320 --window 64

Default: the embedded (shipped) pair on held-out code prompts (file heads of up to 200 lines,
4000 characters: the longest the shipped 1024-position target can continue), those between
--min-prompt tokens and what leaves room for the new tokens. `--window W` adds the same
draft run with every layer sliding over W positions at inference only (non-causal, as it was
trained; it was not trained with a window), to show what cutting the context costs.

Long context (~4k) on the same pair: `--max-positions 4096` runs the target from a copy of its
directory whose config.json says max_position_embeddings 4096 (RoPE has no table limit here),
with longer prompts (`--head-lines`, `--max-chars`), e.g.

    python benchmarks/acceptance_by_context.py --max-positions 4096 --head-lines 2000 --max-chars 12000 \
        --min-prompt 256 --limit 20 --max-new-tokens 256 --ignore-eos --window 256

The shipped target was trained on 1024 positions: past that it runs outside what it learned, so
those figures show the mechanics (buckets, the window's cut), not a long-context model. With
`--window`, a table of the draft's KV memory per request at --memory-at positions (default: the
target's limit) comes first: the memory plan's bytes and what the engine's slot pool allocates,
next to the window's share; `--memory-only` prints just that table (deterministic bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from blockspec import Tokenizer, embedded
from blockspec.bench.context import save_windowed_copy
from blockspec.bench import plots
from blockspec.bench.datasets import heldout_code
from blockspec.bench.metrics import markdown_table
from blockspec.bench.report import CONTEXT_COLUMNS, context_rows
from blockspec.bench.run import BenchOptions, run_bench
from blockspec.config import TargetConfig
from blockspec.engine.memory import KVShapes, plan_kv
from blockspec.engine.slots import SlotPool
from blockspec.models.checkpoint import load_draft, load_target

# planned: KVShapes.draft_kv_bytes; allocated: the engine's slot pool for one slot; x_full: planned / the
# full draft's; window_share: a sliding layer's ring (window + block - 1) over a full layer's positions.
MEMORY_COLUMNS = ["draft", "dtype", "sliding_layers", "ring_positions", "full_positions", "planned_bytes",
                  "allocated_bytes", "x_full", "window_share"]


def longer_target(target: Path, positions: int, out: Path) -> Path:
    """A copy of `target` with max_position_embeddings raised to `positions` (copied, not linked:
    the loader refuses links leading out of a checkpoint directory)."""
    shutil.copytree(target, out)
    raw = json.loads((target / "config.json").read_text())
    if positions < raw["max_position_embeddings"]:
        raise SystemExit(f"error: --max-positions {positions} is below the target's {raw['max_position_embeddings']}")
    (out / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": positions}, indent=2))
    return out


def memory_rows(target_dir: Path, drafts: dict[str, Path], context: int) -> list[dict]:
    """Per draft: its KV bytes in one request slot of `context` positions, as planned
    (`KVShapes.draft_kv_bytes`) and as the engine's slot pool allocates them (one slot)."""
    target = load_target(target_dir)
    rows, full_bytes = [], None
    for name, path in drafts.items():
        draft = load_draft(path, dtype=target.dtype, target=target)   # as the engine runs it
        shapes = KVShapes.of(target.config, target.dtype, draft.config, draft.dtype)
        plan = plan_kv(shapes, shapes.slot_bytes(context), 1, context)
        allocated = SlotPool(target, draft, plan).draft_cache.nbytes
        planned = shapes.draft_kv_bytes(context)
        full_bytes = full_bytes or planned
        cfg = draft.config
        sliding = sum(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers))
        positions = context + shapes.margin + shapes.pending_positions
        rows.append({"draft": name, "dtype": str(draft.dtype).removeprefix("torch."),
                     "sliding_layers": f"{sliding}/{cfg.num_hidden_layers}",
                     "ring_positions": cfg.window_span if sliding else "-", "full_positions": positions,
                     "planned_bytes": planned, "allocated_bytes": allocated, "x_full": f"{planned / full_bytes:.4f}",
                     "window_share": f"{cfg.window_span / positions:.4f}" if sliding else "-"})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded one)")
    p.add_argument("--draft", default=None, help="DFlash draft directory (default: the embedded one)")
    p.add_argument("--min-prompt", type=int, default=256, help="shortest prompt kept (tokens)")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--window", type=int, default=0, help="also run the draft with sliding layers of this window")
    p.add_argument("--max-positions", type=int, default=0,
                   help="run the target with max_position_embeddings raised to this (a config copy)")
    p.add_argument("--head-lines", type=int, default=200, help="held-out prompts: lines of each file head")
    p.add_argument("--max-chars", type=int, default=4000, help="held-out prompts: characters of each file head")
    p.add_argument("--memory-at", type=int, default=0, help="context of the memory table (default: the limit)")
    p.add_argument("--memory-only", action="store_true", help="print only the memory table (needs --window)")
    p.add_argument("--plot", default=None, help="also draw tau against context position of every draft (a PNG path)")
    args = p.parse_args()
    if args.memory_only and not args.window:
        p.error("--memory-only needs --window")
    source = Path(args.target) if args.target else embedded.default_target()
    draft = Path(args.draft) if args.draft else embedded.default_draft("dflash")
    names = f"target `{args.target or 'embedded'}`", f"draft `{args.draft or 'embedded dflash'}`"
    with tempfile.TemporaryDirectory() as tmp:
        trained = TargetConfig.load(source).max_position_embeddings
        target = longer_target(source, args.max_positions, Path(tmp) / "target") if args.max_positions else source
        length = TargetConfig.load(target).max_position_embeddings
        drafts = {"full": draft}
        if args.window:
            drafts[f"window {args.window} (inference only)"] = save_windowed_copy(draft, args.window, Path(tmp) / "w")
            context = args.memory_at or length
            print(f"Draft KV memory per request at {context} positions of context ({names[1]}, {names[0]}"
                  f"{f' with max_position_embeddings {length}' if length > trained else ''}, the draft in the "
                  "target's dtype; one slot planned as the engine plans it):\n")
            print(markdown_table(memory_rows(target, drafts, context), MEMORY_COLUMNS) + "\n")
        if args.memory_only:
            return 0
        tokenizer = Tokenizer(target)
        longest = length - args.max_new_tokens - 32   # room for the new tokens and a block
        prompts = [p for p in heldout_code(head_lines=args.head_lines, max_chars=args.max_chars)
                   if args.min_prompt <= len(tokenizer.encode(p.text)) <= longest][:args.limit]
        beyond = (f"; positions past {trained} are beyond what the target was trained on (its config copy says "
                  f"{length}): mechanics, not a long-context model" if length > trained else "")
        print(f"{names[0]} (max_position_embeddings "
              f"{length}: no context past that is reachable{beyond}), {names[1]}; {len(prompts)} held-out code "
              f"prompts of {args.min_prompt}..{longest} tokens (file heads of {args.head_lines} lines, "
              f"{args.max_chars} characters), {args.max_new_tokens} new tokens, greedy, fixed full windows (every "
              f"round drafts the whole block){', ignore_eos' if args.ignore_eos else ''}. Acceptance only "
              "(no timings).\n")
        curves = {}
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
            curves[name] = spec["tau_by_position"]
        if args.plot:
            saved = plots.plot_tau_vs_position(curves, args.plot).resolve()
            docs = Path("docs").resolve()   # a plot under docs/ is linked as results.md sees it
            print(f"![tau vs context position]({saved.relative_to(docs) if saved.is_relative_to(docs) else saved})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
