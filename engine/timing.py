"""`PhaseTimer`: accumulated time per named phase of a drafter step (backbone, lm_head, tree, gather, ...).

Shared by the drafters (`engine.drafters.lmhead`) and the vocabulary policies (`engine.vocab`), which time
their own phases on the drafter's timer; it lives here so that neither imports the other.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseTimer:
    """Accumulated time per named phase. On CUDA, pairs of events are recorded and resolved only in
    `totals()` (one synchronize at the end, none in the decode loop); on CPU every op is synchronous and
    `time.perf_counter` is exact."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._cpu: dict[str, float] = defaultdict(float)
        self._events: dict[str, list] = defaultdict(list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu[name] += time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        out = dict(self._cpu)
        if self._events:
            torch.cuda.synchronize()   # once, when results are read; never inside a step
            for name, pairs in self._events.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1e3
        return out
