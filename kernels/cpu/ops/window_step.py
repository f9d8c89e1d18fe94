"""MicroSpec's window step in one C loop over the step's entries (kernels/cpu_portable.c `sv_window_step`, in
either library), O(m) per step. Its reference, bit for bit, is kernels.window's `_window_step_torch`, whose
state fields these are; `kernels.window.window_step` calls this on a CPU where it runs."""

from __future__ import annotations

import torch

from specvocab.kernels.cpu import builds


def window_step(entries: torch.Tensor, fifo_unique: bool, ring: torch.Tensor, ring_head: torch.Tensor,
                stream_len: torch.Tensor, cnt: torch.Tensor, active: torch.Tensor, slot_of: torch.Tensor,
                tok_of_slot: torch.Tensor, free_slots: torch.Tensor, free_top: torch.Tensor,
                mark: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window step on CPU tensors in place: entries [m] int64 with m <= ring.numel(). Returns the gather list
    (slots [m], tokens [m], -1 past the count; count 0-d int64). The caller (`kernels.window.window_step`)
    checks ids and shapes; `available_portable()` must be None."""
    m = entries.numel()
    e = entries.to(torch.int64).contiguous()
    scratch = torch.empty(2, m, dtype=torch.int64)
    flag = torch.empty(m, dtype=torch.uint8)
    slots, tokens = torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int64)
    fn, _ = builds.function("window_step")
    count = fn(e.data_ptr(), m, int(fifo_unique), ring.data_ptr(), ring.numel(), ring_head.data_ptr(),
               stream_len.data_ptr(), cnt.data_ptr(), active.data_ptr(), slot_of.data_ptr(), tok_of_slot.data_ptr(),
               free_slots.data_ptr(), free_top.data_ptr(), mark.data_ptr(), scratch[0].data_ptr(),
               scratch[1].data_ptr(), flag.data_ptr(), slots.data_ptr(), tokens.data_ptr())
    return slots, tokens, torch.tensor(count, dtype=torch.int64)
