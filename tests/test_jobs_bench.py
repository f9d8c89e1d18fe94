"""`engine.jobs.bench` on a tiny random model (byte-level prompts): rows, Parquet file, summary table, crash
safety and resume (and refusing an old-format file), clear errors for methods that cannot run; outputs that
differ from ar's (`engine.divergence`: the ulp bound, verdicts and first divergent token on a hand-made frame,
the run's "exact" / "near-tie" / "mismatch", ar's margin against the model's own logits - and mutants that
measure one token early or late failing that check -, a later turn after a diverged one, only differing rows
paying a forward); drafter x
vocab runs (policy / vocab_size / run columns, phase columns that add up, policy statistics, lossless
against ar, run keys with the run label, comparisons); Table 2 on one eagle head (full, frspec, dynaspec
- unsized and dynaspec:N, sized in tokens - and microspec: the router phase, the head and what was compared
in the printout, the comparison pairs); and (slow) the same on SmolLM2 with its real tokenizer.

(Over 600 lines on purpose: every behaviour of the bench job, on the one random model fixture it shares.)
"""

import json
from collections import Counter

import numpy as np
import polars as pl
import pytest
import torch

import specvocab.engine.jobs.bench as bench
import specvocab.engine.divergence as divergence
import specvocab.engine.resolve as resolve
from specvocab.engine.calibration import NO_CALIBRATION
from specvocab.engine.jobs.bench import (BenchError, PHASES, RESULTS_FILE, compare_vocabs, plan_runs, run_bench, summarize)
from specvocab.engine.divergence import (NEAR_TIE_ULPS, DivergenceError, classify, diagnose_rows, first_divergence,
                               near_tie_bound, ulp)
