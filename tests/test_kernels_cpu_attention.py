"""The exact decode's attention (kernels.cpu.ops.attention): `attention` over a bf16 cache on the bf16 builds,
`attention_f32` over an fp32 cache on the AVX2 library (AVX-512 CPUs run it too). Each against
`attention_reference`, and a row's bits are a function of its logical context alone: alone or among others, on
any thread count, its keys committed or gathered from other slots.

Mutants these tests were checked against (each fails at least one test here):
- attention ignoring `ok` (the tree's ancestry) or the sliding window                  -> reference
- attention folding the two tail blocks as one 64-key block                           -> committed vs tail
- attention reading the tail in slot order (idx ignored)                               -> slots moved
- attention's shared value loop weighting every head by the first head's probabilities;
  the fold's rescale of the running output skipped (fa = 1)                           -> reference
- the fp32 attention: the window ignored on committed keys; `ok` ignored; the tail read in slot order (idx
  ignored); the weights' sum missing its last key; a 5-chunk head's values pass run at 4 chunks; scale
  dropped                                                                               -> its reference
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu
from tests.kernels_cpu_testing import attn_case, builds_with, use_build

# (op, build, dtype, the call): each attention kernel on each build that holds it
KERNELS = ([pytest.param("attention_bf16", b, torch.bfloat16, id=f"bf16-{b}") for b in builds_with("attention_bf16")]
           + [pytest.param("attention_f32", b, torch.float32, id=f"fp32-{b}") for b in builds_with("attention_f32")])
SHAPES = [dict(H=9, kvh=3, hd=64), dict(H=4, kvh=1, hd=256), dict(H=4, kvh=4, hd=16),
          dict(H=10, kvh=2, hd=48),                    # 5 heads a KV head: groups of 3 and 2, a half chunk (bf16)
          dict(H=10, kvh=2, hd=40), dict(H=2, kvh=2, hd=8, P=0)]   # fp32: a 5-chunk head; no committed block


def _call(op):
    return cpu.attention if op == "attention_bf16" else cpu.attention_f32


def _takes(op, hd):
    return cpu.takes_head_dim(hd) if op == "attention_bf16" else hd % 8 == 0


@pytest.mark.parametrize("op,build,dtype,shape", [
    pytest.param(*k.values, shape, id=f"{k.id}-{shape['H']}x{shape['kvh']}x{shape['hd']}")
    for k in KERNELS for shape in SHAPES if _takes(k.values[0], shape["hd"])])
@pytest.mark.parametrize("window", [None, 40])
def test_the_attention_equals_its_reference(op, build, dtype, window, shape, monkeypatch):
    """The float softmax over the row's keys in logical order (committed blocks, then the tail through idx where
    ok), the window applied; each head size the kernel takes (up to 16 chunks, a 5-chunk one: the values'
    registers in one partial pass), no committed block at all."""
    use_build(monkeypatch, build, op)
    q, kc, vc, b0, pos, idx, ok = attn_case(**shape, dtype=dtype)
    got = _call(op)(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    ref = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    assert got.dtype == torch.float32 and float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    if window and b0:                             # the window matters in this case (the test's power)
        no_window = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, None, 0.125)
        assert float((no_window - ref).abs().max()) > 1e-3
    flipped = ok.clone()
    flipped[:, 3] = ~flipped[:, 3]
    assert float((_call(op)(q, kc, vc, b0, pos, idx, flipped, window, 0.125) - got).abs().max()) > 1e-4


@pytest.mark.parametrize("op,build,dtype", KERNELS)
def test_the_attention_gives_a_row_the_same_bits_alone_among_others_and_on_any_thread_count(op, build, dtype,
                                                                                            monkeypatch):
    use_build(monkeypatch, build, op)
    q, kc, vc, b0, pos, idx, ok = attn_case(n=7, dtype=dtype)
    full = _call(op)(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=1)
    for r in range(7):
        alone = _call(op)(q[r:r + 1], kc, vc, b0, pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], 40, 0.125)
        assert torch.equal(alone[0], full[r])
    assert torch.equal(_call(op)(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=2), full)


@pytest.mark.parametrize("op,build,dtype", KERNELS)
def test_the_attention_depends_on_logical_positions_not_on_where_keys_lie(op, build, dtype, monkeypatch):
    """The `ar`-step-versus-tree property: the same logical context read (a) with block 2 committed and (b)
    with block 2 in the gathered tail, its keys copied to other cache slots, gives the same bits."""
    use_build(monkeypatch, build, op)
    B = cpu.BLOCK
    n, H, kvh, hd, cap = 1, 9, 3, 64, 400
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, H, hd, generator=g).to(dtype)
    kc = torch.randn(kvh, cap, hd, generator=g).to(dtype)
    vc = torch.randn(kvh, cap, hd, generator=g).to(dtype)
    pos = torch.tensor([3 * B + 5])                  # the row sees positions 0 .. 3B + 5
    # (a) three committed blocks; the tail is block 3 (positions 3B .. 3B + 5 in their own slots) and block 4
    idx_a = torch.arange(3 * B, 5 * B)[None]
    ok_a = (torch.arange(3 * B, 5 * B) <= pos)[None]
    a = _call(op)(q, kc, vc, 3, pos, idx_a, ok_a, None, 0.125)
    # (b) two committed blocks; block 2's keys moved to slots 300.., block 3's to 340..
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, 300:300 + B], vc2[:, 300:300 + B] = kc[:, 2 * B:3 * B], vc[:, 2 * B:3 * B]
    kc2[:, 340:340 + 6], vc2[:, 340:340 + 6] = kc[:, 3 * B:3 * B + 6], vc[:, 3 * B:3 * B + 6]
    kc2[:, 2 * B:3 * B + 6] = 0                     # the old places now hold something else
    vc2[:, 2 * B:3 * B + 6] = 0
    idx_b = torch.cat([torch.arange(300, 300 + B), torch.arange(340, 340 + B)])[None]
    ok_b = torch.cat([torch.ones(B, dtype=torch.bool), torch.arange(B) < 6])[None]
    b = _call(op)(q, kc2, vc2, 2, pos, idx_b, ok_b, None, 0.125)
    assert torch.equal(a, b)


@pytest.mark.parametrize("build", builds_with("attention_bf16"))
def test_the_attention_refuses_a_cache_it_cannot_read(build, monkeypatch):
    use_build(monkeypatch, build, "attention_bf16")
    q, kc, vc, b0, pos, idx, ok = attn_case()
    with pytest.raises(cpu.CpuKernelError, match="bf16 cache"):
        cpu.attention(q, kc.float(), vc.float(), b0, pos, idx, ok, None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="contiguous"):
        cpu.attention(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, b0, pos, idx, ok, None, 0.125)


@pytest.mark.parametrize("build", builds_with("attention_f32"))
def test_the_fp32_attention_refuses_what_it_cannot_read(build, monkeypatch):
    use_build(monkeypatch, build, "attention_f32")
    q, kc, vc, b0, pos, idx, ok = attn_case(dtype=torch.float32)
    with pytest.raises(cpu.CpuKernelError, match="fp32 cache"):
        cpu.attention_f32(q, kc.bfloat16(), vc.bfloat16(), b0, pos, idx, ok, None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="multiple of 8"):
        cpu.attention_f32(q[..., :12], kc[..., :12].contiguous(), vc[..., :12].contiguous(), b0, pos, idx, ok,
                          None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="contiguous"):
        cpu.attention_f32(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, b0, pos, idx, ok, None, 0.125)
    assert "multiples of 8" in cpu.attention_f32_reason(12)
