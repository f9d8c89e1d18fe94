"""The native forward (`engine.native` behind `engine.target`): parity with transformers, bitwise row
invariance of fixed-shape verification, lossless decoding on the native path in fp32 and bf16, bad input.

Mutants these tests were checked against (each fails at least one test here):
- RoPE applied at the cache slot instead of the logical position (P + depth)      -> parity (tree)
- Gemma's RMSNorm as w * x instead of (1 + w) * x; embedding scale dropped        -> parity (gemma3)
- qwen3's q/k norm skipped; qwen2's q/k/v bias dropped                             -> parity (qwen3 / qwen2)
- sliding-window mask left out of the committed blocks                              -> parity (gemma3, long prompt)
- tail gathered in slot order (`idx = arange`) instead of logical order             -> bitwise test, parity
- blocks merged with `sum` over a padded block axis instead of the sequential fold  -> (passes here: on this
  CPU both are sequential for these sizes; the fold is kept for the reason in engine.native)
- the non-exact (SDPA over slots) path used for verification                       -> bitwise test shows it
  differs on the real models in bf16 (`test_sdpa_path_is_not_row_invariant_in_bf16`: the test's power)
- compact keeping `keep` relative to slot 0 instead of the committed prefix        -> lossless tests
- the bucket floor assumed (MIN_ROWS) instead of measured (`row_floor`), in the step or in `bucket_edge`;
  the probe comparing row 0 only, or keyed without the F.linear in use             -> the row-floor test

Over 600 lines on purpose: parity, row invariance and losslessness share the tree helpers above their tests.
"""

from __future__ import annotations

import time

import numpy as np
import polars as pl
import pytest
import torch

from specvocab.engine import generate
from specvocab.engine.config import SpecConfig
from specvocab.engine.models import load_model
from specvocab.engine.drafters.layerskip import LayerSkipDrafter
from specvocab.engine.native import (BLOCK, MIN_ROWS, ROW_PROBE, NativeError, NativeModel, bucket_rows, row_invariance,
                           tail_blocks, tail_index)
from specvocab.engine.target import (BackendError, HFTarget, NativeTarget, backend_label, make_target, native_model,
                           resolve_backend)
from specvocab.kernels import cpu
from specvocab.kernels.testing import cpu_as
from specvocab.engine.tree import DraftTree, Drafter
from specvocab.engine.verify import tree_layout
from tests.engine_testing import random_parents, untie_head

FAMILIES = ("random-llama", "random-qwen3", "random-gemma3")


