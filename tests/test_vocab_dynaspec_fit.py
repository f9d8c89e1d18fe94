"""Fitting DynaSpec (`engine.vocab.dynaspec_fit`; the jobs `engine.jobs.fit_dynaspec`, `engine.jobs.dynaspec_choices`).

- spherical k-means recovers well-separated, unbalanced clusters exactly (up to a permutation), re-seeds an
  empty cluster, and is deterministic in its seed;
- the router learns a known cluster mapping (BCE falls, held-out recall high), and an interrupted training
  run resumes from its checkpoint to the same weights; the training targets (multi-hot clusters);
- `fit` end to end on a random model (logging, resume, a file the policy loads), and the sweep of the
  choices the paper leaves open on its logged rows (every cluster picked: recall 1; resume); the CLI.
"""

import dataclasses
import math
import json

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F

import specvocab.engine.jobs.dynaspec_choices as choices_job
import specvocab.engine.jobs.fit_dynaspec as ds
import specvocab.engine.vocab.dynaspec_fit as fitlib
from specvocab.engine.vocab.dynaspec_fit import (RouterRows, RouterTraining, cluster_targets, router_metrics,
                                                 spherical_kmeans, train_router)
from specvocab.engine.models import load_model
from specvocab.engine.vocab.dynaspec import ClusterLayout, DynaSpecError, load_dynaspec, select_clusters
from tests.engine_testing import tiny_dynaspec_fit


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py: tiny matmuls run faster on one thread


# --- spherical k-means ---------------------------------------------------------------------------------------

