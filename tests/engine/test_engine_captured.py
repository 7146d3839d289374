"""The engine on captured static-shape steps (`EngineOptions(compile=True)`): the same
tokens as the eager packed engine for AR, DFlash and DSpark (ragged rows, rejected drafts
rolled back, admissions and retirements mid-run, chunked prefill, planned verify lengths),
seeded sampling included; and no host read inside a captured step.

The steps run uncaptured here (capture_mode="eager": the static-shape code a CUDA graph
records, run as is), so equality is exact and the host reads are visible to Python."""

from __future__ import annotations

import random

import pytest

import blockspec.engine.engine as engine_module
from blockspec import EngineOptions, PolicyOptions
from blockspec.config import SamplingParams
from blockspec.decoding.captured import CapturedSteps
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.generate import generate
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import Eagle3Drafter
from blockspec.serving.server import add_serve_arguments
from conftest import make_draft, make_eagle3, make_target
from host_reads import HostReads

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [4, 4, 4, 4],
           [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 2]]
MAX_NEW = [20, 12, 16, 20, 9, 20, 14, 18]
LONG = [(7 * i + 3) % 60 + 1 for i in range(45)]      # chunked: 6 chunks of 8
# Affine verify cost with a knee: the planner gives rows different lengths, 0 included.
SCHED_TABLE = CostTable([1, 8, 64], [1.0, 1.3, 5.0])
GATED_TABLE = CostTable([1, 8, 64], [1.0, 1.3, 5.0], draft_rows=[1, 2, 3], draft_times_s=[2.0, 3.0, 3.0],
                        draft_slot_times={1: [0.01, 2.0, 2.5]}, draft_window=3)
CONFIGS = ["ar", "dflash", "dflash-gated", "dspark", "dspark-scheduled"]


def engine(target, config: str, captured: bool, max_running: int = 3, chunk: int | None = None,
           mode: str | None = "eager") -> Engine:
    """The config's engine, eager (packed forwards) or on captured steps run as `mode` says
    (default: uncaptured; None: the device's default)."""
    options = EngineOptions(compile=captured, capture_mode=mode if captured else None, prefill_chunk_tokens=chunk)
    kw = dict(max_running=max_running, max_model_len=80, options=options)
    if config == "ar":
        return Engine(target, method="ar", policy=PolicyOptions(adapt=False), **kw)
    if config.startswith("dflash"):
        policy = (PolicyOptions(adapt=False, draft_gate=True, cost_table=GATED_TABLE, gate_feedback=False)
                  if config == "dflash-gated" else PolicyOptions(adapt=False))
        return Engine(target, make_draft(target, "zlab", 4), "dflash", policy=policy, **kw)
    draft = make_draft(target, "deepspec", 4, markov_rank=4, markov_type="gated", confidence=True)
    scheduled = config == "dspark-scheduled"
    policy = PolicyOptions(adapt=False, scheduled=scheduled, cost_table=SCHED_TABLE if scheduled else None,
                           gate_feedback=False)
    return Engine(target, draft, "dspark", policy=policy, **kw)


CANCELLED = 0


def drive(eng: Engine, work: list[tuple[list[int], SamplingParams]], seed: int) -> list[list[int]]:
    """Submit at random steps (admissions mid-run), cancel request CANCELLED after its third
    token (a retirement that is not a finish); every request's tokens."""
    rng = random.Random(seed)
    pending, handles, streamed = list(range(len(work))), {}, {i: [] for i in range(len(work))}
    while pending or eng.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop(0)
                handles[i] = eng.submit(*work[i], on_output=lambda out, i=i: streamed[i].extend(out.token_ids))
        if CANCELLED in handles and len(streamed[CANCELLED]) >= 3 and not handles[CANCELLED].done:
            eng.cancel(handles[CANCELLED].request_id)
        eng.step()
    return [handles[i].result(timeout=0).tokens for i in range(len(work))]


def counted_steps(monkeypatch, steps: CapturedSteps) -> dict[tuple, int]:
    """Calls per (step, rows, width) of a runner."""
    calls: dict[tuple, int] = {}
    real = steps._run

    def run(name, fn, width, module, x, *rest):
        key = (name, x.shape[0], width)
        calls[key] = calls.get(key, 0) + 1
        return real(name, fn, width, module, x, *rest)

    monkeypatch.setattr(steps, "_run", run)
    return calls


