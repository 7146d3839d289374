"""The adaptive policy (the default of every speculative path) stays lossless while it
switches between AR rounds, short blocks and full blocks inside one request."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.decoding.context import PendingContext
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.generate import generate
from blockspec.decoding.policy import RoundPolicy
from blockspec import GenerateOptions, PolicyOptions
from conftest import make_draft, make_target
from lossless_stats import chi_square_p, exact_first_three

scipy_stats = pytest.importorskip("scipy.stats")
generate_module = importlib.import_module("blockspec.decoding.generate")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
TABLE = CostTable([1, 64], [1.0, 2.0], draft_rows=[1, 64], draft_times_s=[0.5, 2.0],
                  draft_slot_times={1: [0.2, 1.0], 2: [0.3, 1.5]}, draft_window=3)


def drafts(target):
    return {"dflash": make_draft(target, "zlab", 4, seed=5),
            "dspark": make_draft(target, "deepspec", 3, seed=5, markov_rank=4, markov_type="gated", confidence=True)}


def switching_policy(target, draft, method: str, rows: int, script: list[tuple[float, int]]) -> RoundPolicy:
    """The real policy (gate, planner, calibration) whose gate follows `script`: per round
    (share of rows that draft, block length), cycling; 0 rows is an AR round."""
    policy = RoundPolicy.for_method(target, draft, method, PolicyOptions(cost_table=TABLE, gate_feedback=False),
                                    rows=rows)
    cycle = itertools.cycle(script)

    def decide(bands):
        share, block = next(cycle)
        k = int(round(share * len(bands)))
        return (k, block) if k else (0, 0)
    policy.gate.decide = decide
    return policy


class Blocks:
    """Round observer: the block length (0: AR) each request saw, round by round."""

    def __init__(self) -> None:
        self.by_request: dict[int, list[int]] = {}

    def on_round(self, outcome, requests) -> None:
        for i, r in enumerate(requests):
            self.by_request.setdefault(r, []).append(outcome.block if i < outcome.drafting_rows else 0)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_greedy_output_equals_ar_while_switching_inside_a_request(method):
    target = make_target(dtype=torch.float64)
    draft = drafts(target)[method]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = [c.tokens for c in generate(target, PROMPTS, params).completions]
    window = draft.config.num_drafts
    policy = switching_policy(target, draft, method, len(PROMPTS), [(0.0, 0), (1.0, 1), (0.5, window), (1.0, window),
                                                                   (0.25, 2)])
    seen = Blocks()
    out = generate(target, PROMPTS, params, draft=draft, method=method, policy=policy,
                   options=GenerateOptions(observer=seen))
    assert [c.tokens for c in out.completions] == ref
    assert {0, 1, window} <= set(seen.by_request[0])         # AR, short and full blocks in one request
    # The default path (adaptive, this machine's measured table) is lossless too.
    default = generate(target, PROMPTS, params, draft=draft, method=method)
    assert [c.tokens for c in default.completions] == ref


def test_adaptive_is_the_default_and_no_adapt_is_the_full_window(monkeypatch):
    target = make_target(dtype=torch.float64)
    draft = drafts(target)["dflash"]
    used = []
    module = importlib.import_module("blockspec.decoding.generate")
    real = module.speculative_round
    monkeypatch.setattr(module, "speculative_round",
                        lambda batch, policy, **kw: (used.append(policy), real(batch, policy, **kw))[1])
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    generate(target, PROMPTS[:1], params, draft=draft)
    generate(target, PROMPTS[:1], params, draft=draft, policy=PolicyOptions(adapt=False))
    assert used[0].adaptive and not used[0].fixed and used[-1].fixed   # one policy type, two settings


VOCAB, N, ALPHA = 12, 12000, 1e-3


@pytest.mark.parametrize("method, params", [("dflash", SamplingParams(temperature=1.0)),
                                            ("dspark", SamplingParams(temperature=0.7, top_p=0.8))])
def test_sampled_distribution_is_exact_while_switching(method, params):
    """Chi-square over the first three tokens of 12000 seeded rows (as
    test_lossless_sampling), with rows switching between AR, one-slot, two-slot and
    full blocks from round to round, and only part of the batch drafting."""
    target = make_target(seed=3, vocab=VOCAB, dtype=torch.float64)
    draft = drafts(target)[method]
    window = draft.config.num_drafts
    policy = switching_policy(target, draft, method, N, [(0.5, 1), (0.0, 0), (1.0, window), (0.3, 2)])
    rows = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           max_new_tokens=3, seed=i, ignore_eos=True) for i in range(N)]
    prompt = [3, 5, 7, 2]
    seen = Blocks()
    out = generate(target, [prompt] * N, rows, draft=draft, method=method, policy=policy,
                   options=GenerateOptions(observer=seen))
    assert len({tuple(b) for b in seen.by_request.values()}) > 2   # rows really followed different schedules
    counts = torch.zeros(VOCAB ** 3)
    for c in out.completions:
        a, b, d = c.tokens
        counts[(a * VOCAB + b) * VOCAB + d] += 1
    assert chi_square_p(counts, exact_first_three(target, params, prompt, VOCAB)) > ALPHA


class Trims:
    """Counts the rows whose buffered draft context was cut to its recent window, and the
    rows whose draft context was then rebuilt from it."""

    def __init__(self, monkeypatch) -> None:
        self.rows = self.rebuilt = 0
        trim, flush = PendingContext._trim, PendingContext.flush

        def trimmed(pending, rows):
            before = int(pending.cut[:rows].sum())
            trim(pending, rows)
            self.rows += int(pending.cut[:rows].sum()) - before

        def flushed(pending, rows, start=0):
            if rows > start and int(pending.lengths[start:rows].max()) > 0:
                self.rebuilt += int(pending.cut[start:rows].sum())
            flush(pending, rows, start)
        monkeypatch.setattr(PendingContext, "_trim", trimmed)
        monkeypatch.setattr(PendingContext, "flush", flushed)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("pending", [None, "tight"])
def test_greedy_output_equals_ar_across_long_ar_stretches(monkeypatch, method, pending):
    """Rows run AR stretches longer than the buffered context (which then keeps only a
    recent window) and draft again from a rebuilt context: still AR token for token.
    pending "tight": a buffer barely larger than a round, so it is cut every few rounds."""
    target = make_target(dtype=torch.float64)
    draft = drafts(target)[method]
    window = draft.config.num_drafts
    if pending == "tight":
        monkeypatch.setattr(generate_module, "PENDING_POSITIONS", window + 2)
    trims = Trims(monkeypatch)
    params = SamplingParams(max_new_tokens=90 if pending is None else 30, ignore_eos=True)
    ref = [c.tokens for c in generate(target, PROMPTS, params).completions]
    stretch = 70 if pending is None else 4
    script = [(0.0, 0)] * stretch + [(1.0, window), (0.5, 2), (1.0, 1)]
    policy = switching_policy(target, draft, method, len(PROMPTS), script)
    out = generate(target, PROMPTS, params, draft=draft, method=method, policy=policy)
    assert [c.tokens for c in out.completions] == ref
    assert trims.rows >= len(PROMPTS) and trims.rebuilt >= len(PROMPTS)   # contexts really were cut and rebuilt


def test_sampled_distribution_is_exact_with_cut_draft_contexts(monkeypatch):
    """The chi-square of test_sampled_distribution_is_exact_while_switching with a buffer
    so small that drafting rows' contexts are cut to one feature and rebuilt."""
    target = make_target(seed=3, vocab=VOCAB, dtype=torch.float64)
    draft = drafts(target)["dflash"]
    window = draft.config.num_drafts
    monkeypatch.setattr(generate_module, "PENDING_POSITIONS", window + 2)
    trims = Trims(monkeypatch)
    params = SamplingParams(temperature=1.0)
    policy = switching_policy(target, draft, "dflash", N, [(1.0, window), (0.5, 2), (0.0, 0), (1.0, window)])
    # Five tokens, so rows cut in one round draft again from a rebuilt context (a row that
    # finishes is dropped, never rebuilt); the first three tokens' law does not depend on
    # how many follow them.
    rows = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=i, ignore_eos=True) for i in range(N)]
    prompt = [3, 5, 7, 2]
    out = generate(target, [prompt] * N, rows, draft=draft, method="dflash", policy=policy)
    assert trims.rows > N // 4 and trims.rebuilt > N // 8
    counts = torch.zeros(VOCAB ** 3)
    for c in out.completions:
        a, b, d = c.tokens[:3]
        counts[(a * VOCAB + b) * VOCAB + d] += 1
    assert chi_square_p(counts, exact_first_three(target, params, prompt, VOCAB)) > ALPHA


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_call_that_never_drafts_never_runs_the_draft(monkeypatch, method):
    """Where drafting does not pay (sampling on a CPU), the policy runs AR rounds; the
    prompts' features wait in the pending context, so the draft costs nothing at all."""
    target = make_target(dtype=torch.float64)
    draft = drafts(target)[method]
    calls = []
    for name in ("append_context", "block_hidden"):
        real = getattr(draft, name)
        monkeypatch.setattr(draft, name, lambda *a, real=real, name=name, **k: (calls.append(name), real(*a, **k))[1])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [c.tokens for c in generate(target, PROMPTS, params).completions]
    out = generate(target, PROMPTS, params, draft=draft, method=method,
                   policy=switching_policy(target, draft, method, len(PROMPTS), [(0.0, 0)]))
    assert [c.tokens for c in out.completions] == ref and calls == []
    # Drafting later in the call appends the prompt first: still AR token for token.
    out = generate(target, PROMPTS, params, draft=draft, method=method,
                   policy=switching_policy(target, draft, method, len(PROMPTS), [(0.0, 0)] * 3 + [(1.0, 2)]))
    assert [c.tokens for c in out.completions] == ref and "append_context" in calls
