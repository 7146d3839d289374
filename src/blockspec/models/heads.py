"""DSpark heads (docs/design.md section 5): the Markov head that corrects each block
slot's logits with the previously drafted token, and the confidence head
that predicts whether a slot's draft will be accepted."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.models.layers import Linear


class MarkovHead(nn.Module):
    """Low-rank bigram correction `w2(f(w1[prev], h))` added to a slot's logits.

    vanilla: f = w1[prev]; gated: sigmoid(gate_proj([h; w1[prev]])) * w1[prev];
    rnn: a GRU-like state over the slots, f = tanh(output). h is the slot's
    hidden state after the draft's final norm."""

    def __init__(self, vocab: int, hidden: int, rank: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(rank + rank + hidden, 3 * rank)
        nn.init.zeros_(self.markov_w2.weight)  # start as the plain DFlash draft

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(batch, self.rank) if self.kind == "rnn" else None

    def step(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: prev [..], h [.., H] -> (logit bias [.., V], new state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return self.markov_w2(gate * e), state
        # GRU-like (SGLang's port of DeepSpec): chunks are (gate, candidate, output);
        # the bias uses the output computed from the previous state.
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        new_state = g * state + (1 - g) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), new_state

    def add_to(self, base: torch.Tensor, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot's corrected logits: base [B, V] (float) + the bias of `step`.

        Drafting calls this once per slot in a sequential loop, where per-op overhead
        dominates: the vanilla head is then one embedding lookup and one fused addmm."""
        if self.kind == "vanilla" and base.dtype == self.markov_w2.weight.dtype and base.dim() == 2:
            return torch.addmm(base, self.markov_w1(prev), self.markov_w2.weight.t()), state
        bias, state = self.step(prev, h, state)
        return base + bias.float(), state

    def teacher_forced(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """All slots at once given the true previous tokens: prev [B, S], h [B, S, H] -> [B, S, V]."""
        if self.kind != "rnn":
            return self.step(prev, h, None)[0]
        state = self.initial_state(prev.shape[0], h)
        out = []
        for k in range(prev.shape[1]):
            bias, state = self.step(prev[:, k], h[:, k], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k; w1[prev_k]]) / T_k): P(draft k accepted | drafts < k accepted).

    The projection is linear, so its logit is computed by input: `hidden_term(h)` (bias
    included) plus `prev_term(e)` of the Markov embedding e of the previous token. Training
    passes the looked-up embeddings; drafting passes the whole embedding table once and
    then looks up one value per slot. Without the Markov part (rank 0) only h is read."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.proj = nn.Linear(hidden + rank, 1)

    @property
    def reads_prev(self) -> bool:
        """Whether the logit also reads the previous token's Markov embedding."""
        return self.proj.in_features > self.hidden

    def hidden_term(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> the hidden-state part of the logit [...], bias included."""
        return F.linear(h, self.proj.weight[:, :self.hidden], self.proj.bias).squeeze(-1)

    def prev_term(self, prev_embed: torch.Tensor) -> torch.Tensor:
        """Markov embeddings [..., rank] (rows of markov_w1, or the whole table [V, rank])
        -> the previous-token part of the logit [...]."""
        return F.linear(prev_embed, self.proj.weight[:, self.hidden:]).squeeze(-1)

    def logit(self, h: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """The uncalibrated logit [...] of slots h [..., H] whose previous tokens have the
        Markov embeddings prev_embed [..., rank] (None when the head does not read them)."""
        z = self.hidden_term(h)
        return z if prev_embed is None else z + self.prev_term(prev_embed)
