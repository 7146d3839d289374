"""The KV memory plan with the real Qwen3-8B and Llama-3.1-8B shapes (the published
config.json values) and 80 / 141 GiB GPUs: it fits, reports slots x length, never
allocates more than its budget (checked by allocating the pool on the meta device), caps
max_model_len to what fits, and refuses a plan that cannot hold one sequence."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import DraftConfig, EagleTree, TargetConfig
from blockspec.engine.memory import (DEFAULT_UTILIZATION, GIB, PROMPT_WAIT_POSITIONS, KVShapes, activation_reserve,
                                     kv_budget, plan_kv)
from blockspec.engine import memory
from blockspec.engine.slots import SlotPool
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import Eagle3Drafter
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from conftest import make_eagle3, make_target

# Shape fields of Qwen/Qwen3-8B and meta-llama/Llama-3.1-8B config.json (bfloat16).
QWEN3_8B = TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, qk_norm=True, torch_dtype="bfloat16")
LLAMA31_8B = TargetConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=131072, torch_dtype="bfloat16")
# Per position: K and V x layers x 8 KV heads x head_dim 128 x 2 bytes.
PER_POSITION = {"qwen3": 2 * 36 * 8 * 128 * 2, "llama": 2 * 32 * 8 * 128 * 2}
MAX_NUM_SEQS = 32


def meta_target(cfg: TargetConfig) -> TargetModel:
    with torch.device("meta"):
        return TargetModel(cfg).to(torch.bfloat16)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gpu_plan(model: TargetModel, gpu_gib: int, max_model_len: int | None = None):
    """The plan Engine makes on a GPU of `gpu_gib` GiB holding only these weights."""
    total = gpu_gib * GIB
    reserve = activation_reserve(model.config, MAX_NUM_SEQS, 0)
    budget = kv_budget(total, total - weight_bytes(model), DEFAULT_UTILIZATION, reserve)
    shapes = KVShapes.of(model.config, model.dtype)
    return plan_kv(shapes, budget, MAX_NUM_SEQS, max_model_len, source=f"{gpu_gib} GiB"), budget, reserve


@pytest.mark.parametrize("cfg", [QWEN3_8B, LLAMA31_8B], ids=["qwen3-8b", "llama3.1-8b"])
@pytest.mark.parametrize("gpu_gib", [80, 141])
def test_the_plan_fits_the_gpu(cfg, gpu_gib):
    model = meta_target(cfg)
    plan, budget, reserve = gpu_plan(model, gpu_gib)
    length = cfg.max_position_embeddings
    slot = PER_POSITION[cfg.model_type] * (length + 2)   # + the AR margin
    assert plan.max_model_len == length and not plan.capped
    assert plan.slot_bytes == slot and plan.slots == min(MAX_NUM_SEQS, budget // slot) >= 1
    assert plan.total_bytes <= budget
    assert weight_bytes(model) + reserve + plan.total_bytes <= DEFAULT_UTILIZATION * gpu_gib * GIB
    assert f"{plan.slots} slots x {length} positions" in plan.describe()
    # Blind preallocation (32 x the model's length) would not fit: 180 GiB for Qwen3-8B, 512 for Llama.
    assert MAX_NUM_SEQS * slot > gpu_gib * GIB or cfg is QWEN3_8B
    pool = SlotPool(model, None, plan)   # allocated on the meta device: exactly the plan's bytes
    assert pool.cache.nbytes == plan.total_bytes and pool.rows == plan.slots


def test_expected_slot_counts():
    # Hand arithmetic: Qwen3-8B on 80 GiB: 0.9 x 80 - 15.3 GiB weights - ~1 GiB reserve = 55.7 GiB
    # of KV; one 40962-position slot is 5.63 GiB: 9 slots. Llama-3.1-8B: 16.0 GiB per slot: 3.
    assert gpu_plan(meta_target(QWEN3_8B), 80)[0].slots == 9
    assert gpu_plan(meta_target(LLAMA31_8B), 80)[0].slots == 3
    assert gpu_plan(meta_target(LLAMA31_8B), 141)[0].slots == 6


def zlab_8b_draft() -> tuple[DraftConfig, DraftModel]:
    """The z-lab 5-layer DFlash draft shape for Qwen3-8B, on the meta device."""
    cfg = DraftConfig(layout="zlab", block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                      num_target_layers=36, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    with torch.device("meta"):
        return cfg, DraftModel(cfg).to(torch.bfloat16)


def test_with_a_draft_the_slot_holds_its_cache_too():
    model = meta_target(QWEN3_8B)
    draft_cfg, draft = zlab_8b_draft()
    shapes = KVShapes.of(QWEN3_8B, torch.bfloat16, draft_cfg, torch.bfloat16)
    budget = 60 * GIB
    plan = plan_kv(shapes, budget, MAX_NUM_SEQS)
    assert plan.total_bytes <= budget and plan.slots >= 1
    pool = SlotPool(model, draft, plan)
    allocated = pool.cache.nbytes + pool.draft_cache.nbytes
    assert allocated + plan.slots * shapes.pending_bytes == plan.total_bytes   # + the lazily made buffer


def test_the_slot_budgets_a_waiting_prompt():
    """A prompt of up to prompt_positions waits for its row's first draft as target
    features (float32): their bytes are in every slot's budget, beside the AR rounds' buffer."""
    draft_cfg, _ = zlab_8b_draft()
    shapes = KVShapes.of(QWEN3_8B, torch.bfloat16, draft_cfg, torch.bfloat16)
    feature_bytes = len(draft_cfg.target_layer_ids) * draft_cfg.hidden_size * 4
    assert shapes.prompt_positions == PROMPT_WAIT_POSITIONS
    assert shapes.pending_bytes == (shapes.pending_positions + shapes.prompt_positions) * feature_bytes
    assert KVShapes.of(QWEN3_8B, torch.bfloat16).prompt_positions == 0   # no draft, nothing waits


def test_an_ar_stretch_trims_its_buffered_context_rarely():
    """A gated engine's AR rounds buffer each row's feature; a full buffer keeps its latest
    `keep` (PendingContext). With room for two blocks (34 positions at block 16) it was
    trimmed every other AR round."""
    model = meta_target(QWEN3_8B)
    draft_cfg, draft = zlab_8b_draft()
    pool = SlotPool(model, draft, plan_kv(KVShapes.of(QWEN3_8B, torch.bfloat16, draft_cfg, torch.bfloat16),
                                          60 * GIB, 4))
    pending = pool.pending
    rounds_between_trims = pending.capacity - pending.window - pending.keep
    assert rounds_between_trims >= draft_cfg.block_size   # was 2


def test_max_model_len_is_capped_to_what_fits():
    model = meta_target(LLAMA31_8B)
    plan, budget, _ = gpu_plan(model, 24)   # 0.9 x 24 - 15 - 1 GiB: ~5.6 GiB of KV, a third of one full slot
    assert plan.capped and plan.slots == 1 and 2 < plan.max_model_len < LLAMA31_8B.max_position_embeddings
    assert plan.total_bytes <= budget < PER_POSITION["llama"] * (plan.max_model_len + 3)   # the longest that fits
    assert "capped" in plan.describe()


def test_a_plan_without_room_for_one_sequence_is_a_clear_error():
    model = meta_target(LLAMA31_8B)
    with pytest.raises(BlockspecError, match="holds no request slot: one sequence of 131072 positions needs 16"):
        gpu_plan(model, 24, max_model_len=131072)
    with pytest.raises(BlockspecError, match="holds no request slot"):
        gpu_plan(model, 16)   # the weights alone use 0.9 x 16 GiB: a negative budget
    with pytest.raises(BlockspecError, match="max_model_len must be an integer in 2..131072"):
        gpu_plan(model, 80, max_model_len=200_000)
    with pytest.raises(BlockspecError, match="max_num_seqs"):
        plan_kv(KVShapes.of(LLAMA31_8B, torch.bfloat16), GIB, 0)


def test_cpu_default_budget_is_modest(monkeypatch):
    """On a CPU host the default KV budget is the smaller of 4 GiB and a quarter of the free memory
    (vLLM's CPU backend), not 0.9 x the host: a 131k-context checkpoint must not take the machine."""
    from blockspec.engine import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: (256 * GIB, 100 * GIB))
    budget, source = memory.memory_budget("cpu", None, None, GIB)
    assert budget == 4 * GIB and "CPU default" in source and "--kv-memory-gb" in source
    monkeypatch.setattr(memory, "device_memory", lambda device: (16 * GIB, 9 * GIB))
    assert memory.memory_budget("cpu", None, None, GIB)[0] == 2 * GIB   # a quarter of (9 - 1) GiB
    assert memory.memory_budget("cpu", 0.5, None, GIB)[0] == int(0.5 * 16 * GIB) - 7 * GIB - GIB   # as asked
    assert memory.memory_budget("cpu", None, 10.0, GIB)[0] == 10 * GIB
    plan = plan_kv(KVShapes.of(LLAMA31_8B, torch.bfloat16), memory.memory_budget("cpu", None, None, GIB)[0], 32)
    assert plan.total_bytes <= 2 * GIB and plan.max_model_len < 131072   # capped to what the budget holds