from specvocab.engine.artifacts import head_fingerprint
from specvocab.engine.vocab.dynaspec_fit import spherical_kmeans
from specvocab.engine.vocab.dynaspec import (DynaSpecError, FittedDynaSpec, Router, k_max_for_tokens, save_dynaspec,
                                   tokens_for_k_max)
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.target import pads_rows
from specvocab.engine.jobs.frequency import corpus_texts
from specvocab.engine.prompts import ByteTokenizer, decode_answer, encode_prompt, load_prompts
from specvocab.locality.shortlist import load_ranking
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


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A private specvocab cache, so default rankings are counted here and not shared with other runs."""
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    return tmp_path / "cache"


def test_run_bench_rows_file_and_table(loaded, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    df = run_bench(methods=",".join(METHODS), prompts=str(prompt_file), max_new_tokens=8, repeats=2,
                   out=out, loaded=loaded, progress=False, calibration=NO_CALIBRATION)   # the methods' defaults
    # 4 turns (prompt 2 has two) x 3 methods x 2 repeats
    assert df.height == 4 * len(METHODS) * 2
    for col in ("method", "prompt_id", "category", "repeat", "new_tokens", "steps", "wall_s", "tau",
                "output_ids", "model", "language", "draft_s", "verify_s", "prefill_s", "g", "turn", "run", "policy",
                "vocab_size", "draft_size"):
        assert col in df.columns
    assert "question_id" not in df.columns and "vocab" not in df.columns
    turns = df.filter(pl.col("method") == "ar").group_by("prompt_id").agg(pl.col("turn").unique().sort())
    assert dict(turns.rows()) == {"1": [1], "2": [1, 2], "3": [1]}             # MT-Bench's "turn 1", "turn 2"
    assert (df["policy"] == "full").all() and df["vocab_size"].is_null().all() and (df["run"] == "full").all()
    pads = pads_rows(loaded[0])                       # fp32: padded on oneDNN, unpadded on the fp32 kernel
    assert df.select("method", "draft_size").unique(maintain_order=True).rows() == \
        [("ar", None), ("pld", 15 if pads else 10), ("hf-prompt-lookup", 10)]   # each method's default, resolved
    # (pld's 10 raised to its row bucket's edge where steps are padded, engine.harness.bucket_edge;
    # hf-prompt-lookup runs transformers)
    assert df["new_tokens"].to_list() == [len(o) for o in df["output_ids"].to_list()]
    assert (df.filter(pl.col("method") == "ar")["tau"] == 1.0).all()
    on_disk = pl.read_parquet(out / RESULTS_FILE)
    assert on_disk.equals(df)
    table = summarize(df)
    assert set(table["task"]) == {"writing", "math", "all"}
    assert table["lossless"].to_list() == ["exact"] * table.height
    assert df["verdict"].to_list() == ["exact"] * df.height and df["first_divergence"].is_null().all()
    assert on_disk["verdict"].to_list() == df["verdict"].to_list()                # diagnosed before each write
    ar = table.filter(pl.col("method") == "ar")
    assert (ar["speedup"] == 1.0).all() and (ar["tau"] == 1.0).all()
    printed = capsys.readouterr().out
    assert "lossless" in printed and "hf-prompt-lookup" in printed and "writing" in printed
    # how the target ran rides on every row and in the header: native (fixed-shape) where it applies
    assert df["backend"].unique().to_list() == ["native"] and "native target forward" in printed
    hf = run_bench(methods="ar", prompts=str(prompt_file), max_new_tokens=4, loaded=loaded, progress=False,
                   config={"backend": "hf"}, show=False)
    assert hf["backend"].unique().to_list() == ["hf"]


def test_summary_flags_a_differing_output(loaded, prompt_file):
    df = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, loaded=loaded, progress=False,
                   show=False, warmup=0)
    broken = df.with_columns(
        output_ids=pl.when((pl.col("method") == "pld") & (pl.col("prompt_id") == "3"))
        .then(pl.lit([0, 0], dtype=pl.List(pl.Int64))).otherwise(pl.col("output_ids")))
    table = summarize(broken)
    lossless = {(r["task"], r["method"]): r["lossless"] for r in table.iter_rows(named=True)}
    # the stored verdict "exact" predates the edit: not trusted; a difference never diagnosed is a mismatch
    assert lossless[("math", "pld")] == "mismatch" and lossless[("all", "pld")] == "mismatch"
    assert lossless[("writing", "pld")] == "exact" and lossless[("all", "ar")] == "exact"
    (ar3,) = broken.filter((pl.col("method") == "ar") & (pl.col("prompt_id") == "3"))["output_ids"].to_list()
    (line,) = bench.divergence_lines(broken)
    pos = next((i for i, t in enumerate(ar3[:2]) if t != 0), 2)           # [0, 0] against ar's 6 tokens
    assert line == f"pld full: prompt 3, turn 1, repeat 0: first divergent token {pos}, ar margin n/a (not " \
                   f"diagnosed: `diagnose`) -> mismatch"
    # a results file from before the diagnosis columns reads as before
    old = df.drop(*bench.DIAGNOSIS)
    assert summarize(old)["lossless"].to_list() == ["exact"] * summarize(old).height


def test_a_crash_keeps_finished_runs_and_resume_completes(loaded, prompt_file, tmp_path, monkeypatch):
    out = tmp_path / "crash"
    real, calls = bench.generate, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "generate", flaky)
    with pytest.raises(bench.RunsFailed, match="pld full failed on prompt 2: RuntimeError: simulated crash"):
        run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
                  progress=False, show=False, warmup=0)
    saved = pl.read_parquet(out / RESULTS_FILE)
    # runs finished: prompt 1 (ar, pld), prompt 2 ar with its two turns, prompt 3 ar; pld crashed on prompt 2
    # and skipped the rest, ar went on
    assert saved.height == 5 and saved.filter(pl.col("prompt_id") == "2")["method"].to_list() == ["ar", "ar"]
    assert saved.filter(pl.col("method") == "pld")["prompt_id"].to_list() == ["1"]
    monkeypatch.setattr(bench, "generate", real)
    saved.drop(*bench.DIAGNOSIS).write_parquet(out / RESULTS_FILE)   # written before the diagnosis columns
    full = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
                     progress=False, show=False, warmup=0, resume=True)
    assert full.height == 4 * 2
    assert full["verdict"].to_list() == ["exact"] * full.height          # the resumed rows diagnosed too
    assert full.unique(["method", "prompt_id", "turn", "repeat"]).height == full.height
    assert (full["run"] == "full").all()
    # a results file from before prompt_id / policy (question_id, vocab, turns from 0) is refused
    saved.rename({"prompt_id": "question_id", "run": "vocab"}).drop("policy", "vocab_size").with_columns(
        pl.col("turn") - 1).write_parquet(out / RESULTS_FILE)
    with pytest.raises(BenchError, match="older engine.jobs.bench.*new --out folder"):
        run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=6, out=out, loaded=loaded,
                  progress=False, show=False, warmup=0, resume=True)



def test_a_failing_method_keeps_the_other_methods_rows_and_the_command_fails_at_the_end(loaded, prompt_file,
                                                                                      tmp_path, monkeypatch, capsys):
    """pld raises on every prompt (warm-up included) while ar and hf-prompt-lookup run: one stderr line names pld
    and the cause, the others' rows are written and summarised, and the command exits non-zero at the end.
    Mutants checked: the failure re-raised at once (ar's later rows lost), the failed method retried on every
    prompt (more than one line), no error at the end (exit 0)."""
    real = bench.generate

    def pld_fails(model, ids, cfg, **kw):
        if cfg.method == "pld":
            raise RuntimeError("no room for the chain\nsecond line")
        return real(model, ids, cfg, **kw)
    monkeypatch.setattr(bench, "generate", pld_fails)
    monkeypatch.setattr(bench, "load_model", lambda *a, **kw: loaded)
    out = tmp_path / "cli"
    status = bench.run_main(bench.main, ["--model", "random-llama", "--methods", "ar,pld,hf-prompt-lookup",
                                         "--prompts", str(prompt_file), "--max-new-tokens", "6", "--out", str(out)])
    err = capsys.readouterr()
    assert status != 0
    lines = [x for x in err.err.splitlines() if "failed on prompt" in x]
    assert lines[0] == ("[specvocab] bench: pld full failed on prompt 1: RuntimeError: no room for the chain; its "
                        "other prompts are skipped, the other runs go on")
    assert len(lines) == 2 and lines[1].startswith("error: 1 run(s) failed, the others' rows were kept: pld full")
    saved = pl.read_parquet(out / RESULTS_FILE)
    assert Counter(saved["method"].to_list()) == {"ar": 4, "hf-prompt-lookup": 4}      # 4 turns each, no pld
    assert saved["verdict"].to_list() == ["exact"] * saved.height
    assert "hf-prompt-lookup" in err.out and "lossless" in err.out                  # the others summarised


def test_methods_that_cannot_run_are_refused_up_front(loaded, prompt_file):
    with pytest.raises(BenchError, match="not-a-drafter.*available"):
        run_bench(methods="ar,not-a-drafter", prompts=str(prompt_file), loaded=loaded, progress=False)
    with pytest.raises(BenchError, match="no methods"):
        run_bench(methods="", prompts=str(prompt_file), loaded=loaded)
    with pytest.raises(BenchError, match="draft_size"):
        run_bench(methods="pld", prompts=str(prompt_file), loaded=loaded, config={"draft_size": 0})
    with pytest.raises(BenchError, match="unknown dtype 'fp8'"):
        run_bench(model="random-llama", methods="ar", prompts=str(prompt_file), dtype="fp8")


def test_cli_parses_into_run_bench(monkeypatch):
    got = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: got.update(kw))
    bench.main(["--model", "random-llama", "--methods", "ar,pld", "--per-category", "2", "--max-new-tokens", "16",
                "--set", "draft_size=5", "--set", "vocab=microspec", "--categories", "math,qa", "--dtype", "bf16"])
    assert got["methods"] == "ar,pld" and got["per_category"] == 2 and got["max_new_tokens"] == 16
    assert got["config"] == {"draft_size": 5, "vocab": "microspec"} and got["categories"] == ["math", "qa"]
    assert got["dtype"] == "bf16"
    with pytest.raises(BenchError, match="FIELD=VALUE"):
        bench.main(["--set", "no_such_field=1"])


# --- outputs that differ from ar's: where they part, ar's margin there, near tie or bug --------------------

def test_ulp_and_the_near_tie_bound():
    # ulp(x) = 2^(floor(log2|x|) - fraction bits): bf16 keeps 7, fp16 10, fp32 23
    assert ulp(20.0, "bfloat16") == ulp(-20.0, "bf16") == ulp(16.0, torch.bfloat16) == 0.125
    assert ulp(15.9, "bfloat16") == 0.0625 and ulp(1.0, "float32") == 2.0 ** -23 and ulp(0.75, "fp16") == 2.0 ** -11
    assert near_tie_bound(20.0, "bfloat16") == NEAR_TIE_ULPS["bfloat16"] * 0.125
    assert near_tie_bound(-20.0, "float32") == NEAR_TIE_ULPS["float32"] * 2.0 ** -19
    bound = near_tie_bound(20.0, "bfloat16")
    assert classify(bound, bound, 20.0, "bfloat16") == "near-tie"           # the bound is inclusive
    assert classify(bound * 1.01, None, 20.0, "bfloat16") == "mismatch"
    assert classify(-bound / 2, -bound / 2, 20.0, "bfloat16") == "near-tie"  # the recomputation ranked it second
    # the method took a token far below a near tie between ar's first two: not a flipped tie
    assert classify(bound / 8, bound * 4, 20.0, "bfloat16") == "mismatch"
    # the bound scales with the logit: 0.5 is within rounding of bf16 at 20, not at 1
    assert classify(0.5, 0.5, 20.0, "bfloat16") == "near-tie" and classify(0.5, 0.5, 1.0, "bfloat16") == "mismatch"
    assert classify(None, None, None, "float32") == "mismatch"             # ar had stopped: no tie to flip
    assert first_divergence([1, 2, 3, 4], [1, 2, 3, 4]) is None and first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3, 4]) == 3 and first_divergence([1, 2, 3, 4], [1, 2]) == 2
    with pytest.raises(DivergenceError, match="int8.*bfloat16"):
        near_tie_bound(1.0, "int8")


V_FAKE = 128
# ar's outputs of a hand-made bench: prompts a (math), b (code), c (chat, two turns)
AR_OUT = {("a", 1): [10, 11, 12, 13, 14, 15], ("b", 1): [20, 21, 22, 23, 24, 25],
          ("c", 1): [30, 31, 32, 33, 34], ("c", 2): [40, 41, 42, 43]}
CATEGORY = {"a": "math", "b": "code", "c": "chat"}
TINY = 1e-5                    # well within fp32's bound at a logit of 20 (64 ulps = 1.2e-4)


def _fake_prompt(row: dict, earlier: list[list[int]]) -> list[int]:
    """A prompt that holds the prompt id, the turn and the earlier answers, as a real one does."""
    return [100 + ord(row["prompt_id"]) - ord("a"), int(row["turn"]), *[t for o in earlier for t in o]]


def _logits(ar_token: int, ar_logit: float, others: dict[int, float]) -> torch.Tensor:
    x = torch.full((V_FAKE,), -3.0)
    x[ar_token] = ar_logit
    for t, v in others.items():
        x[t] = v
    return x


# the target's logits at the ONLY contexts a right diagnosis asks for: ar's prompt + ar's first 3 tokens
FAKE_LOGITS = {
    # a: ar's 13 and the method's 99 a hair apart (a near tie)
    (100, 1, 10, 11, 12): _logits(13, 20.0, {99: 20.0 - TINY}),
    # b: ar's 23 leads its runner-up 5 by 0.1, the method's 98 by 0.5 (a bug)
    (101, 1, 20, 21, 22): _logits(23, 20.0, {5: 19.9, 98: 19.5}),
    # c turn 1: a near tie that this forward ranks the other way: ar's margin is negative
    (102, 1, 30, 31, 32): _logits(33, 20.0, {99: 20.0 + TINY}),
}


def _hand_made_rows() -> list[dict]:
    """ar; run "same" (every output equal); "tie" (a differs at 3 by a tiny margin); "bug" (a tiny, b differs
    at 3 with a clear margin, c's turn 1 a tiny margin - so its turn 2 was asked another prompt than ar's -
    listed first so an aggregation that takes the first row's verdict fails)."""
    changed = {
        "tie": {("a", 1): [10, 11, 12, 99, 14, 15]},
        "bug": {("a", 1): [10, 11, 12, 99, 14, 15], ("b", 1): [20, 21, 22, 98, 24, 25],
                ("c", 1): [30, 31, 32, 99, 34], ("c", 2): [7, 7, 7]},
    }
    rows = []
    for method, run in (("pld", "bug"), ("ar", "full"), ("pld", "same"), ("pld", "tie")):
        for (pid, turn), out in AR_OUT.items():
            rows.append({"method": method, "run": run, "prompt_id": pid, "turn": turn, "repeat": 0,
                         "category": CATEGORY[pid], "output_ids": changed.get(run, {}).get((pid, turn), out),
                         "dtype": "float32", "temperature": 0.0, "new_tokens": len(out), "steps": len(out)})
    return rows


def test_verdicts_first_divergence_and_run_verdict_on_a_hand_made_frame():
    rows = _hand_made_rows()
    asked = []

    def fake_logits(ids):
        asked.append(tuple(ids))
        assert tuple(ids) in FAKE_LOGITS, f"logits asked at {ids}: not ar's prompt + ar's tokens up to the divergence"
        return FAKE_LOGITS[tuple(ids)]

    forwards = diagnose_rows(rows, prompt_ids=_fake_prompt, next_logits=fake_logits)
    assert forwards == len(asked) == 4                          # only the 4 differing rows of the same prompt
    got = {(r["run"], r["prompt_id"], r["turn"]): r for r in rows}
    for run in ("full", "same"):
        for key in AR_OUT:
            r = got[(run, *key)]
            assert (r["verdict"], r["first_divergence"], r["ar_margin"], r["prompt_differs"]) == \
                ("exact", None, None, False)
    tie = got[("tie", "a", 1)]
    assert tie["verdict"] == "near-tie" and tie["first_divergence"] == 3
    assert tie["ar_margin"] == pytest.approx(TINY, abs=1e-6) and tie["ar_gap"] == pytest.approx(TINY, abs=1e-6)
    assert got[("tie", "b", 1)]["verdict"] == "exact"
    bug = got[("bug", "b", 1)]
    assert bug["verdict"] == "mismatch" and bug["first_divergence"] == 3
    assert bug["ar_margin"] == pytest.approx(0.1, abs=1e-5) and bug["ar_gap"] == pytest.approx(0.5, abs=1e-5)
    assert got[("bug", "a", 1)]["verdict"] == got[("bug", "c", 1)]["verdict"] == "near-tie"
    assert got[("bug", "c", 1)]["ar_margin"] == pytest.approx(-TINY, abs=1e-6)   # ar's token minus the best other
    # c's turn 2 after a diverged turn 1: another prompt than ar's; not compared token by token, the verdict
    # of the turn where the conversation parted (its own tokens [7, 7, 7] would say "mismatch" at 0)
    second = got[("bug", "c", 2)]
    assert (second["verdict"], second["first_divergence"], second["ar_margin"], second["prompt_differs"]) == \
        ("near-tie", 0, None, True)

    # a run: exact if every row is, mismatch if any row is one, else near-tie - per category and over all
    table = summarize(pl.DataFrame(rows, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32}))
    lossless = {(r["task"], r["run"]): r["lossless"] for r in table.iter_rows(named=True)}
    assert {c: lossless[(c, "same")] for c in ("math", "code", "chat", "all")} == dict.fromkeys(
        ("math", "code", "chat", "all"), "exact")
    assert [lossless[(c, "tie")] for c in ("math", "code", "chat", "all")] == ["near-tie", "exact", "exact", "near-tie"]
    assert [lossless[(c, "bug")] for c in ("math", "code", "chat", "all")] == ["near-tie", "mismatch", "near-tie",
                                                                                "mismatch"]
    assert lossless[("all", "full")] == "exact"
    lines = bench.divergence_lines(pl.DataFrame(rows, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32}))
    assert "pld bug: prompt b, turn 1, repeat 0: first divergent token 3, ar margin 0.1, gap to the method's " \
           "token 0.5 -> mismatch" in lines
    assert "pld bug: prompt c, turn 2, repeat 0: prompt differs (an earlier turn diverged; its verdict) -> " \
           "near-tie" in lines
    assert len(lines) == 5 and not any(" same" in line or "ar full" in line for line in lines)


