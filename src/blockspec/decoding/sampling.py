"""The one sampling / verification module used by every decoding path.

logits -> warped probabilities (temperature, top-k, top-p) -> sample, and the
three acceptance rules of docs/design.md section 4: greedy prefix match, lossless
rejection sampling (default when temperature > 0) and sample-and-match.

Rows carry their own parameters and their own seeded generator, so a
request's random stream does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.penalties import LogitAdjust


_ARGMAX_CHUNK = 128
_ARGMAX_TWO_LEVEL_MIN = 1 << 16   # below this many logits the extra ops cost more than they save


def argmax_last(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """torch.argmax over the last dim (first maximum on ties), in two levels on CPU:
    the max of each 128-wide chunk (a vectorised reduction, ~5x faster there than
    argmax over vocabulary-sized rows), then argmax over the chunk maxima and within
    the first chunk that holds the maximum (NaN ranks highest in both, as in
    torch.argmax). Plain torch.argmax off the CPU, for widths that are not a
    multiple of the chunk, and for small inputs (one row of logits at batch 1)."""
    v = x.shape[-1]
    if (x.device.type != "cpu" or v % _ARGMAX_CHUNK or not x.dtype.is_floating_point
            or x.numel() < _ARGMAX_TWO_LEVEL_MIN):
        return x.argmax(-1, keepdim=keepdim)
    chunks = x.reshape(-1, v // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(-1).argmax(-1)                                        # [N] first chunk with the max
    within = chunks[torch.arange(chunks.shape[0], device=x.device), best].argmax(-1)
    out = (best * _ARGMAX_CHUNK + within).view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


@dataclass
class RowSampler:
    """Sampling parameters of a batch of rows, as tensors, plus one generator per row."""

    temperature: torch.Tensor  # [R] float, 0 = greedy
    top_k: torch.Tensor        # [R] long, 0 = off
    top_p: torch.Tensor        # [R] float
    generators: list[torch.Generator]
    # Whether every row is greedy, known on the host when built from params: reading it
    # from `temperature` is a device synchronisation, several per round otherwise.
    greedy_rows: bool | None = None
    min_p: torch.Tensor | None = None      # [R] float; None: no row sets one
    adjust: LogitAdjust | None = None      # penalties / logit_bias of the target's logits
    logprobs: list[int] | None = None      # [R] alternatives per emitted token (-1: none); None: no row

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu",
                    generators: list[torch.Generator] | None = None,
                    histories: list[tuple[list[int], list[int]]] | None = None, vocab: int = 0) -> "RowSampler":
        """One row per params; `generators`: the rows' own (a running request keeps
        its generator across rounds), else new ones seeded from `params`. histories[r]
        (prompt, output so far) and the vocabulary size: for the rows' penalties, which
        a penalised row must have."""
        gens = generators if generators is not None else [new_generator(p) for p in params]
        if any(p.penalized for p in params) and histories is None:
            raise ValueError("penalties and logit_bias need each row's (prompt, output) history")
        return cls(
            temperature=torch.tensor([float(p.temperature) for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], device=device),
            generators=gens,
            greedy_rows=all(p.temperature == 0 for p in params),
            min_p=(torch.tensor([float(p.min_p) for p in params], device=device)
                   if any(p.min_p for p in params) else None),
            adjust=LogitAdjust.build(params, histories, vocab, device) if histories is not None else None,
            logprobs=([-1 if p.logprobs is None else p.logprobs for p in params]
                      if any(p.logprobs is not None for p in params) else None),
        )

    def select(self, rows: list[int]) -> "RowSampler":
        idx = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        return RowSampler(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                          [self.generators[r] for r in rows], True if self.greedy_rows else None,
                          None if self.min_p is None else self.min_p[idx],
                          None if self.adjust is None else self.adjust.select(rows),
                          None if self.logprobs is None else [self.logprobs[r] for r in rows])

    def adjusted(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits [R, W, V] after the rows' penalties and logit_bias
        (position j following drafts[:, :j]); unchanged when no row has any."""
        return logits if self.adjust is None else self.adjust.apply(logits, drafts)

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    @property
    def all_greedy(self) -> bool:
        if self.greedy_rows is not None:
            return self.greedy_rows
        return bool(self.greedy.all())

    def uniform(self, shape_per_row: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """[R, *shape] uniforms in [0, 1), each row from its own generator."""
        return torch.stack([torch.rand(shape_per_row, generator=g) for g in self.generators]).to(device)

    def uniform_rows(self, counts: list[int], width: int, device: torch.device) -> torch.Tensor:
        """[R, width] uniforms where row r draws only its first counts[r] (the rest are 0):
        a row consumes its generator for its own positions alone, so its random stream
        does not depend on how far its neighbours verify."""
        out = torch.zeros(len(counts), width)
        for r, (n, g) in enumerate(zip(counts, self.generators)):
            out[r, :n] = torch.rand(n, generator=g)
        return out.to(device)


def new_generator(params: SamplingParams) -> torch.Generator:
    """A request's own generator: seeded when it asks for a seed, else from entropy."""
    g = torch.Generator(device="cpu")
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def warp(logits: torch.Tensor, sampler: RowSampler) -> torch.Tensor:
    """logits [R, ..., V] -> float32 probabilities after temperature, top-k, top-p.

    Greedy rows (temperature 0) become one-hot at the argmax, which makes the
    rejection rule below reduce exactly to greedy prefix matching."""
    r, v = logits.shape[0], logits.shape[-1]
    x = logits.float().reshape(r, -1, v)
    t = sampler.temperature.view(r, 1, 1)
    greedy = (t == 0)
    x = x / torch.where(greedy, torch.ones_like(t), t)
    if sampler.min_p is not None:   # after temperature, before top-k / top-p (vLLM's order)
        probs = torch.softmax(x, dim=-1)
        floor = sampler.min_p.view(r, 1, 1) * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    k = sampler.top_k.view(r, 1, 1)
    if bool((k > 0).any()):
        kth = torch.topk(x, min(int(k.max()), v), dim=-1).values
        idx = (k.clamp(1, v) - 1).clamp(max=kth.shape[-1] - 1).expand(r, x.shape[1], 1)
        threshold = kth.gather(-1, idx)
        x = torch.where((k > 0) & (x < threshold), torch.full_like(x, float("-inf")), x)
    p = sampler.top_p.view(r, 1, 1)
    if bool((p < 1).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = (before >= p) & (p < 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, argmax_last(logits.float().reshape(r, -1, v), keepdim=True), 1.0)
        probs = torch.where(greedy, onehot, probs)
    return probs.reshape(logits.shape[:-1] + (v,))


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V], uniforms [...] -> token ids [...]."""
    cdf = probs.cumsum(-1)
    u = (uniforms * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, sampler: RowSampler) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, T, V] -> (tokens [R, T], probs [R, T, V]). Greedy rows take the argmax."""
    probs = warp(logits, sampler)
    if sampler.all_greedy:
        return argmax_last(logits), probs
    u = sampler.uniform(tuple(logits.shape[1:-1]), logits.device)
    tokens = sample_from(probs, u)
    tokens = torch.where(sampler.greedy.view(-1, *([1] * (tokens.dim() - 1))), argmax_last(logits), tokens)
    return tokens, probs


@dataclass
class Verdict:
    accepted: torch.Tensor  # [R] number of drafts accepted
    bonus: torch.Tensor     # [R] the token sampled after the accepted prefix
    logprobs: list | None = None   # [R] the committed tokens' TokenLogprobs (None for rows that asked none)
    # A tree's accepted path [R, D+1]: its nodes in the verify sequence [anchor, drafts], the
    # anchor first (entries past accepted + 1 are 0). None: a chain, whose path is its prefix.
    path: torch.Tensor | None = None


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           sampler: RowSampler, num_drafts: torch.Tensor | None = None,
           rule: str = "rejection") -> Verdict:
    """Decide how many drafts each row keeps (docs/design.md section 4).

    target_logits [R, g+1, V]: next-token rows for [anchor, d1..dg];
    drafts [R, g]; draft_probs [R, g, V]: the exact (warped) proposal
    distributions, needed for rejection sampling; num_drafts [R]: how many
    drafts each row actually verifies (<= g; the rest count as not proposed).
    rule: "rejection" (lossless, default) or "match" (sample-and-match).
    """
    r, g = drafts.shape
    device = drafts.device
    slot = torch.arange(g, device=device)
    if num_drafts is None:
        num_drafts = torch.full((r,), g, dtype=torch.long, device=device)
    proposed = slot.unsqueeze(0) < num_drafts.unsqueeze(1)  # [R, g]

    if sampler.all_greedy:
        choice = argmax_last(target_logits)  # [R, g+1]
        ok = (drafts == choice[:, :g]) & proposed
        accepted = ok.long().cumprod(1).sum(1)
        return Verdict(accepted, choice.gather(1, accepted.unsqueeze(1)).squeeze(1))

    p = warp(target_logits, sampler)  # [R, g+1, V]
    if g == 0:  # plain AR step: nothing to accept, sample from P_0
        u = sampler.uniform((1,), device)
        return Verdict(torch.zeros(r, dtype=torch.long, device=device), sample_from(p[:, 0], u[:, 0]))
    # Row r draws num_drafts[r] + 1 uniforms: its verified slots and its bonus.
    u = sampler.uniform_rows((num_drafts + 1).tolist(), g + 1, device)
    own_last = num_drafts.unsqueeze(1)
    if rule == "match":
        target_tokens = sample_from(p, u)  # independent target samples t_1..t_{g+1}
        ok = (drafts == target_tokens[:, :g]) & proposed
        accepted = ok.long().cumprod(1).sum(1)
        return Verdict(accepted, target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1))
    if rule != "rejection":
        raise ValueError(f"unknown verification rule {rule!r}")
    if draft_probs is None:
        raise ValueError("rejection sampling needs the draft's proposal probabilities")
    p_d = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)            # P_{i-1}(d_i)
    q_d = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1).float()  # Q_i(d_i)
    ok = (u[:, :g] * q_d < p_d) & proposed  # u < P/Q without dividing by zero
    accepted = ok.long().cumprod(1).sum(1)
    # Bonus: residual max(0, P - Q) after a rejection of a proposed draft, else P itself.
    rows = torch.arange(r, device=device)
    p_a = p[rows, accepted]
    rejected = accepted < num_drafts
    q_a = draft_probs[rows, accepted.clamp(max=g - 1)].float()
    residual = (p_a - q_a).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    use_residual = rejected.unsqueeze(1) & (mass > 0)
    bonus_dist = torch.where(use_residual, residual / mass.clamp(min=1e-30), p_a)
    bonus = sample_from(bonus_dist, u.gather(1, own_last).squeeze(1))
    return Verdict(accepted, bonus)


