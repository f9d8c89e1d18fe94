"""Frequency rankings (FR-Spec, VocabTrim), their files, shortlists and coverage-vs-K curves."""

import json

import numpy as np
import pytest

from specvocab.locality import (ShortlistError, count_tokens, load_ranking, ranking_from_traces, save_ranking,
                      shortlist_coverage, shortlist_coverage_by)
from specvocab.locality.shortlist import main as shortlist_main
from specvocab.locality.shortlist import shortlist
from tests import locality_reference as ref
from tests.locality_testing import random_traces


# --- static shortlists -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_ranking_matches_reference(seed):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(5, 40))
    arrays = [rng.integers(0, V, int(rng.integers(0, 50))) for _ in range(4)]
    r = count_tokens(arrays, V)
    exp_rank, exp_count = ref.frequency_ranking(arrays, V)
    assert r.height == V and r["rank"].to_list() == list(range(V))
    assert {t: k for t, k in zip(r["token_id"], r["rank"])} == exp_rank
    assert {t: c for t, c in zip(r["token_id"], r["count"]) if c} == dict(exp_count)
    ks = [0, 1, 2, V // 2, V, V + 5]
    gen = rng.integers(0, V, 60)
    f = shortlist_coverage(r, gen, ks)
    for k, cov in zip(f["k"], f["coverage"]):
        sl = set(shortlist(r, k).tolist())
        assert len(sl) == min(k, V)
        assert cov == pytest.approx(np.mean([int(v) in sl for v in gen]))


def test_ties_by_first_occurrence_and_unseen_by_id():
    r = count_tokens([np.array([4, 2, 2, 4, 7])], vocab_size=9)
    assert r["token_id"].to_list()[:3] == [4, 2, 7]          # 4 and 2 tie at 2; 4 came first
    assert r["token_id"].to_list()[3:] == [0, 1, 3, 5, 6, 8]
    assert shortlist(r, 2, always_include=[8, 4]).tolist() == [4, 2, 8]


def test_ranking_file_roundtrip_and_mismatch(tmp_path):
    trs = random_traces(1, n=4, T=10)
    r = ranking_from_traces(trs, vocab_size=12, what="prompt+generated")
    assert r["count"].sum() == sum(len(t.prompt) + len(t.generated) for t in trs)
    path = save_ranking(r, tmp_path / "freq" / "rank.parquet", tokenizer="toy-12", source="unit test")
    side = json.loads((tmp_path / "freq" / "rank.parquet.json").read_text())
    assert side["tokenizer"] == "toy-12" and side["vocab_size"] == 12
    back = load_ranking(path, tokenizer="toy-12", vocab_size=12)
    assert back.equals(r)
    with pytest.raises(ShortlistError, match="tokenizer 'toy-12', not 'llama3'"):
        load_ranking(path, tokenizer="llama3")
    with pytest.raises(ShortlistError, match="vocabulary of 12 ids but the model has 128256"):
        load_ranking(path, vocab_size=128256)
    with pytest.raises(ShortlistError, match="missing"):
        load_ranking(tmp_path / "nope.parquet")
    with pytest.raises(ShortlistError, match="outside the vocabulary"):
        count_tokens([np.array([1, 12])], vocab_size=12)
    with pytest.raises(ShortlistError, match="another tokenizer"):
        shortlist_coverage(r, np.array([3, 40]), [4])


def test_vocabtrim_ranking_covers_its_own_generations_best():
    trs = random_traces(2, n=6, V=40, T=14)
    own = ranking_from_traces(trs, 40, "generated")
    prompt = ranking_from_traces(trs, 40, "prompt")
    a = shortlist_coverage(own, trs, [5, 10])["coverage"].to_numpy()
    b = shortlist_coverage(prompt, trs, [5, 10])["coverage"].to_numpy()
    assert (a >= b).all()           # the most frequent generated tokens cover the generated tokens best
    by = shortlist_coverage_by(own, trs, ["category"], [5, 10])
    for cat, g in by.group_by("category"):
        sub = [t for t in trs if t.meta["category"] == cat[0]]
        assert g.drop("category").equals(shortlist_coverage(own, sub, [5, 10]))


def test_cli_builds_a_ranking_from_traces_and_id_arrays(tmp_path, capsys):
    from specvocab.locality import write_traces

    trs = random_traces(6, n=4, T=8)
    write_traces(trs, tmp_path / "t.parquet")
    out = shortlist_main(["--traces", str(tmp_path / "t.parquet"), "--vocab-size", "12", "--tokenizer", "toy",
                          "--out", str(tmp_path / "gen.parquet"), "--k", "3", "6"])
    assert load_ranking(out, tokenizer="toy", vocab_size=12).equals(ranking_from_traces(trs, 12, "generated"))
    ids = np.random.default_rng(0).integers(0, 12, 100)
    np.save(tmp_path / "corpus.npy", ids)
    out2 = shortlist_main(["--token-ids", str(tmp_path / "corpus.npy"), "--vocab-size", "12", "--tokenizer", "toy",
                           "--out", str(tmp_path / "corpus.parquet")])
    assert load_ranking(out2)["count"].sum() == 100
    assert "coverage" in capsys.readouterr().out


# --- the module stays token-only --------------------------------------------------------------------------

def test_text_counting_lives_in_engine_and_the_cli_says_so(tmp_path, capsys):
    import specvocab.locality.shortlist as sl

    for name in ("tokenize_texts", "ranking_from_texts", "read_texts"):
        assert not hasattr(sl, name), name               # moved to engine.jobs.frequency
    with pytest.raises(SystemExit):
        shortlist_main(["--texts", "c.jsonl", "--vocab-size", "12", "--tokenizer", "t", "--out", str(tmp_path / "r")])
    assert "unrecognized arguments: --texts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        shortlist_main(["--vocab-size", "12", "--tokenizer", "t", "--out", str(tmp_path / "r.parquet")])
    assert "python -m specvocab.engine.jobs.frequency" in capsys.readouterr().err


def test_sidecar_counts_the_distinct_ids_seen(tmp_path):
    r = count_tokens([np.array([4, 2, 2, 4, 7])], vocab_size=9)
    save_ranking(r, tmp_path / "r.parquet", tokenizer="toy")
    side = json.loads((tmp_path / "r.parquet.json").read_text())
    assert side["seen"] == 3 and side["total_tokens"] == 5 and side["vocab_size"] == 9
