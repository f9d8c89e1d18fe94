"""Test-only trace generators for the locality tests: random traces and speculative traces as the harness
writes them."""

from __future__ import annotations

import numpy as np

from specvocab.locality import Trace


def random_trace(rng, V=12, K=4, draft=None, L=None, T=None, meta=None):
    """Small vocabulary to force repeats; top-K rows without repeats inside a row."""
    K = min(K, V)
    L = int(rng.integers(1, 12)) if L is None else L
    T = int(rng.integers(0, 15)) if T is None else T
    rows = lambda n: np.array([rng.permutation(V)[:K] for _ in range(n)], dtype=np.int64).reshape(n, K)  # noqa
    draft = bool(rng.integers(0, 2)) if draft is None else draft
    return Trace(prompt=rng.integers(0, V, L), prefill_topk=rows(L - 1), generated=rng.integers(0, V, T),
                 step_topk=rows(T), meta=meta or {},
                 draft_tokens=[rng.integers(0, V, rng.integers(0, 6)) for _ in range(T)] if draft else None)


def random_traces(seed, n=None, **kw):
    rng = np.random.default_rng(seed)
    return [random_trace(rng, meta={"category": ["qa", "code", "math"][i % 3], "language": ["en", "de"][i % 2]},
                         **kw) for i in range(int(rng.integers(1, 7)) if n is None else n)]


def spec_traces(seed, n=4, V=12, cut=True):
    """Speculative traces as the harness writes them: step 0 commits one token, later steps 1-4; the last
    step may be recorded whole past the end (cut at an eos / max_new_tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = random_trace(rng, V=V, draft=False, meta={"category": ["qa", "code"][i % 2]})
        T = len(t.generated)
        sizes = [1] if T else []
        while sum(sizes) < T:
            sizes.append(int(rng.integers(1, 5)))
        if not cut and sum(sizes) > T:
            sizes[-1] -= sum(sizes) - T
        t.draft_tokens = [np.zeros(0, np.int64)] + [rng.integers(0, V, rng.integers(0, 7)) for _ in sizes[1:]]
        t.meta["step_sizes"] = sizes
        out.append(t)
    return out
