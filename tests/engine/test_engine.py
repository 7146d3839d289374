"""The continuous-batching engine: greedy output equals single-request AR output
under random arrivals and cancellations; sampled output follows the exact target
distribution under batching; packed verification; slots, limits, streaming,
stop strings and the background thread."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
import math
import random

import pytest
import torch

from blockspec import EngineOptions, PolicyOptions
from blockspec.config import EagleTree, SamplingParams
from blockspec.decoding import policy as policy_module
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.generate import generate
from blockspec.decoding.prefill import ContextSink, prefill
from blockspec.decoding.round import Forwards, Proposal, WrappedForwards
from blockspec.decoding.sampling import RowSampler, Verdict, warp
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from lossless_stats import chi_square_p, exact_first_three
from blockspec.models.chain_draft import Eagle3Drafter
from conftest import make_draft, make_eagle3, make_target, oracle_tokens, plant_path

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [4, 4, 4, 4],
           [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 2]]
MAX_NEW = [20, 12, 16, 20, 9, 20, 14, 18]
# Synthetic verify cost: affine with a knee, so the planner picks 0..g drafts for different rows.
SCHED_TABLE = CostTable([1, 8, 64], [1.0, 1.3, 5.0])
# The same, plus draft times: drafting is cheap for one running request, too dear for more,
# so the draft gate mixes drafted and plain AR rounds.
# A one-slot block costs far less than the full one: alone, a request drafts one slot;
# with more running requests it verifies its anchor, and explores with the full block.
GATED_TABLE = CostTable([1, 8, 64], [1.0, 1.3, 5.0], draft_rows=[1, 2, 3], draft_times_s=[2.0, 3.0, 3.0],
                        draft_slot_times={1: [0.01, 2.0, 2.5]}, draft_window=3)
CONFIGS = ["ar", "dflash", "dspark", "dspark-scheduled", "dspark-gated", "dflash-gated", "dflash-auto", "dspark-auto",
           "eagle3", "eagle3-auto", "eagle3-tree", "dflash-window", "dspark-window"]
# An EAGLE-3 draft tree: 3 levels of the 3 best nodes' 3 children, its 6 best nodes verified.
TREE = EagleTree(topk=3, num_steps=3, num_draft_tokens=7)
# Sliding-window drafts (issue 34): a window of 3 over prompts + outputs of up to 31 positions.
WINDOWED = dict(layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=3)


@pytest.fixture(scope="module")
def requests(target64):
    """(prompt, params, AR greedy reference); one request stops on a stop token mid-output."""
    out = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        if i == 3:
            plain = generate(target64, [prompt], params).completions[0].tokens
            params = SamplingParams(max_new_tokens=n, stop_token_ids=[plain[6]], ignore_eos=True)
        ref = generate(target64, [prompt], params).completions[0]
        out.append((prompt, params, ref))
    assert out[3][2].finish_reason == "stop"
    return out


def build(target, config: str, block_size: int = 4, max_running: int = 3, max_model_len: int = 64,
          kv_memory_gb: float | None = None, **kw) -> Engine:
    kw.update(max_running=max_running, max_model_len=max_model_len, options=EngineOptions(kv_memory_gb=kv_memory_gb))
    if config == "eagle3-tree":
        return Engine(target, Eagle3Drafter.pair(make_eagle3(target), target).with_tree(TREE), "eagle3",
                      policy=PolicyOptions(adapt=False), **kw)
    if config.startswith("eagle3"):   # a chain of block_size - 1 drafts; -auto: the adaptive policy
        draft = Eagle3Drafter.pair(make_eagle3(target), target, block_size - 1)
        return Engine(target, draft, "eagle3", policy=None if config.endswith("-auto") else PolicyOptions(adapt=False),
                      **kw)
    if config.endswith("-auto"):   # the default: adaptive, the cost table measured and cached
        method = config.removesuffix("-auto")
        draft = (make_draft(target, "zlab", block_size) if method == "dflash" else
                 make_draft(target, "deepspec", block_size, markov_rank=4, markov_type="gated", confidence=True))
        return Engine(target, draft, method, **kw)
    if config == "ar":
        return Engine(target, method="ar", policy=PolicyOptions(adapt=False), **kw)
    if config == "dflash-window":
        return Engine(target, make_draft(target, "zlab", block_size, **WINDOWED), "dflash",
                      policy=PolicyOptions(adapt=False), **kw)
    if config == "dspark-window":
        draft = make_draft(target, "deepspec", block_size, markov_rank=4, confidence=True, **WINDOWED)
        return Engine(target, draft, "dspark", policy=PolicyOptions(adapt=False), **kw)
    if config in ("dflash", "dflash-gated"):  # gated: full window, the gate learns from acceptance
        gate = (PolicyOptions(adapt=False, draft_gate=True, cost_table=GATED_TABLE, gate_feedback=False)
                if config == "dflash-gated" else PolicyOptions(adapt=False))   # fixed windows unless gated
        return Engine(target, make_draft(target, "zlab", block_size), "dflash", policy=gate, **kw)
    draft = make_draft(target, "deepspec", block_size, markov_rank=4, markov_type="gated", confidence=True)
    table = {"dspark-scheduled": SCHED_TABLE, "dspark-gated": GATED_TABLE}.get(config)
    policy = PolicyOptions(adapt=False, scheduled=table is not None, cost_table=table, gate_feedback=False)
    return Engine(target, draft, "dspark", policy=policy, **kw)


def count_calls(monkeypatch, obj, name: str) -> list[int]:
    calls = [0]
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def drive(engine: Engine, requests, seed: int, cancel_waiting: int = 2, cancel_running: int = 5):
    """Submit requests at random times between steps; cancel one while it waits and
    one after it has streamed tokens. Returns handles and streamed tokens per request."""
    rng = random.Random(seed)
    pending = list(range(len(requests)))
    handles, streamed = {}, {i: [] for i in pending}
    while pending or engine.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop(0)
                handles[i] = engine.submit(requests[i][0], requests[i][1],
                                           on_output=lambda out, i=i: streamed[i].extend(out.token_ids))
                if i == cancel_waiting:
                    assert engine.cancel(handles[i].request_id)
        if cancel_running in handles and len(streamed[cancel_running]) >= 3 and not handles[cancel_running].done:
            assert engine.cancel(handles[cancel_running].request_id)
        engine.step()
    return handles, streamed


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_with_arrivals_and_cancellations_equals_ar(monkeypatch, target64, requests, config):
    engine = build(target64, config)
    packed = count_calls(monkeypatch, target64, "forward_packed")
    trees = count_calls(monkeypatch, engine.forwards, "tree_forward")
    proposals = count_calls(monkeypatch, engine.forwards, "propose")
    handles, streamed = drive(engine, requests, seed=7)
    for i, (_, _, ref) in enumerate(requests):
        result = handles[i].result(timeout=0)
        if i in (2, 5):
            assert result.finish_reason == "cancelled"
            assert result.tokens == ref.tokens[:len(result.tokens)]
            continue
        assert result.tokens == ref.tokens, f"request {i}"
        assert result.finish_reason == ref.finish_reason
        assert streamed[i] == result.tokens
    assert len(streamed[5]) >= 3 and handles[5].result().tokens == streamed[5]
    m = engine.metrics()
    assert (m["kv_bytes_in_use"], m["running"], m["waiting"]) == (0, 0, 0)
    assert m["kv_bytes_total"] == 3 * m["kv_bytes_per_slot"] > 0
    assert (m["finished"], m["cancelled"]) == (6, 2)
    assert m["generated_tokens"] == sum(len(h.result().tokens) for h in handles.values())
    # ONE packed target forward (a tree's: ONE tree forward) and (speculative methods) ONE
    # draft proposal per round.
    assert (trees if config == "eagle3-tree" else packed)[0] == m["rounds"] and packed[0] + trees[0] == m["rounds"]
    assert proposals[0] == m["drafting_rounds"]
    if config == "ar":
        assert m["drafting_rounds"] == 0
    elif config.endswith("-gated"):  # the gate really skipped some drafts and kept others
        assert 0 < m["undrafted_request_rounds"] < m["request_rounds"]
        assert 0 < m["drafting_rounds"] < m["rounds"]
    elif config.endswith("-auto"):   # adaptive by default: the gate runs on a measured table, and drafts
        assert engine.metrics()["draft_gate"] and m["drafting_rounds"] > 0
        assert engine.policy.scheduled == (config == "dspark-auto")
    else:
        assert m["undrafted_request_rounds"] == 0 and m["drafting_rounds"] == m["rounds"]
    if config == "dspark-scheduled":
        assert {0, 1, 4} <= set(m["verified_histogram"])  # per-row lengths vary, 0 drafts included


class OracleForwards(WrappedForwards):
    """Draft the target's own greedy continuation (found by position + anchor), corrupt
    some slots, and report varied confidences so the scheduler picks varied lengths."""

    def __init__(self, inner: Forwards, full_sequences: list[list[int]], corrupt_every: int = 4) -> None:
        super().__init__(inner)
        self.full_sequences, self.corrupt_every = full_sequences, corrupt_every
        self.calls = itertools.count(1)

    def propose(self, draft, target, draft_cache, anchors, sampler, block=None, stop_below=0.0,
                confidence_map=None):
        # Full window always: the oracle reports its own confidences (the plan applies the floor).
        proposal = self.inner.propose(draft, target, draft_cache, anchors, sampler, block)
        tokens = oracle_tokens(proposal.tokens, draft_cache, anchors, self.full_sequences, self.calls,
                               self.corrupt_every, target.config.vocab_size)
        g = tokens.shape[1]
        pos = draft_cache.lengths.double().unsqueeze(1) + torch.arange(g, dtype=torch.float64)
        confidence = 0.35 + 0.64 * torch.sin(pos * 12.9898 + 78.233).abs()
        probs = torch.nn.functional.one_hot(tokens, target.config.vocab_size).double()
        confidence = confidence.float()
        planned = confidence if confidence_map is None else confidence_map(confidence, 0)
        return Proposal(tokens, probs, planned, confidence)


@pytest.mark.parametrize("config", ["dflash", "dspark", "dspark-scheduled", "eagle3"])
def test_long_accepted_runs_stop_inside_runs(monkeypatch, target64, requests, config):
    full = [prompt + ref.tokens for prompt, _, ref in requests]
    engine = build(target64, config, block_size=8, max_running=4)
    engine.forwards = OracleForwards(engine.forwards, full)
    handles, _ = drive(engine, requests, seed=3, cancel_waiting=-1, cancel_running=-1)
    assert [handles[i].result().tokens for i in range(len(requests))] == [ref.tokens for _, _, ref in requests]
    m = engine.metrics()
    assert m["tau"] > 2.0 and max(m["accepted_histogram"]) >= 5   # runs of 5 drafts + bonus
    if config == "dspark-scheduled":
        assert len(m["verified_histogram"]) >= 4 and 0 in m["verified_histogram"]


class TreeOracle(WrappedForwards):
    """Plants each greedy row's reference continuation (found by position + anchor) along a random
    deepest path of its draft tree, corrupting the path on every third row proposal: long
    paths off the tree's first nodes are accepted, so their K/V move in the pool's rows."""

    def __init__(self, inner: Forwards, full_sequences: list[list[int]]) -> None:
        super().__init__(inner)
        self.full_sequences, self.calls = full_sequences, itertools.count(1)
        self.rng, self.off_diagonal = torch.Generator().manual_seed(0), 0
        self.anchors = torch.zeros(0, dtype=torch.long)   # the round's, set by `propose`

    def draft_tree(self, draft, draft_cache, sampler):
        proposal = self.inner.draft_tree(draft, draft_cache, sampler)
        tree, vocab = proposal.tree, draft.model.config.vocab_size
        tokens = proposal.tokens.clone()
        for r in range(tokens.shape[0]):
            if not bool(sampler.greedy[r]):   # a sampled row's tree stays as drawn (its probs say how)
                continue
            depth = int(tree.depths[r].max())
            p = int(draft_cache.lengths[r])   # the anchor's position: the draft holds what precedes it
            cont = next((seq[p + 1:p + 1 + depth] for seq in self.full_sequences if p < len(seq)
                         and seq[p] == int(self.anchors[r])), [])
            path = plant_path(tokens[r], tree.parents[r], tree.depths[r], cont, self.rng, vocab,
                              corrupt=next(self.calls) % 3 == 0)
            self.off_diagonal += sum(node != d for d, node in enumerate(path, start=1))
        return Proposal(tokens, proposal.probs, None, tree=tree)

    def propose(self, draft, target, draft_cache, anchors, sampler, block=None, stop_below=0.0,
                confidence_map=None):
        self.anchors = anchors
        return super().propose(draft, target, draft_cache, anchors, sampler, block, stop_below, confidence_map)


def test_tree_paths_off_the_first_nodes_are_kept_in_the_pools_rows(target64, requests):
    """Requests arriving and leaving while planted tree paths are accepted: the K/V of each
    accepted path move into place inside the pool's rows, and every output equals AR."""
    full = [prompt + ref.tokens for prompt, _, ref in requests]
    engine = build(target64, "eagle3-tree", max_running=4)
    engine.forwards = oracle = TreeOracle(engine.forwards, full)
    handles, _ = drive(engine, requests, seed=3, cancel_waiting=-1, cancel_running=-1)
    assert [handles[i].result().tokens for i in range(len(requests))] == [ref.tokens for _, _, ref in requests]
    m = engine.metrics()
    assert m["tau"] > 2.0 and max(m["accepted_histogram"]) >= 3 and oracle.off_diagonal >= 10
    assert m["kv_bytes_in_use"] == 0 and m["finished"] == len(requests)