def _direct_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's logits after `ids`, straight from the HF model's own forward (not engine.target)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _forge(frame: pl.DataFrame, edits: dict) -> pl.DataFrame:
    """`frame` with pld's output_ids of (prompt_id, turn) replaced."""
    outs = [edits.get((r["prompt_id"], r["turn"]), r["output_ids"]) if r["method"] == "pld" else r["output_ids"]
            for r in frame.iter_rows(named=True)]
    return frame.with_columns(output_ids=pl.Series(outs, dtype=pl.List(pl.Int64)))


def test_ar_margin_is_the_targets_top2_margin_where_outputs_part(loaded, prompt_file, monkeypatch):
    model, tok, info = loaded
    # pld before ar: its rows get their verdicts once ar's rows are there
    df = run_bench(methods="pld,ar", prompts=str(prompt_file), max_new_tokens=8, loaded=loaded, progress=False,
                   show=False, warmup=0)
    assert df["verdict"].to_list() == ["exact"] * df.height and not df["prompt_differs"].any()
    prompts = {str(p.prompt_id): p for p in load_prompts(str(prompt_file))}
    eos = eos_token_ids(model, tok)
    ar = {(r["prompt_id"], r["turn"]): r["output_ids"]
          for r in df.filter(pl.col("method") == "ar").iter_rows(named=True)}
    ar_prompt = {("3", 1): encode_prompt(tok, info, prompts["3"].turns, []),
                 ("2", 2): encode_prompt(tok, info, prompts["2"].turns, [decode_answer(tok, ar[("2", 1)], eos)])}
    # prompt 3: pld takes ar's THIRD choice at 3; prompt 2's second turn: ar's runner-up at 2
    cases = {("3", 1): (3, 2), ("2", 2): (2, 1)}
    expect, edits = {}, {}
    for key, (pos, rank) in cases.items():
        logits = _direct_logits(model, ar_prompt[key] + ar[key][:pos])
        order = logits.argsort(descending=True).tolist()
        assert order[0] == ar[key][pos]                               # ar's greedy choice, recomputed
        edits[key] = ar[key][:pos] + [order[rank]] + ar[key][pos + 1:]
        expect[key] = (pos, float(logits[order[0]] - logits[order[1]]), float(logits[order[0]] - logits[order[rank]]))
        # the test tells pos from its neighbours: ar's margin one token earlier or later is another number
        for near in (pos - 1, pos + 1):
            other = _direct_logits(model, ar_prompt[key] + ar[key][:near]).topk(2).values
            assert abs(float(other[0] - other[1]) - expect[key][1]) > 1e-2, (key, near)
    forged = _forge(df, edits)

    def check(diagnosed: pl.DataFrame) -> None:
        got = {(r["method"], r["prompt_id"], r["turn"]): r for r in diagnosed.iter_rows(named=True)}
        for key, (pos, margin, gap) in expect.items():
            r = got[("pld", *key)]
            assert r["first_divergence"] == pos, key
            assert r["ar_margin"] == pytest.approx(margin, abs=1e-4), key
            assert r["ar_gap"] == pytest.approx(gap, abs=1e-4), key
            top1 = float(_direct_logits(model, ar_prompt[key] + ar[key][:pos]).max())
            assert margin > near_tie_bound(top1, "float32") and r["verdict"] == "mismatch"   # a clear margin
            assert r["prompt_differs"] is False
        others = [r["verdict"] for k, r in got.items() if (k[1], k[2]) not in expect or k[0] == "ar"]
        assert others == ["exact"] * len(others)

    check(bench.diagnose(forged, loaded, str(prompt_file)))
    assert expect[("3", 1)][2] > expect[("3", 1)][1]                 # the third choice: gap > margin
    assert expect[("2", 2)][2] == pytest.approx(expect[("2", 2)][1])  # the runner-up: gap = margin

    # mutants: a diagnosis that measures one token early or late fails the check above
    real = divergence.margin_at
    for shift in (-1, 1):
        monkeypatch.setattr(divergence, "margin_at", lambda f, p, a, o, pos, s=shift: real(f, p, a, o, pos + s))
        with pytest.raises(AssertionError):
            check(bench.diagnose(forged, loaded, str(prompt_file)))
    monkeypatch.setattr(divergence, "margin_at", real)


