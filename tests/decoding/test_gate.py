"""The draft gate's temperature bands, hysteresis, exploration and warm-up (decoding/gate.py)."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import SamplingParams, temperature_band
from blockspec.decoding import exploration
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.exploration import (EXPLORE_BUDGET, EXPLORE_CREDIT, EXPLORE_FLOOR, GREEDY_MAX_BACKOFF,
                                            MAX_BACKOFF)
from blockspec.decoding.gate import (PROBE_EVERY, PROBE_STALE, RECHOOSE_ROUNDS, REPRICE_SHIFT, ArProbes, DraftGate,
                                    GateTuning, band_groups)
from blockspec.decoding.round_costs import KEY_SAMPLES, PACE_ROUNDS, RATIO_SAMPLES
from blockspec.errors import BlockspecError

# Drafting a full 3-slot block costs 0.5 s at 1 row and 1.0 s at 4; verify T(n) rises
# after 4 tokens. With every draft accepted drafting pays; with none it does not.
TABLE = CostTable([1, 4, 8, 16], [1.0, 1.0, 1.5, 2.5], draft_rows=[1, 4], draft_times_s=[0.5, 1.0])


def test_temperature_bands():
    assert [temperature_band(t) for t in (0.0, 1e-6, 1e-5, 0.5, 0.7, 1.0, 1.3)] == [0, 0, 1, 1, 2, 2, 3]
    assert SamplingParams(temperature=0.8).band == 2 and SamplingParams().band == 0
    assert band_groups([0, 0, 2, 2, 2, 3]) == ((0, 2), (2, 3), (3, 1))
    assert band_groups([]) == ()


def test_greedy_rows_keep_drafting_next_to_sampled_rows_that_do_not_pay():
    """Acceptance is learned per band: the sampled band's misses do not pull the greedy
    rows' curve down, so in a mixed batch exactly the greedy prefix drafts."""
    gate = DraftGate(TABLE, window=3, full_window=True, tuning=GateTuning(explore_every=1000))
    assert gate.decide([0, 0, 2, 2]) == (2, 3)          # greedy band unmeasured: it drafts (explores) first
    gate.update(torch.ones(2, 3), bands=[0, 0])
    assert gate.decide([0, 0, 2, 2]) == (4, 3)          # then the sampled band explores (a prefix: both draft)
    gate.update(torch.cat([torch.ones(2, 3), torch.zeros(2, 3)]), bands=[0, 0, 2, 2])
    greedy = gate.curves[0].clone()
    for _ in range(20):
        gate.update(torch.zeros(2, 3), bands=[2, 2])    # sampled rows accept nothing ...
    assert torch.equal(gate.curves[0], greedy) and float(greedy.min()) > 0.95   # ... the greedy curve stays
    assert float(gate.curves[2].max()) < 0.05
    assert gate.decide([0, 0, 2, 2]) == (2, 3)          # greedy rows draft, sampled rows run AR
    assert gate.decide([2, 2]) == (0, 0)
    # One pooled curve (all rows in one band) would have stopped the greedy rows too.
    pooled = DraftGate(TABLE, window=3, full_window=True, tuning=GateTuning(explore_every=1000, best_case_share=1.0))
    pooled.update(torch.ones(2, 3))
    for _ in range(20):
        pooled.update(torch.cat([torch.ones(2, 3), torch.zeros(2, 3)]))
    assert pooled.decide(4) == (4, 3)                   # (rows accepted whole blocks: one more exploration)
    assert pooled.decide(4) == (0, 0)


