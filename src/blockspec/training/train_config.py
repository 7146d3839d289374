"""`blockspec train`'s options and the pieces of a run that follow from them alone: the
draft's config, the warm start from the target, the LR schedule and the time budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from blockspec.config import DRAFT_LAYER_TYPES, DRAFT_METHODS, DraftConfig, Eagle3Config, default_aux_layer_ids
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel


TRAIN_METHODS = DRAFT_METHODS


@dataclass
class TrainConfig:
    method: str = "dflash"              # dflash (z-lab layout) | dspark (DeepSpec) | eagle3 (LlamaForCausalLMEagle3)
    target: str = ""                    # HF target directory ("" = the embedded target)
    data: str = ""                      # jsonl: prompt_ids/response_ids rows or conversations
    out: str = "runs/draft"             # where the draft (out/draft) and checkpoints go
    init_from: str | None = None        # continue from a saved draft
    block_size: int = 16                # zlab: includes the anchor; deepspec: gamma
    num_layers: int = 1                 # draft decoder layers
    intermediate_size: int = 0          # 0 = the target's
    num_heads: int = 0                  # 0 = the target's
    num_kv_heads: int = 0               # 0 = the target's
    draft_sliding_window: int = 0       # > 0: draft layers attend to the last W positions (sliding_attention)
    draft_layer_types: str = ""         # per layer "sliding_attention,full_attention,..."; "" = all sliding with a window
    target_layer_ids: str = ""          # "1,5" ; empty = design default for num_layers
    ttt_steps: int = 7                  # eagle3: unrolled training-time-test steps (and drafts per evaluated round)
    draft_vocab_size: int = 32000       # eagle3: draft vocabulary (most frequent trained tokens, <= the target's)
    markov_rank: int = 64               # DSpark: rank of the Markov head (0 = none)
    markov_head_type: str = "vanilla"   # DSpark Markov head: vanilla | gated
    confidence: bool = True             # DSpark: train the confidence head
    init_from_target: bool = False      # warm start: draft layers = the target's last layers (see warm_start)
    mask_token_id: int = -1             # -1 = the tokenizer's mask token, else the first unused embedding row
    loss_decay: float = 0.0             # 0 = the reference value for the block size
    distill: bool = False               # DFlash: learn the target's distribution too (DSpark's 0.1 CE + 0.9 L1)
    num_anchors: int = 32               # anchors (blocks) sampled per training sequence
    batch_size: int = 4                 # per process and micro-batch
    grad_accum: int = 1                 # micro-batches per optimizer step
    max_len: int = 512                  # tokens per example (longer ones are cut)
    pack: bool = False                  # pack several examples back to back per row (up to max_len tokens)
    epochs: float = 1.0                 # passes over the data (when max_steps is 0)
    max_steps: int = 0                  # 0 = from epochs
    lr: float = 6e-4                    # peak learning rate (AdamW)
    warmup_ratio: float = 0.04          # fraction of the steps with a linear warmup, then cosine decay
    weight_decay: float = 0.0           # AdamW weight decay
    grad_clip: float = 1.0              # clip the gradient norm to this (0 = off)
    eval_every: int = 100               # greedy acceptance (tau) on the held-out examples every N steps
    eval_examples: int = 16             # examples held out for evaluation (at most a fifth of small data)
    eval_new_tokens: int = 64           # tokens generated per held-out example in evaluation
    save_every: int = 100               # atomic checkpoint (model, optimizer, scheduler, data, RNG) every N steps
    resume: bool = False                # continue from <out>/checkpoints (exactly where it was saved)
    seed: int = 0                       # initial weights, data order and anchors
    bf16: bool = False                  # draft compute under bf16 autocast (the draft's weights stay fp32)
    device: str = "auto"                # cpu | cuda | auto (cuda when available)
    dtype: str = ""                     # frozen target: "" = bfloat16 on GPU (or with --bf16), float32 on CPU; auto = the checkpoint's
    fsdp: bool = False                  # shard the draft with FSDP2 instead of replicating it (DDP)
    grad_checkpoint: bool = False       # recompute draft layers in backward (activation checkpointing)
    ce_chunk: int = 4096                # trained slots per vocabulary-projection chunk; 0 = all at once
    logdir: str = ""                    # TensorBoard event files here (needs tensorboard)
    wandb: bool = False                 # log to Weights & Biases (needs wandb)
    wandb_project: str = "blockspec"    # Weights & Biases project
    threads: int = 0                    # torch CPU threads (0 = torch's default)
    time_budget_s: float = 0.0          # > 0: fit max_steps to this wall time (timed over the first steps)
    halt_at_step: int = 0               # > 0: stop after this step without saving, as a killed run would

    def validate(self) -> None:
        if self.method not in TRAIN_METHODS:
            raise BlockspecError(f"train: method must be one of {', '.join(TRAIN_METHODS)}, got {self.method!r}")
        if not self.data:
            raise BlockspecError("train: --data is required (jsonl of prompt_ids/response_ids rows or conversations)")
        for name in ("block_size", "num_layers", "num_anchors", "batch_size", "grad_accum", "max_len", "eval_every",
                     "save_every"):
            if getattr(self, name) <= 0:
                raise BlockspecError(f"train: {name} must be > 0")
        if self.method == "dflash" and self.block_size < 2:
            raise BlockspecError("train: a z-lab DFlash block needs block_size >= 2 (it includes the anchor)")
        if self.init_from and self.init_from_target:   # both would start the weights: one would be ignored
            raise BlockspecError("train: --init-from continues a saved draft; drop --init-from-target "
                                 "(or pass --no-init-from-target)")
        if self.distill and self.method != "dflash":   # DSpark always learns it; EAGLE-3 learns the data's tokens
            raise BlockspecError(f"train: --distill is for DFlash drafts (a {self.method} draft has its own loss)")
        if self.method == "eagle3":
            if self.num_layers != 1:
                raise BlockspecError("train: an EAGLE-3 draft has one decoder layer (--num-layers 1)")
            if self.init_from_target:
                raise BlockspecError("train: --init-from-target is for DFlash / DSpark drafts, not EAGLE-3")
            if self.ttt_steps <= 0 or self.draft_vocab_size <= 0:
                raise BlockspecError("train: ttt_steps and draft_vocab_size must be > 0")
            if self.mask_token_id != -1:
                raise BlockspecError("train: --mask-token-id does not apply to EAGLE-3 drafts")
        if self.draft_sliding_window < 0:
            raise BlockspecError("train: --draft-sliding-window must be > 0 (0: no window)")
        if self.method == "eagle3" and (self.draft_sliding_window or self.draft_layer_types):
            raise BlockspecError("train: sliding-window layers are for DFlash / DSpark drafts, not EAGLE-3")
        if not 0 < self.lr < 1:
            raise BlockspecError("train: lr must be in (0, 1)")
        for name in ("time_budget_s", "ce_chunk", "halt_at_step"):
            if getattr(self, name) < 0:
                raise BlockspecError(f"train: {name} must be >= 0")

    @property
    def layout(self) -> str:
        return "zlab" if self.method == "dflash" else "deepspec"

    def decay(self, num_drafts: int) -> float:
        # Reference lambdas: 7 for B=16, 5 for B=10, 4 for B=8 (and DeepSpec gamma 7).
        if self.loss_decay > 0:
            return self.loss_decay
        return 7.0 if num_drafts >= 15 else (5.0 if num_drafts >= 9 else 4.0)

    def target_dtype(self, device: torch.device) -> str:
        return self.dtype or ("bfloat16" if self.bf16 or device.type == "cuda" else "float32")


def distinct_layer_ids(layers: int, wanted: int, design: list[int]) -> list[int]:
    """The design's layer ids (docs/design.md section 2) when they are distinct; on a target too
    shallow for that (4 layers, 2 draft layers: [1, 1]) the same span, 1..layers-2, spread over
    distinct layers, then the whole stack; an error if the target has fewer layers than asked."""
    if len(set(design)) == len(design):
        return design
    for low, high in ((1, layers - 2), (0, layers - 1)):
        if high - low + 1 >= wanted:
            return [low + round(i * (high - low) / max(wanted - 1, 1)) for i in range(wanted)]
    raise BlockspecError(f"train: {wanted} target layers to capture, but the target has only {layers}: "
                         "lower --num-layers or give --target-layer-ids")


def with_window(cfg: TrainConfig, draft: DraftConfig) -> DraftConfig:
    """`draft` with the flags' sliding-window layers (unchanged without the flags)."""
    if not cfg.draft_sliding_window and not cfg.draft_layer_types:
        return draft
    n = draft.num_hidden_layers
    types = (tuple(t.strip() for t in cfg.draft_layer_types.split(",")) if cfg.draft_layer_types
             else ("sliding_attention",) * n)
    if len(types) != n:
        raise BlockspecError(f"train: --draft-layer-types lists {len(types)} layers, the draft has {n}")
    if any(t not in DRAFT_LAYER_TYPES for t in types):
        raise BlockspecError(f"train: --draft-layer-types entries must be {' or '.join(DRAFT_LAYER_TYPES)}, "
                             f"got {cfg.draft_layer_types!r}")
    window = cfg.draft_sliding_window or None
    if window is None and "sliding_attention" in types:
        raise BlockspecError("train: sliding_attention layers need --draft-sliding-window W")
    if window is not None and "sliding_attention" not in types:
        raise BlockspecError("train: --draft-sliding-window needs sliding_attention layers in --draft-layer-types")
    return replace(draft, layer_types=types, sliding_window=window)