def test_a_later_turn_after_a_diverged_one_is_judged_on_its_prompt(loaded, prompt_file):
    model, tok, info = loaded
    df = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=8, loaded=loaded, progress=False,
                   show=False, warmup=0)
    ar1 = df.filter((pl.col("method") == "ar") & (pl.col("prompt_id") == "2") & (pl.col("turn") == 1))
    (ar1,) = ar1["output_ids"].to_list()
    eos = eos_token_ids(model, tok)
    # a byte token changes the answer text, so pld's turn 2 was asked another prompt than ar's
    byte = ord("Z") if ar1[1] != ord("Z") else ord("Y")
    diag = bench.diagnose(_forge(df, {("2", 1): ar1[:1] + [byte] + ar1[2:]}), loaded, str(prompt_file))
    t1, t2 = diag.filter((pl.col("method") == "pld") & (pl.col("prompt_id") == "2")).sort("turn").iter_rows(named=True)
    assert t1["first_divergence"] == 1 and t1["ar_margin"] is not None and t1["prompt_differs"] is False
    assert (t2["prompt_differs"], t2["first_divergence"], t2["ar_margin"], t2["verdict"]) == \
        (True, 0, None, t1["verdict"])
    # an id the byte-level tokenizer drops (>= 256) swapped for another: same answer text, same turn-2 prompt,
    # so turn 2 is compared token by token (and equals ar's) - decided on the prompt ids, not the outputs
    pos = next(i for i, t in enumerate(ar1) if t >= 256 and t not in eos)
    swap = next(t for t in range(256, 512) if t != ar1[pos] and t not in eos)
    diag = bench.diagnose(_forge(df, {("2", 1): ar1[:pos] + [swap] + ar1[pos + 1:]}), loaded, str(prompt_file))
    t1, t2 = diag.filter((pl.col("method") == "pld") & (pl.col("prompt_id") == "2")).sort("turn").iter_rows(named=True)
    assert t1["first_divergence"] == pos and t1["verdict"] in ("near-tie", "mismatch")
    assert (t2["prompt_differs"], t2["verdict"], t2["first_divergence"]) == (False, "exact", None)
    with pytest.raises(BenchError, match="cannot rebuild the rows' prompts.*pass prompts="):
        bench.diagnose(df, loaded)                                 # prompt_set "prompts" is no set's name


