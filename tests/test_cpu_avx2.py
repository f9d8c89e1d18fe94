"""The AVX2 build of the fp32 kernels - linear, decode attention, top-k, layer - (kernels/cpu_avx2.c): what a CPU
without AVX-512 - most laptops and desktops - runs for the native fp32 decode (the attention on AVX-512 CPUs too).
Against the float64 product, the row invariance the exact decode needs, and the choice of build
(`kernels.cpu.isa`, `$SPECVOCAB_CPU_ISA`). The decode on it, end to end, is in tests/test_native.py (`isa="avx2"`,
`fp32-avx2`).

Mutants these tests were checked against (each fails at least one test here):
- the partial last K chunk of x loaded whole (the next row's values leak in)          -> the product
- the 1-row tile summing its chunks in reverse order; hsum4x8 pairing lanes (0,1) for
  the 2-row tile only                                                                   -> row invariance
- bias dropped                                                                          -> the product
- an fp32 weight packed at the AVX-512 build's 16-wide chunks for this build            -> the product
- `pack` ignoring $SPECVOCAB_CPU_ISA (always the AVX-512 build where it runs)           -> the choice
- `linear_reason` counting only the AVX-512 build (fp32 without AVX-512 -> native-blas) -> a CPU with AVX2 only
- engine.calibration.device_name the same with and without SPECVOCAB_CPU_ISA=avx2; the
  default dtype left at bf16 there                                                      -> the choice
- the fp32 attention: the window ignored on committed keys; `ok` ignored; the tail read in slot order (idx
  ignored); the weights' sum missing its last key; a 5-chunk head's values pass run at 4 chunks; scale
  dropped                                                                               -> its reference
- engine.native never calling it (the torch exact path in fp32)                         -> tests/test_native.py
- top-k: the masked last vector of 8 skipped; ties inserted ahead of the incumbent (>=); the log-sum-exp's high
  half dropped; the AVX2 build's passes never called (torch instead)                    -> the top-k test
- route_linears skipping fp32 linears (bf16 only, as before)                           -> route_linears
- the fp32 layer: RoPE's rotate-half sign; the post-MLP norm skipped; GELU taken as SiLU; k and v swapped in
  the cache write; the activation rows not compacted; the q norm skipping the first head -> the layer test
- engine.native never fusing an fp32 layer                                              -> tests/test_native.py
- kernels.cpu._portable ignoring SPECVOCAB_CPU_ISA (the AVX-512 copy of the tree / window step)
                                                        -> tests/test_unispec_tree.py, tests/test_kernels_window.py
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu

CPU = torch.device("cpu")


@pytest.fixture
def avx2(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    if cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu._why_not2}")


@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576), (7, 9), (5, 3)])
def test_the_avx2_linear_equals_the_product_and_gives_a_row_the_same_bits_for_every_row_count(avx2, N, K):
    """tests/test_cpu_kernels.py's fp32 linear test on this build (the float64 product to fp32 rounding, bias
    included; a row's bits the same at every M - every place in the 3-, 2- and 1-row tiles - on any thread count,
    in any row order; the partial last K chunk masked), packed at 8-float chunks, and a row first in its tile."""
    from tests.test_cpu_kernels import (
        test_the_fp32_linear_equals_the_product_and_gives_a_row_the_same_bits_for_every_row_count as fp32_case)
    fp32_case(N, K)
    g = torch.Generator().manual_seed(N + K)
    p = cpu.pack(torch.randn(N, K, generator=g))
    assert p.isa == "avx2" and p.packed.shape[-1] == 8                # [N/4][K/8][4][8]
    x = torch.randn(11, K, generator=g)
    full = p(x, threads=1)
    for M in range(1, 12):
        assert torch.equal(p(x[11 - M:])[0], full[11 - M])              # row 11 - M first in its tile


def test_the_build_is_chosen_by_the_cpu_and_by_the_environment(monkeypatch):
    """auto: AVX-512 where it runs; avx2 turns every AVX-512 kernel off (a run here is then what an AVX2 CPU
    runs: bf16 kernels, top-k, window step in torch) while the fp32 linear still runs; a bad value names the
    choices."""
    from specvocab.engine.calibration import device_name
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    expected = "avx512" if cpu.available_fp32() is None else ("avx2" if cpu._load_avx2() is not None else None)
    assert cpu.isa() == expected
    from specvocab.kernels.hardware import BF16_CPU_FLAGS, cpu_flags, cpu_has_native_bf16, default_dtype
    here = device_name("cpu")
    assert cpu_has_native_bf16() == any(f in cpu_flags() for f in BF16_CPU_FLAGS)
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert device_name("cpu") == here + ":avx2"          # calibrated g* and timings kept apart from AVX-512's
    assert not cpu_has_native_bf16()                     # an AVX2 CPU has no bf16 dot products: fp32 by default
    assert default_dtype(env="", cuda=False, cpu_bf16=cpu_has_native_bf16()) == torch.float32
    if cpu._load_avx2() is None:
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu._why_not2}")
    assert cpu.isa() == "avx2"
    assert "SPECVOCAB_CPU_ISA=avx2" in cpu.available_fp32() and cpu.available() is not None
    assert cpu.linear_reason(CPU, torch.float32) is None
    assert cpu.linear_reason(CPU, torch.bfloat16) is not None
    assert cpu.pack(torch.randn(8, 20)).isa == "avx2"
    with pytest.raises(cpu.CpuKernelError, match="not available here"):
        cpu.pack(torch.randn(8, 20).bfloat16())
    z = torch.randn(2, 100)
    assert torch.equal(cpu.topk(z, 3)[1], torch.topk(z, 3).indices)  # the AVX2 pass, not the AVX-512 one
    monkeypatch.setenv(cpu.ISA_ENV, "sse4")
    with pytest.raises(cpu.CpuKernelError, match=r"SPECVOCAB_CPU_ISA='sse4' is not one of \['auto', 'avx512', "
                                                 r"'avx2'\]"):
        cpu.isa()


def test_a_cpu_with_avx2_but_not_avx512_runs_the_avx2_linear(monkeypatch):
    """/proc/cpuinfo of a laptop (avx2, fma, no avx512*): the AVX-512 library refuses to build and names what is
    missing, the AVX2 build runs the fp32 linear, so `native` in fp32 runs unpadded; without FMA neither runs and
    the reason names both."""
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    for name, value in (("_tried", False), ("_lib", None), ("_why_not", None), ("_tried2", False), ("_lib2", None),
                        ("_why_not2", None), ("_bf16", cpu._bf16)):
        monkeypatch.setattr(cpu, name, value)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    assert "avx512f" in cpu.available_fp32()
    if cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu._why_not2}")
    assert cpu.linear_reason(CPU, torch.float32) is None and "avx512f" in cpu.linear_reason(CPU, torch.bfloat16)
    w = torch.randn(8, 20)
    assert torch.allclose(cpu.pack(w)(torch.ones(1, 20)), w.sum(1)[None], rtol=1e-5, atol=1e-5)
    for name, value in (("_tried", False), ("_lib", None), ("_tried2", False), ("_lib2", None)):
        monkeypatch.setattr(cpu, name, value)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx", "avx2"})
    assert cpu.isa() is None
    why = cpu.linear_reason(CPU, torch.float32)
    assert "avx512f" in why and "fma" in why


def test_topk_and_topk_lse_on_the_avx2_build(avx2, monkeypatch):
    """tests/test_cpu_kernels.py's two top-k tests, run on kernels/cpu_avx2.c's passes (a masked last vector of
    8, ties, NaN, -inf, +inf rows, 1 and 2 threads), which must be the ones called."""
    from tests.test_cpu_kernels import test_topk_is_torchs_topk_and_argmax_keeps_the_first_maximum as topk_case
    from tests.test_cpu_kernels import test_topk_lse_gives_topk_and_each_rows_logsumexp as topk_lse_case
    calls = []
    for name in ("sv2_topk_f32", "sv2_topk_lse_f32"):
        real = getattr(cpu._lib2, name)
        monkeypatch.setattr(cpu._lib2, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    threads = torch.get_num_threads()
    try:
        topk_case()
        topk_lse_case()
    finally:
        torch.set_num_threads(threads)
    assert {"sv2_topk_f32", "sv2_topk_lse_f32"} <= set(calls)


def test_route_linears_runs_a_drafters_fp32_linears_on_the_avx2_kernel(avx2):
    """A drafter kept in fp32 (an EAGLE head on a CPU without bf16 dot products): its small-row linears go
    through this build's kernel, large inputs through F.linear, a bf16 module is left alone here."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40, bias=False))
    assert cpu.route_linears(net, max_rows=8) == 2
    lin = net[0]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu.pack(lin.weight, lin.bias)(x))                  # the kernel's bits
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        big = torch.randn(20, 64)
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))
    assert cpu.route_linears(torch.nn.Linear(64, 8).to(torch.bfloat16)) == 0     # no bf16 kernel under avx2


