"""UniSpec / Token Recycling drafting, checked against plain-Python references written like the spec.

- the successor store update vs a loop that writes rows one by one (later rows win);
- node confidences (both variants) on a hand-built store;
- the vectorised tree construction vs a node-by-node reference of UniSpec Alg. 1 l.16-30 on random stores;
- the C tree (`kernels.cpu.unispec_tree`, what the drafter runs on a CPU) vs the vectorised one, bitwise
  (mutants: the root kept in C; eff = score without the bottleneck; the frontier without its r check; the path
  product taken in node mode. The sorts' index tie-break dropped passes here, rightly: glibc's qsort is a
  merge sort, stable by itself; the tie-break keeps the order on a C library whose qsort is not);
- ancestor closure and size of the top-g selection;
- Token Recycling's template (80 nodes, depth 6) and its truncation;
- sampling-mode confidences come from the verifier's warped distribution; ids outside the vocabulary and
  stores of another vocabulary give clear errors.
"""

import heapq
import math
import random

import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.recycling import TEMPLATES, RecyclingDrafter, RecyclingError, Template, fill_template
from specvocab.engine.drafters.unispec import UniSpecDrafter, UniSpecError, accepted_last_order, build_unispec_tree
from specvocab.engine.store import StoreError, SuccessorStore, deployment_store, topk_probs
from specvocab.engine.tree import DraftTree, StepResult
from specvocab.engine.verify import warp_probs
from specvocab.kernels import cpu as cpu_kernels


# ---- store ---------------------------------------------------------------------------------------

def reference_store_update(tok, con, tokens, logits, k):
    """Row by row, in order: later writes overwrite earlier ones."""
    tok, con = tok.clone(), con.clone()
    for v, z in zip(tokens.tolist(), logits):
        p = torch.softmax(z.double(), dim=-1)
        vals, idx = torch.sort(p, descending=True)
        tok[v] = idx[:k]
        con[v] = vals[:k].float()
    return tok, con


@pytest.mark.parametrize("n,vocab,k", [(1, 7, 3), (37, 50, 10), (200, 263, 8)])
def test_store_update_matches_loop(n, vocab, k):
    g = torch.Generator().manual_seed(n)
    store = SuccessorStore(vocab, k)
    ref_tok, ref_con = store.tok.clone(), store.con.clone()
    for _ in range(3):                                     # several updates accumulate
        tokens = torch.randint(0, max(2, vocab // 4), (n,), generator=g)   # many duplicates
        logits = torch.randn(n, vocab, generator=g) * 3
        store.update(tokens, logits)
        ref_tok, ref_con = reference_store_update(ref_tok, ref_con, tokens, logits, k)
    assert torch.equal(store.tok, ref_tok)
    torch.testing.assert_close(store.con, ref_con, rtol=1e-5, atol=1e-7)
    assert store.num_filled() == int((ref_con[:, 0] > 0).sum()) < vocab   # unwritten rows stay empty


def test_topk_probs_temperature_and_chunks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1030, 91, generator=g) * 4
    for temp in (0.0, 0.7, 1.5):
        ids, probs = topk_probs(logits, 5, temp, chunk=100)
        p = torch.softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
        ref_vals, ref_ids = p.topk(5, dim=-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(probs, ref_vals)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.5), (1.3, 0.9)])
