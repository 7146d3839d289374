"""Acceptance by context length (bench/context.py): each round's anchor position, the buckets
(<512, 512-2k, 2k-8k, 8k+) with tau and per-slot acceptance, and the binned tau for the plot."""

from __future__ import annotations

import pytest
import torch

from blockspec.bench.arms import RunRecord
from blockspec.bench.context import ContextAcceptance, bucket_of, round_positions, save_windowed_copy
from blockspec.bench.measure import ArmTotals
from blockspec.bench.report import context_rows
from blockspec.decoding.output import RequestStats
from blockspec.interop import EngineCompatibilityWarning
from blockspec.models.checkpoint import load_draft, save_draft
from conftest import make_draft, make_target


def test_round_positions_follow_the_tokens_each_round_produced():
    # the first anchor is the prefill's token at position = prompt length; a round adds accepted + 1
    assert round_positions(10, [3, 0, 2]) == [10, 14, 15]
    assert round_positions(7, []) == []


@pytest.mark.parametrize("position, label", [(0, "<512"), (511, "<512"), (512, "512-2k"), (2047, "512-2k"),
                                             (2048, "2k-8k"), (8191, "2k-8k"), (8192, "8k+"), (100000, "8k+")])
def test_bucket_edges(position, label):
    assert bucket_of(position) == label


def test_rounds_split_across_buckets_keep_the_overall_figure():
    totals = ArmTotals()
    # rounds at 505, 509, 513 (>= 512), 517, 518: the first two below 512
    stats = RequestStats(verified=[3, 3, 3, 3, 3], accepted=[3, 3, 3, 0, 1])
    totals.add([RunRecord(14, 1.0, stats, None, [0] * 14)], prompt_len=505)
    table = totals.by_context.table()
    assert [e["context"] for e in table] == ["<512", "512-2k"]
    assert [e["rounds"] for e in table] == [2, 3]
    assert table[0]["tau"] == 4.0 and table[1]["tau"] == pytest.approx((4 + 1 + 2) / 3)
    assert table[1]["per_slot"] == [pytest.approx(2 / 3), 0.5, 1.0]
    assert sum(e["rounds"] for e in table) == totals.acceptance.rounds
    series = totals.by_context.tau_by_position(bins=2)
    assert sum(series["rounds"]) == 5
    assert sum(t * n for t, n in zip(series["tau"], series["rounds"])) == totals.acceptance.tokens


def test_the_report_shows_the_buckets_next_to_the_overall_figure():
    acc = ContextAcceptance()
    acc.add(600, [1, 1], [3, 3])
    row = {"dataset": "d", "label": "dflash B=4", "temperature": 0.0, "drafts": 3,
           "acceptance": {"rounds": 2, "tau": 2.0, "per_slot": [1.0, 0.0, None]}, "by_context": acc.table()}
    rows = context_rows([row, {**row, "drafts": 0}])
    assert [r["context"] for r in rows] == ["all", "512-2k"] and rows[0]["per_slot"] == "1.00 0.00 -"


def test_a_windowed_copy_is_the_same_draft_with_every_layer_sliding(tmp_path):
    """save_windowed_copy (the benchmarks' and the vLLM test's windowed variant): same weights,
    every layer `sliding_attention` over W, non-causal unless asked, and the cut changes the block."""
    target = make_target()
    draft = make_draft(target, "zlab", 4, layers=2)
    save_draft(draft, tmp_path / "full")
    with pytest.warns(EngineCompatibilityWarning):   # dflash_config.causal: SGLang does not read it
        save_windowed_copy(tmp_path / "full", 3, tmp_path / "w3")
    copy = load_draft(tmp_path / "w3", target=target)
    assert copy.config.layer_types == ("sliding_attention",) * 2 and copy.config.sliding_window == 3
    assert copy.config.causal is False
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), draft.state_dict().values()))
    save_windowed_copy(tmp_path / "full", 3, tmp_path / "w3c", causal=None)
    assert load_draft(tmp_path / "w3c", target=target).config.layer_causal(0)
    features = torch.randn(1, 9, len(draft.config.target_layer_ids) * draft.config.hidden_size,
                           generator=torch.Generator().manual_seed(0))
    block = torch.tensor([[5, 2, 2, 2]])
    outs = []
    for model in (draft, copy):
        cache = model.new_cache(1, 32)
        model.append_context(cache, features, 9)
        outs.append(model.block_hidden(block, cache, target.embed_tokens))
    assert not torch.allclose(outs[0], outs[1])
