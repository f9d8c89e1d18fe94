"""`[sweep] timing`: the timed cells (calibrate, bench) of a CPU sweep alone on their machine ("exclusive", the
default) or side by side ("shared").

Why it is the default, measured (PERFORMANCE.md, section 3): on a 2-core machine the quick sweep's `ar` decoded SmolLM2 at
43.5 tok/s alone and at 31-33 tok/s beside a neighbour, while the 5-8-row steps of the speculative methods slowed
much less - so speedups timed side by side read 0.1-0.25 high.

Mutants these tests fail (each was applied and run): the driver ignoring the key (timed cells overlap); every
phase run one actor wide (record cells stop overlapping); `timed_alone` written as a constant True; the rows
without `timed_alone`; the timed actors placed without node affinity on a two-machine cluster (Ray packs both on
one machine); the key left in the config hash (a folder would not resume under the other value).
"""

from __future__ import annotations

import tomllib

import polars as pl
import pytest
import ray

from specvocab import sweeps
from specvocab.sweeps.cell import SweepError
from specvocab.sweeps.cluster import LOOPBACK, loopback_env, start_local
from specvocab.sweeps.config import parse_sweep
from specvocab.sweeps.run import run_sweep
from specvocab.sweeps.tables import describe
from tests.sweeps_testing import tiny_toml

# 4 record cells, 8 bench cells and 1 calibrate cell, each at least 0.3 s (`[testing] delay_s`), so that
# cells that run at the same time are seen to
TEXT = tiny_toml(kinds=("record", "bench", "calibrate"), categories=("qa", "writing", "math", "coding"),
                 bench='[[bench]]\nmethods = ["ar", "pld"]\n', testing="delay_s = 0.3")


def _sweep(timing: str | None):
    text = TEXT if timing is None else TEXT.replace("warmup = 0\n", f'warmup = 0\ntiming = "{timing}"\n', 1)
    return parse_sweep(tomllib.loads(text), default_name="tiny")


def _overlapping(spans: list, kinds: tuple[str, ...], same_node: bool = False) -> int:
    """Pairs of the cells of `kinds` whose [began, ended] intervals overlap (on one node, with `same_node`)."""
    mine = sorted((b, e, node) for kind, node, b, e, _ in spans if kind in kinds)
    return sum(1 for i, (b1, e1, n1) in enumerate(mine) for b2, e2, n2 in mine[i + 1:]
               if b2 < e1 and (n1 == n2 or not same_node))


