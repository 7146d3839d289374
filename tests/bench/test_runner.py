"""The benchmark end to end on tiny random models, the round observer behind calibration,
forced (simulated) acceptance, the CLI hook and the GPU script's fail-fast path."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec import Engine, GenerateOptions, PolicyOptions, embedded
from blockspec.bench.arms import ForcedAcceptance, accept_pattern, draft_kind
from blockspec.bench.cli import add_bench_parser
from blockspec.bench.datasets import BenchPrompt
from blockspec.bench.measure import ArmTotals, collect_calibration, paired_ratio, throughput_vs_concurrency
from blockspec.bench.report import render_markdown
from blockspec.bench.run import BenchOptions, _code_quality, _datasets, run_bench
from blockspec.config import SamplingParams
from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.generate import RoundRecorder
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import save_draft
from conftest import make_draft, make_target, write_tiny_target_dir

REPO = Path(__file__).resolve().parents[2]
MAX_NEW, LIMIT = 8, 2
HAS_HF = importlib.util.find_spec("transformers") is not None


def strict_json(path: Path):
    def no_nan(name):
        raise AssertionError(f"{path} holds {name}")
    return json.loads(path.read_text(), parse_constant=no_nan)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target on disk with a DFlash draft (zlab, B=4) and a DSpark draft (gamma 3)."""
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_target_dir(root / "target")
    save_draft(make_draft(target, layout="zlab", block_size=4), root / "dflash")
    save_draft(make_draft(target, layout="deepspec", block_size=3, markov_rank=4, confidence=True), root / "dspark")
    prompts = [{"prompt": " ".join(f"w{(5 * i + j) % 60}" for j in range(6)), "id": f"p{i}"} for i in range(3)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


def drafts_of(root: Path) -> dict[str, Path]:
    return {"dflash": root / "dflash", "dspark": root / "dspark"}


@pytest.fixture(scope="module")
def bench(models):
    methods = ["ar", "dflash", "dspark", "dspark-scheduled"] + (["hf"] if HAS_HF else [])
    out = models / "out"
    results = run_bench(models / "target", drafts_of(models), [str(models / "prompts.jsonl")],
                        options=BenchOptions(methods=methods, temperatures=[0.0, 1.0], max_new_tokens=MAX_NEW,
                                             limit=LIMIT, repeats=1, out_dir=out, ignore_eos=True))
    return results, out


def test_bench_writes_json_markdown_and_plots(bench):
    results, out = bench
    assert len(strict_json(out / "results.json")["rows"]) == len(results["rows"])
    md = (out / "results.md").read_text()
    assert "| dataset | method |" in md and "dflash B=4" in md and "dspark B=3" in md
    assert "Confidence-head calibration" in md and "NOT lossless" not in md
    assert "## Acceptance by context length" in md and "| prompts | dflash B=4 adaptive | 0.000 | <512 |" in md
    for temp in ("0", "1"):
        for kind in ("acceptance", "per_slot", "tau_vs_position", "dspark-B-3-adaptive_reliability"):
            png = out / f"prompts_t{temp}_{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert sorted(Path(p).name for p in results["plots"]) == sorted(p.name for p in out.glob("*.png"))


def test_bench_rows_cover_every_method_and_temperature(bench):
    results, _ = bench
    rows = results["rows"]
    expected = {"ar", "dflash", "dspark", "dspark-scheduled"} | ({"hf"} if HAS_HF else set())
    for temp in (0.0, 1.0):
        assert {r["method"] for r in rows if r["temperature"] == temp} == expected
    assert results["meta"]["lossless"] and results["meta"]["prompts"] == {"prompts": ["p0", "p1"]}


def test_bench_metrics_are_consistent(bench):
    results, _ = bench
    for row in results["rows"]:
        assert row["new_tokens"] == LIMIT * MAX_NEW, row["label"]     # ignore_eos: every request is full
        assert row["tau"] >= 1.0 and row["speedup"] > 0 and row["tokens_per_s"] > 0
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["tau"])
        assert row["t_ar_ms"] > 0
        if row["method"] == "hf":
            assert "acceptance" not in row and row["t_draft_ms"] is None
            continue
        acc = row["acceptance"]
        assert sum(acc["histogram"]) == acc["rounds"] > 0
        # short prompts: every round is in the first context bucket, which is the overall figure
        assert [(e["context"], e["rounds"], e["tau"]) for e in row["by_context"]] == [("<512", acc["rounds"],
                                                                                          acc["tau"])]
        assert sum(row["tau_by_position"]["rounds"]) == acc["rounds"]
        assert acc["tau"] == pytest.approx(row["tau"])
        assert len(acc["histogram"]) <= row["drafts"] + 1
        if row["method"] == "ar":
            assert acc["histogram"] == [LIMIT * (MAX_NEW - 1)]        # first token comes from prefill
            assert row["speedup"] == 1.0 and row["t_draft_ms"] is None
        else:
            assert row["t_draft_ms"] > 0 and row["t_verify_ms"] > 0
            assert row["tau"] <= row["drafts"] + 1
            assert row["projected_speedup"] == pytest.approx(
                row["tau"] * row["t_ar_ms"] / (row["t_draft_ms"] + row["t_verify_ms"]))


