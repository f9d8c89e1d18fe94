"""How kernels.cpu builds and loads its C libraries (kernels/cpu/compiler.py, kernels/cpu/builds.py): once across
threads and processes, with a compiler that may hang or change, into a directory nobody else can write, and what the
decode says when it runs torch instead.

Each test starts from a process that tried no build (`fresh`), a fresh `$SPECVOCAB_CACHE` and a fresh system temp
dir (so a fresh `kernels.cpu.compiler.private_dir()`). The real sources are built at -O0 (the same library in a
fraction of the time); the rest build a one-function C file. `$CC` is a script that logs each compile (so "one
compile" is counted, not timed) and can wait before it runs the real compiler, so that two builders really overlap.

Mutants these tests were checked against (each fails at least one test here):
- a library's result stored before the build finishes (a second thread sees it tried, gets None) -> two threads
- no in-process lock (both threads build; each gets its own library object)             -> two threads
- no file lock (two processes both compile)                                             -> two processes
- no fallback directory (an unwritable cache is an error)                               -> read-only cache
- the private directory made with the umask's mode (0755)                               -> read-only cache
- the private directory's symlink followed (stat for lstat)                             -> planted private dir
- a group- or other-writable cache directory, or a build file others can write, used    -> shared cache
- the compiler's version, or its resolved path, left out of the hash                    -> compiler change
- no compiler timeout; only the compiler's own process killed on timeout                -> timeout
- the stale build removal ignoring the stem, or the age, or outside the file lock;
  none at all                                                                           -> stale builds
- $SPECVOCAB_REQUIRE_KERNELS ignored; or raising for a CPU that lacks the ISA            -> require
- engine.native not reporting its torch path (no line), or reporting it on every call   -> the decode's line
- the test hook failing every skip, or none                                             -> conftest hook
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import filelock
import pytest
import torch

from specvocab.kernels import cpu
from specvocab.kernels.cpu import compiler
from specvocab.kernels.hardware import cpu_flags
from specvocab.kernels.testing import cpu_as

CPU = torch.device("cpu")
REAL_CC = shutil.which("cc") or shutil.which("gcc")
TINY_FLAGS = ("-O0", "-shared", "-fPIC")
ROOT = Path(__file__).resolve().parents[1]

needs_cc = pytest.mark.skipif(REAL_CC is None, reason="needs a C compiler (cc or gcc on PATH)")


def _needs_avx2():
    if not set(cpu.AVX2_FLAGS) <= cpu_flags():
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()})")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """kernels.cpu as in a process that tried no build and said nothing; a fresh cache and temp dir."""
    cpu_as(monkeypatch)
    for var in (cpu.REQUIRE_ENV, cpu.CC_TIMEOUT_ENV, cpu.ISA_ENV, "CC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path


def _fake_cc(tmp_path: Path, name: str = "cc", version: str = "fakecc 1.0", wait: float = 0.0,
             body: str | None = None) -> tuple[Path, Path]:
    """A `$CC` script answering `--version` with `version` and otherwise (after `wait` seconds, or `body`)
    running the real compiler at -O0; each compile appends a line to the log it returns."""
    log = tmp_path / f"{name}.log"
    script = tmp_path / name
    # -O0 for -O3: the same library, built in a fraction of the time (kernels/cpu.c: ~10 s of CPU at -O3)
    run = body if body is not None else (f"sleep {wait}\nfor a in \"$@\"; do shift; [ \"$a\" = -O3 ] && a=-O0; "
                                         f"set -- \"$@\" \"$a\"; done\nexec {REAL_CC} \"$@\"")
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo '{version}'; exit 0; fi\n"
                      f"echo compile >> {log}\n{run}\n")
    script.chmod(0o755)
    return script, log


def _compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _probe(tmp_path: Path, stem: str = "probe") -> Path:
    src = tmp_path / f"{stem}.c"
    src.write_text("int sv_probe(void) { return 42; }\n")
    return src


def _sos(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.so")) if d.is_dir() else []


# --- once, across threads and processes ---------------------------------------------------------------------

@needs_cc
@pytest.mark.parametrize("load,flags,name", [("avx512", cpu.BUILD_FLAGS, "AVX-512F/BW/VL"),
                                             ("avx2", cpu.AVX2_FLAGS, "AVX2 + FMA")])
def test_two_threads_building_at_once_both_get_the_library_from_one_compile(fresh, monkeypatch, load, flags, name):
    if not set(flags) <= cpu_flags():
        pytest.skip(f"needs {name} (this CPU: {cpu.cpu_isa()})")
    cc, log = _fake_cc(fresh, wait=1)                      # the first build is still compiling when the second asks
    monkeypatch.setenv("CC", str(cc))
    start, got = threading.Barrier(2), [None, None]

    def build(i):
        start.wait()
        got[i] = cpu.builds.load(load)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] is not None and got[0] is got[1], cpu.builds.library_reason(load)
    assert (got[0].sv2_chunk() if load == "avx2" else got[0].sv_block_outputs()) > 0   # it answers
    assert _compiles(log) == 1
    assert len(_sos(fresh / "cache" / "kernels")) == 1


_PROCESS = """
import os, sys, time
from pathlib import Path
from specvocab.kernels.cpu import compiler
Path(sys.argv[1]).touch()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
print(compiler.library(Path(sys.argv[3]), {flags!r}).sv_probe())
"""


@needs_cc
def test_two_processes_building_at_once_compile_once_and_both_load_it(fresh):
    cc, log = _fake_cc(fresh, wait=1)
    src = _probe(fresh)
    env = {**os.environ, "CC": str(cc), "SPECVOCAB_CACHE": str(fresh / "cache"), "TMPDIR": str(fresh / "tmp")}
    go = fresh / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS.format(flags=TINY_FLAGS), str(fresh / f"ready{i}"),
                               str(go), str(src)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        while not all((fresh / f"ready{i}").exists() for i in range(2)):   # both imported: start together
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-2000:]
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert [o[0].strip() for o in outs] == ["42", "42"]
    assert _compiles(log) == 1
    assert len(_sos(fresh / "cache" / "kernels")) == 1


# --- where it builds ----------------------------------------------------------------------------------------

@needs_cc
def test_a_cache_that_cannot_be_written_falls_back_to_a_private_dir_and_says_why_once(fresh, monkeypatch, capsys):
    """A cache under a regular file (not writable, even by root): the build goes to `private_dir()` (this user's,
    mode 0700) with one line naming the cache and why; where that fails too, one error line names both."""
    (fresh / "file").write_text("")
    monkeypatch.setenv("SPECVOCAB_CACHE", str(fresh / "file" / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    src = _probe(fresh)
    for _ in range(2):
        assert compiler.library(src, TINY_FLAGS).sv_probe() == 42
    private = compiler.private_dir()
    assert private.parent == fresh / "tmp" and len(_sos(private)) == 1
    st = os.lstat(private)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(private) in err[0] and str(fresh / "file" / "cache" / "kernels") in err[0]
    assert "cannot be made a directory" in err[0]

    monkeypatch.setattr(tempfile, "tempdir", str(fresh / "file"))       # the private dir under the file too
    with pytest.raises(cpu.CpuKernelError) as e:
        compiler.library(src, TINY_FLAGS)
    assert "\n" not in str(e.value) and str(e.value).count("cannot be made a directory") == 2


@needs_cc
@pytest.mark.parametrize("planted", ["symlink", "0777"])
def test_a_private_dir_planted_by_someone_else_is_refused(fresh, monkeypatch, planted):
    """The private dir's name is known in a shared temp dir: one made in advance as a symlink, or writable by
    others, is not built in (and, the cache being unwritable too, one error line says both)."""
    (fresh / "file").write_text("")
    monkeypatch.setenv("SPECVOCAB_CACHE", str(fresh / "file" / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    theirs = fresh / "theirs"
    theirs.mkdir(mode=0o700)
    if planted == "symlink":
        compiler.private_dir().symlink_to(theirs)
        expect = f"{compiler.private_dir()} is not a directory (a symlink)"
    else:
        compiler.private_dir().mkdir()
        compiler.private_dir().chmod(0o777)
        expect = f"{compiler.private_dir()} is writable by others (mode 777)"
    with pytest.raises(cpu.CpuKernelError, match="no directory to build the CPU kernels in") as e:
        compiler.library(_probe(fresh), TINY_FLAGS)
    assert expect in str(e.value) and _sos(theirs) == [] and _sos(compiler.private_dir()) == []


@needs_cc
@pytest.mark.parametrize("mode,who", [(0o777, "others"), (0o775, "its group")])
def test_a_cache_dir_others_can_write_is_refused_for_the_private_dir(fresh, capsys, mode, who):
    """A shared library is loaded only from a directory this user owns and nobody else may write (root reads
    and writes anything: the mode bits decide, not os.access)."""
    shared = fresh / "cache" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(mode)
    assert compiler.library(_probe(fresh), TINY_FLAGS).sv_probe() == 42
    assert _sos(shared) == [] and len(_sos(compiler.private_dir())) == 1
    err = capsys.readouterr().err
    assert f"{shared} is writable by {who} (mode {mode:o})" in err and str(compiler.private_dir()) in err


@needs_cc
def test_a_build_file_others_could_write_or_that_another_user_owns_is_built_again(fresh, monkeypatch, capsys):
    cc, log = _fake_cc(fresh)
    monkeypatch.setenv("CC", str(cc))
    src = _probe(fresh)
    compiler.library(src, TINY_FLAGS)
    (so,) = (fresh / "cache" / "kernels").glob("*.so")
    assert stat.S_IMODE(so.stat().st_mode) == 0o755 and _compiles(log) == 1
    so.chmod(0o666)
    compiler.library(src, TINY_FLAGS)
    assert _compiles(log) == 2 and stat.S_IMODE(so.stat().st_mode) == 0o755
    assert f"{so} is writable by others (mode 666)" in capsys.readouterr().err
    if os.geteuid() == 0:                                  # only root can give a file to another user
        os.chown(so, 4242, -1)
        compiler.library(src, TINY_FLAGS)
        assert _compiles(log) == 3 and so.stat().st_uid == os.geteuid()
        assert "belongs to uid 4242" in capsys.readouterr().err


# --- the compiler -------------------------------------------------------------------------------------------

@needs_cc
def test_another_compiler_version_or_path_is_another_build(fresh, monkeypatch):
    src = _probe(fresh)
    cc, log = _fake_cc(fresh, version="fakecc 1.0")
    monkeypatch.setenv("CC", str(cc))
    compiler.library(src, TINY_FLAGS)
    compiler.library(src, TINY_FLAGS)
    assert _compiles(log) == 1
    _fake_cc(fresh, version="fakecc 1.1")                  # the same path, upgraded
    compiler.library(src, TINY_FLAGS)
    assert _compiles(log) == 2
    other, log2 = _fake_cc(fresh, name="cc2", version="fakecc 1.1")   # the same version at another path
    monkeypatch.setenv("CC", str(other))
    compiler.library(src, TINY_FLAGS)
    assert _compiles(log2) == 1
    assert len(_sos(fresh / "cache" / "kernels")) == 3


@needs_cc
@pytest.mark.parametrize("compiler", ["missing", "hangs"])
def test_without_a_working_compiler_the_decode_runs_torch_and_says_so_once(fresh, monkeypatch, capsys, compiler):
    """No compiler (a wheel installed where there is none) or one that hangs (stopped after
    `$SPECVOCAB_CC_TIMEOUT` s, its children too): one line says why, the native decode runs torch."""
    from specvocab.engine.models import load_model
    from specvocab.engine.native import NativeModel
    _needs_avx2()
    if compiler == "missing":
        monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
        expect = "did not run"
    else:
        pid = fresh / "pid"
        cc, _ = _fake_cc(fresh, body=f"sleep 600 &\necho $! > {pid}\nwait")
        monkeypatch.setenv("CC", str(cc))
        monkeypatch.setenv(cpu.CC_TIMEOUT_ENV, "0.5")
        expect = f"took over 0.5 s and was stopped — set {cpu.CC_TIMEOUT_ENV} higher"
    model = load_model("random-llama", dtype="fp32")[0]
    assert NativeModel(model).use_cpu_kernels(True) is False
    assert NativeModel(model).use_cpu_kernels(True) is False
    why = cpu.builds.library_reason("avx2")
    assert cpu.isa() is None and expect in why and why in cpu.broken()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "the CPU decode runs torch" in err[0] and expect in err[0]
    if compiler == "hangs":                                # the compiler's child was stopped with it
        child = int(pid.read_text())
        for _ in range(500):
            try:
                if "State:\tZ" in Path(f"/proc/{child}/status").read_text():
                    break
            except FileNotFoundError:
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the hung compiler's child {child} still runs")


# --- stale builds -------------------------------------------------------------------------------------------

@needs_cc
def test_a_new_build_removes_stale_builds_of_its_source_under_the_file_lock(fresh, monkeypatch):
    d = fresh / "cache" / "kernels"
    d.mkdir(parents=True, mode=0o755)
    old = time.time() - compiler.STALE_S - 3600
    stale, recent = d / "probe-0123456789abcdef.so", d / "probe-fedcba9876543210.so"
    other = d / "cpu-0123456789abcdef.so"                  # another source's build
    partial = d / ".probe-0123456789abcdef.so.x1y2.tmp"
    for p in (stale, recent, other, partial):
        p.write_bytes(b"")
    for p in (stale, other, partial):
        os.utime(p, (old, old))
    held = []
    real = compiler._remove_stale

    def check_lock(d_, stem, keep):                        # no other process may be loading one meanwhile
        probe = filelock.FileLock(str(d_ / f"{stem}.lock"), timeout=0)
        try:
            probe.acquire()
        except filelock.Timeout:
            held.append(stem)
        else:
            probe.release()
        real(d_, stem, keep)

    monkeypatch.setattr(compiler, "_remove_stale", check_lock)
    compiler.library(_probe(fresh), TINY_FLAGS)
    assert held == ["probe"]
    assert not stale.exists() and not partial.exists()
    assert recent.exists() and other.exists()             # another checkout's build; another source's
    assert len(_sos(d)) == 3


# --- $SPECVOCAB_REQUIRE_KERNELS ---------------------------------------------------------------------------

def test_require_kernels_turns_a_failed_build_into_an_error_but_not_a_missing_isa(fresh, monkeypatch, capsys):
    _needs_avx2()
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    monkeypatch.setenv(cpu.REQUIRE_ENV, "1")
    with pytest.raises(cpu.CpuKernelError, match=rf"{cpu.REQUIRE_ENV}=1 .*no-such-cc did not run"):
        cpu.decode_reason(CPU, torch.float32)
    assert cpu.decode_reason(CPU, torch.float32, on=False) is not None      # turned off on purpose: no error
    assert "float16" in cpu.decode_reason(CPU, torch.float16)               # a dtype the kernels do not take
    monkeypatch.setenv(cpu.REQUIRE_ENV, "0")
    assert "did not run" in cpu.decode_reason(CPU, torch.float32)
    assert len(capsys.readouterr().err.splitlines()) == 1                   # said once, for all four
    cpu_as(monkeypatch, flags={"sse4_2", "avx"})                            # a CPU without AVX2: a fact, no error
    monkeypatch.setenv(cpu.REQUIRE_ENV, "1")
    assert "lacks avx2, fma" in cpu.decode_reason(CPU, torch.float32) and cpu.broken() == []
    monkeypatch.setenv(cpu.REQUIRE_ENV, "yes")
    with pytest.raises(cpu.CpuKernelError, match=f"{cpu.REQUIRE_ENV}='yes': set it to 1"):
        cpu.require_kernels()


_SKIPS = """
import pytest
from specvocab.kernels import cpu

