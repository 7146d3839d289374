"""One training loop for DFlash / DSpark drafters: one CPU process or
`torchrun --nproc_per_node N` (DDP semantics: gloo on CPU, nccl on GPU) with no
code change.

Each step runs the frozen target online over the batch to get the selected
layers' features (and its next-token distributions for DSpark), samples fresh
random anchors, and trains all blocks of every sequence in one packed draft
forward (mask in anchors.py). Drafts are written directly in the z-lab
(DFlash) or DeepSpec (DSpark) format.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rich.progress import Progress

from blockspec.config import DRAFT_METHODS, DraftConfig, SamplingParams
from blockspec.decoding.acceptance import AcceptanceStats
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.interop import mask_token_of
from blockspec.models.checkpoint import (load_draft, load_target, read_tensors, resolve_device, save_draft,
                                        write_tensors)
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.anchors import pack_blocks, sample_anchors
from blockspec.training.data import Example, collate, load_examples
from blockspec.training.losses import LossParts, dflash_loss, dspark_loss, slot_weights


@dataclass
class TrainConfig:
    method: str = "dflash"              # dflash (z-lab layout) | dspark (DeepSpec layout)
    target: str = ""                    # HF target directory
    data: str = ""                      # regenerated jsonl (prompt_ids, response_ids)
    out: str = "runs/draft"
    init_from: str | None = None        # continue from a saved draft
    block_size: int = 16                # zlab: includes the anchor; deepspec: gamma
    num_layers: int = 1
    intermediate_size: int = 0          # 0 = the target's
    num_heads: int = 0                  # 0 = the target's
    num_kv_heads: int = 0
    target_layer_ids: str = ""          # "1,5" ; empty = design default for num_layers
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence: bool = True
    init_from_target: bool = False      # warm start: draft layers = the target's last layers (see warm_start)
    loss_decay: float = 0.0             # 0 = the reference value for the block size
    num_anchors: int = 32
    batch_size: int = 4
    grad_accum: int = 1
    max_len: int = 512
    epochs: float = 1.0
    max_steps: int = 0                  # 0 = from epochs
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_examples: int = 16
    eval_new_tokens: int = 64
    seed: int = 0
    bf16: bool = False
    device: str = "auto"                # cpu | cuda | auto (cuda when available)
    dtype: str = ""                     # frozen target: "" = bf16 if --bf16 else float32; auto = the checkpoint's
    threads: int = 0
    time_budget_s: float = 0.0          # > 0: fit max_steps to this wall time (timed over the first steps)

    def validate(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise BlockspecError(f"train: method must be dflash or dspark, got {self.method!r}")
        if not self.target or not self.data:
            raise BlockspecError("train: --target and --data are required")
        for name in ("block_size", "num_layers", "num_anchors", "batch_size", "grad_accum", "max_len", "eval_every"):
            if getattr(self, name) <= 0:
                raise BlockspecError(f"train: {name} must be > 0")
        if self.method == "dflash" and self.block_size < 2:
            raise BlockspecError("train: a z-lab DFlash block needs block_size >= 2 (it includes the anchor)")
        if not 0 < self.lr < 1:
            raise BlockspecError("train: lr must be in (0, 1)")
        if self.time_budget_s < 0:
            raise BlockspecError("train: time_budget_s must be >= 0")

    @property
    def layout(self) -> str:
        return "zlab" if self.method == "dflash" else "deepspec"

    def decay(self, num_drafts: int) -> float:
        # Reference lambdas: 7 for B=16, 5 for B=10, 4 for B=8 (and DeepSpec gamma 7).
        if self.loss_decay > 0:
            return self.loss_decay
        return 7.0 if num_drafts >= 15 else (5.0 if num_drafts >= 9 else 4.0)


def draft_config_for(cfg: TrainConfig, target: TargetModel, mask_token_id: int) -> DraftConfig:
    tc = target.config
    ids = ([int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids
           else tc.default_layer_ids(cfg.num_layers))
    dspark = cfg.method == "dspark"
    return DraftConfig(
        layout=cfg.layout, block_size=cfg.block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
        num_target_layers=tc.num_hidden_layers, hidden_size=tc.hidden_size,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads or tc.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps, rope=tc.rope,
        markov_rank=cfg.markov_rank if dspark else 0, markov_head_type=cfg.markov_head_type,
        enable_confidence_head=dspark and cfg.confidence)


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


def block_loss(draft: DraftModel, target: TargetModel, ids: torch.Tensor, loss_mask: torch.Tensor,
               decay: float, num_anchors: int, gen: torch.Generator) -> LossParts:
    """Loss of one batch: online target features, random anchors, one packed forward."""
    cfg = draft.config
    g, first = cfg.num_drafts, cfg.first_draft_slot
    with torch.no_grad():
        out = target(ids, capture=tuple(cfg.target_layer_ids))
    anchors, valid = sample_anchors(loss_mask.cpu(), g, num_anchors, gen)
    anchors, valid = anchors.to(ids.device), valid.to(ids.device)
    packed = pack_blocks(ids, anchors, valid, cfg.block_size, cfg.mask_token_id)
    hidden = draft(out.features, packed.block_ids, packed.positions, packed.mask, target.embed_tokens)
    b, a = anchors.shape
    h = hidden.view(b, a, cfg.block_size, -1)[:, :, first:first + g]           # [B, A, g, H]
    label_pos = anchors.unsqueeze(-1) + 1 + torch.arange(g, device=ids.device)  # token a+k+1 for draft k
    labels = ids.gather(1, label_pos.flatten(1)).view(b, a, g)
    weights = slot_weights(g, decay).to(ids.device).view(1, 1, g) * valid.unsqueeze(-1)
    logits = target.lm_head(h.to(target.dtype)).float()
    if draft.markov_head is None and draft.confidence_head is None:
        return dflash_loss(logits.flatten(0, 1), labels.flatten(0, 1), weights.flatten(0, 1))
    prev = torch.cat([ids.gather(1, anchors).unsqueeze(-1), labels[..., :-1]], dim=-1)  # teacher forcing
    if draft.markov_head is not None:
        logits = logits + draft.markov_head.teacher_forced(prev.flatten(0, 1), h.flatten(0, 1)).view_as(logits).float()
    # The target's distribution for token a+k+1 is its output at position a+k.
    target_probs = torch.softmax(out.logits.float(), dim=-1)
    t_probs = target_probs.gather(1, (label_pos - 1).flatten(1).unsqueeze(-1).expand(-1, -1, target_probs.shape[-1]))
    conf = None
    if draft.confidence_head is not None:
        conf = draft.confidence_logit(h, prev)
    return dspark_loss(logits, labels, weights, t_probs.view(b, a, g, -1), conf)


def sync_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Average gradients across ranks with one all-reduce over a flat buffer."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


@torch.no_grad()
def evaluate_acceptance(draft: DraftModel, target: TargetModel, examples: list[Example], new_tokens: int) -> dict:
    """Greedy speculative decoding on held-out prompts: tau and per-slot acceptance."""
    draft.eval()
    stats = AcceptanceStats()
    prompts = [e.ids[:e.response_start] for e in examples]
    out = generate(target, prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), draft=draft)
    for c in out.completions:
        stats.add_rounds(c.stats.accepted, c.stats.verified)
    draft.train()
    return {"tau": round(stats.tau, 4),
            "per_slot": [None if math.isnan(x) else round(x, 3) for x in stats.per_slot_acceptance()]}


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


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


def train(cfg: TrainConfig) -> dict:
    cfg.validate()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(cfg.device)
    use_cuda = device.type == "cuda"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True   # float32 training at tensor-core speed
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)

    target = load_target(cfg.target, dtype=cfg.dtype or ("bfloat16" if cfg.bf16 else "float32"), device=device)
    tokenizer = Tokenizer(cfg.target)
    if tokenizer.mask_token_id is None:
        raise BlockspecError("train: the target's tokenizer has no mask_token; add a reserved <|mask|> token")
    mask_token = mask_token_of(Path(cfg.target), tokenizer.mask_token_id)  # written next to its id (SGLang)
    if cfg.init_from:
        draft = load_draft(cfg.init_from, dtype="float32", target=target).requires_grad_(True)  # trained in fp32
    else:
        draft = DraftModel(draft_config_for(cfg, target, tokenizer.mask_token_id))
        if cfg.init_from_target:
            warm_start(draft, target)
    draft.to(device).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    examples = load_examples(Path(cfg.data), cfg.max_len)
    held_out, examples = examples[:cfg.eval_examples], examples[cfg.eval_examples:]
    mine = examples[rank::world]
    per_step = cfg.batch_size * cfg.grad_accum
    total = cfg.max_steps or max(1, int(cfg.epochs * len(mine) / per_step))
    decay = cfg.decay(draft.config.num_drafts)
    pad = tokenizer.pad_token_id or 0

    out = Path(cfg.out)
    state = out / "state"
    step, elapsed, history = 0, 0.0, []
    if (state / "model.safetensors").is_file():
        draft.load_state_dict(read_tensors(state, "resume"))
        opt.load_state_dict(torch.load(state / "optimizer.pt", weights_only=True))
        meta = json.loads((state / "meta.json").read_text())
        step, elapsed, history = meta["step"], meta["elapsed"], meta["history"]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.jsonl", "a") if rank == 0 else None
    t_start = time.time() - elapsed
    run_start, run_t0 = step, time.time()
    with Progress(disable=rank != 0) as bar:
        task = bar.add_task(f"train {cfg.method}", total=total, completed=step)
        while step < total:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            order = random.Random(cfg.seed * 7919 + step).sample(range(len(mine)), k=min(len(mine), per_step))
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * world + rank)
            parts = None
            for i in range(cfg.grad_accum):
                batch = [mine[j] for j in order[i * cfg.batch_size:(i + 1) * cfg.batch_size]] or [mine[0]]
                ids, loss_mask = collate(batch, pad)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    parts = block_loss(draft, target, ids.to(device), loss_mask.to(device), decay,
                                       cfg.num_anchors, gen)
                (parts.total / cfg.grad_accum).backward()
            if world > 1:
                sync_gradients(params, world)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            budgeted = fit_to_budget(cfg, step, total, run_start, time.time() - run_t0, time.time() - t_start)
            if world > 1 and cfg.time_budget_s > 0:   # every rank stops where rank 0 does
                shared = torch.tensor([budgeted], device=device)
                dist.broadcast(shared, 0)
                budgeted = int(shared.item())
            if budgeted != total:
                total = budgeted
                bar.update(task, total=total)
            assert parts is not None
            record = {"step": step, "loss": round(parts.total.item(), 4), "ce": round(parts.ce.item(), 4),
                      "lr": lr_at(step - 1, total, cfg), "grad_norm": round(grad_norm, 3),
                      "total": total, "time_s": round(time.time() - t_start, 1)}
            if parts.l1 is not None:
                record["l1"] = round(parts.l1.item(), 4)
            if parts.bce is not None:
                record["bce"] = round(parts.bce.item(), 4)
            if rank == 0 and (step % cfg.eval_every == 0 or step == total):
                record["eval"] = evaluate_acceptance(draft, target, held_out, cfg.eval_new_tokens)
                history.append([step, record["eval"]["tau"]])
                save_draft(draft, out / "draft", dtype="bfloat16", mask_token=mask_token)
                state.mkdir(parents=True, exist_ok=True)
                write_tensors(state, {k: v.detach().cpu() for k, v in draft.state_dict().items()})
                torch.save(opt.state_dict(), state / "optimizer.pt")
                (state / "meta.json").write_text(json.dumps(
                    {"step": step, "elapsed": time.time() - t_start, "history": history}))
                (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            bar.update(task, completed=step, description=f"train {cfg.method} loss {record['loss']:.3f}")
    result = {"steps": step, "total_steps": total, "history": history, "rank": rank, "world": world,
              "param_checksum": float(sum(p.detach().double().sum() for p in params))}
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return result
