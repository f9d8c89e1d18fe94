"""`eagle3`: EAGLE-3 heads in the official layout, their draft vocabulary, and every policy inside it.

- a hand-built checkpoint (official names, safetensors or pytorch_model.bin) loads with each tensor in its
  module, checked by drafting: the drafter's tree log-probs over several steps (with multi-token accepted paths)
  equal a plain-torch forward of the raw tensors (tests/eagle3_testing.py), children mapped through d2t;
- the target features: the residual stream entering layers 2, L//2, L-3, on the prefill and on every tree
  node, through the HF hooks and the native forward's tap;
- every vocabulary policy scores what it should inside the draft vocabulary (a plain reference per policy),
  and speculative greedy decoding with each equals autoregressive decoding token for token;
- the errors: a head for another target, d2t / t2d that disagree, d2t outside the vocabulary, draft_vocab_size
  against lm_head, a hub id offline, no head given, a dynaspec without a fit for this head;
- dynaspec inside the draft vocabulary: clusters over the head's own rows, the router reading the target's
  LM-head rows, a fit made for the head by `engine.jobs.fit_dynaspec --drafter eagle3` (logged labels in draft
  ids), lossless, and in Table 2.
"""

import dataclasses
import json

import numpy as np
import polars as pl
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.eagle3 import Eagle3Drafter, eagle3_feature_layers, load_eagle3_head
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.harness import forward_tree, generate, prefill
from specvocab.engine.models import load_model
from specvocab.engine.target import make_target
from specvocab.engine.verify import tree_layout
from specvocab.engine.vocab.dynaspec import DynaSpecError, FittedDynaSpec, Router, save_dynaspec
from tests.eagle3_testing import official_state, reference_logp, target_features, write_checkpoint
from tests.engine_testing import assert_lossless_under_every_policy, deepest_accept, drive_steps

V = 384
ARCHS = ("random-llama", "random-gemma3", "random-qwen3")


def _draft_ids(K=200, seed=0):
    return np.sort(np.random.default_rng(seed).choice(V, K, replace=False))


def _prompt(seed, n=30):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, V, n // 3)
    return torch.tensor(np.concatenate([base, rng.integers(0, V, n - 2 * base.size), base]))


def _cfg(head, **kw):
    return SpecConfig.preset("eagle3", eagle3_head=str(head), eagle_depth=3, eagle_topk=4, draft_size=11).replace(**kw)


def test_feature_layers_are_the_inputs_of_2_mid_and_L_minus_3():
    assert eagle3_feature_layers(32) == (2, 16, 29)          # Llama-3.1-8B: the official 2, L//2, L-3
    assert eagle3_feature_layers(8) == (2, 4, 5)
    assert eagle3_feature_layers(2) == (1, 1, 0)             # clamped for tiny targets


# --- drafting equals a plain reference of the raw tensors ---------------------------------------------------------

def _child_logp(tree):
    p = tree.parents
    return (tree.scores[1:].double() / tree.scores[p[1:]].double()).log()


@pytest.mark.parametrize("arch,fmt,hidden", [("random-llama", "safetensors", None), ("random-qwen3", "bin", None),
                                              ("random-llama", "safetensors", 32)])
