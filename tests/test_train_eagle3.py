"""EAGLE-3 head training (`engine.train.eagle3`) on random models.

- the draft vocabulary is the most frequent target tokens of the training split (top-1 targets or response
  tokens), clipped to the tokens seen, and the saved d2t / t2d are its maps;
- training-time test: step k's midlayer output equals a from-scratch reference of the midlayer run causally over
  the committed pairs and then the head's OWN earlier outputs (positions shifted by one per step) - it fails if a
  step reads the target's feature instead;
- the loss equals a plain reference (0.8^k weights, the target's top-k renormalised inside the draft vocabulary,
  rows whose target top-1 is outside it masked, the sum divided by every row), gradients included;
- a tiny overfit run lowers the loss; a run lowers its held-out loss, saves the official EAGLE-3 layout, loads
  with `load_eagle3_head` and decodes losslessly with the `eagle3` drafter;
- an interrupted run resumes bit for bit; the CLI verb.
"""

import dataclasses
import json
import types
from collections import Counter

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file

import specvocab.engine.train.data as data_job
import specvocab.engine.train.eagle3 as t3
from specvocab.engine.train import shards as shard_files
from specvocab.engine.train.eagle3_head import eagle3_config_dict
from specvocab.engine.train.evaluate import heldout_tau
from specvocab.engine.train.sample import FEATURES
import specvocab.engine.train.ttt as ttt
from specvocab.engine.train.ttt import ttt_forward
from specvocab.engine.drafters.eagle3 import DraftVocab, load_eagle3_head
from specvocab.engine.harness import generate
from specvocab.engine.artifacts import FINGERPRINT_KEY, head_fingerprint, head_matches
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.vocab.frspec import eagle3_maps
from tests.eagle3_testing import midlayer_reference
from tests.engine_testing import assert_trained_head_lossless, dies_at_call

DATA = dict(model="random-llama", num_prompts=6, heldout_prompts=2, max_tokens=160, max_prompt_tokens=120,
            greedy_new_tokens=12, greedy_batch=3, prompts_per_shard=2, topk=8, progress=False)
TRAIN = dict(model="random-llama", tokens=2000, batch_tokens=400, warmup_steps=2, eval_every=10 ** 9, eval_prompts=1,
             eval_new_tokens=8, save_every=2, progress=False, head_dtype="fp32", draft_vocab_size=48, ttt_steps=3,
             lr=3e-3)
OFFICIAL_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                 *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                 *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"))}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train3") / "data"
    return data_job.make_data(data_job.DataConfig(**DATA, sources=("teacher", "greedy"), eagle3_features=True,
                                                  feature_dtype="fp32", out=str(out)))


@pytest.fixture(scope="module")
def target():
    model, _, _ = load_model("random-llama", dtype="fp32")
    return model


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    return t3.train_eagle3(t3.Train3Config(**TRAIN, data=str(data_dir), out=str(tmp_path_factory.mktemp("h") / "head")))


def _head(target, samples, k=40, seed=0, init="random"):
    V = target.config.vocab_size
    ids, _ = t3.draft_vocabulary(samples, V, k)
    d2t, t2d = eagle3_maps(ids, V)
    head = t3.new_eagle3_head(target, d2t, t2d, seed, init).double()
    with torch.no_grad():                                    # norms away from 1, so that a wrong input shows
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype))
            else:
                p.mul_(4)
    return head, DraftVocab.of(head, "cpu")


# --- the draft vocabulary ----------------------------------------------------------------------------------------