def _qwen2(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:                         # make the q/k/v bias matter
            for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                p.normal_(0, 0.5)
        model.get_input_embeddings().weight.mul_(8.0)
    return model


def _model(name):
    if name == "random-qwen2":
        return _qwen2()
    return load_model(name)[0]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_and_native(model, prompt, tree: DraftTree, fixed_shape: bool, cpu_kernels: bool = True):
    """Logits of the prefill and of one tree after it, through both backends."""
    out = {}
    for t in (HFTarget(model), NativeTarget(model, fixed_shape=fixed_shape, cpu_kernels=cpu_kernels)):
        t.begin(prompt.numel() + 64)
        with torch.inference_mode():
            _, pre = t.prefill(prompt)
            d, a = tree_layout(tree.parents)
            _, lg = t.forward_tree(tree.tokens, tree.parents, d, a)
        out[t.name] = (pre, lg)
    return out


@pytest.mark.parametrize("name", [*FAMILIES, "random-qwen2"])
@pytest.mark.parametrize("fixed_shape", [True, False])
def test_native_logits_equal_transformers_on_each_family(name, fixed_shape):
    model = _model(name)
    rng = np.random.default_rng(0)
    # 70 committed tokens: past two attention blocks and past random-gemma3's 16-token sliding window
    prompt = torch.as_tensor(rng.integers(0, 512, 70))
    parents = torch.tensor(random_parents(9, rng))
    tree = DraftTree(torch.as_tensor(rng.integers(0, 512, 9)), parents)
    out = _hf_and_native(model, prompt, tree, fixed_shape)
    assert _rel(out["native"][0], out["hf"][0]) <= 1e-5
    assert _rel(out["native"][1], out["hf"][1]) <= 1e-5


@pytest.mark.parametrize("name", [*FAMILIES, "random-qwen2"])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_native_bf16_logits_are_transformers_bf16_logits_to_rounding(name, cpu_kernels):
    """bf16, with the CPU kernels (kernels.cpu: where they run, `native` runs them) and without (oneDNN): both
    within bf16 rounding of transformers' bf16 forward; and the kernels do run where they can."""
    model = _model(name).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    prompt = torch.as_tensor(rng.integers(0, 512, 70))
    tree = DraftTree(torch.as_tensor(rng.integers(0, 512, 9)), torch.tensor(random_parents(9, rng)))
    native_model(model).fused_calls = 0
    out = _hf_and_native(model, prompt, tree, True, cpu_kernels=cpu_kernels)
    net = native_model(model)
    assert net.kernel_on == (cpu_kernels and cpu.available() is None)
    assert (net.fused_calls > 0) == net.kernel_on          # the exact forward ran kernels.cpu.layer
    assert _rel(out["native"][0], out["hf"][0]) <= 3e-2
    assert _rel(out["native"][1], out["hf"][1]) <= 3e-2
    # the power of the bound: the logits of another tree are far outside it
    other = DraftTree(torch.as_tensor(rng.integers(0, 512, 9)), tree.parents)
    assert _rel(_hf_and_native(model, prompt, other, True, cpu_kernels)["native"][1], out["hf"][1]) > 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2_fp32", "gemma_fp32"])
def test_native_logits_equal_transformers_on_the_offline_models(request, which):
    model, _, info = request.getfixturevalue(which)
    rng = np.random.default_rng(1)
    prompt = torch.as_tensor(rng.integers(0, info.vocab_size, 90))
    tree = DraftTree(torch.as_tensor(rng.integers(0, info.vocab_size, 7)), torch.tensor([-1, 0, 0, 1, 1, 3, 5]))
    for fixed_shape in (True, False):
        out = _hf_and_native(model, prompt, tree, fixed_shape)
        assert _rel(out["native"][0], out["hf"][0]) <= 1e-5
        assert _rel(out["native"][1], out["hf"][1]) <= 1e-5


# --- fixed-shape verification: a row's logits do not depend on the step's shape -------------------------

def _row_logits_in_trees(model, prompt: torch.Tensor, path: list[int], fixed_shape: bool, compile: bool = False,
                         cpu_kernels: bool = True):
    """The logits of the last token of `path` (appended after `prompt`), computed (a) by ar-style one-node
    forwards and (b) inside trees of several shapes in which that path sits at different node indices,
    with decoys around it. Returns (reference row, [rows from trees])."""
    L = prompt.numel()
    rng = np.random.default_rng(3)
    V = model.get_output_embeddings().weight.shape[0]

    def run(tree_tokens, tree_parents, node):
        t = NativeTarget(model, fixed_shape=fixed_shape, compile=compile, cpu_kernels=cpu_kernels)
        t.begin(L + 80)
        with torch.inference_mode():
            t.prefill(prompt[:L - 1], all_logits=False)          # the root (prompt[-1]) is not cached yet
            d, a = tree_layout(tree_parents)
            return t.forward_tree(tree_tokens, tree_parents, d, a)[1][node]

    def ar_row():
        t = NativeTarget(model, fixed_shape=fixed_shape, compile=compile, cpu_kernels=cpu_kernels)
        t.begin(L + 80)
        with torch.inference_mode():
            t.prefill(prompt[:L - 1], all_logits=False)
            row = None
            for tok in [int(prompt[-1])] + path:
                one = torch.tensor([tok])
                row = t.forward_tree(one, torch.tensor([-1]), torch.zeros(1, dtype=torch.long),
                                     torch.ones(1, 1, dtype=torch.bool))[1][0]
                t.compact(1, [0])
            return row

    rows = []
    for n_decoys, width in ((0, 0), (3, 1), (9, 3), (20, 2)):
        toks, pars = [int(prompt[-1])], [-1]
        chain = [0]
        for j, tok in enumerate(path):                           # the path, with decoy siblings before it
            for _ in range(width if n_decoys else 0):
                toks.append(int(rng.integers(0, V)))
                pars.append(chain[-1])
            toks.append(tok)
            pars.append(chain[-1])
            chain.append(len(toks) - 1)
        while len(toks) < len(path) + 1 + n_decoys:               # more decoys hanging anywhere
            toks.append(int(rng.integers(0, V)))
            pars.append(int(rng.integers(0, len(toks) - 1)))
        rows.append(run(torch.tensor(toks), torch.tensor(pars), chain[-1]))
    return ar_row(), rows


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2_bf16", "gemma_bf16", "smollm2_fp32"])
def test_a_row_is_bitwise_the_same_alone_and_inside_trees_in_bf16(request, which):
    """bf16 (and SmolLM2 in fp32, where the kernels run the linears only and a step is unpadded too)."""
    model, _, info = request.getfixturevalue(which)
    rng = np.random.default_rng(2)
    for L in (BLOCK - 2, 3 * BLOCK + 1, 5 * BLOCK - 1):          # trees that cross a block boundary, and not
        prompt = torch.as_tensor(rng.integers(0, info.vocab_size, L))
        path = rng.integers(0, info.vocab_size, 4).tolist()
        for cpu_kernels in (True, False):                         # kernels.cpu where it runs, and oneDNN
            native_model(model).fused_calls = 0
            ref, rows = _row_logits_in_trees(model, prompt, path, fixed_shape=True, cpu_kernels=cpu_kernels)
            net = native_model(model)
            assert net.kernel_on == (cpu_kernels and cpu.linear_reason(net.device, net.dtype) is None)
            # rows through kernels.cpu.layer (bf16, and fp32 on the AVX2 build; the AVX-512 fp32 build runs the
            # packed linears inside the torch layer)
            assert (net.fused_calls > 0) == (net.kernel_on and (net.dtype == torch.bfloat16 or cpu.isa() == "avx2"))
            for r in rows:
                assert torch.equal(r, ref)


def _isa(monkeypatch, isa: str) -> None:
    """Run the fp32 linears on one build of kernels.cpu: "auto" (AVX-512 here), or "avx2" - what a CPU without
    AVX-512 runs (kernels/cpu_avx2.c) - skipped where that build cannot run."""
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    if isa == "avx2" and cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu.builds.library_reason('avx2')}")


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_is_bitwise_the_same_alone_and_inside_trees_in_fp32(name, isa, monkeypatch):
    """fp32 on the random models of each family, with the fp32 kernels (the linears; each step runs exactly its
    tree: 1 row for `ar`) - the AVX-512 build and the AVX2 one - and without (oneDNN, every step padded to >= 4
    rows)."""
    _isa(monkeypatch, isa)
    model = untie_head(load_model(name, dtype="fp32")[0])
    rng = np.random.default_rng(4)
    calls = []
    real = cpu.attention_f32
    monkeypatch.setattr(cpu, "attention_f32", lambda *a, **k: calls.append(1) or real(*a, **k))
    for L in (BLOCK - 2, 3 * BLOCK + 1):
        prompt = torch.as_tensor(rng.integers(0, 512, L))
        path = rng.integers(0, 512, 4).tolist()
        for cpu_kernels in (True, False):
            calls.clear()
            native_model(model).fused_calls = 0
            ref, rows = _row_logits_in_trees(model, prompt, path, fixed_shape=True, cpu_kernels=cpu_kernels)
            net = native_model(model)
            assert net.kernel_on == (cpu_kernels and cpu.linear_reason(net.device, net.dtype) is None)
            if net.kernel_on:
                assert net.head_kernel.isa == cpu.isa()
            # on the AVX2 build the whole layer in one call (kernels/cpu_avx2.c `sv2_layer_f32`, its attention
            # inside); on AVX-512 the packed linears with the C attention between them; torch's exact path elsewhere
            fused = net.kernel_on and cpu.isa() == "avx2"
            assert (net.fused_calls > 0) == fused
            assert bool(calls) == (net.kernel_on and not fused and cpu.attention_f32_reason(net.head_dim) is None)
            for r in rows:
                assert torch.equal(r, ref)


