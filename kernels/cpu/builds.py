"""The builds of the CPU kernels and the choice among them: an ordered chain, the first that runs here wins.

    CHAIN                      amx-bf16 -> avx512-bf16 -> avx512 -> avx2, then torch (no C kernel)
    chain()                    the chain from where `$SPECVOCAB_CPU_ISA` starts it (auto: the top)
    provider(op)               the first build of `chain()` that runs here and has `op`, or None (torch runs it)
    function(op)               (the C function of `op` in that build's library, the build)
    why_not(op)                None when some build runs `op` here, else why not (one line)
    load(name), library_reason(name)   a library (LIBRARIES) built and loaded once per process, or why not
    isa(), available(), available_fp32(), available_portable(), reason(), linear_reason(), attention_f32_reason(),
    decode_reason(), broken(), require_kernels(), cpu_isa()    what the rest of the package asks (one line each)

A build is a C library (LIBRARIES: a source, its compiler flags, the CPU flags it needs, the ops it holds) run
on a CPU with the flags the build names. Two builds may share a library: `avx512-bf16` and `avx512` are both
kernels/cpu.c, the second on a CPU without AVX512-BF16, where only its fp32 ops run. `amx-bf16` is in the chain
ahead of them as a build that is not provided yet: on a CPU with AMX the chain says so in one line and runs the
next build; its library, when it lands, loads after Linux grants tile data (`kernels.cpu.tiles.request_tiles`),
and a refusal is its one-line reason. The bottom of the chain is torch: every op has a plain-torch path.

`$SPECVOCAB_CPU_ISA` (auto | amx-bf16 | avx512-bf16 | avx512 | avx2 | torch) starts the chain at that build,
so a run is what a CPU whose best build that is runs: `avx2` turns every AVX-512 kernel off (and the default dtype
to fp32, `kernels.hardware.cpu_has_native_bf16`), `torch` every C kernel. A requested build this CPU lacks the
flags for (or that is not provided yet) is said in one line, and the next one runs. An unknown value is an error
naming the choices.

Failures. Where a build's library cannot build (no compiler, a compile error or timeout, no directory to build
in) on a CPU that has its flags, the next build runs; engine.native says on one line that its decode runs torch
where it does (`decode_reason`), and `$SPECVOCAB_REQUIRE_KERNELS=1` makes such a failure an error (CI: .ci/run).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specvocab.kernels.cpu.compiler import CpuKernelError, library, say
from specvocab.kernels.cpu.tiles import request_tiles
from specvocab.kernels.hardware import ISA_ENV, cpu_flags, isa_env

_HERE = Path(__file__).resolve().parents[1]                          # kernels/: the C sources
SOURCE = _HERE / "cpu.c"                                              # AVX-512 (bf16: AVX512-BF16)
SOURCE_AVX2 = _HERE / "cpu_avx2.c"                                    # the fp32 kernels for x86 without AVX-512
PORTABLE = _HERE / "cpu_portable.c"                                   # no vector code: #included by both
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
FLAGS_AVX2 = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
BUILD_FLAGS = ("avx512f", "avx512bw", "avx512vl")                     # /proc/cpuinfo names: the fp32 kernels
REQUIRED_FLAGS = (*BUILD_FLAGS, "avx512_bf16")                        # ... and the bf16 ones
AVX2_FLAGS = ("avx2", "fma")                                          # cpu_avx2.c
AMX_FLAGS = ("amx_tile", "amx_bf16")                                  # TDPBF16PS
REQUIRE_ENV = "SPECVOCAB_REQUIRE_KERNELS"   # 1: a kernel build failing on a CPU that has its ISA is an error (CI)


# -- the libraries ----------------------------------------------------------------------------------------------

def _fn(lib: ctypes.CDLL, name: str, argtypes: list, restype=None) -> None:
    f = getattr(lib, name)
    f.argtypes, f.restype = argtypes, restype


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_ATTENTION = [_P] * 7 + [_I] * 4 + [_L, _I, _I, _I, _F, _I]      # ..., cap, b0, tb, window, scale, threads
_TOPK = [_P, _I, _L, _I, _P, _P, _I]
_TOPK_LSE = [_P, _I, _L, _I, _P, _P, _P, _I]
_LAYER = [_P] * 7 + [_L, _P, _I, _I] + [_P] * 3 + [_I, _F, _P, _I, _I]   # ..., cap, slots, b0, tb, ...
_UNISPEC_TREE = [_L, _P, _P, _L, _I, _P, _P, _I, _I, _I, _F, _I, _I, _F, _I, _P, _P, _P]
_WINDOW_STEP = [_P, _I, _I, _P, _I] + [_P] * 14


def _bind(lib: ctypes.CDLL, ops: dict[str, str]) -> None:
    """The ctypes signature of each op's C function (the same across libraries where both hold the op)."""
    sig = {"linear_bf16": ([_P] * 4 + [_I] * 5, None), "linear_f32": ([_P] * 4 + [_I] * 4, None),
           "rows_linear_bf16": ([_P] * 3 + [_I] * 5, None), "attention_bf16": (_ATTENTION, None),
           "attention_f32": (_ATTENTION, _I), "topk": (_TOPK, _I), "topk_lse": (_TOPK_LSE, _I),
           "layer_bf16": (_LAYER, None), "layer_f32": (_LAYER, None), "layer_scratch_bf16": ([_P, _I], ctypes.c_size_t),
           "layer_scratch_f32": ([_P, _I], ctypes.c_size_t), "unispec_tree": (_UNISPEC_TREE, _L),
           "window_step": (_WINDOW_STEP, _L), "block_outputs": ([], _I), "chunk": ([], _I)}
    for op, name in ops.items():
        _fn(lib, name, *sig[op])


