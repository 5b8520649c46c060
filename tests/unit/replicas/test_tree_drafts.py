"""EAGLE-2 draft trees (`spec.tree_topk` > 1): verified in one forward with a tree mask, the
kept path's KV and hidden states moved to its positions, greedy output exactly the target's,
the strict memory check after every step (tiny_engine's default); a one-branch tree drafts
exactly the chain; configurations that cannot run trees are refused. Sessions, retraction,
aborts and the head's KV under trees: test_speculative_decoding.py, parametrized."""

from __future__ import annotations

import math

import pytest
import torch

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.sampling import greedy_tokens
from sessionserve.replicas.speculative.acceptance import accept_greedy_tree
from sessionserve.replicas.speculative.draft_state import DraftState
from sessionserve.replicas.speculative.proposer import _Tree
from sessionserve.replicas.step import Drafts
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, mimic_drafter, random_drafter, tiny_engine, tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7, 9, 30, 31, 2, 5, 99, 12], [3, 3, 3]]


def target():
    return tiny_model(num_hidden_layers=1, seed=1)


def head(model):
    return mimic_drafter(model, noise=0.05)


def count_moved_paths(engine) -> list[int]:
    """Verifies whose kept path left the first branch (its KV had to move)."""
    moved, inner = [0], engine.speculative._keep_path

    def counting(s, path, out):
        moved[0] += any(i != j for j, i in enumerate(path))
        return inner(s, path, out)

    engine.speculative._keep_path = counting
    return moved


def test_tree_masks_and_depths() -> None:
    tree = Drafts([10, 11, 12, 13], None, parents=[-1, -1, 0, 2])
    assert tree.depths() == [1, 1, 2, 3]
    mask = tree.tree_mask()
    # rows: pending, 10, 11, 12 (under 10), 13 (under 12)
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    chain = Drafts([1, 2, 3], None)
    assert torch.equal(chain.tree_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_greedy_acceptance_follows_the_targets_path() -> None:
    tokens, parents = [5, 6, 7, 8, 9], [-1, -1, 1, 1, 3]
    logits = torch.zeros(6, 20)
    for row, best in enumerate([6, 0, 8, 0, 9, 4]):  # pending -> 6 (#1) -> 8 (#3) -> 9 (#4)
        logits[row, best] = 1.0
    verdict, path = accept_greedy_tree(greedy_tokens(logits).tolist(), tokens, parents)
    assert path == [1, 3, 4] and verdict.tokens == [6, 8, 9, 4] and verdict.accepted == 3
    logits[0] = 0
    logits[0, 7] = 1.0  # no first-level draft is the target's token
    verdict, path = accept_greedy_tree(greedy_tokens(logits).tolist(), tokens, parents)
    assert path == [] and verdict.tokens == [7]


@pytest.mark.parametrize("topk", [2, 3])
def test_tree_drafts_keep_the_greedy_output_and_its_logprobs(topk) -> None:
    model = target()
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    plain = tiny_engine(model).generate(PROMPTS, params)
    engine = tiny_engine(model, drafter=head, tree_topk=topk, tree_budget=8)
    moved = count_moved_paths(engine)
    got = engine.generate(PROMPTS, params)
    for prompt, a, b in zip(PROMPTS, got, plain, strict=True):
        assert a.output_ids == b.output_ids == hf_greedy(model, prompt, 40)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):  # the kept path's rows
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-4
    stats = engine.speculative.stats
    assert stats.steps > 0 and stats.accepted > 0
    assert moved[0] > 0  # some kept paths left the first branch: their KV moved


def test_the_head_catches_up_on_the_kept_paths_hidden_states() -> None:
    """What the head reads after each verify is the target's hidden state at every committed
    position (a moved path's rows included), as a dense transformers forward computes it."""
    model = target()
    engine = tiny_engine(model, drafter=head, tree_topk=2, tree_budget=8)
    moved = count_moved_paths(engine)
    seen, inner = [], engine.speculative.eagle.catch_up

    def recording(entries):
        seen.extend((e.req, e.start, e.end, e.hidden.clone()) for e in entries)
        return inner(entries)

    engine.speculative.eagle.catch_up = recording
    (result,) = engine.generate([PROMPTS[1]], GREEDY)
    tokens = PROMPTS[1] + result.output_ids
    with torch.no_grad():
        dense = model.get_decoder()(torch.tensor([tokens])).last_hidden_state[0]
    assert moved[0] > 0
    for _, start, end, hidden in seen:
        torch.testing.assert_close(hidden, dense[start:end], atol=1e-4, rtol=1e-4)


