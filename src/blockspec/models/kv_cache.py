"""A static, batched KV cache built for speculative decoding.

Layout: one preallocated tensor per K and V, [layers, rows, kv_heads, capacity,
head_dim]. Row r holds its tokens in slots 0..lengths[r]-1 (no left padding),
and a token's slot is also its RoPE position. Appending a block writes slots
lengths[r]..lengths[r]+T-1 by index; rolling a row back after a rejected
draft is O(1): only `lengths` changes, stale slots are masked and later
overwritten. Memory is fixed at allocation and reported by `nbytes`.
"""

from __future__ import annotations

import torch

from blockspec.errors import BlockspecError


def sliding_window_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, key_len: int, window: int) -> torch.Tensor:
    """Sliding-window attention mask [B, 1, T, key_len] (True = may attend), as
    transformers' sliding_window_overlay: query at position i sees keys j with
    i - window < j. `mask` [.., 1, T, key_len] is the causal (or custom) mask it
    narrows; None means plain causal (j <= i). q_pos [B, T]: the queries' positions,
    key j sits at position j."""
    key = torch.arange(key_len, device=q_pos.device).view(1, 1, key_len)
    q = q_pos.unsqueeze(-1)
    band = key > q - window
    if mask is None:
        return (band & (key <= q)).unsqueeze(1)
    return mask & band.unsqueeze(1)


class KVCache:
    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, rows, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.capacity = capacity

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def check_room(self, width: int) -> int:
        """Raise if appending `width` slots to the longest row would overflow; else return
        the longest row's length (the one host read a forward needs for its key range)."""
        longest = int(self.lengths.max())
        need = longest + width
        if need > self.capacity:
            raise BlockspecError(
                f"KV cache overflow: {need} positions needed, capacity is {self.capacity} "
                "(prompt + max_new_tokens + block is too long for this cache)")
        return longest

    def positions(self, width: int) -> torch.Tensor:
        """Slots / RoPE positions of the next `width` tokens of every row, [rows, width]."""
        return self.lengths.unsqueeze(1) + torch.arange(width, device=self.lengths.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        """k, v [rows, Hkv, T, D] written at slots [rows, T] of each row. (`counts`, the real
        columns of each row, matters only to a ring (`WindowedKVCache`): here a slot past a
        row's length stays masked until overwritten.)"""
        if torch.compiler.is_compiling():
            # Index the whole buffer, not a per-layer view: a traced write into a view
            # becomes a copy of the entire cache, a write into the buffer stays in place.
            dev = slots.device
            index = (torch.full((1, 1, 1), layer, device=dev), torch.arange(self.rows, device=dev).view(-1, 1, 1),
                     torch.arange(k.shape[1], device=dev).view(1, -1, 1), slots.view(self.rows, 1, -1))
            self.k.index_put_(index, k)
            self.v.index_put_(index, v)
            return
        if self.rows == 1:
            start = int(slots[0, 0])
            self.k[layer, :, :, start:start + k.shape[2]] = k
            self.v[layer, :, :, start:start + k.shape[2]] = v
            return
        row_idx = torch.arange(self.rows, device=slots.device).unsqueeze(1)
        # Advanced indices on dims 0 and 2 (with a slice between) put [rows, T] first.
        self.k[layer][row_idx, :, slots] = k.transpose(1, 2)
        self.v[layer][row_idx, :, slots] = v.transpose(1, 2)

    def view(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, :upto], self.v[layer, :, :, :upto]

    def advance(self, n: torch.Tensor | int) -> None:
        self.lengths += n

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll rows back to `lengths` (each <= its current length)."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("truncate can only shorten rows")
        self.lengths.copy_(lengths)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (finished requests leave the batch)."""
        self.k = self.k[:, index].contiguous()
        self.v = self.v[:, index].contiguous()
        self.lengths = self.lengths[index].clone()

    def reset(self) -> None:
        self.lengths.zero_()

    # -- slot-pool operations (continuous batching, engine/engine.py) ------------
    def slice_rows(self, start: int, stop: int) -> "KVCache":
        """A cache over rows start..stop-1 that shares storage (and lengths) with this one.

        Writes, `advance` and `truncate` on the slice land in this cache; only
        `keep_rows`, which reallocates, must not be called on a slice."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop]
        view.capacity = self.capacity
        return view

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy rows src[i] -> dst[i] (valid slots only) and empty the sources.

        Keeps a pool's live rows contiguous when requests leave: one copy of at most
        max(source length) slots per moved row; src and dst must be disjoint."""
        if not src:
            return
        s = torch.tensor(src, device=self.lengths.device)
        d = torch.tensor(dst, device=self.lengths.device)
        n = int(self.lengths[s].max())
        self.k[:, d, :, :n] = self.k[:, s, :, :n]
        self.v[:, d, :, :n] = self.v[:, s, :, :n]
        self.lengths[d] = self.lengths[s]
        self.lengths[s] = 0

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows a and b (their valid slots and lengths)."""
        ab, ba = [a, b], [b, a]
        n = int(self.lengths[ab].max())
        self.k[:, ab, :, :n] = self.k[:, ba, :, :n]   # advanced indexing: the right side is a copy
        self.v[:, ab, :, :n] = self.v[:, ba, :, :n]
        self.lengths[ab] = self.lengths[ba]

    def check_room_rows(self, counts: torch.Tensor) -> None:
        """Raise if appending counts[r] slots to any row r would overflow it."""
        need = int((self.lengths + counts).max()) if counts.numel() else 0
        if need > self.capacity:
            raise BlockspecError(
                f"KV cache overflow: {need} positions needed, capacity is {self.capacity}")

    def write_packed(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Packed tokens: k, v [Hkv, N, D]; token i goes to slot slots[i] of row rows[i]."""
        # Advanced indices on dims 0 and 2 (with a slice between) put N first.
        self.k[layer][rows, :, slots] = k.transpose(0, 1)
        self.v[layer][rows, :, slots] = v.transpose(0, 1)
