"""The AVX2 build of the fp32 small-row linear (kernels/cpu_avx2.c): what a CPU without AVX-512 - most laptops
and desktops - runs for the native fp32 decode. Against the float64 product, the row invariance the exact
decode needs, and the choice of build (`kernels.cpu.isa`, `$SPECVOCAB_CPU_ISA`). The decode on it, end to end,
is in tests/test_native.py (`isa="avx2"`, `fp32-avx2`).

Mutants these tests were checked against (each fails at least one test here):
- the partial last K chunk of x loaded whole (the next row's values leak in)          -> the product
- the 1-row tile summing its chunks in reverse order; hsum4x8 pairing lanes (0,1) for
  the 2-row tile only                                                                   -> row invariance
- bias dropped                                                                          -> the product
- an fp32 weight packed at the AVX-512 build's 16-wide chunks for this build            -> the product
- `pack` ignoring $SPECVOCAB_CPU_ISA (always the AVX-512 build where it runs)           -> the choice
- `linear_reason` counting only the AVX-512 build (fp32 without AVX-512 -> native-blas) -> a CPU with AVX2 only
- engine.calibration.device_name the same with and without SPECVOCAB_CPU_ISA=avx2     -> the choice
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu

CPU = torch.device("cpu")


@pytest.fixture
def avx2(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    if cpu.isa() != "avx2":
        pytest.skip(f"the AVX2 build does not run here: {cpu._why_not2}")


@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576), (7, 9), (5, 3)])
def test_the_avx2_linear_equals_the_product_and_gives_a_row_the_same_bits_for_every_row_count(avx2, N, K):
    """The float64 product to fp32 rounding, bias included; a row's bits the same at every M (every place in the
    3-row, 2-row and 1-row tiles), on any thread count, in any row order; the partial last K chunk masked."""
    g = torch.Generator().manual_seed(N + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p = cpu.pack(w, b)
    assert p.isa == "avx2" and p.packed.shape[-1] == 8                # [N/4][K/8][4][8]
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


def test_the_build_is_chosen_by_the_cpu_and_by_the_environment(monkeypatch):
    """auto: AVX-512 where it runs; avx2 turns every AVX-512 kernel off (a run here is then what an AVX2 CPU
    runs: bf16 kernels, top-k, window step in torch) while the fp32 linear still runs; a bad value names the
    choices."""
    from engine.calibration import device_name
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    expected = "avx512" if cpu.available_fp32() is None else ("avx2" if cpu._load_avx2() is not None else None)
    assert cpu.isa() == expected
    here = device_name("cpu")
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert device_name("cpu") == here + ":avx2"          # calibrated g* and timings kept apart from AVX-512's
    if cpu._load_avx2() is None:
        pytest.skip(f"the AVX2 build does not run here: {cpu._why_not2}")
    assert cpu.isa() == "avx2"
    assert "SPECVOCAB_CPU_ISA=avx2" in cpu.available_fp32() and cpu.available() is not None
    assert cpu.linear_reason(CPU, torch.float32) is None
    assert cpu.linear_reason(CPU, torch.bfloat16) is not None
    assert cpu.pack(torch.randn(8, 20)).isa == "avx2"
    with pytest.raises(cpu.CpuKernelError, match="not available here"):
        cpu.pack(torch.randn(8, 20).bfloat16())
    z = torch.randn(2, 100)
    assert torch.equal(cpu.topk(z, 3)[1], torch.topk(z, 3).indices)  # torch's, not the AVX-512 pass
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
        pytest.skip(f"the AVX2 build does not run here: {cpu._why_not2}")
    assert cpu.linear_reason(CPU, torch.float32) is None and "avx512f" in cpu.linear_reason(CPU, torch.bfloat16)
    w = torch.randn(8, 20)
    assert torch.allclose(cpu.pack(w)(torch.ones(1, 20)), w.sum(1)[None], rtol=1e-5, atol=1e-5)
    for name, value in (("_tried", False), ("_lib", None), ("_tried2", False), ("_lib2", None)):
        monkeypatch.setattr(cpu, name, value)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx", "avx2"})
    assert cpu.isa() is None
    why = cpu.linear_reason(CPU, torch.float32)
    assert "avx512f" in why and "fma" in why
