"""The KV memory plan: how many request slots of how many positions the engine
preallocates, sized like vLLM's --gpu-memory-utilization.

    budget = utilization x total memory - memory in use now (weights, others) - reserve
    (or --kv-memory-gb GiB, given directly; on the CPU by default the smaller of 4 GiB and
    a quarter of the free memory, as vLLM's CPU backend)
    max_model_len = the one asked for, else the model's, capped to what one slot can hold
    slots = min(max_num_seqs, budget // bytes of one slot)

`plan_kv` is a pure function of the models' shapes, dtypes and the budget (testable on
the meta device with real 8B configs); `memory_budget` reads the device's memory
(CUDA: torch.cuda.mem_get_info; CPU: /proc/meminfo MemTotal / MemAvailable). A plan
that cannot hold one sequence is a BlockspecError naming the numbers, never an
out-of-memory crash later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.config import ChainDraftConfig, DraftConfig, TargetConfig
from blockspec.errors import BlockspecError
from blockspec.models.layers import FusedLinears

GIB = 2**30
DEFAULT_UTILIZATION = 0.9     # vLLM's default --gpu-memory-utilization
# On the CPU the host's memory is everyone's: by default the KV cache takes at most this much and a
# quarter of the memory free now, as vLLM's CPU backend's VLLM_CPU_KVCACHE_SPACE (default 4 GiB).
CPU_DEFAULT_KV_BYTES = 4 * 2**30
CPU_DEFAULT_FREE_SHARE = 0.25
WORKSPACE_BYTES = GIB         # allocator / library workspace kept out of the KV budget
MIN_MODEL_LEN = 2
PROMPT_WAIT_POSITIONS = 512   # `KVShapes.prompt_positions`


def cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, positions: int) -> int:
    """K and V of `layers` layers for one row of `positions` positions."""
    return 2 * layers * kv_heads * positions * head_dim * torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class KVShapes:
    """Bytes of one slot as a function of its length: per position of the target's (and
    draft's) K/V, plus the fixed extras every slot carries."""

    target_per_position: int
    draft_per_position: int     # 0 without a draft
    margin: int                 # positions beyond max_model_len (a block's overrun + bonus)
    pending_positions: int      # the draft cache's extra room for buffered context
    pending_bytes: int          # buffered target features per slot (float32): AR rounds' and a waiting prompt's
    model_max_len: int          # the target's supported length (max_position_embeddings, RoPE scaling included)
    draft_window_bytes: int = 0  # the draft's sliding layers: a fixed ring of window_span positions per slot
    draft_scratch_positions: int = 0   # an EAGLE-3 tree's expanded levels, after a row's committed positions
    prompt_positions: int = 0   # the longest prompt whose features wait for the row's first draft

    @classmethod
    def of(cls, target: TargetConfig, target_dtype: torch.dtype, draft: DraftConfig | ChainDraftConfig | None = None,
           draft_dtype: torch.dtype | None = None) -> "KVShapes":
        per_pos = cache_bytes(target.num_hidden_layers, target.num_key_value_heads, target.head_dim, target_dtype, 1)
        # The longest sequence the target supports: max_position_embeddings, scaled by RoPE scaling.
        model_len = target.supported_length
        if draft is None:
            return cls(per_pos, 0, 2, 0, 0, model_len)
        # Buffered draft context (rows flush before they draft): a row in an AR stretch keeps
        # only its latest half when the next round could overflow it (`PendingContext`), so room
        # for four blocks trims it once per block of rounds or less; with room for two (34
        # positions at block 16) it trimmed every other AR round (0.7% of a batch-1 CPU run, profiled).
        pending = max(64, 4 * (draft.block_size + 1))
        # A prompt's features wait until its row first drafts (`PendingContext.seed`): a request
        # at a temperature where drafting does not pay then never runs the draft over its prompt
        # (with drafting off, 16 rows at temperature 1 on a CPU: 0.930x AR appending them at once,
        # 0.992x with them waiting; benchmarks/engine_ar_overhead.py, noisy).
        # Prompts up to this long wait; a longer one enters the draft context at prefill.
        prompt = PROMPT_WAIT_POSITIONS
        sliding = sum(draft.layer_window(i) is not None for i in range(draft.num_hidden_layers))
        dtype = draft_dtype or target_dtype
        draft_pos = cache_bytes(draft.num_hidden_layers - sliding, draft.num_key_value_heads, draft.head_dim, dtype, 1)
        ring = cache_bytes(sliding, draft.num_key_value_heads, draft.head_dim, dtype, draft.window_span) if sliding else 0
        scratch = draft.tree.scratch_slots if isinstance(draft, ChainDraftConfig) and draft.tree is not None else 0
        feature_bytes = len(draft.target_layer_ids) * draft.hidden_size * 4
        return cls(per_pos, draft_pos, draft.block_size + 2, pending, (pending + prompt) * feature_bytes, model_len,
                   ring, scratch, prompt)

    def slot_bytes(self, max_model_len: int) -> int:
        return (self.target_per_position * (max_model_len + self.margin) + self.draft_kv_bytes(max_model_len)
                + self.pending_bytes)

    def draft_kv_bytes(self, max_model_len: int) -> int:
        """The draft's K/V in one slot: full layers over the slot's positions, the buffered
        context and a tree's scratch, sliding layers their fixed ring."""
        if not self.draft_per_position and not self.draft_window_bytes:
            return 0
        positions = max_model_len + self.margin + self.pending_positions + self.draft_scratch_positions
        return self.draft_per_position * positions + self.draft_window_bytes

    def longest_fitting(self, budget: int) -> int:
        """The longest max_model_len one slot of which fits in `budget` bytes (may be < 1)."""
        fixed = self.slot_bytes(0)
        return (budget - fixed) // (self.target_per_position + self.draft_per_position)


