"""The native target against transformers' own implementations, and checkpoint errors."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_target, save_target
from blockspec import GenerateOptions
from conftest import make_target

HF = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def write_hf(tmp_path, kind: str, **overrides):
    cfg_cls, model_cls = HF[kind]
    kw = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=kind == "qwen3",
              eos_token_id=100, bos_token_id=None, pad_token_id=0)
    kw.update(overrides)
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**kw)).eval()
    path = tmp_path / kind
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
def test_logits_match_transformers(tmp_path, kind):
    hf, path = write_hf(tmp_path, kind)
    ours = load_target(path)
    lengths = [9, 4, 6]
    prompts = [torch.randint(1, 100, (n,)) for n in lengths]
    cache = ours.new_cache(3, 32)
    ids = torch.zeros(3, 9, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
    with torch.no_grad():
        batched = ours(ids, cache, num_new=torch.tensor(lengths)).logits
        for r, p in enumerate(prompts):
            ref = hf(p.unsqueeze(0)).logits[0]
            assert (batched[r, :len(p)] - ref).abs().max().item() <= 1e-4
            single = ours(p.unsqueeze(0)).logits[0]
            assert (single - ref).abs().max().item() <= 1e-4


def test_rope_scaling_llama3_matches(tmp_path):
    hf, path = write_hf(tmp_path, "llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ours = load_target(path)
    ids = torch.randint(1, 100, (1, 120))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_matches_transformers_generate(tmp_path, kind):
    hf, path = write_hf(tmp_path, kind)
    ours = load_target(path)
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3]]
    out = generate(ours, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, completion in zip(prompts, out.completions):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert completion.tokens == ref[0, len(prompt):].tolist()


def test_save_load_roundtrip_bit_exact(tmp_path, target):
    save_target(target, tmp_path / "t")
    again = load_target(tmp_path / "t")
    for (n1, a), (n2, b) in zip(target.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


def test_sharded_and_bf16(tmp_path):
    hf, path = write_hf(tmp_path, "qwen3")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_target(path), load_target(tmp_path / "sharded")
    ids = torch.randint(1, 100, (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert load_target(path, dtype="bfloat16").dtype == torch.bfloat16


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("mutate, message", [
    (lambda p: (p / "config.json").unlink(), "does not exist"),
    (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda p: _edit_config(p, model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (lambda p: _edit_config(p, hidden_size=48), "shape"),
    (lambda p: _edit_config(p, num_hidden_layers=5), "missing tensors"),
    (lambda p: _edit_config(p, num_hidden_layers=2), "does not describe"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "cannot read"),
    (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda p: _edit_config(p, rope_scaling={"rope_type": "proportional", "factor": 4.0}),
     "rope type 'proportional'"),
    (lambda p: _edit_config(p, num_key_value_heads=3), "multiple of num_key_value_heads"),
])
def test_bad_checkpoints_raise_clear_errors(tmp_path, mutate, message):
    _, path = write_hf(tmp_path, "qwen3")
    mutate(path)
    with pytest.raises(BlockspecError, match=message):
        load_target(path)


@pytest.mark.parametrize("lengths", [[5], [3, 9, 6]])
def test_static_decode_step_equals_forward(target, lengths):
    """The shape-static step that compile_decode captures (full-capacity attention under a
    length mask) gives the logits of the ordinary one-token forward, row by row."""
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    caches = [target.new_cache(len(lengths), 32) for _ in range(2)]
    prompts = torch.randint(0, vocab, (len(lengths), max(lengths)))
    lens = torch.tensor(lengths)
    for cache in caches:
        target(prompts, cache, num_new=lens)
    tokens = torch.randint(0, vocab, (len(lengths),))
    with torch.no_grad():
        for _ in range(3):
            ref = target(tokens.unsqueeze(1), caches[0]).logits
            got = target._decode_logits(tokens, caches[1])
            caches[1].advance(1)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(caches[0].lengths, caches[1].lengths)
            tokens = ref[:, -1].argmax(-1)


@pytest.mark.slow
def test_compiled_decode_matches_eager_greedy():
    target = make_target()  # its own model: compile_decode stays attached to it
    prompts = [[3, 4, 5], [7, 1, 2, 9, 4, 8]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eager = generate(target, prompts, params)
    compiled = generate(target, prompts, params, options=GenerateOptions(compile=True))
    assert target.decode_compiled
    assert [c.tokens for c in compiled.completions] == [c.tokens for c in eager.completions]


def test_packed_append_equals_cache_free_forward(target):
    """Every path of the one attention body agrees: ragged rows appended packed (some rows
    adding nothing) give each row's logits and captured features of a cache-free causal
    forward over its whole sequence."""
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,)) for n in (9, 6, 7)]
    prefix, counts = torch.tensor([6, 5, 2]), torch.tensor([3, 0, 5])
    cache = target.new_cache(3, 32)
    with torch.no_grad():
        target(torch.stack([s[:6] for s in seqs]), cache, num_new=prefix)   # right-padded rows
        tokens = torch.cat([s[p:p + c] for s, p, c in zip(seqs, prefix, counts)])
        out = target.forward_packed(tokens, counts, cache, capture=(1, 2))
        assert torch.equal(cache.lengths, prefix + counts)
        offset = 0
        for s, p, c in zip(seqs, prefix.tolist(), counts.tolist()):
            ref = target(s[:p + c].unsqueeze(0), capture=(1, 2))
            torch.testing.assert_close(out.logits[0, offset:offset + c], ref.logits[0, p:], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.features[0, offset:offset + c], ref.features[0, p:], rtol=1e-5, atol=1e-5)
            offset += c
