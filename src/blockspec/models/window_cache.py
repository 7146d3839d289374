"""The draft's KV cache when some draft layers slide (docs/design.md section 3.2).

Full layers keep every position (a `KVCache`); sliding layers keep a ring of
`DraftConfig.window_span` = W + block_size - 1 slots per row, position j in slot
j mod span: a block anchored at p reads positions p - W + 1 .. p + block_size - 1, so
writing it never overwrites a context position it reads. The context only grows
(committed positions) and the block's K/V are scratch overwritten by the next append,
so rollback stays exact with the ring: nothing is ever cut back.

Both parts share one `lengths` tensor (the row's committed positions). An append leaves
each ring slot holding the last of a row's real new positions (`counts`) that maps to it,
or what it held: a padding column would otherwise land in the slot of a position still in
the window. The write has static shapes and reads nothing on the host (see `write`).
"""

from __future__ import annotations

import torch

from blockspec.models.kv_cache import KVCache


class WindowedKVCache:
    """Same interface as `KVCache` for the draft's paths (generate, the engine)."""

    def __init__(self, ring_layers: tuple[bool, ...], rows: int, kv_heads: int, head_dim: int, capacity: int,
                 span: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.span = min(span, capacity)
        self.ring_layers = ring_layers
        # layer -> index into its part (the full cache or the ring)
        self._index = [sum(1 for r in ring_layers[:i] if r == ring_layers[i]) for i in range(len(ring_layers))]
        self.full = KVCache(ring_layers.count(False), rows, kv_heads, head_dim, capacity, dtype, device)
        shape = (ring_layers.count(True), rows, kv_heads, self.span, head_dim)
        self.rk = torch.zeros(shape, dtype=dtype, device=device)
        self.rv = torch.zeros(shape, dtype=dtype, device=device)

    # -- what KVCache offers ------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        return self.full.lengths

    @property
    def rows(self) -> int:
        return self.full.rows

    @property
    def capacity(self) -> int:
        return self.full.capacity

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + 2 * self.rk.numel() * self.rk.element_size()

    def check_room(self, width: int) -> int:
        return self.full.check_room(width)

    def check_room_rows(self, counts: torch.Tensor) -> None:
        self.full.check_room_rows(counts)

    def positions(self, width: int) -> torch.Tensor:
        return self.full.positions(width)

    def advance(self, n: torch.Tensor | int) -> None:
        self.full.advance(n)

    def truncate(self, lengths: torch.Tensor) -> None:
        self.full.truncate(lengths)

    def reset(self) -> None:
        self.full.reset()

    def is_ring(self, layer: int) -> bool:
        return self.ring_layers[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        """k, v [rows, Hkv, T, D] for positions `slots` [rows, T]; `counts` [rows]: only the first
        counts[r] columns of row r are real (an append of ragged rows), None: all are."""
        i = self._index[layer]
        if not self.ring_layers[layer]:
            self.full.write(i, k, v, slots)
            return
        span = self.span
        col = torch.arange(slots.shape[1], device=slots.device)
        real = slots.shape[1] if counts is None else counts.view(-1, 1)
        # A row's columns are consecutive positions, so column c shares its ring slot with every
        # column congruent to it mod span, and the value that slot must end with is that of the
        # last real column among them: `owner` (negative: no real column has that slot, which
        # keeps what it holds). Every column then writes its slot's final value, so writes that
        # meet in one slot carry equal values and their order does not matter: a static-shape
        # index write with no mask, no nonzero, no host read (a captured step can hold it).
        owner = (real - 1 - torch.remainder(real - 1 - col, span)).expand_as(slots)   # [rows, T]
        dev = slots.device
        index = (torch.full((1, 1, 1), i, device=dev), torch.arange(slots.shape[0], device=dev).view(-1, 1, 1),
                 torch.arange(k.shape[1], device=dev).view(1, -1, 1), (slots % span).unsqueeze(1))
        take = owner.clamp(min=0).unsqueeze(1).unsqueeze(-1).expand(-1, k.shape[1], -1, k.shape[3])
        new = (owner >= 0).unsqueeze(1).unsqueeze(-1)
        for ring, x in ((self.rk, k), (self.rv, v)):
            ring.index_put_(index, torch.where(new, x.gather(2, take), ring[index]))

    def view(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer]
        if not self.ring_layers[layer]:
            return self.full.view(i, upto)
        n = min(upto, self.span)
        return self.rk[i, :, :, :n], self.rv[i, :, :, :n]

    def key_positions(self, last: torch.Tensor, upto: int) -> torch.Tensor:
        """[rows, min(upto, span)]: the position each ring slot holds once positions up to
        last[r] are written (negative: a slot not written yet)."""
        slot = torch.arange(min(upto, self.span), device=last.device)
        end = last.view(-1, 1)
        return end - torch.remainder(end - slot, self.span)

    # -- rows ------------------------------------------------------------------------
    def keep_rows(self, index: torch.Tensor) -> None:
        self.full.keep_rows(index)
        self.rk = self.rk[:, index].contiguous()
        self.rv = self.rv[:, index].contiguous()

    def slice_rows(self, start: int, stop: int) -> "WindowedKVCache":
        view = object.__new__(WindowedKVCache)
        view.span, view.ring_layers, view._index = self.span, self.ring_layers, self._index
        view.full = self.full.slice_rows(start, stop)
        view.rk, view.rv = self.rk[:, start:stop], self.rv[:, start:stop]
        return view

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        s = torch.tensor(src, device=self.lengths.device)
        d = torch.tensor(dst, device=self.lengths.device)
        self.rk[:, d] = self.rk[:, s]
        self.rv[:, d] = self.rv[:, s]
        self.full.move_rows(src, dst)

    def swap_rows(self, a: int, b: int) -> None:
        ab, ba = [a, b], [b, a]
        self.rk[:, ab] = self.rk[:, ba]
        self.rv[:, ab] = self.rv[:, ba]
        self.full.swap_rows(a, b)
