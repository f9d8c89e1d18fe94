"""The transformers API the package calls is the current one: decoding through the hf backend and every drafter
that runs transformers modules (eagle, layerskip, hf-prompt-lookup) raises no DeprecationWarning / FutureWarning.

transformers announces removals a few minor versions ahead with such warnings (5.24: `past_key_values` ->
`cache`, removed in 5.40; `engine.target.cache_kwarg` picks the name the installed version takes), so this test
fails as soon as an installed version deprecates something we call - before the removal breaks a decode. CI
installs the newest transformers that satisfies pyproject's bound."""

import warnings

import pytest
import torch
import transformers

from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model


@pytest.mark.parametrize("model", ["random-llama", "random-gemma3"])
def test_decoding_through_transformers_raises_no_deprecation(model):
    m, _, _ = load_model(model, dtype="fp32")
    ids = torch.randint(0, 200, (20,), generator=torch.Generator().manual_seed(0))
    runs = [("ar", {}), ("eagle", {"eagle_head": "random"}), ("layerskip", {"drafter_layers": "skip:1"}),
            ("hf-prompt-lookup", {})]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method, extra in runs:
            for backend in ("hf", "native"):
                cfg = SpecConfig.preset(method, backend=backend, max_new_tokens=8, draft_size=4, **extra)
                generate(m, ids, cfg, eos_ids=[])
    bad = sorted({f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
                  if issubclass(w.category, (DeprecationWarning, FutureWarning))})
    assert bad == [], f"transformers {transformers.__version__} deprecates what we call:\n" + "\n".join(bad)


def test_the_check_sees_a_deprecation():
    """The filter above catches what transformers emits: its `deprecate_kwarg` (how 5.24 announces the removal of
    `past_key_values`) warns with a FutureWarning, recorded here."""
    from transformers.utils.deprecation import deprecate_kwarg

    @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
    def forward(cache=None):
        return cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert forward(past_key_values=1) == 1
    assert [w.category for w in caught] == [FutureWarning] and "past_key_values" in str(caught[0].message)