def test_tree_rows_of_mixed_bands_swap_and_run_to_the_length_limit(monkeypatch, target64, requests):
    """Draft trees next to seeded sampled rows: sampled arrivals land in front of greedy rows,
    so rows swap into band order (their K/V, tree scratch and features move with them); the
    greedy rows still equal AR, a seeded row equals its own `generate` with the same tree,
    and a row whose prompt + output fills max_model_len runs to the last position."""
    engine = build(target64, "eagle3-tree", max_running=4, max_model_len=40)
    swaps, order = [], engine.slots.order_by_band

    def recorded(bands):
        made = order(bands)
        swaps.extend(made)
        return made
    monkeypatch.setattr(engine.slots, "order_by_band", recorded)
    seeded = SamplingParams(temperature=0.8, top_k=8, seed=21, max_new_tokens=16, ignore_eos=True)
    to_the_limit = SamplingParams(max_new_tokens=40 - len(PROMPTS[2]), ignore_eos=True)
    limit_ref = generate(target64, [PROMPTS[2]], to_the_limit).completions[0].tokens
    mixed = [requests[1], requests[4], (PROMPTS[0], seeded, None), (PROMPTS[2], to_the_limit, None), requests[6]]
    engine.forwards = oracle = TreeOracle(engine.forwards, [prompt + ref.tokens for prompt, _, ref in mixed[:2]]
                                          + [PROMPTS[2] + limit_ref, requests[6][0] + requests[6][2].tokens])
    handles, _ = drive(engine, mixed, seed=7, cancel_waiting=-1, cancel_running=-1)
    assert handles[0].result().tokens == requests[1][2].tokens and handles[1].result().tokens == requests[4][2].tokens
    assert handles[4].result().tokens == requests[6][2].tokens
    assert handles[3].result().tokens == limit_ref and len(limit_ref) == 40 - len(PROMPTS[2])
    alone = generate(target64, [PROMPTS[0]], seeded, draft=engine.draft, policy=PolicyOptions(adapt=False))
    assert handles[2].result().tokens == alone.completions[0].tokens
    m = engine.metrics()
    assert swaps and m["tau"] > 1.5 and max(m["accepted_histogram"]) >= 3 and oracle.off_diagonal > 0
    assert m["kv_bytes_in_use"] == 0 and m["finished"] == len(mixed)


