"""engine.resolve: a run's open choices resolved once, before the decode, each with its source; the draft size
calibrated on the spot when this machine's cache has none; the kernel build in the calibration key. Tiny random
Llamas, and SmolLM2 once (the on-the-spot calibration on a real model)."""

from __future__ import annotations

import time
import warnings

import polars as pl
import pytest
import torch

import specvocab.engine.calibration as calib
import specvocab.engine.harness as harness
import specvocab.engine.jobs.bench as bench
import specvocab.engine.resolve as resolve
import specvocab.engine.shipped as shipped
import specvocab.engine.vocab.dynaspec as dynaspec
import specvocab.engine.vocab.frspec_lists as frspec_lists
from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.harness import bucket_edge, generate
from specvocab.engine.models import eos_token_ids, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("random-llama", vocab_size=512, hidden_size=64, num_layers=2, seed=5)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    monkeypatch.setattr(calib, "_warned", set())     # the once-per-key warnings, as in a fresh process
    return tmp_path / "cache"


def _forbid(monkeypatch, calls: list | None = None):
    """Every lookup a resolution makes raises from now on (or, with `calls`, is counted and delegates): the
    shipped head (`engine.shipped._matching`, under both default head functions), the calibration records
    (`calibration_source`), the default frequency list (`kept_special_ids`, which counting one starts with) and
    the DynaSpec fit (`find_fitted`'s cache folder). Patched where they are looked up at call time, so a caller
    that imported a lookup by name is caught too."""
    places = [(shipped, "_matching"), (calib, "calibration_source"), (frspec_lists, "kept_special_ids"),
              (dynaspec, "cache_root")]
    for module, name in places:
        def lookup(*args, _name=name, _real=getattr(module, name), **kwargs):
            if calls is None:
                raise AssertionError(f"{_name} was looked up after the run was resolved")
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, lookup)


def test_a_resolved_run_decodes_without_looking_anything_up(tiny, cache, monkeypatch):
    """Head (shipped), FR-Spec list (default), draft size (given) resolved once; a drafter built from the resolved
    config and a generate on it read no lookup, and a drafter given an open head refuses it rather than look one
    up itself."""
    model, tok, info = tiny
    monkeypatch.setattr(resolve, "default_eagle_head", lambda target: "random")     # the head "shipped" for it
    cfg = SpecConfig.preset("eagle", vocab="frspec", frspec_k=64, draft_size=4, max_new_tokens=8)
    res = resolve.resolve_run(cfg, model, tokenizer=tok, info=info, eos_ids=[])
    assert res.cfg.eagle_head == "random" and res.head == "random" and res.head_source == "shipped"
    assert res.cfg.frequency_file is not None and res.vocab_file == res.cfg.frequency_file
    assert res.vocab_file_source == "default" and (res.vocab_size, res.vocab_size_source) == (64, "given")
    assert (res.draft_size, res.draft_size_source) == (4, "config")
    assert res.provenance() == {"draft_size": "given", "head": "shipped", "vocab_file": "default",
                                "vocab_size": "given", "kernel_build": calib.kernel_build_source()}
    assert res.kernel_build == calib.kernel_build(model, res.cfg)
    _forbid(monkeypatch)
    make_drafter(model, res.cfg)
    prompt = torch.arange(20, 40)
    out = generate(model, prompt, res.cfg, eos_ids=[])
    assert out.output_ids.tolist() == generate(model, prompt, method="ar", max_new_tokens=8, eos_ids=[]).output_ids.tolist()
    with pytest.raises(DrafterError, match="not resolved.*eagle_head="):
        make_drafter(model, SpecConfig.preset("eagle", draft_size=4))


def test_the_bench_resolves_each_run_once_and_writes_its_provenance(tiny, cache, monkeypatch, tmp_path):
    """Two prompts, two runs: each lookup happens once per run, before the first prompt; every row carries the
    resolution's columns."""
    model, tok, info = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": 1, "category": "qa", "turns": ["a b c a b c a b"]}\n'
                       '{"question_id": 2, "category": "qa", "turns": ["one two one two one"]}\n')
    calls: list[str] = []
    resolved = []
    real = bench.resolve_run
    monkeypatch.setattr(bench, "resolve_run", lambda *a, **k: resolved.append(a[0].method) or real(*a, **k))
    _forbid(monkeypatch, calls)
    frame = bench.run_bench(methods="ar,pld", drafter="layerskip", vocab="frspec:32", prompts=str(prompts),
                            max_new_tokens=6, warmup=0, loaded=(model, tok, info), progress=False, show=False,
                            config={"draft_size": 3, "drafter_layers": "first:1"}, calibration=calib.NO_CALIBRATION,
                            draft_size_source="calibrate-cell")
    assert sorted(resolved) == ["ar", "layerskip", "pld"]                  # one resolution per run
    assert calls == ["kept_special_ids"]                                   # the one open choice, looked up once
    rows = {m: frame.filter(pl.col("method") == m) for m in ("ar", "pld", "layerskip")}
    assert all(r.height == 2 for r in rows.values())
    build = calib.kernel_build(model, SpecConfig.preset("ar"))
    assert (frame["kernel_build"] == build).all() and (frame["kernel_build_source"] == calib.kernel_build_source()).all()
    ar, pld, ls = (rows[m].row(0, named=True) for m in ("ar", "pld", "layerskip"))
    assert ar["draft_size_source"] is None and ar["draft_head_source"] is None and ar["vocab_file_source"] is None
    assert (pld["draft_size"], pld["draft_size_source"]) == (3, "calibrate-cell")    # the caller's label of its size
    assert (ls["draft_head"], ls["draft_head_source"]) == ("first:1", "given")
    assert ls["vocab_file_source"] == "default" and ls["vocab_file"].endswith(".pt")
    assert (ls["vocab_size"], ls["vocab_size_source"]) == (32, "given")


