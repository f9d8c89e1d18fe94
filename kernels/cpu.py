"""CPU kernels for the native decode on x86 with AVX-512 (bf16: AVX512-BF16) and with AVX2 + FMA
(fp32), each beside its plain-torch reference. (Over 600 lines on purpose: the one C library's build, its
availability and every wrapper of it, each beside its reference, in one place.)

    pack(weight, bias)                  -> PackedLinear (the weight re-laid for the kernel, once; bf16 or fp32)
    PackedLinear(x, out_dtype)          y = x @ W.T (+ b), [M, N]: the small-row bf16 linear (kernels/cpu.c), or
                                        for an fp32 weight the same product in fp32 (AVX-512F only)
    linear_reference(x, weight, bias)   the same product in plain torch (fp32 accumulation, then rounded)
    rows_linear(x, weight, out_dtype)   the same small-row product over a row-major weight, as it lies (a
                                        buffer rewritten in place: MicroSpec's window head, a vocab head),
                                        with the same L2 prefetch schedule (a window head is read cold
                                        after each target forward)
    attention(q, kc, vc, ...)           the exact decode's attention, one row at a time (engine.native rules 2-3)
    attention_reference(...)            the same in plain torch
    attention_f32(q, kc, vc, ...)       the same over an fp32 cache (kernels/cpu_avx2.c: AVX2 + FMA)
    pack_layer(...)                     -> LayerKernel: a decoder layer's weights for the fused layer call
    layer(x, spec, ...)                 one decoder layer over n rows in one call (norms, RoPE, cache write,
                                        attention, residuals, gated MLP: kernels/cpu.c `sv_layer`; in fp32 on
                                        the AVX2 build kernels/cpu_avx2.c `sv2_layer_f32`)
    layer_reference(x, spec, ...)       the same in plain torch
    route_linears(module)               a module's own bf16 nn.Linear layers on the kernel (drafters' heads)
    topk(z, k)                          torch.topk(z, k) of fp32 CPU rows in one pass at memory speed (ties: the
                                        lower index, as torch.argmax; AVX-512 or AVX2), torch itself elsewhere
    topk_lse(z, k)                      topk and each row's log-sum-exp (the successor store's confidences)
    unispec_tree(root, store, ...)      UniSpec's draft tree in one call (reference: engine.drafters.unispec)
    window_step(entries, ...)           MicroSpec's window step in place (kernels.window: `_window_step_torch`
                                        is its reference, bit for bit), O(m) per step
    available()                         None when the bf16 kernels run here, else why not (one line)
    available_fp32()                    None when the fp32 ones run (linear, top-k, window step: AVX-512F is
                                        enough; a CPU without AVX512-BF16 keeps its models in fp32)
    available_portable()                None when `unispec_tree` and `window_step` run (kernels/cpu_portable.c, no
                                        vector code, #included by both builds: any x86 CPU with AVX2 + FMA)
    isa()                               which build runs the fp32 linear: "avx512" (this library), "avx2"
                                        (kernels/cpu_avx2.c: x86 with AVX2 + FMA, no AVX-512), or None;
                                        `$SPECVOCAB_CPU_ISA` = auto | avx512 | avx2 picks one
    decode_reason(device, dtype, on)    None when a decode there takes the kernels, else why not (said once on
                                        stderr; an error under `$SPECVOCAB_REQUIRE_KERNELS=1` for a failed build)
    broken()                            why each build this CPU has the ISA for failed (empty: none did)
    cpu_isa()                           this CPU's widest level: "avx512_bf16", "avx512", "avx2", "no avx2 (..)"

Why it exists. A decode forward multiplies 1-16 rows by every weight of the model: the work is reading the
weights (N x K x 2 bytes per bf16 linear, once per call, against M x K inputs and M x N outputs), so its limit is
memory bandwidth, of which oneDNN's bf16 GEMM (what `F.linear` calls on a CPU) reaches about a third at these
row counts. This kernel streams a weight layout packed for it ([N/4][K/32][4][32]: four output rows' chunks side
by side, one sequential pass), multiplies with VDPBF16PS, prefetches into L2 ahead of the stream over every row
tile's pass of a block (so the memory stays busy while the later tiles compute), and reduces each tile with one
transposing reduction. `python -m specvocab.engine.jobs.forward --backends native,native-blas` measures both in
one run (figures: PERFORMANCE.md, section 1).

Row invariance by construction (what fixed-shape verification needs, engine.native rule 1): each output is
accumulated in its own register over K in order, then reduced by one fixed shuffle tree, so a row's bits do not
depend on M, on the other rows or on the thread count (tests/test_cpu_kernels.py checks each). Its bits differ
from oneDNN's (another order of the same sum); that is fine for exactness, which compares the decode's own
paths with each other, and both stay within a bf16 rounding of the fp32 product.

The attention. engine.native's fixed-shape attention in torch is per layer a dozen small GEMMs, softmax pieces,
casts and the fold. `attention` does the same work per (row, head) in one call: the row's keys in logical order,
in blocks of 32 aligned to logical positions, one softmax over them in fp32 (the scores and their max, then
the weights and their sum, then the weighted values, each pass over the blocks in order). It reads the same
inputs as engine.native's torch path (the committed block count, the tail's slots and mask) and, like it,
depends only on the row's logical context: an `ar` step and a tree give a row the same bits. It sums in another order than the torch path (and keeps scores in fp32 where that path rounds
them to bf16), so the two agree to rounding, not bitwise; a decode uses one of them for all its forwards.
A KV head's query heads share each value row's load and widening (up to four at a time, each dim still one
fmadd per key in key order: the same bits). The values go through VDPBF16PS over key pairs with the weights
rounded to bf16 (as transformers' eager bf16 attention rounds them); head sizes 64, 128 and 256 are unrolled,
and the KV head is the outer loop, so its cache stays in L2 across the rows.

fp32. A model kept in fp32 (the default on a CPU without bf16 dot products) runs its linears on `sv_linear_f32`:
the bf16 kernel's tiles, reduction tree and prefetch schedule, with one FMA chain per output over 16-wide fp32
chunks, so rows are invariant by construction here too, and it needs AVX-512F/BW/VL only (`available_fp32`:
the library builds without AVX512-BF16, whose functions are then never called). oneDNN's fp32 GEMM gives rows
1-3 of a product other bits than inside a larger one, so the exact decode without the kernel pads every step to
4 rows and an `ar` step streams the weights for 4; with it a step runs exactly its rows. The layer's small ops
stay torch's in fp32 on an AVX-512 CPU; the attention runs in C (`attention_f32`, below).

AVX2. Most laptops and desktops have no AVX-512 (Intel's client cores since Alder Lake, AMD before Zen 4, and
so many of the machines researchers explore on): there the library above cannot build, the default dtype is
fp32, and the native decode without a kernel runs oneDNN padded to 4 rows - slower than transformers' own forward. The fp32 linear
has a second build for them, kernels/cpu_avx2.c (`sv2_linear_f32`): the same design at 8 lanes (packed
[N/4][K/8][4][8], tiles of 3, 2 and 1 rows for AVX2's 16 registers, one FMA chain per output and one fixed
reduction tree, so rows are invariant by construction), chosen by `isa()` where the AVX-512 library cannot run.
`SPECVOCAB_CPU_ISA=avx2` selects it on an AVX-512 machine and turns every AVX-512 kernel off, so a run there is
what an AVX2 CPU runs (tests/test_cpu_avx2.py, tests/test_native.py's `avx2` cases;
`SPECVOCAB_CPU_ISA=avx2 python -m specvocab.engine.jobs.forward --dtype fp32 --backends hf,native,native-blas
--decode 48` times it: PERFORMANCE.md, "The AVX2 build").

The fp32 attention (`attention_f32`, kernels/cpu_avx2.c `sv2_attention_f32`). The exact decode's attention of an
fp32 model, built with the AVX2 file and so run on AVX-512 CPUs as well: the bf16 kernel's contract (a row's keys
in logical order - committed blocks where they lie, the tail through the row's slots - one softmax over them)
with fp32 keys and values: scores by one FMA chain per key and a fixed reduction tree, a vector exp, the values by
one FMA chain per dim over the keys in order, so a row's bits depend on its logical context alone.

The fp32 layer (`layer` over an fp32 `pack_layer`, kernels/cpu_avx2.c `sv2_layer_f32`): the fused layer of the
bf16 path, in fp32 around the AVX2 linears and attention (so it runs where `isa()` is "avx2"; an fp32 model on
an AVX-512 CPU keeps the packed linears and the C attention with torch's small ops between them).

The fused layer. Around its linears and attention a decoder layer has ~25 small torch ops (norms, RoPE, casts,
the cache write, residual adds, the gated activation), a large share of a decode forward once the linears and
the attention run in C. `layer` runs a whole decoder layer in one call, rounding to bf16 wherever
the torch path holds a bf16 tensor (a product or sum of two bf16 values is exact in fp32, so those roundings
give torch's bits; the norms' sums of squares and the activations' exp / tanh run in another fixed order, so
they agree to rounding). Everything in it is per row, so the row-invariance above carries over. The EAGLE
heads' layer uses it too.

The build. Each library is compiled on first use with the system C compiler (`cc`, or `$CC`) into
`$SPECVOCAB_CACHE/kernels/`, in a file named by the hash of its sources, flags and compiler (resolved path and
`--version`), so an edit or another compiler rebuilds. One thread of a process builds while the others wait, and
one process (a file lock in that directory) while the others wait and load its file; the compiler writes a temp
file there, renamed into place, and runs for at most `$SPECVOCAB_CC_TIMEOUT` seconds; a build then removes its
source's stale builds under the same lock. A library is loaded only from a file and directory this user owns and
nobody else may write; a cache that is not so, or cannot be written, gives way to `private_dir()` (one line says
why). Where there is no compiler, no ISA for a build, or the build fails, `available()` says why, and
engine.native runs its torch path and says so on one line (`decode_reason`); `$SPECVOCAB_REQUIRE_KERNELS=1`
makes a failure on a CPU that has the ISA an error instead (CI: .ci/run).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import filelock
import torch
import torch.nn.functional as F

from specvocab.kernels.hardware import ISA_ENV, cache_root, cpu_flags, isa_env

SOURCE = Path(__file__).with_name("cpu.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
BLOCK = 32                                                            # attention block (engine.native.BLOCK)
BUILD_FLAGS = ("avx512f", "avx512bw", "avx512vl")                    # /proc/cpuinfo names: the fp32 kernels
REQUIRED_FLAGS = (*BUILD_FLAGS, "avx512_bf16")                          # ... and the bf16 ones
CHUNK = 32                                                            # K elements per VDPBF16PS
CHUNK_F32 = 16                                                        # K elements per fp32 FMA
SOURCE_AVX2 = Path(__file__).with_name("cpu_avx2.c")                 # the fp32 kernels for x86 without AVX-512
PORTABLE = Path(__file__).with_name("cpu_portable.c")                # no vector code: #included by both
FLAGS_AVX2 = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
AVX2_FLAGS = ("avx2", "fma")                                          # /proc/cpuinfo names: cpu_avx2.c
ISAS = ("auto", "avx512", "avx2")


class CpuKernelError(RuntimeError):
    """The kernel cannot run here (no compiler, no AVX512-BF16, a failed build); the message says which."""


# -- the build: compiled on first use, once per machine, loaded once per process ------------------------------

CC_TIMEOUT_ENV = "SPECVOCAB_CC_TIMEOUT"     # seconds the C compiler may take on one source (default CC_TIMEOUT_S)
CC_TIMEOUT_S = 300.0                        # cpu.c takes seconds at -O3, several times that on a busy machine
REQUIRE_ENV = "SPECVOCAB_REQUIRE_KERNELS"   # 1: a kernel build failing on a CPU that has its ISA is an error (CI)
STALE_S = 7 * 24 * 3600                     # another build of a source, unloaded this long, is removed on a build
_HASHED = re.compile(r"(?P<stem>.+)-[0-9a-f]{16}\.so")      # a build's file name: `<source stem>-<tag>.so`

_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_broken: str | None = None      # `_why_not` when the CPU has the build's ISA (a failure to report, not a fact)
_tried = False                  # set last, once `_lib` or `_why_not` is: another thread never sees it half done
_bf16 = False                   # the CPU has AVX512-BF16 (read with the build, once)
_lib2: ctypes.CDLL | None = None         # kernels/cpu_avx2.c (`_load_avx2`)
_why_not2: str | None = None
_broken2: str | None = None
_tried2 = False
_build_lock = threading.RLock()          # one build at a time in this process (the file lock: across processes)
_said: set[str] = set()                  # the lines `_say` printed
_decode_said = False                     # `decode_reason` printed its line


def _say(line: str) -> None:
    """`line` on stderr, once per process, in engine.target's form for a fallback (`[specvocab] ...`)."""
    if line not in _said:
        _said.add(line)
        print(f"[specvocab] {line}", file=sys.stderr, flush=True)


