"""Test-wide setup. Hardware is decided in `kernels.hardware`; on a machine without CUDA the Triton
kernels run under the interpreter, which must be switched on before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
