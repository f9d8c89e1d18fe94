"""The exact decode's attention, one row at a time (engine.native rules 2-3): kernels/cpu.c `sv_attention` over a
bf16 cache, kernels/cpu_avx2.c `sv2_attention_f32` over an fp32 one, beside their plain-torch reference.

    attention(q, kc, vc, ...)           bf16 cache (AVX512-BF16)
    attention_f32(q, kc, vc, ...)       fp32 cache (AVX2 + FMA: AVX-512 CPUs run it too)
    attention_reference(...)            the same in plain torch, row by row
    takes_head_dim(hd)                  whether `attention` (and so the fused layer) takes this head size
    tail_blocks(idx, ok, n)             the tail's block count T of idx / ok [n, T BLOCK]

engine.native's fixed-shape attention in torch is per layer a dozen small GEMMs, softmax pieces, casts and the
fold. `attention` does the same work per (row, head) in one call: the row's keys in logical order, in blocks of
32 aligned to logical positions, one softmax over them in fp32 (the scores and their max, then the weights and
their sum, then the weighted values, each pass over the blocks in order). It reads the same inputs as
engine.native's torch path (the committed block count, the tail's slots and mask) and, like it, depends only on
the row's logical context: an `ar` step and a tree give a row the same bits, on any thread count (threads split
(row, KV head) pairs, never a sum). It sums in another order than the torch path (and keeps scores in fp32
where that path rounds them to bf16), so the two agree to rounding, not bitwise; a decode uses one of them for
all its forwards. A KV head's query heads share each value row's load and widening (up to four at a time, each
dim still one fmadd per key in key order); the values go through VDPBF16PS over key pairs with the weights
rounded to bf16 (as transformers' eager bf16 attention rounds them); head sizes 64, 128 and 256 are unrolled, and
the KV head is the outer loop, so its cache stays in L2 across the rows.

The fp32 attention has the same contract with fp32 keys and values: scores by one FMA chain per key and a fixed
reduction tree, a vector exp, the values by one FMA chain per dim over the keys in order.
"""

from __future__ import annotations

from typing import Callable

import torch

from specvocab.kernels.cpu import builds
from specvocab.kernels.cpu.compiler import CpuKernelError

BLOCK = 32                                                            # attention block (engine.native.BLOCK)


def takes_head_dim(hd: int) -> bool:
    """Whether the attention (and so the fused layer) takes this head size: a multiple of 16 up to 256."""
    return hd % 16 == 0 and hd <= 256


def tail_blocks(idx: torch.Tensor, ok: torch.Tensor, n: int) -> int:
    """The tail's block count T of the attention's idx / ok [n, T BLOCK] (checked: both that shape, T >= 1)."""
    width = idx.shape[-1] if idx.ndim == 2 else 0
    if idx.shape != (n, width) or ok.shape != (n, width) or width == 0 or width % BLOCK:
        raise CpuKernelError(f"the attention's tail idx and ok must both be [n, T {BLOCK}] (T >= 1 blocks) with "
                             f"n = {n}; got {tuple(idx.shape)} and {tuple(ok.shape)}")
    return width // BLOCK


def _inputs(q, positions, idx, ok):
    return (q.float().contiguous(), positions.to(torch.int64).contiguous(), idx.to(torch.int64).contiguous(),
            ok.to(torch.uint8).contiguous())


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int, positions: torch.Tensor,
              idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
              threads: int | None = None) -> torch.Tensor:
    """q [n, H, hd] (any float dtype; rounded to bf16 for the VDPBF16PS scores, which is exact for the decode's
    q: it is bf16), kc / vc [kvh, capacity, hd] bf16 (one layer's cache; committed slot = logical position),
    committed_blocks: blocks of BLOCK positions read where they lie; idx [n, T BLOCK] the cache slot of each
    position of the next T blocks (the tail: two, or as many as a deep draft tree reaches; `tail_blocks`) for each
    row, ok [n, T BLOCK] whether it is in the row's context; positions [n] the rows' logical positions; window:
    sliding-window length (None = full attention). Returns fp32 [n, H, hd]; reference `attention_reference`."""
    return _attend("attention", "attention_bf16", torch.bfloat16, "a bf16", takes_head_dim,
                   "a multiple of 16 up to 256", q, kc, vc, committed_blocks, positions, idx, ok, window, scale, threads)


