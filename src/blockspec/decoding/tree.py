"""A round's draft tree and what verifying it takes (docs/design.md section 3.1, "Tree
drafting"): the shape each row's drafts form (`TokenTree`), the target's attention mask
and RoPE positions for verifying every node in one forward, and the compaction that
leaves only the accepted path in the target's KV cache.

Nodes are numbered in the verify sequence [anchor, d_1..d_n]: node 0 is the anchor, node
i the i-th draft; a node always comes after its parent. A chain is the tree whose node i's
parent is i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.models.attention import tree_mask
from blockspec.models.kv_cache import KVCache


@dataclass(frozen=True)
class TokenTree:
    """The shape of each row's drafts [R, n] (the tokens are the proposal's)."""

    parents: torch.Tensor   # [R, n] long: draft i's parent node (0: the anchor; j: draft j)
    depths: torch.Tensor    # [R, n] long: draft i's distance from the anchor (1: the anchor's children)

    def ancestry(self) -> torch.Tensor:
        """[R, n+1, n+1] bool: node a is node b's ancestor or b itself (row r's [b, a])."""
        rows, n = self.parents.shape
        up = torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], dim=1)   # the anchor is its own parent
        node = torch.arange(n + 1, device=up.device).expand(rows, n + 1)
        seen = torch.zeros(rows, n + 1, n + 1, dtype=torch.bool, device=up.device)
        for _ in range(int(self.depths.max()) + 1 if n else 1):   # walk every node up to the anchor
            seen.scatter_(2, node.unsqueeze(-1), True)
            node = up.gather(1, node)
        return seen

    def positions(self, start: torch.Tensor) -> torch.Tensor:
        """RoPE positions [R, n+1] of [anchor, drafts] after rows of `start` [R] committed
        tokens: a node sits at its depth, the token it would be in its own sequence."""
        anchor = torch.zeros_like(self.depths[:, :1])
        return start.unsqueeze(1) + torch.cat([anchor, self.depths], dim=1)

    def verify_mask(self, start: torch.Tensor, upto: int) -> torch.Tensor:
        """[R, 1, n+1, upto] bool (True: may attend) for [anchor, drafts] written at slots
        start[r] + i: every node sees its row's committed slots, its ancestors and itself."""
        return tree_mask(start, self.ancestry(), upto)


def keep_path(cache: KVCache, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
    """Keep row r's accepted path in its cache: the K/V of nodes path[r, :accepted[r] + 1]
    (written at slots start[r] + node by the verify forward) move to slots start[r] + 0..,
    as a chain's would lie, and the row is cut after them (the bonus gets its K/V as the
    next anchor). Slots past a row's path are copied too, harmlessly: the cut masks them."""
    rows, width = path.shape
    row = torch.arange(rows, device=path.device).unsqueeze(1)
    src = start.unsqueeze(1) + path
    dst = start.unsqueeze(1) + torch.arange(width, device=path.device)
    for layer in range(cache.k.shape[0]):
        # Advanced indices on dims 0 and 2 put [rows, width] first; the right side is a copy.
        cache.k[layer][row, :, dst] = cache.k[layer][row, :, src]
        cache.v[layer][row, :, dst] = cache.v[layer][row, :, src]
    cache.truncate(start + accepted + 1)