@pytest.mark.parametrize("config", ["dflash", "dspark"])
def test_seeded_sampling_is_independent_of_the_batch(target64, requests, config):
    """A seeded request draws from its own generator in the same order as when it
    runs alone, so the engine reproduces single-request `generate` exactly."""
    engine = build(target64, config, max_running=3)
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=11, max_new_tokens=15, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_new_tokens=15, ignore_eos=True)]
    mixed = [(PROMPTS[0], sampled[0], None), requests[1], (PROMPTS[2], sampled[1], None)] + requests[4:7]
    handles, _ = drive(engine, mixed, seed=5, cancel_waiting=-1, cancel_running=4)
    for i, prompt, params in [(0, PROMPTS[0], sampled[0]), (2, PROMPTS[2], sampled[1])]:
        # Same drafting schedule (fixed windows): the same draws, so the same tokens.
        alone = generate(target64, [prompt], params, draft=engine.draft,
                         policy=PolicyOptions(adapt=False)).completions[0].tokens
        assert handles[i].result().tokens == alone


def test_gated_engine_with_greedy_and_sampled_requests(target64, requests):
    """The gate drafts for a prefix of the batch (one row when exploring). Greedy
    drafted rows next to sampled undrafted ones still verify (their drafts come
    from a point mass) and greedy outputs stay equal to AR."""
    engine = build(target64, "dspark-gated", max_running=3)
    sampled = SamplingParams(temperature=0.9, seed=3, max_new_tokens=12, ignore_eos=True)
    mixed = [requests[1], (PROMPTS[0], sampled, None), requests[4], (PROMPTS[2], sampled, None), requests[6]]
    handles, _ = drive(engine, mixed, seed=2, cancel_waiting=-1, cancel_running=-1)
    for i in (0, 2, 4):
        assert handles[i].result().tokens == mixed[i][2].tokens
    for i in (1, 3):
        assert len(handles[i].result().tokens) == 12
    m = engine.metrics()
    assert m["drafting_rounds"] > 0 and m["undrafted_request_rounds"] > 0


