"""What the adaptive policy learned is kept across `generate` calls (decoding/policy_memory.py)."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
import torch

from blockspec import GenerateOptions, PolicyOptions
from blockspec.config import SamplingParams
from blockspec.decoding import policy_memory
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.generate import generate
from blockspec.decoding.policy import RoundPolicy
from blockspec.decoding.policy_memory import check_state
from blockspec.decoding.round import Proposal, RoundOutcome, WrappedForwards
from blockspec.decoding.round_costs import KEY_SAMPLES
from blockspec.errors import BlockspecError
from conftest import make_draft, make_target, oracle_tokens

PROMPT = [1, 2, 3, 4, 5]
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


class OracleForwards(WrappedForwards):
    """Drafts the target's own greedy continuation: drafting pays as much as it can."""

    def __init__(self, inner, reference):
        super().__init__(inner)
        self.reference, self.calls = reference, itertools.count(1)

    def propose(self, draft, target, draft_cache, anchors, sampler, block=None, *rest):
        proposal = self.inner.propose(draft, target, draft_cache, anchors, sampler, block, *rest)
        tokens = oracle_tokens(proposal.tokens, draft_cache, anchors, self.reference, self.calls, 10 ** 9,
                               target.config.vocab_size)
        return Proposal(tokens, None, proposal.confidence)


