"""`blockspec serve`: load the models, build an Engine, run the OpenAI-compatible API.

Flags follow blockspec's own names, plus the aliases SGLang / vLLM users know, so a
copied `vllm serve MODEL ...` or `python -m sglang.launch_server --model-path ...` line
works (an unsupported flag is named by argparse, exit 2):
- the target: positional MODEL, `--model`, `--model-path` (= --target);
- memory: `--gpu-memory-utilization` / `--mem-fraction-static`, `--kv-memory-gb`,
  `--max-model-len` / `--context-length`, `--max-num-seqs` / `--max-running-requests`
  (= --max-running); the plan is printed at start (engine/memory.py);
- prefill: `--prefill-chunk-tokens` / `--chunked-prefill-size` (SGLang; -1: off) /
  `--max-num-batched-tokens` (vLLM): longer prompts are prefilled that many tokens per
  step between the running requests' rounds (engine/prefill_chunks.py);
- speculation: `--speculative-algorithm` (DFLASH, DSPARK, EAGLE3), `--speculative-draft-model-path`,
  `--speculative-dflash-block-size`, `--speculative-dspark-block-size`,
  `--speculative-num-draft-tokens` and
  `--speculative-config '{"method": ..., "model": ..., "num_speculative_tokens": N}'`
  (keys that only tune vLLM's engine, SPEC_CONFIG_IGNORED, are accepted with a warning).
Block sizes are in the draft's own convention (z-lab: includes the anchor);
num_speculative_tokens counts drafts (z-lab block = N + 1, DeepSpec block = N, EAGLE-3: a
chain of N);
SGLang's speculative_num_draft_tokens counts the verified tokens including the
anchor, as its EAGLE chains do (drafts = N - 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.config import DRAFT_METHODS, EagleTree, GenerationDefaults
from blockspec.decoding.captured import EAGLE3_NOT_CAPTURED
from blockspec.decoding.policy import TREE_NEEDS_FIXED_POLICY, PolicyOptions
from blockspec.engine.engine import Engine, EngineOptions
from blockspec.errors import BlockspecError
from blockspec.loading import draft_method, load_models
from blockspec.options import (add_compile_flag, add_model_flags, add_policy_flags, eagle_shape, load_options,
                               policy_options)
from blockspec.serving.stats_log import INTERVAL_S as STATS_INTERVAL_S

log = logging.getLogger(__name__)

SPEC_CONFIG_KEYS = ("method", "model", "num_speculative_tokens")
# vLLM speculative_config keys that tune only vLLM's own engine (kernels, batching, logging,
# parallelism): blockspec's output does not depend on them, so they are accepted and ignored.
SPEC_CONFIG_IGNORED = ("attention_backend", "disable_padded_drafter_batch", "disable_log_stats", "disable_logprobs",
                       "enforce_eager", "disable_by_batch_size", "draft_tensor_parallel_size")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# vLLM / SGLang flags that do not change what blockspec computes: accepted, with a one-line
# warning naming why they do nothing here. flag(s) -> (argparse options, why).
IGNORED_FLAGS: dict[tuple[str, ...], tuple[dict[str, Any], str]] = {
    ("--attention-backend",): ({}, "blockspec picks its own attention kernels"),
    ("--trust-remote-code",): ({"action": "store_true"}, "blockspec never runs code from a checkpoint"),
    ("--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-radix-cache"):
        ({"action": "store_true"}, "blockspec keeps no prefix cache (every prompt is prefilled)"),
    ("--enforce-eager",): ({"action": "store_true"}, "blockspec runs eagerly unless --compile"),
    ("--disable-log-requests", "--enable-log-requests"): ({"action": "store_true"},
                                                          "blockspec does not log request bodies"),
    ("--tensor-parallel-size", "-tp", "--tp-size", "--tp"): ({"type": int}, "blockspec runs on one device"),
    ("--pipeline-parallel-size", "-pp", "--pp-size"): ({"type": int}, "blockspec runs on one device"),
    ("--swap-space",): ({"type": float}, "blockspec does not swap KV blocks to the host"),
    ("--uvicorn-log-level",): ({}, "use --log-level"),
    ("--max-log-len",): ({"type": int}, "blockspec does not log prompts"),
}


# -- speculation flags ----------------------------------------------------------------------

def speculative_config(text: str) -> dict[str, Any]:
    """argparse type of --speculative-config: a JSON object with known keys only."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(raw) - set(SPEC_CONFIG_KEYS) - set(SPEC_CONFIG_IGNORED))
    if unknown:
        raise argparse.ArgumentTypeError(f"unsupported key(s) {unknown} (supported: {', '.join(SPEC_CONFIG_KEYS)}; "
                                         f"accepted and ignored: {', '.join(SPEC_CONFIG_IGNORED)})")
    method = raw.get("method")
    if method is not None and (not isinstance(method, str) or method.lower() not in DRAFT_METHODS):
        raise argparse.ArgumentTypeError(f"unknown method {method!r} (supported: {', '.join(DRAFT_METHODS)})")
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise argparse.ArgumentTypeError("'model' must be a path string")
    n = raw.get("num_speculative_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise argparse.ArgumentTypeError(f"num_speculative_tokens must be a positive integer, got {n!r}")
    return {"method": method.lower() if method else None, "model": model, "num_speculative_tokens": n,
            "ignored": sorted(set(raw) & set(SPEC_CONFIG_IGNORED))}


def one_of(what: str, **sources: Any) -> Any:
    """The value the given flags agree on (None if none is given); disagreement is an error."""
    given = {flag: value for flag, value in sources.items() if value is not None}
    if len(set(map(str, given.values()))) > 1:
        listed = ", ".join(f"{flag}={value}" for flag, value in given.items())
        raise BlockspecError(f"conflicting {what}: {listed}")
    return next(iter(given.values()), None)


@dataclass
class Speculation:
    method: str
    draft: str | None
    block_size: int | None   # in the draft's own convention
    num_drafts: int | None   # num_speculative_tokens: converted once the draft's layout is known
    tree: EagleTree | None = None   # SGLang's EAGLE tree flags (topk > 1)


def resolve_speculation(args: argparse.Namespace) -> Speculation:
    """Merge --method/--draft/--block-size with their SGLang / vLLM aliases."""
    cfg = args.speculative_config or {}
    if cfg.get("ignored"):
        log.warning("--speculative-config: %s only tune vLLM's engine; ignored", ", ".join(cfg["ignored"]))
    alg = args.speculative_algorithm.lower() if args.speculative_algorithm else None
    draft = one_of("draft paths", draft=args.draft, speculative_draft_model_path=args.speculative_draft_model_path,
                   speculative_config_model=cfg.get("model"))
    method = one_of("methods", method=args.method, speculative_algorithm=alg,
                    speculative_config_method=cfg.get("method"))
    if method is None:  # a draft without a method runs the method its head supports
        method = "ar" if draft is None else draft_method(Path(draft))
    for flag, value, needs in (("--speculative-dflash-block-size", args.speculative_dflash_block_size, "dflash"),
                               ("--speculative-dspark-block-size", args.speculative_dspark_block_size, "dspark"),
                               ("--speculative-num-steps", args.speculative_num_steps, "eagle3"),
                               ("--speculative-eagle-topk", args.speculative_eagle_topk, "eagle3")):
        if value is not None and method != needs:
            raise BlockspecError(f"{flag} applies to method {needs}, not {method}")
    block = one_of("block sizes", block_size=args.block_size,
                   speculative_dflash_block_size=args.speculative_dflash_block_size,
                   speculative_dspark_block_size=args.speculative_dspark_block_size)
    draft_tokens = args.speculative_num_draft_tokens
    if args.speculative_eagle_topk not in (None, 1):   # an EAGLE-3 tree, read as `generate` reads it
        if cfg.get("num_speculative_tokens") is not None:
            raise BlockspecError("a tree's size is --speculative-num-draft-tokens; drop num_speculative_tokens")
        _, tree = eagle_shape(method, block, args.speculative_eagle_topk, args.speculative_num_steps, draft_tokens)
        return Speculation(method, draft, None, None, tree)
    if draft_tokens is not None and draft_tokens < 2:
        raise BlockspecError(f"--speculative-num-draft-tokens counts the anchor and the drafts: at least 2, "
                             f"got {draft_tokens}")
    num_drafts = one_of("draft counts", num_speculative_tokens=cfg.get("num_speculative_tokens"),
                        speculative_num_draft_tokens_minus_1=None if draft_tokens is None else draft_tokens - 1,
                        speculative_num_steps=args.speculative_num_steps)
    if block is not None and num_drafts is not None:
        raise BlockspecError("give a block size or num_speculative_tokens / --speculative-num-draft-tokens, not both")
    if method == "ar" and (draft is not None or block is not None or num_drafts is not None):
        raise BlockspecError("a draft / block size needs a speculative method (--method dflash, dspark or eagle3)")
    return Speculation(method, draft, block, num_drafts)


def block_for(layout: str, num_drafts: int) -> int:
    """Block size giving `num_drafts` drafts per round: z-lab blocks and EAGLE-3 chains
    (`ChainDraftConfig.block_size`) include the anchor."""
    return num_drafts + 1 if layout in ("zlab", "eagle3") else num_drafts


# -- building and running ---------------------------------------------------------------------

def resolve_target(args: argparse.Namespace) -> str | None:
    """--target and its vLLM / SGLang spellings (positional MODEL, --model, --model-path)."""
    return one_of("target models", target=args.target, model=args.model, model_path=args.model_path,
                  positional_model=args.model_positional)


def build_engine(args: argparse.Namespace):
    """(Engine, Tokenizer, served model name) from parsed `serve` flags."""
    args.target = resolve_target(args)
    spec = resolve_speculation(args)
    if args.cost_table and spec.method == "ar":
        raise BlockspecError("--cost-table prices speculative rounds: it needs a speculative method (--draft / "
                             "--method dflash|dspark|eagle3)")
    # The policy's options, checked before the models load (a bad combination costs no load).
    policy = PolicyOptions(**policy_options(args), scheduled=args.scheduled,
                           draft_gate=True if args.draft_gate else None,
                           cost_table=args.cost_table or None)   # read after the models load
    if spec.tree is not None and policy.plans:
        raise BlockspecError(TREE_NEEDS_FIXED_POLICY)
    if args.compile and spec.method == "eagle3":
        raise BlockspecError(EAGLE3_NOT_CAPTURED)
    models = load_models(args.target, spec.draft, spec.method, block_size=spec.block_size, tree=spec.tree,
                         chat_template=args.chat_template, **load_options(args))
    target, tokenizer, draft = models.target, models.tokenizer, models.draft
    # the server's request defaults, as the CLI's
    args.generation_defaults = generation_defaults(args, models.generation_defaults)
    if spec.tree is not None and args.generation_defaults.sampling_params().penalized:   # else every request is refused
        penalty = args.generation_defaults.repetition_penalty
        raise BlockspecError(f"the generation config sets repetition_penalty {penalty}, which EAGLE-3 tree drafting "
                             f"(topk > 1) does not apply: add --generation-config vllm, or use a chain (topk 1)")
    if draft is not None and spec.num_drafts is not None:
        draft = draft.with_block_size(block_for(draft.config.layout, spec.num_drafts))
    engine = Engine(target, draft, spec.method, max_running=args.max_running, max_model_len=args.max_model_len,
                    tokenizer=tokenizer, policy=policy,
                    options=EngineOptions(kv_memory_gb=args.kv_memory_gb,
                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                          prefill_chunk_tokens=args.prefill_chunk_tokens,
                                          compile=args.compile))
    log.info("%s", engine.memory_plan.describe())
    return engine, tokenizer, args.served_model_name or args.target or "blockspec"


def warn_ignored(args: argparse.Namespace) -> None:
    for flags, (_, why) in IGNORED_FLAGS.items():
        value = getattr(args, ignored_dest(flags))
        if value not in (None, False) and not (flags[0].endswith("parallel-size") and value == 1):
            log.warning("%s is accepted for compatibility and ignored: %s", flags[0], why)


def ignored_dest(flags: tuple[str, ...]) -> str:
    return "ignored_" + flags[0].lstrip("-").replace("-", "_")


def generation_defaults(args: argparse.Namespace, target_defaults: GenerationDefaults) -> GenerationDefaults:
    """vLLM's --generation-config: "auto" (the target's generation_config.json), "vllm" (none) or a folder."""
    if args.generation_config == "auto":
        return target_defaults
    if args.generation_config == "vllm":
        return GenerationDefaults()
    folder = Path(args.generation_config)
    if not (folder / "generation_config.json").is_file():
        raise BlockspecError(f"--generation-config: {folder / 'generation_config.json'} does not exist "
                             "(give auto, vllm or a folder holding one)")
    return GenerationDefaults.load(folder)


def cmd_serve(args: argparse.Namespace) -> None:
    try:  # lazy: FastAPI / uvicorn / prometheus_client are the optional `serve` extra
        from blockspec.serving.api import ServerLimits, create_app
        from blockspec.serving.runner import run_server
    except ImportError as exc:
        raise BlockspecError(f"serving needs FastAPI, uvicorn and prometheus_client: "
                             f"pip install 'blockspec[serve]' ({exc})") from None

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                          max_prompt_bytes=args.max_prompt_bytes)
    warn_ignored(args)
    engine, tokenizer, name = build_engine(args)
    app = create_app(engine, tokenizer, name, api_key=args.api_key or None, limits=limits,
                     defaults=args.generation_defaults,
                     stats_interval=0.0 if args.disable_log_stats else STATS_INTERVAL_S)
    if args.host not in LOOPBACK and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who reaches this port can use it", args.host)
    log.info("model %r: method %s, %d KV slots of %d positions", name, engine.method, engine.rows,
             engine.max_model_len)
    run_server(app, args.host, args.port, args.drain_timeout, args.log_level,
               timeout_keep_alive=args.timeout_keep_alive, header_timeout=args.header_timeout,
               body_timeout=args.body_timeout)