class PatternGate:
    """Drafts for the first rows_by_round[i] requests in round i (then everyone)."""

    def __init__(self, rows_by_round: list[int], window: int) -> None:
        self.plan, self.window = list(rows_by_round), window

    def decide(self, bands: list[int]) -> tuple[int, int]:
        rows = len(bands)
        k = min(rows, self.plan.pop(0)) if self.plan else rows
        return k, self.window if k else 0

    def update(self, survival: torch.Tensor, block: int | None = None, bands: list[int] | None = None) -> None:
        pass


def test_a_request_that_never_drafts_never_runs_the_draft_over_its_prompt(monkeypatch, target64, requests):
    """A prompt's features wait in the pool's pending context until its row first drafts:
    rows the gate keeps in AR rounds (sampling where drafting does not pay) finish without
    one draft forward; the row that drafts gets its prompt first, then its rounds."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = build(target64, "dspark-gated", max_running=3)
    appended = []
    real = engine.draft.append_context
    monkeypatch.setattr(engine.draft, "append_context", lambda cache, f, *a: (appended.append(f.shape[:2]),
                                                                              real(cache, f, *a)))
    engine.policy.gate = PatternGate([0] * 6 + [1] + [0] * 40, engine.draft.config.num_drafts)
    engine.policy.memory = None   # (a pattern learns nothing to remember)
    prompts = [requests[i][0] for i in (0, 1, 2)]
    handles = [engine.submit(p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    assert appended == [] and engine.metrics()["drafting_rounds"] == 0
    engine.step()                                           # row 0 drafts: its prompt, then 6 rounds' features
    assert appended[0] == (1, len(engine._running[0].prompt)) and appended[1][0] == 1
    while not all(h.done for h in handles):
        engine.step()
    assert len(appended) == 2                               # rows 1 and 2 never ran the draft
    assert [h.result().tokens for h in handles] == [generate(target64, [p], params).completions[0].tokens
                                                   for p in prompts]


def test_deferred_draft_context_equals_the_full_context(monkeypatch, target64, requests):
    """AR rounds buffer the target features; after a flush every row's draft K/V equal
    those of its whole committed sequence appended at once, through row moves too."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [requests[i][0] for i in (0, 1, 2, 5)]
    full = [p + generate(target64, [p], params).completions[0].tokens for p in prompts]
    engine = build(target64, "dspark-gated", max_running=3)
    engine.forwards = OracleForwards(engine.forwards, full)  # multi-token accepts
    engine.policy.gate = PatternGate([0, 0, 1, 0, 3, 0, 0, 0, 2, 0, 0], engine.draft.config.num_drafts)
    for p in prompts[:3]:
        engine.submit(p, params)
    for _ in range(7):
        engine.step()
    assert engine.metrics()["drafts_accepted"] > 2
    engine.cancel(engine._running[0].id)   # the last row moves into row 0
    engine.submit(prompts[3], params)
    for _ in range(4):
        engine.step()
    assert int(engine.slots.pending.lengths.max()) > 1   # some rows really hold buffered context
    rows = len(engine._running)
    view, draft_view = engine.slots.views(0, rows)
    with torch.inference_mode():
        engine.slots.pending.flush(rows)
        for row, req in enumerate(engine._running):
            committed = req.prompt + req.output.tokens[:-1]   # everything but the next anchor
            assert int(draft_view.lengths[row]) == int(view.lengths[row]) == len(committed)
            target_cache = target64.new_cache(1, 64)
            ref_cache = engine.draft.new_cache(1, 64)
            prefill(target64, target_cache, [committed], RowSampler.from_params([SamplingParams()]),
                    ContextSink(engine.draft, ref_cache))
            n = len(committed)
            torch.testing.assert_close(engine.slots.draft_cache.k[:, row, :, :n], ref_cache.k[:, 0, :, :n])
            torch.testing.assert_close(engine.slots.draft_cache.v[:, row, :, :n], ref_cache.v[:, 0, :, :n])


