"""PackedLMHead: window step + gather + masked packed head, against the full LM head."""

import random

import pytest
import torch

from specvocab.kernels.hardware import DEVICE, using_triton
from specvocab.kernels.streams import PackedLMHead
from specvocab.kernels.testing import rel_rms

BACKENDS = pytest.mark.parametrize("backend", [True, False], ids=["triton", "torch"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _entries(rng, V, m, hot):
    return [-1 if rng.random() < 0.1 else rng.randrange(hot if rng.random() < 0.8 else V) for _ in range(m)]


def check_head(head, weight, h, tol=None):
    """Every active token's packed row equals its weight row; logits equal the full head on I, -inf elsewhere.
    tol: 1e-5 relative, or in fp16/bf16 on the torch path (`packed_head_torch`: one GEMM in that dtype, its
    output rounded once) half a unit in the dtype's last place plus that slack."""
    if tol is None:
        tol = 1e-5 if head.dtype == torch.float32 else 1e-5 + torch.finfo(head.dtype).eps / 2
    tok = head.tok_of_slot.long()
    live = tok >= 0
    assert int(live.sum()) == int(head.active_size())
    assert torch.equal(head.packed[live], weight[tok[live]].to(head.dtype))
    logits = head.logits(h)                                                  # [r, w_max]
    full = h.to(head.dtype).double() @ weight.to(head.dtype).double().T      # [r, V]
    assert torch.isneginf(logits[:, ~live]).all()
    assert rel_rms(logits[:, live], full[:, tok[live]].float()) < tol
    if live.any():   # the draft's top-1 over I, mapped back to a full-vocab id
        best = head.slot_to_token(logits.argmax(-1))
        allowed = torch.full_like(full, float("-inf"))
        allowed[:, tok[live]] = full[:, tok[live]]
        assert torch.equal(best, allowed.argmax(-1))


@BACKENDS
@pytest.mark.parametrize("mode", ["eq4_exact", "fifo_unique"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_packed_head_tracks_the_window(dtype, mode, backend):
    rng = random.Random(17)
    V, d, W = 400, 97, 63
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, d, generator=g).to(DEVICE)
    h = torch.randn(3, d, generator=g).to(DEVICE)
    with using_triton(backend):
        head = PackedLMHead(weight, W, dtype=dtype, mode=mode)
        head.packed.fill_(float("nan"))            # a row the gather should have written fails loudly
        head.reset(_entries(rng, V, 150, hot=80))
        check_head(head, weight, h)
        for _ in range(12):
            head.update(torch.tensor(_entries(rng, V, rng.randrange(0, W + 1), hot=80)))
            check_head(head, weight, h)
    stats = head.stats()
    assert stats["active_vocab"] == int(head.active_size()) <= W and stats["vocab_size"] == V


def test_empty_window_gives_all_minus_inf_and_maps_to_minus_one():
    head = PackedLMHead(torch.randn(50, 16, device=DEVICE), 8)
    head.reset([])
    logits = head.logits(torch.randn(2, 16, device=DEVICE))
    assert torch.isneginf(logits).all()
    assert (head.slot_to_token(torch.tensor([[0, 7]], device=DEVICE)) == -1).all()


@needs_cuda
def test_gather_runs_concurrently_with_the_compute_stream():
    """The gather on the copy stream finishes while the compute stream is still busy (spec 4.1 item 2)."""
    V, d, W = 128256, 4096, 3072
    weight = torch.randn(V, d, device="cuda", dtype=torch.float16)
    head = PackedLMHead(weight, W)
    head.reset(torch.randint(0, V, (2 * W,), device="cuda"))
    h = torch.randn(1, d, device="cuda", dtype=torch.float16)
    head.logits(h)                                          # compile/warm everything first
    torch.cuda.synchronize()
    head.update(torch.randint(0, V, (W,), device="cuda"))  # many fresh tokens: a large gather
    torch.cuda._sleep(2_000_000_000)                        # stands in for the draft backbone (~1 s)
    backbone_done = torch.cuda.Event()
    backbone_done.record()
    head.copy_stream.synchronize()
    assert not backbone_done.query(), "the gather waited for the compute stream: no overlap"
    check_head(head, weight, h, tol=5e-5)                  # fp32 accumulation over d = 4096
    torch.cuda.synchronize()


@needs_cuda
@BACKENDS
def test_update_and_logits_never_sync_with_the_host(backend):
    V, d, W = 4096, 256, 512
    weight = torch.randn(V, d, device="cuda", dtype=torch.float16)
    h = torch.randn(10, d, device="cuda", dtype=torch.float16)
    steps = [torch.randint(-1, V, (80,), device="cuda") for _ in range(5)]
    with using_triton(backend):
        head = PackedLMHead(weight, W)
        head.reset(torch.randint(0, V, (700,), device="cuda"))
        head.logits(h)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for entries in steps:
                head.update(entries)
                top = head.logits(h).topk(10, dim=-1).indices
                head.slot_to_token(top)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check_head(head, weight, h)
