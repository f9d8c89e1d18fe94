"""The small-row linear: y = x @ W.T (+ b) for 1-32 rows, with the weight packed once (kernels/cpu.c
`sv_linear_bf16` / `sv_linear_f32`, kernels/cpu_avx2.c `sv2_linear_f32`) or read where it lies
(`sv_linear_rows_bf16`), beside its reference.

    pack(weight, bias)                  -> PackedLinear (the weight re-laid for the kernel, once; bf16 or fp32)
    PackedLinear(x, out_dtype)          y [M, N]: bf16 (VDPBF16PS) or fp32 (FMA chains) by the weight's dtype
    rows_linear(x, weight, out_dtype)   the same product over a row-major weight, as it lies (a buffer rewritten
                                        in place: MicroSpec's window head)
    linear_reference(x, weight, bias)   the same product in plain torch (fp32 accumulation, then rounded)

Why it exists. A decode forward multiplies 1-16 rows by every weight of the model: the work is reading the
weights (N x K x 2 bytes per bf16 linear, once per call, against M x K inputs and M x N outputs), so its limit is
memory bandwidth, of which oneDNN's bf16 GEMM (what `F.linear` calls on a CPU) reaches about a third at these
row counts. The kernel streams a weight layout packed for it ([N/4][K/32][4][32]: four output rows' chunks side
by side, one sequential pass), multiplies with VDPBF16PS, prefetches into L2 ahead of the stream over every row
tile's pass of a block, and reduces each tile with one transposing reduction. `python -m
specvocab.engine.jobs.forward --backends native,native-blas` measures both in one run (PERFORMANCE.md, section 1).

Row invariance by construction (what fixed-shape verification needs, engine.native rule 1): each output is
accumulated in its own register over K in order, then reduced by one fixed shuffle tree, so a row's bits do not
depend on M, on the other rows or on the thread count (threads split the output blocks, never K). Its bits
differ from oneDNN's (another order of the same sum); both stay within a bf16 rounding of the fp32 product.

fp32. A model kept in fp32 (the default on a CPU without bf16 dot products) runs `sv_linear_f32`: the bf16
kernel's tiles, reduction tree and prefetch schedule, one FMA chain per output over 16-wide chunks (AVX-512F/BW/VL
only). On a CPU with AVX2 + FMA but no AVX-512 (most laptops and desktops), `sv2_linear_f32`: the same design at
8 lanes (packed [N/4][K/8][4][8], tiles of 3, 2 and 1 rows for AVX2's 16 registers). oneDNN's fp32 GEMM gives rows
1-3 of a product other bits than inside a larger one, so the exact decode without the kernel pads every step to
4 rows; with it a step runs exactly its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specvocab.kernels.cpu import builds
from specvocab.kernels.cpu.compiler import CpuKernelError

CHUNK = 32                  # K elements per VDPBF16PS (the bf16 layout)
CHUNK_F32 = 16              # K elements per AVX-512 fp32 FMA (AVX2: the library's `sv2_chunk`)
SMALL_ROWS = 32             # rows up to which the small-row products beat oneDNN's blocked GEMM: `rows_linear`,
                            # `route_linears`, and engine.native's forwards outside exact mode


def block_outputs() -> int:
    """Output rows per packed block of the AVX-512 library (NB in kernels/cpu.c)."""
    lib = builds.load("avx512")
    if lib is None:
        raise CpuKernelError(f"specvocab.kernels.cpu is not available here: {builds.library_reason('avx512')}")
    return lib.sv_block_outputs()


@dataclass
class PackedLinear:
    """One weight [N, K] (and bias [N]) laid out for the kernel: packed [ceil(N/NB), ceil(K/32), NB, 32] bf16,
    zero-padded; bias in fp32. Calling it runs the kernel on x [M, K] bf16. An fp32 weight is packed
    [ceil(N/NB), ceil(K/16), NB, 16] fp32 and takes fp32 rows, out in fp32 (`sv_linear_f32`); with `isa` "avx2",
    [ceil(N/NB), ceil(K/8), NB, 8] for kernels/cpu_avx2.c's `sv2_linear_f32`. `isa`: the library it was packed
    for (kernels.cpu.builds.LIBRARIES)."""
    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    isa: str = "avx512"
    fn: object = field(default=None, repr=False, compare=False)     # the C function, found on the first call

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 threads: int | None = None) -> torch.Tensor:
        fp32 = self.packed.dtype == torch.float32
        if x.dtype != self.packed.dtype or x.device.type != "cpu":
            raise CpuKernelError(f"this weight was packed in {self.packed.dtype}: it multiplies CPU rows of that "
                                 f"dtype; got {x.dtype} on {x.device}")
        if fp32:
            out_dtype = torch.float32
        elif out_dtype not in (torch.bfloat16, torch.float32):
            raise CpuKernelError(f"out_dtype must be bf16 or fp32, not {out_dtype}")
        lead = x.shape[:-1]
        if x.shape[-1] != self.in_features:
            raise CpuKernelError(f"x has {x.shape[-1]} features; this weight takes {self.in_features}")
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=out_dtype)
        if x2.shape[0]:
            fn = self.fn
            if fn is None:
                op = builds.LIBRARIES[self.isa].ops["linear_f32" if fp32 else "linear_bf16"]
                fn = self.fn = getattr(builds.load(self.isa), op)
            bias = None if self.bias is None else self.bias.data_ptr()
            dims = (x2.shape[0], self.out_features, self.in_features, threads or torch.get_num_threads())
            if fp32:
                fn(x2.data_ptr(), self.packed.data_ptr(), bias, out.data_ptr(), *dims)
            else:
                fn(x2.data_ptr(), self.packed.data_ptr(), bias, out.data_ptr(), int(out_dtype == torch.float32), *dims)
        return out.view(*lead, self.out_features)


@torch.no_grad()
def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """The kernel's layout of `weight` [N, K] (bf16 or fp32, CPU): a new tensor, the original is untouched. It is
    packed for the library of the build that runs the weight's dtype here (`builds.provider`)."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu" or weight.dim() != 2:
        raise CpuKernelError(f"pack takes a 2-D bf16 or fp32 CPU weight; got {tuple(weight.shape)} {weight.dtype} "
                             f"on {weight.device}")
    N, K = weight.shape
    op = "linear_f32" if weight.dtype == torch.float32 else "linear_bf16"
    b = builds.provider(op)
    if b is None:
        raise CpuKernelError(f"the {op.removeprefix('linear_')} linear kernel of specvocab.kernels.cpu is not "
                             f"available here: {builds.why_not(op)}")
    lib = builds.load(b.library)
    nb = lib.sv2_block_outputs() if b.library == "avx2" else lib.sv_block_outputs()
    chunk = lib.sv2_chunk() if b.library == "avx2" else (CHUNK if weight.dtype == torch.bfloat16 else CHUNK_F32)
    Np, Kp = -(-N // nb) * nb, -(-K // chunk) * chunk
    w = torch.zeros(Np, Kp, dtype=weight.dtype)
    w[:N, :K] = weight
    packed = w.view(Np // nb, nb, Kp // chunk, chunk).transpose(1, 2).contiguous()
    bias32 = None if bias is None else bias.detach().float().contiguous()
    return PackedLinear(packed=packed, bias=bias32, out_features=N, in_features=K, isa=b.library)


def rows_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rows_linear` runs this product here: bf16 CPU tensors, a contiguous weight, at most SMALL_ROWS
    rows, and the bf16 kernels built."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and 0 < x[..., 0].numel() <= SMALL_ROWS
            and builds.provider("rows_linear_bf16") is not None)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                threads: int | None = None) -> torch.Tensor:
    """x [.., K] @ weight [N, K].T with the weight read row-major where it lies (kernels/cpu.c
    `sv_linear_rows_bf16`, with the packed linear's L2 prefetch schedule: a window head is read cold after each
    target forward): for weights rewritten in place, which a packed copy would have to follow. fp32 or bf16 out;
    reference `linear_reference`."""
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]):
        raise CpuKernelError(f"rows_linear multiplies bf16 CPU x [.., K] by a bf16 CPU weight [N, K]; got "
                             f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise CpuKernelError(f"out_dtype must be bf16 or fp32, not {out_dtype}")
    lead, (N, K) = x.shape[:-1], weight.shape
    x2, w = x.reshape(-1, K).contiguous(), weight.contiguous()
    out = torch.empty(x2.shape[0], N, dtype=out_dtype)
    if x2.shape[0] and N:
        fn, _ = builds.function("rows_linear_bf16")
        fn(x2.data_ptr(), w.data_ptr(), out.data_ptr(), int(out_dtype == torch.float32), x2.shape[0], N, K,
           threads or torch.get_num_threads())
    return out.view(*lead, N)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain-torch reference: the fp32 product of the inputs, bias added in fp32, then rounded to `out_dtype`
    (the kernels compute the same, summing in another fixed order)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(out_dtype)
