"""The merged-tree drafter (`engine.drafters.merged`): one verify tree from a draft head and the n-gram drafters.

- the tree: `merge_trees` equals a plain reference - best-first ranking by growth, one node at a time to the best
  marginal gain, the union as a set of token paths - on random trees over a tiny vocabulary (many shared paths);
- the share follows the profiles, and a measured profile moves it;
- lossless: greedy output == `ar` on random models of three architectures (every source set, head and vocabulary
  policy) and on SmolLM2 (slow); sampled output follows the target's exact distribution (chi-square);
- attribution: `accepted_by_<source>` sums to the committed draft tokens, each counted for a source whose own tree
  held that token path;
- bad input: unknown or repeated sources, two heads, a head that does not ship for the model - each a clear error.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.merged import (PRIOR_WEIGHT, MergedDrafter, MergeError, merge_trees, parse_sources,
                                              profile_from_curve)
from specvocab.engine.harness import generate
from specvocab.engine.metrics import ROW_SCHEMA
from specvocab.engine.models import load_model
from specvocab.engine.prompts import encode_prompt, load_prompts
from specvocab.engine.tree import DraftTree
from specvocab.engine.verify import warp_probs
from specvocab.sweeps.tables import AVG, TARGET_PART, tau_by_source
from tests.engine_testing import untie_head
from tests.sampling_stats import assert_fits, assert_rejects

ARCHS = ("random-llama", "random-gemma3", "random-qwen3")


@pytest.fixture(scope="module", params=ARCHS)
def random_model(request):
    model, _, info = load_model(request.param, vocab_size=384, hidden_size=48, num_layers=2, seed=3)
    return model, info


# --- the tree against a plain reference ---------------------------------------------------------------------------

def _random_source_tree(root: int, n: int, vocab: int, rng) -> DraftTree:
    """A tree of n nodes over a tiny vocabulary, scores decreasing along paths or not (UniSpec's "node" mode)."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = [root] + rng.integers(0, vocab, n - 1).tolist()
    scores = [1.0] + rng.random(n - 1).round(1).tolist()      # rounded: ties in the ranking happen
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores))


def _reference_ranking(tree: DraftTree) -> list[int]:
    """Best-first growth: repeatedly take the best-scored node whose parent is taken (ties: shallower, then lower
    index)."""
    par, sc, n = tree.parents.tolist(), tree.scores.tolist(), tree.size
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[par[i]] + 1
    taken, order = {0}, []
    while len(order) < n - 1:
        ready = [i for i in range(1, n) if i not in taken and par[i] in taken]
        best = min(ready, key=lambda i: (-sc[i], depth[i], i))
        taken.add(best)
        order.append(best)
    return order


def _path(tree: DraftTree, node: int) -> tuple[int, ...]:
    tok = tree.tokens.tolist()
    return tuple(tok[i] for i in tree.path_to(node))


def _reference_union(trees, gains, g):
    """The token paths of the merged tree in the order they enter, and the source that brought each."""
    ranks = [_reference_ranking(t) for t in trees]
    placed = [0] * len(trees)
    paths, owners = [], []
    while len(paths) < g:
        live = [s for s in range(len(trees)) if placed[s] < len(ranks[s])]
        if not live:
            break
        value = {s: (gains[s][placed[s]] if placed[s] < len(gains[s]) else 0.0) for s in live}
        top = max(value.values())
        fewest = min(placed[s] for s in live if value[s] == top)
        s = min(s for s in live if value[s] == top and placed[s] == fewest)
        path = _path(trees[s], ranks[s][placed[s]])
        placed[s] += 1
        if path not in paths:
            paths.append(path)
            owners.append(s)
    return paths, owners


def test_merge_trees_equals_the_plain_union():
    rng = np.random.default_rng(0)
    shared = 0
    for case in range(300):
        k = int(rng.integers(1, 4))
        trees = [_random_source_tree(7, int(rng.integers(1, 12)), 3, rng) for _ in range(k)]
        gains = [rng.random(int(rng.integers(0, 12))).round(1).tolist() for _ in range(k)]
        g = int(rng.integers(1, 20))
        merged = merge_trees(trees, gains, g)
        want_paths, want_owners = _reference_union(trees, gains, g)
        tree = merged.tree
        got = [_path(tree, i) for i in range(1, tree.size)]
        assert got == want_paths, case
        assert merged.owner.tolist() == [-1] + want_owners, case
        assert len(set(got)) == len(got)                              # a token path appears once
        assert (tree.parents[1:] < torch.arange(1, tree.size)).all()  # topological
        shared += sum(t.size - 1 for t in trees) > tree.size - 1 and tree.size - 1 < g
    assert shared > 20                                                # duplicates did occur and were merged


