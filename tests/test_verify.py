"""Acceptance rules: hand-made cases, a naive tree walk, and statistical tests that speculative sampling
reproduces the target's distribution (one step, and sequences of a few tokens over many steps, with drafts
that depend on the target)."""

import numpy as np
import pytest
import torch

from specvocab.engine.tree import DraftTree
from specvocab.engine.verify import VerifyError, tree_layout, verify_greedy, verify_sampling, warp_probs
from tests.engine_testing import random_parents
from tests.sampling_stats import assert_fits, assert_rejects, skewed


def _logits_with_argmax(argmax: list[int], vocab: int) -> torch.Tensor:
    logits = torch.randn(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


# --- greedy ---------------------------------------------------------------------------------------------

def test_greedy_hand_made_tree():
    # R->A, R->B, A->C, B->D, C->E; tokens R=0 A=1 B=2 C=3 D=4 E=5
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    # target: after R -> B, after B -> D, after D -> 7 (bonus); A's and C's rows are never reached
    logits = _logits_with_argmax([2, 3, 4, 5, 7, 6], vocab=8)
    accepted, new = verify_greedy(tokens, parents, logits)
    assert accepted.tolist() == [0, 2, 4]
    assert new.tolist() == [2, 4, 7]


def test_greedy_nothing_accepted_and_root_only():
    tokens, parents = torch.tensor([5, 1, 2]), torch.tensor([-1, 0, 1])
    accepted, new = verify_greedy(tokens, parents, _logits_with_argmax([3, 2, 0], vocab=8))
    assert accepted.tolist() == [0] and new.tolist() == [3]
    accepted, new = verify_greedy(tokens[:1], parents[:1], _logits_with_argmax([6], vocab=8))
    assert accepted.tolist() == [0] and new.tolist() == [6]


def test_greedy_duplicate_siblings_take_the_lowest_index():
    tokens, parents = torch.tensor([0, 4, 4]), torch.tensor([-1, 0, 0])
    accepted, new = verify_greedy(tokens, parents, _logits_with_argmax([4, 1, 2], vocab=8))
    assert accepted.tolist() == [0, 1] and new.tolist() == [4, 1]


def _naive_greedy_walk(tokens, parents, logits):
    """UniSpec Alg. 2 (greedy verification of multiple guesses) as a tree walk that follows every matching child (siblings may repeat a
    token); the longest accepted path wins, then the lowest index of its last node."""
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        y = int(logits[path[-1]].argmax())
        kids = [i for i in range(len(parents)) if parents[i] == path[-1] and tokens[i] == y]
        paths.append(path)
        stack.extend(path + [k] for k in kids)
    best = min(paths, key=lambda p: (-len(p), p[-1]))
    return best, [int(logits[i].argmax()) for i in best]


def test_greedy_matches_the_naive_walk_on_random_trees():
    rng = np.random.default_rng(0)
    vocab = 6
    for trial in range(300):
        n = int(rng.integers(1, 25))
        parents = random_parents(n, rng, chain_bias=rng.random())
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial))
        argmax = logits.argmax(-1).tolist()
        # about half the draft tokens are the argmax at their parent, so long paths get accepted
        tokens = [0] + [argmax[parents[i]] if rng.random() < 0.6 else int(rng.integers(0, vocab))
                        for i in range(1, n)]
        got_acc, got_new = verify_greedy(torch.tensor(tokens), torch.tensor(parents), logits)
        want_acc, want_new = _naive_greedy_walk(tokens, parents, logits)
        assert got_acc.tolist() == want_acc and got_new.tolist() == want_new, f"trial {trial}"


def test_shapes_are_checked():
    with pytest.raises(VerifyError, match="logits"):
        verify_greedy(torch.tensor([0, 1]), torch.tensor([-1, 0]), torch.zeros(3, 5))


# --- the target distribution ----------------------------------------------------------------------------

def test_warp_probs_temperature_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.1), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    t2 = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(warp_probs(logits, 2.0), t2)
    with pytest.raises(VerifyError, match="temperature"):
        warp_probs(logits, 0.0)


# --- sampling: statistics -------------------------------------------------------------------------------
# Counts of committed tokens against the target's exact distribution (`tests.sampling_stats`: float64, no
# draws where the target has none, and a check of each test's own power). The drafts depend on the target,
# as a real drafter's do: the rejections that happen hit likely tokens, which is where a wrong acceptance
# rule or a wrong residual changes the output (a bonus drawn from the unmodified P, say, goes unnoticed
# when the drafts are random tokens that get rejected anyway).

