"""The build system of the CPU kernels: a C source compiled on first use, once per machine, loaded once per process.

    library(source, flags, includes)   a ctypes.CDLL of `source` built with `flags` (and the files it #includes)
    private_dir()                      where builds go when `$SPECVOCAB_CACHE/kernels` cannot hold them
    say(line)                          a line on stderr, once per process (`[specvocab] ...`)

A build is a file in `$SPECVOCAB_CACHE/kernels/`, named `<source stem>-<tag>.so` with the tag the hash of its
sources, flags and compiler (resolved path and `--version`), so an edit or another compiler rebuilds. One process
compiles (a file lock in that directory) while the others wait and load its file; the compiler writes a temp file
there, renamed into place, and runs for at most `$SPECVOCAB_CC_TIMEOUT` seconds; a build then removes its source's
stale builds under the same lock. A library is loaded only from a file and directory this user owns and nobody
else may write; a cache that is not so, or cannot be written, gives way to `private_dir()` (one line says why).
Which source builds for which CPU, and what a failure means, is `kernels.cpu.builds`'.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import filelock

from specvocab.kernels.hardware import cache_root

LIBS = ("-lm",)
CC_TIMEOUT_ENV = "SPECVOCAB_CC_TIMEOUT"     # seconds the C compiler may take on one source (default CC_TIMEOUT_S)
CC_TIMEOUT_S = 300.0                        # cpu.c takes seconds at -O3, several times that on a busy machine
STALE_S = 7 * 24 * 3600                     # another build of a source, unloaded this long, is removed on a build
_HASHED = re.compile(r"(?P<stem>.+)-[0-9a-f]{16}\.so")      # a build's file name: `<source stem>-<tag>.so`

_said: set[str] = set()                  # the lines `say` printed


class CpuKernelError(RuntimeError):
    """A CPU kernel cannot run here (no compiler, no ISA for it, a failed build) or was given what it cannot take;
    the message says which."""


def say(line: str) -> None:
    """`line` on stderr, once per process, in engine.target's form for a fallback (`[specvocab] ...`)."""
    if line not in _said:
        _said.add(line)
        print(f"[specvocab] {line}", file=sys.stderr, flush=True)


def _cc_timeout() -> float:
    raw = os.environ.get(CC_TIMEOUT_ENV, "").strip()
    if not raw:
        return CC_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise CpuKernelError(f"{CC_TIMEOUT_ENV}={raw!r} is not a positive number of seconds — set one or unset it "
                             f"(default {CC_TIMEOUT_S:g})")
    return seconds


def _compiler() -> list[str]:
    """The C compiler's command: `$CC` (split as a shell would: "ccache gcc" works), else cc, else gcc."""
    cc = os.environ.get("CC", "").strip()
    argv = shlex.split(cc) if cc else [shutil.which("cc") or shutil.which("gcc") or ""]
    if not argv or not argv[0]:
        raise CpuKernelError("no C compiler (cc / gcc / $CC) to build the CPU kernels — install gcc or set $CC")
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
        raise CpuKernelError(f"the C compiler {argv[0]} did not run ({e.strerror or e}) — install gcc or set $CC") \
            from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        raise CpuKernelError(f"{what}: the C compiler {argv[0]} took over {timeout:g} s and was stopped — set "
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
        raise CpuKernelError(f"another process has held {lock.lock_file} for over {lock.timeout:g} s — remove it "
                             f"if no build of {source.name} is running") from None
    try:
        why = _untrusted(out, os.stat(out)) if out.exists() else "missing"
        if why is not None:
            if why != "missing":
                say(f"kernels.cpu builds {out.name} again: {why}")
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


def library(source: Path, flags: tuple[str, ...], includes: tuple[Path, ...] = ()) -> ctypes.CDLL:
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
                    say(f"kernels.cpu builds in {d}: {refused[0]}")
                return lib
        refused.append(why)
    raise CpuKernelError(f"no directory to build the CPU kernels in: {'; '.join(refused)}")