def test_hysteresis_keeps_the_last_choice_when_rates_are_close():
    """Near the break-even point the gate does not flap between AR and drafting."""
    table = CostTable([1, 4], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0])   # drafting: 2 s per round
    gate = DraftGate(table, window=3, full_window=True, tuning=GateTuning(explore_every=1000, momentum=0.0,
                                                                          prior_rounds=0.0))
    gate.update(torch.tensor([[1.0, 1.0, 0.0]]))       # 3 tokens in 2 s: 1.5 tok/s vs AR 1.0
    assert gate.decide(1) == (1, 3)
    gate.update(torch.tensor([[0.96, 0.0, 0.0]]))      # 1.96 tokens in 2 s: 0.98 tok/s, AR 2% faster
    assert gate.decide(1) == (1, 3)                    # within the 5% margin: stays drafting
    gate.update(torch.tensor([[0.8, 0.0, 0.0]]))       # 1.8 tokens: 0.9 tok/s, AR 11% faster
    assert gate.decide(1) == (0, 0)
    gate.update(torch.tensor([[1.0, 0.04, 0.0]]))      # 1.02 tok/s, 2% faster than AR: not enough to switch back
    assert gate.decide(1) == (0, 0)
    gate.update(torch.tensor([[1.0, 1.0, 0.0]]))
    assert gate.decide(1) == (1, 3)
    no_margin = DraftGate(table, window=3, full_window=True, tuning=GateTuning(explore_every=1000, momentum=0.0,
                                                                               prior_rounds=0.0, hysteresis=0.0))
    no_margin.update(torch.tensor([[1.0, 1.0, 0.0]]))
    assert no_margin.decide(1) == (1, 3)
    no_margin.update(torch.tensor([[0.96, 0.0, 0.0]]))
    assert no_margin.decide(1) == (0, 0)


def test_a_band_drafting_a_short_block_still_measures_the_full_window():
    """While a band drafts a shorter block, the slots past it are never measured: now and
    then the band drafts the whole window again, or a lucky early estimate would stick."""
    # (the full window pays if every draft is accepted: else exploring it could win nothing)
    table = CostTable([1, 4, 64], [1.0, 1.0, 4.0], draft_rows=[1, 16], draft_times_s=[0.5, 1.0],
                      draft_slot_times={1: [0.1, 0.4]}, draft_window=3)
    gate = DraftGate(table, window=3, full_window=True,
                     tuning=GateTuning(explore_every=4, momentum=0.7, best_case_share=1.0))
    gate.update(torch.ones(16, 1), 1)                    # slot 1 measured only
    gate.update(torch.zeros(16, 3), 3)                   # ... and one bad full round
    gate.update(torch.ones(16, 1), 1)
    blocks = [gate.decide(16)[1] for _ in range(12)]
    assert set(blocks) == {1, 3} and blocks.count(3) >= 1   # mostly one slot, the full window now and then


def test_warm_ar_rounds_price_ar_before_the_first_decision():
    gate = DraftGate(TABLE, window=3, full_window=True, warm_ar_rounds=2, tuning=GateTuning(explore_every=1000))
    assert gate.decide(1) == (1, 3)                      # unmeasured band: explore first
    gate.update(torch.ones(1, 3))
    assert gate.decide(1) == (0, 0)                      # then AR until two AR rounds were timed
    gate.observe(1, 0, 0, 0, seconds=1.0)
    assert gate.decide(1) == (0, 0)
    gate.observe(1, 0, 0, 0, seconds=1.0)
    assert gate.decide(1) == (1, 3)


def test_options_of_mixed_bands_equal_the_planner():
    """The scheduled gate prices 'the first bands draft' with the planner's own rule:
    its expected tokens and verified drafts equal `plan` over the rows' curves."""
    from blockspec.decoding.planner import plan

    table = CostTable([1, 8, 32], [1.0, 1.4, 3.0], draft_rows=[1, 8], draft_times_s=[0.3, 1.0])
    gate = DraftGate(table, window=3, tuning=GateTuning(momentum=0.0, prior_rounds=0.0))
    gate.update(torch.tensor([[0.9, 0.8, 0.5]] * 3), bands=[0, 0, 0])
    gate.update(torch.tensor([[0.6, 0.2, 0.1]] * 2), bands=[2, 2])
    groups = band_groups([0, 0, 0, 2, 2])
    option = next(o for o in gate.options(groups) if (o.rows, o.block) == (5, 3))
    survival = torch.tensor([gate.curve(0)] * 3 + [gate.curve(2)] * 2, dtype=torch.float64)
    lens = plan(survival, table, table.draft_time(5, block=3), base_rows=5)
    expected = 5 + sum(float(survival[r, :int(n)].sum()) for r, n in enumerate(lens))
    assert option.tokens == pytest.approx(expected)
    assert option.table_s == pytest.approx(table.draft_time(5, block=3) + table.time(5 + int(lens.sum())))


