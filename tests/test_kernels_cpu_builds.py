"""The choice of build (kernels.cpu.builds): the chain amx-bf16 -> avx512-bf16 -> avx512 -> avx2 -> torch, chosen
by what the CPU has, `$SPECVOCAB_CPU_ISA` starting it elsewhere; the one-line notes where a build is asked for and
absent, or not provided yet; and Linux's AMX tile permission (kernels.cpu.tiles). CPUs other than this one are
played with `kernels.testing.cpu_as` (their /proc/cpuinfo flags; the libraries still build here).

Mutants these tests were checked against (each fails at least one test here):
- the chain in another order (avx2 before avx512-bf16)                                -> the chain
- `$SPECVOCAB_CPU_ISA` ignored; an unknown value taken as auto                        -> the environment
- the AMX entry taken as running on a CPU with AMX flags (no library: a crash), or skipped without its line;
  the line said on every call                                                         -> AMX, not provided yet
- a requested build the CPU lacks skipped without a line                              -> asked and absent
- `request_tiles` answering None on a CPU without AMX; raising on a refusal; the grant not confirmed with
  ARCH_GET_XCOMP_PERM                                                                 -> tile permission
- a refused tile permission not falling to the next build                            -> tiles refused
- engine.calibration.device_name the same with and without SPECVOCAB_CPU_ISA=avx2; the default dtype left at
  bf16 there                                                                          -> the environment
- `linear_reason` counting only the AVX-512 library (fp32 without AVX-512 -> native-blas) -> an AVX2 CPU
"""

from __future__ import annotations

import errno

import pytest
import torch

from specvocab.kernels import cpu
from specvocab.kernels.cpu import builds, tiles
from specvocab.kernels.hardware import BF16_CPU_FLAGS, cpu_flags, cpu_has_native_bf16, default_dtype
from specvocab.kernels.testing import cpu_as

CPU = torch.device("cpu")
NAMES = [b.name for b in cpu.CHAIN]


def _first_running(flags: set[str], op: str, start: int = 0) -> str | None:
    """The reference choice: the first build from `start` whose flags `flags` holds, that has a library, holds
    `op` (bf16 ops on bf16 builds only) and whose library loads."""
    for b in cpu.CHAIN[start:]:
        lib = cpu.LIBRARIES.get(b.library)
        if (set(b.flags) <= flags and lib is not None and op in lib.ops and (b.bf16 or not op.endswith("_bf16"))
                and builds.library_reason(b.library) is None):
            return b.name
    return None


def test_the_chain_runs_the_first_build_this_cpu_has_and_the_environment_starts_it_elsewhere(monkeypatch):
    """auto: the first build of amx-bf16, avx512-bf16, avx512, avx2 whose flags this CPU lists (and that is
    provided) runs each op; `$SPECVOCAB_CPU_ISA` = a build's name starts the chain there (the builds above it are
    off), torch turns every C kernel off; an unknown value is an error naming the choices."""
    assert NAMES == ["amx-bf16", "avx512-bf16", "avx512", "avx2"] and cpu.ISAS[0] == "auto"
    flags = cpu_flags()
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    for op in ("linear_bf16", "linear_f32", "topk", "attention_f32", "unispec_tree"):
        got = cpu.provider(op)
        assert (got and got.name) == _first_running(flags, op), op
    for i, name in enumerate(NAMES):
        monkeypatch.setenv(cpu.ISA_ENV, name)
        assert [b.name for b in cpu.chain()] == NAMES[i:]
        for op in ("linear_bf16", "linear_f32"):
            assert ((cpu.provider(op) and cpu.provider(op).name) == _first_running(flags, op, i)), (name, op)
    monkeypatch.setenv(cpu.ISA_ENV, "torch")
    assert cpu.chain() == () and cpu.isa() is None and "turns the C kernels off" in cpu.available()
    z = torch.randn(2, 100)
    assert torch.equal(cpu.topk(z, 3)[1], torch.topk(z, 3).indices)        # torch's own answer
    monkeypatch.setenv(cpu.ISA_ENV, "sse4")
    with pytest.raises(cpu.CpuKernelError, match=r"SPECVOCAB_CPU_ISA='sse4' is not one of \['auto', 'amx-bf16', "
                                                 r"'avx512-bf16', 'avx512', 'avx2', 'torch'\]"):
        cpu.isa()


def test_avx2_asked_is_what_an_avx2_cpu_runs(monkeypatch):
    """avx2 turns every AVX-512 kernel off (bf16 kernels, the AVX-512 top-k and window step) while the AVX2
    library runs the fp32 ones; the default dtype is then fp32 and calibrated timings are kept apart."""
    from specvocab.engine.calibration import device_name
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    here = device_name("cpu")
    assert cpu_has_native_bf16() == any(f in cpu_flags() for f in BF16_CPU_FLAGS)
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert device_name("cpu") == here + ":avx2"
    assert not cpu_has_native_bf16()                     # an AVX2 CPU has no bf16 dot products: fp32 by default
    assert default_dtype(env="", cuda=False, cpu_bf16=cpu_has_native_bf16()) == torch.float32
    if cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu.builds.library_reason('avx2')}")
    assert "SPECVOCAB_CPU_ISA=avx2" in cpu.available_fp32() and "SPECVOCAB_CPU_ISA=avx2" in cpu.available()
    assert cpu.linear_reason(CPU, torch.float32) is None
    assert cpu.linear_reason(CPU, torch.bfloat16) is not None
    assert cpu.pack(torch.randn(8, 20)).isa == "avx2"
    with pytest.raises(cpu.CpuKernelError, match="not available here"):
        cpu.pack(torch.randn(8, 20).bfloat16())
    assert cpu.provider("topk").library == cpu.provider("unispec_tree").library == "avx2"