def verify_tree(target_logits: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                sampler: RowSampler) -> Verdict:
    """The acceptance rule over a draft tree (docs/design.md section 3.1, "Tree drafting").

    target_logits [R, n+1, V]: next-token rows of [anchor, d_1..d_n]; drafts [R, n]: chosen
    by the draft alone (top-k, no sampling: a point mass each); parents [R, n]: each draft's
    parent node (0: the anchor, j: d_j; parents come first); depths [R, n]. Greedy: a draft
    is accepted when its parent is and it is the target's argmax after its parent, so the
    accepted drafts lie on one path (siblings are distinct tokens; were two equal, the first
    deepest node's path is taken), and the bonus is the argmax after its last node.
    Sampling: `_sampled_tree_verdict`. Returns the path's length (`accepted`), the bonus and
    the path's nodes."""
    if not sampler.all_greedy:
        return _sampled_tree_verdict(warp(target_logits, sampler), drafts, parents, depths, sampler)
    rows, n = drafts.shape
    choice = argmax_last(target_logits)                                        # [R, n+1]
    match = drafts == choice.gather(1, parents)
    depth = int(depths.max()) if n else 0
    ok = torch.ones(rows, n + 1, dtype=torch.bool, device=drafts.device)       # node 0, the anchor, always
    for _ in range(depth):   # one more level of the path settles per pass
        ok = torch.cat([ok[:, :1], match & ok.gather(1, parents)], dim=1)
    node_depth = torch.cat([torch.zeros_like(depths[:, :1]), depths], dim=1)
    reached = torch.where(ok, node_depth, -1)
    accepted, node = reached.max(dim=1, keepdim=True)                          # the first deepest accepted node
    up = torch.cat([torch.zeros_like(parents[:, :1]), parents], dim=1)
    path = torch.zeros(rows, depth + 1, dtype=torch.long, device=drafts.device)
    for _ in range(depth):   # from the deepest node up to the anchor, each at its depth
        path.scatter_(1, node_depth.gather(1, node), node)
        node = up.gather(1, node)
    bonus = choice.gather(1, path.gather(1, accepted)).squeeze(1)
    return Verdict(accepted.squeeze(1), bonus, path=path)


