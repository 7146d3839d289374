"""The inference GEMM path (fused, oneDNN-prepacked on CPU float32) against plain F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.models import layers
from blockspec.models.layers import FusedLinears, Linear


@pytest.mark.parametrize("rows", [1, 3, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linears_match_separate_layers(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    parts = [Linear(48, n, bias=bias) for n in (32, 16, 16)]
    fused = FusedLinears(*parts)
    x = torch.randn(2, rows, 48)
    with torch.no_grad():
        got = fused(x)
    for out, lin in zip(got, parts):
        assert out.shape == (2, rows, lin.out_features)
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_packed_weight_follows_in_place_updates() -> None:
    torch.manual_seed(0)
    lin = Linear(16, 8, bias=False)
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2.0)   # bumps the tensor version: the packed copy must be rebuilt
        after = lin(x)
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-5)


def test_grad_path_uses_real_parameters() -> None:
    lin = Linear(8, 4)
    lin(torch.randn(3, 8)).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_packing_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "PACKED_LINEAR", False)
    lin = Linear(8, 4)
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert lin._fast.packed is None


def test_packing_used_on_cpu_float32() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    lin = Linear(8, 4)
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert lin._fast.packed is not None
    lin64 = Linear(8, 4).double()
    with torch.no_grad():
        lin64(torch.randn(2, 8, dtype=torch.float64))
    assert lin64._fast.packed is None   # float64 keeps the exact reference GEMM
