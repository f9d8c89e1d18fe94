"""Draft-vocabulary policies (`engine.vocab`): MicroSpec's live candidate stream and window against plain
references (small windows whose steps bring more padded entries than w_max included), the same stream
replayed from a recorded trace against `locality.stream`'s offline stream in both event orders, the coverage
`locality` computes from a recorded MicroSpec run equal to what the live drafter reported, FR-Spec's static
shortlist, the oracle, and the error messages."""

from collections import deque

import numpy as np
import pytest
import torch

from specvocab.engine.config import ConfigError, SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model
from specvocab.engine.tree import DraftTree, StepResult
from specvocab.engine.vocab import (FrSpecVocab, FullVocab, MicroSpecVocab, OracleVocab, VocabError, make_policy,
                          ordered_unique, prefill_entries, replay_trace, step_entries)
from specvocab.locality.shortlist import ShortlistError, count_tokens, save_ranking
from specvocab.locality.coverage import coverage
from specvocab.locality.stream import candidate_stream
from specvocab.locality.trace import Trace, TraceError
from tests.engine_testing import untie_head
from tests.locality_reference import ordered_unique as py_ordered_unique
from tests.engine_testing import drive_steps

V, D = 60, 8


def _weight(v=V, d=D, seed=0):
    return torch.randn(v, d, generator=torch.Generator().manual_seed(seed))


def _cfg(**kw):
    return SpecConfig.preset("microspec", **kw)


def _py_unique(seq, keep="first"):
    seq = list(seq)
    return py_ordered_unique(seq[::-1])[::-1] if keep == "last" else py_ordered_unique(seq)


def _live(entries: torch.Tensor) -> list[int]:
    return [int(v) for v in entries.tolist() if v >= 0]


# --- pure stream builders ---------------------------------------------------------------------------------

def test_stream_builders_match_python():
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 12, int(rng.integers(0, 30)))
        for keep in ("first", "last"):
            assert _live(ordered_unique(torch.tensor(ids, dtype=torch.long), keep)) == _py_unique(ids, keep)
        L = int(rng.integers(1, 10))
        prompt, topk = rng.integers(0, 12, L), rng.integers(0, 12, (L, 3))
        for order in ("first", "last"):
            got = _live(prefill_entries(torch.tensor(prompt), torch.tensor(topk), "ctx+ext", order))
            assert got == prompt.tolist() + _py_unique(topk.reshape(-1), order)
        assert _live(prefill_entries(torch.tensor(prompt), torch.tensor(topk), "ext")) == _py_unique(topk[-1])
        draft, ver = rng.integers(0, 12, 7), rng.integers(0, 12, (3, 3))
        assert _live(step_entries(torch.tensor(draft), torch.tensor(ver))) == \
            _py_unique(draft) + _py_unique(ver.reshape(-1))


# --- window semantics vs a plain reference -------------------------------------------------------------------

class WindowRef:
    """Eq. 4 literally (eq4_exact): I = Unique(last w_max entries of S). fifo_unique: a step pushes the
    distinct entries not active at its start (keep-first) into a FIFO of w_max distinct tokens."""

    def __init__(self, w_max, mode):
        self.w, self.mode, self.S = w_max, mode, []
        self.fifo = deque(maxlen=w_max)

    def init(self, entries):
        self.S = list(entries)
        self.fifo = deque(_py_unique(entries)[-self.w:], maxlen=self.w)

    def step(self, entries):
        self.S += entries
        if self.mode == "fifo_unique":
            active = set(self.fifo)
            self.fifo.extend(v for v in _py_unique(entries) if v not in active)

    def active(self):
        return set(self.S[-self.w:]) if self.mode == "eq4_exact" else set(self.fifo)


def _check_head(policy: MicroSpecVocab, expect: set, weight):
    assert set(policy.active_tokens().tolist()) == expect
    assert int(policy.active_size()) == len(expect)
    h = torch.randn(3, D, generator=torch.Generator().manual_seed(len(expect)))
    logits, slot_tok = policy.logits(h)                       # [3, w_max]
    live = slot_tok >= 0
    assert sorted(slot_tok[live].tolist()) == sorted(expect)   # each active token owns exactly one slot
    torch.testing.assert_close(logits[:, live], h @ weight[slot_tok[live]].T)
    assert bool(torch.isneginf(logits[:, ~live]).all())


