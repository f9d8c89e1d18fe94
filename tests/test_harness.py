"""The harness on tiny random models of all three archs: every method reproduces plain greedy decoding token
for token; self-speculation accepts every draft token; stops, records, errors; sampling keeps the target's
distribution over whole generations."""

import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specvocab.engine import ContextError, GenerateResult, HarnessError, SpecConfig, generate, harness, vocab
from specvocab.engine.calibration import FALLBACK_DRAFT_SIZE, model_key, save_calibration
from specvocab.engine.config import LITERAL_FIELDS, METHODS, POLICIES, ConfigError
from specvocab.engine.drafters.recycling import template_size
from specvocab.engine.harness import resolve_config
from specvocab.engine.drafters import UnknownMethodError, make_drafter
from specvocab.engine.models import load_model
from specvocab.engine.tree import DraftTree, Drafter
from specvocab.engine.verify import warp_probs
from specvocab.kernels import cpu
from specvocab.locality.trace import read_traces, write_traces
from tests.engine_testing import ARCHS, OracleTreeDrafter, SelfDrafter, naive_greedy, untie_head
from tests.sampling_stats import assert_fits, assert_rejects

VOCAB = 512
T = 24


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    # Gemma 3: 6 layers = 5 sliding-window (W = 16) + 1 global, so prompts run past the window
    model, _, info = load_model(request.param, vocab_size=VOCAB, num_layers=6 if "gemma" in request.param else 3,
                                seed=1)
    return untie_head(model), info


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts of 8-40 tokens, some with a repeated span so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, VOCAB, int(rng.integers(8, 30))).tolist()
        if i % 2:
            p = p + p[:int(rng.integers(3, 10))]
        out.append(p)
    return out


@pytest.fixture(scope="module")
def references(target):
    model, _ = target
    prompts = _prompts(4, seed=7)
    return [(p, naive_greedy(model, p, T)) for p in prompts]


@pytest.mark.parametrize("method", ["ar", "pld", "hf-prompt-lookup"])
def test_methods_equal_plain_greedy(target, references, method):
    model, info = target
    for prompt, ref in references:
        res = generate(model, prompt, method=method, info=info, max_new_tokens=T, eos_ids=[])
        assert res.output_ids.tolist() == ref
        assert res.new_tokens == T and res.stop_reason == "max_new_tokens"
        if method == "ar":
            assert res.steps == T and res.tau == 1.0 and res.draft_tokens == 0


def test_random_trees_with_correct_branches_equal_plain_greedy(target, references):
    model, info = target
    total_accepted = 0
    for seed, (prompt, ref) in enumerate(references):
        drafter = OracleTreeDrafter(model, SpecConfig(), prompt + ref, VOCAB, seed=seed)
        res = generate(model, prompt, info=info, drafter=drafter, max_new_tokens=T, eos_ids=[], record=True)
        assert res.output_ids.tolist() == ref
        total_accepted += sum(len(r.accepted) - 1 for r in res.records)
    assert total_accepted > 0                                    # the trees did carry correct tokens


@pytest.mark.parametrize("decoy", [False, True])
def test_self_speculation_accepts_every_draft_token(target, references, decoy):
    model, info = target
    for prompt, ref in references[:2]:
        drafter = SelfDrafter(model, SpecConfig(), num_draft=4, decoy=decoy)
        res = generate(model, prompt, info=info, drafter=drafter, max_new_tokens=T, eos_ids=[], record=True)
        assert res.output_ids.tolist() == ref
        for r in res.records:
            if decoy:
                assert r.accepted == [0] + list(range(2, len(r.tree_tokens)))
            else:
                assert r.accepted == list(range(len(r.tree_tokens)))
        # 1 token from the prefill, then 5 per step (4 draft + bonus), the last step cut to fit
        assert res.steps == 1 + -(-(T - 1) // 5)


def test_max_new_tokens_cuts_the_last_step_exactly(target, references):
    model, info = target
    prompt, ref = references[1]
    for t in (1, 2, 7):
        res = generate(model, prompt, info=info, drafter=SelfDrafter(model, SpecConfig(), num_draft=4),
                       max_new_tokens=t, eos_ids=[])
        assert res.output_ids.tolist() == ref[:t]


@pytest.mark.parametrize("method", ["ar", "pld", "hf-prompt-lookup", "tree"])
def test_stop_at_eos_keeps_the_eos_token(target, references, method):
    model, info = target
    prompt, ref = next((p, r) for p, r in references if len(set(r)) > 1)
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])   # first occurrence of a new token
    kwargs = dict(info=info, max_new_tokens=T, eos_ids=[ref[k]])
    if method == "tree":
        res = generate(model, prompt, drafter=OracleTreeDrafter(model, SpecConfig(), prompt + ref, VOCAB), **kwargs)
    else:
        res = generate(model, prompt, method=method, **kwargs)
    assert res.output_ids.tolist() == ref[:k + 1]
    assert res.stop_reason == "eos"