def require_kernels() -> bool:
    """Whether `$SPECVOCAB_REQUIRE_KERNELS` is 1: a build that fails on a CPU with its ISA (no compiler, a compile
    error or timeout, no directory to build in) is then an error in the decode (`decode_reason`) and in the tests
    (tests/conftest.py), not a fallback to torch. Unset or 0: the fallback, said on one line."""
    raw = os.environ.get(REQUIRE_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise CpuKernelError(f"{REQUIRE_ENV}={raw!r}: set it to 1 (a kernel build failure is an error) or 0 / unset")
    return raw == "1"


def _cc_timeout() -> float:
    raw = os.environ.get(CC_TIMEOUT_ENV, "").strip()
    if not raw:
        return CC_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise CpuKernelError(f"{CC_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; set one or unset it "
                             f"(default {CC_TIMEOUT_S:g})")
    return seconds


def _compiler() -> list[str]:
    """The C compiler's command: `$CC` (split as a shell would: "ccache gcc" works), else cc, else gcc."""
    cc = os.environ.get("CC", "").strip()
    argv = shlex.split(cc) if cc else [shutil.which("cc") or shutil.which("gcc") or ""]
    if not argv or not argv[0]:
        raise CpuKernelError("no C compiler (cc / gcc / $CC) to build the CPU kernels; install gcc or set $CC")
    return argv


def _one_line(text: str, limit: int = 300) -> str:
    """A compiler's output as one line: its first line naming an error, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pick = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output")
    return pick if len(pick) <= limit else pick[:limit] + "..."


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    """argv run to completion within `_cc_timeout()` seconds, in its own process group (killed whole on timeout:
    the compiler's own children too)."""
    timeout = _cc_timeout()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as e:
        raise CpuKernelError(f"the C compiler {argv[0]} did not run ({e.strerror or e}); install gcc or set $CC") \
            from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        raise CpuKernelError(f"{what}: the C compiler {argv[0]} took over {timeout:g} s and was stopped; set "
                             f"{CC_TIMEOUT_ENV} higher (seconds) or $CC to another compiler") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _compiler_id(cc: list[str]) -> str:
    """The compiler as a build's hash sees it: its resolved path, its arguments and the first line of its
    `--version` (an upgraded or another compiler rebuilds)."""
    run = _run([*cc, "--version"], f"{cc[0]} --version")
    first = (run.stdout.strip() or run.stderr.strip()).splitlines()[:1]
    path = os.path.realpath(shutil.which(cc[0]) or cc[0])
    return " ".join([path, *cc[1:], "|", *first])


def _tag(sources: tuple[Path, ...], flags: tuple[str, ...], cc_id: str) -> str:
    """A build's name: the hash of its sources' bytes, the flags and the compiler (`_compiler_id`)."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.read_bytes())
    h.update("\0".join((cc_id, *flags, *LIBS)).encode())
    return h.hexdigest()[:16]


def private_dir() -> Path:
    """Where the kernels build when `$SPECVOCAB_CACHE/kernels` cannot hold them: a directory of this user's under
    the system temp dir, mode 0700."""
    return Path(tempfile.gettempdir()) / f"specvocab-kernels-{os.geteuid()}"


def _untrusted(path: Path, st: os.stat_result) -> str | None:
    """None when `path` (its stat `st`) belongs to this user and nobody else may write it (no group or other
    write bit), else why not: a shared library is loaded only from such a file in such a directory."""
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = "others" if st.st_mode & 0o002 else "its group"
        return f"{path} is writable by {who} (mode {st.st_mode & 0o777:o})"
    return None


def _dir_problem(d: Path, private: bool = False) -> str | None:
    """None when builds may go to `d` (created if missing): a directory this user owns, which nobody else may
    write and this process can; else why not (one line). The private dir must not be a symlink either."""
    try:
        d.mkdir(mode=0o700 if private else 0o755, parents=True, exist_ok=True)
        st = os.lstat(d) if private else os.stat(d)
    except OSError as e:
        return f"{d} cannot be made a directory ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    return _untrusted(d, st) or (None if os.access(d, os.W_OK | os.X_OK) else f"{d} is not writable")


def _remove_stale(d: Path, stem: str, keep: Path) -> None:
    """Under `stem`'s file lock in `d`: partial builds of `stem` (a process killed while compiling: only the
    lock's holder compiles) and builds of `stem` under another hash that no process loaded for `STALE_S`
    (an edited source's; a build loaded now and then - another checkout sharing the cache - stays)."""
    now = time.time()
    for p in d.iterdir():
        m = _HASHED.fullmatch(p.name)
        with contextlib.suppress(OSError):               # gone meanwhile: nothing to remove
            if ((m is not None and m["stem"] == stem and p != keep and now - p.stat().st_mtime > STALE_S)
                    or (p.name.startswith(f".{stem}-") and p.name.endswith(".tmp"))):
                p.unlink()


def _build_in(d: Path, source: Path, flags: tuple[str, ...], cc: list[str], tag: str) -> ctypes.CDLL:
    """The build `d/<stem>-<tag>.so` loaded, compiled first if missing or not trusted (`_untrusted`), all under a
    file lock (`d/<stem>.lock`): one process compiles, the others wait and load its file; the compiler writes a
    temp file in `d`, renamed into place (atomic). Raises OSError where `d` takes no file."""
    out = d / f"{source.stem}-{tag}.so"
    lock = filelock.FileLock(str(d / f"{source.stem}.lock"), timeout=_cc_timeout() + 60)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CpuKernelError(f"another process has held {lock.lock_file} for over {lock.timeout:g} s; remove it "
                             f"if no build of {source.name} is running") from None
    try:
        why = _untrusted(out, os.stat(out)) if out.exists() else "missing"
        if why is not None:
            if why != "missing":
                _say(f"kernels.cpu builds {out.name} again: {why}")
            fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=d)
            os.close(fd)
            try:
                run = _run([*cc, *flags, str(source), "-o", tmp, *LIBS], f"building {source.name}")
                if run.returncode != 0:
                    raise CpuKernelError(f"building {source.name} with {cc[0]} failed: {_one_line(run.stderr)}")
                os.chmod(tmp, 0o755)                     # whatever the umask: nobody else may write it
                os.replace(tmp, out)                     # atomic: a reader sees the old name absent or whole
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            _remove_stale(d, source.stem, out)
        else:
            with contextlib.suppress(OSError):
                os.utime(out)                            # loaded now: not stale (`_remove_stale`)
        return ctypes.CDLL(str(out))                     # under the lock: no process removes it meanwhile
    finally:
        lock.release()


def _library(source: Path, flags: tuple[str, ...], includes: tuple[Path, ...] = (PORTABLE,)) -> ctypes.CDLL:
    """`source` built with `flags` and loaded: a file named by the hash of the source, the files it #includes,
    the flags and the compiler (`_tag`), so an edit or another compiler rebuilds. In `$SPECVOCAB_CACHE/kernels`
    where this user owns it and nobody else may write it, else in `private_dir()` (said once, with why); where
    neither takes it, CpuKernelError names both problems."""
    cc = _compiler()
    tag = _tag((source, *includes), flags, _compiler_id(cc))
    refused = []
    for d, private in ((cache_root() / "kernels", False), (private_dir(), True)):
        why = _dir_problem(d, private)
        if why is None:
            try:
                lib = _build_in(d, source, flags, cc, tag)
            except OSError as e:
                why = f"{d} takes no build ({e.strerror or e})"
            else:
                if refused:
                    _say(f"kernels.cpu builds in {d}: {refused[0]}")
                return lib
        refused.append(why)
    raise CpuKernelError(f"no directory to build the CPU kernels in: {'; '.join(refused)}")


def _bind_shared(lib: ctypes.CDLL, topk: str, topk_lse: str, scratch: str, layer: str) -> None:
    """The signatures both builds give their own names: the top-k passes and the fused layer with its
    scratch size (kernels/cpu.c `sv_*`, kernels/cpu_avx2.c `sv2_*`)."""
    f = getattr(lib, topk)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_int]
    f.restype = ctypes.c_int
    f = getattr(lib, topk_lse)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    f.restype = ctypes.c_int
    f = getattr(lib, scratch)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_size_t
    f = getattr(lib, layer)
    f.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
                  + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int] * 2)
    f.restype = None


