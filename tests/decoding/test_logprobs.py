"""The target's log-probabilities: of emitted tokens (per round, from the forward that
verified them) and of prompt tokens (echo), equal to the target's own full-sequence
forward for AR, DFlash and DSpark, greedy and sampled; penalties do not change them
(raw, as vLLM's default); chunked prefill and streamed deltas carry the same values."""

from __future__ import annotations

import pytest
import torch

from blockspec import EngineOptions, PolicyOptions
from blockspec.config import SamplingParams
from blockspec.engine.engine import Engine
from blockspec.decoding.generate import generate
from conftest import make_draft
from test_generate import OracleForwards

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 3, 3]]
TOP = 3


def drafts(target):
    return {"ar": None, "dflash": make_draft(target, "zlab", 4, seed=1),
            "dspark": make_draft(target, "deepspec", 3, seed=1, markov_rank=4, markov_type="gated", confidence=True)}


def reference(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log P(x_i | x_<i) for every position of prompt + tokens: [len - 1], from one plain forward."""
    seq = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logp = torch.log_softmax(target(seq).logits[0, :-1].double(), -1)
    return logp, seq[0, 1:]


def check_against_reference(target, prompt, completion, top=TOP):
    logp, nxt = reference(target, prompt, completion.tokens)
    emitted = logp[len(prompt) - 1:]
    assert len(completion.logprobs) == len(completion.tokens) > 0
    for j, lp in enumerate(completion.logprobs):
        assert lp.token == completion.tokens[j]
        assert lp.logprob == pytest.approx(float(emitted[j, lp.token]), abs=1e-9)
        assert lp.rank == 1 + int((emitted[j] > emitted[j, lp.token]).sum())
        values, ids = emitted[j].topk(top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-9)
    if completion.prompt_logprobs is not None:
        assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == len(prompt)
        for i, lp in enumerate(completion.prompt_logprobs[1:]):
            assert lp.token == prompt[i + 1]
            assert lp.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=1e-9)


@pytest.mark.parametrize("method", ["ar", "dflash", "dspark"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_logprobs_equal_the_targets_own(target64, method, temperature, monkeypatch):
    draft = drafts(target64)[method]
    # Drafts of the target's own greedy continuation (some corrupted): long accepted runs.
    greedy = generate(target64, PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True)).completions
    engine = Engine(target64, draft, method, max_running=4, max_model_len=64, policy=PolicyOptions(adapt=False))
    engine.forwards = OracleForwards(engine.forwards, [p + c.tokens for p, c in zip(PROMPTS, greedy)], 3)
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=16, ignore_eos=True, logprobs=TOP,
                             prompt_logprobs=TOP if i % 2 == 0 else None,
                             repetition_penalty=1.4 if i == 3 else 1.0)   # raw: penalties do not show
              for i in range(len(PROMPTS))]
    out = engine.generate(PROMPTS, params)
    for prompt, p, completion in zip(PROMPTS, params, out):
        assert (completion.prompt_logprobs is None) == (p.prompt_logprobs is None)
        check_against_reference(target64, prompt, completion)
    if method != "ar":   # drafts were accepted: their logprobs came from the verifying forward
        assert sum(sum(c.stats.accepted) for c in out) > 0


def test_generate_carries_logprobs(target64):
    draft = drafts(target64)["dflash"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = generate(target64, PROMPTS, params, draft=draft).completions
    for prompt, completion in zip(PROMPTS, out):
        check_against_reference(target64, prompt, completion, top=0)
        assert all(lp.top == () for lp in completion.logprobs)


def test_chunked_prefill_first_token_and_streamed_deltas(target64):
    """A long prompt prefilled in chunks gets its first token's logprob; the deltas' logprobs
    are the completion's, in order."""
    engine = Engine(target64, drafts(target64)["dflash"], "dflash", max_running=3, max_model_len=64,
                    options=EngineOptions(prefill_chunk_tokens=4))
    prompt = list(range(1, 20))
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=1))
    short = engine.submit([5, 6], SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=1))
    engine.run_until_done()
    for h, p in ((handle, prompt), (short, [5, 6])):
        deltas = list(h)
        streamed = [lp for d in deltas for lp in d.logprobs or []]
        completion = h.result()
        assert [lp.token for lp in streamed] == completion.tokens
        assert streamed == completion.logprobs
        check_against_reference(target64, p, completion, top=1)


def test_prompt_logprobs_with_one_token_to_generate(target64):
    """lm-evaluation-harness's log-likelihood request: echo the prompt's logprobs, generate one token."""
    engine = Engine(target64, drafts(target64)["dspark"], "dspark", max_running=2, max_model_len=64)
    params = SamplingParams(max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, params)):
        assert len(completion.tokens) <= 1
        logp, _ = reference(target64, prompt, [])
        for i, lp in enumerate(completion.prompt_logprobs[1:]):
            assert lp.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=1e-9)
            assert lp.top[0][0] == int(logp[i].argmax())
