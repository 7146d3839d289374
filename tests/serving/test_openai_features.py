"""What real clients send, answered as vLLM answers it, on the real server (AR and DFlash):
lm-evaluation-harness's request shapes (log-likelihood: token-id prompts in a batch, echo,
logprobs=1, max_tokens=1; generation: lists of text prompts with stop strings), logprobs
equal to the target's own, max_tokens=0, n, chat logprobs, penalties, chat template
options, and vLLM's /tokenize, /detokenize, /version, /v1/models/{id}, /tokenizer_info."""

from __future__ import annotations

import json
from operator import itemgetter

import httpx
import openai
import pytest
import torch

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.models.checkpoint import load_target
from blockspec.models.tokenizer import Tokenizer
from blockspec.serving.server import build_engine
from blockspec.serving.api import ServerLimits, create_app
from serving_harness import KEY, MODEL, ServerThread, dflash_engine, serve_args, write_models

AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w50 {% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}w51{% endif %}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target_dir, draft_dir = write_models(tmp_path_factory.mktemp("models"))
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    (target_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return target_dir, draft_dir


@pytest.fixture(scope="module", params=["ar", "dflash"])
def server(request, dirs):
    if request.param == "ar":
        engine, tokenizer, _ = build_engine(serve_args("--target", str(dirs[0]), "--dtype", "float64",
                                                       "--served-model-name", MODEL, "--max-model-len", "128"))
    else:
        engine, tokenizer, _ = dflash_engine(*dirs)
    with ServerThread(create_app(engine, tokenizer, MODEL, api_key=KEY, limits=ServerLimits(max_tokens=64))) as url:
        yield url


@pytest.fixture(scope="module")
def target(dirs):
    return load_target(dirs[0], dtype="float64"), Tokenizer(dirs[0])


def post(url: str, path: str, **body):
    response = httpx.post(f"{url}{path}", headers=AUTH, json={"model": MODEL, **body}, timeout=60)
    return response.status_code, response.json()


def own_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))[:, 0]


def test_lm_eval_loglikelihood_batch(server, target):
    """local-completions' log-likelihood payload; lm-eval's own parse (sum of token_logprobs[ctxlen:-1])."""
    model, tok = target
    contexts = [tok.encode("w1 w2 w3"), tok.encode("w7 w8")]
    continuations = [tok.encode("w4 w5"), tok.encode("w9")]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    status, out = post(server, "/v1/completions", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                       seed=1234, echo=True)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    for choice, prompt, ctx in zip(sorted(out["choices"], key=itemgetter("index")), prompts, contexts):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(prompt) + 1 == len(lp["tokens"]) == len(lp["text_offset"])
        assert choice["text"].startswith("w1 w2 w3 w4 w5" if ctx == contexts[0] else "w7 w8 w9")
        want = own_logprobs(model, prompt)
        assert lp["token_logprobs"][1:len(prompt)] == pytest.approx(want.tolist(), abs=1e-9)
        loglik = sum(lp["token_logprobs"][len(ctx):-1])
        assert loglik == pytest.approx(float(want[len(ctx) - 1:].sum()), abs=1e-9)
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):   # lm-eval's is_greedy
            assert value <= max(top.values()) + 1e-12 and 1 <= len(top) <= 2
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] <= 2


def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, target):
    model, tok = target
    prompt = tok.encode("w3 w1 w4 w1")
    status, out = post(server, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert status == 200
    choice = out["choices"][0]
    assert choice["text"] == "w3 w1 w4 w1" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["w3", "w1", "w4", "w1"]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(own_logprobs(model, prompt).tolist(), abs=1e-9)
    assert out["usage"]["completion_tokens"] == 0
    status, out = post(server, "/v1/completions", prompt="w3", max_tokens=0)
    assert status == 200 and out["choices"][0]["text"] == ""


def test_lm_eval_generate_until_batch(server, target):
    """Lists of text prompts with stop strings: each choice equals its own single request."""
    single = [post(server, "/v1/completions", prompt=p, max_tokens=12, temperature=0, stop=["w9"])[1]
              for p in ("w1 w2", "w5 w6 w7")]
    status, out = post(server, "/v1/completions", prompt=["w1 w2", "w5 w6 w7"], max_tokens=12, temperature=0,
                       stop=["w9"], seed=1234)
    assert status == 200
    assert [c["text"] for c in out["choices"]] == [s["choices"][0]["text"] for s in single]
    assert out["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in single)


def test_logprobs_of_sampled_tokens_and_streams(server, target):
    model, tok = target
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=10, temperature=0.9, seed=3,
                                    logprobs=3, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) > 1
    prompt = tok.encode("w1 w2")
    for c in out.choices:
        ids = tok.encode(c.text)
        assert c.logprobs.tokens == [tok.token_text(t) for t in ids]
        assert c.logprobs.token_logprobs == pytest.approx(own_logprobs(model, prompt + ids)[1:].tolist(), abs=1e-9)
        assert all(len(top) >= 3 for top in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=10, temperature=0.9, seed=3,
                                            logprobs=3, n=3, stream=True, stream_options={"include_usage": True}))
    total = 0
    for index in range(3):   # interleaved choices (seeded, but speculation's draws depend on its drafting)
        mine = [k.choices[0] for k in chunks if k.choices and k.choices[0].index == index]
        ids = tok.encode("".join(m.text for m in mine))
        streamed = sum((m.logprobs.token_logprobs for m in mine if m.logprobs), [])
        assert streamed == pytest.approx(own_logprobs(model, prompt + ids)[1:].tolist(), abs=1e-9)
        assert mine[-1].finish_reason in ("stop", "length")   # sampled: EOS may come first
        total += len(ids)
    assert chunks[-1].usage.completion_tokens == total