def test_bench_calibration_of_dspark(bench):
    results, _ = bench
    for row in results["rows"]:
        cal = row.get("calibration")
        if row["method"] != "dspark":
            assert cal is None
            continue
        assert 0.0 <= cal["ece"] <= 1.0 and 0.0 <= cal["brier"] <= 1.0
        # Calibration runs its own fixed-window pass (the timed arm is adaptive): whole windows.
        assert cal["n"] > 0 and cal["n"] % row["drafts"] == 0
        assert sum(b["count"] for b in cal["reliability"]) == cal["n"]


def test_bench_reports_degeneracy_next_to_tau(bench):
    results, out = bench
    for row in results["rows"]:
        deg = row["degeneracy"]
        assert deg["tokens"] == row["new_tokens"] and deg["completions"] == LIMIT and deg["n"] == 8
        assert row["rep8"] == pytest.approx(deg["repeated_tokens"] / deg["tokens"])
        assert row["looping"] == deg["looping_share"] and 0.0 <= row["looping"] <= 1.0
        assert row["parse_body"] is None and row["code"] is None         # jsonl prompts name no function
    # greedy and lossless: every blockspec arm decodes AR's tokens, so the same degeneracy
    greedy = {r["method"]: r["degeneracy"] for r in results["rows"] if r["temperature"] == 0.0 and r["method"] != "hf"}
    assert len({json.dumps(d, sort_keys=True) for d in greedy.values()}) == 1
    md = (out / "results.md").read_text()
    assert "| tau | rep8 | looping | parse_body |" in md and "repeated 8-gram" in md
    assert "rep8" in strict_json(out / "results.json")["rows"][0]


class CharTokenizer:
    def decode(self, ids):
        return "".join(map(chr, ids))


def test_code_quality_of_an_arm():
    prompts = [BenchPrompt("a", 'def f(x):\n    """Double."""', "f"), BenchPrompt("b", "def g():", "g"),
               BenchPrompt("c", "free text")]
    total = ArmTotals(outputs=[list(map(ord, "\n    return 2 * x\n\ndef h(")), list(map(ord, "\n    pass")),
                               list(map(ord, "whatever"))])
    row: dict = {}
    _code_quality(row, total, prompts, CharTokenizer())
    assert row["code"] == {"scored": 2, "parsed": 2, "with_body": 1, "parse_rate": 1.0, "body_rate": 0.5}
    assert row["parse_body"] == 0.5
    _code_quality(row, total, prompts[2:], CharTokenizer())
    assert row["code"] is None and row["parse_body"] is None


