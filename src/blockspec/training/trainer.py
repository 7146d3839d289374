"""One training loop for DFlash / DSpark drafters: one process, or `torchrun` on one or many
nodes (PyTorch DDP, or FSDP2 with --fsdp; gloo on CPU, nccl on GPU) with no code change.

Each step runs the frozen target online over the batch to get the selected layers'
features (and, for DSpark, its final states at the trained positions), samples fresh
random anchors per example, and trains all blocks of every sequence in one packed draft
forward (mask in anchors.py; loss in losses.py, chunked over the vocabulary). Checkpoints
are atomic and resume exactly (checkpointing.py). Drafts are written directly in the z-lab
(DFlash) or DeepSpec (DSpark) format. EAGLE-3 (`--method eagle3`, training/eagle3.py) runs the
same loop over its own inputs, objective and evaluation, and is written in the
LlamaForCausalLMEagle3 format.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.decoding.policy import PolicyOptions
from blockspec.embedded import default_target
from blockspec.errors import BlockspecError
from blockspec.interop import mask_token_of
from blockspec.metrics import AcceptanceStats
from blockspec.models.checkpoint import load_draft, load_eagle3, load_target, save_draft, save_eagle3
from blockspec.models.draft import DraftModel
from blockspec.models.eagle3 import Eagle3Draft
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer
from blockspec.training import checkpointing as ckpt
from blockspec.training import distributed as D
from blockspec.training.conversations import end_of_turn_ids
from blockspec.training.data import EpochBatches, Example, collate, collate_packed, load_examples, resolve_mask_token_id
from blockspec.training.eagle3 import Eagle3Objective, greedy_acceptance, prepare_eagle3, select_vocabulary
from blockspec.training.logging import LogSinks, TrainLogger
from blockspec.training.losses import SUMS
from blockspec.training.objective import AnchorSpec, DraftObjective, anchor_generators, prepare, uses_target_probs
from blockspec.training.train_config import (BUDGET_CALIBRATION_STEPS, Schedule, TrainConfig, draft_config_for,
                                             eagle3_config_for, fit_to_budget, lr_at, scheduler_state, warm_start,
                                             with_window)

__all__ = ["BUDGET_CALIBRATION_STEPS", "TrainConfig", "draft_config_for", "fit_to_budget", "train", "warm_start"]


AnyDraft = DraftModel | Eagle3Draft


@torch.no_grad()
def evaluate_acceptance(draft: AnyDraft, target: TargetModel, examples: list[Example], new_tokens: int,
                        chain: int = 0) -> dict:
    """Greedy speculative decoding on held-out prompts: tau and per-slot acceptance (EAGLE-3:
    chained drafts of `chain` tokens, `greedy_acceptance`)."""
    draft.eval()
    prompts = [e.ids[:e.response_start] for e in examples]
    if isinstance(draft, Eagle3Draft):
        stats = greedy_acceptance(draft, target, prompts, new_tokens, chain)
    else:
        stats = AcceptanceStats()
        out = generate(target, prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), draft=draft,
                       policy=PolicyOptions(adapt=False))   # the draft's own acceptance over its full window
        for c in out.completions:
            stats.add_rounds(c.stats.accepted, c.stats.verified)
    draft.train()
    return {"tau": round(stats.tau, 4),
            "per_slot": [None if math.isnan(x) else round(x, 3) for x in stats.per_slot_acceptance()]}


# -- setup -------------------------------------------------------------------------------------

@dataclass
class Run:
    """Everything a training run holds between steps."""
    cfg: TrainConfig
    d: D.Dist
    target: TargetModel
    draft: AnyDraft
    objective: DraftObjective | Eagle3Objective   # the unwrapped module (state dicts, evaluation)
    model: torch.nn.Module             # what the step calls: objective, DDP(objective) or FSDP2-sharded
    opt: torch.optim.Optimizer
    schedule: Schedule
    sched: torch.optim.lr_scheduler.LambdaLR
    examples: list[Example]
    held_out: list[Example]
    batches: EpochBatches
    pad: int
    mask_token: str | None
    total: int
    step: int = 0
    elapsed: float = 0.0
    history: list | None = None

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"


def build_draft(cfg: TrainConfig, target: TargetModel, mask_token_id: int, device: torch.device) -> DraftModel:
    if cfg.init_from:
        draft = load_draft(cfg.init_from, dtype="float32", target=target).requires_grad_(True)  # trained in fp32
        windowed = with_window(cfg, draft.config)
        if windowed != draft.config:   # the same weights under sliding-window layers (fine-tuning into a window)
            state = draft.state_dict()
            draft = DraftModel(windowed)
            draft.load_state_dict(state)
    else:
        torch.manual_seed(cfg.seed)   # the same initial weights on every rank and every run
        draft = DraftModel(draft_config_for(cfg, target, mask_token_id))
        if cfg.init_from_target:
            warm_start(draft, target)
    return draft.to(device).train()


def build_eagle3(cfg: TrainConfig, target: TargetModel, examples: list[Example], device: torch.device
                 ) -> Eagle3Draft:
    """A fresh EAGLE-3 draft whose vocabulary is the training data's most frequent trained tokens
    (or the one `--init-from` draft has)."""
    if cfg.init_from:
        draft = load_eagle3(cfg.init_from, dtype="float32", target=target).requires_grad_(True)
        if draft.embed_tokens is not None:   # a shipped copy of the target's embedding stays frozen
            draft.embed_tokens.requires_grad_(False)
    else:
        dc = eagle3_config_for(cfg, target)
        dc.check_target(target.config)
        torch.manual_seed(cfg.seed)   # the same initial weights on every rank and every run
        draft = Eagle3Draft(dc)
        draft.set_vocabulary(select_vocabulary(examples, dc.vocab_size, dc.draft_vocab_size))
    return draft.to(device).train()


def load_data(cfg: TrainConfig, tokenizer: Tokenizer, target: TargetModel, report: bool
              ) -> tuple[list[Example], list[Example]]:
    """(training examples, held-out evaluation examples); `report`: say which rows were skipped."""
    skipped: list[str] = []
    examples = load_examples(Path(cfg.data), cfg.max_len, tokenizer, end_of_turn_ids(cfg.target, tokenizer),
                             target.config.vocab_size, skipped)
    if skipped and report:
        print(f"train: skipped {len(skipped)} row(s) with fewer than 2 trained tokens within --max-len "
              f"{cfg.max_len}: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
    if len(examples) < 2:
        raise BlockspecError(f"train: {cfg.data} has {len(examples)} usable example(s); training and its "
                             "held-out evaluation need at least 2")
    # Small data: hold out at most a fifth (at least one), never all of it.
    held = min(cfg.eval_examples, max(1, len(examples) // 5))
    if held < cfg.eval_examples and report:
        print(f"train: {len(examples)} examples: holding out {held} for evaluation (--eval-examples "
              f"{cfg.eval_examples} would leave too few to train on)")
    return examples[held:], examples[:held]


def with_target(cfg: TrainConfig) -> TrainConfig:
    """No --target: the embedded target, as every other command."""
    return cfg if cfg.target else dataclasses.replace(cfg, target=str(default_target()))


def setup(cfg: TrainConfig) -> Run:
    cfg = with_target(cfg)
    cfg.validate()
    d = D.init_distributed(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if d.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True   # float32 training at tensor-core speed
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(cfg.target, dtype=cfg.target_dtype(d.device), device=d.device).requires_grad_(False)
    tokenizer = Tokenizer(cfg.target)
    tokenizer.check_fits(target.config.vocab_size)
    examples, held_out = load_data(cfg, tokenizer, target, report=d.main)
    objective: DraftObjective | Eagle3Objective
    if cfg.method == "eagle3":
        mask_id = None
        draft: AnyDraft = build_eagle3(cfg, target, examples, d.device)
        objective = Eagle3Objective(draft, target, cfg.ce_chunk, cfg.grad_checkpoint)
    else:
        mask_id = resolve_mask_token_id(cfg.mask_token_id, tokenizer, target.config.vocab_size)
        draft = build_draft(cfg, target, mask_id, d.device)
        objective = DraftObjective(draft, target, cfg.ce_chunk, cfg.grad_checkpoint, cfg.distill)
    model = D.wrap(objective, d, cfg.fsdp)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    batches = EpochBatches([len(e.ids) for e in examples], cfg.batch_size * cfg.grad_accum * d.world, cfg.seed)
    total = cfg.max_steps or max(1, int(cfg.epochs * batches.steps_per_epoch))
    schedule = Schedule(cfg, total)
    run = Run(cfg, d, target, draft, objective, model, opt, schedule,
              torch.optim.lr_scheduler.LambdaLR(opt, schedule), examples, held_out, batches,
              tokenizer.pad_token_id or 0, None if mask_id is None else mask_token_of(Path(cfg.target), mask_id),
              total, history=[])
    _start_or_resume(run)
    return run


def _start_or_resume(run: Run) -> None:
    cfg, root = run.cfg, run.ckpt_root
    found = ckpt.latest_step(root)
    if found is None:
        if cfg.resume and run.d.main:
            print(f"train: --resume: no checkpoint under {root} yet, starting from step 0")
        _set_lr(run)
        return
    if not cfg.resume:
        raise BlockspecError(f"train: {run.out} already holds a checkpoint (step {found}): pass --resume to "
                             "continue it, or choose another --out")
    model_sd, optim_sd, state, rng = ckpt.load(root, run.d.rank)
    if state["global_batch"] != run.batches.global_batch or state["examples"] != len(run.examples):
        raise BlockspecError(
            f"train: --resume: the checkpoint was trained with {state['examples']} examples in global batches of "
            f"{state['global_batch']}, this run has {len(run.examples)} in batches of {run.batches.global_batch} "
            "(batch_size x grad_accum x processes): the data position would not match")
    try:
        D.load_full_state(run.objective, run.opt, model_sd, optim_sd)
        run.sched.load_state_dict(dict(state["scheduler"], lr_lambdas=[None]))
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise BlockspecError(f"train: --resume: the checkpoint at step {found} does not fit this draft and optimizer "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    run.step, run.elapsed, run.history = state["step"], state["elapsed"], state["history"]
    if rng is not None:
        ckpt.set_rng_state(rng, f"the rank-{run.d.rank} RNG state of step {found}")
    _set_lr(run)


def _set_lr(run: Run) -> None:
    run.schedule.total = run.total
    for group in run.opt.param_groups:
        group["lr"] = lr_at(run.step, run.total, run.cfg)


# -- one step ---------------------------------------------------------------------------------

def _micro_batches(run: Run, step: int) -> tuple[int, list[list[int]]]:
    """(epoch, this rank's example indices per micro-batch); an empty micro-batch (a short
    last batch of an epoch) is [] and runs as a zero-weight stand-in."""
    cfg, d = run.cfg, run.d
    epoch = step // run.batches.steps_per_epoch
    mine = run.batches.batch(step, d.rank, d.world)
    per = max(1, -(-len(mine) // cfg.grad_accum))
    return epoch, [mine[i * per:(i + 1) * per] for i in range(cfg.grad_accum)]


def train_step(run: Run) -> dict:
    """One optimizer step over a global batch; returns the step's record (global figures)."""
    cfg, d = run.cfg, run.d
    t0 = time.perf_counter()
    epoch, micros = _micro_batches(run, run.step)
    inputs = []
    for idx in micros:
        zero = not idx
        batch = [run.examples[i] for i in (idx or [0])]
        rows = collate_packed(batch, run.pad, cfg.max_len).to(d.device) if cfg.pack else None
        ids, loss_mask = (rows.ids, rows.loss_mask) if rows is not None else collate(batch, run.pad)
        ids, loss_mask = ids.to(d.device), loss_mask.to(d.device)
        if isinstance(run.draft, Eagle3Draft):
            inputs.append(prepare_eagle3(run.target, run.draft, ids, loss_mask, cfg.ttt_steps, zero, rows))
            continue
        spec = AnchorSpec(cfg.num_anchors, cfg.decay(run.draft.config.num_drafts), cfg.distill)
        inputs.append(prepare(run.target, run.draft, ids, loss_mask, anchor_generators(cfg.seed, epoch, idx or [0]),
                              spec, zero_weight=zero, packed_rows=rows))
    # Normalise by the weight of the whole global batch: the same update on 1 or N processes.
    weight = D.all_reduce_sum(torch.stack([x.weights.sum() for x in inputs]).sum().double().reshape(1), d)
    scale = d.world / weight.clamp(min=1e-8).float()          # DDP / FSDP average over ranks
    sums = torch.zeros(len(SUMS), device=d.device)
    for i, x in enumerate(inputs):
        with _sync(run.model, last=i == len(inputs) - 1), \
                torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = run.model(x)
            (out[0] * scale).backward()
        sums += out.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.objective.parameters(), cfg.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    sums = D.all_reduce_sum(sums, d)
    tokens = sum(len(run.examples[i].ids) for i in run.batches.batch(run.step))
    run.step += 1
    return _record(run, sums, float(weight.item()), float(grad_norm), tokens, time.perf_counter() - t0, epoch)