def test_one_timed_round_of_a_block_length_does_not_price_it():
    """A block drafted once in a quiet spell must not look cheap on that one sample (the
    gate then drafted it for good, 6% fewer tokens per round than the full block)."""
    table = CostTable([1, 4, 16], [1.0, 1.2, 2.0], draft_rows=[1], draft_times_s=[1.0],
                      draft_slot_times={2: [0.9]}, draft_window=3)
    gate = DraftGate(table, window=3, full_window=True)
    for _ in range(8):                                   # full blocks: as the table says
        gate.observe(1, 1, 3, 3, seconds=table.time(4) + table.draft_time(1))
    gate.observe(1, 1, 2, 2, seconds=0.1 * (table.time(3) + table.draft_time(1, block=2)))   # one quiet round
    assert gate.cost_ratio(True, 1, 2) == pytest.approx(gate.cost_ratio(True, 1))
    for _ in range(KEY_SAMPLES - 1):                     # once measured enough, its own ratio prices it
        gate.observe(1, 1, 2, 2, seconds=0.5 * (table.time(3) + table.draft_time(1, block=2)))
    assert gate.cost_ratio(True, 1, 2) == pytest.approx(0.5)


def test_one_fruitless_round_does_not_make_every_slot_look_likely():
    """The prior decays per slot: one exploration that accepted nothing leaves a fresh gate
    at AR. With a prior of full survival at every slot the curve read 1/3 at all 15 slots
    (6 expected tokens for the price of 3 AR rounds) and a fresh policy kept drafting."""
    table = CostTable([1, 16], [1.0, 2.0], draft_rows=[1], draft_times_s=[1.0])   # drafting: 3 AR rounds
    gate = DraftGate(table, window=15, full_window=True, tuning=GateTuning(explore_every=1000))
    assert gate.decide(1) == (1, 15)                    # unmeasured: explore
    gate.update(torch.zeros(1, 15))
    assert gate.decide(1) == (0, 0)
    flat = DraftGate(table, window=15, full_window=True, tuning=GateTuning(explore_every=1000, prior_decay=1.0))
    flat.decide(1)
    flat.update(torch.zeros(1, 15))
    assert flat.curve(0)[-1] == pytest.approx(1 / 3) and flat.decide(1) == (1, 15)
    with pytest.raises(BlockspecError, match="prior_decay"):
        GateTuning(prior_decay=0.0)


def test_a_whole_block_accepted_explores_again_at_once(monkeypatch):
    """Greedy text turns repetitive after a novel start (the shipped target loops): a band
    priced out early explores only every backed-off interval (128 rounds: a whole request
    at batch 1), so an exploration whose rows accepted the whole block explores again next
    round; a fruitless one waits its doubled interval (credit aside: refilled every round)."""
    monkeypatch.setattr(exploration, "EXPLORE_BUDGET", EXPLORE_CREDIT * 10)
    table = CostTable([1, 16], [1.0, 2.0], draft_rows=[1], draft_times_s=[1.0])
    gate = DraftGate(table, window=4, full_window=True, tuning=GateTuning(explore_every=2, momentum=1.0, jitter=False))
    assert gate.decide(1) == (1, 4)
    for _ in range(8):
        gate.update(torch.zeros(1, 4))                  # a novel start: nothing accepted
    schedule = [gate.decide(1) for _ in range(7)]
    assert schedule == [(0, 0), (1, 4), (0, 0), (0, 0), (0, 0), (1, 4), (0, 0)]   # every 2, then 4 rounds
    gate.update(torch.ones(1, 4))                       # the text turned repetitive
    assert gate.decide(1) == (1, 4)                     # at once, not 8 rounds later
    gate.update(torch.ones(1, 4))
    assert gate.decide(1) == (1, 4)
    gate.update(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # a miss: the band waits its interval (8) again
    assert [gate.decide(1) for _ in range(8)] == [(0, 0)] * 7 + [(1, 4)]


def test_options_are_priced_every_few_rounds_and_at_once_after_a_new_curve():
    """Pricing every option every round cost ~1% of a CPU AR round: a choice is priced
    again after RECHOOSE_ROUNDS rounds, or at once when a curve changed."""
    table = CostTable([1, 4], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0])
    tuning = GateTuning(explore_every=1000, momentum=0.0, prior_rounds=0.0, hysteresis=0.0)
    gate = DraftGate(table, window=3, full_window=True, tuning=tuning)
    for _ in range(KEY_SAMPLES):
        gate.observe(1, 0, 0, 0, seconds=1.0)          # AR rounds as the table says
    gate.update(torch.tensor([[1.0, 1.0, 0.0]]))       # 3 tokens in 2 s drafting vs AR's 1 tok/s
    assert gate.decide(1) == (1, 3)
    for _ in range(KEY_SAMPLES):                         # drafting rounds turn out 2x the table's price
        gate.observe(1, 1, 3, 3, seconds=4.0)
    assert [gate.decide(1) for _ in range(RECHOOSE_ROUNDS - 1)] == [(1, 3)] * (RECHOOSE_ROUNDS - 1)
    assert gate.decide(1) == (0, 0)                    # priced again: 0.75 tok/s
    fresh = DraftGate(table, window=3, full_window=True, tuning=tuning)
    fresh.update(torch.tensor([[1.0, 1.0, 0.0]]))
    assert fresh.decide(1) == (1, 3)
    fresh.update(torch.tensor([[0.0, 0.0, 0.0]]))      # a new curve is priced at once
    assert fresh.decide(1) == (0, 0)


