"""Measuring the cost table on a shared machine: interleaved repeats and a monotone fit."""

from types import SimpleNamespace

import pytest
import torch

from blockspec.decoding import cost_table
from blockspec.decoding.cost_table import interleaved_minimum, monotone
from conftest import make_draft, make_target


def test_monotone_pools_a_spike_with_its_neighbours_instead_of_raising_every_later_point():
    # A running maximum would turn [1, 1, 5, 1, 1] into [1, 1, 5, 5, 5]: every wider round priced out.
    fitted = monotone([1.0, 1.0, 5.0, 1.0, 1.0])
    assert fitted[:2] == [1.0, 1.0]
    assert fitted[2:] == pytest.approx([7 / 3] * 3)
    assert monotone([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert monotone([0.5, 1.0, 2.0]) == [0.5, 1.0, 2.0]   # already non-decreasing: unchanged


def test_monotone_is_non_decreasing_and_keeps_the_mean():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ys = torch.rand(12, generator=gen).tolist()
        fitted = monotone(ys)
        assert all(b >= a - 1e-12 for a, b in zip(fitted, fitted[1:]))
        assert sum(fitted) == pytest.approx(sum(ys))   # pooling replaces runs by their means


class FakeMachine:
    """A clock a run advances by its cost, plus `extra` while a busy spell covers it."""

    def __init__(self, busy: range, extra: float) -> None:
        self.now, self.runs, self.busy, self.extra = 0.0, 0, busy, extra

    def run(self, cost: float):
        def go() -> None:
            self.now += cost + (self.extra if self.runs in self.busy else 0.0)
            self.runs += 1
        return go


def test_interleaved_minimum_survives_a_busy_spell_as_long_as_one_points_repeats(monkeypatch):
    costs = [1.0, 2.0, 3.0]
    repeats = 4
    # A spell over runs 6-9: measured point by point (a warm-up and 4 timed runs each), those
    # are all of point 1's timed runs; taking turns, each point meets it on at most two.
    machine = FakeMachine(busy=range(6, 6 + repeats), extra=10.0)
    monkeypatch.setattr(cost_table, "time", SimpleNamespace(perf_counter=lambda: machine.now))
    ticks = []
    best = interleaved_minimum([machine.run(c) for c in costs], repeats, warmup=1, device=torch.device("cpu"),
                               tick=lambda: ticks.append(1))
    assert best == costs
    assert len(ticks) == repeats * len(costs)   # progress after every timed run, none for the warm-up


def test_profiled_table_is_non_decreasing_in_tokens_and_in_block():
    target = make_target()
    draft = make_draft(target)
    table = cost_table.profile_cost_table(target, [1, 2, 3, 4], cost_table.ProfileOptions(repeats=2, rows=1, context=4,
                                                                                          warmup=0, draft_slots=[1, 2]),
                                          draft=draft, draft_rows=[1, 2])
    assert all(b >= a for a, b in zip(table.times_s, table.times_s[1:]))
    for r in range(2):
        by_block = [table.draft_slot_times[1][r], table.draft_slot_times[2][r], table.draft_times_s[r]]
        assert all(b >= a for a, b in zip(by_block, by_block[1:]))
