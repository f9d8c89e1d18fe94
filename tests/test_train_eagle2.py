"""Training data and EAGLE-2 heads (`engine.train.data`, `engine.train.eagle2`) on random models; the shipped heads on the real ones.

- the chunked LM-head cross-entropy equals its plain reference (loss and gradient, with soft-capping);
- a data folder: shards with the target's features and top-k equal to the harness' own prefill, greedy
  continuations equal to the harness' AR decoding, the held-out split by prompt, resume after a lost shard
  (finished shards untouched), and clear errors for other settings, a damaged shard, an empty corpus;
- a head trained a few steps lowers its loss, saves in the EAGLE-1/2 layout with the official tensor names,
  loads back through the `eagle` drafter, decodes losslessly, resumes after an interruption to the same
  weights and losses as an uninterrupted run (bitwise), and refuses a target it was not trained for;
- known answers of `make_batch`, `head_forward` and `eagle_loss` on a hand-built bigram target;
- the shipped heads: found by default for both offline models, lossless, and better than an untrained head.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle import EagleDrafter, load_eagle_head, random_eagle_head, save_eagle_head
from specvocab.engine.catalog import shipped_heads
from specvocab.engine.shipped import default_eagle_head
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.harness import generate, prefill
from specvocab.engine.kv import new_cache
from specvocab.engine.models import load_model
import specvocab.engine.train.data as data_job
import specvocab.engine.train.eagle2 as tr
from specvocab.engine.train import shards as shard_files
from specvocab.engine.train.losses import reference_head_ce
from tests.engine_testing import assert_trained_head_lossless, dies_at_call

OFFICIAL_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
                 *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


# --- the chunked head loss --------------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_head_ce_equals_reference(chunk, softcap):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 50, (23, 4), generator=g)
    p = torch.softmax(torch.randn(23, 4, generator=g, dtype=torch.float64), -1)
    loss, grad = tr.chunked_head_ce(h, w, ids, p, chunk, softcap)
    hr = h.clone().requires_grad_(True)
    ref = reference_head_ce(hr, w, ids, p, softcap)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach().double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, hr.grad)
    no_grad_loss, none = tr.chunked_head_ce(h, w, ids, p, chunk, softcap, with_grad=False)
    assert none is None and torch.isclose(no_grad_loss.double(), ref.detach().double())


def test_block_causal_bias_keeps_sequences_apart():
    bias = tr._block_causal_bias([2, 3], torch.float32)[0, 0]
    seen = bias == 0
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
                          dtype=torch.bool)
    assert torch.equal(seen, expect)


# --- data ----------------------------------------------------------------------------------------------------

DATA = dict(model="random-llama", num_prompts=6, heldout_prompts=2, max_tokens=160, max_prompt_tokens=120,
            greedy_new_tokens=12, greedy_batch=3, prompts_per_shard=2, topk=8, progress=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "data"
    return data_job.make_data(data_job.DataConfig(**DATA, sources=("teacher", "greedy"), eagle3_features=True,
                                      feature_dtype="fp32", out=str(out)))


def test_data_shards_hold_the_targets_own_features(data_dir):
    model, _, info = load_model("random-llama")
    manifest = shard_files.read_manifest(data_dir)
    assert manifest["vocab_size"] == info.vocab_size and manifest["settings"]["sources"] == ["teacher", "greedy"]
    held, train = shard_files.load_split(data_dir, "heldout"), shard_files.load_split(data_dir, "train")
    assert len({s.prompt_id for s in held}) == 2 and len({s.prompt_id for s in train}) == 4
    assert not {s.prompt_id for s in held} & {s.prompt_id for s in train}          # split by prompt
    assert {s.source for s in train} == {"teacher", "greedy"}
    s = train[0]
    cache = new_cache(model)
    hidden, logits = prefill(model, s.input_ids, cache)
    torch.testing.assert_close(s.hidden, hidden, rtol=1e-4, atol=1e-4)
    assert torch.equal(s.topk_ids[:, 0], logits.argmax(-1))
    torch.testing.assert_close(s.topk_logits, logits.topk(8, -1).values, rtol=1e-4, atol=1e-4)
    assert s.loss_mask.any() and not s.loss_mask[0]
    assert set(s.extra) == {"hidden_low", "hidden_mid", "hidden_high"}
    assert all(v.shape == s.hidden.shape for v in s.extra.values())


def test_greedy_samples_are_the_targets_greedy_continuation(data_dir):
    model, tok, info = load_model("random-llama")
    for s in shard_files.load_split(data_dir, "train"):
        if s.source != "greedy":
            continue
        prompt_len = int((~s.loss_mask).sum())
        ar = generate(model, s.input_ids[:prompt_len], method="ar", max_new_tokens=12, eos_ids=[], info=info)
        cont = s.input_ids[prompt_len:].tolist()
        assert cont == ar.output_ids.tolist()[: len(cont)]


def test_greedy_batches_are_length_sorted_and_each_continuation_stays_with_its_prompt(tmp_path, monkeypatch):
    """The batched generation sees prompts of similar lengths together, and the continuation of each prompt lands
    in that prompt's sample (a random model's continuations repeat one token whatever the prompt, so a fake
    generator that answers each prompt with its own reversed tail tells them apart)."""
    calls = []

    def fake(model, prompts, new_tokens, eos_ids, pad_id=0):
        calls.append([len(q) for q in prompts])
        return [list(q[::-1][:new_tokens]) for q in prompts]

    monkeypatch.setattr(data_job, "greedy_continuations", fake)
    out = data_job.make_data(data_job.DataConfig(**{**DATA, "prompts_per_shard": 4, "greedy_batch": 2},
                                                 sources=("greedy",), store_features=False, out=str(tmp_path / "g")))
    samples = shard_files.load_split(out, "heldout") + shard_files.load_split(out, "train")
    assert len(samples) == DATA["num_prompts"]
    for s in samples:
        n = int((~s.loss_mask).sum())
        prompt = s.input_ids[:n].tolist()
        assert s.input_ids[n:].tolist() == prompt[::-1][:DATA["greedy_new_tokens"]]
    flat = [n for c in calls for n in c]
    assert sorted(flat) == sorted(int((~s.loss_mask).sum()) for s in samples)
    train_calls = calls[1:]                              # the held-out shard first, then the one train shard
    assert [n for c in train_calls for n in c] == sorted(n for c in train_calls for n in c)
    assert max(len(c) for c in calls) == 2


def test_data_resumes_and_refuses_other_settings(tmp_path):
    out = tmp_path / "d"
    cfg = data_job.DataConfig(**DATA, out=str(out))
    data_job.make_data(cfg)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == 3
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[1].unlink()                                   # a shard lost mid-run
    data_job.make_data(cfg)
    again = {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("*.safetensors"))}
    assert set(again) == set(stamps)
    assert [n for n in again if again[n] != stamps[n]] == [shards[1].name]       # only the lost one rewritten
    with pytest.raises(data_job.TrainError, match="other settings"):
        data_job.make_data(data_job.DataConfig(**{**DATA, "topk": 4}, out=str(out)))
    shards[0].write_bytes(shards[0].read_bytes()[:100])                           # a torn shard
    with pytest.raises(data_job.TrainError, match=f"{shards[0].name}.*not readable.*delete"):
        shard_files.load_split(out, shards[0].name.split("-")[0])


def test_bad_corpora_and_settings_name_the_problem(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(data_job.TrainError, match="empty"):
        data_job.make_data(data_job.DataConfig(**{**DATA, "prompts": str(empty)}, out=str(tmp_path / "x")))
    with pytest.raises(data_job.TrainError, match="unknown data source"):
        data_job.DataConfig(model="random-llama", sources=("beam",)).validate()
    with pytest.raises(data_job.TrainError, match="no training data"):
        shard_files.read_manifest(tmp_path)


# --- heads ----------------------------------------------------------------------------------------------------

TRAIN = dict(model="random-llama", tokens=3000, batch_tokens=400, warmup_steps=2, eval_every=10 ** 9,
             eval_prompts=1, eval_new_tokens=8, save_every=2, progress=False)


def test_training_lowers_the_loss_and_saves_the_eagle_layout(data_dir, tmp_path):
    out = tr.train_eagle(tr.TrainConfig(**TRAIN, data=str(data_dir), out=str(tmp_path / "head"), lr=3e-3))
    curve = json.loads((out / "config.json").read_text())["specvocab"]["training"]
    assert curve["steps"] >= 6
    import polars as pl
    lc = pl.read_parquet(out / "learning_curve.parquet")
    assert lc["heldout_loss"][-1] < lc["heldout_loss"][0]                 # it learned something
    from safetensors.torch import load_file
    assert set(load_file(str(out / "model.safetensors"))) == OFFICIAL_KEYS
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "tau" in (out / "README.md").read_text()
    # loads back through the drafter and decodes losslessly
    assert_trained_head_lossless(load_model("random-llama")[0], "eagle", str(out))


def test_interrupted_training_resumes_to_the_same_run(data_dir, tmp_path, monkeypatch):
    """Killed after 4 steps and resumed from the step-4 checkpoint, a run ends bit for bit where the
    uninterrupted run ends: head weights, optimiser state, per-step losses, learning curve. This needs the
    noise generator's state in the checkpoint (reseeding it on resume draws other noise)."""
    full = tr.train_eagle(tr.TrainConfig(**TRAIN, data=str(data_dir), out=str(tmp_path / "full")))
    out = tmp_path / "head"
    # killed at the 5th training step (the held-out evaluation's calls pass no noise generator)
    monkeypatch.setattr(tr, "eagle_loss", dies_at_call(tr.eagle_loss, 5, lambda *a, **k: k.get("gen") is not None))
    with pytest.raises(KeyboardInterrupt):
        tr.train_eagle(tr.TrainConfig(**TRAIN, data=str(data_dir), out=str(out)))
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 4 and len(state["losses"]) == 4   # the checkpoint before the crash
    monkeypatch.undo()
    tr.train_eagle(tr.TrainConfig(**TRAIN, data=str(data_dir), out=str(out)))
    a = torch.load(full / "train_state.pt", weights_only=False)
    b = torch.load(out / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] > 4 and (out / "model.safetensors").is_file()
    assert b["losses"] == a["losses"] and len(a["losses"]) == a["step"]          # the loss curve, exactly
    assert json.dumps(b["curve"]) == json.dumps(a["curve"])                      # held-out points (tau may be nan)
    for k, w in a["head"].items():
        assert torch.equal(w, b["head"][k]), k                                     # bitwise
    for (i, sa), sb in zip(a["opt"]["state"].items(), b["opt"]["state"].values()):
        assert all(torch.equal(sa[n], sb[n]) for n in sa), i
    assert torch.equal(a["rng"], b["rng"])
    from safetensors.torch import load_file
    fa, fb = load_file(str(full / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    with pytest.raises(data_job.TrainError, match="other settings"):
        tr.train_eagle(tr.TrainConfig(**{**TRAIN, "lr": 0.5}, data=str(data_dir), out=str(out)))


def test_a_head_for_another_target_is_refused(tmp_path):
    model, _, _ = load_model("random-llama", seed=0)
    other, _, _ = load_model("random-llama", seed=1)              # same shapes, other weights
    save_eagle_head(random_eagle_head(model), tmp_path, target_name="random-llama",
                    target_weight=model.get_output_embeddings().weight)
    cfg = SpecConfig.preset("eagle", eagle_head=str(tmp_path), draft_size=8)
    EagleDrafter(model, cfg)                                        # its own target: fine
    with pytest.raises(DrafterError, match="trained for 'random-llama'.*not for this target"):
        EagleDrafter(other, cfg)
    with pytest.raises(data_job.TrainError, match="made for model"):
        data = tmp_path / "d"
        data_job.make_data(data_job.DataConfig(**{**DATA, "num_prompts": 3, "heldout_prompts": 1}, out=str(data)))
        tr.train_eagle(tr.TrainConfig(**{**TRAIN, "model": "random-gemma3"}, data=str(data), out=str(tmp_path / "h")))


# --- the shipped heads ------------------------------------------------------------------------------------------

def test_every_offline_model_ships_a_head():
    assert set(shipped_heads()) >= {"smollm2-135m-instruct", "gemma-3-270m"}
    for name, path in shipped_heads().items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["specvocab"]["target"] == name
        assert (path / "README.md").is_file() and (path / "model.safetensors").stat().st_size < 40 << 20
        head = load_eagle_head(f"specvocab:{name}")
        assert head.embed_tokens is None                           # the target's embedding, not a copy


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_shipped_head_is_the_default_and_lossless(name, request):
    model, tok, info = request.getfixturevalue(name)
    source = default_eagle_head(model)
    assert source == f"specvocab:{info.name}"
    from specvocab.engine.prompts import encode_prompt, load_prompts
    p = load_prompts("spec_bench", categories=["summarization"], per_category=1)[0]
    ids = torch.as_tensor(encode_prompt(tok, info, p.turns[:1], [], max_new_tokens=24))
    ar = generate(model, ids, method="ar", max_new_tokens=24, tokenizer=tok, info=info)
    trained = generate(model, ids, method="eagle", max_new_tokens=24, tokenizer=tok, info=info)
    untrained = generate(model, ids, method="eagle", eagle_head="random", max_new_tokens=24, tokenizer=tok, info=info)
    assert trained.output_ids.tolist() == ar.output_ids.tolist()
    assert trained.tau > untrained.tau + 0.3, (trained.tau, untrained.tau)


# --- training targets: known answers -----------------------------------------------------------------------------
# A bigram "target" over V = d = 4 tokens: its feature after reading x_i is f_i = E[x_i] = 2 e_{x_i} and its LM
# head is the identity, so its next-token logits at i are f_i (top-1: x_i). EAGLE pairs (f_i, x_{i+1}) at
# position i with the targets at i + 1: the feature f_{i+1} and the distribution after x_{i+1}. A head that
# outputs E[x_{i+1}] is then exactly right, and one that outputs f_i is one position behind.

D = 4


def _bigram_sample(ids, mask, prompt_id="p"):
    x = torch.tensor(ids)
    return data_job.Sample(prompt_id=prompt_id, source="teacher", input_ids=x, loss_mask=torch.tensor(mask),
                           hidden=2.0 * F.one_hot(x, D).float(),
                           topk_ids=torch.stack([x, (x + 1) % D], 1),                       # [L, 2]
                           topk_logits=torch.tensor([[2.0, 0.0]]).expand(len(ids), 2).clone())


def _bigram_samples():
    return [_bigram_sample([0, 1, 2, 3], [False, False, True, True], "a"),
            _bigram_sample([3, 1, 0], [False, True, True], "b")]


def _linear_head(which: str) -> tuple:
    """An EAGLE head whose decoder layer is the identity (o_proj and down_proj zero: the residual passes x
    through) and whose fc reads only the token embedding ("embedding": h_i = E[x_{i+1}]) or only the feature
    ("feature": h_i = f_i). Returns (head, embed) with embed = 2 I."""
    from specvocab.engine.drafters.eagle import EagleHead, llama_config
    head = EagleHead(llama_config(dict(hidden_size=D, intermediate_size=8, num_attention_heads=1,
                                        num_key_value_heads=1, vocab_size=D, max_position_embeddings=64)))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()                                       # everything else random: it must not matter
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
        head.fc.bias.zero_()
        eye, zero = torch.eye(D), torch.zeros(D, D)
        head.fc.weight.copy_(torch.cat([eye, zero] if which == "embedding" else [zero, eye], 1))
    embed = torch.nn.Embedding(D, D)
    with torch.no_grad():
        embed.weight.copy_(2.0 * torch.eye(D))
    return head.float().eval(), embed


def test_make_batch_pairs_each_feature_with_the_next_token_and_the_targets_after_it():
    b = tr.make_batch(_bigram_samples(), loss_on="response")
    e = lambda *ids: (2.0 * F.one_hot(torch.tensor(ids), D)).float()             # noqa: E731
    assert b.tokens.tolist() == [1, 2, 3, 1, 0]                                   # x_{i+1}
    assert torch.equal(b.feats, e(0, 1, 2, 3, 1))                                 # f_i
    assert torch.equal(b.target, e(1, 2, 3, 1, 0))                                # f_{i+1}
    assert b.top_ids.tolist() == [[1, 2], [2, 3], [3, 0], [1, 2], [0, 1]]         # the target's top-k at i+1
    p0 = math.exp(2) / (math.exp(2) + 1)
    torch.testing.assert_close(b.top_p, torch.tensor([[p0, 1 - p0]] * 5), rtol=0, atol=1e-7)
    assert b.mask.tolist() == [False, True, True, True, True]                     # x_{i+1} is a response token
    assert tr.make_batch(_bigram_samples(), loss_on="all").mask.tolist() == [True] * 5
    assert b.positions.tolist() == [0, 1, 2, 0, 1]
    assert torch.equal(b.bias, tr._block_causal_bias([3, 2], torch.float32))


def test_head_forward_and_eagle_loss_known_answers():
    b = tr.make_batch(_bigram_samples(), loss_on="response")
    weight = torch.eye(D)                                     # the target's LM head
    kw = dict(feature_rms=1.0, noise=0.0, w_reg=1.0, w_cls=0.1, chunk=2, backward=False)
    # the right head: h_i = E[x_{i+1}] = f_{i+1}
    head, embed = _linear_head("embedding")
    with torch.no_grad():
        h = tr.head_forward(head, embed, b.tokens, b.feats, b.positions, b.bias)
    assert torch.equal(h, b.target)
    r = tr.eagle_loss(head, embed, weight, b, **kw)
    # every loss row: logits 2 e_{x_{i+1}}, target (x_{i+1}: p0, x_{i+1}+1: 1-p0) -> CE = log(e^2 + 3) - 2 p0
    p0 = math.exp(2) / (math.exp(2) + 1)
    ce = math.log(math.exp(2) + 3) - 2 * p0
    assert r["rows"] == 4 and r["reg"] == 0.0 and r["acc"] == 1.0
    assert r["cls"] == pytest.approx(ce, rel=1e-6) and r["loss"] == pytest.approx(0.1 * ce, rel=1e-6)
    # a head one position behind: h_i = f_i. Regression: |f_i - f_{i+1}| = 2 at two of the 4 coordinates,
    # SmoothL1(2) = 1.5 -> 3 / 4 per element; CE: the target's top-1 gets logit 0, x_i (p = 0) gets 2
    head, embed = _linear_head("feature")
    with torch.no_grad():
        h = tr.head_forward(head, embed, b.tokens, b.feats, b.positions, b.bias)
    assert torch.equal(h, b.feats)
    r = tr.eagle_loss(head, embed, weight, b, **kw)
    assert r["reg"] == pytest.approx(0.75, rel=1e-6) and r["acc"] == 0.0
    # rows 1..4 (x_i, x_{i+1}): (1,2), (2,3), (3,1), (1,0); the target's second token x_{i+1}+1 equals x_i
    # only for (1,0), where it gets logit 2
    z = math.log(math.exp(2) + 3)
    per_row = [z, z, z, z - 2 * (1 - p0)]
    assert r["cls"] == pytest.approx(sum(per_row) / 4, rel=1e-6)


def test_head_forward_keeps_packed_sequences_apart():
    """The packed forward of two samples equals each sample's forward alone (block-causal mask, positions
    restarting at 0 per sample), with a random head."""
    from specvocab.engine.drafters.eagle import EagleHead, llama_config
    torch.manual_seed(0)
    head = EagleHead(llama_config(dict(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=D, max_position_embeddings=64))).eval()
    embed = torch.nn.Embedding(D, 8)
    g = torch.Generator().manual_seed(1)
    samples = [data_job.Sample(prompt_id=str(n), source="teacher", input_ids=torch.randint(0, D, (n,), generator=g),
                               loss_mask=torch.ones(n, dtype=torch.bool), hidden=torch.randn(n, 8, generator=g),
                               topk_ids=torch.zeros(n, 1, dtype=torch.long), topk_logits=torch.zeros(n, 1))
               for n in (5, 3, 6)]
    with torch.no_grad():
        b = tr.make_batch(samples)
        packed = tr.head_forward(head, embed, b.tokens, b.feats, b.positions, b.bias)
        alone = []
        for s in samples:
            one = tr.make_batch([s])
            alone.append(tr.head_forward(head, embed, one.tokens, one.feats, one.positions, one.bias))
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-6)


# --- data at the corpus's scale: batched prefill, resume, features on the fly ------------------------------------

def _split_tensors(folder):
    """Every sample of a data folder as (shard, prompt id, source) -> tensors, in shard order."""
    out = {}
    for split in ("heldout", "train"):
        for path in sorted(folder.glob(f"{split}-*.safetensors")):
            for s in shard_files.load_shard(path):
                key = (path.name, s.prompt_id, s.source)
                assert key not in out
                out[key] = (s.input_ids, s.loss_mask, s.hidden, s.topk_ids, s.topk_logits,
                            *(s.extra[k] for k in sorted(s.extra)))
    return out


def test_interrupted_data_run_resumes_losing_and_duplicating_nothing(tmp_path, monkeypatch):
    """Killed during its third prefill and run again, a data run ends with exactly the shards, samples and
    features of an uninterrupted run: every prompt once, none lost (a resume that renumbers shards, reshuffles
    the prompts or keeps a half-written shard fails)."""
    cfg = dict(DATA, eagle3_features=True, feature_dtype="fp32", prefill_tokens=64)
    whole = data_job.make_data(data_job.DataConfig(**cfg, out=str(tmp_path / "whole")))
    real, calls = data_job.target_features_batch, {"n": 0}

    def dies_on_call_3(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(data_job, "target_features_batch", dies_on_call_3)
    cut = data_job.DataConfig(**cfg, out=str(tmp_path / "cut"))
    with pytest.raises(KeyboardInterrupt):
        data_job.make_data(cut)
    written = sorted(p.name for p in (tmp_path / "cut").glob("*.safetensors"))
    assert 0 < len(written) < len(list(whole.glob("*.safetensors")))       # it died between shards' writes
    monkeypatch.setattr(data_job, "target_features_batch", real)
    data_job.make_data(cut)
    a, b = _split_tensors(whole), _split_tensors(tmp_path / "cut")
    assert list(a) == list(b)
    prompts = [k[1] for k in a if k[2] == "teacher"]
    assert len(prompts) == len(set(prompts)) == DATA["num_prompts"]
    for key in a:
        for x, y in zip(a[key], b[key]):
            assert torch.equal(x, y), key


def test_prefill_groups_cover_every_sequence_once_within_the_budget():
    lengths = [5, 40, 7, 33, 12, 12, 90, 1, 64]
    groups = data_job.prefill_groups(lengths, 64)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))                     # each once
    assert [lengths[i] for i in flat] == sorted(lengths)                 # by length: little padding
    for g in groups:                                                     # count x longest within the budget,
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 64  # or one sequence alone
    assert len(groups[0]) > 1