def test_bench_scores_code_prompts(models):
    prompts = [BenchPrompt(f"p{i}", f'def f{i}(x):\n    """Return x."""', f"f{i}") for i in range(2)]
    options = BenchOptions(methods=["ar", "dflash"], temperatures=[0.0], max_new_tokens=MAX_NEW,
                           out_dir=models / "code", ignore_eos=True, progress=False)
    results = run_bench(models / "target", drafts_of(models), {"code": prompts}, options)
    for row in results["rows"]:
        assert row["code"]["scored"] == 2 and 0.0 <= row["parse_body"] <= row["code"]["parse_rate"] <= 1.0
        assert row["degeneracy"]["completions"] == 2


def test_every_kth_prompt_then_limit(models):
    prompts = [BenchPrompt(f"p{i}", f"text {i}") for i in range(10)]
    assert [p.id for p in _datasets({"d": prompts}, None, 3, 4)["d"]] == ["p0", "p4", "p8"]
    assert [p.id for p in _datasets({"d": prompts}, None, 2, 3)["d"]] == ["p0", "p3"]
    assert [p.id for p in _datasets({"d": prompts}, None, None)["d"]] == [f"p{i}" for i in range(10)]
    with pytest.raises(BlockspecError, match="every"):
        run_bench(models / "missing", {}, ["x.jsonl"], options=BenchOptions(every=0, out_dir=models / "never"))


def test_simulated_acceptance_hits_requested_tau(models):
    tau = 2.5
    results = run_bench(models / "target", drafts_of(models), [str(models / "prompts.jsonl")],
                        options=BenchOptions(methods=["ar", "dflash"], temperatures=[0.0], max_new_tokens=16,
                                             limit=LIMIT, block_sizes=[2, 3, 4], out_dir=models / "sim",
                                             simulate_accept=tau, ignore_eos=True, progress=False))
    spec = [r for r in results["rows"] if r["method"] == "dflash"]
    assert [r["block_size"] for r in spec] == [3, 4]               # B=2 has one draft: tau 2.5 is out of reach
    assert any("B=2 skipped" in n for n in results["meta"]["notes"])
    for row in spec:
        assert not row["lossless"] and row["mode"] == "simulated"
        assert abs(row["tau"] - tau) <= 1.0 / row["acceptance"]["rounds"] + 1e-9
    assert not results["meta"]["lossless"]
    assert "NOT lossless" in (models / "sim" / "results.md").read_text()
    assert (models / "sim" / "prompts_t0_speedup_vs_block.png").is_file()


def test_accept_pattern_mean_and_validation():
    for tau in (1.0, 2.5, 3.0, 4.2, 5.0):
        seq = [a for a, _ in zip(accept_pattern(tau, 4), range(40))]
        assert set(seq) <= {math.floor(tau - 1), math.ceil(tau - 1)}
        assert abs(sum(seq) - 40 * (tau - 1)) < 1
    later = accept_pattern(2.5, 4, start=3)
    assert [next(later) for _ in range(3)] == [a for a, _ in zip(accept_pattern(2.5, 4), range(6))][3:]
    for bad in (0.5, 5.5, float("nan")):
        with pytest.raises(BlockspecError, match="simulated tau"):
            accept_pattern(bad, 4)   # raises at the call, not at the first round


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_round_recorder_sees_every_round_of_generate(kind, temperature):
    target = make_target()
    draft = (make_draft(target, block_size=4) if kind == "dflash" else
             make_draft(target, layout="deepspec", block_size=3, markov_rank=4, confidence=True))
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3)
    recorder = RoundRecorder()
    out = generate(target, [[1, 2, 3, 4]], params, draft=draft, method=kind, policy=PolicyOptions(adapt=False),
                   options=GenerateOptions(observer=recorder))
    loop = out.completions[0]
    ref = generate(target, [[1, 2, 3, 4]], params, draft=draft, method=kind,
                   policy=PolicyOptions(adapt=False)).completions[0]
    assert loop.tokens == ref.tokens
    assert loop.stats.accepted == ref.stats.accepted and loop.stats.verified == ref.stats.verified
    assert [r.accepted for r in recorder.records] == loop.stats.accepted
    assert [r.verified for r in recorder.records] == loop.stats.verified
    assert sum(bool(r.confidences) for r in recorder.records) == (loop.stats.rounds if kind == "dspark" else 0)
    assert out.timing.rounds == loop.stats.rounds