def _bind_portable(lib: ctypes.CDLL) -> None:
    """The signatures of kernels/cpu_portable.c's functions, in either build."""
    lib.sv_unispec_tree.argtypes = ([ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
                                    + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_int]
                                    + [ctypes.c_int, ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 3)
    lib.sv_unispec_tree.restype = ctypes.c_long
    lib.sv_window_step.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                                   + [ctypes.c_void_p] * 14)
    lib.sv_window_step.restype = ctypes.c_long


class _NoIsa(CpuKernelError):
    """The CPU lacks a build's instructions: a fact of the machine, not a failure (`require_kernels`)."""


def _build() -> ctypes.CDLL:
    missing = [f for f in BUILD_FLAGS if f not in cpu_flags()]
    if missing:
        raise _NoIsa(f"this CPU lacks {', '.join(missing)} (the kernels need AVX-512; the bf16 ones "
                     f"AVX512-BF16 too)")
    lib = _library(SOURCE, FLAGS)
    lib.sv_linear_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    lib.sv_linear_bf16.restype = None
    lib.sv_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.sv_linear_f32.restype = None
    lib.sv_block_outputs.restype = ctypes.c_int
    lib.sv_attention.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 4
                                 + [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int])
    lib.sv_attention.restype = None
    lib.sv_linear_rows_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    lib.sv_linear_rows_bf16.restype = None
    _bind_shared(lib, "sv_topk_f32", "sv_topk_lse_f32", "sv_layer_scratch", "sv_layer")
    _bind_portable(lib)
    return lib


