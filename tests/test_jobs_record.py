"""specvocab.engine.jobs.record: traces through the one decode loop (generate(..., method="ar", record=True).to_trace()),
equal to a plain greedy reference; one trace per turn, Parquet round trip, resume, CLI."""

import numpy as np
import polars as pl
import pytest
import torch

import specvocab.engine.jobs.record as record
from specvocab.engine.harness import generate
from specvocab.engine.models import RANDOM_MODELS, eos_token_ids, load_random_model
from specvocab.engine.prompts import PromptTooLongError, encode_prompt, load_prompts
from specvocab.engine.jobs.record import record_traces
from specvocab.locality import read_traces, write_traces
from tests.engine_testing import greedy_topk_reference, naive_greedy


def _trace(model, prompt, n, topk, eos=()):
    return generate(model, prompt, method="ar", max_new_tokens=n, eos_ids=list(eos), record=True,
                    record_topk=topk).to_trace({"prompt_id": "p"})


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_ar_trace_equals_a_plain_greedy_reference(name):
    model, _, _ = load_random_model(name, num_layers=3)
    prompt = list(range(5, 45))           # longer than random-gemma3's sliding window (16)
    t = _trace(model, prompt, 12, 5)
    prefill, generated, step = greedy_topk_reference(model, prompt, 12, 5)
    assert t.prompt.tolist() == prompt
    assert np.array_equal(t.prefill_topk, prefill) and t.prefill_topk.shape == (len(prompt) - 1, 5)
    assert np.array_equal(t.generated, generated) and np.array_equal(t.step_topk, step)
    assert t.generated.tolist() == naive_greedy(model, prompt, 12)          # no KV cache at all
    assert (t.step_topk[:, 0] == t.generated).all()
    # autoregressive decoding drafts nothing: the trace is a plain greedy recording
    assert t.draft_tokens is None and "step_sizes" not in t.meta
    assert t.meta == {"method": "ar", "prompt_id": "p"}


def test_greedy_stops_after_an_eos_and_keeps_it():
    model, _, _ = load_random_model("random-llama")
    prompt = [1, 2, 3, 4]
    free = naive_greedy(model, prompt, 10)
    eos = free[3]
    stop = free.index(eos)               # the first time that token appears
    t = _trace(model, prompt, 10, 3, eos=[eos])
    assert t.generated.tolist() == free[:stop + 1] and t.step_topk.shape == (stop + 1, 3)
    assert np.array_equal(t.step_topk, greedy_topk_reference(model, prompt, 10, 3, eos_ids=[eos])[2])


def test_one_token_prompt_has_an_empty_prefill():
    model, _, _ = load_random_model("random-qwen3")
    t = _trace(model, [7], 3, 4)
    assert t.prefill_topk.shape == (0, 4) and len(t.generated) == 3 and t.step_topk.shape == (3, 4)


