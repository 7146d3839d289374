"""The slot pool keeps running rows in temperature-band order (engine/slots.py)."""

from __future__ import annotations

import random

import torch

from blockspec import PolicyOptions
from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.engine.engine import Engine
from blockspec.engine.slots import band_swaps
from conftest import make_draft, make_target


def test_band_swaps_sort_with_few_swaps():
    rng = random.Random(0)
    for _ in range(500):
        bands = [rng.randint(0, 3) for _ in range(rng.randint(0, 12))]
        out = list(bands)
        swaps = band_swaps(bands)
        for a, b in swaps:
            out[a], out[b] = out[b], out[a]
        assert out == sorted(bands)
        assert len(swaps) <= sum(x != y for x, y in zip(bands, sorted(bands)))
    assert band_swaps([0, 0, 2, 2, 1, 0]) == [(2, 5), (3, 4)]    # a newcomer at the end: two swaps
    assert band_swaps([0, 1, 2]) == []


def test_engine_orders_rows_greedy_first_and_outputs_stay_exact():
    """Sampled requests admitted before greedy ones are swapped behind them (the gate's
    drafting rows are a prefix); the KV rows move with them, so greedy outputs equal AR
    and seeded sampled ones equal their own fixed-window run."""
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, "zlab", 4)
    engine = Engine(target, draft, "dflash", max_running=4, max_model_len=64, policy=PolicyOptions(adapt=False))
    sampled = SamplingParams(temperature=0.9, seed=4, max_new_tokens=12, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    params = [sampled, SamplingParams(temperature=1.3, seed=5, max_new_tokens=12, ignore_eos=True), greedy, greedy]
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    engine.step()
    assert [q.params.band for q in engine._running] == [0, 0, 2, 3]
    engine.run_until_done()
    for h, p, sp in zip(handles, prompts, params):
        ref = generate(target, [p], sp, draft=draft,
                       policy=PolicyOptions(adapt=False)) if sp.temperature else generate(target, [p], sp)
        assert h.result().tokens == ref.completions[0].tokens
