"""Chunked prefill in the engine (engine/prefill_chunks.py): a long prompt is prefilled
a chunk per step while the running requests keep decoding, and nothing it produces
differs from a whole-prompt prefill."""

from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch

from blockspec import EngineOptions, PolicyOptions
from blockspec.config import EagleTree, SamplingParams
from blockspec.decoding.generate import generate
from blockspec.decoding.prefill import ContextSink, prefill
from blockspec.decoding.sampling import RowSampler
from blockspec.engine.engine import Engine
from blockspec.engine.prefill_chunks import DEFAULT_CHUNK, chunk_size
from blockspec.errors import BlockspecError
from blockspec.serving.server import add_serve_arguments
from blockspec.models.chain_draft import Eagle3Drafter
from conftest import make_draft, make_eagle3

LONG = [(7 * i + 3) % 60 + 1 for i in range(45)]     # 6 chunks of 8 (the last one 5 tokens)
SHORT = [[5, 9, 2, 4], [11, 3]]
CHUNK = 8


def engine_for(target, method: str, chunk: int, max_running: int = 3) -> Engine:
    draft = None
    if method == "dflash":
        draft = make_draft(target, "zlab", 4)
    elif method == "dspark":
        draft = make_draft(target, "deepspec", 4, markov_rank=4, markov_type="gated", confidence=True)
    elif method == "eagle3":
        draft = Eagle3Drafter.pair(make_eagle3(target), target, 3)
    elif method == "eagle3-tree":   # trees run the fixed policy
        draft = Eagle3Drafter.pair(make_eagle3(target), target).with_tree(EagleTree(3, 3, 7))
        return Engine(target, draft, "eagle3", max_running=max_running, max_model_len=80,
                      policy=PolicyOptions(adapt=False), options=EngineOptions(prefill_chunk_tokens=chunk))
    return Engine(target, draft, method, max_running=max_running, max_model_len=80,
                  options=EngineOptions(prefill_chunk_tokens=chunk))


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    return [h.result().tokens for h in handles]


@pytest.mark.parametrize("method", ["ar", "dflash", "dspark", "eagle3", "eagle3-tree"])
def test_greedy_output_is_the_same_with_and_without_chunks(target64, method: str) -> None:
    prompts = [SHORT[0], LONG, SHORT[1], LONG[:20]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 15, 12, 10)]
    chunked = engine_for(target64, method, CHUNK)
    ran: list[bool] = []        # per advance call: whether a prompt was in flight
    advance = chunked.chunks.advance
    chunked.chunks.advance = lambda: ran.append(chunked.chunks.req is not None) or advance()
    got = run(chunked, prompts, params)
    assert got == run(engine_for(target64, method, 1000), prompts, params)
    for p, sp, tokens in zip(prompts, params, got):
        assert tokens == generate(target64, [p], sp).completions[0].tokens
    # both long prompts went a chunk at a time: 6 + 3 chunks (the idle calls do nothing)
    assert sum(ran) == 9 and chunked.chunks.req is None


def test_seeded_sampling_is_the_same_with_and_without_chunks(target64) -> None:
    prompts = [SHORT[0], LONG, SHORT[1]]
    params = [SamplingParams(temperature=1.0, top_k=30, seed=s, max_new_tokens=14, ignore_eos=True) for s in (3, 4, 5)]
    got = run(engine_for(target64, "ar", CHUNK), prompts, params)
    assert got == run(engine_for(target64, "ar", 1000), prompts, params)
    assert got[1] == generate(target64, [LONG], params[1]).completions[0].tokens


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_running_request_decodes_while_a_long_prompt_is_prefilled(target64, method: str) -> None:
    engine = engine_for(target64, method, CHUNK)
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    engine.submit(SHORT[0], SamplingParams(max_new_tokens=60, ignore_eos=True),
                  on_output=lambda out: tokens["short"].extend(out.token_ids))
    engine.step()
    engine.submit(LONG, SamplingParams(max_new_tokens=5, ignore_eos=True),
                  on_output=lambda out: tokens["long"].extend(out.token_ids))
    steps = 0
    while not tokens["long"]:
        before = len(tokens["short"])
        engine.step()
        steps += 1
        assert len(tokens["short"]) > before              # a round ran for the running request
        if not tokens["long"]:                            # still prefilling: queued, not in the rounds
            m = engine.metrics()
            assert (m["running"], m["waiting"]) == (1, 1)
    assert steps == math.ceil(len(LONG) / CHUNK)          # one chunk per step
    engine.run_until_done()