def test_draft_kind():
    assert [draft_kind(m) for m in ("ar", "hf", "dflash", "dspark", "dspark-scheduled", "eagle3")] == \
        [None, None, "dflash", "dspark", "dspark", "eagle3"]


def test_eagle3_side_by_side_with_draft_time_curves(models):
    """`--methods ar,eagle3,dflash,dspark`: one row per method, and t_draft measured at every
    drafted-token count of each draft (EAGLE-3 over the block drafts' range), with its plot."""
    from blockspec.models.checkpoint import load_target, save_eagle3
    from conftest import make_eagle3
    target = load_target(models / "target", dtype="float32")
    save_eagle3(make_eagle3(target), models / "eagle3")
    out = models / "out_eagle3"
    results = run_bench(models / "target", {**drafts_of(models), "eagle3": models / "eagle3"},
                        [str(models / "prompts.jsonl")],
                        options=BenchOptions(methods=["ar", "eagle3", "dflash", "dspark"], temperatures=[0.0],
                                             max_new_tokens=MAX_NEW, limit=LIMIT, out_dir=out, ignore_eos=True,
                                             policies=("fixed",), progress=False))
    rows = {r["method"].split()[0]: r for r in results["rows"]}
    assert set(rows) == {"ar", "eagle3", "dflash", "dspark"}
    assert rows["eagle3"]["drafts"] == 7 and rows["eagle3"]["drafted"] == 1.0   # fixed: every round drafts
    curves = results["draft_time"]
    assert curves["eagle3"]["drafts"] == curves["dflash"]["drafts"] == [1, 2, 3]   # the widest block draft's range
    assert all(t > 0 for c in curves.values() for t in c["t_draft_s"])
    assert (out / "draft_time_vs_drafts.png").is_file() and str(out / "draft_time_vs_drafts.png") in results["plots"]


def test_forced_acceptance_follows_the_pattern():
    target = make_target()
    draft = make_draft(target, block_size=5)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    forced = GenerateOptions(forwards=lambda inner: ForcedAcceptance(inner, accept_pattern(3.5, 4)))
    out = generate(target, [[5, 6, 7]], params, draft=draft, policy=PolicyOptions(adapt=False), options=forced)
    stats = out.completions[0].stats
    assert stats.accepted == [a for a, _ in zip(accept_pattern(3.5, 4), range(stats.rounds))]
    assert len(out.completions[0].tokens) == 20
    # The engine's forwards take the same wrapper (benchmarks/gpu_bench.py); counts never exceed what was verified.
    engine = Engine(target, draft, "dflash", max_running=2, max_model_len=64, policy=PolicyOptions(adapt=False))
    engine.forwards = ForcedAcceptance(engine.forwards, iter([9, 0, 2] * 20))
    ref = [c.stats.accepted for c in engine.generate([[5, 6, 7], [8, 9]], params)]
    assert ref[0][:3] == [4, 0, 2] and ref[1][:3] == [4, 0, 2]


def test_calibration_needs_a_confidence_head():
    target = make_target()
    with pytest.raises(BlockspecError, match="confidence head"):
        collect_calibration(target, make_draft(target), [[1, 2]], [SamplingParams(max_new_tokens=4)])


def test_throughput_vs_concurrency(tmp_path):
    pytest.importorskip("blockspec.engine.engine")
    target = make_target()
    out = throughput_vs_concurrency(target, {"dflash": make_draft(target, block_size=3)}, [[1, 2, 3], [4, 5]],
                                    [1, 2], SamplingParams(max_new_tokens=6, ignore_eos=True),
                                    tmp_path / "tvc.png")
    assert out["concurrency"] == [1, 2] and set(out["tokens_per_s"]) == {"ar", "dflash"}
    assert all(v > 0 for vals in out["tokens_per_s"].values() for v in vals)
    assert (tmp_path / "tvc.png").is_file()


