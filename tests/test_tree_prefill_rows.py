"""The prefill's LM head computes only the rows a drafter reads (`Drafter.prefill_rows`, `uses_prefill_logits`):
the LM-head drafters outside MicroSpec get the last row, UniSpec and Token Recycling the last occurrence of each
prompt token, and what they build from those rows is what they built from every row, bit for bit."""

from __future__ import annotations

import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model
from specvocab.engine.store import prompt_rows, rows_tokens
from specvocab.engine.target import BackendError, head_topk, make_target, prefill_logits
from specvocab.engine.tree import PrefillTopK
from tests.engine_testing import untie_head

VOCAB = 96
# repeats with different contexts: a row-selection that kept the first occurrence, or the last rows, would
# build another store
PROMPT = torch.tensor([5, 9, 5, 17, 9, 40, 5, 33, 17, 2, 9, 61, 5, 70])


@pytest.fixture(scope="module")
def model():
    m, _, info = load_model("random-llama", vocab_size=VOCAB, num_layers=2, seed=4)
    return untie_head(m), info


def test_prompt_rows_are_each_tokens_last_position_ascending():
    assert prompt_rows(PROMPT).tolist() == [5, 7, 8, 9, 10, 11, 12, 13]
    assert prompt_rows(torch.tensor([4, 4, 4])).tolist() == [2]
    assert rows_tokens(PROMPT, 8).tolist() == [40, 33, 17, 2, 9, 61, 5, 70]
    assert rows_tokens(PROMPT, PROMPT.numel()).tolist() == PROMPT.tolist()
    assert rows_tokens(PROMPT, 2).tolist() == [5, 70]                     # other counts: the last rows


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_prefill_logits_of_chosen_rows_are_those_rows_of_all(model, backend, monkeypatch):
    m, _ = model
    monkeypatch.setattr("specvocab.engine.target.PREFILL_HEAD_ROWS", 4)              # several chunks on a short prompt
    t = make_target(m, backend)
    with torch.inference_mode():
        t.begin(32)
        _, full = t.prefill(PROMPT)
        t.begin(32)
        _, last = t.prefill(PROMPT, all_logits=False)
        rows = prompt_rows(PROMPT)
        t.begin(32)
        _, some = t.prefill(PROMPT, rows=rows)
    assert full.shape == (PROMPT.numel(), VOCAB) and last.shape == (1, VOCAB) and some.shape == (rows.numel(), VOCAB)
    assert torch.equal(full[-1:], last) and torch.equal(some[-1:], last)    # the first token's row: alone, always
    assert torch.allclose(some, full[rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full[:-1], full[1:], rtol=1e-3, atol=1e-3)   # rows differ: a shifted pick would show


def test_prefill_rows_that_are_not_positions_ending_at_the_last_are_refused():
    head = lambda h: h.float()                                            # noqa: E731
    hidden = torch.randn(6, 3)
    for bad in ([0, 2], [3, 1, 5], [], [-1, 5], [2, 2, 5]):
        with pytest.raises(BackendError, match="ascending prompt positions"):
            prefill_logits(head, hidden, rows=torch.tensor(bad, dtype=torch.long))
    assert torch.equal(prefill_logits(head, hidden, rows=torch.tensor([1, 5])), hidden[[1, 5]])


@pytest.mark.parametrize("method", ["unispec", "recycling"])
def test_a_store_built_from_the_chosen_rows_is_the_store_built_from_every_row(model, method):
    m, _ = model
    with torch.inference_mode():
        t = make_target(m, "hf")
        t.begin(32)
        hidden, full = t.prefill(PROMPT)
    rows = prompt_rows(PROMPT)
    stores = []
    for logits in (full, full[rows]):
        # per_prompt: a fresh store each time (the deployment store is shared by the target's drafters)
        d = make_drafter(m, SpecConfig.preset(method, draft_size=4, store_persistence="per_prompt"))
        assert torch.equal(d.prefill_rows(PROMPT), rows)
        d.begin(PROMPT, logits, hidden)
        stores.append((d.store.tok.clone(), d.store.con.clone()))
    assert torch.equal(stores[0][0], stores[1][0]) and torch.equal(stores[0][1], stores[1][1])
    assert stores[0][1].sum() > 0                                           # the store was written


class _Spy:
    """Wraps a drafter's begin to record the prefill logits' shape it got."""

    def __init__(self, drafter):
        self.shape = None
        inner = drafter.begin

        def begin(prompt_ids, prefill_logits, prefill_hidden):
            self.shape = (tuple(prefill_logits.ids.shape) if isinstance(prefill_logits, PrefillTopK)
                          else tuple(prefill_logits.shape))
            return inner(prompt_ids, prefill_logits, prefill_hidden)
        drafter.begin = begin


@pytest.mark.parametrize("method, vocab, rows", [
    ("unispec", None, "prompt_rows"), ("recycling", None, "prompt_rows"),
    ("eagle", "full", 1), ("eagle", "oracle", 1), ("eagle", "microspec", "topk"), ("pld", None, 1)])
def test_the_harness_computes_the_rows_each_drafter_reads_and_stays_lossless(model, method, vocab, rows):
    m, info = model
    extra = {} if vocab is None else dict(vocab=vocab, eagle_head="random", w_max=32, k_pre=3)
    cfg = SpecConfig.preset(method, draft_size=4, max_new_tokens=12, **extra)
    drafter = make_drafter(m, cfg)
    spy = _Spy(drafter)
    out = generate(m, PROMPT, cfg, info=info, drafter=drafter, eos_ids=[])
    want = {1: (1, VOCAB), "topk": (PROMPT.numel(), 3), "prompt_rows": (prompt_rows(PROMPT).numel(), VOCAB)}[rows]
    assert spy.shape == want
    ar = generate(m, PROMPT, SpecConfig.preset("ar", max_new_tokens=12), info=info, eos_ids=[])
    assert out.output_ids.tolist() == ar.output_ids.tolist()


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_head_topk_is_the_top_k_of_every_rows_logits_in_chunks(backend, monkeypatch):
    """MicroSpec's prefill top-K_pre without [L, V] logits: the same ids as the top-k of the full logits, on
    Gemma-2-style soft-capped logits (the cap is skipped: tanh keeps the order)."""
    m, _, _ = load_model("random-gemma3", vocab_size=VOCAB, num_layers=2, seed=5)
    m.config.get_text_config(decoder=True).final_logit_softcapping = 2.0      # Gemma-3 itself has none
    monkeypatch.setattr("specvocab.engine.target.PREFILL_HEAD_ROWS", 4)
    t = make_target(m, backend)
    with torch.inference_mode():
        t.begin(32)
        hidden, full = t.prefill(PROMPT)
        ids = head_topk(t.head, hidden, 3)
        capped = t.head(hidden[:2])
        raw = t.head(hidden[:2], softcap=False)
    assert ids.shape == (PROMPT.numel(), 3) and torch.equal(ids, full.topk(3).indices)
    assert not torch.allclose(capped, raw)                              # the model does soft-cap
