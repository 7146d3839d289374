"""Slot-wise temperature scaling (STS) of the DSpark confidence head (design section 5).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.acceptance import calibration, prefix_outcomes
from blockspec.decoding.sampling import RowSampler
from blockspec.decoding.speculate import prefill, propose, verify_and_commit
from blockspec.errors import BlockspecError
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


@torch.inference_mode()
def collect_rollouts(target: TargetModel, draft: DraftModel, prompts: list[list[int]],
                     params: SamplingParams) -> Rollouts:
    """Run full-window speculative decoding and record every round's confidences and outcome."""
    if draft.confidence_head is None:
        raise BlockspecError("calibration needs a draft with a confidence head")
    saved, draft.config.confidence_temperatures = draft.config.confidence_temperatures, None
    g = draft.config.num_drafts
    out = Rollouts([[] for _ in range(g)], [[] for _ in range(g)])
    try:
        for prompt in prompts:
            sampler = RowSampler.from_params([params])
            capacity = len(prompt) + params.max_new_tokens + 2 * draft.config.block_size + 2
            cache, dcache = target.new_cache(1, capacity), draft.new_cache(1, capacity + draft.config.block_size)
            anchors = prefill(target, cache, [prompt], sampler, draft, dcache)
            produced = 1
            while produced < params.max_new_tokens:
                proposal = propose(draft, target, dcache, anchors, sampler)
                conf = proposal.confidence[0].double().clamp(1e-12, 1 - 1e-12)
                verdict = verify_and_commit(target, cache, anchors, proposal, sampler, draft, dcache)
                a = int(verdict.accepted[0])
                for k in range(min(a + 1, g)):  # slot k was reached: all before it accepted
                    out.logits[k].append(float(torch.log(conf[k] / (1 - conf[k]))))
                    out.outcomes[k].append(int(a > k))
                out.round_logits.append(torch.log(conf / (1 - conf)).tolist())
                out.accepted.append(a)
                produced += a + 1
                anchors = verdict.bonus
    finally:
        draft.config.confidence_temperatures = saved
    return out


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
