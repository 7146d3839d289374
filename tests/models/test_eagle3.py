"""The EAGLE-3 draft: config spellings, the forward against the published formula, the
LlamaForCausalLMEagle3 checkpoint layout (round trip, foreign files, refusals) and chain
drafting against a fresh-cache recomputation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from blockspec.config import Eagle3Config, SamplingParams
from blockspec.decoding.sampling import RowSampler, sample
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_eagle3, save_eagle3
from blockspec.training.eagle3 import greedy_acceptance
from conftest import make_eagle3, make_target

SPECFORGE_QWEN3_8B = {   # SpecForge's configs/qwen3-8b-eagle3.json (keys as shipped)
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936, "draft_vocab_size": 32000}


@pytest.fixture
def target():
    return make_target(layers=8)


def test_config_reads_specforge_and_writes_both_layer_spellings():
    cfg = Eagle3Config.from_dict(SPECFORGE_QWEN3_8B)
    assert cfg.target_layer_ids is None and cfg.aux_layer_ids(36) == [1, 17, 32]   # engines' default for 36 layers
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.head_dim) == (32000, 4096, 128)
    pinned = Eagle3Config.from_dict({**SPECFORGE_QWEN3_8B, "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                            [2, 18, 33]}})
    raw = pinned.to_dict()
    # SGLang reads the nested ids as layer outputs, vLLM the top-level ones as layer inputs.
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 18, 33]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [3, 19, 34]
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 32000
    assert Eagle3Config.from_dict(raw) == pinned
    vllm_only = Eagle3Config.from_dict({**SPECFORGE_QWEN3_8B, "eagle_aux_hidden_state_layer_ids": [3, 19, 34]})
    assert vllm_only.target_layer_ids == [2, 18, 33]
    assert Eagle3Config.from_dict({**SPECFORGE_QWEN3_8B, "draft_vocab_size": None}).draft_vocab_size == 151936


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"fc_norm": True}, "fc_norm"),
    ({"draft_vocab_size": 200000}, "exceeds vocab_size"),
    ({"attention_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 draft"),
    ({"speculators_model_type": "eagle3"}, "speculators"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 5, 9]}, "embedding output"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 5, 9], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 9]}},
     "name different layers"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 2, 9]}}, "3 distinct"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
])
def test_config_refuses_bad_fields_in_one_line(change, message):
    with pytest.raises(BlockspecError, match=message) as err:
        Eagle3Config.from_dict({**SPECFORGE_QWEN3_8B, **change})
    assert "\n" not in str(err.value)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double().unsqueeze(-1) * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(draft, embed, features, tokens):
    """The engines' forward written out (vLLM / SGLang llama_eagle3.py, SpecForge's midlayer):
    residual = fc(features); x = [input_layernorm(embed) ; hidden_norm(residual)] into q/k/v;
    causal attention; residual add; post-norm MLP; final norm; lm_head -> target ids via d2t."""
    sd = {k: v.double() if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    cfg = draft.config
    t = tokens.shape[1]
    h = features.double() @ sd["fc.weight"].T
    x = torch.cat([_rms(embed(tokens).double(), sd["midlayer.input_layernorm.weight"]),
                   _rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    heads = lambda w, n: (x @ sd[w].T).view(1, t, n, cfg.head_dim).transpose(1, 2)  # noqa: E731
    pos = torch.arange(t)
    q = _rope(heads("midlayer.self_attn.q_proj.weight", cfg.num_attention_heads), pos, cfg.rope.theta)
    k = _rope(heads("midlayer.self_attn.k_proj.weight", cfg.num_key_value_heads), pos, cfg.rope.theta)
    v = heads("midlayer.self_attn.v_proj.weight", cfg.num_key_value_heads)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, -1) @ sd["midlayer.self_attn.o_proj.weight"].T
    r = h + o
    m = _rms(r, sd["midlayer.post_attention_layernorm.weight"])
    out = r + (F.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (m @ sd["midlayer.mlp.up_proj.weight"].T)) \
        @ sd["midlayer.mlp.down_proj.weight"].T
    small = _rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T
    full = torch.full((1, t, cfg.vocab_size), float("-inf"), dtype=torch.float64)
    full[..., torch.arange(cfg.draft_vocab_size) + sd["d2t"]] = small
    return full


def test_forward_matches_the_published_formula(target):
    draft = make_eagle3(target)
    feats = torch.randn(1, 6, 96)
    tokens = torch.randint(0, 64, (1, 6))
    out = draft.append(draft.new_cache(1, 16), feats, tokens, 6, target.embed_tokens)
    got = draft.target_logits(draft.draft_logits(out))
    ref = reference_logits(draft, target.embed_tokens, feats, tokens)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)) and int(finite[0, 0].sum()) == 40
    assert torch.allclose(got[finite].double(), ref[finite], atol=1e-4)


def test_roundtrip_file_layout_and_identical_drafts(tmp_path, target):
    draft = make_eagle3(target)
    save_eagle3(draft, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert {n.split(".")[0] for n in tensors} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)          # 2H wide input
    again = load_eagle3(tmp_path / "d", target=target)
    assert again.config == draft.config and again.embed_tokens is None
    for (n1, a), (n2, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    feats, toks = torch.randn(2, 5, 96), torch.randint(0, 64, (2, 5))
    runs = [d.chain(d.new_cache(2, 16), feats, toks, torch.tensor([5, 3]), 4, target.embed_tokens)[0]
            for d in (draft, again)]
    assert torch.equal(runs[0], runs[1])


def _specforge_files(path, draft, target, prefix="", **tensor_changes):
    """A draft directory as SpecForge exports it (own embedding, names without prefix)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {prefix + k: v.contiguous() for k, v in draft.state_dict().items()}
    tensors[prefix + "embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    for k, v in tensor_changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, str(path / "model.safetensors"))
    raw = {**SPECFORGE_QWEN3_8B, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "draft_vocab_size": 40, "rope_theta": 10000.0,
           "torch_dtype": "float32", "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("prefix", ["", "model."])
def test_loads_a_specforge_export(tmp_path, target, prefix):
    draft = make_eagle3(target)
    loaded = load_eagle3(_specforge_files(tmp_path / "d", draft, target, prefix), target=target)
    assert loaded.embed_tokens is not None and torch.equal(loaded.vocabulary, draft.vocabulary)
    feats, toks = torch.randn(1, 4, 96), torch.randint(0, 64, (1, 4))
    a = draft.append(draft.new_cache(1, 8), feats, toks, 4, target.embed_tokens)
    b = loaded.append(loaded.new_cache(1, 8), feats, toks, 4, target.embed_tokens)
    assert torch.equal(a, b)


@pytest.mark.parametrize("changes, message", [
    ({"d2t": torch.zeros(39, dtype=torch.int64)}, "d2t must be an integer tensor of shape"),
    ({"d2t": torch.zeros(40)}, "d2t must be an integer tensor"),
    ({"d2t": torch.full((40,), 30, dtype=torch.int64)}, "outside the 64-token vocabulary"),
    ({"d2t": -torch.arange(40)}, "two onto one token"),
    ({"t2d": torch.ones(64, dtype=torch.bool)}, "t2d does not mark exactly"),
    ({"d2t": None}, "needs one"),
    ({"lm_head.weight": None}, "missing tensors: lm_head.weight"),
    ({"fc.weight": torch.zeros(32, 64)}, "fc.weight"),
    ({"layers.1.mlp.up_proj.weight": torch.zeros(48, 32)}, "second decoder layer"),
    ({"midlayer.self_attn.q_proj.weight": torch.zeros(32, 64, dtype=torch.int8)}, "stored as I8"),
])
def test_refuses_bad_files_in_one_line(tmp_path, target, changes, message):
    path = _specforge_files(tmp_path / "d", make_eagle3(target), target, **changes)
    with pytest.raises(BlockspecError, match=message) as err:
        load_eagle3(path, target=target)
    assert "\n" not in str(err.value)


def test_the_dflash_loader_names_an_eagle3_draft(tmp_path, target):
    save_eagle3(make_eagle3(target), tmp_path / "d")
    with pytest.raises(BlockspecError, match="is an EAGLE-3 draft, not a DFlash / DSpark one"):
        load_draft(tmp_path / "d", target=target)


def test_refuses_a_draft_for_another_target(tmp_path, target):
    save_eagle3(make_eagle3(target, layer_ids=[1, 3, 7]), tmp_path / "d")
    with pytest.raises(BlockspecError, match="beyond the target's 4"):
        load_eagle3(tmp_path / "d", target=make_target(layers=4))


def _sampler(seed: int, rows: int = 2) -> RowSampler:
    return RowSampler.from_params([SamplingParams(temperature=1.0, seed=seed + r) for r in range(rows)])


@pytest.mark.parametrize("sampled", [False, True])
def test_chain_with_cache_equals_fresh_recomputation(target, sampled):
    """Three rounds on two ragged rows with rollback: each round's drafts and distributions
    equal those of a new cache fed every committed position at once."""
    draft = make_eagle3(target).double()
    embed = copy.deepcopy(target.embed_tokens).double()
    feats, toks = torch.randn(2, 24, 96, dtype=torch.float64), torch.randint(0, 64, (2, 24))
    cache, done = draft.new_cache(2, 40), torch.tensor([0, 0])
    for step, new in enumerate([[6, 4], [2, 5], [3, 1]]):
        end = done + torch.tensor(new)
        width = int(torch.tensor(new).max())
        idx = (done.unsqueeze(1) + torch.arange(width)).clamp(max=23)
        f = feats.gather(1, idx.unsqueeze(-1).expand(-1, -1, 96))
        pick = (lambda s: lambda logits: sample(logits, s))(_sampler(step)) if sampled else None
        got, got_p = draft.chain(cache, f, toks.gather(1, idx), torch.tensor(new), 4, embed, pick)
        for r in range(2):
            fresh = draft.new_cache(1, 40)
            n = int(end[r])
            # row r's own generator (seeded step + r), as in the batch
            pick_r = (lambda s: lambda logits: sample(logits, s))(_sampler(step + r, 1)) if sampled else None
            ref, ref_p = draft.chain(fresh, feats[r:r + 1, :n], toks[r:r + 1, :n], torch.tensor([n]), 4, embed,
                                     pick_r)
            assert torch.equal(got[r], ref[0])
            if sampled:
                assert torch.allclose(got_p[r], ref_p[0], atol=1e-10)
        assert torch.equal(cache.lengths, end)
        done = end


def test_sampled_chain_distributions_cover_only_the_draft_vocabulary(target):
    draft = make_eagle3(target)
    sampler = _sampler(0)
    tokens, probs = draft.chain(draft.new_cache(2, 16), torch.randn(2, 3, 96), torch.randint(0, 64, (2, 3)),
                                torch.tensor([3, 2]), 5, target.embed_tokens, lambda logits: sample(logits, sampler))
    assert tokens.shape == (2, 5) and probs.shape == (2, 5, 64)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 5))
    outside = ~draft.t2d
    assert float(probs[..., outside].abs().max()) == 0.0 and bool(draft.t2d[tokens].all())


def test_greedy_acceptance_with_perfect_agreement(target):
    """Target and draft both always choose token 0 (zero final norms): every draft is accepted,
    k + 1 tokens a round; with token 0 outside the draft vocabulary none is."""
    with torch.no_grad():
        target.norm.weight.zero_()
    agree = make_eagle3(target)
    agree.set_vocabulary(torch.arange(40))
    with torch.no_grad():
        agree.norm.weight.zero_()
    stats = greedy_acceptance(agree, target, [[5, 9, 11], [7, 3]], 16, 3)
    assert stats.tau == pytest.approx(4.0) and stats.rounds == 8
    agree.set_vocabulary(torch.arange(1, 41))
    assert greedy_acceptance(agree, target, [[5, 9, 11]], 16, 3).tau == pytest.approx(1.0)