def test_draft_vocabulary_is_the_most_frequent_target_tokens(data_dir, trained):
    train = shard_files.load_split(data_dir, "train")
    top1 = Counter(t for s in train for t in s.topk_ids[1:, 0].tolist())
    ranked = sorted(top1, key=lambda t: (-top1[t], t))
    ids, counts = t3.draft_vocabulary(train, 512, 10)
    assert ids.tolist() == ranked[:10] and counts.tolist() == [top1[t] for t in ranked[:10]]
    ids, _ = t3.draft_vocabulary(train, 512, 10 ** 6)                       # clipped to the tokens seen
    assert sorted(ids.tolist()) == sorted(top1)
    resp = Counter(t for s in train for t in s.input_ids[s.loss_mask].tolist())
    ids, _ = t3.draft_vocabulary(train, 512, 7, how="response")
    assert ids.tolist() == sorted(resp, key=lambda t: (-resp[t], t))[:7]
    # the saved head's maps are those of the top-48 target tokens
    state = load_file(str(trained / "model.safetensors"))
    d2t, t2d = eagle3_maps(ranked[:48], 512)
    assert torch.equal(state["d2t"], d2t) and torch.equal(state["t2d"], t2d)
    info = json.loads((trained / "config.json").read_text())
    assert info["draft_vocab_size"] == 48 and info["specvocab"]["training"]["draft_vocab"]["size"] == 48


# --- training-time test --------------------------------------------------------------------------------------------

def test_ttt_step_k_reads_the_heads_own_hidden(data_dir, target):
    train = shard_files.load_split(data_dir, "train")
    samples = [train[0], train[3]]                           # two sequences packed, different lengths
    head, maps = _head(target, train)
    steps = 3
    batch = t3.make_batch3(samples, maps, steps, dtype=torch.float64)
    outs = ttt_forward(head, lambda t: target.get_input_embeddings()(t).double(), batch)
    S = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary")}
    C = eagle3_config_dict(head, (0, 1, 1))
    emb_w = target.get_input_embeddings().weight.detach().double()
    checked = 0
    for j, s in enumerate(samples):
        L = s.input_ids.numel()
        g = torch.cat([s.extra[f] for f in FEATURES], -1).double()
        rows = (batch.seg == j).nonzero().flatten()
        for p in (0, 5, L - 4):
            h = g[: p + 1] @ S["fc.weight"].T                  # committed pairs (g_i, x_{i+1}), i <= p
            toks = s.input_ids[1: p + 2].tolist()
            ref = None
            for k in range(steps):
                if k:                                          # step k: the previous step's OWN output, x_{p+1+k}
                    h = torch.cat([h, ref[-1:]])
                    toks.append(int(s.input_ids[p + 1 + k]))
                ref = midlayer_reference(S, C, emb_w[toks], h)
                torch.testing.assert_close(outs[k][rows[p]], ref[-1], rtol=1e-4, atol=1e-4)   # RoPE angles in fp32
                checked += 1
    assert checked == 18


def test_loss_equals_reference_and_masks_out_of_vocabulary_targets(data_dir, target):
    train = shard_files.load_split(data_dir, "train")
    samples = train[:3]
    head, maps = _head(target, train, k=12)                   # a small draft vocabulary: many targets outside it
    steps, w = 3, 0.8
    batch = t3.make_batch3(samples, maps, steps, dtype=torch.float64)
    embed = lambda t: target.get_input_embeddings()(t).double()
    # the reference, from the raw samples
    outs = ttt_forward(head, embed, batch)
    row_of = {int(t): i for i, t in enumerate(torch.arange(maps.d2t.numel()) + maps.d2t)}
    total, masked, kept = 0.0, 0, 0
    for k in range(steps):
        logq = torch.log_softmax(head.lm_head(head.norm(outs[k])), -1)
        r = 0
        lk = 0.0
        for s in samples:
            L = s.input_ids.numel()
            for p in range(L - 1):
                i = p + 1 + k
                if i <= L - 1:
                    ids, logits = s.topk_ids[i].tolist(), s.topk_logits[i].double()
                    if ids[0] not in row_of:
                        masked += 1
                    else:
                        kept += 1
                        adm = [a for a, t in enumerate(ids) if t in row_of]
                        pr = torch.softmax(logits[adm], -1)
                        lk = lk - (pr * logq[r, [row_of[ids[a]] for a in adm]]).sum()
                r += 1
        total = total + w ** k * lk / r
    assert masked > 20 and kept > 20
    head.zero_grad()
    total.backward()
    ref_grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    got = t3.ttt_loss(head, embed, batch, step_weight=w, head_dtype=torch.float64, chunk=7)
    assert got["loss"] == pytest.approx(float(total), rel=1e-6)     # chunked_head_ce sums in fp32
    for n, p in head.named_parameters():
        err = float((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
        assert err < 1e-6, (n, err)                            # the target's p is computed in fp32
    assert not batch.mask[~maps.t2d[batch.top1]].any()        # no loss where the target's top-1 is outside


def test_steps_past_0_run_only_the_rows_they_score(data_dir, target, monkeypatch):
    """With the loss on the response only, TTT steps >= 1 run just the rows scored at some step >= 1 (a prompt's
    early rows drop out after step 0): their outputs, the loss and every gradient equal those of running every
    row, and the rows left out stay zeros."""
    train = shard_files.load_split(data_dir, "train")
    samples = [s for s in train if s.source == "teacher"][:3]
    head, maps = _head(target, train, k=40)
    steps = 3
    batch = t3.make_batch3(samples, maps, steps, loss_on="response", dtype=torch.float64)
    embed = lambda t: target.get_input_embeddings()(t).double()
    keep = ttt.scored_rows(batch, steps)
    prompt_rows = sum(int((~s.loss_mask).sum()) for s in samples)
    assert keep is not None and keep.numel() < batch.rows - prompt_rows + len(samples) * steps
    out = torch.ones(batch.rows, dtype=torch.bool)
    out[keep] = False

    def run():
        head.zero_grad()
        outs = ttt_forward(head, embed, batch)
        res = t3.ttt_loss(head, embed, batch, head_dtype=torch.float64, chunk=7)
        return outs, res, {n: p.grad.clone() for n, p in head.named_parameters()}

    outs, res, grads = run()
    monkeypatch.setattr(ttt, "scored_rows", lambda batch, steps: None)
    ref_outs, ref, ref_grads = run()
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-9) and res["counted"] == ref["counted"]
    for k in range(steps):
        torch.testing.assert_close(outs[k][keep], ref_outs[k][keep], rtol=1e-9, atol=1e-9)
        assert k == 0 or not outs[k][out].any()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-7, atol=1e-9)


