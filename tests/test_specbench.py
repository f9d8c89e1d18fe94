"""Spec-Bench model-answer files (`engine.specbench`, the job `engine.jobs.specbench`), read back by a reader written from
Spec-Bench's public field names (its evaluation/speed.py and equal.py: question_id, category,
choices[0].turns / decoding_steps / new_tokens / wall_time / accept_lengths); and the per-step sizes they
carry (`GenerateResult.step_sizes`, bench's `step_sizes` column) on every method, transformers' prompt
lookup included."""

import json

import numpy as np
import polars as pl
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate
from specvocab.engine.jobs.bench import run_bench
from specvocab.engine.jobs.specbench import main as specbench_main
from specvocab.engine.specbench import SpecBenchError, answer_files, write_answer_files
from specvocab.engine.models import load_model
from specvocab.engine.prompts import ByteTokenizer, decode_answer
from tests.engine_testing import untie_head

SPEC_BENCH_KEYS = {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
CHOICE_KEYS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}


# --- a reader written from Spec-Bench's field names (evaluation/speed.py, evaluation/equal.py) -------------

def read_answers(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def spec_bench_speed(path, base_path):
    """(mean accepted tokens, tokens/s, baseline tokens/s, speedup) as speed.py computes them ("overall"),
    with the baseline's tokens from its new_tokens (speed.py re-tokenises the baseline's text instead)."""
    speeds, accept = [], []
    for q in read_answers(path):
        c = q["choices"][0]
        accept.extend(c["accept_lengths"])
        speeds.append(sum(c["new_tokens"]) / sum(c["wall_time"]))
    base = [sum(q["choices"][0]["new_tokens"]) / sum(q["choices"][0]["wall_time"]) for q in read_answers(base_path)]
    return float(np.mean(accept)), float(np.mean(speeds)), float(np.mean(base)), float(np.mean(speeds) / np.mean(base))


def spec_bench_equal(path1, path2):
    """equal.py: the str() of each line's choices[0].turns, line by line."""
    a = [str(q["choices"][0]["turns"]) for q in read_answers(path1)]
    b = [str(q["choices"][0]["turns"]) for q in read_answers(path2)]
    return all(x == y for x, y in zip(a, b))


# --- fixtures ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    model, tok, info = load_model("random-llama", vocab_size=512, num_layers=2, seed=2)
    return untie_head(model), tok, info


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    rows = [
        {"question_id": 12, "category": "writing", "turns": ["abc abc abc", "and once more: abc abc"]},
        {"question_id": 3, "category": "math_reasoning", "turns": ["1 2 3 1 2 3 1 2"]},
        {"question_id": 7, "category": "writing", "turns": ["the cat sat on the mat, the cat sat on the"]},
    ]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def rows(loaded, prompt_file):
    return run_bench(methods="ar,pld,hf-prompt-lookup", prompts=str(prompt_file), max_new_tokens=12, repeats=2,
                     loaded=loaded, progress=False, show=False, config={"draft_size": 4})


def byte_decode(model, ids):
    return decode_answer(None, ids)


# --- the per-step sizes --------------------------------------------------------------------------------------

def test_every_row_has_step_sizes_that_add_up(rows):
    """One size per step (the prefill's step 0 commits 1), summing to the row's new tokens - on every method,
    transformers' prompt lookup included (its sizes come from each forward's first position)."""
    assert set(rows["method"]) == {"ar", "pld", "hf-prompt-lookup"}
    for r in rows.iter_rows(named=True):
        sizes = r["step_sizes"]
        assert len(sizes) == r["steps"] and sum(sizes) == r["new_tokens"] and sizes[0] == 1, r["method"]
        assert min(sizes) >= 1
        if r["method"] == "ar":
            assert sizes == [1] * r["new_tokens"]
    drafted = rows.filter(pl.col("method") != "ar")
    assert any(max(s) > 1 for s in drafted["step_sizes"]), "the fixture's prompts repeat: pld must accept drafts"


def test_step_sizes_are_the_recorded_steps_commits(loaded):
    """The sizes equal what each recorded step committed (StepRecord.new_tokens), the last one cut at
    max_new_tokens: run once, then again with max_new_tokens ending inside a step that committed several
    tokens - a mutant that appends the uncut count, or leaves out the prefill's token, fails."""
    model, tok, info = loaded
    prompt = torch.tensor(list(b"the cat sat on the mat, the cat sat on the"))    # this model falls into a loop
    cfg = SpecConfig.preset("pld", max_new_tokens=40, draft_size=4, record=True)
    full = generate(model, prompt, cfg)
    committed = [1] + [len(r.new_tokens) for r in full.records]          # before the max_new_tokens cut
    assert full.step_sizes[:-1] == committed[:-1] and full.step_sizes[-1] <= committed[-1]
    ends = np.cumsum(full.step_sizes)
    multi = [i for i, n in enumerate(full.step_sizes) if n > 1]
    assert multi, "pld must accept a draft once the model loops"
    cut = int(ends[multi[0]] - 1)                                   # one token short of that step's end
    res = generate(model, prompt, cfg.replace(max_new_tokens=cut))
    assert res.step_sizes == full.step_sizes[:multi[0]] + [full.step_sizes[multi[0]] - 1]
    assert sum(res.step_sizes) == res.new_tokens == cut


# --- the answer files ----------------------------------------------------------------------------------------

def test_answer_files_in_spec_bench_fields(rows, tmp_path):
    written = write_answer_files(rows, tmp_path, byte_decode)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in written)
    model = rows["model"][0]
    assert names == sorted(f"{model}/{rows['prompt_set'][0]}/{r}.jsonl" for r in ("ar", "pld", "hf-prompt-lookup"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert {v["method"] for v in index.values()} == {"ar", "pld", "hf-prompt-lookup"}
    for path in written:
        answers = read_answers(path)
        assert [a["question_id"] for a in answers] == [3, 7, 12]        # ints, sorted as Spec-Bench reorganises
        assert [a["category"] for a in answers] == ["math_reasoning", "writing", "writing"]
        run = path.stem
        for a in answers:
            assert set(a) == SPEC_BENCH_KEYS and a["model_id"] == f"{model}-{run}"
            assert [c["index"] for c in a["choices"]] == [0, 1]          # one choice per repeat
            for c in a["choices"]:
                assert set(c) == CHOICE_KEYS
                mine = rows.filter((pl.col("method") == run) & (pl.col("prompt_id") == str(a["question_id"]))
                                   & (pl.col("repeat") == c["index"])).sort("turn")
                # per turn, in turn order, from this repeat's own rows (a mix-up of turns or repeats fails here)
                assert c["turns"] == [byte_decode(model, o) for o in mine["output_ids"].to_list()]
                assert c["new_tokens"] == mine["new_tokens"].to_list()
                assert c["decoding_steps"] == mine["steps"].to_list()
                assert c["wall_time"] == pytest.approx((mine["wall_s"] - mine["uncharged_s"]).to_list())
                assert c["accept_lengths"] == [s for sizes in mine["step_sizes"].to_list() for s in sizes]
                assert len(c["accept_lengths"]) == sum(c["decoding_steps"])
                assert sum(c["accept_lengths"]) == sum(c["new_tokens"])


def test_spec_bench_scripts_read_what_our_metrics_say(rows, tmp_path):
    """speed.py's mean accepted tokens is our tau (tokens per step, bonus included) over the rows it reads
    (choices[0] = repeat 0), its speedup the mean of per-question tokens/s over ar's; equal.py finds pld
    equal to ar (lossless) and sees a changed answer (power)."""
    files = {p.stem: p for p in write_answer_files(rows, tmp_path, byte_decode)}
    accept, tps, base_tps, speedup = spec_bench_speed(files["pld"], files["ar"])
    first = rows.filter(pl.col("repeat") == 0)
    pld, ar = first.filter(pl.col("method") == "pld"), first.filter(pl.col("method") == "ar")
    assert accept == pytest.approx(pld["new_tokens"].sum() / pld["steps"].sum())
    assert spec_bench_speed(files["ar"], files["ar"])[0] == 1.0

    def per_question(frame):
        g = frame.group_by("prompt_id").agg(pl.col("new_tokens").sum() / (pl.col("wall_s") - pl.col("uncharged_s")).sum())
        return float(g["new_tokens"].mean())
    assert tps == pytest.approx(per_question(pld)) and base_tps == pytest.approx(per_question(ar))
    assert speedup == pytest.approx(tps / base_tps)
    assert spec_bench_equal(files["ar"], files["pld"]) and spec_bench_equal(files["ar"], files["hf-prompt-lookup"])
    changed = tmp_path / "changed.jsonl"
    answers = read_answers(files["pld"])
    answers[1]["choices"][0]["turns"][0] += "!"
    changed.write_text("".join(json.dumps(a) + "\n" for a in answers))
    assert not spec_bench_equal(files["ar"], changed)


def test_rows_from_before_step_sizes(rows):
    """An old results file (no step_sizes): ar's sizes are known (one per step), a drafting run's are not -
    refused, naming the run and the fix, rather than written with made-up sizes."""
    old = rows.with_columns(pl.lit(None, dtype=pl.List(pl.Int64)).alias("step_sizes"))
    ar = answer_files(old.filter(pl.col("method") == "ar"), byte_decode)
    (_, lines), = ar.values()
    assert all(set(c["accept_lengths"]) == {1} for a in lines for c in a["choices"])
    drafted = old.filter((pl.col("method") == "pld") & (pl.col("steps") < pl.col("new_tokens")))
    assert drafted.height
    with pytest.raises(SpecBenchError, match="pld.*no step_sizes.*bench it again"):
        answer_files(old.filter(pl.col("method") == "pld"), byte_decode)
    with pytest.raises(SpecBenchError, match="lack.*output_ids"):
        answer_files(rows.drop("output_ids"), byte_decode)


def test_one_run_under_two_configs_gets_two_files(rows):
    """A sweep's bench rows may hold one run label under several configs (a `config` column): each gets its
    own file, named by the config's hash, instead of one file mixing them."""
    two = pl.concat([rows.filter(pl.col("method") == "pld").with_columns(pl.lit(c).alias("config"))
                     for c in ('{"draft_size": 2}', '{"draft_size": 4}')])
    files = answer_files(two, byte_decode)
    assert len(files) == 2 and all("/pld-" in k for k in files)
    assert {key["config"] for key, _ in files.values()} == {'{"draft_size": 2}', '{"draft_size": 4}'}


def test_the_command_on_a_bench_folder(loaded, prompt_file, tmp_path, monkeypatch):
    out = tmp_path / "bench"
    run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
              progress=False, show=False)
    # the command loads each model's tokenizer by the rows' model name; the random model's is the byte one
    monkeypatch.setattr("specvocab.engine.specbench.load_model", lambda name: (loaded[0], None, loaded[2]))
    written = specbench_main([str(out), "--out", str(tmp_path / "answers")])
    assert sorted(p.stem for p in written) == ["ar", "pld"]
    frame = pl.read_parquet(out / "results.parquet").filter(pl.col("method") == "ar", pl.col("prompt_id") == "3")
    ar = next(p for p in written if p.stem == "ar")
    assert read_answers(ar)[0]["choices"][0]["turns"] == [ByteTokenizer().decode(frame["output_ids"][0].to_list()).strip()]
    with pytest.raises(SpecBenchError, match="no results.parquet"):
        specbench_main([str(tmp_path), "--out", str(tmp_path / "x")])
