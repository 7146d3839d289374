"""What the adaptive policy learned, kept across `generate` calls (docs/design.md section 5).

Each call builds its `RoundPolicy` afresh; without memory its gate would explore, warm
up and learn acceptance from zero on every call, so a loop of calls (the bench, an
evaluation harness, a script) never profits from the previous call. `PolicyMemory` is
one slot of a small registry keyed by (target, draft, method, device, dtypes, rows,
policy options): a policy recalls the slot's state when it is built and keeps its
own there when its call ends, so the tenth call starts where the ninth ended.

In process the slot is found by the models' ids, guarded by weak references: a model
that died and whose id was reused, or another draft, never finds it. On disk
(`memory="disk"`) the state is a JSON file next to the cost tables, keyed by the
machine and the models' weight fingerprints; it is checked on read and a foreign or
broken file is ignored with a warning. The state is plain numbers (survival sums,
exploration schedule, round-time ratios, confidence calibration): nothing read from
disk runs as code.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import weakref
from pathlib import Path
from typing import Any

import torch

from blockspec.decoding.cost_table import CostTable, dtype_name, machine_signature
from blockspec.decoding.table_cache import cache_dir, save_json
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft
from blockspec.models.target import TargetModel

log = logging.getLogger(__name__)

STATE_FORMAT = "blockspec-policy-state"
STATE_VERSION = 1
MEMORY_MODES = ("off", "process", "disk")
# Values per parameter tensor that a weight fingerprint reads (evenly spaced).
FINGERPRINT_SAMPLES = 64

# key -> (weak reference to the target, to the draft, the state kept last)
_REGISTRY: dict[tuple, tuple[weakref.ref, weakref.ref, dict[str, Any]]] = {}


def weights_fingerprint(model: TargetModel | AnyDraft) -> str:
    """A short hash of a model's parameter names, shapes, dtypes and evenly spaced values:
    two checkpoints of one shape differ in it (computed once per model object)."""
    cached = model.__dict__.get("_weights_fingerprint")
    if cached is not None:
        return cached
    weights = model if isinstance(model, torch.nn.Module) else model.model   # an EAGLE-3 drafter wraps its draft
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in weights.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            digest.update(flat[::step][:FINGERPRINT_SAMPLES].float().cpu().numpy().tobytes())
    model.__dict__["_weights_fingerprint"] = digest.hexdigest()[:20]
    return model.__dict__["_weights_fingerprint"]


def table_signature(table: CostTable | None) -> str:
    """Which table a state's round-time ratios were learned against."""
    if table is None:
        return ""
    raw = json.dumps([table.ns, table.times_s, table.draft_rows, table.draft_times_s,
                      sorted(table.draft_slot_times.items())])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


