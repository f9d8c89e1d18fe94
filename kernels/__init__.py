"""MicroSpec's device side (Triton kernels) and the native decode's CPU kernels, each beside its plain-torch
reference.

    kernels.hardware  device, dtype, compiled vs interpreted Triton, torch-or-Triton switch (import first)
    kernels.gather    gather_rows(weight, packed, slots, tokens, count)   packed[slots[i]] = weight[tokens[i]]
    kernels.head      packed_head(h, packed, tok_of_slot), indexed_head(h, weight, idx)   fp32 logits
    kernels.window    WindowState, window_init, window_step (Eq. 4 / fifo_unique), unique_new
    kernels.streams   PackedLMHead: window step + gather on a copy stream + masked packed head
    kernels.bench     python -m specvocab.kernels.bench [--json] [--quick]
    kernels.cpu       the native decode's CPU kernels (C, built on first use; kernels/cpu/ops/: one file per op
                      beside its reference) and the ISA chain amx-bf16 -> avx512-bf16 -> avx512 -> avx2 -> torch

Importing `specvocab.kernels` itself stays light (no torch, no triton).
"""
