"""The adaptive policy's cost table: measured once, cached per machine and model pair (decoding/table_cache.py)."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec import PolicyOptions
from blockspec.decoding import cost_table, table_cache
from blockspec.decoding import policy as policy_module
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.policy import RoundPolicy
from blockspec.decoding.round import RoundOutcome
from blockspec.decoding.table_cache import DRIFT_ROUNDS, DRIFT_SECONDS, PROFILER_VERSION, CostDrift, cached_cost_table, profile_points, table_key
from blockspec.errors import BlockspecError
from conftest import make_draft, make_target


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no tables remembered in this process."""
    monkeypatch.setattr(table_cache, "_MEMO", {})
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path


def count_profiles(monkeypatch) -> list[int]:
    calls = []
    real = table_cache.profile_cost_table

    def counted(*args, **kwargs):
        calls.append(args[2].rows)
        return real(*args, **kwargs)
    monkeypatch.setattr(table_cache, "profile_cost_table", counted)
    return calls


def test_measured_once_then_read_from_the_cache(fresh, monkeypatch):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    calls = count_profiles(monkeypatch)
    table = cached_cost_table(target, draft, rows=3, repeats=1)
    assert calls == [4]                                         # rows rounded up to a power of two
    files = list((fresh / "cost_tables").glob("*.json"))
    assert len(files) == 1 and table.has_draft_times and table.draft_slot_counts[-1] == draft.config.num_drafts
    assert table.meta["key"] == table_key(target, draft, 4)
    assert table.meta["key"]["profiler"] == PROFILER_VERSION   # tables of an older profiler are measured again
    assert cached_cost_table(target, draft, rows=4) is table   # this process: no file read
    monkeypatch.setattr(table_cache, "_MEMO", {})               # a new process reads the file
    again = cached_cost_table(target, draft, rows=4)
    assert calls == [4] and again.ns == table.ns and again.times_s == pytest.approx(table.times_s)


def test_another_pair_dtype_or_row_count_never_reuses_a_table(fresh, monkeypatch):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    calls = count_profiles(monkeypatch)
    cached_cost_table(target, draft, rows=1, repeats=1)
    cached_cost_table(target, make_draft(target, "zlab", 3), rows=1, repeats=1)            # another block
    cached_cost_table(target, make_draft(target, "zlab", 4, layers=2), rows=1, repeats=1)  # another draft shape
    cached_cost_table(make_target(layers=3), make_draft(make_target(layers=3), "zlab", 4), rows=1, repeats=1)
    t64 = make_target(dtype=torch.float64)
    cached_cost_table(t64, make_draft(t64, "zlab", 4), rows=1, repeats=1)                  # another dtype
    cached_cost_table(target, draft, rows=8, repeats=1)                                     # more rows
    assert len(calls) == 6 and len(list((fresh / "cost_tables").glob("*.json"))) == 6
    cached_cost_table(target, make_draft(target, "zlab", 4, seed=9), rows=1)               # other weights, same shape
    assert len(calls) == 6


def test_a_foreign_or_broken_file_is_measured_again(fresh, monkeypatch, caplog):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    calls = count_profiles(monkeypatch)
    cached_cost_table(target, draft, rows=1, repeats=1)
    path = next((fresh / "cost_tables").glob("*.json"))
    raw = json.loads(path.read_text())
    raw["meta"]["key"]["machine"] = "another machine"           # copied from elsewhere: not trusted
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(table_cache, "_MEMO", {})
    cached_cost_table(target, draft, rows=1, repeats=1)
    path.write_text("{not json")
    monkeypatch.setattr(table_cache, "_MEMO", {})
    cached_cost_table(target, draft, rows=1, repeats=1)
    assert len(calls) == 3 and "ignoring the cached cost table" in caplog.text
    assert CostTable.load(path).meta["key"] == table_key(target, draft, 1)