@pytest.mark.parametrize("config", CONFIGS)
def test_captured_engine_equals_the_eager_engine(monkeypatch, target64, config):
    """Greedy, with arrivals, a cancellation and a chunked long prompt: token for token the
    eager engine's (and AR's); every round ran on the captured steps, none on the packed forward."""
    work = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, MAX_NEW)]
    work.insert(3, (LONG, SamplingParams(max_new_tokens=10, ignore_eos=True)))
    eager = drive(engine(target64, config, False, max_running=4, chunk=8), work, seed=7)
    eng = engine(target64, config, True, max_running=4, chunk=8)
    calls = counted_steps(monkeypatch, eng.captured)
    packed = [0]
    real_packed = target64.forward_packed

    def forward_packed(*args, **kwargs):
        packed[0] += 1
        return real_packed(*args, **kwargs)

    monkeypatch.setattr(target64, "forward_packed", forward_packed)
    shapes = []   # (running rows, a prompt in chunked prefill) of every round
    real_round = eng._round
    monkeypatch.setattr(eng, "_round", lambda: shapes.append((len(eng._running), eng.chunks.req is not None))
                        or real_round())
    assert drive(eng, work, seed=7) == eager
    # 3 rows ran in bucket 4 while the 4th row held a prompt being chunk-prefilled: that padding
    # row's committed K/V survived the steps' writes (its request's tokens above equal AR's).
    assert (3, True) in shapes
    for i, (prompt, params) in enumerate(work):
        alone = generate(target64, [prompt], params).completions[0].tokens
        assert eager[i] == (alone[:len(eager[i])] if i == CANCELLED else alone), i
    assert 3 <= len(eager[CANCELLED]) < MAX_NEW[CANCELLED]
    m = eng.metrics()
    assert packed[0] == 0 and (m["finished"], m["cancelled"]) == (8, 1)
    targets = {key: n for key, n in calls.items() if key[0].startswith("target")}
    assert sum(targets.values()) == m["rounds"]
    # Rows padded to their bucket within the 4-slot pool (3 running rows run 4: the 4th,
    # a free slot or the chunked prompt's row, is a padding row).
    assert {rows for _, rows, _ in calls} <= {1, 2, 4} and any(rows == 4 for _, rows, _ in calls)
    if config != "ar":
        assert m["drafts_accepted"] > 0 or m["drafting_rounds"] > 0
    if config == "dspark-scheduled":   # planned lengths: verifies narrower than the window ran narrower
        assert {0, 1, 2} <= set(m["verified_histogram"])
        assert {w for (_, _, w) in targets} - {1, 5}   # e.g. 2 drafts + anchor: width bucket 4


@pytest.mark.parametrize("config", ["dflash", "dspark"])
def test_seeded_sampling_captured_equals_eager(target64, config):
    """Sampled rows (own seeds) next to greedy ones draw the same tokens on captured steps:
    the steps change the forwards only, never the random streams."""
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=11, max_new_tokens=15, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_new_tokens=15, ignore_eos=True)]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    work = [(PROMPTS[0], sampled[0]), (PROMPTS[1], greedy), (PROMPTS[2], sampled[1]), (PROMPTS[4], greedy),
            (PROMPTS[6], sampled[0])]
    eager = drive(engine(target64, config, False), work, seed=5)
    assert drive(engine(target64, config, True), work, seed=5) == eager


def watch(monkeypatch, eng: Engine) -> HostReads:
    """Host reads during the engine's rounds (`speculative_round`), steps marked."""
    mode = HostReads()
    real_round, real_run = engine_module.speculative_round, eng.captured._run

    def round_(*args, **kwargs):
        with mode:
            return real_round(*args, **kwargs)

    def run(*args, **kwargs):
        mode.in_step = True
        try:
            return real_run(*args, **kwargs)
        finally:
            mode.in_step = False

    monkeypatch.setattr(engine_module, "speculative_round", round_)
    monkeypatch.setattr(eng.captured, "_run", run)
    return mode


# Every host read a captured engine round may make, by (read, the function making it).
OUTCOME = ("tolist", "_outcome_lists")   # THE round's synchronisation: accepted counts, bonus tokens, drafts
# Reads of host-born tensors: no device involved on a GPU.
HOST_BORN = {("__int__", "verified_width"),   # verify lengths, planned on the host
             ("tolist", "plan"),              # the planner's sort (after its one copy of the confidences)
             ("tolist", "curve"),             # the draft gate's measured curves
             ("tolist", "_dense_upto")}       # the cost table