def test_a_curve_that_moved_a_little_waits_for_the_next_pricing():
    """Pricing every option after every drafting round cost ~0.5% of one on a CPU: a curve
    whose expected tokens moved by less than REPRICE_SHIFT is priced at the next regular
    pricing (RECHOOSE_ROUNDS), one that moved more at once."""
    table = CostTable([1, 4], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0])   # AR 1 tok/s; drafting 2 s
    tuning = GateTuning(explore_every=1000, prior_rounds=0.0, hysteresis=0.0)
    gate = DraftGate(table, window=3, full_window=True, tuning=tuning)
    gate.update(torch.tensor([[1.0, 0.04, 0.0]]))      # 2.04 tokens in 2 s: drafting, barely
    assert gate.decide(1) == (1, 3)
    gate.update(torch.tensor([[0.95, 0.0, 0.0]]))      # 1.995 tokens now (2.2% less): AR would win
    expected = 1.0 + sum(gate.curve(0))
    assert expected < 2.0 and (2.04 - expected) / 2.04 < REPRICE_SHIFT
    assert [gate.decide(1) for _ in range(RECHOOSE_ROUNDS - 1)] == [(1, 3)] * (RECHOOSE_ROUNDS - 1)
    assert gate.decide(1) == (0, 0)                    # priced again
    moved = DraftGate(table, window=3, full_window=True, tuning=tuning)
    moved.update(torch.tensor([[1.0, 0.04, 0.0]]))
    assert moved.decide(1) == (1, 3)
    moved.update(torch.tensor([[0.8, 0.0, 0.0]]))      # 1.92 tokens: moved by more, priced at once
    assert moved.decide(1) == (0, 0)


def test_ar_probes_reprice_ar_while_rows_draft_every_round():
    """AR rounds timed in a slow spell priced AR above what it costs once the machine is quiet,
    and rows that draft every round never time AR again: where drafting wins by less than
    PROBE_MARGIN, one round in PROBE_EVERY is an AR probe, counted for the rounds it stands
    for, and the gate goes back to AR once it is cheaper; where drafting wins clearly, a probe
    only once in PROBE_STALE rounds."""
    table = CostTable([1, 4], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0])   # AR 1 s; drafting 2 s
    tuning = GateTuning(explore_every=1000, prior_rounds=0.0, hysteresis=0.0)

    def run(curve: list[float], rounds: int, slow_ar_s: float = 1.3) -> list[int]:
        gate = DraftGate(table, window=3, full_window=True, tuning=tuning)
        for _ in range(RATIO_SAMPLES):
            gate.observe(1, 0, 0, 0, seconds=slow_ar_s)    # AR timed in a slow spell
        for _ in range(2 * KEY_SAMPLES):
            gate.observe(1, 1, 3, 3, seconds=2.0)          # drafting timed in a quiet one
        gate.update(torch.tensor([curve]))
        drafting = []
        for _ in range(rounds):
            k, _ = gate.decide(1)
            drafting.append(k)
            if k:
                gate.observe(1, 1, 3, 3, seconds=2.0)      # drafting as the table says
                gate.update(torch.tensor([curve]))
            else:
                gate.observe(1, 0, 0, 0, seconds=1.0)      # AR as the table says, now
        return drafting

    close = run([0.5, 0.2, 0.1], 20 * PROBE_EVERY)        # 1.8 tokens in 2 s: 0.9 tok/s vs AR's 1.0
    assert close[0] == 1 and close[PROBE_EVERY - 1] == 0   # priced at 1.3 s, AR lost; then a probe
    assert sum(close[-4 * PROBE_EVERY:]) == 0               # AR, priced as it runs now
    clear = run([1.0, 1.0, 1.0], 4 * PROBE_STALE)         # 4 tokens in 2 s: drafting wins 2x
    assert clear.count(0) == 4 and all(clear[:PROBE_STALE - 1])   # one probe per PROBE_STALE rounds
    # AR priced at 2.5x what it costs (the pace misread when drafting took over): drafting, at
    # 0.9 tok/s against AR's real 1.0, looks 2.25x ahead, past PROBE_MARGIN; without the
    # stale probes it drafted for good.
    stuck = run([0.5, 0.2, 0.1], 8 * PROBE_STALE, slow_ar_s=2.5)
    assert all(stuck[:PROBE_STALE - 1]) and stuck[PROBE_STALE - 1] == 0
    assert sum(stuck[-2 * PROBE_STALE:]) == 0


