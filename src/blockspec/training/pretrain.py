"""Pretraining recipe for the embedded target (a small Qwen3 code model).

One loop that runs unchanged on CPU or a CUDA GPU: AdamW, cosine schedule with
warmup, gradient clipping, gradient accumulation, optional bf16 autocast,
periodic validation loss, checkpoint + resume, a progress bar. The best model
so far is exported in Hugging Face format (bf16) with its tokenizer, so the run
can be stopped at any moment and still leaves a shippable model.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

from blockspec.config import TargetConfig
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_target, read_tensors, resolve_device, save_target, write_tensors
from blockspec.models.target import TargetModel
from blockspec.training.corpus import EOS, iter_texts


@dataclass
class PretrainConfig:
    corpus: str = "runs/corpus"
    tokenizer: str = "runs/tokenizer"
    out: str = "runs/pretrain"
    init_from: str | None = None      # continue from an exported HF model (weights only)
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    seq_len: int = 768
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    max_steps: int = 800
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 16
    seed: int = 1234
    bf16: bool = False
    device: str = "auto"
    threads: int = 0

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "seq_len",
                     "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches"):
            if getattr(self, name) <= 0:
                raise BlockspecError(f"pretrain: {name} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise BlockspecError("pretrain: num_heads must be a multiple of num_kv_heads")
        if not 0 < self.lr < 1:
            raise BlockspecError("pretrain: lr must be in (0, 1)")


def lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def tokenize_split(corpus: Path, tokenizer_dir: Path, split: str, cache_dir: Path) -> torch.Tensor:
    """All files of a split as one token stream, files separated by EOS (cached)."""
    cache = cache_dir / f"{split}_tokens.safetensors"
    if cache.is_file():
        return read_tensors_file(cache)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    texts = list(iter_texts(corpus / f"{split}.jsonl"))
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": stream}, str(cache))
    return stream


def read_tensors_file(path: Path) -> torch.Tensor:
    return load_file(str(path))["tokens"]


def model_config(cfg: PretrainConfig, vocab_size: int, eos_id: int) -> TargetConfig:
    return TargetConfig.from_dict({
        "model_type": "qwen3", "vocab_size": vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "eos_token_id": eos_id, "bos_token_id": None, "pad_token_id": 1,
    })


def init_weights(model: TargetModel) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by depth."""
    std = 0.02
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scale = 1 / math.sqrt(2 * model.config.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            nn.init.normal_(p, 0.0, std * scale)


def batch_at(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model: TargetModel, val: torch.Tensor, cfg: PretrainConfig, device: torch.device) -> float:
    model.eval()
    # Fixed, evenly spaced windows so every evaluation sees the same tokens.
    n = cfg.eval_batches * cfg.batch_size
    step = max(1, (len(val) - cfg.seq_len - 1) // n)
    losses = []
    for i in range(cfg.eval_batches):
        starts = [(i * cfg.batch_size + j) * step for j in range(cfg.batch_size)]
        x = torch.stack([val[s:s + cfg.seq_len + 1] for s in starts]).long().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def export(model: TargetModel, cfg: PretrainConfig, dest: Path, info: dict) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_target(model, tmp, dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(cfg.tokenizer) / name, tmp / name)
    gen = {"eos_token_id": model.config.eos_token_id[0], "pad_token_id": 1, "do_sample": False,
           "max_new_tokens": 128}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (tmp / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def pretrain(cfg: PretrainConfig) -> dict:
    cfg.validate()

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train = tokenize_split(Path(cfg.corpus), Path(cfg.tokenizer), "train", out)
    val = tokenize_split(Path(cfg.corpus), Path(cfg.tokenizer), "val", out)
    tok = Tokenizer.from_file(str(Path(cfg.tokenizer) / "tokenizer.json"))

    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        model = load_target(cfg.init_from, dtype="float32").requires_grad_(True)
    else:
        model = TargetModel(model_config(cfg, tok.get_vocab_size(), tok.token_to_id(EOS)))
        init_weights(model)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    state_dir = out / "state"
    step, best, elapsed, tokens, history = 0, float("inf"), 0.0, 0, []
    if (state_dir / "model.safetensors").is_file():
        model.load_state_dict(read_tensors(state_dir, "resume"), strict=False)
        opt.load_state_dict(torch.load(state_dir / "optimizer.pt", weights_only=True))
        meta = json.loads((state_dir / "meta.json").read_text())
        step, best, elapsed, tokens, history = (meta["step"], meta["best"], meta["elapsed"],
                                                meta["tokens"], meta["history"])
    n_params = sum(p.numel() for p in model.parameters())
    log = open(out / "log.jsonl", "a")
    t_start = time.time() - elapsed
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn()) as bar:
        task = bar.add_task("pretrain", total=cfg.max_steps, completed=step)
        while step < cfg.max_steps:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss_sum = 0.0
            for _ in range(cfg.grad_accum):
                x = batch_at(train, cfg.batch_size, cfg.seq_len, gen).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    logits = model(x[:, :-1]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
                (loss / cfg.grad_accum).backward()
                loss_sum += loss.item() / cfg.grad_accum
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += cfg.batch_size * cfg.seq_len * cfg.grad_accum
            record = {"step": step, "loss": round(loss_sum, 4), "lr": lr_at(step - 1, cfg),
                      "grad_norm": round(grad_norm, 3), "tokens": tokens, "time_s": round(time.time() - t_start, 1)}
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                record["val_loss"] = round(evaluate(model, val, cfg, device), 4)
                history.append([step, record["val_loss"]])
                if record["val_loss"] < best:
                    best = record["val_loss"]
                    info = {"step": step, "tokens": tokens, "val_loss": best, "val_ppl": math.exp(best),
                            "train_time_s": round(time.time() - t_start, 1), "params": n_params,
                            "config": asdict(cfg)}
                    export(model, cfg, out / "best", info)
                state_dir.mkdir(exist_ok=True)
                write_tensors(state_dir, {k: v.detach().cpu() for k, v in model.state_dict().items()
                                          if k != "lm_head.weight"})
                torch.save(opt.state_dict(), state_dir / "optimizer.pt")
                (state_dir / "meta.json").write_text(json.dumps(
                    {"step": step, "best": best, "elapsed": time.time() - t_start, "tokens": tokens,
                     "history": history}))
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(task, completed=step, description=f"pretrain loss {loss_sum:.3f} best val {best:.3f}")
    return {"best_val_loss": best, "steps": step, "tokens": tokens, "params": n_params}