def test_sampling_confidences_are_the_verifiers_warped_probabilities(temperature, top_p):
    """In sampling mode the stored confidences are the probabilities `verify_sampling` accepts by:
    warp_probs (temperature, then top-p), exactly; tokens outside the nucleus get 0 (empty slots)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(300, 91, generator=g) * 3
    ids, probs = topk_probs(logits, 8, temperature, top_p, chunk=64)
    want = warp_probs(logits, temperature, top_p).topk(8, dim=-1)
    assert torch.equal(probs, want.values)
    assert torch.equal(ids[probs > 0], want.indices[probs > 0])   # zero slots: any id, never drafted
    if top_p < 1:
        assert bool((probs == 0).any())                            # the nucleus did cut some top-8 rows
        plain = torch.softmax(logits / temperature, -1).topk(8, dim=-1).values
        assert not torch.allclose(probs, plain)                    # and differs from the unwarped softmax


def test_drafters_store_the_warped_distribution_when_sampling():
    """UniSpec's and Token Recycling's stores and UniSpec's first-level cache, after `begin` and after
    `observe`, hold warp_probs' top-k for the run's temperature and top-p."""
    vocab = 40
    g = torch.Generator().manual_seed(4)
    for method, cls in (("unispec", UniSpecDrafter), ("recycling", RecyclingDrafter)):
        cfg = SpecConfig.preset(method, draft_size=6, temperature=0.8, top_p=0.6)
        d = cls(torch.nn.Linear(2, 2), cfg)
        k = cfg.store_k
        prompt = torch.tensor([3, 9, 17, 5])                    # distinct: every row is written once
        logits = torch.randn(4, vocab, generator=g) * 2
        d.begin(prompt, logits, None)
        want = warp_probs(logits, 0.8, 0.6).topk(k, dim=-1).values
        assert torch.equal(d.store.con[prompt], want), method
        if method == "unispec":
            assert torch.equal(d.cache_con, want[-1])
        tree = DraftTree(torch.tensor([5, 30, 31]), torch.tensor([-1, 0, 0]))
        step_logits = torch.randn(3, vocab, generator=g) * 2
        d.observe(StepResult(tree=tree, logits=step_logits, hidden=None, accepted=torch.tensor([0, 2]),
                             new_tokens=torch.tensor([31, 0])))
        assert torch.equal(d.store.con[tree.tokens], warp_probs(step_logits, 0.8, 0.6).topk(k, dim=-1).values)


def test_ids_outside_the_vocabulary_are_named_not_index_errors():
    store = SuccessorStore(20, 4)
    top = torch.randn(2, 20).topk(4, dim=-1)
    with pytest.raises(StoreError, match=r"outside the vocabulary \[0, 20\), e.g. \[20\]"):
        store.update_topk(torch.tensor([3, 20]), top.indices, top.values)
    with pytest.raises(StoreError, match=r"e.g. \[-1\]"):
        store.update_topk(torch.tensor([3, -1]), top.indices, top.values)
    with pytest.raises(StoreError, match="top-k ids"):
        store.update_topk(torch.tensor([3, 4]), top.indices + 17, top.values)
    with pytest.raises(StoreError, match="rows were asked for"):
        store.rows(torch.tensor([25]))
    assert store.num_filled() == 0                                 # nothing was half-written
    S_tok, S_con = random_store(10, 3, seed=1)
    with pytest.raises(StoreError, match="root token"):
        build_unispec_tree(10, S_tok, S_con, None, None, k=3, depth=2, r=0.0, g=4)
    with pytest.raises(StoreError, match="first-level cache"):
        build_unispec_tree(2, S_tok, S_con, torch.tensor([1, 12]), torch.tensor([0.5, 0.2]), k=3, depth=2,
                           r=0.0, g=4)
    with pytest.raises(UniSpecError, match=r"\[V, k\]"):
        build_unispec_tree(2, S_tok, S_con[:, :2], None, None, k=3, depth=2, r=0.0, g=4)
    # a drafter's begin names the prompt
    for method, cls in (("unispec", UniSpecDrafter), ("recycling", RecyclingDrafter)):
        d = cls(torch.nn.Linear(2, 2), SpecConfig.preset(method, draft_size=4))
        with pytest.raises(StoreError, match="the prompt holds token ids outside the vocabulary"):
            d.begin(torch.tensor([1, 2, 40]), torch.randn(3, 30), None)


def test_a_given_store_of_another_vocabulary_is_refused():
    """A store passed to the drafter is used as it is, or refused with the reason: never silently replaced."""
    for method, cls in (("unispec", UniSpecDrafter), ("recycling", RecyclingDrafter)):
        cfg = SpecConfig.preset(method, draft_size=4)
        logits = torch.randn(3, 30)
        with pytest.raises(StoreError, match="has 31 rows but the target's vocabulary has 30 tokens"):
            cls(torch.nn.Linear(2, 2), cfg, store=SuccessorStore(31, 8)).begin(torch.tensor([1, 2, 3]), logits, None)
        bad = SuccessorStore(30, 8)
        bad.tok[4, 0] = 30
        with pytest.raises(StoreError, match="store given to the"):
            cls(torch.nn.Linear(2, 2), cfg, store=bad).begin(torch.tensor([1, 2, 3]), logits, None)
        mine = SuccessorStore(30, 8)
        d = cls(torch.nn.Linear(2, 2), cfg, store=mine)
        d.begin(torch.tensor([1, 2, 3]), logits, None)
        assert d.store is mine and mine.num_filled() == 3
    with pytest.raises(RecyclingError, match="k >= 8"):
        RecyclingDrafter(torch.nn.Linear(2, 2), SpecConfig.preset("recycling", draft_size=80),
                         store=SuccessorStore(30, 4)).begin(torch.tensor([1]), torch.randn(1, 30), None)


def test_accepted_path_written_last():
    """The same token at an accepted and a rejected node: the accepted node's row must win."""
    vocab, k = 20, 4
    tree_tokens = torch.tensor([5, 9, 9, 3, 9])           # node 1 rejected, node 2 accepted, node 4 rejected
    accepted = torch.tensor([0, 2, 3])
    logits = torch.randn(5, vocab)
    logits[2, 17] = 50.0                                   # the accepted 9's top-1 is 17
    logits[4, 11] = 60.0                                   # the rejected 9's top-1 is 11
    order = accepted_last_order(5, accepted)
    assert order.tolist() == [1, 4, 0, 2, 3]
    store = SuccessorStore(vocab, k)
    store.update(tree_tokens[order], logits[order])
    assert store.tok[9, 0].item() == 17