def test_timing_is_exclusive_by_default_a_runtime_key_and_checked():
    assert _sweep(None).timing == "exclusive" and _sweep("shared").timing == "shared"
    # a run-time setting: an output folder resumes under the other value
    assert _sweep("shared").config_hash == _sweep("exclusive").config_hash == _sweep(None).config_hash
    with pytest.raises(SweepError, match=r"\[sweep\].timing: 'alone' is not one of \['exclusive', 'shared'\]"):
        _sweep("alone")


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray: 2 CPUs, every process on 127.0.0.1."""
    start_local(num_cpus=2)
    yield
    ray.shutdown()


@pytest.mark.timeout(600)
def test_exclusive_runs_timed_cells_one_at_a_time_and_record_cells_side_by_side(local_ray, tmp_path):
    out = tmp_path / "out"
    s = run_sweep(_sweep(None), out, progress=False, show=False)
    assert s.ok, s.lines()
    assert dict(s.ran) == {"record": 4, "bench": 8, "calibrate": 1}
    assert _overlapping(s.spans, ("calibrate", "bench")) == 0
    assert _overlapping(s.spans, ("record",)) >= 1          # two actors ran them: only the timed cells wait
    bench = sweeps.load(out, "bench").collect()
    calibrate = sweeps.load(out, "calibrate").collect()
    assert bench["timed_alone"].to_list() == [True] * bench.height
    assert calibrate["timed_alone"].to_list() == [True] * calibrate.height
    assert "timed_alone" not in sweeps.load(out, "record").collect().columns
    assert 'one at a time on its machine, nothing else of the sweep beside them ([sweep] timing = "exclusive")' \
        in "\n".join(s.lines())
    assert "each cell timed alone on its machine" in describe(bench)[0]
    # every method on one task's prompts back to back (`by_prompts`), not the config's method-major order
    split = {c: v for c, v in bench.select("cell_id", "split_value").unique().iter_rows()}
    order = [split[cell_id] for kind, _, began, _, cell_id in sorted(s.spans, key=lambda x: x[2]) if kind == "bench"]
    runs = [v for i, v in enumerate(order) if i == 0 or v != order[i - 1]]
    assert len(order) == 8 and len(runs) == 4 == len(set(runs)), order


@pytest.mark.timeout(600)
def test_shared_runs_timed_cells_side_by_side_and_the_rows_say_so(local_ray, tmp_path):
    out = tmp_path / "out"
    s = run_sweep(_sweep("shared"), out, progress=False, show=False)
    assert s.ok, s.lines()
    assert _overlapping(s.spans, ("calibrate", "bench")) >= 1
    bench = sweeps.load(out, "bench").collect()
    assert bench["timed_alone"].to_list() == [False] * bench.height
    assert 'up to 2 at once ([sweep] timing = "shared")' in "\n".join(s.lines())
    assert 'cells timed beside other cells on their machine' in describe(bench)[0]
    # one slot: alone whatever the key says
    s1 = run_sweep(_sweep("shared"), tmp_path / "one", progress=False, show=False, max_workers=1)
    assert s1.ok and _overlapping(s1.spans, ("record", "calibrate", "bench")) == 0
    assert pl.concat([sweeps.load(tmp_path / "one", "bench").collect()["timed_alone"]]).all()


@pytest.mark.timeout(600)
def test_exclusive_on_two_machines_places_one_timed_actor_on_each(tmp_path):
    """A two-node Ray on 127.0.0.1 (ray.cluster_utils), 4 CPUs a node: Ray's default placement would pack two
    1-CPU actors onto one node; "exclusive" puts one on each, so timed cells overlap across the machines and
    never on one."""
    import os

    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray.shutdown()
    os.environ.update(loopback_env())         # as start_local: every process of both nodes on 127.0.0.1 only
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "node_ip_address": LOOPBACK,
                                                             "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4, node_ip_address=LOOPBACK)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == [LOOPBACK, LOOPBACK]
        s = run_sweep(_sweep(None), tmp_path / "out", progress=False, show=False, max_workers=2)
        assert s.ok, s.lines()
        timed = [span for span in s.spans if span[0] in ("calibrate", "bench")]
        assert len({node for _, node, _, _, _ in timed}) == 2                      # both machines ran timed cells
        assert _overlapping(s.spans, ("calibrate", "bench"), same_node=True) == 0
        assert _overlapping(s.spans, ("calibrate", "bench")) >= 1                # ... side by side
        assert "one at a time on each of 2 machines" in "\n".join(s.lines())
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_the_subtitle_says_how_cells_were_timed_and_never_claims_more_than_the_rows():
    """`describe` reads `timed_alone`: all True -> alone; any False -> beside; True beside rows that do not say
    (a folder resumed from a run before the column) -> not "each cell"; no column -> nothing said."""
    base = {"model": ["m"] * 3, "device": ["cpu"] * 3}
    said = {name: describe(pl.DataFrame({**base, "timed_alone": col}))[0] for name, col in
            {"alone": [True, True, True], "beside": [True, False, None], "older": [True, None, True]}.items()}
    assert "each cell timed alone on its machine" in said["alone"]
    assert 'cells timed beside other cells on their machine' in said["beside"]
    assert "each cell" not in said["older"] and "older rows do not say how" in said["older"]
    assert "timed" not in describe(pl.DataFrame(base))[0]