def test_an_unwritable_cache_still_works(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(table_cache, "_MEMO", {})
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(blocker))     # a file where the directory should be
    target = make_target()
    table = cached_cost_table(target, make_draft(target, "zlab", 4), rows=1, repeats=1)
    assert table.has_draft_times and "could not cache the cost table" in caplog.text


def test_profile_points_cover_every_round_width():
    ns, rows = profile_points(1, 15)
    assert ns == list(range(1, 17)) and rows == [1]
    ns, rows = profile_points(32, 15)
    assert ns[:16] == list(range(1, 17)) and ns[-1] == 512 and {32, 33, 64, 128, 256} <= set(ns)
    assert rows == [1, 2, 4, 8, 16, 32]


def test_eagle3_chains_get_their_own_table_with_draft_times_growing_with_the_chain(fresh, monkeypatch):
    """An EAGLE-3 round drafts k tokens with k one-token forwards: the table measures each
    chain length (below the window) and the time grows with it; a chain of another length,
    or a DFlash draft, never shares its table."""
    from blockspec.models.chain_draft import Eagle3Drafter
    from conftest import make_eagle3
    target = make_target(layers=4)
    chain = Eagle3Drafter.pair(make_eagle3(target), target, 7)
    calls = count_profiles(monkeypatch)
    table = cached_cost_table(target, chain, rows=1, repeats=3)
    assert table.draft_window == 7 and table.draft_slot_counts == [1, 2, 3, 4, 6, 7]
    assert table.draft_time(1, block=7) > 2.5 * table.draft_time(1, block=1)   # 7 draft forwards vs 1
    cached_cost_table(target, chain.with_num_drafts(5), rows=1, repeats=1)
    cached_cost_table(target, make_draft(target, "zlab", 8), rows=1, repeats=1)
    assert len(calls) == 3 and "eagle3" in table.meta["key"]["draft"]


def test_two_cpu_models_never_share_a_table(fresh, monkeypatch):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    calls = count_profiles(monkeypatch)
    monkeypatch.setattr(cost_table, "cpu_model", lambda: "Intel(R) Xeon(R) CPU @ 2.20GHz")
    xeon = cached_cost_table(target, draft, rows=1, repeats=1)
    monkeypatch.setattr(cost_table, "cpu_model", lambda: "AMD EPYC 7B13")
    epyc = cached_cost_table(target, draft, rows=1, repeats=1)
    assert len(calls) == 2 and len(list((fresh / "cost_tables").glob("*.json"))) == 2
    assert "Xeon" in xeon.machine and "EPYC" in epyc.machine and xeon.meta["key"] != epyc.meta["key"]
    monkeypatch.setattr(table_cache, "_MEMO", {})
    monkeypatch.setattr(cost_table, "cpu_model", lambda: "Intel(R) Xeon(R) CPU @ 2.20GHz")
    assert cached_cost_table(target, draft, rows=1).machine == xeon.machine and len(calls) == 2


def test_the_cpu_model_is_read_from_cpuinfo():
    name = cost_table.cpu_model()
    assert isinstance(name, str) and name and name in cost_table.machine_signature("cpu")


ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\ncpu family\t: 99\n"
ZEN5 = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f avx512_bf16\n"


def test_a_virtual_cpu_name_is_told_apart_by_family_model_and_bf16_units():
    # VMs show both CPUs as "AMD EPYC": one has bf16 units, the other not (times differ ~10x in bf16).
    assert cost_table.cpu_model(ZEN3) == "AMD EPYC (family 25 model 1)"
    assert cost_table.cpu_model(ZEN5) == "AMD EPYC (family 26 model 2; avx512_bf16)"
    assert cost_table.cpu_model("model name\t: Some CPU\n") == "Some CPU"
    assert cost_table.cpu_model("") and cost_table.cpu_model("") != "AMD EPYC"


