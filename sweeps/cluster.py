"""Connecting to Ray: a local cluster bound to 127.0.0.1, or an existing cluster at an address.

Loopback: Ray turns a node address of 127.0.0.1 into the machine's reachable IP
(`ray._private.services.resolve_ip_for_localhost`) unless multi-node clusters are switched off, which
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` does - then the GCS, the raylet and every worker listen on 127.0.0.1
only. Ray reads the variable when it is imported, so `start_local` sets it for the processes Ray starts
and, for a `ray` already imported, the constant it was read into. `ray start --head` needs the same
variable in its environment (`loopback_env`).

Attaching from a checkout (`--address` outside `ray job submit`): the workers on other machines need this
code, so `attach` ships the checkout as the job's `runtime_env` working_dir (`.git` and the .gitignored
files left out) and passes `$SPECVOCAB_DATA` on where it is set. Inside a Ray job (`ray job submit`, which
sets `RAY_JOB_CONFIG_JSON_ENV_VAR` for its entrypoint; or a process Ray started, with `RAY_JOB_ID`) the job
already has its runtime_env - giving one again would conflict - so none is given.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import ray
from ray._private import ray_constants

from specvocab.sweeps.cell import SweepError

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
STARTS = 3                      # a raylet that misses Ray's fixed 30 s start deadline on a loaded machine


def loopback_env() -> dict[str, str]:
    """Environment variables that keep a Ray started from this process (or by `ray start`) on 127.0.0.1."""
    return dict(LOOPBACK_ENV)


def start_local(num_cpus: int | None = None, **kwargs) -> None:
    """ray.init a new local cluster of `num_cpus` CPUs (default os.cpu_count()) bound to 127.0.0.1."""
    os.environ.update(LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    for attempt in range(STARTS):
        try:
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), _node_ip_address=LOOPBACK,
                     include_dashboard=False, log_to_driver=False, **kwargs)
            break
        except Exception as e:  # Ray raises a bare Exception when its raylet misses the 30 s start deadline
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == STARTS - 1:
                raise SweepError(f"could not start a local Ray ({e}) — on a loaded machine try again") from e
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    if nodes != {LOOPBACK}:
        ray.shutdown()
        raise SweepError(f"the local Ray cluster came up on {sorted(nodes)}, not {LOOPBACK} only; stopped it")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `ray://host:port` or `host:port`; None for `auto` (resolved by Ray itself)."""
    if address == "auto":
        return None
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    if not parsed.hostname or not parsed.port:
        raise SweepError(f"--address {address!r} is not `auto`, `host:port` or `ray://host:port`")
    return parsed.hostname, parsed.port


JOB_ENV_VARS = ("RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_JOB_ID")
# What a job never reads. Ray's dashboard takes at most 100 MiB per upload (ray_constants.DASHBOARD_CLIENT_MAX_SIZE)
# and the shipped heads (engine/heads/) are 99 MB of it, so the tests stay home too (README's `ray job submit`
# says the same; tests/test_sweeps_cluster.py checks the size).
WORKING_DIR_EXCLUDES = [".git", "**/__pycache__", "*.pyc", "tests/"]
UPLOAD_LIMIT = ray_constants.DASHBOARD_CLIENT_MAX_SIZE


def in_ray_job() -> bool:
    """Whether this process is a Ray job's driver or worker (its runtime_env is set already)."""
    return any(os.environ.get(v) for v in JOB_ENV_VARS)


def checkout_runtime_env() -> dict | None:
    """The runtime_env `attach` gives a cluster (module docstring): None inside a Ray job or when this
    package is installed rather than run from a checkout (the workers then need it installed too)."""
    from specvocab.sweeps.provenance import checkout

    repo = checkout()
    if in_ray_job() or repo is None:
        return None
    env: dict = {"working_dir": str(repo), "excludes": list(WORKING_DIR_EXCLUDES)}
    if os.environ.get("SPECVOCAB_DATA"):
        env["env_vars"] = {"SPECVOCAB_DATA": os.environ["SPECVOCAB_DATA"]}
    return env


def attach(address: str, timeout_s: float = 5.0) -> None:
    """Connect to an existing cluster (with `checkout_runtime_env()`); SweepError naming the address when
    nothing answers there."""
    hp = _host_port(address)
    if hp is not None:
        try:
            with socket.create_connection(hp, timeout=timeout_s):
                pass
        except OSError as e:
            raise SweepError(f"cannot reach the Ray cluster at {address} ({e}) — start one with "
                             f"`ray start --head`, check the address, or leave --address out to run on a "
                             f"local Ray") from None
    try:
        runtime_env = checkout_runtime_env()
        ray.init(address=address, log_to_driver=False, **({"runtime_env": runtime_env} if runtime_env else {}))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SweepError(f"cannot connect to the Ray cluster at {address!r} ({type(e).__name__}: {e}) — with "
                         f"`auto`, run inside the cluster (`ray job submit ... --address auto`) or pass its "
                         f"host:port") from None


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Use the Ray this process already joined, else attach to `address`, else start a local one.
    Returns True when this call started or joined a cluster (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if address is None:
        start_local(num_cpus)
    else:
        attach(address)
    return True


def physical_cores(cpus: set[int] | None = None, sysfs: str | Path = "/sys/devices/system/cpu") -> list[int]:
    """One logical CPU per physical core among `cpus` (default: the CPUs this process may run on), the lowest
    of each core's hardware threads, in order: the CPUs that timed actors are pinned to, so that no two share a
    core (hyper-threads share its execution units, and a timing). A CPU whose topology sysfs does not give is
    its own core."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    first: dict[tuple[str, str], int] = {}
    for cpu in cpus:
        topo = Path(sysfs) / f"cpu{cpu}" / "topology"
        try:
            core = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            core = ("cpu", str(cpu))
        first.setdefault(core, cpu)
    return sorted(first.values())


def is_local() -> bool:
    """Whether the Ray this process joined is this machine alone (one live node, on 127.0.0.1)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == LOOPBACK


def resources() -> tuple[int, int]:
    """(CPUs, GPUs) of the cluster."""
    res = ray.cluster_resources()
    return int(res.get("CPU", 0)), int(res.get("GPU", 0))


def cpu_nodes() -> dict[str, float]:
    """{node id: CPUs} of the cluster's live nodes that have CPUs: the machines `[sweep] timing = "exclusive"`
    gives one timed actor each."""
    return {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0}
