"""Tree attention and KV compaction against plain references, on tiny random models of all three archs.

Gemma 3's random model has a sliding window of 16 on 5 of every 6 layers, so prompts of 10-40 tokens
cover caches below, at and beyond the window."""

import re

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from specvocab.engine import kv
from specvocab.engine.harness import forward_tree, generate, prefill
from specvocab.engine.models import load_model
from specvocab.engine.tree import DraftTree
from specvocab.engine.verify import tree_layout
from tests.engine_testing import ARCHS, random_tree, untie_head

VOCAB = 512


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    m, _, _ = load_model(request.param, vocab_size=VOCAB, num_layers=6, seed=3)
    return untie_head(m)


def _plain_logits(model, ids: list[int]) -> torch.Tensor:
    """Last-row logits of a fresh, cache-free forward over ids."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("prompt_len", [5, 15, 16, 17, 40])
def test_tree_logits_match_sequential_runs(model, prompt_len):
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, VOCAB, prompt_len).tolist()
    committed, root = prompt[:-1], prompt[-1]
    with torch.inference_mode():
        cache = kv.new_cache(model)
        prefill(model, torch.tensor(committed), cache)
        tree = random_tree(root, 14, VOCAB, rng)
        _, logits = forward_tree(model, cache, len(committed), tree.tokens, tree.parents)
    for i in range(tree.size):
        path = tree.tokens[tree.path_to(i)].tolist()
        ref = _plain_logits(model, committed + path)
        assert _rel_err(logits[i], ref) < 1e-4, f"node {i} (depth {len(path) - 1})"


def test_tree_layout_matches_draft_tree(model):
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 33):
        tree = random_tree(1, n, VOCAB, rng)
        depths, anc = tree_layout(tree.parents)
        assert torch.equal(depths, tree.depths())
        assert torch.equal(anc, tree.ancestor_mask())


def test_masks_have_the_shapes_each_layer_attends_over(model):
    rng = np.random.default_rng(1)
    with torch.inference_mode():
        cache = kv.new_cache(model)
        prefill(model, torch.tensor(rng.integers(0, VOCAB, 30).tolist()), cache)
        tree = random_tree(1, 6, VOCAB, rng)
        depths, anc = tree_layout(tree.parents)
        masks = kv.tree_attention_masks(model, cache, 30, depths, anc)
    types = kv.layer_types(model.config)
    if isinstance(masks, torch.Tensor):
        assert set(types) == {"full_attention"}
        masks = {"full_attention": masks}
    for t, m in masks.items():
        layer = cache.layers[types.index(t)]
        expected = (min(30, layer.sliding_window - 1) if t == "sliding_attention" else 30) + 6
        assert m.shape == (1, 1, 6, expected)
        # the root row sees every committed column it may see and, in the tree, only itself
        assert (m[0, 0, 0, -6:] == 0).tolist() == [True] + [False] * 5


def _run_steps(model, rng, prompt_len: int, num_steps: int):
    """Prefill, then random trees with random accepted paths; returns the cache and the committed ids."""
    prompt = rng.integers(0, VOCAB, prompt_len).tolist()
    committed, root = prompt[:-1], prompt[-1]
    cache = kv.new_cache(model)
    prefill(model, torch.tensor(committed), cache)
    for _ in range(num_steps):
        tree = random_tree(root, int(rng.integers(1, 12)), VOCAB, rng)
        forward_tree(model, cache, len(committed), tree.tokens, tree.parents)
        path = tree.path_to(int(rng.integers(0, tree.size)))  # any root path may be the accepted one
        new_len = kv.compact(cache, len(committed), tree.size, path)
        committed += tree.tokens[path].tolist()
        assert new_len == len(committed)
        root = int(rng.integers(0, VOCAB))                       # the bonus token
    return cache, committed, root


@pytest.mark.parametrize("prompt_len,num_steps", [(4, 3), (12, 6), (30, 5)])
def test_compaction_equals_fresh_prefill(model, prompt_len, num_steps):
    rng = np.random.default_rng(prompt_len * 7 + num_steps)
    with torch.inference_mode():
        cache, committed, root = _run_steps(model, rng, prompt_len, num_steps)
        fresh = kv.new_cache(model)
        prefill(model, torch.tensor(committed), fresh)
        for i, (a, b) in enumerate(zip(cache.layers, fresh.layers)):
            assert type(a) is type(b)
            assert a.keys.shape == b.keys.shape, f"layer {i}"
            assert a.get_seq_length() == b.get_seq_length() == len(committed)
            if isinstance(a, DynamicSlidingWindowLayer):
                assert a.keys.shape[-2] == min(len(committed), a.sliding_window - 1)
            assert _rel_err(a.keys, b.keys) < 1e-5 and _rel_err(a.values, b.values) < 1e-5, f"layer {i}"
        # and the next tree sees the same context through both caches
        tree = random_tree(root, 9, VOCAB, rng)
        _, got = forward_tree(model, cache, len(committed), tree.tokens, tree.parents)
        _, want = forward_tree(model, fresh, len(committed), tree.tokens, tree.parents)
    assert _rel_err(got, want) < 1e-5
    ref = _plain_logits(model, committed + [root])
    assert _rel_err(got[0], ref) < 1e-4


def test_compaction_rejects_a_cache_out_of_step(model):
    with torch.inference_mode():
        cache = kv.new_cache(model)
        prefill(model, torch.arange(10), cache)
        with pytest.raises(kv.CacheError, match="out of step"):
            kv.compact(cache, 7, 1, [0])


def test_unsupported_layer_types_are_refused():
    m, _, _ = load_model("random-qwen3", vocab_size=VOCAB, num_layers=2)
    m.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(kv.CacheError, match="chunked_attention"):
        kv.new_cache(m)


@pytest.mark.parametrize("prompt_len", [6, 30])
def test_a_chain_deeper_than_the_sliding_window(model, prompt_len):
    """20 nodes in a chain: on Gemma the deepest nodes must not see the root (window 16)."""
    rng = np.random.default_rng(99)
    prompt = rng.integers(0, VOCAB, prompt_len).tolist()
    chain = rng.integers(0, VOCAB, 19).tolist()
    with torch.inference_mode():
        cache = kv.new_cache(model)
        prefill(model, torch.tensor(prompt[:-1]), cache)
        tree = DraftTree.chain(prompt[-1], chain)
        _, logits = forward_tree(model, cache, prompt_len - 1, tree.tokens, tree.parents)
        # a chain verified as a tree equals the same tokens run as plain causal input
        ref = model(torch.tensor([prompt + chain])).logits[0, prompt_len - 1:].float()
    assert _rel_err(logits, ref) < 1e-4


def test_eager_attention_takes_the_same_masks():
    for name in ARCHS:
        m, _, _ = load_model(name, vocab_size=VOCAB, num_layers=6, seed=4)
        m.set_attn_implementation("eager")
        rng = np.random.default_rng(5)
        prompt = rng.integers(0, VOCAB, 25).tolist()
        with torch.inference_mode():
            cache = kv.new_cache(m)
            prefill(m, torch.tensor(prompt[:-1]), cache)
            tree = random_tree(prompt[-1], 10, VOCAB, rng)
            _, logits = forward_tree(m, cache, 24, tree.tokens, tree.parents)
        for i in range(tree.size):
            ref = _plain_logits(m, prompt[:-1] + tree.tokens[tree.path_to(i)].tolist())
            assert _rel_err(logits[i], ref) < 1e-4, f"{name} node {i}"


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged|sdpa"])
def test_attention_that_ignores_the_tree_mask_is_refused_before_any_forward(impl):
    """Flash-attention builds its own causal mask and would verify a tree as one chain: the hf backend
    refuses it (the native backend runs its own attention and never reads the implementation)."""
    model, _, _ = load_model("random-gemma3", vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=1)
    model.config._attn_implementation = impl
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(kv.AttentionImplementationError, match=rf"{re.escape(impl)}.*4D.*sdpa"):
            generate(model, list(range(10)), method="pld", max_new_tokens=4, eos_ids=[], backend="hf")
        with pytest.raises(kv.AttentionImplementationError, match="set_attn_implementation"):
            kv.new_cache(model)
    finally:
        hook.remove()
    assert forwards == []


def test_eager_attention_verifies_trees_like_sdpa():
    model, _, _ = load_model("random-llama", vocab_size=VOCAB, num_layers=3, seed=2)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 12).tolist()
    tree = random_tree(prompt[-1], 9, VOCAB, rng)
    out = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == impl
        with torch.inference_mode():
            cache = kv.new_cache(model)
            prefill(model, torch.tensor(prompt[:-1]), cache)
            out[impl] = forward_tree(model, cache, len(prompt) - 1, tree.tokens, tree.parents)[1]
    assert _rel_err(out["eager"], out["sdpa"]) < 1e-5
    path = tree.tokens[tree.path_to(tree.size - 1)].tolist()
    assert _rel_err(out["eager"][-1], _plain_logits(model, prompt[:-1] + path)) < 1e-4