def test_remeasure_measures_again_with_a_progress_line(fresh, monkeypatch, capsys):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    calls = count_profiles(monkeypatch)
    first = cached_cost_table(target, draft, rows=1, repeats=1)
    err = capsys.readouterr().err
    assert "measuring" in err and "cost table measured in" in err
    assert cached_cost_table(target, draft, rows=1) is first and len(calls) == 1
    again = cached_cost_table(target, draft, rows=1, repeats=1, refresh=True)
    assert len(calls) == 2 and again is not first and "re-measuring" in capsys.readouterr().err
    assert cached_cost_table(target, draft, rows=1) is again          # the new table replaces the old one
    monkeypatch.setattr(table_cache, "_MEMO", {})
    assert cached_cost_table(target, draft, rows=1).times_s == pytest.approx(again.times_s)
    # The policy's option: a fresh measurement through the factory.
    RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(remeasure=True))
    assert len(calls) == 3
    with pytest.raises(BlockspecError, match="remeasure-costs"):
        PolicyOptions(remeasure=True, adapt=False)


def test_a_table_that_live_rounds_disprove_is_rescaled_and_written_back(fresh, monkeypatch):
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    monkeypatch.setattr(table_cache, "DRIFT_SECONDS", 0.0)   # windows of rounds only (tiny tables)
    monkeypatch.setattr(policy_module, "AR_TIMING_S", 0.0)   # every AR round timed
    policy = RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(memory="off"))
    table = policy.gate.table
    before = list(table.times_s)
    path = next((fresh / "cost_tables").glob("*.json"))
    ar = RoundOutcome([[]], [0], [0], [0], None, 0, 0)
    policy.observe_time(1, ar, 3.0 * table.time(1))     # the first AR round runs cold: not counted
    for _ in range(2 * DRIFT_ROUNDS - 1):   # the machine got 3x slower than when the table was measured
        policy.observe_time(1, ar, 3.0 * table.time(1))
    assert table.times_s == before                       # not before two windows of DRIFT_ROUNDS rounds
    policy.observe_time(1, ar, 3.0 * table.time(1))
    assert table.times_s == pytest.approx([3.0 * t for t in before], rel=1e-6)
    assert policy.gate.cost_ratio(False, 1) == pytest.approx(1.0)   # prices unchanged: ratios follow the table
    assert CostTable.load(path).times_s == pytest.approx(table.times_s)
    for _ in range(DRIFT_ROUNDS):                        # now right: left alone
        policy.observe_time(1, ar, 1.2 * table.time(1))
    assert table.times_s == pytest.approx([3.0 * t for t in before], rel=1e-6)


def test_an_ar_stretch_times_about_one_round_per_ar_timing_span(fresh, monkeypatch):
    """Past the warm-up, about one AR round per AR_TIMING_S of them is timed (the rest
    only add their seconds to the drift check's window), drawn whatever its own length
    (timing the round that completed the span favoured long rounds: AR priced dearer
    than it ran); drafting rounds and AR probes are always timed."""
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    policy = RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(memory="off"))
    timed = []
    real = policy.gate.observe
    monkeypatch.setattr(policy.gate, "observe", lambda *a, **k: (timed.append(a[4]), real(*a, **k))[1])
    ar = RoundOutcome([[]], [0], [0], [0], None, 0, 0)
    drafting = RoundOutcome([[1, 2, 3]], [3], [1], [0], None, 1, 3)
    fast, slow = 0.1 * policy_module.AR_TIMING_S, 0.4 * policy_module.AR_TIMING_S   # one in four, on average
    warm = 1 + policy_module.WARM_AR_ROUNDS
    for _ in range(warm):                                    # the cold round, then the warm-up: each timed
        policy.observe_time(1, ar, fast)
    assert len(timed) == warm
    lengths = [slow if i % 2 else fast for i in range(600)]   # 3 s: within one drift window
    for seconds in lengths:
        policy.observe_time(1, ar, seconds)
    lengths.append(fast)
    policy.observe_time(1, ar, fast)
    sampled = timed[warm:]
    assert 0.1 < len(sampled) / len(lengths) < 0.6
    assert sum(x == slow for x in sampled) / len(sampled) == pytest.approx(0.5, abs=0.1)   # unbiased
    window = sum(lengths[:-1]) + policy_module.WARM_AR_ROUNDS * fast
    assert policy.drift.elapsed <= window + fast and policy.drift.elapsed >= window - 20 * slow   # every second
    before = len(timed)
    policy.observe_time(1, drafting, fast)                   # a drafting round: timed (twice: the first is cold)
    policy.observe_time(1, drafting, fast)
    policy.gate.probes.probing = True                        # an AR probe among drafting rounds: timed
    policy.observe_time(1, ar, fast)
    assert len(timed) == before + 3


