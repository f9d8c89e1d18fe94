"""`engine.bench` on a tiny random model (byte-level prompts): rows, Parquet file, summary table, crash
safety and resume, and clear errors for methods that cannot run."""

import json

import polars as pl
import pytest

import engine.bench as bench
from engine.bench import BenchError, RESULTS_FILE, run_bench, summarize
from engine.models import load_model
from tests.engine_testing import untie_head

METHODS = ["ar", "pld", "hf-prompt-lookup"]


@pytest.fixture(scope="module")
def loaded():
    model, tok, info = load_model("random-llama", vocab_size=512, num_layers=2, seed=2)
    return untie_head(model), tok, info


@pytest.fixture()
def prompt_file(tmp_path):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["the cat sat on the mat, the cat sat on the"]},
        {"question_id": 2, "category": "writing", "turns": ["abc abc abc", "and once more: abc abc"]},
        {"question_id": 3, "category": "math", "turns": ["1 2 3 1 2 3 1 2"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_run_bench_rows_file_and_table(loaded, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    df = run_bench(methods=",".join(METHODS), prompts=str(prompt_file), max_new_tokens=8, repeats=2,
                   out=out, loaded=loaded, progress=False)
    # 4 turns (prompt 2 has two) x 3 methods x 2 repeats
    assert df.height == 4 * len(METHODS) * 2
    for col in ("method", "question_id", "category", "repeat", "new_tokens", "steps", "wall_s", "tau",
                "output_ids", "model", "language", "draft_s", "verify_s", "prefill_s", "g", "turn"):
        assert col in df.columns
    assert df["new_tokens"].to_list() == [len(o) for o in df["output_ids"].to_list()]
    assert (df.filter(pl.col("method") == "ar")["tau"] == 1.0).all()
    on_disk = pl.read_parquet(out / RESULTS_FILE)
    assert on_disk.equals(df)
    table = summarize(df)
    assert set(table["category"]) == {"writing", "math", "all"}
    assert table["lossless"].to_list() == [True] * table.height
    ar = table.filter(pl.col("method") == "ar")
    assert (ar["speedup"] == 1.0).all() and (ar["tau"] == 1.0).all()
    printed = capsys.readouterr().out
    assert "lossless" in printed and "hf-prompt-lookup" in printed and "writing" in printed


def test_summary_flags_a_differing_output(loaded, prompt_file):
    df = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, loaded=loaded, progress=False,
                   show=False, warmup=0)
    broken = df.with_columns(
        output_ids=pl.when((pl.col("method") == "pld") & (pl.col("question_id") == "3"))
        .then(pl.lit([0, 0], dtype=pl.List(pl.Int64))).otherwise(pl.col("output_ids")))
    table = summarize(broken)
    lossless = {(r["category"], r["method"]): r["lossless"] for r in table.iter_rows(named=True)}
    assert lossless[("math", "pld")] is False and lossless[("all", "pld")] is False
    assert lossless[("writing", "pld")] is True


def test_a_crash_keeps_finished_runs_and_resume_completes(loaded, prompt_file, tmp_path, monkeypatch):
    out = tmp_path / "crash"
    real, calls = bench.generate, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "generate", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
                  progress=False, show=False, warmup=0)
    saved = pl.read_parquet(out / RESULTS_FILE)
    # runs finished: prompt 1 (ar, pld), prompt 2 ar with its two turns; prompt 2 pld crashed
    assert saved.height == 4 and saved.filter(pl.col("question_id") == "2")["method"].to_list() == ["ar", "ar"]
    monkeypatch.setattr(bench, "generate", real)
    full = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
                     progress=False, show=False, warmup=0, resume=True)
    assert full.height == 4 * 2
    assert full.unique(["method", "question_id", "turn", "repeat"]).height == full.height


def test_methods_that_cannot_run_are_refused_up_front(loaded, prompt_file):
    with pytest.raises(BenchError, match="not-a-drafter.*available"):
        run_bench(methods="ar,not-a-drafter", prompts=str(prompt_file), loaded=loaded, progress=False)
    with pytest.raises(BenchError, match="no methods"):
        run_bench(methods="", prompts=str(prompt_file), loaded=loaded)
    with pytest.raises(BenchError, match="pld_num_draft"):
        run_bench(methods="pld", prompts=str(prompt_file), loaded=loaded, config={"pld_num_draft": 0})


def test_cli_parses_into_run_bench(monkeypatch):
    got = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: got.update(kw))
    bench.main(["--model", "random-llama", "--methods", "ar,pld", "--per-category", "2", "--max-new-tokens", "16",
                "--set", "pld_num_draft=5", "--set", "vocab=microspec", "--categories", "math,qa"])
    assert got["methods"] == "ar,pld" and got["per_category"] == 2 and got["max_new_tokens"] == 16
    assert got["config"] == {"pld_num_draft": 5, "vocab": "microspec"} and got["categories"] == ["math", "qa"]
    with pytest.raises(BenchError, match="FIELD=VALUE"):
        bench.main(["--set", "no_such_field=1"])