def test_a_cpu_with_avx512_but_not_bf16_runs_the_fp32_kernels_and_says_why_not_the_bf16_ones(monkeypatch):
    """kernels/cpu.c builds on AVX-512F/BW/VL alone; there `available_fp32()` is None (fp32 linear, top-k, window
    step), `available()` and `reason(.., bf16)` name avx512_bf16, `linear_reason` passes fp32 only; without
    AVX-512 the library names what is missing."""
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    cpu_as(monkeypatch, flags=set(cpu.BUILD_FLAGS) | {"avx2", "fma"})
    if cpu.builds.library_reason("avx512") is not None:
        pytest.skip(f"kernels/cpu.c does not build here: {cpu.builds.library_reason('avx512')}")
    assert cpu.available_fp32() is None and "avx512_bf16" in cpu.available()
    assert cpu.provider("linear_f32").name == "avx512" and cpu.provider("linear_bf16") is None
    assert "avx512_bf16" in cpu.reason(CPU, torch.bfloat16)
    assert "avx512_bf16" in cpu.linear_reason(CPU, torch.bfloat16)
    assert cpu.linear_reason(CPU, torch.float32) is None
    assert "bf16 or fp32" in cpu.linear_reason(CPU, torch.float16)
    if not set(cpu.BUILD_FLAGS) <= cpu_flags():
        return                                          # its kernels cannot run on this CPU; the choice above holds
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 20, generator=g)
    # another order of the same fp32 sum: within a few ulps of the terms
    assert torch.allclose(cpu.pack(w)(torch.ones(1, 20)), w.sum(1)[None], rtol=1e-5, atol=1e-5)
    z = torch.randn(2, 100, generator=g)
    assert torch.equal(cpu.topk(z, 3)[1], torch.topk(z, 3).indices)
    cpu_as(monkeypatch, flags={"avx512f", "avx2"})
    assert "avx512bw" in cpu.available_fp32() and "avx512bw" in cpu.available()
    assert cpu.builds.load("avx512") is None and "avx512bw, avx512vl" in cpu.builds.library_reason("avx512")
    assert cpu.broken() == []                           # a CPU without the flags is a fact, not a failure


def test_a_cpu_with_avx2_but_not_avx512_runs_the_avx2_linear(monkeypatch):
    """/proc/cpuinfo of a laptop (avx2, fma, no avx512*): the AVX-512 library names what is missing, the AVX2
    library runs the fp32 linear, so `native` in fp32 runs unpadded; without FMA neither runs and the reason names
    both."""
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    cpu_as(monkeypatch, flags={"sse4_2", "avx", "avx2", "fma"})
    assert "avx512f" in cpu.available_fp32()
    if cpu.isa() != "avx2":
        pytest.skip(f"needs AVX2 + FMA (this CPU: {cpu.cpu_isa()}): {cpu.builds.library_reason('avx2')}")
    assert cpu.linear_reason(CPU, torch.float32) is None and "avx512f" in cpu.linear_reason(CPU, torch.bfloat16)
    if set(cpu.AVX2_FLAGS) <= cpu_flags():
        w = torch.randn(8, 20)
        assert torch.allclose(cpu.pack(w)(torch.ones(1, 20)), w.sum(1)[None], rtol=1e-5, atol=1e-5)
    cpu_as(monkeypatch, flags={"avx", "avx2"})
    assert cpu.isa() is None
    why = cpu.linear_reason(CPU, torch.float32)
    assert "avx512f" in why and "fma" in why


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    """No compiler on a CPU with the flags: the library is None, its reason names the compiler, and it is a
    failure (`broken`), which the next build does not hide."""
    cpu_as(monkeypatch, flags=set(cpu.REQUIRED_FLAGS))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    assert cpu.builds.load("avx512") is None
    assert "compiler /nonexistent/cc did not run" in cpu.builds.library_reason("avx512")
    assert cpu.broken() == [cpu.builds.library_reason("avx512")]
    assert cpu.provider("linear_bf16") is None and "did not run" in cpu.available()


def _bf16_here():
    if cpu.builds.library_reason("avx512") is not None:
        pytest.skip(f"kernels/cpu.c does not build here: {cpu.builds.library_reason('avx512')}")