V = 6


def _one_step_logits(seed: int) -> torch.Tensor:
    return torch.randn(5, V, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_one_step_deterministic_tree_matches_target(temperature, top_p):
    # root with three children (the third most likely token, the most likely, the least likely - outside
    # the nucleus when top_p < 1), examined in that order; one grandchild under the most likely
    logits = _one_step_logits(1)
    p = warp_probs(logits, temperature, top_p).double()
    order = p[0].argsort(descending=True).tolist()
    kid_a = order[0]
    tokens = torch.tensor([0, order[2], kid_a, order[-1], int(p[2].argmax())])
    parents = torch.tensor([-1, 0, 0, 0, 2])
    gen = torch.Generator().manual_seed(123)
    n = 4000
    first = np.zeros(V, dtype=np.int64)
    second_after_a = np.zeros(V, dtype=np.int64)
    for _ in range(n):
        acc, new = verify_sampling(tokens, parents, logits, temperature=temperature, top_p=top_p, generator=gen)
        new = new.tolist()
        first[new[0]] += 1
        if new[0] == kid_a:
            assert acc.tolist()[:2] == [0, 2]                    # a correct first token is taken as the node
            second_after_a[new[1]] += 1
    assert top_p == 1.0 or p[0, order[-1]] == 0                 # the zero-count check below has a zero cell
    assert_fits(first, p[0].numpy(), "first token")
    assert_fits(second_after_a, p[2].numpy(), "second token after kid_a")   # row 2 = after root -> kid_a
    # the test has power: the same counts do not fit a distribution that is off by a little
    assert_rejects(first, skewed(p[0].numpy(), 0.15), "first token vs a skewed target")


@pytest.mark.parametrize("width,top_p", [(1, 1.0), (3, 1.0), (3, 0.8)])
def test_one_step_sampled_children_match_target(width, top_p):
    # the children of the root are i.i.d. draws from q (draft_probs); q differs from p a lot and puts
    # mass on tokens outside the nucleus
    logits = _one_step_logits(2)
    p = warp_probs(logits, 1.0, top_p).double()
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(9)) * 2, -1)
    gen, draw = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    n = 4000
    first = np.zeros(V, dtype=np.int64)
    drafted = np.zeros(V, dtype=np.int64)
    for _ in range(n):
        kids = torch.multinomial(q, width, replacement=True, generator=draw)
        tokens = torch.cat([torch.tensor([0]), kids])
        parents = torch.tensor([-1] + [0] * width)
        dp = torch.zeros(1 + width, V)
        dp[0] = q
        _, new = verify_sampling(tokens, parents, logits[:1 + width], temperature=1.0, top_p=top_p,
                                 generator=gen, draft_probs=dp)
        first[int(new[0])] += 1
        drafted[int(kids[0])] += 1
    assert top_p == 1.0 or (drafted[p[0].numpy() == 0] > 0).any()   # drafts did fall outside the nucleus
    assert_fits(first, p[0].numpy(), "first token")
    assert_rejects(drafted, p[0].numpy(), "the drafts alone")   # power: the drafts alone do not fit p
    assert_rejects(first, skewed(p[0].numpy(), 0.15), "first token vs a skewed target")


def _bigram_chain_probs(table: np.ndarray, start: int, length: int) -> np.ndarray:
    """Exact joint probabilities (float64) of the next `length` tokens of a bigram model, flattened with
    the first token most significant (cell index = the tokens in base v)."""
    table = np.asarray(table, dtype=np.float64)
    table = table / table.sum(-1, keepdims=True)
    v = table.shape[0]
    probs, last = np.ones(1), np.array([start])
    for _ in range(length):
        probs = (probs[:, None] * table[last]).reshape(-1)      # [cells * v]
        last = np.tile(np.arange(v), len(last))
    return probs