class Blocks:
    """Round observer: the block each round drafted (0: an AR round)."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def on_round(self, outcome, requests) -> None:
        self.blocks.append(outcome.block)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path))
    target = make_target(dtype=torch.float64)
    reference = [PROMPT + generate(target, [PROMPT], PARAMS).completions[0].tokens]
    # Drafting (one draft forward) costs little next to a verify; the measured round times
    # price the rounds too (gate feedback), as by default.
    table = CostTable([1, 64], [1.0, 1.2], draft_rows=[1, 64], draft_times_s=[0.05, 0.5])
    return target, reference, table


def run(target, draft, reference, options):
    seen = Blocks()
    forwards = GenerateOptions(observer=seen, forwards=lambda inner: OracleForwards(inner, reference))
    out = generate(target, [PROMPT], PARAMS, draft=draft, method="dflash", policy=options, options=forwards)
    assert out.completions[0].tokens == reference[0][len(PROMPT):]   # lossless all along
    return seen.blocks


def test_a_second_call_drafts_from_its_first_round(pair):
    target, reference, table = pair
    draft = make_draft(target, "zlab", 4, seed=5)
    first = run(target, draft, reference, PolicyOptions(cost_table=table))
    # A policy that knows nothing explores once, then prices AR rounds before deciding.
    assert first[0] > 0 and first[1:4] == [0, 0, 0] and first[-1] > 0
    second = run(target, draft, reference, PolicyOptions(cost_table=table))
    assert all(b > 0 for b in second[:4])                 # it starts where the first call ended
    fresh = run(target, draft, reference, PolicyOptions(cost_table=table, memory="off"))
    assert fresh[1:4] == [0, 0, 0]
    restarted = run(target, draft, reference, PolicyOptions(cost_table=table, fresh=True))
    assert restarted[1:4] == [0, 0, 0]
    other = make_draft(target, "zlab", 4, seed=6)          # another draft (same shape) learns for itself
    assert run(target, other, reference, PolicyOptions(cost_table=table))[1:4] == [0, 0, 0]
    assert run(target, draft, reference, PolicyOptions(cost_table=table, min_survival=0.1))[1:4] == [0, 0, 0]


def test_disk_memory_survives_the_process_and_a_broken_file_is_ignored(pair, tmp_path, monkeypatch, caplog):
    target, reference, table = pair
    draft = make_draft(target, "zlab", 4, seed=5)
    options = PolicyOptions(cost_table=table, memory="disk")
    run(target, draft, reference, options)
    files = list((tmp_path / "policy_state").glob("*.json"))
    assert len(files) == 1
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})    # a new process: only the file remains
    assert all(b > 0 for b in run(target, draft, reference, options)[:4])
    saved = json.loads(files[0].read_text())
    saved["state"]["gate"]["bands"]["0"]["sums"][0] = float("nan")   # hand-edited / corrupt
    files[0].write_text(json.dumps(saved))
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    assert run(target, draft, reference, options)[1:4] == [0, 0, 0]
    assert "ignoring the saved policy state" in caplog.text
    files[0].write_text("{not json")
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    assert run(target, draft, reference, options)[1:4] == [0, 0, 0]
    # The same weights in another object (a reload) find the file; other weights do not.
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    reloaded = make_draft(target, "zlab", 4, seed=5)
    assert all(b > 0 for b in run(target, reloaded, reference, options)[:4])
    assert run(target, make_draft(target, "zlab", 4, seed=7), reference, options)[1:4] == [0, 0, 0]


def test_a_policy_state_round_trips_and_bad_states_are_refused(pair):
    target, reference, table = pair
    draft = make_draft(target, "deepspec", 3, seed=5, markov_rank=4, markov_type="gated", confidence=True)
    options = PolicyOptions(cost_table=table, memory="off")
    policy = RoundPolicy.for_method(target, draft, "dspark", options)
    generate(target, [PROMPT], PARAMS, draft=draft, method="dspark", policy=policy)
    state = json.loads(json.dumps(policy.state()))         # what a file holds
    check_state(state, draft.config.num_drafts)
    again = RoundPolicy.for_method(target, draft, "dspark", options)
    again.load_state(state)
    assert again.state() == state and again.gate.curves.keys() == policy.gate.curves.keys()
    # Kinds' ratios carry over (the medians of their samples); the machine's pace is measured
    # again by the next rounds.
    samples = {tuple(key): values for key, values in state["gate"]["ratios"]}
    ar = samples[(False, 1)] if len(samples.get((False, 1), ())) >= KEY_SAMPLES else samples[(False,)]
    assert again.gate.costs.pace == 1.0 and again.gate.cost_ratio(False, 1) == pytest.approx(statistics.median(ar))
    assert torch.equal(again.calibrations[0].scale, policy.calibrations[0].scale)
    with pytest.raises(BlockspecError, match="window"):
        check_state(state, draft.config.num_drafts + 1)
    bad = json.loads(json.dumps(state))
    bad["gate"]["ratios"][0][1] = [math.inf]
    with pytest.raises(BlockspecError, match="ratio samples"):
        check_state(json.loads(json.dumps(bad).replace("Infinity", "1e999")), draft.config.num_drafts)
    bad = json.loads(json.dumps(state))
    bad["calibrations"]["0"]["accepted"] = bad["calibrations"]["0"]["accepted"][:-1]
    with pytest.raises(BlockspecError, match="calibration 0 accepted"):
        check_state(bad, draft.config.num_drafts)
    for field, value, message in (("credit", "1", "credit"), ("draws", -1, "draws")):
        bad = json.loads(json.dumps(state))
        bad["gate"]["exploration"][field] = value
        with pytest.raises(BlockspecError, match=message):
            check_state(bad, draft.config.num_drafts)
    older = json.loads(json.dumps(state))
    del older["gate"]["exploration"]                       # saved before the credit was kept
    check_state(older, draft.config.num_drafts)
    with pytest.raises(BlockspecError, match="memory"):
        PolicyOptions(memory="forever")


def test_the_first_round_of_each_kind_runs_cold_and_is_not_learned(pair):
    """The draft's first forward in a process costs several warm rounds; learned (and
    remembered) it would price drafting out for many calls."""
    target, reference, table = pair
    draft = make_draft(target, "zlab", 4, seed=5)
    policy = RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(cost_table=table, memory="off"))
    g = draft.config.num_drafts
    drafting = RoundOutcome([[0] * g], [g], [g], [0], None, 1, g)
    ar = RoundOutcome([[]], [0], [0], [0], None, 0, 0)
    priced = table.time(1 + g) + table.draft_time(1, block=g)
    policy.observe_time(1, drafting, 10.0 * priced)         # cold
    policy.observe_time(1, drafting, 1.0 * priced)
    policy.observe_time(1, ar, 5.0 * table.time(1))         # cold
    policy.observe_time(1, ar, 0.5 * table.time(1))
    assert policy.gate.cost_ratio(True, 1, g) == pytest.approx(1.0)
    assert policy.gate.cost_ratio(False, 1) == pytest.approx(0.5)


def test_an_eagle3_chain_remembers_too(pair, tmp_path, monkeypatch):
    from blockspec.models.chain_draft import Eagle3Drafter
    from conftest import make_eagle3

    _, _, table = pair
    target = make_target()                                 # EAGLE-3 drafts in float32
    chain = Eagle3Drafter.pair(make_eagle3(target), target, 3)
    options = PolicyOptions(cost_table=table, memory="disk")
    out = generate(target, [PROMPT], PARAMS, draft=chain, method="eagle3", policy=options)
    assert out.completions[0].tokens == generate(target, [PROMPT], PARAMS).completions[0].tokens
    monkeypatch.setattr(policy_memory, "_REGISTRY", {})
    again = RoundPolicy.for_method(target, chain, "eagle3", options)
    assert again.gate.curves and len(list((tmp_path / "policy_state").glob("*.json"))) == 1
    shorter = RoundPolicy.for_method(target, chain.with_num_drafts(2), "eagle3", options)
    assert not shorter.gate.curves                      # another chain length learns for itself