def _load() -> ctypes.CDLL | None:
    """kernels/cpu.c built and loaded, once per process (None where it cannot be: `_why_not` says why). Threads
    wait for one build; `_tried` is set last, so none sees it tried before the library or its reason is set."""
    global _lib, _why_not, _broken, _tried, _bf16
    if not _tried:
        with _build_lock:
            if not _tried:
                _bf16 = "avx512_bf16" in cpu_flags()
                lib = why = broken = None
                try:
                    lib = _build()
                except (CpuKernelError, OSError) as e:
                    why, broken = str(e), None if isinstance(e, _NoIsa) else str(e)
                _lib, _why_not, _broken = lib, why, broken
                _tried = True
    return _lib


def _build_avx2() -> ctypes.CDLL:
    missing = [f for f in AVX2_FLAGS if f not in cpu_flags()]
    if missing:
        raise _NoIsa(f"this CPU lacks {', '.join(missing)} (the fp32 linear needs AVX-512F or AVX2 + FMA)")
    lib = _library(SOURCE_AVX2, FLAGS_AVX2)
    lib.sv2_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.sv2_linear_f32.restype = None
    lib.sv2_block_outputs.restype = ctypes.c_int
    lib.sv2_chunk.restype = ctypes.c_int
    lib.sv2_attention_f32.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 4
                                      + [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int])
    lib.sv2_attention_f32.restype = ctypes.c_int
    _bind_shared(lib, "sv2_topk_f32", "sv2_topk_lse_f32", "sv2_layer_scratch", "sv2_layer_f32")
    _bind_portable(lib)
    return lib


def _load_avx2() -> ctypes.CDLL | None:
    """kernels/cpu_avx2.c built and loaded, as `_load` (`_why_not2` says why not)."""
    global _lib2, _why_not2, _broken2, _tried2
    if not _tried2:
        with _build_lock:
            if not _tried2:
                lib = why = broken = None
                try:
                    lib = _build_avx2()
                except (CpuKernelError, OSError) as e:
                    why, broken = str(e), None if isinstance(e, _NoIsa) else str(e)
                _lib2, _why_not2, _broken2 = lib, why, broken
                _tried2 = True
    return _lib2


def cpu_isa() -> str:
    """This CPU's widest level among the builds' instructions, as kernel tests name it in a skip reason ("needs
    AVX512-BF16 (this CPU: avx2)"): "avx512_bf16" (REQUIRED_FLAGS), "avx512" (BUILD_FLAGS), "avx2" (AVX2_FLAGS)
    or "no avx2 (<machine>)"."""
    flags = cpu_flags()
    if set(BUILD_FLAGS) <= flags:
        return "avx512_bf16" if set(REQUIRED_FLAGS) <= flags else "avx512"
    return "avx2" if set(AVX2_FLAGS) <= flags else f"no avx2 ({platform.machine() or 'unknown machine'})"


def _isa_asked() -> str:
    asked = isa_env()
    if asked not in ISAS:
        raise CpuKernelError(f"{ISA_ENV}={asked!r} is not one of {list(ISAS)}; unset it (auto: AVX-512 where the "
                             f"CPU has it, else AVX2) or choose one")
    return asked


def isa() -> str | None:
    """Which build of the packed fp32 linear runs here: "avx512" (kernels/cpu.c, with every other kernel of this
    module), "avx2" (kernels/cpu_avx2.c: the fp32 kernels - linear, attention, top-k - for x86 CPUs with AVX2 +
    FMA but no AVX-512, most laptops and desktops), or None (neither: `linear_reason` says why).
    `$SPECVOCAB_CPU_ISA` (auto | avx512 | avx2) picks one; avx2 on an AVX-512 machine also turns the AVX-512
    kernels off and the default dtype to fp32 (`kernels.hardware.cpu_has_native_bf16`), so a run there is what an
    AVX2 machine runs (the tests, and `python -m specvocab.engine.jobs.forward` for its timings)."""
    asked = _isa_asked()
    if asked != "avx2" and _load() is not None:
        return "avx512"
    if asked != "avx512" and _load_avx2() is not None:
        return "avx2"
    return None


def available_fp32() -> str | None:
    """None when the AVX-512 fp32 kernels (the fp32 linear, `topk`, `topk_lse`, `window_step`, `unispec_tree`) run
    on this machine, else why not (one line): the library built, on a CPU with AVX-512F/BW/VL, and
    `$SPECVOCAB_CPU_ISA` is not avx2. (`linear_reason` also counts the AVX2 build of the fp32 linear.)"""
    if _isa_asked() == "avx2":
        return f"{ISA_ENV}=avx2 turns the AVX-512 kernels off"
    return None if _load() is not None else _why_not


def _portable() -> ctypes.CDLL | None:
    # whichever build is loaded (AVX-512 where `available_fp32` allows it, else AVX2): both hold cpu_portable.c
    return _lib if available_fp32() is None else _load_avx2()


def available_portable() -> str | None:
    """None when the kernels without vector code (`unispec_tree`, `window_step`: kernels/cpu_portable.c) run
    here - in either build, so on any x86 CPU with AVX2 + FMA - else why not (one line)."""
    if _portable() is not None:
        return None
    return f"{available_fp32()}; and the AVX2 build: {_why_not2}"


def available() -> str | None:
    """None when the bf16 kernels run on this machine (everything here), else why not (one line): the fp32 ones
    run, and the CPU has AVX512-BF16. The library itself builds without it: the bf16 functions are then never
    called."""
    why = available_fp32()
    if why is None and not _bf16:
        return "this CPU lacks avx512_bf16 (the bf16 kernels need AVX512-BF16; the fp32 ones run)"
    return why


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
        if isa() is not None:
            return None
        why = available_fp32()
        return why if _isa_asked() == "avx512" else f"{why}; and the AVX2 build: {_why_not2}"
    return f"the model is in {str(dtype).removeprefix('torch.')}, the packed linear multiplies bf16 or fp32"


def broken() -> list[str]:
    """Why each build this CPU has the instructions for, and that was tried, did not load (no compiler, a compile
    error or timeout, no directory to build in); empty when none failed. Tries nothing itself."""
    return [why for why in (_broken, _broken2) if why]


def decode_reason(device: torch.device, dtype: torch.dtype, on: bool = True) -> str | None:
    """None when a decode of a model on `device` in `dtype` takes this machine's fastest path (the kernels here, or
    a device other than the CPU); else why it runs torch instead, said once per process on stderr (one line).
    on=False: the kernels were turned off (`SpecConfig.cpu_kernels`). With `$SPECVOCAB_REQUIRE_KERNELS=1` a
    reason that is a build failure on a CPU with its ISA (`broken`) raises CpuKernelError instead."""
    global _decode_said
    if torch.device(device).type != "cpu":
        return None
    why = "the kernels are turned off (SpecConfig.cpu_kernels=False)" if not on else linear_reason(device, dtype)
    if why is None and dtype == torch.float32 and attention_f32_reason(8) is not None:
        why = f"the fp32 attention runs torch: {_why_not2}"          # kernels/cpu_avx2.c, on AVX-512 CPUs too
    if why is None:
        return None
    failed = [b for b in broken() if b in why]
    if on and failed and require_kernels():
        raise CpuKernelError(f"{REQUIRE_ENV}=1 and the CPU kernels failed on a CPU that has their ISA: {failed[0]}")
    if not _decode_said:
        _decode_said = True
        print(f"[specvocab] the CPU decode runs torch, not the kernels of kernels.cpu: {why}", file=sys.stderr,
              flush=True)
    return why


def block_outputs() -> int:
    """Output rows per packed block (NB in the C source)."""
    lib = _load()
    if lib is None:
        raise CpuKernelError(f"specvocab.kernels.cpu is not available here: {_why_not}")
    return lib.sv_block_outputs()