def test_batched_features_equal_a_direct_forward_of_each_sequence():
    """The features of sequences prefilled together (right-padded to the longest) are each sequence's own: the
    last hidden state, the top-k logits and the residual stream entering EAGLE-3's three layers, as a forward of
    that sequence alone computes them (fails on left padding, or on the layer's output for its input)."""
    from specvocab.engine.drafters.eagle3 import eagle3_feature_layers
    model, _, info = load_model("random-llama", dtype="fp32")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, info.vocab_size, (n,), generator=g).tolist() for n in (9, 31, 17)]
    got = data_job.target_features_batch(model, seqs, topk=5, eagle3=True)
    layers = eagle3_feature_layers(info.num_layers)
    for q, f in zip(seqs, got):
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor([q]), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        torch.testing.assert_close(f["hidden"], hs[-1][0], rtol=1e-4, atol=1e-4)      # after the final norm
        for name, layer in zip(("hidden_low", "hidden_mid", "hidden_high"), layers):
            torch.testing.assert_close(f[name], hs[layer][0], rtol=1e-4, atol=1e-4)
        top = out.logits[0].float().topk(5, -1)
        torch.testing.assert_close(f["topk_logits"], top.values, rtol=1e-4, atol=1e-4)
        assert torch.equal(f["topk_ids"][:, 0], top.indices[:, 0])
        assert f["hidden"].shape[0] == len(q)


