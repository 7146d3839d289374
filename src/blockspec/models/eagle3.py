"""The EAGLE-3 draft (docs/design.md section 3.1): one decoder layer over the token
embedding and a fused projection of three target layers, drafting one token per forward.

Position t of the draft reads [input_layernorm(embed(x_{t+1})) ; hidden_norm(h_t)] (2H wide
into q/k/v) with h_t = fc(target features at t) and predicts x_{t+2}; its residual is h_t
(hidden_norm's output with `norm_before_residual`). A chained step feeds back the layer's
own output before the final norm as the next h. Logits cover the draft vocabulary; token
i of it is target token i + d2t[i] (`t2d` marks the target tokens it holds).

Cache: committed positions hold K/V computed from the target's features (`append`); the
chained steps of a round write K/V in the slots after them and leave the row length alone,
so the next `append` (the verified positions' true features) overwrites them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from blockspec.config import Eagle3Config, EagleTree
from blockspec.models.attention import ALL_KEYS, append_mask, limit_mask, tree_mask
from blockspec.models.kv_cache import KVCache
from blockspec.models.layers import (Attention, AttentionShape, CacheAccess, Linear, RMSNorm, RotaryEmbedding,
                                     SwiGLU)

# (logits over the full vocabulary [R, 1, V]) -> (tokens [R, 1], the distributions they were
# drawn from [R, 1, V], or None for greedy): how `chain` picks each drafted token.
Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (HF names, `midlayer.*` in the files)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)      # normalises the embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)          # normalises fc's output / the fed-back state
        # q/k/v read [embedding ; hidden] (2H); the attention output is H wide.
        self.self_attn = Attention(AttentionShape(2 * h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                                  qk_norm=False, eps=cfg.rms_norm_eps))
        self.self_attn.o_proj = Linear(cfg.num_attention_heads * cfg.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [.., 2H], residual [.., H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output -> the layer's output (before the final norm)."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """Draft weights, the vocabulary maps (buffers `d2t`, `t2d`) and a RoPE table. The
    embedding is the target's (passed to each call) unless the draft has its own
    (`own_embedding`: a checkpoint that ships `embed_tokens`)."""

    def __init__(self, cfg: Eagle3Config, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        # Until set_vocabulary: draft token i is target token i.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- vocabulary ------------------------------------------------------------------
    @torch.no_grad()
    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: target_ids [draft_vocab_size], distinct, ascending."""
        ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def vocabulary(self) -> torch.Tensor:
        """Target id of each draft token [draft_vocab_size] (what vLLM and SGLang build from d2t)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer outputs [.., H] -> float logits over the draft vocabulary [.., Vd]."""
        return self.lm_head(self.norm(hidden)).float()

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[.., Vd] -> [.., V]: -inf on target tokens outside the draft vocabulary."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.vocabulary] = draft_logits
        return out

    # -- one forward over cached positions -------------------------------------------
    def new_cache(self, rows: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(1, rows, cfg.num_key_value_heads, cfg.head_dim, capacity, self.dtype, self.fc.weight.device)

    def embed(self, tokens: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        return (embed if self.embed_tokens is None else self.embed_tokens)(tokens).to(self.dtype)

    def _cached(self, tokens: torch.Tensor, hidden: torch.Tensor, embed: nn.Embedding, cache: KVCache,
                slots: torch.Tensor, upto: int, mask, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The layer over tokens [B, T] with hidden [B, T, H], K/V written at slots [B, T] and
        rotated at positions (default: the slots; a tree's nodes sit at their depth)."""
        layer = self.midlayer
        x, residual = layer.inputs(self.embed(tokens, embed), hidden)
        cos, sin = self.rotary(slots if positions is None else positions, x.dtype)
        return layer.finish(layer.self_attn(x, cos, sin, mask, CacheAccess(cache, slots, upto)), residual)

    def append(self, cache: KVCache, features: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor | int,
               embed: nn.Embedding) -> torch.Tensor:
        """Commit positions: features [B, n, 3*Ht] of the next n positions of every row, each
        paired with the token after it, tokens [B, n]; rows advance by num_new (right padding
        beyond). Returns the layer outputs [B, n, H]."""
        n = features.shape[1]
        upto = cache.check_room(n) + n
        slots = cache.positions(n)
        mask = append_mask(cache.lengths, n, upto, fresh=upto == n)
        out = self._cached(tokens, self.fc(features.to(self.dtype)), embed, cache, slots, upto, mask)
        cache.advance(num_new)
        return out

    def step(self, cache: KVCache, tokens: torch.Tensor, hidden: torch.Tensor, offset: int,
             embed: nn.Embedding) -> torch.Tensor:
        """One chained step per row: tokens [B] with fed-back hidden [B, H] at slot
        length + offset, seeing every slot up to it. Row lengths do not change."""
        upto = cache.check_room(offset + 1) + offset + 1
        slots = cache.positions(offset + 1)[:, offset:]
        mask = ALL_KEYS if cache.rows == 1 else limit_mask(cache.lengths + offset + 1, 1, upto, causal=False)
        return self._cached(tokens.unsqueeze(1), hidden.unsqueeze(1), embed, cache, slots, upto, mask)[:, 0]

    @torch.no_grad()
    def chain(self, cache: KVCache, features: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor,
              k: int, embed: nn.Embedding, pick: Pick | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain drafting of k tokens: commit the new positions (`append`; the last one holds
        the anchor, the token the target has not run yet), then draft from each row's last
        committed position, feeding back the draft's own state k - 1 times.

        pick: (logits over the full vocabulary [R, 1, V]) -> (tokens [R, 1], the distributions
        drawn from [R, 1, V] or None); None: greedy. Returns (drafts [R, k], their distributions
        [R, k, V] mapped to the full vocabulary, or None when `pick` returns none)."""
        out = self.append(cache, features, tokens, num_new, embed)
        rows = torch.arange(out.shape[0], device=out.device)
        last = torch.as_tensor(num_new, device=out.device).expand(out.shape[0]) - 1
        return self.chain_from(cache, out[rows, last], k, embed, pick)

    @torch.no_grad()
    def chain_from(self, cache: KVCache, hidden: torch.Tensor, k: int, embed: nn.Embedding, pick: Pick | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`chain`'s drafting from each row's last committed output hidden [R, H]: k drafts
        (the chained steps write K/V after the rows' lengths, which stay unchanged)."""
        drafts, dists = [], []
        for i in range(k):
            logits = self.draft_logits(hidden)
            if pick is None:
                tok, dist = self.vocabulary[logits.argmax(-1)].unsqueeze(1), None
            else:
                tok, dist = pick(self.target_logits(logits).unsqueeze(1))
            drafts.append(tok)
            if dist is not None:
                dists.append(dist)
            if i + 1 < k:
                hidden = self.step(cache, tok[:, 0], hidden, i, embed)
        return torch.cat(drafts, 1), torch.cat(dists, 1) if dists else None

    @torch.no_grad()
    def tree_from(self, cache: KVCache, hidden: torch.Tensor, tree: EagleTree, embed: nn.Embedding
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's draft tree (`EagleTree`; top-k, no sampling) from each row's last committed output
        hidden [R, H]: level 1 is the topk most likely tokens; each later level runs the
        previous level's topk nodes as one step (each at position length + depth - 1, seeing
        the committed slots, its ancestors and itself) and scores their topk children by
        path log-probability, keeping the topk best as the next level. Of all nodes drafted,
        the num_draft_tokens - 1 best-scored are returned in drafting order (a node after
        its parent: a parent scores at least as high and wins ties by coming first).

        Returns (tokens [R, n], parents [R, n]: each node's parent as an index into [anchor,
        nodes] (0: the anchor), depths [R, n] (1: the anchor's children)). Like the chain's
        steps, the levels' K/V sit after the rows' lengths, which stay unchanged."""
        k, rows = tree.topk, hidden.shape[0]
        device = hidden.device
        logp = torch.log_softmax(self.draft_logits(hidden), -1)
        score, ids = logp.topk(k, -1)                                         # [R, k]
        tokens, scores, parents = [self.vocabulary[ids]], [score], [torch.full_like(ids, -1)]
        frontier = torch.arange(k, device=device).expand(rows, k)           # candidate index of each level node
        level_tokens, level_hidden = tokens[0], hidden.unsqueeze(1).expand(rows, k, hidden.shape[-1])
        sees = torch.eye(k, dtype=torch.bool, device=device).expand(rows, k, k)   # [R, k, slots so far]
        for step in range(1, tree.num_steps):
            out = self._tree_level(cache, level_tokens, level_hidden, step, sees, embed)
            logp = torch.log_softmax(self.draft_logits(out), -1)            # [R, k, Vd]
            child_logp, child_ids = logp.topk(k, -1)                        # [R, k, k]
            child_score = (score.unsqueeze(-1) + child_logp).flatten(1)     # [R, k*k]
            first = sum(t.shape[1] for t in tokens)                         # candidate index of the first child
            tokens.append(self.vocabulary[child_ids].flatten(1))
            scores.append(child_score)
            parents.append(frontier.repeat_interleave(k, dim=1))
            if step + 1 == tree.num_steps:
                break
            score, best = child_score.topk(k, -1)                            # the next level: [R, k]
            parent = best // k                                              # which level node it extends
            frontier = first + best
            level_tokens = tokens[-1].gather(1, best)
            level_hidden = out.gather(1, parent.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
            grown = torch.eye(k, dtype=torch.bool, device=device).expand(rows, k, k)
            sees = torch.cat([sees.gather(1, parent.unsqueeze(-1).expand(-1, -1, sees.shape[-1])), grown], -1)
        depths = torch.cat([torch.full_like(t, d + 1) for d, t in enumerate(tokens)], 1)
        return _best_nodes(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), depths,
                           tree.num_draft_tokens - 1)

    def _tree_level(self, cache: KVCache, tokens: torch.Tensor, hidden: torch.Tensor, step: int, sees: torch.Tensor,
                    embed: nn.Embedding) -> torch.Tensor:
        """One tree level: tokens [R, k] with their parents' outputs hidden [R, k, H], at depth
        `step` (position length + step - 1), K/V in slots length + (step - 1) * k + j; sees
        [R, k, step * k]: which of the tree's slots so far each node attends to (its
        ancestors and itself). Returns the nodes' outputs [R, k, H]."""
        rows, k = tokens.shape
        width = step * k
        upto = cache.check_room(width) + width
        lengths = cache.lengths
        slots = cache.positions(width)[:, width - k:]
        positions = (lengths + step - 1).unsqueeze(1).expand(rows, k)
        return self._cached(tokens, hidden, embed, cache, slots, upto, tree_mask(lengths, sees, upto), positions)

    # -- training: the unrolled training-time test -----------------------------------
    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, embed: nn.Embedding, checkpoint_steps: bool = False) -> list[torch.Tensor]:
        """EAGLE-3's training-time test over whole sequences: S = tokens.shape[1] steps.

        features [B, T, 3*Ht]; tokens [B, S, T]: step s at position t reads x_{t+1+s};
        positions [B, T] (RoPE; step s rotates at position + s, where inference runs it);
        mask [B, 1, T, T]: which positions a position sees at step 0 (causal, own sequence).
        Step s > 0 feeds back step s-1's output at the same position, and its queries see
        step 0's keys under `mask` plus the keys of steps 1..s at their own position only:
        exactly the keys the s-th chained step of inference sees. `checkpoint_steps`: keep
        only each step's inputs and recompute the step in backward (its [T, T] attention
        probabilities are the largest activations). Returns the S outputs [B, T, H] (before
        the final norm)."""
        hidden = self.fc(features.to(self.dtype))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for s in range(tokens.shape[1]):
            # (the earlier steps' K/V as tuples: a recomputation must see the lists as they were)
            args = (self.embed(tokens[:, s], embed), hidden, positions + s, mask, tuple(keys), tuple(values))
            if checkpoint_steps and torch.is_grad_enabled():
                hidden, k, v = torch.utils.checkpoint.checkpoint(self._unrolled_step, *args, use_reentrant=False)
            else:
                hidden, k, v = self._unrolled_step(*args)
            keys.append(k)
            values.append(v)
            outs.append(hidden)
        return outs

    def _unrolled_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of `unrolled` over the earlier steps' K/V: (output, this step's K, V)."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x, residual = layer.inputs(embeds, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        q, k, v = attn.project_qkv(x, cos, sin)
        out = layer.finish(attn.output(unrolled_attention(q, [*keys, k], [*values, v], mask)), residual)
        return out, k, v


def _best_nodes(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n best-scored of every row's candidates [R, C] (drafting order; parents [R, C]
    as candidate indices, -1: the anchor), kept in drafting order: (tokens, parents as
    indices into [anchor, kept nodes], depths) [R, n]. A stable sort keeps a parent
    before a child of equal score, so every kept node's parent is kept."""
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values
    rows, c = scores.shape
    index = torch.zeros(rows, c + 1, dtype=torch.long, device=scores.device)   # candidate + 1 -> kept node + 1
    index.scatter_(1, keep + 1, torch.arange(1, n + 1, device=scores.device).expand(rows, n))
    return tokens.gather(1, keep), index.gather(1, parents.gather(1, keep) + 1), depths.gather(1, keep)


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D]; keys / values of steps 0..s, each [B, Hkv, T, D]. Step 0's keys under
    mask [B, 1, T, T], each later step's key at the query's own position (a diagonal: one
    score per query, never a [T, T] block)."""
    b, hq, t, d = q.shape
    hkv = keys[0].shape[1]
    q5 = q.view(b, hkv, hq // hkv, t, d)                                      # GQA without copying K/V
    scale = 1.0 / math.sqrt(d)
    first = torch.einsum("bhgtd,bhsd->bhgts", q5, keys[0]) * scale
    first = first.masked_fill(~mask.unsqueeze(2), float("-inf"))
    diag = [(q5 * k.unsqueeze(2)).sum(-1, keepdim=True) * scale for k in keys[1:]]
    scores = torch.cat([first, *diag], dim=-1)
    probs = torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    out = torch.einsum("bhgts,bhsd->bhgtd", probs[..., :t], values[0])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t + i:t + i + 1] * v.unsqueeze(2)
    return out.reshape(b, hq, t, d)
