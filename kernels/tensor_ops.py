"""Small vectorised torch helpers that never sync with the host (no `.item()`, no boolean indexing,
no Python branch on device values), so the torch paths stay CUDA-graph friendly."""

from __future__ import annotations

import torch


def scatter_masked_(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                    keep: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = values[i] where keep[i]; in place, returns dst.

    Torch has no masked scatter and boolean indexing would sync. Dropped lanes are redirected to a copy
    of the first kept write (or, when nothing is kept, to a write-back of dst's own element), so
    duplicate indices only ever write identical values and the result is deterministic. Kept lanes must
    have distinct indices; dropped lanes may hold any index (it is not read)."""
    if index.numel() == 0:
        return dst
    index = index.long()
    # 1-element indices, not 0-d ones: indexing with a 0-d tensor may be read as a Python int (a sync)
    first = keep.to(torch.int8).argmax().view(1)              # first kept lane (0 if none)
    any_kept = keep.any()
    index0 = torch.where(any_kept, index[first], 0)           # [1]
    value0 = torch.where(any_kept, values[first], dst[index0])  # [1, ...]
    lane_keep = keep.view(-1, *([1] * (values.dim() - 1)))
    dst[torch.where(keep, index, index0)] = torch.where(lane_keep, values, value0)
    return dst


def compact(values: torch.Tensor, keep: torch.Tensor, fill: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable stream compaction: the kept values first, in order, then `fill`.

    values [m], keep [m] bool -> (out [m], count 0-d int64). A gather (searchsorted over the running
    count), not a scatter, so there are no write conflicts."""
    m = values.numel()
    if m == 0:
        return values.clone(), torch.zeros((), dtype=torch.int64, device=values.device)
    running = keep.cumsum(0)                                   # [m] non-decreasing
    count = running[-1]
    k = torch.arange(m, device=values.device)
    src = torch.searchsorted(running, k + 1).clamp(max=m - 1)  # index of the (k+1)-th kept lane
    out = torch.where(k < count, values[src], torch.full_like(values, fill))
    return out, count


def first_occurrence(values: torch.Tensor) -> torch.Tensor:
    """[m] bool: True at the first (lowest-index) occurrence of each value. Sort-based, O(m log m), no
    [V]-sized scratch."""
    m = values.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    ordered, perm = values.sort(stable=True)
    first_sorted = torch.ones(m, dtype=torch.bool, device=values.device)
    first_sorted[1:] = ordered[1:] != ordered[:-1]
    return torch.empty_like(first_sorted).scatter_(0, perm, first_sorted)


def row_chunks(n_rows: int, row_bytes: int, budget_bytes: int = 8 << 20) -> list[tuple[int, int]]:
    """[(start, stop)] covering n_rows in chunks of at most `budget_bytes` (at least one row each).

    The CPU paths gather rows chunk by chunk: a temporary of a few MB is reused by the allocator, while
    one of hundreds of MB is mapped fresh and page-faulted on every call. Shapes only: no device read."""
    step = max(1, budget_bytes // max(1, row_bytes))
    return [(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]
