"""The LM-head cross-entropy both heads train with, chunked so a large vocabulary never materialises all its
logits (the fused linear + cross-entropy of Liger-Kernel), its plain reference, and top-1 agreement."""

from __future__ import annotations

import torch


def chunked_head_ce(h: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, target_p: torch.Tensor,
                    chunk: int, softcap: float | None = None, with_grad: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean over rows of the cross-entropy -sum_j p_j log softmax(W h)[id_j], and (with_grad) its gradient
    w.r.t. h, computed chunk by chunk so that at most [chunk, V] logits exist at once. Returns (loss, dloss/dh)."""
    grad = torch.zeros_like(h) if with_grad else None
    total = torch.zeros((), dtype=torch.float32)
    n = h.shape[0]
    for a in range(0, n, chunk):
        with torch.enable_grad() if with_grad else torch.no_grad():
            hc = h[a:a + chunk].detach().requires_grad_(with_grad)
            logits = (hc.to(weight.dtype) @ weight.T).float()
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            logp = torch.log_softmax(logits, dim=-1)
            loss = -(target_p[a:a + chunk] * logp.gather(1, target_ids[a:a + chunk])).sum() / n
            if with_grad:
                loss.backward()
                grad[a:a + chunk] = hc.grad
        total += loss.detach()
    return total, grad


def reference_head_ce(h: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, target_p: torch.Tensor,
                      softcap: float | None = None) -> torch.Tensor:
    """The plain reference of `chunked_head_ce` (all logits at once, autograd through everything)."""
    logits = (h @ weight.T).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return -(target_p * torch.log_softmax(logits, dim=-1).gather(1, target_ids)).sum() / h.shape[0]


def top1_agreement(h: torch.Tensor, weight: torch.Tensor, target_top1: torch.Tensor, chunk: int) -> float:
    """Share of rows h [n, d] whose argmax over `weight` [V, d] is `target_top1` [n] (chunk rows at once)."""
    hits = sum(int(((h[a:a + chunk].to(weight.dtype) @ weight.T).argmax(-1) == target_top1[a:a + chunk]).sum())
               for a in range(0, h.shape[0], chunk))
    return hits / max(h.shape[0], 1)