@pytest.mark.parametrize("mode", ["eq4_exact", "fifo_unique"])
@pytest.mark.parametrize("order", ["first", "last"])
def test_window_matches_a_plain_reference(mode, order):
    rng = np.random.default_rng(1)
    weight = _weight()
    policy = MicroSpecVocab(weight, _cfg(w_max=16, window_mode=mode, prefill_order=order))
    ref = WindowRef(16, mode)
    for trial in range(3):                                    # begin() restarts the stream
        L = int(rng.integers(1, 30))
        prompt, topk = rng.integers(0, V, L), rng.integers(0, V, (L, 4))
        policy.begin_ids(torch.tensor(prompt), torch.tensor(topk))
        ref.init(prompt.tolist() + _py_unique(topk[:, :3].reshape(-1), order))
        _check_head(policy, ref.active(), weight)
        for _ in range(25):
            draft = rng.integers(0, V // 3, int(rng.integers(1, 8)))        # repeats, so refreshes happen
            ver = np.stack([rng.permutation(V)[:5] for _ in range(int(rng.integers(1, 3)))])
            policy.observe_ids(torch.tensor(draft), torch.tensor(ver))
            ref.step(_py_unique(draft) + _py_unique(ver[:, :3].reshape(-1)))
            _check_head(policy, ref.active(), weight)
            policy.record_step()
        stats = policy.stats()
        assert 0 < stats["mean_active_vocab"] <= stats["max_active_vocab"] <= 16
        if mode == "eq4_exact":                               # |S|; fifo_unique counts pushed entries only
            assert stats["stream_len"] == len(ref.S)


def test_padding_never_counts_as_window_entries():
    """Eq. 4 on the REAL entries: a step whose -1-padded entries outnumber w_max keeps its last w_max tokens
    (a plain entries[-w_max:] of the padded buffer would keep lanes of padding and lose real tokens)."""
    policy = MicroSpecVocab(_weight(100), _cfg(w_max=8))
    policy.begin_ids(torch.arange(60, 70), torch.arange(60, 70)[:, None].repeat(1, 3))
    draft = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6, 7, 8, 1, 9, 10, 11, 2, 3])      # C_draft: 0..11, 4 repeats
    ver = torch.tensor([[50, 51, 52], [51, 50, 52], [56, 57, 50]])             # C_ver: 50, 51, 52, 56, 57
    assert step_entries(draft, ver).numel() == 25                             # 17 real entries + 8 padding
    policy.observe_ids(draft, ver)
    assert policy.active_tokens().tolist() == [9, 10, 11, 50, 51, 52, 56, 57]
    assert int(policy.stats()["stream_len"]) == 10 + 10 + 17                   # |S|: padding never counted