def test_run_bench_diagnoses_only_the_rows_that_differ(loaded, prompt_file, monkeypatch, capsys):
    real_generate, real_logits = bench.generate, bench.next_logits
    forwards = []

    def corrupting(model, ids, cfg, **kw):                        # pld goes wrong on prompt 3 at token 2
        res = real_generate(model, ids, cfg, **kw)
        if cfg.method == "pld" and ByteTokenizer().decode(ids).startswith("1 2 3"):
            out = res.output_ids.clone()
            out[2] = (out[2] + 1) % 256
            res.output_ids = out
        return res

    monkeypatch.setattr(bench, "generate", corrupting)
    monkeypatch.setattr(bench, "next_logits", lambda *a, **kw: forwards.append(a[1]) or real_logits(*a, **kw))
    df = run_bench(methods="ar,pld", prompts=str(prompt_file), max_new_tokens=8, loaded=loaded, progress=False,
                   warmup=0)
    printed = capsys.readouterr().out
    assert len(forwards) == 1                                    # equal rows cost no forward
    bad = df.filter(pl.col("verdict") != "exact")
    assert bad.select("method", "prompt_id", "turn", "first_divergence").rows() == [("pld", "3", 1, 2)]
    assert bad["verdict"].item() == "mismatch" and bad["ar_margin"].item() > 0
    table = summarize(df)
    lossless = {(r["task"], r["method"]): r["lossless"] for r in table.iter_rows(named=True)}
    assert (lossless[("math", "pld")], lossless[("writing", "pld")], lossless[("all", "pld")]) == \
        ("mismatch", "exact", "mismatch")
    assert f"pld full: prompt 3, turn 1, repeat 0: first divergent token 2, ar margin {bad['ar_margin'].item():.4g}" \
        in printed and "-> mismatch" in printed


# --- drafters x draft vocabularies ------------------------------------------------------------------------

# a 2-layer random model: the drafter keeps its first layer; windows and shortlists well below V = 512
DRAFT_CFG = dict(drafter_layers="first:1", w_max=64, frspec_k=100, eagle_depth=3, eagle_topk=4, draft_size=9)
ALL_VOCABS = ["full", "frspec", "microspec", "oracle"]


def _check_drafter_rows(df: pl.DataFrame, vocabs, drafter: str) -> None:
    key = ["prompt_id", "turn", "repeat"]
    ar = {tuple(r[k] for k in key): r["output_ids"] for r in df.filter(pl.col("method") == "ar").iter_rows(named=True)}
    assert df.filter(pl.col("method") == "ar")["run"].to_list() == ["full"] * len(ar)
    assert df.unique(["method", "run", *key]).height == df.height
    requested = {"full": None, "frspec": DRAFT_CFG["frspec_k"], "microspec": DRAFT_CFG["w_max"],
                 "oracle": DRAFT_CFG["w_max"]}
    for v in vocabs:
        rows = df.filter((pl.col("method") == drafter) & (pl.col("run") == v))
        assert rows.height == len(ar)
        assert (rows["policy"] == v).all() and rows["vocab_size"].to_list() == [requested[v]] * rows.height
        assert (rows["draft_size"] == DRAFT_CFG["draft_size"]).all()
        for r in rows.iter_rows(named=True):
            assert r["output_ids"] == ar[tuple(r[k] for k in key)], (drafter, v, r["prompt_id"], r["turn"])
            phases = sum(r[f"{p}_s"] for p in PHASES)
            assert all(r[f"{p}_s"] >= 0 for p in PHASES) and r["backbone_s"] > 0 and r["lm_head_s"] > 0
            # the phases, the drafter's prompt pass and the oracle's uncharged head all lie inside draft_s
            assert phases + r["draft_prefill_s"] + r["uncharged_s"] <= r["draft_s"] + 1e-6
            assert (r["uncharged_s"] > 0) == (v == "oracle")
            assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / (r["wall_s"] - r["uncharged_s"]))
            assert r["threads"] == 1 and 0 <= r["draft_coverage"] <= 1
            expect = {"full": 512, "frspec": DRAFT_CFG["frspec_k"], "oracle": DRAFT_CFG["w_max"]}
            if v in expect:
                assert r["mean_active_vocab"] == expect[v]
            else:
                assert 0 < r["mean_active_vocab"] <= r["max_active_vocab"] <= DRAFT_CFG["w_max"]
            if v in ("full", "oracle"):
                assert r["draft_coverage"] == 1.0          # the drafter proposes from the whole vocabulary
    for col in ("backbone_s", "gather_s", "lm_head_s", "tree_s", "mean_active_vocab", "draft_coverage"):
        assert df.filter(pl.col("method") == "ar")[col].is_null().all()


