"""MicroSpec's window state on the device: the active vocab I_t = Unique(Suffix(S, w_max)) (Eq. 4).

Device data structures (MicroSpec §3.3), all tensors:

    ring         [w_max] int32   the last w_max entries of the candidate stream S; -1 = empty
    ring_head    0-d int64       entries pushed into the ring so far (ring position = ring_head % w_max)
    stream_len   0-d int64       the true |S| (window_init pushes only the suffix that can be active)
    cnt          [V] int32       occurrences of token v in `ring`
    active       [V] bool        v in I_t  (invariant after every call: active == cnt > 0)
    slot_of      [V] int32       token -> row of the packed LM-head buffer, -1 = none
    tok_of_slot  [w_max] int32   row -> token, -1 = empty slot (masked to -inf in the packed head)
    free_slots   [w_max] int32   stack of free rows: free_slots[:free_top] are free, the top is popped first
    free_top     0-d int64       number of free rows, so |I_t| = w_max - free_top
    first_pos    [V] int32       scratch for the Triton kernels' keep-first dedup (INT32_MAX when idle)

`window_step(state, entries)` appends one step's entries (C_draft then C_ver, Eq. 3) and commits Eq. 4:
tokens whose count drops to 0 leave (their rows go back on the free stack, pushed in stream order),
then tokens that were not active enter (they pop rows, in stream order). It returns the gather list
(slots, tokens of the tokens that entered), padded to the entries' length with -1, and a device count:
no `.item()`, no Python branch on device values, so the step can be enqueued (or graph-captured) with
no host sync. Negative entries are padding and are skipped, so a fixed-size append buffer works as is.

Window modes (two readings of MicroSpec §3.2 Eq. 4):
  "eq4_exact"   Eq. 4 literally: every entry is pushed; re-appending a token refreshes its recency.
  "fifo_unique" a step pushes only Unique(entries) minus I_t (keep-first order), so the ring holds
                distinct tokens; a token active at the start of the step is not refreshed.
Both are implemented three times, bit-identical (same slot assignment): `_window_step_torch` (vectorised
torch, the reference), `_window_step_kernel` (one Triton program per step; lock-free within the
program: atomics for counts and keep-first dedup, prefix sums for compaction and the slot stack) and
`kernels.cpu.window_step` (one C loop over the step's entries: what a CPU with the kernels runs, ~50x
fewer launches than the torch path's ~50 small ops, which cost ~0.8 ms a step; `using_c_step(False)` turns
it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

import contextlib
from typing import Iterator

from specvocab.kernels import cpu as cpu_kernels
from specvocab.kernels import hardware  # noqa: F401  (sets TRITON_INTERPRET before the kernels below are defined)
from specvocab.kernels.hardware import check_triton_can_run, triton_enabled
from specvocab.kernels.tensor_ops import compact, first_occurrence, scatter_masked_

import triton
import triton.language as tl

MODES = ("eq4_exact", "fifo_unique")
_INT32_MAX = 2**31 - 1


class WindowError(ValueError):
    """Bad window arguments; the message names the problem and the fix."""


class GatherList(NamedTuple):
    """Rows to copy into the packed buffer after a step: packed[slots[i]] = weight[tokens[i]], i < count."""
    slots: torch.Tensor    # [m] int64, -1 padded
    tokens: torch.Tensor   # [m] int64, -1 padded
    count: torch.Tensor    # 0-d int64


@dataclass
class WindowState:
    ring: torch.Tensor         # [w_max] int32
    ring_head: torch.Tensor    # 0-d int64
    stream_len: torch.Tensor   # 0-d int64
    cnt: torch.Tensor          # [V] int32
    active: torch.Tensor       # [V] bool
    slot_of: torch.Tensor      # [V] int32
    tok_of_slot: torch.Tensor  # [w_max] int32
    free_slots: torch.Tensor   # [w_max] int32
    free_top: torch.Tensor     # 0-d int64
    first_pos: torch.Tensor    # [V] int32 scratch
    mode: str = "eq4_exact"

    @property
    def w_max(self) -> int:
        return self.ring.numel()

    @property
    def vocab_size(self) -> int:
        return self.cnt.numel()

    @property
    def device(self) -> torch.device:
        return self.ring.device

    def active_size(self) -> torch.Tensor:
        """|I_t| as a 0-d device tensor (no sync)."""
        return self.w_max - self.free_top

    def reset(self) -> "WindowState":
        """Empty window, all slots free (O(V) fills; once per generate() call)."""
        self.ring.fill_(-1)
        self.ring_head.zero_()
        self.stream_len.zero_()
        self.cnt.zero_()
        self.active.zero_()
        self.slot_of.fill_(-1)
        self.tok_of_slot.fill_(-1)
        # reversed so that pops hand out slot 0, 1, 2, ... on a fresh window
        torch.arange(self.w_max - 1, -1, -1, out=self.free_slots)
        self.free_top.fill_(self.w_max)
        self.first_pos.fill_(_INT32_MAX)
        return self


def new_window_state(vocab_size: int, w_max: int, device: torch.device | str | None = None,
                     mode: str = "eq4_exact") -> WindowState:
    """An empty window over a vocabulary of `vocab_size` tokens holding the last `w_max` stream entries."""
    if mode not in MODES:
        raise WindowError(f"unknown window mode {mode!r} — choose one of {list(MODES)} (MicroSpec §3.2 Eq. 4)")
    if vocab_size <= 0 or w_max <= 0:
        raise WindowError(f"vocab_size and w_max must be > 0, got {vocab_size} and {w_max}")
    device = torch.device(device) if device is not None else hardware.DEVICE
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    state = WindowState(
        ring=torch.empty(w_max, **i32), ring_head=torch.empty((), **i64), stream_len=torch.empty((), **i64),
        cnt=torch.empty(vocab_size, **i32), active=torch.empty(vocab_size, dtype=torch.bool, device=device),
        slot_of=torch.empty(vocab_size, **i32), tok_of_slot=torch.empty(w_max, **i32),
        free_slots=torch.empty(w_max, **i32), free_top=torch.empty((), **i64),
        first_pos=torch.empty(vocab_size, **i32), mode=mode)
    return state.reset()


# --- unique new candidates (keep-first dedup) -------------------------------------------------------------

@triton.jit
def _unique_new_kernel(ids_ptr, m, exclude_ptr, first_ptr, out_ptr, count_ptr,
                       HAS_EXCLUDE: tl.constexpr, BLOCK: tl.constexpr):
    # one program: keep the first occurrence of every id >= 0 (not excluded), compact in order
    lane = tl.arange(0, BLOCK)
    v = tl.load(ids_ptr + lane, mask=lane < m, other=-1).to(tl.int64)
    keep = (lane < m) & (v >= 0)
    if HAS_EXCLUDE:
        keep = keep & (tl.load(exclude_ptr + v, mask=keep, other=1) == 0)
    tl.atomic_min(first_ptr + v, lane, mask=keep)
    tl.debug_barrier()
    first = tl.load(first_ptr + v, mask=keep, other=-1, cache_modifier=".cg")
    tl.debug_barrier()
    tl.store(first_ptr + v, 2147483647, mask=keep)              # leave the scratch idle again
    keep = keep & (first == lane)
    k = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(out_ptr + k, v, mask=keep)
    tl.store(count_ptr, tl.sum(keep.to(tl.int64), 0))


def _check_ids(ids: torch.Tensor, name: str = "ids") -> None:
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise WindowError(f"{name} must be a 1-d integer tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")


def unique_new_ref(ids: torch.Tensor, exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids >= 0 (not in `exclude` [V] bool), in first-occurrence order.
    ids [m] -> (uniq [m] int64 padded with -1, count 0-d int64). Vectorised, no host sync."""
    _check_ids(ids)
    ids = ids.long()
    keep = (ids >= 0) & first_occurrence(ids)
    if exclude is not None:
        keep &= ~exclude[ids.clamp(min=0)]
    return compact(ids, keep)


