"""Drafters with an LM head (`layerskip`, `eagle`) and their shared EAGLE-2 tree expansion.

- `expand_tree` against a plain recursive reference (tokens, parents, scores, the rows it runs);
- lossless greedy decoding (output == ar, token for token) for both drafters x every vocab policy on
  tiny random models of all three architectures;
- layerskip with every layer kept is the target itself: the draft distribution at every tree node equals
  the target's (Gemma's sliding windows, embedding scale, KV compaction over several steps);
- eagle against a cache-free sequential reference of the same head (positions, target features,
  tree features), a head built to mimic a one-layer target (high acceptance), checkpoint loading in the
  official layout, and the error messages.
"""

import json

import numpy as np
import pytest
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.eagle import EagleDrafter, EagleHead, load_eagle_head, random_eagle_head
from specvocab.engine.drafters.layerskip import LayerSkipDrafter, parse_layers
from specvocab.engine.drafters.lmhead import DrafterError, PhaseTimer, expand_tree
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model
from tests.engine_testing import VOCAB_VARIANTS, assert_lossless_under_every_policy, drive_steps

ARCHS = ("random-llama", "random-gemma3", "random-qwen3")
V = 384


# --- expand_tree vs a plain reference -----------------------------------------------------------------------

class ToyModel:
    """h_child = tanh(A h_parent + E[token]); logits = W h (+ a slot mask). Records what the tree forward ran."""

    def __init__(self, vocab=40, d=8, seed=0, live=None):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5
        self.E = torch.randn(vocab, d, generator=g, dtype=torch.float64)
        self.W = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 2
        self.live = live                         # None or [vocab] bool: slots outside are -inf
        self.rows_h, self.rows_parent_h = [], []

    def step(self, parent_h, tokens):
        return torch.tanh(parent_h @ self.A.T + self.E[tokens])

    def logp(self, h):
        logits = h @ self.W.T
        if self.live is not None:
            logits = logits.masked_fill(~self.live, float("-inf"))
        return torch.log_softmax(logits, -1)

    # the callables expand_tree takes
    def forward(self, tokens, parent_h, tree_mask, depth):
        T = len(self.rows_h)
        assert tree_mask.shape == (tokens.numel(), T + tokens.numel())
        for i in range(tokens.numel()):
            anc = tree_mask[i, :T].nonzero().flatten().tolist()
            assert tree_mask[i, T:].tolist() == [j == i for j in range(tokens.numel())]
            if depth == 1:
                assert anc == []
            else:                                 # the deepest ancestor row is the parent: its h is parent_h
                assert len(anc) == depth - 1 and torch.equal(self.rows_h[anc[-1]], parent_h[i])
                assert tree_mask[i, :T].tolist() == [j in anc for j in range(T)]
        h = self.step(parent_h, tokens)
        self.rows_h.extend(h)
        return h

    def head(self, h, k):
        logp = self.logp(h)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return top.values, top.indices


def reference_tree(toy, h_root, root, depth, topk, total):
    """EAGLE-2 written out with Python lists: nodes = (token, parent node or -1, cumulative log-prob, h)."""
    nodes = []
    lp = toy.logp(h_root[0])
    for t in sorted(range(lp.numel()), key=lambda t: -lp[t])[:topk]:
        nodes.append((t, -1, float(lp[t]), h_root[0]))
    frontier = list(range(len(nodes)))
    for _ in range(1, depth):
        cands = []
        for f in frontier:
            tok, _, s, hp = nodes[f]
            h = toy.step(hp, torch.tensor(tok))
            lp = toy.logp(h)
            for t in sorted(range(lp.numel()), key=lambda t: -lp[t])[:topk]:
                cands.append((t, f, s + float(lp[t]), h))
        base = len(nodes)
        nodes.extend(cands)
        order = sorted(range(len(cands)), key=lambda i: (-cands[i][2], i))
        frontier = [base + i for i in order[:topk]]
    keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], i))[: total - 1])
    keep = [i for i in keep if nodes[i][2] > float("-inf")]
    new = {old: j + 1 for j, old in enumerate(keep)}
    tokens = [root] + [nodes[i][0] for i in keep]
    parents = [-1] + [0 if nodes[i][1] < 0 else new[nodes[i][1]] for i in keep]
    scores = [1.0] + [float(np.exp(nodes[i][2])) for i in keep]
    return tokens, parents, scores