def test_layerskip_every_vocab_is_lossless_with_phase_columns(loaded, prompt_file, tmp_path, cache, capsys,
                                                               monkeypatch):
    before = torch.get_num_threads()
    df = run_bench(prompts=str(prompt_file), drafter="layerskip", vocab=",".join(ALL_VOCABS), max_new_tokens=10,
                   loaded=loaded, progress=False, threads=1, config=DRAFT_CFG, out=tmp_path / "ls")
    assert torch.get_num_threads() == before                 # restored after the bench
    assert df.select("method", "run").unique(maintain_order=True).rows() == \
        [("ar", "full")] + [("layerskip", v) for v in ALL_VOCABS]
    _check_drafter_rows(df, ALL_VOCABS, "layerskip")
    printed = capsys.readouterr().out
    assert "frspec list counted" in printed and "train_corpus" in printed       # which corpus
    assert "layerskip microspec vs full" in printed and "layerskip microspec vs frspec" in printed
    assert "targets:" in printed and "backbone_ms" in printed

    table = summarize(df)
    assert (table["lossless"] == "exact").all()
    allrows = {(r["method"], r["run"]): r for r in table.filter(pl.col("task") == "all").iter_rows(named=True)}
    assert {k: (r["policy"], r["vocab_size"]) for k, r in allrows.items()} == {
        ("ar", "full"): ("full", None), ("layerskip", "full"): ("full", None),
        ("layerskip", "frspec"): ("frspec", 100), ("layerskip", "microspec"): ("microspec", 64),
        ("layerskip", "oracle"): ("oracle", 64)}
    ls = df.filter(pl.col("method") == "layerskip")
    for v in ALL_VOCABS:                                      # draft ms per drafted step, as the docstring says
        rows = ls.filter(pl.col("run") == v)
        drafted = (rows["steps"] - 1).sum()
        assert allrows[("layerskip", v)]["draft_ms"] == pytest.approx(
            (rows["draft_s"] - rows["begin_s"] - rows["uncharged_s"]).sum() / drafted * 1e3)
        assert (rows["begin_s"] >= rows["draft_prefill_s"]).all()    # the head's prompt pass is inside begin
        decode = (rows["new_tokens"] - 1) / (rows["wall_s"] - rows["prefill_s"] - rows["begin_s"] - rows["uncharged_s"])
        assert allrows[("layerskip", v)]["decode_tokens_per_s"] == pytest.approx(decode.mean())
        assert allrows[("layerskip", v)]["lm_head_ms"] == pytest.approx(rows["lm_head_s"].sum() / drafted * 1e3)
        assert allrows[("layerskip", v)]["tau"] == pytest.approx(rows["new_tokens"].sum() / rows["steps"].sum())
    assert allrows[("ar", "full")]["backbone_ms"] is None and allrows[("ar", "full")]["speedup"] == 1.0

    cmp = compare_vocabs(table)
    assert cmp.select("run", "base").rows() == [("frspec", "full"), ("microspec", "full"), ("oracle", "full"),
                                                ("microspec", "frspec")]
    for r in cmp.iter_rows(named=True):
        a, b = allrows[("layerskip", r["run"])], allrows[("layerskip", r["base"])]
        assert r["draft_ratio"] == pytest.approx(b["draft_ms"] / a["draft_ms"])
        assert r["tau_ratio"] == pytest.approx(a["tau"] / b["tau"])
        assert r["speed_ratio"] == pytest.approx(a["tokens_per_s"] / b["tokens_per_s"])

    # the run key holds the run label: resuming with one more label runs only that one
    calls = {"n": 0}
    real = bench.generate

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "generate", counting)
    more = run_bench(prompts=str(prompt_file), drafter="layerskip", vocab="full,microspec", max_new_tokens=10,
                     loaded=loaded, progress=False, show=False, warmup=0, config=DRAFT_CFG, out=tmp_path / "ls",
                     resume=True)
    assert calls["n"] == 0 and more.height == df.height      # every (method, run) was there already
    sized = run_bench(prompts=str(prompt_file), drafter="layerskip", vocab="frspec:32", max_new_tokens=10,
                      loaded=loaded, progress=False, show=False, warmup=0, config=DRAFT_CFG, out=tmp_path / "ls",
                      resume=True)
    assert calls["n"] == 4                                    # only the 4 turns of the new run label
    new = sized.filter(pl.col("run") == "frspec:32")
    assert (new["policy"] == "frspec").all() and (new["vocab_size"] == 32).all()
    assert (summarize(sized)["lossless"] == "exact").all()


def test_eagle_vocabs_lossless(loaded, prompt_file, cache):
    df = run_bench(prompts=str(prompt_file), methods="ar", drafter="eagle", vocab="full,microspec,oracle",
                   max_new_tokens=6, loaded=loaded, progress=False, show=False, warmup=0, threads=1,
                   config={**DRAFT_CFG, "eagle_head": "random"})
    _check_drafter_rows(df, ["full", "microspec", "oracle"], "eagle")


# --- Table 2 on one head: eagle with full, frspec, dynaspec (unsized, and sized in tokens), microspec ---------

M = 32                                        # clusters of the test DynaSpec: 16 tokens each on average (V = 512)


def _random_eagle_key(model) -> dict:
    """The drafter key of eagle_head="random" (seed 0) at DRAFT_CFG's depth: what a fit for it records."""
    from specvocab.engine.drafters.eagle import head_digest, random_eagle_head
    return {"drafter": "eagle", "eagle_head_sha": head_digest(random_eagle_head(model, 0)),
            "eagle_depth": DRAFT_CFG["eagle_depth"]}