def test_drafts_equal_a_plain_reference_of_the_checkpoint(tmp_path, arch, fmt, hidden):
    """Catches any tensor landing in the wrong module (q/k swapped, the two input norms swapped, fc bypassed),
    a feature taken after instead of before a layer or in another order, the embedding/feature halves of the
    attention input swapped, the wrong state fed back in the tree, and draft ids not mapped through d2t."""
    model, _, _ = load_model(arch, vocab_size=V, hidden_size=48, num_layers=8, seed=4)
    state, config = official_state(model, draft_ids=_draft_ids(), seed=1, hidden=hidden,
                                   with_embedding=hidden is not None)
    head_dir = write_checkpoint(tmp_path / "head", state, config, fmt)
    head = load_eagle3_head(str(head_dir))
    for k, v in state.items():                   # every official tensor is in the module of the same name
        torch.testing.assert_close(head.state_dict()[k], v.to(head.state_dict()[k].dtype))
    drafter = make_drafter(model, _cfg(head_dir))
    assert isinstance(drafter, Eagle3Drafter)
    t2d = state["t2d"]
    checked = 0
    # all steps first: the reference's own target forwards would replace the features the drafter reads next
    for ids, tree, _ in list(drive_steps(model, drafter, _prompt(5, n=20), steps=3, accept=deepest_accept)):
        assert bool(t2d[tree.tokens[1:]].all())                  # every draft token is in the draft vocabulary
        children = tree.children()
        for node in range(tree.size):
            if not children[node]:
                continue
            path = [int(tree.tokens[i]) for i in tree.path_to(node)[1:]]
            ref = reference_logp(state, config, model, ids, path)
            kids = children[node]
            torch.testing.assert_close(_child_logp(tree)[[c - 1 for c in kids]], ref[tree.tokens[kids]],
                                       atol=2e-4, rtol=0)
            if node == 0:                                        # the root's children: the reference's top-k
                assert sorted(tree.tokens[kids].tolist()) == sorted(ref.topk(len(kids)).indices.tolist())
            checked += 1
        assert max(tree_layout(tree.parents)[0].tolist()) >= 2   # the forced path takes several tokens
    assert checked >= 6


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_the_tap_holds_the_inputs_of_the_three_layers(tmp_path, backend):
    """On the prefill and on every node of a tree (native: a fixed-shape forward with padded rows), the features
    the drafter reads are the reference's for the node's own path."""
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=8, seed=2)
    state, config = official_state(model, draft_ids=_draft_ids(), seed=0)
    drafter = make_drafter(model, _cfg(write_checkpoint(tmp_path, state, config), backend=backend))
    prompt = _prompt(1, n=12)
    target = make_target(model, backend)
    target.begin(64)
    with torch.inference_mode():
        target.prefill(prompt)
        torch.testing.assert_close(drafter.tap.take(prompt.numel()), target_features(model, prompt), atol=1e-5, rtol=0)
        tokens, parents = torch.tensor([7, 3, 9, 4, 11]), torch.tensor([-1, 0, 0, 1, 3])
        depths, anc = tree_layout(parents)
        target.forward_tree(tokens, parents, depths, anc)
        got = drafter.tap.take(tokens.numel())
        with pytest.raises(DrafterError, match="no target features"):
            drafter.tap.take(1)                                      # read once: never a stale forward
    for node in range(tokens.numel()):
        path = [int(tokens[i]) for i in range(tokens.numel()) if anc[node, i]]
        ref = target_features(model, torch.cat([prompt, torch.tensor(path)]))[-1]
        torch.testing.assert_close(got[node], ref, atol=1e-5, rtol=0)


# --- vocabulary policies inside the draft vocabulary ------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_head(tmp_path_factory):
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=5)
    state, config = official_state(model, draft_ids=_draft_ids(), seed=2)
    folder = write_checkpoint(tmp_path_factory.mktemp("e3") / "head", state, config)
    ranking = tmp_path_factory.mktemp("freq") / "ranking.npy"
    np.save(ranking, np.random.default_rng(0).permutation(V))
    return model, state, folder, ranking