def test_on_a_cpu_with_amx_the_chain_says_once_that_no_amx_build_is_present_and_runs_the_next(monkeypatch,
                                                                                             capsys):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    cpu_as(monkeypatch, flags=set(cpu.REQUIRED_FLAGS) | set(cpu.AMX_FLAGS) | set(cpu.AVX2_FLAGS))
    _bf16_here()
    assert cpu.cpu_isa() == "amx_bf16"
    assert cpu.provider("linear_bf16").name == "avx512-bf16" and cpu.isa() == "avx512"
    assert cpu.available() is None
    err = capsys.readouterr().err.splitlines()
    assert err == ["[specvocab] amx-bf16: no amx-bf16 build of the kernels is present yet; the avx512-bf16 build "
                   "runs instead"]
    cpu.provider("topk")
    assert capsys.readouterr().err == ""                 # once per process
    cpu_as(monkeypatch, flags=set(cpu.REQUIRED_FLAGS))   # no AMX: nothing to say
    assert cpu.provider("linear_bf16").name == "avx512-bf16" and capsys.readouterr().err == ""


def test_a_requested_build_this_cpu_lacks_is_said_in_one_line_and_the_next_runs(monkeypatch, capsys):
    cpu_as(monkeypatch, flags=set(cpu.AVX2_FLAGS))
    monkeypatch.setenv(cpu.ISA_ENV, "avx512-bf16")
    assert cpu.provider("linear_f32").name == "avx2" or cpu.builds.library_reason("avx2") is not None
    then = "the avx2 build" if cpu.builds.library_reason("avx2") is None else "torch"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[specvocab] SPECVOCAB_CPU_ISA=avx512-bf16: this CPU lacks avx512f, avx512bw, avx512vl, "
                   f"avx512_bf16; {then} runs instead"]
    assert cpu.provider("linear_bf16") is None and "avx512_bf16" in cpu.available()


def test_a_tile_refusal_is_one_line_and_the_next_build_runs(monkeypatch, capsys):
    """An AMX build (played by kernels/cpu.c behind a tile-permission request) on a CPU whose kernel refuses
    tile data: it does not run, the line gives Linux's reason, and avx512-bf16 runs."""
    amx = cpu.Build("amx-bf16", (), "avx512", bf16=True, tiles=True)
    monkeypatch.setattr(builds, "CHAIN", (amx, *cpu.CHAIN[1:]))
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    cpu_as(monkeypatch, flags=set(cpu.REQUIRED_FLAGS))
    _bf16_here()
    asked = []
    monkeypatch.setattr(builds, "request_tiles", lambda: asked.append(1) or "Linux refused AMX tile data: (test)")
    assert cpu.provider("linear_bf16").name == "avx512-bf16"
    assert asked and capsys.readouterr().err.splitlines() == [
        "[specvocab] amx-bf16: Linux refused AMX tile data: (test); the avx512-bf16 build runs instead"]
    cpu_as(monkeypatch, flags=set(cpu.REQUIRED_FLAGS))
    monkeypatch.setattr(builds, "request_tiles", lambda: None)         # granted: the AMX entry runs
    assert cpu.provider("linear_bf16") is amx and capsys.readouterr().err == ""


# --- Linux's tile permission ----------------------------------------------------------------------------------

def test_tile_permission_on_this_cpu_is_an_answer_not_a_crash(monkeypatch):
    """The real request: where the CPU has no AMX, a one-line refusal naming the call; where it has AMX, None
    (granted and confirmed) or a refusal (an old kernel, a sandbox). Asked once per process."""
    monkeypatch.setattr(tiles, "_answer", [])
    why = tiles.request_tiles()
    if "amx_tile" not in cpu_flags():
        assert isinstance(why, str) and "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)" in why
        assert "\n" not in why
    else:
        assert why is None or "arch_prctl" in why
    assert tiles.request_tiles() is why


def test_tile_permission_reads_the_system_calls_answers(monkeypatch):
    """Through a stand-in for the system call: a refusal names its errno; a grant is confirmed by
    ARCH_GET_XCOMP_PERM (the tile-data bit set: None; not set: a reason); another OS is a reason."""
    def fake(req_rc, req_errno, mask):
        def arch_prctl(code, arg):
            if code == tiles.ARCH_REQ_XCOMP_PERM:
                assert arg == tiles.XFEATURE_XTILEDATA
                return req_rc, req_errno
            arg.value = mask
            return 0, 0
        return arch_prctl

    monkeypatch.setattr(tiles.sys, "platform", "linux")
    monkeypatch.setattr(tiles.platform, "machine", lambda: "x86_64")
    for rc, err, mask, expect in ((-1, errno.EPERM, 0, "Operation not permitted"),
                                  (-1, errno.EINVAL, 0, "Invalid argument"),
                                  (0, 0, 1 << tiles.XFEATURE_XTILEDATA | 3, None),
                                  (0, 0, 3, "lack tile data")):
        monkeypatch.setattr(tiles, "_answer", [])
        monkeypatch.setattr(tiles, "_arch_prctl", fake(rc, err, mask))
        got = tiles.request_tiles()
        assert (got is None) if expect is None else (expect in got), (rc, err, mask, got)
    monkeypatch.setattr(tiles, "_answer", [])
    monkeypatch.setattr(tiles.sys, "platform", "darwin")
    assert "Linux on x86-64" in tiles.request_tiles()