def _sampled_tree_verdict(p: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                          sampler: RowSampler) -> Verdict:
    """Recursive rejection sampling over siblings with point-mass proposals (the rule EAGLE
    samples its trees with; docs/design.md section 3.1). From the anchor, with r the target's
    warped distribution p at the current node: try its children in drafting order, accepting
    child x with probability r(x); on a rejection, r = r without x, renormalised (the residual
    max(0, r - q) of a proposal q that is a point mass at x), and the next sibling is tried;
    on an acceptance, descend into x with r = p at x. Where no child is accepted (or there is
    none) the bonus is drawn from r. Each step reproduces r exactly (accept x with r(x), else
    draw from r without x), so the emitted tokens follow the target: lossless, because the
    drafts depend on the draft alone. A greedy row's p is one-hot: the greedy rule.
    Row r draws n + 1 uniforms from its own generator: node j's coin (u[:, j]), the bonus (u[:, 0])."""
    rows, n = drafts.shape
    device = drafts.device
    u = sampler.uniform((n + 1,), device)
    same = parents.unsqueeze(2) == parents.unsqueeze(1)
    rank = (same & torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)).sum(-1)   # among its siblings
    siblings = int(rank.max()) + 1 if n else 0
    depth = int(depths.max()) if n else 0
    index = torch.arange(rows, device=device)
    node = torch.zeros(rows, dtype=torch.long, device=device)                 # the path's last node
    residual = p[:, 0].clone()
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    path = torch.zeros(rows, depth + 1, dtype=torch.long, device=device)
    for level in range(1, depth + 1):
        moved = torch.zeros(rows, dtype=torch.bool, device=device)
        for s in range(siblings):
            is_child = (parents == node.unsqueeze(1)) & (rank == s)
            tried = is_child.any(1) & alive & ~moved
            child = is_child.to(torch.uint8).argmax(1)                         # a draft index (valid where tried)
            tok = drafts[index, child]
            take = tried & (u[index, child + 1] < residual[index, tok])
            dropped = residual.scatter(1, tok.unsqueeze(1), 0.0)
            dropped = dropped / dropped.sum(-1, keepdim=True).clamp(min=1e-30)
            residual = torch.where((tried & ~take).unsqueeze(1), dropped, residual)
            residual = torch.where(take.unsqueeze(1), p[index, child + 1], residual)
            node = torch.where(take, child + 1, node)
            moved |= take
        alive &= moved
        path[:, level] = torch.where(alive, node, 0)
    accepted = (path[:, 1:] > 0).long().sum(1)
    return Verdict(accepted, sample_from(residual, u[:, 0]), path=path)
