"""Plain token-id streams in every `locality` analysis: the same numbers as a brute-force simulation over the
stream itself, the same as Traces built by hand, and one-line errors for input that cannot be measured.

The references here work on Python lists of ids, not on Traces: a FIFO window is the set of the last W ids
before a token, an LRU vocabulary an OrderedDict, a shortlist a Counter. A stream's first `prompt_len` ids
(default 1) are context; every later id is queried once against the ids before it in its own text.
"""

from collections import OrderedDict

import numpy as np
import polars as pl
import pytest

from specvocab.locality import (LocalityError, Trace, TraceError, as_traces, count_tokens, coverage, coverage_by,
                                distance_histograms, miss_ratio_curves, read_traces, shortlist_coverage,
                                successor_coverage, token_distances, write_traces)
from specvocab.locality.shortlist import ShortlistError, token_ranks
from tests import locality_reference as ref

WS = [1, 2, 3, 5, 8, 40]


def random_texts(seed, n=None):
    """A few texts over a small shared vocabulary, so ids repeat inside a text and across texts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5)) if n is None else n
    return [rng.integers(0, int(rng.integers(3, 9)), int(rng.integers(1, 30))).tolist() for _ in range(n)]


# --- brute-force references over lists of ids ------------------------------------------------------------

def fifo(texts, w, prompt_len=1):
    """[(covered, |window|)] per queried id: the window is the set of the last w ids before it, in its text."""
    return [(s[i] in set(s[max(0, i - w):i]), len(set(s[max(0, i - w):i])))
            for s in texts for i in range(prompt_len, len(s))]


def prompt_only(texts, w, prompt_len):
    """[(covered, |window|)] per queried id when the stream never grows past the prompt (no top-k, no drafts)."""
    return [(s[i] in set(s[:prompt_len][-w:]), len(set(s[:prompt_len][-w:])))
            for s in texts for i in range(prompt_len, len(s))]


def distances(texts):
    """[(reuse distance, stack distance)] per queried id (prompt_len 1), None for an id not seen before."""
    out = []
    for s in texts:
        for i in range(1, len(s)):
            p = max((j for j in range(i) if s[j] == s[i]), default=None)
            out.append((None, None) if p is None else (i - p, len(set(s[p + 1:i])) + 1))
    return out


def lru(texts, c):
    """[(covered, |vocabulary|)] per queried id for an LRU vocabulary of the c most recently seen distinct ids."""
    out = []
    for s in texts:
        recent = OrderedDict()
        for i, v in enumerate(s):
            if i >= 1:
                held = list(recent)[-c:]
                out.append((v in held, len(held)))
            recent.pop(v, None)
            recent[v] = True
    return out


def as_lists(ids):
    """One stream of ints as [stream]; several streams as they are."""
    return [ids] if isinstance(ids[0], int) else ids


def mean(per, j):
    return sum(x[j] for x in per) / len(per)


def hand_traces(texts, seed, k=3):
    """The texts as Traces built field by field, with made-up top-k rows and draft trees that the generated
    stream must ignore."""
    rng = np.random.default_rng(seed)
    return [Trace(prompt=s[:1], prefill_topk=np.zeros((0, k), dtype=np.int64), generated=s[1:],
                  step_topk=rng.integers(0, 50, (len(s) - 1, k)),
                  draft_tokens=[rng.integers(0, 50, 2) for _ in s[1:]]) for s in texts]


# --- the plain-token path equals the references ---------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_coverage_of_token_streams_is_the_fifo_window_over_them(seed):
    texts = random_texts(seed)
    f = coverage(texts, WS, stream="generated")
    n = sum(len(s) - 1 for s in texts)
    assert f["tokens"].to_list() == [n] * len(WS) and f["steps"].to_list() == [n] * len(WS)
    for w, cov, bonus, active in f.select("w_max", "coverage", "bonus_coverage", "mean_active_vocab").rows():
        per = fifo(texts, w)
        assert cov == pytest.approx(mean(per, 0)) and bonus == cov      # every token is its own step
        assert active == pytest.approx(mean(per, 1))


def test_one_stream_of_ints_is_one_text_in_every_form():
    s = [4, 1, 4, 2, 1, 4, 4, 3, 1]
    exp = coverage([Trace.from_tokens(s)], WS, stream="generated")
    for form in (s, tuple(s), np.array(s, dtype=np.int32), pl.Series(s), [np.int64(v) for v in s]):
        assert coverage(form, WS, stream="generated").equals(exp), type(form)
    per = fifo([s], 2)
    assert exp.filter(pl.col("w_max") == 2)["coverage"].item() == pytest.approx(mean(per, 0))


def test_several_texts_never_share_a_window():
    """The second text repeats the first: one stream per text finds no repeat, a concatenation would."""
    texts = [[1, 2, 3], [3, 2, 1]]
    f = coverage(texts, [10], stream="generated")
    assert f["coverage"].item() == 0.0 and f["tokens"].item() == 4
    for form in (np.array(texts), [np.array(t) for t in texts], (tuple(t) for t in texts)):
        assert coverage(form, [10], stream="generated").equals(f)
    assert coverage([1, 2, 3, 3, 2, 1], [10], stream="generated")["coverage"].item() == 0.6


@pytest.mark.parametrize("seed", range(4))
def test_token_path_equals_hand_built_traces(seed):
    """Token ids and Traces with the same prompt and generated tokens give identical frames wherever no top-k
    source is asked for: the generated stream, and the candidate stream with k_pre = k_ver = 0."""
    texts = [s for s in random_texts(seed) if len(s) > 1]
    hand = hand_traces(texts, seed)
    assert coverage(texts, WS, stream="generated").equals(coverage(hand, WS, stream="generated"))
    assert token_distances(texts, by=()).equals(token_distances(hand, by=()))
    assert miss_ratio_curves(texts, [1, 2, 4], by=(), stream="generated").equals(
        miss_ratio_curves(hand, [1, 2, 4], by=(), stream="generated"))
    # k_pre = k_ver = 0: the candidate stream is the prompt (and the hand traces' draft trees)
    no_drafts = [Trace(t.prompt, t.prefill_topk, t.generated, t.step_topk) for t in hand]
    assert coverage(texts, WS, k_pre=0, k_ver=0).equals(coverage(no_drafts, WS, k_pre=0, k_ver=0))


@pytest.mark.parametrize("prompt_len", [1, 2, 4])
def test_prompt_len_moves_the_first_query(prompt_len):
    texts = [[3, 1, 3, 2, 2, 1, 3, 0, 1], [2, 2, 0, 1, 2, 0, 0]]
    traces = [Trace.from_tokens(s, prompt_len=prompt_len) for s in texts]
    assert [t.prompt.tolist() for t in traces] == [s[:prompt_len] for s in texts]
    assert as_traces(texts, prompt_len=prompt_len)[1].generated.tolist() == texts[1][prompt_len:]
    f = coverage(traces, WS, stream="generated")
    ctx = coverage(traces, WS, k_pre=0, k_ver=0)
    for w in WS:
        per, only = fifo(texts, w, prompt_len), prompt_only(texts, w, prompt_len)
        assert f.filter(pl.col("w_max") == w)["coverage"].item() == pytest.approx(mean(per, 0))
        assert ctx.filter(pl.col("w_max") == w)["coverage"].item() == pytest.approx(mean(only, 0))
        assert ctx.filter(pl.col("w_max") == w)["mean_active_vocab"].item() == pytest.approx(mean(only, 1))


@pytest.mark.parametrize("seed", range(6))
def test_distances_of_token_streams(seed):
    texts = random_texts(seed)
    d = token_distances(texts, by=())
    assert list(zip(d["reuse_distance"].to_list(), d["stack_distance"].to_list())) == distances(texts)
    assert d["token"].to_list() == [v for s in texts for v in s[1:]]
    assert d["trace"].to_list() == [i for i, s in enumerate(texts) for _ in s[1:]]
    # the default grouping columns exist for ids too (null: a stream has no meta)
    grouped = token_distances(texts)
    assert grouped.select("category", "language").null_count().row(0) == (len(d), len(d))
    assert grouped.drop("category", "language").equals(d)
    h = distance_histograms(texts, by=(), streams=["generated"]).filter(pl.col("metric") == "stack_distance")
    stack = [b for _, b in distances(texts)]
    for lo, hi, count in h.select("bin_lo", "bin_hi", "count").rows():
        assert count == sum(1 for v in stack if (v is None if lo is None else v is not None and lo <= v <= hi))


@pytest.mark.parametrize("seed", range(6))
def test_lru_vs_fifo_of_token_streams(seed):
    texts = random_texts(seed)
    caps = [1, 2, 3, 6]
    f = miss_ratio_curves(texts, caps, by=(), stream="generated")
    for c, lru_size, lru_miss, w, fifo_size, fifo_miss in f.select(
            "capacity", "lru_mean_active_vocab", "lru_miss_ratio", "fifo_w_max", "fifo_mean_active_vocab",
            "fifo_miss_ratio").rows():
        per = lru(texts, c)
        assert lru_size == pytest.approx(mean(per, 1)) and lru_miss == pytest.approx(1 - mean(per, 0))
        # the FIFO window is the smallest w_max whose mean size reaches the LRU's
        assert mean(fifo(texts, w), 1) >= mean(per, 1) - 1e-12
        assert w == 1 or mean(fifo(texts, w - 1), 1) < mean(per, 1) - 1e-12
        assert fifo_size == pytest.approx(mean(fifo(texts, w), 1))
        assert fifo_miss == pytest.approx(1 - mean(fifo(texts, w), 0))


def test_lru_keeps_what_a_fifo_window_of_equal_size_loses():
    f = miss_ratio_curves([1, 2, 3, 3, 3, 2], [2], by=(), stream="generated")
    assert f.select("lru_miss_ratio", "fifo_w_max", "fifo_miss_ratio").row(0) == \
        pytest.approx((1 - mean(lru([[1, 2, 3, 3, 3, 2]], 2), 0), 3, 1 - mean(fifo([[1, 2, 3, 3, 3, 2]], 3), 0)))
    assert f["lru_miss_ratio"].item() < f["fifo_miss_ratio"].item()


@pytest.mark.parametrize("seed", range(4))
def test_shortlist_coverage_of_token_streams_counts_every_id(seed):
    """A static shortlist needs no context: every id of every text is counted, the first included."""
    texts = random_texts(seed)
    V = 9
    r = count_tokens([np.array(s[: len(s) // 2]) for s in texts], V)
    rank, _ = ref.frequency_ranking([s[: len(s) // 2] for s in texts], V)
    ks = [0, 1, 2, 5, V]
    f = shortlist_coverage(r, texts, ks)
    ids = [v for s in texts for v in s]
    assert f["tokens"].to_list() == [len(ids)] * len(ks)
    assert f["coverage"].to_list() == pytest.approx([sum(rank[v] < k for v in ids) / len(ids) for k in ks])
    assert shortlist_coverage(r, ids, ks).equals(f)
    assert shortlist_coverage(r, texts[0], ks)["tokens"].to_list() == [len(texts[0])] * len(ks)


def test_coverage_by_groups_texts_by_meta():
    texts = {"code": [[1, 2, 1, 2, 1], [5, 5, 5]], "chat": [[1, 2, 3, 4], [4, 3, 2, 1, 4]]}
    traces = [Trace.from_tokens(s, meta={"category": c}) for c, ss in texts.items() for s in ss]
    f = coverage_by(traces, ["category"], [2], stream="generated")
    for c, ss in texts.items():
        assert f.filter(pl.col("category") == c)["coverage"].item() == pytest.approx(mean(fifo(ss, 2), 0))
    # ids without meta form one group (category null), whether one stream or several
    for ids in ([s for ss in texts.values() for s in ss], [4, 1, 4, 2, 1, 4]):
        g = coverage_by(ids, ["category"], [2], stream="generated")
        assert g["category"].to_list() == [None]
        assert g["coverage"].item() == pytest.approx(mean(fifo(as_lists(ids), 2), 0))


def test_token_traces_survive_a_trace_file(tmp_path):
    traces = [Trace.from_tokens([1, 2, 1, 3], meta={"category": "toy"}), Trace.from_tokens([7])]
    back = read_traces(write_traces(traces, tmp_path / "t.parquet"))
    for a, b in zip(traces, back):
        assert a.prompt.tolist() == b.prompt.tolist() and a.generated.tolist() == b.generated.tolist()
        assert b.step_topk.shape == a.step_topk.shape and b.k == 0 and b.meta == a.meta


# --- errors ------------------------------------------------------------------------------------------------

def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("call", [
    lambda x: coverage(x, [4]),
    lambda x: coverage(x, [4], k_pre=0),
    lambda x: miss_ratio_curves(x, [2], by=()),
    lambda x: distance_histograms(x, by=()),
    lambda x: token_distances(x, "candidate", by=()),
])
def test_top_k_sources_without_rows_name_the_fix(call):
    with pytest.raises(LocalityError) as err:
        call([1, 2, 1, 3])
    msg = _one_line(err)
    assert "traces[0] has no top-k rows" in msg
    assert "stream='generated'" in msg and "k_pre=0, k_ver=0" in msg and "specvocab record" in msg


def test_the_missing_row_error_names_the_source_asked_for():
    with pytest.raises(LocalityError, match=r"top-3 of every prefill row \(k_pre=3\)"):
        coverage([[5, 6], [1, 2, 1]], [4])
    with pytest.raises(LocalityError, match=r"traces\[1\] has no top-k rows .* verify row \(k_ver=2\)"):
        coverage([Trace.from_tokens([5]), Trace.from_tokens([1, 2, 1])], [4], k_pre=0, k_ver=2)
    # "ctx" takes no verify rows, a recorded trace keeps its own message
    assert coverage([1, 2, 1, 3], [4], k_pre=0, k_ver=2, sources="ctx")["tokens"].item() == 3
    with pytest.raises(TraceError, match="k_pre=4 is larger than the K=3"):
        coverage(hand_traces([[1, 2, 1]], 0), [4], k_pre=4)


def test_the_successor_store_needs_rows():
    with pytest.raises(LocalityError) as err:
        successor_coverage([1, 2, 1, 3])
    assert "successor store" in _one_line(err) and "specvocab record" in _one_line(err)


@pytest.mark.parametrize("bad, match", [
    ([1, [2, 3]], r"traces mixes kinds: traces\[0\] is a token id but traces\[1\] is a sequence of token ids"),
    ([hand_traces([[1, 2]], 0)[0], [1, 2]], r"traces\[0\] is a Trace but traces\[1\] is a sequence"),
    ([[1, 2], 3], r"traces\[0\] is a sequence of token ids but traces\[1\] is a token id"),
    ([4, 1, -2, 3], r"traces: token id -2 at position 2 is negative"),
    ([[1, 2], [3, -1]], r"traces\[1\]: token id -1 at position 1 is negative"),
    (np.array([[1, 2], [3, -5]]), r"traces\[1\]: token id -5 at position 1 is negative"),
    ([1.0, 2.0], r"traces\[0\] has type float"),
    (np.array([1.5, 2.0]), r"token ids must be integers, got dtype float64"),
    ([True, False], r"traces\[0\] has type bool"),
    ("1 2 3", r"traces has type str"),
    (7, r"traces has type int"),
    ([[1, 2], []], r"traces\[1\]: a token stream of 0 id\(s\) is shorter than prompt_len=1"),
    ([[[1, 2]]], r"traces\[0\]: a token stream must be 1-D"),
    (pl.DataFrame({"prompt": [[1]]}), r"traces is a polars DataFrame"),
])
def test_bad_token_input_is_refused_in_one_line(bad, match):
    with pytest.raises(TraceError, match=match) as err:
        coverage(bad, [4], stream="generated")
    _one_line(err)


def test_empty_input_and_bad_prompt_len():
    with pytest.raises(LocalityError, match="empty"):
        coverage([], [4], stream="generated")
    with pytest.raises(TraceError, match="prompt_len must be an int >= 1"):
        Trace.from_tokens([1, 2], prompt_len=0)
    with pytest.raises(TraceError, match="shorter than prompt_len=3"):
        Trace.from_tokens([1, 2], prompt_len=3)


def test_shortlist_refuses_bad_ids():
    r = count_tokens([[1, 2]], 4)
    with pytest.raises(ShortlistError, match=r"tokens\[1\]: token id -1 at position 0 is negative"):
        shortlist_coverage(r, [[1], [-1]], [1])
    with pytest.raises(TraceError, match=r"tokens mixes kinds"):
        shortlist_coverage(r, [Trace.from_tokens([1, 2]), [1, 2]], [1])
    with pytest.raises(ShortlistError, match="token id -3 is outside"):
        token_ranks(r, np.array([1, -3]))