def test_record_round_trips_through_parquet_with_one_trace_per_turn(tmp_path):
    model, tok, info = load_random_model("random-llama", vocab_size=256)
    prompts = load_prompts("spec_bench", categories=["qa", "writing"], per_category=1)
    traces = record_traces(model, tok, info, prompts, max_new_tokens=8, topk=4, progress=False)
    assert [(t.meta["category"], t.meta["turn"]) for t in traces] == [("writing", 1), ("writing", 2), ("qa", 1)]
    for t, (p, turn) in zip(traces, [(prompts[0], 1), (prompts[0], 2), (prompts[1], 1)]):
        assert t.meta["model"] == "random-llama" and t.meta["prompt_set"] == "spec_bench"
        assert t.meta["prompt_id"] == p.prompt_id and t.meta["language"] == "en" and t.meta["method"] == "ar"
        assert t.prefill_topk.shape == (len(t.prompt) - 1, 4) and t.step_topk.shape == (len(t.generated), 4)
        assert (t.step_topk[:, 0] == t.generated).all()
        assert 1 <= len(t.generated) <= 8
        _, generated, step = greedy_topk_reference(model, t.prompt, 8, 4, eos_ids=eos_token_ids(model, tok))
        assert np.array_equal(t.generated, generated) and np.array_equal(t.step_topk, step)
    # turn 2 is turn 1's prompt, the model's own answer, then the second question
    t1, t2 = traces[0], traces[1]
    answer = bytes(x for x in t1.generated if x < 256).decode("utf-8", "surrogateescape").strip()
    assert t2.prompt.tolist() == encode_prompt(None, info, prompts[0].turns, [answer])
    assert t2.prompt[:len(t1.prompt)].tolist() == t1.prompt.tolist()

    path = write_traces(traces, tmp_path / "traces.parquet")
    back = read_traces(path)
    assert len(back) == len(traces)
    for a, b in zip(traces, back):
        for field in ("prompt", "prefill_topk", "generated", "step_topk"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert a.meta == b.meta and b.draft_tokens is None
    df = pl.read_parquet(path)
    assert df["turn"].to_list() == [1, 2, 1] and df["tokenizer"].to_list() == ["", "", ""]


def test_record_checks_every_first_turn_fits_before_decoding(monkeypatch):
    model, tok, info = load_random_model("random-llama", max_context=128)
    short = load_prompts("spec_bench", categories=["qa"], per_category=1)
    long = load_prompts("spec_bench", categories=["summarization"], per_category=1)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started before every first turn was checked")

    monkeypatch.setattr(record, "generate", no_decoding)
    with pytest.raises(PromptTooLongError, match=f"spec_bench/{long[0].prompt_id}"):
        record_traces(model, tok, info, short + long, max_new_tokens=8, topk=2, progress=False)
    with pytest.raises(ValueError, match="topk must be in 1..512"):
        record_traces(model, tok, info, short, max_new_tokens=8, topk=513, progress=False)


def test_cli_writes_traces_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "run"
    kwargs = record._parse(["--model", "random-gemma3", "--prompts", "multilingual", "--per-category", "1",
                            "--categories", "qa,multi_turn", "--languages", "en,zh", "--max-new-tokens", "5",
                            "--topk", "3", "--out", str(out), "--no-progress", "--report"])
    path = record.record(**kwargs)
    assert path == out / "traces.parquet"
    traces = read_traces(path)
    assert sorted((t.meta["language"], t.meta["category"], t.meta["turn"]) for t in traces) == [
        ("en", "multi_turn", 1), ("en", "multi_turn", 2), ("en", "qa", 1),
        ("zh", "multi_turn", 1), ("zh", "multi_turn", 2), ("zh", "qa", 1)]
    assert all(t.k == 3 for t in traces)
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("recorded")]
    assert len(lines) == 1 and "6 traces" in lines[0] and str(path) in lines[0]
    # --report prints the per-category coverage table (an "(all)" row included) and writes it as Parquet
    assert "MicroSpec window coverage" in captured.out and "(all)" in captured.out
    report = pl.read_parquet(out / "coverage.parquet")
    assert set(report["category"]) == {"qa", "multi_turn", "(all)"}
    total = report.filter(pl.col("category") == "(all)")
    assert total["tokens"].item() == total["steps"].item() == sum(len(t.generated) for t in traces)


def test_record_writes_after_every_prompt_and_resumes(tmp_path, monkeypatch):
    model, tok, info = load_random_model("random-llama", vocab_size=256)
    prompts = load_prompts("spec_bench", categories=["qa", "math", "translation"], per_category=1)
    path = tmp_path / "traces.parquet"
    calls = []
    real = record.generate
    crash_at = [len(prompts[0].turns) + len(prompts[1].turns) + 1]

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at[0]:
            raise KeyboardInterrupt                          # the third prompt never finishes
        return real(*args, **kwargs)

    monkeypatch.setattr(record, "generate", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        record_traces(model, tok, info, prompts, max_new_tokens=4, topk=3, progress=False, out=path)
    kept = read_traces(path)                                 # the two finished prompts are on disk
    assert [t.meta["prompt_id"] for t in kept] == [p.prompt_id for p in prompts[:2] for _ in p.turns]
    calls.clear()
    crash_at[0] = -1
    traces = record_traces(model, tok, info, prompts, max_new_tokens=4, topk=3, progress=False, out=path,
                           resume=True)
    ids = [p.prompt_id for p in prompts for _ in p.turns]
    assert [t.meta["prompt_id"] for t in traces] == ids and len(calls) == len(prompts[2].turns)
    assert [t.meta["prompt_id"] for t in read_traces(path)] == ids
    # a folder read takes the trace files only, not the results written beside them
    pl.DataFrame({"w_max": [1]}).write_parquet(tmp_path / "coverage.parquet")
    assert len(read_traces(tmp_path)) == len(ids)
    with pytest.raises(ValueError, match="max_new_tokens"):
        record_traces(model, tok, info, prompts, max_new_tokens=5, topk=3, progress=False, out=path, resume=True)


@pytest.mark.slow
def test_recorder_on_smollm2_equals_transformers_generate(smollm2_fp32):
    model, tok, info = smollm2_fp32
    prompts = load_prompts("spec_bench", categories=["qa", "math_reasoning"], per_category=1)
    eos = eos_token_ids(model, tok)
    traces = record_traces(model, tok, info, prompts, max_new_tokens=16, topk=16, progress=False)
    assert len(traces) == 2
    for t in traces:
        ids = torch.tensor([t.prompt.tolist()])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        assert t.generated.tolist() == out[0, ids.shape[1]:].tolist()
        assert (t.step_topk[:, 0] == t.generated).all()
        assert t.meta["tokenizer"] == "smollm2" and t.meta["system_prompt"] is True
