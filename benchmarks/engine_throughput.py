"""Engine throughput vs concurrency on HumanEval prompts (greedy, 128 new tokens) for
AR, DFlash, DSpark (full window) and DSpark (confidence-scheduled), measured side by
side in one run; plus the engine process's peak resident memory.

    python benchmarks/engine_throughput.py [--concurrency 1,4,16,32] [--repeats 3] [--cost-table runs/cost_table.json]

Each (method, concurrency) cell runs max(4, 2*c) requests through a fresh engine with
max_running = c; tokens/s = generated tokens / wall time. With --repeats N the four
methods run N times in turn at each concurrency and each cell is the median. The cost table for the
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
from blockspec.decoding.scheduler import CostTable, profile_cost_table


def prompts_humaneval(tok: Tokenizer) -> list[list[int]]:
    from blockspec.bench.datasets import humaneval  # the bench's prompts: no bare trailing newline token
    return [tok.encode(p.text) for p in humaneval()]


def run_cell(target, draft, method: str, scheduled: bool, table, prompts, conc: int, new_tokens: int) -> dict:
    engine = Engine(target, draft if method != "ar" else None, method=method, scheduled=scheduled,
                    max_running=conc, max_model_len=1024, cost_table=table if scheduled else None)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    engine.run_until_done()
    elapsed = time.perf_counter() - t0
    m = engine.metrics()
    assert m["kv_bytes_in_use"] == 0 and all(h.done for h in handles)
    return {"tokens_per_s": m["generated_tokens"] / elapsed, "tau": m["tau"], "kv_mb": m["kv_bytes_total"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cost-table", default=None)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs per cell (median)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    dflash = load_draft(embedded.default_draft("dflash"), target=target)
    dspark = load_draft(embedded.default_draft("dspark"), target=target)
    if args.cost_table:
        table = CostTable.load(Path(args.cost_table))
    else:
        table = profile_cost_table(target, [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512], repeats=5, rows=16,
                                   capture=tuple(dspark.config.target_layer_ids), draft=dspark,
                                   draft_rows=[1, 2, 4, 8, 16, 32])
    pool = prompts_humaneval(tok)
    methods = [("ar", None, False), ("dflash", dflash, False), ("dspark", dspark, False), ("dspark-scheduled", dspark, True)]
    rows = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        prompts = [pool[i % len(pool)] for i in range(max(4, 2 * conc))]
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in methods}
        for _ in range(args.repeats):  # side by side for this concurrency, interleaved
            for name, draft, scheduled in methods:
                runs[name].append(run_cell(target, draft, name.split("-")[0], scheduled, table, prompts, conc,
                                           args.new_tokens))
        cells = {name: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for name, r in runs.items()}
        rows.append((conc, cells))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"HumanEval prompts, greedy, {args.new_tokens} new tokens, float32, {torch.get_num_threads()} threads; "
          "tok/s (tau incl. bonus; DFlash z-lab block 16 = 15 drafts, DSpark gamma 15: same 16-token window)")
    print(f"median of {args.repeats} interleaved run(s) per cell")
    print("| concurrency | AR | DFlash | DSpark full | DSpark scheduled | sched / DFlash | sched / AR | min spec / AR |")
    print("|---|---|---|---|---|---|---|---|")
    for conc, c in rows:
        spec = min(c[m]["tokens_per_s"] for m in ("dflash", "dspark", "dspark-scheduled"))
        cell = lambda m: f"{c[m]['tokens_per_s']:.1f} ({c[m]['tau']:.2f})"  # noqa: E731
        sched, ar = c["dspark-scheduled"]["tokens_per_s"], c["ar"]["tokens_per_s"]
        print(f"| {conc} | {ar:.1f} | {cell('dflash')} | {cell('dspark')} | {cell('dspark-scheduled')} | "
              f"{sched / c['dflash']['tokens_per_s']:.2f}x | {sched / ar:.2f}x | {spec / ar:.2f}x |")
    print(f"\npeak resident memory of this process (all engines, models, cost table): {peak_mb:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peak_rss_mib": peak_mb}, indent=1, default=str))


if __name__ == "__main__":
    main()
