"""STS calibration: the fitted temperature recovers a known miscalibration."""

from __future__ import annotations

import torch

from blockspec.config import SamplingParams
from blockspec.models.checkpoint import load_draft, save_draft
from blockspec.training.calibrate import collect_rollouts, fit_sts, fit_temperature, save_temperatures
from conftest import make_draft, make_target


def test_fit_temperature_recovers_overconfidence():
    gen = torch.Generator().manual_seed(0)
    true_logit = torch.randn(20000, generator=gen) * 2
    outcomes = (torch.rand(20000, generator=gen) < torch.sigmoid(true_logit)).long()
    # The head reports logits 3x too large: the fitted T must be ~3.
    t = fit_temperature((true_logit * 3).tolist(), outcomes.tolist())
    assert abs(t - 3.0) < 0.15


def test_collect_fit_save_roundtrip(tmp_path):
    target = make_target()
    draft = make_draft(target, "deepspec", 3, markov_rank=4, confidence=True)
    rollouts = collect_rollouts(target, draft, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=20))
    assert len(rollouts.logits) == 3 and len(rollouts.logits[0]) == len(rollouts.accepted) > 0
    assert all(len(z) == len(y) for z, y in zip(rollouts.logits, rollouts.outcomes))
    temps = fit_sts(rollouts)
    assert len(temps) == 3 and all(t > 0 for t in temps)
    before = rollouts.prefix_calibration()
    after = rollouts.prefix_calibration(temps)
    assert after["brier"] <= before["brier"] + 1e-9  # fitted on the same rollouts: cannot be worse
    save_draft(draft, tmp_path / "d")
    save_temperatures(tmp_path / "d", temps)
    assert load_draft(tmp_path / "d", target=target).config.confidence_temperatures == temps