def test_throughput_vs_concurrency_with_scheduled_dspark():
    pytest.importorskip("blockspec.engine.engine")
    target = make_target()
    dspark = make_draft(target, "deepspec", 3, markov_rank=4, confidence=True)
    table = CostTable([1, 64], [1.0, 2.0], draft_rows=[1, 2], draft_times_s=[0.1, 0.2])
    out = throughput_vs_concurrency(target, {"dspark": dspark}, [[1, 2, 3], [4, 5]], [1, 2],
                                    SamplingParams(max_new_tokens=6, ignore_eos=True), scheduled_table=table)
    assert set(out["tokens_per_s"]) == {"ar", "dspark", "dspark-scheduled"}
    assert all(len(v) == 2 and min(v) > 0 for v in out["tokens_per_s"].values())


def test_bad_arguments_fail_before_loading(models):
    common = dict(target_dir=models / "missing", datasets=["x.jsonl"])
    never = models / "never"
    with pytest.raises(BlockspecError, match="unknown bench method"):
        run_bench(drafts={}, **common, options=BenchOptions(methods=["ar", "eagle"], out_dir=never))
    with pytest.raises(BlockspecError, match="needs a dflash draft"):
        run_bench(drafts={"dflash": None}, **common, options=BenchOptions(methods=["dflash"], out_dir=never))
    with pytest.raises(BlockspecError, match="repeats"):
        run_bench(drafts={}, **common, options=BenchOptions(repeats=0, out_dir=never))
    with pytest.raises(BlockspecError, match="temperatures"):
        run_bench(drafts={}, **common, options=BenchOptions(temperatures=[-1.0], out_dir=never))


