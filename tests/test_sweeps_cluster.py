"""`python -m specvocab.sweeps.run` as a user runs it, in subprocesses: bad input exits 2 with the problem named, a driver
killed mid-sweep resumes without losing or recomputing finished cells, and `ray job submit` runs the same
command on a head started here (127.0.0.1 only, token authentication)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specvocab.engine.prompts import data_root
from specvocab.sweeps.cluster import loopback_env
from specvocab.sweeps.config import load_sweep
from specvocab.sweeps.results import result_files
from tests.sweeps_testing import tiny_toml, write_toml

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specvocab.sweeps.run", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kw)


def _group_alive(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True).stdout
    return [int(p) for p, g in (line.split() for line in out.splitlines()) if int(g) == pgid]


def _stop_group(pgid: int, signals=((signal.SIGTERM, 15), (signal.SIGKILL, 5))) -> None:
    """Stop a process group this test started (the driver and the Ray it started, or a `ray start` head)."""
    for sig, wait in signals:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)


@pytest.mark.timeout(300)
def test_cli_bad_input_exits_2_naming_the_problem(tmp_path):
    text = tiny_toml()
    assert 'methods = ["ar", "pld", "unispec"]' in text
    bad = write_toml(tmp_path, text.replace('methods = ["ar", "pld", "unispec"]', 'methods = ["ar", "pdl"]'))
    r = _cli(bad, "--out", tmp_path / "out")
    assert r.returncode == 2 and "unknown method 'pdl'" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    port = _free_port()
    good = write_toml(tmp_path, tiny_toml(), "good.toml")
    r = _cli(good, "--out", tmp_path / "out", "--address", f"127.0.0.1:{port}")
    assert r.returncode == 2 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in r.stderr, r.stderr


@pytest.mark.timeout(900)
def test_driver_killed_mid_sweep_resumes(tmp_path):
    text = tiny_toml(kinds=("record", "bench"), categories=("qa", "writing", "math_reasoning", "translation"),
                     bench='[[bench]]\nmethods = ["ar", "pld"]\n', testing="delay_s = 1.0")
    config = write_toml(tmp_path, text)
    total = len(load_sweep(config).cells)                      # 4 record + 8 bench
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specvocab.sweeps.run", str(config), "--out", str(out), "--num-cpus", "2", "--no-progress"]
    with open(tmp_path / "first.log", "w") as log:
        driver = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not result_files(out) and driver.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            _stop_group(driver.pid, [(signal.SIGKILL, 10)])    # the driver and its local Ray, mid-sweep
            driver.wait()
    assert not _group_alive(driver.pid)
    kept = {f: f.stat().st_mtime_ns for f in result_files(out)}
    assert 0 < len(kept) < total, f"{len(kept)} of {total} cells finished before the kill"

    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    skipped = int(re.search(r"skipped (\d+)", r.stdout).group(1))
    assert skipped == len(kept)
    assert f"{total}/{total} result files" in r.stdout
    assert len(result_files(out)) == total
    assert {f: f.stat().st_mtime_ns for f in kept} == kept     # finished cells were neither lost nor recomputed
    print(r.stdout)


@pytest.mark.timeout(900)
def test_the_checkout_ray_uploads_fits_under_its_request_limit():
    """`ray job submit --working-dir .` (README) and `attach` upload the checkout minus WORKING_DIR_EXCLUDES in one
    request of at most 100 MiB (Ray's dashboard limit); the shipped heads fill most of it. Counted here on the
    tracked files (the zip of safetensors is about their size), so a head added or grown fails this test
    with the numbers rather than a user's job with HTTP 413."""
    from specvocab.sweeps.cluster import UPLOAD_LIMIT, WORKING_DIR_EXCLUDES
    repo = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=True)
    dirs = tuple(e for e in WORKING_DIR_EXCLUDES if e.endswith("/"))
    sizes = {f: (repo / f).stat().st_size for f in files.stdout.split("\0")
             if f and (repo / f).is_file() and not f.startswith(dirs) and not f.startswith(".git/")}
    heads = sum(v for f, v in sizes.items() if f.startswith("engine/heads/"))
    total = sum(sizes.values())
    assert total < UPLOAD_LIMIT, (
        f"the checkout Ray uploads is {total / 2**20:.1f} MiB, over Ray's {UPLOAD_LIMIT / 2**20:.0f} MiB request "
        f"limit ({heads / 2**20:.1f} MiB of it shipped heads): exclude more in sweeps.cluster.WORKING_DIR_EXCLUDES "
        f"and README's `ray job submit`, or ship smaller heads")
    assert sum(v for f, v in sizes.items()) + sum((repo / f).stat().st_size for f in files.stdout.split("\0")
                                                   if f.startswith("tests/")) > 0.9 * UPLOAD_LIMIT  # why tests/ go


def test_ray_job_submit_to_a_local_head(tmp_path):
    gcs, dashboard, client, agent = (_free_port() for _ in range(4))
    # token authentication (Ray's default for new clusters): the head and the client share the token
    env = {**os.environ, **loopback_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    head_cmd = ["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", gcs,
                "--dashboard-host", "127.0.0.1", "--dashboard-port", dashboard, "--ray-client-server-port", client,
                "--dashboard-agent-listen-port", agent, "--num-cpus", "2", "--disable-usage-stats"]
    config = write_toml(tmp_path, tiny_toml(kinds=("record", "coverage", "bench"),
                                            bench='[[bench]]\nmethods = ["ar"]\n'))
    total = len(load_sweep(config).cells)
    out = tmp_path / "out"
    with open(tmp_path / "head.log", "w") as log:
        head = subprocess.Popen([str(a) for a in head_cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        # the job runs in a copy of the working dir, away from the checkout's ../shared/data: name the data root
        runtime_env = json.dumps({"env_vars": {"SPECVOCAB_DATA": str(data_root())}, "excludes": ["tests/"]})
        submit = ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(REPO),
                  "--runtime-env-json", runtime_env, "--", "python", "-m", "specvocab.sweeps.run", str(config), "--out", str(out),
                  "--address", "auto", "--no-progress"]
        deadline = time.monotonic() + 300
        while True:                                           # the dashboard takes a while to come up
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            r = subprocess.run(["ray", "job", "list", "--address", f"http://127.0.0.1:{dashboard}"], env=env,
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
        r = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
        log = r.stdout + r.stderr
        assert r.returncode == 0 and "succeeded" in log, log[-4000:]
        assert f"{total}/{total} result files" in log
        assert len(result_files(out)) == total
    finally:
        _stop_group(head.pid)
        current = Path("/tmp/ray/ray_current_cluster")       # `ray start` points `address="auto"` here
        if current.is_file() and current.read_text().strip() == f"127.0.0.1:{gcs}":
            current.unlink()
