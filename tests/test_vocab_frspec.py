"""FR-Spec's static list (`engine.vocab.frspec`):

- FR-Spec-PA (DynaSpec App. A.1), `frspec_budget="position"`: draft step t scores the top floor(K / (t + 1))
  of the list, set by the drafter's `route` call before each head call; "fixed" (FR-Spec) keeps K. Sizes per
  step, through a real drafter; losslessness is in test_drafters_lmhead's policy variants;
- a `.pt` list loads through `load_token_map` (weights_only: a pickle with code is refused), and a list made
  for another tokenizer is refused for the target's tokenizer (`ModelInfo.tokenizer_name`, which the drafter
  passes to the policy).
"""

import dataclasses

import numpy as np
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model, tokenizer_name
from specvocab.engine.vocab import FrequencyError, make_policy, save_token_map
from specvocab.engine.vocab.frspec import load_frequency_ranking

V = 512


@pytest.fixture(scope="module")
def model():
    return load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=5)[0]


def _ranking(tmp_path, tokenizer="smollm2"):
    return save_token_map(np.random.default_rng(0).permutation(V), tmp_path / "map.pt", tokenizer=tokenizer,
                          vocab_size=V)


@pytest.mark.parametrize("budget, sizes", [("fixed", [96] * 5), ("position", [96, 48, 32, 24, 19])])
def test_the_position_aware_budget_shrinks_the_list_per_draft_step(model, tmp_path, budget, sizes):
    cfg = SpecConfig.preset("layerskip", vocab="frspec", frspec_k=96, frspec_budget=budget,
                            frequency_file=str(_ranking(tmp_path)))
    policy = make_policy(cfg, model.get_output_embeddings().weight)
    h = torch.randn(3, 48)
    seen = []
    for t in range(5):
        policy.route(torch.zeros(3, dtype=torch.long), h, t)
        logits, ids = policy.logits(h)
        assert logits.shape == (3, ids.numel())
        assert torch.equal(ids, policy.ids[: ids.numel()])                     # a prefix: the most frequent
        seen.append(ids.numel())
    assert seen == sizes == policy.step_sizes(5)


def test_a_drafter_routes_before_every_head_call(model, tmp_path):
    cfg = SpecConfig.preset("layerskip", vocab="frspec", frspec_k=96, frspec_budget="position", eagle_depth=4,
                            draft_size=12, drafter_layers="skip:1", frequency_file=str(_ranking(tmp_path)))
    drafter = make_drafter(model, cfg)
    widths, real = [], drafter.policy.logits
    drafter.policy.logits = lambda h: (lambda out: (widths.append(out[0].shape[1]), out)[1])(real(h))
    out = generate(model, torch.arange(20) % V, cfg.replace(max_new_tokens=6), drafter=drafter, eos_ids=[])
    assert out.steps > 1 and widths[:4] == [96, 48, 32, 24]
    assert set(widths) == {96, 48, 32, 24}


def test_a_list_for_another_tokenizer_is_refused(model, tmp_path):
    path = _ranking(tmp_path, tokenizer="llama3")                              # same vocabulary size
    cfg = SpecConfig.preset("layerskip", vocab="frspec", frspec_k=96, frequency_file=str(path), draft_size=8,
                            drafter_layers="skip:1")
    weight = model.get_output_embeddings().weight
    with pytest.raises(FrequencyError, match="made for tokenizer 'llama3'.*'smollm2'"):
        make_policy(cfg, weight, tokenizer="smollm2")
    make_policy(cfg, weight, tokenizer="llama3")                                # its own tokenizer
    make_policy(cfg, weight)                                                    # unknown: checked by size only
    # through a drafter: the target's tokenizer name comes from load_model's ModelInfo
    assert tokenizer_name(model) is None                                       # a random model has none
    other = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=5)[0]
    other.specvocab_info = dataclasses.replace(other.specvocab_info, tokenizer_name="smollm2")
    with pytest.raises(FrequencyError, match="made for tokenizer 'llama3'"):
        make_drafter(other, cfg)


def test_a_pt_list_is_read_with_weights_only(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("pickled code ran",))
    bad = tmp_path / "bad.pt"
    torch.save([Payload()], bad)
    with pytest.raises(FrequencyError, match="weights_only=True"):
        load_frequency_ranking(bad, V)
    good = _ranking(tmp_path)
    assert load_frequency_ranking(good, V, tokenizer="smollm2").tolist() == np.random.default_rng(0).permutation(V).tolist()
