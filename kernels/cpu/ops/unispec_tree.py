"""UniSpec's draft tree in one C call (kernels/cpu_portable.c `sv_unispec_tree`, in either library). Its
reference is the vectorised `engine.drafters.unispec.build_unispec_tree`, which calls this where it runs (CPU
stores, `available_portable()` None); tests/test_drafters_unispec.py compares the two node for node."""

from __future__ import annotations

import torch

from specvocab.kernels.cpu import builds


def unispec_tree(root: int, store_tok: torch.Tensor, store_con: torch.Tensor, cache_tok: torch.Tensor | None,
                 cache_con: torch.Tensor | None, *, k: int, depth: int, r: float, g: int, path: bool,
                 min_score: float, exclude_root: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(tokens [n], parents [n] int64, scores [n] fp32), root first, n <= 1 + g: the same tree, node for node and
    bit for bit, as `engine.drafters.unispec.build_unispec_tree`. store_tok [V, ks] int64 / store_con [V, ks] fp32,
    contiguous; cache [kc] or None. Returns None where the root or a cache token is outside [0, V): the
    reference then names the problem."""
    V, ks = store_tok.shape
    ct = cache_tok.to(torch.int64).contiguous() if cache_tok is not None else None
    cc = cache_con.to(torch.float32).contiguous() if cache_con is not None else None
    tok = torch.empty(1 + g, dtype=torch.int64)
    par = torch.empty(1 + g, dtype=torch.int64)
    score = torch.empty(1 + g, dtype=torch.float32)
    fn, _ = builds.function("unispec_tree")
    n = fn(int(root), store_tok.data_ptr(), store_con.data_ptr(), V, ks, None if ct is None else ct.data_ptr(),
           None if cc is None else cc.data_ptr(), 0 if ct is None else ct.numel(), k, depth, r, g, int(path),
           min_score, int(exclude_root), tok.data_ptr(), par.data_ptr(), score.data_ptr())
    if n < 0:
        return None
    return tok[:n], par[:n], score[:n]
