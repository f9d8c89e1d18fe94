"""Acceptance rules: hand-made cases, a naive tree walk, and statistical tests that speculative sampling
reproduces the target's distribution (one step, and sequences of a few tokens over many steps)."""

import numpy as np
import pytest
import torch
from scipy import stats

from engine.tree import DraftTree
from engine.verify import VerifyError, tree_layout, verify_greedy, verify_sampling, warp_probs
from tests.engine_testing import random_parents


def _logits_with_argmax(argmax: list[int], vocab: int) -> torch.Tensor:
    logits = torch.randn(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


# --- greedy ---------------------------------------------------------------------------------------------

def test_greedy_hand_made_tree():
    # R->A, R->B, A->C, B->D, C->E (specs/unispec.md section 4.4); tokens R=0 A=1 B=2 C=3 D=4 E=5
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
    """specs/unispec.md section 4.6 as a tree walk that follows every matching child (siblings may repeat a
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

def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are merged into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == counts.sum() or counts[small].sum() == 0, "mass observed where the target has none"
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


V = 6


def _one_step_logits(seed: int) -> torch.Tensor:
    return torch.randn(5, V, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_one_step_deterministic_tree_matches_target(temperature, top_p):
    # root with three children (one likely, one unlikely, one outside the nucleus), one grandchild
    logits = _one_step_logits(1)
    p = warp_probs(logits, temperature, top_p)
    order = p[0].argsort(descending=True).tolist()
    kid_a = order[0]
    tokens = torch.tensor([0, order[2], kid_a, order[-1], int(p[2].argmax())])
    parents = torch.tensor([-1, 0, 0, 0, 2])
    gen = torch.Generator().manual_seed(123)
    n = 3000
    first = np.zeros(V, dtype=np.int64)
    second_after_a = np.zeros(V, dtype=np.int64)
    for _ in range(n):
        acc, new = verify_sampling(tokens, parents, logits, temperature=temperature, top_p=top_p, generator=gen)
        new = new.tolist()
        first[new[0]] += 1
        if new[0] == kid_a:
            assert acc.tolist()[:2] == [0, 2]                    # a correct first token is taken as the node
            second_after_a[new[1]] += 1
    assert _chi2_pvalue(first, p[0].numpy()) > 1e-3
    assert _chi2_pvalue(second_after_a, p[2].numpy()) > 1e-3     # row 2 = after root -> kid_a
    # the test has power: the same counts do not fit a distribution that is off by a little
    skew = p[0].numpy() * np.linspace(0.8, 1.2, V)
    assert _chi2_pvalue(first, skew / skew.sum()) < 1e-3


@pytest.mark.parametrize("width", [1, 3])
def test_one_step_sampled_children_match_target(width):
    # the children of the root are i.i.d. draws from q (draft_probs); q differs from p a lot
    logits = _one_step_logits(2)
    p = warp_probs(logits, 1.0)
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(9)) * 2, -1)
    gen, draw = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    n = 3000
    first = np.zeros(V, dtype=np.int64)
    drafted = np.zeros(V, dtype=np.int64)
    for _ in range(n):
        kids = torch.multinomial(q, width, replacement=True, generator=draw)
        tokens = torch.cat([torch.tensor([0]), kids])
        parents = torch.tensor([-1] + [0] * width)
        dp = torch.zeros(1 + width, V)
        dp[0] = q
        _, new = verify_sampling(tokens, parents, logits[:1 + width], temperature=1.0, generator=gen,
                                 draft_probs=dp)
        first[int(new[0])] += 1
        drafted[int(kids[0])] += 1
    assert _chi2_pvalue(first, p[0].numpy()) > 1e-3
    assert _chi2_pvalue(drafted, p[0].numpy()) < 1e-3            # power: the drafts alone do not fit p


def _bigram_chain_probs(table: torch.Tensor, start: int, length: int) -> np.ndarray:
    """Exact joint probabilities of the next `length` tokens of a bigram model, flattened."""
    v = table.shape[0]
    probs, last = np.ones(1), np.array([start])                  # cell index = tokens in base v
    for _ in range(length):
        probs = (probs[:, None] * table[last].numpy()).reshape(-1)   # [cells * v]
        last = np.tile(np.arange(v), len(last))
    return probs


@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
def test_multi_step_sequences_match_target(mode):
    """A bigram target over 4 tokens; random draft trees each step; the first 3 committed tokens must be
    distributed as the target's chain, whatever the trees accept."""
    v, length, n_runs = 4, 3, 2500
    logits_table = torch.randn(v, v, generator=torch.Generator().manual_seed(11)) * 1.2
    p_table = warp_probs(logits_table, 0.9, top_p=0.95)        # [v, v] next-token distribution per token
    rng = np.random.default_rng(0)
    gen, draw = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts = np.zeros(v ** length, dtype=np.int64)
    for _ in range(n_runs):
        seq = [0]
        while len(seq) < 1 + length:
            n = int(rng.integers(1, 7))
            parents = random_parents(n, rng)
            dp = None
            if mode == "deterministic":
                tokens = [seq[-1]] + rng.integers(0, v, n - 1).tolist()
            else:                                                # children i.i.d. from a per-node q
                dp = torch.softmax(torch.randn(n, v, generator=draw) * 1.5, -1)
                tokens = [seq[-1]] + [int(torch.multinomial(dp[parents[i]], 1, generator=draw))
                                      for i in range(1, n)]
            tokens_t = torch.tensor(tokens)
            logits = logits_table[tokens_t]                      # bigram: a node's row depends on its token
            _, new = verify_sampling(tokens_t, torch.tensor(parents), logits, temperature=0.9, top_p=0.95,
                                     generator=gen, draft_probs=dp, scores=torch.tensor(rng.random(n)))
            seq.extend(new.tolist())
        idx = 0
        for t in seq[1:1 + length]:
            idx = idx * v + t
        counts[idx] += 1
    want = _bigram_chain_probs(p_table, 0, length)
    assert np.isclose(want.sum(), 1.0)
    assert _chi2_pvalue(counts, want) > 1e-3


def test_tree_layout_on_a_chain_and_a_star():
    depths, anc = tree_layout(torch.arange(-1, 9))
    assert depths.tolist() == list(range(10)) and anc.equal(torch.ones(10, 10, dtype=torch.bool).tril())
    depths, anc = tree_layout(torch.tensor([-1] + [0] * 7))
    assert depths.tolist() == [0] + [1] * 7
    assert DraftTree(torch.zeros(8), torch.tensor([-1] + [0] * 7)).ancestor_mask().equal(anc)