@pytest.mark.parametrize("max_running,row,method", [(3, 1, "dflash"), (2, 1, "dflash"), (3, 1, "eagle3")])
def test_joined_row_holds_the_whole_prompt_prefill(target64, max_running: int, row: int, method: str) -> None:
    """After the last chunk the request's target K/V and draft context (appended chunk by
    chunk) equal a whole-prompt prefill's, in the row after the running ones (moved from the
    pool's last row, or already there); EAGLE-3's context pairs each chunk's last position
    with the next chunk's first token, and the last one with the first generated token."""
    engine = engine_for(target64, method, CHUNK, max_running=max_running)
    engine.submit(SHORT[0], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    long = engine.submit(LONG, SamplingParams(max_new_tokens=5, ignore_eos=True))
    with torch.inference_mode():
        while engine.metrics()["running"] < 2:
            engine._admit()
        cache, ctx = target64.new_cache(1, 80), engine.draft.new_cache(1, 80)
        sampler = RowSampler.from_params([SamplingParams()], target64.device)
        first = prefill(target64, cache, [LONG], sampler, ContextSink(engine.draft, ctx)).anchors
    assert engine._running[row].id == long.request_id and engine._running[row].anchor == int(first[0])
    n = len(LONG)
    for pool, whole in ((engine.slots.cache, cache), (engine.slots.draft_cache, ctx)):
        assert int(pool.lengths[row]) == n
        assert torch.allclose(pool.k[:, row, :, :n], whole.k[:, 0, :, :n], atol=1e-10)
        assert torch.allclose(pool.v[:, row, :, :n], whole.v[:, 0, :, :n], atol=1e-10)
    if method == "eagle3":   # where its next chain starts
        assert torch.allclose(engine.slots.draft_cache.last[row], ctx.last[0], atol=1e-10)
    engine.run_until_done()


def test_cancelled_while_prefilling_frees_the_row(target64) -> None:
    engine = engine_for(target64, "ar", CHUNK, max_running=2)
    first = engine.submit(LONG, SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    assert engine.chunks.req is not None and engine.cancel(first.request_id)
    assert first.result(timeout=0).finish_reason == "cancelled"
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert run(engine, [LONG[:30], SHORT[1]], [params, params]) == [
        generate(target64, [p], params).completions[0].tokens for p in (LONG[:30], SHORT[1])]
    assert engine.chunks.req is None and not engine.has_work


@pytest.mark.parametrize("bad", [0, -4, True, 2.5, "512"])
def test_bad_chunk_sizes_are_refused(target64, bad) -> None:
    with pytest.raises(BlockspecError, match="prefill_chunk_tokens"):
        Engine(target64, max_running=2, max_model_len=80, options=EngineOptions(prefill_chunk_tokens=bad))


def test_default_chunk_by_device() -> None:
    assert chunk_size(None, torch.device("cpu")) == DEFAULT_CHUNK["cpu"] == 512
    assert chunk_size(None, torch.device("cuda")) == DEFAULT_CHUNK["cuda"] == 2048
    assert chunk_size(64, torch.device("cpu")) == 64


@pytest.mark.parametrize("flags,want", [([], None), (["--prefill-chunk-tokens", "64"], 64),
                                        (["--chunked-prefill-size", "256"], 256),
                                        (["--max-num-batched-tokens", "1024"], 1024),
                                        (["--chunked-prefill-size", "-1"], sys.maxsize)])
def test_serve_flag_and_its_sglang_vllm_spellings(flags: list[str], want: int | None) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(flags).prefill_chunk_tokens == want
