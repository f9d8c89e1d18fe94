"""The top-k passes over fp32 rows (kernels.cpu.ops.topk: `topk`, `argmax`, `topk_lse`) on each library that
holds them (AVX-512 and AVX2), which must be the ones called: torch.topk's answer with ties to the lower index,
and each row's log-sum-exp within a few ulp.

Mutants these tests were checked against (each fails at least one test here):
- topk: the masked last vector (16 or 8 wide) skipped; ties inserted ahead of the incumbent (>= for >) -> topk
- topk_lse: the masked last vector left out of the sum; the high half of each 16 (s1) dropped; lse without
  the max added back                                                                   -> topk_lse
- the build's C passes never called (torch instead)                                    -> the calls check
  (exp_ps's polynomial one term short passes: its error, ~2e-6 relative at the edge of the reduced interval and
  ~3e-7 of a sum, is under every tolerance these outputs are held to)
  (the vector pre-filter's > made >= passes, rightly: the scalar check after it decides)
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu
from tests.kernels_cpu_testing import builds_with, use_build


@pytest.fixture
def calls(monkeypatch):
    """The C top-k functions of the build that runs, counted as they are called."""
    seen = []
    for op in ("topk", "topk_lse"):
        b = cpu.provider(op)
        if b is None:
            continue
        lib = cpu.builds.load(b.library)
        name = cpu.LIBRARIES[b.library].ops[op]
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, real=real, op=op: seen.append(op) or real(*a))
    return seen


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("build", builds_with("topk"))
def test_topk_is_torchs_topk_and_argmax_keeps_the_first_maximum(build, monkeypatch, restore_threads, request):
    """`topk` (the verify's argmax, MicroSpec's and UniSpec's top-k over the vocabulary): torch's values and
    indices; ties go to the lower index (torch.argmax's rule); NaN rows and rows with fewer than k values
    above -inf are answered by torch."""
    use_build(monkeypatch, build, "topk")
    called = request.getfixturevalue("calls")
    g = torch.Generator().manual_seed(5)
    z = torch.randn(5, 70001, generator=g)                  # not a multiple of 16 or 8: the masked last vector
    z[2, -1] = 50.0                                          # the maximum in the masked tail
    for k in (1, 3, 17):
        v, i = cpu.topk(z, k)
        tv, ti = torch.topk(z, k)
        assert torch.equal(v, tv) and torch.equal(i, ti), k
    assert int(cpu.argmax(z)[2]) == 70000
    ties = torch.randint(0, 4, (64, 333), generator=g).float()     # many equal maxima per row
    assert torch.equal(cpu.argmax(ties), ties.argmax(-1))
    v, i = cpu.topk(ties, 5)
    assert torch.equal(v, torch.topk(ties, 5).values)
    for r in range(64):                                      # equal values: ascending indices
        for a in range(4):
            if v[r, a] == v[r, a + 1]:
                assert i[r, a] < i[r, a + 1]
    z[1, 7] = float("nan")
    assert torch.equal(cpu.argmax(z), z.argmax(-1))          # torch ranks NaN first; so does the fallback
    short = torch.full((2, 40), float("-inf"))
    short[:, 3] = 1.0
    assert cpu.topk(short, 2)[1][:, 0].tolist() == [3, 3]
    assert torch.equal(cpu.topk(z.double(), 2)[1], torch.topk(z.double(), 2)[1])   # other dtypes: torch
    assert "topk" in called


@pytest.mark.parametrize("build", builds_with("topk_lse"))
def test_topk_lse_gives_topk_and_each_rows_logsumexp(build, monkeypatch, restore_threads, request):
    """`topk_lse` (the successor store's confidences): `topk`'s values and indices, and a log-sum-exp within a
    few ulp of float64's - over the masked last vector too, on rows with -inf entries, on any thread count; rows
    C declines (NaN, +inf, fewer than k finite values) get the torch reference's answer."""
    use_build(monkeypatch, build, "topk_lse")
    called = request.getfixturevalue("calls")
    g = torch.Generator().manual_seed(11)
    z = torch.randn(6, 70001, generator=g) * 8              # not a multiple of 16: the masked last vector
    z[2, -1] = 90.0                                          # the maximum in the masked tail: lse = 90 + ...
    z[3, 5:] = -torch.inf                                    # a masked vocabulary: 5 finite logits
    z[4, 70001 - 9:] = 60.0                                  # the tail's mass decides the row's lse
    want = torch.logsumexp(z.double(), dim=-1)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        v, i, lse = cpu.topk_lse(z, 5)
        tv, ti = cpu.topk(z, 5)
        assert torch.equal(v, tv) and torch.equal(i, ti)
        assert lse.dtype == torch.float32 and lse.shape == (6,)
        assert torch.allclose(lse.double(), want, rtol=0, atol=4 * 90 * 2.0 ** -23), (lse.double() - want).abs().max()
    torch.set_num_threads(1)
    p = (v - lse[:, None]).exp()                            # the top-k probabilities
    assert torch.allclose(p.double(), (tv.double() - want[:, None]).exp(), rtol=1e-5, atol=0)
    odd = torch.full((4, 40), 0.5)
    odd[0, 7] = float("nan")
    odd[1, 3] = float("inf")
    odd[2, 2:] = -torch.inf                                  # 2 finite values, k = 3
    v, i, lse = cpu.topk_lse(odd, 3)
    rv, ri, rl = cpu.topk_lse_reference(odd, 3)
    assert torch.equal(i, ri) and torch.equal(lse.isnan(), rl.isnan()) and lse[1] == torch.inf
    assert torch.equal(lse[2:], rl[2:])
    assert "topk_lse" in called
