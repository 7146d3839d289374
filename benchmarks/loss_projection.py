"""How many more tokens the pretraining campaign needs (issue 35): fits val(t) = floor + b * t^-c
to a run's validation history (each loss column apart), once with the floor free and once with
no floor (a pure power law, the optimistic reading), and prints the tokens at which each fit
reaches each goal, in the constant phase and after a WSD decay worth the drop a decay branch
measured (`--decay-drop`, the main run's val at the branch point minus the branch's).

    python benchmarks/loss_projection.py [--meta runs/campaign/state/meta.json] [--from-step 800]
        [--goals 2.64,2.0] [--decay-drop 0.185,0.157]

Points before --from-step are left out (warm-up, and the corpus change at step 754: its
validation split changed, so the curve jumps there). A fit over a short stretch of the curve
extrapolates poorly: the floor's uncertainty dominates far goals; read the output as a scale,
not a date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

NAMES = ("val_loss", "val_stdlib_loss")


# Data exponents of language-model loss curves are a few tenths; a short stretch of curve fits
# anything, so the free fit's exponent is kept to this range (at its edge: the fit says so).
EXPONENTS = np.linspace(0.05, 1.0, 191)


def fit(tokens: np.ndarray, loss: np.ndarray, free_floor: bool) -> tuple[float, float, float, float]:
    """(floor, b, c, rms residual) of loss = floor + b * tokens^-c: least squares in (floor, b)
    (b alone with floor 0 when not `free_floor`) for each c of a grid, the best c kept."""
    best = None
    for c in EXPONENTS:
        x = tokens ** -c
        design = np.stack([np.ones_like(x), x], axis=1) if free_floor else x[:, None]
        coef, *_ = np.linalg.lstsq(design, loss, rcond=None)
        floor, b = (coef[0], coef[1]) if free_floor else (0.0, coef[0])
        if b <= 0:
            continue
        rms = float(np.sqrt(np.mean((floor + b * x - loss) ** 2)))
        if best is None or rms < best[3]:
            best = (float(floor), float(b), float(c), rms)
    if best is None:
        raise SystemExit("error: the losses do not fall with tokens; nothing to fit")
    return best


def tokens_for(goal: float, floor: float, b: float, c: float) -> float | None:
    """Tokens at which the fit reaches `goal` (None: at or below its floor, never)."""
    return None if goal <= floor else (b / (goal - floor)) ** (1.0 / c)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meta", default="runs/campaign/state/meta.json")
    ap.add_argument("--from-step", type=int, default=800)
    ap.add_argument("--goals", default="2.64,2.0")
    ap.add_argument("--decay-drop", default="0,0", help="per column: what a WSD decay took off (measured)")
    args = ap.parse_args()
    path = Path(args.meta)
    if not path.is_file():
        print(f"error: {path} does not exist (a pretraining run's state/meta.json)", file=sys.stderr)
        return 2
    meta = json.loads(path.read_text())
    cfg = meta["config"]
    per_step = cfg["batch_size"] * cfg["seq_len"] * cfg.get("grad_accum", 1)
    rows = [r for r in meta["history"] if r[0] >= args.from_step]
    goals = [float(g) for g in args.goals.split(",")]
    drops = [float(d) for d in args.decay_drop.split(",")]
    if len(rows) < 4:
        print(f"error: {len(rows)} validation points from step {args.from_step}; at least 4 to fit", file=sys.stderr)
        return 2
    tokens = np.array([r[0] * per_step for r in rows], dtype=np.float64)
    last = rows[-1][0] * per_step
    print(f"{path}: {len(rows)} validation points, steps {rows[0][0]}-{rows[-1][0]} "
          f"({tokens[0] / 1e6:.1f}M-{last / 1e6:.1f}M tokens), {per_step} tokens per step\n")
    print("| loss | fit: floor + b * tokens^-c | rms | now (fit) | decay drop | goal | tokens (constant phase) "
          "| tokens (after a decay) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, name in enumerate(NAMES[:len(rows[0]) - 1]):
        loss = np.array([r[1 + i] for r in rows], dtype=np.float64)
        drop = drops[i] if i < len(drops) else 0.0
        for free_floor in (True, False):
            floor, b, c, rms = fit(tokens, loss, free_floor)
            edge = " (exponent at the grid's edge)" if c in (EXPONENTS[0], EXPONENTS[-1]) else ""
            now = floor + b * last ** -c
            for goal in goals:
                plain, decayed = tokens_for(goal, floor, b, c), tokens_for(goal + drop, floor, b, c)
                show = [f"{t / 1e6:,.0f}M" if t is not None else "never (below the floor)" for t in (plain, decayed)]
                print(f"| {name} | {floor:.3f} + {b:.3g} * t^-{c:.2f}{edge} | {rms:.4f} | {now:.3f} | {drop:.3f} | "
                      f"{goal} | {show[0]} | {show[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