def test_chat_logprobs_n_and_penalties(server, target):
    model, tok = target
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2, n=2)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].message.content == out.choices[1].message.content
    content = out.choices[0].logprobs.content
    assert " ".join(e.token for e in content) == out.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-12 for e in content)
    assert content[0].bytes == list(content[0].token.encode())
    # penalties reach the target's distribution: the server equals generate() under the same ones
    prompt = tok.encode("w1 w2 w3 w50 ", add_special_tokens=False)
    penalties = dict(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={5: 3.0})
    want = generate(model, [prompt], SamplingParams(max_new_tokens=10, **penalties)).completions[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         frequency_penalty=0.4, presence_penalty=0.5, logit_bias={"5": 3.0},
                                         extra_body={"repetition_penalty": 1.8})
    assert got.choices[0].message.content == tok.decode(want.tokens)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].message.content != got.choices[0].message.content


def test_chat_template_options(server):
    def rendered(**fields):
        status, out = post(server, "/tokenize", messages=[{"role": "user", "content": "w1"},
                                                          {"role": "assistant", "content": "w2 w3"}], **fields)
        assert status == 200, out
        return " ".join(out["token_strs"])
    assert rendered(return_token_strs=True) == "w1 w2 w3 w50"
    assert rendered(return_token_strs=True, add_generation_prompt=False) == "w1 w2 w3"
    assert rendered(return_token_strs=True, chat_template_kwargs={"enable_thinking": False}) == "w1 w2 w3 w50 w51"
    assert rendered(return_token_strs=True, continue_final_message=True, add_generation_prompt=False) == "w1 w2 w3"
    status, out = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                       chat_template_kwargs={"enable_thinking": False})
    assert status == 200 and out["usage"]["prompt_tokens"] == 3
    for bad, param in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                       ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"n": 0}, "n"),
                       ({"response_format": {"type": "json_schema"}}, "response_format")):
        status, out = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "w1"}], **bad)
        assert status == 400 and out["error"]["param"] == param, (bad, out)


def test_operational_endpoints(server):
    status, out = post(server, "/tokenize", prompt="w1 w2 w9")
    assert status == 200 and out == {"count": 3, "max_model_len": 128, "tokens": [1, 2, 9], "token_strs": None}
    assert post(server, "/detokenize", tokens=[1, 2, 9]) == (200, {"prompt": "w1 w2 w9"})
    status, out = post(server, "/detokenize", tokens=[1, 10**6])
    assert status == 400 and out["error"]["param"] == "tokens"
    assert post(server, "/tokenize", prompt="w1", model="other")[0] == 404
    with httpx.Client(base_url=server, headers=AUTH) as http:
        assert http.get("/version").json()["version"]
        card = http.get(f"/v1/models/{MODEL}").json()
        assert card["id"] == MODEL and card["max_model_len"] == 128 and card["object"] == "model"
        assert http.get("/v1/models/other").status_code == 404
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
        assert info["model_max_length"] == 128
        assert httpx.get(f"{server}/tokenizer_info").status_code == 401   # behind the key as the rest


def test_generation_config_defaults_and_one_validation():
    """The server's request defaults are the checkpoint's generation_config.json (as the CLI's); the
    request's own values win; SamplingParams alone validates (its message names the request's field)."""
    from blockspec.config import GenerationDefaults
    from blockspec.serving.protocol import ApiError, CompletionRequest, parse_request, sampling_params

    def params(body: dict, defaults=GenerationDefaults()):
        req = parse_request(CompletionRequest, json.dumps({"prompt": "w1", **body}).encode())
        return sampling_params(req, 4, 64, "max_tokens", defaults, names={"prompt_logprobs": "logprobs"})
    checkpoint = GenerationDefaults(temperature=0.3, top_k=5, top_p=0.9, repetition_penalty=1.1)
    p = params({}, checkpoint)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.3, 5, 0.9, 1.1)
    assert params({"temperature": 0, "top_k": -1}, checkpoint).temperature == 0.0
    assert params({"top_k": -1}, checkpoint).top_k == 0
    assert params({}).temperature == 1.0   # no generation_config.json: OpenAI's default
    assert params({"seed": -5}).seed == -5 and params({"top_k": 1000}).top_k == 0   # k >= vocab: off
    for body, field in (({"seed": 2**63}, "seed"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
                        ({"repetition_penalty": 0}, "repetition_penalty")):
        with pytest.raises(ApiError) as err:
            params(body)
        assert err.value.param == field and err.value.status == 400
