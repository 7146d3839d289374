"""DSpark confidence-scheduled verification (design section 5).

`CostTable`: the measured time T(n) of one packed target verify forward over
n tokens on this machine (saved as JSON with the model / dtype / machine it was
measured on). `plan` decides how many drafts each running request verifies
this round: it admits draft slots in descending order of prefix survival while
the expected throughput `tau* * SPS(n)` keeps improving, and stops at the first
slot that does not improve it (the early stop is what keeps sampling lossless).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.config import read_json
from blockspec.errors import BlockspecError
from blockspec.models.target import TargetModel

TABLE_FORMAT = "blockspec-cost-table"
TABLE_VERSION = 1


def model_signature(target: TargetModel) -> str:
    """What a cost table was measured for: the target's shape, not its weights."""
    c = target.config
    return (f"{c.model_type} layers={c.num_hidden_layers} hidden={c.hidden_size} inter={c.intermediate_size} "
            f"heads={c.num_attention_heads}/{c.num_key_value_heads} head_dim={c.head_dim} vocab={c.vocab_size}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_signature(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} torch {torch.__version__}"
    return f"{device.type} {platform.machine()} {os.cpu_count()} cpus torch {torch.__version__}"


@dataclass
class CostTable:
    """Verify forward time `times_s[i]` (seconds) for `ns[i]` packed tokens; n strictly increasing.

    Between measured points T is interpolated linearly; below the first point it is
    T(ns[0]); above the last it continues the last segment's slope (never decreasing)."""

    ns: list[int]
    times_s: list[float]
    model: str = ""
    dtype: str = ""
    machine: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "cost table"
        if not isinstance(self.ns, list) or not isinstance(self.times_s, list) or not self.ns:
            raise BlockspecError(f"{where}: 'n' and 'time_s' must be non-empty lists")
        if len(self.ns) != len(self.times_s):
            raise BlockspecError(f"{where}: 'n' has {len(self.ns)} entries but 'time_s' has {len(self.times_s)}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.ns):
            raise BlockspecError(f"{where}: every n must be a positive integer, got {self.ns}")
        if any(b <= a for a, b in zip(self.ns, self.ns[1:])):
            raise BlockspecError(f"{where}: n must be strictly increasing, got {self.ns}")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                   for t in self.times_s):
            raise BlockspecError(f"{where}: every time_s must be a positive finite number, got {self.times_s}")
        for name in ("model", "dtype", "machine"):
            if not isinstance(getattr(self, name), str):
                raise BlockspecError(f"{where}: '{name}' must be a string")
        self.times_s = [float(t) for t in self.times_s]

    def time(self, n: torch.Tensor | int) -> torch.Tensor:
        """Interpolated T(n) in seconds, float64, same shape as n."""
        n = torch.as_tensor(n, dtype=torch.float64)
        xs = torch.tensor(self.ns, dtype=torch.float64)
        ys = torch.tensor(self.times_s, dtype=torch.float64)
        if len(xs) == 1:
            return torch.full_like(n, float(ys[0]))
        i = torch.searchsorted(xs, n.clamp(min=xs[0]).contiguous()).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        slope = (y1 - y0) / (x1 - x0)
        inside = y0 + slope * (n.clamp(min=xs[0]) - x0)
        # Past the last measurement keep the last slope, never falling (no free tokens).
        beyond = y1 + slope.clamp(min=0) * (n - x1)
        return torch.where(n > xs[-1], beyond, inside)

    def sps(self, n: torch.Tensor | int) -> torch.Tensor:
        """Verify steps per second, 1 / T(n)."""
        return 1.0 / self.time(n)

    def check_target(self, target: TargetModel) -> None:
        """Refuse a table measured for another model shape or dtype (empty fields are not checked)."""
        if self.model and self.model != model_signature(target):
            raise BlockspecError(f"cost table was measured for '{self.model}', not for this target "
                                 f"('{model_signature(target)}'); profile it again")
        if self.dtype and self.dtype != dtype_name(target.dtype):
            raise BlockspecError(f"cost table was measured in {self.dtype}, the target runs in "
                                 f"{dtype_name(target.dtype)}; profile it again")

    # -- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "model": self.model, "dtype": self.dtype,
                "machine": self.machine, "n": self.ns, "time_s": self.times_s, "meta": self.meta}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "cost table") -> "CostTable":
        if raw.get("format") != TABLE_FORMAT:
            raise BlockspecError(f"{where}: not a blockspec cost table (format {raw.get('format')!r}, "
                                 f"expected {TABLE_FORMAT!r})")
        if raw.get("version") != TABLE_VERSION:
            raise BlockspecError(f"{where}: unsupported version {raw.get('version')!r} (expected {TABLE_VERSION})")
        for key in ("model", "dtype", "machine", "n", "time_s"):
            if key not in raw:
                raise BlockspecError(f"{where}: missing required key '{key}'")
        meta = raw.get("meta", {})
        if not isinstance(meta, dict):
            raise BlockspecError(f"{where}: 'meta' must be an object")
        try:
            return cls(raw["n"], raw["time_s"], raw["model"], raw["dtype"], raw["machine"], meta)
        except BlockspecError as exc:
            raise BlockspecError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls.from_dict(read_json(Path(path), "cost table"), where=str(path))