def test_cli_parser_and_handler(models, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="blockspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    defaults = parser.parse_args(["bench"])
    assert (defaults.datasets, defaults.temperatures, defaults.max_new_tokens, defaults.out, defaults.methods,
            defaults.block_sizes, defaults.simulate_accept) == (
        ["humaneval", "heldout"], [0.0, 1.0], 128, "runs/bench", None, None, None)   # outside the source tree
    full = parser.parse_args(["bench", "--methods", "ar,dflash", "--block-sizes", "8,16", "--temperatures", "0,0.7",
                              "--simulate-accept", "3.5", "--repeats", "3", "--concurrency", "1,4"])
    assert (full.methods, full.block_sizes, full.temperatures, full.simulate_accept, full.repeats,
            full.concurrency) == (["ar", "dflash"], [8, 16], [0.0, 0.7], 3.5, 3, [1, 4])
    assert defaults.every == 1 and parser.parse_args(["bench", "--every", "4"]).every == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--block-sizes", "eight"])
    args = parser.parse_args(["bench", "--target", str(models / "target"), "--datasets",
                              str(models / "prompts.jsonl"), "--methods", "ar", "--temperatures", "0",
                              "--max-new-tokens", "4", "--limit", "1", "--out", str(tmp_path / "cli"),
                              "--no-progress"])
    args.func(args)
    out = capsys.readouterr().out
    assert "| prompts | ar |" in out
    assert out.startswith("row: prompts T=0 ar: tau 1.00")   # streamed as the row finished, before the table
    assert strict_json(tmp_path / "cli" / "results.json")["meta"]["methods"] == ["ar"]


def test_bench_uses_only_the_drafts_it_is_given(tmp_path):
    from blockspec.bench.cli import _draft_dirs

    parser = argparse.ArgumentParser(prog="blockspec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    given = _draft_dirs(parser.parse_args(["bench", "--target", "T", "--dflash-draft", "D"]))
    assert given == {"dflash": Path("D"), "dspark": None, "eagle3": None}   # no embedded draft next to another target
    assert _draft_dirs(parser.parse_args(["bench", "--target", "T"])) == {"dflash": None, "dspark": None,
                                                                          "eagle3": None}
    assert _draft_dirs(parser.parse_args(["bench", "--eagle3-draft", "E"]))["eagle3"] == Path("E")
    embedded_only = _draft_dirs(parser.parse_args(["bench"]))   # every shipped draft, EAGLE-3's included
    assert embedded_only == {k: embedded.ASSETS / k for k in ("dflash", "dspark", "eagle3")}


def test_interrupted_bench_keeps_the_finished_groups(models, tmp_path, monkeypatch):
    from blockspec.bench import run as run_module

    real, calls = run_module._run_group, []

    def interrupted(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(run_module, "_run_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_bench(models / "target", {}, [str(models / "prompts.jsonl")],
                  BenchOptions(methods=["ar"], temperatures=[0.0, 1.0], max_new_tokens=4, limit=1,
                               out_dir=tmp_path / "part", progress=False))
    partial = strict_json(tmp_path / "part" / "results.json")
    assert len(partial["rows"]) == 1 and any("interrupted" in n for n in partial["meta"]["notes"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["bash", "benchmarks/gpu.sh"], [sys.executable, "benchmarks/gpu_bench.py"]])
def test_gpu_bench_fails_fast_without_gpu(command):
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "GPU" in lines[0]
    assert proc.stdout == ""


def test_markdown_report_has_the_throughput_table(bench):
    results, _ = bench
    assert "Engine throughput vs concurrency" not in render_markdown(results)   # not measured: no table
    with_conc = dict(results, concurrency={"concurrency": [1, 4],
                                           "tokens_per_s": {"ar": [100.0, 300.0], "dspark": [150.5, 420.25]}})
    md = render_markdown(with_conc)
    assert "## Engine throughput vs concurrency (output tokens/s)" in md
    assert "| concurrency | ar | dspark |" in md and "| 4 | 300.00 | 420.25 |" in md


def test_adaptive_and_fixed_arms_side_by_side(models):
    """--also-fixed: every speculative method runs as users run it (adaptive) and with fixed
    full windows; the two arms of one draft share one calibration pass (one table row)."""
    out = models / "out_policies"
    results = run_bench(models / "target", drafts_of(models), [str(models / "prompts.jsonl")],
                        options=BenchOptions(methods=["ar", "dflash", "dspark"], temperatures=[0.0],
                                             max_new_tokens=MAX_NEW, limit=LIMIT, repeats=1, out_dir=out,
                                             ignore_eos=True, policies=("adaptive", "fixed")))
    labels = [r["label"] for r in results["rows"]]
    assert labels == ["ar", "dflash B=4 adaptive", "dflash B=4 fixed", "dspark B=3 adaptive", "dspark B=3 fixed"]
    drafted = {r["label"]: r["drafted"] for r in results["rows"]}
    assert drafted["ar"] is None and drafted["dflash B=4 fixed"] == drafted["dspark B=3 fixed"] == 1.0
    # The adaptive arm decides round by round from this machine's costs and what its warm-up
    # call taught the policy (kept in process memory), so its share may be anything, even 0
    # where the tiny random draft never pays; it is measured, not a fixed 1.
    assert 0.0 <= drafted["dflash B=4 adaptive"] <= 1.0
    dspark = [r for r in results["rows"] if r["method"] == "dspark"]
    assert dspark[0]["calibration"] == dspark[1]["calibration"] is not None
    md = (out / "results.md").read_text()
    assert md.split("Confidence-head calibration")[1].count("| dspark |") == 1
    with pytest.raises(BlockspecError, match="policies"):
        run_bench(models / "target", drafts_of(models), [str(models / "prompts.jsonl")],
                  options=BenchOptions(methods=["ar"], limit=1, out_dir=out, policies=("sometimes",)))


def test_ratios_are_paired_within_a_repeat():
    """A slow spell that hits both arms of one repeat cancels out of that repeat's ratio;
    the ratio of the medians mixes repeats of different spells (here 1.2x against 1.0x)."""
    arm, ar = [100.0, 60.0, 120.0], [100.0, 50.0, 100.0]
    assert statistics.median(arm) / statistics.median(ar) == pytest.approx(1.0)
    assert paired_ratio(arm, ar) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        paired_ratio(arm, ar[:2])
