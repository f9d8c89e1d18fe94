"""Helpers for kernel tests and benchmarks: error metrics and loud scratch buffers."""

from __future__ import annotations

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||actual - expected||_2 / ||expected||_2 over the entries where `expected` is
    finite; the non-finite entries must match exactly (same -inf mask, same NaNs), else returns inf."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    same_nonfinite = torch.equal(torch.where(finite, 0.0, e.nan_to_num(nan=1.0)),
                                 torch.where(finite, 0.0, a.nan_to_num(nan=1.0)))
    if not same_nonfinite or not torch.isfinite(a[finite]).all():
        return float("inf")
    if not finite.any():
        return 0.0
    err = (a[finite] - e[finite]).pow(2).mean().sqrt()
    ref = e[finite].pow(2).mean().sqrt().clamp(min=torch.finfo(torch.float64).tiny)
    return float(err / ref)


def nan_filled(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """A scratch buffer full of NaN, so any row a kernel should have written and did not fails loudly."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def cpu_as(monkeypatch, flags: set[str] | None = None, failed: dict[str, str] | None = None) -> None:
    """kernels.cpu as a fresh process sees it on a CPU whose /proc/cpuinfo lists `flags` (None: this CPU's), with
    each library of `failed` ({"avx512" | "avx2": why}) failing to build there; `monkeypatch` undoes it. Nothing
    is tried until asked (`kernels.cpu.builds`: the chain, each library once), and no line is said yet."""
    from specvocab.kernels.cpu import builds, compiler

    monkeypatch.setattr(compiler, "_said", set())
    state = builds._State()
    if flags is not None:
        state.flags = set(flags)
    for name, why in (failed or {}).items():
        state.libs[name] = builds._Loaded(None, why, why)
    monkeypatch.setattr(builds, "_state", state)
