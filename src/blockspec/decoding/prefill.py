"""Prefill (docs/design.md section 4): the prompts run through the target in groups of
similar length, each row's first token (the first anchor) is sampled, and the prompts'
target features seed the draft context (or wait in a `PendingContext` until a row first
drafts). The speculative round (decoding/round.py) continues from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.decoding.context import PendingContext, append_to_draft
from blockspec.decoding.logprobs import TokenLogprob, prompt_logprobs, row_logprobs
from blockspec.decoding.sampling import RowSampler, sample
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel

__all__ = ["ContextSink", "Prefilled", "first_logprobs", "next_tokens", "padding_groups", "prefill"]


def padding_groups(lengths: list[int], max_padding: float = 0.25) -> list[tuple[int, int]]:
    """Contiguous row ranges [a, b) whose right-padded size stays within
    (1 + max_padding) x their real tokens: a padded batch of very different prompt
    lengths costs more than separate forwards (32 HumanEval prompts: 1.21 s padded,
    0.66 s grouped; benchmarks/prefill.py)."""
    groups, start, longest, total = [], 0, 0, 0
    for i, n in enumerate(lengths):
        if i > start and max(longest, n) * (i - start + 1) > (1 + max_padding) * (total + n):
            groups.append((start, i))
            start, longest, total = i, 0, 0
        longest, total = max(longest, n), total + n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


@dataclass
class Prefilled:
    """What a prefill produced per row: the first anchors [R], their log-probabilities
    (rows that asked: sampler.logprobs) and the prompts' (rows with prompt_tops[r] >= 0)."""

    anchors: torch.Tensor
    logprobs: list[list[TokenLogprob] | None] | None = None
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None


def prefill(target: TargetModel, cache: KVCache, prompts: list[list[int]], sampler: RowSampler,
            sink: ContextSink | None = None, prompt_tops: list[int] | None = None) -> Prefilled:
    """Run the prompts through the target (right-padded, in groups of similar length:
    `padding_groups`), hand their features to `sink` (the draft context, now or when
    their rows first draft), and sample each row's first token (the first anchor; every
    row draws from its own generator, so grouping changes no draw). prompt_tops[r] >= 0:
    also the log-probabilities of row r's prompt tokens. No sink: a target alone."""
    groups = padding_groups([len(p) for p in prompts])
    tops = prompt_tops if prompt_tops is not None else [-1] * len(prompts)
    sink = sink if sink is not None else ContextSink()
    if len(groups) == 1:
        return _prefill_rows(target, cache, prompts, sampler, sink, tops)
    parts = [_prefill_rows(target, cache.slice_rows(a, b), prompts[a:b], sampler.select(list(range(a, b))),
                           sink.rows(a, b), tops[a:b])
             for a, b in groups]

    def joined(name: str) -> list | None:
        lists = [getattr(p, name) or [None] * (b - a) for p, (a, b) in zip(parts, groups)]
        return None if all(getattr(p, name) is None for p in parts) else [x for part in lists for x in part]
    return Prefilled(torch.cat([p.anchors for p in parts]), joined("logprobs"), joined("prompt_logprobs"))


@dataclass(frozen=True)
class ContextSink:
    """Where prefilled rows' features go: the draft context (`draft_cache`, rows from 0)
    or, with `pending`, that PendingContext's rows first_row, first_row + 1, ... (they
    wait there until the rows first draft: `PendingContext.seed`). No draft: nowhere."""

    draft: AnyDraft | None = None
    draft_cache: KVCache | None = None
    pending: PendingContext | None = None
    first_row: int = 0

    def rows(self, start: int, stop: int) -> ContextSink:
        """This sink for rows start..stop-1 of the prompts."""
        cache = self.draft_cache.slice_rows(start, stop) if self.draft_cache is not None else None
        return ContextSink(self.draft, cache, self.pending, self.first_row + start)

    def take(self, features: torch.Tensor, lengths: torch.Tensor, after: torch.Tensor | None) -> None:
        """Row r's first lengths[r] features (after [R, T]: the token after each, EAGLE-3)."""
        assert self.draft is not None and self.draft_cache is not None
        if self.pending is not None:
            self.pending.seed(self.first_row, features, lengths, after)
        else:
            append_to_draft(self.draft, self.draft_cache, features, lengths, after)


def _prefill_rows(target: TargetModel, cache: KVCache, prompts: list[list[int]], sampler: RowSampler,
                  sink: ContextSink, prompt_tops: list[int]) -> Prefilled:
    draft = sink.draft
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, device=device)
    capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
    scored = None
    if any(n >= 0 for n in prompt_tops):   # every position's states, for the prompt's log-probabilities
        out = target(ids, cache, num_new=lengths, capture=capture, output="hidden")
        hidden = out.hidden
        last = (lengths - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        logits = target.lm_head(hidden.gather(1, last))
        scored = [prompt_logprobs(hidden[r, :len(p)], target.lm_head, p, n) if n >= 0 else None
                  for r, (p, n) in enumerate(zip(prompts, prompt_tops))]
    else:
        out = target(ids, cache, num_new=lengths, capture=capture, logits_at=(lengths - 1).unsqueeze(1))
        logits = out.logits
    anchors = sample(sampler.adjusted(logits), sampler)[0][:, 0]
    if draft is not None:
        assert out.features is not None   # EAGLE-3 pairs each position with the token after it
        sink.take(out.features, lengths,
                  next_tokens(ids, lengths, anchors) if isinstance(draft, Eagle3Drafter) else None)
    return Prefilled(anchors, first_logprobs(logits, anchors, sampler), scored)


def next_tokens(seq: torch.Tensor, counts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The token committed after each of a row's first counts[r] positions: seq [R, W] holds
    the tokens at the positions, last [R] the one after row r's final position. [R, W]
    (past a row's count: zeros, never read)."""
    out = torch.cat([seq[:, 1:], seq.new_zeros(seq.shape[0], 1)], dim=1)
    out.scatter_(1, (counts - 1).clamp(min=0).unsqueeze(1), last.unsqueeze(1))
    return out


def first_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampler: RowSampler
                   ) -> list[list[TokenLogprob] | None] | None:
    """Log-probabilities of the first tokens [R] sampled from logits [R, 1, V] (raw)."""
    if sampler.logprobs is None:
        return None
    return row_logprobs(logits, tokens.view(-1, 1), [1] * tokens.shape[0], sampler.logprobs)
