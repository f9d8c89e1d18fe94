"""specvocab.kernels.hardware: one place decides device, dtype, compiled vs interpreted Triton, and the backend."""

import pytest
import torch

from specvocab.kernels import gather, hardware
from specvocab.kernels.hardware import KernelBackendError, triton_enabled, use_triton, using_triton


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(hardware.ENV_VAR, raising=False)
    previous = use_triton(None)
    yield
    use_triton(previous)


def test_device_and_dtype_follow_the_machine(monkeypatch):
    monkeypatch.delenv(hardware.DTYPE_ENV, raising=False)
    assert hardware.DEVICE.type == ("cuda" if torch.cuda.is_available() else "cpu")
    expect = (torch.float16 if torch.cuda.is_available()
              else torch.bfloat16 if hardware.cpu_has_native_bf16() else torch.float32)
    assert hardware.default_dtype() == expect
    if not torch.cuda.is_available():
        assert hardware.triton_interpreted(), "without CUDA the Triton kernels must run interpreted"


def test_default_dtype_rules():
    # the order: $SPECVOCAB_DTYPE, then CUDA fp16, then bf16 only where the CPU has bf16 dot products
    assert hardware.default_dtype(env="", cuda=True, cpu_bf16=True) == torch.float16
    assert hardware.default_dtype(env="", cuda=False, cpu_bf16=True) == torch.bfloat16
    assert hardware.default_dtype(env="", cuda=False, cpu_bf16=False) == torch.float32
    assert hardware.default_dtype(env="fp32", cuda=True, cpu_bf16=True) == torch.float32
    assert hardware.default_dtype(env=" BF16 ", cuda=False, cpu_bf16=False) == torch.bfloat16
    with pytest.raises(hardware.HardwareError, match="SPECVOCAB_DTYPE='int4'.*bf16"):
        hardware.default_dtype(env="int4")


def test_cpu_bf16_flags_are_read_from_cpuinfo():
    avx = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n"
    no = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512vl\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert hardware.cpu_has_native_bf16(avx) and hardware.cpu_has_native_bf16(arm)
    assert not hardware.cpu_has_native_bf16(no)
    # a flag's name inside another word does not count (avx512_bf16x is not a flag we know; "bf16" must be
    # a whole flag, not a substring of "avx512_fp16")
    assert not hardware.cpu_has_native_bf16("flags\t: avx512_fp16 amx_int8\n")
    assert not hardware.cpu_has_native_bf16("model name\t: bf16 avx512_bf16 marketing text\n")


def test_check_dtype_refuses_what_cannot_run():
    hardware.check_dtype(torch.bfloat16, "cpu")                   # emulated where there is no bf16: runs
    hardware.check_dtype(torch.float16, "cpu")
    with pytest.raises(hardware.HardwareError, match="not a floating-point dtype"):
        hardware.check_dtype(torch.int8, "cpu")


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