@dataclass(frozen=True)
class MemoryPlan:
    shapes: KVShapes
    slots: int
    max_model_len: int
    budget_bytes: int
    source: str           # where the budget came from, for the start-up line
    capped: bool = False  # max_model_len lowered from the model's to fit

    @property
    def slot_bytes(self) -> int:
        return self.shapes.slot_bytes(self.max_model_len)

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def describe(self) -> str:
        line = (f"KV plan: {self.slots} slots x {self.max_model_len} positions = {self.total_bytes / GIB:.2f} GiB "
                f"({self.slot_bytes / GIB:.3f} GiB per slot) of a {self.budget_bytes / GIB:.2f} GiB budget "
                f"[{self.source}]")
        if self.capped:
            line += (f"; max_model_len capped from the model's {self.shapes.model_max_len} to what fits "
                     "(raise the memory budget for longer contexts)")
        return line


def plan_kv(shapes: KVShapes, budget_bytes: int, max_num_seqs: int, max_model_len: int | None = None,
            source: str = "") -> MemoryPlan:
    """Slots x length for `budget_bytes`; BlockspecError if not one sequence fits."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise BlockspecError(f"max_num_seqs (max_running) must be a positive integer, got {max_num_seqs!r}")
    limit = shapes.model_max_len
    hint = "lower --max-model-len or raise --gpu-memory-utilization / --kv-memory-gb"
    capped = False
    if max_model_len is not None:
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) \
                or not MIN_MODEL_LEN <= max_model_len <= limit:
            raise BlockspecError(f"max_model_len must be an integer in {MIN_MODEL_LEN}..{limit} (the model's "
                                 f"max_position_embeddings, RoPE scaling included), got {max_model_len!r}")
        length = max_model_len
    else:
        length = min(limit, shapes.longest_fitting(budget_bytes))
        capped = length < limit
        if length < MIN_MODEL_LEN:
            length = limit  # report the model's own length in the error below
    fit = budget_bytes // shapes.slot_bytes(length) if budget_bytes > 0 else 0
    if fit < 1:
        where = f" [{source}]" if source else ""
        raise BlockspecError(
            f"the KV budget of {budget_bytes / GIB:.4f} GiB{where} holds no request slot: one sequence of "
            f"{length} positions needs {shapes.slot_bytes(length) / GIB:.4f} GiB; {hint}")
    return MemoryPlan(shapes, min(max_num_seqs, fit), length, budget_bytes, source, capped)


# -- the budget ---------------------------------------------------------------------------

def device_memory(device: torch.device | str) -> tuple[int, int]:
    """(total, free) bytes of the memory `device` allocates from."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    if device.type == "cpu":
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
        if "MemTotal" not in info or "MemAvailable" not in info:
            raise BlockspecError("cannot read MemTotal / MemAvailable from /proc/meminfo: give --kv-memory-gb")
        return info["MemTotal"], info["MemAvailable"]
    raise BlockspecError(f"cannot measure free memory on device {device}: give --kv-memory-gb")