def test_tokens_only_folder_gets_the_stored_features_on_the_fly(tmp_path):
    """A folder written without features holds the same samples as one with them, the target's greedy
    continuations included, and `with_features` gives them the features that folder stores; a folder of one kind
    is refused as the other's resume."""
    cfg = dict(DATA, sources=("teacher", "greedy"), eagle3_features=True, feature_dtype="fp32")
    stored = data_job.make_data(data_job.DataConfig(**cfg, out=str(tmp_path / "s")))
    tokens = data_job.make_data(data_job.DataConfig(**cfg, store_features=False, out=str(tmp_path / "t")))
    assert sum(p.stat().st_size for p in tokens.glob("*.safetensors")) * 10 < \
        sum(p.stat().st_size for p in stored.glob("*.safetensors"))
    a, b = shard_files.load_split(stored, "train"), shard_files.load_split(tokens, "train")
    assert all(s.hidden is None and not s.extra for s in b) and {s.source for s in b} == {"teacher", "greedy"}
    model, _, _ = load_model("random-llama", dtype="fp32")
    filled = data_job.with_features(model, b, topk=DATA["topk"], eagle3=True, prefill_tokens=100)
    for x, y in zip(a, filled):
        assert (x.prompt_id, x.source) == (y.prompt_id, y.source) and torch.equal(x.input_ids, y.input_ids)
        for name in ("hidden", "topk_logits"):
            torch.testing.assert_close(getattr(y, name), getattr(x, name), rtol=1e-4, atol=1e-4)
        assert torch.equal(y.topk_ids[:, 0], x.topk_ids[:, 0])
        for k in x.extra:
            torch.testing.assert_close(y.extra[k], x.extra[k], rtol=1e-4, atol=1e-4)
    with pytest.raises(data_job.TrainError, match="other settings"):
        data_job.make_data(data_job.DataConfig(**cfg, store_features=False, out=str(tmp_path / "s")))