def test_packed_forward_equals_per_row_forward(target64):
    prompts, new = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12]], [[5, 6, 7], [], [2, 3]]
    cache = target64.new_cache(3, 32)
    capture = (1, 2)
    with torch.inference_mode():
        prefill(target64, cache, prompts, RowSampler.from_params([SamplingParams()] * 3))
        out = target64.forward_packed(torch.tensor(sum(new, [])), torch.tensor([3, 0, 2]), cache, capture=capture)
        full = [target64(torch.tensor([p + n]), capture=capture) for p, n in zip(prompts, new)]
    ref_logits = torch.cat([f.logits[0, len(p):] for f, p in zip(full, prompts)])
    ref_feats = torch.cat([f.features[0, len(p):] for f, p in zip(full, prompts)])
    assert torch.allclose(out.logits[0], ref_logits, atol=1e-10)
    assert torch.allclose(out.features[0], ref_feats, atol=1e-10)
    assert cache.lengths.tolist() == [8, 2, 6]


# -- sampling is lossless under batching ----------------------------------------------

VOCAB, N, ALPHA = 12, 12000, 1e-3
SAMPLE_PROMPT = [3, 5, 7, 2]


@pytest.fixture(scope="module")
def target12():
    return make_target(seed=3, vocab=VOCAB, dtype=torch.float64)


def sample_under_load(engine: Engine, params: SamplingParams) -> torch.Tensor:
    """N seeded requests of the measured kind, interleaved with other prompts and params."""
    rng = random.Random(0)
    handles = []
    for i in range(N):
        handles.append(engine.submit(SAMPLE_PROMPT, SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i,
            max_new_tokens=3, ignore_eos=True)))
        if i % 8 == 0:
            prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 6))]
            engine.submit(prompt, SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=0.9,
                                                 max_new_tokens=rng.randint(2, 8), seed=N + i))
    engine.run_until_done()
    counts = torch.zeros(VOCAB ** 3)
    for h in handles:
        a, b, c = h.result().tokens
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    return counts


def sampling_engine(target, method: str, calibrate: bool = True) -> Engine:
    if method == "dflash":
        return Engine(target, make_draft(target, "zlab", 4, seed=5), "dflash", max_running=1024, max_model_len=24,
                      policy=PolicyOptions(adapt=False))
    if method.startswith("eagle3"):   # a draft vocabulary of 8 of the 12 tokens: q = 0 on the other 4
        draft = Eagle3Drafter.pair(make_eagle3(target, draft_vocab=8, seed=5), target, 3)
        if method == "eagle3-tree":   # recursive rejection over 3 siblings per node, 2 levels
            draft = draft.with_tree(EagleTree(3, 2, 7))
        return Engine(target, draft, "eagle3", max_running=1024, max_model_len=24, policy=PolicyOptions(adapt=False))
    if method == "dflash-gated":
        table = CostTable([1, 10000], [1.0, 51.0], draft_rows=[1, 10000], draft_times_s=[0.01, 500.0],
                          draft_slot_times={1: [0.005, 200.0]}, draft_window=3)
        return Engine(target, make_draft(target, "zlab", 4, seed=5), "dflash", max_running=1024, max_model_len=24,
                      policy=PolicyOptions(cost_table=table, draft_gate=True, gate_feedback=False))
    draft = make_draft(target, "deepspec", 3, seed=5, markov_rank=4, markov_type="gated", confidence=True)
    table = CostTable([1, 10000], [1.0, 51.0])
    if method == "dspark-gated":  # drafting pays only with few running requests
        table = CostTable([1, 10000], [1.0, 51.0], draft_rows=[1, 10000], draft_times_s=[0.01, 500.0],
                          draft_slot_times={1: [0.005, 200.0]}, draft_window=3)
    policy = PolicyOptions(scheduled=True, cost_table=table, gate_feedback=False, calibrate=calibrate)
    return Engine(target, draft, "dspark", max_running=1024, max_model_len=24, policy=policy)