@dataclass
class PackedLinear:
    """One weight [N, K] (and bias [N]) laid out for the kernel: packed [ceil(N/NB), ceil(K/32), NB, 32] bf16,
    zero-padded; bias in fp32. Calling it runs the kernel on x [M, K] bf16. An fp32 weight is packed
    [ceil(N/NB), ceil(K/16), NB, 16] fp32 and takes fp32 rows, out in fp32 (`sv_linear_f32`); with `isa` "avx2",
    [ceil(N/NB), ceil(K/8), NB, 8] for kernels/cpu_avx2.c's `sv2_linear_f32`."""
    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    isa: str = "avx512"

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
        if x2.shape[0] and fp32 and self.isa == "avx2":
            _lib2.sv2_linear_f32(x2.data_ptr(), self.packed.data_ptr(),
                                 None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), x2.shape[0],
                                 self.out_features, self.in_features, threads or torch.get_num_threads())
        elif x2.shape[0] and fp32:
            _lib.sv_linear_f32(x2.data_ptr(), self.packed.data_ptr(),
                               None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), x2.shape[0],
                               self.out_features, self.in_features, threads or torch.get_num_threads())
        elif x2.shape[0]:
            _lib.sv_linear_bf16(x2.data_ptr(), self.packed.data_ptr(),
                                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                                int(out_dtype == torch.float32), x2.shape[0], self.out_features,
                                self.in_features, threads or torch.get_num_threads())
        return out.view(*lead, self.out_features)


@torch.no_grad()
def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """The kernel's layout of `weight` [N, K] (bf16 or fp32, CPU): a new tensor, the original is untouched. An
    fp32 weight is packed for the build `isa()` picks here (AVX-512, else AVX2)."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu" or weight.dim() != 2:
        raise CpuKernelError(f"pack takes a 2-D bf16 or fp32 CPU weight; got {tuple(weight.shape)} {weight.dtype} "
                             f"on {weight.device}")
    N, K = weight.shape
    kind = "avx512"
    if weight.dtype == torch.float32:
        kind = isa()
        if kind is None:
            raise CpuKernelError(f"no fp32 linear kernel here: {linear_reason(weight.device, weight.dtype)}")
    elif available() is not None:
        raise CpuKernelError(f"specvocab.kernels.cpu is not available here: {available()}")
    if kind == "avx2":
        nb, chunk = _lib2.sv2_block_outputs(), _lib2.sv2_chunk()
    else:
        nb, chunk = block_outputs(), (CHUNK if weight.dtype == torch.bfloat16 else CHUNK_F32)
    Np, Kp = -(-N // nb) * nb, -(-K // chunk) * chunk
    w = torch.zeros(Np, Kp, dtype=weight.dtype)
    w[:N, :K] = weight
    packed = w.view(Np // nb, nb, Kp // chunk, chunk).transpose(1, 2).contiguous()
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedLinear(packed=packed, bias=b, out_features=N, in_features=K, isa=kind)


SMALL_ROWS = 32   # rows up to which the kernels' small-row products beat oneDNN's blocked GEMM here (the
                  # crossover measured in this module's docstring): `rows_linear`, `route_linears`, and
                  # engine.native's forwards outside exact mode


def rows_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rows_linear` runs this product here: bf16 CPU tensors, a contiguous weight, at most SMALL_ROWS
    rows, and the kernels built."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and 0 < x[..., 0].numel() <= SMALL_ROWS
            and available() is None)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                threads: int | None = None) -> torch.Tensor:
    """x [.., K] @ weight [N, K].T with the weight read row-major where it lies (kernels/cpu.c
    `sv_linear_rows_bf16`): for weights rewritten in place, which a packed copy would have to follow. fp32 or
    bf16 out; reference `linear_reference`."""
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
        _load().sv_linear_rows_bf16(x2.data_ptr(), w.data_ptr(), out.data_ptr(), int(out_dtype == torch.float32),
                                    x2.shape[0], N, K, threads or torch.get_num_threads())
    return out.view(*lead, N)


TOPK_MAX = 64      # k up to which `topk` scans in C (an insertion sort per improvement); above: torch.topk


def _topk_c() -> tuple | None:
    """(top-k, top-k + log-sum-exp) C functions of the build that runs here: AVX-512 where `available_fp32`
    allows it, else AVX2 (kernels/cpu_avx2.c: the same top-k, the log-sum-exp summed in another order); None
    where neither runs."""
    if available_fp32() is None:
        return _lib.sv_topk_f32, _lib.sv_topk_lse_f32
    lib = _load_avx2()
    return None if lib is None else (lib.sv2_topk_f32, lib.sv2_topk_lse_f32)


def _c_rows(z: torch.Tensor, k: int) -> tuple[torch.Tensor, tuple] | None:
    """(z [.., V] as contiguous [rows, V], the C functions) where the C top-k passes take it (fp32 CPU rows,
    0 < k <= TOPK_MAX, a build here), else None."""
    V = z.shape[-1]
    if z.dtype != torch.float32 or z.device.type != "cpu" or not 0 < k <= min(V, TOPK_MAX) or z.numel() == 0:
        return None
    fns = _topk_c()
    return None if fns is None else (z.reshape(-1, V).contiguous(), fns)


def topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of z [.., V], descending, as `torch.topk(z, k)`: in C for
    fp32 CPU rows where the kernels run (one pass at memory speed: Gemma's 262k logits ~0.1 ms a row against
    torch's ~0.5), ties broken by the lower index (torch.argmax's first maximum; torch.topk leaves tie order
    unspecified). A row holding NaN, or fewer than k values above -inf, is answered by torch."""
    c = _c_rows(z, k)
    if c is None:
        return torch.topk(z, min(k, z.shape[-1]), dim=-1)
    z2, (topk_c, _) = c
    V, lead = z.shape[-1], z.shape[:-1]
    vals = torch.empty(z2.shape[0], k, dtype=torch.float32)
    idx = torch.empty(z2.shape[0], k, dtype=torch.int64)
    nan = topk_c(z2.data_ptr(), z2.shape[0], V, k, vals.data_ptr(), idx.data_ptr(), torch.get_num_threads())
    if nan or bool((idx[:, -1] < 0).any()):
        return torch.topk(z, k, dim=-1)
    return vals.view(*lead, k), idx.view(*lead, k)


def topk_lse(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [.., k], indices [.., k], logsumexp [..]) of each row of z [.., V]: `topk`, and the row's
    log-sum-exp, so that exp(values - lse) are the top-k softmax probabilities (the successor store's
    confidences, engine.store.topk_probs). In C for fp32 CPU rows where the kernels run: the top-k pass, then
    one pass of exp(z - max) summed in fp64 (kernels/cpu.c `sv_topk_lse_f32`; torch.logsumexp spends ~3 ns a
    logit on one thread, ~10x this). The log-sum-exp agrees with torch's to float rounding (a few ulp), not
    bitwise. Elsewhere, and for rows C declines (NaN, +inf, fewer than k values above -inf):
    `topk_lse_reference`."""
    c = _c_rows(z, k)
    if c is None:
        return topk_lse_reference(z, k)
    z2, (_, topk_lse_c) = c
    V, lead = z.shape[-1], z.shape[:-1]
    vals = torch.empty(z2.shape[0], k, dtype=torch.float32)
    idx = torch.empty(z2.shape[0], k, dtype=torch.int64)
    lse = torch.empty(z2.shape[0], dtype=torch.float32)
    bad = topk_lse_c(z2.data_ptr(), z2.shape[0], V, k, vals.data_ptr(), idx.data_ptr(), lse.data_ptr(),
                     torch.get_num_threads())
    if bad:
        return topk_lse_reference(z, k)
    return vals.view(*lead, k), idx.view(*lead, k), lse.view(lead)


def topk_lse_reference(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain-torch `topk_lse`: `topk` (torch.topk where C does not run) and torch.logsumexp."""
    vals, idx = topk(z, min(k, z.shape[-1]))
    return vals, idx, torch.logsumexp(z.float(), dim=-1)