@pytest.mark.parametrize("mode", ["eq4_exact", "fifo_unique"])
@pytest.mark.parametrize("w_max", [1, 3, 8])
def test_small_windows_match_a_plain_reference(mode, w_max):
    rng = np.random.default_rng(w_max)
    weight = _weight()
    policy = MicroSpecVocab(weight, _cfg(w_max=w_max, window_mode=mode))
    ref = WindowRef(w_max, mode)
    L = 12
    prompt, topk = rng.integers(0, V, L), rng.integers(0, V, (L, 3))
    policy.begin_ids(torch.tensor(prompt), torch.tensor(topk))
    ref.init(prompt.tolist() + _py_unique(topk.reshape(-1)))
    _check_head(policy, ref.active(), weight)
    for _ in range(30):
        draft = rng.integers(0, V // 2, int(rng.integers(1, 25)))            # big trees with many repeats
        ver = rng.integers(0, V // 2, (int(rng.integers(1, 5)), 3))
        policy.observe_ids(torch.tensor(draft), torch.tensor(ver))
        ref.step(_py_unique(draft) + _py_unique(ver.reshape(-1)))
        _check_head(policy, ref.active(), weight)
    if mode == "eq4_exact":
        assert policy.stats()["stream_len"] == len(ref.S)


def _step(tree_tokens, parents, logits, accepted):
    tree = DraftTree(torch.tensor(tree_tokens), torch.tensor(parents))
    acc = torch.tensor(accepted)
    new = logits[acc].argmax(-1)
    return StepResult(tree=tree, logits=logits, hidden=None, accepted=acc, new_tokens=new)


@pytest.mark.parametrize("variant", [dict(), dict(ver_rows="last"), dict(ver_rows="all_tree"),
                                     dict(draft_tree_tokens="all_expanded"), dict(sources="ctx"),
                                     dict(sources="ext")])
def test_live_policy_feeds_the_stream_as_specified(variant):
    """begin(prompt, logits [L, V]) and observe(StepResult) append exactly Eq. 2 / Eq. 3 with the switches."""
    g = torch.Generator().manual_seed(2)
    weight = _weight()
    cfg = _cfg(w_max=40, **variant)
    policy = MicroSpecVocab(weight, cfg)
    prompt = torch.randint(0, V, (12,), generator=g)
    pre_logits = torch.randn(12, V, generator=g)
    policy.begin(prompt, pre_logits)
    top = pre_logits.topk(3, -1).indices
    if cfg.sources == "ext":
        S = _py_unique(top[-1].tolist())
    else:
        S = prompt.tolist() + _py_unique(top.reshape(-1).tolist(), "first")
    assert set(policy.active_tokens().tolist()) == set(S[-40:])
    tokens, parents = [5, 7, 9, 7, 11, 3], [-1, 0, 0, 1, 3, 2]
    logits = torch.randn(6, V, generator=g)
    tried = torch.tensor([7, 9, 13, 7, 11, 3, 17])
    policy.observe(_step(tokens, parents, logits, [0, 1, 3, 4]), tried)
    if cfg.sources != "ctx":
        draft = [5] + tried.tolist() if cfg.draft_tree_tokens == "all_expanded" else tokens
        rows = {"accepted_path": [0, 1, 3, 4], "last": [4], "all_tree": list(range(6))}[cfg.ver_rows]
        S += _py_unique(draft) + _py_unique(logits[rows].topk(3, -1).indices.reshape(-1).tolist())
    assert set(policy.active_tokens().tolist()) == set(S[-40:])


# --- the live stream replayed from a trace == locality.stream's offline stream --------------------------------

def _synthetic_trace(seed, L, T, K=4, drafts=True):
    rng = np.random.default_rng(seed)
    gen = rng.integers(0, V, T)
    step_topk = np.stack([np.concatenate([[g], rng.permutation(np.setdiff1d(np.arange(V), [g]))[:K - 1]])
                          for g in gen])
    return Trace(prompt=rng.integers(0, V, L), prefill_topk=np.stack([rng.permutation(V)[:K] for _ in range(L - 1)]),
                 generated=gen, step_topk=step_topk,
                 draft_tokens=[rng.integers(0, V, int(rng.integers(0, 6))) for _ in range(T)] if drafts else None)


def _offline_active(trace, w_max, **kw):
    stream = candidate_stream([trace], **kw)
    s = stream.trace_stream(0)
    return [set(s[max(0, n - w_max):n].tolist()) for n in stream.query_pos.tolist()]


@pytest.mark.parametrize("sources", ["ctx+ext", "ctx", "ext"])
@pytest.mark.parametrize("order", ["first", "last"])
@pytest.mark.parametrize("drafts", [True, False])
def test_replay_equals_the_offline_stream(sources, order, drafts):
    for seed, w_max in [(0, 12), (1, 40), (2, 7)]:
        trace = _synthetic_trace(seed, L=int(8 + 9 * seed), T=30, drafts=drafts)
        policy = MicroSpecVocab(_weight(), _cfg(w_max=w_max, sources=sources, prefill_order=order, k_pre=3, k_ver=2))
        live = [set(a.tolist()) for a in replay_trace(policy, trace)]
        offline = _offline_active(trace, w_max, k_pre=3, k_ver=2, sources=sources, prefill_order=order)
        assert live == offline


@pytest.mark.parametrize("sources", ["ctx+ext", "ctx", "ext"])
def test_engine_order_replay_equals_the_offline_stream(sources):
    rng = np.random.default_rng(3)
    for w_max in (5, 16, 60):
        trace = _synthetic_trace(int(w_max), L=14, T=30, drafts=False)
        sizes = [1]
        while sum(sizes) < 30:
            sizes.append(int(rng.integers(1, 5)))
        trace.draft_tokens = [np.zeros(0, np.int64)] + [rng.integers(0, V, int(rng.integers(0, 12))) for _ in sizes[1:]]
        trace.meta["step_sizes"] = sizes
        cfg = _cfg(w_max=w_max, sources=sources, k_pre=3, k_ver=2)
        live = [set(a.tolist()) for a in replay_trace(MicroSpecVocab(_weight(), cfg), trace, "engine")]
        stream = candidate_stream([trace], k_pre=3, k_ver=2, sources=sources, event_order="engine")
        s = stream.trace_stream(0)
        assert live == [set(s[max(0, n - w_max):n].tolist()) for n in stream.query_pos.tolist()]
        assert len(live) == 29                                 # every token but the prefill's


def test_replay_of_a_recorded_trace_equals_the_offline_stream():
    model, _, _ = load_model("random-qwen3", vocab_size=V * 5, hidden_size=32, num_layers=2, seed=1)
    prompt = torch.randint(0, V * 5, (30,), generator=torch.Generator().manual_seed(0))
    trace = generate(model, prompt, method="ar", max_new_tokens=40, eos_ids=[], record=True, record_topk=4).to_trace()
    policy = MicroSpecVocab(_weight(V * 5), _cfg(w_max=64))
    live = [set(a.tolist()) for a in replay_trace(policy, trace)]
    assert live == _offline_active(trace, 64, k_pre=3, k_ver=3, sources="ctx+ext", prefill_order="first")


# --- the policy inside the drafter ---------------------------------------------------------------------------

LAYERSKIP, EAGLE = ("layerskip", dict(drafter_layers="skip:1")), ("eagle", dict(eagle_head="random"))


@pytest.mark.parametrize("drafter,w_max,variant", [(LAYERSKIP, 8, {}), (LAYERSKIP, 200, {}),
                                                   (LAYERSKIP, 24, dict(prefill_order="last")),
                                                   (EAGLE, 24, dict(sources="ext"))])
def test_locality_reproduces_the_live_coverage_of_a_recorded_run(drafter, w_max, variant):
    """The coverage, bonus coverage and mean active vocab `locality` computes from a recorded MicroSpec run
    (event order "engine") equal what the live drafter reported, exactly: small windows whose steps bring
    more entries than w_max, multi-token steps, and a last step cut at max_new_tokens (36 here)."""
    model, _, _ = load_model("random-llama", vocab_size=300, hidden_size=32, num_layers=3, seed=2)
    untie_head(model, seed=5)                                     # varied text, so the window matters
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4))
    method, extra = drafter
    res = generate(model, prompt, method=method, vocab="microspec", w_max=w_max, max_new_tokens=36, eos_ids=[],
                   record=True, record_topk=4, eagle_depth=3, eagle_topk=4, draft_size=12, **extra, **variant)
    trace = res.to_trace()
    assert len(trace.draft_tokens) == res.steps and trace.meta["step_sizes"][0] == 1
    assert sum(trace.meta["step_sizes"]) == len(trace.generated) == 36
    live = res.drafter_stats
    f = coverage([trace], [w_max], k_pre=3, k_ver=3, event_order="engine", **variant).row(0, named=True)
    assert (f["tokens"], f["steps"]) == (35, res.steps - 1)        # the prefill's token was not drafted
    assert f["coverage"] == live["coverage"] and f["bonus_coverage"] == live["bonus_coverage"]
    assert f["mean_active_vocab"] == live["mean_active_vocab"]



