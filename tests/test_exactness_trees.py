"""Fixed-shape verification above 32 rows, on the real models (SmolLM2-135M, Gemma-3-270M).

The claim that every method's greedy output equals `ar`'s in bf16 rests on a row's logits being bitwise the
same whether an `ar` step (one row) or a draft tree of any size computed them (`engine.native`, rules 1-3).
Default trees are larger than the row tests of tests/test_native.py (eagle3: 59 nodes, recycling: 80), and
32 rows is where behaviour can change: oneDNN's bf16 GEMM on an AMX CPU changes a row's bits below it, the
CPU kernels' small-row routing (`engine.native.KERNEL_MAX_ROWS`) stops there. So here, over a real prompt's
cache, random trees of 33, 59 and 90 nodes - the CPU kernels on and off, bf16 and SmolLM2 in fp32:

- a path of the prompt's own tokens sits at random node indices of each tree, with decoys around it: its rows
  equal the `ar` rows of the same tokens bit for bit;
- the same tree with its nodes relabelled (another topological order, so other cache slots): every row equal;
- a decode whose every verify tree has 59 or 90 nodes (a drafter that hides the `ar` continuation in a random
  tree) commits tokens whose logits rows are `ar`'s bit for bit, and accepts the whole hidden path each step.

Mutants checked (each fails a test here, none fails the 25-node tests of test_native.py unless said):
- exact-mode linears through the C kernel only up to 32 rows (F.linear above)       -> row and decode tests
- the tail gathered in slot order, ancestors at their slot offsets (`idx = slot`)   -> row tests (and
  test_native's)
- with the kernels off, the step's bucket floor MIN_ROWS instead of `row_floor`, under a stand-in GEMM whose
  bits change below 64 rows                                                         -> the stand-in test
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specvocab.engine import generate
from specvocab.engine.native import BLOCK, MIN_ROWS, NativeModel, bucket_rows
from specvocab.engine.target import NativeTarget, native_model
from specvocab.engine.tree import DraftTree, Drafter
from specvocab.engine.verify import tree_layout
from specvocab.kernels import cpu

pytestmark = pytest.mark.slow

SIZES = (33, 59, 90)          # tree nodes: just above 32 rows, eagle3's default tree, past recycling's 80
PATH = 6                      # draft tokens of the hidden path
MAX_DEPTH = 20                # decoys hang at most this deep (deep trees: tests/test_native.py)
PROMPT = 2 * BLOCK + 20       # committed tokens + the path: the tree's positions cross a block boundary


def _prompt(tok, info) -> torch.Tensor:
    """[PROMPT] token ids of a real Spec-Bench turn (its first PROMPT tokens)."""
    from specvocab.engine.prompts import load_prompts
    text = " ".join(load_prompts("spec_bench", per_category=1)[0].turns[:1]) * 4
    ids = tok(text, add_special_tokens=False)["input_ids"][:PROMPT]
    assert len(ids) == PROMPT
    return torch.tensor(ids)


def _tree_with_path(n: int, root: int, path: list[int], vocab: int, rng: np.random.Generator,
                    avoid=()) -> tuple[DraftTree, list[int]]:
    """An n-node tree rooted at `root` holding `path` as a chain at random node indices, decoys (random
    tokens, none in `avoid`) hanging anywhere above MAX_DEPTH. Returns (tree, path nodes, root first)."""
    at = sorted(rng.choice(np.arange(1, n), size=len(path), replace=False).tolist())
    tokens, parents, depth, nodes = [root], [-1], [0], [0]
    for i in range(1, n):
        if at and i == at[0]:
            at.pop(0)
            parent, tok = nodes[-1], path[len(nodes) - 1]
            nodes.append(i)
        else:
            shallow = [j for j in range(i) if depth[j] < MAX_DEPTH]
            parent = i - 1 if depth[i - 1] < MAX_DEPTH and rng.random() < 0.5 else int(rng.choice(shallow))
            tok = int(rng.integers(0, vocab))
            while tok in avoid:
                tok = int(rng.integers(0, vocab))
        tokens.append(tok)
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents)), nodes


def _relabel(tree: DraftTree, rng: np.random.Generator) -> tuple[DraftTree, list[int]]:
    """The same tree in another topological order (by depth, ties at random): (tree, new index of each old node)."""
    depth, _ = tree_layout(tree.parents)
    order = sorted(range(tree.size), key=lambda i: (int(depth[i]), rng.random()))   # old node at each new index
    new = [0] * tree.size
    for k, i in enumerate(order):
        new[i] = k
    parents = [-1] + [new[int(tree.parents[i])] for i in order[1:]]
    return DraftTree(tree.tokens[order], torch.tensor(parents)), new


def _forward(t: NativeTarget, tree: DraftTree) -> torch.Tensor:
    d, a = tree_layout(tree.parents)
    return t.forward_tree(tree.tokens, tree.parents, d, a)[1].clone()       # [n, V] fp32


def _rows_alone_and_in_trees(model, prompt: torch.Tensor, vocab: int, cpu_kernels: bool, sizes=SIZES,
                             relabel: bool = True, seed: int = 0):
    """Over the cache of prompt[:-PATH-1]: the `ar` rows of the prompt's last PATH + 1 tokens (one-row forwards,
    committed one by one) [PATH + 1, V], and for each size a tree holding those tokens as a path at random node
    indices and (`relabel`: the largest tree only) the same tree relabelled. Returns (ar rows, [(logits, path
    nodes, relabelled logits or None, map)])."""
    rng = np.random.default_rng(seed)
    root, path = int(prompt[-PATH - 1]), prompt[-PATH:].tolist()
    t = NativeTarget(model, cpu_kernels=cpu_kernels)
    t.begin(prompt.numel() + max(sizes) + 1)
    out = []
    with torch.inference_mode():
        t.prefill(prompt[:-PATH - 1], all_logits=False)
        for n in sizes:                       # nothing committed between trees: each starts at the same slot
            tree, nodes = _tree_with_path(n, root, path, vocab, rng)
            other, new = _relabel(tree, rng)
            out.append((_forward(t, tree), nodes, _forward(t, other) if relabel and n == max(sizes) else None, new))
        ar = []
        for tok in [root] + path:
            ar.append(_forward(t, DraftTree(torch.tensor([tok]), torch.tensor([-1])))[0])
            t.compact(1, [0])
    return torch.stack(ar), out


CASES = [("smollm2_bf16", True, SIZES), ("smollm2_bf16", False, SIZES), ("gemma_bf16", True, SIZES),
         ("gemma_bf16", False, SIZES), ("smollm2_fp32", True, (90,)), ("smollm2_fp32", False, (90,))]


@pytest.mark.parametrize("which,cpu_kernels,sizes", CASES)
def test_a_row_is_bitwise_the_same_alone_and_inside_trees_of_33_to_90_nodes(request, which, cpu_kernels, sizes):
    """Per size, a tree over a real prompt's cache: the hidden path's rows are the `ar` rows, and the largest
    tree relabelled gives every node the same row - with the CPU kernels (where they build) and without; fp32
    (SmolLM2) at 90 nodes only."""
    model, tok, info = request.getfixturevalue(which)
    prompt = _prompt(tok, info)
    net = native_model(model)
    net.fused_calls = 0
    ar, trees = _rows_alone_and_in_trees(model, prompt, info.vocab_size, cpu_kernels, sizes)
    assert net.kernel_on == (cpu_kernels and cpu.linear_reason(net.device, net.dtype) is None)
    assert (net.fused_calls > 0) == (net.kernel_on and (net.dtype == torch.bfloat16 or cpu.isa() == "avx2"))
    for (logits, nodes, other, new), n in zip(trees, sizes):
        assert logits.shape[0] == n and nodes[-1] > 0
        for j, node in enumerate(nodes):
            assert torch.equal(logits[node], ar[j]), (n, j, node)
        assert other is None or torch.equal(other[new], logits), n      # every row, at its new index
    assert trees[-1][2] is not None
    # the power: the path's last row differs from its parent's (distinct rows are compared, not one row)
    assert not torch.equal(ar[-1], ar[-2])


def test_with_a_gemm_whose_bits_change_below_64_rows_the_measured_floor_keeps_big_trees_exact(smollm2_bf16,
                                                                                              monkeypatch):
    """Kernels off, F.linear replaced by a stand-in that rounds fewer than 64 rows through fp64 (other bits than
    oneDNN's, as an AMX GEMM gives rows below its blocking): the measured floor (`row_floor`) becomes 64, every
    step runs at >= 64 rows, and trees of 59 and 90 nodes (64 and 128 rows) keep the `ar` rows. With the floor
    MIN_ROWS instead, an `ar` step (4 rows, the stand-in) and a tree (oneDNN) round differently."""
    model, tok, info = smollm2_bf16
    real = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.dim() == 2 and x.shape[0] < 64:
            y = (x.double() @ w.double().T).to(x.dtype)
            return y if b is None else y + b
        return real(x, w, b)
    net = native_model(model)
    own = net.row_floor()
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    assert net.row_floor() == max(64, own) and bucket_rows(1, net.row_floor()) == max(64, own)
    prompt = _prompt(tok, info)
    ar, trees = _rows_alone_and_in_trees(model, prompt, info.vocab_size, False, sizes=(59, 90), relabel=False)
    for logits, nodes, _, _ in trees:
        assert all(torch.equal(logits[node], ar[j]) for j, node in enumerate(nodes))
    monkeypatch.setattr(NativeModel, "row_floor", lambda self: MIN_ROWS)
    ar, trees = _rows_alone_and_in_trees(model, prompt, info.vocab_size, False, sizes=(59,), relabel=False)
    logits, nodes = trees[0][:2]
    assert not all(torch.equal(logits[node], ar[j]) for j, node in enumerate(nodes))


# --- a decode whose every verify tree is large ------------------------------------------------------------

class HiddenPathDrafter(Drafter):
    """Proposes an n-node random tree holding the next `k` tokens of a known continuation (the `ar` output) as a
    path at random node indices: every verify step runs n rows, and where rows are exact the whole path is
    accepted."""

    name = "hidden-path"
    uses_prefill_logits = False

    def __init__(self, continuation: list[int], prompt_len: int, n: int, k: int, vocab: int, seed: int = 0):
        self.continuation, self.L, self.n, self.k, self.vocab = continuation, prompt_len, n, k, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, ids: torch.Tensor) -> DraftTree:
        m = ids.numel() - self.L                               # tokens generated so far; the root is the last
        path = self.continuation[m:m + self.k]
        return _tree_with_path(self.n, int(ids[-1]), path, self.vocab, self.rng, avoid=set(self.continuation))[0]


def _committed_rows(monkeypatch):
    """Spy on NativeTarget: the logits rows of every accepted node, in commit order (row i predicts token i + 1
    of the output), and each verify tree's size."""
    rows, sizes = [], []
    fwd, compact = NativeTarget.forward_tree, NativeTarget.compact
    last = {}

    def forward_tree(self, tokens, parents, depths, anc):
        hidden, logits = fwd(self, tokens, parents, depths, anc)
        last["logits"] = logits
        sizes.append(tokens.numel())
        return hidden, logits

    def compact_spy(self, num_new, keep):
        rows.extend(last["logits"][keep].clone())
        return compact(self, num_new, keep)
    monkeypatch.setattr(NativeTarget, "forward_tree", forward_tree)
    monkeypatch.setattr(NativeTarget, "compact", compact_spy)
    return rows, sizes


@pytest.mark.parametrize("which", ["smollm2_bf16", "gemma_bf16"])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_a_decode_verifying_59_and_90_node_trees_commits_the_ar_rows(request, which, cpu_kernels, monkeypatch):
    model, tok, info = request.getfixturevalue(which)
    ids = _prompt(tok, info)[:BLOCK + 9].tolist()
    T, k = 8, 3
    kw = dict(max_new_tokens=T, eos_ids=[], cpu_kernels=cpu_kernels)
    rows, sizes = _committed_rows(monkeypatch)
    ar = generate(model, ids, method="ar", **kw).output_ids.tolist()
    ar_rows = list(rows)
    assert sizes == [1] * (T - 1) and len(ar_rows) == T - 1
    for n in (59, 90):
        rows.clear()
        sizes.clear()
        res = generate(model, ids, method="pld", draft_size=n - 1, **kw,
                       drafter=HiddenPathDrafter(ar, len(ids), n, k, info.vocab_size, seed=n))
        assert res.output_ids.tolist() == ar
        assert sizes and all(s == n for s in sizes)              # every verify tree: n rows
        assert res.step_sizes[1:-1] == [k + 1] * (len(sizes) - 1)     # the whole hidden path + the bonus
        assert len(rows) >= len(ar_rows) and all(torch.equal(a, b) for a, b in zip(rows, ar_rows))