def _target_dependent_tree(root: int, p_table: torch.Tensor, q_table: torch.Tensor, mode: str,
                           rng: np.random.Generator, draw: torch.Generator, max_nodes: int = 9):
    """A draft tree for the bigram target, grown level by level (at most 3 levels, 1-4 children under the
    root, 0-3 under the others). "deterministic": a node's children are the target's most likely next
    tokens, most likely first (one in ten a random token instead), scored by their target probability
    along the path, as a confident drafter would. "sampled": the children are i.i.d. draws from
    q = q_table[token], a draft model's distribution: near the target's, with systematic errors (noise
    drawn afresh every step would average out, and with it the effect of a wrong residual). Returns
    tokens, parents, scores, draft_probs (None when deterministic)."""
    v = p_table.shape[0]
    tokens, parents, scores, q_rows = [root], [-1], [1.0], {}
    frontier = [0]
    for level in range(3):
        grown = []
        for node in frontier:
            width = min(int(rng.integers(1, 5) if level == 0 else rng.integers(0, 4)), max_nodes - len(tokens))
            if width <= 0:
                continue
            t = tokens[node]
            if mode == "deterministic":
                top = p_table[t].argsort(descending=True).tolist()
                kids = [top[j] if rng.random() < 0.9 else int(rng.integers(0, v)) for j in range(width)]
                kid_p = [float(p_table[t, x]) for x in kids]
            else:
                q = q_table[t]
                q_rows[node] = q
                kids = torch.multinomial(q, width, replacement=True, generator=draw).tolist()
                kid_p = [float(q[x]) for x in kids]
            for x, px in zip(kids, kid_p):
                tokens.append(x)
                parents.append(node)
                scores.append(scores[node] * px)
                grown.append(len(tokens) - 1)
        frontier = grown
    dp = None
    if mode == "sampled":
        dp = torch.zeros(len(tokens), v)
        for node, q in q_rows.items():
            dp[node] = q
    return torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), dp


def _multi_step_counts(mode: str, n_runs: int, seed: int, v: int = 4, length: int = 3):
    """Run a bigram target (T = 0.9, top-p 0.95) with target-dependent draft trees until `length` tokens
    are committed, n_runs times; count the committed sequences (cells in base v). Returns the counts, the
    target's bigram logits [v, v] and its next-token distributions (warped) [v, v]."""
    logits_table = torch.randn(v, v, generator=torch.Generator().manual_seed(14)) * 1.2
    p_table = warp_probs(logits_table, 0.9, top_p=0.95)        # [v, v] next-token distribution per token
    # the draft model: the target's logits at a higher temperature plus a fixed error, no nucleus (accepts
    # about half the time); several siblings get rejected in a row, where the residual must be recursive
    error = torch.randn(v, v, generator=torch.Generator().manual_seed(15))
    q_table = torch.softmax(logits_table / 3.0 + 1.5 * error, -1)
    rng = np.random.default_rng(seed)
    gen, draw = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    counts = np.zeros(v ** length, dtype=np.int64)
    for _ in range(n_runs):
        seq = [0]
        while len(seq) < 1 + length:
            tokens, parents, scores, dp = _target_dependent_tree(seq[-1], p_table, q_table, mode, rng, draw)
            logits = logits_table[tokens]                        # bigram: a node's row depends on its token
            _, new = verify_sampling(tokens, parents, logits, temperature=0.9, top_p=0.95, generator=gen,
                                     draft_probs=dp, scores=scores)
            seq.extend(new.tolist())
        idx = 0
        for t in seq[1:1 + length]:
            idx = idx * v + t
        counts[idx] += 1
    return counts, logits_table, p_table


@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
def test_multi_step_sequences_match_target(mode):
    """A bigram target over 4 tokens; a target-dependent draft tree each step (see `_target_dependent_tree`);
    the first 3 committed tokens must be distributed as the target's chain, whatever the trees accept."""
    counts, logits_table, p_table = _multi_step_counts(mode, n_runs=3000, seed=0)
    want = _bigram_chain_probs(p_table.numpy(), 0, 3)
    assert np.isclose(want.sum(), 1.0) and (want == 0).any()  # top-p leaves impossible sequences
    assert_fits(counts, want, f"{mode} sequences")
    # power: the counts do not fit the chain at temperature 1.1 instead of 0.9 (L1 distance 0.19)
    near = _bigram_chain_probs(warp_probs(logits_table, 1.1, top_p=0.95).numpy(), 0, 3)
    assert_rejects(counts, near, f"{mode} sequences vs the chain at T = 1.1")


def test_tree_layout_on_a_chain_and_a_star():
    depths, anc = tree_layout(torch.arange(-1, 9))
    assert depths.tolist() == list(range(10)) and anc.equal(torch.ones(10, 10, dtype=torch.bool).tril())
    depths, anc = tree_layout(torch.tensor([-1] + [0] * 7))
    assert depths.tolist() == [0] + [1] * 7
    assert DraftTree(torch.zeros(8), torch.tensor([-1] + [0] * 7)).ancestor_mask().equal(anc)