def unique_new_triton(ids: torch.Tensor, vocab_size: int, exclude: torch.Tensor | None = None,
                      scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for `unique_new_ref`'s contract. scratch: [vocab_size] int32 filled with INT32_MAX (left
    that way); allocated when None. ids must be < vocab_size (not checked: that would sync)."""
    _check_ids(ids)
    m = ids.numel()
    if exclude is not None and exclude.numel() != vocab_size:
        raise WindowError(f"exclude must be [vocab_size]={vocab_size}, got {tuple(exclude.shape)}")
    if scratch is None:
        scratch = torch.full((vocab_size,), _INT32_MAX, dtype=torch.int32, device=ids.device)
    elif scratch.numel() != vocab_size or scratch.dtype != torch.int32:
        raise WindowError(f"scratch must be [vocab_size]={vocab_size} int32 (INT32_MAX-filled), got "
                          f"{tuple(scratch.shape)} {scratch.dtype}")
    check_triton_can_run(ids, scratch)
    out = torch.full((m,), -1, dtype=torch.int64, device=ids.device)
    count = torch.zeros((), dtype=torch.int64, device=ids.device)
    if m == 0:
        return out, count
    block = max(16, triton.next_power_of_2(m))
    ex = exclude.view(torch.uint8) if exclude is not None else scratch
    _unique_new_kernel[(1,)](ids.contiguous(), m, ex, scratch, out, count, HAS_EXCLUDE=exclude is not None,
                             BLOCK=block, num_warps=_warps(block))
    return out, count


def unique_new(ids: torch.Tensor, vocab_size: int, exclude: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique new candidates: distinct ids >= 0 not in `exclude`, keep-first order, padded with -1 + count."""
    if triton_enabled():
        return unique_new_triton(ids, vocab_size, exclude, scratch)
    return unique_new_ref(ids, exclude)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# --- window step ------------------------------------------------------------------------------------------

