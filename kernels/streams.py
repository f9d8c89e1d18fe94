"""`PackedLMHead`: MicroSpec's draft LM head over the active vocab, with the gather on a copy stream.

Per step (MicroSpec §3.3):

    head.update(entries)   # compute stream: window_step (Eq. 3/4, no host sync) -> event E_state
                           # copy stream:    wait(E_state) -> gather_rows of the entered tokens -> E_gather
    ... draft backbone on the compute stream, overlapping the gather ...
    head.logits(h)         # compute stream waits on E_gather only here, then the packed head (masked)
    head.slot_to_token(top_slots)

On CPU (or any non-CUDA device) the same calls run in order. The class knows only tensors: no model,
tree or engine concept. The packed buffer is read by `logits` on the compute stream and rewritten by the
next `update`'s gather on the copy stream; the copy stream waits on E_state, which is recorded after
everything already enqueued on the compute stream, so a gather never overwrites rows a pending head
still reads.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specvocab.kernels.gather import gather_rows
from specvocab.kernels.head import packed_head
from specvocab.kernels.window import MODES, GatherList, WindowError, new_window_state, window_init, window_step


class PackedLMHead:
    """Draft LM head over the active vocab I_t, kept in a packed [w_max, d] buffer.

    weight: [V, d] the full LM head (W_head of the drafter; often the tied embedding), not copied.
    w_max:  rows of the packed buffer = maximum |I_t| (the window length, paper default 3072).
    dtype:  of the packed buffer (default: weight's); rows are cast while gathered.
    mode:   "eq4_exact" | "fifo_unique" (Eq. 4 exactly, or a FIFO of unique tokens: a reading where MicroSpec §3.2 is ambiguous).
    """

    def __init__(self, weight: torch.Tensor, w_max: int, dtype: torch.dtype | None = None,
                 mode: str = "eq4_exact"):
        if weight.dim() != 2:
            raise WindowError(f"weight must be the [V, d] LM head, got {tuple(weight.shape)}")
        if mode not in MODES:
            raise WindowError(f"unknown window mode {mode!r} — choose one of {list(MODES)}")
        self.weight = weight                                       # [V, d]
        self.dtype = dtype or weight.dtype
        self.device = weight.device
        vocab_size, d = weight.shape
        self.packed = torch.zeros(w_max, d, dtype=self.dtype, device=self.device)   # [w_max, d]
        self.state = new_window_state(vocab_size, w_max, self.device, mode)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._state_ready = torch.cuda.Event()
            self._gather_done = torch.cuda.Event()
        self._gather_pending = False    # host-side bookkeeping only (never reads the device)

    @property
    def w_max(self) -> int:
        return self.state.w_max

    @property
    def tok_of_slot(self) -> torch.Tensor:
        return self.state.tok_of_slot                              # [w_max] int32, -1 = empty

    def _entries(self, entries: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if not isinstance(entries, torch.Tensor):
            entries = torch.as_tensor(list(entries), dtype=torch.int64)
        return entries.to(self.device, non_blocking=True)

    def _gather(self, todo: GatherList) -> None:
        if not self.on_cuda:
            gather_rows(self.weight, self.packed, todo.slots, todo.tokens, todo.count)
            return
        compute = torch.cuda.current_stream(self.device)
        self._state_ready.record(compute)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._state_ready)
            gather_rows(self.weight, self.packed, todo.slots, todo.tokens, todo.count)
            self._gather_done.record(self.copy_stream)
        for t in todo:   # made on the compute stream, read on the copy stream: keep them alive for it
            t.record_stream(self.copy_stream)
        self._gather_pending = True

    def reset(self, entries: torch.Tensor | Sequence[int]) -> GatherList:
        """Start a new candidate stream from S_init (Eq. 2) and gather the rows of I_first."""
        todo = window_init(self.state, self._entries(entries))
        self._gather(todo)
        return todo

    def update(self, entries: torch.Tensor | Sequence[int]) -> GatherList:
        """Append one step's entries (C_draft then C_ver; negative = padding), commit Eq. 4, and start
        the gather of the entered rows (asynchronous on CUDA)."""
        todo = window_step(self.state, self._entries(entries))
        self._gather(todo)
        return todo

    def wait_gather(self) -> None:
        """Make the current (compute) stream wait for the last gather. No host sync."""
        if self.on_cuda and self._gather_pending:
            torch.cuda.current_stream(self.device).wait_event(self._gather_done)
            self._gather_pending = False

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> logits [..., w_max] fp32 over slots; empty slots are -inf."""
        self.wait_gather()
        return packed_head(h.to(self.dtype), self.packed, self.state.tok_of_slot)

    def slot_to_token(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocab token ids (int64) of packed slots, any shape; an empty slot maps to -1."""
        return self.state.tok_of_slot[slot_ids.long()].long()

    def active_size(self) -> torch.Tensor:
        """|I_t| as a 0-d device tensor (no sync)."""
        return self.state.active_size()

    def stats(self) -> dict[str, int]:
        """Host-side numbers for logging. Syncs with the device: call it outside the decode loop."""
        return {"active_vocab": int(self.state.active_size()), "stream_len": int(self.state.stream_len),
                "w_max": self.w_max, "vocab_size": self.state.vocab_size}