def draft_config_for(cfg: TrainConfig, target: TargetModel, mask_token_id: int) -> DraftConfig:
    tc = target.config
    ids = ([int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids
           else distinct_layer_ids(tc.num_hidden_layers, cfg.num_layers, tc.default_layer_ids(cfg.num_layers)))
    if len(set(ids)) != len(ids) or not all(0 <= i < tc.num_hidden_layers for i in ids):
        raise BlockspecError(f"train: target_layer_ids {ids} must be distinct layers of the target's "
                             f"0..{tc.num_hidden_layers - 1}")
    dspark = cfg.method == "dspark"
    return with_window(cfg, DraftConfig(
        layout=cfg.layout, block_size=cfg.block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
        num_target_layers=tc.num_hidden_layers, hidden_size=tc.hidden_size,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads or tc.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps, rope=tc.rope,
        markov_rank=cfg.markov_rank if dspark else 0, markov_head_type=cfg.markov_head_type,
        enable_confidence_head=dspark and cfg.confidence))


def eagle3_config_for(cfg: TrainConfig, target: TargetModel) -> Eagle3Config:
    """The EAGLE-3 draft's shape: the target's attention shape and RoPE, one layer."""
    tc = target.config
    ids = ([int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids
           else default_aux_layer_ids(tc.num_hidden_layers))
    return Eagle3Config(
        hidden_size=tc.hidden_size, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=cfg.num_heads or tc.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, draft_vocab_size=min(cfg.draft_vocab_size, tc.vocab_size),
        target_hidden_size=tc.hidden_size, target_layer_ids=ids, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps, rope=tc.rope)


@torch.no_grad()
def warm_start(draft: DraftModel, target: TargetModel) -> None:
    """Start the draft as a copy of the target's top: draft layer i takes the weights
    of target layer L-n+i, `fc` passes the deepest captured feature through, and
    `hidden_norm` is that layer's input norm. The context K/V then equal what the
    copied target layer would compute from that feature; training starts from a
    model that already maps hidden states to the shared lm_head."""
    dc, tc = draft.config, target.config
    n = dc.num_hidden_layers
    if (dc.hidden_size, dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim) != (
            tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim):
        raise BlockspecError("train: --init-from-target needs the draft's layer shape to equal the target's")
    if tc.qkv_bias or tc.o_bias or not tc.qk_norm:
        raise BlockspecError("train: --init-from-target needs a Qwen3-style target (q/k norm, no biases)")
    for i, layer in enumerate(draft.layers):
        layer.load_state_dict(target.layers[tc.num_hidden_layers - n + i].state_dict())
    deepest = max(range(len(dc.target_layer_ids)), key=lambda j: dc.target_layer_ids[j])
    h = dc.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
    draft.hidden_norm.weight.copy_(target.layers[tc.num_hidden_layers - n].input_layernorm.weight)
    draft.norm.weight.copy_(target.norm.weight)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


class Schedule:
    """LambdaLR's factor at a step: warmup then cosine over `total` steps (a time budget may
    shorten `total` mid-run; the schedule follows)."""

    def __init__(self, cfg: TrainConfig, total: int) -> None:
        self.cfg, self.total = cfg, total

    def __call__(self, step: int) -> float:
        return lr_at(step, self.total, self.cfg) / self.cfg.lr


def scheduler_state(sched: torch.optim.lr_scheduler.LambdaLR) -> dict:
    """The scheduler's position (JSON): its factor function is rebuilt from the config."""
    return {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}


BUDGET_CALIBRATION_STEPS = 20


def fit_to_budget(cfg: TrainConfig, step: int, total: int, run_start_step: int, run_s: float,
                  elapsed_s: float) -> int:
    """The step count that ends training inside cfg.time_budget_s: once, after the first
    steps of this run are timed (with 15% left for evaluations and saving), and as a
    hard stop when the budget is spent anyway."""
    if cfg.time_budget_s <= 0:
        return total
    if elapsed_s >= cfg.time_budget_s:
        return step
    if step - run_start_step == BUDGET_CALIBRATION_STEPS:
        per_step = run_s / BUDGET_CALIBRATION_STEPS
        return min(total, step + max(1, int(0.85 * (cfg.time_budget_s - elapsed_s) / per_step)))
    return total
