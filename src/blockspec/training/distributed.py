"""The trainer's process group, model wrapping and data order.

One process, or N under `torchrun` on one or many nodes (RANK / WORLD_SIZE / LOCAL_RANK
from the launcher): gloo on CPU, nccl on GPU. The draft is wrapped in PyTorch's own
DistributedDataParallel (gradients all-reduced in buckets while backward runs), or with
`--fsdp` sharded by FSDP2 (`fully_shard`: parameters, gradients and optimizer state split
across ranks, for drafts too big to replicate). Every rank holds the frozen target.

Data order (training/data.py `EpochBatches`) is a function of (seed, epoch, step) only and
every loss is normalised by the weight sum of the whole global batch (all ranks, all
micro-batches), so the same global batch on 1 or N processes gives the same update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import resolve_device


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed(device: str) -> Dist:
    """The process group torchrun describes (none for one process) and this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def close(d: Dist) -> None:
    if d.active and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.active:
        dist.all_reduce(t)
    return t


def broadcast_int(value: int, d: Dist) -> int:
    """Rank 0's value on every rank (decisions such as when to stop)."""
    if not d.active:
        return value
    t = torch.tensor([value], device=d.device)
    dist.broadcast(t, 0)
    return int(t.item())


def wrap(module: nn.Module, d: Dist, fsdp: bool) -> nn.Module:
    """The module the step runs: itself (one process), DDP, or FSDP2-sharded in place.

    FSDP2 shards the whole draft as one unit: parameters, gradients and AdamW state are
    split across ranks between steps and the draft is gathered for each step's forward
    and backward (the draft's context K/V projection reads every layer's weights outside
    that layer's forward, so per-layer units would see sharded weights there)."""
    if fsdp:
        if not d.active:
            raise BlockspecError("train: --fsdp needs several processes (run under torchrun)")
        fully_shard(module)
        return module
    if not d.active:
        return module
    return DistributedDataParallel(module, device_ids=[d.device.index] if d.device.type == "cuda" else None)


def full_state(module: nn.Module, opt: torch.optim.Optimizer, d: Dist) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state on CPU, keyed by parameter name; a
    collective under FSDP (every rank must call it)."""
    return get_state_dict(module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(module: nn.Module, opt: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))
