"""--pack: several examples back to back in one row (per-sequence RoPE positions, a
block-diagonal causal target mask, each block's context inside its own sequence) trains
exactly as the same examples one per row: same loss sums, same gradients, same features."""

from __future__ import annotations

import pytest
import torch

from blockspec.training.data import Example, collate, collate_packed, pack_rows
from blockspec.training.objective import AnchorSpec, DraftObjective, anchor_generators, prepare
from conftest import make_draft, make_target

LENGTHS = [(5, 19), (9, 14), (3, 26), (7, 11)]   # (prompt, response) of four examples


def examples(vocab: int) -> list[Example]:
    g = torch.Generator().manual_seed(3)
    return [Example(torch.randint(0, vocab - 2, (p + r,), generator=g).tolist(), p) for p, r in LENGTHS]


def run(target, draft, exs, pack: bool, max_len: int = 64):
    rows = collate_packed(exs, 0, max_len) if pack else None
    ids, mask = (rows.ids, rows.loss_mask) if pack else collate(exs, 0)
    x = prepare(target, draft, ids, mask, anchor_generators(0, 0, list(range(len(exs)))), AnchorSpec(4, 4.0),
                packed_rows=rows)
    draft.zero_grad(set_to_none=True)
    sums = DraftObjective(draft, target, ce_chunk=5)(x)
    sums[0].backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return sums.detach(), grads, rows


CASES = [("zlab", None, False), ("deepspec", "vanilla", True)]


@pytest.mark.parametrize("layout, markov, confidence", CASES)
def test_packed_rows_train_as_unpacked(layout, markov, confidence):
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, layout, 4, markov_rank=8 if markov else 0, markov_type=markov or "vanilla",
                       confidence=confidence, layers=2, dtype=torch.float64).train().requires_grad_(True)
    exs = examples(target.config.vocab_size)
    ref, ref_grads, _ = run(target, draft, exs, pack=False)
    got, grads, rows = run(target, draft, exs, pack=True)
    assert rows.ids.shape[0] == 2 and max(len(s) for s in rows.segments) >= 2   # really packed
    assert ref[-1] >= 12                                                      # many blocks trained
    # The heads project to the vocabulary in float32 (losses.block_sums): the sums carry float32
    # rounding of a different summation order; everything before them is float64.
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-7, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-8, msg=name)


def test_packed_features_equal_each_sequence_alone():
    target = make_target(dtype=torch.float64)
    exs = examples(target.config.vocab_size)
    rows = collate_packed(exs, 0, 64)
    capture = tuple(target.config.default_layer_ids(2))
    packed = target(rows.ids, capture=capture, output="hidden", positions=rows.positions,
                    mask=rows.attention_mask())
    for r, segs in enumerate(rows.segments):
        for k, start, n in segs:
            alone = target(torch.tensor([exs[k].ids]), capture=capture, output="hidden")
            torch.testing.assert_close(packed.features[r, start:start + n], alone.features[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(packed.hidden[r, start:start + n], alone.hidden[0], rtol=1e-10, atol=1e-10)


def test_first_fit_rows_and_segments():
    assert pack_rows([30, 20, 40, 10, 25], 50) == [[2, 3], [0, 1], [4]]
    exs = [Example(list(range(1, n + 1)), 1) for n in (6, 3, 5)]
    rows = collate_packed(exs, 0, 10)
    assert rows.segments == [[(0, 0, 6), (1, 6, 3)], [(2, 0, 5)]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert rows.loss_mask[0].tolist() == [False] + [True] * 5 + [False, True, True]
    assert rows.loss_mask[1].tolist() == [False] + [True] * 4 + [False] * 4     # padding: never trained
    m = rows.attention_mask()[0, 0]
    assert m[7, 5].item() is False and m[7, 6].item() is True and m[5, 0].item() is True and m[6, 7].item() is False
