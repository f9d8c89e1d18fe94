"""Hardware, decided in one place: device, default dtype, and how the kernels run.

Every module of `kernels` imports this one before it defines a `@triton.jit` kernel, because Triton
decides between compiled and interpreted kernels at decoration time (`triton.jit` reads
`TRITON_INTERPRET` then). On a machine without CUDA we set `TRITON_INTERPRET=1` here, so the Triton
kernels can still run - on CPU tensors, about 100x slower than torch.

Which implementation an op uses (the Triton kernel or its plain-torch reference):

1. `use_triton(True|False)` / the context manager `using_triton(...)` (tests), else
2. the environment variable `SPECVOCAB_KERNELS=triton|torch`, else
3. the default: Triton when CUDA is available, the torch reference on CPU (the interpreter is far too
   slow for production paths; the torch reference is vectorised and is what CPU runs).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

HAS_CUDA: bool = torch.cuda.is_available()
if not HAS_CUDA:
    # Must happen before any kernels module runs `@triton.jit` (see the module docstring).
    os.environ.setdefault("TRITON_INTERPRET", "1")


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here; the message says why and what to do."""


class HardwareError(ValueError):
    """An unknown device or dtype name; the message lists the valid ones."""


DEVICE: torch.device = torch.device("cuda" if HAS_CUDA else "cpu")

# The one dtype vocabulary of every CLI (`--dtype`) and loader.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
DTYPE_ENV = "SPECVOCAB_DTYPE"     # overrides DEFAULT_DTYPE for every loader and CLI (fp32 | bf16 | fp16)
# CPU feature flags (Linux /proc/cpuinfo) that mean bf16 dot products in hardware: x86 AVX512-BF16 / AMX,
# Arm's BF16 extension (BFDOT, BFMMLA)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 "flags", Arm "Features") from /proc/cpuinfo's text (read when None; empty
    where there is none, e.g. macOS)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


ISA_ENV = "SPECVOCAB_CPU_ISA"     # where kernels.cpu's chain of builds starts (`kernels.cpu.builds.ISAS`)


def isa_env() -> str:
    """`$SPECVOCAB_CPU_ISA` as asked, lower-cased ("auto" when unset); kernels.cpu checks it is one of its choices."""
    return (os.environ.get(ISA_ENV) or "auto").strip().lower()


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot products in hardware (then a bf16 GEMM reads half the bytes of an fp32
    one, at up to twice the rate). cpuinfo: the text of /proc/cpuinfo (False where there is none, so the
    default stays fp32 there). This machine run as an AVX2 CPU or an AVX-512 one without bf16
    (`$SPECVOCAB_CPU_ISA=avx2` or `avx512`) has none, as those CPUs have none: its default dtype is then fp32."""
    if cpuinfo is None and isa_env() in ("avx512", "avx2"):
        return False
    flags = cpu_flags(cpuinfo)
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def cache_root() -> Path:
    """`$SPECVOCAB_CACHE`, default `~/.cache/specvocab`: converted models (`models/`), calibration
    (`calibration.json`) and built CPU kernels (`kernels/`)."""
    return Path(os.environ.get("SPECVOCAB_CACHE") or Path.home() / ".cache" / "specvocab").expanduser()


CPU_BF16: bool = cpu_has_native_bf16()


def default_dtype(env: str | None = None, cuda: bool = HAS_CUDA, cpu_bf16: bool = CPU_BF16) -> torch.dtype:
    """The dtype every loader and CLI uses when none is given.

    1. `$SPECVOCAB_DTYPE` (fp32 | bf16 | fp16), when set;
    2. CUDA: fp16, the precision of the FR-Spec and UniSpec experiments (UniSpec App. A);
    3. a CPU with bf16 dot products (`cpu_has_native_bf16`): bf16. The native backend's fixed-shape
       verification keeps every method token-equal to `ar` in bf16 (engine.native, tests/test_native.py), and
       a bf16 forward costs about what an fp32 forward of a quarter of the rows does (PERFORMANCE.md, section 1);
    4. any other CPU: fp32 (bf16 GEMMs are emulated there and gain nothing).
    """
    env = os.environ.get(DTYPE_ENV, "") if env is None else env
    if env.strip():
        name = env.strip().lower().removeprefix("torch.")
        if name not in DTYPES:
            raise HardwareError(f"{DTYPE_ENV}={env!r} is not a dtype — set it to one of {sorted(DTYPES)} or unset it")
        return DTYPES[name]
    if cuda:
        return torch.float16
    return torch.bfloat16 if cpu_bf16 else torch.float32

DEFAULT_DTYPE: torch.dtype = default_dtype()

ENV_VAR = "SPECVOCAB_KERNELS"
_BACKENDS = ("triton", "torch")
_override: bool | None = None


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype:
    """A dtype from a CLI string ("fp16", "bfloat16", "torch.float32", ...), a torch.dtype, or None for
    `DEFAULT_DTYPE`. Every CLI and loader parses `--dtype` here."""
    if value is None:
        return DEFAULT_DTYPE
    if isinstance(value, torch.dtype):
        return value
    name = str(value).strip().lower().removeprefix("torch.")
    if name not in DTYPES:
        raise HardwareError(f"unknown dtype {value!r} — choose one of {sorted(DTYPES)} (default here: "
                            f"{str(DEFAULT_DTYPE).removeprefix('torch.')})")
    return DTYPES[name]


def check_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise a clear error for a dtype that `device` cannot run a model in: a non-floating dtype anywhere,
    bf16 on a GPU without bf16 support (before Ampere). On a CPU every float dtype runs (bf16 and fp16 are
    emulated where the processor lacks them: slow, not wrong), so only the kind is checked there."""
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise HardwareError(f"dtype {dtype} is not a floating-point dtype — a model runs in one of fp32, bf16, fp16")
    if device.type == "cuda" and dtype == torch.bfloat16 and HAS_CUDA and not torch.cuda.is_bf16_supported():
        raise HardwareError(f"this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support — pass "
                            f"--dtype fp16 or fp32 (or set {DTYPE_ENV})")


