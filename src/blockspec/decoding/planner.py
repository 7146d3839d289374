"""DSpark's prefix scheduler (docs/design.md section 5): how many drafts each row verifies.

`plan` admits draft slots in descending order of prefix survival while the
expected throughput tau* / T(n) keeps improving, and stops at the first slot
that does not improve it (the early stop is what keeps sampling lossless).
`admit` is that rule over slots already in admission order; the draft gate
(decoding/gate.py) prices whole rounds with it.
"""

from __future__ import annotations

import torch

from blockspec.decoding.cost_table import CostTable


def plan(survival: torch.Tensor, table: CostTable | None, draft_time_s: float = 0.0,
         min_survival: float = 0.0, base_rows: int | None = None) -> torch.Tensor:
    """Drafts to verify per request, [R] long, on the host (docs/design.md section 5, DSpark
    Algorithm 1): the round sizes its verify forward from them without a device read.

    survival [R, g]: prefix survival a_{r,j} = prod_{i<=j} c_{r,i}, non-increasing in j.
    Start from anchors only (n = R, tau* = R); admit slots in descending survival
    (ties: smaller j, then smaller r) while the round's expected throughput
    tau* / (draft_time_s + T(n)) strictly improves, and stop at the first slot that
    does not improve it. draft_time_s is the round's draft cost, already spent when
    the plan is made: it is part of the round's time, so a costly draft makes
    verifying more of what it proposed worth it (0: the paper's tau* * SPS(n)).
    Slots whose survival is below min_survival are never admitted (a floor that
    depends only on the slot's own survival, so `propose` may skip drafting them).
    base_rows (>= R): rows in the verify forward, when only the first R of them
    drafted this round (the others verify their anchor only). No table: verify
    every draft."""
    r, g = survival.shape
    if table is None or g == 0 or r == 0:
        return torch.full((r,), g, dtype=torch.long)
    base = r if base_rows is None else base_rows
    if r == 1:   # one row's prefix survival is already in admission order (batch 1: every round)
        row = survival[0].tolist()
        if all(a >= b for a, b in zip(row, row[1:])):
            admitted, _ = admit(row, base, table.times_upto(base + g), draft_time_s, min_survival)
            return torch.tensor([admitted])
    flat = survival.detach().to("cpu", torch.float64).t().reshape(-1)  # index j*R + r
    order = torch.sort(flat, descending=True, stable=True).indices       # stable: ties by (j, r)
    admitted, _ = admit(flat[order].tolist(), base, table.times_upto(base + r * g), draft_time_s, min_survival)
    return torch.bincount(order[:admitted] % r, minlength=r)


def admit(survivals: list[float], base_rows: int, times: list[float], draft_time_s: float,
          min_survival: float) -> tuple[int, float]:
    """The planner's admission rule over slots already in admission order (descending
    survival): admit while tau* / (draft time + T(base_rows + admitted)) strictly
    improves and the slot's survival is at least min_survival; stop at the first slot
    that fails (the early stop is a correctness rule: x_j's own admission may not
    depend on x_j, so no global argmax over cut points). times: T(0), T(1), ...
    Returns (admitted slots, expected tokens tau*)."""
    tau = float(base_rows)
    value = tau / (draft_time_s + times[base_rows])
    for n, s in enumerate(survivals):
        nxt = (tau + s) / (draft_time_s + times[base_rows + n + 1])
        if s < min_survival or not nxt > value:
            return n, tau
        tau, value = tau + s, nxt
    return len(survivals), tau
