"""Penalties and logit_bias on the target's logits, before any verification rule sees them.

Speculation stays exact because only the target's distribution changes: a draft proposes
as usual, and position j of a verified block [anchor, d1..dg] is penalised as if
d1..dj had already been emitted (they have, if they are accepted). The order is vLLM's:
logit_bias, then the repetition penalty (tokens of the prompt or the output: a positive
logit is divided by it, a negative one multiplied), then the frequency penalty (times each
output token's count) and the presence penalty (once per output token seen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import SamplingParams


@dataclass
class LogitAdjust:
    """The penalised rows of a batch: their settings and their token histories as [n, V]."""

    rows: torch.Tensor         # [n] batch rows that have a penalty or a bias
    presence: torch.Tensor     # [n, 1, 1]
    frequency: torch.Tensor    # [n, 1, 1]
    repetition: torch.Tensor   # [n, 1, 1]
    counts: torch.Tensor       # [n, V] how often each token is in the row's output so far
    prompt_seen: torch.Tensor  # [n, V] bool: the token is in the prompt
    bias: torch.Tensor         # [n, V]

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[tuple[list[int], list[int]]], vocab: int,
              device: torch.device | str) -> "LogitAdjust | None":
        """histories[r]: (prompt, output tokens so far) of row r; None when no row is penalised."""
        rows = [r for r, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        n = len(rows)
        counts = torch.zeros(n, vocab, device=device)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        bias = torch.zeros(n, vocab, device=device)
        for i, r in enumerate(rows):
            prompt, output = histories[r]
            if output:
                counts[i] = torch.bincount(torch.tensor(output, device=device), minlength=vocab)[:vocab].float()
            if prompt and params[r].repetition_penalty != 1:
                seen[i, torch.tensor(prompt, device=device)] = True
            for token, value in params[r].logit_bias.items():
                bias[i, token] = float(value)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(params[r], name)) for r in rows], device=device).view(n, 1, 1)
        return cls(torch.tensor(rows, device=device), column("presence_penalty"), column("frequency_penalty"),
                   column("repetition_penalty"), counts, seen, bias)

    def select(self, keep: list[int]) -> "LogitAdjust | None":
        """The adjustment of batch rows `keep` (renumbered 0..len(keep)-1)."""
        where = {int(r): i for i, r in enumerate(self.rows.tolist())}
        pairs = [(new, where[old]) for new, old in enumerate(keep) if old in where]
        if not pairs:
            return None
        idx = torch.tensor([i for _, i in pairs], device=self.rows.device)
        return LogitAdjust(torch.tensor([new for new, _ in pairs], device=self.rows.device),
                           self.presence[idx], self.frequency[idx], self.repetition[idx], self.counts[idx],
                           self.prompt_seen[idx], self.bias[idx])

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, W, V] (position j follows the row's output and drafts[:, :j]) -> a new
        tensor with the penalised rows changed; drafts [R, >= W - 1] or None (W == 1)."""
        rows = self.rows
        x = logits[rows].to(torch.promote_types(logits.dtype, torch.float32))   # [n, W, V]
        counts = self.counts.unsqueeze(1).expand(-1, x.shape[1], -1)
        if x.shape[1] > 1:
            assert drafts is not None
            counts = counts.clone()
            mine = drafts[rows]
            for j in range(1, x.shape[1]):   # position j has also emitted d_1..d_j
                counts[:, j:].scatter_add_(-1, mine[:, j - 1].view(-1, 1, 1).expand(-1, x.shape[1] - j, 1),
                                           torch.ones(len(rows), x.shape[1] - j, 1, device=x.device))
        x = x + self.bias.unsqueeze(1)
        seen = (counts > 0) | self.prompt_seen.unsqueeze(1)
        penalised = torch.where(x > 0, x / self.repetition, x * self.repetition)
        x = torch.where(seen, penalised, x)
        x = x - self.frequency * counts - self.presence * (counts > 0).to(x.dtype)
        out = logits.clone()
        out[rows] = x.to(logits.dtype)
        return out