class PolicyMemory:
    """One registry slot: `recall` the state kept last (None: nothing yet), `keep` a new
    one, `forget` it (`PolicyOptions(fresh=True)`). path: the slot's file (disk memory)."""

    def __init__(self, key: tuple, target: TargetModel, draft: AnyDraft, path: Path | None = None) -> None:
        self.key, self.path = key, path
        self._target, self._draft = weakref.ref(target), weakref.ref(draft)

    @classmethod
    def of(cls, target: TargetModel, draft: AnyDraft, method: str, rows: int, options: str,
           mode: str) -> "PolicyMemory":
        """The slot of this pair, method, row count and policy options (`options`: their
        signature); mode "disk" also keeps it in a file."""
        if mode not in MEMORY_MODES[1:]:
            raise BlockspecError(f"policy memory must be one of {', '.join(MEMORY_MODES)}, got {mode!r}")
        key = (id(target), id(draft), method, str(target.device), dtype_name(target.dtype),
               dtype_name(draft.dtype), rows, options)
        path = None
        if mode == "disk":
            disk_key = {"machine": machine_signature(target.device), "device": str(target.device),
                        "target": weights_fingerprint(target), "draft": weights_fingerprint(draft),
                        "method": method, "window": draft.config.num_drafts, "dtypes": list(key[4:6]), "rows": rows,
                        "options": options}
            digest = hashlib.sha256(json.dumps(disk_key, sort_keys=True).encode()).hexdigest()[:20]
            path = cache_dir() / "policy_state" / f"{digest}.json"
        return cls(key, target, draft, path)

    def recall(self, window: int) -> dict[str, Any] | None:
        """The state kept last for this slot (in this process, else on disk), checked
        against the draft window; None when there is none or it cannot be trusted."""
        entry = _REGISTRY.get(self.key)
        if entry is not None:
            if entry[0]() is self._target() and entry[1]() is self._draft():
                return copy.deepcopy(entry[2])
            del _REGISTRY[self.key]   # the ids were reused by other models
        if self.path is None or not self.path.is_file():
            return None
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT or raw.get("version") != STATE_VERSION:
                raise BlockspecError(f"not a {STATE_FORMAT} file of version {STATE_VERSION}")
            state = raw.get("state")
            check_state(state, window)
        except (OSError, ValueError, BlockspecError) as exc:
            log.warning("blockspec: ignoring the saved policy state %s (%s); learning afresh", self.path, exc)
            return None
        return state

    def keep(self, state: dict[str, Any]) -> None:
        target, draft = self._target(), self._draft()
        if target is None or draft is None:
            return
        _REGISTRY[self.key] = (weakref.ref(target), weakref.ref(draft), copy.deepcopy(state))
        if self.path is not None:
            save_json({"format": STATE_FORMAT, "version": STATE_VERSION, "state": state}, self.path,
                      "the policy state")

    def forget(self) -> None:
        _REGISTRY.pop(self.key, None)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def check_state(state: Any, window: int) -> None:
    """A policy state (`RoundPolicy.state`) as read from disk: every field present, of the
    right type and length, every number finite; BlockspecError otherwise."""
    def fail(what: str) -> None:
        raise BlockspecError(f"policy state: {what}")

    def numbers(xs: Any, what: str, n: int | None = None, positive: bool = False) -> None:
        if not isinstance(xs, list) or (n is not None and len(xs) != n) or not xs:
            fail(f"{what} must be a list of {n or 'some'} numbers")
        for x in xs:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 \
                    or (positive and x == 0):
                fail(f"{what} holds {x!r}, not a finite number >= 0")

    def bands(value: Any, what: str) -> dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdigit() for k in value):
            fail(f"{what} must map temperature bands to their state")
        return value

    if not isinstance(state, dict):
        fail("not an object")
    if state.get("window") != window:
        fail(f"learned for a draft window of {state.get('window')!r}, this draft has {window}")
    if not isinstance(state.get("table"), str):
        fail("'table' must be a string")
    gate = state.get("gate")
    if gate is not None:
        if not isinstance(gate, dict):
            fail("'gate' must be an object")
        for name, band in bands(gate.get("bands"), "gate bands").items():
            if not isinstance(band, dict):
                fail(f"gate band {name} must be an object")
            numbers(band.get("sums"), f"band {name} sums", window)
            numbers(band.get("weights"), f"band {name} weights", window)
            for field in ("skipped", "interval"):
                value = band.get(field)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    fail(f"band {name} {field} must be an integer >= 0")
        explored = gate.get("exploration", {"credit": 0.0, "draws": 0})
        if not isinstance(explored, dict):
            fail("'exploration' must be an object")
        credit, draws = explored.get("credit"), explored.get("draws")
        if isinstance(credit, bool) or not isinstance(credit, (int, float)) or not math.isfinite(credit):
            fail(f"exploration credit holds {credit!r}, not a finite number")
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 0:
            fail("exploration draws must be an integer >= 0")
        ratios = gate.get("ratios")
        if not isinstance(ratios, list):
            fail("'ratios' must be a list")
        for entry in ratios:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                    and 1 <= len(entry[0]) <= 3 and isinstance(entry[0][0], bool)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[0][1:])):
                fail("each ratio must be [[drafting, rows?, block?], [samples]]")
            numbers(entry[1], "ratio samples", positive=True)
    calibrations = bands(state.get("calibrations"), "calibrations")
    for name, cal in calibrations.items():
        if not isinstance(cal, dict):
            fail(f"calibration {name} must be an object")
        numbers(cal.get("accepted"), f"calibration {name} accepted", window)
        numbers(cal.get("expected"), f"calibration {name} expected", window)