@pytest.mark.parametrize("depth,topk,total,live", [(5, 10, 60, None), (4, 3, 12, None), (1, 4, 60, None),
                                                   (3, 5, 400, None), (4, 6, 30, 4), (3, 10, 60, 1)])
def test_expand_tree_matches_the_reference(depth, topk, total, live):
    mask = None
    if live is not None:                     # fewer live slots than top-k: -inf candidates are dropped
        mask = torch.zeros(40, dtype=torch.bool)
        mask[torch.randperm(40, generator=torch.Generator().manual_seed(1))[:live]] = True
    toy = ToyModel(live=mask)
    h_root = torch.randn(1, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exp = expand_tree(7, h_root, toy.forward, toy.head, depth=depth, topk=topk, total_tokens=total,
                      timer=PhaseTimer())
    tokens, parents, scores = reference_tree(toy, h_root, 7, depth, topk, total)
    assert exp.tree.tokens.tolist() == tokens
    assert exp.tree.parents.tolist() == parents
    np.testing.assert_allclose(exp.tree.scores.numpy(), scores, rtol=1e-5)
    n_run = min(topk, 40)                     # -inf candidates still fill the frontier (edge case A7)
    assert exp.num_tree_rows == len(toy.rows_h) == (depth - 1) * n_run
    assert exp.tried_tokens.numel() == n_run + (depth - 1) * n_run * n_run
    # tree_row names the forward row that ran a node: its h is the node's own h
    for i, row in enumerate(exp.tree_row.tolist()):
        if row >= 0:
            path = exp.tree.path_to(i)
            h = h_root[0]
            for node in path[1:]:
                h = toy.step(h, exp.tree.tokens[node])
            torch.testing.assert_close(toy.rows_h[row], h)
    if live is None:
        assert exp.tree.size == min(total, 1 + exp.tried_tokens.numel())
    d = exp.tree.depths()
    assert bool((d[1:] >= d[:-1]).all())     # BFS order
    assert int(d.max()) <= depth


@pytest.mark.parametrize("seed", range(12))
def test_pruned_expansion_drafts_the_same_tree_with_fewer_rows(seed):
    """`prune=True` (what drafters run unless MicroSpec's all_expanded source needs every candidate): the same
    tree as EAGLE-2's full expansion - tokens, parents, scores - for trees smaller than the expansion, and
    only min(topk, g) rows per level over min(depth, g) levels."""
    rng = np.random.default_rng(seed)
    depth, topk, total = int(rng.integers(2, 7)), int(rng.integers(2, 11)), int(rng.integers(2, 12))
    live = None
    if seed % 3 == 0:                        # few live slots: -inf candidates in the frontier
        live = torch.zeros(40, dtype=torch.bool)
        live[torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:int(rng.integers(1, 6))]] = True
    toy = ToyModel(seed=seed, live=live)
    toy.W *= (0.25, 1.0, 10.0)[seed % 3]       # broad trees, EAGLE-like ones, near-chains: each pruning matters
    h_root = torch.randn(1, 8, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    full = expand_tree(7, h_root, toy.forward, toy.head, depth=depth, topk=topk, total_tokens=total)
    toy.rows_h.clear()
    pruned = expand_tree(7, h_root, toy.forward, toy.head, depth=depth, topk=topk, total_tokens=total, prune=True)
    assert pruned.tree.tokens.tolist() == full.tree.tokens.tolist(), (depth, topk, total)
    assert pruned.tree.parents.tolist() == full.tree.parents.tolist()
    torch.testing.assert_close(pruned.tree.scores, full.tree.scores)
    g = total - 1
    assert pruned.num_tree_rows == (min(depth, g) - 1) * min(topk, g, 40)
    for i, row in enumerate(pruned.tree_row.tolist()):       # rows still name the forward that ran a node
        if row >= 0:
            h = h_root[0]
            for node in pruned.tree.path_to(i)[1:]:
                h = toy.step(h, pruned.tree.tokens[node])
            torch.testing.assert_close(toy.rows_h[row], h)


def test_pruning_one_short_of_the_tree_changes_it():
    """The power of the test above: one frontier node too few per level (broad trees) or one level too few
    (near-chains) loses final nodes."""
    def tokens(toy, h_root, depth, topk):
        toy.rows_h.clear()
        exp = expand_tree(7, h_root, toy.forward, toy.head, depth=depth, topk=topk, total_tokens=7)
        return exp.tree.tokens.tolist()
    narrow = deep = 0
    for seed in range(12):
        h_root = torch.randn(1, 8, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
        broad = ToyModel(seed=seed)
        broad.W *= 0.25
        narrow += tokens(broad, h_root, 4, 10) != tokens(broad, h_root, 4, 5)         # g = 6, topk g - 1
        chain = ToyModel(seed=seed)
        chain.W *= 10.0
        deep += tokens(chain, h_root, 6, 10) != tokens(chain, h_root, 5, 10)          # depth g - 1
    assert narrow > 0 and deep > 0, (narrow, deep)


# --- layer specs ------------------------------------------------------------------------------------------

def test_parse_layers_forms():
    assert parse_layers("skip:1,3", 5) == [0, 2, 4]
    assert parse_layers("first:2", 5) == [0, 1]
    assert parse_layers("every:2", 5) == [0, 2, 4]
    assert parse_layers("keep:4,0", 5) == [0, 4]
    assert parse_layers("all", 3) == [0, 1, 2]


@pytest.mark.parametrize("spec,needle", [("skip:9", "layers 0..4"), ("first:0", "1 <= n <= 5"),
                                         ("every:0", "s >= 1"), ("skip:0,1,2,3,4", "keeps no layer"),
                                         ("middle:2", "not understood"), ("skip:a", "integers")])
def test_parse_layers_errors(spec, needle):
    with pytest.raises(DrafterError, match=needle):
        parse_layers(spec, 5)


# --- lossless decoding on tiny random models ------------------------------------------------------------------

@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    model, _, info = load_model(request.param, vocab_size=V, hidden_size=48, num_layers=4, seed=5)
    ranking = tmp_path_factory.mktemp("freq") / "ranking.npy"
    np.save(ranking, np.random.default_rng(0).permutation(V))
    ar = {}                                   # prompt seed -> the autoregressive output, computed once
    return model, info, ranking, ar


def _prompt(seed, n=40):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, V, n // 3)
    return torch.tensor(np.concatenate([base, rng.integers(0, V, n - 2 * base.size), base]))


def _ar(tiny, seed, T=20):
    model, _, _, ar = tiny
    if (seed, T) not in ar:
        ar[seed, T] = generate(model, _prompt(seed), method="ar", max_new_tokens=T, eos_ids=[]).output_ids.tolist()
    return ar[seed, T]


@pytest.mark.parametrize("method", ["layerskip", "eagle"])
def test_layerskip_and_eagle_are_lossless_under_every_policy(tiny, method):
    """Every vocabulary policy (and FR-Spec-PA, DynaSpec App. A.1) decodes ar's tokens; each drafted step
    timed its backbone, LM head and tree, MicroSpec its gather, the oracle its uncharged full head."""
    model, info, ranking, _ = tiny
    extra = dict(drafter_layers="skip:1") if method == "layerskip" else dict(eagle_head="random")

    def timed(variant, out):
        t = out.drafter_timings
        assert t["backbone"] > 0 and t["lm_head"] > 0 and t["tree"] > 0
        if variant["vocab"] == "microspec":
            assert t["gather"] > 0
        if variant["vocab"] == "oracle":
            assert t["oracle_uncharged"] > 0
    variants = (*VOCAB_VARIANTS, dict(vocab="frspec", frspec_k=96, frspec_budget="position"))    # FR-Spec-PA
    assert_lossless_under_every_policy(model, _prompt, lambda i: _ar(tiny, i), variants=variants, check=timed,
                                       method=dict(method=method, frequency_file=str(ranking), **extra))


def test_the_policys_pass_over_the_prompt_is_draft_prefill_not_gather(tiny, monkeypatch):
    """MicroSpec's first window (its `begin`, timed as gather) is moved to draft_prefill, so gather is the
    steps' own (MicroSpec Fig. 4 per drafted step). The policy's begin is slowed by 50 ms here."""
    import time
    from specvocab.engine.vocab.microspec import MicroSpecVocab
    model, info, _, _ = tiny
    original = MicroSpecVocab.begin_ids

    def slow_begin(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with self.timer.phase("gather"):
            time.sleep(0.05)
    monkeypatch.setattr(MicroSpecVocab, "begin_ids", slow_begin)
    out = generate(model, _prompt(0), method="layerskip", drafter_layers="skip:1", vocab="microspec", w_max=48,
                   max_new_tokens=12, eos_ids=[], draft_size=4)
    t = out.drafter_timings
    assert t["draft_prefill"] >= 0.05 and 0 < t["gather"] < 0.05
    assert out.begin_s >= t["draft_prefill"]


def test_layerskip_drafts_tokens_the_target_accepts(tiny):
    model, info, _, _ = tiny
    out = generate(model, _prompt(0), method="layerskip", drafter_layers="skip:2", max_new_tokens=20, eos_ids=[])
    assert out.output_ids.tolist() == _ar(tiny, 0)
    assert out.tau > 1.5
    assert isinstance(make_drafter(model, SpecConfig.preset("layerskip", drafter_layers="first:2", draft_size=8)),
                      LayerSkipDrafter)
    assert isinstance(make_drafter(model, SpecConfig.preset("eagle", eagle_head="random", draft_size=8)),
                      EagleDrafter)


def test_oracle_proposes_what_full_proposes(tiny):
    model, info, _, _ = tiny
    prompt = _prompt(8)
    full = generate(model, prompt, method="layerskip", vocab="full", max_new_tokens=16, eos_ids=[], record=True,
                    drafter_layers="skip:1", eagle_depth=4, draft_size=19)
    drafter = make_drafter(model, SpecConfig.preset("layerskip", vocab="oracle", w_max=16, drafter_layers="skip:1",
                                                    eagle_depth=4, draft_size=19))
    oracle = generate(model, prompt, method="layerskip", max_new_tokens=16, eos_ids=[], record=True,
                      drafter=drafter)
    assert [r.tree_tokens for r in oracle.records] == [r.tree_tokens for r in full.records]
    assert oracle.steps == full.steps
    stats = drafter.stats()
    assert stats["mean_active_vocab"] == stats["max_active_vocab"] == 16


# --- drive a drafter step by step through the harness's pieces ------------------------------------------------

def _child_logp(tree):
    """log p(child | parent's path) of every non-root node, from the tree's cumulative scores."""
    p = tree.parents
    return (tree.scores[1:].double() / tree.scores[p[1:]].double()).log()


@pytest.mark.parametrize("arch", ARCHS)
def test_layerskip_with_every_layer_is_the_target(arch):
    model, _, _ = load_model(arch, vocab_size=V, hidden_size=48, num_layers=3, seed=11)
    drafter = make_drafter(model, SpecConfig.preset("layerskip", drafter_layers="all", draft_size=59))
    accepted_total = 0
    for ids, tree, lg in drive_steps(model, drafter, _prompt(3, n=37), steps=4):   # 37 > Gemma's window of 16
        target = torch.log_softmax(lg.double(), -1)[tree.parents[1:], tree.tokens[1:]]
        torch.testing.assert_close(_child_logp(tree), target, atol=2e-4, rtol=0)
        accepted_total += 1
    assert accepted_total == 4
    assert drafter.n_ctx > 37                 # accepted tree rows were compacted into the context


# --- eagle ----------------------------------------------------------------------------------------------------

def _eagle_reference_logp(drafter, model, ids, path_tokens):
    """log-softmax of the head at the end of `path_tokens`, computed from scratch without a cache:
    pairs (target feature f_i, x_{i+1}) over the committed ids, then (head output, token) along the path."""
    head = drafter.eagle
    with torch.inference_mode():
        feats = model.model(input_ids=ids[None]).last_hidden_state[0]          # [N, d]
        f, toks = feats[:-1], ids[1:]
        out = None
        for t in [None] + list(path_tokens):
            if t is not None:
                f = torch.cat([f, out[-1:]])
                toks = torch.cat([toks, torch.tensor([int(t)])])
            x = head.fc(torch.cat([drafter.embed(toks), f], -1))[None]
            n = x.shape[1]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
            out = head.layers[0](x, attention_mask=mask, position_ids=pos,
                                 position_embeddings=head.rotary_emb(x, pos))
            out = (out[0] if isinstance(out, tuple) else out)[0]
        return torch.log_softmax((out[-1] @ drafter.head_weight.T).double(), -1)


@pytest.mark.parametrize("arch", ["random-llama", "random-gemma3"])
def test_eagle_matches_a_cache_free_reference(arch):
    model, _, _ = load_model(arch, vocab_size=V, hidden_size=48, num_layers=2, seed=4)
    drafter = EagleDrafter(model, SpecConfig.preset("eagle", eagle_head="random", eagle_depth=3,
                                                    draft_size=11))
    with torch.no_grad():                     # a sharper head, so that scores are far from uniform
        drafter.eagle.fc.weight.mul_(20)
    for ids, tree, _ in drive_steps(model, drafter, _prompt(5, n=20), steps=3):
        children = tree.children()
        for node in range(tree.size):
            if not children[node]:
                continue
            path = [int(tree.tokens[i]) for i in tree.path_to(node)[1:]]
            ref = _eagle_reference_logp(drafter, model, ids, path)
            got = _child_logp(tree)[[c - 1 for c in children[node]]]
            torch.testing.assert_close(got, ref[tree.tokens[children[node]]], atol=2e-4, rtol=0)


def _mimic_head(model):
    """An EAGLE head that reproduces a one-layer Llama target up to its final norm: fc passes the token
    embedding through, the decoder layer is the target's (the target's embeddings have unit RMS, so its
    input norm is the identity)."""
    t = model.model
    with torch.no_grad():
        e = t.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    head = random_eagle_head(model)
    d = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :d] = torch.eye(d)
        head.fc.bias.zero_()
        src = t.layers[0].state_dict()
        head.layers[0].load_state_dict({k: v for k, v in src.items() if not k.startswith("input_layernorm")})
    return head


def test_eagle_mimicking_the_target_gets_drafts_accepted():
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=1, seed=6)
    head = _mimic_head(model)
    cfg = SpecConfig.preset("eagle", eagle_head="random", max_new_tokens=30, draft_size=59)
    prompt = _prompt(9)
    ar = generate(model, prompt, method="ar", max_new_tokens=30, eos_ids=[])
    for vocab in ("full", "microspec"):
        out = generate(model, prompt, cfg.replace(vocab=vocab, w_max=64), drafter=EagleDrafter(model, cfg.replace(
            vocab=vocab, w_max=64), head=head), eos_ids=[])
        assert out.output_ids.tolist() == ar.output_ids.tolist()
        assert out.tau > 2.5, vocab


def test_eagle_checkpoint_round_trip(tmp_path):
    model, _, _ = load_model("random-qwen3", vocab_size=V, hidden_size=48, num_layers=2, seed=2)
    head = random_eagle_head(model, seed=3)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    torch.save(state, tmp_path / "pytorch_model.bin")
    c = head.config
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, num_hidden_layers=1,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"], vocab_size=V,
        max_position_embeddings=c.max_position_embeddings, hidden_act="silu", bias=True)))
    loaded = load_eagle_head(str(tmp_path))
    assert loaded.embed_tokens is not None
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    prompt = _prompt(4)
    a = generate(model, prompt, method="eagle", eagle_head="random", seed=3, max_new_tokens=12, eos_ids=[],
                 record=True)
    b = generate(model, prompt, method="eagle", eagle_head=str(tmp_path), max_new_tokens=12, eos_ids=[],
                 record=True)
    assert [r.tree_tokens for r in a.records] == [r.tree_tokens for r in b.records]
    # a key the layout does not have
    torch.save({**state, "layers.0.input_layernorm.weight": torch.ones(48)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(DrafterError, match="unexpected.*input_layernorm"):
        load_eagle_head(str(tmp_path))
    torch.save({**state, "midlayer.fc.weight": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(DrafterError, match="EAGLE-3"):
        load_eagle_head(str(tmp_path))


def test_eagle_errors_name_the_fix(tmp_path):
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=48, num_layers=2)
    with pytest.raises(DrafterError, match="eagle_head="):
        make_drafter(model, SpecConfig.preset("eagle", draft_size=8))
    with pytest.raises(DrafterError, match="local directory"):
        make_drafter(model, SpecConfig.preset("eagle", eagle_head=str(tmp_path / "nowhere"), draft_size=8))
    other, _, _ = load_model("random-llama", vocab_size=V, hidden_size=64, num_layers=2)
    cfg = SpecConfig.preset("eagle", eagle_head="random", draft_size=8)
    with pytest.raises(DrafterError, match="hidden size 64 but the target's is 48"):
        EagleDrafter(model, cfg, head=random_eagle_head(other))
    bigger, _, _ = load_model("random-llama", vocab_size=V + 1, hidden_size=48, num_layers=2)
    with pytest.raises(DrafterError, match=r"vocabulary \(385\) differs from the target's \(384\)"):
        EagleDrafter(model, cfg, head=random_eagle_head(bigger))
    assert isinstance(random_eagle_head(model), EagleHead)


def test_sampling_mode_keeps_the_target_distribution():
    """Temperature 1: the drafter's deterministic top-k children (one-hot q) under engine.verify's sampling
    acceptance; the second generated token (the first one a draft tree decides) follows the target's
    marginal P(t2) = sum_t1 P(t1) P(t2 | t1): total variation within sampling noise (~0.09 for 300 draws;
    accepting drafts regardless of the target would put most mass on the drafted token, TV > 0.5)."""
    vocab = 16
    model, _, _ = load_model("random-llama", vocab_size=vocab, hidden_size=32, num_layers=2, seed=8)
    with torch.no_grad():                    # a flat target, so that t2 really is random
        model.get_input_embeddings().weight.mul_(0.3)
    prompt = torch.tensor([3, 1, 4, 9])
    with torch.inference_mode():
        p1 = torch.softmax(model(prompt[None]).logits[0, -1].double(), -1)                     # [V]
        seqs = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = (p1[:, None] * torch.softmax(model(seqs).logits[:, -1].double(), -1)).sum(0)     # [V]
    cfg = SpecConfig.preset("layerskip", drafter_layers="skip:1", temperature=1.0, max_new_tokens=2,
                            eagle_depth=2, eagle_topk=4, draft_size=7)
    n = 300
    counts = torch.zeros(vocab, dtype=torch.float64)
    for seed in range(n):
        counts[generate(model, prompt, cfg.replace(seed=seed), eos_ids=[]).output_ids[1]] += 1
    tv = 0.5 * float((counts / n - p2).abs().sum())
    assert tv < 0.18, tv