@triton.jit
def _window_step_kernel(entries_ptr, m, ring_ptr, head_ptr, len_ptr, cnt_ptr, active_ptr, slot_of_ptr,
                        tok_of_slot_ptr, free_ptr, top_ptr, first_ptr, g_slots_ptr, g_tokens_ptr, g_count_ptr,
                        W, FIFO_UNIQUE: tl.constexpr, BLOCK: tl.constexpr):
    # One program handles the whole step (m <= w_max entries). Phases that read what other threads
    # wrote are separated by barriers, and such reads bypass L1 (.cg: atomics resolve in L2).
    # active is passed as uint8.
    lane = tl.arange(0, BLOCK)
    e = tl.load(entries_ptr + lane, mask=lane < m, other=-1).to(tl.int64)
    keep = (lane < m) & (e >= 0)
    head = tl.load(head_ptr)
    stream_len = tl.load(len_ptr)
    top = tl.load(top_ptr)
    if FIFO_UNIQUE:   # push only Unique(entries) \ I_t, keep-first
        tl.atomic_min(first_ptr + e, lane, mask=keep)
        tl.debug_barrier()
        first = tl.load(first_ptr + e, mask=keep, other=-1, cache_modifier=".cg")
        was_active = tl.load(active_ptr + e, mask=keep, other=1)
        tl.debug_barrier()
        tl.store(first_ptr + e, 2147483647, mask=keep)
        tl.debug_barrier()
        keep = keep & (first == lane) & (was_active == 0)
    # push: the k-th kept entry overwrites ring position (head + k) % W (distinct positions: m <= W)
    k = tl.cumsum(keep.to(tl.int32), 0) - 1
    n = tl.sum(keep.to(tl.int64), 0)
    pos = (head + k) % W
    old = tl.load(ring_ptr + pos, mask=keep, other=-1).to(tl.int64)
    tl.store(ring_ptr + pos, e.to(tl.int32), mask=keep)
    evict = keep & (old >= 0)
    tl.atomic_add(cnt_ptr + old, -1, mask=evict)
    tl.atomic_add(cnt_ptr + e, 1, mask=keep)
    # keep-first dedup of the touched tokens: evicted lanes rank before pushed lanes
    tl.atomic_min(first_ptr + old, lane, mask=evict)
    tl.atomic_min(first_ptr + e, lane + BLOCK, mask=keep)
    tl.debug_barrier()
    first_old = tl.load(first_ptr + old, mask=evict, other=-1, cache_modifier=".cg")
    first_new = tl.load(first_ptr + e, mask=keep, other=-1, cache_modifier=".cg")
    cnt_old = tl.load(cnt_ptr + old, mask=evict, other=1, cache_modifier=".cg")
    active_old = tl.load(active_ptr + old, mask=evict, other=0)
    active_new = tl.load(active_ptr + e, mask=keep, other=1)
    tl.debug_barrier()
    tl.store(first_ptr + old, 2147483647, mask=evict)
    tl.store(first_ptr + e, 2147483647, mask=keep)
    # Eq. 4 commit. A pushed token has cnt >= 1, so only evicted tokens can leave and only pushed ones enter.
    leave = evict & (first_old == lane) & (cnt_old == 0) & (active_old != 0)
    enter = keep & (first_new == lane + BLOCK) & (active_new == 0)
    # leave: free the rows, push them on the stack in stream order
    lk = tl.cumsum(leave.to(tl.int32), 0) - 1
    n_leave = tl.sum(leave.to(tl.int64), 0)
    slot_old = tl.load(slot_of_ptr + old, mask=leave, other=-1).to(tl.int64)
    tl.store(free_ptr + top + lk, slot_old.to(tl.int32), mask=leave)
    tl.store(tok_of_slot_ptr + slot_old, -1, mask=leave)
    tl.store(slot_of_ptr + old, -1, mask=leave)
    tl.store(active_ptr + old, 0, mask=leave)
    tl.debug_barrier()
    # enter: pop rows (stack top first), in stream order; record the gather list
    top = top + n_leave
    ek = tl.cumsum(enter.to(tl.int32), 0) - 1
    n_enter = tl.sum(enter.to(tl.int64), 0)
    slot_new = tl.load(free_ptr + top - 1 - ek, mask=enter, other=-1, cache_modifier=".cg").to(tl.int64)
    tl.store(slot_of_ptr + e, slot_new.to(tl.int32), mask=enter)
    tl.store(tok_of_slot_ptr + slot_new, e.to(tl.int32), mask=enter)
    tl.store(active_ptr + e, 1, mask=enter)
    tl.store(g_slots_ptr + ek, slot_new, mask=enter)
    tl.store(g_tokens_ptr + ek, e, mask=enter)
    # scalars last: every thread has read the old values (barriers above)
    tl.store(head_ptr, head + n)
    tl.store(len_ptr, stream_len + n)
    tl.store(top_ptr, top - n_enter)
    tl.store(g_count_ptr, n_enter)


