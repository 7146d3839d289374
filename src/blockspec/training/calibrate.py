"""Slot-wise temperature scaling (STS) of the DSpark confidence head (docs/design.md section 5).

Raw confidences are over-confident. On held-out rollouts we record, for every
verified draft slot k whose predecessors were all accepted, the head's raw
logit z_k and whether d_k was accepted; then fit one temperature T_k per slot
minimising the BCE of sigmoid(z_k / T_k). The temperatures are stored in the
draft's config (`confidence_temperatures`) and in `sts_temperatures.json`
beside it, the file other engines read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.generate import RoundRecorder
from blockspec.decoding.generate import GenerateOptions, generate
from blockspec.decoding.policy import PolicyOptions
from blockspec.errors import BlockspecError
from blockspec.metrics import calibration, prefix_outcomes
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel


@dataclass
class Rollouts:
    """Per slot k: raw confidence logits and acceptance outcomes, given slots < k accepted."""

    logits: list[list[float]] = field(default_factory=list)
    outcomes: list[list[int]] = field(default_factory=list)
    # Per round: every slot's raw logit and the number accepted, for prefix calibration.
    round_logits: list[list[float]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def prefix_calibration(self, temperatures: list[float] | None = None) -> dict:
        """ECE / Brier / AUROC of survival s_k = prod c_j against actual prefix acceptance."""
        preds, outcomes = [], []
        for z, a in zip(self.round_logits, self.accepted):
            t = torch.tensor(temperatures or [1.0] * len(z), dtype=torch.float64)
            surv = torch.cumprod(torch.sigmoid(torch.tensor(z, dtype=torch.float64) / t), 0).tolist()
            preds += surv
            outcomes += prefix_outcomes(a, len(z))
        return calibration(preds, outcomes)


def collect_rollouts(target: TargetModel, draft: DraftModel, prompts: list[list[int]],
                     params: SamplingParams) -> Rollouts:
    """Full-window speculative decoding of `prompts` (`generate`, which stops at EOS or
    max_new_tokens) with the draft's raw confidences; every round's logits and outcome recorded."""
    if draft.confidence_head is None:
        raise BlockspecError("calibration needs a draft with a confidence head")
    draft = draft.with_config(replace(draft.config, confidence_temperatures=None))  # raw confidences
    recorder = RoundRecorder()
    generate(target, prompts, params, draft=draft, method="dspark", policy=PolicyOptions(adapt=False),
             options=GenerateOptions(observer=recorder))
    g = draft.config.num_drafts
    out = Rollouts([[] for _ in range(g)], [[] for _ in range(g)])
    for r in sorted(recorder.records, key=lambda r: r.request):   # prompt by prompt, rounds in order
        z = [_logit(c) for c in r.confidences[:r.verified]]
        for k in range(min(r.accepted + 1, r.verified)):  # slot k was reached: all before it accepted
            out.logits[k].append(z[k])
            out.outcomes[k].append(int(r.accepted > k))
        out.round_logits.append(z)
        out.accepted.append(r.accepted)
    return out


def _logit(confidence: float) -> float:
    c = min(max(confidence, 1e-12), 1 - 1e-12)
    return math.log(c / (1 - c))


def bce(logits: torch.Tensor, outcomes: torch.Tensor, temperature: float) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits / temperature, outcomes))


def fit_temperature(logits: list[float], outcomes: list[int]) -> float:
    """The T > 0 minimising BCE(sigmoid(z / T), y): golden-section search on log T."""
    if len(logits) < 2 or len(set(outcomes)) < 2:
        return 1.0  # not enough evidence to move away from the raw head
    z = torch.tensor(logits, dtype=torch.float64)
    y = torch.tensor(outcomes, dtype=torch.float64)
    lo, hi = math.log(0.05), math.log(20.0)
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa, fb = bce(z, y, math.exp(a)), bce(z, y, math.exp(b))
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = bce(z, y, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = bce(z, y, math.exp(b))
    return math.exp((lo + hi) / 2)


def fit_sts(rollouts: Rollouts) -> list[float]:
    return [round(fit_temperature(z, y), 6) for z, y in zip(rollouts.logits, rollouts.outcomes)]


def save_temperatures(directory: Path, temperatures: list[float]) -> None:
    """Write the temperatures into the draft's config.json and sts_temperatures.json."""
    cfg_path = Path(directory) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["confidence_temperatures"] = temperatures
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (Path(directory) / "sts_temperatures.json").write_text(json.dumps({"sts_temperatures": temperatures}) + "\n")
