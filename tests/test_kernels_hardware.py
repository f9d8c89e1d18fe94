"""kernels.hardware: one place decides device, dtype, compiled vs interpreted Triton, and the backend."""

import pytest
import torch

from kernels import gather, hardware
from kernels.hardware import KernelBackendError, triton_enabled, use_triton, using_triton


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(hardware.ENV_VAR, raising=False)
    previous = use_triton(None)
    yield
    use_triton(previous)


def test_device_and_dtype_follow_cuda():
    assert hardware.DEVICE.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert hardware.DEFAULT_DTYPE == (torch.float16 if torch.cuda.is_available() else torch.float32)
    if not torch.cuda.is_available():
        assert hardware.triton_interpreted(), "without CUDA the Triton kernels must run interpreted"


def test_default_backend_is_torch_on_cpu_and_triton_on_cuda():
    assert triton_enabled() == torch.cuda.is_available()


def test_env_variable_selects_backend(monkeypatch):
    monkeypatch.setenv(hardware.ENV_VAR, "triton")
    assert triton_enabled()
    monkeypatch.setenv(hardware.ENV_VAR, "TORCH")
    assert not triton_enabled()
    monkeypatch.setenv(hardware.ENV_VAR, "cuda")
    with pytest.raises(KernelBackendError, match="triton.*torch"):
        triton_enabled()


def test_override_beats_env_and_context_restores(monkeypatch):
    monkeypatch.setenv(hardware.ENV_VAR, "torch")
    with using_triton(True):
        assert triton_enabled()
        with using_triton(False):
            assert not triton_enabled()
        assert triton_enabled()
    assert not triton_enabled()
    with pytest.raises(TypeError):
        use_triton("yes")


def test_dispatch_calls_the_chosen_implementation(monkeypatch):
    calls = []
    monkeypatch.setattr(gather, "gather_rows_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(gather, "gather_rows_ref", lambda *a, **k: calls.append("torch"))
    args = (torch.zeros(4, 3), torch.zeros(2, 3), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with using_triton(True):
        gather.gather_rows(*args)
    with using_triton(False):
        gather.gather_rows(*args)
    assert calls == ["triton", "torch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_cpu_tensor_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelBackendError, match="TRITON_INTERPRET=1"):
        hardware.check_triton_can_run(torch.zeros(1))


def test_describe_names_device_and_backend():
    line = hardware.describe()
    assert hardware.DEVICE.type in line and ("torch reference" in line) != triton_enabled()


def test_transformers_does_not_mistake_us_for_the_kernel_hub():
    """Our top-level `kernels` shares its name with Hugging Face's kernel hub (shared/FACTS.md)."""
    import kernels
    from transformers.utils.import_utils import is_kernels_available

    assert kernels.__version__ == "0.1.0"
    assert not is_kernels_available()
