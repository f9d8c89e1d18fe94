"""The small-row linears (kernels.cpu.ops.linear: `pack`, `PackedLinear`, `rows_linear`) and the module patcher
(`route_linears`), on every build of kernels.cpu this CPU has (tests/kernels_cpu_testing.py `builds_with`): bf16
on the bf16 builds, fp32 on the AVX-512 and AVX2 libraries. Each against its reference, and the property the
decode needs: a row's bits are a function of that row alone (every row count, tile position, thread count, order).

Mutants these tests were checked against (each fails at least one test here):
- the linear's leftover rows (M % 4) summed in another order than the 4-row tile    -> row invariance
  (the 2-row tile's second row reduced lane by lane; hsum4 pairing 128-bit lanes (0,1),(2,3) instead of
  hsum16's (0,2),(1,3); rows_linear's 4-row tile reduced lane by lane                -> row invariance)
- threads splitting K instead of the outputs                                         -> thread invariance
- the partial last K chunk of x read unmasked (the next row's values leak in)        -> masked tail
- bias dropped, or added after rounding to bf16                                       -> reference (fp32 out)
- bf16 output truncated instead of rounded to nearest even                            -> rounding
- the packed layout's block and chunk axes swapped                                    -> reference
- the fp32 linear (either library): its partial last chunk read unmasked; the 2-row tile's second row reduced
  lane by lane; bias dropped; packed at another library's chunk width                -> fp32 linear
- the AVX2 1-row tile summing its chunks in reverse order; hsum4x8 pairing lanes (0,1) for the 2-row tile
  only                                                                                 -> fp32 linear (avx2)
- `pack` ignoring $SPECVOCAB_CPU_ISA (always the AVX-512 library where it runs)      -> fp32 linear (avx2)
- route_linears serving the first packed copy after the weights changed in place      -> weight updates
- route_linears skipping fp32 linears (bf16 only)                                     -> route_linears, fp32
- rows_linear reading the weight's or x's partial last chunk unmasked                  -> row-major tails
(computing every row with the 1-row tile instead of the 4-row one passes: the same sums, in the same order)
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu
from tests.kernels_cpu_testing import builds_with, use_build, weights

BF16 = builds_with("linear_bf16")
FP32 = builds_with("linear_f32")


@pytest.mark.parametrize("build", BF16)
@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576)])
def test_the_linear_equals_its_reference(build, N, K, monkeypatch):
    use_build(monkeypatch, build, "linear_bf16")
    w, b = weights(N, K)
    p = cpu.pack(w, b)
    x = torch.randn(9, K).bfloat16()
    got = p(x, torch.float32)
    ref = cpu.linear_reference(x, w, b, torch.float32)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    # bf16 output: the fp32 result rounded to nearest even (what torch's cast does), bitwise
    assert torch.equal(p(x), got.to(torch.bfloat16))


@pytest.mark.parametrize("build", BF16)
def test_the_linear_gives_a_row_the_same_bits_for_every_row_count_and_thread_count(build, monkeypatch):
    use_build(monkeypatch, build, "linear_bf16")
    w, b = weights(1001, 577, seed=1)
    p = cpu.pack(w, b)
    x = torch.randn(11, 577).bfloat16()
    f32 = torch.float32                         # fp32 out: no rounding to bf16 hides a changed last bit
    full = p(x, f32, threads=1)
    for M in range(1, 12):                      # every position of a row inside 4-row tiles and leftovers
        got = p(x[:M], f32, threads=1)
        assert torch.equal(got, full[:M]), M
        for r in range(M):
            assert torch.equal(p(x[r:r + 1], f32)[0], full[r])
    for threads in (2, 3):
        assert torch.equal(p(x, f32, threads=threads), full)
    perm = torch.randperm(11)
    assert torch.equal(p(x[perm], f32), full[perm])


@pytest.mark.parametrize("build", BF16)
def test_the_linear_reads_no_further_than_each_row(build, monkeypatch):
    """K = 40: the last chunk is partial; the next row's first values (inf here) must not leak in."""
    use_build(monkeypatch, build, "linear_bf16")
    w, b = weights(8, 40, seed=2)
    p = cpu.pack(w, b)
    x = torch.randn(6, 40).bfloat16()
    x[1, :8] = float("inf")
    x[3, :] = float("nan")
    got = p(x, torch.float32)
    ok = [0, 2, 4, 5]
    assert torch.isfinite(got[ok]).all()
    ref = cpu.linear_reference(x[ok], w, b, torch.float32)
    assert float((got[ok] - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("build", BF16)
def test_the_linear_refuses_what_it_cannot_multiply(build, monkeypatch):
    use_build(monkeypatch, build, "linear_bf16")
    w, _ = weights(8, 32)
    with pytest.raises(cpu.CpuKernelError, match="bf16 or fp32"):
        cpu.pack(w.half())
    p = cpu.pack(w)
    with pytest.raises(cpu.CpuKernelError, match="features"):
        p(torch.randn(2, 33).bfloat16())
    with pytest.raises(cpu.CpuKernelError, match="packed in torch.bfloat16"):
        p(torch.randn(2, 32))
    with pytest.raises(cpu.CpuKernelError, match="packed in torch.float32"):
        cpu.pack(w.float())(torch.randn(2, 32).bfloat16())


@pytest.mark.parametrize("build", FP32)
@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576), (7, 9), (5, 3)])
def test_the_fp32_linear_equals_the_product_and_gives_a_row_the_same_bits_for_every_row_count(build, N, K,
                                                                                                monkeypatch):
    """The fp32 kernel (`pack` of an fp32 weight) of the build's library: the float64 product to fp32 rounding,
    bias included; a row's bits the same at every M (every place in the row tiles: 4, 2, 1 rows on AVX-512, 3, 2,
    1 on AVX2, a row first in its tile too), on any thread count, in any row order; the partial last K chunk
    masked (the next row's inf does not leak in)."""
    use_build(monkeypatch, build, "linear_f32")
    g = torch.Generator().manual_seed(N + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p = cpu.pack(w, b)
    assert p.packed.dtype == torch.float32 and p.isa == cpu.provider("linear_f32").library
    x = torch.randn(11, K, generator=g)
    full = p(x, threads=1)
    assert full.dtype == torch.float32 and full.shape == (11, N)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert float((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for M in range(1, 12):
        assert torch.equal(p(x[:M], threads=1), full[:M]), M
        assert torch.equal(p(x[M - 1:M])[0], full[M - 1])
        assert torch.equal(p(x[11 - M:])[0], full[11 - M])              # row 11 - M first in its tile
    for threads in (2, 3):
        assert torch.equal(p(x, threads=threads), full)
    perm = torch.randperm(11, generator=g)
    assert torch.equal(p(x[perm]), full[perm])
    leak = x.clone()
    leak[4, :] = float("inf")                             # row 3's partial chunk must not read row 4
    assert torch.equal(p(leak)[3], full[3])


@pytest.mark.parametrize("build", builds_with("rows_linear_bf16"))
@pytest.mark.parametrize("N,K", [(3072, 576), (101, 45), (7, 64)])
def test_the_row_major_linear_equals_its_reference_and_keeps_rows_invariant(build, N, K, monkeypatch):
    """`rows_linear` (a weight read where it lies: MicroSpec's window buffer): the fp32 product; a row's bits
    the same at every M; the partial K chunk masked on both sides (the weight row after it holds inf here, and
    so does the next row of x)."""
    use_build(monkeypatch, build, "rows_linear_bf16")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(N + 1, K, generator=g).bfloat16()
    w[-1] = float("inf")                               # right after the weight's last row
    w = w[:N]
    x = torch.randn(10, K, generator=g).bfloat16()
    x[9] = float("inf")                                # right after the rows multiplied
    got = cpu.rows_linear(x[:9], w)
    ref = cpu.linear_reference(x[:9], w, None, torch.float32)
    assert torch.isfinite(got).all()
    x2 = x[:5].clone()                                 # a 4-row tile and one row left over
    x2[1, 0] = float("inf")                            # what row 0's partial chunk must not read
    assert torch.isfinite(cpu.rows_linear(x2, w)[[0, 2, 3, 4]]).all()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    for M in (1, 2, 4, 5, 9):
        assert torch.equal(cpu.rows_linear(x[:M], w), got[:M])
    assert torch.equal(cpu.rows_linear(x[:9], w, threads=2), got)
    assert torch.equal(cpu.rows_linear(x[:3], w, torch.bfloat16), got[:3].to(torch.bfloat16))
    with pytest.raises(cpu.CpuKernelError, match="bf16 CPU"):
        cpu.rows_linear(x.float(), w)


@pytest.mark.parametrize("build", builds_with("rows_linear_bf16"))
def test_the_window_head_runs_the_row_major_kernel_in_bf16(build, monkeypatch):
    from specvocab.kernels.head import packed_head_ref, packed_head_torch
    use_build(monkeypatch, build, "rows_linear_bf16")
    w = torch.randn(300, 64).bfloat16()
    tok = torch.arange(300)
    tok[::7] = -1
    h = torch.randn(3, 64).bfloat16()
    got = packed_head_torch(h, w, tok)
    assert torch.equal(got, cpu.rows_linear(h, w).masked_fill(tok < 0, float("-inf")))
    ref = packed_head_ref(h, w, tok)
    live = tok >= 0
    assert float((got[:, live] - ref[:, live]).abs().max() / ref[:, live].abs().max()) < 1e-5
    assert torch.isinf(got[:, ~live]).all()


# --- the module patcher ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", BF16)
def test_route_linears_runs_a_modules_small_row_linears_on_the_kernel_and_follows_weight_updates(build,
                                                                                                 monkeypatch):
    """`route_linears` (a drafter's own layers): small bf16 inputs go through the kernel, large ones and
    training through F.linear; a weight changed in place (an optimizer step) is packed again, not served stale."""
    use_build(monkeypatch, build, "linear_bf16")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40, bias=False))
    net = net.to(torch.bfloat16)
    assert cpu.route_linears(net, max_rows=8) == 2
    lin = net[0]
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu.pack(lin.weight, lin.bias)(x))                  # the kernel's bits
        big = torch.randn(20, 64).bfloat16()
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))
    with torch.no_grad():
        lin.weight.mul_(2.0)                                                            # in place: _version moves
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu.pack(lin.weight, lin.bias)(x))
    y = net(torch.randn(2, 64).bfloat16())                                              # grad on: F.linear, autograd
    y.float().sum().backward()
    assert lin.weight.grad is not None
    with torch.inference_mode():                     # a head made in inference mode (no version counter)
        frozen = torch.nn.Linear(64, 8).to(torch.bfloat16)
    assert cpu.route_linears(frozen) == 1
    with torch.inference_mode():
        assert torch.equal(frozen(x), cpu.pack(frozen.weight, frozen.bias)(x))
    assert torch.equal(frozen(x), cpu.pack(frozen.weight, frozen.bias)(x))


@pytest.mark.parametrize("build", FP32)
def test_route_linears_runs_a_drafters_fp32_linears_on_the_fp32_kernel(build, monkeypatch):
    """A drafter kept in fp32 (an EAGLE head on a CPU without bf16 dot products): its small-row linears go
    through this build's kernel, large inputs through F.linear; a bf16 module is left alone on a build without
    the bf16 kernels."""
    use_build(monkeypatch, build, "linear_f32")
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
    assert cpu.route_linears(torch.nn.Linear(64, 8).to(torch.bfloat16)) == 0     # no bf16 kernel on this build