def parse_device(value: str | torch.device | None) -> torch.device:
    """A torch.device from a CLI string ("cpu", "cuda", "cuda:1"), a torch.device, or None for `DEVICE`."""
    if value is None:
        return DEVICE
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise HardwareError(f"unknown device {value!r} ({e}) — pass cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not HAS_CUDA:
        raise HardwareError(f"device {value!r} asked for, but this machine has no CUDA — pass cpu or leave the "
                            f"device unset (default here: {DEVICE})")
    return device


def triton_interpreted() -> bool:
    """True when `@triton.jit` kernels run under the Triton interpreter (CPU tensors, slow)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(flag: bool | None) -> bool | None:
    """Force the Triton kernels on (True) or off (False); None returns to the default. Returns the
    previous override."""
    global _override
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"use_triton takes True, False or None, got {flag!r}")
    previous, _override = _override, flag
    return previous


@contextlib.contextmanager
def using_triton(flag: bool | None = True) -> Iterator[None]:
    """`with using_triton(True): ...` runs the Triton kernels (interpreted on CPU); `False` the torch
    reference. Restores the previous choice on exit."""
    previous = use_triton(flag)
    try:
        yield
    finally:
        use_triton(previous)


def triton_enabled() -> bool:
    """Whether ops dispatch to their Triton kernel (see the module docstring for the order)."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env:
        if env not in _BACKENDS:
            raise KernelBackendError(f"{ENV_VAR}={env!r} is not a kernel backend — set it to one of "
                                     f"{list(_BACKENDS)} or unset it (default: triton on CUDA, torch on CPU)")
        return env == "triton"
    return HAS_CUDA


def check_triton_can_run(*tensors: torch.Tensor) -> None:
    """Raise a clear error when the Triton path was chosen for tensors it cannot run on."""
    for t in tensors:
        if t.is_cuda:
            if triton_interpreted():
                raise KernelBackendError("CUDA tensor passed to a Triton kernel while TRITON_INTERPRET=1 — "
                                         "unset TRITON_INTERPRET to run compiled kernels on the GPU")
            continue
        if t.device.type == "cpu" and not triton_interpreted():
            raise KernelBackendError(
                "Triton kernel called on a CPU tensor without the interpreter — import `kernels.hardware` "
                "before anything defines Triton kernels on a CPU-only machine, set TRITON_INTERPRET=1, or use "
                "the torch reference (use_triton(False) / SPECVOCAB_KERNELS=torch)")
        if t.device.type not in ("cpu", "cuda"):
            raise KernelBackendError(f"Triton kernels need CPU (interpreted) or CUDA tensors, got {t.device}")


def describe() -> str:
    """One line for benchmark headers and logs."""
    if HAS_CUDA:
        where = f"cuda ({torch.cuda.get_device_name()})"
    else:
        where = f"cpu ({torch.get_num_threads()} threads)"
    mode = "interpreted" if triton_interpreted() else "compiled"
    backend = "triton" if triton_enabled() else "torch reference"
    return f"device={where} dtype={str(DEFAULT_DTYPE).removeprefix('torch.')} kernels={backend} triton={mode}"