def test_skips_over_a_failed_build():
    pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu.builds.library_reason('avx2')}")

def test_skips_for_a_missing_isa():
    pytest.skip("needs AVX512-BF16 (this CPU: avx2)")
"""


def test_the_test_hook_fails_a_kernel_skip_over_a_failed_build_under_require(fresh, monkeypatch):
    """tests/conftest.py: under `$SPECVOCAB_REQUIRE_KERNELS=1` a skip that names a failed build fails, a skip for
    an ISA the CPU lacks stays a skip (a pytest run of two such tests); without it, both stay skips."""
    _needs_avx2()
    (fresh / "test_skips.py").write_text(_SKIPS)
    env = {**os.environ, "CC": str(fresh / "no-such-cc"), "SPECVOCAB_CACHE": str(fresh / "cache"),
           "TMPDIR": str(fresh / "tmp"), cpu.REQUIRE_ENV: "1"}
    env.pop(cpu.ISA_ENV, None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rfs",
                          "-q", "--rootdir", str(fresh), str(fresh / "test_skips.py")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 skipped" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    failed = [ln for ln in run.stdout.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].split(" - ")[0].endswith("test_skips.py::test_skips_over_a_failed_build")
    assert f"{cpu.REQUIRE_ENV}=1: this CPU" in run.stdout

    from tests import conftest                             # the same skip without the variable: a skip
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    why = cpu.builds.library_reason("avx2")
    assert cpu.broken()
    report = SimpleNamespace(skipped=True, outcome="skipped",
                             longrepr=("x.py", 1, f"Skipped: needs AVX2 + FMA: {why}"))
    hook = conftest.pytest_runtest_makereport(None, None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(SimpleNamespace(get_result=lambda: report))
    assert report.outcome == "skipped"