def unispec_tree(root: int, store_tok: torch.Tensor, store_con: torch.Tensor, cache_tok: torch.Tensor | None,
                 cache_con: torch.Tensor | None, *, k: int, depth: int, r: float, g: int, path: bool,
                 min_score: float, exclude_root: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """UniSpec's draft tree in one C call (kernels/cpu_portable.c `sv_unispec_tree`): (tokens [n], parents [n] int64,
    scores [n] fp32), root first, n <= 1 + g; the same tree, node for node and bit for bit, as the reference
    `engine.drafters.unispec.build_unispec_tree` (that module calls this where it runs: CPU stores,
    `available_portable()` None). store_tok [V, ks] int64 / store_con [V, ks] fp32, contiguous; cache [kc] or None.
    Returns None where the root or a cache token is outside [0, V): the reference then names the problem."""
    V, ks = store_tok.shape
    ct = cache_tok.to(torch.int64).contiguous() if cache_tok is not None else None
    cc = cache_con.to(torch.float32).contiguous() if cache_con is not None else None
    tok = torch.empty(1 + g, dtype=torch.int64)
    par = torch.empty(1 + g, dtype=torch.int64)
    score = torch.empty(1 + g, dtype=torch.float32)
    n = _portable().sv_unispec_tree(int(root), store_tok.data_ptr(), store_con.data_ptr(), V, ks,
                                None if ct is None else ct.data_ptr(), None if cc is None else cc.data_ptr(),
                                0 if ct is None else ct.numel(), k, depth, r, g, int(path), min_score,
                                int(exclude_root), tok.data_ptr(), par.data_ptr(), score.data_ptr())
    if n < 0:
        return None
    return tok[:n], par[:n], score[:n]


def window_step(entries: torch.Tensor, fifo_unique: bool, ring: torch.Tensor, ring_head: torch.Tensor,
                stream_len: torch.Tensor, cnt: torch.Tensor, active: torch.Tensor, slot_of: torch.Tensor,
                tok_of_slot: torch.Tensor, free_slots: torch.Tensor, free_top: torch.Tensor,
                mark: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MicroSpec's window step on CPU tensors in place (kernels/cpu_portable.c `sv_window_step`; the reference,
    bit for bit, is kernels.window's `_window_step_torch`, whose state fields these are): entries [m] int64 with
    m <= ring.numel(). Returns the gather list (slots [m], tokens [m], -1 past the count; count 0-d int64).
    The caller (`kernels.window.window_step`) checks ids and shapes; `available_portable()` must be None."""
    m = entries.numel()
    e = entries.to(torch.int64).contiguous()
    scratch = torch.empty(2, m, dtype=torch.int64)
    flag = torch.empty(m, dtype=torch.uint8)
    slots, tokens = torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int64)
    count = _portable().sv_window_step(e.data_ptr(), m, int(fifo_unique), ring.data_ptr(), ring.numel(),
                                ring_head.data_ptr(), stream_len.data_ptr(), cnt.data_ptr(), active.data_ptr(),
                                slot_of.data_ptr(), tok_of_slot.data_ptr(), free_slots.data_ptr(), free_top.data_ptr(),
                                mark.data_ptr(), scratch[0].data_ptr(), scratch[1].data_ptr(), flag.data_ptr(),
                                slots.data_ptr(), tokens.data_ptr())
    return slots, tokens, torch.tensor(count, dtype=torch.int64)


def argmax(z: torch.Tensor) -> torch.Tensor:
    """z.argmax(-1) (the first maximum), through `topk` (k = 1)."""
    return topk(z, 1)[1][..., 0]


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain-torch reference: the fp32 product of the bf16 inputs, bias added in fp32, then rounded to
    `out_dtype` (the kernel computes the same, summing in another fixed order)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(out_dtype)


def takes_head_dim(hd: int) -> bool:
    """Whether the attention (and so the fused layer) takes this head size: a multiple of 16 up to 256."""
    return hd % 16 == 0 and hd <= 256


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int, positions: torch.Tensor,
              idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
              threads: int | None = None) -> torch.Tensor:
    """The exact decode's attention (kernels/cpu.c, `sv_attention`): q [n, H, hd] (any float dtype; rounded to
    bf16 for the VDPBF16PS scores, which is exact for the decode's q: it is bf16), kc / vc [kvh, capacity, hd]
    bf16 (one layer's cache; committed slot = logical position), committed_blocks: blocks of BLOCK positions
    read where they lie; idx [n, 2 BLOCK] the cache slot of each position of the next two blocks for each row,
    ok [n, 2 BLOCK] whether it is in the row's context; positions [n] the rows' logical positions; window:
    sliding-window length (None = full attention).
    Returns fp32 [n, H, hd]."""
    n, H, hd = q.shape
    kvh, cap = kc.shape[0], kc.shape[1]
    if kc.dtype != torch.bfloat16 or vc.dtype != torch.bfloat16 or not takes_head_dim(hd) or H % kvh:
        raise CpuKernelError(f"attention takes a bf16 cache with head_dim a multiple of 16 up to 256; got "
                             f"{kc.dtype}, head_dim {hd}, {H} heads over {kvh} KV heads")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise CpuKernelError("attention reads each layer's cache in place: give contiguous [kvh, capacity, hd]")
    qf = q.float().contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = idx.to(torch.int64).contiguous()
    okb = ok.to(torch.uint8).contiguous()
    out = torch.empty(n, H, hd, dtype=torch.float32)
    _load().sv_attention(qf.data_ptr(), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), slots.data_ptr(),
                         okb.data_ptr(), out.data_ptr(), n, H, kvh, hd, cap, committed_blocks, int(window or 0),
                         float(scale), threads or torch.get_num_threads())
    return out


def attention_f32_reason(head_dim: int) -> str | None:
    """None when `attention_f32` runs here for this head size (kernels/cpu_avx2.c built: a CPU with AVX2 + FMA,
    AVX-512 ones included), else why not (one line)."""
    if head_dim % 8:
        return f"the fp32 attention kernel takes head sizes that are multiples of 8, not {head_dim}"
    return None if _load_avx2() is not None else _why_not2


def attention_f32(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int,
                  positions: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
                  threads: int | None = None) -> torch.Tensor:
    """`attention` over an fp32 cache (kernels/cpu_avx2.c, `sv2_attention_f32`: the same rules, keys and order;
    the weights stay fp32, as the torch path's do in fp32): the exact decode's attention of an fp32 model.
    q [n, H, hd] fp32, kc / vc [kvh, capacity, hd] fp32, the rest as `attention`. Returns fp32 [n, H, hd];
    reference `attention_reference`."""
    n, H, hd = q.shape
    kvh, cap = kc.shape[0], kc.shape[1]
    if kc.dtype != torch.float32 or vc.dtype != torch.float32 or hd % 8 or H % kvh:
        raise CpuKernelError(f"attention_f32 takes an fp32 cache with head_dim a multiple of 8; got {kc.dtype}, "
                             f"head_dim {hd}, {H} heads over {kvh} KV heads")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise CpuKernelError("attention_f32 reads each layer's cache in place: give contiguous [kvh, capacity, hd]")
    lib = _load_avx2()
    if lib is None:
        raise CpuKernelError(f"the fp32 attention kernel is not available here: {_why_not2}")
    qf = q.float().contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = idx.to(torch.int64).contiguous()
    okb = ok.to(torch.uint8).contiguous()
    out = torch.empty(n, H, hd, dtype=torch.float32)
    if lib.sv2_attention_f32(qf.data_ptr(), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), slots.data_ptr(),
                             okb.data_ptr(), out.data_ptr(), n, H, kvh, hd, cap, committed_blocks,
                             int(window or 0), float(scale), threads or torch.get_num_threads()):
        raise CpuKernelError("attention_f32 could not allocate its scratch (out of memory)")
    return out


def attention_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, committed_blocks: int,
                        positions: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, window: int | None,
                        scale: float) -> torch.Tensor:
    """`attention` (and `attention_f32`) in plain torch, row by row: the same keys in logical order, one softmax
    over them (fp32; the weights rounded to the cache's dtype before they multiply the values - bf16 as
    transformers' eager bf16 attention does, unrounded for an fp32 cache)."""
    n, H, hd = q.shape
    kvh = kc.shape[0]
    out = torch.empty(n, H, hd, dtype=torch.float32)
    b0 = committed_blocks
    for r in range(n):
        key_pos = torch.arange((b0 + 2) * BLOCK)
        slots = torch.cat([key_pos[:b0 * BLOCK], idx[r].to(torch.int64)])
        vis = torch.cat([torch.ones(b0 * BLOCK, dtype=torch.bool), ok[r].bool()])
        if window:
            vis &= int(positions[r]) - key_pos < window
        safe = torch.where(vis, slots, 0)
        for h in range(H):
            k = kc[h // (H // kvh)].float()[safe]                          # [keys, hd] in logical order
            v = vc[h // (H // kvh)].float()[safe]
            s = torch.where(vis, (k @ q[r, h].float()) * scale, float("-inf"))
            e = torch.exp(s - s.max()).to(vc.dtype).float()                 # the weights the values get
            out[r, h] = (e @ v) / e.sum()
    return out


def _stamp(t: torch.Tensor) -> tuple:
    """Where a tensor's data is and how often it was changed in place (inference tensors keep no count: they
    cannot be changed outside inference mode, and nothing trains them)."""
    return t.data_ptr(), None if t.is_inference() else t._version


def route_linears(module: torch.nn.Module, max_rows: int = SMALL_ROWS) -> int:
    """Run every bf16 `nn.Linear` inside `module` (on a CPU) through the small-row kernel for inputs of up to
    `max_rows` rows (`F.linear` above: oneDNN's blocked GEMM is as fast there). Each linear keeps its parameters
    (state_dict, digests and training see nothing new) and gets a packed copy of its weight; its `forward` is
    replaced on the instance. For drafters' own layers (an EAGLE head's decoder layer and fc: ~1.5 ms per call
    on oneDNN at 1-8 rows on SmolLM2's sizes, more than their weights take to read). Returns how many linears
    it routed (0 where the kernel does not run here). bf16 linears on the bf16 kernel, fp32 ones on the fp32 kernel
    of the build `isa()` picks (AVX-512 or AVX2: a drafter in fp32, the default on a CPU without bf16 dot products;
    its fc and decoder layer took 5.4 of its 9.0 ms a step on F.linear, SmolLM2 under the AVX2 build)."""
    routed = 0
    for lin in module.modules():
        if not isinstance(lin, torch.nn.Linear) or linear_reason(lin.weight.device, lin.weight.dtype) is not None:
            continue
        state: dict = {}

        def forward(x, lin=lin, state=state):
            w, b = lin.weight, lin.bias
            if (x.dtype != w.dtype or x[..., 0].numel() > max_rows or w.dtype not in (torch.bfloat16, torch.float32)
                    or w.device.type != "cpu" or torch.is_grad_enabled() and w.requires_grad):
                return F.linear(x, w, b)                         # large, other dtype/device, or being trained
            key = (_stamp(w), None if b is None else _stamp(b))
            if state.get("key") != key:                          # packed once; again if the weights changed
                state["packed"] = pack(w.detach(), None if b is None else b.detach())
                state["key"] = key
            return state["packed"](x)
        lin.forward = forward
        routed += 1
    return routed


# -- the fused decoder layer ---------------------------------------------------------------------------------

class _LayerSpec(ctypes.Structure):                 # kernels/cpu.c `sv_layer_t`, field for field
    _fields_ = ([(f, ctypes.c_int) for f in ("d", "H", "kvh", "hd", "I", "din", "gemma_norm", "act")]
                + [("eps", ctypes.c_float)]
                + [(f, ctypes.c_void_p) for f in ("in_norm", "q_norm", "k_norm", "post_attn_norm", "pre_mlp_norm",
                                                  "post_mlp_norm", "qkv", "o", "gate_up", "down", "qkv_bias")])


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass
class LayerKernel:
    """One decoder layer's weights for `layer` (built by `pack_layer`): the four linears packed, the norm
    weights in fp32 (as the norm multiplies them: Llama's bf16 weight exactly, Gemma's 1 + weight), and the
    C struct that points at them (the tensors here keep that memory alive)."""
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    norms: dict[str, torch.Tensor | None]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    gemma_norm: bool
    act: str
    spec: _LayerSpec

    @property
    def hidden(self) -> int:
        return self.o.out_features


def _norm32(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.detach().float().contiguous()


def pack_layer(qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, o_w: torch.Tensor, gate_up_w: torch.Tensor,
               down_w: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int, eps: float,
               in_norm: torch.Tensor | None, pre_mlp_norm: torch.Tensor, post_attn_norm: torch.Tensor | None = None,
               post_mlp_norm: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, gemma_norm: bool = False, act: str = "silu") -> LayerKernel:
    """A decoder layer for `layer`: qkv_w [(H + 2 kvh) hd, din] (q, k, v rows fused), o_w [d, H hd],
    gate_up_w [2 I, d] (gate rows, then up), down_w [I, d]; norms as the norm multiplies (`gemma_norm`: the fp32
    1 + weight and round(h w); else the model's weight and round(w round(h))); in_norm None: the attention input
    is x itself (EAGLE-1's layer) or given to `layer` (EAGLE-3's midlayer). act: "silu" or "gelu_tanh"."""
    if act not in ACTIVATIONS:
        raise CpuKernelError(f"act={act!r}: the fused layer computes {sorted(ACTIVATIONS)}")
    if qkv_w.dtype == torch.float32:                  # kernels/cpu_avx2.c `sv2_layer_f32`
        if isa() != "avx2" or attention_f32_reason(head_dim) is not None or heads % kv_heads:
            raise CpuKernelError(f"the fp32 fused layer runs on the AVX2 build (kernels.cpu.isa() {isa()!r}), with "
                                 f"head_dim a multiple of 8 and whole KV groups; got head_dim {head_dim}, {heads} "
                                 f"heads over {kv_heads}")
    elif not takes_head_dim(head_dim) or heads % kv_heads:
        raise CpuKernelError(f"the fused layer takes head_dim a multiple of 16 up to 256 and whole KV groups; got "
                             f"head_dim {head_dim}, {heads} heads over {kv_heads}")
    if (q_norm is None) != (k_norm is None):
        raise CpuKernelError("q_norm and k_norm come together (qwen3 / gemma3) or not at all")
    lin = {"qkv": pack(qkv_w, qkv_b), "o": pack(o_w), "gate_up": pack(gate_up_w), "down": pack(down_w)}
    d, inter = o_w.shape[0], down_w.shape[1]
    if lin["qkv"].out_features != (heads + 2 * kv_heads) * head_dim or gate_up_w.shape[0] != 2 * inter:
        raise CpuKernelError("the fused layer's weights do not match its heads / MLP width: qkv_w must be "
                             "[(H + 2 kvh) hd, din], gate_up_w [2 I, d], down_w [d, I]")
    norms = {k: _norm32(v) for k, v in dict(in_norm=in_norm, q_norm=q_norm, k_norm=k_norm,
                                               post_attn_norm=post_attn_norm, pre_mlp_norm=pre_mlp_norm,
                                               post_mlp_norm=post_mlp_norm).items()}
    ptr = {k: (None if v is None else v.data_ptr()) for k, v in norms.items()}
    spec = _LayerSpec(d=d, H=heads, kvh=kv_heads, hd=head_dim, I=inter, din=qkv_w.shape[1],
                      gemma_norm=int(gemma_norm), act=ACTIVATIONS[act], eps=float(eps), **ptr,
                      qkv=lin["qkv"].packed.data_ptr(), o=lin["o"].packed.data_ptr(),
                      gate_up=lin["gate_up"].packed.data_ptr(), down=lin["down"].packed.data_ptr(),
                      qkv_bias=None if lin["qkv"].bias is None else lin["qkv"].bias.data_ptr())
    return LayerKernel(**lin, norms=norms, heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=float(eps),
                       gemma_norm=gemma_norm, act=act, spec=spec)


_local = threading.local()          # per thread: the fused layer's scratch, reused by every call


def _scratch(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least nbytes for `sv_layer`'s intermediates, one per thread and kept (a forward
    calls the layer 30 times with the same sizes; the C side only writes it before reading it)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as contiguous `dtype`, without a copy where it already is (a bool mask is viewed as uint8)."""
    if t.dtype == torch.bool and dtype == torch.uint8 and t.is_contiguous():
        return t.view(torch.uint8)
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def layer(x: torch.Tensor, spec: LayerKernel, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
          vc: torch.Tensor, slots: torch.Tensor, committed_blocks: int, positions: torch.Tensor, idx: torch.Tensor,
          ok: torch.Tensor, window: int | None, scale: float, attn_in: torch.Tensor | None = None,
          threads: int | None = None) -> torch.Tensor:
    """One decoder layer over x [n, d] bf16 in one call (kernels/cpu.c `sv_layer`; an fp32 layer packed on the AVX2
    build: kernels/cpu_avx2.c `sv2_layer_f32`, all in fp32, caches fp32 too); returns the new residual
    stream [n, d] (a new tensor). cos, sin [n, hd]: the rows' RoPE; kc, vc [kvh, capacity, hd]: the layer's
    cache, row r's key and value written to slot slots[r]; committed_blocks, positions, idx, ok, window,
    scale: the attention's inputs, as `attention` takes them; attn_in [n, din]: the attention's input where the
    layer has no input norm of its own (EAGLE-3's midlayer), else None."""
    n, d = x.shape
    dt = spec.qkv.packed.dtype                        # bf16 (kernels/cpu.c), or fp32 (kernels/cpu_avx2.c)
    name = "bf16" if dt == torch.bfloat16 else "fp32"
    if x.dtype != dt or d != spec.hidden:
        raise CpuKernelError(f"this fused layer takes x [n, {spec.hidden}] {name}; got {tuple(x.shape)} {x.dtype}")
    if not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == dt == vc.dtype):
        raise CpuKernelError(f"the fused layer writes the cache in place: give contiguous {name} [kvh, capacity, hd]")
    if attn_in is not None and attn_in.shape != (n, spec.qkv.in_features):
        raise CpuKernelError(f"attn_in must be [n, {spec.qkv.in_features}]; got {tuple(attn_in.shape)}")
    out = x.clone(memory_format=torch.contiguous_format)
    if n == 0:
        return out
    lib = _load() if dt == torch.bfloat16 else _load_avx2()
    scratch_of, run = ((lib.sv_layer_scratch, lib.sv_layer) if dt == torch.bfloat16 else
                       (lib.sv2_layer_scratch, lib.sv2_layer_f32))
    scratch = _scratch(scratch_of(ctypes.byref(spec.spec), n))
    # the same inputs come to every layer of a forward: each conversion is a no-op unless needed
    keep = [_as(cos, dt), _as(sin, dt), _as(slots, torch.int64),
            _as(positions, torch.int64), _as(idx, torch.int64), _as(ok, torch.uint8)]
    a_in = None if attn_in is None else _as(attn_in, dt)
    run(ctypes.byref(spec.spec), out.data_ptr(), None if a_in is None else a_in.data_ptr(),
                 keep[0].data_ptr(), keep[1].data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1],
                 keep[2].data_ptr(), committed_blocks, keep[3].data_ptr(), keep[4].data_ptr(), keep[5].data_ptr(),
                 int(window or 0), float(scale), scratch.data_ptr(), n, threads or torch.get_num_threads())
    return out


def _rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * w).to(x.dtype) if gemma else (w.to(x.dtype) * h.to(x.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def layer_reference(x: torch.Tensor, spec: LayerKernel, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                    vc: torch.Tensor, slots: torch.Tensor, committed_blocks: int, positions: torch.Tensor,
                    idx: torch.Tensor, ok: torch.Tensor, window: int | None, scale: float,
                    attn_in: torch.Tensor | None = None) -> torch.Tensor:
    """`layer` in plain torch ops, each rounded to bf16 where the C code rounds (engine.native's `_layer` with
    the kernel's linears and attention is the same computation spread over ~25 calls)."""
    n = x.shape[0]
    H, kvh, hd = spec.heads, spec.kv_heads, spec.head_dim
    nm, eps, g = spec.norms, spec.eps, spec.gemma_norm
    lin = {k: getattr(spec, k) for k in ("qkv", "o", "gate_up", "down")}

    def linear(name, h):
        p = lin[name]
        chunk = p.packed.shape[-1]                    # 32 (bf16), 16 or 8 (fp32 on AVX-512 / AVX2)
        w = p.packed.transpose(1, 2).reshape(-1, p.packed.shape[1] * chunk)[:p.out_features, :p.in_features]
        return linear_reference(h, w, p.bias, out_dtype=x.dtype)

    h = attn_in if attn_in is not None else (_rmsnorm_ref(x, nm["in_norm"], eps, g) if nm["in_norm"] is not None
                                             else x)
    qk, v = linear("qkv", h).split([(H + kvh) * hd, kvh * hd], dim=-1)
    qk, v = qk.reshape(n, H + kvh, hd), v.reshape(n, kvh, hd)
    if nm["q_norm"] is not None:
        qk = torch.cat([_rmsnorm_ref(qk[:, :H], nm["q_norm"], eps, g), _rmsnorm_ref(qk[:, H:], nm["k_norm"], eps, g)],
                       dim=1)
    c, s = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    qk = qk * c + _rotate_half(qk) * s
    q, k = qk[:, :H], qk[:, H:]
    kc[:, slots] = k.transpose(0, 1)
    vc[:, slots] = v.transpose(0, 1)
    a = attention_reference(q, kc, vc, committed_blocks, positions, idx, ok, window, scale).to(x.dtype)
    a = linear("o", a.reshape(n, H * hd))
    if nm["post_attn_norm"] is not None:
        a = _rmsnorm_ref(a, nm["post_attn_norm"], eps, g)
    x = x + a
    gate, up = linear("gate_up", _rmsnorm_ref(x, nm["pre_mlp_norm"], eps, g)).chunk(2, dim=-1)
    act = F.silu(gate) if spec.act == "silu" else F.gelu(gate, approximate="tanh")
    h = linear("down", act * up)
    if nm["post_mlp_norm"] is not None:
        h = _rmsnorm_ref(h, nm["post_mlp_norm"], eps, g)
    return x + h
