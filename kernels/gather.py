"""Row gather into the packed LM-head buffer: packed[slots[i], :] = weight[tokens[i], :].

MicroSpec keeps a pre-allocated contiguous buffer `packed [W_max, d]` and, after every step, copies
in only the rows of the tokens that entered the active vocab (MicroSpec §3.3).
The gather list comes from `kernels.window.window_step`: fixed size, padded with -1, plus a device
count, so the launch needs no host sync.

Bytes moved per call: 2 * n * d * itemsize (read n rows, write n rows).

Three layers: `_gather_rows_kernel` (Triton), `gather_rows_triton` (launcher), `gather_rows_ref`
(plain torch, what CPU runs); `gather_rows` picks one (see `kernels.hardware`).
"""

from __future__ import annotations

import torch

from specvocab.kernels import hardware  # noqa: F401  (sets TRITON_INTERPRET before the kernels below are defined)
from specvocab.kernels.hardware import check_triton_can_run, triton_enabled
from specvocab.kernels.tensor_ops import row_chunks

import triton
import triton.language as tl


class GatherError(ValueError):
    """Bad arguments to `gather_rows`; the message names the tensor and the expected shape/dtype."""


@triton.jit
def _gather_rows_kernel(weight_ptr, packed_ptr, slots_ptr, tokens_ptr, count_ptr, d,
                        stride_w, stride_p, HAS_COUNT: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid = (m, cdiv(d, BLOCK_D)): one program copies BLOCK_D columns of one row (or nothing, for a
    # padded pair or one past the count).
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    token = tl.load(tokens_ptr + i).to(tl.int64)
    live = (slot >= 0) & (token >= 0)
    if HAS_COUNT:
        live = live & (i < tl.load(count_ptr))
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    keep = (cols < d) & live
    row = tl.load(weight_ptr + token * stride_w + cols, mask=keep)
    tl.store(packed_ptr + slot * stride_p + cols, row.to(packed_ptr.dtype.element_ty), mask=keep)


def _check(weight: torch.Tensor, packed: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
           count: torch.Tensor | None) -> None:
    if weight.dim() != 2 or packed.dim() != 2 or weight.shape[1] != packed.shape[1]:
        raise GatherError(f"need weight [V, d] and packed [W, d] with the same d, got {tuple(weight.shape)} "
                          f"and {tuple(packed.shape)}")
    if slots.dim() != 1 or tokens.shape != slots.shape:
        raise GatherError(f"slots and tokens must both be [m], got {tuple(slots.shape)} and {tuple(tokens.shape)}")
    if slots.dtype.is_floating_point or tokens.dtype.is_floating_point:
        raise GatherError(f"slots/tokens must be integer tensors, got {slots.dtype}/{tokens.dtype}")
    if weight.stride(1) != 1 or packed.stride(1) != 1:
        raise GatherError("weight and packed need contiguous rows (stride 1 along d) — call .contiguous()")
    if count is not None and count.numel() != 1:
        raise GatherError(f"count must be a 0-d (or 1-element) device tensor, got shape {tuple(count.shape)}")
    devices = {t.device for t in (weight, packed, slots, tokens) + ((count,) if count is not None else ())}
    if len(devices) != 1:
        raise GatherError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def gather_rows_triton(weight: torch.Tensor, packed: torch.Tensor, slots: torch.Tensor,
                       tokens: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: packed[slots[i]] = weight[tokens[i]] for i < count (all i if None); pairs with a negative
    slot or token are skipped. Returns `packed` (written in place)."""
    _check(weight, packed, slots, tokens, count)
    check_triton_can_run(weight, packed)
    m, d = slots.numel(), weight.shape[1]
    if m == 0 or d == 0:
        return packed
    block_d = min(1024, triton.next_power_of_2(d))
    grid = (m, triton.cdiv(d, block_d))
    slots, tokens = slots.contiguous(), tokens.contiguous()
    _gather_rows_kernel[grid](weight, packed, slots, tokens, count if count is not None else slots, d,
                              weight.stride(0), packed.stride(0), HAS_COUNT=count is not None,
                              BLOCK_D=block_d, num_warps=4)
    return packed


def gather_rows_ref(weight: torch.Tensor, packed: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                    count: torch.Tensor | None = None) -> torch.Tensor:
    """Reference (and the CPU path): same contract as `gather_rows_triton`, vectorised, no host sync."""
    _check(weight, packed, slots, tokens, count)
    m = slots.numel()
    if m == 0:
        return packed
    slots, tokens = slots.long(), tokens.long()
    keep = (slots >= 0) & (tokens >= 0)                        # [m]
    if count is not None:
        keep &= torch.arange(m, device=slots.device) < count.reshape(())
    # Dropped lanes copy the first kept lane's (slot, token), so duplicate writes are identical. When no
    # lane is kept they all write slot0, whose row is saved first and put back. No host sync, no branch.
    first = keep.to(torch.int8).argmax().view(1)              # [1]
    any_kept = keep.any()
    slot0 = torch.where(any_kept, slots[first], 0)            # [1]
    token0 = torch.where(any_kept, tokens[first], 0)          # [1]
    saved = packed.index_select(0, slot0)                     # [1, d]
    src = torch.where(keep, tokens, token0)                   # [m]
    dst = torch.where(keep, slots, slot0)                     # [m]
    for a, b in row_chunks(m, weight.shape[1] * weight.element_size()):
        packed.index_copy_(0, dst[a:b], weight.index_select(0, src[a:b]).to(packed.dtype))
    return packed.index_copy_(0, slot0, torch.where(any_kept, packed.index_select(0, slot0), saved))


def gather_rows(weight: torch.Tensor, packed: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                count: torch.Tensor | None = None) -> torch.Tensor:
    """packed[slots[i]] = weight[tokens[i]] (i < count; negative pairs skipped), in place; returns packed.

    weight [V, d], packed [W, d] (any float dtypes; rows are cast to packed's), slots/tokens [m] integer,
    count: optional 0-d device tensor. Triton or torch per `kernels.hardware.triton_enabled()`."""
    if triton_enabled():
        return gather_rows_triton(weight, packed, slots, tokens, count)
    return gather_rows_ref(weight, packed, slots, tokens, count)