def test_features_for_a_response_loss_run_the_lm_head_on_the_response_only(tmp_path, monkeypatch):
    """`response_topk_only` (a run whose loss is on the response): the top-k at the response's positions equal
    the full computation's, the prompt's are zeros, every other feature is unchanged, and the target's LM head
    sees the response's rows only (the point: it is most of a large vocabulary's prefill)."""
    cfg = dict(DATA, eagle3_features=True, feature_dtype="fp32", store_features=False)
    samples = shard_files.load_split(data_job.make_data(data_job.DataConfig(**cfg, out=str(tmp_path / "t"))), "train")
    model, _, _ = load_model("random-llama", dtype="fp32")
    full = data_job.with_features(model, samples, topk=DATA["topk"], eagle3=True)
    seen = []
    real = data_job.lm_logits
    monkeypatch.setattr(data_job, "lm_logits", lambda m, h: seen.append(h.shape[0]) or real(m, h))
    part = data_job.with_features(model, samples, topk=DATA["topk"], eagle3=True, response_topk_only=True)
    assert sum(seen) == sum(int(s.loss_mask.sum()) for s in samples) < sum(s.input_ids.numel() for s in samples)
    for x, y in zip(full, part):
        m = x.loss_mask
        torch.testing.assert_close(y.topk_logits[m], x.topk_logits[m], rtol=1e-5, atol=1e-5)   # another M: any
        assert torch.equal(y.topk_ids[m][:, 0], x.topk_ids[m][:, 0])                          # CPU's GEMM order
        assert not y.topk_ids[~m].any() and not y.topk_logits[~m].any()
        assert torch.equal(y.hidden, x.hidden) and all(torch.equal(y.extra[k], x.extra[k]) for k in x.extra)


def test_a_damaged_shard_is_named(tmp_path):
    """A shard whose offsets disagree with its tensors, or that is not a shard, raises naming that file."""
    from safetensors.torch import load_file, save_file
    out = data_job.make_data(data_job.DataConfig(**DATA, out=str(tmp_path / "d")))
    path = sorted(out.glob("train-*.safetensors"))[0]
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    t["offsets"] = t["offsets"].clone()
    t["offsets"][-1] -= 1                                                # an edited shard
    save_file(t, str(path), metadata=meta)
    with pytest.raises(data_job.TrainError, match=f"{path.name}.*offsets and tensor lengths disagree"):
        shard_files.load_split(out, "train")
    save_file({"x": torch.zeros(2)}, str(path))                          # another safetensors file
    with pytest.raises(data_job.TrainError, match=f"{path.name} is not a specvocab training shard"):
        shard_files.load_split(out, "train")