# the tiny heads' probabilities are flat (~0.02 a token): 4e-4 stops about half the chains at
# their second or third draft
@pytest.mark.parametrize("confidence", [0.0, 4e-4])
def test_a_one_branch_tree_drafts_the_chain(confidence) -> None:
    """With one branch per node a tree is a chain: the tree code (entries in scratch slots,
    each attending to its ancestors) must draft exactly what the chain code drafts, where
    the chain stops by the head's confidence too."""
    model = target()
    runs = []
    for tree in (False, True):
        engine = tiny_engine(
            model,
            drafter=head,
            tree_topk=2 if tree else 1,
            tree_budget=4,
            min_draft_confidence=confidence,
        )
        if tree:
            engine.speculative.eagle.tree_topk = 1  # first-level candidates: the best one
        drafted, inner = [], engine.speculative.propose

        def recording(batch, inner=inner, drafted=drafted, tree=tree):
            out = inner(batch)
            drafted.append({rid: d.tokens for rid, d in out.items()})
            assert all((d.parents is not None) == tree for d in out.values())
            return out

        engine.speculative.propose = recording
        outputs = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
        runs.append((outputs, [sorted(d.values()) for d in drafted]))
    assert runs[0] == runs[1]
    assert sum(len(d) for d in runs[0][1]) > 10
    lengths = {len(c) for step in runs[0][1] for c in step}
    assert (lengths != {4}) == (confidence > 0)  # stopped chains are shorter than the budget
    assert confidence == 0 or len(lengths) > 1  # and not all stopped at the first draft


def test_a_tree_stops_where_its_paths_are_unlikely() -> None:
    """With a confidence floor a node is expanded only if its path is that likely, and
    verified only if it is its parent's best child or that likely itself."""
    draft = DraftState(token=5, feature=torch.zeros(2), candidates=([5, 6], [-0.1, -3.0]))
    tree = _Tree.first_level(draft, 2, torch.arange(8))
    floor = math.log(0.3)
    assert tree.frontier(1, 2, floor) == [0]  # node 1 (p 0.05) is not expanded
    tree.claim_entry(0)
    tree.expand(0, torch.zeros(2), [7, 8], [-0.2, -2.5])  # paths: 0.74, 0.07
    assert tree.frontier(2, 2, floor) == [2]
    tree.claim_entry(2)
    tree.expand(2, torch.zeros(2), [9, 10], [-2.0, -2.2])  # paths: 0.10, 0.08 (both unlikely)
    assert tree.frontier(3, 2, floor) == []
    kept = tree.select(8, floor)
    # the best child of each expanded node and the root's best candidate: a chain of 3
    assert kept.tokens == [5, 7, 9] and kept.parents == [-1, 0, 1]
    everything = tree.select(8)  # no floor: every node, likeliest first within budget
    assert sorted(everything.tokens) == [5, 6, 7, 8, 9, 10]
    assert tree.select(3).tokens == [5, 7, 9]


@pytest.mark.parametrize("confidence", [0.0, 4e-4])
def test_trees_stopped_by_confidence_keep_the_greedy_output(confidence) -> None:
    model = target()
    plain = tiny_engine(model).generate(PROMPTS, GREEDY)
    engine = tiny_engine(
        model, drafter=head, tree_topk=2, tree_budget=8, min_draft_confidence=confidence
    )
    sizes, inner = [], engine.speculative.eagle.propose_tree

    def recording(*args):
        out = inner(*args)
        sizes.extend(len(t.tokens) for t in out)
        return out

    engine.speculative.eagle.propose_tree = recording
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert sizes and engine.speculative.stats.accepted > 0
    if confidence:  # unsure steps verify fewer drafts than the budget
        assert min(sizes) < max(sizes) <= 8
    else:
        assert set(sizes) == {8}


def test_sampled_requests_draft_chains_and_keep_their_seeded_answer() -> None:
    model = target()
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    answers = []
    for topk in (1, 2):
        engine = tiny_engine(model, drafter=head, tree_topk=topk)
        grown = [0]
        inner = engine.speculative.eagle.propose_tree
        engine.speculative.eagle.propose_tree = lambda *a, inner=inner, grown=grown: (
            grown.__setitem__(0, grown[0] + 1) or inner(*a)
        )
        answers.append(engine.generate([PROMPTS[0]], params)[0].output_ids)
        assert grown[0] == 0
    assert answers[0] == answers[1]


def test_configurations_that_cannot_draft_trees_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="needs an EAGLE head"):
        tiny_engine(target(), tree_topk=2, history_drafts=True)
    windowed = tiny_model("mistral", seed=1, sliding_window=12)
    with pytest.raises(InvalidConfigError, match="sliding-window layers"):
        tiny_engine(windowed, drafter=random_drafter, tree_topk=2)
