"""Tiny random models built in memory (and written to disk when a test needs files)."""

from __future__ import annotations

import os

import torch
import pytest

from blockspec.config import DraftConfig, Eagle3Config, SamplingParams, TargetConfig
from blockspec.decoding.generate import generate
from blockspec.models.draft import DraftModel
from blockspec.models.eagle3 import Eagle3Draft
from blockspec.models.target import TargetModel

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def cost_table_cache(tmp_path_factory: pytest.TempPathFactory):
    """Cost tables the adaptive policy measures go to a per-session directory, not the
    user's cache (CLI subprocesses inherit it)."""
    path = tmp_path_factory.mktemp("blockspec-cache")
    old = os.environ.get("BLOCKSPEC_CACHE_DIR")
    os.environ["BLOCKSPEC_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("BLOCKSPEC_CACHE_DIR", None)
    else:
        os.environ["BLOCKSPEC_CACHE_DIR"] = old


def tiny_target_config(model_type: str = "qwen3", vocab: int = 64, layers: int = 4, **kw) -> TargetConfig:
    raw = dict(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, tie_word_embeddings=model_type == "qwen3", eos_token_id=vocab - 1)
    raw.update(kw)
    return TargetConfig.from_dict(raw)


def _larger_weights(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():  # peaked, less tie-prone distributions
            if p.dim() == 2:
                p.normal_(0, 0.3)


def oracle_tokens(tokens: torch.Tensor, draft_cache, anchors: torch.Tensor, reference: list[list[int]], calls,
                  corrupt_every: int, vocab: int) -> torch.Tensor:
    """Test oracles' drafts: each row's reference continuation (found by its position and
    anchor), one slot corrupted on every `corrupt_every`-th row proposal (calls: a counter
    from 1, `itertools.count(1)`), so long accepted runs, partial runs and rejections occur."""
    tokens = tokens.clone()
    r, g = tokens.shape
    for row in range(r):
        p, anchor = int(draft_cache.lengths[row]), int(anchors[row])
        for seq in reference:
            if p < len(seq) and seq[p] == anchor:
                cont = seq[p + 1:p + 1 + g]
                tokens[row, :len(cont)] = torch.tensor(cont)
                break
        n = next(calls)
        if n % corrupt_every == 0:
            tokens[row, n % g] = (tokens[row, n % g] + 1) % vocab
    return tokens


def plant_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, cont: list[int],
               generator: torch.Generator, vocab: int, corrupt: bool = False) -> list[int]:
    """Test oracles' draft trees: one row's reference continuation `cont` planted along the
    path to a random deepest node (tokens [n], parents / depths [n] as `TokenTree` has them;
    nodes numbered from 1), the path's middle node corrupted when `corrupt`, siblings kept
    distinct tokens as the draft makes them. Returns the path's nodes, shallowest first."""
    deepest = torch.nonzero(depths == depths.max()).flatten()
    node = int(deepest[torch.randint(len(deepest), (1,), generator=generator)]) + 1
    path = []
    while node:
        path.append(node)
        node = int(parents[node - 1])
    path.reverse()
    for depth, node in enumerate(path[:len(cont)], start=1):
        tokens[node - 1] = cont[depth - 1]
    if corrupt:
        node = path[len(path) // 2]
        tokens[node - 1] = (tokens[node - 1] + 1) % vocab
    for node in path:
        group = torch.nonzero(parents == parents[node - 1]).flatten().tolist()
        for s in group:
            if s != node - 1 and int(tokens[s]) == int(tokens[node - 1]):
                used = {int(tokens[j]) for j in group}
                tokens[s] = next(t for t in range(vocab) if t not in used)
    return path[:len(cont)]


# Ragged prompts for greedy-equality tests of speculative decoding against AR.
RAGGED_PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def ar_greedy(target: TargetModel, prompts: list[list[int]], params) -> list[list[int]]:
    """Each prompt's plain AR greedy output, generated alone: what every speculative run must equal."""
    return [generate(target, [p], params).completions[0].tokens for p in prompts]


@pytest.fixture(scope="module")
def target64() -> TargetModel:
    """A float64 tiny target: batched and single-row runs agree to the last bit (a module's own
    `target64` replaces it where it needs another)."""
    return make_target(dtype=torch.float64)


@pytest.fixture(scope="module")
def ar_reference(target64) -> list[list[int]]:
    """RAGGED_PROMPTS' AR greedy outputs, 24 tokens each (ignore EOS)."""
    return ar_greedy(target64, RAGGED_PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))


def make_target(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> TargetModel:
    torch.manual_seed(seed)
    model = TargetModel(tiny_target_config(**kw))
    _larger_weights(model)
    return model.to(dtype).eval().requires_grad_(False)


def make_draft(target: TargetModel, layout: str = "zlab", block_size: int = 4, seed: int = 1,
               markov_rank: int = 0, markov_type: str = "vanilla", confidence: bool = False,
               layers: int = 1, dtype: torch.dtype | None = None, **attention) -> DraftModel:
    """A tiny random draft; `attention`: DraftConfig's layer_types / sliding_window / causal."""
    tc = target.config
    cfg = DraftConfig(layout=layout, block_size=block_size, mask_token_id=tc.vocab_size - 2,
                      target_layer_ids=tc.default_layer_ids(2), num_target_layers=tc.num_hidden_layers,
                      hidden_size=tc.hidden_size, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=tc.vocab_size,
                      markov_rank=markov_rank, markov_head_type=markov_type, enable_confidence_head=confidence,
                      **attention)
    torch.manual_seed(seed)
    draft = DraftModel(cfg)
    _larger_weights(draft)
    return draft.to(dtype or target.dtype).eval().requires_grad_(False)


def make_eagle3(target: TargetModel, draft_vocab: int = 40, seed: int = 1, layer_ids: list[int] | None = None,
                **kw) -> Eagle3Draft:
    """A random EAGLE-3 draft for `target` whose vocabulary is `draft_vocab` random tokens."""
    tc = target.config
    cfg = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab,
                       target_hidden_size=tc.hidden_size, target_layer_ids=layer_ids or [0, 1, 2], rope=tc.rope, **kw)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    _larger_weights(draft)
    draft.set_vocabulary(torch.randperm(tc.vocab_size)[:draft_vocab].sort().values)
    return draft.to(target.dtype).eval().requires_grad_(False)


@pytest.fixture
def target() -> TargetModel:
    return make_target()


def write_tiny_target_dir(path, vocab: int = 64, seed: int = 0):
    """A tiny random target on disk with a word-level tokenizer holding the special tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from blockspec.models.checkpoint import save_target

    target = make_target(seed=seed, vocab=vocab)
    save_target(target, path)
    words = {f"w{i}": i for i in range(vocab - 3)}
    words.update({"<|pad|>": vocab - 3, "<|mask|>": vocab - 2, "<|endoftext|>": vocab - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>",
         "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return target


def write_pattern_data(path, n: int = 64, vocab: int = 60, seed: int = 0):
    """Sequences whose responses follow x[t+1] = (x[t] + 3) % vocab: learnable in a few steps."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            start = rng.randrange(vocab)
            seq = [(start + 3 * i) % vocab for i in range(40)]
            f.write(json.dumps({"prompt_ids": seq[:8], "response_ids": seq[8:]}) + "\n")
