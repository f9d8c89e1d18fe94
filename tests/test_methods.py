"""The method registry (`engine.methods`): a method defined in this one file - a drafter that proposes a fixed
chain and its description - runs through the bench and the sweep's Table 2 builders with no other file edited,
its output is ar's token for token, and its description (default draft size, cap, display name, order) is what
the harness, the bench and the tables use; each shipped description agrees with its code; the registry's views
are live, its errors clear, and it loads without torch."""

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

import specvocab.engine.config as config
import specvocab.engine.metrics as metrics
from specvocab.engine import harness
from specvocab.engine.calibration import NO_CALIBRATION
from specvocab.engine.config import ConfigError, SpecConfig, calibration_fields
from specvocab.engine.drafters import available_methods, drafter_factory, make_drafter
from specvocab.engine.drafters.lmhead import LMHeadDrafter
from specvocab.engine.jobs.bench import BenchError, plan_runs, run_bench
from specvocab.engine.methods import (SHIPPED, MethodSpec, UnknownMethodError, forget_method, method_names,
                                      method_spec, register_method)
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

SHIPPED_NAMES = [s.name for s in SHIPPED]
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


@pytest.mark.parametrize("name", [s.name for s in SHIPPED if s.lm_head])
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
    for spec in SHIPPED:
        cfg = SpecConfig.preset(spec.name, eagle_depth=3, eagle_topk=4, store_k=3, tree_depth=2)
        assert harness.max_draft_size(cfg) == spec.draft_size_cap(cfg)
    # a description's own cap is what the harness returns without a model
    cap = lambda cfg: 11                                            # noqa: E731
    register_method(MethodSpec("capped", order=1, drafter=FixedChainDrafter, max_draft_size=cap))
    try:
        assert harness.max_draft_size(SpecConfig.preset("capped")) == 11
    finally:
        forget_method("capped")


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
    root = Path(config.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", "import json, sys; import specvocab.engine.methods as m; "
                          "print(json.dumps(sorted(k for k in sys.modules if k == 'torch' or "
                          "k.startswith('specvocab.engine.'))))"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["specvocab.engine.methods"]
