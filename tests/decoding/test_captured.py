"""Captured rounds (decoding/captured.py, models/static_steps.py): the static-shape steps
give the eager forwards' results, and captured rounds the eager rounds' tokens (greedy,
every method, ragged rows, rejected drafts rolled back, rows padded to several buckets).
The static steps run eagerly here (compile=False); one slow test compiles them."""

from __future__ import annotations

import itertools
import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.decoding.captured import (CapturedSteps, captured_steps, release_captured, row_bucket,
                                         width_bucket)
from blockspec.decoding.generate import generate
from blockspec.bench.arms import ForcedAcceptance
from blockspec.decoding.policy import RoundPolicy as FixedWindow   # no table, no gate: full windows
from blockspec.decoding.prefill import ContextSink, prefill
from blockspec.decoding.round import DENSE, Proposal, RoundInputs, speculative_round
from blockspec.decoding.sampling import RowSampler
from blockspec.errors import BlockspecError
from blockspec import GenerateOptions, PolicyOptions
from conftest import make_draft, make_target

PROMPTS = {1: [[5, 9, 2, 7]], 3: [[3, 4, 5], [7, 1, 2, 9, 4, 8, 11, 6], [12, 30]],
           5: [[3, 4, 5], [7, 1, 2, 9, 4, 8], [12, 30, 2, 2], [8], [21, 22, 23, 24, 25, 26, 27]]}


class DirectContext:
    """The eager reference's draft context: every round's features appended at once."""

    def __init__(self, draft, cache) -> None:
        self.draft, self.cache = draft, cache

    def flush(self, rows: int) -> None:
        pass

    def add(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        self.draft.append_context(self.cache, features, counts)


def models(method: str, dtype: torch.dtype = torch.float64):
    target = make_target(dtype=dtype)
    if method == "ar":
        return target, None
    if method == "dflash":
        return target, make_draft(target, block_size=4)
    return target, make_draft(target, layout="deepspec", block_size=4, markov_rank=8, confidence=True)


def test_row_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 9, 17, 32, 33, 65)] == [1, 2, 4, 4, 8, 16, 32, 32, 64, 96]


def test_width_buckets():
    """Verify widths (anchor + drafts) run at 1, a power of two, or the whole window."""
    assert [width_bucket(w, 17) for w in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 17]
    assert [width_bucket(w, 5) for w in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]


@pytest.mark.parametrize("rows", [1, 3])
def test_static_steps_equal_the_eager_forwards(rows):
    """Target verify (with features), draft block and draft context over the full
    capacity under a length mask equal the eager cached forwards, ragged rows included."""
    target, draft = models("dflash")
    prompts = PROMPTS[rows]
    steps = CapturedSteps(target, draft, compile=False)
    cache, dcache = steps.new_caches(rows, 64, 72)
    ref, dref = target.new_cache(rows, 64), draft.new_cache(rows, 72)
    sampler = RowSampler.from_params([SamplingParams()] * rows)
    capture = tuple(draft.config.target_layer_ids)
    with torch.inference_mode():
        anchors = prefill(target, cache, prompts, sampler, ContextSink(draft, dcache)).anchors
        assert torch.equal(anchors, prefill(target, ref, prompts, sampler, ContextSink(draft, dref)).anchors)
        block = torch.full((rows, 4), draft.config.mask_token_id)
        block[:, 0] = anchors
        torch.testing.assert_close(steps.block_hidden(draft, block, dcache, target.embed_tokens),
                                   draft.block_hidden(block, dref, target.embed_tokens))
        tokens = torch.cat([anchors.unsqueeze(1), torch.randint(0, 60, (rows, 3))], dim=1)
        logits, features = steps.target_forward(cache, tokens, capture)
        out = target(tokens, ref, capture=capture)
        torch.testing.assert_close(logits, out.logits)
        torch.testing.assert_close(features, out.features)
        keep = torch.tensor([1, 3, 2][:rows])
        cache.lengths.add_(keep)          # the static step leaves lengths to the caller
        ref.truncate(ref.lengths - 4 + keep)
        steps.append_context(features, keep)
        draft.append_context(dref, out.features, keep)
    assert torch.equal(cache.lengths, ref.lengths) and torch.equal(dcache.lengths, dref.lengths)
    for mine, theirs in ((cache, ref), (dcache, dref)):
        for r, n in enumerate(theirs.lengths.tolist()):
            torch.testing.assert_close(mine.k[:, r, :, :n], theirs.k[:, r, :, :n])
            torch.testing.assert_close(mine.v[:, r, :, :n], theirs.v[:, r, :, :n])


@pytest.mark.parametrize("kind", [dict(model_type="llama"), dict(model_type="qwen2"),
                                  dict(model_type="mistral", sliding_window=6)])