def test_record_builds_a_trace(target, references, tmp_path):
    model, info = target
    prompt, ref = references[1]
    res = generate(model, prompt, method="pld", info=info, max_new_tokens=T, eos_ids=[], record=True, record_topk=5)
    trace = res.to_trace({"prompt_id": "p1", "model": info.name})
    assert trace.generated.tolist() == ref
    assert trace.step_topk.shape == (T, 5) and trace.prefill_topk.shape == (len(prompt) - 1, 5)
    assert trace.step_topk[:, 0].tolist() == ref                 # greedy: top-1 of each row is the token
    with torch.inference_mode():
        plain = model(torch.tensor([prompt])).logits[0].topk(5).indices
    assert trace.prefill_topk.tolist() == plain[:-1].tolist()
    assert len(trace.draft_tokens) == res.steps and len(trace.draft_tokens[0]) == 0
    assert [len(d) for d in trace.draft_tokens[1:]] == [len(r.tree_tokens) - 1 for r in res.records]
    back = read_traces(write_traces([trace], tmp_path / "t.parquet"))[0]
    assert back.generated.tolist() == ref and back.meta["method"] == "pld"
    with pytest.raises(HarnessError, match="record=True"):
        generate(model, prompt, method="ar", info=info, max_new_tokens=3).to_trace()


class _WrongRoot(Drafter):
    def propose(self, ids):
        return DraftTree.chain(int(ids[-1]) + 1, [1, 2])


class _BigTree(Drafter):
    def propose(self, ids):
        return DraftTree.chain(int(ids[-1]), list(range(60)))


def test_errors_are_clear(target):
    model, info = target
    small = load_model(info.name, vocab_size=VOCAB, num_layers=1, max_context=64)
    untie_head(small[0])
    with pytest.raises(ContextError, match="exceeds the model's context"):
        generate(small[0], list(range(50)), info=small[2], max_new_tokens=20)
    with pytest.raises(ContextError, match="draft tree of 61 nodes"):
        generate(small[0], list(range(10)), info=small[2], max_new_tokens=20, drafter=_BigTree(small[0], None))
    with pytest.raises(ContextError, match="empty"):
        generate(model, [], info=info)
    with pytest.raises(ConfigError, match="choose one of"):
        generate(model, [1, 2, 3], method="nope")
    with pytest.raises(UnknownMethodError, match="no drafter yet.*available.*register_drafter"):
        make_drafter(model, SimpleNamespace(method="not-written-yet"))   # a method nobody wrote yet
    with pytest.raises(ConfigError, match="temperature"):
        generate(model, [1, 2, 3], temperature=-1.0)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, [1, 2, 3], temperature=1.0, top_p=1.5)
    with pytest.raises(HarnessError, match="root must be the last committed token"):
        generate(model, [1, 2, 3], info=info, max_new_tokens=4, drafter=_WrongRoot(model, None))
    with pytest.raises(HarnessError, match="greedy only"):
        generate(model, [1, 2, 3], method="hf-prompt-lookup", temperature=1.0)


def test_result_fields(target, references):
    model, info = target
    prompt, _ = references[0]
    res = generate(model, prompt, method="pld", info=info, max_new_tokens=T, eos_ids=[])
    assert isinstance(res, GenerateResult) and res.method == "pld"
    assert res.prompt_ids.tolist() == prompt
    assert res.tau == res.new_tokens / res.steps
    assert res.wall_s >= res.prefill_s + res.verify_s


# --- sampling ----------------------------------------------------------------------------------------------

def test_sampling_is_reproducible_per_seed(target, references):
    model, info = target
    prompt, _ = references[1]
    for method in ("ar", "pld"):
        a = generate(model, prompt, method=method, info=info, max_new_tokens=12, temperature=1.5, seed=3, eos_ids=[])
        b = generate(model, prompt, method=method, info=info, max_new_tokens=12, temperature=1.5, seed=3, eos_ids=[])
        assert a.output_ids.tolist() == b.output_ids.tolist()
    outs = {tuple(generate(model, prompt, method="ar", info=info, max_new_tokens=12, temperature=1.5, seed=s,
                           eos_ids=[]).output_ids.tolist()) for s in range(6)}
    assert len(outs) > 1


