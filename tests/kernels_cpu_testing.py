"""Shared pieces of the CPU kernel suites (tests/test_kernels_cpu_*.py): which builds an op is tested on, the
switch to one build (a skip naming the ISA this CPU lacks), and the attention and layer cases."""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu

NEEDS = {"amx-bf16": "AMX-BF16", "avx512-bf16": "AVX512-BF16", "avx512": "AVX-512F/BW/VL", "avx2": "AVX2 + FMA"}


def builds_with(op: str) -> list[str]:
    """The builds of kernels.cpu.CHAIN that hold `op`, one per library (the least demanding: `avx512` for the
    fp32 ops AVX-512 CPUs run with or without bf16), and the bf16 builds not provided yet (they skip until
    their library lands)."""
    last: dict[str, str] = {}
    for b in cpu.CHAIN:
        if b.has(op) or (b.library is None and b.bf16 == op.endswith("_bf16")):
            last[b.library or b.name] = b.name
    return list(last.values())


def use_build(monkeypatch, build: str, op: str) -> None:
    """Run `op` on `build` for the rest of the test (`$SPECVOCAB_CPU_ISA` starts the chain there), or skip naming
    what this CPU lacks for it (or why its library failed: a failure under `$SPECVOCAB_REQUIRE_KERNELS=1`)."""
    monkeypatch.setenv(cpu.ISA_ENV, build)
    b = cpu.provider(op)
    if b is None or b.name != build:
        why = cpu.builds.refusal(next(c for c in cpu.CHAIN if c.name == build))
        pytest.skip(f"needs {NEEDS[build]} (this CPU: {cpu.cpu_isa()}): {why}")


def weights(N, K, seed=0, bias=True, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return w, b


def attn_case(n=5, H=9, kvh=3, hd=64, cap=300, P=70, seed=0, dtype=torch.bfloat16):
    """q [n, H, hd], a cache [kvh, cap, hd] (bf16 values, in `dtype`), P // BLOCK committed blocks, each row's
    position, tail slots and a random ancestry mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, hd, generator=g).bfloat16().to(dtype)
    kc = torch.randn(kvh, cap, hd, generator=g).bfloat16().to(dtype)
    vc = torch.randn(kvh, cap, hd, generator=g).bfloat16().to(dtype)
    pos = P + torch.randint(0, 8, (n,), generator=g)
    idx = torch.randint(0, cap, (n, 2 * cpu.BLOCK), generator=g)
    ok = torch.rand(n, 2 * cpu.BLOCK, generator=g) > 0.3
    return q, kc, vc, P // cpu.BLOCK, pos, idx, ok


LAYERS = {   # (family-like options) -> what they exercise
    "llama": dict(),
    "qwen": dict(bias=True, qk_norm=True),
    "gemma": dict(gemma=True, act="gelu_tanh", qk_norm=True, H=4, kvh=1, hd=64),
    "eagle1": dict(in_norm=False),                  # EAGLE-1/2's layer: no input norm
    "eagle3": dict(in_norm=False, din=192),         # EAGLE-3's midlayer: a 2 d attention input given
    "odd": dict(d=100, I=200),                      # widths that are not a multiple of 16
}


def layer_case(d=96, H=6, kvh=2, hd=32, I=160, gemma=False, act="silu", qk_norm=False, in_norm=True, bias=False,
               din=None, n=6, P=45, seed=0, dtype=torch.bfloat16):
    """A packed layer (`cpu.pack_layer`), x [n, d] and the layer's other inputs: n causal rows after P committed
    ones."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (0.3 * torch.randn(*s, generator=g)).to(dtype)                               # noqa: E731
    if gemma:                                      # norm weights as the norm multiplies them (pack_layer)
        nw = lambda k: 0.2 * torch.randn(k, generator=g)                                      # noqa: E731
    else:
        nw = lambda k: (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)                     # noqa: E731
    spec = cpu.pack_layer(r((H + 2 * kvh) * hd, din or d), r((H + 2 * kvh) * hd) if bias else None, r(d, H * hd),
                          r(2 * I, d), r(d, I), heads=H, kv_heads=kvh, head_dim=hd, eps=1e-6,
                          in_norm=nw(d) + gemma if in_norm else None, pre_mlp_norm=nw(d) + gemma,
                          post_attn_norm=nw(d) + 1 if gemma else None, post_mlp_norm=nw(d) + 1 if gemma else None,
                          q_norm=nw(hd) + gemma if qk_norm else None, k_norm=nw(hd) + gemma if qk_norm else None,
                          gemma_norm=gemma, act=act)
    cap, B = 128, cpu.BLOCK
    kc, vc = r(kvh, cap, hd) / 0.3, r(kvh, cap, hd) / 0.3
    x = torch.randn(n, d, generator=g).to(dtype)
    pos = torch.arange(P, P + n)
    angle = pos[:, None].float() * (1e-2 ** (torch.arange(hd // 2) / (hd // 2)))[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    base = (P // B) * B                           # a causal run of n rows after P committed ones
    logical = base + torch.arange(2 * B)
    ok = logical[None, :] <= pos[:, None]
    idx = torch.where(ok, logical[None, :], 0)
    attn_in = torch.randn(n, din, generator=g).to(dtype) if din else None
    args = (cos, sin, kc, vc, pos.clone(), P // B, pos, idx, ok, None, hd ** -0.5)
    return spec, x, args, attn_in


def run_layer(fn, spec, x, args, attn_in, rows=None, threads=None):
    """fn (`cpu.layer` or `cpu.layer_reference`) over `rows` of the case, on copies of its cache: (out, kc, vc)."""
    cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale = args
    kc, vc = kc.clone(), vc.clone()
    sel = slice(None) if rows is None else rows
    kw = {} if threads is None else dict(threads=threads)
    out = fn(x[sel], spec, cos[sel], sin[sel], kc, vc, slots[sel], b0, pos[sel], idx[sel], ok[sel], window, scale,
             attn_in=None if attn_in is None else attn_in[sel], **kw)
    return out, kc, vc
