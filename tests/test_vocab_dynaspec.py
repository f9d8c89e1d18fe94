"""DynaSpec at decode time (`engine.vocab.dynaspec`, `engine.vocab.DynaSpecVocab`).

- the position-aware budget k_c(t) and the fixed one;
- option B (one head over the union, each row masked to its own shortlist) equals a per-row reference;
- the policy: every row gets k_c(t) clusters, greedy decoding with the layerskip drafter is lossless
  (== ar), all clusters reproduce the full head's drafts, stats report per-row and union sizes;
- save/load round trip, a torn or foreign file, another model's head -> clear errors; `find_fitted`;
- the router on its own CUDA stream equals the CPU one.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specvocab.engine.artifacts import head_fingerprint, sidecar_path
from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate
from specvocab.engine.vocab.dynaspec_fit import spherical_kmeans
from specvocab.engine.models import load_model
from specvocab.engine.vocab import DynaSpecVocab, head_topk, make_policy
from specvocab.engine.vocab.dynaspec import (ClusterLayout, DynaSpecError, FittedDynaSpec, Router, cluster_budget, find_fitted,
                                   load_dynaspec, per_row_reference_logits, save_dynaspec, select_clusters,
                                   shortlist_logits, union_shortlist)
from tests.engine_testing import untie_head

V = 384


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py: tiny matmuls run faster on one thread


# --- budget ------------------------------------------------------------------------------------------------

def test_cluster_budget_schedule():
    # DynaSpec-PA (§4.2): k_max at t = 0, 1, then floor(k_max / ((t + 1) * 2))
    assert [cluster_budget(t, 60) for t in range(6)] == [60, 60, 10, 7, 6, 5]
    assert [cluster_budget(t, 256) for t in range(6)] == [256, 256, 42, 32, 25, 21]
    assert [cluster_budget(t, 60, "fixed") for t in range(6)] == [60] * 6          # DynaSpec-F
    assert [cluster_budget(t, 4) for t in range(4)] == [4, 4, 1, 1]                 # floor 0 -> k_min = 1
    assert [cluster_budget(t, 24, k_min=3) for t in range(6)] == [24, 24, 4, 3, 3, 3]
    assert cluster_budget(0, 300, num_clusters=128) == 128
    with pytest.raises(DynaSpecError, match="unknown budget"):
        cluster_budget(0, 8, "decay")
    with pytest.raises(DynaSpecError, match="k_max >= 1"):
        cluster_budget(2, 0)


# --- option B vs a per-row reference -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_union_head_masked_per_row_equals_per_row_reference(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, d, m, r = 301, 24, 19, 7
    weight = torch.randn(vocab, d, generator=g)
    assign = torch.randint(0, m, (vocab,), generator=g)                  # unbalanced, some maybe empty
    layout = ClusterLayout.from_assign(assign, m)
    h = torch.randn(r, d, generator=g)
    ks = [1, 2, 3, 5, 8, 13, 19]                                          # a different budget per row
    mask = torch.stack([select_clusters(torch.randn(1, m, generator=g), k)[0] for k in ks])   # [r, M]
    idx, row_ok = union_shortlist(mask, layout)
    assert sorted(idx.tolist()) == sorted(torch.nonzero(mask.any(0)[assign]).flatten().tolist())
    logits = shortlist_logits(h, weight, idx, row_ok)                     # [r, u]
    ref = per_row_reference_logits(h, weight, assign, mask)               # [r, V]
    scattered = torch.full((r, vocab), float("-inf")).scatter(1, idx.expand(r, -1), logits)
    assert torch.equal(torch.isfinite(scattered), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(scattered[fin], ref[fin], rtol=1e-5, atol=1e-5)
    lp, ids = head_topk(logits, idx, 10)                                  # what the drafter proposes
    lp_ref, ids_ref = head_topk(ref, None, 10)
    assert torch.equal(ids, ids_ref) and torch.allclose(lp, lp_ref, atol=1e-5)
    assert row_ok.sum(1).tolist() == (mask.long() * layout.sizes).sum(1).tolist()


# --- the policy -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=5)
    untie_head(model, seed=3)
    weight = model.get_output_embeddings().weight.detach()
    m = 32
    km = spherical_kmeans(weight, m, seed=0)
    torch.manual_seed(0)
    fitted = FittedDynaSpec(assign=km.assign, router=Router(48, m, 32).eval(),
                            meta={"model": "random-llama-seed5", "head_fingerprint": head_fingerprint(weight),
                                  "drafter_config": {"drafter": "layerskip", "drafter_layers": "skip:1",
                                                     "eagle_depth": 5}})
    return model, weight, fitted


def _prompt(seed, n=40):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, V, n // 3)
    return torch.tensor(np.concatenate([base, rng.integers(0, V, n - 2 * base.size), base]))


def test_policy_routes_each_row_to_its_budget(tiny):
    _, weight, fitted = tiny
    cfg = SpecConfig.preset("layerskip", vocab="dynaspec", dynaspec_k_max=12)
    pol = DynaSpecVocab(weight, cfg, fitted=fitted)
    pol.begin(torch.tensor([1, 2, 3]), None)
    g = torch.Generator().manual_seed(0)
    for t, r in enumerate([1, 10, 10, 10, 10]):
        tokens = torch.randint(0, V, (r,), generator=g)
        parent_h, h = torch.randn(r, 48, generator=g), torch.randn(r, 48, generator=g)
        pol.route(tokens, parent_h, t)
        mask = pol.head._pending.clone()
        assert mask.sum(1).tolist() == [cluster_budget(t, 12)] * r
        logits, idx = pol.logits(h)
        ref = per_row_reference_logits(h, weight, fitted.assign, mask)
        assert torch.equal(torch.isfinite(logits).sum(1), torch.isfinite(ref).sum(1))
        with pytest.raises(DynaSpecError, match="route"):                 # one head call per routing
            pol.logits(h)
    pol.record_step()
    st = pol.stats()
    assert 0 < st["mean_row_vocab"] <= st["mean_union_vocab"] <= st["max_union_vocab"] < V
    assert st["mean_active_vocab"] == pytest.approx(st["mean_row_vocab"])


def test_policy_lossless_greedy_and_reports_sizes(tiny, tmp_path):
    model, weight, fitted = tiny
    fitted = dataclasses.replace(fitted, meta={**fitted.meta, "drafter_config": {**fitted.meta["drafter_config"],
                                                                                 "eagle_depth": 4}})
    path = save_dynaspec(fitted, tmp_path / "tiny.safetensors")
    common = dict(max_new_tokens=24, eos_ids=[], drafter_layers="skip:1", eagle_depth=4, draft_size=19)
    for i, extra in enumerate([dict(dynaspec_k_max=8), dict(dynaspec_k_max=4, dynaspec_budget="fixed"),
                               dict(dynaspec_k_max=1)]):
        ar = generate(model, _prompt(i), method="ar", max_new_tokens=24, eos_ids=[]).output_ids.tolist()
        out = generate(model, _prompt(i), method="layerskip", vocab="dynaspec", dynaspec_file=str(path),
                       **common, **extra)
        assert out.output_ids.tolist() == ar, extra
        st, tm = out.drafter_stats, out.drafter_timings
        assert 0 < st["mean_row_vocab"] <= st["mean_union_vocab"] <= st["max_union_vocab"] <= V
        assert st["mean_row_vocab"] < V / 2 and tm["router"] > 0 and tm["lm_head"] > 0
        assert 0 <= st["coverage"] <= 1
    # every cluster at every step: the union is the whole vocabulary and the drafts are the full head's
    full = generate(model, _prompt(5), method="layerskip", vocab="full", **common)
    every = generate(model, _prompt(5), method="layerskip", vocab="dynaspec", dynaspec_file=str(path),
                     dynaspec_k_max=32, dynaspec_budget="fixed", **common)
    assert every.output_ids.tolist() == full.output_ids.tolist() and every.steps == full.steps
    assert every.drafter_stats["mean_row_vocab"] == every.drafter_stats["mean_union_vocab"] == V


# --- save / load -----------------------------------------------------------------------------------------------

def test_save_load_round_trip_and_wrong_model(tiny, tmp_path):
    _, weight, fitted = tiny
    path = save_dynaspec(fitted, tmp_path / "a.safetensors")
    meta = json.loads((tmp_path / "a.safetensors.json").read_text())
    assert (meta["model"], meta["vocab_size"], meta["hidden_size"], meta["num_clusters"], meta["router_width"]) \
        == ("random-llama-seed5", V, 48, 32, 32)
    back = load_dynaspec(path, weight)
    assert torch.equal(back.assign, fitted.assign)
    for (k, a), b in zip(fitted.router.state_dict().items(), back.router.state_dict().values()):
        assert torch.equal(a, b), k

    other, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=6)
    with pytest.raises(DynaSpecError, match="fitted for model 'random-llama-seed5'.*other weights"):
        load_dynaspec(path, other.get_output_embeddings().weight)
    bigger, _, _ = load_model("random-llama", vocab_size=V + 8, hidden_size=48, num_layers=1)
    with pytest.raises(DynaSpecError, match="vocabulary 384"):
        load_dynaspec(path, bigger.get_output_embeddings().weight)
    with pytest.raises(DynaSpecError, match="vocabulary 384"):            # through the policy, too
        make_policy(SpecConfig.preset("layerskip", vocab="dynaspec", dynaspec_file=str(path)),
                    bigger.get_output_embeddings().weight)

    save_dynaspec(fitted, tmp_path / "b.safetensors")                     # a torn pair: b's tensors, a's sidecar
    (tmp_path / "b.safetensors.json").write_text((tmp_path / "a.safetensors.json").read_text())
    with pytest.raises(DynaSpecError, match="different fits"):
        load_dynaspec(tmp_path / "b.safetensors")
    (tmp_path / "b.safetensors.json").unlink()
    with pytest.raises(DynaSpecError, match="sidecar"):
        load_dynaspec(tmp_path / "b.safetensors")
    with pytest.raises(DynaSpecError, match="does not exist"):
        load_dynaspec(tmp_path / "none.safetensors")
    with pytest.raises(DynaSpecError, match="needs meta"):                # no model name / fingerprint to check
        save_dynaspec(FittedDynaSpec(fitted.assign, fitted.router, {}), tmp_path / "c.safetensors")


def test_find_fitted_matches_head_and_drafter(tiny, tmp_path):
    _, weight, fitted = tiny
    cfg = SpecConfig.preset("layerskip", vocab="dynaspec", drafter_layers="skip:1")
    with pytest.raises(DynaSpecError, match="none is in"):
        find_fitted(weight, cfg, tmp_path)
    path = save_dynaspec(fitted, tmp_path / "x.safetensors")
    assert find_fitted(weight, cfg, tmp_path) == path
    with pytest.raises(DynaSpecError, match="none is in"):                # another drafter's states
        find_fitted(weight, cfg.replace(drafter_layers="skip:2"), tmp_path)
    with pytest.raises(DynaSpecError, match="none is in"):                # the steps of another tree depth
        find_fitted(weight, cfg.replace(eagle_depth=3), tmp_path)


def test_the_policy_looks_up_no_fit_and_the_resolution_names_the_fit_command(tiny, tmp_path, monkeypatch):
    """The policy takes a resolved `dynaspec_file` (or `fitted`) and looks nothing up, even with a matching fit
    in the cache; the run's resolution (`engine.resolve.resolve_run`) finds the fit, or names the command that
    makes one."""
    from specvocab.engine.resolve import resolve_run
    model, weight, fitted = tiny
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    cfg = SpecConfig.preset("layerskip", vocab="dynaspec", drafter_layers="skip:1", draft_size=4)
    with pytest.raises(DynaSpecError, match="python -m specvocab.engine.jobs.fit_dynaspec"):
        resolve_run(cfg, model)
    path = save_dynaspec(fitted, tmp_path / "dynaspec" / "fit.safetensors")
    with pytest.raises(DynaSpecError, match=r"dynaspec_file=None.*not resolved.*resolve_run.*dynaspec_file=<path>"):
        make_policy(cfg, weight)
    run = resolve_run(cfg, model).cfg
    assert run.dynaspec_file == str(path)
    assert torch.equal(make_policy(run, weight).head.router.fc2.weight, fitted.router.fc2.weight)   # that fit


# --- CUDA: the router on its own stream -------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the router's side stream)")
def test_side_stream_router_matches_cpu(tiny):
    _, weight, fitted = tiny
    cfg = SpecConfig.preset("layerskip", vocab="dynaspec", dynaspec_k_max=8)
    cpu = DynaSpecVocab(weight, cfg, fitted=fitted)
    gpu = DynaSpecVocab(weight.cuda(), cfg, fitted=FittedDynaSpec(fitted.assign, Router(48, 32, 32), fitted.meta))
    gpu.head.router.load_state_dict(fitted.router.state_dict())
    assert gpu.head.stream is not None
    g = torch.Generator().manual_seed(0)
    for t, r in enumerate([1, 10, 10]):
        tokens = torch.randint(0, V, (r,), generator=g)
        parent_h, h = torch.randn(r, 48, generator=g), torch.randn(r, 48, generator=g)
        cpu.route(tokens, parent_h, t)
        gpu.route(tokens.cuda(), parent_h.cuda(), t)
        lc, ic = cpu.logits(h)
        lg, ig = gpu.logits(h.cuda())
        assert torch.equal(ic, ig.cpu()) and torch.allclose(lc, lg.cpu(), atol=1e-4, equal_nan=True)




# --- the fit names its drafter: head hash and depth ---------------------------------------------------------------

def _eagle_fit(model, folder, head, depth):
    from specvocab.engine.artifacts import head_fingerprint
    from specvocab.engine.drafters.eagle import head_digest
    from specvocab.engine.vocab.dynaspec_fit import spherical_kmeans
    weight = model.get_output_embeddings().weight.detach()
    km = spherical_kmeans(weight, 16, seed=0)
    torch.manual_seed(0)
    meta = {"model": "random-llama", "head_fingerprint": head_fingerprint(weight), "created": 1.0,
            "drafter_config": {"drafter": "eagle", "eagle_head_sha": head_digest(head), "eagle_depth": depth}}
    return save_dynaspec(FittedDynaSpec(assign=km.assign, router=Router(weight.shape[1], 16, 8).eval(), meta=meta),
                         folder / "fit.safetensors")


def test_a_retrained_head_or_another_depth_does_not_reuse_a_stale_router(tmp_path, monkeypatch):
    """A key that named the head only by its name (`eagle_head`) and ignored depth would let a head retrained
    into the same folder, or a run at depth 5 on a fit logged at depth 3, silently reuse the router."""
    from specvocab.engine.drafters.eagle import EagleDrafter, random_eagle_head, save_eagle_head
    model, _, _ = load_model("random-llama", seed=0)
    weight = model.get_output_embeddings().weight
    folder = tmp_path / "head"
    save_eagle_head(random_eagle_head(model, seed=0), folder, target_name="random-llama", target_weight=weight)
    from specvocab.engine.drafters.eagle import load_eagle_head
    from specvocab.engine.resolve import resolve_run
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    fit = _eagle_fit(model, tmp_path / "cache" / "dynaspec", load_eagle_head(str(folder)), depth=3)
    cfg = SpecConfig.preset("eagle", vocab="dynaspec", eagle_head=str(folder), eagle_depth=3, draft_size=8)
    run = resolve_run(cfg, model).cfg                                          # found for its own head and depth
    assert run.dynaspec_file == str(fit) and EagleDrafter(model, run).policy.head is not None
    with pytest.raises(DynaSpecError, match="none is in"):                     # the default depth 5: not this fit
        resolve_run(cfg.replace(eagle_depth=5), model)
    save_eagle_head(random_eagle_head(model, seed=1), folder, target_name="random-llama", target_weight=weight)
    with pytest.raises(DynaSpecError, match="none is in"):                     # retrained into the same folder
        resolve_run(cfg, model)
    # an explicit file is checked against the drafter too, with a clear message
    with pytest.raises(DynaSpecError, match="fitted for drafter .*not for this one"):
        EagleDrafter(model, cfg.replace(dynaspec_file=str(fit)))
    old = json.loads(sidecar_path(fit).read_text())
    old["drafter_config"] = {"drafter": "eagle", "eagle_head": str(folder)}   # a key without hash or depth
    sidecar_path(fit).write_text(json.dumps(old))
    with pytest.raises(DynaSpecError, match="records neither"):
        EagleDrafter(model, cfg.replace(dynaspec_file=str(fit)))



# The depths each shipped head has a DynaSpec fit for: the default depth, and depth 3 (for runs at
# eagle_depth=3).
SHIPPED_FIT_DEPTHS = {"smollm2-135m-instruct": {3, SpecConfig().eagle_depth}, "gemma-3-270m": {3, SpecConfig().eagle_depth}}


@pytest.mark.parametrize("name", sorted(SHIPPED_FIT_DEPTHS))
def test_the_shipped_fits_are_keyed_by_head_and_depth(name):
    """Each shipped fit records its depth and the head's hash, and is named for its depth:
    `dynaspec-eagle.safetensors` at the default depth, `dynaspec-eagle-depth<d>.safetensors` at another, so a run finds the fit logged at its depth."""
    from specvocab.engine.drafters.eagle import head_digest, load_eagle_head
    from specvocab.engine.shipped import SHIPPED_HEADS
    folder = SHIPPED_HEADS / name
    sha = head_digest(load_eagle_head(f"specvocab:{name}"))
    depths = {}
    for side in folder.glob("dynaspec-eagle*.safetensors.json"):
        key = json.loads(side.read_text())["drafter_config"]
        assert key["drafter"] == "eagle" and key["eagle_head_sha"] == sha, side
        depths[key["eagle_depth"]] = side.name
    assert set(depths) == SHIPPED_FIT_DEPTHS[name], depths
    for depth, file in depths.items():
        assert file == ("dynaspec-eagle.safetensors.json" if depth == SpecConfig().eagle_depth
                        else f"dynaspec-eagle-depth{depth}.safetensors.json")


# The depths each shipped EAGLE-3 head has a DynaSpec fit for (engine/heads/<model>/eagle3/).
SHIPPED_EAGLE3_FIT_DEPTHS = {"smollm2-135m-instruct": {3, SpecConfig().eagle_depth},
                             "gemma-3-270m": {3, SpecConfig().eagle_depth}}


@pytest.mark.parametrize("name", sorted(SHIPPED_EAGLE3_FIT_DEPTHS))
def test_the_shipped_eagle3_fits_are_keyed_by_head_and_depth(name):
    """The DynaSpec fits beside a shipped EAGLE-3 head partition its draft vocabulary (V = draft_vocab_size),
    are keyed by that head's hash and the depth they were logged at, and are named for the depth."""
    from specvocab.engine.catalog import shipped_eagle3_heads
    from specvocab.engine.drafters.eagle import head_digest
    from specvocab.engine.drafters.eagle3 import load_eagle3_head
    folder = shipped_eagle3_heads()[name]
    head = load_eagle3_head(f"specvocab:{name}")
    sha = head_digest(head)
    depths = {}
    for side in folder.glob("dynaspec-eagle3*.safetensors.json"):
        meta = json.loads(side.read_text())
        key = meta["drafter_config"]
        assert key["drafter"] == "eagle3" and key["eagle3_head_sha"] == sha, side
        assert meta["vocab_size"] == head.draft_vocab_size, side
        depths[key["eagle_depth"]] = side.name
    assert set(depths) == SHIPPED_EAGLE3_FIT_DEPTHS[name], depths
    for depth, file in depths.items():
        assert file == ("dynaspec-eagle3.safetensors.json" if depth == SpecConfig().eagle_depth
                        else f"dynaspec-eagle3-depth{depth}.safetensors.json")