@pytest.mark.parametrize("vocab", ["full", "frspec", "microspec", "oracle"])
def test_each_policy_scores_its_candidates_that_t2d_admits(llama_head, vocab):
    """Catches a MicroSpec window gathering lm_head[target id] instead of the draft row, slots t2d does not admit
    left live, FR-Spec packing rows by target id or ignoring t2d, and slots not mapped through d2t."""
    model, state, folder, ranking = llama_head
    drafter = make_drafter(model, _cfg(folder, vocab=vocab, frspec_k=96, frequency_file=str(ranking), w_max=200,
                                       k_pre=3))
    prompt = _prompt(2)
    logits = torch.randn(prompt.numel(), V, generator=torch.Generator().manual_seed(0))
    drafter.policy.begin(prompt, logits)
    t2d = state["t2d"]
    if vocab == "frspec":
        candidates = torch.as_tensor(np.load(ranking)[:96])
    elif vocab == "microspec":                                   # S_init fits the window: I = its distinct ids
        candidates = torch.cat([prompt, logits.topk(3, dim=-1).indices.reshape(-1)]).unique()
    else:
        candidates = torch.arange(V)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[candidates] = True
    allowed &= t2d
    h = torch.randn(3, 48, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got_lp, got_ids = drafter._head_topk(h, 6)
    # reference: h through the final norm and the draft head, restricted to the allowed target ids
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * state["norm.weight"]
    draft_logits = hn @ state["lm_head.weight"].T                    # [3, K] by draft id
    to_target = torch.arange(state["d2t"].numel()) + state["d2t"]
    full = torch.full((3, V), float("-inf"))
    full[:, to_target] = draft_logits
    full[:, ~allowed] = float("-inf")
    ref = torch.log_softmax(full.double(), -1).topk(6, dim=-1)
    torch.testing.assert_close(got_lp.double(), ref.values, atol=1e-5, rtol=0)
    assert got_ids.tolist() == ref.indices.tolist()
    drafter.policy.record_step()
    stats = drafter.policy.stats()
    assert stats["mean_active_vocab"] == int(allowed.sum())
    if vocab == "microspec":
        assert stats["window_vocab"] == candidates.numel() > stats["window_admitted"] == int(allowed.sum())
    if vocab == "frspec":
        assert stats["frspec_candidates"] == 96 and stats["frspec_admitted"] == int(allowed.sum())


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_is_lossless_under_every_policy_within_its_draft_vocabulary(tmp_path, arch):
    """Every vocabulary policy decodes ar's tokens with an EAGLE-3 head; every drafted token lies in the head's
    draft vocabulary (t2d), and MicroSpec's window admits only draft-vocabulary tokens."""
    model, _, _ = load_model(arch, vocab_size=V, hidden_size=48, num_layers=4, seed=5)
    state, config = official_state(model, draft_ids=_draft_ids(seed=3), seed=2)
    folder = write_checkpoint(tmp_path / "head", state, config)
    ranking = tmp_path / "ranking.npy"
    np.save(ranking, np.random.default_rng(0).permutation(V))

    def in_draft_vocab(variant, out):
        assert all(bool(state["t2d"][r.tree_tokens[1:]].all()) for r in out.records), variant
        assert out.drafter_stats["draft_vocab"] == 200
        if variant["vocab"] == "microspec":
            s = out.drafter_stats
            assert s["window_admitted"] == s["mean_active_vocab"] < s["window_vocab"], s
    ar = lambda i: generate(model, _prompt(i), method="ar", max_new_tokens=20, eos_ids=[]).output_ids.tolist()  # noqa: E731
    assert_lossless_under_every_policy(model, _prompt, ar, check=in_draft_vocab,
                                       method=dict(method="eagle3", eagle3_head=str(folder), frequency_file=str(ranking),
                                                   record=True))


def test_oracle_proposes_what_the_draft_vocabulary_proposes(llama_head):
    model, _, folder, _ = llama_head
    prompt = _prompt(8)
    full = generate(model, prompt, _cfg(folder, max_new_tokens=16, draft_size=19), eos_ids=[], record=True)
    oracle = generate(model, prompt, _cfg(folder, vocab="oracle", w_max=16, max_new_tokens=16, draft_size=19),
                      eos_ids=[], record=True)
    assert [r.tree_tokens for r in oracle.records] == [r.tree_tokens for r in full.records]
    assert oracle.drafter_stats["mean_active_vocab"] == 16


# --- errors ----------------------------------------------------------------------------------------------------------

def test_a_head_for_another_target_is_refused(tmp_path, llama_head):
    model, _, _, _ = llama_head
    wider, _, _ = load_model("random-llama", vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    state, config = official_state(wider, draft_ids=_draft_ids(), seed=0)
    with pytest.raises(DrafterError, match=r"width 64 .* target's hidden size is 48"):
        make_drafter(model, _cfg(write_checkpoint(tmp_path / "wide", state, config)))
    bigger, _, _ = load_model("random-llama", vocab_size=V + 16, hidden_size=48, num_layers=4, seed=1)
    state, config = official_state(bigger, draft_ids=_draft_ids(), seed=0)
    with pytest.raises(DrafterError, match=r"vocabulary \(400\) differs from the target's \(384\)"):
        make_drafter(model, _cfg(write_checkpoint(tmp_path / "big", state, config)))


def test_inconsistent_maps_and_sizes_have_clear_errors(tmp_path, llama_head):
    model, _, _, _ = llama_head
    state, config = official_state(model, draft_ids=_draft_ids(), seed=0)

    def load(**changes):
        s = {**state, **{k: v for k, v in changes.items() if k in state}}
        c = {**config, **{k: v for k, v in changes.items() if k not in state}}
        return load_eagle3_head(str(write_checkpoint(tmp_path / "h", s, c)))

    t2d = state["t2d"].clone()
    t2d[int((~t2d).nonzero()[0])] = True                         # one id t2d admits that d2t never names
    with pytest.raises(DrafterError, match=r"d2t and t2d disagree .* exactly the set"):
        load(t2d=t2d)
    d2t = state["d2t"].clone()
    d2t[0] = d2t[1] + 1                                          # draft ids 0 and 1 name the same target id
    with pytest.raises(DrafterError, match="d2t and t2d disagree"):
        load(d2t=d2t)
    d2t = state["d2t"].clone()
    d2t[-1] = V                                                  # beyond the vocabulary
    with pytest.raises(DrafterError, match=r"outside the vocabulary \[0, 384\)"):
        load(d2t=d2t)
    with pytest.raises(DrafterError, match=r"draft_vocab_size=199 but lm_head.weight has 200 rows"):
        load(draft_vocab_size=199)
    with pytest.raises(DrafterError, match="no d2t"):
        load_eagle3_head(str(write_checkpoint(tmp_path / "h", {k: v for k, v in state.items() if k != "d2t"}, config)))
    layer12 = {"fc.weight": torch.zeros(48, 96), "layers.0.self_attn.q_proj.weight": torch.zeros(48, 48)}
    with pytest.raises(DrafterError, match="EAGLE-1/2 head, use method='eagle'"):
        load_eagle3_head(str(write_checkpoint(tmp_path / "h", layer12, config)))
    swapped = {**state, "midlayer.self_attn.q_proj.weight": state["midlayer.self_attn.k_proj.weight"]}
    with pytest.raises(DrafterError, match="does not match its config.json"):
        load_eagle3_head(str(write_checkpoint(tmp_path / "h", swapped, config)))
    loaded = load()                                              # the untouched checkpoint loads
    assert loaded.draft_vocab_size == 200


def test_missing_head_hub_offline_and_dynaspec_name_the_fix(tmp_path, llama_head):
    model, _, folder, _ = llama_head
    with pytest.raises(DrafterError, match="no EAGLE-3 head ships for this model.*eagle3_head="):
        make_drafter(model, SpecConfig.preset("eagle3", draft_size=8))
    with pytest.raises(DrafterError, match="eagle3_head='nobody/no-such-eagle3-head' is neither a local directory "
                                           "nor a downloadable hub repo"):
        make_drafter(model, SpecConfig.preset("eagle3", eagle3_head="nobody/no-such-eagle3-head", draft_size=8))
    with pytest.raises(DrafterError, match="no EAGLE-3 head ships"):
        load_eagle3_head("specvocab:random-llama")
    from specvocab.engine.resolve import resolve_run
    with pytest.raises(DynaSpecError, match="needs a fitted DynaSpec for this model and drafter.*'drafter': "
                                            "'eagle3'.*--drafter eagle3"):
        resolve_run(_cfg(folder, vocab="dynaspec"), model)          # the run's resolution looks the fit up
    with pytest.raises(DynaSpecError, match="dynaspec_file=None.*resolve_run"):
        make_drafter(model, _cfg(folder, vocab="dynaspec"))         # the drafter's policy never does
    assert isinstance(make_drafter(model, SpecConfig.preset("eagle3", eagle3_head="random", draft_size=8)),
                      Eagle3Drafter)


def test_a_shipped_head_is_the_default_for_its_own_target_only(tmp_path, monkeypatch, llama_head):
    """`eagle3_head=None` resolves (`resolve_config`, never the drafter itself) to the EAGLE-3 head shipped
    in `engine/heads/<model>/eagle3/` whose LM-head fingerprint matches the target - decoding with it equals ar
    - and to nothing for a same-shape target of other weights (the fix named), even with a head shipped."""
    from specvocab.engine.harness import resolve_config
    from specvocab.engine.train.eagle3_head import new_eagle3_head, save_eagle3_head

    model = llama_head[0]
    other, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=6)
    weight = model.get_output_embeddings().weight.detach()
    head = new_eagle3_head(model, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool), seed=1)
    heads = tmp_path / "heads"
    save_eagle3_head(head, heads / "tiny" / "eagle3", target_name="random-llama", target_weight=weight,
                     feature_layers=eagle3_feature_layers(model.config.num_hidden_layers))
    monkeypatch.setattr("specvocab.engine.catalog.SHIPPED_HEADS", heads)
    cfg = resolve_config(cfg=SpecConfig.preset("eagle3", draft_size=8, max_new_tokens=16), model=model)
    assert cfg.eagle3_head == "specvocab:tiny"
    assert make_drafter(model, cfg).head_source == "specvocab:tiny"
    prompt = _prompt(7)
    ar = generate(model, prompt, method="ar", max_new_tokens=16, eos_ids=[]).output_ids.tolist()
    assert generate(model, prompt, method="eagle3", draft_size=8, max_new_tokens=16, eos_ids=[]).output_ids.tolist() == ar
    assert resolve_config(cfg=SpecConfig.preset("eagle3", draft_size=8), model=other).eagle3_head is None
    with pytest.raises(DrafterError, match="no EAGLE-3 head ships for this model.*train_eagle3"):
        make_drafter(other, SpecConfig.preset("eagle3", draft_size=8))


