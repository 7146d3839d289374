"""Pretraining recipe for the embedded target (a small Qwen3 code model).

One loop that runs unchanged on CPU or a CUDA GPU: AdamW, a cosine or
warmup-stable-decay (WSD) schedule, gradient clipping and accumulation, float32 or
bf16 autocast (`precision="auto"` times both on this machine at every start and
takes the faster), optional `torch.compile`, periodic validation loss, a progress
bar. The best model so far is exported in Hugging Face format (bf16) with its
tokenizer, so the run can be stopped at any moment and still leaves a shippable
model.

Interruption-proof: the batch of step `s` is drawn from a generator seeded by
`(seed, s)`, so the data position is the step itself; the run's state directory
(`state/`: weights, `meta.json` with step, tokens, schedule and history, and the
optimizer's moments as safetensors) lets a rerun of the same command continue
exactly. A campaign snapshot (`snapshot_state`: bf16 weights and `meta.json`, no
optimizer) is what gets committed; a run resumed from it starts its optimizer from
zero and re-warms the learning rate over `rewarm_steps`, which the WSD schedule's
constant phase makes harmless. Nothing here unpickles: every file is safetensors
or JSON.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
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
from blockspec.training.corpus import EOS, STDLIB, iter_rows

SCHEDULES = ("cosine", "wsd")
PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass
class PretrainConfig:
    corpus: str = "runs/corpus"
    tokenizer: str = "runs/tokenizer"
    out: str = "runs/pretrain"
    init_from: str | None = None      # continue from an exported HF model (weights only)
    resume_from: str | None = None    # a campaign snapshot (snapshot_state) when out/ has no state yet
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
    schedule: str = "cosine"
    warmup_steps: int = 50
    decay_steps: int = 0              # wsd: the last decay_steps before max_steps decay linearly to the floor
    rewarm_steps: int = 20            # resumed without optimizer state: lr ramps back over these steps
    max_steps: int = 800
    stop_at_step: int = 0             # end this invocation after this step (the schedule still plans max_steps)
    stop_after_s: float = 0.0         # ... or after this many seconds of this invocation
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 16
    seed: int = 1234
    precision: str = "float32"
    compile: bool = False
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
        if self.schedule not in SCHEDULES:
            raise BlockspecError(f"pretrain: schedule must be one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise BlockspecError(f"pretrain: precision must be one of {', '.join(PRECISIONS)}")
        if self.decay_steps < 0 or self.rewarm_steps < 0 or self.decay_steps > self.max_steps:
            raise BlockspecError("pretrain: decay_steps must be in [0, max_steps] and rewarm_steps >= 0")
        if self.stop_at_step < 0 or self.stop_after_s < 0:
            raise BlockspecError("pretrain: stop_at_step and stop_after_s must be >= 0")


def lr_at(step: int, cfg: PretrainConfig, rewarm_from: int | None = None) -> float:
    """The schedule's learning rate at `step`; a run resumed without optimizer state at
    `rewarm_from` ramps linearly back to it over `rewarm_steps`."""
    if step < cfg.warmup_steps:
        lr = cfg.lr * (step + 1) / cfg.warmup_steps
    elif cfg.schedule == "wsd":
        decay = cfg.decay_steps or max(1, cfg.max_steps // 5)
        frac = min(1.0, max(0, step - (cfg.max_steps - decay)) / decay)
        lr = cfg.lr * (1 - (1 - cfg.min_lr_ratio) * frac)
    else:
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        lr = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
    if rewarm_from is not None and step - rewarm_from < cfg.rewarm_steps:
        lr *= (step - rewarm_from + 1) / (cfg.rewarm_steps + 1)
    return lr


# ---------------------------------------------------------------------- data
def tokenize_split(corpus: Path, tokenizer_dir: Path, split: str, cache_dir: Path,
                   package: str | None = None) -> torch.Tensor:
    """All files of a split (optionally one package's) as one token stream, files separated
    by EOS (cached next to the run)."""
    cache = cache_dir / f"{split}{'_' + package if package else ''}_tokens.safetensors"
    if cache.is_file():
        return load_file(str(cache))["tokens"]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    texts = [row["text"] for row in iter_rows(corpus / f"{split}.jsonl")
             if package is None or row.get("package", STDLIB) == package]
    ids: list[int] = []
    for start in range(0, len(texts), 256):   # batches: the token ids of all files at once are many GB
        for enc in tok.encode_batch(texts[start:start + 256]):
            ids.extend(enc.ids)
            ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": stream}, str(cache))
    return stream


def batch_at(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


def step_batch(stream: torch.Tensor, cfg: PretrainConfig, step: int, micro: int) -> torch.Tensor:
    """The training batch of (step, micro-batch): a function of the seed and the position only."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 7919 + micro)
    return batch_at(stream, cfg.batch_size, cfg.seq_len, gen)


# ---------------------------------------------------------------------- model
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


def make_optimizer(model: nn.Module, cfg: PretrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Not fused=True: the fused kernel updates the weights without bumping their version
    # counters, so the no-grad forwards' prepacked weight copies (models/layers.py FusedLinears)
    # would stay those of the first evaluation and every later validation loss would be wrong.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, stream: torch.Tensor, cfg: PretrainConfig,
               step: int, device: torch.device, bf16: bool) -> tuple[float, float]:
    loss_sum = 0.0
    for micro in range(cfg.grad_accum):
        x = step_batch(stream, cfg, step, micro).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        (loss / cfg.grad_accum).backward()
        loss_sum += loss.item() / cfg.grad_accum
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def choose_precision(model: nn.Module, stream: torch.Tensor, cfg: PretrainConfig, device: torch.device,
                     steps: int = 3) -> tuple[bool, dict[str, float]]:
    """(use bf16, tokens/s of each precision): `auto` times a few training steps of each on a
    copy of the model (the run's own weights and optimizer are untouched), each from its
    fastest step: a pause or another process during one step must not pick the precision
    (a probe paused during bf16's one timed step chose float32 at 148 tokens/s on a CPU
    where bf16 runs 2.4x float32's 666). bf16 is timed second and stops after two timed
    steps once it has used float32's whole probe time: on CPUs without native bf16 matrix
    units its GEMMs run ~10x slower (an AMD EPYC without AVX512-BF16: 11x), and finishing
    its steps would cost minutes to learn what two steps show."""
    if cfg.precision != "auto":
        return cfg.precision == "bfloat16", {}
    speeds = {}
    # Two rows of seq_len tokens are GEMMs of thousands of rows already: the ratio holds, the
    # probe costs a quarter of the run's own batches (it runs at every start).
    cfg = replace(cfg, batch_size=min(cfg.batch_size, 2), grad_accum=1)
    tokens = cfg.batch_size * cfg.seq_len
    budget = None
    for name in ("float32", "bfloat16"):
        probe = copy.deepcopy(model)
        probe = torch.compile(probe) if cfg.compile else probe
        opt = make_optimizer(probe, cfg)
        start = time.perf_counter()
        train_step(probe, opt, stream, cfg, 0, device, name == "bfloat16")   # warm-up (and compile)
        fastest, done = math.inf, 0
        while done < steps and (done < 2 or budget is None or time.perf_counter() - start < budget):
            t0 = time.perf_counter()
            train_step(probe, opt, stream, cfg, done + 1, device, name == "bfloat16")
            fastest = min(fastest, time.perf_counter() - t0)
            done += 1
        speeds[name] = round(tokens / fastest, 1)
        budget = time.perf_counter() - start if budget is None else budget
        del probe, opt
    return speeds["bfloat16"] > speeds["float32"], speeds


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, cfg: PretrainConfig, device: torch.device, bf16: bool) -> float:
    model.eval()
    # Fixed, evenly spaced windows so every evaluation sees the same tokens.
    seq = min(cfg.seq_len, len(val) - 2)
    n = cfg.eval_batches * cfg.batch_size
    step = max(1, (len(val) - seq - 1) // n)
    losses = []
    for i in range(cfg.eval_batches):
        starts = [min((i * cfg.batch_size + j) * step, len(val) - seq - 1) for j in range(cfg.batch_size)]
        x = torch.stack([val[s:s + seq + 1] for s in starts]).long().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------- state
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


def save_state(state_dir: Path, model: TargetModel, opt: torch.optim.Optimizer | None, meta: dict) -> None:
    """Weights (float32), the optimizer's moments and meta.json, written to a new directory
    that then replaces the old one, so an interruption never leaves half a state."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_tensors(tmp, {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"})
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        moments = {}
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    moments[f"{names[id(p)]}::{key}"] = torch.as_tensor(value).detach().cpu().float()
        save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    old = state_dir.with_name(state_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if state_dir.exists():
        state_dir.rename(old)
    tmp.rename(state_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_state(state_dir: Path, model: TargetModel, opt: torch.optim.Optimizer) -> tuple[dict, bool]:
    """(meta, optimizer restored). Weights of any float dtype load into the float32 model."""
    try:
        meta = json.loads((state_dir / "meta.json").read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BlockspecError(f"pretrain: {state_dir}/meta.json is not a pretraining state ({exc})") from None
    if step < 0:
        raise BlockspecError(f"pretrain: {state_dir}/meta.json has a negative step")
    tensors = read_tensors(state_dir, "resume")
    try:
        result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    except RuntimeError as exc:   # a tensor of another shape: another model size
        raise BlockspecError(f"pretrain: {state_dir} does not fit this model ({str(exc).splitlines()[-1].strip()})") from None
    missing = [k for k in result.missing_keys if k != "lm_head.weight"] + result.unexpected_keys
    if missing:
        raise BlockspecError(f"pretrain: {state_dir} does not fit this model (tensors {missing[:3]} differ)")
    moments_file = state_dir / "optimizer.safetensors"
    if not moments_file.is_file():
        return meta, False
    moments = load_file(str(moments_file))
    params = dict(model.named_parameters())
    for key, value in moments.items():
        name, _, slot = key.partition("::")
        if name not in params:
            raise BlockspecError(f"pretrain: {moments_file} names an unknown parameter {name!r}")
        opt.state[params[name]][slot] = value if slot != "step" else value.reshape(())
    return meta, True


def snapshot_state(state_dir: Path, dest: Path) -> dict:
    """A committable copy of a run's state: bf16 weights and meta.json, no optimizer."""
    meta = json.loads((state_dir / "meta.json").read_text())
    tensors = read_tensors(state_dir, "snapshot")
    dest.mkdir(parents=True, exist_ok=True)
    write_tensors(dest, {k: v.to(torch.bfloat16) for k, v in tensors.items()})
    (dest / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# ---------------------------------------------------------------------- the loop
class StopRequest:
    """SIGINT / SIGTERM end the run after the current step, with its state saved (a background
    campaign is stopped this way before its machine goes away); so do the invocation's limits."""

    def __init__(self) -> None:
        self.signalled = False
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def now(self, cfg: PretrainConfig, step: int, seconds: float) -> bool:
        return (self.signalled or (cfg.stop_at_step and step >= cfg.stop_at_step)
                or (cfg.stop_after_s and seconds >= cfg.stop_after_s))

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def build_model(cfg: PretrainConfig, tok: Tokenizer) -> TargetModel:
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        return load_target(cfg.init_from, dtype="float32").requires_grad_(True)
    model = TargetModel(model_config(cfg, tok.get_vocab_size(), tok.token_to_id(EOS)))
    init_weights(model)
    return model


def pretrain(cfg: PretrainConfig) -> dict:
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, tokdir = Path(cfg.corpus), Path(cfg.tokenizer)
    train = tokenize_split(corpus, tokdir, "train", out)
    vals = {"val": tokenize_split(corpus, tokdir, "val", out),
            "val_stdlib": tokenize_split(corpus, tokdir, "val", out, package=STDLIB)}
    vals = {k: v for k, v in vals.items() if len(v) > 2}
    corpus_id = json.loads((corpus / "manifest.json").read_text()).get("sha256") \
        if (corpus / "manifest.json").is_file() else None
    tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    model = build_model(cfg, tok).to(device).train()
    opt = make_optimizer(model, cfg)

    state_dir = out / "state"
    meta = {"step": 0, "best": float("inf"), "elapsed": 0.0, "tokens": 0, "history": [], "events": []}
    source = state_dir if (state_dir / "meta.json").is_file() else Path(cfg.resume_from) if cfg.resume_from else None
    rewarm_from = None
    if source is not None:
        loaded, restored = load_state(source, model, opt)
        meta.update(loaded)
        meta.setdefault("events", [])
        if not restored:
            rewarm_from = meta["step"]
            meta["events"].append({"step": meta["step"], "event": f"resumed from {source} without optimizer "
                                   f"state: lr re-warmed over {cfg.rewarm_steps} steps"})
        if meta.get("corpus_sha256") not in (None, corpus_id):
            meta["events"].append({"step": meta["step"], "event": f"corpus changed: {meta['corpus_sha256']} -> "
                                   f"{corpus_id}; the data order continues on the new corpus"})
            print(f"warning: pretrain: the corpus differs from the one step {meta['step']} trained on")
    meta.update({"corpus_sha256": corpus_id, "train_tokens": len(train), "config": asdict(cfg)})
    bf16, speeds = choose_precision(model, train, cfg, device)
    if speeds:
        meta["events"].append({"step": meta["step"], "event": "precision probe", "tokens_per_s": speeds,
                               "chosen": "bfloat16" if bf16 else "float32", "device": device.type})
    step_model = torch.compile(model) if cfg.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    step = meta["step"]
    log = open(out / "log.jsonl", "a")
    t_start, t_invocation = time.time() - meta["elapsed"], time.time()
    stop = StopRequest()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn()) as bar:
        task = bar.add_task("pretrain", total=cfg.max_steps, completed=step)
        while step < cfg.max_steps and not stop.now(cfg, step, time.time() - t_invocation):
            lr = lr_at(step, cfg, rewarm_from)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, grad_norm = train_step(step_model, opt, train, cfg, step, device, bf16)
            step += 1
            meta["tokens"] += cfg.batch_size * cfg.seq_len * cfg.grad_accum
            record = {"step": step, "loss": round(loss, 4), "lr": lr, "grad_norm": round(grad_norm, 3),
                      "tokens": meta["tokens"], "time_s": round(time.time() - t_start, 1)}
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                for name, stream in vals.items():
                    record[f"{name}_loss"] = round(evaluate(step_model, stream, cfg, device, bf16), 4)
                val_loss = record["val_loss"]
                meta["history"].append([step, val_loss] + ([record["val_stdlib_loss"]]
                                                           if "val_stdlib_loss" in record else []))
                if val_loss < meta["best"]:
                    meta["best"] = val_loss
                    info = {"step": step, "tokens": meta["tokens"], "val_loss": val_loss,
                            "val_stdlib_loss": record.get("val_stdlib_loss"), "val_ppl": math.exp(val_loss),
                            "train_time_s": round(time.time() - t_start, 1), "params": n_params,
                            "config": asdict(cfg)}
                    export(model, cfg, out / "best", info)
                meta.update(step=step, elapsed=time.time() - t_start)
                save_state(state_dir, model, opt, meta)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(task, completed=step, description=f"pretrain loss {loss:.3f} best val {meta['best']:.3f}")
    stop.restore()
    if meta["step"] != step:   # stopped between evaluations: keep every step done
        meta.update(step=step, elapsed=time.time() - t_start)
        save_state(state_dir, model, opt, meta)
    return {"best_val_loss": meta["best"], "steps": step, "tokens": meta["tokens"], "params": n_params,
            "precision": "bfloat16" if bf16 else "float32", "precision_probe": speeds}