def kv_budget(total: int, free: int, utilization: float, reserve: int) -> int:
    """utilization x total, less what is in use now (total - free) and the activation reserve."""
    return int(utilization * total) - (total - free) - reserve


def activation_reserve(target: TargetConfig, max_num_seqs: int, block: int, tree_keys: int = 0) -> int:
    """Memory kept for the forward passes: float32 logits and probabilities of the widest
    verification (every slot, a block plus the bonus) and a fixed workspace. A draft tree
    (tree_keys: the positions a row's queries may see) verifies under a dense mask, one bool
    per (slot, query, key), which attention expands to an additive float32 mask."""
    tree_mask = max_num_seqs * block * tree_keys * (1 + 4)
    return 2 * max_num_seqs * (block + 1) * target.vocab_size * 4 + tree_mask + WORKSPACE_BYTES


def lazy_weight_copies(*models: torch.nn.Module | None) -> int:
    """Bytes of the concatenated weights FusedLinears will build on first use on the CPU
    (fused QKV, gate-up, the draft's context K/V; none on a GPU) and that are not built
    yet: memory the first request takes beside the weights, so it is kept out of the KV budget."""
    total = 0
    for model in models:
        for module in model.modules() if model is not None else ():
            for value in vars(module).values():
                if isinstance(value, FusedLinears):
                    total += value.pending_copy_bytes()
    return total


def memory_budget(device: torch.device | str, utilization: float | None, kv_memory_gb: float | None,
                  reserve: int) -> tuple[int, str]:
    """(KV budget bytes, how it was found): --kv-memory-gb as given, else utilization x the
    device's memory less what is in use now (call it after the weights are loaded)."""
    if kv_memory_gb is not None:
        if utilization is not None:
            raise BlockspecError("give --kv-memory-gb or --gpu-memory-utilization, not both")
        if not kv_memory_gb > 0:
            raise BlockspecError(f"--kv-memory-gb must be > 0, got {kv_memory_gb}")
        return int(kv_memory_gb * GIB), f"--kv-memory-gb {kv_memory_gb:g}"
    if utilization is None and torch.device(device).type == "cpu":
        total, free = device_memory(device)
        budget = min(CPU_DEFAULT_KV_BYTES, int(CPU_DEFAULT_FREE_SHARE * (free - reserve)))
        return budget, (f"CPU default: the smaller of {CPU_DEFAULT_KV_BYTES / GIB:g} GiB and "
                        f"{CPU_DEFAULT_FREE_SHARE:g} x ({free / GIB:.1f} GiB free - {reserve / GIB:.1f} GiB reserve); "
                        "raise it with --kv-memory-gb or --gpu-memory-utilization")
    utilization = DEFAULT_UTILIZATION if utilization is None else utilization
    if not 0 < utilization <= 1:
        raise BlockspecError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    total, free = device_memory(device)
    budget = kv_budget(total, free, utilization, reserve)
    kind = "GPU" if torch.device(device).type == "cuda" else "host"
    return budget, (f"{utilization:g} x {total / GIB:.1f} GiB {kind} memory - {(total - free) / GIB:.1f} GiB in use "
                    f"- {reserve / GIB:.1f} GiB reserve for activations and fused weight copies")


def plan_for_models(target: torch.nn.Module, draft: torch.nn.Module | None, max_num_seqs: int,
                    max_model_len: int | None, kv_memory_gb: float | None,
                    utilization: float | None) -> MemoryPlan:
    """The plan of a loaded target (and draft): their shapes and dtypes, the memory free now."""
    shapes = KVShapes.of(target.config, target.dtype, draft.config if draft is not None else None,
                         draft.dtype if draft is not None else None)
    block = draft.config.block_size if draft is not None else 0
    rows = max_num_seqs if isinstance(max_num_seqs, int) and max_num_seqs > 0 else 1   # plan_kv names a bad one
    tree = getattr(draft.config, "tree", None) if draft is not None else None
    keys = (max_model_len or target.config.max_position_embeddings) if tree is not None else 0
    reserve = activation_reserve(target.config, rows, block, keys) + lazy_weight_copies(target, draft)
    budget, source = memory_budget(target.device, utilization, kv_memory_gb, reserve)
    return plan_kv(shapes, budget, max_num_seqs, max_model_len, source)
