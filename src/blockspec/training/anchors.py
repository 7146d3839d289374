"""Random anchors and the packed block attention mask (docs/design.md section 7).

All blocks of a sequence run in one draft forward. Keys are
[context positions 0..T-1 | all block slots]; the block of anchor a sees
context keys j < a (the anchor's own target state does not exist at
inference time) and every slot of its own block, nothing else.

A draft with sliding-window or causal layers (docs/design.md section 3.2) narrows that
mask per layer exactly as inference does: slot u of the block at anchor a (position
a + u) sees the keys at positions > a + u - W, and with a causal layer only its own
block's slots <= u.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBlocks:
    anchors: torch.Tensor      # [B, A] anchor positions (padded entries are 0)
    valid: torch.Tensor        # [B, A] bool: real anchor or padding
    block_ids: torch.Tensor    # [B, A*S] [anchor token, MASK...] per block
    positions: torch.Tensor    # [B, A*S] a, a+1, ..., a+S-1
    mask: torch.Tensor | list[torch.Tensor]   # [B, 1, A*S, T + A*S] True = may attend; one per layer
                                              # when a layer slides or is causal (`layer_masks`)


def sample_anchors(loss_mask: torch.Tensor, span: int, num_anchors: int,
                   gen: torch.Generator | list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, up to `num_anchors` positions a whose next `span` tokens (a+1..a+span)
    are all trainable (response) tokens; uniformly without replacement, sorted.
    `gen`: one generator for the batch, or one per row (the trainer seeds each example's
    own, so its anchors do not depend on which rank or micro-batch it lands in)."""
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool)
    if t > span:
        # window[a] = all(loss_mask[a+1 : a+1+span])
        m = loss_mask[:, 1:].long()
        csum = torch.cat([torch.zeros(b, 1, dtype=torch.long), m.cumsum(1)], dim=1)
        full = (csum[:, span:] - csum[:, :-span]) == span  # [B, t-span]
        ok[:, :t - span] = full
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for r in range(b):
        cand = ok[r].nonzero().flatten()
        if len(cand) == 0:
            continue
        row_gen = gen[r] if isinstance(gen, list) else gen
        pick = cand[torch.randperm(len(cand), generator=row_gen)[:num_anchors]].sort().values
        anchors[r, :len(pick)] = pick
        valid[r, :len(pick)] = True
    return anchors, valid


def sample_packed_anchors(loss_mask: torch.Tensor, segments: list[list[tuple[int, int, int]]], span: int,
                          num_anchors: int, gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_anchors` for packed rows: each sequence (example k at [start, start+n)) draws its
    own up to `num_anchors` anchors with its own generator gens[k], exactly as it would alone in a
    row, shifted to where it sits. A row holds up to num_anchors x (its sequences) anchors."""
    per_row = max(len(segs) for segs in segments) * num_anchors
    anchors = torch.zeros(len(segments), per_row, dtype=torch.long)
    valid = torch.zeros(len(segments), per_row, dtype=torch.bool)
    for r, segs in enumerate(segments):
        at = 0
        for k, start, n in sorted(segs, key=lambda s: s[1]):
            a, v = sample_anchors(loss_mask[r:r + 1, start:start + n], span, num_anchors, [gens[k]])
            a = a[0, v[0]] + start
            anchors[r, at:at + len(a)] = a
            valid[r, at:at + len(a)] = True
            at += len(a)
    return anchors, valid


def layer_masks(mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                layers: tuple[tuple[int | None, bool], ...]) -> torch.Tensor | list[torch.Tensor]:
    """The packed mask [B, 1, N, T + N] narrowed for each layer's (window, causal): query slot u
    of anchor a sees a key at position k only when k > a + u - window and, causal, k <= a + u
    (context key j sits at j, slot v of anchor a' at a' + v). Layers that are full and
    non-causal share `mask`; a list only when some layer is not."""
    if all(window is None and not causal for window, causal in layers):
        return mask
    b, _, n, keys = mask.shape
    t = keys - n
    dev = mask.device
    q_pos = (anchors.unsqueeze(-1) + torch.arange(block_size, device=dev)).reshape(b, n, 1)
    k_pos = torch.cat([torch.arange(t, device=dev).expand(b, t), q_pos.view(b, n)], dim=1).unsqueeze(1)
    narrowed: dict[tuple[int | None, bool], torch.Tensor] = {}
    for kind in set(layers):
        window, causal = kind
        band = torch.ones(b, n, keys, dtype=torch.bool, device=dev)
        if window is not None:
            band &= k_pos > q_pos - window
        if causal:
            band &= k_pos <= q_pos
        # (a padded query's own slot, its only key, sits at its own position: always kept)
        narrowed[kind] = mask & band.unsqueeze(1)
    return [narrowed[kind] for kind in layers]


def pack_blocks(input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                mask_token_id: int, seg_start: torch.Tensor | None = None,
                layers: tuple[tuple[int | None, bool], ...] = ()) -> PackedBlocks:
    """Built on the inputs' device (on a GPU the [B, 1, A*S, T+A*S] mask never crosses PCIe).
    `seg_start` [B, T] (packed rows): the index each token's sequence starts at; a block then
    sees only its own sequence's context and is positioned from that sequence's start.
    `layers`: each draft layer's (window, causal) (`layer_masks`); empty: all full."""
    b, t = input_ids.shape
    a = anchors.shape[1]
    s = block_size
    dev = input_ids.device
    slot = torch.arange(s, device=dev)
    start = torch.zeros_like(anchors) if seg_start is None else seg_start.gather(1, anchors)   # [B, A]
    positions = (anchors.unsqueeze(-1) - start.unsqueeze(-1) + slot).reshape(b, a * s)
    block_ids = torch.full((b, a, s), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    # Query i belongs to block i // s; context key j is visible iff j < anchor of that block.
    q_anchor = anchors.repeat_interleave(s, dim=1)                                  # [B, N]
    q_valid = valid.repeat_interleave(s, dim=1)
    ctx_mask = torch.arange(t, device=dev).view(1, 1, t) < q_anchor.unsqueeze(-1)    # [B, N, T]
    if seg_start is not None:
        q_start = start.repeat_interleave(s, dim=1)
        ctx_mask = ctx_mask & (torch.arange(t, device=dev).view(1, 1, t) >= q_start.unsqueeze(-1))
    q_block = torch.arange(a * s, device=dev) // s
    own = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(b, -1, -1)            # [B, N, N]
    mask = torch.cat([ctx_mask, own], dim=-1) & q_valid.unsqueeze(-1)
    # Padded queries still need one visible key (their own slot) to avoid NaNs.
    diag = torch.zeros(a * s, t + a * s, dtype=torch.bool, device=dev)
    rows = torch.arange(a * s, device=dev)
    diag[rows, t + rows] = True
    mask = (mask | (~q_valid.unsqueeze(-1) & diag)).unsqueeze(1)
    return PackedBlocks(anchors, valid, block_ids.reshape(b, a * s), positions,
                        layer_masks(mask, anchors, s, layers))