def _separated(sizes, d=32, noise=0.003, seed=0):
    """Rows around len(sizes) orthonormal directions, cluster i holding sizes[i] rows at random norms."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.linalg.qr(torch.randn(d, len(sizes), generator=g, dtype=torch.float64))[0].T.float()  # [M, d]
    truth = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    x = dirs[truth] + noise * torch.randn(truth.numel(), d, generator=g)
    x = x * (0.5 + 3 * torch.rand(truth.numel(), 1, generator=g))          # norms must not matter
    perm = torch.randperm(truth.numel(), generator=g)
    return x[perm], truth[perm], dirs


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b split the rows identically (labels may be permuted)."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_recovers_separated_unbalanced_clusters(seed):
    sizes = [1, 60, 3, 25, 2, 40, 9, 14]
    x, truth, _ = _separated(sizes, seed=seed)
    km = spherical_kmeans(x, len(sizes), seed=seed)
    assert _same_partition(km.assign, truth)
    assert sorted(torch.bincount(km.assign).tolist()) == sorted(sizes)
    assert km.converged and km.mean_cosine > 0.99
    assert torch.allclose(km.centroids.norm(dim=1), torch.ones(len(sizes)), atol=1e-5)


def test_kmeans_reseeds_an_empty_cluster():
    sizes = [30, 20, 25, 15]
    x, truth, dirs = _separated(sizes, seed=3)
    bad = -F.normalize(dirs.sum(0), dim=0)                                # negative cosine with every row
    init = torch.cat([dirs[:3], bad[None]])                               # cluster 3 has no centroid near it
    first, _ = fitlib._nearest(F.normalize(x, dim=1), init)
    assert (first == 3).sum() == 0                                        # the bad centroid starts empty
    km = spherical_kmeans(x, 4, init=init)
    assert _same_partition(km.assign, truth)
    # random init on the same data: still a partition into 4 non-empty clusters, deterministic in the seed
    r1, r2 = spherical_kmeans(x, 4, init="random", seed=7), spherical_kmeans(x, 4, init="random", seed=7)
    assert torch.equal(r1.assign, r2.assign) and torch.bincount(r1.assign, minlength=4).min() >= 1


def test_kmeans_one_row_per_cluster_and_errors():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    km = spherical_kmeans(x, 6, iters=3)
    assert sorted(km.assign.tolist()) == list(range(6))                   # every cluster non-empty
    with pytest.raises(DynaSpecError, match="num_clusters"):
        spherical_kmeans(x, 7)
    with pytest.raises(DynaSpecError, match="unknown k-means init"):
        spherical_kmeans(x, 2, init="kmeans")
    with pytest.raises(DynaSpecError, match="init centroids"):
        spherical_kmeans(x, 2, init=torch.randn(3, 5))


# --- router ------------------------------------------------------------------------------------------------

def _mapping_rows(n, d=16, m=8, vocab=48, seed=0):
    """Rows whose positive clusters follow a known rule: the cluster of (5 x) mod vocab for the token x, and
    argmax of P h. top ids are one token from each (token v sits in cluster v mod m)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(m, d, generator=torch.Generator().manual_seed(99))
    h = torch.randn(n, d, generator=g)
    tok = torch.randint(0, vocab, (n,), generator=g)
    c1 = ((5 * tok) % vocab) % m
    c2 = (h @ P.T).argmax(1)
    top = torch.stack([c1 + m * torch.randint(0, vocab // m, (n,), generator=g),
                       c2 + m * torch.randint(0, vocab // m, (n,), generator=g)], 1)
    return RouterRows(tokens=tok.int(), parent_h=h.half(), t=torch.zeros(n, dtype=torch.int8), top=top.int())


def test_router_learns_a_known_mapping(tmp_path):
    d, m, vocab = 16, 8, 48
    weight = torch.randn(vocab, d, generator=torch.Generator().manual_seed(1))
    assign = torch.arange(vocab) % m
    train, held = _mapping_rows(8000, seed=0), _mapping_rows(500, seed=1)
    cfg = RouterTraining(router_width=256, epochs=6, batch_size=64, lr=1e-2, progress=False)
    router, losses = train_router(cfg, train, weight, assign, tmp_path)
    assert np.mean(losses[-20:]) < 0.15 * np.mean(losses[:5])
    layout = ClusterLayout.from_assign(assign, m)
    got = router_metrics(router, held, weight, layout, k_max=2, budget="fixed")["overall"]
    assert got["cluster_recall"] > 0.93 and got["top1_hit"] > 0.97
    assert got["mean_row_vocab"] == pytest.approx(2 * vocab / m)          # two clusters of 6 tokens per row
    static = router_metrics(router, held, weight, layout, k_max=2, budget="fixed",
                            scores_fn=lambda tok, h: torch.arange(m, dtype=torch.float32).expand(tok.numel(), -1))
    assert static["overall"]["cluster_recall"] < 0.4                      # a fixed guess cannot do this


def test_router_training_resumes_after_an_interruption(tmp_path, monkeypatch):
    d, m, vocab = 16, 8, 48
    weight = torch.randn(vocab, d, generator=torch.Generator().manual_seed(1))
    assign = torch.arange(vocab) % m
    train = _mapping_rows(1000, seed=0)
    cfg = RouterTraining(router_width=32, epochs=2, batch_size=32, lr=1e-2, progress=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    router, losses = train_router(cfg, train, weight, assign, tmp_path / "a")
    calls = {"n": 0}
    real_loss = fitlib.router_loss

    def crashing_loss(scores, targets):
        calls["n"] += 1
        if calls["n"] == 41:
            raise KeyboardInterrupt
        return real_loss(scores, targets)

    monkeypatch.setattr(fitlib, "router_loss", crashing_loss)
    with pytest.raises(KeyboardInterrupt):
        train_router(cfg, train, weight, assign, tmp_path / "b")
    monkeypatch.setattr(fitlib, "router_loss", real_loss)
    # checkpoints every 100 batches and at each epoch's end (32 batches): the last before the crash is 32
    assert torch.load(tmp_path / "b" / "router.pt", weights_only=True)["step"] == 32
    resumed, losses_b = train_router(cfg, train, weight, assign, tmp_path / "b")
    for (k, a), b in zip(router.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert losses_b == pytest.approx(losses)


def test_cluster_targets_and_selection():
    assign = torch.tensor([0, 1, 1, 2, 3, 3])
    y = cluster_targets(torch.tensor([[1, 2], [0, 5]]), assign, 4)
    assert y.tolist() == [[0, 1, 0, 0], [1, 0, 0, 1]]
    sel = select_clusters(torch.tensor([[0.1, 0.9, 0.5, -1.0], [3.0, 2.0, 1.0, 0.0]]), 2)
    assert sel.tolist() == [[False, True, True, False], [True, True, False, False]]


# --- fit end to end ------------------------------------------------------------------------------------------------

def test_fit_end_to_end_on_a_random_model(tmp_path, monkeypatch):
    out = tmp_path / "fitted.safetensors"
    cfg = tiny_dynaspec_fit(tmp_path, out)
    assert ds.fit(cfg) == out
    meta = json.loads((tmp_path / "fitted.safetensors.json").read_text())
    assert len(meta["training"]["prompt_ids"]) == 4 and meta["training"]["heldout_prompts"] == 1
    assert meta["training"]["train_rows"] > 0 and meta["heldout"]["router"]["overall"]["rows"] > 0
    assert set(meta["heldout"]["router"]["by_t"]) == {"0", "1", "2"}
    work = tmp_path / "fitted.safetensors.work"
    shards = sorted(work.glob("log-*.safetensors"))
    assert len(shards) == 4
    rows = ds.load_rows(shards[:1])
    assert rows.top.shape[1] == 4 and rows.parent_h.shape[1] == 64
    n_steps = int((rows.t == 0).sum())
    assert n_steps >= 1 and int((rows.t == 1).sum()) == 10 * n_steps  # EAGLE-2 frontier: eagle_topk rows
    model, _, _ = load_model("random-llama")
    load_dynaspec(out, model.get_output_embeddings().weight)

    # a rerun resumes: shards and clusters are reused (generation is not run again)
    monkeypatch.setattr(ds, "RouterDataLogger", None)                      # would fail if logging ran
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    ds.fit(cfg)
    assert {p.name: p.stat().st_mtime_ns for p in sorted(work.glob("log-*.safetensors"))} == before
    with pytest.raises(DynaSpecError, match="other settings"):
        ds.fit(dataclasses.replace(cfg, num_clusters=8))

    # the sweep of the unstated choices runs on the same logged rows
    monkeypatch.undo()
    vocab = model.get_output_embeddings().weight.shape[0]
    choices = choices_job.ChoicesConfig(work_dir=str(work), out=str(tmp_path / "choices"), num_clusters=(8, 16),
                               router_width=(8,), top_l=(1, 4), budget_tokens=(vocab // 8, vocab, vocab + 1),
                               epochs=1, threads=None, progress=False)
    settings = choices_job.choice_settings(choices, json.loads((work / "fit.json").read_text()))
    assert settings == [(16, 512, 4), (8, 512, 4), (16, 8, 4), (16, 512, 1)]        # the fit's own first
    out = choices_job.sweep_choices(choices)
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 4
    table = pl.read_parquet(files)
    assert table.height == 4 * 2 * 3                                 # settings x valid budgets x scorers
    split = json.loads((work / "split.json").read_text())           # the fit's own split, which the sweep used
    assert split["heldout_prompt_ids"] == meta["training"]["prompt_ids"][-1:]
    assert split["train_prompt_ids"] == meta["training"]["prompt_ids"][:-1]
    assert (table["train_rows"] == meta["training"]["train_rows"]).all()
    # every cluster picked at every step (DynaSpec-F at k_max = M): nothing is missed
    full = table.filter((pl.col("budget_tokens") == vocab) & (pl.col("budget") == "fixed"))
    assert (full["token_recall"] == 1.0).all() and (full["mean_row_vocab"] == vocab).all()
    small = table.filter(pl.col("budget_tokens") == vocab // 8)
    assert (small["mean_row_vocab"] < vocab).all() and (small["k_max"] == small["num_clusters"] // 8).all()
    before = {p.name: p.stat().st_mtime_ns for p in files}
    choices_job.sweep_choices(choices)                                       # resumable: nothing is redone
    assert {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("*.parquet"))} == before
    with pytest.raises(DynaSpecError, match="the fit logged"):
        choices_job.sweep_choices(dataclasses.replace(choices, top_l=(5,)))
    # a fit that held out two prompts (the first and the last): the sweep trains on the other two only
    ds.write_split(work, shards[1:3], [shards[0], shards[3]], 0.5)
    one = choices_job.sweep_choices(dataclasses.replace(choices, out=str(tmp_path / "one"), num_clusters=(16,),
                                                        router_width=(512,), top_l=(4,), budget_tokens=(vocab,)))
    assert (pl.read_parquet(sorted(one.glob("*.parquet")))["train_rows"] == len(ds.load_rows(shards[1:3]))).all()
    with pytest.raises(DynaSpecError, match="not a DynaSpec fit's work dir"):
        choices_job.sweep_choices(dataclasses.replace(choices, work_dir=str(tmp_path)))


def test_cli_builds_the_fit_config(monkeypatch):
    seen = []
    monkeypatch.setattr(ds, "fit", seen.append)
    ds.main(["--model", "smollm2-135m-instruct", "--num-clusters", "256", "--heldout", "0.2",
             "--set", "drafter_layers=skip:12,14", "--set", "eagle_depth=4", "--no-progress"])
    (cfg,) = seen
    assert (cfg.model, cfg.num_clusters, cfg.heldout, cfg.progress) == ("smollm2-135m-instruct", 256, 0.2, False)
    assert cfg.spec == (("drafter_layers", "skip:12,14"), ("eagle_depth", 4))
    assert cfg.spec_config().drafter_layers == "skip:12,14" and cfg.spec_config().vocab == "full"


def test_cli_set_takes_only_specconfig_fields(monkeypatch):
    """`--set` is engine.config.parse_overrides: a misspelt field stops the CLI before anything runs."""
    monkeypatch.setattr(ds, "fit", lambda cfg: pytest.fail("fit ran with a bad --set"))
    with pytest.raises(SystemExit, match="'drafter_layer=skip:12'.*FIELD one of"):
        ds.main(["--model", "smollm2-135m-instruct", "--set", "drafter_layer=skip:12"])
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        ds.main(["--model", "smollm2-135m-instruct", "--set", "eagle_depth"])


# --- known answers (tests that would catch the mutants) ------------------------------------------------------

def test_router_loss_is_the_hand_computed_bce():
    """BCE over all M clusters, summed over clusters and averaged over rows (§4.2), on numbers whose sigmoid
    is exact: s = 0 -> 1/2, s = ln 3 -> 3/4, s = -ln 3 -> 1/4. Catches reduction="mean" (a factor 1/M) and a
    softmax cross-entropy in its place."""
    ln3 = math.log(3.0)
    scores = torch.tensor([[0.0, ln3, -ln3], [ln3, 0.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    # row 0: -ln(1/2) - ln(1 - 3/4) - ln(1/4) = ln 2 + ln 4 + ln 4;  row 1: -ln(3/4) - ln(1/2) - ln(1/2)
    row0 = math.log(2) + 2 * math.log(4)
    row1 = math.log(4 / 3) + 2 * math.log(2)
    got = fitlib.router_loss(scores, targets)
    assert float(got) == pytest.approx((row0 + row1) / 2, rel=1e-12)
    # one row, one cluster: the plain binary cross-entropy, -ln(3/4)
    assert float(fitlib.router_loss(torch.tensor([[ln3]]), torch.tensor([[1.0]]))) == pytest.approx(math.log(4 / 3))


# --- k-means at its fixed point ----------------------------------------------------------------------------

def _overlapping(n=300, d=8, m=6, seed=0):
    """Rows drawn around m random directions with so much noise that the clusters overlap: Lloyd needs many
    iterations, and an assignment or centroid step done wrong leaves rows at a centroid that is not their best."""
    g = torch.Generator().manual_seed(seed)
    dirs = F.normalize(torch.randn(m, d, generator=g), dim=1)
    x = dirs[torch.randint(0, m, (n,), generator=g)] + 0.8 * torch.randn(n, d, generator=g)
    return x * (0.2 + 5 * torch.rand(n, 1, generator=g))                 # norms must not matter


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_ends_at_its_fixed_point_on_overlapping_data(seed):
    """Spherical k-means' result is a fixed point of both Lloyd steps: every row sits at the centroid of highest
    cosine, and every centroid is the L2-normalised mean (= normalised sum) of its rows. Catches centroids left
    unnormalised and a loop that stops after one iteration."""
    x = _overlapping(seed=seed)
    m = 6
    km = spherical_kmeans(x, m, iters=200, seed=seed)
    xn = F.normalize(x.double(), dim=1)
    c = km.centroids.double()
    assert torch.bincount(km.assign, minlength=m).min() >= 1
    sims = xn @ c.T                                                        # [n, M]
    own = sims.gather(1, km.assign[:, None])[:, 0]
    assert bool((own >= sims.max(1).values - 1e-6).all()), "a row is not at its best centroid"
    means = torch.zeros(m, x.shape[1], dtype=torch.float64).index_add_(0, km.assign, xn)
    torch.testing.assert_close(c, F.normalize(means, dim=1), rtol=0, atol=1e-5)
    assert km.mean_cosine == pytest.approx(float(own.mean()), abs=1e-5)
    assert km.converged and km.iterations > 2                              # the data needs several iterations


# --- fit quality and row logging ------------------------------------------------------------------------------

def _full_head_top(weight, h, el):
    return (h.double() @ weight.double().T).topk(el, dim=1).indices


def assert_rows_are_the_full_heads_top(rows: RouterRows, weight: torch.Tensor) -> None:
    """Recompute the logged labels from the logged router inputs. A row's parent_h is the input of the head
    call that proposed its token: at t = 0 it is the root's own head input (h_root), and at t >= 1 it is the
    head input of the row's parent, one level up in the same draft step. So the full head's top-L of parent_h
    is the logged top of the t = 0 row itself, and of some row of level t - 1 for the others."""
    el = rows.top.shape[1]
    top = rows.top.long()
    starts = (rows.t == 0).nonzero().flatten().tolist() + [len(rows)]
    assert starts[0] == 0
    for a, b in zip(starts[:-1], starts[1:]):                       # one draft step per t = 0 row
        t = rows.t[a:b].long()
        recomputed = _full_head_top(weight, rows.parent_h[a:b], el)        # [rows, L]
        assert torch.equal(recomputed[0], top[a]), "the root row's logged top-L is not the full head's"
        assert int(recomputed[0, 0]) == int(top[a, 0])
        for level in range(1, int(t.max()) + 1):
            sel = (t == level).nonzero().flatten()
            parents = {tuple(r) for r in top[a:b][t == level - 1].tolist()}
            for i in sel.tolist():
                assert tuple(recomputed[i].tolist()) in parents, \
                    f"row {a + i} (t={level}): the full head's top-L of its parent_h is no logged row's top"
                # its token was proposed by that head call: it is among the parent's top tokens
                assert int(rows.tokens[a + i]) in _full_head_top(weight, rows.parent_h[a + i:a + i + 1], 10)[0]


def test_fit_logs_the_full_heads_top_and_the_router_beats_the_static_list(tmp_path):
    """A fit on the random Llama with enough rows to learn from (16 prompts): the logged labels are the full
    head's top-L recomputed from the logged hidden states, the hidden states are logged in the drafter's dtype,
    and on the held-out prompts the router beats the static baseline (the most frequent clusters) at a budget
    below M (k_max = 4 of M = 16)."""
    prompts = tmp_path / "many.jsonl"
    with open(prompts, "w") as f:
        for i in range(20):
            f.write(json.dumps({"question_id": f"q{i}", "category": "chat",
                                "turns": [f"Item {i}: write about {i * 7 % 13} and {i * 3}. " * 2]}) + "\n")
    out = tmp_path / "fitted.safetensors"
    cfg = dataclasses.replace(tiny_dynaspec_fit(tmp_path, out), prompts=str(prompts), num_prompts=16,
                              max_new_tokens=24, epochs=30, router_width=64, lr=3e-3)
    ds.fit(cfg)
    model, _, _ = load_model("random-llama")
    weight = model.get_output_embeddings().weight.detach()
    rows = ds.load_rows(sorted((tmp_path / "fitted.safetensors.work").glob("log-*.safetensors")))
    assert rows.parent_h.dtype == weight.dtype == torch.float32           # not rounded to fp16
    assert int(rows.t.max()) == 2                                          # eagle_depth 3: levels 0, 1, 2
    assert_rows_are_the_full_heads_top(rows, weight)
    meta = json.loads((tmp_path / "fitted.safetensors.json").read_text())
    assert cfg.k_max < cfg.num_clusters
    router, static = meta["heldout"]["router"]["overall"], meta["heldout"]["static_baseline"]["overall"]
    assert router["rows"] == static["rows"] > 200
    assert router["token_recall"] > static["token_recall"] + 0.1, (router, static)
    assert router["cluster_recall"] > static["cluster_recall"] + 0.1, (router, static)
    assert router["mean_row_vocab"] <= static["mean_row_vocab"] * 1.05    # not by a larger shortlist


class _HeadOnly:
    """A full-vocabulary policy stand-in: head_topk over a fixed weight."""

    def __init__(self, weight):
        self.weight = weight

    def head_topk(self, h, k):
        logp = torch.log_softmax(h.float() @ self.weight.float().T, -1)
        return logp.topk(k, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_inputs_are_logged_in_the_drafters_dtype(dtype):
    """The router reads parent_h upcast to fp32 from the drafter's dtype (`Router.forward`): the log keeps
    exactly those values. fp16 would round 1 + 2^-20 to 1 and overflow 1e5 (in bf16's range) to inf."""
    weight = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    log = fitlib.RouterDataLogger(_HeadOnly(weight), top_l=3)
    h = torch.tensor([[1 + 2 ** -20, 1e5, -3e-6, 0.1], [2.0, -1e5, 7.0, 1 / 3]]).to(dtype)
    log.route(torch.tensor([5, 7]), h, 0)
    _, ids = log.head_topk(h, 2)
    rows = log.take()
    assert rows.parent_h.dtype == dtype and torch.equal(rows.parent_h, h)
    assert torch.isfinite(rows.parent_h.float()).all()
    assert torch.equal(rows.top.long(), _HeadOnly(weight).head_topk(h, 3)[1]) and ids.shape == (2, 2)


def test_a_fit_trains_its_router_with_its_own_settings():
    """`FitConfig.router_training()` carries every router-training field of the fit (none left at
    RouterTraining's default), and the fit's defaults are RouterTraining's: one definition of each."""
    fields = [f.name for f in dataclasses.fields(RouterTraining)]
    assert {f.name for f in dataclasses.fields(ds.FitConfig)} >= set(fields)
    for name in fields:
        assert getattr(ds.FitConfig, name) == getattr(RouterTraining, name), name
    changed = {name: (not v if isinstance(v, bool) else v * 3 + 1)
               for name, v in ((n, getattr(RouterTraining, n)) for n in fields)}
    assert ds.FitConfig(model="m", **changed).router_training() == RouterTraining(**changed)


def test_router_training_refuses_changed_hyper_parameters(tmp_path):
    d, m, vocab = 16, 8, 48
    weight = torch.randn(vocab, d, generator=torch.Generator().manual_seed(1))
    assign = torch.arange(vocab) % m
    train = _mapping_rows(200, seed=0)
    cfg = RouterTraining(router_width=8, epochs=1, batch_size=50, lr=1e-2, progress=False)
    router, losses = train_router(cfg, train, weight, assign, tmp_path)
    again, losses2 = train_router(cfg, train, weight, assign, tmp_path)          # the same settings: resumes
    assert losses2 == losses and all(torch.equal(a, b) for a, b in zip(router.state_dict().values(),
                                                                       again.state_dict().values()))
    for change in (dict(lr=2e-2), dict(batch_size=40), dict(weight_decay=0.1), dict(seed=1), dict(epochs=2),
                   dict(router_width=16)):
        (name, value), = change.items()
        with pytest.raises(DynaSpecError, match=rf"other hyper-parameters \({name} .* -> {value}\).*delete it"):
            train_router(dataclasses.replace(cfg, **change), train, weight, assign, tmp_path)
    with pytest.raises(DynaSpecError, match=r"train_rows 200 -> 150"):
        train_router(cfg, RouterRows(*(getattr(train, f.name)[:150] for f in dataclasses.fields(RouterRows))),
                     weight, assign, tmp_path)


def _fake_shards(work, ids):
    from specvocab.engine.artifacts import save_safetensors
    paths = []
    for j, pid in enumerate(ids):
        rows = _mapping_rows(3 + j, seed=j)
        p = work / f"log-{j:05d}.safetensors"
        save_safetensors(rows.tensors(), p, metadata={"prompt_id": pid})
        paths.append(p)
    return paths


def test_choices_use_the_fits_own_split(tmp_path):
    """The choices sweep holds out the prompts the fit held out (its split.json), whatever fraction the sweep
    would pick itself; a work dir without split.json is refused unless a re-split is asked for."""
    shards = _fake_shards(tmp_path, ["p0", "p1", "p2", "p3", "p4"])
    with pytest.raises(DynaSpecError, match="no split.json"):
        choices_job.fit_split(tmp_path, shards)
    ds.write_split(tmp_path, [shards[0], shards[2], shards[4]], [shards[1], shards[3]], 0.4)
    train, held = choices_job.fit_split(tmp_path, shards)
    assert train == [shards[0], shards[2], shards[4]] and held == [shards[1], shards[3]]
    assert choices_job.fit_split(tmp_path, shards, heldout=0.2) == (shards[:4], shards[4:])   # asked for
    with pytest.raises(DynaSpecError, match=r"no log shard for"):
        choices_job.fit_split(tmp_path, shards[:4])
    # a work dir from before split.json: the fitted file's sidecar names the prompts, the held-out ones last
    work = tmp_path / "f.safetensors.work"
    work.mkdir()
    shards = _fake_shards(work, ["p0", "p1", "p2", "p3", "p4"])
    (tmp_path / "f.safetensors.json").write_text(json.dumps(
        {"training": {"prompt_ids": ["p4", "p0", "p3", "p1", "p2"], "heldout_prompts": 2}}))
    train, held = choices_job.fit_split(work, shards)
    assert train == [shards[4], shards[0], shards[3]] and held == [shards[1], shards[2]]
