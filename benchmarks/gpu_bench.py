"""GPU figures of issue 18 in ONE run: blockspec on a random-weight Qwen3-8B-shaped target.

Models (bf16, built in memory, no checkpoint files): the target (36 layers, hidden 4096),
the 5-layer z-lab DFlash draft (block 16 = anchor + 15 drafts, target layers [1, 9, 17,
25, 33]) and a DSpark draft of the same backbone (DeepSpec layout, gamma 15: the same
16-token verify window; vanilla Markov head of rank 64, confidence head reading it).
Sections, each printed as Markdown as soon as it is measured:

1. Round costs (captured steps) at batch 1, 8, 32 and both contexts: T_ar (one AR
   step), T_draft (one draft round, DFlash and DSpark), T_verify(16) (verify + commit +
   draft context), medians of CUDA-event timings; caches filled to the context (kernel
   times do not depend on the values held). Projected speedup
   tau * T_ar / (T_draft + T_verify) at tau 6.49 (the DFlash paper's) and 3.
2. Engine throughput vs concurrency (1, 4, 16, 32) with SIMULATED acceptance
   (tau 6.5 imposed, NOT lossless) for AR, DFlash and scheduled DSpark (its cost table
   profiled here; its confidence head set to the constant per-slot acceptance that
   gives tau 6.5, so the planner sees what the simulation imposes), the engine's rounds
   on captured steps (`EngineOptions(compile=True)`: CUDA graphs, what `serve --compile` runs).
3. AR decode tok/s at batch 1 and 8 (--ar-cells, context x batch): blockspec `generate`
   with `GenerateOptions(compile=True)` (captured rounds: CUDA graphs) against
   `transformers` generate with its static cache, auto-compiled (sdpa), on the SAME
   weight tensors (the twin shares them). tok/s = rows x (N - 1) / (t(N new tokens) -
   t(1 new token)): decode only, prefill cancelled. Last: compiling transformers' model
   takes the longest.
4. Peak GPU memory, overall and per section.

    bash benchmarks/gpu.sh [--contexts 512,4096] [--batches 1,8,32] [--out FILE]
    python benchmarks/record.py "GPU: issue 18 figures" -- bash benchmarks/gpu.sh

The Markdown goes to stdout (what record.py appends to docs/results.md) and to --out
(rewritten after every line, so a run stopped by its deadline leaves what it measured);
progress goes to stderr. Each section has its own time budget (SECTION_BUDGETS_S, scaled
to --budget-s) and starts no new cell past it or past the global --budget-s; a section that
fails reports its error in one line and the next one runs. Exits with status 2 and one
line on stderr when no CUDA GPU is available. `--smoke` runs tiny shapes on the CPU
through every section (numbers meaningless; the captured steps run uncompiled).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import resource
import signal
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from blockspec.bench.arms import ForcedAcceptance, accept_pattern
from blockspec.config import DraftConfig, SamplingParams, TargetConfig
from blockspec.decoding.captured import CapturedSteps, release_captured
from blockspec.decoding.cost_table import ProfileOptions, profile_cost_table
from blockspec.decoding.generate import GenerateOptions, generate
from blockspec.decoding.policy import PolicyOptions
from blockspec.decoding.sampling import RowSampler
import blockspec.engine.engine as engine_module
from blockspec.engine.engine import Engine, EngineOptions
from blockspec.models.draft import DraftModel
from blockspec.models.layers import rope_inv_freq
from blockspec.models.target import TargetModel

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, eos_token_id=151645)
# The published z-lab DFlash draft for Qwen3-8B (docs/design.md section 6), minus the weights.
DFLASH_8B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=16,
                 dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
                 num_target_layers=36, num_hidden_layers=5, hidden_size=4096, intermediate_size=12288,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936)
# A DeepSpec-layout DSpark draft on the same backbone (section 6: heads at top level, block = gamma).
DSPARK_8B = dict({k: v for k, v in DFLASH_8B.items() if k != "dflash_config"}, architectures=["Qwen3DSparkModel"],
                 block_size=15, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], markov_rank=64,
                 markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)
SMOKE_TARGET = dict(QWEN3_8B, **SMOKE, num_hidden_layers=6, eos_token_id=511)
SMOKE_DFLASH = dict(DFLASH_8B, **SMOKE, block_size=8, dflash_config={"mask_token_id": 510, "target_layer_ids": [1, 3]},
                    num_target_layers=6, num_hidden_layers=1)
SMOKE_DSPARK = dict(DSPARK_8B, **SMOKE, block_size=7, mask_token_id=510, target_layer_ids=[1, 3],
                    num_target_layers=6, num_hidden_layers=1, markov_rank=8)
TAUS = (6.49, 3.0)
SIM_TAU = 6.5
DEFAULTS = dict(contexts="512,4096", batches="1,8,32", concurrency="1,4,16,32", ar_cells="512x1,512x8,4096x1",
                new_tokens=128, warmup=3, iters=10)
SMOKE_DEFAULTS = dict(contexts="32,96", batches="1,4", concurrency="1,4", ar_cells="32x1,96x1", new_tokens=12,
                      warmup=1, iters=2)
# Seconds per section out of the default global budget of 330 (scaled to --budget-s), sized for an
# H200: round costs ~30 s of timing plus graph captures; the engine's cost-table profile (eager
# packed forwards, compiled flex_attention) then 3 arms x 4 concurrency levels; AR mostly
# compiling transformers' model (about a minute per shape).
SECTION_BUDGETS_S = {"round costs": 70.0, "engine": 110.0, "AR decode": 150.0}
GLOBAL_BUDGET_S = 330.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", help="cached tokens per row (comma list; default 512,4096)")
    ap.add_argument("--batches", help="round-cost batch sizes (comma list; default 1,8,32)")
    ap.add_argument("--concurrency", help="engine concurrency levels (comma list; default 1,4,16,32)")
    ap.add_argument("--ar-cells", help="AR decode cells, CONTEXTxBATCH (comma list; default 512x1,512x8,4096x1)")
    ap.add_argument("--new-tokens", type=int, help="AR decode and engine: new tokens per request (default 128)")
    ap.add_argument("--warmup", type=int, help="untimed calls before each measurement (default 3)")
    ap.add_argument("--iters", type=int, help="timed calls per measurement, median (default 10)")
    ap.add_argument("--budget-s", type=float, default=GLOBAL_BUDGET_S,
                    help="skip what would start after this many seconds (sections get their share)")
    ap.add_argument("--out", default=None, help="also write the Markdown here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: tests this script only")
    args = ap.parse_args(argv)
    # --smoke rehearses every section in seconds: smaller defaults for what was not given.
    defaults = SMOKE_DEFAULTS if args.smoke else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def ar_cells(text: str) -> list[tuple[int, int]]:
    """--ar-cells "512x1,512x8" -> [(512, 1), (512, 8)]."""
    try:
        cells = [tuple(int(v) for v in cell.split("x")) for cell in text.split(",") if cell.strip()]
    except ValueError:
        cells = []
    if not cells or any(len(c) != 2 or min(c) < 1 for c in cells):
        raise SystemExit(f"error: --ar-cells must be CONTEXTxBATCH pairs (e.g. 512x1,512x8), got {text!r}")
    return [(c[0], c[1]) for c in cells]


def int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"error: {name} must be comma-separated integers >= 1, got {text!r}")
    return values


# -- models -------------------------------------------------------------------------

@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly in bf16: an fp32 detour would need 32 GB for the 8B target."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def random_init(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Materialise a meta-device model on `device` with N(0, 0.02) matrices and unit norms."""
    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model = model.to(dtype).eval().requires_grad_(False)
    # Non-persistent RoPE buffer: recomputed in float32 after the cast, as load_target does.
    model.rotary.inv_freq = rope_inv_freq(model.config.head_dim, model.config.rope).to(device)
    return model