@pytest.mark.parametrize("method, params", [
    ("dflash", SamplingParams(temperature=1.0)),
    ("eagle3", SamplingParams(temperature=1.0)),
    ("eagle3-tree", SamplingParams(temperature=0.7, top_k=5)),
    ("dspark-scheduled", SamplingParams(temperature=0.7, top_p=0.8)),
    ("dspark-scheduled-uncalibrated", SamplingParams(temperature=0.7, top_p=0.8)),
    ("dspark-gated", SamplingParams(temperature=1.0, top_k=6)),
    ("dflash-gated", SamplingParams(temperature=0.8, top_p=0.9)),
])
def test_batched_sampling_follows_target_distribution(target12, method, params):
    engine = sampling_engine(target12, method.removesuffix("-uncalibrated"), calibrate="uncalibrated" not in method)
    counts = sample_under_load(engine, params)
    assert chi_square_p(counts, exact_first_three(target12, params, SAMPLE_PROMPT, VOCAB)) > ALPHA
    m = engine.metrics()
    assert m["kv_bytes_in_use"] == 0 and m["finished"] == N + N // 8
    if method == "dspark-scheduled-uncalibrated":  # the planner really varied the lengths
        assert all(m["verified_histogram"].get(k, 0) > 100 for k in range(4))
        assert sum(m["accepted_histogram"].get(k, 0) for k in (1, 2, 3)) > 200
    if method == "dspark-scheduled":  # rescaled by outcomes, the head of this random draft verifies less
        assert len(m["verified_histogram"]) == 4 and m["verified_histogram"][0] > m["verified_histogram"][2] > 100
    if method.endswith("-gated"):
        assert 0 < m["undrafted_request_rounds"] < m["request_rounds"]
    if method == "eagle3-tree":   # drafts were accepted: the rule, not the fallback, made the tokens
        assert m["tau"] > 1.15


def test_lossy_verifier_is_detected_under_batching(target12, monkeypatch):
    """Power: accepting every verified draft gives the draft's distribution; the test sees it."""
    class AcceptAll(WrappedForwards):
        def verdict(self, target_logits, drafts, draft_probs, sampler, num_drafts, rule):
            rows = torch.arange(drafts.shape[0])
            verified = num_drafts if num_drafts is not None else torch.full_like(rows, drafts.shape[1])
            bonus = torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in
                                 zip(warp(target_logits, sampler)[rows, verified], sampler.generators)])
            return Verdict(verified.clone(), bonus)

    params = SamplingParams(temperature=1.0)
    engine = sampling_engine(target12, "dflash")
    engine.forwards = AcceptAll(engine.forwards)
    counts = sample_under_load(engine, params)
    assert chi_square_p(counts, exact_first_three(target12, params, SAMPLE_PROMPT, VOCAB)) < ALPHA


# -- slots, limits, rejection -----------------------------------------------------------

