"""argmax_last: the greedy rule's argmax, equal to torch.argmax (first maximum on ties)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.decoding import sampling
from blockspec.decoding.sampling import argmax_last


@pytest.fixture(autouse=True)
def two_level_everywhere(monkeypatch):
    """The tests' tensors are small: take the two-level path for all of them."""
    monkeypatch.setattr(sampling, "_ARGMAX_TWO_LEVEL_MIN", 0)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)  # same examples every run
@given(rows=st.integers(0, 5), cols=st.integers(1, 3), width=st.sampled_from([256, 512, 1024, 100, 128]),
       levels=st.integers(1, 6), specials=st.integers(0, 3), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), keepdim=st.booleans())
def test_equals_torch_argmax_with_ties_infs_and_nans(rows, cols, width, levels, specials, seed, dtype, keepdim):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, cols, width), generator=gen).to(dtype)   # few levels: many ties
    flat = x.view(-1)
    if flat.numel():
        for value in (float("inf"), float("-inf"), float("nan"))[:specials]:
            flat[torch.randint(0, flat.numel(), (2,), generator=gen)] = value
    assert torch.equal(argmax_last(x, keepdim=keepdim), x.argmax(-1, keepdim=keepdim))


def test_non_contiguous_and_2d_inputs():
    x = torch.randn(8, 1024).t().contiguous().t()[:, :512]       # strided view
    assert not x.is_contiguous()
    assert torch.equal(argmax_last(x), x.argmax(-1))
    y = torch.randn(3, 4, 2048)[:, 1]
    assert torch.equal(argmax_last(y), y.argmax(-1))
