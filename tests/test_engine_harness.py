"""The harness on tiny random models of all three archs: every method reproduces plain greedy decoding token
for token; self-speculation accepts every draft token; stops, records, errors; sampling keeps the target's
distribution over whole generations."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from engine import ContextError, GenerateResult, HarnessError, SpecConfig, generate
from engine.config import ConfigError
from engine.drafters import UnknownMethodError, make_drafter
from engine.models import load_model
from engine.tree import DraftTree, Drafter
from engine.verify import warp_probs
from locality.trace import read_traces, write_traces
from tests.engine_testing import (ARCHS, OracleTreeDrafter, SampledChainDrafter, SelfDrafter, naive_greedy,
                                  untie_head)

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


def _exact_two_token_probs(model, prompt, temperature, top_p):
    with torch.inference_mode():
        p1 = warp_probs(model(torch.tensor([prompt])).logits[0, -1], temperature, top_p)     # [V]
        seqs = torch.tensor([prompt + [y] for y in range(8)])
        p2 = warp_probs(model(seqs).logits[:, -1], temperature, top_p)                        # [V, V]
    return (p1[:, None] * p2).reshape(-1).numpy()


@pytest.mark.parametrize("kind", ["ar", "spec"])
def test_sampled_generations_follow_the_target(tiny_target, kind):
    """First two sampled tokens over many seeds vs the exact joint distribution (64 cells), through the
    whole harness: sampled first token at prefill, tree verification, cache compaction. "spec" alternates
    deterministic random trees (some correct branches) and trees whose children are drawn from a q."""
    model, info = tiny_target
    temperature, top_p = 2.0, 0.95
    prompt = [1, 5, 2, 7, 1, 5, 2, 7, 3, 1, 5, 2, 7, 3, 6, 0, 4, 1, 5, 2]   # longer than the window (16)
    want = _exact_two_token_probs(model, prompt, temperature, top_p)
    greedy = naive_greedy(model, prompt, 6)
    n = 600
    counts = np.zeros(64, dtype=np.int64)
    for seed in range(n):
        cfg = SpecConfig(max_new_tokens=2, temperature=temperature, top_p=top_p, seed=seed)
        if kind == "ar":
            drafter = None
        elif seed % 2:
            drafter = OracleTreeDrafter(model, cfg, prompt + greedy, 8, seed=seed, max_nodes=6)
        else:
            drafter = SampledChainDrafter(model, cfg, 8, seed=seed)
        out = generate(model, prompt, cfg, info=info, drafter=drafter, eos_ids=[]).output_ids.tolist()
        counts[out[0] * 8 + out[1]] += 1
    expected = want * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    assert stats.chisquare(obs, exp * n / exp.sum()).pvalue > 1e-3


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