# --- the fp32 attention (kernels/cpu_avx2.c `sv2_attention_f32`) ------------------------------------------------

needs_attention = pytest.mark.skipif(
    cpu.attention_f32_reason(64) is not None,
    reason=f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu.attention_f32_reason(64)}")


def _attn_case(**shape):
    """tests/test_cpu_kernels.py's attention case (bf16 values) with an fp32 query and cache."""
    from tests.test_cpu_kernels import _attn_case as bf16_case
    q, kc, vc, b0, pos, idx, ok = bf16_case(**shape)
    return q.float(), kc.float(), vc.float(), b0, pos, idx, ok


@needs_attention
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("shape", [dict(H=9, kvh=3, hd=64), dict(H=4, kvh=1, hd=256), dict(H=4, kvh=4, hd=16),
                                   dict(H=10, kvh=2, hd=40), dict(H=2, kvh=2, hd=8, P=0)])
def test_the_fp32_attention_equals_its_reference(window, shape):
    """The float softmax over the row's keys in logical order (committed blocks, then the tail through idx where
    ok), the window applied; head sizes of 1 to 32 chunks (a 5-chunk one: the values' registers in one partial
    pass), no committed block at all."""
    q, kc, vc, b0, pos, idx, ok = _attn_case(**shape)
    got = cpu.attention_f32(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    ref = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    assert got.dtype == torch.float32 and float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    if window and b0:                             # the window matters in this case (the test's power)
        no_window = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, None, 0.125)
        assert float((no_window - ref).abs().max()) > 1e-3
    flipped = ok.clone()
    flipped[:, 3] = ~flipped[:, 3]
    assert float((cpu.attention_f32(q, kc, vc, b0, pos, idx, flipped, window, 0.125) - got).abs().max()) > 1e-4


