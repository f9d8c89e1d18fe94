"""locality.record: greedy decoding with top-K kept, traces per turn, Parquet round trip, CLI."""


import numpy as np
import polars as pl
import pytest
import torch

from engine.models import RANDOM_MODELS, eos_token_ids, load_random_model
from engine.prompts import PromptTooLongError, encode_prompt, load_prompts
from locality import read_traces, write_traces
from locality import record
from locality.record import greedy_with_topk, record_traces


def _naive_greedy(model, prompt, n, eos=()):
    """Reference: no KV cache, a full forward over the whole sequence for every token."""
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            break
    return out


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_greedy_with_topk_matches_a_naive_loop(name, monkeypatch):
    model, _, _ = load_random_model(name, num_layers=3)
    prompt = list(range(5, 45))           # longer than random-gemma3's sliding window (16)
    # chunks of 7 rows in the prefill top-K, so the chunk seams are exercised
    monkeypatch.setattr(record, "_TOPK_CHUNK_ELEMS", 7 * model.config.vocab_size)
    prefill, generated, step = greedy_with_topk(model, prompt, max_new_tokens=12, topk=5, eos_ids=[])
    assert generated.tolist() == _naive_greedy(model, prompt, 12)
    assert step.shape == (12, 5) and torch.equal(step[:, 0], generated)
    with torch.no_grad():
        full = model(torch.tensor([prompt + generated.tolist()])).logits[0]       # [L+T, V]
    L = len(prompt)
    assert prefill.shape == (L - 1, 5)
    assert torch.equal(prefill, full[:L - 1].topk(5, dim=-1).indices)
    assert torch.equal(step[:, 0], full[L - 1:-1].argmax(-1))
    # rows are sorted by logit: each top-K is a descending run of the reference logits
    vals = full[:L - 1].gather(1, prefill)
    assert (vals[:, :-1] >= vals[:, 1:]).all()


def test_greedy_stops_after_an_eos_and_keeps_it():
    model, _, _ = load_random_model("random-llama")
    prompt = [1, 2, 3, 4]
    free = _naive_greedy(model, prompt, 10)
    eos = free[3]
    stop = free.index(eos)               # the first time that token appears
    _, generated, step = greedy_with_topk(model, prompt, max_new_tokens=10, topk=3, eos_ids=[eos])
    assert generated.tolist() == free[:stop + 1] and step.shape == (stop + 1, 3)


def test_one_token_prompt_has_an_empty_prefill():
    model, _, _ = load_random_model("random-qwen3")
    prefill, generated, step = greedy_with_topk(model, [7], max_new_tokens=3, topk=4, eos_ids=[])
    assert prefill.shape == (0, 4) and len(generated) == 3 and step.shape == (3, 4)


def test_record_round_trips_through_parquet_with_one_trace_per_turn(tmp_path):
    model, tok, info = load_random_model("random-llama", vocab_size=256)
    prompts = load_prompts("spec_bench", categories=["qa", "writing"], per_category=1)
    traces = record_traces(model, tok, info, prompts, max_new_tokens=8, topk=4, progress=False)
    assert [(t.meta["category"], t.meta["turn"]) for t in traces] == [("writing", 1), ("writing", 2), ("qa", 1)]
    for t, (p, turn) in zip(traces, [(prompts[0], 1), (prompts[0], 2), (prompts[1], 1)]):
        assert t.meta["model"] == "random-llama" and t.meta["prompt_set"] == "spec_bench"
        assert t.meta["prompt_id"] == p.question_id and t.meta["language"] == "en"
        assert t.prefill_topk.shape == (len(t.prompt) - 1, 4) and t.step_topk.shape == (len(t.generated), 4)
        assert (t.step_topk[:, 0] == t.generated).all()
        assert 1 <= len(t.generated) <= 8
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
        assert a.meta == b.meta
    df = pl.read_parquet(path)
    assert df["turn"].to_list() == [1, 2, 1] and df["tokenizer"].to_list() == ["", "", ""]


def test_record_checks_every_first_turn_fits_before_decoding(monkeypatch):
    model, tok, info = load_random_model("random-llama", max_context=128)
    short = load_prompts("spec_bench", categories=["qa"], per_category=1)
    long = load_prompts("spec_bench", categories=["summarization"], per_category=1)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started before every first turn was checked")

    monkeypatch.setattr(record, "greedy_with_topk", no_decoding)
    with pytest.raises(PromptTooLongError, match=f"spec_bench/{long[0].question_id}"):
        record_traces(model, tok, info, short + long, max_new_tokens=8, topk=2, progress=False)


def test_cli_writes_traces_and_prints_a_summary(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kwargs = record._parse(["--model", "random-gemma3", "--prompts", "multilingual", "--per-category", "1",
                            "--categories", "qa,multi_turn", "--languages", "en,zh", "--max-new-tokens", "5",
                            "--topk", "3", "--out", str(out), "--no-progress", "--report"])
    path = record.main(**kwargs)
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
    assert report.filter(pl.col("category") == "(all)")["steps"].item() == sum(len(t.generated) for t in traces)


def test_record_writes_after_every_prompt_and_resumes(tmp_path, monkeypatch):
    model, tok, info = load_random_model("random-llama", vocab_size=256)
    prompts = load_prompts("spec_bench", categories=["qa", "math", "translation"], per_category=1)
    path = tmp_path / "traces.parquet"
    calls = []
    real = record.greedy_with_topk
    crash_at = [len(prompts[0].turns) + len(prompts[1].turns) + 1]

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at[0]:
            raise KeyboardInterrupt                          # the third prompt never finishes
        return real(*args, **kwargs)

    monkeypatch.setattr(record, "greedy_with_topk", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        record_traces(model, tok, info, prompts, max_new_tokens=4, topk=3, progress=False, out=path)
    kept = read_traces(path)                                 # the two finished prompts are on disk
    assert [t.meta["prompt_id"] for t in kept] == [p.question_id for p in prompts[:2] for _ in p.turns]
    calls.clear()
    crash_at[0] = -1
    traces = record_traces(model, tok, info, prompts, max_new_tokens=4, topk=3, progress=False, out=path,
                           resume=True)
    ids = [p.question_id for p in prompts for _ in p.turns]
    assert [t.meta["prompt_id"] for t in traces] == ids and len(calls) == len(prompts[2].turns)
    assert [t.meta["prompt_id"] for t in read_traces(path)] == ids
    # a folder read takes the trace files only, not the results written beside them
    pl.DataFrame({"w_max": [1]}).write_parquet(tmp_path / "coverage.parquet")
    assert len(read_traces(tmp_path)) == len(ids)
    with pytest.raises(ValueError, match="max_new_tokens"):
        record_traces(model, tok, info, prompts, max_new_tokens=5, topk=3, progress=False, out=path, resume=True)


@pytest.mark.slow
def test_recorder_on_smollm2_equals_transformers_generate(smollm2):
    model, tok, info = smollm2
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