def simulated_acceptance(num_drafts: int, tau: float) -> float:
    """The per-slot acceptance p with 1 + p + p^2 + ... + p^g = tau (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if 1 + sum(p ** k for k in range(1, num_drafts + 1)) < tau else (lo, p)
    return (lo + hi) / 2


def build_models(smoke: bool, device: torch.device, dtype: torch.dtype
                 ) -> tuple[TargetModel, DraftModel, DraftModel]:
    tcfg = TargetConfig.from_dict(SMOKE_TARGET if smoke else QWEN3_8B)
    dflash_cfg = DraftConfig.from_dict(SMOKE_DFLASH if smoke else DFLASH_8B)
    dspark_cfg = DraftConfig.from_dict(SMOKE_DSPARK if smoke else DSPARK_8B)
    for cfg in (dflash_cfg, dspark_cfg):
        cfg.check_target(tcfg)
    with default_dtype(dtype), torch.device("meta"):
        target, dflash, dspark = TargetModel(tcfg), DraftModel(dflash_cfg), DraftModel(dspark_cfg)
    target, dflash, dspark = (random_init(m, device, dtype) for m in (target, dflash, dspark))
    # A constant confidence: survival p^k, the simulated tau's own curve (section 3 of the docstring).
    p = simulated_acceptance(dspark_cfg.num_drafts, SIM_TAU)
    with torch.no_grad():
        dspark.confidence_head.proj.weight.zero_()
        dspark.confidence_head.proj.bias.fill_(math.log(p / (1 - p)))
    return target, dflash, dspark


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """BLOCKSPEC_ATTENTION=name for the block (models/attention.py reads it per call)."""
    old = os.environ.get("BLOCKSPEC_ATTENTION")
    os.environ["BLOCKSPEC_ATTENTION"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("BLOCKSPEC_ATTENTION", None)
        else:
            os.environ["BLOCKSPEC_ATTENTION"] = old


# -- timing -------------------------------------------------------------------------

class Timer:
    """Median seconds of `fn` after warm-up; CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters

    def once(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1e3

    def median(self, fn: Callable[[], object], reset: Callable[[], None] = lambda: None) -> float:
        samples = []
        for i in range(self.warmup + self.iters):
            t = self.once(fn)
            reset()
            if i >= self.warmup:
                samples.append(t)
        return statistics.median(samples)


class Report:
    """Markdown lines to stdout (and --out, rewritten after every line) as they are measured;
    progress to stderr. Sections (`section`) have their own deadline inside the global one."""

    def __init__(self, out: str | None, budget_s: float, device: torch.device) -> None:
        self.out, self.budget_s, self.t0, self.device = out, budget_s, time.perf_counter(), device
        self.lines: list[str] = []
        self.section_end = math.inf
        self.section_notes: list[str] = []
        self.peak_gib = 0.0   # the run's peak (CUDA), over the sections' own

    def emit(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
        self.lines += lines
        if self.out:
            Path(self.out).write_text("\n".join(self.lines) + "\n")

    def progress(self, what: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {what}", file=sys.stderr, flush=True)

    def time_left(self) -> bool:
        now = time.perf_counter()
        return now - self.t0 < self.budget_s and now < self.section_end

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a section within its budget (its share of the global one, never past it); a
        failure is reported in one Markdown line (traceback on stderr) and the run goes on."""
        budget = SECTION_BUDGETS_S[name] * self.budget_s / GLOBAL_BUDGET_S
        start = time.perf_counter()
        self.section_end = start + budget
        self.progress(f"section {name}: budget {budget:.0f}s ({self.budget_s - (start - self.t0):.0f}s left "
                      "in the run)")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except Exception as exc:   # a first run on new hardware: report it, keep the other sections
            traceback.print_exc(file=sys.stderr)
            self.emit("", f"**{name} failed** after {time.perf_counter() - start:.0f}s: "
                      f"`{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}`")
        finally:
            self.section_end = math.inf
            used = time.perf_counter() - start
            if self.device.type == "cuda":
                self.peak_gib = max(self.peak_gib, torch.cuda.max_memory_allocated(self.device) / 2**30)
            note = f"{name}: {used:.0f}s of its {budget:.0f}s budget, peak memory {peak_memory(self.device)}"
            self.section_notes.append(note)
            self.progress(note)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def stop_on_sigterm(self) -> None:
        """`timeout` (gpu.sh's global deadline) sends SIGTERM: say so in the report, then exit."""
        def stop(signum, frame) -> None:
            self.emit("", f"**stopped by the global deadline** after {time.perf_counter() - self.t0:.0f}s "
                      "(what is above was measured)")
            sys.exit(3)
        signal.signal(signal.SIGTERM, stop)


def peak_memory(device: torch.device, gib: float | None = None) -> str:
    """The peak since the last reset (CUDA: allocated tensors; gib: this figure instead)."""
    if device.type == "cuda":
        return f"{(gib if gib is not None else torch.cuda.max_memory_allocated(device) / 2**30):.1f} GiB"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB (CPU: peak resident memory)"


# -- 1. AR decode against transformers ----------------------------------------------

def transformers_twin(target: TargetModel, raw: dict):
    """transformers' Qwen3ForCausalLM over the SAME weight tensors as `target` (no copy), sdpa."""
    from transformers import Qwen3Config, Qwen3ForCausalLM   # optional extra: only this section needs it

    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"}, attn_implementation="sdpa")
    with default_dtype(target.dtype), torch.device("meta"):
        hf = Qwen3ForCausalLM(cfg)
    state = {(n if n == "lm_head.weight" else f"model.{n}"): t for n, t in target.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or missing:
        raise RuntimeError(f"transformers twin: missing {missing}, unexpected {unexpected}")
    # Its non-persistent RoPE buffer is still on the meta device: rebuild it where the weights are.
    with torch.device(target.device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg)
    hf.generation_config.pad_token_id = cfg.eos_token_id
    return hf.eval().requires_grad_(False)


def decode_rate(run: Callable[[int], list[int]], new_tokens: int, rows: int, timer: Timer, repeats: int
                ) -> tuple[float, list[int]]:
    """Decode tok/s = rows x (N - 1) / (t(N) - t(1)) (t(1) is the prefill and its first token),
    medians of `repeats` after one warm-up each (compilation, graph capture); also row 0's N tokens."""
    tokens = run(new_tokens)
    run(1)
    full = statistics.median(timer.once(lambda: run(new_tokens)) for _ in range(repeats))
    prefill = statistics.median(timer.once(lambda: run(1)) for _ in range(repeats))
    return rows * (new_tokens - 1) / max(full - prefill, 1e-9), tokens


def ar_section(target: TargetModel, raw: dict, cells: list[tuple[int, int]], new_tokens: int, timer: Timer,
               smoke: bool, report: Report) -> None:
    report.emit("", "**AR decode** (greedy; blockspec `generate`, `GenerateOptions(compile=True)`: "
                "captured rounds; transformers `generate`, static cache, auto-compiled, sdpa; same weight tensors; "
                "both attend over the same static cache length; tok/s over all rows)", "",
                "| context | batch | blockspec tok/s | transformers tok/s | blockspec / transformers | row 0 the same "
                "as transformers for the first |", "|---|---|---|---|---|---|")
    try:
        hf = transformers_twin(target, raw)
    except ImportError as exc:   # an optional extra: blockspec's own figure is still worth having
        report.emit(f"(transformers is not installed: {exc}; its column is empty)")
        hf = None
    gen = torch.Generator().manual_seed(0)
    repeats = 1 if smoke else 3
    for context, batch in cells:
        if not report.time_left():
            report.emit(f"| {context} | {batch} | skipped: time budget | | | |")
            continue
        report.progress(f"AR decode, context {context}, batch {batch}")
        prompts = torch.randint(0, target.config.vocab_size, (batch, context), generator=gen).tolist()
        # The static length blockspec's captured AR round uses (a power of two), given to transformers too.
        cache_len = max(256, 1 << (context + new_tokens + 2 - 1).bit_length())
        ids = torch.tensor(prompts, device=target.device)

        def ours(n: int) -> list[int]:
            out = generate(target, prompts, SamplingParams(max_new_tokens=n, ignore_eos=True),
                           options=GenerateOptions(compile=not smoke))
            return out.completions[0].tokens

        def theirs(n: int) -> list[int]:
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, cache_implementation="static", max_cache_len=cache_len)
            return out[0, context:].tolist()

        ours_rate, ours_tokens = decode_rate(ours, new_tokens, batch, timer, repeats)
        if hf is None:
            report.emit(f"| {context} | {batch} | {ours_rate:.1f} | | | |")
            continue
        if not report.time_left():   # compiling transformers' model for a new shape takes about a minute
            report.emit(f"| {context} | {batch} | {ours_rate:.1f} | skipped: time budget | | |")
            continue
        try:
            theirs_rate, theirs_tokens = decode_rate(theirs, new_tokens, batch, timer, repeats)
        except Exception as exc:   # the baseline's failure must not hide blockspec's figure
            traceback.print_exc(file=sys.stderr)
            report.emit(f"| {context} | {batch} | {ours_rate:.1f} | failed: `{type(exc).__name__}` | | |")
            continue
        same = next((i for i, (a, b) in enumerate(zip(ours_tokens, theirs_tokens)) if a != b), len(ours_tokens))
        report.emit(f"| {context} | {batch} | {ours_rate:.1f} | {theirs_rate:.1f} | {ours_rate / theirs_rate:.2f}x | "
                    f"{same} of {new_tokens} tokens |")
    release_captured(target)


# -- 2. round costs -----------------------------------------------------------------

def round_costs(target: TargetModel, drafts: dict[str, DraftModel], context: int, batches: list[int],
                timer: Timer, smoke: bool) -> dict[int, dict[str, float]]:
    """{batch: {"ar", "verify", "draft <name>": seconds}} with the captured steps."""
    width = max(d.config.block_size for d in drafts.values()) + 1
    cap = -(-(context + 2 * width + 1) // 256) * 256
    top = max(batches)
    runners = {name: CapturedSteps(target, d, compile=not smoke) for name, d in drafts.items()}
    first = next(iter(drafts))
    # The first draft's runner holds the target buffers; the others only their draft's.
    views = {name: r.new_caches(top, cap if name == first else 1, cap + width) for name, r in runners.items()}
    for cache, dcache in views.values():
        cache.lengths.fill_(context)      # kernel times do not depend on the values cached
        dcache.lengths.fill_(context)
    steps, (tcache, _) = runners[first], views[first]
    fwd = {name: r.forwards() for name, r in runners.items()}   # the round's forwards as captured steps
    capture = tuple(drafts[first].config.target_layer_ids)
    out = {}
    for b in batches:
        sampler = RowSampler.from_params([SamplingParams()] * b, target.device)
        anchors = torch.randint(0, target.config.vocab_size, (b,), device=target.device)
        tview = tcache.slice_rows(0, b)
        dviews = {name: views[name][1].slice_rows(0, b) for name in drafts}
        t_len = tview.lengths.clone()
        d_lens = {name: v.lengths.clone() for name, v in dviews.items()}

        def reset() -> None:   # every sample starts from the same cached context
            tview.lengths.copy_(t_len)
            for name, v in dviews.items():
                v.lengths.copy_(d_lens[name])

        t = {"ar": timer.median(lambda: fwd[first].verify_and_commit(target, tview, anchors, None, sampler),
                                reset)}
        for name, d in drafts.items():
            t[f"draft {name}"] = timer.median(
                lambda d=d, name=name: fwd[name].propose(d, target, dviews[name], anchors, sampler),
                reset)
        proposal = fwd[first].propose(drafts[first], target, dviews[first], anchors, sampler)

        def verify() -> None:   # verify, commit, and the kept tokens' features into the draft context
            verdict, features = fwd[first].verify_and_commit(target, tview, anchors, proposal, sampler,
                                                             capture=capture)
            steps.append_context(features, verdict.accepted + 1)

        t["verify"] = timer.median(verify, reset)
        out[b] = t
    return out


def round_section(target: TargetModel, drafts: dict[str, DraftModel], contexts: list[int], batches: list[int],
                  timer: Timer, smoke: bool, report: Report) -> None:
    names = list(drafts)
    g = drafts[names[0]].config.num_drafts
    head = ["context", "batch", "T_ar ms", f"T_verify({g + 1}) ms"] + [f"T_draft {n} ms" for n in names]
    head += [f"{n} (T_draft + T_verify) / T_ar" for n in names]
    head += [f"{n} speedup @ tau {tau}" for n in names for tau in TAUS]
    report.emit("", f"**Round costs, captured steps** (greedy; verify window {g + 1} = anchor + {g} drafts; "
                "T_verify includes the commit and the draft context; speedup(tau) = tau * T_ar / "
                "(T_draft + T_verify), tau counting the bonus token)", "",
                "| " + " | ".join(head) + " |", "|---" * len(head) + "|")
    for context in contexts:
        if not report.time_left():
            report.emit(f"| {context} | skipped: time budget |" + " |" * (len(head) - 2))
            continue
        report.progress(f"round costs, context {context}")
        with torch.inference_mode():   # as generate and the engine run
            costs = round_costs(target, drafts, context, batches, timer, smoke)
        for b, t in costs.items():
            cells = [str(context), str(b), f"{t['ar'] * 1e3:.2f}", f"{t['verify'] * 1e3:.2f}"]
            cells += [f"{t[f'draft {n}'] * 1e3:.2f}" for n in names]
            cells += [f"{(t[f'draft {n}'] + t['verify']) / t['ar']:.2f}" for n in names]
            cells += [f"{tau * t['ar'] / (t[f'draft {n}'] + t['verify']):.2f}x" for n in names for tau in TAUS]
            report.emit("| " + " | ".join(cells) + " |")
        if target.device.type == "cuda":
            torch.cuda.empty_cache()


# -- 3. engine throughput with simulated acceptance ---------------------------------

def run_engine(target: TargetModel, draft: DraftModel | None, method: str, prompts: list[list[int]], conc: int,
               new_tokens: int, table, smoke: bool) -> tuple[float, float, int]:
    """(generated tok/s, tau, slots) of one captured engine over `prompts`, acceptance forced to
    SIM_TAU. A first batch of `conc` short requests runs untimed in the same engine: the steps of
    its row bucket and widths are recorded then (CUDA graphs), as a server's first requests would."""
    policy = PolicyOptions(adapt=False, scheduled=table is not None, cost_table=table)
    # --smoke: the static-shape steps run uncompiled (inductor on 2 CPU cores would take minutes).
    options = EngineOptions(compile=True, capture_mode="eager" if smoke else None)
    engine = Engine(target, draft, method=method, max_running=conc,
                    max_model_len=max(map(len, prompts)) + new_tokens + 64, policy=policy, options=options)
    if draft is not None:
        engine.forwards = ForcedAcceptance(engine.forwards, accept_pattern(SIM_TAU, draft.config.num_drafts))
    for p in prompts[:conc]:
        engine.submit(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.run_until_done()
    before = engine.metrics()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(p, params)
    engine.run_until_done()
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    m = engine.metrics()
    generated = m["generated_tokens"] - before["generated_tokens"]
    rounds = m["request_rounds"] - before["request_rounds"]
    accepted = m["drafts_accepted"] - before["drafts_accepted"]
    return generated / elapsed, (accepted + rounds) / max(rounds, 1), engine.rows


def engine_section(target: TargetModel, dflash: DraftModel, dspark: DraftModel, concurrency: list[int],
                   new_tokens: int, prompt_len: int, smoke: bool, report: Report) -> None:
    report.progress("engine: profiling the cost table of scheduled DSpark")
    ns = [1, 2, 4, 8] if smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def profile():
        return profile_cost_table(target, ns, ProfileOptions(repeats=1 if smoke else 3, rows=min(16, max(ns)),
                                                             context=prompt_len),
                                  capture=tuple(dspark.config.target_layer_ids), draft=dspark,
                                  draft_rows=[1, 2] if smoke else [1, 4, 16, 32])
    try:
        table = profile()
    except Exception as exc:   # the eager packed forwards use compiled flex_attention on CUDA: the likeliest
        traceback.print_exc(file=sys.stderr)   # first-contact failure; the masked SDPA path runs anywhere
        report.emit("", f"(cost-table profiling failed: `{type(exc).__name__}: {str(exc).splitlines()[0][:200]}`; "
                    "profiled again with BLOCKSPEC_ATTENTION=sdpa)")
        with attention_backend("sdpa"):
            table = profile()
    arms = {"AR": (None, "ar", None), "DFlash": (dflash, "dflash", None), "DSpark scheduled": (dspark, "dspark", table)}
    report.emit("", f"**Engine throughput with SIMULATED acceptance** (tau {SIM_TAU} imposed: NOT lossless; "
                f"prompts of {prompt_len} random tokens, {new_tokens} new tokens each, max(2, 2 x concurrency) "
                "requests; continuous batching, rounds on captured steps (`EngineOptions(compile=True)`), "
                "ragged verify padded to its width bucket; cost table profiled with eager packed forwards; "
                "tok/s (tau))", "",
                "| concurrency | " + " | ".join(arms) + " | DFlash / AR | DSpark scheduled / AR |",
                "|---" * (len(arms) + 3) + "|")
    gen = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    for conc in concurrency:
        if not report.time_left():
            report.emit(f"| {conc} | skipped: time budget |" + " |" * (len(arms) + 1))
            continue
        report.progress(f"engine, concurrency {conc}")
        prompts = torch.randint(0, vocab, (max(2, 2 * conc), prompt_len), generator=gen).tolist()
        cells = {}
        for name, (d, m, tab) in arms.items():
            cells[name] = run_engine(target, d, m, prompts, conc, new_tokens, tab, smoke)
            gc.collect()   # the engine's KV pool and graphs go before the next one plans its memory
            if target.device.type == "cuda":
                torch.cuda.empty_cache()
        ar = cells["AR"][0]
        slots = {rows for _, _, rows in cells.values()}
        row = [f"{cells['AR'][0]:.1f}"] + [f"{tps:.1f} ({tau:.2f})" for name, (tps, tau, _) in cells.items()
                                            if name != "AR"]
        row += [f"{cells['DFlash'][0] / ar:.2f}x", f"{cells['DSpark scheduled'][0] / ar:.2f}x"]
        note = "" if slots == {conc} else f" (slots: {sorted(slots)}: fewer fit)"
        report.emit(f"| {conc}{note} | " + " | ".join(row) + " |")
    if not report.time_left():
        return
    report.progress("engine: host synchronisations per round")
    counted = {name: round_syncs(target, d, m, prompt_len, tab, smoke) for name, (d, m, tab) in arms.items()}
    report.emit("", "Host synchronisations per steady engine round (4 running requests; "
                "`torch.cuda.set_sync_debug_mode`, which flags every synchronising CUDA call; the goal: the "
                "outcome's one read, DSpark's planner adding its copy of the confidences): "
                + ", ".join(f"{name} {n}" for name, n in counted.items()))


def round_syncs(target: TargetModel, draft: DraftModel | None, method: str, prompt_len: int, table,
                smoke: bool) -> str:
    """Synchronising CUDA calls per engine round (`speculative_round`), over 5 rounds after the steps
    are recorded (CPU: not measurable here; tests/engine/test_engine_captured.py counts host reads)."""
    if target.device.type != "cuda":
        return "n/a (CPU)"
    policy = PolicyOptions(adapt=False, scheduled=table is not None, cost_table=table)
    engine = Engine(target, draft, method=method, max_running=4, max_model_len=prompt_len + 96, policy=policy,
                    options=EngineOptions(compile=True))
    gen = torch.Generator().manual_seed(2)
    for p in torch.randint(0, target.config.vocab_size, (4, prompt_len), generator=gen).tolist():
        engine.submit(p, SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(3):   # admission, then rounds that record the steps
        engine.step()
    rounds = engine.metrics()["rounds"]
    real = engine_module.speculative_round

    def watched(*args, **kwargs):   # the round alone (not the engine's bookkeeping between rounds)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine_module.speculative_round = watched
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                engine.step()
    finally:
        engine_module.speculative_round = real
    done = engine.metrics()["rounds"] - rounds
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    engine.shutdown(drain=False)
    return f"{len(syncs) / max(done, 1):.1f}"


# -- main ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    contexts, batches = int_list(args.contexts, "--contexts"), int_list(args.batches, "--batches")
    concurrency = int_list(args.concurrency, "--concurrency")
    if args.new_tokens < 2 or args.iters < 1 or args.warmup < 0:
        print("error: --new-tokens must be >= 2, --iters >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("error: gpu_bench needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); "
              "--smoke rehearses it on the CPU", file=sys.stderr)
        return 2
    cells = ar_cells(args.ar_cells)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    report = Report(args.out, args.budget_s, device)
    report.stop_on_sigterm()
    report.progress("building the models")
    t0 = time.perf_counter()
    target, dflash, dspark = build_models(args.smoke, device, dtype)
    built = time.perf_counter() - t0
    weights_gib = sum(p.numel() * p.element_size() for m in (target, dflash, dspark) for p in m.parameters()) / 2**30
    timer = Timer(device, args.warmup, args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--smoke: numbers meaningless)"
    tc = target.config
    report.emit(f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}; random weights (built in "
                f"{built:.1f}s, {weights_gib:.1f} GiB): target {tc.num_hidden_layers} layers, hidden {tc.hidden_size}, "
                f"vocab {tc.vocab_size}; DFlash draft {dflash.config.num_hidden_layers} layers, z-lab block "
                f"{dflash.config.block_size}; DSpark draft {dspark.config.num_hidden_layers} layers, gamma "
                f"{dspark.config.block_size}, Markov rank {dspark.config.markov_rank}; timings: median of "
                f"{args.iters} after {args.warmup} warm-up")
    # The round costs first: the cheapest section and the main goal; the captured engine
    # next; AR against transformers last (compiling transformers' model takes the longest).
    with report.section("round costs"):
        round_section(target, {"DFlash": dflash, "DSpark": dspark}, contexts, batches, timer, args.smoke, report)
    with report.section("engine"):
        engine_section(target, dflash, dspark, concurrency, args.new_tokens, min(contexts), args.smoke, report)
    with report.section("AR decode"):
        ar_section(target, SMOKE_TARGET if args.smoke else QWEN3_8B, cells, args.new_tokens, timer, args.smoke,
                   report)
    report.emit("", f"peak memory: {peak_memory(device, report.peak_gib or None)} (weights {weights_gib:.1f} GiB; per section: "
                + "; ".join(report.section_notes) + f"); total {time.perf_counter() - report.t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