def test_ar_probes_count_per_batch_make_up_and_forget_with_the_cache():
    """Each batch make-up counts its own drafting rounds to its next probe; an AR round, or
    the gate's make-up cache being reset (`forget`), starts the count again."""
    probes, a, b = ArProbes(), ((0, 1),), ((0, 2),)
    margin = lambda: False                                   # noqa: E731 (drafting does not win clearly)
    assert not any(probes.due(a, True, margin) for _ in range(PROBE_EVERY - 1))
    assert not probes.due(b, True, margin)                   # another make-up: its own count
    assert probes.due(a, True, margin) and probes.probing    # a's PROBE_EVERY-th drafting round
    assert probes.take(drafting_rows=0) and not probes.probing
    for _ in range(PROBE_EVERY - 2):
        probes.due(b, True, margin)
    probes.forget()
    assert not probes.due(b, True, margin)                   # b's count started again
    assert not probes.due(a, False, margin) and probes.drafted[a] == 0   # an AR round resets a


def test_a_slow_spell_of_the_machine_does_not_make_drafting_look_cheap():
    """On a shared CPU the machine's speed swings for seconds at a time, and where drafting
    seldom pays its rounds are timed at other moments than the AR rounds: each kind is
    kept relative to the machine's pace when it was timed, so a slow spell raises every
    price alike (AR rounds timed in one priced AR above drafting rounds timed in a quiet
    one, and at temperature 1 the engine's gate drafted up to every round)."""
    table = CostTable([1, 4], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0])
    tuning = GateTuning(explore_every=1000, momentum=0.0, prior_rounds=0.0, hysteresis=0.0)
    gate = DraftGate(table, window=3, full_window=True, tuning=tuning)
    for _ in range(2 * KEY_SAMPLES):
        gate.observe(1, 0, 0, 0, seconds=1.0)          # AR rounds as the table says: 1 tok/s
        gate.observe(1, 1, 3, 3, seconds=3.0)          # drafting rounds 1.5x the table's 2 s
    gate.update(torch.tensor([[1.0, 0.7, 0.0]]))       # 2.7 tokens in 3 s: 0.9 tok/s
    assert gate.decide(1) == (0, 0)
    for _ in range(RATIO_SAMPLES):                     # then the machine runs 1.6x slower
        gate.observe(1, 0, 0, 0, seconds=1.6)
    # (the AR kind takes a little of the spell: its ratios are timed against a pace that lags)
    assert gate.costs.pace == pytest.approx(1.6, rel=0.05) and gate.cost_ratio(False, 1) == pytest.approx(1.6)
    assert gate.cost_ratio(True, 1, 3) == pytest.approx(2.4, rel=0.05)
    assert [gate.decide(1) for _ in range(2 * RECHOOSE_ROUNDS)] == [(0, 0)] * (2 * RECHOOSE_ROUNDS)
    for _ in range(PACE_ROUNDS):                       # quiet again
        gate.observe(1, 0, 0, 0, seconds=1.0)
    assert gate.cost_ratio(True, 1, 3) == pytest.approx(1.5, rel=0.05) and gate.decide(1) == (0, 0)