@pytest.fixture(scope="module")
def tiny_target():
    model, _, info = load_model("random-gemma3", vocab_size=8, hidden_size=32, num_layers=2, seed=5)
    return untie_head(model, scale=2.0), info


def _exact_joint_probs(model, prompt, length: int, temperature: float, top_p: float) -> np.ndarray:
    """[V ** length] float64: the target's exact joint distribution of its next `length` sampled tokens
    (cell index = the tokens in base V, first most significant), from cache-free forwards of every prefix."""
    v = model.config.vocab_size
    joint = np.ones(1)
    with torch.inference_mode():
        for depth in range(length):
            prefixes = [prompt + [(c // v ** j) % v for j in reversed(range(depth))] for c in range(v ** depth)]
            p = warp_probs(model(torch.tensor(prefixes)).logits[:, -1], temperature, top_p).double().numpy()
            joint = (joint[:, None] * p / p.sum(-1, keepdims=True)).reshape(-1)      # [v ** (depth + 1)]
    return joint


class _TargetDrafter(Drafter):
    """Draft trees that depend on the target, so that the rejections that happen hit likely tokens. "top":
    the root's children are the target's 2 most likely next tokens (most likely first), the first child's
    children its 2 most likely after it. "sampled": 3 children of the root and 2 of the first child drawn
    i.i.d. from q, a draft model's distribution: the target's logits at 3x the temperature plus a fixed
    error per token (about half the drafts are accepted). The target's rows come from cache-free forwards,
    memoised in `memo` across runs. The drafter's generator must not share the harness's seed: draws
    coupled with the verifier's uniforms are not independent drafts."""

    name = "test-target"

    def __init__(self, target, cfg, mode: str, memo: dict, seed: int):
        super().__init__(target, cfg)
        self.mode, self.memo = mode, memo
        self.gen = torch.Generator().manual_seed(seed)
        v = target.config.vocab_size
        self.error = torch.randn(v, v, generator=torch.Generator().manual_seed(7))   # [V, V] fixed

    def _children(self, ctx: list[int], width: int):
        if tuple(ctx) not in self.memo:
            self.memo[tuple(ctx)] = self.target(torch.tensor([ctx])).logits[0, -1].float()
        z = self.memo[tuple(ctx)]                                                     # [V]
        if self.mode == "top":
            p = warp_probs(z, self.cfg.temperature, self.cfg.top_p)
            kids = p.topk(width).indices
            return kids.tolist(), p[kids], None
        q = torch.softmax(z / (3 * self.cfg.temperature) + 1.5 * self.error[ctx[-1]], -1)
        kids = torch.multinomial(q, width, replacement=True, generator=self.gen)
        return kids.tolist(), q[kids], q

    def propose(self, ids):
        ctx = ids.tolist()
        kids, s1, q0 = self._children(ctx, 2 if self.mode == "top" else 3)
        grand, s2, q1 = self._children(ctx + [kids[0]], 2)
        tokens = [ctx[-1]] + kids + grand
        parents = [-1] + [0] * len(kids) + [1] * len(grand)
        scores = torch.cat([torch.ones(1), s1, s1[0] * s2])
        draft_probs = None
        if self.mode == "sampled":
            draft_probs = torch.zeros(len(tokens), q0.numel())                        # [n, V]
            draft_probs[0], draft_probs[1] = q0, q1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), scores, draft_probs)


@pytest.mark.parametrize("kind", ["ar", "top", "sampled"])
def test_sampled_generations_follow_the_target(tiny_target, kind):
    """First three sampled tokens over many seeds vs the exact joint distribution (512 cells, 94 possible
    under top-p), through the whole harness: sampled first token at prefill, tree verification, cache
    compaction before the next step. Drafts depend on the target (`_TargetDrafter`)."""
    model, info = tiny_target
    temperature, top_p, length = 1.0, 0.9, 3
    prompt = [1, 5, 2, 7, 1, 5, 2, 7, 3, 1, 5, 2, 7, 3, 6, 0, 4, 1, 5, 2]   # longer than the window (16)
    want = _exact_joint_probs(model, prompt, length, temperature, top_p)
    assert (want == 0).any()                                 # top-p leaves impossible sequences
    n, memo = 1000, {}
    counts = np.zeros(8 ** length, dtype=np.int64)
    for seed in range(n):
        cfg = SpecConfig(max_new_tokens=length, temperature=temperature, top_p=top_p, seed=seed)
        drafter = None if kind == "ar" else _TargetDrafter(model, cfg, kind, memo, seed=10 ** 6 + seed)
        out = generate(model, prompt, cfg, info=info, drafter=drafter, eos_ids=[]).output_ids.tolist()
        counts[(out[0] * 8 + out[1]) * 8 + out[2]] += 1
    assert_fits(counts, want, f"{kind}: first {length} tokens")
    # power: the counts do not fit the target at a slightly higher temperature
    assert_rejects(counts, _exact_joint_probs(model, prompt, length, 1.3, top_p), f"{kind} vs T = 1.3")


class _Spy(Drafter):
    def begin(self, prompt_ids, prefill_logits, prefill_hidden):
        self.shapes = (tuple(prefill_logits.shape), tuple(prefill_hidden.shape))


class _SpyLastRow(_Spy):
    uses_prefill_logits = False


def test_drafters_get_prefill_logits_at_every_position_unless_they_opt_out(target):
    model, info = target
    prompt = list(range(11))
    v, d = model.config.vocab_size, model.config.hidden_size
    spy, last = _Spy(model, None), _SpyLastRow(model, None)
    generate(model, prompt, info=info, drafter=spy, max_new_tokens=2)
    generate(model, prompt, info=info, drafter=last, max_new_tokens=2)
    assert spy.shapes == ((11, v), (11, d)) and last.shapes == ((1, v), (11, d))


class _SlowBegin(Drafter):
    def begin(self, prompt_ids, prefill_logits, prefill_hidden):
        time.sleep(0.05)


def test_begin_s_is_the_drafters_pass_over_the_prompt_inside_draft_s(target):
    """`begin_s` (what the decode-phase measures leave out with the prefill) times `Drafter.begin` alone:
    not the prefill's time, not a step's; ar's is ~0."""
    model, info = target
    res = generate(model, list(range(11)), info=info, drafter=_SlowBegin(model, None), max_new_tokens=3, eos_ids=[])
    assert 0.05 <= res.begin_s <= res.draft_s and res.begin_s < 0.05 + res.prefill_s
    assert res.wall_s >= res.prefill_s + res.begin_s + res.verify_s
    ar = generate(model, list(range(11)), info=info, max_new_tokens=3, eos_ids=[])
    assert ar.begin_s < 0.01


# --- the draft size: one field, resolved once --------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    model, _, info = load_model("random-llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=4)
    return untie_head(model), info


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_draft_size_none_is_each_methods_default(small, tmp_path, monkeypatch, cpu_kernels):
    model, _ = small
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    if cpu_kernels and cpu.linear_reason(torch.device("cpu"), next(model.parameters()).dtype) is not None:
        pytest.skip(f"the CPU kernels do not run here: {cpu.available_fp32()}")
    # the defaults (pld 10, layerskip / eagle 59), where steps are padded (the fp32 model on oneDNN) at their
    # row bucket's edge (engine.harness.bucket_edge), unpadded (the fp32 kernels) as they are; recycling's
    # whole template; hf-prompt-lookup's 10 (transformers' forward: no buckets)
    padded = not cpu_kernels
    expect = {"ar": None, "pld": 15 if padded else 10, "hf-prompt-lookup": 10, "layerskip": 63 if padded else 59,
              "eagle": 63 if padded else 59, "recycling": template_size("tr-default")}
    for method, g in expect.items():
        cfg = SpecConfig.preset(method, cpu_kernels=cpu_kernels)
        assert resolve_config(cfg, model=model).draft_size == g, method
    assert template_size("tr-default") == 80                       # Token Recycling's Figure 5 tree
    assert resolve_config(SpecConfig.preset("pld", draft_size=3), model=model).draft_size == 3
    assert resolve_config(SpecConfig.preset("pld")).draft_size is None     # no model: nothing to resolve
    unispec = SpecConfig.preset("unispec", cpu_kernels=cpu_kernels)
    with pytest.warns(UserWarning, match="no calibrated draft size"):
        assert resolve_config(unispec, model=model).draft_size == FALLBACK_DRAFT_SIZE["cpu"]
    save_calibration(model_key(model, unispec), {"g_star": 17})
    assert resolve_config(unispec, model=model).draft_size == (31 if padded else 17)   # at its bucket's edge
    with pytest.warns(UserWarning, match="no calibrated draft size"):         # another r: another key
        other_r = resolve_config(unispec, overrides={"threshold_r": 0.2}, model=model)
    assert other_r.draft_size == FALLBACK_DRAFT_SIZE["cpu"]


def test_unispec_draft_size_comes_from_the_harness_not_the_drafter(small, monkeypatch):
    """g* is looked up once per generate, where the config is resolved; the drafter only reads draft_size."""
    model, info = small
    calls = []
    monkeypatch.setattr(harness, "resolve_draft_size_source",
                        lambda cfg, m, **kw: calls.append(cfg.method) or (3, "calibration-cache:test"))
    out = generate(model, list(range(30, 60)), method="unispec", info=info, max_new_tokens=12, eos_ids=[])
    assert calls == ["unispec"]
    assert out.draft_tokens <= 3 * (out.steps - 1) and out.draft_tokens > 0
    with pytest.raises(ConfigError, match="resolve_config"):
        make_drafter(model, SpecConfig.preset("unispec"))             # an unresolved config is refused
    for method in ("pld", "recycling", "layerskip"):
        with pytest.raises(ConfigError, match="draft_size is None"):
            make_drafter(model, SpecConfig.preset(method, drafter_layers="all"))


@pytest.mark.parametrize("method", ["pld", "hf-prompt-lookup"])
def test_prompt_lookup_drafts_at_most_draft_size(small, method):
    model, info = small
    prompt = list(range(40, 52)) * 3
    sizes = {}
    for g in (1, 6):
        out = generate(model, prompt, method=method, info=info, max_new_tokens=24, eos_ids=[], draft_size=g)
        assert out.draft_tokens <= g * out.steps
        sizes[g] = out.draft_tokens
    assert sizes[6] > sizes[1]


@pytest.mark.parametrize("method", ["unispec", "layerskip"])
def test_score_bins_count_what_the_records_show(small, method):
    """The on-device confidence histogram equals a plain recount over the recorded steps' trees."""
    model, info = small
    prompt = list(range(40, 52)) * 3
    res = generate(model, prompt, method=method, info=info, max_new_tokens=32, eos_ids=[], draft_size=6,
                   drafter_layers="all", record=True)
    proposed, accepted = np.zeros(harness.SCORE_BINS, int), np.zeros(harness.SCORE_BINS, int)
    for r in res.records:
        for node, score in enumerate(r.tree_scores[1:], start=1):
            s = min(max(np.float32(score), np.float32(0)), np.float32(1))
            b = min(int(s * np.float32(harness.SCORE_BINS)), harness.SCORE_BINS - 1)
            proposed[b] += 1
            accepted[b] += node in r.accepted[1:]
    assert res.score_bins_proposed == proposed.tolist() and res.score_bins_accepted == accepted.tolist()
    assert sum(res.score_bins_proposed) == res.draft_tokens > 0
    assert 0 < sum(res.score_bins_accepted) <= res.new_tokens
    assert np.count_nonzero(proposed) > 1                # the drafter's scores spread over several bins
    ar = generate(model, prompt, method="ar", info=info, max_new_tokens=8, eos_ids=[])
    assert ar.score_bins_proposed == ar.score_bins_accepted == [0] * harness.SCORE_BINS


# --- allowed values: defined once, checked from the Literal types ---------------------------------------------

def test_every_literal_field_is_checked_against_its_own_choices():
    assert set(LITERAL_FIELDS) >= {"vocab", "confidence", "store_persistence", "threshold_scope", "sources",
                                   "ver_rows", "window_mode", "draft_tree_tokens", "prefill_order"}
    for name, choices in LITERAL_FIELDS.items():
        with pytest.raises(ConfigError, match=rf"'bogus'.*choose one of.*{re.escape(repr(list(choices)))}.*{name}"):
            SpecConfig().replace(**{name: "bogus"})
        for value in choices:
            assert getattr(SpecConfig().replace(**{name: value}), name) == value
    assert POLICIES == LITERAL_FIELDS["vocab"]
    # the methods are the registry's (engine.methods), checked the same way
    with pytest.raises(ConfigError, match=rf"'bogus'.*choose one of.*{re.escape(repr(list(METHODS)))}.*method"):
        SpecConfig().replace(method="bogus")
    assert [SpecConfig().replace(method=m).method for m in METHODS] == list(METHODS) != []
    assert vocab.POLICIES is POLICIES                                  # one definition
    with pytest.raises(ConfigError, match="store_persistence"):
        generate(None, [1, 2], store_persistence="bogus")