@pytest.mark.parametrize("types", [("sliding_attention",) * 5, ("full_attention", "sliding_attention") * 2
                                   + ("full_attention",)])
def test_a_windowed_draft_counts_only_its_window(types):
    """Issue 34: at 4k context a sliding layer holds window + block - 1 positions per slot, not
    the whole context; the plan counts exactly what the pool allocates."""
    model = meta_target(QWEN3_8B)
    full_cfg = DraftConfig(layout="zlab", block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                           num_target_layers=36, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    cfg = DraftConfig(**{**full_cfg.__dict__, "layer_types": types, "sliding_window": 512})
    full = KVShapes.of(QWEN3_8B, torch.bfloat16, full_cfg, torch.bfloat16)
    windowed = KVShapes.of(QWEN3_8B, torch.bfloat16, cfg, torch.bfloat16)
    length, sliding = 4096, types.count("sliding_attention")
    per_layer_position = 2 * 8 * 128 * 2
    positions = length + full.margin + full.pending_positions
    saved = sliding * per_layer_position * (positions - cfg.window_span)
    assert full.slot_bytes(length) - windowed.slot_bytes(length) == saved
    assert full.draft_kv_bytes(length) - windowed.draft_kv_bytes(length) == saved
    with torch.device("meta"):
        draft = DraftModel(cfg).to(torch.bfloat16)
    plan = plan_kv(windowed, 60 * GIB, MAX_NUM_SEQS, length)
    pool = SlotPool(model, draft, plan)
    allocated = pool.cache.nbytes + pool.draft_cache.nbytes
    assert allocated + plan.slots * windowed.pending_bytes == plan.total_bytes
    assert pool.draft_cache.nbytes == plan.slots * windowed.draft_kv_bytes(length)   # the draft's share alone


def test_a_draft_tree_slot_holds_its_expanded_levels(monkeypatch):
    """An EAGLE-3 tree's levels take (num_steps - 1) x topk draft positions after a row's
    committed ones: the plan counts exactly what the pool allocates."""
    target = make_target()
    chain = Eagle3Drafter.pair(make_eagle3(target), target, 6)
    tree = chain.with_tree(EagleTree(topk=4, num_steps=5, num_draft_tokens=7))   # 6 drafts, as the chain
    shapes = {d: KVShapes.of(target.config, target.dtype, d.config, d.dtype) for d in (chain, tree)}
    assert shapes[tree].draft_scratch_positions == 16 and shapes[chain].draft_scratch_positions == 0
    per_position = shapes[chain].draft_per_position
    assert shapes[tree].slot_bytes(40) - shapes[chain].slot_bytes(40) == 16 * per_position
    plan = plan_kv(shapes[tree], 10 * shapes[tree].slot_bytes(40), 3, 40)
    pool = SlotPool(target, tree, plan)
    assert pool.cache.nbytes + pool.draft_cache.nbytes + plan.slots * shapes[tree].pending_bytes == plan.total_bytes
    # the tree verifies its 7 queries per row under a dense mask over the row's 40 keys: the
    # bool mask and its float32 form (5 bytes an entry) are kept out of the KV budget
    reserves = []
    monkeypatch.setattr(memory, "memory_budget", lambda device, utilization, kv_gb, reserve:
                        (reserves.append(reserve) or GIB, "test"))
    for draft in (chain, tree):
        memory.plan_for_models(target, draft, 3, 40, None, 0.5)
    assert reserves[1] - reserves[0] == 3 * 7 * 40 * 5
