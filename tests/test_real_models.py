"""The real offline models (SmolLM2-135M-Instruct: Llama; Gemma-3-270M: sliding-window layers, W = 512) on
Spec-Bench prompts, 24 new tokens: every method equals plain greedy decoding token for token. Gemma's
summarization prompt (688 tokens) runs past its sliding window."""

import pytest
import torch

from specvocab.engine import SpecConfig, generate
from specvocab.engine.divergence import classify, first_divergence, margin_at, next_logits
from specvocab.engine.models import eos_token_ids
from specvocab.engine.prompts import encode_prompt, load_prompts
from specvocab.engine.resolve import resolve_run
from tests.engine_testing import OracleTreeDrafter

T = 24
pytestmark = pytest.mark.slow


def _prompt_ids(loaded, category: str) -> list[int]:
    model, tok, info = loaded
    p = next(p for p in load_prompts("spec_bench", per_category=1) if p.category == category)
    return encode_prompt(tok, info, p.turns[:1], [], system_prompt=p.system_prompt)


def _hf_greedy(model, ids, eos):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=T, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0, temperature=None, top_p=None, top_k=None)
    return out[0, len(ids):].tolist()


def _same_or_near_tie(model, ids, ar_out, other):
    """transformers' own decoding (generate, prompt lookup) against ours: token-equal in fp32; in a half
    dtype its forward is not row-invariant, so it may part from ar, but only at a near tie of ar's logits
    (engine.divergence), never where ar's token led clearly."""
    if model.dtype == torch.float32:
        assert other == ar_out
        return
    pos = first_divergence(ar_out, other)
    if pos is None:
        return
    margin, gap, top1 = margin_at(lambda x: next_logits(model, x), ids, ar_out, other, pos)
    assert classify(margin, gap, top1, model.dtype) == "near-tie", (pos, margin, gap, top1)


@pytest.mark.parametrize("which,category", [("smollm2", "extraction"), ("gemma", "summarization")])
def test_methods_equal_greedy_on_real_models(request, which, category):
    loaded = request.getfixturevalue(which)
    model, tok, info = loaded
    ids = _prompt_ids(loaded, category)
    ar = generate(model, ids, method="ar", tokenizer=tok, info=info, max_new_tokens=T)
    if which == "smollm2":                                       # Gemma's 688-token prompt: keep it to 4 runs
        _same_or_near_tie(model, ids, ar.output_ids.tolist(), _hf_greedy(model, ids, eos_token_ids(model, tok)))
    assert ar.steps == ar.new_tokens and ar.tau == 1.0
    res = generate(model, ids, method="pld", tokenizer=tok, info=info, max_new_tokens=T)
    assert res.output_ids.tolist() == ar.output_ids.tolist(), "pld"
    res = generate(model, ids, method="hf-prompt-lookup", tokenizer=tok, info=info, max_new_tokens=T)
    _same_or_near_tie(model, ids, ar.output_ids.tolist(), res.output_ids.tolist())
    full = ids + ar.output_ids.tolist()
    tree = generate(model, ids, tokenizer=tok, info=info, max_new_tokens=T,
                    drafter=OracleTreeDrafter(model, SpecConfig(), full, info.vocab_size, seed=1, max_nodes=8),
                    record=True)
    assert tree.output_ids.tolist() == ar.output_ids.tolist()
    assert tree.steps < ar.steps                                 # the trees' correct branches were taken


SHIPPED_EAGLE3 = ("smollm2", "gemma")      # the offline models an EAGLE-3 head ships for (engine/heads/<model>/eagle3/)


@pytest.mark.parametrize("which", SHIPPED_EAGLE3)
def test_the_shipped_eagle3_head_is_the_default_and_lossless_with_every_policy(request, which):
    """`method="eagle3"` with no head named drafts with the head shipped for the model (in its draft
    vocabulary, d2t-mapped), and with every policy - the dynaspec fit shipped beside it at depth 3 included -
    the output equals ar token for token, on a real model in its default dtype; the trees hold several tokens
    (a head that never agreed with the target would draft in vain: tau > 1 guards against a head loaded wrong)."""
    loaded = request.getfixturevalue(which)
    model, tok, info = loaded
    ids = _prompt_ids(loaded, "extraction")
    ar = generate(model, ids, method="ar", tokenizer=tok, info=info, max_new_tokens=T).output_ids.tolist()
    taus = {}
    for vocab in ("full", "frspec", "dynaspec", "microspec"):
        # the run's one resolution, as bench and the sweeps give it: frspec the training corpus's list for this
        # tokenizer, dynaspec the fit shipped beside the head
        cfg = resolve_run(SpecConfig.preset("eagle3", vocab=vocab, eagle_depth=3, draft_size=8, max_new_tokens=T),
                          model, tokenizer=tok, info=info, eos_ids=eos_token_ids(model, tok)).cfg
        res = generate(model, ids, cfg, tokenizer=tok, info=info)
        assert res.output_ids.tolist() == ar, vocab
        taus[vocab] = res.tau
        assert res.drafter_stats["draft_vocab"] < info.vocab_size, vocab      # the head's own draft vocabulary
    assert taus["full"] > 1.3, taus