def test_a_tiny_overfit_run_lowers_the_loss(data_dir, target):
    train = shard_files.load_split(data_dir, "train")
    head, maps = _head(target, train, k=64, init="target")
    head = head.float()
    batch = t3.make_batch3(train[:2], maps, 3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        losses.append(t3.ttt_loss(head, target.get_input_embeddings(), batch)["loss"])
        opt.step()
    assert losses[-1] < 0.5 * losses[0], losses


# --- a run ---------------------------------------------------------------------------------------------------------

def test_a_run_learns_saves_the_official_layout_and_decodes_losslessly(trained, target):
    lc = pl.read_parquet(trained / "learning_curve.parquet")
    assert lc["heldout_loss"][-1] < lc["heldout_loss"][0] and lc["tokens"][-1] >= 2000
    assert set(load_file(str(trained / "model.safetensors"))) == OFFICIAL_KEYS
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    weight = target.get_output_embeddings().weight.detach()
    assert cfg["specvocab"]["target"] == "random-llama"
    assert cfg["specvocab"][FINGERPRINT_KEY] == head_fingerprint(weight) and head_matches(cfg["specvocab"], weight)
    card = (trained / "README.md").read_text()
    assert "tau" in card and "differs from EAGLE" in card
    head = load_eagle3_head(str(trained))
    assert head.draft_vocab_size == 48
    assert_trained_head_lossless(target, "eagle3", str(trained))
    # the curve's last tau is the saved checkpoint's
    manifest = shard_files.read_manifest(cfg["specvocab"]["training"]["data"])
    held = shard_files.load_split(cfg["specvocab"]["training"]["data"], "heldout")
    prompts = t3.heldout_prompts(held, manifest, 1)
    _, tok, info = load_model("random-llama", dtype="fp32")
    tau = heldout_tau(target, tok, info, None, prompts, 8, eos_token_ids(target, tok), method="eagle3",
                      head_dir=str(trained))
    assert tau == pytest.approx(lc["heldout_tau"][-1])


def test_a_head_trained_here_is_refused_on_another_target(trained, target):
    """The saved `specvocab` block ties the head to its target's LM head: the same shapes with other weights (a
    1% perturbation, as a fine-tune would be) are refused by the eagle3 drafter, naming the field and the fix."""
    import copy

    from specvocab.engine.drafters.lmhead import DrafterError

    other = copy.deepcopy(target)
    with torch.no_grad():
        w = other.get_output_embeddings().weight
        w.add_(0.01 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(DrafterError, match=r"eagle3_head=.*was trained for 'random-llama'.*train_eagle3"):
        generate(other, torch.arange(3, 20), method="eagle3", eagle3_head=str(trained), max_new_tokens=4, eos_ids=[])
    generate(target, torch.arange(3, 20), method="eagle3", eagle3_head=str(trained), max_new_tokens=4, eos_ids=[])


def test_interrupted_training_resumes_bit_for_bit(data_dir, trained, tmp_path, monkeypatch):
    cfg = dict(TRAIN, data=str(data_dir))
    whole = trained                                           # the same settings, uninterrupted
    # killed at the 4th training step (the held-out evaluation's calls run without backward)
    monkeypatch.setattr(t3, "ttt_loss", dies_at_call(t3.ttt_loss, 4, lambda *a, **k: k.get("backward", True)))
    with pytest.raises(KeyboardInterrupt):
        t3.train_eagle3(t3.Train3Config(**cfg, out=str(tmp_path / "cut")))
    assert torch.load(tmp_path / "cut" / "train_state.pt", weights_only=False)["step"] == 2
    monkeypatch.undo()
    resumed = t3.train_eagle3(t3.Train3Config(**cfg, out=str(tmp_path / "cut")))
    a = torch.load(whole / "train_state.pt", weights_only=False)
    b = torch.load(resumed / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] >= 4 and a["tokens_seen"] == b["tokens_seen"]
    for name in a["head"]:
        assert torch.equal(a["head"][name], b["head"][name]), name
    for pid, st in a["opt"]["state"].items():
        for key, v in st.items():
            assert torch.equal(v, b["opt"]["state"][pid][key]), (pid, key)
    assert str(a["curve"]) == str(b["curve"])                  # (nan != nan)
    sa, sb = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(data_job.TrainError, match="other settings"):
        t3.train_eagle3(t3.Train3Config(**{**cfg, "lr": 0.5}, out=str(tmp_path / "cut")))


def test_a_run_sliced_by_run_minutes_ends_as_the_whole_run(data_dir, trained, tmp_path, monkeypatch):
    """`run_minutes` stops a run on the way as if its budget ended there: a curve point at that step, the state,
    and a head whose card says the budget is not spent. The same command again continues from the checkpoint
    and ends with the uninterrupted run's head, bit for bit, its curve holding the stop's point besides."""
    import specvocab.engine.train.loop as loop_module
    cfg = dict(TRAIN, data=str(data_dir), out=str(tmp_path / "sliced"))
    clock = iter(range(0, 10 ** 6, 20))                          # each reading of the clock: 20 s later
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    out = t3.train_eagle3(t3.Train3Config(**cfg, run_minutes=1))
    stopped = torch.load(out / "train_state.pt", weights_only=False)
    whole = torch.load(trained / "train_state.pt", weights_only=False)
    assert 0 < stopped["step"] < whole["step"] and stopped["curve"][-1]["step"] == stopped["step"]
    assert "a run stopped on the way" in (out / "README.md").read_text()
    monkeypatch.undo()
    t3.train_eagle3(t3.Train3Config(**cfg))
    end = torch.load(out / "train_state.pt", weights_only=False)
    assert end["step"] == whole["step"] and "a run stopped on the way" not in (out / "README.md").read_text()
    for name in whole["head"]:
        assert torch.equal(end["head"][name], whole["head"][name]), name
    assert [p["step"] for p in end["curve"]] == sorted({p["step"] for p in whole["curve"]} | {stopped["step"]})


def test_a_cards_commands_make_the_same_data_and_run(data_dir, trained, monkeypatch):
    """The model card's two commands, parsed by their jobs, give back the data folder's settings and the run's
    config (a card that drops a changed setting - the draft vocabulary's coverage, the loss's rows - fails)."""
    import shlex
    import specvocab.engine.jobs.eagle_data as eagle_data_job
    from specvocab.engine.jobs.args import config_main
    from specvocab.engine.train.cards import data_command, train_command
    settings = shard_files.read_manifest(data_dir)["settings"]
    cfg = t3.Train3Config(**{**TRAIN, "draft_vocab_coverage": 0.9, "loss_on": "response", "vocab_count": "response",
                             "threads": 1}, data="D", out="O")
    monkeypatch.setattr(eagle_data_job, "make_data", lambda c: c)
    made = eagle_data_job.main(shlex.split(data_command("random-llama", settings).replace("<data>", "D"))[3:])
    assert made.key() == settings
    parsed = config_main(shlex.split(train_command("train_eagle3", cfg).replace("<data>", "D")
                                     .replace("<dir>", "O"))[3:], prog="p", description="", cls=t3.Train3Config,
                         run=lambda c: c, skip={"model", "betas", "progress"})
    assert parsed == dataclasses.replace(cfg, progress=True)
    card = (trained / "README.md").read_text()
    assert train_command("train_eagle3", t3.Train3Config(**TRAIN, data="x")).replace("--data <data> ", "") \
        .split(" --out")[0].split("--model random-llama ")[1] in card


def test_data_without_eagle3_features_is_refused(tmp_path):
    data = data_job.make_data(data_job.DataConfig(**{**DATA, "num_prompts": 3, "heldout_prompts": 1},
                                                  out=str(tmp_path / "d")))
    with pytest.raises(data_job.TrainError, match="--eagle3-features"):
        t3.train_eagle3(t3.Train3Config(**TRAIN, data=str(data), out=str(tmp_path / "h")))


def test_cli_verb():
    from specvocab.sweeps.cli import resolve
    assert resolve(["train", "eagle3", "--model", "x"]) == ("specvocab.engine.jobs.train_eagle3", ["--model", "x"])


def test_compare_heads_runs_both_heads_at_one_tree(data_dir, trained, target):
    """`engine.jobs.compare_heads`: ar, the EAGLE-2 head and the EAGLE-3 head on the data's held-out prompts at one
    tree; each tau is the one a direct decode of those prompts gives (catches another tree, other prompts or the
    heads swapped), outputs counted against ar's."""
    from specvocab.engine.train.compare import CompareConfig, compare_heads

    loaded = (target, *load_model("random-llama", dtype="fp32")[1:])
    cfg = CompareConfig(model="random-llama", data=str(data_dir), eagle_head="random", eagle3_head=str(trained),
                        prompts=2, new_tokens=8, eagle_depth=3, draft_size=6, progress=False)
    frame = compare_heads(cfg, loaded=loaded)
    assert frame["method"].to_list() == ["ar", "eagle", "eagle3"]
    assert frame["equal_to_ar"].to_list() == [2, 2, 2] and frame["tau"][0] == 1.0
    prompts = t3.heldout_prompts(shard_files.load_split(str(data_dir), "heldout"), shard_files.read_manifest(str(data_dir)), 2)
    eos = eos_token_ids(target, loaded[1])
    for method, head in (("eagle", {"eagle_head": "random"}), ("eagle3", {"eagle3_head": str(trained)})):
        res = [generate(target, torch.as_tensor(p), method=method, eagle_depth=3, draft_size=6, max_new_tokens=8,
                        eos_ids=eos, **head) for p in prompts]
        tau = sum(r.new_tokens for r in res) / sum(r.steps for r in res)
        assert frame.filter(pl.col("method") == method)["tau"][0] == pytest.approx(tau), method
    with pytest.raises(t3.TrainError, match="--data is required"):
        compare_heads(CompareConfig(model="random-llama"), loaded=loaded)
    # a candidate EAGLE-3 head: a fourth row at the same tree, its tau a direct decode's
    frame = compare_heads(dataclasses.replace(cfg, eagle3_head="random", candidate=str(trained)), loaded=loaded)
    assert frame["method"].to_list() == ["ar", "eagle", "eagle3", "eagle3 candidate"]
    assert frame["equal_to_ar"].to_list() == [2, 2, 2, 2]
    assert frame["head"][3] == str(trained) and frame["head"][2] != str(trained)
    assert frame["tau"][3] == pytest.approx(tau)             # the trained head's tau computed above


def test_features_on_the_fly_train_the_head_a_stored_folder_trains(tmp_path):
    """A run on a tokens-only folder (features from one prefill per batch) follows the run on the folder that
    stores those features: the same steps and tokens, the same losses and head up to float noise, one draft
    vocabulary counted over the response tokens (a 'top1' count needs stored top-1s: refused, naming the fix)."""
    kw = dict(DATA, sources=("teacher", "greedy"), eagle3_features=True, feature_dtype="fp32")
    tokens = data_job.make_data(data_job.DataConfig(**{**kw, "sources": ("teacher",)}, store_features=False,
                                                    out=str(tmp_path / "tokens")))
    stored = data_job.make_data(data_job.DataConfig(**{**kw, "sources": ("teacher",)}, out=str(tmp_path / "stored")))
    cfg = dict(TRAIN, vocab_count="response")
    a = t3.train_eagle3(t3.Train3Config(**cfg, data=str(stored), out=str(tmp_path / "a")))
    b = t3.train_eagle3(t3.Train3Config(**cfg, data=str(tokens), out=str(tmp_path / "b")))
    sa = torch.load(a / "train_state.pt", weights_only=False)
    sb = torch.load(b / "train_state.pt", weights_only=False)
    assert sa["step"] == sb["step"] >= 4 and sa["tokens_seen"] == sb["tokens_seen"]
    torch.testing.assert_close(torch.tensor(sb["losses"]), torch.tensor(sa["losses"]), rtol=1e-3, atol=1e-4)
    for name, w in sa["head"].items():
        torch.testing.assert_close(sb["head"][name].double(), w.double(), rtol=1e-3, atol=1e-4)
    assert json.loads((b / "config.json").read_text())["specvocab"]["training"]["features"] == "on the fly"
    with pytest.raises(data_job.TrainError, match="vocab-count response"):
        t3.train_eagle3(t3.Train3Config(**TRAIN, data=str(tokens), out=str(tmp_path / "c")))


def test_train_speed_measures_packing_and_both_dtypes(data_dir, target):
    """`train_speed` on a real data folder: its packing figures are the padding of the batches the loop makes
    (recomputed here from the lengths), grouping never pads more than random packing, both dtypes are timed, and
    its FLOP count is the matmuls' (recomputed from the head's shapes: a count that forgets the backward or the
    LM head fails)."""
    from specvocab.engine.train.loop import length_grouped_batches
    from specvocab.engine.train.speed import SpeedConfig, padding, step_flops, train_speed

    out = train_speed(SpeedConfig(model="random-llama", data=str(data_dir), batch_tokens=400, group_batches=2,
                                  draft_vocab_size=48, ttt_steps=3, head_dtype="fp32", steps=2, repeats=1,
                                  progress=False))
    lengths = np.array([s.input_ids.numel() for s in shard_files.load_split(data_dir, "train")])
    pack = {r["setting"]: r for r in out.filter(pl.col("measure") == "packing").iter_rows(named=True)}
    for name, group in (("random", 0), ("length-grouped", 2)):
        want = padding(lengths, length_grouped_batches(lengths, np.random.default_rng(0), 400, group))
        assert (pack[name]["padded_rows"], pack[name]["padded_scores"]) == pytest.approx(want)
    assert pack["length-grouped"]["padded_scores"] <= pack["random"]["padded_scores"]
    steps = out.filter(pl.col("measure") == "step")
    assert sorted(steps["setting"]) == ["bf16", "fp32"] and (steps["step_s"] > 0).all()

    train = shard_files.load_split(data_dir, "train")
    head, maps = _head(target, train)
    d, V = head.lm_head.weight.shape[1], head.lm_head.weight.shape[0]
    layer = sum(m.weight.numel() for m in head.midlayer.modules() if isinstance(m, torch.nn.Linear))
    for loss_on in ("all", "response"):
        batch = t3.make_batch3(train[:3], maps, 3, loss_on)
        later = ttt.scored_rows(batch, 3)
        later = batch.rows if later is None else later.numel()
        mid, lm = step_flops(head, batch)
        assert lm == 6 * int(batch.mask.sum()) * V * d
        assert mid == 6 * (batch.rows * (layer + head.fc.weight.numel()) + 2 * later * layer)
        if loss_on == "response":
            assert later < batch.rows