def test_target_step_equals_forward_across_families(kind):
    """No q/k norm (Llama), q/k/v biases (Qwen2), a sliding window narrower than the rows
    (Mistral): the static target step over [anchor + 3] equals the eager forward."""
    target = make_target(dtype=torch.float64, **kind)
    steps = CapturedSteps(target, None, compile=False)
    cache, _ = steps.new_caches(3, 32)
    ref = target.new_cache(3, 32)
    sampler = RowSampler.from_params([SamplingParams()] * 3)
    with torch.inference_mode():
        for c in (cache, ref):
            prefill(target, c, PROMPTS[3], sampler)
        tokens = torch.randint(0, 60, (3, 4))
        logits, _ = steps.target_forward(cache, tokens)
        torch.testing.assert_close(logits, target(tokens, ref).logits)


class PrefixPolicy:
    """Rounds that exercise the captured path's ragged cases: the first k < R rows draft
    (k cycles), a shorter block every third round, rows verifying fewer drafts, an AR round."""

    def __init__(self, window: int) -> None:
        self.window, self.n = window, 0

    def decide(self, bands) -> tuple[int, int]:
        rows = len(bands) if not isinstance(bands, int) else bands
        self.n += 1
        if self.n % 4 == 0:
            return 0, 0
        k = max(1, rows - self.n % 3)
        return k, self.window if self.n % 3 else max(1, self.window - 1)

    def stop_below(self, rows: int) -> float:
        return 0.0

    def confidence_map(self):
        return None

    def verify_lengths(self, proposal: Proposal | None, rows: int, block: int) -> torch.Tensor | None:
        if proposal is None:
            return None
        k, g = proposal.tokens.shape
        lens = torch.zeros(rows, dtype=torch.long)
        lens[:k] = torch.tensor([g - (i % 2) for i in range(k)]).clamp(min=1)
        return lens

    def observe(self, outcome, proposal, lens) -> None:
        pass

    def observe_time(self, rows, outcome, seconds) -> None:
        pass


def run_rounds(target, draft, prompts, policy_factory, captured: CapturedSteps | None, rounds: int,
               forced: list[int] | None = None) -> list[list[int]]:
    """Each row's tokens after `rounds` rounds (no row leaves), eager or captured."""
    rows, g = len(prompts), draft.config.num_drafts if draft is not None else 0
    width = draft.config.block_size + 1 if draft is not None else 1
    capacity = max(map(len, prompts)) + rounds * width + width + 1
    if captured is not None:
        cache, dcache = captured.new_caches(rows, capacity, capacity + width)
    else:
        cache = target.new_cache(rows, capacity)
        dcache = draft.new_cache(rows, capacity + width) if draft is not None else None
    sampler = RowSampler.from_params([SamplingParams()] * rows)
    policy = policy_factory(g)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        anchors = prefill(target, cache, prompts, sampler, ContextSink(draft, dcache)).anchors
        context = None
        if draft is not None:
            context = captured.context() if captured is not None else DirectContext(draft, dcache)
        forwards = captured.forwards() if captured is not None else DENSE
        if forced is not None:
            forwards = ForcedAcceptance(forwards, itertools.cycle(forced))
        batch = RoundInputs(target, draft, cache, dcache, context, anchors, sampler, forwards=forwards)
        for i in range(rounds):
            outcome = speculative_round(batch, policy)
            for r in range(rows):
                out[r] += outcome.new_tokens(r)
    return out


@pytest.mark.parametrize("method,rows,policy", [
    ("ar", 1, FixedWindow), ("ar", 5, FixedWindow),
    ("dflash", 1, FixedWindow), ("dflash", 3, FixedWindow), ("dflash", 5, PrefixPolicy),
    ("dspark", 3, FixedWindow), ("dspark", 5, PrefixPolicy)])