def test_the_row_floor_is_measured_so_a_gemm_that_changes_bits_with_m_stays_exact(monkeypatch):
    """Rule 1's floor is measured on the machine (`NativeModel.row_floor`), not assumed: on an Intel Xeon
    (AMX) the fp32 GEMM changes a row's bits at M >= 4, where the fp32 row test above fails with the kernels
    off and a floor of MIN_ROWS. Stand-in for such a GEMM: an F.linear that computes fewer than 16 rows in
    fp64 and rounds (other bits than the fp32 GEMM's). The floor measured is then 16 (or this machine's own
    floor where that is higher), and a row is bitwise
    the same alone and inside trees; with the floor assumed (MIN_ROWS) an `ar` step (4 rows) and a
    tree (16) round differently - the test's power."""
    real = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.dim() == 2 and x.shape[0] < 16 and x.dtype == torch.float32:
            y = (x.double() @ w.double().T).float()
            return y if b is None else y + b
        return real(x, w, b)

    model = untie_head(load_model("random-llama", dtype="fp32")[0])
    net = native_model(model)
    floor = net.row_floor()                                      # this machine's own GEMM
    assert floor in [2 ** i for i in range(2, 8)] and floor <= ROW_PROBE
    assert all(m < floor for ms in row_invariance(net.linear_weights()).values() for m in ms)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    stand_in = max(16, floor)                                    # 16, or this GEMM's own floor where higher
    assert net.row_floor() == stand_in and bucket_rows(3, stand_in) == stand_in
    assert bucket_rows(stand_in + 1, stand_in) == 2 * stand_in
    # the draft size runs at its bucket's edge (engine.harness.bucket_edge), the bucket this floor gives
    from specvocab.engine.harness import bucket_edge
    assert bucket_edge(SpecConfig.preset("pld", cpu_kernels=False), model, 2) == stand_in - 1
    rng = np.random.default_rng(5)
    prompt = torch.as_tensor(rng.integers(0, 512, BLOCK + 5))
    path = rng.integers(0, 512, 4).tolist()
    ref, rows = _row_logits_in_trees(model, prompt, path, fixed_shape=True, cpu_kernels=False)
    assert all(torch.equal(r, ref) for r in rows)
    monkeypatch.setattr(NativeModel, "row_floor", lambda self: MIN_ROWS)
    ref, rows = _row_logits_in_trees(model, prompt, path, fixed_shape=True, cpu_kernels=False)
    assert not all(torch.equal(r, ref) for r in rows)


@pytest.mark.slow
def test_sdpa_path_is_not_row_invariant_in_bf16(request):
    """The power of the test above: the plain path (SDPA over cache slots) does change a row's bits."""
    model, _, info = request.getfixturevalue("smollm2_bf16")
    rng = np.random.default_rng(2)
    differs = 0
    for L in (BLOCK - 2, 3 * BLOCK + 1, 5 * BLOCK - 1):
        prompt = torch.as_tensor(rng.integers(0, info.vocab_size, L))
        ref, rows = _row_logits_in_trees(model, prompt, rng.integers(0, info.vocab_size, 4).tolist(), False)
        differs += sum(not torch.equal(r, ref) for r in rows)
    assert differs > 0


# --- lossless on the native path -------------------------------------------------------------------------

LOSSLESS = [("pld", {}), ("recycling", {}), ("unispec", {"draft_size": 12}),
            ("layerskip", {"drafter_layers": "keep:0", "draft_size": 6}),
            ("eagle", {"eagle_head": "random", "draft_size": 6, "eagle_depth": 3}),
            ("eagle", {"eagle_head": "random", "draft_size": 6, "eagle_depth": 3, "vocab": "microspec"}),
            ("eagle", {"eagle_head": "random", "draft_size": 6, "eagle_depth": 3, "vocab": "oracle"})]


@pytest.mark.parametrize("dtype,cpu_kernels", [("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False),
                                               ("fp32-avx2", True)])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_method_equals_ar_on_the_native_path(name, dtype, cpu_kernels, monkeypatch):
    if dtype == "fp32-avx2":                                     # the fp32 linears of a CPU without AVX-512
        _isa(monkeypatch, "avx2")
        dtype = "fp32"
    model = untie_head(load_model(name, dtype=dtype)[0]).to(dtype=torch.bfloat16 if dtype == "bf16" else
                                                            torch.float32)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, int(n)).tolist() for n in (20, 45)]
    for ids in prompts:
        ar = generate(model, ids, method="ar", max_new_tokens=40, eos_ids=[], backend="native",
                      cpu_kernels=cpu_kernels)
        assert native_model(model).kernel_on == (cpu_kernels and cpu.linear_reason(torch.device("cpu"), next(
            model.parameters()).dtype) is None)                  # bf16: every kernel; fp32: the linears
        net = native_model(model)
        if net.kernel_on and net.dtype == torch.float32:         # on the build asked for (AVX-512 or AVX2)
            assert net.head_kernel.isa == cpu.isa()
        hf = generate(model, ids, method="ar", max_new_tokens=40, eos_ids=[], backend="hf")
        if dtype == "fp32":                                      # the reference agrees in fp32
            assert ar.output_ids.tolist() == hf.output_ids.tolist()
        for method, kw in LOSSLESS:
            res = generate(model, ids, method=method, max_new_tokens=40, eos_ids=[], backend="native", w_max=128,
                           cpu_kernels=cpu_kernels, **kw)
            assert res.output_ids.tolist() == ar.output_ids.tolist(), (method, kw)


