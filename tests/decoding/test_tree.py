"""EAGLE-3 tree drafting through the one round: greedy output equals AR (ragged rows, batch
1 and 3, several tree shapes, greedy rows beside sampled ones); with the target's
continuation planted along a random deep path of each tree (so the accepted nodes are not
the first ones and the K/V must be moved into place), output still equals AR, long paths
are accepted, and every tree the round drafts starts from the draft context a fresh
recomputation gives; sampled trees follow the target's distribution (chi-square, through
generate and on the rule alone); the tree rules and the K/V compaction on hand-made cases;
what trees refuse, in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockspec import Engine, EngineOptions, GenerateOptions, PolicyOptions
from blockspec.config import EagleTree, SamplingParams
from blockspec.decoding.generate import generate
from blockspec.decoding.proposal import Proposal
from blockspec.decoding.round import Forwards, WrappedForwards
from blockspec.decoding.sampling import RowSampler, verify_tree
from blockspec.decoding.tree import TokenTree, keep_path
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import Eagle3Drafter
from blockspec.models.kv_cache import KVCache
from conftest import RAGGED_PROMPTS as PROMPTS
from conftest import make_eagle3, make_target, plant_path
from lossless_stats import chi_square_p, sampled_first_three

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
FIXED = PolicyOptions(adapt=False)
TREES = [EagleTree(topk=1, num_steps=3, num_draft_tokens=4), EagleTree(topk=2, num_steps=3, num_draft_tokens=6),
         EagleTree(topk=4, num_steps=4, num_draft_tokens=12), EagleTree(topk=3, num_steps=1, num_draft_tokens=3)]


def tree_draft(target, tree: EagleTree) -> Eagle3Drafter:
    return Eagle3Drafter.pair(make_eagle3(target), target).with_tree(tree)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"k{t.topk}-s{t.num_steps}-n{t.num_draft_tokens}")
@pytest.mark.parametrize("batch", [1, 3])
def test_tree_greedy_equals_ar(target64, ar_reference, tree, batch):
    prompts, expected = (PROMPTS, ar_reference) if batch > 1 else ([PROMPTS[2]], [ar_reference[2]])
    out = generate(target64, prompts, GREEDY, draft=tree_draft(target64, tree), policy=FIXED)
    assert [c.tokens for c in out.completions] == expected


class PlantedPaths(WrappedForwards):
    """Checks each tree's best first-level node against a fresh recomputation of the draft
    from the committed sequence (the context the round handed the draft: the accepted
    path's features, each paired with the token after it), then plants each row's true
    continuation along the path to a random deepest node (other nodes keep the draft's
    tokens, siblings kept distinct), corrupting one path node on every third row proposal."""

    def __init__(self, inner: Forwards, target, prompts: list[list[int]], reference: list[list[int]],
                 emitted: dict[int, list[int]]) -> None:
        super().__init__(inner)
        self.target, self.prompts, self.emitted = target, prompts, emitted
        self.full = [p + ref for p, ref in zip(prompts, reference)]
        self.calls, self.rng = itertools.count(1), torch.Generator().manual_seed(0)
        self.checked = self.off_diagonal = 0

    def draft_tree(self, draft, draft_cache, sampler):
        proposal = self.inner.draft_tree(draft, draft_cache, sampler)
        tokens, tree = proposal.tokens.clone(), proposal.tree
        if draft_cache.rows != len(self.full):   # a row has left: rows no longer map to prompts
            return proposal
        for r in range(tokens.shape[0]):
            seq = self.prompts[r] + self.emitted[r]
            n = len(seq) - 1   # committed positions; the last token is the anchor
            assert int(draft_cache.lengths[r]) == n
            feats = self.target(torch.tensor([seq[:n]]), capture=tuple(draft.config.target_layer_ids),
                                output="features").features
            first, _ = draft.model.chain(draft.model.new_cache(1, n + 2), feats, torch.tensor([seq[1:]]),
                                         torch.tensor([n]), 1, self.target.embed_tokens)
            assert int(tokens[r, 0]) == int(first[0, 0]), f"row {r} at {n} positions"
            self.checked += 1
            path = plant_path(tokens[r], tree.parents[r], tree.depths[r], self.full[r][len(seq):], self.rng,
                              self.target.config.vocab_size, corrupt=next(self.calls) % 3 == 0)
            self.off_diagonal += sum(node != depth for depth, node in enumerate(path, start=1))
        return Proposal(tokens, None, None, tree=tree)


def planted(target, prompts: list[list[int]], reference: list[list[int]]) -> tuple[GenerateOptions, list]:
    """Generate options whose rounds plant the reference along the trees (`PlantedPaths`,
    listed in the returned list once built)."""
    emitted: dict[int, list[int]] = {r: [] for r in range(len(prompts))}
    wrapped: list[PlantedPaths] = []

    def wrap(inner):
        wrapped.append(PlantedPaths(inner, target, prompts, reference, emitted))
        return wrapped[0]
    return GenerateOptions(forwards=wrap, on_tokens=lambda r, toks: emitted[r].extend(toks)), wrapped


def test_planted_paths_are_accepted_and_moved_into_place(target64, ar_reference):
    options, wrapped = planted(target64, PROMPTS, ar_reference)
    draft = tree_draft(target64, EagleTree(topk=3, num_steps=4, num_draft_tokens=14))
    out = generate(target64, PROMPTS, GREEDY, draft=draft, policy=FIXED, options=options)
    assert [c.tokens for c in out.completions] == ar_reference
    assert out.tau > 2.5 and wrapped[0].checked >= 6 and wrapped[0].off_diagonal >= 6


def test_tree_logprobs_are_the_targets_own(target64):
    """Each emitted token's log-probability (and its top alternatives) comes from the tree
    node that predicted it, as AR's from its decode step; the planted paths make long runs."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2)
    ar = generate(target64, [PROMPTS[2]], params).completions[0]
    options, _ = planted(target64, [PROMPTS[2]], [ar.tokens])
    out = generate(target64, [PROMPTS[2]], params, draft=tree_draft(target64, TREES[2]), policy=FIXED, options=options)
    tree = out.completions[0]
    assert out.tau > 2 and tree.tokens == ar.tokens and len(tree.logprobs) == len(ar.logprobs) == 16
    for mine, theirs in zip(tree.logprobs, ar.logprobs):
        assert (mine.token, mine.rank) == (theirs.token, theirs.rank)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-9)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_greedy_rows_beside_sampled_ones_equal_ar(target64, ar_reference):
    """In a batch that samples, greedy rows still get AR's output (their target row is one-hot)."""
    params = [GREEDY, SamplingParams(temperature=1.0, seed=1, max_new_tokens=24, ignore_eos=True), GREEDY]
    out = generate(target64, PROMPTS, params, draft=tree_draft(target64, TREES[2]), policy=FIXED)
    assert [out.completions[i].tokens for i in (0, 2)] == [ar_reference[0], ar_reference[2]]


