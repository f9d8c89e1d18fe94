"""Top-k over fp32 rows in one pass at memory speed (the verify's argmax, MicroSpec's and UniSpec's top-k over
the vocabulary, the successor store's confidences): kernels/cpu.c `sv_topk_f32` / `sv_topk_lse_f32`,
kernels/cpu_avx2.c `sv2_topk_f32` / `sv2_topk_lse_f32`, beside their references.

    topk(z, k)                  torch.topk(z, k) of fp32 CPU rows (ties: the lower index, as torch.argmax)
    argmax(z)                   z.argmax(-1) through `topk`
    topk_lse(z, k)              `topk` and each row's log-sum-exp
    topk_lse_reference(z, k)    the same in plain torch

Rows are split across threads whole (a row's answer never depends on the thread count); a row holding NaN,
+inf, or fewer than k values above -inf is answered by torch.
"""

from __future__ import annotations

import torch

from specvocab.kernels.cpu import builds

TOPK_MAX = 64      # k up to which `topk` scans in C (an insertion sort per improvement); above: torch.topk


def _c_rows(z: torch.Tensor, k: int, op: str):
    """(z [.., V] as contiguous [rows, V], the C function of `op`) where the C passes take it (fp32 CPU rows,
    0 < k <= TOPK_MAX, a build here), else None."""
    V = z.shape[-1]
    if z.dtype != torch.float32 or z.device.type != "cpu" or not 0 < k <= min(V, TOPK_MAX) or z.numel() == 0:
        return None
    if builds.provider(op) is None:
        return None
    return z.reshape(-1, V).contiguous(), builds.function(op)[0]


def topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of z [.., V], descending, as `torch.topk(z, k)`: in C for
    fp32 CPU rows where the kernels run (one pass at memory speed: Gemma's 262k logits ~0.1 ms a row against
    torch's ~0.5), ties broken by the lower index (torch.argmax's first maximum; torch.topk leaves tie order
    unspecified). A row holding NaN, or fewer than k values above -inf, is answered by torch."""
    c = _c_rows(z, k, "topk")
    if c is None:
        return torch.topk(z, min(k, z.shape[-1]), dim=-1)
    z2, topk_c = c
    V, lead = z.shape[-1], z.shape[:-1]
    vals = torch.empty(z2.shape[0], k, dtype=torch.float32)
    idx = torch.empty(z2.shape[0], k, dtype=torch.int64)
    nan = topk_c(z2.data_ptr(), z2.shape[0], V, k, vals.data_ptr(), idx.data_ptr(), torch.get_num_threads())
    if nan or bool((idx[:, -1] < 0).any()):
        return torch.topk(z, k, dim=-1)
    return vals.view(*lead, k), idx.view(*lead, k)


def argmax(z: torch.Tensor) -> torch.Tensor:
    """z.argmax(-1) (the first maximum), through `topk` (k = 1)."""
    return topk(z, 1)[1][..., 0]


def topk_lse(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [.., k], indices [.., k], logsumexp [..]) of each row of z [.., V]: `topk`, and the row's
    log-sum-exp, so that exp(values - lse) are the top-k softmax probabilities (the successor store's
    confidences, engine.store.topk_probs). In C for fp32 CPU rows where the kernels run: the top-k pass, then
    one pass of exp(z - max) summed in fp64 (torch.logsumexp spends ~3 ns a logit on one thread, ~10x this).
    The log-sum-exp agrees with torch's to float rounding (a few ulp), not bitwise. Elsewhere, and for rows C
    declines (NaN, +inf, fewer than k values above -inf): `topk_lse_reference`."""
    c = _c_rows(z, k, "topk_lse")
    if c is None:
        return topk_lse_reference(z, k)
    z2, topk_lse_c = c
    V, lead = z.shape[-1], z.shape[:-1]
    vals = torch.empty(z2.shape[0], k, dtype=torch.float32)
    idx = torch.empty(z2.shape[0], k, dtype=torch.int64)
    lse = torch.empty(z2.shape[0], dtype=torch.float32)
    bad = topk_lse_c(z2.data_ptr(), z2.shape[0], V, k, vals.data_ptr(), idx.data_ptr(), lse.data_ptr(),
                     torch.get_num_threads())
    if bad:
        return topk_lse_reference(z, k)
    return vals.view(*lead, k), idx.view(*lead, k), lse.view(lead)


def topk_lse_reference(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain-torch `topk_lse`: `topk` (torch.topk where C does not run) and torch.logsumexp."""
    vals, idx = topk(z, min(k, z.shape[-1]))
    return vals, idx, torch.logsumexp(z.float(), dim=-1)
