"""One decoder layer over n rows in one call (kernels/cpu.c `sv_layer` in bf16; kernels/cpu_avx2.c
`sv2_layer_f32` in fp32 on the AVX2 build), beside its plain-torch reference.

    pack_layer(...)                     -> LayerKernel: a decoder layer's weights for the fused call
    layer(x, spec, ...)                 norms, RoPE, cache write, attention, residuals, gated MLP
    layer_reference(x, spec, ...)       the same in plain torch ops

Around its linears and attention a decoder layer has ~25 small torch ops (norms, RoPE, casts, the cache write,
residual adds, the gated activation), a large share of a decode forward once the linears and the attention run
in C. `layer` runs them in one call, rounding to bf16 wherever the torch path holds a bf16 tensor (a product or
sum of two bf16 values is exact in fp32, so those roundings give torch's bits; the norms' sums of squares and the
activations' exp / tanh run in another fixed order, so they agree to rounding). Everything in it is per row, so
the linears' and the attention's row invariance carries over. The EAGLE heads' layer uses it too. The fp32 layer
is the same in fp32 around the AVX2 linears and attention (so it runs where `isa()` is "avx2"; an fp32 model on an
AVX-512 CPU keeps the packed linears and the C attention with torch's small ops between them).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specvocab.kernels.cpu import builds
from specvocab.kernels.cpu.compiler import CpuKernelError
from specvocab.kernels.cpu.ops.attention import attention_reference, tail_blocks, takes_head_dim
from specvocab.kernels.cpu.ops.linear import PackedLinear, linear_reference, pack


class _LayerSpec(ctypes.Structure):                 # kernels/cpu.c `sv_layer_t`, field for field
    _fields_ = ([(f, ctypes.c_int) for f in ("d", "H", "kvh", "hd", "I", "din", "gemma_norm", "act")]
                + [("eps", ctypes.c_float)]
                + [(f, ctypes.c_void_p) for f in ("in_norm", "q_norm", "k_norm", "post_attn_norm", "pre_mlp_norm",
                                                  "post_mlp_norm", "qkv", "o", "gate_up", "down", "qkv_bias")])


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass
class LayerKernel:
    """One decoder layer's weights for `layer` (built by `pack_layer`): the four linears packed, the norm
    weights in fp32 (as the norm multiplies them: Llama's bf16 weight exactly, Gemma's 1 + weight), and the
    C struct that points at them (the tensors here keep that memory alive)."""
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    norms: dict[str, torch.Tensor | None]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    gemma_norm: bool
    act: str
    spec: _LayerSpec

    @property
    def hidden(self) -> int:
        return self.o.out_features


def _norm32(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.detach().float().contiguous()


def pack_layer(qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, o_w: torch.Tensor, gate_up_w: torch.Tensor,
               down_w: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int, eps: float,
               in_norm: torch.Tensor | None, pre_mlp_norm: torch.Tensor, post_attn_norm: torch.Tensor | None = None,
               post_mlp_norm: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, gemma_norm: bool = False, act: str = "silu") -> LayerKernel:
    """A decoder layer for `layer`: qkv_w [(H + 2 kvh) hd, din] (q, k, v rows fused), o_w [d, H hd],
    gate_up_w [2 I, d] (gate rows, then up), down_w [I, d]; norms as the norm multiplies (`gemma_norm`: the fp32
    1 + weight and round(h w); else the model's weight and round(w round(h))); in_norm None: the attention input
    is x itself (EAGLE-1's layer) or given to `layer` (EAGLE-3's midlayer). act: "silu" or "gelu_tanh"."""
    if act not in ACTIVATIONS:
        raise CpuKernelError(f"act={act!r}: the fused layer computes {sorted(ACTIVATIONS)}")
    if qkv_w.dtype == torch.float32:                  # kernels/cpu_avx2.c `sv2_layer_f32`
        if builds.isa() != "avx2" or builds.attention_f32_reason(head_dim) is not None or heads % kv_heads:
            raise CpuKernelError(f"the fp32 fused layer runs on the AVX2 build (kernels.cpu.isa() {builds.isa()!r}), "
                                 f"with head_dim a multiple of 8 and whole KV groups; got head_dim {head_dim}, "
                                 f"{heads} heads over {kv_heads}")
    elif not takes_head_dim(head_dim) or heads % kv_heads:
        raise CpuKernelError(f"the fused layer takes head_dim a multiple of 16 up to 256 and whole KV groups; got "
                             f"head_dim {head_dim}, {heads} heads over {kv_heads}")
    if (q_norm is None) != (k_norm is None):
        raise CpuKernelError("q_norm and k_norm come together (qwen3 / gemma3) or not at all")
    lin = {"qkv": pack(qkv_w, qkv_b), "o": pack(o_w), "gate_up": pack(gate_up_w), "down": pack(down_w)}
    d, inter = o_w.shape[0], down_w.shape[1]
    if lin["qkv"].out_features != (heads + 2 * kv_heads) * head_dim or gate_up_w.shape[0] != 2 * inter:
        raise CpuKernelError("the fused layer's weights do not match its heads / MLP width: qkv_w must be "
                             "[(H + 2 kvh) hd, din], gate_up_w [2 I, d], down_w [d, I]")
    norms = {k: _norm32(v) for k, v in dict(in_norm=in_norm, q_norm=q_norm, k_norm=k_norm,
                                               post_attn_norm=post_attn_norm, pre_mlp_norm=pre_mlp_norm,
                                               post_mlp_norm=post_mlp_norm).items()}
    ptr = {k: (None if v is None else v.data_ptr()) for k, v in norms.items()}
    spec = _LayerSpec(d=d, H=heads, kvh=kv_heads, hd=head_dim, I=inter, din=qkv_w.shape[1],
                      gemma_norm=int(gemma_norm), act=ACTIVATIONS[act], eps=float(eps), **ptr,
                      qkv=lin["qkv"].packed.data_ptr(), o=lin["o"].packed.data_ptr(),
                      gate_up=lin["gate_up"].packed.data_ptr(), down=lin["down"].packed.data_ptr(),
                      qkv_bias=None if lin["qkv"].bias is None else lin["qkv"].bias.data_ptr())
    return LayerKernel(**lin, norms=norms, heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=float(eps),
                       gemma_norm=gemma_norm, act=act, spec=spec)


_local = threading.local()          # per thread: the fused layer's scratch, reused by every call


def _scratch(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least nbytes for the layer's intermediates, one per thread and kept (a forward calls
    the layer 30 times with the same sizes; the C side only writes it before reading it)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as contiguous `dtype`, without a copy where it already is (a bool mask is viewed as uint8)."""
    if t.dtype == torch.bool and dtype == torch.uint8 and t.is_contiguous():
        return t.view(torch.uint8)
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def layer(x: torch.Tensor, spec: LayerKernel, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
          vc: torch.Tensor, slots: torch.Tensor, committed_blocks: int, positions: torch.Tensor, idx: torch.Tensor,
          ok: torch.Tensor, window: int | None, scale: float, attn_in: torch.Tensor | None = None,
          threads: int | None = None) -> torch.Tensor:
    """One decoder layer over x [n, d] bf16 in one call (an fp32 layer packed on the AVX2 build: all in fp32,
    caches fp32 too); returns the new residual stream [n, d] (a new tensor). cos, sin [n, hd]: the rows' RoPE;
    kc, vc [kvh, capacity, hd]: the layer's cache, row r's key and value written to slot slots[r];
    committed_blocks, positions, idx, ok, window, scale: the attention's inputs, as `attention` takes them;
    attn_in [n, din]: the attention's input where the layer has no input norm of its own (EAGLE-3's midlayer),
    else None."""
    n, d = x.shape
    dt = spec.qkv.packed.dtype                        # bf16 (kernels/cpu.c), or fp32 (kernels/cpu_avx2.c)
    name = "bf16" if dt == torch.bfloat16 else "fp32"
    if x.dtype != dt or d != spec.hidden:
        raise CpuKernelError(f"this fused layer takes x [n, {spec.hidden}] {name}; got {tuple(x.shape)} {x.dtype}")
    if not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == dt == vc.dtype):
        raise CpuKernelError(f"the fused layer writes the cache in place: give contiguous {name} [kvh, capacity, hd]")
    if attn_in is not None and attn_in.shape != (n, spec.qkv.in_features):
        raise CpuKernelError(f"attn_in must be [n, {spec.qkv.in_features}]; got {tuple(attn_in.shape)}")
    out = x.clone(memory_format=torch.contiguous_format)
    if n == 0:
        return out
    tb = tail_blocks(idx, ok, n)
    lib = builds.load(spec.qkv.isa)                   # the library its linears were packed for
    ops = builds.LIBRARIES[spec.qkv.isa].ops
    kind = "bf16" if dt == torch.bfloat16 else "f32"
    scratch_of, run = getattr(lib, ops[f"layer_scratch_{kind}"]), getattr(lib, ops[f"layer_{kind}"])
    scratch = _scratch(scratch_of(ctypes.byref(spec.spec), n))
    # the same inputs come to every layer of a forward: each conversion is a no-op unless needed
    keep = [_as(cos, dt), _as(sin, dt), _as(slots, torch.int64),
            _as(positions, torch.int64), _as(idx, torch.int64), _as(ok, torch.uint8)]
    a_in = None if attn_in is None else _as(attn_in, dt)
    run(ctypes.byref(spec.spec), out.data_ptr(), None if a_in is None else a_in.data_ptr(),
        keep[0].data_ptr(), keep[1].data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1],
        keep[2].data_ptr(), committed_blocks, tb, keep[3].data_ptr(), keep[4].data_ptr(), keep[5].data_ptr(),
        int(window or 0), float(scale), scratch.data_ptr(), n, threads or torch.get_num_threads())
    return out


