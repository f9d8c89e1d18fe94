"""gather_rows: Triton kernel vs torch reference, NaN scratch so an unwritten row fails loudly."""

import pytest
import torch

from specvocab.kernels.gather import GatherError, gather_rows, gather_rows_ref, gather_rows_triton
from specvocab.kernels.hardware import DEVICE, using_triton
from specvocab.kernels.testing import nan_filled

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (V, d, W, m): d not a multiple of any block (781 > 512 and < 1024; 1500 spans two blocks), odd W,
# m = 0 (nothing changed), m = W (full window)
SHAPES = [(100, 781, 63, 17), (1823, 781, 63, 63), (50, 1500, 9, 5), (40, 1, 7, 3), (300, 63, 31, 0)]


def _case(V, d, W, m, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, d, generator=g).to(dtype)
    slots = torch.randperm(W, generator=g)[:m]                        # distinct rows of the buffer
    tokens = torch.randint(0, V, (m,), generator=g)
    return weight.to(DEVICE), slots.to(DEVICE), tokens.to(DEVICE)     # kernels run where hardware says


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V,d,W,m", SHAPES)
def test_gather_matches_reference_and_weight(V, d, W, m, dtype):
    weight, slots, tokens = _case(V, d, W, m, dtype, seed=V + d + m)
    out_t = gather_rows_triton(weight, nan_filled(W, d, dtype=dtype, device=DEVICE), slots, tokens)
    out_r = gather_rows_ref(weight, nan_filled(W, d, dtype=dtype, device=DEVICE), slots, tokens)
    assert torch.equal(out_t.isnan(), out_r.isnan())
    assert torch.equal(out_t.nan_to_num(), out_r.nan_to_num())
    assert torch.equal(out_t[slots], weight[tokens])
    untouched = torch.ones(W, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert out_t[untouched].isnan().all(), "rows outside the gather list must not be written"


@pytest.mark.parametrize("backend", [True, False], ids=["triton", "torch"])
def test_count_and_padding_limit_what_is_copied(backend):
    weight, slots, tokens = _case(200, 130, 40, 30, torch.float32, seed=3)
    slots[5], tokens[9] = -1, -1                                     # padded pairs are skipped
    count = torch.tensor(20, device=DEVICE)
    with using_triton(backend):
        out = gather_rows(weight, nan_filled(40, 130, device=DEVICE), slots, tokens, count)
    copied = torch.zeros(30, dtype=torch.bool, device=DEVICE)
    copied[:20] = True
    copied[5] = copied[9] = False
    assert torch.equal(out[slots[copied]], weight[tokens[copied]])
    assert out[slots[~copied].clamp(min=0)][slots[~copied] >= 0].isnan().all()
    assert out.isnan().all(dim=1).sum() == 40 - copied.sum()


@pytest.mark.parametrize("backend", [True, False], ids=["triton", "torch"])
def test_count_zero_copies_nothing(backend):
    weight, slots, tokens = _case(64, 33, 16, 16, torch.float16, seed=4)
    with using_triton(backend):
        out = gather_rows(weight, nan_filled(16, 33, dtype=torch.float16, device=DEVICE), slots, tokens,
                           torch.tensor(0, device=DEVICE))
    assert out.isnan().all()


@pytest.mark.parametrize("backend", [True, False], ids=["triton", "torch"])
def test_rows_are_cast_to_the_packed_dtype(backend):
    weight, slots, tokens = _case(90, 70, 12, 12, torch.float32, seed=5)
    with using_triton(backend):
        out = gather_rows(weight, nan_filled(12, 70, dtype=torch.float16, device=DEVICE), slots, tokens)
    assert torch.equal(out[slots], weight[tokens].half())


def test_bad_arguments_name_the_problem():
    weight = torch.zeros(10, 8, device=DEVICE)
    with pytest.raises(GatherError, match="same d"):
        gather_rows_ref(weight, torch.zeros(4, 9), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(GatherError, match="integer"):
        gather_rows_ref(weight, torch.zeros(4, 8), torch.zeros(1), torch.zeros(1))
    with pytest.raises(GatherError, match="contiguous"):
        transposed = torch.zeros(8, 4, device=DEVICE).T
        gather_rows_triton(weight, transposed, *torch.zeros(2, 1, dtype=torch.long, device=DEVICE))


def test_row_chunks_cover_every_row_within_the_budget():
    from specvocab.kernels.tensor_ops import row_chunks
    for n, row_bytes, budget in [(0, 8, 64), (1, 1000, 64), (10, 8, 64), (1823, 781 * 4, 1 << 16)]:
        chunks = row_chunks(n, row_bytes, budget)
        assert [i for a, b in chunks for i in range(a, b)] == list(range(n))
        assert all(b - a == 1 or (b - a) * row_bytes <= budget for a, b in chunks)


def test_reference_gathers_in_chunks(monkeypatch):
    """The CPU path copies a few rows at a time; force many chunks and compare with the kernel."""
    import specvocab.kernels.gather as g
    from specvocab.kernels.tensor_ops import row_chunks
    monkeypatch.setattr(g, "row_chunks", lambda n, row_bytes: row_chunks(n, row_bytes, 3 * row_bytes))
    weight, slots, tokens = _case(300, 97, 63, 50, torch.float16, seed=9)
    count = torch.tensor(41, device=DEVICE)
    ref = gather_rows_ref(weight, nan_filled(63, 97, dtype=torch.float16, device=DEVICE), slots, tokens, count)
    out = gather_rows_triton(weight, nan_filled(63, 97, dtype=torch.float16, device=DEVICE), slots, tokens, count)
    assert torch.equal(ref.isnan(), out.isnan()) and torch.equal(ref.nan_to_num(), out.nan_to_num())
    assert torch.equal(ref[slots[:41]], weight[tokens[:41]]) and int(ref.isnan().all(1).sum()) == 63 - 41
