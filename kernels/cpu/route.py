"""The module patcher: a module's own small-row linears (a drafter's EAGLE head, its fc) on the packed linear.

    route_linears(module, max_rows)   every bf16 / fp32 nn.Linear inside `module` through `pack` for inputs of up
                                      to max_rows rows; returns how many it routed
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specvocab.kernels.cpu import builds
from specvocab.kernels.cpu.ops.linear import SMALL_ROWS, pack


def _stamp(t: torch.Tensor) -> tuple:
    """Where a tensor's data is and how often it was changed in place (inference tensors keep no count: they
    cannot be changed outside inference mode, and nothing trains them)."""
    return t.data_ptr(), None if t.is_inference() else t._version


def route_linears(module: torch.nn.Module, max_rows: int = SMALL_ROWS) -> int:
    """Run every bf16 `nn.Linear` inside `module` (on a CPU) through the small-row kernel for inputs of up to
    `max_rows` rows (`F.linear` above: oneDNN's blocked GEMM is as fast there). Each linear keeps its parameters
    (state_dict, digests and training see nothing new) and gets a packed copy of its weight; its `forward` is
    replaced on the instance. For drafters' own layers (an EAGLE head's decoder layer and fc: ~1.5 ms per call
    on oneDNN at 1-8 rows on SmolLM2's sizes, more than their weights take to read). Returns how many linears
    it routed (0 where the kernel does not run here). bf16 linears on the bf16 kernel, fp32 ones on the fp32 kernel
    of the build `isa()` picks (AVX-512 or AVX2: a drafter in fp32, the default on a CPU without bf16 dot products;
    its fc and decoder layer took 5.4 of its 9.0 ms a step on F.linear, SmolLM2 under the AVX2 build)."""
    routed = 0
    for lin in module.modules():
        if not isinstance(lin, torch.nn.Linear) or builds.linear_reason(lin.weight.device, lin.weight.dtype):
            continue
        state: dict = {}

        def forward(x, lin=lin, state=state):
            w, b = lin.weight, lin.bias
            if (x.dtype != w.dtype or x[..., 0].numel() > max_rows or w.dtype not in (torch.bfloat16, torch.float32)
                    or w.device.type != "cpu" or torch.is_grad_enabled() and w.requires_grad):
                return F.linear(x, w, b)                         # large, other dtype/device, or being trained
            key = (_stamp(w), None if b is None else _stamp(b))
            if state.get("key") != key:                          # packed once; again if the weights changed
                state["packed"] = pack(w.detach(), None if b is None else b.detach())
                state["key"] = key
            return state["packed"](x)
        lin.forward = forward
        routed += 1
    return routed
