"""Engine throughput vs concurrency on HumanEval prompts (greedy, 128 new tokens) for
AR, DFlash, DSpark (full window) and DSpark (confidence-scheduled), plus DFlash and
DSpark full window behind the draft gate, measured side by side in one run; plus the
engine process's peak resident memory.

    python benchmarks/engine_throughput.py [--concurrency 1,4,16,32] [--repeats 3] [--methods ar,dflash,...]

Each (method, concurrency) cell runs max(8, waves*c) requests (default 4 waves) through
a fresh engine with max_running = c, so requests join as others finish, as in serving;
tokens/s = generated tokens / wall time. With --repeats N the four
arms run N times in turn at each concurrency and each cell is the median. The cost table for the
scheduled method is measured first (`blockspec profile`) unless one is given.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from blockspec import Engine, SamplingParams, Tokenizer, embedded, load_draft, load_target
from blockspec.bench.datasets import humaneval  # the bench's prompts: no bare trailing newline token
from blockspec.decoding.cost_table import CostTable, profile_cost_table


def prompts_humaneval(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(p.text) for p in humaneval()]


def run_cell(target, draft, method: str, scheduled: bool, gated: bool, table, prompts, conc: int,
             new_tokens: int) -> dict:
    engine = Engine(target, draft if method != "ar" else None, method=method, scheduled=scheduled,
                    max_running=conc, max_model_len=1024, cost_table=table if (scheduled or gated) else None,
                    draft_gate=gated or None)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    engine.run_until_done()
    elapsed = time.perf_counter() - t0
    m = engine.metrics()
    assert m["kv_bytes_in_use"] == 0 and all(h.done for h in handles)
    return {"tokens_per_s": m["generated_tokens"] / elapsed, "tau": m["tau"], "kv_mb": m["kv_bytes_total"] / 2**20}


def profile(target, draft) -> CostTable:
    return profile_cost_table(target, [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512], repeats=5, rows=16,
                              capture=tuple(draft.config.target_layer_ids), draft=draft,
                              draft_rows=[1, 2, 4, 8, 16, 32])


# name -> (method, draft key, scheduled, draft gate)
ARMS = {"ar": ("ar", None, False, False), "dflash": ("dflash", "dflash", False, False),
        "dspark": ("dspark", "dspark", False, False), "dspark-scheduled": ("dspark", "dspark", True, None),
        "dflash-gated": ("dflash", "dflash", False, True), "dspark-gated": ("dspark", "dspark", False, True)}
HEADERS = {"ar": "AR", "dflash": "DFlash", "dspark": "DSpark full", "dspark-scheduled": "DSpark scheduled",
           "dflash-gated": "DFlash gated", "dspark-gated": "DSpark full gated"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cost-table", default=None, help="DSpark's table (DFlash's gate is always profiled)")
    ap.add_argument("--methods", default="ar,dflash,dspark,dspark-scheduled,dflash-gated,dspark-gated",
                    help=f"comma list of {','.join(ARMS)}")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs per cell (median)")
    ap.add_argument("--waves", type=int, default=4, help="requests per cell = max(8, waves x concurrency)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    names = args.methods.split(",")
    if "ar" not in names or any(n not in ARMS for n in names):
        ap.error(f"--methods: a comma list of {', '.join(ARMS)} including ar")
    torch.manual_seed(0)
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    drafts = {k: load_draft(embedded.default_draft(k), target=target) for k in ("dflash", "dspark")}
    tables = {"dspark": CostTable.load(Path(args.cost_table)) if args.cost_table else profile(target, drafts["dspark"])}
    if any(ARMS[n][1] == "dflash" and ARMS[n][3] for n in names):
        tables["dflash"] = profile(target, drafts["dflash"])
    pool = prompts_humaneval(tok)
    rows = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        prompts = [pool[i % len(pool)] for i in range(max(8, args.waves * conc))]
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.repeats):  # side by side for this concurrency, interleaved
            for name in names:
                method, key, scheduled, gated = ARMS[name]
                runs[name].append(run_cell(target, drafts.get(key), method, scheduled, bool(gated),
                                           tables.get(key), prompts, conc, args.new_tokens))
        cells = {name: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for name, r in runs.items()}
        rows.append((conc, cells))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"HumanEval prompts, greedy, {args.new_tokens} new tokens, float32, {torch.get_num_threads()} threads; "
          "tok/s (tau incl. bonus; DFlash z-lab block 16 = 15 drafts, DSpark gamma 15: same 16-token window); "
          "gated = the draft gate may skip drafting or shorten the block when the cost table predicts it pays")
    print(f"median of {args.repeats} interleaved run(s) per cell; max(8, {args.waves} x concurrency) requests per cell")
    ratios = [("sched / DFlash", "dspark-scheduled", "dflash"), ("sched / AR", "dspark-scheduled", "ar")]
    ratios = [r for r in ratios if r[1] in names and r[2] in names]
    spec_names = [n for n in names if n != "ar"]
    print("| concurrency | " + " | ".join(HEADERS[n] for n in names) + " | "
          + " | ".join(r[0] for r in ratios) + " | min spec / AR | min gated-or-scheduled / AR |")
    print("|---" * (len(names) + len(ratios) + 3) + "|")
    for conc, c in rows:
        tps = {n: c[n]["tokens_per_s"] for n in names}
        cells = [f"{tps['ar']:.1f}"] + [f"{tps[n]:.1f} ({c[n]['tau']:.2f})" for n in spec_names]
        cells += [f"{tps[a] / tps[b]:.2f}x" for _, a, b in ratios]
        adaptive = [n for n in spec_names if n.endswith(("-gated", "-scheduled"))]
        cells.append(f"{min(tps[n] for n in spec_names) / tps['ar']:.2f}x" if spec_names else "")
        cells.append(f"{min(tps[n] for n in adaptive) / tps['ar']:.2f}x" if adaptive else "")
        print(f"| {conc} | " + " | ".join(cells) + " |")
    print(f"\npeak resident memory of this process (all engines, models, cost tables): {peak_mb:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peak_rss_mib": peak_mb}, indent=1, default=str))


if __name__ == "__main__":
    main()