def test_too_big_request_is_rejected_and_others_continue(target64, requests):
    engine = build(target64, "dflash", max_running=2)
    first = engine.submit(requests[0][0], requests[0][1])
    engine.step()
    with pytest.raises(BlockspecError, match="max_model_len=64"):
        engine.submit([1] * 60, SamplingParams(max_new_tokens=10))
    with pytest.raises(BlockspecError, match="empty"):
        engine.submit([], SamplingParams(max_new_tokens=4))
    with pytest.raises(BlockspecError, match="token ids"):
        engine.submit([64], SamplingParams(max_new_tokens=4))
    with pytest.raises(BlockspecError, match="tokenizer"):
        engine.submit([1], SamplingParams(max_new_tokens=4, stop=["x"]))
    second = engine.submit(requests[1][0], requests[1][1])
    engine.run_until_done()
    assert first.result().tokens == requests[0][2].tokens
    assert second.result().tokens == requests[1][2].tokens
    def bad_callback(out):
        raise ValueError("client bug")

    third = engine.submit(requests[4][0], requests[4][1], on_output=bad_callback)
    engine.run_until_done()
    assert third.result().tokens == requests[4][2].tokens and isinstance(third.error, ValueError)
    m = engine.metrics()
    assert (m["rejected"], m["finished"], m["kv_bytes_in_use"]) == (4, 3, 0)
    # Beyond the model itself: max_model_len defaults to max_position_embeddings (256).
    with pytest.raises(BlockspecError, match="max_model_len=256"):
        Engine(target64, max_running=1).submit([1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(BlockspecError, match="max_model_len"):
        Engine(target64, max_model_len=1000)


def test_draft_gate_needs_a_speculative_method_and_draft_times(target64):
    draft = make_draft(target64, "zlab", 4)
    with pytest.raises(BlockspecError, match="draft_gate needs"):
        Engine(target64, draft, "dflash", policy=PolicyOptions(draft_gate=True, adapt=False))           # no table
    with pytest.raises(BlockspecError, match="draft_gate needs"):
        # no draft times in the table
        Engine(target64, draft, "dflash", policy=PolicyOptions(draft_gate=True, cost_table=SCHED_TABLE))
    with pytest.raises(BlockspecError, match="draft_gate needs"):
        Engine(target64, None, "ar", policy=PolicyOptions(draft_gate=True, cost_table=GATED_TABLE))
    gated = PolicyOptions(draft_gate=True, cost_table=GATED_TABLE)
    assert Engine(target64, draft, "dflash", policy=gated).metrics()["draft_gate"]
    with pytest.raises(BlockspecError, match="cost table is used by"):   # never silently ignored
        PolicyOptions(cost_table=GATED_TABLE, adapt=False)


@pytest.mark.parametrize("config", ["dflash-gated", "dspark-gated"])
def test_gate_drafts_shorter_blocks_and_output_still_equals_ar(monkeypatch, target64, requests, config):
    """Blocks shortened by the gate (one slot at 1 row here, where the table makes the
    full block dearer than it returns on these random drafts) keep greedy output equal to AR."""
    engine = build(target64, config, max_running=2)
    window = engine.draft.config.num_drafts
    blocks = []
    real = engine.forwards.propose
    monkeypatch.setattr(engine.forwards, "propose", lambda *a: (blocks.append(a[5]), real(*a))[1])
    handles = [engine.submit(p, params) for p, params, _ in requests]
    engine.run_until_done()
    for h, (_, _, ref) in zip(handles, requests):
        assert h.result().tokens == ref.tokens
    # one slot chosen, the full window explored first, later explorations as far as the curve reaches
    assert 1 in blocks and window in blocks and set(blocks) <= set(engine.policy.gate.block_choices)
    assert engine.metrics()["draft_block_histogram"] == dict(sorted(Counter(blocks).items()))


@pytest.mark.parametrize("config", ["dflash-gated", "dspark-scheduled"])
def test_gate_observes_every_round_it_gated(monkeypatch, target64, requests, config):
    """With feedback on, every round reports its rows, drafting rows, verified drafts
    and wall time to the gate: they add up to the engine's own counts (every AR round
    timed: `AR_TIMING_S` 0)."""
    monkeypatch.setattr(policy_module, "AR_TIMING_S", 0.0)
    table = GATED_TABLE
    draft = (make_draft(target64, "zlab", 4) if config == "dflash-gated" else
             make_draft(target64, "deepspec", 3, markov_rank=4, markov_type="gated", confidence=True))
    engine = Engine(target64, draft, "dflash" if config == "dflash-gated" else "dspark", max_running=3,
                    max_model_len=64, policy=PolicyOptions(scheduled=config == "dspark-scheduled", cost_table=table,
                                                           draft_gate=True))
    seen = []
    real = engine.policy.gate.observe
    monkeypatch.setattr(engine.policy.gate, "observe", lambda *a, **kw: (seen.append(a), real(*a, **kw))[1])
    for prompt, params, _ in requests:
        engine.submit(prompt, params)
    engine.run_until_done()
    m = engine.metrics()
    assert len(seen) == m["rounds"] and sum(rows for rows, *_ in seen) == m["request_rounds"]
    assert sum(1 for _, k, *_ in seen if k) == m["drafting_rounds"]
    assert sum(v for *_, v, _ in seen) == m["drafts_verified"]
    assert all(seconds > 0 and 0 <= k <= rows for rows, k, _, _, seconds in seen)


def test_kv_budget_sets_the_slot_count(target64):
    probe = build(target64, "dflash", max_running=1)
    per_slot = probe.slots.row_bytes
    engine = build(target64, "dflash", max_running=32, kv_memory_gb=5.5 * per_slot / 2**30)
    assert engine.rows == 5 and engine.metrics()["kv_bytes_total"] == 5 * per_slot
    assert build(target64, "dflash", max_running=2, kv_memory_gb=1.0).rows == 2
    with pytest.raises(BlockspecError, match="holds no request slot"):
        build(target64, "dflash", kv_memory_gb=0.5 * per_slot / 2**30)
    with pytest.raises(BlockspecError, match="confidence head"):
        Engine(target64, make_draft(target64, "zlab", 4), "dflash",
               policy=PolicyOptions(scheduled=True, cost_table=SCHED_TABLE))


def test_requests_beyond_slots_wait_then_run(target64, requests):
    engine = build(target64, "ar", max_running=2)
    handles = [engine.submit(p, sp) for p, sp, _ in requests[:5]]
    engine.step()
    m = engine.metrics()
    assert (m["running"], m["waiting"], m["kv_bytes_in_use"]) == (2, 3, 2 * m["kv_bytes_per_slot"])
    engine.run_until_done()
    assert [h.result().tokens for h in handles] == [ref.tokens for _, _, ref in requests[:5]]


# -- stop strings and text ------------------------------------------------------------

class CharTokenizer:
    """Token i decodes to one or two letters, so stop strings can start mid-token."""

    @staticmethod
    def piece(i: int) -> str:
        return chr(97 + i % 26) * (1 + i % 2)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(i) for i in ids)


def test_stop_strings_cut_text_and_tokens(target64, requests):
    tok = CharTokenizer()
    prompt, _, ref = requests[0]
    text = tok.decode(ref.tokens)
    stop = text[9:12]
    cut = text.find(stop)
    keep = max(k for k in range(len(ref.tokens) + 1) if len(tok.decode(ref.tokens[:k])) <= cut)
    engine = build(target64, "dflash", tokenizer=tok)
    deltas = []
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, stop=["zzzz", stop]),
                           on_output=deltas.append)
    plain = engine.submit(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.run_until_done()
    result = handle.result()
    assert result.finish_reason == "stop" and result.text == text[:cut]
    assert result.tokens == ref.tokens[:keep]
    assert "".join(d.text for d in deltas) == text[:cut]
    assert sum((d.token_ids for d in deltas), []) == result.tokens
    assert plain.result().text == text and plain.result().finish_reason == "length"


def test_cancelled_stream_delivers_the_held_back_tokens(target64, requests):
    """A stop string that never matches holds back its length's worth of text; cancelling
    releases it with the final delta: the stream is exactly the completion (issue 30)."""
    tok = CharTokenizer()
    engine = build(target64, "dflash", tokenizer=tok)
    deltas = []
    handle = engine.submit(requests[0][0], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=["zqzqzqzq"],
                                                          logprobs=0), on_output=deltas.append)
    for _ in range(3):
        engine.step()
    assert handle.request_id in engine._live and not handle.done
    engine.cancel(handle.request_id)
    engine.run_until_done()
    result = handle.result()
    assert result.finish_reason == "cancelled" and deltas[-1].finished and result.tokens
    assert sum((d.token_ids for d in deltas), []) == result.tokens
    assert "".join(d.text or "" for d in deltas) == result.text == tok.decode(result.tokens)
    assert [lp for d in deltas for lp in d.logprobs or []] == result.logprobs
    assert deltas[-1].token_ids   # the held-back tail came with the end


