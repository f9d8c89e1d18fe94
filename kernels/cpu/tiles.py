"""Linux's permission for AMX tile data: what an AMX build asks for before its first tile instruction.

    request_tiles()    None once this process may use AMX tile data, else why not (one line); asked once

Linux keeps the tile data state (XFEATURE_XTILEDATA, 8 KiB of registers per thread) off until a process asks
for it with `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` (Linux 5.16+, Documentation/arch/x86/xstate.rst);
a tile instruction before that kills the process with SIGILL. A CPU without AMX, an older kernel, a sandbox that
filters the call, or another OS answer with a refusal, and the ISA chain (`kernels.cpu.builds`) runs the next
build. The request goes straight to the system call (ctypes), so it needs no build of its own.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

SYS_ARCH_PRCTL = 158            # x86-64 system call number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022    # the bitmask of extended features this process may use
ARCH_REQ_XCOMP_PERM = 0x1023    # ask for one more
XFEATURE_XTILEDATA = 18         # AMX tile data

_answer: list[str | None] = []          # the one answer of this process (`request_tiles`)


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> tuple[int, int]:
    """arch_prctl(code, arg) through libc's syscall(2): (return value, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ref = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_ulong(arg)
    rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ref)
    return rc, ctypes.get_errno()


def _ask() -> str | None:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"AMX tile permission is asked of Linux on x86-64; this is {sys.platform} on "
                f"{platform.machine() or 'an unknown machine'}")
    call = "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)"
    rc, err = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc != 0:
        return (f"Linux refused AMX tile data: {call} failed with {os.strerror(err) if err else 'no errno'} "
                f"(a CPU without AMX, a kernel before 5.16, or a sandbox filtering the call)")
    mask = ctypes.c_uint64(0)
    rc, err = _arch_prctl(ARCH_GET_XCOMP_PERM, mask)
    if rc != 0 or not mask.value >> XFEATURE_XTILEDATA & 1:
        return f"{call} returned 0 but the permitted features (0x{mask.value:x}) lack tile data"
    return None


def request_tiles() -> str | None:
    """None once this process may execute AMX tile instructions, else why not (one line, never an exception):
    `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, then `ARCH_GET_XCOMP_PERM` to confirm the grant.
    Asked once per process (the grant lasts its life); an AMX build calls this before it loads."""
    if not _answer:
        _answer.append(_ask())
    return _answer[0]