def test_exploring_spends_a_budget_scaled_by_what_it_could_win():
    """At 16 rows on a CPU a greedy exploration took 6 AR rounds' time, and rows accepting a
    whole block made the band due again at once: explorations took half the wall time.
    Each now spends credit (EXPLORE_BUDGET per round) by its cost over what it could win
    at most, its rows accepting half their drafts (GateTuning.best_case_share), and none
    runs where even that would not beat the choice: at 16 and 32 greedy rows on a CPU, where
    drafting whole blocks only tied AR, explorations priced with every draft accepted made
    the default trail AR (0.89x and 0.94-0.96x)."""
    def gate_on(verify_64: float) -> DraftGate:   # verify free up to 16 tokens, then dearer per token
        table = CostTable([1, 16, 64], [1.0, 1.0, verify_64], draft_rows=[1, 16], draft_times_s=[0.2, 0.5])
        gate = DraftGate(table, window=3, full_window=True, tuning=GateTuning(jitter=False))
        gate.update(torch.zeros(4, 3))
        return gate

    def explorations(gate: DraftGate, rounds: int) -> int:
        count = 0
        for _ in range(rounds):
            k, block = gate.decide(16)
            if k:
                count += 1   # one row of the 4 accepts its whole block: the band is due again
                gate.update(torch.tensor([[1.0, 1.0, 1.0]] + [[0.0, 0.0, 0.0]] * (k - 1)))
        return count

    # 16 rows drafting 3 slots: every draft accepted, 64 tokens in 3 s (1.33x AR's 16 / s);
    # half of them, 40 tokens (0.83x): no exploration
    cannot_win = gate_on(2.5)
    assert explorations(cannot_win, 200) == 0 and cannot_win.exploration.interval[0] == GREEDY_MAX_BACKOFF * 8
    assert DraftGate(cannot_win.table, window=3, full_window=True, tuning=GateTuning(best_case_share=1.0)
                     ).exploration_cost(((0, 16),), (0, 0), (4, 3), 16) is not None
    wins_little = gate_on(1.5)          # ... 40 tokens in 2 s: 1.25x AR at best
    cost = wins_little.exploration_cost(((0, 16),), (0, 0), (4, 3), 16)
    assert cost == pytest.approx((1.385 - 1.0) / (40 / 2.0 / 16 - 1.0), rel=0.01)   # 4 rows: 28 tokens, 1.385 s
    assert 1 <= explorations(wins_little, 200) <= 1 + (EXPLORE_CREDIT + 200 * EXPLORE_BUDGET) / cost
    batch_one = DraftGate(CostTable([1, 16, 64], [1.0, 1.0, 3.0], draft_rows=[1, 16], draft_times_s=[0.2, 1.5]),
                          window=3, full_window=True, tuning=GateTuning(jitter=False))
    for _ in range(20):   # at batch 1 exploring could win 2x at half its drafts: the interval paces it
        batch_one.update(torch.zeros(1, 3))
    assert [i for i in range(200) if batch_one.decide(1)[0]] == [7, 23, 55, 87, 119, 151, 183]   # waits 8, 16, 32...


def test_a_loop_of_calls_explores_as_one_long_call():
    """Each `generate` call builds its gate afresh from the last call's state; the credit
    and the jitter draws are part of it. A call that started with full credit explored
    whatever the last one spent, so in a loop of calls (HumanEval at temperature 1, one call
    per prompt) the budget never bound (here 13 explorations in 400 rounds against 9), and
    each call's first jitter draw was the same (every wait 315 rounds)."""
    table = CostTable([1, 16, 64], [1.0, 1.0, 1.5], draft_rows=[1, 16], draft_times_s=[0.2, 0.5])

    def explored(calls: int, rounds: int) -> list[int]:
        gate = DraftGate(table, window=3, full_window=True)
        gate.update(torch.zeros(4, 3))
        out = []
        for call in range(calls):
            state = gate.state()
            gate = DraftGate(table, window=3, full_window=True)
            gate.load_state(state)
            for i in range(rounds):
                k, _ = gate.decide(16)
                if k:                                      # explorations that win nothing
                    out.append(call * rounds + i)
                    gate.update(torch.zeros(k, 3))
        return out

    one_call = explored(1, 400)
    assert explored(40, 10) == explored(4, 100) == one_call and 5 <= len(one_call) <= 12