def test_deployment_store_is_shared_per_target():
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a = deployment_store(m1, "unispec", 30, 4)
    assert deployment_store(m1, "unispec", 30, 4) is a
    assert deployment_store(m2, "unispec", 30, 4) is not a
    assert deployment_store(m1, "recycling", 30, 4) is not a


# ---- plain reference of UniSpec Alg. 1 l.16-30 ----------------------------------------------------

def reference_tree(root, S_tok, S_con, C_tok, C_con, k, d, r, g, confidence, scope):
    """Node-by-node reference. Returns a set of root->node token paths with their scores."""
    nodes = []                                            # dicts: tok, parent (-1 root), depth, score, ins

    def add(tok, parent, depth, score):
        nodes.append(dict(tok=tok, parent=parent, depth=depth, score=score, ins=len(nodes)))
        return len(nodes) - 1

    cand = [(S_tok[root][j], S_con[root][j]) for j in range(len(S_tok[root]))]
    if C_tok is not None:
        cand += [(C_tok[j], C_con[j]) for j in range(len(C_tok))]
    best = {}
    order = sorted(range(len(cand)), key=lambda i: (-cand[i][1], i))
    level = []
    for i in order:
        t, c = cand[i]
        if c == 0 or t in best:
            continue
        best[t] = c
        level.append(add(t, -1, 1, c))

    def frontier_of(level):
        top = sorted(level, key=lambda u: (-nodes[u]["score"], nodes[u]["ins"]))[:k]
        return [u for u in top if nodes[u]["score"] >= r]

    frontier = frontier_of(level)
    for depth in range(2, d + 1):
        if not frontier:
            break
        level = []
        for u in frontier:
            t = nodes[u]["tok"]
            for j in range(len(S_tok[t])):
                p = S_con[t][j]
                if p == 0:
                    continue
                s = nodes[u]["score"] * p if confidence == "path" else p
                level.append(add(S_tok[t][j], u, depth, s))
        frontier = frontier_of(level)

    elig = [u for u in range(len(nodes)) if nodes[u]["score"] > 0
            and (scope == "expand" or nodes[u]["score"] >= r)]
    # best-first growth: a max-heap over the eligible children of taken nodes, keyed by the bottleneck
    # confidence (min score along the path), then depth, then insertion order
    eff = {}
    for u in range(len(nodes)):                            # parents are inserted before children
        p = nodes[u]["parent"]
        eff[u] = nodes[u]["score"] if p == -1 else min(nodes[u]["score"], eff[p])
    key = lambda u: (-eff[u], nodes[u]["depth"], nodes[u]["ins"])
    children = {}
    for u in elig:
        children.setdefault(nodes[u]["parent"], []).append(u)
    heap = [key(u) + (u,) for u in children.get(-1, [])]
    heapq.heapify(heap)
    taken = []
    while heap and len(taken) < g:
        u = heapq.heappop(heap)[-1]
        taken.append(u)
        for c in children.get(u, []):
            heapq.heappush(heap, key(c) + (c,))

    def path(u):
        out = []
        while u != -1:
            out.append(nodes[u]["tok"])
            u = nodes[u]["parent"]
        return tuple(out[::-1])

    return {path(u): nodes[u]["score"] for u in taken}