def test_shared_prefixes_are_one_node():
    """Two chains that share their first two tokens: 2 + 1 + 1 nodes, not 3 + 3."""
    a = DraftTree.chain(5, [1, 2, 3])
    b = DraftTree.chain(5, [1, 2, 4])
    merged = merge_trees([a, b], [[0.9, 0.8, 0.7], [0.9, 0.8, 0.7]], g=6)
    assert merged.tree.tokens.tolist() == [5, 1, 2, 3, 4]
    assert merged.tree.parents.tolist() == [-1, 0, 1, 2, 2]
    assert merged.owner.tolist() == [-1, 0, 0, 0, 1]


def test_the_share_follows_the_profiles():
    """A source whose first node is likely but whose next ones are not gets one node; the other the rest."""
    a = DraftTree.chain(0, [1, 2, 3, 4, 5, 6])
    b = DraftTree.chain(0, [7, 8, 9, 10, 11, 12])
    merged = merge_trees([a, b], [[0.9, 0.05, 0.05, 0.05, 0.05, 0.05], [0.6] * 6], g=6)
    assert merged.owner.tolist() == [-1, 0, 1, 1, 1, 1, 1]
    merged = merge_trees([a, b], [[0.9] * 6, [0.6] * 6], g=6)           # a outbids b at every rank
    assert merged.owner.tolist() == [-1] + [0] * 6


def test_profile_from_a_calibration_curve():
    """a(r) = tau(r) - tau(r - 1), tau linear between measured sizes from tau(0) = 1, flat past the grid."""
    a = profile_from_curve([2, 4], [1.6, 1.8], 6)
    np.testing.assert_allclose(a, [0.3, 0.3, 0.1, 0.1, 0.0, 0.0])
    assert profile_from_curve([4, 2], [1.8, 1.6], 6) == a            # the order of the grid does not matter
    assert profile_from_curve([2, 4], [1.6, 1.5], 4)[2:] == [0.0, 0.0]   # a noisy drop counts as nothing


def test_a_measured_profile_moves_the_share(random_model):
    """After steps where only one source's nodes were accepted, its later nodes outbid the other's prior."""
    model, _ = random_model
    cfg = SpecConfig.preset("merged", draft_size=4, merge_sources="pld+unispec")
    d = MergedDrafter(model, cfg, profiles={"pld": [0.5] * 4, "unispec": [0.5] * 4})
    d.placed[:] = 10
    d.hits[1] = 10                                     # unispec's nodes always accepted, pld's never
    gains = d.gains()
    np.testing.assert_allclose(gains[0], [(0 + PRIOR_WEIGHT * 0.5) / (10 + PRIOR_WEIGHT)] * 4)
    np.testing.assert_allclose(gains[1], [(10 + PRIOR_WEIGHT * 0.5) / (10 + PRIOR_WEIGHT)] * 4)
    a, b = DraftTree.chain(0, [1, 2, 3, 4]), DraftTree.chain(0, [5, 6, 7, 8])
    assert merge_trees([a, b], gains, 4).owner.tolist() == [-1, 1, 1, 1, 1]


# --- lossless -----------------------------------------------------------------------------------------------------

