"""A counter of host reads: every call that makes a GPU wait for its result (the host needs
a tensor's value or an output whose shape depends on values), wherever it is made."""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

# Reads of a value: .item(), .tolist(), .cpu(), bool() / int() / float() / indexing with a tensor.
VALUE_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
# Outputs whose shape depends on values: the host waits for the count.
SHAPE_READS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
HOST_READS = VALUE_READS | SHAPE_READS
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def _has_bool_tensor(args) -> bool:
    """A boolean-mask index (x[mask], x[mask] = y): a nonzero in disguise."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype == torch.bool:
            return True
        if isinstance(a, (tuple, list)) and _has_bool_tensor(a):
            return True
    return False


class HostReads(TorchFunctionMode):
    """Every host read (above) as (read, the blockspec function that made it, inside a
    captured step?). A TorchFunctionMode sees the calls wherever they are made, in any
    module, so a new read anywhere is counted. On the CPU a read of a host-born tensor
    counts too: the expected lists name each read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, bool]] = []
        self.in_step = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in INDEXING and _has_bool_tensor(args[1:])):
            frame = sys._getframe(1)
            while frame is not None and "blockspec" not in frame.f_code.co_filename:
                frame = frame.f_back
            self.reads.append((name, frame.f_code.co_name if frame is not None else "?", self.in_step))
        return func(*args, **(kwargs or {}))
