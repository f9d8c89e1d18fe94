"""UniSpec's successor store replayed as a stream vs the per-position reference (exact)."""

import numpy as np
import polars as pl
import pytest

from specvocab.locality import Trace, TraceError, successor_coverage, successor_ranks
from tests import locality_reference as ref
from tests.locality_testing import random_trace, random_traces


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("persist", [False, True])
@pytest.mark.parametrize("from_prefill", [True, False])
def test_successor_ranks_match_reference(seed, persist, from_prefill):
    trs = random_traces(seed)
    for i, t in enumerate(trs):
        t.meta["model"] = ["a", "b"][i % 2]
    r = successor_ranks(trs, persist=persist, from_prefill=from_prefill)
    exp = ref.successor_ranks(trs, persist=persist, from_prefill=from_prefill)
    assert list(zip(r["rank"].to_list(), r["store_hit"].to_list())) == exp
    f = successor_coverage(trs, persist=persist, from_prefill=from_prefill)
    n = len(exp)
    assert f["k"].to_list() == [1, 2, 3, 4] and f["tokens"].to_list() == [n] * 4
    assert r["position"].to_list() == [t for tr in trs for t in range(len(tr.generated))]
    if n:
        for k, cov in zip(f["k"], f["coverage"]):
            assert cov * n == pytest.approx(sum(rk is not None and rk < k for rk, _ in exp))
        assert f["store_hit_rate"][0] * n == pytest.approx(sum(h for _, h in exp))


def test_successor_by_hand_and_errors():
    # prompt [1, 2, 1]; rows: pos0 (1) -> [2, 5], pos1 (2) -> [1, 6], pos2 (1) -> step_topk[0] = [3, 2]
    tr = Trace(prompt=[1, 2, 1], prefill_topk=[[2, 5], [1, 6]], generated=[3, 1, 9],
               step_topk=[[3, 2], [1, 4], [9, 1]])
    r = successor_ranks([tr])
    # t=0: root 1 (pos 2) -> store[1] from pos 0 = [2, 5]: 3 missing. t=1: root 3 (pos 3): no row yet.
    # t=2: root 1 (pos 4) -> store[1] from pos 2 = [3, 2]: 9 missing.
    assert r["rank"].to_list() == [None, None, None] and r["store_hit"].to_list() == [True, False, True]
    tr2 = Trace(prompt=[1, 2, 1], prefill_topk=[[2, 5], [1, 6]], generated=[2, 1, 6],
                step_topk=[[2, 3], [1, 4], [6, 1]])
    r2 = successor_ranks([tr2])
    # t=0: root 1 -> [2, 5]: rank 0. t=1: root 2 (pos 3) -> store[2] from pos 1 = [1, 6]: rank 0.
    # t=2: root 1 (pos 4) -> store[1] from pos 2 = [2, 3]: 6 missing.
    assert r2["rank"].to_list() == [0, 0, None]
    f = successor_coverage([tr2, tr], by=[])
    assert f["coverage"].to_list() == [2 / 6, 2 / 6]
    with pytest.raises(TraceError, match="k=3 is larger than the K=2"):
        successor_coverage([tr], k=3)
    rng = np.random.default_rng(0)
    g = successor_coverage([random_trace(rng, T=0), tr2], by=["category"])
    assert g["tokens"].to_list() == [3, 3] and g["category"].to_list() == [None, None]
    assert isinstance(g, pl.DataFrame)