def _save_random_dynaspec(model, folder, drafter_config: dict):
    """A DynaSpec for the random model's LM head, where `find_fitted` looks: spherical k-means clusters and
    an untrained router (the bench needs a file the policy loads; routing quality is test_dynaspec's)."""
    weight = model.get_output_embeddings().weight.detach()
    km = spherical_kmeans(weight, M, seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        router = Router(weight.shape[1], M, 16).eval()
    meta = {"model": "random-llama", "head_fingerprint": head_fingerprint(weight), "drafter_config": drafter_config,
            "created": 1.0}
    return save_dynaspec(FittedDynaSpec(assign=km.assign, router=router, meta=meta), folder / "random.safetensors")


def test_dynaspec_token_budget_sets_k_max():
    assert k_max_for_tokens(4096, 1024, 49152) == 85           # SmolLM2: 48 tokens a cluster, 4096 / 48 = 85.3
    assert k_max_for_tokens(32768, 1024, 131072) == 256        # the default k_max = FR-Spec's 32k of Llama-3's 128k
    assert tokens_for_k_max(256, 1024, 131072) == 32768
    assert tokens_for_k_max(85, 1024, 49152) == 4080
    assert k_max_for_tokens(1, 1024, 262144) == 1              # at least one cluster
    assert k_max_for_tokens(262144, 1024, 262144) == 1024      # the whole vocabulary: every cluster
    assert tokens_for_k_max(5000, 1024, 262144) == 262144      # more clusters than M: all of them
    for bad in (0, 513, True):
        with pytest.raises(DynaSpecError, match="token budget"):
            k_max_for_tokens(bad, M, 512)


def test_table2_on_one_eagle_head(loaded, prompt_file, cache, capsys):
    fit = _save_random_dynaspec(loaded[0], cache / "dynaspec", _random_eagle_key(loaded[0]))
    vocabs = ["full", "frspec", "dynaspec", "dynaspec:64", "microspec"]
    df = run_bench(prompts=str(prompt_file), drafter="eagle", vocab=",".join(vocabs), max_new_tokens=8,
                   loaded=loaded, progress=False, warmup=0, threads=1,
                   config={**DRAFT_CFG, "eagle_head": "random", "dynaspec_k_max": 8})
    printed = capsys.readouterr().out
    assert df.select("method", "run").unique(maintain_order=True).rows() == [("ar", "full")] + [
        ("eagle", v) for v in vocabs]
    _check_drafter_rows(df.filter(~pl.col("run").str.starts_with("dynaspec")), ["full", "frspec", "microspec"], "eagle")
    ar = df.filter(pl.col("method") == "ar")["output_ids"].to_list()
    # unsized: the configured k_max = 8 of 32 clusters stands for 8 x 16 = 128 tokens; dynaspec:64 -> k_max 4
    for label, k_max, size in (("dynaspec", 8, 128), ("dynaspec:64", 4, 64)):
        rows = df.filter(pl.col("run") == label)
        assert rows["output_ids"].to_list() == ar, label                   # lossless
        assert (rows["policy"] == "dynaspec").all() and rows["vocab_size"].to_list() == [size] * rows.height
        assert (rows["dynaspec_k_max"] == k_max).all() and (rows["vocab_file"] == str(fit)).all()
        for r in rows.iter_rows(named=True):
            assert r["router_s"] > 0 and r["lm_head_s"] > 0 and r["backbone_s"] > 0
            assert sum(r[f"{p}_s"] for p in PHASES) + r["draft_prefill_s"] <= r["draft_s"] + 1e-6
            assert 0 < r["mean_active_vocab"] < 512 and 0 < r["mean_union_vocab"] <= 512
    others = df.filter(~pl.col("run").str.starts_with("dynaspec") & (pl.col("method") == "eagle"))
    assert (others["router_s"] == 0).all() and others["dynaspec_k_max"].is_null().all()
    assert others["mean_union_vocab"].is_null().all()
    assert (df.filter(pl.col("method") == "eagle")["draft_head"] == "random").all()
    assert df.filter(pl.col("method") == "ar")["draft_head"].is_null().all()
    assert (df["dtype"] == "float32").all() and (df["max_new_tokens"] == 8).all()

    table = summarize(df)
    assert (table["lossless"] == "exact").all()
    allrows = {r["run"]: r for r in table.filter((pl.col("task") == "all") & (pl.col("method") == "eagle"))
               .iter_rows(named=True)}
    rows = df.filter(pl.col("run") == "dynaspec:64")
    drafted = (rows["steps"] - 1).sum()
    assert allrows["dynaspec:64"]["router_ms"] == pytest.approx(rows["router_s"].sum() / drafted * 1e3)
    assert allrows["dynaspec:64"]["router_ms"] > 0 and allrows["full"]["router_ms"] == 0.0
    assert (allrows["dynaspec"]["vocab_size"], allrows["dynaspec"]["dynaspec_k_max"]) == (128, 8)
    assert allrows["dynaspec"]["mean_union_vocab"] > 0 and allrows["full"]["mean_union_vocab"] is None
    cmp = compare_vocabs(table)
    assert cmp.select("run", "base").rows() == [
        ("frspec", "full"), ("dynaspec", "full"), ("dynaspec:64", "full"), ("microspec", "full"),
        ("microspec", "frspec"), ("microspec", "dynaspec"), ("microspec", "dynaspec:64"),
        ("dynaspec", "frspec"), ("dynaspec:64", "frspec")]

    # what was compared, then Table 2's layout, a table per task, the overall block, the ratio lines
    assert f"DynaSpec {fit}" in printed and "k_max = 4 clusters per row at draft steps 0-1 (~64 tokens)" in printed
    assert "bench: random-llama on cpu, float32, native target forward, 1 torch thread(s)" in printed
    assert "prompts: " in printed and "(3 prompts, 4 turns, 2 categories, 1 repeat(s))" in printed
    assert "tokens: max_new_tokens 8 per turn" in printed and "greedy" in printed
    assert "drafter: eagle, head random, draft_size 9; runs:" in printed
    assert "  dynaspec:64: vocab_size 64, k_max 4 clusters, " + str(fit) in printed
    assert "MicroSpec Table 2's layout" in printed and "\nmath:\n" in printed and "\nwriting:\n" in printed
    assert "router_ms" in printed and "lm_head_ms" in printed and "mean_union_vocab" in printed
    for line in ("eagle dynaspec:64 vs full", "eagle microspec vs dynaspec:64", "eagle dynaspec vs frspec"):
        assert line in printed
    assert "target: tokens/s > dynaspec" in printed and "target (DynaSpec Table 1)" in printed


def test_the_shipped_head_the_resolution_picks_is_printed_and_named(loaded, prompt_file, monkeypatch, capsys):
    # eagle_head=None resolves once, in the run's resolution (engine.resolve), to the head shipped for the target:
    # its rows name it and its source; a head set in the config is "given"
    monkeypatch.setattr(resolve, "default_eagle_head", lambda target: "random")     # "shipped" for this target
    df = run_bench(prompts=str(prompt_file), drafter="eagle", vocab="full", max_new_tokens=4, loaded=loaded,
                   progress=False, warmup=0, config=DRAFT_CFG)
    rows = df.filter(pl.col("method") == "eagle")
    assert (rows["draft_head"] == "random").all() and (rows["draft_head_source"] == "shipped").all()
    assert "drafter: eagle, head random" in capsys.readouterr().out
    given = run_bench(prompts=str(prompt_file), drafter="eagle", vocab="full", max_new_tokens=4, loaded=loaded,
                      progress=False, warmup=0, show=False, config={**DRAFT_CFG, "eagle_head": "random"})
    assert (given.filter(pl.col("method") == "eagle")["draft_head_source"] == "given").all()


def test_drafter_problems_fail_before_any_prompt(loaded, prompt_file, cache, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a prompt ran before the runs were checked")

    monkeypatch.setattr(bench, "generate", never)
    common = dict(prompts=str(prompt_file), loaded=loaded, progress=False, warmup=0)
    with pytest.raises(BenchError, match="eagle full: .*eagle_head"):               # no head for this model
        run_bench(drafter="eagle", vocab="full", config=DRAFT_CFG, **common)
    with pytest.raises(BenchError, match="eagle dynaspec: .*python -m specvocab.engine.jobs.fit_dynaspec"):   # nothing fitted
        run_bench(drafter="eagle", vocab="dynaspec", config={**DRAFT_CFG, "eagle_head": "random"}, **common)
    _save_random_dynaspec(loaded[0], cache / "dynaspec", _random_eagle_key(loaded[0]))
    with pytest.raises(BenchError, match="dynaspec:513: .*token budget must be in \\[1, V=512\\]"):
        run_bench(drafter="eagle", vocab="dynaspec:513", config={**DRAFT_CFG, "eagle_head": "random"}, **common)


def test_plan_runs_adds_ar_and_refuses_bad_flags(loaded, prompt_file):
    plan = [(r.method, r.label) for r in plan_runs(None, "layerskip", "full,microspec")]
    assert plan == [("ar", "full"), ("layerskip", "full"), ("layerskip", "microspec")]
    plan = plan_runs("pld,layerskip", "layerskip", None, {"vocab": "frspec"})
    assert [(r.method, r.label) for r in plan] == [("ar", "full"), ("pld", "full"), ("layerskip", "frspec"),
                                                   ("layerskip", "full")]
    assert [r.cfg.vocab for r in plan] == ["frspec", "frspec", "frspec", "full"]
    assert [(r.method, r.label) for r in plan_runs(None)] == [("ar", "full"), ("pld", "full"),
                                                              ("hf-prompt-lookup", "full")]
    with pytest.raises(BenchError, match="unknown drafter 'pld'.*layerskip"):
        plan_runs("ar", "pld", "full")
    with pytest.raises(BenchError, match=r"unknown vocab\(s\) \['tiny'\].*microspec"):
        plan_runs("ar", "layerskip", "full,tiny")
    with pytest.raises(BenchError, match="--vocab full,microspec needs --drafter"):
        plan_runs("ar", None, "full,microspec")
    assert [r.cfg.eagle_head for r in plan_runs("ar", "eagle", "full")] == [None, None]   # the drafter decides
    with pytest.raises(BenchError, match="w_max"):
        plan_runs("ar", "layerskip", "microspec", {"w_max": 0})
    with pytest.raises(BenchError, match="needs --drafter"):
        bench.main(["--model", "random-llama", "--vocab", "microspec"])
    sized = plan_runs(None, "layerskip", "frspec,frspec:1024,microspec:512,dynaspec,dynaspec:4096")
    assert [r.label for r in sized] == ["full", "frspec", "frspec:1024", "microspec:512", "dynaspec", "dynaspec:4096"]
    # dynaspec's size is a token budget, known once the fitted file is (None until then when unsized)
    assert [(r.policy, r.vocab_size) for r in sized] == [("full", None), ("frspec", 32768), ("frspec", 1024),
                                                         ("microspec", 512), ("dynaspec", None), ("dynaspec", 4096)]
    assert [(r.cfg.vocab, r.cfg.frspec_k, r.cfg.w_max) for r in sized[1:4]] == [
        ("frspec", 32768, 3072), ("frspec", 1024, 3072), ("microspec", 32768, 512)]
    assert [r.cfg.dynaspec_k_max for r in sized[4:]] == [256, 256]      # k_max is set from N after loading
    with pytest.raises(BenchError, match="positive integer"):
        plan_runs(None, "layerskip", "frspec:0")
    with pytest.raises(BenchError, match="take a size"):
        plan_runs(None, "layerskip", "oracle:10")
    with pytest.raises(BenchError, match="unknown vocab"):
        plan_runs(None, "layerskip", "tiny:10")
    with pytest.raises(BenchError, match="threads"):
        run_bench(prompts=str(prompt_file), loaded=loaded, threads=0)


def test_cli_passes_drafter_vocab_and_threads(monkeypatch):
    got = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: got.update(kw))
    bench.main(["--methods", "ar", "--drafter", "layerskip", "--vocab", "full,microspec", "--threads", "1",
                "--set", "drafter_layers=first:4"])
    assert got["drafter"] == "layerskip" and got["vocab"] == "full,microspec" and got["threads"] == 1
    assert got["config"] == {"drafter_layers": "first:4"}
    bench.main(["--drafter", "eagle", "--vocab", "full,frspec,dynaspec:4096,microspec", "--set", "eagle_head=/x/head",
                "--set", "dynaspec_file=/x/fit.safetensors"])
    assert got["drafter"] == "eagle" and got["vocab"] == "full,frspec,dynaspec:4096,microspec"
    assert got["config"] == {"eagle_head": "/x/head", "dynaspec_file": "/x/fit.safetensors"}


# --- a real model (slow) -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_layerskip_every_vocab_lossless(smollm2, cache, capsys):
    model, tok, info = smollm2
    df = run_bench(prompts="spec_bench", categories=["qa"], per_category=1, drafter="layerskip",
                   vocab=",".join(ALL_VOCABS), max_new_tokens=12, loaded=smollm2, progress=False, warmup=0,
                   threads=1, config=dict(drafter_layers="skip:12,14,16,18", eagle_depth=3, eagle_topk=4,
                                          draft_size=9, w_max=512, frspec_k=2048))
    _ = capsys.readouterr()
    ar = df.filter(pl.col("method") == "ar")["output_ids"].to_list()
    for v in ALL_VOCABS:
        rows = df.filter((pl.col("method") == "layerskip") & (pl.col("run") == v))
        assert rows["output_ids"].to_list() == ar, v
    # the frspec ranking was counted with SmolLM2's own tokenizer on the training corpus
    ranking = load_ranking(next((cache / "rankings").glob("smollm2-*.parquet")), tokenizer=info.tokenizer_name,
                           vocab_size=info.vocab_size)
    sample = corpus_texts("train_corpus")[:3]
    ids = np.concatenate([tok.encode(t, add_special_tokens=False) for t in sample])
    counts = dict(zip(ranking["token_id"].to_list(), ranking["count"].to_list()))
    assert all(counts[int(i)] >= c for i, c in Counter(ids.tolist()).items())


def test_compare_vocabs_pairs_microspec_with_every_frspec_size():
    rows = [("full", 10.0, 2.0, 1.0, None), ("frspec", 4.0, 1.9, 1.5, 32768.0), ("frspec:1024", 3.0, 1.5, 1.6, 1024.0),
            ("microspec", 2.5, 1.8, 1.9, 700.0)]
    table = pl.DataFrame([{"task": "all", "method": "layerskip", "run": v, "draft_ms": d, "tau": t,
                           "tokens_per_s": s, "mean_active_vocab": m} for v, d, t, s, m in rows])
    cmp = compare_vocabs(table)
    assert cmp.select("run", "base").rows() == [("frspec", "full"), ("frspec:1024", "full"), ("microspec", "full"),
                                                  ("microspec", "frspec"), ("microspec", "frspec:1024")]
    lines = bench.comparison_lines(cmp)
    assert "draft >= 3x less met" in lines[2] and "tau >= 0.95x MISSED" in lines[2]   # 4.0x less, 0.90x tau
    assert "tau > frspec at <= its vocab MISSED" in lines[3]          # 32k shortlist: higher tau than microspec
    assert "tau > frspec at <= its vocab met" in lines[4]             # 1k shortlist, more rows than microspec's 700
    assert cmp.filter(pl.col("base") == "frspec:1024")["tau_ratio"].item() == pytest.approx(1.8 / 1.5)