def plan(survival: torch.Tensor, table: CostTable | None) -> torch.Tensor:
    """Drafts to verify per request, [R] long (design section 5, DSpark Algorithm 1).

    survival [R, g]: prefix survival a_{r,j} = prod_{i<=j} c_{r,i}, non-increasing in j.
    Start from anchors only (n = R, tau* = R); admit slots in descending survival
    (ties: smaller j, then smaller r) while tau* * SPS(n) strictly improves, and stop
    at the first slot that does not improve it. No table: verify every draft."""
    r, g = survival.shape
    if table is None or g == 0 or r == 0:
        return torch.full((r,), g, dtype=torch.long, device=survival.device)
    flat = survival.detach().to("cpu", torch.float64).t().reshape(-1)  # index j*R + r
    order = torch.sort(flat, descending=True, stable=True).indices       # stable: ties by (j, r)
    steps = torch.arange(r * g + 1, dtype=torch.float64)
    tau = r + torch.cat([torch.zeros(1, dtype=torch.float64), flat[order].cumsum(0)])
    value = tau * table.sps(r + steps)
    # Admit until the first non-improving slot: the early stop is a correctness rule
    # (x_j's own admission may not depend on x_j), not a global argmax over cut points.
    admitted = int((value[1:] > value[:-1]).long().cumprod(0).sum())
    lens = torch.bincount(order[:admitted] % r, minlength=r)
    return lens.to(survival.device)


def _split(n: int, rows: int) -> torch.Tensor:
    """n tokens over `rows` rows as evenly as possible (each row >= 1)."""
    base = torch.full((rows,), n // rows, dtype=torch.long)
    base[: n % rows] += 1
    return base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def profile_cost_table(target: TargetModel, ns: list[int], repeats: int = 5, *, rows: int = 8,
                       context: int = 128, capture: tuple[int, ...] = (), warmup: int = 2,
                       seed: int = 0) -> CostTable:
    """Measure the packed verify forward (`TargetModel.forward_packed`) for each n.

    n tokens are spread over min(n, rows) rows, each already holding `context`
    cached positions; the median of `repeats` timed runs is kept."""
    if not ns or repeats < 1 or rows < 1 or context < 0:
        raise BlockspecError("profile_cost_table needs ns, repeats >= 1, rows >= 1, context >= 0")
    ns = sorted(set(int(n) for n in ns))
    if ns[0] < 1:
        raise BlockspecError("profile_cost_table: every n must be >= 1")
    device = target.device
    cache = target.new_cache(rows, context + ns[-1] + 1)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for n in ns:
        counts = _split(n, min(n, rows)).to(device)
        view = cache.slice_rows(0, counts.shape[0])
        tokens = torch.randint(0, target.config.vocab_size, (n,), generator=gen).to(device)
        samples = []
        for i in range(warmup + repeats):
            view.lengths.fill_(context)
            _sync(device)
            t0 = time.perf_counter()
            target.forward_packed(tokens, counts, view, capture=capture)
            _sync(device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        times.append(sorted(samples)[len(samples) // 2])
    return CostTable(ns, times, model=model_signature(target), dtype=dtype_name(target.dtype),
                     machine=machine_signature(device),
                     meta={"rows": rows, "context": context, "repeats": repeats, "capture": list(capture)})