def tree_paths(tree):
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = {}
    for i in range(1, tree.size):
        path, u = [], i
        while u != 0:
            path.append(toks[u])
            u = par[u]
        out[tuple(path[::-1])] = float(tree.scores[i])
    return out


def random_store(vocab, k, seed, fill=0.7, peaked=True):
    """A store like a real one: distinct successors per row, descending probabilities, some rows empty."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.zeros(vocab, k, dtype=torch.long)
    con = torch.zeros(vocab, k)
    for v in range(vocab):
        if torch.rand(1, generator=g).item() > fill:
            continue
        tok[v] = torch.randperm(vocab, generator=g)[:k]
        # quantised probabilities make exact ties between nodes likely (tests the tie-breaks)
        logits = torch.randn(vocab, generator=g) * (3.0 if peaked else 1.0)
        p = torch.softmax(logits, 0).sort(descending=True).values[:k]
        con[v] = torch.round(p * 64) / 64
    con = torch.sort(con, dim=1, descending=True).values
    return tok, con


@pytest.mark.parametrize("confidence", ["path", "node"])
@pytest.mark.parametrize("scope", ["expand", "expand+select"])
def test_tree_matches_reference_on_random_stores(confidence, scope):
    rng = random.Random(0)
    for trial in range(40):
        vocab, k = rng.choice([(12, 3), (40, 5), (64, 10)])
        d, g = rng.randint(1, 6), rng.choice([1, 3, 8, 25, 60])
        r = rng.choice([0.0, 0.02, 0.05, 0.2])
        S_tok, S_con = random_store(vocab, k, seed=trial, fill=rng.choice([0.5, 0.9, 1.0]))
        use_cache = trial % 3 != 0
        C_tok, C_con = random_store(vocab, k, seed=1000 + trial, fill=1.0)
        C_tok, C_con = (C_tok[0], C_con[0]) if use_cache else (None, None)
        root = rng.randrange(vocab)
        tree = build_unispec_tree(root, S_tok, S_con, C_tok, C_con, k=k, depth=d, r=r, g=g,
                                  confidence=confidence, threshold_scope=scope)
        ref = reference_tree(root, S_tok.tolist(), S_con.tolist(),
                             None if C_tok is None else C_tok.tolist(),
                             None if C_con is None else C_con.tolist(), k, d, r, g, confidence, scope)
        got = tree_paths(tree)
        assert tree.tokens[0].item() == root
        assert set(got) == set(ref), f"trial {trial}"
        for p in got:
            assert math.isclose(got[p], ref[p], rel_tol=1e-6)
        assert tree.num_draft <= g


@pytest.mark.skipif(cpu_kernels.available_portable() is not None,
                    reason=f"the CPU kernels do not run here: {cpu_kernels.available_portable()}")
@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_the_c_tree_is_the_torch_tree_node_for_node(isa, monkeypatch):
    """`kernels.cpu.unispec_tree` (what the drafter runs on a CPU) against `build_unispec_tree`: the same tokens,
    parents and fp32 scores, bitwise, on random stores with many tied confidences (rounded to 1/64, or to a few
    levels) and empty slots, over both confidence modes, both threshold scopes, with and without the first-level
    cache and its root exclusion; an id outside the vocabulary is left to the reference (None). In the library the
    CPU picks, and in the AVX2 build (a CPU without AVX-512: the same C compiled for it)."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)
    if isa == "avx2" and cpu_kernels.builds.library_reason("avx2") is not None:
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu_kernels.cpu_isa()}): "
                    f"{cpu_kernels.builds.library_reason('avx2')}")
    assert isa == "auto" or cpu_kernels.provider("unispec_tree").library == "avx2"
    rng = random.Random(3)
    for trial in range(600):
        vocab, k = rng.choice([(12, 3), (40, 5), (64, 10)])
        S_tok, S_con = random_store(vocab, k, seed=trial, fill=rng.choice([0.5, 0.9, 1.0]))
        if trial % 4 == 0:                                    # few levels: ties everywhere
            S_con = (S_con * 3).round() / 3
        C_tok, C_con = random_store(vocab, k, seed=1000 + trial, fill=1.0)
        C_tok, C_con = (C_tok[0], C_con[0]) if trial % 3 else (None, None)
        root, d, g = rng.randrange(vocab), rng.randint(1, 6), rng.choice([1, 3, 8, 25, 60])
        r = rng.choice([0.0, 0.02, 0.05, 0.2])
        confidence, scope, exclude = rng.choice(["path", "node"]), rng.choice(["expand", "expand+select"]), trial % 2
        ref = build_unispec_tree(root, S_tok, S_con, C_tok, C_con, k=k, depth=d, r=r, g=g, confidence=confidence,
                                 threshold_scope=scope, cache_exclude_root=bool(exclude))
        tok, par, score = cpu_kernels.unispec_tree(root, S_tok, S_con, C_tok, C_con, k=k, depth=d, r=r, g=g,
                                                   path=confidence == "path", exclude_root=bool(exclude),
                                                   min_score=r if scope == "expand+select" else 0.0)
        assert torch.equal(tok, ref.tokens) and torch.equal(par, ref.parents), trial
        assert torch.equal(score, ref.scores.float()), trial
    S_tok, S_con = random_store(12, 3, seed=0)
    assert cpu_kernels.unispec_tree(12, S_tok, S_con, None, None, k=3, depth=2, r=0.0, g=4, path=True,
                                    min_score=0.0, exclude_root=True) is None
    assert cpu_kernels.unispec_tree(1, S_tok, S_con, torch.tensor([3, 99]), torch.tensor([0.5, 0.2]), k=3, depth=2,
                                    r=0.0, g=4, path=True, min_score=0.0, exclude_root=True) is None