# Device reads beyond the outcome, DSpark only: the early stop of drafting (fewer than 8 rows,
# one per drafted slot) and the policy's learning from the confidences (after the outcome:
# one copy, then per-band boolean masks of that host copy, summed as plain floats).
DSPARK_READS = {("__bool__", "markov_drafts"), ("cpu", "observe"), ("__getitem__", "observe"), ("tolist", "observe")}


@pytest.mark.parametrize("config", CONFIGS)
def test_captured_rounds_read_the_host_once(monkeypatch, target64, config):
    """No host read inside any captured step (a CUDA graph could not even record one), and
    per round the outcome's one transfer; any other read is one of the known ones above, so
    a new .item() / .tolist() / bool() anywhere in a round fails this test."""
    eng = engine(target64, config, True)
    mode = watch(monkeypatch, eng)
    for p, n in zip(PROMPTS[:3], (14, 10, 12)):
        eng.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    eng.step()            # admission and the first round: the steps are built (graphs recorded on CUDA)
    mode.reads.clear()
    rounds = eng.metrics()["rounds"]
    for _ in range(3):
        eng.step()
    rounds = eng.metrics()["rounds"] - rounds
    assert rounds == 3 and eng.metrics()["finished"] == 0
    assert [r for r in mode.reads if r[2]] == []                       # none inside a step
    outside = [(name, where) for name, where, _ in mode.reads]
    assert outside.count(OUTCOME) == rounds
    if config in ("ar", "dflash"):
        assert outside == [OUTCOME] * rounds
    else:
        assert set(outside) <= {OUTCOME} | HOST_BORN | (DSPARK_READS if config.startswith("dspark") else set())


def test_a_new_read_inside_a_step_is_caught(monkeypatch, target64):
    """The counter's power: an .item() slipped into the draft's static block step is seen."""
    import blockspec.models.static_steps as static_steps
    real = static_steps.draft_block

    def leaky(draft, block_ids, cache, embed):
        int(cache.lengths.max())
        return real(draft, block_ids, cache, embed)

    monkeypatch.setattr(static_steps, "draft_block", leaky)
    eng = engine(target64, "dflash", True)
    mode = watch(monkeypatch, eng)
    eng.submit(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()
    assert [read for read in mode.reads if read[2]] and all(name == "__int__" for name, _, inside in mode.reads
                                                              if inside)


def test_pool_buffers_are_the_steps_buffers(target64):
    """The runner adopts the slot pool's buffers (no second KV copy); a 3-slot pool runs
    3 rows, not its bucket of 4; options are checked."""
    eng = engine(target64, "dflash", True)
    assert eng.captured.cache is eng.slots.cache and eng.captured.draft_cache is eng.slots.draft_cache
    assert eng.slots.pending is None and eng.captured.mode == "eager"
    for p in PROMPTS[:3]:
        eng.submit(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    assert {rows for _, rows, _ in eng.captured._steps} == {3}
    with pytest.raises(BlockspecError, match="capture_mode"):
        EngineOptions(capture_mode="graphs")
    with pytest.raises(BlockspecError, match="capture_mode"):
        EngineOptions(compile=True, capture_mode="fast")
    with pytest.raises(BlockspecError, match="CUDA only"):
        Engine(target64, method="ar", options=EngineOptions(compile=True, capture_mode="graphs"))
    eagle3 = Eagle3Drafter.pair(make_eagle3(target64), target64, 3)
    with pytest.raises(BlockspecError, match="EAGLE-3"):
        Engine(target64, eagle3, "eagle3", policy=PolicyOptions(adapt=False), options=EngineOptions(compile=True))


def test_serve_compile_flag():
    import argparse
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--compile"]).compile and not p.parse_args([]).compile


@pytest.mark.slow
def test_compiled_captured_engine_equals_eager():
    """The CPU default of `serve --compile`: the steps compiled by inductor, same greedy tokens
    as the eager engine (DFlash, rows arriving and leaving, float32)."""
    target = make_target()
    work = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS[:5], MAX_NEW[:5])]
    eager = drive(engine(target, "dflash", False), work, seed=3)
    eng = engine(target, "dflash", True, mode=None)
    assert eng.captured.mode == "compile"
    assert drive(eng, work, seed=3) == eager