def test_the_kernel_build_is_part_of_the_calibration_key(tiny, cache, monkeypatch):
    """A machine with matrix units and one without (here: the same CPU told it is one, then the other) keep their
    own g*: the key names the build, and a record of one build is not found under the other."""
    model = tiny[0]
    cfg = SpecConfig.preset("pld")
    builds = {b.name: b for b in calib.cpu.builds.CHAIN}
    monkeypatch.setattr(calib, "cpu_kernels_run", lambda *a, **k: True)
    monkeypatch.setattr(calib.cpu, "provider", lambda op: builds["avx512"])
    plain = calib.model_key(model, cfg)
    calib.save_calibration(plain, {"g_star": 5, "code": calib.code_stamp()})
    assert calib.resolve_draft_size_source(cfg, model) == (5, calib.calibration_source().label)
    monkeypatch.setattr(calib.cpu, "provider", lambda op: builds["amx-bf16"])
    amx = calib.model_key(model, cfg)
    assert amx != plain and amx.endswith("|amx-bf16") and plain.endswith("|avx512")
    assert amx.rsplit("|", 1)[0] == plain.rsplit("|", 1)[0]                # the same model, device, dtype, config
    with pytest.warns(UserWarning, match="no calibrated draft size"):
        assert calib.resolve_draft_size_source(cfg, model)[1] == "default"
    monkeypatch.setattr(calib, "cpu_kernels_run", lambda *a, **k: False)   # the kernels off: torch decodes
    assert calib.model_key(model, cfg).endswith("|torch")


def test_the_head_is_resolved_before_the_size_it_keys(tiny, cache, monkeypatch):
    """eagle_head is part of eagle's calibration key: with eagle_head=None the size is looked up under the head
    that will run (the shipped one), where a calibration of that head keyed it - by resolve_run and by
    generate's own resolve_config alike."""
    model, tok, info = tiny
    for module in (resolve, harness):
        monkeypatch.setattr(module, "default_eagle_head", lambda target: "random")
    cfg = SpecConfig.preset("eagle", max_new_tokens=8)
    calib.save_calibration(calib.model_key(model, cfg.replace(eagle_head="random")),
                           {"g_star": 5, "code": calib.code_stamp()})
    expect = harness.default_draft_size(cfg.replace(eagle_head="random"), model)
    res = resolve.resolve_run(cfg, model, tokenizer=tok, info=info, eos_ids=[])
    assert (res.cfg.eagle_head, res.draft_size) == ("random", expect)
    assert res.draft_size_source.startswith("calibration-cache:")
    assert harness.resolve_config(cfg, model=model).draft_size == expect


def test_on_the_spot_the_size_is_the_best_at_or_below_the_knee(tiny, cache, monkeypatch):
    """Measurements (made up here) where the largest tree has the best step time but its forward does not pay
    for itself: g* is chosen among the sizes at or below the knee only."""
    model, tok, info = tiny
    cfg = SpecConfig.preset("pld", max_new_tokens=8)
    grid = resolve.spot_grid(cfg, model)
    assert len(grid) >= 3
    forward = {0: 1.0, **{g: 1.0 + 0.1 * i for i, g in enumerate(grid)}}
    forward[grid[-1]] = 10.0                                      # the largest tree's forward: far past its tau
    step = {0: 1.0, **{g: 1.0 for g in grid}}
    step[grid[-1]] = 0.5                                          # ... yet the fastest step (inconsistent on purpose)
    tau = {0: 1.0, **{g: 1.0 + 0.2 * i for i, g in enumerate(grid)}}

    def fake_round_robin(model_, prompts, cfgs, **kw):
        return {g: [{"new_tokens": int(100 * tau[g]), "steps": 100, "s_step": [step[g]], "s_forward": [forward[g]],
                     "draft_tokens": 100 * g}] for g in cfgs}

    monkeypatch.setattr(resolve, "round_robin", fake_round_robin)
    monkeypatch.setattr(resolve, "run_prompts", lambda *a, **k: None)
    rec = resolve.calibrate_here(model, cfg, prompts=[torch.arange(5)], save=False, show=False)
    assert rec["knee"] == grid[-2] and rec["g_star"] <= grid[-2]
    assert rec["g_star"] == grid[-2]                               # tau rises, the step time is flat below the knee