def _window_step_triton(st: WindowState, entries: torch.Tensor) -> GatherList:
    check_triton_can_run(entries, st.ring)
    m = entries.numel()
    slots = torch.full((m,), -1, dtype=torch.int64, device=st.device)
    tokens = torch.full((m,), -1, dtype=torch.int64, device=st.device)
    count = torch.zeros((), dtype=torch.int64, device=st.device)
    if m == 0:
        return GatherList(slots, tokens, count)
    block = max(16, triton.next_power_of_2(m))
    _window_step_kernel[(1,)](entries.contiguous(), m, st.ring, st.ring_head, st.stream_len, st.cnt,
                              st.active.view(torch.uint8), st.slot_of, st.tok_of_slot, st.free_slots,
                              st.free_top, st.first_pos, slots, tokens, count, st.w_max,
                              FIFO_UNIQUE=st.mode == "fifo_unique", BLOCK=block, num_warps=_warps(block))
    return GatherList(slots, tokens, count)


def _window_step_torch(st: WindowState, entries: torch.Tensor) -> GatherList:
    """The same step as `_window_step_kernel`, in vectorised torch (what CPU runs)."""
    m = entries.numel()
    dev = st.device
    lane = torch.arange(m, device=dev)
    if m == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return GatherList(empty, empty.clone(), torch.zeros((), dtype=torch.int64, device=dev))
    raw = entries.long()                                           # [m]
    keep = raw >= 0
    if st.mode == "fifo_unique":
        keep &= first_occurrence(raw) & ~st.active[raw.clamp(min=0)]
    e, n = compact(raw, keep)                                      # [m]: the n pushed entries first
    live = lane < n
    # push: entry k overwrites ring position (ring_head + k) % w_max; distinct positions since m <= w_max
    pos = (st.ring_head + lane) % st.w_max                         # [m]
    old = st.ring[pos].long()                                      # [m]
    st.ring[pos] = torch.where(live, e, old).to(torch.int32)
    evict = live & (old >= 0)
    old = torch.where(evict, old, -1)
    st.cnt.scatter_add_(0, old.clamp(min=0), -evict.to(torch.int32))
    st.cnt.scatter_add_(0, e.clamp(min=0), live.to(torch.int32))
    st.ring_head += n
    st.stream_len += n
    # Eq. 4 commit: only evicted tokens can leave, only pushed tokens can enter
    old_c, e_c = old.clamp(min=0), e.clamp(min=0)
    leave = evict & first_occurrence(old) & (st.cnt[old_c] == 0) & st.active[old_c]
    enter = live & first_occurrence(e) & ~st.active[e_c]
    # leave: free rows, push them on the stack in stream order
    gone, n_leave = compact(old, leave)                            # [m] tokens leaving, -1 padded
    gone_lane = lane < n_leave
    gone_c = gone.clamp(min=0)
    freed = st.slot_of[gone_c].long()                              # [m]
    scatter_masked_(st.free_slots, st.free_top + lane, freed.to(torch.int32), gone_lane)
    scatter_masked_(st.tok_of_slot, freed.clamp(min=0), torch.full_like(st.tok_of_slot[:1], -1).expand(m),
                    gone_lane)
    scatter_masked_(st.slot_of, gone_c, torch.full_like(st.slot_of[:1], -1).expand(m), gone_lane)
    scatter_masked_(st.active, gone_c, torch.zeros(m, dtype=torch.bool, device=dev), gone_lane)
    top = st.free_top + n_leave
    # enter: pop rows from the stack top, in stream order
    new, n_enter = compact(e, enter)                               # [m] tokens entering, -1 padded
    new_lane = lane < n_enter
    new_c = new.clamp(min=0)
    got = st.free_slots[(top - 1 - lane).clamp(min=0)].long()      # [m]
    scatter_masked_(st.slot_of, new_c, got.to(torch.int32), new_lane)
    scatter_masked_(st.tok_of_slot, got.clamp(min=0), new.to(torch.int32), new_lane)
    scatter_masked_(st.active, new_c, torch.ones(m, dtype=torch.bool, device=dev), new_lane)
    st.free_top.copy_(top - n_enter)
    return GatherList(torch.where(new_lane, got, -1), torch.where(new_lane, new, -1), n_enter)


