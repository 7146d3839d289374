"""An EAGLE-3 draft at run time (docs/design.md section 3.1): `Eagle3Drafter` pairs the
weights (`Eagle3Draft`) with the target's embedding and a chain length, and offers what
the round asks of any draft (a cache, context appends, a `ChainDraftConfig` under the
names DFlash's config uses), plus `draft`, the chain of k drafts.

Context: each committed position t becomes K/V in the draft's one layer from the target's
features at t and the token after it (EAGLE-3 reads x_{t+1} at t), so an append needs the
committed tokens too. A chain starts from the layer's output at a row's last committed
position: `Eagle3Cache` keeps it per row (`last`) beside the K/V, and moves it with them
(row slices, drops, moves and swaps of the batch and the engine's slot pool).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.config import DEFAULT_CHAIN_DRAFTS, ChainDraftConfig, EagleTree
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.eagle3 import Eagle3Draft, Pick
from blockspec.models.kv_cache import KVCache


class Eagle3Cache(KVCache):
    """The draft's KV cache plus `last` [rows, H]: the layer's output at each row's last
    committed position (where its next chain starts)."""

    def __init__(self, rows: int, kv_heads: int, head_dim: int, capacity: int, hidden: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(1, rows, kv_heads, head_dim, capacity, dtype, device)
        self.last = torch.zeros(rows, hidden, dtype=dtype, device=device)

    def slice_rows(self, start: int, stop: int) -> "Eagle3Cache":
        view = super().slice_rows(start, stop)
        view.__class__ = Eagle3Cache
        view.last = self.last[start:stop]
        return view   # type: ignore[return-value]

    def keep_rows(self, index: torch.Tensor) -> None:
        super().keep_rows(index)
        self.last = self.last[index].contiguous()

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        super().move_rows(src, dst)
        if src:
            self.last[dst] = self.last[src]

    def swap_rows(self, a: int, b: int) -> None:
        super().swap_rows(a, b)
        self.last[[a, b]] = self.last[[b, a]]


class Eagle3Drafter:
    """An EAGLE-3 draft ready to run with one target (see the module docstring): the round
    drafts with `draft` (k one-token steps), not one block forward."""

    markov_head = None        # the DSpark heads the round looks for: an EAGLE-3 draft has neither
    confidence_head = None

    def __init__(self, model: Eagle3Draft, embed: nn.Embedding, config: ChainDraftConfig) -> None:
        self.model, self.embed, self.config = model, embed, config

    @classmethod
    def pair(cls, model: Eagle3Draft, target: nn.Module, num_drafts: int = DEFAULT_CHAIN_DRAFTS) -> "Eagle3Drafter":
        """`model` drafting k = num_drafts tokens per round for `target` (checked against it)."""
        model.config.check_target(target.config)
        return cls(model, target.embed_tokens,
                   ChainDraftConfig.of(model.config, target.config.num_hidden_layers, num_drafts))

    def with_num_drafts(self, num_drafts: int) -> "Eagle3Drafter":
        """The same weights drafting chains of another length."""
        return Eagle3Drafter(self.model, self.embed, ChainDraftConfig(self.config.draft, num_drafts,
                                                                      self.config.target_layer_ids))

    def with_tree(self, tree: EagleTree) -> "Eagle3Drafter":
        """The same weights drafting `tree` each round (EAGLE-2's dynamic tree, `draft_tree`)."""
        vocab = self.config.draft.draft_vocab_size
        if tree.topk > vocab:
            raise BlockspecError(f"EAGLE-3 tree: topk {tree.topk} exceeds the draft's vocabulary of {vocab} tokens")
        return Eagle3Drafter(self.model, self.embed, ChainDraftConfig(self.config.draft, tree.num_draft_tokens - 1,
                                                                      self.config.target_layer_ids, tree=tree))

    def with_block_size(self, block_size: int) -> "Eagle3Drafter":
        """`with_num_drafts(block_size - 1)`: blocks count the anchor (`ChainDraftConfig.block_size`)."""
        if self.config.tree is not None:
            raise BlockspecError("an EAGLE-3 tree's size is its num_draft_tokens; give it no block size")
        return self.with_num_drafts(block_size - 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def modules(self):
        """The weights' modules (memory accounting walks them)."""
        return self.model.modules()

    def new_cache(self, rows: int, capacity: int) -> Eagle3Cache:
        """`capacity` slots, plus the room a tree's levels take after the committed ones."""
        d, tree = self.config.draft, self.config.tree
        scratch = 0 if tree is None else tree.scratch_slots
        return Eagle3Cache(rows, d.num_key_value_heads, d.head_dim, capacity + scratch, d.hidden_size, self.dtype,
                           self.device)

    def append_context(self, cache: Eagle3Cache, features: torch.Tensor, num_new: torch.Tensor | int,
                       next_tokens: torch.Tensor | None = None) -> None:
        """Commit the next features.shape[1] positions of every row (right-padded; rows advance
        by num_new), position j paired with next_tokens[:, j], the token committed after it.
        Rows that commit none keep their `last`."""
        if next_tokens is None:
            raise ValueError("an EAGLE-3 context append needs the token after each position")
        rows = features.shape[0]
        counts = torch.as_tensor(num_new, device=features.device).expand(rows)
        out = self.model.append(cache, features, next_tokens.to(features.device), counts, self.embed)
        index = torch.arange(rows, device=out.device)
        newest = out[index, (counts - 1).clamp(min=0)]
        cache.last.copy_(torch.where((counts > 0).unsqueeze(1), newest, cache.last))

    def draft(self, cache: Eagle3Cache, k: int, pick: Pick | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k chained drafts per row from its last committed position (`Eagle3Draft.chain_from`):
        (tokens [R, k], their distributions over the full vocabulary [R, k, V] or None)."""
        return self.model.chain_from(cache, cache.last, k, self.embed, pick)

    def draft_tree(self, cache: Eagle3Cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft tree (top-k) of `config.tree` per row from its last committed position
        (`Eagle3Draft.tree_from`): (tokens, parents, depths), each [R, num_draft_tokens - 1]."""
        assert self.config.tree is not None
        return self.model.tree_from(cache, cache.last, self.config.tree, self.embed)


# A draft the round runs: DFlash / DSpark (one block forward) or EAGLE-3 (a chain of one-token forwards).
AnyDraft = DraftModel | Eagle3Drafter