def test_captured_rounds_equal_eager_rounds(method, rows, policy):
    """Greedy: the same tokens round after round (random drafts: mostly rejected, rolled back),
    rows padded to their bucket (1, 4, 8), drafting prefixes, shorter blocks and AR rounds."""
    target, draft = models(method)
    eager = run_rounds(target, draft, PROMPTS[rows], policy, None, 6)
    steps = CapturedSteps(target, draft, compile=False)
    captured = run_rounds(target, draft, PROMPTS[rows], policy, steps, 6)
    assert captured == eager
    # Shorter verifies ran at their width bucket: 1 (AR), powers of two, or the whole window g + 1.
    g = draft.config.num_drafts if draft is not None else 0
    widths = {width for name, _, width in steps._steps if name != "draft_block"}
    assert widths <= {1, 2, 4, g + 1}
    if method == "dspark" and policy is PrefixPolicy:   # 3 drafts + anchor of a window of 5: bucket 4
        assert 4 in widths


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_captured_rounds_commit_long_accepted_runs(method):
    """Forced acceptance (whole runs committed, then a full rejection): caches and draft
    context advance and roll back as in the eager round."""
    target, draft = models(method)
    forced = [3, 0, 2, 3, 1]
    eager = run_rounds(target, draft, PROMPTS[3], FixedWindow, None, 5, forced)
    steps = CapturedSteps(target, draft, compile=False)
    captured = run_rounds(target, draft, PROMPTS[3], FixedWindow, steps, 5, forced)
    assert captured == eager and all(len(t) == 9 + 5 for t in captured)
    # What a CUDA graph would hold alive: both models' RoPE tables and fused q/k norm weights.
    held = steps._lazy_tensors()
    assert any(t is target.rotary.table(1, target.dtype)[0] for t in held)
    assert any(t is draft.layers[0].self_attn._qk_weight for t in held)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_generate_compile_equals_eager_as_rows_finish(method):
    """generate(compile=True) on the captured runner: rows finish at different lengths (the
    buffers are compacted in place, bucket 8 -> 4 -> 2 ...) and every row's tokens equal
    the eager generation's; a second call reuses the runner and its buffers."""
    target, draft = models(method)
    prompts = PROMPTS[5]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 17, 9, 3, 12)]
    eager = generate(target, prompts, params, draft=draft, method=method, policy=PolicyOptions(adapt=False))
    runner = captured_steps(target, draft, compile=False)
    first = generate(target, prompts, params, draft=draft, method=method, policy=PolicyOptions(adapt=False),
                     options=GenerateOptions(compile=True))
    buffers = runner.cache.k
    again = generate(target, prompts[1:3], params[1:3], draft=draft, method=method, policy=PolicyOptions(adapt=False),
                     options=GenerateOptions(compile=True))
    assert captured_steps(target, draft) is runner and runner.cache.k is buffers
    want = [c.tokens for c in eager.completions]
    assert [c.tokens for c in first.completions] == want
    assert [c.tokens for c in again.completions] == want[1:3]
    release_captured(target)
    assert "_captured_steps" not in target.__dict__


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_seeded_sampling_captured_equals_eager(method):
    """Sampled rows (temperature, top-p, own seeds; greedy rows mixed in) draw the same
    tokens: the captured steps change the forwards only, never the random stream."""
    target, draft = models(method)
    prompts = PROMPTS[3]
    params = [SamplingParams(temperature=1.0, seed=7, max_new_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=8, ignore_eos=True)]
    eager = generate(target, prompts, params, draft=draft, method=method, policy=PolicyOptions(adapt=False))
    captured_steps(target, draft, compile=False)
    captured = generate(target, prompts, params, draft=draft, method=method, policy=PolicyOptions(adapt=False),
                        options=GenerateOptions(compile=True))
    assert [c.tokens for c in captured.completions] == [c.tokens for c in eager.completions]
    release_captured(target)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("method", ["ar", "dflash", "dspark"])
def test_a_greedy_captured_round_reads_the_host_once(monkeypatch, method):
    """What would synchronise with a GPU (a tensor value read on the host) happens once per
    captured round: the outcome's one transfer."""
    target, draft = models(method)
    steps = CapturedSteps(target, draft, compile=False)
    prompts = PROMPTS[3]
    width = draft.config.block_size + 1 if draft is not None else 1
    cache, dcache = steps.new_caches(3, 64, 64 + width)
    sampler = RowSampler.from_params([SamplingParams()] * 3)
    with torch.inference_mode():
        anchors = prefill(target, cache, prompts, sampler, ContextSink(draft, dcache)).anchors
        batch = RoundInputs(target, draft, cache, dcache, steps.context() if draft is not None else None, anchors,
                            sampler, forwards=steps.forwards())
        batch.bands = [0, 0, 0]   # as generate and the engine pass them
        policy = FixedWindow(draft.config.num_drafts if draft is not None else 0)
        speculative_round(batch, policy)          # the first round builds the steps
        reads: list[str] = []

        def counted(name: str):
            real = getattr(torch.Tensor, name)

            def read(self, *args, **kwargs):
                reads.append(name)
                return real(self, *args, **kwargs)
            return read

        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, counted(name))
        speculative_round(batch, policy)
        monkeypatch.undo()
    assert reads == ["tolist"]


def test_modes():
    """compile=False is eager whatever the mode; CUDA graphs need CUDA; the CPU compiles with inductor."""
    target, draft = models("dflash")
    assert CapturedSteps(target, draft, compile=False, mode="graphs").mode == "eager"
    assert CapturedSteps(target, draft).mode == "compile" and not CapturedSteps(target, draft).cuda_graphs
    with pytest.raises(BlockspecError, match="CUDA only"):
        CapturedSteps(target, draft, mode="graphs")
    with pytest.raises(BlockspecError, match="captured mode"):
        CapturedSteps(target, draft, mode="fast")


def test_foreign_cache_is_refused():
    target, draft = models("dflash")
    steps = CapturedSteps(target, draft, compile=False)
    steps.new_caches(2, 32, 40)
    with pytest.raises(BlockspecError, match="own caches"):
        steps.target_forward(target.new_cache(2, 32), torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.slow
def test_compiled_captured_rounds_equal_eager():
    """torch.compile (inductor on the CPU) of the static steps: same greedy tokens."""
    target, draft = models("dflash", torch.float32)
    prompts = PROMPTS[3]
    eager = run_rounds(target, draft, prompts, FixedWindow, None, 4)
    steps = CapturedSteps(target, draft, compile=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert run_rounds(target, draft, prompts, FixedWindow, steps, 4) == eager
    # fullgraph: each of the three steps compiled as one graph (a break would have raised)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 3
    assert {key[0] for key in steps._steps} == {f"target{tuple(draft.config.target_layer_ids)}", "draft_block",
                                                "draft_context"}