def test_a_state_taken_right_after_a_rescale_keeps_the_prices():
    """The drift check can rescale the table in a call's last round, before any decision
    follows it: the state must hold ratios relative to the rescaled table, whose signature
    it is kept with, or the next call prices every kind off by the rescale."""
    table = CostTable([1, 16], [1.0, 2.0], draft_rows=[1], draft_times_s=[1.0])
    gate = DraftGate(table, window=3, full_window=True)
    for _ in range(8):
        gate.observe(1, 0, 0, 0, seconds=1.5)
        gate.observe(1, 1, 3, 3, seconds=4.0)
    before = (gate.cost_ratio(False, 1), gate.cost_ratio(True, 1, 3))
    table.rescale(2.0)
    again = DraftGate(table, window=3, full_window=True)
    again.load_state(gate.state())
    assert (again.cost_ratio(False, 1), again.cost_ratio(True, 1, 3)) == pytest.approx((before[0] / 2, before[1] / 2))


def test_a_band_accepting_most_of_a_short_block_still_explores_its_window():
    """The best case takes each slot's survival from the band's curve where it is above
    half: a band drafting 11 slots at batch 1 whose rows accept most of them (DSpark's
    greedy band on a CPU) priced its full-window exploration at half acceptance, below what
    it already had, and stayed at 11 slots (0.90x its fixed window)."""
    table = CostTable([1, 16], [1.0, 1.0], draft_rows=[1], draft_times_s=[1.0],
                      draft_slot_times={11: [0.9]}, draft_window=15)
    gate = DraftGate(table, window=15, full_window=True, tuning=GateTuning(prior_rounds=0.0, jitter=False))
    gate.update(torch.tensor([[0.9] * 11 + [0.0] * 4]))         # one full window: the last 4 slots missed
    for _ in range(20):
        gate.update(torch.tensor([[0.9] * 11]), block=11)       # then 11-slot blocks, mostly accepted
    one = ((0, 1),)
    rates = {(o.rows, o.block): gate.rate(o, 1) for o in gate.options(one)}
    assert max(rates, key=rates.__getitem__) == (1, 11)          # the choice: 11 slots
    cost = gate.exploration_cost(one, (1, 11), (1, 15), 1)     # 12.9 tokens in 2 s at best vs 10.9 in 1.9 s
    assert cost == pytest.approx((2.0 / 1.9 - 1.0) / ((1 + 11 * 0.9 + 4 * 0.5) / 2.0 / ((1 + 11 * 0.9) / 1.9) - 1.0),
                                 rel=0.01)


def test_an_exploration_costs_its_extra_rounds_over_what_it_could_win():
    assert exploration.credit_cost(3.0, 1.0, 0.0, 1) is None          # could not beat the choice
    assert exploration.credit_cost(3.0, 1.0, 4.0, 1) == pytest.approx(2.0)   # wins 5x: its 2 extra rounds
    assert exploration.credit_cost(3.0, 1.0, 0.5, 1) == pytest.approx(4.0)   # at most 1.5x: twice that
    assert exploration.credit_cost(3.0, 1.0, 4.0, 8) == pytest.approx(4.0)   # backed off 8x: 4 / 8 = 0.5x
    assert exploration.credit_cost(0.5, 1.0, 4.0, 1) == 0.0           # faster than the choice: free


def test_fruitless_explorations_expect_less_of_the_next():
    """What an exploration could win at most (every draft accepted) is divided by its band's
    backoff level: at 32 greedy rows on a CPU, where every exploration lost, the credit let
    one run every ~30 rounds (~7% of the time) on a bound of 1.8x that never came. Where the bound is
    several times the cost (batch 1) nothing changes; a band due (its rows accepted a
    whole block) is priced at level 1."""
    table = CostTable([1, 16, 64], [1.0, 1.0, 1.5], draft_rows=[1, 16], draft_times_s=[0.2, 0.5])
    gate = DraftGate(table, window=3, full_window=True, tuning=GateTuning(jitter=False))
    gate.update(torch.zeros(4, 3))
    many = ((0, 16),)
    level_one = gate.exploration_cost(many, (0, 0), (4, 3), 16)   # 16 rows: 1.25x at best
    assert gate.exploration_cost(many, (0, 0), (4, 3), 16, level=4) == pytest.approx(4 * level_one)
    batch_one = DraftGate(table, window=15, full_window=True)   # 16 tokens in 1.2 s against 1 in 1 s
    batch_one.update(torch.zeros(1, 15))
    one = ((0, 1),)
    at_level_four = batch_one.exploration_cost(one, (0, 0), (1, 15), 1, level=4)
    assert at_level_four == batch_one.exploration_cost(one, (0, 0), (1, 15), 1)
    explored = []
    for i in range(2000):
        k, _ = gate.decide(16)
        if k:
            explored.append(i)
            gate.update(torch.zeros(k, 3))   # nothing ever accepted: never due
    assert gate.exploration.level(0) == GREEDY_MAX_BACKOFF
    # three at levels 1, 2 and 4 (the credit it starts with), then one per 4 x cost of refills
    assert len(explored) <= 3 + (EXPLORE_CREDIT + 2000 * EXPLORE_BUDGET) / (GREEDY_MAX_BACKOFF * level_one) + 1
    gate.exploration.due.add(0)
    assert gate.exploration.level(0) == 1