def test_table2_on_an_eagle3_head(tmp_path, llama_head):
    """Bench's --drafter eagle3 runs the head once per vocabulary policy inside its draft vocabulary,
    every run equal to ar's output, the head named in `draft_head`, the policies' sizes in `vocab_size`."""
    from specvocab.engine.jobs.bench import run_bench

    model, _, folder, ranking = llama_head
    frame = run_bench(methods="ar", drafter="eagle3", vocab="full,frspec:64,microspec:32,oracle",
                      prompts="spec_bench", per_category=1, categories=["qa"], max_new_tokens=12,
                      loaded=(model, None, load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4,
                                                      seed=5)[2]),
                      config={"eagle3_head": str(folder), "frequency_file": str(ranking), "draft_size": 8,
                              "eagle_depth": 3, "w_max": 48}, progress=False, show=False)
    runs = frame.filter(pl.col("method") == "eagle3")
    assert sorted(runs["run"].unique()) == ["frspec:64", "full", "microspec:32", "oracle"]
    assert set(runs["draft_head"]) == {str(folder)}
    assert runs.select("run", "vocab_size").unique().sort("run").rows() == [
        ("frspec:64", 64), ("full", None), ("microspec:32", 32), ("oracle", 48)]
    assert set(runs["verdict"].to_list()) == {"exact"}


