"""The `blockspec` command line: thin, parses flags and calls the package API.

Every BlockspecError is printed as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from blockspec import __version__, embedded
from blockspec.bench.cli import add_bench_parser
from blockspec.config import SamplingParams
from blockspec.decoding.generate import GenerateOptions, generate
from blockspec.decoding.policy import PolicyOptions, RoundPolicy
from blockspec.decoding.cost_table import ProfileOptions, profile_cost_table
from blockspec.decoding.output import TextTracker
from blockspec.decoding.table_cache import cached_cost_table, cached_keys, table_key, table_path
from blockspec.errors import BlockspecError
from blockspec.interop import ENGINES, HOSTS, EngineCompatibilityWarning, launch_line, mask_token_of
from blockspec.loading import draft_method, load_drafts, load_models
from blockspec.models.checkpoint import load_draft, load_target, save_draft
from blockspec.options import (add_chat_template_flag, add_compile_flag, add_dataclass_flags, add_dtype_flag,
                               add_eagle_shape_flags, add_load_flags, add_model_flags, add_policy_flags, add_rule_flag,
                               add_target_flag, dataclass_from_args, eagle_shape, load_options, policy_options)
from blockspec.serving.server import add_serve_parser
from blockspec.training.calibrate import collect_rollouts, fit_sts, save_temperatures
from blockspec.training.corpus import build_corpus, train_tokenizer
from blockspec.training.data import load_prompts, regenerate
from blockspec.training.regenerate import TURNS, EndpointConfig, regenerate_endpoint
from blockspec.training.pretrain import PretrainConfig, pretrain
from blockspec.training.trainer import TrainConfig, train


def cmd_pretrain(args: argparse.Namespace) -> None:
    print(json.dumps(pretrain(dataclass_from_args(PretrainConfig, args, args.config))))


def cmd_corpus(args: argparse.Namespace) -> None:
    manifest = build_corpus(Path(args.out), val_percent=args.val_percent, packages=args.packages,
                            val_package_percent=args.val_package_percent)
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("file_list", "packages")}))
    if args.tokenizer_out:
        train_tokenizer(Path(args.out), Path(args.tokenizer_out), args.vocab_size)


def cmd_generate(args: argparse.Namespace) -> None:
    block_size, tree = eagle_shape(args.method, args.block_size, args.speculative_eagle_topk,
                                   args.speculative_num_steps, args.speculative_num_draft_tokens)
    models = load_models(args.target, args.draft, args.method, block_size=block_size, tree=tree,
                         chat_template=args.chat_template, **load_options(args))
    # Flags not given fall back to the checkpoint's generation_config.json, then SamplingParams' own defaults.
    params = models.generation_defaults.sampling_params(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens)
    params.check_vocab(models.target.config.vocab_size)
    tokenizer = models.tokenizer
    # A chat prompt carries the template's special tokens; a plain one gets the tokenizer's (BOS).
    prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
                  else tokenizer.encode(args.prompt))
    stream = TextTracker(tokenizer, stops=[])
    if not args.chat:
        sys.stdout.write(args.prompt)

    deliveries = [0]

    def on_tokens(row: int, tokens: list[int]) -> None:
        deliveries[0] += 1
        if args.compile and deliveries[0] == 2:   # the first round's tokens: its steps are compiled
            print(f"\n[compile] compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sys.stdout.write(stream.push(tokens, final=False)[1])
        sys.stdout.flush()

    # Built before the clock starts: a first measurement of the cost table (announced on
    # stderr) is setup, not decoding speed.
    policy = RoundPolicy.of(PolicyOptions(**policy_options(args)), models.target, models.draft, args.method)
    if args.compile:
        print("[compile] compiling the decoding steps (torch.compile, once per process; tens of seconds on a "
              "small CPU) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = generate(models.target, [prompt_ids], params, draft=models.draft, method=args.method, rule=args.rule,
                   policy=policy, options=GenerateOptions(on_tokens=on_tokens, compile=args.compile))
    elapsed = time.perf_counter() - t0
    sys.stdout.write(stream.push([], final=True)[1] + "\n")
    if args.stats:
        c, t = out.completions[0], out.timing
        drafted = sum(v > 0 for v in c.stats.verified)
        print(f"[{args.method}] {len(c.tokens)} tokens in {elapsed:.2f}s ({len(c.tokens) / elapsed:.1f} tok/s), "
              f"tau {c.stats.tau:.2f} over {c.stats.rounds} rounds ({drafted} drafted); prefill {t.prefill_s * 1e3:.0f} ms, "
              f"draft {t.draft_s * 1e3:.0f} ms, verify {t.verify_s * 1e3:.0f} ms; finish: {c.finish_reason}"
              + ("; the time includes compiling the steps (once per process)" if args.compile else ""),
              file=sys.stderr)


def cmd_regenerate(args: argparse.Namespace) -> None:
    if args.endpoint:
        summary = regenerate_endpoint(endpoint_config(args), Path(args.prompts), Path(args.out))
        print(json.dumps(summary))
        if summary["failed"]:
            raise BlockspecError(f"regenerate: {summary['failed']} of {summary['rows']} rows failed (listed with their "
                                 f"errors in {summary['failed_file']}); run the same command again to retry them")
        return
    models = load_models(args.target, chat_template=args.chat_template, **load_options(args))
    prompts = load_prompts(args.prompts, models.tokenizer, args.num_prompts or 1000, seed=args.seed)
    n = regenerate(models.target, prompts, Path(args.out), max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                   temperature=args.temperature, seed=args.seed)
    print(json.dumps({"prompts": n, "out": args.out}))


def add_endpoint_flags(p: argparse.ArgumentParser) -> None:
    """`regenerate --endpoint ...`: through an OpenAI-compatible server instead of in process."""
    p.add_argument("--endpoint", default=None,
                   help="OpenAI-compatible server (vLLM, SGLang, blockspec serve), e.g. http://localhost:8000: the "
                        "target's answers come from its /v1/chat/completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for --endpoint (default: $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name for --endpoint (default: the server's only model)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight with --endpoint")
    p.add_argument("--turns", choices=TURNS, default="all",
                   help="all: every assistant turn regenerated in order (the target's own history); last: only "
                        "the final turn (earlier answers kept as context, not trained on)")
    p.add_argument("--retries", type=int, default=3, help="retries per request (backoff) on 429 / 5xx / network errors")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--extra-body", default=None,
                   help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'')


def endpoint_config(args: argparse.Namespace) -> EndpointConfig:
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as exc:
        raise BlockspecError(f"--extra-body is not valid JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise BlockspecError("--extra-body must be a JSON object")
    return EndpointConfig(endpoint=args.endpoint, api_key=args.api_key, model=args.model, concurrency=args.concurrency,
                          max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          turns=args.turns, retries=args.retries, timeout_s=args.request_timeout,
                          limit=args.num_prompts, extra_body=extra)


def cmd_train(args: argparse.Namespace) -> None:
    result = train(dataclass_from_args(TrainConfig, args, args.config))
    if result["rank"] == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "param_checksum"}))


def cmd_convert(args: argparse.Namespace) -> None:
    """Load a draft in any supported format and save it (dtype change / normalised names)."""
    target = load_target(args.target, device="cpu") if args.target else None
    draft = load_draft(args.draft, device="cpu", target=target)
    # The mask token's string, for SGLang's check (written only when the config has none).
    mask = mask_token_of(Path(args.target), draft.config.mask_token_id) if args.target else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EngineCompatibilityWarning)
        save_draft(draft, Path(args.out), dtype=args.dtype, mask_token=mask)
    for w in caught:  # engine warnings as CLI lines; anything else as Python shows it
        if issubclass(w.category, EngineCompatibilityWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(json.dumps({"out": args.out, "layout": draft.config.layout, "block_size": draft.config.block_size,
                      "dtype": args.dtype}))


def cmd_launch_line(args: argparse.Namespace) -> None:
    """Print the command that serves a draft with vLLM, SGLang or blockspec (notes on stderr)."""
    host = args.host if args.host != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    line = launch_line(args.draft, args.engine, target=args.target, scheduled=args.scheduled, host=host)
    for note in line.notes:
        print(f"note: {note}", file=sys.stderr)
    if line.problems:
        raise BlockspecError(f"{args.engine} cannot load this draft as saved: {'; '.join(line.problems)} "
                             f"(blockspec serves it: blockspec launch-line {args.draft} --engine blockspec)")
    print(line.shell())


def cmd_profile(args: argparse.Namespace) -> None:
    """Measure the verify cost table T(n) that DSpark's scheduler plans with."""
    opts = load_options(args)
    target = load_target(Path(args.target) if args.target else embedded.default_target(), **opts)
    ns = [int(x) for x in args.tokens.split(",")] if args.tokens else list(range(1, args.max_tokens + 1))
    draft = None
    if args.draft is not None:
        draft_dir = embedded.default_draft("dspark") if args.draft == "embedded" else Path(args.draft)
        kind = draft_method(draft_dir)   # an EAGLE-3 draft is timed as chains of each length
        draft = load_drafts(target, {kind: draft_dir}, [kind], allow_nonfinite=opts["allow_nonfinite"])[kind]
    if args.refresh:
        if draft is None:
            raise BlockspecError("profile --refresh re-measures the adaptive policy's cached tables of a model "
                                 "pair: give --draft DIR (or --draft embedded)")
        # Every row count cached for this machine and pair (a server's too), else one row.
        rows = sorted({int(key["rows"]) for key in cached_keys() if key == table_key(target, draft, int(key["rows"]))})
        tables, seconds = {}, {}
        for r in rows or [1]:
            t0 = time.perf_counter()
            tables[r] = cached_cost_table(target, draft, r, refresh=True)
            seconds[r] = round(time.perf_counter() - t0, 2)
        print(json.dumps({"refreshed": [str(table_path(t.meta["key"])) for t in tables.values()],
                          "rows": list(tables), "seconds": seconds}))
        return
    draft_rows = [int(x) for x in args.draft_rows.split(",")] if args.draft_rows else None
    options = ProfileOptions(repeats=args.repeats, rows=args.rows, context=args.context)
    table = profile_cost_table(target, ns, options, draft=draft, draft_rows=draft_rows,
                               capture=tuple(draft.config.target_layer_ids) if draft is not None else ())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.save(Path(args.out))
    report = {"out": args.out, "points": len(table.ns),
              "ms": {n: round(t * 1e3, 3) for n, t in zip(table.ns, table.times_s)}}
    if table.has_draft_times:
        report["draft_ms"] = {r: round(t * 1e3, 3) for r, t in zip(table.draft_rows, table.draft_times_s)}
    for slots, times in table.draft_slot_times.items():   # shorter blocks: {slots: {rows: ms}}
        report.setdefault("draft_ms_by_slots", {})[slots] = {r: round(t * 1e3, 3)
                                                             for r, t in zip(table.draft_rows, times)}
    print(json.dumps(report))


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Fit per-slot confidence temperatures (STS) on held-out rollouts; report before / after."""
    models = load_models(args.target, args.draft, "dspark", **load_options(args))
    target, draft = models.target, models.draft
    prompts = load_prompts(args.prompts, models.tokenizer, args.num_prompts, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    half = len(prompts) // 2  # fit on one half, report on the other
    fit, held = collect_rollouts(target, draft, prompts[:half], params), collect_rollouts(target, draft, prompts[half:], params)
    temps = fit_sts(fit)
    summary = {k: {m: v[m] for m in ("ece", "brier", "auroc", "n")}
               for k, v in (("before", held.prefix_calibration()), ("after", held.prefix_calibration(temps)))}
    # Keep the temperatures only if they calibrate the held-out half better.
    improved = summary["after"]["ece"] < summary["before"]["ece"]
    saved = not args.dry_run and (improved or args.force)
    out = calibrated_dir(Path(args.draft), args.out, args.in_place) if saved else None
    if out is not None:
        save_temperatures(out, temps)
    print(json.dumps({"temperatures": temps, "held_out": summary, "saved": saved,
                      "out": str(out) if out is not None else None}))


def calibrated_dir(draft: Path, out: str | None, in_place: bool) -> Path:
    """Where calibrated temperatures go: the draft itself only with --in-place; else a copy of it
    (--out, default DRAFT-calibrated), so a shipped or shared draft is never rewritten by surprise."""
    if in_place:
        if out is not None:
            raise BlockspecError("give --out or --in-place, not both")
        return draft
    target = Path(out) if out is not None else draft.with_name(draft.name + "-calibrated")
    if target.exists():
        raise BlockspecError(f"{target} exists: choose another --out (or --in-place to rewrite {draft})")
    shutil.copytree(draft, target)
    return target


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text (streams to the terminal)")
    p.add_argument("prompt")
    add_model_flags(p)
    add_eagle_shape_flags(p)
    # Sampling flags default to the checkpoint's generation_config.json (as vLLM), then to
    # greedy / 128 tokens (SamplingParams' defaults).
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: generation_config.json's max_new_tokens, else 128")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: generation_config.json's temperature, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default: generation_config.json's, else 0)")
    p.add_argument("--seed", type=int, default=None)
    add_rule_flag(p)
    add_policy_flags(p)
    p.add_argument("--chat", action="store_true", help="format the prompt with the chat template")
    add_compile_flag(p, "AR: torch.compile the decode step; speculative methods: captured static round steps "
                        "(CUDA graphs on a GPU, torch.compile on the CPU); slow first step, faster after")
    p.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_generate)


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="re-save a DFlash / DSpark draft (checks it, normalises names, casts dtype)")
    p.add_argument("--draft", required=True)
    p.add_argument("--out", required=True)
    add_target_flag(p, help="check the draft against this target")
    add_dtype_flag(p, default="bfloat16", help="dtype of the saved draft (default bfloat16)")
    p.set_defaults(func=cmd_convert)


def _add_launch_line(sub: Any) -> None:
    p = sub.add_parser("launch-line", help="print the exact command that serves a draft in vLLM, SGLang or blockspec")
    p.add_argument("draft", help="draft directory (z-lab DFlash or DeepSpec DSpark)")
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--target", default=None,
                   help="target directory: checks the pair and puts it in the line (else the placeholder TARGET)")
    p.add_argument("--scheduled", action="store_true",
                   help="confidence-based verification (blockspec --scheduled; vLLM enable_adaptive_verification)")
    p.add_argument("--host", choices=("auto", *HOSTS), default="auto",
                   help="the machine the engine runs on (auto: this one): on a CPU host vLLM's line is the form its "
                        "CPU build starts")
    p.set_defaults(func=cmd_launch_line)


def _add_profile(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure the verify cost table T(n) for DSpark scheduling")
    add_target_flag(p)
    p.add_argument("--out", default="cost_table.json")
    p.add_argument("--max-tokens", type=int, default=256, help="profile n = 1..max-tokens")
    p.add_argument("--tokens", default=None, help="explicit comma-separated n values instead")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    add_load_flags(p)
    p.add_argument("--draft", default=None,
                   help="also time draft rounds of this draft ('embedded' = the shipped DSpark draft), so the "
                        "scheduled engine can skip drafting when a plain AR round is faster")
    p.add_argument("--draft-rows", default=None, help="request counts to time draft rounds at (default 1,2,4,8,16,32)")
    p.add_argument("--refresh", action="store_true",
                   help="instead: measure again the cost tables the adaptive policy cached for this machine and "
                        "--draft (every row count cached, else one row), e.g. after they were measured on a busy "
                        "machine")
    p.set_defaults(func=cmd_profile)


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit DSpark confidence temperatures (STS) on held-out rollouts")
    p.add_argument("--draft", required=True)
    add_target_flag(p)
    p.add_argument("--prompts", required=True, help="jsonl of prompts, or a corpus directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--dry-run", action="store_true", help="report only, do not write the temperatures")
    p.add_argument("--force", action="store_true", help="write the temperatures even if held-out ECE does not improve")
    p.add_argument("--out", default=None, help="the calibrated draft: a copy of --draft (default: DRAFT-calibrated)")
    p.add_argument("--in-place", action="store_true", help="write the temperatures into --draft itself")
    add_load_flags(p)
    p.set_defaults(func=cmd_calibrate)


def _add_corpus(sub: Any) -> None:
    p = sub.add_parser("corpus", help="build the offline Python code corpus (+ BPE tokenizer)")
    p.add_argument("--out", default="runs/corpus")
    p.add_argument("--val-percent", type=int, default=2, help="stdlib files held out (by path hash)")
    p.add_argument("--packages", action=argparse.BooleanOptionalAction, default=True,
                   help="add the installed distributions' Python sources (default: yes)")
    p.add_argument("--val-package-percent", type=int, default=6,
                   help="installed distributions held out whole (by name hash)")
    p.add_argument("--tokenizer-out", default="runs/tokenizer", help="train a BPE tokenizer here ('' = none)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=cmd_corpus)


def _add_regenerate(sub: Any) -> None:
    p = sub.add_parser("regenerate", help="write the target's own responses to prompts (draft training data)")
    p.add_argument("--prompts", required=True,
                   help="jsonl of prompt/text/messages rows, or a corpus directory; with --endpoint: jsonl (or a "
                        "JSON array) of messages / ShareGPT conversations / prompt rows")
    p.add_argument("--out", required=True)
    add_endpoint_flags(p)
    add_target_flag(p)
    add_chat_template_flag(p)   # renders the 'messages' rows
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N rows (default: all with --endpoint, else 1000)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    add_load_flags(p)
    p.set_defaults(func=cmd_regenerate)


def _add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="train a DFlash, DSpark or EAGLE-3 drafter (also under torchrun)")
    p.add_argument("--config", default=None, help="JSON file of TrainConfig fields")
    add_dataclass_flags(p, TrainConfig)
    p.set_defaults(func=cmd_train)


def _add_pretrain(sub: Any) -> None:
    p = sub.add_parser("pretrain", help="pretrain a small target model on the code corpus")
    p.add_argument("--config", default=None, help="JSON file of PretrainConfig fields")
    add_dataclass_flags(p, PretrainConfig)
    p.set_defaults(func=cmd_pretrain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="Block speculative decoding (DFlash / DSpark).")
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_launch_line(sub)
    _add_profile(sub)
    _add_calibrate(sub)
    _add_corpus(sub)
    _add_regenerate(sub)
    _add_train(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    _add_pretrain(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # also `torchrun ... -m blockspec.cli train ...`
    sys.exit(main())
