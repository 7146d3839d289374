"""blockspec.loading: the library's model loading (embedded models by default)."""

from __future__ import annotations

import pytest

from blockspec import EagleTree, embedded
from blockspec.errors import BlockspecError
from blockspec.loading import load_drafts, load_models


def test_load_models_ar_has_no_draft():
    models = load_models()
    assert models.draft is None and models.method == "ar"
    assert models.tokenizer.encode("def f():")
    assert models.target.config.vocab_size >= len(models.tokenizer.encode("def f():"))


def test_load_models_shorter_block_is_a_new_draft():
    full = load_models(method="dspark").draft
    short = load_models(method="dspark", block_size=2).draft
    assert short.config.block_size == 2 and full.config.block_size > 2


def test_load_models_tree_is_an_eagle3_draft_drafting_it():
    tree = EagleTree(4, 5, 12)
    draft = load_models(method="eagle3", tree=tree).draft
    assert draft.config.tree == tree and draft.config.num_drafts == 11
    with pytest.raises(BlockspecError, match="EAGLE-3's"):
        load_models(method="dflash", tree=tree)


def test_load_models_missing_target(tmp_path):
    with pytest.raises(BlockspecError):
        load_models(tmp_path / "missing")


def test_load_drafts_loads_the_kinds_asked_for():
    target = load_models().target
    assert load_drafts(target, {}, []) == {}
    with pytest.raises(BlockspecError, match="unknown draft kind"):
        load_drafts(target, {}, ["dspark-scheduled"])
    loaded = load_drafts(target, {"dspark": None}, ["dspark"])
    assert list(loaded) == ["dspark"] and loaded["dspark"].config.is_dspark
    assert set(load_drafts(target, {}, ["dflash", "dspark"])) == {"dflash", "dspark"}


def test_load_drafts_refuses_a_dflash_draft_for_dspark():
    target = load_models().target
    with pytest.raises(BlockspecError, match="neither a Markov nor a confidence head"):
        load_drafts(target, {"dspark": embedded.default_draft("dflash")}, ["dspark"])


# -- device, dtype and generation_config.json (issue 17) --------------------------------------