def _rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * w).to(x.dtype) if gemma else (w.to(x.dtype) * h.to(x.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def layer_reference(x: torch.Tensor, spec: LayerKernel, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                    vc: torch.Tensor, slots: torch.Tensor, committed_blocks: int, positions: torch.Tensor,
                    idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
                    attn_in: torch.Tensor | None = None) -> torch.Tensor:
    """`layer` in plain torch ops, each rounded to bf16 where the C code rounds (engine.native's `_layer` with
    the kernel's linears and attention is the same computation spread over ~25 calls)."""
    n = x.shape[0]
    H, kvh, hd = spec.heads, spec.kv_heads, spec.head_dim
    nm, eps, g = spec.norms, spec.eps, spec.gemma_norm
    lin = {k: getattr(spec, k) for k in ("qkv", "o", "gate_up", "down")}

    def linear(name, h):
        p = lin[name]
        chunk = p.packed.shape[-1]                    # 32 (bf16), 16 or 8 (fp32 on AVX-512 / AVX2)
        w = p.packed.transpose(1, 2).reshape(-1, p.packed.shape[1] * chunk)[:p.out_features, :p.in_features]
        return linear_reference(h, w, p.bias, out_dtype=x.dtype)

    h = attn_in if attn_in is not None else (_rmsnorm_ref(x, nm["in_norm"], eps, g) if nm["in_norm"] is not None
                                             else x)
    qk, v = linear("qkv", h).split([(H + kvh) * hd, kvh * hd], dim=-1)
    qk, v = qk.reshape(n, H + kvh, hd), v.reshape(n, kvh, hd)
    if nm["q_norm"] is not None:
        qk = torch.cat([_rmsnorm_ref(qk[:, :H], nm["q_norm"], eps, g), _rmsnorm_ref(qk[:, H:], nm["k_norm"], eps, g)],
                       dim=1)
    c, s = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    qk = qk * c + _rotate_half(qk) * s
    q, k = qk[:, :H], qk[:, H:]
    kc[:, slots] = k.transpose(0, 1)
    vc[:, slots] = v.transpose(0, 1)
    a = attention_reference(q, kc, vc, committed_blocks, positions, idx, ok, window, scale).to(x.dtype)
    a = linear("o", a.reshape(n, H * hd))
    if nm["post_attn_norm"] is not None:
        a = _rmsnorm_ref(a, nm["post_attn_norm"], eps, g)
    x = x + a
    gate, up = linear("gate_up", _rmsnorm_ref(x, nm["pre_mlp_norm"], eps, g)).chunk(2, dim=-1)
    act = F.silu(gate) if spec.act == "silu" else F.gelu(gate, approximate="tanh")
    h = linear("down", act * up)
    if nm["post_mlp_norm"] is not None:
        h = _rmsnorm_ref(h, nm["post_mlp_norm"], eps, g)
    return x + h