_PORTABLE_OPS = {"unispec_tree": "sv_unispec_tree", "window_step": "sv_window_step"}   # cpu_portable.c, in both


@dataclass(frozen=True)
class Library:
    """One C library: `source` compiled with `cflags` (including `includes`), loadable on a CPU whose
    /proc/cpuinfo lists `flags` (`needs` says them in words); `ops` maps each op it holds to its C function."""
    name: str
    source: Path
    cflags: tuple[str, ...]
    flags: tuple[str, ...]
    needs: str
    ops: dict[str, str]
    includes: tuple[Path, ...] = (PORTABLE,)


LIBRARIES = {
    "avx512": Library("avx512", SOURCE, FLAGS, BUILD_FLAGS, "AVX-512F/BW/VL", {
        "linear_bf16": "sv_linear_bf16", "rows_linear_bf16": "sv_linear_rows_bf16", "attention_bf16": "sv_attention",
        "layer_bf16": "sv_layer", "layer_scratch_bf16": "sv_layer_scratch", "linear_f32": "sv_linear_f32",
        "topk": "sv_topk_f32", "topk_lse": "sv_topk_lse_f32", "block_outputs": "sv_block_outputs", **_PORTABLE_OPS}),
    "avx2": Library("avx2", SOURCE_AVX2, FLAGS_AVX2, AVX2_FLAGS, "AVX2 + FMA", {
        "linear_f32": "sv2_linear_f32", "attention_f32": "sv2_attention_f32", "layer_f32": "sv2_layer_f32",
        "layer_scratch_f32": "sv2_layer_scratch", "topk": "sv2_topk_f32", "topk_lse": "sv2_topk_lse_f32",
        "block_outputs": "sv2_block_outputs", "chunk": "sv2_chunk", **_PORTABLE_OPS}),
}


# -- the chain ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Build:
    """One entry of the chain: `library` (a LIBRARIES key; None: not provided yet) on a CPU whose /proc/cpuinfo
    lists `flags`; `bf16`: it runs the library's bf16 ops (else only the others); `tiles`: it asks Linux for AMX
    tile data before it loads."""
    name: str
    flags: tuple[str, ...]
    library: str | None
    bf16: bool
    tiles: bool = False

    def has(self, op: str) -> bool:
        """Whether this build runs `op` (a LIBRARIES op name; those ending in _bf16 only on a bf16 build)."""
        return (self.library is not None and op in LIBRARIES[self.library].ops
                and (self.bf16 or not op.endswith("_bf16")))