@pytest.mark.skipif(cpu_kernels.available_portable() is not None,
                    reason=f"the CPU kernels do not run here: {cpu_kernels.available_portable()}")
def test_the_drafter_drafts_the_same_trees_with_and_without_the_c_tree(monkeypatch):
    """A whole decode: UniSpecDrafter's trees with the C tree (`cpu_kernels=True`) equal the torch ones."""
    from specvocab.engine import generate
    from specvocab.engine.models import load_model
    model = load_model("random-llama", vocab_size=200, hidden_size=32, num_layers=1, seed=2)[0]
    calls = []
    real = cpu_kernels.unispec_tree
    monkeypatch.setattr(cpu_kernels, "unispec_tree", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = list(range(3, 40)) * 2
    runs = [generate(model, ids, method="unispec", max_new_tokens=24, eos_ids=[], draft_size=6, record=True,
                     cpu_kernels=ck, store_persistence="per_prompt") for ck in (True, False)]
    assert len(calls) == runs[0].steps - 1 > 0                    # every step but the last drafted in C
    trees = [[(s.tree_tokens, s.tree_parents) for s in run.records] for run in runs]
    assert trees[0] == trees[1] and runs[0].output_ids.tolist() == runs[1].output_ids.tolist()


def test_selection_is_ancestor_closed_and_topological():
    for seed in range(30):
        S_tok, S_con = random_store(50, 6, seed=seed, fill=1.0, peaked=False)
        for confidence in ("path", "node"):
            tree = build_unispec_tree(seed % 50, S_tok, S_con, S_con[0].long(), S_con[1], k=6, depth=7,
                                      r=0.01, g=20, confidence=confidence)
            par = tree.parents
            assert bool((par[1:] < torch.arange(1, tree.size)).all()) and bool((par[1:] >= 0).all())
            depth = tree.depths()
            assert bool((depth[1:] >= depth[:-1]).all())      # BFS: level by level
            # siblings are distinct tokens (the tree walk's unique-child assumption)
            for kids in tree.children():
                toks = tree.tokens[kids].tolist()
                assert len(toks) == len(set(toks))


def test_node_mode_closure_pulls_in_low_scoring_parents():
    """In "node" mode a child can outscore its parent; the selection must still include the parent."""
    V, k = 10, 2
    S_tok = torch.zeros(V, k, dtype=torch.long)
    S_con = torch.zeros(V, k)
    S_tok[0] = torch.tensor([1, 2]); S_con[0] = torch.tensor([0.30, 0.25])   # root 0 -> 1 (0.3), 2 (0.25)
    S_tok[1] = torch.tensor([3, 4]); S_con[1] = torch.tensor([0.90, 0.05])   # 1 -> 3 (0.9)
    S_tok[2] = torch.tensor([5, 6]); S_con[2] = torch.tensor([0.80, 0.10])   # 2 -> 5 (0.8)
    tree = build_unispec_tree(0, S_tok, S_con, None, None, k=2, depth=2, r=0.05, g=2, confidence="node")
    # best-first: take 1 (.30), which makes 3 (.90) available, then 3
    assert tree_paths(tree) == {(1,): pytest.approx(0.30), (1, 3): pytest.approx(0.90)}
    tree = build_unispec_tree(0, S_tok, S_con, None, None, k=2, depth=2, r=0.05, g=3, confidence="node")
    assert set(tree_paths(tree)) == {(1,), (1, 3), (2,)}
    tree = build_unispec_tree(0, S_tok, S_con, None, None, k=2, depth=2, r=0.05, g=4, confidence="node")
    assert set(tree_paths(tree)) == {(1,), (1, 3), (2,), (2, 5)}
    assert tree.tokens.tolist() == [0, 1, 2, 3, 5] and tree.parents.tolist() == [-1, 0, 0, 1, 2]


def test_confidence_scores_hand_computed():
    """root 7; S[7] = (2: .6, 4: .3); C = (7: .5, 4: .4, 8: .1); S[2] = (9: .5); S[4] = (2: .8); S[9] = (1: .9)."""
    V = 12
    S_tok = torch.zeros(V, 2, dtype=torch.long)
    S_con = torch.zeros(V, 2)
    S_tok[7] = torch.tensor([2, 4]); S_con[7] = torch.tensor([0.6, 0.3])
    S_tok[2] = torch.tensor([9, 0]); S_con[2] = torch.tensor([0.5, 0.0])
    S_tok[4] = torch.tensor([2, 0]); S_con[4] = torch.tensor([0.8, 0.0])
    S_tok[9] = torch.tensor([1, 0]); S_con[9] = torch.tensor([0.9, 0.0])
    C_tok, C_con = torch.tensor([7, 4, 8]), torch.tensor([0.5, 0.4, 0.1])
    # level 1 after dedup (4 keeps max(.3, .4)): 2 .6, 7 .5, 4 .4, 8 .1; frontier (k=2): 2, 7
    expected = {
        "path": {(2,): 0.6, (7,): 0.5, (4,): 0.4, (8,): 0.1,
                 (2, 9): 0.3, (7, 2): 0.3, (7, 4): 0.15,       # frontier {(2,9) .3, (7,2) .3}
                 (2, 9, 1): 0.27, (7, 2, 9): 0.15,              # S[1] is empty; S[9] -> 1
                 (7, 2, 9, 1): 0.135},
        "node": {(2,): 0.6, (7,): 0.5, (4,): 0.4, (8,): 0.1,
                 (2, 9): 0.5, (7, 2): 0.6, (7, 4): 0.3,         # frontier {(7,2) .6, (2,9) .5}
                 (7, 2, 9): 0.5, (2, 9, 1): 0.9,                # frontier {(2,9,1) .9, (7,2,9) .5}
                 (7, 2, 9, 1): 0.9},
    }
    for confidence, want in expected.items():
        got = tree_paths(build_unispec_tree(7, S_tok, S_con, C_tok, C_con, k=2, depth=4, r=0.05, g=50,
                                            confidence=confidence))
        assert set(got) == set(want), confidence
        for p, s in want.items():
            assert got[p] == pytest.approx(s), (confidence, p)
    # without the root's own entry in C (7 is the root): level 1 = 2 .6, 4 .4, 8 .1; frontier {2, 4}
    got = tree_paths(build_unispec_tree(7, S_tok, S_con, C_tok, C_con, k=2, depth=4, r=0.05, g=3,
                                        cache_exclude_root=True))
    assert got == {(2,): pytest.approx(0.6), (4,): pytest.approx(0.4), (4, 2): pytest.approx(0.32)}
    # g = 3 keeps the three best in each mode
    assert set(tree_paths(build_unispec_tree(7, S_tok, S_con, C_tok, C_con, k=2, depth=4, r=0.05, g=3))) \
        == {(2,), (7,), (4,)}


def test_threshold_stops_expansion():
    S_tok, S_con = random_store(30, 5, seed=3, fill=1.0)
    big = build_unispec_tree(0, S_tok, S_con, None, None, k=5, depth=6, r=0.0, g=500)
    small = build_unispec_tree(0, S_tok, S_con, None, None, k=5, depth=6, r=0.99, g=500)
    assert small.depths().max().item() <= 1 < big.depths().max().item()


def test_empty_store_gives_root_only_tree():
    S_tok = torch.zeros(10, 4, dtype=torch.long)
    S_con = torch.zeros(10, 4)
    tree = build_unispec_tree(3, S_tok, S_con, None, None, k=4, depth=5, r=0.05, g=10)
    assert tree.size == 1 and tree.tokens.tolist() == [3]


# ---- Token Recycling template -----------------------------------------------------------------------

def test_recycling_template_shape():
    t = Template(TEMPLATES["tr-default"])
    assert t.size == 80 and int(t.depths.max()) == 6 and t.max_slot == 8
    for g in (1, 5, 17, 53, 79, 80):
        tt = t.truncated(g)
        assert tt.size == g
        assert bool((tt.parents < torch.arange(1, g + 1)).all())       # closed, topological
    chain = t.truncated(6)
    assert chain.slots.tolist() == [0] * 6 and chain.depths.tolist() == [1, 2, 3, 4, 5, 6]


def test_recycling_fill_matches_loop():
    S_tok, S_con = random_store(40, 8, seed=5, fill=0.8)
    t = Template(TEMPLATES["tr-default"])
    for root in range(40):
        tree = fill_template(root, t, S_tok, S_con)
        # reference: walk the template node by node, drop nodes under an empty slot
        toks, alive, score = [root], [True], [1.0]
        for i in range(t.size):
            p = int(t.parents[i])
            tok = int(S_tok[toks[p], t.slots[i]])
            c = float(S_con[toks[p], t.slots[i]])
            toks.append(tok)
            alive.append(alive[p] and c > 0)
            score.append(score[p] * c)
        ref_paths = {}
        for i in range(1, t.size + 1):
            if not alive[i]:
                continue
            path, u = [], i
            while u != 0:
                path.append(toks[u])
                u = int(t.parents[u - 1])
            ref_paths[tuple(path[::-1])] = score[i]
        got = tree_paths(tree)
        assert set(got) == set(ref_paths)
        for p in got:
            assert got[p] == pytest.approx(ref_paths[p])