def test_every_policy_of_a_shared_table_follows_its_rescale(fresh, monkeypatch):
    """Engines and `generate` calls of one process share the cached table: one policy
    rescaling it left another's ratios learned against the old times, so its AR and
    drafting rounds were priced `factor` times dearer (or cheaper) than measured."""
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    monkeypatch.setattr(table_cache, "DRIFT_SECONDS", 0.0)
    monkeypatch.setattr(policy_module, "AR_TIMING_S", 0.0)   # every AR round timed
    rescaling, other = (RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(memory="off"))
                        for _ in range(2))
    table = rescaling.gate.table
    assert other.gate.table is table
    ar = RoundOutcome([[]], [0], [0], [0], None, 0, 0)
    for _ in range(2):   # cold, then learned: the other policy measured AR rounds at 1.3x the table
        other.observe_time(1, ar, 1.3 * table.time(1))
    assert other.gate.cost_ratio(False, 1) == pytest.approx(1.3)
    seconds = 1.3 * table.time(1)
    for _ in range(2 * DRIFT_ROUNDS + 1):
        rescaling.observe_time(1, ar, 3.0 * table.time(1))
    assert table.meta["rescaled"] == pytest.approx(3.0)
    # The other policy's AR round is priced as it measured it, not 3x dearer.
    assert other.gate.cost_ratio(False, 1) * table.time(1) == pytest.approx(seconds)


def test_a_load_that_comes_and_goes_does_not_rescale_the_table():
    """Busy and quiet windows in turn (other processes starting and stopping): rescaling
    after each flipped the table (and its cached file) by 2x and back every 32 rounds."""
    drift = CostDrift(seconds=0.0)
    factors = [drift.observe(ratio) for window in range(8) for ratio in [0.5 if window % 2 else 2.0] * DRIFT_ROUNDS]
    assert factors == [None] * len(factors)
    # Slower for good: two windows in a row, rescaled by the one nearer 1.
    steady = [drift.observe(r) for r in [2.5] * DRIFT_ROUNDS + [2.0] * DRIFT_ROUNDS]
    assert steady[-1] == pytest.approx(2.0) and steady[:-1] == [None] * (2 * DRIFT_ROUNDS - 1)


def test_a_window_spans_seconds_of_rounds_and_a_loop_of_calls_adds_up(fresh):
    """Spells of a shared CPU last seconds: windows of 32 fast rounds (a third of a second)
    rescaled the table 1.9x and back every few seconds. A window needs DRIFT_SECONDS of
    rounds too, and the policies of one cached table share its check, so short calls
    (a loop of `generate`) add up to a window."""
    drift = CostDrift()
    round_s = DRIFT_SECONDS / (4 * DRIFT_ROUNDS)
    assert [drift.observe(2.0, round_s) for _ in range(8 * DRIFT_ROUNDS - 1)] == [None] * (8 * DRIFT_ROUNDS - 1)
    assert drift.observe(2.0, round_s) == pytest.approx(2.0)
    target = make_target()
    draft = make_draft(target, "zlab", 4)
    first, second = (RoundPolicy.for_method(target, draft, "dflash", PolicyOptions(memory="off")) for _ in range(2))
    assert first.gate.table is second.gate.table and first.drift is second.drift
    assert CostDrift() is not first.drift
