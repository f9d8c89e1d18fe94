"""Reuse/stack distances, histograms and LRU-vs-FIFO curves vs the per-token reference (exact)."""

import numpy as np
import polars as pl
import pytest

from specvocab.locality import (LocalityError, StreamIndex, candidate_stream, coverage, distance_histograms,
                      miss_ratio_curves, token_distances)
from specvocab.locality.stream import range_count_less
from tests import locality_reference as ref
from tests.locality_testing import random_traces


@pytest.mark.parametrize("seed", range(8))
def test_range_count_less_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    values = rng.integers(0, int(rng.integers(1, 70)), n)
    lo = rng.integers(0, n + 1, 200)
    hi = np.maximum(lo, rng.integers(0, n + 1, 200))
    c = rng.integers(0, 80, 200)
    exp = [int((values[a:b] < x).sum()) for a, b, x in zip(lo, hi, c)]
    assert range_count_less(values, lo, hi, c).tolist() == exp


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("stream", ["candidate", "generated"])
def test_token_distances_match_reference(seed, stream):
    trs = random_traces(seed)
    kw = dict(k_pre=2, k_ver=3, sources=["ctx+ext", "ext", "ctx"][seed % 3],
              prefill_order=["first", "last"][seed % 2])
    d = token_distances(trs, stream, **kw)
    events = ref.candidate_events if stream == "candidate" else ref.generated_events
    exp = ref.distances(trs, events=events, **(kw if stream == "candidate" else {}))
    assert list(zip(d["reuse_distance"].to_list(), d["stack_distance"].to_list())) == exp
    assert d["category"].to_list() == [t.meta["category"] for t in trs for _ in t.generated]
    assert d["position"].to_list() == [s for t in trs for s in range(len(t.generated))]
    assert d["step"].to_list() == d["position"].to_list()       # the "token" order: every token is a step


def test_token_distances_in_the_engine_order():
    from tests.locality_testing import spec_traces

    trs = spec_traces(4)
    d = token_distances(trs, "candidate", k_pre=2, k_ver=2, event_order="engine")
    exp = []
    for t in trs:                 # the reuse distance of each queried token, from the reference's events
        s, steps = ref.engine_events(t, k_pre=2, k_ver=2)
        s = list(s)
        for ys, app in steps:
            for y in ys:
                p = next((j for j in range(len(s) - 1, -1, -1) if s[j] == y), None)
                exp.append(None if p is None else len(s) - p)
            s.extend(app)
    assert d["reuse_distance"].to_list() == exp
    c = np.concatenate([[0], np.cumsum(trs[0].meta["step_sizes"])])
    first = d.filter(pl.col("trace") == 0)
    assert first["position"].to_list() == list(range(1, len(trs[0].generated)))   # the prefill's token: no query
    assert first["step"].to_list() == [int(np.searchsorted(c, p, side="right")) - 1 for p in first["position"]]


@pytest.mark.parametrize("seed", range(6))
def test_lru_and_fifo_curves_match_reference(seed):
    trs = random_traces(seed, n=5)
    caps = [1, 2, 3, 5, 9, 40]
    f = miss_ratio_curves(trs, caps, by=[], k_pre=3, k_ver=2)
    tokens = sum(len(t.generated) for t in trs)
    for row in f.iter_rows(named=True):
        per = ref.lru_per_step(trs, row["capacity"], k_pre=3, k_ver=2)
        assert row["tokens"] == tokens == len(per)
        assert row["lru_miss_ratio"] * tokens == pytest.approx(sum(not c for c, _ in per))
        assert row["lru_mean_active_vocab"] * tokens == pytest.approx(sum(a for _, a in per))
        # fifo_w_max: the smallest window whose mean active vocab reaches the LRU's mean size
        w = row["fifo_w_max"]
        c, a, _ = ref.coverage(trs, w, k_pre=3, k_ver=2)
        assert a >= row["lru_mean_active_vocab"] * tokens - 1e-9
        if w > 1:
            assert ref.coverage(trs, w - 1, k_pre=3, k_ver=2)[1] < row["lru_mean_active_vocab"] * tokens - 1e-9
        assert row["fifo_mean_active_vocab"] * tokens == pytest.approx(a)
        assert row["fifo_mean_active_vocab"] - row["lru_mean_active_vocab"] < 1
        assert row["fifo_miss_ratio"] * tokens == pytest.approx(tokens - c)


def test_miss_ratio_per_group_and_errors():
    trs = random_traces(2, n=8, T=6)
    f = miss_ratio_curves(trs, [2, 8], by=["language"])
    assert sorted(set(f["language"])) == ["de", "en"]
    for lang in ["de", "en"]:
        sub = [t for t in trs if t.meta["language"] == lang]
        assert f.filter(pl.col("language") == lang).drop("language").equals(miss_ratio_curves(sub, [2, 8], by=[]))
    with pytest.raises(LocalityError, match="w_max must be integers >= 1"):
        miss_ratio_curves(trs, [0])
    with pytest.raises(LocalityError, match="no generated tokens"):
        miss_ratio_curves(random_traces(1, n=2, T=0), [4], by=[])


def test_histograms_are_the_coverage_curve():
    trs = random_traces(5, n=6, T=14)
    h = distance_histograms(trs, by=["language"])
    assert set(h["stream"]) == {"generated", "candidate"}
    tokens = {lang: sum(len(t.generated) for t in trs if t.meta["language"] == lang) for lang in ["de", "en"]}
    for (lang, stream, metric), g in h.group_by(["language", "stream", "metric"]):
        assert g["count"].sum() == tokens[lang]
        assert g["cum_fraction"][-1] == pytest.approx(1.0)
        assert g["bin_lo"][-1] is None or g["bin_lo"].null_count() == 0
        sub = [t for t in trs if t.meta["language"] == lang]
        for lo, hi, cum in g.drop_nulls("bin_lo").select("bin_lo", "bin_hi", "cum_fraction").iter_rows():
            assert hi == 2 * lo - 1
            if metric == "reuse_distance":     # P(reuse distance <= W) = coverage of the window W
                kw = {"stream": stream}
                assert cum == pytest.approx(coverage(sub, [hi], **kw)["coverage"][0])
            else:                              # P(stack distance <= C) = LRU hit rate at capacity C
                events = ref.candidate_events if stream == "candidate" else ref.generated_events
                per = ref.lru_per_step(sub, hi, events=events)
                assert cum == pytest.approx(sum(c for c, _ in per) / len(per))


def test_stack_never_exceeds_reuse_and_distinct_before():
    trs = random_traces(9, n=4, V=30)
    idx = StreamIndex(candidate_stream(trs))
    reuse, stack = idx.reuse_distance, idx.stack_distance()
    assert (stack <= reuse).all() and ((stack == 1) == (reuse == 1)).all()   # NEVER on both sides too
    per = ref.lru_per_step(trs, 10 ** 6)                       # unbounded LRU = every distinct token so far
    assert idx.distinct_before().tolist() == [a for _, a in per]