@pytest.mark.parametrize("band, cap", [(0, GREEDY_MAX_BACKOFF), (2, MAX_BACKOFF)])
def test_exploration_waits_are_jittered_and_capped_per_band(band, cap, monkeypatch):
    """A wait between fruitless explorations is drawn from the upper half of its interval
    (an interval as long as a request measured the same phase of every request), and the
    greedy band's interval stops doubling sooner: its acceptance changes with the text
    (credit aside: refilled every round)."""
    monkeypatch.setattr(exploration, "EXPLORE_BUDGET", EXPLORE_CREDIT * 10)
    table = CostTable([1, 16], [1.0, 2.0], draft_rows=[1], draft_times_s=[1.0])
    gate = DraftGate(table, window=4, full_window=True, tuning=GateTuning(explore_every=4))
    gate.decide([band])
    gate.update(torch.zeros(1, 4), bands=[band])          # drafting does not pay
    explored = [i for i in range(6000) if gate.decide([band])[0]]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    late = gaps[8:]                                        # the interval is at its cap by then
    assert gate.exploration.interval[band] == cap * 4
    assert all(cap * 2 <= g <= cap * 4 for g in late) and len(set(late)) > 3
    fixed = DraftGate(table, window=4, full_window=True, tuning=GateTuning(explore_every=4, jitter=False))
    fixed.decide([band])
    fixed.update(torch.zeros(1, 4), bands=[band])
    explored = [i for i in range(3000) if fixed.decide([band])[0]]
    assert {b - a for a, b in zip(explored[8:], explored[9:])} == {cap * 4}


def test_a_sampled_band_explores_as_far_as_its_curve_reaches():
    """A sampled band's exploration drafts up to one slot past the last that rounds reach
    with survival >= EXPLORE_FLOOR (verifying slots nobody reaches is what exploring costs
    where drafting does not pay); the greedy band explores the whole window."""
    table = CostTable([1, 16], [1.0, 3.0], draft_rows=[1], draft_times_s=[2.0],
                      draft_slot_times={2: [1.0], 4: [1.5]}, draft_window=8)   # drafting never pays here
    gate = DraftGate(table, window=8, full_window=True,   # (exploring pays only with every draft accepted)
                     tuning=GateTuning(explore_every=4, prior_rounds=0.0, jitter=False, best_case_share=1.0))
    assert gate.explore_block(2) == 8 and gate.decide([2]) == (1, 8)   # unmeasured: the full window
    gate.update(torch.tensor([[1.0] + [0.0] * 7]), bands=[2])          # slot 1 accepted, slot 2 not
    assert gate.explore_block(2) == 2                   # slot 2 (survival 0) is the one past the reached slot
    decisions = [gate.decide([2]) for _ in range(4)]
    assert decisions[:3] == [(0, 0)] * 3 and decisions[3] == (1, 2)
    gate.update(torch.tensor([[1.0, 1.0]]), block=2, bands=[2])   # the tail improves: both slots accepted ...
    assert gate.explore_block(2) == 4                   # ... slot 3 (0 from the first round) is next
    assert gate.decide([2]) == (1, 4)                   # and, a whole block accepted, at once
    greedy = DraftGate(table, window=8, full_window=True, tuning=GateTuning(prior_rounds=0.0))
    greedy.decide([0])
    greedy.update(torch.tensor([[1.0] + [0.0] * 7]), bands=[0])
    assert greedy.explore_block(0) == 8 and EXPLORE_FLOOR < 0.1
