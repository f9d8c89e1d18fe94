"""The fused decoder layer (kernels.cpu.ops.layer: `pack_layer`, `layer`): bf16 on the bf16 builds, fp32 on the
AVX2 library, for the families' options (Llama, qwen's bias and q/k norms, Gemma's norms and GELU, EAGLE-1's layer
without an input norm, EAGLE-3's 2 d input, widths off the vector size). The layer and the cache it writes equal
`layer_reference`; a row's bits are the same alone and among others, on any thread count.

Mutants these tests were checked against (each fails at least one test here):
- RoPE's rotate-half sign flipped; the activation taken before the gate/up split's other half (SiLU for Gemma's
  GELU); the norm weight multiplied before rounding h (Llama's order); the post-attention / post-MLP norms
  skipped; k and v swapped in the cache write; the act rows not compacted (row r > 0 reads the wrong values);
  the q norm skipping the first head                                                  -> layer reference (both)
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu
from specvocab.kernels.cpu.ops import layer as layer_op
from tests.kernels_cpu_testing import LAYERS, builds_with, layer_case, run_layer, use_build

KERNELS = ([pytest.param("layer_bf16", b, torch.bfloat16, id=f"bf16-{b}") for b in builds_with("layer_bf16")]
           + [pytest.param("layer_f32", b, torch.float32, id=f"fp32-{b}") for b in builds_with("layer_f32")])


def close(a, b, dtype):
    """Within rounding. fp32: 1e-5 relative. bf16: the norms' sums of squares and the activations' exp / tanh run
    in other orders than torch's, and the attention's exp differs from torch's in the last fp32 bit, which can
    move a bf16-rounded weight by one step; so a value may land a bf16 step or more away. A real error moves many
    values by more: under 5% may differ by more than one bf16 step of their own size (the power test below
    checks it)."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    if dtype == torch.float32:
        return float(diff.max() / b.abs().max()) < 1e-5
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)     # one bf16 step at b
    return float(diff.max() / b.abs().max()) < 2e-2 and float((diff > step * 1.01).float().mean()) < 0.05


@pytest.mark.parametrize("op,build,dtype", KERNELS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_fused_layer_equals_its_reference_and_gives_a_row_the_same_bits(op, build, dtype, name, monkeypatch):
    """The layer and its cache writes against `layer_reference`; the layer's own update is large against that
    bound (a skipped step would show); row r run alone (the rows before it already in the cache) is row r of the
    6-row run, bitwise, and so is the run on 1 or 2 threads."""
    use_build(monkeypatch, build, op)
    spec, x, args, attn_in = layer_case(**LAYERS[name], dtype=dtype)
    assert spec.qkv.isa == cpu.provider(op).library
    got, kc, vc = run_layer(cpu.layer, spec, x, args, attn_in)
    ref, kr, vr = run_layer(cpu.layer_reference, spec, x, args, attn_in)
    assert got.dtype == kc.dtype == dtype
    assert close(got, ref, dtype) and close(kc, kr, dtype) and close(vc, vr, dtype)
    assert not close(x, ref, dtype)
    for r in range(x.shape[0]):
        cos, sin, kc0, vc0, slots, b0, pos, idx, ok, window, scale = args
        alone = cpu.layer(x[r:r + 1], spec, cos[r:r + 1], sin[r:r + 1], kc.clone(), vc.clone(), slots[r:r + 1], b0,
                          pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], window, scale,
                          attn_in=None if attn_in is None else attn_in[r:r + 1])
        assert torch.equal(alone[0], got[r]), (name, r)
    for threads in (1, 2):
        one, kc1, _ = run_layer(cpu.layer, spec, x, args, attn_in, threads=threads)
        assert torch.equal(one, got) and torch.equal(kc1, kc)


def test_the_fused_layers_reference_catches_a_wrong_step(monkeypatch):
    """Each wrong step, made in the reference, falls outside `close`: the equality above can see it."""
    use_build(monkeypatch, builds_with("layer_bf16")[-1], "layer_bf16")
    spec, x, args, attn_in = layer_case(**LAYERS["gemma"])
    ref, _, _ = run_layer(cpu.layer_reference, spec, x, args, attn_in)
    flip = lambda t: torch.cat((t.chunk(2, dim=-1)[1], -t.chunk(2, dim=-1)[0]), dim=-1)      # noqa: E731
    spec.act = "silu"                                                         # GELU taken as SiLU
    assert not close(run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref, torch.bfloat16)
    spec.act = "gelu_tanh"
    monkeypatch.setattr(layer_op, "_rotate_half", flip)                       # RoPE's sign
    assert not close(run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref, torch.bfloat16)
    monkeypatch.undo()
    spec.norms["post_mlp_norm"] = torch.ones_like(spec.norms["post_mlp_norm"])   # a norm skipped
    assert not close(run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref, torch.bfloat16)


@pytest.mark.parametrize("build", builds_with("layer_bf16"))
def test_the_fused_layer_refuses_what_it_cannot_run(build, monkeypatch):
    use_build(monkeypatch, build, "layer_bf16")
    spec, x, args, _ = layer_case()
    with pytest.raises(cpu.CpuKernelError, match="bf16"):
        run_layer(cpu.layer, spec, x.float(), args, None)
    with pytest.raises(cpu.CpuKernelError, match="attn_in"):
        run_layer(cpu.layer, spec, x, args, torch.zeros(x.shape[0], 7).bfloat16())
    w = torch.zeros(8, 8).bfloat16()
    with pytest.raises(cpu.CpuKernelError, match="act="):
        cpu.pack_layer(w, None, w, w, w, heads=1, kv_heads=1, head_dim=16, eps=1e-6, in_norm=None,
                       pre_mlp_norm=torch.ones(8), act="relu")
    with pytest.raises(cpu.CpuKernelError, match="head_dim"):
        cpu.pack_layer(w, None, w, w, w, heads=1, kv_heads=1, head_dim=8, eps=1e-6, in_norm=None,
                       pre_mlp_norm=torch.ones(8))


def test_the_fp32_layer_is_refused_off_the_avx2_library(monkeypatch):
    """The fp32 layer's linears are the AVX2 library's: packing an fp32 layer where the fp32 linear runs on
    AVX-512 is an error naming the build; a bf16 x or cache on an fp32 layer is an error naming the dtype."""
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")
    if cpu.isa() == "avx512":
        with pytest.raises(cpu.CpuKernelError, match="fp32 fused layer runs on the AVX2 build"):
            layer_case(dtype=torch.float32)
    use_build(monkeypatch, "avx2", "layer_f32")
    spec, x, args, _ = layer_case(dtype=torch.float32)
    cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale = args
    with pytest.raises(cpu.CpuKernelError, match="fp32"):
        cpu.layer(x.bfloat16(), spec, cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale)
    with pytest.raises(cpu.CpuKernelError, match="contiguous fp32"):
        cpu.layer(x, spec, cos, sin, kc.bfloat16(), vc.bfloat16(), slots, b0, pos, idx, ok, window, scale)