def _pushed_suffix(state: WindowState, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries a step would push (valid ones; for fifo_unique the distinct ones not active at the start
    of the step), compacted, and the last w_max of them: (suffix [w_max] -1 padded, pushed count 0-d).

    Only the last w_max pushed entries can be active after the step (Eq. 4), so pushing the suffix gives
    the same window as pushing them all. Padding (-1) must be dropped BEFORE the suffix is taken: a
    padded tail such as entries[-w_max:] would count -1 lanes as stream entries. Fixed shapes, no sync."""
    raw = entries.long()
    m, W = raw.numel(), state.w_max
    if m == 0:
        return torch.full((W,), -1, dtype=torch.int64, device=state.device), raw.new_zeros(())
    keep = raw >= 0
    if state.mode == "fifo_unique":
        keep &= first_occurrence(raw) & ~state.active[raw.clamp(min=0)]
    pushed, n = compact(raw, keep)                                 # [m]: the n pushed entries first
    start = (n - W).clamp(min=0)
    lane = torch.arange(W, device=state.device)
    suffix = torch.where(lane < n.clamp(max=W), pushed[(start + lane).clamp(max=m - 1)], -1)
    return suffix, n


_C_STEP = True


@contextlib.contextmanager
def using_c_step(flag: bool) -> Iterator[None]:
    """`with using_c_step(False): ...` runs the torch reference on CPU where the C step would run."""
    global _C_STEP
    previous, _C_STEP = _C_STEP, flag
    try:
        yield
    finally:
        _C_STEP = previous


def _window_step_c(st: WindowState, entries: torch.Tensor) -> GatherList:
    """The same step as `_window_step_torch`, in C (kernels/cpu_portable.c `sv_window_step`)."""
    slots, tokens, count = cpu_kernels.window_step(
        entries, st.mode == "fifo_unique", st.ring, st.ring_head, st.stream_len, st.cnt, st.active, st.slot_of,
        st.tok_of_slot, st.free_slots, st.free_top, st.first_pos)
    return GatherList(slots, tokens, count)


def window_step(state: WindowState, entries: torch.Tensor) -> GatherList:
    """Append one step's entries [m] (int, negative = padding) to the candidate stream and commit Eq. 4
    (or fifo_unique). Returns the gather list of the tokens that entered I. No host sync.

    m > w_max is allowed: the padding is compacted away first and only the last w_max pushed entries
    are written (`_pushed_suffix`), at the ring positions they would have had if all were pushed one by
    one (ring_head and stream_len advance by every pushed entry)."""
    _check_ids(entries, "entries")
    if entries.device != state.device:
        raise WindowError(f"entries are on {entries.device} but the window state is on {state.device}")
    if entries.numel() > state.w_max:
        entries, n = _pushed_suffix(state, entries)                # [w_max]
        dropped = n - n.clamp(max=state.w_max)                     # pushed entries overwritten in this step
        state.ring_head += dropped
        state.stream_len += dropped
    if triton_enabled():
        return _window_step_triton(state, entries)
    if _C_STEP and state.device.type == "cpu" and cpu_kernels.available_portable() is None:
        return _window_step_c(state, entries)
    return _window_step_torch(state, entries)


def window_init(state: WindowState, entries: torch.Tensor) -> GatherList:
    """Reset the window and push the prompt-derived stream S_init [L] (Eq. 2: prompt tokens, then the
    top-k_pre union; negative = padding). Only the last w_max pushed entries can be active, so only that
    suffix enters the ring (MicroSpec §3.2, Eq. 4); stream_len keeps the true |S|.
    Returns the gather list (up to min(L, w_max) rows: every token of I_first)."""
    _check_ids(entries, "entries")
    if entries.device != state.device:
        raise WindowError(f"entries are on {entries.device} but the window state is on {state.device}")
    state.reset()
    suffix, n = _pushed_suffix(state, entries)                     # [w_max]; nothing is active yet
    gathered = window_step(state, suffix)
    state.stream_len.copy_(n)
    return gathered