@needs_attention
def test_the_fp32_attention_gives_a_row_the_same_bits_alone_among_others_on_any_thread_count_and_slot():
    """Row invariance (an `ar` step and a tree): a row alone or among others, 1 or 2 threads; and the same
    logical context read with a block committed or gathered from other slots through the tail gives the same
    bits."""
    q, kc, vc, b0, pos, idx, ok = _attn_case(n=7)
    full = cpu.attention_f32(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=1)
    for r in range(7):
        alone = cpu.attention_f32(q[r:r + 1], kc, vc, b0, pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], 40, 0.125)
        assert torch.equal(alone[0], full[r])
    assert torch.equal(cpu.attention_f32(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=2), full)
    B, cap = cpu.BLOCK, 400
    g = torch.Generator().manual_seed(3)
    q, kc, vc = (torch.randn(s, generator=g) for s in ((1, 9, 64), (3, cap, 64), (3, cap, 64)))
    pos = torch.tensor([3 * B + 5])
    a = cpu.attention_f32(q, kc, vc, 3, pos, torch.arange(3 * B, 5 * B)[None],
                          (torch.arange(3 * B, 5 * B) <= pos)[None], None, 0.125)
    kc2, vc2 = kc.clone(), vc.clone()                 # block 2 moved to slots 300.., block 3's 6 keys to 340..
    kc2[:, 300:300 + B], vc2[:, 300:300 + B] = kc[:, 2 * B:3 * B], vc[:, 2 * B:3 * B]
    kc2[:, 340:346], vc2[:, 340:346] = kc[:, 3 * B:3 * B + 6], vc[:, 3 * B:3 * B + 6]
    kc2[:, 2 * B:3 * B + 6], vc2[:, 2 * B:3 * B + 6] = 0, 0
    idx_b = torch.cat([torch.arange(300, 300 + B), torch.arange(340, 340 + B)])[None]
    ok_b = torch.cat([torch.ones(B, dtype=torch.bool), torch.arange(B) < 6])[None]
    assert torch.equal(cpu.attention_f32(q, kc2, vc2, 2, pos, idx_b, ok_b, None, 0.125), a)


