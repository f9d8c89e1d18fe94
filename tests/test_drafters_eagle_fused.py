"""The EAGLE heads' decoder layer run as one `kernels.cpu.layer` call (bf16 on a CPU with the kernels): every
forward of a decode is checked against the transformers layer it replaces, on the same cache, and the decode
stays equal to `ar`.

Mutants checked (each fails a test here): the committed count taken as the cache length for tree rows (the
previous level's rows read as committed context); the prompt fed in one call past the kernel's two-block tail
(no chunks); the values written to the keys' cache. (Keys placed in the tail by cache slot rather than logical
position pass, rightly: the drafter needs the right keys, and slot order only changes the sum's rounding.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from specvocab.engine import generate
from specvocab.engine.drafters import eagle as eagle_mod
from specvocab.engine.models import load_model
from specvocab.kernels import cpu
from tests.engine_testing import untie_head

pytestmark = pytest.mark.skipif(cpu.available() is not None,
                                reason=f"the CPU kernels do not run here: {cpu.available()}")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_fused_eagle_layer_computes_the_transformers_layer_and_the_decode_equals_ar(method, monkeypatch):
    model = untie_head(load_model("random-llama", dtype="bf16")[0]).to(torch.bfloat16)
    ids = torch.randint(0, 512, (75,), generator=torch.Generator().manual_seed(0)).tolist()  # > 2 chunks of 32
    checked = {"feed": 0, "tree": 0}
    real = eagle_mod.EagleTreeDrafter._backbone

    def both(self, layer, x, positions, visible, own, attn_in=None, **hf):
        assert self.fused is not None                                     # bf16 on a CPU: the fused path runs
        if not own and x.shape[0] > eagle_mod.FUSED_CHUNK:               # checked chunk by chunk (the calls below)
            return real(self, layer, x, positions, visible, own, attn_in, **hf)
        cache = copy.deepcopy(self.cache)
        out = real(self, layer, x, positions, visible, own, attn_in, **hf)
        fused_cache, self.cache, fused, self.fused = self.cache, cache, self.fused, None
        try:                                      # the same forward through transformers, on the cache as it was
            if layer is None:                     # EAGLE-3: the midlayer after its attention input (given)
                mid = self.eagle.midlayer

                def layer(h, pe, mask):
                    a = mid.self_attn(attn_in[None], position_embeddings=pe, attention_mask=mask,
                                      **{self.cache_kw: self.cache})[0]
                    h = h + a
                    return h + mid.mlp(mid.post_attention_layernorm(h))
            ref = real(self, layer, x, positions, visible, own, None, **hf)
            n = self.cache.length
            assert n == fused_cache.length
            assert _rel(out, ref) < 3e-2, (own, _rel(out, ref))
            assert _rel(fused_cache.k[0][..., :n, :], self.cache.k[0][..., :n, :]) < 3e-2
            assert _rel(fused_cache.v[0][..., :n, :], self.cache.v[0][..., :n, :]) < 3e-2
        finally:
            self.cache, self.fused = fused_cache, fused
        checked["tree" if own else "feed"] += 1
        return out

    monkeypatch.setattr(eagle_mod.EagleTreeDrafter, "_backbone", both)
    kw = dict(max_new_tokens=24, eos_ids=[], backend="native")
    ar = generate(model, ids, method="ar", **kw)
    head = {"eagle_head": "random"} if method == "eagle" else {"eagle3_head": "random"}
    res = generate(model, ids, method=method, draft_size=6, eagle_depth=3, **head, **kw)
    assert res.output_ids.tolist() == ar.output_ids.tolist()
    assert checked["feed"] >= 2 and checked["tree"] >= 6, checked