# --- dynaspec inside the draft vocabulary -----------------------------------------------------------------------

def _hand_fit(model, folder, path, *, M=8, seed=0, **cfg_kw):
    """A DynaSpec over the EAGLE-3 head's draft rows with random clusters and router, keyed to that head."""
    from specvocab.engine.artifacts import FINGERPRINT_KEY, head_fingerprint

    drafter = make_drafter(model, _cfg(folder, **cfg_kw))
    K, d = drafter.head_weight.shape
    torch.manual_seed(seed)
    router = Router(d, M, 16)
    assign = torch.randint(0, M, (K,), generator=torch.Generator().manual_seed(seed))
    meta = {"model": "random-llama", FINGERPRINT_KEY: head_fingerprint(drafter.head_weight),
            "drafter_config": drafter.drafter_key()}
    return save_dynaspec(FittedDynaSpec(assign=assign, router=router.eval(), meta=meta), path), assign, router


def test_dynaspec_scores_the_routed_clusters_of_draft_rows(tmp_path, llama_head):
    """Catches clusters indexed by target id instead of draft id, the router reading the draft head's row (or
    no row) for E(x) instead of the target's LM-head row of the target id, slots not mapped through d2t, the
    k_max budget ignored, and a mask over draft ids reported as a mask over target ids."""
    model, state, folder, _ = llama_head
    path, assign, router = _hand_fit(model, folder, tmp_path / "fit.safetensors")
    drafter = make_drafter(model, _cfg(folder, vocab="dynaspec", dynaspec_file=str(path), dynaspec_k_max=3))
    prompt = _prompt(3)
    drafter.policy.begin(prompt, torch.randn(prompt.numel(), V))
    tokens = torch.tensor([int(i) for i in np.flatnonzero(~state["t2d"].numpy())[:2]] + [7])   # two outside t2d
    parent_h = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    h = torch.randn(3, 48, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        drafter.policy.route(tokens, parent_h, 0)
        got_lp, got_ids = drafter._head_topk(h, 6)
        emb = model.get_output_embeddings().weight[tokens]                       # E(x): the target's rows
        picked = router(parent_h, emb).topk(3, dim=1).indices                     # [3, 3] clusters
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * state["norm.weight"]
    draft_logits = hn @ state["lm_head.weight"].T                                 # [3, K]
    ok = (assign[None, :, None] == picked[:, None, :]).any(-1)                    # [3, K] row's own clusters
    to_target = torch.arange(state["d2t"].numel()) + state["d2t"]
    full = torch.full((3, V), float("-inf"))
    full[:, to_target] = draft_logits.masked_fill(~ok, float("-inf"))
    ref = torch.log_softmax(full.double(), -1).topk(6, dim=-1)
    torch.testing.assert_close(got_lp.double(), ref.values, atol=1e-5, rtol=0)
    assert got_ids.tolist() == ref.indices.tolist()
    union = torch.zeros(V, dtype=torch.bool)
    union[to_target[ok.any(0)]] = True
    assert torch.equal(drafter.policy.active_mask(), union)                       # target ids of the union
    drafter.policy.record_step()
    assert drafter.policy.stats()["mean_active_vocab"] == pytest.approx(float(ok.sum(1).double().mean()))


def test_dynaspec_fit_for_an_eagle3_head_logs_draft_ids_and_decodes_losslessly(tmp_path, monkeypatch, llama_head):
    """`fit_dynaspec --drafter eagle3`: the clusters split the head's K draft rows, the logged labels are the
    draft head's own top-L in draft ids (a log in target ids would put labels outside [0, K) or on the wrong
    rows), the fit is found by `find_fitted` for this head and depth only, and decoding with it equals ar;
    Table 2 on the head includes it."""
    import specvocab.engine.jobs.fit_dynaspec as ds
    from specvocab.engine.jobs.bench import run_bench
    from tests.engine_testing import tiny_dynaspec_fit

    model, state, folder, ranking = llama_head
    out = tmp_path / "fit.safetensors"
    cfg = dataclasses.replace(tiny_dynaspec_fit(tmp_path, out), drafter="eagle3",
                              spec=(("eagle3_head", str(folder)), ("eagle_depth", 3), ("draft_size", 8)))
    loaded = (model, *load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=4, seed=5)[1:])
    monkeypatch.setattr(ds, "load_model", lambda name, **kw: loaded)      # the fit loads this very target
    ds.fit(cfg)
    meta = json.loads((tmp_path / "fit.safetensors.json").read_text())
    assert meta["vocab_size"] == 200 and meta["drafter_config"]["drafter"] == "eagle3"
    assert meta["drafter_config"]["eagle_depth"] == 3 and meta["drafter_config"]["eagle3_head_sha"]
    rows = ds.load_rows(sorted((tmp_path / "fit.safetensors.work").glob("log-*.safetensors")))
    top = rows.top.long()
    assert 0 <= int(top.min()) and int(top.max()) < 200                           # draft ids, not target ids
    # and the draft head's own top-L: recomputed from the logged state of each row's parent, every token x
    # drafted at t >= 1 is among the children its parent's head proposed (draft rows mapped through d2t)
    to_target = torch.arange(200) + state["d2t"]
    deeper = torch.nonzero(rows.t > 0).flatten()
    assert deeper.numel() > 10
    for i in deeper[:: max(1, deeper.numel() // 12)].tolist():
        h = rows.parent_h[i].float()
        hn = h * torch.rsqrt(h.pow(2).mean() + 1e-5) * state["norm.weight"]
        kids = to_target[(hn @ state["lm_head.weight"].T).topk(10).indices]
        assert int(rows.tokens[i]) in kids.tolist()
    prompt = _prompt(4)
    ar = generate(model, prompt, method="ar", max_new_tokens=16, eos_ids=[]).output_ids.tolist()
    got = generate(model, prompt, _cfg(folder, vocab="dynaspec", dynaspec_file=str(out), dynaspec_k_max=4,
                                       max_new_tokens=16), eos_ids=[], record=True)
    assert got.output_ids.tolist() == ar
    assert all(bool(state["t2d"][r.tree_tokens[1:]].all()) for r in got.records)
    assert 0 < got.drafter_stats["mean_active_vocab"] < 200
    with pytest.raises(DynaSpecError, match="not for this one"):                 # another depth: refused
        make_drafter(model, _cfg(folder, vocab="dynaspec", dynaspec_file=str(out), eagle_depth=4))
    frame = run_bench(methods="ar", drafter="eagle3", vocab="full,dynaspec:100",
                      prompts="spec_bench", per_category=1, categories=["qa"], max_new_tokens=12,
                      loaded=loaded,
                      config={"eagle3_head": str(folder), "draft_size": 8, "eagle_depth": 3,
                              "dynaspec_file": str(out)}, progress=False, show=False)
    runs = frame.filter(pl.col("method") == "eagle3")
    assert sorted(runs["run"].unique()) == ["dynaspec:100", "full"]
    assert set(runs["verdict"].to_list()) == {"exact"}
