"""The native decode's CPU kernels (C, built on first use), each op beside its plain-torch reference, and the
choice of build: what engine.native, the drafters and the heads import as `kernels.cpu`.

    builds.py        the ISA chain amx-bf16 -> avx512-bf16 -> avx512 -> avx2 -> torch, chosen at run time by what
                     the CPU has, `$SPECVOCAB_CPU_ISA` overriding it; every availability question (one line each)
    compiler.py      the build system: a C source compiled once per machine into `$SPECVOCAB_CACHE/kernels`
    tiles.py         Linux's AMX tile-data permission, asked before an AMX build loads
    ops/linear.py    pack, PackedLinear, rows_linear                   reference: linear_reference
    ops/topk.py      topk, argmax, topk_lse                             reference: topk_lse_reference, torch.topk
    ops/attention.py attention (bf16), attention_f32                   reference: attention_reference
    ops/layer.py     pack_layer, layer: a decoder layer in one call    reference: layer_reference
    ops/unispec_tree.py  UniSpec's draft tree in one call               reference: engine.drafters.unispec
    ops/window_step.py   MicroSpec's window step in one loop            reference: kernels.window._window_step_torch
    route.py         route_linears: a module's own small-row linears on the kernel (the module patcher)

The C sources are kernels/cpu.c (AVX-512; bf16 with AVX512-BF16), kernels/cpu_avx2.c (fp32, AVX2 + FMA) and
kernels/cpu_portable.c (no vector code, #included by both). Every kernel gives a row the same bits whatever the
other rows, the row count or the thread count (threads split output blocks or whole rows, never a sum): what
fixed-shape verification needs (engine.native rule 1; tests/test_kernels_cpu*.py check each op and build).
"""

from specvocab.kernels.cpu import builds, compiler, tiles
from specvocab.kernels.cpu.builds import (
    AMX_FLAGS, AVX2_FLAGS, BUILD_FLAGS, CHAIN, ISAS, LIBRARIES, PORTABLE, REQUIRE_ENV, REQUIRED_FLAGS, SOURCE,
    SOURCE_AVX2, Build, attention_f32_reason, available, available_fp32, available_portable, broken, chain, cpu_isa,
    decode_reason, isa, linear_reason, provider, reason, require_kernels)
from specvocab.kernels.cpu.compiler import CC_TIMEOUT_ENV, CpuKernelError, private_dir
from specvocab.kernels.cpu.ops.attention import (
    BLOCK, attention, attention_f32, attention_reference, tail_blocks, takes_head_dim)
from specvocab.kernels.cpu.ops.layer import ACTIVATIONS, LayerKernel, layer, layer_reference, pack_layer
from specvocab.kernels.cpu.ops.linear import (
    SMALL_ROWS, PackedLinear, block_outputs, linear_reference, pack, rows_linear, rows_usable)
from specvocab.kernels.cpu.ops.topk import TOPK_MAX, argmax, topk, topk_lse, topk_lse_reference
from specvocab.kernels.cpu.ops.unispec_tree import unispec_tree
from specvocab.kernels.cpu.ops.window_step import window_step
from specvocab.kernels.cpu.route import route_linears
from specvocab.kernels.cpu.tiles import request_tiles
from specvocab.kernels.hardware import ISA_ENV

__all__ = [
    "ACTIVATIONS", "AMX_FLAGS", "AVX2_FLAGS", "BLOCK", "BUILD_FLAGS", "CC_TIMEOUT_ENV", "CHAIN", "ISAS", "ISA_ENV",
    "LIBRARIES", "PORTABLE", "REQUIRED_FLAGS", "REQUIRE_ENV", "SMALL_ROWS", "SOURCE", "SOURCE_AVX2", "TOPK_MAX",
    "Build", "CpuKernelError", "LayerKernel", "PackedLinear", "argmax", "attention", "attention_f32",
    "attention_f32_reason", "attention_reference", "available", "available_fp32", "available_portable",
    "block_outputs", "broken", "builds", "chain", "compiler", "cpu_isa", "decode_reason", "isa", "layer",
    "layer_reference", "linear_reason", "linear_reference", "pack", "pack_layer", "private_dir", "provider",
    "reason", "request_tiles", "require_kernels", "route_linears", "rows_linear", "rows_usable", "takes_head_dim",
    "tail_blocks", "tiles", "topk", "topk_lse", "topk_lse_reference", "unispec_tree", "window_step",
]