def _sync(model: torch.nn.Module, last: bool):
    """Gradient accumulation: ranks synchronise gradients only on the last micro-batch."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):   # FSDP2
        return _FsdpNoSync(model)
    return contextlib.nullcontext()


class _FsdpNoSync:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)   # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)    # type: ignore[operator]


def _record(run: Run, sums: torch.Tensor, weight: float, grad_norm: float, tokens: int, dt: float,
            epoch: int) -> dict:
    s = dict(zip(SUMS, sums.tolist()))
    w = max(weight, 1e-8)
    rec = {"step": run.step, "epoch": epoch, "loss": round(s["total"] / w, 4), "ce": round(s["ce"] / w, 4),
           "tau_est": round(1 + s["accepted"] / max(s["blocks"], 1.0), 3),
           "lr": lr_at(run.step - 1, run.total, run.cfg), "grad_norm": round(grad_norm, 3),
           "tokens_per_s": round(tokens / max(dt, 1e-9), 1), "total": run.total}
    if isinstance(run.draft, DraftModel) and uses_target_probs(run.draft, run.cfg.distill):
        rec["l1"] = round(s["l1"] / w, 4)
        if run.draft.confidence_head is not None:
            rec["bce"] = round(s["bce"] / w, 4)
    return rec


# -- saving ----------------------------------------------------------------------------------

def plain_draft(run: Run, model_sd: dict) -> AnyDraft | None:
    """Rank 0's unsharded draft for evaluation and export (under FSDP2 a copy from the
    gathered state; otherwise the draft itself)."""
    if not run.d.main:
        return None
    if not run.cfg.fsdp:
        return run.draft
    copy = type(run.draft)(run.draft.config)
    copy.load_state_dict({k.removeprefix("draft."): v for k, v in model_sd.items()})
    return copy.to(run.d.device).train()


def save_checkpoint(run: Run, model_sd: dict, optim_sd: dict) -> None:
    """Every rank: its RNG part; rank 0: weights, optimizer, trainer state; then the commit."""
    root, d = run.ckpt_root, run.d
    ckpt.save_rank_part(root, run.step, d.rank)
    if d.main:
        state = {"step": run.step, "elapsed": run.elapsed, "history": run.history,
                 "scheduler": scheduler_state(run.sched), "global_batch": run.batches.global_batch,
                 "examples": len(run.examples), "steps_per_epoch": run.batches.steps_per_epoch,
                 "data_position": {"epoch": run.step // run.batches.steps_per_epoch,
                                   "batch": run.step % run.batches.steps_per_epoch}}
        ckpt.save_main_part(root, run.step, model_sd, optim_sd, state)
    if d.active:
        torch.distributed.barrier()
    if d.main:
        ckpt.commit(root, run.step)


def end_of_step(run: Run, rec: dict, final: bool) -> None:
    """Evaluation, draft export and checkpoint when due (collectives on every rank)."""
    cfg = run.cfg
    do_eval = final or run.step % cfg.eval_every == 0
    do_save = final or do_eval or run.step % cfg.save_every == 0
    if not do_save:
        return
    model_sd, optim_sd = D.full_state(run.objective, run.opt, run.d)
    if do_eval:
        draft = plain_draft(run, model_sd)
        if draft is not None:
            rec["eval"] = evaluate_acceptance(draft, run.target, run.held_out, cfg.eval_new_tokens, cfg.ttt_steps)
            assert run.history is not None
            run.history.append([run.step, rec["eval"]["tau"]])
            if isinstance(draft, Eagle3Draft):
                save_eagle3(draft, run.out / "draft", dtype="bfloat16")
            else:
                save_draft(draft, run.out / "draft", dtype="bfloat16", mask_token=run.mask_token)
            ckpt.write_json(run.out / "train_config.json", asdict(cfg))
    save_checkpoint(run, model_sd, optim_sd)


def param_checksum(draft: AnyDraft) -> float:
    """Sum of every weight (gathered under FSDP2: a collective): equal on every rank."""
    full = (p.full_tensor() if isinstance(p, DTensor) else p for p in draft.parameters())
    return float(sum(p.detach().double().sum() for p in full))


# -- the loop --------------------------------------------------------------------------------

def train(cfg: TrainConfig) -> dict:
    cfg = with_target(cfg)
    run = setup(cfg)
    d = run.d
    t_start = time.time() - run.elapsed
    run_start, run_t0 = run.step, time.time()
    sinks = LogSinks(cfg.logdir, cfg.wandb, cfg.wandb_project)
    with TrainLogger(run.out, d.main, run.total, run.step, f"train {cfg.method}", sinks=sinks,
                     config=asdict(cfg)) as log:
        while run.step < run.total:
            rec = train_step(run)
            budgeted = fit_to_budget(cfg, run.step, run.total, run_start, time.time() - run_t0, time.time() - t_start)
            budgeted = D.broadcast_int(budgeted, d) if cfg.time_budget_s > 0 else budgeted  # stop where rank 0 does
            if budgeted != run.total:
                run.total = rec["total"] = budgeted
                run.schedule.total = budgeted
                log.set_total(budgeted)
            run.elapsed = time.time() - t_start
            rec["time_s"] = round(run.elapsed, 1)
            if cfg.halt_at_step and run.step >= cfg.halt_at_step and run.step < run.total:
                log.record(rec)
                break
            end_of_step(run, rec, final=run.step == run.total)
            log.record(rec)
    result = {"steps": run.step, "total_steps": run.total, "history": run.history, "rank": d.rank, "world": d.world,
              "param_checksum": param_checksum(run.draft)}
    # DDP's reducer must go before the process group does: freed after destroy_process_group,
    # it can block its process at exit (seen with gloo).
    run.model = run.objective
    gc.collect()
    D.close(d)
    return result
