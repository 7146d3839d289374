"""The target's log-probabilities of emitted (and prompt) tokens, as vLLM returns them.

Raw log-probabilities (vLLM's default `--logprobs-mode raw_logprobs`): the log-softmax of
the target's logits before penalties, temperature and top-k / top-p. Each emitted token's
comes from the target's forward that verified it, at the position that predicted it, so
speculation returns the same values as plain AR decoding (lossless), up to the float
rounding of a different batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POSITIONS_PER_CHUNK = 256   # prompt positions whose full-vocabulary log-softmax is held at once


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    rank: int                               # 1 + how many tokens are more likely
    top: tuple[tuple[int, float], ...]      # the n most likely (token, logprob), most likely first


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """In float32 at least (float64 models keep float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def _gather(logp: torch.Tensor, tokens: torch.Tensor, n: int) -> list[TokenLogprob]:
    """logp [T, V] log-probabilities, tokens [T] -> one TokenLogprob per position."""
    chosen = logp.gather(-1, tokens.unsqueeze(-1))                 # [T, 1]
    rank = (logp > chosen).sum(-1) + 1
    top_v, top_i = logp.topk(n, dim=-1) if n else (logp[:, :0], tokens[:, None][:, :0])
    out = []
    for t, lp, rk, vs, ids in zip(tokens.tolist(), chosen[:, 0].tolist(), rank.tolist(), top_v.tolist(),
                                  top_i.tolist()):
        out.append(TokenLogprob(t, lp, rk, tuple(zip(ids, vs))))
    return out


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int], tops: list[int]
                 ) -> list[list[TokenLogprob] | None]:
    """logits [R, W, V] raw, tokens [R, W]: row r's first counts[r] positions' tokens, with
    tops[r] alternatives each (tops[r] < 0: the row asked for none: None)."""
    out: list[list[TokenLogprob] | None] = []
    for r, (count, n) in enumerate(zip(counts, tops)):
        if n < 0:
            out.append(None)
            continue
        logp = log_softmax(logits[r, :count])
        out.append(_gather(logp, tokens[r, :count], n))
    return out


def prompt_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, prompt: list[int], n: int
                    ) -> list[TokenLogprob | None]:
    """Log-probabilities of prompt[1:] from the target's final states hidden [T, H] (the first
    token has none: None, as in vLLM), in chunks of positions so [T, V] is never held."""
    out: list[TokenLogprob | None] = [None]
    ids = torch.tensor(prompt, device=hidden.device)
    for a in range(0, len(prompt) - 1, POSITIONS_PER_CHUNK):
        b = min(a + POSITIONS_PER_CHUNK, len(prompt) - 1)
        logp = log_softmax(lm_head(hidden[a:b]))
        out.extend(_gather(logp, ids[a + 1:b + 1], n))
    return out
