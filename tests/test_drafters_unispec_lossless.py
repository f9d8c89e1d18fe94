"""Token Recycling and UniSpec through the harness: greedy output == autoregressive output, token for token.

Tiny random models of all three architectures with many random prompts and configurations (draft sizes,
both confidence variants, with and without the broadened first level, both threshold scopes, store per
deployment and per prompt); a store given by the user is used or refused, never replaced; prompt ids outside
the vocabulary are refused by name; then SmolLM2 on two Spec-Bench prompts (slow)."""

import itertools

import numpy as np
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.recycling import RecyclingDrafter
from specvocab.engine.drafters.unispec import UniSpecDrafter
from specvocab.engine.harness import ContextError, generate
from specvocab.engine.models import load_model
from specvocab.engine.prompts import encode_prompt, load_prompts
from specvocab.engine.store import StoreError, SuccessorStore

ARCHS = ("random-llama", "random-gemma3", "random-qwen3")


@pytest.fixture(scope="module", params=ARCHS)
def random_model(request):
    model, _, info = load_model(request.param, vocab_size=384, hidden_size=48, num_layers=2, seed=3)
    return model, info


def test_registry_builds_both_drafters(random_model):
    model, _ = random_model
    assert isinstance(make_drafter(model, SpecConfig.preset("unispec", draft_size=4)), UniSpecDrafter)
    assert isinstance(make_drafter(model, SpecConfig.preset("recycling", draft_size=80)), RecyclingDrafter)


def test_lossless_on_random_models(random_model):
    model, info = random_model
    rng = np.random.default_rng(0)
    variants = list(itertools.product(
        ["unispec", "recycling"], [1, 5, 30], ["path", "node"], [True, False],
        ["expand", "expand+select"], ["deployment", "per_prompt"]))
    rng.shuffle(variants)
    accepted_drafts = 0
    for i, (method, g, conf, broaden, scope, persist) in enumerate(variants[:24]):
        L = int(rng.integers(1, 48))
        # prompts with repeats (as in real text) and without
        base = rng.integers(0, info.vocab_size, L // 3)
        prompt = torch.tensor(np.concatenate([base, base, rng.integers(0, info.vocab_size, L - 2 * base.size)])
                              if i % 2 else rng.integers(0, info.vocab_size, L))
        T = int(rng.integers(8, 40))
        ar = generate(model, prompt, method="ar", max_new_tokens=T, eos_ids=[])
        cfg = SpecConfig.preset(method, max_new_tokens=T, confidence=conf, broaden_first_level=broaden,
                                threshold_scope=scope, store_persistence=persist,
                                draft_size=None if (method == "recycling" and g == 30) else g)
        out = generate(model, prompt, cfg, eos_ids=[])
        assert out.output_ids.tolist() == ar.output_ids.tolist(), (method, g, conf, broaden, scope, persist)
        accepted_drafts += out.new_tokens - out.steps
    assert accepted_drafts > 0                      # the drafters did draft tokens the target accepted


def test_stops_at_eos_like_ar(random_model):
    model, info = random_model
    prompt = torch.arange(5, 25)
    ar = generate(model, prompt, method="ar", max_new_tokens=30, eos_ids=[])
    eos = ar.output_ids[10].item()                   # a token the model does emit
    ar_eos = generate(model, prompt, method="ar", max_new_tokens=30, eos_ids=[eos])
    for method in ("unispec", "recycling"):
        out = generate(model, prompt, method=method, max_new_tokens=30, eos_ids=[eos], draft_size=12)
        assert out.output_ids.tolist() == ar_eos.output_ids.tolist() and out.stop_reason == "eos"


def test_store_persists_per_deployment_and_resets_per_prompt(random_model):
    model, info = random_model
    prompt = torch.arange(40, 70)
    cfg = SpecConfig.preset("unispec", draft_size=8, max_new_tokens=10, store_persistence="per_prompt")
    d = make_drafter(model, cfg)
    generate(model, prompt, cfg, drafter=d, eos_ids=[])
    filled = d.store.num_filled()
    generate(model, torch.arange(100, 103), cfg, drafter=d, eos_ids=[])
    assert d.store.num_filled() < filled             # reset, then only the short prompt + 10 tokens
    dep = SpecConfig.preset("unispec", draft_size=8, max_new_tokens=10)
    d1, d2 = make_drafter(model, dep), make_drafter(model, dep)
    generate(model, prompt, dep, drafter=d1, eos_ids=[])
    generate(model, torch.arange(100, 103), dep, drafter=d2, eos_ids=[])
    assert d2.store is d1.store                      # one store per (model, method): hot start
    assert d2.store.num_filled() >= filled


def test_scores_reach_the_harness_records(random_model):
    model, _ = random_model
    out = generate(model, torch.arange(10, 40), method="unispec", draft_size=6, max_new_tokens=12,
                   eos_ids=[], record=True)
    assert out.records
    for rec in out.records:
        assert rec.tree_scores[0] == 1.0 and len(rec.tree_scores) == len(rec.tree_tokens) <= 7
        assert all(0 < s <= 1 for s in rec.tree_scores)


def test_a_given_store_is_used_or_refused(random_model):
    """A store passed to the drafter is the one it fills (and output stays lossless); one of another
    vocabulary is refused with the reason instead of being silently swapped for the deployment store."""
    model, info = random_model
    prompt = torch.arange(40, 70)
    ar = generate(model, prompt, method="ar", max_new_tokens=16, eos_ids=[])
    for method, cls in (("unispec", UniSpecDrafter), ("recycling", RecyclingDrafter)):
        cfg = SpecConfig.preset(method, draft_size=8, max_new_tokens=16)
        mine = SuccessorStore(info.vocab_size, cfg.store_k)
        d = cls(model, cfg, store=mine)
        out = generate(model, prompt, cfg, drafter=d, eos_ids=[])
        assert out.output_ids.tolist() == ar.output_ids.tolist(), method
        assert d.store is mine and mine.num_filled() > 0
        other = cls(model, cfg, store=SuccessorStore(info.vocab_size + 7, cfg.store_k))
        with pytest.raises(StoreError, match=f"vocabulary has {info.vocab_size} tokens"):
            generate(model, prompt, cfg, drafter=other, eos_ids=[])


def test_prompt_ids_outside_the_vocabulary_are_refused(random_model):
    model, info = random_model
    for method, g in (("ar", None), ("unispec", 4), ("recycling", 4)):
        for bad in (info.vocab_size, -1):
            with pytest.raises(ContextError, match=rf"outside the model's vocabulary \[0, {info.vocab_size}\)"):
                generate(model, [5, 6, bad, 7], method=method, max_new_tokens=4, eos_ids=[], draft_size=g)


@pytest.mark.slow
def test_lossless_on_smollm2(smollm2):
    model, tok, info = smollm2
    prompts = load_prompts("spec_bench", categories=["summarization", "coding"], per_category=1)
    for i, p in enumerate(prompts):
        ids = torch.tensor(encode_prompt(tok, info, p.turns[:1], [], max_new_tokens=24))
        ar = generate(model, ids, method="ar", max_new_tokens=24, eos_ids=[])
        # the whole 80-node template on the first prompt (slow on a CPU), a truncated one on the second
        for method, g in (("unispec", 10), ("recycling", None if i == 0 else 16)):
            out = generate(model, ids, method=method, max_new_tokens=24, eos_ids=[], draft_size=g)
            assert out.output_ids.tolist() == ar.output_ids.tolist(), (p.prompt_id, method)