def attention_f32(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int,
                  positions: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
                  threads: int | None = None) -> torch.Tensor:
    """`attention` over an fp32 cache (the same rules, keys and order; the weights stay fp32, as the torch path's
    do in fp32): the exact decode's attention of an fp32 model. q [n, H, hd] fp32, kc / vc [kvh, capacity, hd]
    fp32, the rest as `attention`. Returns fp32 [n, H, hd]; reference `attention_reference`."""
    return _attend("attention_f32", "attention_f32", torch.float32, "an fp32", lambda hd: hd % 8 == 0,
                   "a multiple of 8", q, kc, vc, committed_blocks, positions, idx, ok, window, scale, threads)


def _attend(name: str, kernel: str, dtype: torch.dtype, dtype_words: str, takes: Callable[[int], bool], rule: str,
            q, kc, vc, committed_blocks, positions, idx, ok, window, scale, threads) -> torch.Tensor:
    """The launcher of `attention` / `attention_f32` (`name`): checks the cache (`dtype`, head sizes `takes`
    accepts, described as `rule`; whole KV groups; contiguous) and the tail (`tail_blocks`), allocates the fp32
    output [n, H, hd] and runs the build's function `kernel`, whose nonzero return is a failed scratch
    allocation."""
    n, H, hd = q.shape
    kvh, cap = kc.shape[0], kc.shape[1]
    if kc.dtype != dtype or vc.dtype != dtype or not takes(hd) or H % kvh:
        raise CpuKernelError(f"{name} takes {dtype_words} cache with head_dim {rule}; got {kc.dtype}, head_dim {hd}, "
                             f"{H} heads over {kvh} KV heads")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise CpuKernelError(f"{name} reads each layer's cache in place: give contiguous [kvh, capacity, hd]")
    tb = tail_blocks(idx, ok, n)
    qf, pos, slots, okb = _inputs(q, positions, idx, ok)
    out = torch.empty(n, H, hd, dtype=torch.float32)
    fn, _ = builds.function(kernel)
    if fn(qf.data_ptr(), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), slots.data_ptr(), okb.data_ptr(),
          out.data_ptr(), n, H, kvh, hd, cap, committed_blocks, tb, int(window or 0), float(scale),
          threads or torch.get_num_threads()):                        # the bf16 kernel returns nothing (None)
        raise CpuKernelError(f"{name} could not allocate its scratch (out of memory)")
    return out


def attention_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int,
                        positions: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, window: int | None,
                        scale: float) -> torch.Tensor:
    """`attention` (and `attention_f32`) in plain torch, row by row: the same keys in logical order, one softmax
    over them (fp32; the weights rounded to the cache's dtype before they multiply the values - bf16 as
    transformers' eager bf16 attention does, unrounded for an fp32 cache)."""
    n, H, hd = q.shape
    kvh = kc.shape[0]
    out = torch.empty(n, H, hd, dtype=torch.float32)
    b0 = committed_blocks
    for r in range(n):
        key_pos = torch.arange(b0 * BLOCK + idx.shape[1])
        slots = torch.cat([key_pos[:b0 * BLOCK], idx[r].to(torch.int64)])
        vis = torch.cat([torch.ones(b0 * BLOCK, dtype=torch.bool), ok[r].bool()])
        if window:
            vis &= int(positions[r]) - key_pos < window
        safe = torch.where(vis, slots, 0)
        for h in range(H):
            k = kc[h // (H // kvh)].float()[safe]                          # [keys, hd] in logical order
            v = vc[h // (H // kvh)].float()[safe]
            s = torch.where(vis, (k @ q[r, h].float()) * scale, float("-inf"))
            e = torch.exp(s - s.max()).to(vc.dtype).float()                 # the weights the values get
            out[r, h] = (e @ v) / e.sum()
    return out