CHAIN = (
    Build("amx-bf16", (*REQUIRED_FLAGS, *AMX_FLAGS), None, bf16=True, tiles=True),
    Build("avx512-bf16", REQUIRED_FLAGS, "avx512", bf16=True),
    Build("avx512", BUILD_FLAGS, "avx512", bf16=False),
    Build("avx2", AVX2_FLAGS, "avx2", bf16=False),
)
TORCH = "torch"
ISAS = ("auto", *(b.name for b in CHAIN), TORCH)


@dataclass
class _Loaded:
    lib: ctypes.CDLL | None
    why_not: str | None
    broken: str | None                  # `why_not` where the CPU has the library's flags: a failure, not a fact


@dataclass
class _State:
    """What this process found out: each library tried (once), this CPU's flags, each (start, op)'s provider."""
    libs: dict[str, _Loaded] = field(default_factory=dict)
    flags: set[str] | None = None
    providers: dict[tuple[str, str], Build | None] = field(default_factory=dict)
    decode_said: bool = False


_state = _State()                        # tests swap in a fresh one (monkeypatch.setattr(builds, "_state", ...))
_build_lock = threading.RLock()          # one build at a time in this process (the file lock: across processes)


def _flags() -> set[str]:
    if _state.flags is None:
        _state.flags = cpu_flags()
    return _state.flags


def _missing(flags: tuple[str, ...]) -> list[str]:
    have = _flags()
    return [f for f in flags if f not in have]


def load(name: str) -> ctypes.CDLL | None:
    """LIBRARIES[name] built and loaded, once per process (None where it cannot be: `library_reason` says why).
    Threads wait for one build; the result is stored whole, so none sees a library tried but not yet set."""
    got = _state.libs.get(name)
    if got is None:
        with _build_lock:
            got = _state.libs.get(name)
            if got is None:
                spec = LIBRARIES[name]
                missing = _missing(spec.flags)
                if missing:
                    got = _Loaded(None, f"this CPU lacks {', '.join(missing)} (the {name} kernels need "
                                        f"{spec.needs})", None)
                else:
                    try:
                        lib = library(spec.source, spec.cflags, spec.includes)
                        _bind(lib, spec.ops)
                        got = _Loaded(lib, None, None)
                    except (CpuKernelError, OSError) as e:
                        got = _Loaded(None, str(e), str(e))
                _state.libs[name] = got
    return got.lib


def library_reason(name: str) -> str | None:
    """None when LIBRARIES[name] loads here, else why not (one line); tries the build."""
    load(name)
    return _state.libs[name].why_not


def refusal(build: Build) -> str | None:
    """None when `build` runs on this machine, else why not (one line): the CPU lacks its flags, it is not
    provided yet, Linux refuses tile data, or its library does not build."""
    missing = _missing(build.flags)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if build.library is None:
        return f"no {build.name} build of the kernels is present yet"
    if build.tiles:
        why = request_tiles()
        if why is not None:
            return why
    return library_reason(build.library)


def asked() -> str:
    """`$SPECVOCAB_CPU_ISA`, checked: one of ISAS ("auto" when unset)."""
    value = isa_env()
    if value not in ISAS:
        raise CpuKernelError(f"{ISA_ENV}={value!r} is not one of {list(ISAS)} — unset it (auto: the first build of "
                             f"the chain this CPU runs) or choose one")
    return value


def chain() -> tuple[Build, ...]:
    """The builds tried, in order: CHAIN from the one `$SPECVOCAB_CPU_ISA` names (all of it for auto, none for
    torch)."""
    start = asked()
    if start == "auto":
        return CHAIN
    names = [b.name for b in CHAIN]
    return CHAIN[names.index(start):] if start in names else ()