VOCAB, N, ALPHA = 12, 12000, 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["T1", "T0.7-k5"])
def test_sampled_trees_follow_target_distribution(params):
    """Recursive rejection over siblings: the first three tokens (the second and third from
    trees of two levels, three children per expanded node) follow the target's joint
    distribution, with a draft vocabulary of 8 of the 12 tokens (4 never drafted)."""
    target = make_target(seed=3, vocab=VOCAB, dtype=torch.float64)
    draft = Eagle3Drafter.pair(make_eagle3(target, draft_vocab=8, seed=5), target).with_tree(EagleTree(3, 2, 7))
    p_value, tau = sampled_first_three(target, draft, params, [3, 5, 7, 2], VOCAB, N)
    assert tau > 1.15   # drafts were accepted: the rule, not the fallback, made the tokens
    assert p_value > ALPHA


def test_sampled_tree_rule_is_exact_on_a_fixed_tree():
    """The rule alone, with high target probabilities on siblings (where a wrong residual
    shows most): tree anchor -> a, b, c; a -> two children; b -> one. The first emitted token
    follows the target after the anchor, the second (a path token or the bonus) the target
    after the first, over 20000 rows each with its own generator."""
    vocab, rows = 6, 20000
    parents, depths = torch.tensor([[0, 0, 0, 1, 1, 2]]), torch.tensor([[1, 1, 1, 2, 2, 2]])
    drafts = torch.tensor([[0, 1, 2, 3, 4, 0]])
    after = torch.tensor([[0.35, 0.3, 0.15, 0.1, 0.05, 0.05],   # the anchor
                          [0.1, 0.1, 0.1, 0.4, 0.2, 0.1],       # a = 0
                          [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],       # b = 1
                          [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],       # c = 2 (a leaf)
                          *[[1 / 6] * 6] * 3], dtype=torch.float64)
    sampler = RowSampler.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(rows)])
    verdict = verify_tree(after.log().expand(rows, -1, -1), drafts.expand(rows, -1), parents.expand(rows, -1),
                          depths.expand(rows, -1), sampler)
    emitted = torch.cat([torch.cat([torch.zeros(1, dtype=torch.long), drafts[0]])[verdict.path[:, 1:]],
                         verdict.bonus.unsqueeze(1)], dim=1)
    first = torch.where(verdict.accepted > 0, emitted[:, 0], verdict.bonus)
    second = torch.where(verdict.accepted > 1, emitted[:, 1], verdict.bonus)
    # cells: (first, second) for a drafted first token (0..2), (first, -) for the others
    cell = torch.where(first < 3, first * vocab + second, 3 * vocab + first - 3)
    counts = torch.bincount(cell, minlength=3 * vocab + 3).double()
    exact = torch.cat([(after[0, :3].unsqueeze(1) * after[1:4]).flatten(), after[0, 3:]])
    assert chi_square_p(counts, exact) > 1e-3
    assert (verdict.accepted == 2).sum() > rows // 10   # second-level drafts were accepted