@pytest.mark.parametrize("name", ["random-llama", "random-gemma3"])
def test_layerskip_drafts_the_same_trees_on_the_native_partial_stack(name):
    """The layer-skip drafter on the native backend (NativeModel.forward(layer_ids=...), NativeDraftKV) drafts
    what it drafts through transformers' layer modules: the same tree tokens at every step, fp32. Gemma's
    sliding window (shrunk below a tree's breadth) checks the tree rows' positions in the window mask."""
    model = untie_head(load_model(name)[0])
    if name == "random-gemma3":
        model.config.sliding_window = 5          # shorter than a tree level: tree rows sit at the window edge
    ids = np.random.default_rng(7).integers(0, 512, 40).tolist()
    kw = dict(method="layerskip", drafter_layers="keep:0", draft_size=10, eagle_depth=7, max_new_tokens=24, eos_ids=[],
              record=True)
    levels = {"hf": [], "native": []}
    real = LayerSkipDrafter._forward_tree

    def spy(self, tokens, parent_h, tree_mask, depth):            # every tree level's hidden states
        h = real(self, tokens, parent_h, tree_mask, depth)
        levels["native" if self.net is not None else "hf"].append(h.float().clone())
        return h
    LayerSkipDrafter._forward_tree = spy
    try:
        hf = generate(model, ids, backend="hf", **kw)
        native = generate(model, ids, backend="native", **kw)
    finally:
        LayerSkipDrafter._forward_tree = real
    assert [r.tree_tokens for r in native.records] == [r.tree_tokens for r in hf.records]
    assert native.output_ids.tolist() == hf.output_ids.tolist()
    assert sum(len(r.accepted) for r in native.records) > len(native.records)     # it drafted and hit
    assert len(levels["native"]) == len(levels["hf"]) > 0
    for a, b in zip(levels["native"], levels["hf"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_compiled_decode_keeps_rows_bitwise_and_every_method_equal_to_ar():
    """SpecConfig.compile: inductor fuses the layer's elementwise ops but must keep rules 1-3 (the GEMMs stay
    library calls; its reductions run per row). Compiled rows are not eager rows bitwise (fused norms round
    differently), so compiled runs are compared with the compiled `ar`; one prompt length keeps the committed
    block count fixed, so the test compiles few graphs."""
    model = untie_head(load_model("random-llama", dtype="bf16")[0]).to(torch.bfloat16)
    prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 512, BLOCK + 3))
    ref, rows = _row_logits_in_trees(model, prompt, [5, 77, 300, 9], fixed_shape=True, compile=True)
    assert all(torch.equal(r, ref) for r in rows)
    ids = prompt.tolist()
    ar = generate(model, ids, method="ar", max_new_tokens=20, eos_ids=[], compile=True)
    for method, kw in [("unispec", {"draft_size": 12}), ("eagle", {"eagle_head": "random", "draft_size": 6,
                                                                   "eagle_depth": 3, "vocab": "microspec"})]:
        res = generate(model, ids, method=method, max_new_tokens=20, eos_ids=[], compile=True, w_max=128, **kw)
        assert res.output_ids.tolist() == ar.output_ids.tolist(), method