# -- background thread ------------------------------------------------------------------

def test_background_thread_streams_cancels_and_drains(target64, requests):
    engine = build(target64, "dspark-scheduled", max_running=2, max_model_len=256)
    engine.start()
    long = SamplingParams(max_new_tokens=240, ignore_eos=True)
    h_cancel = engine.submit(PROMPTS[5], long)       # cancelled from this thread once it streams
    first = next(iter(h_cancel))
    engine.cancel(h_cancel.request_id)
    # ... and one cancelled from its own callback (on the engine thread, mid-step).
    h_self = engine.submit(PROMPTS[6], long, request_id="self", on_output=lambda o: engine.cancel("self"))
    callback_tokens: list[int] = []
    h_iter = engine.submit(requests[0][0], requests[0][1])
    h_cb = engine.submit(requests[1][0], requests[1][1], on_output=lambda o: callback_tokens.extend(o.token_ids))
    h_async = engine.submit(requests[2][0], requests[2][1])
    h_await = engine.submit(requests[4][0], requests[4][1])

    streamed = [t for out in h_iter for t in out.token_ids]

    async def consume():
        got = [t async for out in h_async for t in out.token_ids]
        return got, await h_await

    async_tokens, awaited = asyncio.run(asyncio.wait_for(consume(), timeout=60))
    engine.shutdown(drain=True, timeout=60)
    assert streamed == h_iter.result().tokens == requests[0][2].tokens
    assert callback_tokens == h_cb.result(timeout=1).tokens == requests[1][2].tokens
    assert async_tokens == requests[2][2].tokens and awaited.tokens == requests[4][2].tokens
    assert first.token_ids and not first.finished
    for h in (h_cancel, h_self):
        assert h.result().finish_reason == "cancelled" and len(h.result().tokens) < 240
    assert not engine.cancel(h_iter.request_id)  # finished: nothing to cancel
    m = engine.metrics()
    assert (m["kv_bytes_in_use"], m["cancelled"], m["finished"]) == (0, 2, 4)
    with pytest.raises(BlockspecError, match="shut down"):
        engine.submit([1], SamplingParams())


def test_shutdown_without_drain_cancels_everything(target64):
    engine = build(target64, "dflash", max_running=2)
    engine.start()
    handles = [engine.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:5]]
    next(iter(handles[0]))  # at least one step ran
    engine.shutdown(drain=False, timeout=60)
    reasons = {h.result(timeout=1).finish_reason for h in handles}
    assert "cancelled" in reasons and reasons <= {"cancelled", "length"}
    m = engine.metrics()
    assert (m["kv_bytes_in_use"], m["running"], m["waiting"]) == (0, 0, 0)
    assert not math.isnan(m["tau"])


def test_failed_step_fails_every_request_in_background(target64, monkeypatch):
    engine = build(target64, "dflash", max_running=1)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.forwards, "verify_and_commit", broken)
    engine.start()
    handles = [engine.submit(p, SamplingParams(max_new_tokens=5)) for p in PROMPTS[:3]]
    results = [h.result(timeout=30) for h in handles]
    assert {r.finish_reason for r in results} == {"error"}
    assert isinstance(engine.failure, RuntimeError) and handles[0].error is engine.failure
    engine.shutdown(timeout=30)


def test_a_drained_engine_leaves_what_its_policy_learned_to_the_next_engine(target64, requests, monkeypatch):
    from blockspec.decoding import policy_memory

    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    draft = make_draft(target64, "zlab", 4, seed=5)
    options = PolicyOptions(cost_table=CostTable(SCHED_TABLE.ns, SCHED_TABLE.times_s, draft_rows=[1, 4],
                                                 draft_times_s=[0.1, 0.2]))
    first = Engine(target64, draft, "dflash", max_running=4, policy=options)
    assert first.policy.gate.curves == {}
    outs = first.generate([p for p, _, _ in requests[:4]], [sp for _, sp, _ in requests[:4]])
    assert [c.tokens for c in outs] == [ref.tokens for _, _, ref in requests[:4]]
    learned = first.policy.gate.curves[0]
    second = Engine(target64, draft, "dflash", max_running=4, policy=options)
    assert torch.equal(second.policy.gate.curves[0], learned)
    other = Engine(target64, make_draft(target64, "zlab", 4, seed=6), "dflash", max_running=4, policy=options)
    assert other.policy.gate.curves == {}