def _repeating_prompt(rng, vocab, length):
    base = rng.integers(0, vocab, max(1, length // 3))
    return torch.tensor(np.concatenate([base, base, rng.integers(0, vocab, length - 2 * base.size)]))


CASES = [("eagle3+pld+unispec", "full", 6), ("eagle+pld+unispec", "microspec", 4), ("eagle3+unispec", "microspec", 9),
         ("pld+eagle", "full", 3), ("unispec+pld", "full", 12), ("eagle3", "oracle", 5)]


def test_greedy_equals_ar_on_random_models(random_model):
    model, info = random_model
    rng = np.random.default_rng(1)
    accepted = 0
    for sources, vocab, g in CASES:
        prompt = _repeating_prompt(rng, info.vocab_size, int(rng.integers(4, 40)))
        T = int(rng.integers(8, 32))
        ar = generate(model, prompt, method="ar", max_new_tokens=T, eos_ids=[])
        cfg = SpecConfig.preset("merged", max_new_tokens=T, draft_size=g, merge_sources=sources, vocab=vocab,
                                w_max=64, eagle_head="random", eagle3_head="random")
        out = generate(model, prompt, cfg, eos_ids=[])
        assert out.output_ids.tolist() == ar.output_ids.tolist(), (sources, vocab, g)
        accepted += int(out.drafter_stats["accepted_draft_tokens"])
    assert accepted > 0


def test_attribution_sums_to_the_committed_drafts_and_names_a_proposer(random_model):
    """Every committed draft token is counted once, for a source whose own tree held its token path (a token path
    only one source proposed is that source's); the sum is the committed draft tokens the records show."""
    model, info = random_model
    rng = np.random.default_rng(2)
    for sources in ("eagle3+pld+unispec", "eagle+pld"):
        cfg = SpecConfig.preset("merged", max_new_tokens=29, draft_size=5, merge_sources=sources, record=True,
                                eagle_head="random", eagle3_head="random")
        drafter = make_drafter(model, cfg)
        proposed = []                                      # per step: {source: set of token paths it proposed}
        for name, sub in zip(drafter.sources, drafter.drafters):
            def spy(ids, _propose=sub.propose, _name=name):
                tree = _propose(ids)
                if _name == drafter.sources[0]:
                    proposed.append({})
                proposed[-1][_name] = {_path(tree, i) for i in range(1, tree.size)}
                return tree
            sub.propose = spy
        prompt = _repeating_prompt(rng, info.vocab_size, 30)
        out = generate(model, prompt, cfg, drafter=drafter, eos_ids=[])
        want = {s: 0 for s in drafter.sources}
        for rec, kept, paths in zip(out.records, out.step_sizes[1:], proposed):
            tree = DraftTree(torch.tensor(rec.tree_tokens), torch.tensor(rec.tree_parents))
            for node in rec.accepted[1: 1 + min(len(rec.accepted) - 1, kept)]:
                path = _path(tree, node)
                holders = [s for s in drafter.sources if path in paths[s]]
                assert holders, path
                if len(holders) == 1:
                    want[holders[0]] += 1
        stats = out.drafter_stats
        committed = sum(min(len(r.accepted) - 1, k) for r, k in zip(out.records, out.step_sizes[1:]))
        assert sum(stats[f"accepted_by_{s}"] for s in drafter.sources) == stats["accepted_draft_tokens"] == committed
        assert committed == out.new_tokens - out.steps + (out.step_sizes[-1] < len(out.records[-1].accepted))
        for s in drafter.sources:                          # at least the tokens only s proposed
            assert stats[f"accepted_by_{s}"] >= want[s], (sources, s)
        assert committed > 0 and max(want.values()) > 0


def test_sampled_generations_follow_the_target():
    """First two sampled tokens over 600 seeds vs the exact joint distribution (64 cells, some impossible under
    top-p), the merged drafter (PLD and UniSpec: the tree's sources are all point-mass proposers, the head's too;
    greedy tests above cover the head) drafting; power: the counts reject the target at T = 1.3."""
    model, _, info = load_model("random-gemma3", vocab_size=8, hidden_size=32, num_layers=2, seed=5)
    model = untie_head(model, scale=2.0)
    temperature, top_p, length, v = 1.0, 0.9, 2, 8
    prompt = [1, 5, 2, 7, 1, 5, 2, 7, 3, 1, 5, 2, 7, 3, 6, 0, 4, 1, 5, 2]

    def joint(t):
        out = np.ones(1)
        with torch.inference_mode():
            for depth in range(length):
                prefixes = [prompt + [(c // v ** j) % v for j in reversed(range(depth))] for c in range(v ** depth)]
                p = warp_probs(model(torch.tensor(prefixes)).logits[:, -1], t, top_p).double().numpy()
                out = (out[:, None] * p / p.sum(-1, keepdims=True)).reshape(-1)
        return out

    base = SpecConfig.preset("merged", max_new_tokens=length, temperature=temperature, top_p=top_p, draft_size=4,
                             merge_sources="pld+unispec", store_k=4)
    drafter = make_drafter(model, base)
    counts, drafted = np.zeros(v ** length, dtype=np.int64), 0
    for seed in range(600):
        out = generate(model, prompt, base.replace(seed=seed), info=info, drafter=drafter, eos_ids=[])
        ids = out.output_ids.tolist()
        counts[ids[0] * v + ids[1]] += 1
        drafted += out.draft_tokens
    assert drafted > 0
    assert_fits(counts, joint(temperature), "merged: first 2 tokens")
    assert_rejects(counts, joint(1.3), "merged vs T = 1.3")


@pytest.mark.slow
def test_greedy_equals_ar_on_smollm2(smollm2):
    model, tok, info = smollm2
    prompts = load_prompts("spec_bench", categories=["summarization", "coding"], per_category=1)
    for p, (sources, vocab) in zip(prompts, [("eagle3+pld+unispec", "full"), ("eagle+pld+unispec", "microspec")]):
        ids = torch.tensor(encode_prompt(tok, info, p.turns[:1], [], max_new_tokens=24))
        ar = generate(model, ids, method="ar", max_new_tokens=24, eos_ids=[])
        out = generate(model, ids, method="merged", max_new_tokens=24, eos_ids=[], draft_size=7,
                       merge_sources=sources, vocab=vocab)
        assert out.output_ids.tolist() == ar.output_ids.tolist(), (p.prompt_id, sources)
        assert out.drafter_stats["accepted_draft_tokens"] > 0


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [("eagle3+ngram", "unknown source"), ("", "no source"),
                                         ("pld+pld", "twice"), ("eagle3+eagle+pld", "two draft heads")])
def test_bad_source_lists_are_named(text, words):
    with pytest.raises(MergeError, match=words):
        parse_sources(text)


@pytest.mark.parametrize("sources, missing", [("eagle3+pld", "EAGLE-3 head"), ("eagle+unispec", "EAGLE-2 head")])
def test_a_head_that_does_not_ship_is_named(random_model, sources, missing):
    model, _ = random_model
    with pytest.raises(MergeError, match=missing):
        make_drafter(model, SpecConfig.preset("merged", draft_size=4, merge_sources=sources))


# --- the bench rows and the tau-by-source table -----------------------------------------------------------------

def test_tau_by_source_splits_each_run_by_the_rows_counts():
    """Each merged run's part of source s is sum accepted_by_s / sum steps, the target's the rest of tau; a source
    run alone is all its own; the avg task is the mean over tasks. Rows as the bench writes them (`ROW_SCHEMA`)."""
    def row(method, category, steps, new, **acc):
        return {"model": "m", "prompt_set": "spec_bench", "method": method, "policy": "full", "category": category,
                "prompt_id": category, "turn": 0, "repeat": 0, "steps": steps, "new_tokens": new, "tokens_per_s": 1.0,
                "wall_s": 1.0, **{f"accepted_by_{s}": n for s, n in acc.items()}}
    rows = [row("merged", "qa", 10, 25, eagle3=6, pld=3, unispec=5), row("merged", "qa", 6, 14, eagle3=1, pld=4,
                                                                         unispec=3),
            row("merged", "rag", 8, 20, eagle3=2, pld=0, unispec=9), row("pld", "qa", 12, 18), row("pld", "rag", 9, 16),
            row("ar", "qa", 16, 16)]
    frame = pl.DataFrame([{k: r.get(k) for k in ROW_SCHEMA} for r in rows], schema=ROW_SCHEMA)
    parts = tau_by_source(frame)
    got = {(r["task"], r["method"], r["source"]): r["tau_part"] for r in parts.iter_rows(named=True)}
    assert got[("qa", "merged", "eagle3")] == pytest.approx(7 / 16)
    assert got[("qa", "merged", "pld")] == pytest.approx(7 / 16)
    assert got[("qa", "merged", "unispec")] == pytest.approx(8 / 16)
    assert got[("qa", "merged", TARGET_PART)] == pytest.approx(39 / 16 - 22 / 16)
    assert got[("qa", "pld", "pld")] == pytest.approx(18 / 12 - 1) and got[("qa", "pld", TARGET_PART)] == 1.0
    assert got[(AVG, "merged", "unispec")] == pytest.approx((8 / 16 + 9 / 8) / 2)
    assert ("qa", "merged", "eagle") not in got and not parts.filter(pl.col("method") == "ar").height
    for (task, method), part in parts.group_by("task", "method"):
        assert part["tau_part"].sum() == pytest.approx(part["tau"][0])      # the parts make up tau


def test_the_unispec_source_keeps_a_store_apart_from_plain_unispec(random_model):
    """Interleaved in one process (a bench runs every method on a prompt in turn), a plain unispec run must not
    hand the merged tree's UniSpec source the rows it stored for the same prompt, nor take its rows."""
    model, info = random_model
    prompt = torch.arange(1, 30) % 17
    plain = make_drafter(model, SpecConfig.preset("unispec", draft_size=4))
    generate(model, prompt, SpecConfig.preset("unispec", draft_size=4, max_new_tokens=6), drafter=plain, eos_ids=[])
    merged = make_drafter(model, SpecConfig.preset("merged", draft_size=4, merge_sources="pld+unispec"))
    generate(model, prompt, SpecConfig.preset("merged", draft_size=4, max_new_tokens=6, merge_sources="pld+unispec"),
             drafter=merged, eos_ids=[])
    source = merged.drafters[merged.sources.index("unispec")]
    assert source.store is not plain.store
    again = make_drafter(model, SpecConfig.preset("merged", draft_size=4, merge_sources="pld+unispec"))
    generate(model, prompt, SpecConfig.preset("merged", draft_size=4, max_new_tokens=6, merge_sources="pld+unispec"),
             drafter=again, eos_ids=[])
    assert again.drafters[again.sources.index("unispec")].store is source.store      # its own, per deployment
