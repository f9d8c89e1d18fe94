"""Real offline models (slow): layerskip and eagle (the head shipped for the model) with every draft-vocabulary
policy - dynaspec too for eagle where a router fit ships beside the head - decode exactly what autoregressive
greedy decoding does, on SmolLM2-135M-Instruct (49k vocab, chat template) and Gemma-3-270M (262k vocab,
sliding-window layers, scaled embeddings). One Spec-Bench prompt, 10 new tokens, small trees (the point is the
token-for-token check, not speed)."""

import numpy as np
import pytest

from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate
from specvocab.engine.prompts import encode_prompt, load_prompts
from specvocab.engine.resolve import resolve_run
from specvocab.engine.shipped import SHIPPED_HEADS
from specvocab.locality.shortlist import count_tokens, save_ranking

POLICIES = [dict(vocab="full"), dict(vocab="frspec", frspec_k=2048), dict(vocab="microspec", w_max=512),
            dict(vocab="oracle", w_max=512)]
SMALL_TREE = dict(eagle_depth=3, eagle_topk=4, draft_size=9, max_new_tokens=10, eos_ids=[])


def _case(loaded, layers, tmp_path_factory, name):
    model, tok, info = loaded
    prompts = load_prompts("spec_bench", per_category=1)
    encoded = [encode_prompt(tok, info, p.turns[:1], []) for p in prompts]
    ids = min(encoded, key=len)                               # the shortest prompt of one per category
    # an FR-Spec-style ranking counted over the other prompts' tokens (a stand-in for corpus counts)
    path = save_ranking(count_tokens([np.asarray(e) for e in encoded], info.vocab_size),
                        tmp_path_factory.mktemp(name) / "ranking.parquet", tokenizer=info.tokenizer_name)
    ar = generate(model, ids, method="ar", tokenizer=tok, info=info, **{k: v for k, v in SMALL_TREE.items()
                                                                         if k in ("max_new_tokens", "eos_ids")})
    return model, tok, info, ids, str(path), ar.output_ids.tolist(), layers


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def case(request, tmp_path_factory):
    loaded = request.getfixturevalue(request.param)
    layers = "skip:12,14,16,18" if request.param == "smollm2" else "skip:8,10"
    return _case(loaded, layers, tmp_path_factory, request.param)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["layerskip", "eagle"])
def test_real_models_lossless_every_policy(case, method):
    model, tok, info, ids, ranking, ar, layers = case
    extra = dict(drafter_layers=layers) if method == "layerskip" else {}      # eagle: the shipped head
    # dynaspec where a router fit ships beside the model's head (engine/heads/<model>/dynaspec-eagle.*)
    fitted = any((SHIPPED_HEADS / info.name).glob("dynaspec-eagle*.safetensors"))
    policies = POLICIES + ([dict(vocab="dynaspec")] if method == "eagle" and fitted else [])
    for policy in policies:
        if policy["vocab"] == "dynaspec":               # the fit the run's one resolution picks: the shipped one
            tree = {k: v for k, v in SMALL_TREE.items() if k != "eos_ids"}
            fit = resolve_run(SpecConfig.preset(method, vocab="dynaspec", **tree), model).vocab_file
            policy = {**policy, "dynaspec_file": fit}
        out = generate(model, ids, method=method, tokenizer=tok, info=info, frequency_file=ranking,
                       **{**SMALL_TREE, **extra, **policy})
        T = extra.get("max_new_tokens", SMALL_TREE["max_new_tokens"])
        assert out.output_ids.tolist() == ar[:T], (method, policy)
        if policy["vocab"] == "full":
            assert out.tau > 1.2, method                      # the drafter does get tokens accepted