def test_tree_rule_follows_the_matching_branch():
    # [anchor, d1..d5]: d1, d2 children of the anchor; d3 of d2; d4, d5 of d3.
    parents = torch.tensor([[0, 0, 2, 3, 3]])
    depths = torch.tensor([[1, 1, 2, 3, 3]])
    drafts = torch.tensor([[4, 5, 6, 7, 8]])
    argmax = [5, 0, 6, 8, 0, 0]   # target's choice after each node: d2, then d3, then d5 after d3
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), 10).double()
    sampler = RowSampler.from_params([GREEDY])
    verdict = verify_tree(logits, drafts, parents, depths, sampler)
    assert verdict.accepted.tolist() == [3] and verdict.path.tolist() == [[0, 2, 3, 5]]
    assert verdict.bonus.tolist() == [0]   # the target's choice after d5
    argmax[0] = 9   # nothing matches at the root: no draft, the target's own token
    verdict = verify_tree(torch.nn.functional.one_hot(torch.tensor([argmax]), 10).double(), drafts, parents, depths,
                          sampler)
    assert verdict.accepted.tolist() == [0] and verdict.bonus.tolist() == [9]


def test_tree_mask_sees_the_context_and_the_ancestors():
    tree = TokenTree(torch.tensor([[0, 0, 2]]), torch.tensor([[1, 1, 2]]))
    mask = tree.verify_mask(torch.tensor([2]), 7)[0, 0]
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0, 0],     # anchor
                                   [1, 1, 1, 1, 0, 0, 0],     # d1
                                   [1, 1, 1, 0, 1, 0, 0],     # d2
                                   [1, 1, 1, 0, 1, 1, 0]]     # d3 (child of d2)
    assert tree.positions(torch.tensor([2])).tolist() == [[2, 3, 3, 4]]


def test_keep_path_moves_the_accepted_nodes_into_place():
    cache = KVCache(2, 2, 1, 1, 12)
    cache.k[..., 0] = torch.arange(12, dtype=torch.float32)
    cache.v[..., 0] = -torch.arange(12, dtype=torch.float32)
    cache.lengths.copy_(torch.tensor([9, 11]))   # rows of 3 and 5 committed slots, trees after them
    keep_path(cache, torch.tensor([3, 5]), torch.tensor([[0, 2, 5], [0, 1, 0]]), torch.tensor([2, 1]))
    assert cache.lengths.tolist() == [6, 7]
    assert cache.k[1, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 8]
    assert cache.v[0, 1, 0, :7, 0].tolist() == [0, -1, -2, -3, -4, -5, -6]


def test_what_trees_refuse(target64):
    draft = tree_draft(target64, TREES[1])
    prompt = [PROMPTS[0]]
    with pytest.raises(BlockspecError, match="--rule match runs chains only"):
        generate(target64, prompt, SamplingParams(temperature=1.0, max_new_tokens=4), draft=draft, policy=FIXED,
                 rule="match")
    with pytest.raises(BlockspecError, match="penalties"):
        generate(target64, prompt, SamplingParams(repetition_penalty=1.2, max_new_tokens=4), draft=draft,
                 policy=FIXED)
    with pytest.raises(BlockspecError, match="--no-adapt"):
        generate(target64, prompt, GREEDY, draft=draft)
    with pytest.raises(BlockspecError, match="compile"):
        generate(target64, prompt, GREEDY, draft=draft, policy=FIXED, options=GenerateOptions(compile=True))
    with pytest.raises(BlockspecError, match="--no-adapt"):
        Engine(target64, draft, "eagle3")
    engine = Engine(target64, draft, "eagle3", policy=FIXED, max_running=2, max_model_len=32)
    with pytest.raises(BlockspecError, match="penalties"):
        engine.submit(PROMPTS[0], SamplingParams(repetition_penalty=1.2, max_new_tokens=4))
    matching = Engine(target64, draft, "eagle3", policy=FIXED, max_running=2, max_model_len=32,
                      options=EngineOptions(rule="match"))
    with pytest.raises(BlockspecError, match="--rule match runs chains only"):
        matching.submit(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=4))
    assert engine.metrics()["rejected"] == matching.metrics()["rejected"] == 1 and not engine.has_work
    with pytest.raises(BlockspecError, match="compile"):
        Engine(target64, draft, "eagle3", policy=FIXED, options=EngineOptions(compile=True))
    with pytest.raises(BlockspecError, match="no block size"):
        draft.with_block_size(4)
    with pytest.raises(BlockspecError, match="exceeds the draft's vocabulary of 40"):
        draft.with_tree(EagleTree(topk=41, num_steps=1, num_draft_tokens=3))
    with pytest.raises(BlockspecError, match="num_draft_tokens"):
        EagleTree(topk=2, num_steps=2, num_draft_tokens=8)   # 2 + 4 nodes drafted: at most 7
    with pytest.raises(BlockspecError, match="topk"):
        EagleTree(topk=0, num_steps=2, num_draft_tokens=2)