def test_the_knee_is_the_largest_size_whose_forward_pays_for_itself():
    rows = [{"g": 1, "tau": 1.3, "s_forward": 1.2}, {"g": 3, "tau": 1.6, "s_forward": 1.5},
            {"g": 7, "tau": 1.9, "s_forward": 2.0}, {"g": 15, "tau": 2.2, "s_forward": 2.1}]
    assert resolve.knee(rows, 1.0) == 15            # 2.1 / 1.0 <= 2.2: the largest that pays, not the first that fails
    assert resolve.knee(rows[:3], 1.0) == 3
    assert resolve.knee([{"g": 2, "tau": 1.1, "s_forward": 3.0}, {"g": 4, "tau": 1.2, "s_forward": 4.0}], 1.0) == 2


def test_an_empty_cache_calibrates_on_the_spot_at_or_below_the_knee(tiny, cache):
    """No record: `draft_size=None` is measured here (training-corpus prompts), cached, and said in one line; the
    size is the fit over the sizes at or below the knee, so never above it; the next run reads the record."""
    model, tok, info = tiny
    cfg = SpecConfig.preset("pld", max_new_tokens=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                # no fallback warning: nothing was missing
        res = resolve.resolve_run(cfg, model, tokenizer=tok, info=info, eos_ids=[], show=False)
    rec = calib.load_calibrations()[calib.model_key(model, cfg)]
    assert res.draft_size_source == resolve.ON_THE_SPOT and rec["on_the_spot"]
    assert res.draft_size == rec["g_star"] <= rec["knee"]
    assert rec["knee"] == resolve.knee(rec["rows"], rec["ar"]["s_forward"])
    assert [r["g"] for r in rec["rows"]] == resolve.spot_grid(cfg, model)
    again = resolve.resolve_run(cfg, model, tokenizer=tok, info=info, eos_ids=[])
    assert again.draft_size == res.draft_size and again.draft_size_source.startswith("calibration-cache:")
    # a run told to read no records never calibrates: the uncalibrated default, as a sweep's cells
    with pytest.warns(UserWarning, match="no calibrated draft size"):
        none = resolve.resolve_run(cfg, model, tokenizer=tok, info=info, calibration=calib.NO_CALIBRATION)
    assert (none.draft_size, none.draft_size_source) == (harness.default_draft_size(cfg, model, calibration=calib.NO_CALIBRATION), "default")


def test_without_training_prompts_the_cpu_default_is_cpu_sized(tiny, cache):
    """No info to encode training-corpus prompts with: one warning, and on a CPU the fallback is capped at the
    CPU's default tree, never a GPU-sized one (eagle's uncalibrated 59)."""
    model = tiny[0]
    cfg = SpecConfig.preset("layerskip", drafter_layers="first:1")
    with pytest.warns(UserWarning, match="none could be measured on the spot"):
        res = resolve.resolve_run(cfg, model)
    assert res.draft_size_source == "default"
    assert res.draft_size == bucket_edge(cfg, model, calib.FALLBACK_DRAFT_SIZE["cpu"]) < 59


def test_smollm2_calibrates_on_the_spot_in_seconds(smollm2, cache, capsys):
    """The real model with an empty cache: unispec's g at or below the measured knee, said in one line; the time
    it took is printed (not asserted: a shared machine's timing is no test)."""
    model, tok, info = smollm2
    t0, c0 = time.perf_counter(), time.process_time()
    res = resolve.resolve_run(SpecConfig.preset("unispec"), model, tokenizer=tok, info=info,
                              eos_ids=eos_token_ids(model, tok), show=True)
    took, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    rec = calib.load_calibrations()[calib.model_key(model, res.keyed)]
    said = [line for line in capsys.readouterr().out.splitlines() if "calibrated on the spot" in line]
    assert len(said) == 1 and f"g = {res.draft_size}" in said[0] and str(calib.cache_file()) in said[0]
    assert res.draft_size_source == resolve.ON_THE_SPOT and res.draft_size == rec["g_star"] <= rec["knee"]
    print(f"on-the-spot calibration of unispec on SmolLM2: {took:.1f} s wall, {cpu_s:.1f} s of this process's CPU "
          f"time on {torch.get_num_threads()} threads, g = {res.draft_size}, knee {rec['knee']}, "
          f"rows {[(r['g'], round(r['tau'], 2), round(r['verify_ratio'], 2)) for r in rec['rows']]}")