import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from blockspec.config import GenerationDefaults, SamplingParams  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.decoding.generate import generate  # noqa: E402
from blockspec.models.checkpoint import load_target, resolve_dtype  # noqa: E402


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory):
    """A tiny Qwen3 written by transformers in bfloat16, with a generation_config.json
    (Qwen-style: two eos ids, sampling defaults) and the embedded tokenizer."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=0,
                                   bos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=[0, 7], temperature=0.6, top_p=0.95, top_k=20, do_sample=True,
                                  repetition_penalty=1.05).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded.default_target() / name, path / name)
    return path


def test_dtype_auto_loads_the_checkpoint_dtype(hf_bf16):
    models = load_models(hf_bf16, dtype="auto")
    assert models.target.dtype == torch.bfloat16
    state = models.target.state_dict()
    for name, tensor in load_file(str(hf_bf16 / "model.safetensors")).items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(state[name.removeprefix("model.")], tensor), name
    assert load_models(hf_bf16).target.dtype == torch.float32            # CPU default: float32
    assert load_models(hf_bf16, dtype="float16").target.dtype == torch.float16


def test_dtype_rules():
    def stored():
        return torch.bfloat16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu, stored) == torch.float32
    assert resolve_dtype(None, cuda, stored) == torch.bfloat16
    assert resolve_dtype("auto", cpu, stored) == torch.bfloat16
    assert resolve_dtype("float16", cuda, stored) == torch.float16
    with pytest.raises(BlockspecError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", cpu, stored)


def test_unknown_or_missing_device_refused(hf_bf16):
    with pytest.raises(BlockspecError, match="unknown device"):
        load_target(hf_bf16, device="tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(BlockspecError, match="CUDA is not available"):
            load_target(hf_bf16, device="cuda")


def test_generation_config_eos_ids_stop_and_sampling_defaults(hf_bf16):
    models = load_models(hf_bf16, dtype="auto")
    assert models.target.config.eos_token_id == [0, 7]
    gen = models.generation_defaults
    assert (gen.temperature, gen.top_p, gen.top_k) == (0.6, 0.95, 20)
    assert gen.unsupported == () and gen.repetition_penalty == 1.05   # a default now, as in vLLM
    params = gen.sampling_params(max_new_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.6, 0.95, 20, 5)
    assert gen.sampling_params(temperature=0.0, top_k=None).temperature == 0.0   # the request wins
    assert GenerationDefaults().sampling_params() == SamplingParams()           # no file: built-in defaults
    # The second eos id stops generation.
    prompt = models.tokenizer.encode("def f():")
    free = generate(models.target, [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True)).completions[0]
    stop_at = free.tokens[3]
    cfg = json.loads((hf_bf16 / "generation_config.json").read_text())
    path = hf_bf16.parent / "qwen3-eos"
    shutil.copytree(hf_bf16, path, dirs_exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [0, stop_at]}))
    again = load_models(path, dtype="auto")
    out = generate(again.target, [prompt], SamplingParams(max_new_tokens=12)).completions[0]
    # The stop token ends the request and is not part of the output (as vLLM).
    assert out.tokens == free.tokens[:free.tokens.index(stop_at)] and out.finish_reason == "stop"


@pytest.mark.parametrize("gen, message", [
    ({"eos_token_id": [0, 9000]}, r"eos_token_id \[9000\]"),
    ({"temperature": -1.0}, "generation_config.json: temperature"),
    ({"top_p": 2.0}, "generation_config.json: top_p"),
    ({"eos_token_id": "x"}, "eos_token_id must be"),
])
def test_bad_generation_config_refused(hf_bf16, tmp_path, gen, message):
    path = tmp_path / "m"
    shutil.copytree(hf_bf16, path)
    (path / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(BlockspecError, match=message):
        load_models(path)


def test_cli_generate_uses_generation_defaults_unless_flags_say(hf_bf16, monkeypatch):
    import blockspec.cli as cli
    seen = []

    def fake_generate(target, prompts, params, **kw):
        seen.append((target.dtype, params))
        raise BlockspecError("stop here")
    monkeypatch.setattr(cli, "generate", fake_generate)
    assert cli.main(["generate", "hi", "--target", str(hf_bf16), "--device", "cpu", "--dtype", "auto"]) == 2
    assert cli.main(["generate", "hi", "--target", str(hf_bf16), "--device", "cpu", "--temperature", "0",
                     "--top-k", "5", "--max-new-tokens", "3"]) == 2
    (dtype1, p1), (dtype2, p2) = seen
    assert dtype1 == torch.bfloat16 and (p1.temperature, p1.top_p, p1.top_k, p1.max_new_tokens) == (0.6, 0.95, 20, 128)
    assert dtype2 == torch.float32 and (p2.temperature, p2.top_p, p2.top_k, p2.max_new_tokens) == (0.0, 0.95, 5, 3)


def test_stop_token_ids_out_of_vocabulary_refused():
    models = load_models()
    vocab = models.target.config.vocab_size
    prompt = models.tokenizer.encode("def f():")
    bad = SamplingParams(max_new_tokens=4, stop_token_ids=[5, vocab])
    with pytest.raises(BlockspecError, match=rf"stop_token_ids \[{vocab}\] are outside the vocabulary"):
        generate(models.target, [prompt], bad)
    engine = Engine(models.target, method="ar", max_running=1, max_model_len=64)
    try:
        with pytest.raises(BlockspecError, match="outside the vocabulary"):
            engine.submit(prompt, bad)
        assert engine.generate([prompt], SamplingParams(max_new_tokens=2, stop_token_ids=[vocab - 1]))
    finally:
        engine.shutdown(drain=False)
    for ids in ([-1], [True], ["3"], [1.5]):
        with pytest.raises(BlockspecError, match="stop_token_ids must be a list of token ids"):
            SamplingParams(stop_token_ids=ids)


def test_load_models_cli_flags_reach_the_loader():
    import argparse

    from blockspec.options import add_model_flags, load_options
    p = argparse.ArgumentParser()
    add_model_flags(p)
    args = p.parse_args(["--dtype", "auto", "--device", "cpu", "--allow-nonfinite-weights"])
    assert load_options(args) == {"dtype": "auto", "device": "cpu", "allow_nonfinite": True}
    assert load_options(p.parse_args([])) == {"dtype": None, "device": "auto", "allow_nonfinite": False}