def _say_skips(start: str, builds: tuple[Build, ...]) -> None:
    """The chain's one-line notes, once per process: a requested build this CPU lacks the flags for (or that is
    not provided yet), and a build whose flags the CPU has that is not provided yet (AMX today) or is refused
    tile data. A build that fails to compile is not said here: `decode_reason` says it where it matters."""
    for i, b in enumerate(builds):
        missing = _missing(b.flags)
        explicit = i == 0 and start != "auto"
        if b.library is not None and not missing and (not b.tiles or request_tiles() is None):
            continue                    # it runs, or only its compile can fail
        if missing and not explicit:
            continue                    # a CPU without a build's flags: a fact, said only when that build is asked for
        who = f"{ISA_ENV}={start}" if explicit else b.name
        then = next((c.name for c in builds[i + 1:] if refusal(c) is None), None)
        say(f"{who}: {refusal(b)}; " + (f"the {then} build runs instead" if then else "torch runs instead"))


def provider(op: str) -> Build | None:
    """The build that runs `op` here: the first of `chain()` that has it and runs (`refusal`), or None (the op's
    torch path runs). Found once per process and `$SPECVOCAB_CPU_ISA` value."""
    start = asked()
    key = (start, op)
    if key not in _state.providers:
        builds = chain()
        if not any(k[0] == start for k in _state.providers):
            _say_skips(start, builds)
        _state.providers[key] = next((b for b in builds if b.has(op) and refusal(b) is None), None)
    return _state.providers[key]


def function(op: str):
    """(the C function of `op` in its provider's library, the provider); CpuKernelError where none runs it."""
    b = provider(op)
    if b is None:
        raise CpuKernelError(f"the CPU kernel for {op} does not run here: {why_not(op)}")
    return getattr(load(b.library), LIBRARIES[b.library].ops[op]), b


def why_not(op: str) -> str | None:
    """None when a build runs `op` here, else why not (one line): each build of the chain that has the op and
    the reason it does not run (one build per library: the least demanding; a build not provided yet only where
    the CPU has its flags)."""
    if provider(op) is not None:
        return None
    last: dict[str | None, Build] = {}
    for b in chain():
        if (b.has(op) or (b.library is None and b.bf16 == op.endswith("_bf16"))) and not (
                b.library is None and _missing(b.flags)):
            last[b.library if b.library is not None else b.name] = b
    if not last:
        start = asked()
        return (f"{ISA_ENV}={start} turns the C kernels off" if start == TORCH else
                f"{ISA_ENV}={start} turns the {op} kernel off (no build from {start} on has it)")
    return "; ".join(f"{b.name}: {refusal(b)}" for b in last.values())


# -- what the rest of the package asks ---------------------------------------------------------------------------

