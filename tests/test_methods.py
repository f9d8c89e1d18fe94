"""The method registry (`engine.methods`): a method defined in this one file - a drafter that proposes a fixed
chain and its description - runs through the bench and the sweep's Table 2 builders with no other file edited,
its output is ar's token for token, and its description (default draft size, cap, display name, order) is what
the harness, the bench and the tables use; a shipped method is one file too - its drafter module's `METHOD`, read
from the source without importing it, is what importing the module gives - and each shipped description agrees
with its code; the registry's views are live, its errors clear, and it loads without torch."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

import specvocab.engine.config as config
import specvocab.engine.methods as methods
import specvocab.engine.metrics as metrics
from specvocab.engine import harness
from specvocab.engine.calibration import NO_CALIBRATION
from specvocab.engine.config import ConfigError, SpecConfig, calibration_fields
from specvocab.engine.drafters import available_methods, drafter_factory, make_drafter
from specvocab.engine.drafters.lmhead import LMHeadDrafter
from specvocab.engine.jobs.bench import BenchError, plan_runs, run_bench
from specvocab.engine.methods import (NO_DRAFTER, MethodSpec, UnknownMethodError, drafter_sources, forget_method,
                                      method_names, method_spec, read_method, register_method, shipped_specs)
from specvocab.engine.models import load_model
from specvocab.engine.tree import DraftTree, Drafter
from specvocab.sweeps import tables

TOY = "toy-chain"
TOY_SIZE, TOY_CAP = 5, 5          # the cap holds g at 5 where a padded row bucket would raise it to 7


class FixedChainDrafter(Drafter):
    """Proposes the same chain every step: the root, then tokens 1, 2, ..., g (whatever the context)."""

    uses_prefill_logits = False

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.g = cfg.require_draft_size()

    def propose(self, ids: torch.Tensor) -> DraftTree:
        tokens = torch.cat([ids[-1:].cpu(), torch.arange(1, self.g + 1)])
        return DraftTree(tokens, torch.arange(-1, self.g))


TOY_SPEC = MethodSpec(TOY, order=5, label="toy chain", drafter=FixedChainDrafter, default_draft_size=TOY_SIZE,
                      max_draft_size=lambda cfg: TOY_CAP, calibration_fields=("temperature",))


@pytest.fixture()
def toy():
    register_method(TOY_SPEC)
    yield TOY_SPEC
    forget_method(TOY)


@pytest.fixture(scope="module")
def loaded():
    return load_model("random-llama", vocab_size=256, num_layers=2, seed=3)


@pytest.fixture()
def prompt_file(tmp_path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["the cat sat on the mat, the cat sat on the"]},
            {"question_id": 2, "category": "math", "turns": ["1 2 3 1 2 3 1 2"]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# --- a method in one file ------------------------------------------------------------------------------------

def test_a_toy_method_runs_through_the_bench_and_table2_as_its_description_says(toy, loaded, prompt_file, tmp_path):
    frame = run_bench(methods=f"ar,pld,{TOY}", prompts=str(prompt_file), max_new_tokens=12, warmup=0,
                      out=tmp_path / "run", loaded=loaded, progress=False, show=False, calibration=NO_CALIBRATION)
    rows = frame.filter(pl.col("method") == TOY)
    assert rows.height == 2
    # lossless: the toy's tokens are ar's, prompt by prompt
    ar = frame.filter(pl.col("method") == "ar").select("prompt_id", ar_ids="output_ids")
    both = rows.join(ar, on="prompt_id")
    assert both.height == 2 and (both["output_ids"] == both["ar_ids"]).all()
    assert (rows["verdict"] == "exact").all()
    # the draft size is the description's default, held at its cap, and every step drafted the whole chain
    assert rows["draft_size"].to_list() == [TOY_CAP] * 2 and (rows["draft_size_source"] == "default").all()
    assert rows["g"].to_list() == [float(TOY_CAP)] * 2

    # Table 2 (MicroSpec): the run is named by the description's label and sits where its order puts it
    summary = tables.method_summary(frame.with_columns(prompt_set=pl.lit("toy")))
    assert tables.run_order(summary) == ["ar", "toy chain", "pld"]
    wide = tables.methods_wide(summary)
    assert wide["run"].to_list() == ["ar", "toy chain", "pld"]
    avg = summary.filter((pl.col("task") == metrics.AVG) & (pl.col("run") == "toy chain"))
    assert avg.height == 1 and avg["tau"][0] >= 1.0


def test_the_harness_reads_the_description_default_and_cap(toy, loaded):
    model = loaded[0]
    cfg = SpecConfig.preset(TOY)
    assert harness.max_draft_size(cfg) == TOY_CAP
    assert harness.default_draft_size(cfg, model, calibration=NO_CALIBRATION, with_source=True) == (TOY_SIZE, "default")
    resolved, source = harness.resolve_config(None, TOY, {"draft_size": 2}, model, with_source=True)
    assert (resolved.draft_size, source) == (2, "config")
    res = harness.generate(model, [5, 6, 7], method=TOY, draft_size=3, max_new_tokens=6, eos_ids=[])
    assert res.method == TOY and res.draft_tokens == 3 * (res.steps - 1)
    ar = harness.generate(model, [5, 6, 7], method="ar", max_new_tokens=6, eos_ids=[])
    assert res.output_ids.tolist() == ar.output_ids.tolist()


def test_a_registered_method_is_in_every_view_while_registered(toy):
    assert TOY in config.METHODS and TOY in config.DRAFTING_METHODS and TOY not in config.HF_METHODS
    assert TOY not in metrics.DRAFTERS and list(metrics.METHOD_ORDER)[:2] == ["ar", TOY]
    assert config.DEFAULT_DRAFT_SIZE[TOY] == TOY_SIZE and config.CALIBRATION_FIELDS[TOY] == ("temperature",)
    assert calibration_fields(SpecConfig.preset(TOY, temperature=0.5, top_p=0.9)) == {"temperature": 0.5}
    assert TOY in available_methods()
    forget_method(TOY)
    assert TOY not in config.METHODS and TOY not in metrics.METHOD_ORDER and TOY not in config.CALIBRATION_FIELDS
    with pytest.raises(ConfigError, match=f"unknown method.*{TOY}"):
        SpecConfig.preset(TOY)
    with pytest.raises(ConfigError, match=f"unknown method '{TOY}'.*register_method"):
        SpecConfig(method=TOY).validate()
    with pytest.raises(BenchError, match=TOY):
        plan_runs(f"ar,{TOY}")
    register_method(TOY_SPEC)                    # the fixture forgets it again


# --- the shipped descriptions agree with their code ---------------------------------------------------------

SHIPPED_NAMES = [s.name for s in shipped_specs()]
FIELDS = {f for f in SpecConfig.__dataclass_fields__}


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_each_shipped_description_agrees_with_its_code(name):
    spec = method_spec(name)
    assert set(spec.calibration_fields) <= FIELDS, set(spec.calibration_fields) - FIELDS
    assert name in config.PRESETS and SpecConfig.preset(name).method == name
    if spec.runner == "hf":
        with pytest.raises(UnknownMethodError, match="transformers' own generate"):
            drafter_factory(name)
        return
    factory = drafter_factory(name)
    # an LM head behind a vocabulary policy is what LMHeadDrafter adds; the bench takes --vocab for exactly these
    assert issubclass(factory, LMHeadDrafter) == spec.lm_head, (name, factory)
    if spec.lm_head:
        assert [r.policy for r in plan_runs(None, drafter=name, vocab="full,microspec")][1:] == ["full", "microspec"]
    else:
        with pytest.raises(BenchError, match="drafter"):
            plan_runs(None, drafter=name, vocab="microspec")
    cfg = SpecConfig.preset(name)
    if not spec.drafts:
        assert harness.default_draft_size(cfg, None) is None and harness.max_draft_size(cfg) is None


def test_display_names_and_orders_are_distinct_and_ar_comes_first():
    specs = [method_spec(n) for n in method_names()]
    assert len({s.display for s in specs}) == len({s.order for s in specs}) == len(specs)
    assert method_names()[0] == "ar" and not method_spec("ar").drafts


@pytest.mark.parametrize("name", [s.name for s in shipped_specs() if s.lm_head])
def test_a_method_with_an_lm_head_drafts_from_the_policy_it_is_given(name, loaded):
    """lm_head=True: the drafter restricts its head to `cfg.vocab` (its statistics report the active vocabulary,
    at most the window) and stays lossless."""
    model = loaded[0]
    heads = {"eagle": {"eagle_head": "random"}, "eagle3": {"eagle3_head": "random"},
             "layerskip": {"drafter_layers": "first:1"}}
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    res = harness.generate(model, prompt, method=name, vocab="microspec", w_max=16, draft_size=4, max_new_tokens=6,
                           eos_ids=[], **heads.get(name, {}))
    ar = harness.generate(model, prompt, method="ar", max_new_tokens=6, eos_ids=[])
    assert res.output_ids.tolist() == ar.output_ids.tolist()
    assert 0 < res.drafter_stats["mean_active_vocab"] <= 16


def test_the_caps_are_the_descriptions():
    for spec in shipped_specs():
        cfg = SpecConfig.preset(spec.name, eagle_depth=3, eagle_topk=4, store_k=3, tree_depth=2)
        assert harness.max_draft_size(cfg) == spec.draft_size_cap(cfg)
    # a description's own cap is what the harness returns without a model
    cap = lambda cfg: 11                                            # noqa: E731
    register_method(MethodSpec("capped", order=1, drafter=FixedChainDrafter, max_draft_size=cap))
    try:
        assert harness.max_draft_size(SpecConfig.preset("capped")) == 11
    finally:
        forget_method("capped")


# --- a shipped method is one file: its drafter module's METHOD, read without importing it ---------------------

WITH_DRAFTER = ["ar", "pld", "recycling", "unispec", "layerskip", "eagle", "eagle3", "merged"]


def test_the_shipped_methods_are_the_drafter_modules_descriptions_and_no_drafter():
    assert sorted(SHIPPED_NAMES) == sorted([*WITH_DRAFTER, *(s.name for s in NO_DRAFTER)])
    assert [s.name for s in NO_DRAFTER] == ["hf-prompt-lookup"]


@pytest.mark.parametrize("module", sorted(drafter_sources()))
def test_importing_a_drafter_module_gives_the_description_read_from_its_source(module):
    """The registry's reading of `METHOD = ...` (ast, no import) equals executing the module: every field, the
    callables included; a module without METHOD (lmhead) describes no method."""
    imported = importlib.import_module(f"{methods.DRAFTERS_PACKAGE}.{module}")
    name = module.replace("_", "-")
    if name not in WITH_DRAFTER:
        assert not hasattr(imported, "METHOD") and name not in method_names()
        return
    assert imported.METHOD == method_spec(name)
    assert imported.METHOD.name == name


def test_merged_is_keyed_by_its_sources_fields():
    fields = method_spec("merged").calibration_fields
    assert fields[0] == "merge_sources" and len(set(fields)) == len(fields)
    assert set(fields) - {"merge_sources"} == {f for m in config.MERGE_SOURCES
                                               for f in method_spec(m).calibration_fields}


def test_reading_the_methods_loads_neither_torch_nor_a_drafter():
    """A process that reads the registry through the config (a sweep's planner) lists every method without
    importing torch or any drafter module."""
    names, loaded = _in_a_fresh_process("import json, sys; import specvocab.engine.config as c; "
                                        "names = list(c.METHODS); print(json.dumps([names, sorted(k for k in "
                                        "sys.modules if k == 'torch' or k.startswith('specvocab.engine.drafters'))]))")
    assert names == list(method_names()) and loaded == []


def _in_a_fresh_process(code: str):
    """The JSON on the last line `code` prints, run by a fresh interpreter in the checkout."""
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(config.__file__).parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


FAKE_DRAFTERS = {
    # read before beta (sorted), yet its key names beta's fields: a description reads another's on demand
    "alpha.py": 'METHOD = MethodSpec("alpha", order=51, calibration_fields=("merge_sources", '
                '*calibration_fields_of("beta")))\n',
    "beta.py": "import torch\n\nMETHOD = MethodSpec('beta', order=50, max_draft_size=eagle_candidates,\n"
               "                    calibration_fields=(*SAMPLING, 'store_k'))\n\ndef f(): pass\n",
    "helper.py": "import torch\nLIMIT = 3\n",
}


@pytest.fixture()
def fake_drafters(tmp_path, monkeypatch):
    """The registry as a fresh process sees it, its drafter modules being the files written to the returned
    folder (read on the next registry read)."""
    monkeypatch.setattr(methods, "drafter_sources", lambda: {p.stem: p for p in sorted(tmp_path.glob("*.py"))})
    monkeypatch.setattr(methods, "_SOURCES", None)
    monkeypatch.setattr(methods, "_READ", {})
    monkeypatch.setattr(methods, "_REGISTRY", {s.name: s for s in NO_DRAFTER})
    return tmp_path


def test_the_registry_reads_each_drafter_source_once_in_any_order(fake_drafters):
    for name, text in FAKE_DRAFTERS.items():
        (fake_drafters / name).write_text(text)
    assert method_names() == ("hf-prompt-lookup", "beta", "alpha")
    beta = method_spec("beta")
    assert beta == MethodSpec("beta", order=50, max_draft_size=methods.eagle_candidates,
                              calibration_fields=("temperature", "top_p", "store_k"))
    assert method_spec("alpha").calibration_fields == ("merge_sources", "temperature", "top_p", "store_k")
    assert [s.name for s in shipped_specs()] == ["hf-prompt-lookup", "beta", "alpha"]
    with pytest.raises(UnknownMethodError, match="ships with the package"):
        forget_method("beta")
    with pytest.raises(UnknownMethodError, match="described twice"):
        register_method(MethodSpec("beta", order=7))


@pytest.mark.parametrize("text, match", [
    ("METHOD = MethodSpec('mine', order=50, default_draft_size=helper)\n\ndef helper(cfg): return 3\n",
     r"mine\.py: METHOD uses 'helper'.*literal, a 'module:attribute' string, or a public name of engine\.methods"),
    # no builtins: what a description may name is engine.methods' public names
    ("METHOD = MethodSpec('mine', order=50, calibration_fields=tuple(['temperature']))\n", r"mine\.py.*'tuple'"),
    ("METHOD = MethodSpec('mine', order=50)\nMETHOD = MethodSpec('mine', order=51)\n", "METHOD 2 times"),
    ("METHOD = ('mine', 50)\n", "is a tuple, not a MethodSpec"),
])
def test_a_description_the_reader_cannot_evaluate_is_a_clear_error(tmp_path, text, match):
    path = tmp_path / "mine.py"
    path.write_text(text)
    with pytest.raises(UnknownMethodError, match=match):
        read_method(path)


def test_a_drafter_source_describing_another_method_fails_the_registry_read(fake_drafters):
    (fake_drafters / "mine.py").write_text("METHOD = MethodSpec('yours', order=50)\n")
    for _ in range(2):                   # the next read reports the same error, never a partial registry
        with pytest.raises(UnknownMethodError, match=r"mine\.py describes method 'yours'.*yours\.py"):
            method_names()


def test_descriptions_that_read_each_other_are_a_clear_error(fake_drafters):
    (fake_drafters / "one.py").write_text("METHOD = MethodSpec('one', order=50, calibration_fields="
                                          "calibration_fields_of('two'))\n")
    (fake_drafters / "two.py").write_text("METHOD = MethodSpec('two', order=51, calibration_fields="
                                          "calibration_fields_of('one'))\n")
    with pytest.raises(UnknownMethodError, match="one -> two -> one read each other"):
        method_names()


# --- the registry's rules ------------------------------------------------------------------------------------

def test_inconsistent_descriptions_and_unknown_names_are_clear_errors():
    with pytest.raises(UnknownMethodError, match="drafts nothing.*lm_head"):
        MethodSpec("x", order=1, drafts=False, lm_head=True)
    with pytest.raises(UnknownMethodError, match="runner='hf'.*no drafter"):
        MethodSpec("x", order=1, runner="hf", drafter=FixedChainDrafter)
    with pytest.raises(UnknownMethodError, match="runner 'vllm'"):
        MethodSpec("x", order=1, runner="vllm")
    with pytest.raises(UnknownMethodError, match="without commas"):
        MethodSpec("a,b", order=1)
    with pytest.raises(UnknownMethodError, match="described twice"):
        register_method(MethodSpec("ar", order=3))
    with pytest.raises(UnknownMethodError, match="ships with the package"):
        forget_method("pld")
    with pytest.raises(UnknownMethodError, match=r"unknown method 'nope'.*'ar'"):
        method_spec("nope")
    register_method(MethodSpec("no-code", order=2))
    try:
        with pytest.raises(UnknownMethodError, match="no module.*no_code.*register_drafter"):
            make_drafter(None, SpecConfig.preset("no-code"))
    finally:
        forget_method("no-code")


def test_a_description_names_its_code_lazily():
    """"module:attribute" callables: recycling's default and cap read its template, imported on first call."""
    from specvocab.engine.drafters.recycling import template_size
    spec, cfg = method_spec("recycling"), SpecConfig.preset("recycling")
    assert spec.draft_size_default(cfg) == spec.draft_size_cap(cfg) == template_size(cfg.recycling_tree)
    assert spec.draft_size_cap(cfg.replace(recycling_tree="nope")) is None
    bad = MethodSpec("bad-ref", order=1, default_draft_size="no_colon_here")
    with pytest.raises(UnknownMethodError, match="not a 'package.module:attribute'"):
        bad.draft_size_default(cfg)


def test_the_registry_loads_without_torch_or_the_engine():
    loaded = _in_a_fresh_process("import json, sys; import specvocab.engine.methods as m; print(json.dumps(sorted("
                                 "k for k in sys.modules if k == 'torch' or k.startswith('specvocab.engine.'))))")
    assert loaded == ["specvocab.engine.methods"]
