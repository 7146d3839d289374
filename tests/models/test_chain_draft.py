"""The run-time EAGLE-3 draft: `Eagle3Cache` keeps each row's last output with its K/V
through every row operation; context appends update only the rows that commit; a draft
saved in the LlamaForCausalLMEagle3 layout (as vLLM / SGLang read it) and loaded back
drafts exactly the same chains in `generate`."""

from __future__ import annotations

import torch

from blockspec import PolicyOptions
from blockspec.config import EagleTree, SamplingParams
from blockspec.decoding.generate import GenerateOptions, generate
from blockspec.loading import load_drafts
from blockspec.models.chain_draft import Eagle3Cache, Eagle3Drafter
from blockspec.models.checkpoint import save_eagle3
from conftest import make_eagle3, make_target


def _filled(rows: int = 4) -> Eagle3Cache:
    cache = Eagle3Cache(rows, 2, 8, 16, 32, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    cache.last.copy_(torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, 32))
    cache.lengths.copy_(torch.tensor([3, 5, 7, 9])[:rows])
    return cache


def test_last_outputs_move_with_their_rows():
    cache = _filled()
    k2 = cache.k[:, 2].clone()
    cache.swap_rows(0, 2)
    assert cache.last[0, 0] == 2 and cache.last[2, 0] == 0 and torch.equal(cache.k[:, 0, :, :7], k2[:, :, :7])
    cache.move_rows([3], [1])
    assert cache.last[1, 0] == 3 and int(cache.lengths[1]) == 9
    view = cache.slice_rows(1, 3)
    assert isinstance(view, Eagle3Cache) and view.last[0, 0] == 3
    view.last[1].fill_(-1.0)            # a slice shares storage with the pool
    assert cache.last[2, 0] == -1
    cache.keep_rows(torch.tensor([2, 0]))
    assert cache.last[:, 0].tolist() == [-1.0, 2.0] and cache.lengths.tolist() == [3, 7]


def test_append_updates_only_committing_rows():
    target = make_target()
    draft = Eagle3Drafter.pair(make_eagle3(target), target, 3)
    cache = draft.new_cache(2, 32)
    feats = torch.randn(2, 4, 3 * target.config.hidden_size)
    tokens = torch.randint(0, 60, (2, 4))
    draft.append_context(cache, feats, torch.tensor([4, 2]), tokens)
    before = cache.last.clone()
    out = draft.model.append(draft.model.new_cache(1, 32), feats[1:, :2], tokens[1:, :2], 2, target.embed_tokens)
    assert torch.allclose(before[1], out[0, 1], atol=1e-5)   # row 1's own last position
    draft.append_context(cache, feats[:, :1], torch.tensor([0, 1]), tokens[:, :1])
    assert torch.equal(cache.last[0], before[0]) and not torch.equal(cache.last[1], before[1])
    assert cache.lengths.tolist() == [4, 3]


class Drafted:
    def __init__(self) -> None:
        self.rounds: list[list[list[int]]] = []

    def on_round(self, outcome, requests) -> None:
        self.rounds.append(outcome.drafted)


def test_saved_and_loaded_draft_drafts_the_same_chains(tmp_path):
    target = make_target(dtype=torch.float64)
    model = make_eagle3(target)
    save_eagle3(model, tmp_path, dtype="float64")
    loaded = load_drafts(target, {"eagle3": tmp_path}, ["eagle3"])["eagle3"]
    assert isinstance(loaded, Eagle3Drafter) and torch.equal(loaded.model.d2t, model.d2t)
    runs = []
    for draft in (Eagle3Drafter.pair(model, target, 4), loaded.with_num_drafts(4)):
        seen = Drafted()
        params = [SamplingParams(max_new_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=3, max_new_tokens=16, ignore_eos=True)]
        out = generate(target, [[1, 2, 3, 4], [9, 8]], params, draft=draft, policy=PolicyOptions(adapt=False),
                       options=GenerateOptions(observer=seen))
        runs.append(([c.tokens for c in out.completions], seen.rounds))
    assert runs[0] == runs[1] and sum(len(r[0]) for r in runs[0][1]) > 8


def _forced_logp(draft: Eagle3Drafter, cache: Eagle3Cache, path: list[int]) -> torch.Tensor:
    """The draft's log-probabilities over its vocabulary after feeding `path` as a chain
    (`Eagle3Draft.step`, one token per forward) from the cache's last committed output."""
    model, hidden = draft.model, cache.last
    for i, tok in enumerate(path):
        hidden = model.step(cache, torch.tensor([tok]), hidden, i, draft.embed)
    return torch.log_softmax(model.draft_logits(hidden), -1)[0]


def _paths_and_scores(draft: Eagle3Drafter, cache: Eagle3Cache, tree: EagleTree) -> dict[tuple[int, ...], float]:
    """Each drafted node's path from the anchor -> its path log-probability, recomputed one
    chained step at a time; checks that nodes come after their parents."""
    tokens, parents, depths = (t[0].tolist() for t in draft.with_tree(tree).draft_tree(cache))
    vocab = draft.model.vocabulary.tolist()
    paths: dict[int, tuple[int, ...]] = {0: ()}
    scores: dict[tuple[int, ...], float] = {(): 0.0}
    for i, (tok, parent) in enumerate(zip(tokens, parents), start=1):
        assert parent < i
        paths[i] = paths[parent] + (tok,)
        assert depths[i - 1] == len(paths[i])
        logp = _forced_logp(draft, cache, list(paths[parent]))
        scores[paths[i]] = scores[paths[parent]] + float(logp[vocab.index(tok)])
    del scores[()]
    return scores


def test_tree_nodes_are_the_best_scored_topk_children_of_their_paths():
    """With every candidate kept, a tree's levels are: the topk draft tokens after the
    anchor, then the topk children (recomputed one chained step at a time) of the topk
    best-scored nodes of the level before; a smaller tree keeps the best-scored of those;
    a topk-1 tree drafts the chain."""
    target = make_target(dtype=torch.float64)
    chain = Eagle3Drafter.pair(make_eagle3(target), target, 3)
    cache = chain.new_cache(1, 32)
    feats = torch.randn(1, 6, 3 * target.config.hidden_size, dtype=torch.float64)
    chain.append_context(cache, feats, 6, torch.randint(0, 60, (1, 6)))
    k, vocab = 3, chain.model.vocabulary
    full = _paths_and_scores(chain, cache, EagleTree(topk=k, num_steps=3, num_draft_tokens=22))   # all 3 + 9 + 9
    assert len(full) == 21
    for depth in (1, 2):
        level = sorted((p for p in full if len(p) == depth), key=lambda p: -full[p])
        expanded = {p[:-1] for p in full if len(p) == depth + 1}
        assert expanded == set(level[:k])
        for path in expanded:
            children = sorted(p[-1] for p in full if len(p) == depth + 1 and p[:-1] == path)
            assert children == sorted(vocab[_forced_logp(chain, cache, list(path)).topk(k).indices].tolist())
    assert sorted(p[0] for p in full if len(p) == 1) == sorted(vocab[_forced_logp(chain, cache, []).topk(k).indices].tolist())
    kept = _paths_and_scores(chain, cache, EagleTree(topk=k, num_steps=3, num_draft_tokens=10))
    assert set(kept) == set(sorted(full, key=lambda p: -full[p])[:9])
    assert chain.with_tree(EagleTree(1, 3, 4)).draft_tree(cache)[0].tolist() == chain.draft(cache, 3)[0].tolist()