def require_kernels() -> bool:
    """Whether `$SPECVOCAB_REQUIRE_KERNELS` is 1: a build that fails on a CPU with its ISA (no compiler, a compile
    error or timeout, no directory to build in) is then an error in the decode (`decode_reason`) and in the tests
    (tests/conftest.py), not a fallback to torch. Unset or 0: the fallback, said on one line."""
    raw = os.environ.get(REQUIRE_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise CpuKernelError(f"{REQUIRE_ENV}={raw!r}: set it to 1 (a kernel build failure is an error) or 0 / unset")
    return raw == "1"


def cpu_isa() -> str:
    """This CPU's widest level among the builds' instructions, as kernel tests name it in a skip reason ("needs
    AVX512-BF16 (this CPU: avx2)"): "amx_bf16", "avx512_bf16", "avx512", "avx2" or "no avx2 (<machine>)"."""
    flags = _flags()
    if set(BUILD_FLAGS) <= flags:
        if set(REQUIRED_FLAGS) <= flags:
            return "amx_bf16" if set(AMX_FLAGS) <= flags else "avx512_bf16"
        return "avx512"
    return "avx2" if set(AVX2_FLAGS) <= flags else f"no avx2 ({platform.machine() or 'unknown machine'})"


def isa() -> str | None:
    """Which library runs the packed fp32 linear: "avx512" (kernels/cpu.c), "avx2" (kernels/cpu_avx2.c: x86 CPUs
    with AVX2 + FMA but no AVX-512, most laptops and desktops), or None (`linear_reason` says why)."""
    b = provider("linear_f32")
    return None if b is None else b.library


def available() -> str | None:
    """None when the bf16 kernels (linear, attention, fused layer, row-major linear) run here, else why not."""
    return why_not("linear_bf16")


def available_fp32() -> str | None:
    """None when kernels/cpu.c runs its fp32 kernels here (the fp32 linear, `topk`, `topk_lse`, `window_step`,
    `unispec_tree`: AVX-512F/BW/VL is enough), else why not (one line). (`linear_reason` also counts the AVX2
    build of the fp32 linear.)"""
    if isa() == "avx512":
        return None
    if "avx512" not in [b.name for b in chain()]:
        return f"{ISA_ENV}={asked()} turns the AVX-512 kernels off"
    return refusal(next(b for b in CHAIN if b.name == "avx512"))


def available_portable() -> str | None:
    """None when the kernels without vector code (`unispec_tree`, `window_step`: kernels/cpu_portable.c, in
    either library) run here, else why not (one line)."""
    return why_not("unispec_tree")


def reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the bf16 kernels (all of them: the linears, the attention, the fused layer) can run a model on
    `device` in `dtype`, else why not (one line)."""
    if torch.device(device).type != "cpu":
        return f"the model is on {torch.device(device).type}, the kernels are for CPUs"
    if dtype != torch.bfloat16:
        return f"the model is in {str(dtype).removeprefix('torch.')}, the kernels multiply bf16"
    return available()


def linear_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the packed linear (`pack`) can run a model's weights on `device` in `dtype` - bf16 (`reason`)
    or fp32 (`isa`: AVX-512 or AVX2) - else why not (one line)."""
    if torch.device(device).type != "cpu" or dtype == torch.bfloat16:
        return reason(device, dtype)
    if dtype == torch.float32:
        return why_not("linear_f32")
    return f"the model is in {str(dtype).removeprefix('torch.')}, the packed linear multiplies bf16 or fp32"


def attention_f32_reason(head_dim: int) -> str | None:
    """None when `attention_f32` runs here for this head size (kernels/cpu_avx2.c: a CPU with AVX2 + FMA,
    AVX-512 ones included), else why not (one line)."""
    if head_dim % 8:
        return f"the fp32 attention kernel takes head sizes that are multiples of 8, not {head_dim}"
    return why_not("attention_f32")


def broken() -> list[str]:
    """Why each library this CPU has the instructions for, and that was tried, did not load (no compiler, a
    compile error or timeout, no directory to build in); empty when none failed. Tries nothing itself."""
    return [got.broken for got in _state.libs.values() if got.broken]


def decode_reason(device: torch.device, dtype: torch.dtype, on: bool = True) -> str | None:
    """None when a decode of a model on `device` in `dtype` takes this machine's fastest path (the kernels here, or
    a device other than the CPU); else why it runs torch instead, said once per process on stderr (one line).
    on=False: the kernels were turned off (`SpecConfig.cpu_kernels`). With `$SPECVOCAB_REQUIRE_KERNELS=1` a
    reason that is a build failure on a CPU with its ISA (`broken`) raises CpuKernelError instead."""
    if torch.device(device).type != "cpu":
        return None
    why = "the kernels are turned off (SpecConfig.cpu_kernels=False)" if not on else linear_reason(device, dtype)
    if why is None and dtype == torch.float32 and attention_f32_reason(8) is not None:
        why = f"the fp32 attention runs torch: {why_not('attention_f32')}"   # kernels/cpu_avx2.c, AVX-512 too
    if why is None:
        return None
    failed = [b for b in broken() if b in why]
    if on and failed and require_kernels():
        raise CpuKernelError(f"{REQUIRE_ENV}=1 and the CPU kernels failed on a CPU that has their ISA: {failed[0]}")
    if not _state.decode_said:
        _state.decode_said = True
        print(f"[specvocab] the CPU decode runs torch, not the kernels of kernels.cpu: {why}", file=sys.stderr,
              flush=True)
    return why