def test_draft_tokens_come_from_the_active_vocab():
    """Spec section 2.1: every non-root draft token was chosen from I_t."""
    model, _, _ = load_model("random-llama", vocab_size=300, hidden_size=32, num_layers=3, seed=2)
    drafter = make_drafter(model, _cfg(w_max=48, drafter_layers="skip:1", eagle_depth=3, draft_size=15))
    prompt = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(3))
    steps = 0
    for ids, tree, _ in drive_steps(model, drafter, prompt, steps=5):
        assert bool(drafter.policy.active_mask()[tree.tokens[1:]].all())
        steps += 1
    stats = drafter.stats()
    assert steps == 5 and stats["steps"] == 5
    assert 0 < stats["mean_active_vocab"] <= stats["max_active_vocab"] <= 48
    assert 0 < stats["coverage"] <= 1 and 0 <= stats["bonus_coverage"] <= 1


def test_full_and_frspec_policies(tmp_path):
    weight = _weight()
    h = torch.randn(4, D)
    full = FullVocab(weight, _cfg(vocab="full"))
    logits, m = full.logits(h)
    assert m is None and torch.allclose(logits, h @ weight.T)
    ranking = count_tokens([np.random.default_rng(0).integers(0, 20, 500)], V)
    path = save_ranking(ranking, tmp_path / "rank.parquet", tokenizer="test")
    fr = FrSpecVocab(weight, _cfg(vocab="frspec", frspec_k=10, frequency_file=str(path)))
    ids = ranking.sort("rank")["token_id"].to_numpy()[:10]
    logits, m = fr.logits(h)
    assert m.tolist() == ids.tolist()
    torch.testing.assert_close(logits, h @ weight[m].T)
    logp, tok = fr.head_topk(h, 3)
    assert set(tok.reshape(-1).tolist()) <= set(ids.tolist())
    with pytest.warns(UserWarning, match="true size is 20"):
        big = FrSpecVocab(weight, _cfg(vocab="frspec", frspec_k=32768, frequency_file=str(path)))
    assert big.k == 20                          # K clipped to the 20 ids the corpus showed, not padded by id
    np.save(tmp_path / "rank.npy", ids)
    assert FrSpecVocab(weight, _cfg(vocab="frspec", frspec_k=4, frequency_file=str(tmp_path / "rank.npy"))) \
        .ids.tolist() == ids[:4].tolist()
    fr.record_step()
    full.record_step()
    assert fr.stats()["mean_active_vocab"] == 10 and full.stats()["max_active_vocab"] == V