def test_compile_needs_the_fixed_shape():
    model = load_model("random-llama")[0]
    with pytest.raises(BackendError, match="fixed_shape=True"):
        generate(model, [1, 2, 3], method="ar", max_new_tokens=2, eos_ids=[], fixed_shape=False, compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2_bf16", "gemma_bf16"])
def test_every_method_equals_ar_on_real_models_in_bf16(request, which):
    from specvocab.engine.prompts import encode_prompt, load_prompts
    model, tok, info = request.getfixturevalue(which)
    p = load_prompts("spec_bench", per_category=1)[0]
    ids = encode_prompt(tok, info, p.turns[:1], [], system_prompt=p.system_prompt)
    ar = generate(model, ids, method="ar", tokenizer=tok, info=info, max_new_tokens=24)
    for method, kw in [("pld", {}), ("unispec", {"draft_size": 15}), ("recycling", {}),
                       ("eagle", {"draft_size": 7, "eagle_depth": 3, "vocab": "microspec",
              "w_max": 128})]:
        res = generate(model, ids, method=method, tokenizer=tok, info=info, max_new_tokens=24, **kw)
        assert res.output_ids.tolist() == ar.output_ids.tolist(), method


@pytest.mark.slow
def test_every_method_equals_ar_on_smollm2_in_fp32_on_the_avx2_build(smollm2_fp32, monkeypatch):
    """What a CPU without AVX-512 runs by default (fp32, kernels/cpu_avx2.c's linears, each step unpadded): the
    real model, every method token-equal to `ar`."""
    from specvocab.engine.prompts import encode_prompt, load_prompts
    _isa(monkeypatch, "avx2")
    model, tok, info = smollm2_fp32
    monkeypatch.setattr(model, "_specvocab_native", None, raising=False)  # packed afresh for this build, then restored
    p = load_prompts("spec_bench", per_category=1)[1]
    ids = encode_prompt(tok, info, p.turns[:1], [], system_prompt=p.system_prompt)
    ar = generate(model, ids, method="ar", tokenizer=tok, info=info, max_new_tokens=16)
    assert native_model(model).head_kernel.isa == "avx2" and backend_label(model) == "native"
    for method, kw in [("pld", {}), ("unispec", {"draft_size": 15}),
                       ("eagle", {"draft_size": 7, "eagle_depth": 3, "vocab": "microspec", "w_max": 128})]:
        res = generate(model, ids, method=method, tokenizer=tok, info=info, max_new_tokens=16, **kw)
        assert res.output_ids.tolist() == ar.output_ids.tolist(), method


def test_the_cache_is_allocated_once_and_compacted_in_place():
    model = untie_head(load_model("random-llama")[0])
    t = make_target(model, "native")
    t.begin(200)
    k_ptr = t.cache.k.data_ptr()
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        t.prefill(torch.as_tensor(rng.integers(0, 512, 30)))
        for _ in range(10):
            parents = torch.tensor(random_parents(6, rng))
            tokens = torch.as_tensor(rng.integers(0, 512, 6))
            d, a = tree_layout(parents)
            t.forward_tree(tokens, parents, d, a)
            before = t.cache.k[:, :, t.committed + 3].clone()
            path = [0, 3] if parents[3] == 0 else [0]
            t.compact(6, path)
            if path == [0, 3]:                                   # node 3's entries moved to the next slot
                assert torch.equal(t.cache.k[:, :, t.committed - 1], before)
    assert t.cache.k.data_ptr() == k_ptr


def test_bucket_rows_and_tail_index():
    assert [bucket_rows(n) for n in (1, 3, 4, 5, 8, 9, 17)] == [4, 4, 4, 8, 8, 16, 32]
    assert MIN_ROWS == 4
    parents = torch.tensor([-1, 0, 0, 2])                        # root, two children, a grandchild under 2
    d, a = tree_layout(parents)
    P = BLOCK + 30
    idx, ok = tail_index(P, P + d, a, d)
    base = BLOCK                                                 # the tail starts at the block holding P
    # row 3 (depth 2): committed positions base..P-1 in their slots, then root, node 2, node 3
    want = list(range(base, P)) + [P + 0, P + 2, P + 3]
    assert idx[3][ok[3]].tolist() == want
    assert idx[1][ok[1]].tolist() == list(range(base, P)) + [P + 0, P + 1]
    assert ok.sum(1).tolist() == [P - base + 1, P - base + 2, P - base + 2, P - base + 3]


# --- trees deeper than a block: the tail takes as many blocks as the deepest node reaches ---------------

def test_tail_blocks_count_to_the_deepest_node_and_the_tail_index_spans_them():
    # the deepest node sits at P + depth; the tail starts at the block holding P
    assert [tail_blocks(P, d) for P, d in ((0, 0), (31, 32), (32, 31), (0, 63), (0, 64), (10, 54), (10, 53))] == \
        [2, 2, 2, 2, 3, 3, 2]
    P, depth = 2 * BLOCK + 10, 54                                # the deepest node at 4 BLOCK: a third block's first
    parents = torch.arange(-1, depth)                            # a chain of 54 drafts
    d, a = tree_layout(parents)
    idx, ok = tail_index(P, P + d, a, d)
    assert idx.shape == ok.shape == (depth + 1, 3 * BLOCK)
    assert idx[-1][ok[-1]].tolist() == list(range(2 * BLOCK, P + depth + 1))    # a chain: slot = position
    with pytest.raises(NativeError, match="needs 3 tail blocks"):
        tail_index(P, P + d, a, d, blocks=2)


def _deep_trees(root: int, path: list[int], vocab: int, rng: np.random.Generator) -> list[tuple[DraftTree, list[int]]]:
    """(tree, the path's nodes) for: root + path as a chain; and the path at random node indices among decoys
    hanging at any depth (some below the path's block edge), in a topological order by depth."""
    out = [(DraftTree.chain(root, path), list(range(len(path) + 1)))]
    tokens, parents, depth, nodes = [root], [-1], [0], [0]
    for tok in path:                                             # the path, each step with a random decoy or two
        for _ in range(int(rng.integers(0, 3))):
            tokens.append(int(rng.integers(0, vocab)))
            parents.append(int(rng.choice(nodes)))
            depth.append(depth[parents[-1]] + 1)
        tokens.append(tok)
        parents.append(nodes[-1])
        depth.append(depth[nodes[-1]] + 1)
        nodes.append(len(tokens) - 1)
    order = sorted(range(len(tokens)), key=lambda i: (depth[i], rng.random()))   # old node at each new index
    new = {old: k for k, old in enumerate(order)}
    tree = DraftTree(torch.tensor([tokens[i] for i in order]),
                     torch.tensor([-1] + [new[parents[i]] for i in order[1:]]))
    out.append((tree, [new[i] for i in nodes]))
    return out


@pytest.mark.parametrize("cpu_kernels", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["random-llama", "random-gemma3"])
def test_rows_of_trees_deeper_than_a_block_are_the_ar_rows(name, dtype, cpu_kernels):
    """A path of 54 draft tokens after 74 committed ones (its deepest node at 4 BLOCK, the first position of a
    third tail block), as a chain and inside a tree of decoys in another node order: every path row is the `ar`
    row of the same tokens, bit for bit - fp32 and bf16, the CPU kernels on and off (torch's exact attention),
    llama and gemma3 (a 16-token sliding window over the tail). Mutants checked: the tail one block short at the
    edge (`tail_blocks` without its + 1); the C attention reading two tail blocks whatever idx holds; the torch
    path's tail cut to two blocks."""
    model = untie_head(load_model(name, dtype=dtype)[0]).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    rng = np.random.default_rng(9)
    prompt = torch.as_tensor(rng.integers(0, 512, 2 * BLOCK + 10))
    root, path = int(rng.integers(0, 512)), rng.integers(0, 512, 54).tolist()
    t = NativeTarget(model, cpu_kernels=cpu_kernels)
    t.begin(prompt.numel() + 200)
    with torch.inference_mode():
        t.prefill(prompt, all_logits=False)
        rows = []
        for tree, nodes in _deep_trees(root, path, 512, rng):        # nothing committed: each over the same cache
            d, a = tree_layout(tree.parents)
            assert int(d.max()) == len(path) and t.committed % BLOCK + len(path) == 2 * BLOCK   # the edge
            rows.append(t.forward_tree(tree.tokens, tree.parents, d, a)[1][nodes].clone())
        ar = []
        for tok in [root] + path:
            ar.append(t.forward_tree(torch.tensor([tok]), torch.tensor([-1]), torch.zeros(1, dtype=torch.long),
                                     torch.ones(1, 1, dtype=torch.bool))[1][0].clone())
            t.compact(1, [0])
    ar = torch.stack(ar)
    dt = next(model.parameters()).dtype
    assert native_model(model).kernel_on == (cpu_kernels and cpu.linear_reason(torch.device("cpu"), dt) is None)
    for got in rows:
        assert got.shape == ar.shape
        assert all(torch.equal(got[j], ar[j]) for j in range(len(path) + 1)), \
            [j for j in range(len(path) + 1) if not torch.equal(got[j], ar[j])]
    assert not torch.equal(ar[-1], ar[-2])                           # distinct rows are compared


class ChainDrafter(Drafter):
    """Proposes the next `k` tokens of a known continuation (the `ar` output) as one chain: where verification
    is exact, every step accepts all of it."""

    name = "known-chain"
    uses_prefill_logits = False

    def __init__(self, continuation: list[int], prompt_len: int, k: int):
        self.continuation, self.L, self.k = continuation, prompt_len, k

    def propose(self, ids: torch.Tensor) -> DraftTree:
        m = ids.numel() - self.L                               # tokens generated so far; the root is the last
        return DraftTree.chain(int(ids[-1]), self.continuation[m:m + self.k])


def _committed_rows(monkeypatch) -> list[torch.Tensor]:
    """Spy on NativeTarget: the logits row of every accepted node, in commit order (row i predicts token i + 1)."""
    rows, last = [], {}
    fwd, compact = NativeTarget.forward_tree, NativeTarget.compact

    def forward_tree(self, *a):
        hidden, last["logits"] = fwd(self, *a)
        return hidden, last["logits"]

    def compact_spy(self, num_new, keep):
        rows.extend(last["logits"][keep].clone())
        return compact(self, num_new, keep)
    monkeypatch.setattr(NativeTarget, "forward_tree", forward_tree)
    monkeypatch.setattr(NativeTarget, "compact", compact_spy)
    return rows


@pytest.mark.parametrize("backend,dtype,cpu_kernels", [("native", "fp32", True), ("native", "fp32", False),
                                                       ("native", "bf16", True), ("native", "bf16", False),
                                                       ("hf", "fp32", True)])
def test_chains_deeper_than_a_block_decode_exactly_to_ar(backend, dtype, cpu_kernels, monkeypatch):
    """pld at draft sizes 40 and 64 on a repetitive prompt, and a drafter proposing the `ar` continuation 60 tokens
    at a time (a step accepts 61 tokens: its chain crosses block edges): output equal to `ar`'s, fp32 and bf16,
    the CPU kernels on and off, and the hf backend; on the native path every committed token's logits row is
    `ar`'s bit for bit (a random model's argmax barely reads the context: outputs alone would miss a lost key).
    Mutants checked: the depth cap of fixed-shape verification put back (the first deep step raises); the tail
    one block short at the edge; the third tail block's keys dropped."""
    model = untie_head(load_model("random-llama", dtype=dtype)[0]).to(
        torch.bfloat16 if dtype == "bf16" else torch.float32)
    ids = (list(range(7, 27)) * 3)[:50]
    kw = dict(max_new_tokens=130, eos_ids=[], backend=backend, cpu_kernels=cpu_kernels)
    rows = _committed_rows(monkeypatch)
    ar = generate(model, ids, method="ar", **kw).output_ids.tolist()
    ar_rows = list(rows)
    for g in (40, 64):
        res = generate(model, ids, method="pld", draft_size=g, **kw)
        assert res.output_ids.tolist() == ar, g
        assert res.steps < len(ar)                                   # pld drafted and was accepted
    rows.clear()
    res = generate(model, ids, method="pld", draft_size=60, drafter=ChainDrafter(ar, len(ids), 60), **kw)
    assert res.output_ids.tolist() == ar
    assert res.step_sizes[1] == 61 and max(res.step_sizes) > 2 * BLOCK - 4    # the whole chain, past a block
    if backend == "native":
        assert len(ar_rows) == len(ar) - 1 and len(rows) >= len(ar) - 1
        assert [j for j in range(len(ar) - 1) if not torch.equal(rows[j], ar_rows[j])] == []


# --- bad input -------------------------------------------------------------------------------------------

def test_an_unknown_architecture_falls_back_with_one_line_or_is_refused(capsys):
    from transformers import AutoModelForCausalLM, GPT2Config
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    assert resolve_backend(model, "auto") == "hf"
    assert "native forward unavailable" in capsys.readouterr().err
    with pytest.raises(NativeError, match="llama, qwen2, qwen3, gemma3_text"):
        resolve_backend(model, "native")
    with pytest.raises(NativeError, match="backend='hf'"):
        NativeModel(model)
    with pytest.raises(BackendError, match="choose one of"):
        resolve_backend(model, "onnx")


def test_without_the_cpu_kernels_the_native_path_runs_onednn_and_says_so(monkeypatch):
    """A CPU where kernels.cpu cannot build (no compiler, no AVX512-BF16): `native` runs F.linear and the
    torch attention, its label says `native-blas`, and the decode is unchanged in kind (every method == ar)."""
    from specvocab.kernels.cpu import CpuKernelError
    model = load_model("random-llama", dtype="bf16")[0]
    cpu_as(monkeypatch, flags=set(cpu.BUILD_FLAGS) | set(cpu.AVX2_FLAGS))     # AVX-512 without AVX512-BF16
    net = NativeModel(model)
    assert net.use_cpu_kernels(True) is False and "avx512_bf16" in net.cpu_kernels_reason()
    assert backend_label(model) == "native-blas"
    with pytest.raises(CpuKernelError, match="not available here"):
        cpu.pack(model.get_output_embeddings().weight)
    ar = generate(model, [5, 6, 7, 8], method="ar", max_new_tokens=20, eos_ids=[])
    assert not native_model(model).kernel_on
    for method, kw in LOSSLESS[:3]:
        assert generate(model, [5, 6, 7, 8], method=method, max_new_tokens=20, eos_ids=[],
                        **kw).output_ids.tolist() == ar.output_ids.tolist()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_with_the_cpu_kernels_a_step_runs_its_tree_unpadded_and_g_stays(dtype):
    """bf16 or fp32 on a CPU where kernels.cpu runs: no row buckets (engine.target.pads_rows), so a tree of g + 1
    nodes costs g + 1 rows and g is not raised; without the kernels (cpu_kernels=False) the bucket edge again."""
    from specvocab.engine.harness import bucket_edge
    from specvocab.engine.target import pads_rows
    model = load_model("random-llama", vocab_size=300, hidden_size=64, num_layers=1, dtype=dtype)[0]
    uni = SpecConfig.preset("unispec")
    why = cpu.linear_reason(torch.device("cpu"), next(model.parameters()).dtype)
    if why is not None:
        pytest.skip(f"the CPU kernels do not run here: {why}")
    assert not pads_rows(model) and pads_rows(model, cpu_kernels=False)
    assert [bucket_edge(uni, model, g) for g in (1, 2, 4, 7)] == [1, 2, 4, 7]
    floor = native_model(model).row_floor()                      # rule 1's floor, as measured on this CPU
    edges = [bucket_edge(uni.replace(cpu_kernels=False), model, g) for g in (1, 2, 4, 7)]
    assert edges == [max(g, bucket_rows(g + 1, floor) - 1) for g in (1, 2, 4, 7)]
    assert all(e + 1 == bucket_rows(e + 1, floor) >= floor for e in edges)      # each edge fills its bucket
    rows = []
    net_forward = NativeModel.forward

    def spy(self, ids, *a, **kw):
        rows.append(ids.numel())
        return net_forward(self, ids, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NativeModel, "forward", spy)
        generate(model, [1, 2, 3, 4], method="unispec", max_new_tokens=6, eos_ids=[], draft_size=2)
        unpadded = rows[1:]
        rows.clear()
        generate(model, [1, 2, 3, 4], method="unispec", max_new_tokens=6, eos_ids=[], draft_size=2,
                 cpu_kernels=False)
    assert max(unpadded) <= 3                                         # trees of <= 3 nodes, unpadded
    assert all(r == bucket_rows(r, floor) for r in rows[1:])          # every step a bucket of >= floor rows


def test_backend_labels_name_the_cpu_path():
    model = load_model("random-llama", dtype="bf16")[0]
    kernels_here = cpu.available() is None
    assert backend_label(model) == ("native" if kernels_here else "native-blas")
    assert backend_label(model, cpu_kernels=False) == "native-blas"
    assert backend_label(model, compile=True) == "native-compiled"        # compiled: F.linear inside the graph
    fp32 = load_model("random-llama", dtype="fp32")[0]                  # the fp32 linears: AVX-512F is enough
    assert backend_label(fp32) == ("native" if cpu.isa() is not None else "native-blas")
    assert backend_label(fp32, cpu_kernels=False) == "native-blas"
    assert backend_label(model, "hf") == "hf" and backend_label(model, fixed_shape=False) == "native-sdpa"


def test_a_tree_larger_than_fixed_rows_is_a_clear_error(monkeypatch):
    """A draft size over the largest bucket (fixed `verify_rows`) fails before the prefill, naming the limit and
    the fix; a tree over it at a step (a drafter that drafts more than its draft size) fails there, alike.
    Mutants checked: the check after the prefill (the prefill spy), the limit off by one (draft_size 7 fits 8 rows)."""
    model = load_model("random-llama")[0]
    prefills = []
    real = NativeTarget.prefill
    monkeypatch.setattr(NativeTarget, "prefill", lambda self, *a, **kw: prefills.append(1) or real(self, *a, **kw))
    want = ("a draft tree of 13 nodes (root included) exceeds the largest verify bucket, 8 rows (verify_rows=8) — "
            "lower draft_size to at most 7 or set verify_rows to at least 13")
    with pytest.raises(BackendError) as e:
        generate(model, [1, 2, 3], method="unispec", max_new_tokens=8, eos_ids=[], draft_size=12,
                 verify_rows=8)
    assert str(e.value) == want and prefills == []                    # before the decode started
    assert generate(model, [1, 2, 3], method="pld", max_new_tokens=8, eos_ids=[], draft_size=7,
                    verify_rows=8).new_tokens == 8                    # the largest draft size that fits
    ids = [5, 6, 7] * 6
    with pytest.raises(BackendError, match="a draft tree of 13 nodes .* 8 rows .* at most 7"):
        generate(model, ids, method="pld", max_new_tokens=8, eos_ids=[], draft_size=7, verify_rows=8,
                 drafter=ChainDrafter(ids * 4, len(ids), 12))         # drafts 12 at a step: the step's check
    out = generate(model, [1, 2, 3], method="unispec", max_new_tokens=8, eos_ids=[], draft_size=12,
                   verify_rows=16)
    assert out.new_tokens == 8


def test_the_forward_benchmark_prints_what_it_compared_and_the_targets(tmp_path, capsys):
    from specvocab.engine.jobs import forward
    out = tmp_path / "fwd.parquet"
    forward.main(["--model", "random-llama", "--dtype", "fp32,bf16", "--backends", "hf,native", "--sizes", "1,8,16",
                  "--context", "40", "--repeats", "1", "--copy-mb", "8", "--threads", "1", "--ar-tokens", "0",
                  "--out", str(out)])
    printed = capsys.readouterr().out
    assert "copy bandwidth" in printed and "bare matmul" in printed and "bound" in printed
    assert "ar step native bf16" in printed and "verify(16) / verify(1)" in printed
    assert "ar step native fp32" in printed                     # informational: the fp32 path vs hf
    frame = pl.read_parquet(out)
    assert frame.height == 2 * 2 * 3                            # dtypes x backends x sizes
    assert set(frame["backend"]) == {"hf", "native"} and (frame["ms"] > 0).all() and (frame["bare_ms"] > 0).all()


def test_the_forward_benchmark_refuses_a_backend_it_does_not_know(capsys):
    """A name outside BACKENDS (here a dtype glued to a backend) is an error naming the choices, before any model
    loads; it once timed `native` under the unknown name."""
    from specvocab.engine.jobs import forward
    with pytest.raises(SystemExit):
        forward.main(["--model", "random-llama", "--backends", "hf-fp32,native", "--sizes", "1"])
    err = capsys.readouterr().err
    assert "unknown backend(s) 'hf-fp32'" in err and "native-blas" in err and "--dtype" in err


def test_the_forward_benchmark_times_the_sizes_round_robin(monkeypatch):
    """Each n's warm-up first, then every repeat runs every size once, in order: a slow spell of a shared
    machine falls on all sizes alike (a per-size loop put one spell on one n and moved verify(n) / verify(1)).
    The medians are of each size's own calls."""
    from specvocab.engine.jobs import forward
    calls, cost = [], {1: 0.001, 8: 0.003}

    def fake_step(model, backend, n, context):
        def step():
            calls.append(n)
            time.sleep(cost[n])
        return step
    monkeypatch.setattr(forward, "forward_step", fake_step)
    timed = forward.forward_ms(load_model("random-llama")[0], "native", [1, 8], 40, 3)
    assert calls == [1, 8] + [1, 8] * 3
    assert 1.0 <= timed[1][0] < timed[8][0] and timed[8][0] >= 3.0       # each size its own calls


# --- the accelerator's pieces, checked on a CPU: the grouped fold and the graphed decode's buffers ------------

def test_the_group_fold_is_the_sum_and_blind_to_padding_blocks():
    """`_group_fold` (rule 3 where cumsum is a parallel scan): the fold of the blocks' terms, and bitwise the
    same when blocks a row cannot see (exact zeros) are appended - an `ar` step has fewer blocks than a tree.
    Mutant checked: one `sum` over the unpadded blocks (its length grows with the blocks; fails the padding
    assert on this CPU's vectorised sum)."""
    from specvocab.engine.native import FOLD_GROUP, _group_fold
    g = torch.Generator().manual_seed(0)
    for blocks in (3, FOLD_GROUP - 1, FOLD_GROUP + 6, 2 * FOLD_GROUP + 1):
        wl = torch.rand(2, 5, 4, blocks, generator=g)
        wo = torch.randn(2, 5, 4, blocks, 8, generator=g)
        total, out = _group_fold(wl, wo)
        torch.testing.assert_close(total, wl.sum(-1, keepdim=True), rtol=1e-6, atol=0)
        torch.testing.assert_close(out, wo.sum(-2), rtol=1e-5, atol=1e-6)
        for extra in (1, 40, 2 * FOLD_GROUP):
            t2, o2 = _group_fold(torch.cat([wl, wl.new_zeros(2, 5, 4, extra)], -1),
                                 torch.cat([wo, wo.new_zeros(2, 5, 4, extra, 8)], -2))
            assert torch.equal(t2, total) and torch.equal(o2, out)


@pytest.mark.parametrize("name", ["random-llama", "random-gemma3"])
def test_the_graphed_decode_feeds_its_buffers_and_equals_the_eager_decode(name, monkeypatch):
    """`GraphedDecode` on a CPU (a recording replayed eagerly, `engine.target.GRAPH_DEVICES`): one capture per
    (rows, committed blocks), the step's tokens / positions / tail / write slots copied into its buffers, the
    static cache reused by the next decode - and every method's output equal to the ungraphed decode's.
    Mutants checked: write slots left at the capture's P (outputs differ), a graph keyed by rows alone
    (outputs differ once the committed blocks change), a fresh cache per decode (the reuse assert)."""
    import specvocab.engine.target as target_mod
    model = untie_head(load_model(name)[0])
    ids = np.random.default_rng(8).integers(0, 512, 2 * BLOCK - 5).tolist()
    kw = dict(max_new_tokens=40, eos_ids=[], backend="native", w_max=128)
    runs = [("ar", {}), ("unispec", {"draft_size": 12}),
            ("eagle", {"eagle_head": "random", "draft_size": 6, "eagle_depth": 3, "vocab": "microspec"})]
    plain = {m: generate(model, ids, method=m, **kw, **k).output_ids.tolist() for m, k in runs}
    monkeypatch.setattr(target_mod, "GRAPH_DEVICES", ("cuda", "cpu"))
    net = target_mod.native_model(model)
    for m, k in runs:
        assert generate(model, ids, method=m, **kw, **k).output_ids.tolist() == plain[m], m
    graphs = net.graphs()
    assert {key[1] for key in graphs.graphs} >= {1, 2}          # the decode crossed a block boundary
    # a chain of the ar output's 39 tokens after its first, over 59 committed ones: a third tail block,
    # its own graph (tail blocks in the key)
    deep = generate(model, ids, method="pld", draft_size=45, drafter=ChainDrafter(plain["ar"], len(ids), 45), **kw)
    assert deep.output_ids.tolist() == plain["ar"] and deep.step_sizes == [1, 39]     # one step: all of it
    assert {key[3] for key in graphs.graphs} == {2, 3}
    cache = net.graphs().cache
    t = target_mod.make_target(model, "native")
    t.begin(100)
    assert t.cache is cache and t.graphs is graphs               # the static cache serves the next decode
