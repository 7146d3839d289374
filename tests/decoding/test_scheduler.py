"""The DSpark prefix scheduler (design section 5) and the cost table."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.decoding.cost_table import CostTable, interpolate, model_signature, ProfileOptions, profile_cost_table
from blockspec.decoding.gate import RECHOOSE_ROUNDS, DraftGate, GateTuning
from blockspec.decoding.planner import admit, plan
from blockspec.decoding.proposal import STOP_CHECK_SLOTS
from blockspec.decoding.policy import ConfidenceCalibration
from blockspec.errors import BlockspecError
from conftest import make_target


def expected_rates(gate: DraftGate, rows: int, band: int = 0) -> tuple[float, float, int]:
    """(best drafting, AR) expected tokens per second for `rows` rows of one band, and
    the block length of the drafting rate (the gate's own pricing)."""
    options = gate.options(((band, rows),))
    best = max(options[1:], key=lambda o: gate.rate(o, rows))
    return gate.rate(best, rows), gate.rate(options[0], rows), best.block


def reference_plan(survival: list[list[float]], table: CostTable, draft_s: float = 0.0) -> list[int]:
    """Design section 5 written out literally, one admission at a time (round time
    = the spent draft time + T(n))."""
    r = len(survival)
    slots = sorted(((-a, j, row) for row, s in enumerate(survival) for j, a in enumerate(s)))
    n, tau = r, float(r)
    best = tau / (draft_s + float(table.time(n)))
    lens = [0] * r
    for neg_a, j, row in slots:
        n, tau = n + 1, tau - neg_a
        value = tau / (draft_s + float(table.time(n)))
        if not value > best:
            break  # stop at once: never look further
        best = value
        lens[row] = j + 1
    return lens


def run_plan(survival: list[list[float]], table: CostTable | None) -> list[int]:
    return plan(torch.tensor(survival, dtype=torch.float64), table).tolist()


def test_no_table_verifies_everything():
    assert run_plan([[0.9, 0.1, 0.0], [0.2, 0.1, 0.05]], None) == [3, 3]


def test_constant_cost_admits_every_positive_survival():
    table = CostTable([1], [1.0])
    # Admitting a zero-survival slot adds nothing: not an improvement, so the scan stops there.
    assert run_plan([[0.9, 0.5, 0.0], [0.8, 0.0, 0.0]], table) == [2, 1]


def test_linear_cost_known_answer():
    # T(n) = 1 + 0.1 n. Values: n=2: 2/1.2=1.667; +0.9 -> 2.9/1.3=2.231; +0.7 -> 3.6/1.4=2.571;
    # +0.6 -> 4.2/1.5=2.8; +0.3 -> 4.5/1.6=2.8125; +0.2 -> 4.7/1.7=2.765 (worse: stop).
    table = CostTable([1, 100], [1.1, 11.0])
    survival = [[0.9, 0.6, 0.2], [0.7, 0.3, 0.1]]
    assert run_plan(survival, table) == [2, 2]
    assert reference_plan(survival, table) == [2, 2]


def test_early_stop_is_not_a_global_argmax():
    """A flat stretch of T(n) (e.g. GPU tile quantisation): admitting d_1 alone loses,
    d_1 + d_2 would win. A global argmax over cut points picks 2 drafts, letting
    a_2 (which depends on the token d_1) decide whether d_1 is verified; the
    rule stops at the first non-improving slot and verifies none."""
    table = CostTable([1, 2, 3], [1.0, 1.6, 1.6])
    survival = [[0.5, 0.45]]
    values = [(1 + sum(survival[0][:k])) * float(1.0 / table.time(1 + k)) for k in range(3)]
    assert max(range(3), key=values.__getitem__) == 2   # what a global argmax would pick
    assert run_plan(survival, table) == [0]


def test_ties_are_broken_by_slot_then_row():
    # One admission improves, the second does not: the tie goes to row 0.
    table = CostTable([2, 3, 4], [1.0, 1.1, 1.5])
    assert run_plan([[0.5, 0.5], [0.5, 0.5]], table) == [1, 0]
    # Equal survivals within a row: slot j is always admitted before slot j+1 (a prefix).
    table = CostTable([2, 3, 4, 5], [1.0, 1.1, 1.15, 5.0])
    assert run_plan([[0.6, 0.6], [0.6, 0.6]], table) == [1, 1]


def test_matches_literal_algorithm_on_random_survivals():
    gen = torch.Generator().manual_seed(0)
    table = CostTable([1, 4, 16, 64], [1.0, 1.05, 1.6, 6.0])
    seen = set()
    for _ in range(200):
        r, g = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        survival = torch.rand(r, g, generator=gen, dtype=torch.float64).cumprod(1)
        lens = plan(survival, table).tolist()
        assert lens == reference_plan(survival.tolist(), table)
        draft_s = float(torch.rand(1, generator=gen)) * 2.0
        with_draft = plan(survival, table, draft_s).tolist()
        assert with_draft == reference_plan(survival.tolist(), table, draft_s)
        # The spent draft time is part of the round: verifying more of the draft can only get more worth it.
        assert all(a >= b for a, b in zip(with_draft, lens))
        seen.update(lens)
    assert len(seen) >= 4  # the table produces a spread of lengths, 0 included
    assert 0 in seen


def test_plan_output_device_and_dtype():
    lens = plan(torch.full((3, 4), 0.9), CostTable([1], [1.0]))
    assert lens.dtype == torch.long and lens.tolist() == [4, 4, 4]
    assert plan(torch.zeros(2, 0), CostTable([1], [1.0])).tolist() == [0, 0]


# -- cost table ----------------------------------------------------------------------

def test_interpolation_and_extrapolation():
    table = CostTable([2, 4, 8], [1.0, 2.0, 3.0])
    n = torch.tensor([1, 2, 3, 4, 6, 8, 12])
    assert table.time(n).tolist() == pytest.approx([1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0])
    assert float(1.0 / table.time(4)) == pytest.approx(0.5)
    falling = CostTable([1, 2], [2.0, 1.0])  # noisy tail: never extrapolated downwards
    assert float(falling.time(10)) == pytest.approx(1.0)
    assert CostTable([5], [0.25]).time(torch.tensor([1, 50])).tolist() == [0.25, 0.25]


def test_json_round_trip(tmp_path):
    table = CostTable([1, 8, 64], [0.01, 0.012, 0.05], model="m", dtype="float32", machine="box",
                      meta={"rows": 8})
    path = tmp_path / "cost.json"
    table.save(path)
    assert CostTable.load(path) == table


def test_draft_time_by_block_length(tmp_path):
    """A round drafting a shorter block costs what the table measured for that block,
    interpolated between measured lengths; never more than the full block."""
    table = CostTable([1, 8], [1.0, 2.0], draft_rows=[1, 4], draft_times_s=[5.0, 9.0],
                      draft_slot_times={4: [2.0, 12.0], 1: [1.0, 3.0]}, draft_window=9)
    assert table.draft_slot_counts == [1, 4, 9]
    assert float(table.draft_time(1)) == pytest.approx(5.0)               # no slots given: the full round
    assert float(table.draft_time(1, block=1)) == pytest.approx(1.0)
    assert float(table.draft_time(1, block=4)) == pytest.approx(2.0)
    assert float(table.draft_time(1, block=6)) == pytest.approx(2.0 + 3.0 * 2 / 5)
    assert float(table.draft_time(4, block=4)) == pytest.approx(9.0)      # capped at the full block
    assert float(table.draft_time(4, block=40)) == pytest.approx(9.0)     # clamped to the window
    assert float(table.draft_time(2, block=1)) == pytest.approx(1.0 + 2.0 / 3)
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == table
    plain = CostTable([1, 8], [1.0, 2.0], draft_rows=[1, 4], draft_times_s=[5.0, 9.0])
    assert float(plain.draft_time(1, block=1)) == pytest.approx(5.0)       # no block times: the full round
    assert plain.draft_slot_counts == []
    raw = plain.to_dict() | {"draft_time_1slot_s": [1.0, 3.0], "draft_window": 9}   # an earlier release's file
    assert CostTable.from_dict(raw).draft_slot_times == {1: [1.0, 3.0]}
    with pytest.raises(BlockspecError, match="draft_window"):
        CostTable([1], [1.0], draft_rows=[1], draft_times_s=[2.0], draft_slot_times={1: [1.0]})
    with pytest.raises(BlockspecError, match="below draft_window"):
        CostTable([1], [1.0], draft_rows=[1], draft_times_s=[2.0], draft_slot_times={4: [1.0]}, draft_window=4)
    with pytest.raises(BlockspecError, match=r"draft_time_by_slots_s\[1\]"):
        CostTable([1], [1.0], draft_rows=[1, 2], draft_times_s=[2.0, 3.0], draft_slot_times={1: [1.0]},
                  draft_window=4)
    with pytest.raises(BlockspecError, match="slot counts"):
        CostTable.from_dict(plain.to_dict() | {"draft_time_by_slots_s": {"one": [1.0, 3.0]}, "draft_window": 9})


GATE_TABLE = CostTable([1, 4, 64], [1.0, 1.0, 4.0], draft_rows=[1, 16], draft_times_s=[0.5, 8.0])


def test_gate_rates_known_answer():
    gate = DraftGate(GATE_TABLE, window=3, tuning=GateTuning(prior_decay=1.0))   # a prior of full survival
    gate.update(torch.ones(2, 3))                  # first measurement taken as is: every draft survives
    spec, ar, block = expected_rates(gate, 1)
    assert block == 3                              # no shorter blocks in this table
    assert ar == pytest.approx(1.0)
    assert spec == pytest.approx(4 / (0.5 + 1.0))  # all 3 drafts planned; T(4) = 1.0
    spec, ar, _ = expected_rates(gate, 16)          # 16 rows: verifying every draft still pays in the plan
    assert spec == pytest.approx(64 / (8.0 + 4.0))  # T(64) = 4.0
    assert ar == pytest.approx(16 / (1.0 + 3.0 * 12 / 60))


def test_gate_asks_the_planner_with_the_mean_survival_curve():
    gate = DraftGate(GATE_TABLE, window=3, tuning=GateTuning(momentum=0.5, explore_rows=2, prior_rounds=1.0,
                                                                      prior_decay=1.0))
    # An early-stopped proposal of a 3-slot block: slot 3 = 0. Two request-rounds
    # next to the prior's one of full survival.
    gate.update(torch.tensor([[0.9, 0.5], [0.7, 0.3]]), 3)
    assert gate.curves[0].tolist() == pytest.approx([2.6 / 3, 1.8 / 3, 1 / 3])
    d = 0.5 ** 0.5                                  # one later request-round decays the others by this
    gate.update(torch.tensor([[0.6, 0.2, 0.1]]))
    sums, weight = [d * 1.6 + 0.6, d * 0.8 + 0.2, 0.1], 2 * d + 1
    expected = [(1 + x) / (1 + weight) for x in sums]
    assert gate.curves[0].tolist() == pytest.approx(expected)
    lens = plan(gate.curves[0].unsqueeze(0), GATE_TABLE, float(GATE_TABLE.draft_time(1)))
    tokens = 1 + float(gate.curves[0][:int(lens[0])].sum())
    spec, ar, _ = expected_rates(gate, 1)
    assert spec == pytest.approx(tokens / (0.5 + float(GATE_TABLE.time(1 + int(lens[0])))))
    gate.update(torch.zeros(0, 3))                 # an empty round changes nothing
    assert gate.curves[0].tolist() == pytest.approx(expected)
    assert expected_rates(gate, 1) == (spec, ar, 3)  # memoised ...
    gate.update(torch.ones(1, 3))
    assert expected_rates(gate, 1)[0] > spec        # ... until the next measurement


def test_full_window_gate_prices_every_draft():
    """DFlash / unscheduled DSpark verify every draft: the rate counts the whole window."""
    gate = DraftGate(GATE_TABLE, window=3, full_window=True,
                     tuning=GateTuning(momentum=0.0, prior_rounds=0.0))  # the last round alone
    gate.update(torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))   # measured prefix acceptance
    spec, ar, _ = expected_rates(gate, 16)
    assert spec == pytest.approx((16 + 16 * 1.5) / (8.0 + 4.0))    # 16 rows x 4 tokens = T(64)
    planned = DraftGate(GATE_TABLE, window=3, tuning=GateTuning(momentum=0.0, prior_rounds=0.0))
    planned.update(torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert expected_rates(planned, 16)[0] > spec                   # the planner drops the dead slot


def test_gate_shortens_the_block_under_load():
    """A full block pays at one row, but at 16 rows only a one-slot block beats AR:
    its draft costs a fraction of the full block's."""
    table = CostTable([1, 4, 64], [1.0, 1.0, 4.0], draft_rows=[1, 16], draft_times_s=[0.5, 8.0],
                      draft_slot_times={1: [0.1, 0.4]}, draft_window=3)
    gate = DraftGate(table, window=3, full_window=True, tuning=GateTuning(explore_every=1000, momentum=0.7,
                                                                          prior_decay=1.0))
    assert gate.block_choices == [1, 3]
    gate.update(torch.ones(4, 3))
    spec, ar, block = expected_rates(gate, 1)
    assert (block, spec) == (3, pytest.approx(4 / 1.5))         # full: 4 tokens in 0.5 + T(4)
    assert gate.decide(1) == (1, 3)
    spec, ar, block = expected_rates(gate, 16)
    t32 = 1.0 + 3.0 * 28 / 60
    assert (block, spec, ar) == (1, pytest.approx(32 / (0.4 + t32)), pytest.approx(16 / 1.6))
    assert gate.decide(16) == (16, 1)
    # A one-slot round measures slot 1 only; slots 2 and 3 keep their estimate.
    gate.update(torch.zeros(16, 1), 1)
    d = 0.7 ** 4                                   # 16 rows: momentum ** (16 / explore_rows)
    assert gate.curves[0].tolist() == pytest.approx([(0.5 + 4 * d) / (0.5 + 4 * d + 16), 1.0, 1.0])   # prior 0.5
    assert gate.decide(16) == (0, 0)                              # slot 1 never survives: AR
    # The curve the planner sees stays a prefix survival (never rising with the slot).
    gate2 = DraftGate(table, window=3, tuning=GateTuning(momentum=0.0, prior_rounds=0.0))
    gate2.update(torch.tensor([[1.0, 0.2, 0.2]]))
    gate2.update(torch.tensor([[0.1]]), 1)
    assert gate2.curves[0].tolist() == pytest.approx([0.1, 0.2, 0.2])
    for option in gate2.options(((0, 1),))[1:]:
        assert option.tokens <= 1 + 0.1 * option.block + 1e-6


def test_gate_scales_the_table_by_measured_round_times():
    """Rounds cost more than the forward passes the table prices; the gate compares
    the rates really achieved: the median measured / predicted ratio per kind of
    round, rows and (drafting) block length."""
    gate = DraftGate(GATE_TABLE, window=3, full_window=True, tuning=GateTuning(prior_decay=1.0))
    gate.update(torch.ones(1, 3))
    spec, ar, _ = expected_rates(gate, 16)              # table only: 64 / 12 vs 16 / 1.6
    assert (spec, ar) == (pytest.approx(64 / 12.0), pytest.approx(10.0))
    for seconds in (0.8, 0.8, 5.0):                    # AR rounds at 16 rows take half the table's time ...
        gate.observe(16, 0, 0, 0, seconds=seconds)
    assert gate.cost_ratio(False, 16) == pytest.approx(0.5)   # ... one descheduled round does not count
    for _ in range(3):                                 # drafting rounds: 1.5x the table's 8 + T(64)
        gate.observe(16, 16, 3, 48, seconds=18.0)
    assert gate.cost_ratio(True, 16, 3) == gate.cost_ratio(True, 16) == pytest.approx(1.5)
    assert expected_rates(gate, 16) == (pytest.approx(64 / 18.0), pytest.approx(20.0), 3)
    # Other row counts fall back to the ratio of that kind of round, then of the other kind.
    assert gate.cost_ratio(True, 8) == pytest.approx(1.5) and gate.cost_ratio(False, 8) == pytest.approx(0.5)
    fresh = DraftGate(GATE_TABLE, window=3, full_window=True)
    fresh.observe(1, 1, 3, 3, seconds=3.0)             # twice the table's 0.5 + T(4)
    assert fresh.cost_ratio(False, 1) == pytest.approx(2.0)


def test_gate_follows_measured_costs_to_ar():
    """The table alone says drafting pays at 1 row (4 tokens in 1.5 s vs 1 in 1 s);
    measured rounds say it does not."""
    gate = DraftGate(GATE_TABLE, window=3, full_window=True, tuning=GateTuning(explore_every=1000))
    gate.update(torch.ones(1, 3))
    assert gate.decide(1)[0] == 1
    for _ in range(30):
        gate.observe(1, 1, 3, 3, seconds=10.0)         # 4 tokens in 10 s
        gate.observe(1, 0, 0, 0, seconds=1.0)          # 1 token in 1 s
    assert [gate.decide(1)[0] for _ in range(RECHOOSE_ROUNDS)][-1] == 0   # once the options are priced again


def test_gate_survival_is_a_mean_over_request_rounds():
    """At batch 1 a hard start does not switch drafting off at once: three
    request-rounds stand next to the prior's one; a round of many rows outweighs it."""
    table = CostTable([1, 16, 64], [1.0, 1.0, 4.0], draft_rows=[1, 16], draft_times_s=[0.5, 0.5])
    gate = DraftGate(table, window=3, full_window=True, tuning=GateTuning(explore_every=1000, prior_rounds=1.0))
    for _ in range(3):                                  # three rounds that accept nothing
        gate.update(torch.zeros(1, 3))
    assert gate.decide(1)[0] == 1                   # still drafting: 3 samples of 1 row
    d = 0.95 ** 0.25
    assert gate.curves[0][0] == pytest.approx(1 / (1 + 1 + d + d * d))
    many = DraftGate(table, window=3, full_window=True, tuning=GateTuning(explore_every=1000, prior_rounds=1.0))
    many.update(torch.zeros(16, 3))                     # 16 rows that accept nothing
    assert float(many.curves[0].max()) == pytest.approx(1 / 17)
    assert many.decide(16)[0] == 0


def test_gate_measures_with_few_rows_then_follows_measurements():
    gate = DraftGate(GATE_TABLE, window=3, tuning=GateTuning(momentum=0.7))
    assert gate.decide(16)[0] == 4             # unmeasured: a few rows explore (explore_rows=4)
    assert gate.decide(2)[0] == 2
    gate.update(torch.ones(1, 3))
    assert gate.decide(1)[0] == 1 and gate.decide(16)[0] == 0   # pays alone, not at 16 rows
    for _ in range(40):                            # drafts never accepted
        gate.update(torch.zeros(2, 3))
    assert gate.decide(1)[0] == 0


def test_gate_explores_after_a_run_of_undrafted_rounds():
    gate = DraftGate(GATE_TABLE, window=3, tuning=GateTuning(explore_every=4, explore_rows=1, jitter=False,
                                                             best_case_share=1.0))
    gate.update(torch.zeros(1, 3))                 # drafting never pays (at 2 rows it would, all accepted)
    decisions = [gate.decide(2)[0] for _ in range(4 + 8 + 16)]
    explored = [i for i, d in enumerate(decisions) if d]
    assert explored == [3, 11, 27]             # intervals 4, 8, 16: each fruitless exploration backs off
    assert {decisions[i] for i in explored} == {1}   # exploring drafts one row only
    for _ in range(40):                        # the text turns easy: every draft survives
        gate.update(torch.ones(1, 3))
    assert all(gate.decide(1)[0] == 1 for _ in range(5))
    assert gate.exploration.interval[0] == 4     # a win resets the back-off
    with pytest.raises(BlockspecError, match="explore_every"):
        DraftGate(GATE_TABLE, window=3, tuning=GateTuning(explore_every=0))


def test_gate_without_draft_times_always_drafts():
    gate = DraftGate(CostTable([1, 2], [1.0, 1.0]), window=3)
    gate.update(torch.zeros(1, 3))
    assert gate.decide(64)[0] == 64
    with pytest.raises(BlockspecError, match="no draft times"):
        gate.table.draft_time(1)


def test_plan_with_base_rows_counts_the_undrafted_rows():
    table = CostTable([1, 4, 8], [1.0, 1.0, 3.0])    # free up to 4 tokens, then 0.5 s per token
    survival = [[0.9, 0.8, 0.7]]
    assert run_plan(survival, table) == [3]           # 1 row: n = 4 is free
    # 4 rows in the forward, 1 drafted: every admitted draft now costs time; only a sure one pays.
    assert plan(torch.tensor(survival, dtype=torch.float64), table, base_rows=4).tolist() == [0]
    assert plan(torch.tensor([[0.99]], dtype=torch.float64), CostTable([1, 4, 5], [1.0, 1.0, 1.2]),
                base_rows=4).tolist() == [1]


def test_draft_times_round_trip_and_validation(tmp_path):
    GATE_TABLE.save(tmp_path / "t.json")
    back = CostTable.load(tmp_path / "t.json")
    assert (back.draft_rows, back.draft_times_s) == ([1, 16], [0.5, 8.0])
    assert float(back.draft_time(8)) == pytest.approx(0.5 + 7.5 * 7 / 15)
    with pytest.raises(BlockspecError, match="'draft_rows' has 2 entries but 'draft_time_s' has 1"):
        CostTable([1], [1.0], draft_rows=[1, 2], draft_times_s=[1.0])
    with pytest.raises(BlockspecError, match="draft_rows must be strictly increasing"):
        CostTable([1], [1.0], draft_rows=[2, 1], draft_times_s=[1.0, 2.0])


def test_profile_with_a_draft_measures_draft_rounds():
    from conftest import make_draft

    target = make_target()
    draft = make_draft(target, "zlab", 4)
    table = profile_cost_table(target, [1, 2], ProfileOptions(repeats=1, rows=2, context=4, warmup=0), draft=draft,
                               draft_rows=[2, 1])
    assert table.draft_rows == [1, 2] and len(table.draft_times_s) == 2
    assert all(t > 0 for t in table.draft_times_s)
    assert table.draft_window == 3 and table.draft_slot_counts == [1, 2, 3]
    assert all(0 < a <= b for times in table.draft_slot_times.values() for a, b in zip(times, table.draft_times_s))


# -- the survival floor: skipped drafts never change the plan -------------------------

def test_plan_never_admits_below_the_floor():
    table = CostTable([1, 64], [1.0, 1.0])     # verifying is free: everything above the floor is admitted
    survival = [[0.9, 0.3, 0.01], [0.04, 0.02, 0.0]]
    assert run_plan(survival, table) == [3, 2]   # a zero-survival slot adds nothing: not admitted
    assert plan(torch.tensor(survival, dtype=torch.float64), table, 0.0, 0.03).tolist() == [2, 1]


def test_early_stopped_proposal_plans_like_the_full_one():
    from blockspec.config import SamplingParams
    from blockspec.decoding.sampling import RowSampler
    from blockspec.decoding.round import propose
    from conftest import make_draft

    target = make_target(dtype=torch.float64)
    draft = make_draft(target, "deepspec", 8, markov_rank=8, confidence=True)
    table = CostTable([1, 8, 64], [1.0, 1.1, 3.0])
    gen = torch.Generator().manual_seed(0)
    stopped_early = 0
    for trial in range(12):
        rows = 1 + trial % 4
        cache = draft.new_cache(rows, 64)
        feats = torch.randn(rows, 5, len(draft.config.target_layer_ids) * target.config.hidden_size,
                            generator=gen, dtype=torch.float64)
        draft.append_context(cache, feats, 5)
        anchors = torch.randint(0, target.config.vocab_size, (rows,), generator=gen)
        sampler = RowSampler.from_params([SamplingParams()] * rows)
        floor = 0.3
        with torch.no_grad():
            full = propose(draft, target, cache, anchors, sampler)
            short = propose(draft, target, cache, anchors, sampler, stop_below=floor)
        g = short.tokens.shape[1]
        stopped_early += g < full.tokens.shape[1]
        if g < full.tokens.shape[1]:   # at the first check (every STOP_CHECK_SLOTS slots) every row is below
            survival = full.confidence.cumprod(1)
            assert g % STOP_CHECK_SLOTS == 0 and bool((survival[:, g - 1] < floor).all())
            assert g == STOP_CHECK_SLOTS or not bool((survival[:, g - 1 - STOP_CHECK_SLOTS] < floor).all())
        assert torch.equal(short.tokens, full.tokens[:, :g])
        torch.testing.assert_close(short.confidence, full.confidence[:, :g])
        for draft_s in (0.0, 0.5):
            assert torch.equal(plan(short.confidence.cumprod(1), table, draft_s, floor),
                               plan(full.confidence.cumprod(1), table, draft_s, floor))
    assert stopped_early > 0   # the floor did cut some proposals short


def test_confidence_calibration_learns_from_rows_at_risk():
    """Per slot: accepted / sum of confidences over the rows that verified the slot with
    every earlier draft accepted; rows that stopped earlier or were not verified that far
    do not count."""
    calib = ConfidenceCalibration(3, momentum=0.5, prior=1.0)
    conf = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.8, 0.4, 0.2]])
    assert calib.apply(conf).tolist() == conf.double().tolist()          # starts as the head
    # row 0 verified 3 and accepted all; row 1 verified 3, accepted 1; row 2 verified 1, accepted 1.
    calib.observe(conf, torch.tensor([3, 3, 1]), torch.tensor([3, 1, 1]))
    assert calib.accepted.tolist() == [3.0, 1.0, 1.0]
    assert calib.expected.tolist() == pytest.approx([1.8, 1.0, 0.5])
    assert calib.scale.tolist() == pytest.approx([4 / 2.8, 1.0, 2 / 1.5])
    assert calib.apply(torch.tensor([[0.9, 0.3, 0.6]]))[0].tolist() == pytest.approx([1.0, 0.3, 0.8])  # capped at 1
    calib.observe(conf[:0], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert calib.accepted.tolist() == [1.5, 0.5, 0.5]                    # each round decays the sums


@pytest.mark.parametrize("layout", ["zlab", "deepspec"])
def test_propose_a_shorter_block_equals_a_draft_run_at_that_block_size(layout):
    """propose(block=g) drafts the block a draft set to g drafts would: the anchor and
    the mask slots of g drafts only (a cheaper forward), not a cut of the full block."""
    from blockspec.config import SamplingParams
    from blockspec.decoding.sampling import RowSampler
    from blockspec.decoding.round import propose
    from conftest import make_draft

    target = make_target()
    draft = make_draft(target, layout, 6, markov_rank=4 if layout == "deepspec" else 0,
                       confidence=layout == "deepspec")
    short = draft.with_block_size(3 if layout == "zlab" else 2)  # 2 drafts either way
    sampler = RowSampler.from_params([SamplingParams()] * 2)
    anchors = torch.tensor([5, 9])
    feats = torch.randn(2, 7, len(draft.config.target_layer_ids) * draft.config.hidden_size)
    outs = []
    for d in (draft, short):
        cache = d.new_cache(2, 32)
        d.append_context(cache, feats, 7)
        with torch.inference_mode():
            outs.append(propose(d, target, cache, anchors, sampler, block=2 if d is draft else None))
    assert outs[0].tokens.shape == (2, 2) and torch.equal(outs[0].tokens, outs[1].tokens)
    if layout == "deepspec":
        assert torch.allclose(outs[0].confidence, outs[1].confidence)
    full = propose(draft, target, draft.new_cache(2, 32), anchors, sampler)
    assert full.tokens.shape == (2, draft.config.num_drafts)
    with pytest.raises(ValueError, match="num_drafts"):
        propose(draft, target, draft.new_cache(2, 32), anchors, sampler, block=draft.config.num_drafts + 1)


@pytest.mark.parametrize("seed", range(6))
def test_gate_plans_identical_rows_as_the_planner_does(seed):
    """The gate's plain-float plan for rows sharing one curve admits what `plan` admits."""
    gen = torch.Generator().manual_seed(seed)
    table = CostTable([1, 3, 8, 40, 200], [1.0, 1.05, 1.3, 2.5, 9.0])
    gate = DraftGate(table, window=6, min_survival=0.05 * (seed % 2))
    survival = torch.rand(6, generator=gen, dtype=torch.float64).sort(descending=True).values
    for rows in (1, 3, 7, 16):
        draft_s = float(torch.rand(1, generator=gen)) * 3
        lens = plan(survival.unsqueeze(0).expand(rows, -1), table, draft_s, gate.min_survival)
        admitted = torch.arange(6).unsqueeze(0) < lens.unsqueeze(1)
        n, tokens = admit([s for s in survival.tolist() for _ in range(rows)], rows, table.times_upto(rows * 7),
                          draft_s, gate.min_survival)
        assert n == int(lens.sum())
        assert tokens == pytest.approx(rows + float((survival * admitted).sum()))