def test_oracle_charges_a_tiny_head_and_proposes_the_full_one():
    weight = _weight()
    h = torch.randn(2, D)
    oracle = OracleVocab(weight, _cfg(vocab="oracle", w_max=8))
    lp_o, tok_o = oracle.head_topk(h, 5)
    lp_f, tok_f = FullVocab(weight, _cfg(vocab="full")).head_topk(h, 5)
    assert torch.equal(tok_o, tok_f) and torch.allclose(lp_o, lp_f)
    assert oracle.timer.totals()["oracle_uncharged"] > 0
    assert oracle.active_size() == 8


# --- errors --------------------------------------------------------------------------------------------------

def test_errors_name_the_problem_and_the_fix(tmp_path):
    weight = _weight()
    with pytest.raises(VocabError, match=r"w_max=61 must be in \[1, V=60\]"):
        MicroSpecVocab(weight, _cfg(w_max=61))
    with pytest.raises(VocabError, match=r"w_max=99 must be in"):
        OracleVocab(weight, _cfg(vocab="oracle", w_max=99))
    with pytest.raises(ConfigError, match="w_max must be > 0"):
        _cfg(w_max=0)
    with pytest.raises(VocabError, match="k_pre=61 is larger than the vocabulary"):
        MicroSpecVocab(weight, _cfg(w_max=8, k_pre=61))
    policy = MicroSpecVocab(weight, _cfg(w_max=8, k_pre=3, k_ver=4))
    with pytest.raises(VocabError, match="k_pre=3 is larger than the K=2 top-k ids"):
        policy.begin_ids(torch.arange(5), torch.zeros(5, 2, dtype=torch.long))
    policy.begin_ids(torch.arange(5), torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(VocabError, match="k_ver=4 is larger than the K=3"):
        policy.observe_ids(torch.arange(3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(VocabError, match="logits at all 5 prompt positions"):
        policy.begin(torch.arange(5), torch.zeros(1, V))
    with pytest.raises(TraceError, match="larger than the K=4"):
        replay_trace(MicroSpecVocab(weight, _cfg(w_max=8, k_ver=5)), _synthetic_trace(0, 6, 5))
    with pytest.raises(VocabError, match="width 7 but the LM head expects d=8"):
        policy.logits(torch.zeros(1, 7))
    with pytest.raises(VocabError, match="frequency_file="):
        make_policy(_cfg(vocab="frspec"), weight)
    with pytest.raises(VocabError, match="does not exist"):
        make_policy(_cfg(vocab="frspec", frequency_file=str(tmp_path / "none.npy")), weight)
    np.save(tmp_path / "big.npy", np.array([3, 70, 1]))
    with pytest.raises(VocabError, match="token id 70 outside this model's vocabulary of 60"):
        make_policy(_cfg(vocab="frspec", frequency_file=str(tmp_path / "big.npy")), weight)
    path = save_ranking(count_tokens([np.arange(10)], 100), tmp_path / "r.parquet", tokenizer="test")
    with pytest.raises(ShortlistError, match="vocabulary of 100 ids but the model has 60"):
        make_policy(_cfg(vocab="frspec", frequency_file=str(path)), weight)
    with pytest.raises(ConfigError, match="unknown vocab policy"):
        _cfg(vocab="tiny")
