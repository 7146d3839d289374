"""Tests for blockspec.metrics, blockspec.bench.metrics and blockspec.bench.plots
(hand-computed answers)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from blockspec.bench.metrics import markdown_table, speedup_summary
from blockspec.metrics import AcceptanceStats, calibration, prefix_outcomes, survival

# Rounds as (accepted, num_drafts); some rows verified fewer drafts than the maximum.
MIXED = [(0, 3), (1, 3), (3, 3), (2, 2), (1, 1), (0, 2)]


def _stats(rounds):
    s = AcceptanceStats()
    for a, n in rounds:
        s.add_round(a, n)
    return s


# ------------------------------------------------------------------ AcceptanceStats
def test_tau_known_rounds():
    s = _stats([(0, 7), (3, 7), (7, 7)])
    assert s.rounds == 3
    assert s.tokens == 1 + 4 + 8
    assert s.tau == pytest.approx((1 + 4 + 8) / 3)


def test_histogram():
    s = _stats([(0, 7), (3, 7), (7, 7), (3, 7)])
    assert s.histogram() == [1, 0, 0, 2, 0, 0, 0, 1]
    assert _stats(MIXED).histogram() == [2, 2, 1, 1]


def test_per_slot_conditional_acceptance_by_hand():
    s = _stats(MIXED)
    # slot 1: accepted>=1 -> 4 rounds; verified slot 1 and accepted>=0 -> all 6
    # slot 2: accepted>=2 -> (3,3),(2,2); verified slot 2 and accepted>=1 -> (1,3),(3,3),(2,2)
    #         ((1,1) accepted slot 1 but never verified slot 2, so it is excluded)
    # slot 3: accepted>=3 -> (3,3); verified slot 3 and accepted>=2 -> (3,3) only
    assert s.per_slot_acceptance() == pytest.approx([4 / 6, 2 / 3, 1.0])
    assert s.tokens == 13
    assert s.tau == pytest.approx(13 / 6)


def test_per_slot_unreached_slot_is_nan():
    s = _stats([(0, 2), (0, 2)])
    ps = s.per_slot_acceptance()
    assert ps[0] == 0.0
    assert math.isnan(ps[1])
    assert s.to_dict()["per_slot"] == [0.0, None]


def test_counts_give_the_unconditional_acceptance_rates():
    s = _stats(MIXED)

    def rate_at(k: int) -> float:   # #(accepted >= k) / rounds
        return sum(c for (_, a), c in s.counts.items() if a >= k) / s.rounds
    assert s.rounds == 6 and rate_at(0) == 1.0
    assert [rate_at(k) for k in (1, 2, 3, 4)] == pytest.approx([4 / 6, 2 / 6, 1 / 6, 0.0])


@pytest.mark.parametrize("accepted,num_drafts", [(-1, 3), (4, 3), (0, -1), (1.5, 3)])
def test_invalid_round_raises(accepted, num_drafts):
    s = AcceptanceStats()
    with pytest.raises(ValueError):
        s.add_round(accepted, num_drafts)
    assert s.rounds == 0


def test_merge_equals_combined():
    a = _stats(MIXED[:3])
    b = _stats(MIXED[3:])
    combined = _stats(MIXED)
    merged = a.merge(b)
    assert merged is a
    assert merged.rounds == combined.rounds
    assert merged.tokens == combined.tokens
    assert merged.histogram() == combined.histogram()
    assert merged.per_slot_acceptance() == pytest.approx(combined.per_slot_acceptance())
    assert merged.to_dict() == combined.to_dict()
    assert b.rounds == 3  # other is untouched


def test_empty_stats_and_to_dict_is_json():
    e = AcceptanceStats()
    assert e.rounds == 0 and e.tokens == 0
    assert math.isnan(e.tau)
    assert e.histogram() == [] and e.per_slot_acceptance() == []
    d = _stats(MIXED).to_dict()
    assert d == {
        "rounds": 6,
        "tokens": 13,
        "tau": pytest.approx(13 / 6),
        "histogram": [2, 2, 1, 1],
        "per_slot": pytest.approx([4 / 6, 2 / 3, 1.0]),
    }
    json.dumps(d, allow_nan=False)
    json.dumps(e.to_dict(), allow_nan=False)


# ---------------------------------------------------------------------- calibration
def test_perfect_calibration():
    r = calibration([0.0, 1.0, 1.0, 0.0], [0, 1, True, False])
    assert r["ece"] == 0.0
    assert r["brier"] == 0.0
    assert r["auroc"] == 1.0
    assert r["n"] == 4
    assert len(r["reliability"]) == 10
    assert r["reliability"][0]["count"] == 2 and r["reliability"][-1]["count"] == 2  # 1.0 lands in last bin


def test_ece_two_bins_by_hand():
    r = calibration([0.2, 0.4, 0.6, 0.9], [0, 1, 1, 1], bins=2)
    # bin [0, .5): mean .3, frac .5 -> .2 * 2/4 ; bin [.5, 1]: mean .75, frac 1 -> .25 * 2/4
    assert r["ece"] == pytest.approx(0.1 + 0.125)
    assert r["brier"] == pytest.approx((0.04 + 0.36 + 0.16 + 0.01) / 4)
    assert r["auroc"] == 1.0
    rel = r["reliability"]
    assert [(b["lo"], b["hi"], b["count"]) for b in rel] == [(0.0, 0.5, 2), (0.5, 1.0, 2)]
    assert rel[0]["mean_pred"] == pytest.approx(0.3) and rel[0]["frac_pos"] == 0.5
    assert rel[1]["mean_pred"] == pytest.approx(0.75) and rel[1]["frac_pos"] == 1.0


def test_empty_bin_in_reliability():
    r = calibration([0.1, 0.2], [0, 1], bins=2)
    assert r["reliability"][1] == {"lo": 0.5, "hi": 1.0, "count": 0, "mean_pred": None, "frac_pos": None}
    assert r["ece"] == pytest.approx(abs(0.15 - 0.5))


def test_auroc_all_ties_is_half():
    assert calibration([0.5] * 4, [0, 1, 0, 1])["auroc"] == 0.5


def test_auroc_partial_ties_matches_pairwise():
    pred = [0.1, 0.5, 0.5, 0.9, 0.3, 0.3]
    y = [0, 0, 1, 1, 1, 0]
    pairs = [
        1.0 if pp > pn else 0.5 if pp == pn else 0.0
        for (pp, yp), (pn, yn) in itertools.product(zip(pred, y), repeat=2)
        if yp == 1 and yn == 0
    ]
    assert calibration(pred, y)["auroc"] == pytest.approx(sum(pairs) / len(pairs))
    assert calibration([0.1, 0.5, 0.5, 0.9], [0, 0, 1, 1])["auroc"] == pytest.approx(3.5 / 4)
    assert calibration([0.9, 0.1], [0, 1])["auroc"] == 0.0


def test_auroc_one_class_is_nan():
    assert math.isnan(calibration([0.2, 0.7], [1, 1])["auroc"])
    assert math.isnan(calibration([0.2, 0.7], [0, 0])["auroc"])


@pytest.mark.parametrize(
    "pred,outcome,bins",
    [([0.5], [0, 1], 10), ([], [], 10), ([1.5], [1], 10), ([0.5], [2], 10), ([0.5], [1], 0)],
)
def test_calibration_invalid(pred, outcome, bins):
    with pytest.raises(ValueError):
        calibration(pred, outcome, bins=bins)


# -------------------------------------------------------- survival / prefix outcomes
def test_survival_cumulative_product():
    assert survival([0.9, 0.5, 0.8]) == pytest.approx([0.9, 0.45, 0.36])
    assert survival([]) == []
    with pytest.raises(ValueError):
        survival([0.5, 1.2])


def test_prefix_outcomes():
    assert prefix_outcomes(2, 4) == [1, 1, 0, 0]
    assert prefix_outcomes(0, 3) == [0, 0, 0]
    assert prefix_outcomes(3, 3) == [1, 1, 1]
    assert prefix_outcomes(0, 0) == []
    with pytest.raises(ValueError):
        prefix_outcomes(4, 3)


# ----------------------------------------------------------------- speedup / table
def test_speedup_summary():
    d = speedup_summary(300.0, 100.0, 4.0)
    assert d["speedup"] == pytest.approx(3.0)
    assert d["efficiency"] == pytest.approx(0.75)
    with pytest.raises(ValueError):
        speedup_summary(1.0, 0.0, 2.0)
    with pytest.raises(ValueError):
        speedup_summary(1.0, 1.0, 0.0)


def test_markdown_table_format():
    rows = [
        {"method": "dflash", "tau": 3.14159, "tps": 123.456, "n": 5},
        {"method": "a|b", "tau": 0.5, "n": 12},
    ]
    out = markdown_table(rows, ["method", "tau", "tps", "n"])
    assert out == (
        "| method | tau | tps | n |\n"
        "| --- | --- | --- | --- |\n"
        "| dflash | 3.142 | 123.46 | 5 |\n"
        "| a\\|b | 0.500 |  | 12 |"
    )
    assert markdown_table([], ["x"]) == "| x |\n| --- |"


# ----------------------------------------------------------------------------- plots
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(p) -> bool:
    data = p.read_bytes()
    return len(data) > 100 and data[:8] == PNG_MAGIC


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    from blockspec.bench import plots

    s = _stats(MIXED)
    cal = calibration([0.2, 0.4, 0.6, 0.9], [0, 1, 1, 1], bins=4)
    outs = [
        plots.plot_acceptance_histogram({"dflash": s.histogram(), "dspark": [1, 2, 3, 4, 5]}, tmp_path / "hist.png"),
        plots.plot_per_slot({"dflash": s.per_slot_acceptance(), "dspark": [0.9, float("nan"), None]}, tmp_path / "slot.png"),
        plots.plot_speedup_vs_block([4, 8, 16], {"dflash": [2.0, 2.8, 3.1], "dspark": [2.2, 3.0, 3.5]}, tmp_path / "sp.png"),
        plots.plot_throughput_vs_concurrency([1, 4, 16], {"ar": [50.0, 180.0, 600.0]}, tmp_path / "tp.png"),
        plots.plot_reliability(cal["reliability"], tmp_path / "sub" / "rel.png"),
    ]
    for p in outs:
        assert p.exists() and _is_png(p), p


def test_tau_formula():
    from blockspec.metrics import tau

    assert tau(5, 2) == 3.5 and tau(0, 4) == 1.0
    assert math.isnan(tau(0, 0)) and tau(0, 0, empty=0.0) == 0.0
    assert _stats(MIXED).tau == tau(sum(a for a, _ in MIXED), len(MIXED))