@needs_attention
def test_the_fp32_attention_refuses_what_it_cannot_read():
    q, kc, vc, b0, pos, idx, ok = _attn_case()
    with pytest.raises(cpu.CpuKernelError, match="fp32 cache"):
        cpu.attention_f32(q, kc.bfloat16(), vc.bfloat16(), b0, pos, idx, ok, None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="multiple of 8"):
        cpu.attention_f32(q[..., :12], kc[..., :12].contiguous(), vc[..., :12].contiguous(), b0, pos, idx, ok,
                          None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="contiguous"):
        cpu.attention_f32(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, b0, pos, idx, ok, None, 0.125)
    assert "multiples of 8" in cpu.attention_f32_reason(12)


# --- the fp32 layer (kernels/cpu_avx2.c `sv2_layer_f32`) ------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen", "gemma", "eagle1", "eagle3", "odd"])
def test_the_fp32_layer_equals_its_reference_and_gives_a_row_the_same_bits(avx2, name):
    """tests/test_cpu_kernels.py's layer cases in fp32 (Llama, qwen's bias and q/k norms, Gemma's norms and GELU,
    EAGLE-1's layer without an input norm, EAGLE-3's 2 d input, widths off the vector size): the layer and the
    cache it writes equal `layer_reference` to fp32 rounding; the layer's update is far larger than that bound;
    row r run alone is row r of the 6-row run, bitwise, and 1 or 2 threads give the same bits."""
    from tests.test_cpu_kernels import LAYERS, _layer_case, _run_layer
    spec, x, args, attn_in = _layer_case(**LAYERS[name], dtype=torch.float32)
    assert spec.qkv.isa == "avx2"
    got, kc, vc = _run_layer(cpu.layer, spec, x, args, attn_in)
    ref, kr, vr = _run_layer(cpu.layer_reference, spec, x, args, attn_in)
    assert got.dtype == kc.dtype == torch.float32
    for a, b in ((got, ref), (kc, kr), (vc, vr)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert float((x - ref).abs().max() / ref.abs().max()) > 1e-2
    cos, sin, _, _, slots, b0, pos, idx, ok, window, scale = args
    for r in range(x.shape[0]):
        alone = cpu.layer(x[r:r + 1], spec, cos[r:r + 1], sin[r:r + 1], kc.clone(), vc.clone(), slots[r:r + 1], b0,
                          pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], window, scale,
                          attn_in=None if attn_in is None else attn_in[r:r + 1])
        assert torch.equal(alone[0], got[r]), (name, r)
    kc1, vc1 = args[2].clone(), args[3].clone()
    one = cpu.layer(x, spec, cos, sin, kc1, vc1, slots, b0, pos, idx, ok, window, scale, attn_in=attn_in, threads=1)
    assert torch.equal(one, got) and torch.equal(kc1, kc)


def test_the_fp32_layer_is_refused_off_the_avx2_build(monkeypatch):
    """Its linears are the AVX2 build's: packing an fp32 layer needs that build; a bf16 x or cache on an fp32
    layer is an error naming the dtype."""
    from tests.test_cpu_kernels import _layer_case
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")
    if cpu.isa() == "avx512":
        with pytest.raises(cpu.CpuKernelError, match="fp32 fused layer runs on the AVX2 build"):
            _layer_case(dtype=torch.float32)
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    if cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu._why_not2}")
    spec, x, args, _ = _layer_case(dtype=torch.float32)
    cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale = args
    with pytest.raises(cpu.CpuKernelError, match="fp32"):
        cpu.layer(x.bfloat16(), spec, cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale)
    with pytest.raises(cpu.CpuKernelError, match="contiguous fp32"):
        cpu.layer(x, spec, cos, sin, kc.bfloat16(), vc.bfloat16(), slots, b0, pos, idx, ok, window, scale)