# -- flags ----------------------------------------------------------------------------------------

def prefill_chunk(text: str) -> int:
    """--prefill-chunk-tokens: tokens per step (the engine refuses 0 and negatives); SGLang's
    -1 turns chunking off: no prompt is longer than the largest int."""
    value = int(text)
    return sys.maxsize if value == -1 else value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.set_defaults(method=None)  # None: from the aliases, else from the draft, else ar
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help="= --target (vLLM style)")
    add_policy_flags(p)
    p.add_argument("--scheduled", action="store_true", default=None,
                   help="DSpark confidence-scheduled verification (default: on with --adapt and a draft with a "
                        "confidence head)")
    p.add_argument("--cost-table", default=None,
                   help="verify / draft cost table JSON (blockspec profile); default with --adapt: this "
                        "machine's, measured once and cached")
    p.add_argument("--draft-gate", action="store_true",
                   help="pick each round's block length, or a plain AR round, by the cost table's predicted "
                        "throughput (on by default with --adapt)")
    add_compile_flag(p, "run the engine's rounds as captured static-shape steps (CUDA graphs on a GPU, "
                        "torch.compile on the CPU): each new row / width bucket is recorded on first use")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BLOCKSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $BLOCKSPEC_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--max-running", "--max-num-seqs", "--max-running-requests", dest="max_running", type=int,
                   default=32, help="most requests decoding at once (KV slots; fewer if memory holds fewer)")
    p.add_argument("--gpu-memory-utilization", "--mem-fraction-static", dest="gpu_memory_utilization",
                   type=float, default=None,
                   help="fraction of the device's memory (GPU, or host RAM on the CPU) blockspec may use; the KV "
                        "cache gets what is left after the weights and an activation reserve (default 0.9)")
    p.add_argument("--kv-memory-gb", type=float, default=None,
                   help="KV cache budget in GiB (instead of --gpu-memory-utilization)")
    p.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None,
                   help="prompt + output positions per request (default: the model's, capped to what fits)")
    p.add_argument("--prefill-chunk-tokens", "--chunked-prefill-size", "--max-num-batched-tokens",
                   dest="prefill_chunk_tokens", type=prefill_chunk, default=None,
                   help="longer prompts are prefilled this many tokens per step, between the running requests' "
                        "rounds (default 2048 on CUDA, 512 on the CPU; -1: off)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (else 413)")
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="largest text prompt in bytes, refused (400) before tokenizing "
                        "(default: 16 bytes per token of the prompt-token limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: seconds in-flight requests may finish before the rest end with 503")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="close idle keep-alive connections after")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="close connections whose request headers are not complete after this many seconds")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="answer 408 and close when a request body is not complete after this many seconds "
                        "(unless it still arrives at 16 KiB/s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g = p.add_argument_group("SGLang / vLLM aliases")
    g.add_argument("--model", default=None, help="= --target (vLLM)")
    g.add_argument("--model-path", default=None, help="= --target (SGLang)")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="SGLang: tokens verified per round including the anchor (drafts = N - 1)")
    g.add_argument("--speculative-algorithm", type=str.upper, choices=["DFLASH", "DSPARK", "EAGLE3"], default=None,
                   help="= --method")
    g.add_argument("--speculative-draft-model-path", default=None, help="= --draft")
    g.add_argument("--speculative-num-steps", type=int, default=None,
                   help="SGLang EAGLE: draft levels per round (method eagle3; a chain: its drafts)")
    g.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="SGLang EAGLE: children per expanded node and nodes expanded per level; above 1 an EAGLE-3 "
                        "draft tree (--no-adapt; needs --speculative-num-steps and --speculative-num-draft-tokens)")
    g.add_argument("--speculative-dflash-block-size", type=int, default=None,
                   help="z-lab block size (includes the anchor)")
    g.add_argument("--speculative-dspark-block-size", type=int, default=None, help="DeepSpec block size (drafts)")
    g.add_argument("--speculative-config", type=speculative_config, default=None,
                   help='JSON, e.g. \'{"method": "dflash", "model": DIR, "num_speculative_tokens": 15}\'')
    g.add_argument("--generation-config", default="auto",
                   help="request sampling defaults: auto (the target's generation_config.json), vllm (none: "
                        "OpenAI's), or a folder holding a generation_config.json (vLLM's flag)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help=f"no periodic engine stats line (default: every {STATS_INTERVAL_S:.0f} s while busy)")
    g.add_argument("--kv-cache-dtype", choices=["auto"], default="auto",
                   help="only auto: a quantised KV cache would change the results")
    c = p.add_argument_group("accepted for compatibility, ignored with a warning")
    for flags, (options, why) in IGNORED_FLAGS.items():
        c.add_argument(*flags, dest=ignored_dest(flags), default=None, help=why, **options)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server on the batching engine")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m blockspec.serving.server FLAGS` == `blockspec serve FLAGS`."""
    parser = argparse.ArgumentParser(prog="blockspec serve")
    add_serve_arguments(parser)
    try:
        cmd_serve(parser.parse_args(argv))
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
