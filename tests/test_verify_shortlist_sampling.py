"""Speculative sampling stays lossless when the draft vocabulary leaves out the target's likely tokens.

A draft shortlist (FR-Spec's static list, MicroSpec's in-context window, DynaSpec's routed clusters) only
restricts what the drafter may propose; the verifier must still commit tokens distributed exactly as the
target's. Here each policy's shortlist is built to exclude the target's most likely tokens at the first
verified position, so every draft is a token the target finds unlikely and most are rejected: the committed
token is then the verifier's recovered token, drawn from the target with the rejected drafts removed.

Through the harness (`generate`, temperature 1, one draft-verify step): the first token comes from the
prefill, the second from verifying the drafter's tree. Its counts over many seeds are compared with its exact
marginal, sum_x1 P(x1) P(x2 | x1), by a chi-square test (`tests.sampling_stats`). The test checks its own
power: the same run with a verifier that accepts a draft without the ratio test, or that draws the recovered
token from P without removing the rejected drafts, is rejected.
"""

import numpy as np
import pytest
import torch

import specvocab.engine.verify as verify
from specvocab.engine.artifacts import head_fingerprint
from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate
from specvocab.engine.models import load_model
from specvocab.engine.vocab.dynaspec import FittedDynaSpec, Router, drafter_key, save_dynaspec
from tests.engine_testing import untie_head
from tests.sampling_stats import ALPHA, assert_fits, chi2_pvalue

V = 24
EXCLUDE = 3                  # the target's top tokens at x2 that no shortlist holds
RUNS = 2000


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py: tiny matmuls run faster on one thread


def _second_token_marginal(model, prompt: torch.Tensor) -> np.ndarray:
    """The exact distribution of the second sampled token at temperature 1: sum_x1 P(x1) P(x2 | prompt, x1)."""
    with torch.no_grad():
        p1 = torch.softmax(model(prompt[None]).logits[0, -1].double(), -1)                    # [V]
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)                  # [V, L + 1]
        p2 = torch.softmax(model(seqs).logits[:, -1].double(), -1)                             # [V, V]
    return (p1 @ p2).numpy()


@pytest.fixture(scope="module")
def target():
    """A random Llama with its own LM head, and a prompt whose second-token marginal puts much of its mass on
    EXCLUDE tokens that neither occur in the prompt nor are the target's top-1 at a prompt position (so that
    MicroSpec's initial window, the prompt and the prefill's top-k_pre with k_pre = 1, cannot hold them)."""
    model, _, _ = load_model("random-llama", vocab_size=V, hidden_size=32, num_layers=2, seed=3)
    untie_head(model, seed=4, scale=3.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompt = torch.as_tensor(rng.integers(0, V, 6))
        p = _second_token_marginal(model, prompt)
        top = np.argsort(-p)[:EXCLUDE]
        with torch.no_grad():
            window = set(prompt.tolist()) | set(model(prompt[None]).logits[0].argmax(-1).tolist())
        if p[top].sum() > 0.4 and not set(top.tolist()) & window:
            return model, prompt, p, top
    pytest.fail("no prompt puts its likely second tokens outside the prompt")


def _config(kind: str, tmp_path, model, top: np.ndarray, p: np.ndarray) -> SpecConfig:
    """The policy's config, its shortlist built to leave out `top` (the EXCLUDE most likely second tokens)."""
    base = dict(temperature=1.0, max_new_tokens=2, eagle_depth=2, eagle_topk=4, draft_size=6,
                drafter_layers="skip:1")
    if kind == "frspec":                       # the static list: every token but the likely ones
        ranking = np.argsort(p)[: V - EXCLUDE]                                 # least likely first
        np.save(tmp_path / "ranking.npy", ranking)
        return SpecConfig.preset("layerskip", vocab="frspec", frequency_file=str(tmp_path / "ranking.npy"),
                                 frspec_k=V - EXCLUDE, **base)
    if kind == "microspec":                    # the window: the prompt and the prefill's top-1 per position
        return SpecConfig.preset("layerskip", vocab="microspec", sources="ctx", k_pre=1, w_max=12, **base)
    assert kind == "dynaspec"                  # cluster 0 holds the likely tokens; the router never picks it
    weight = model.get_output_embeddings().weight.detach()
    m = 4
    assign = torch.tensor([0 if t in set(top.tolist()) else 1 + t % (m - 1) for t in range(V)])
    router = Router(weight.shape[1], m, 4)
    with torch.no_grad():
        router.fc2.weight.zero_()
        router.fc2.bias.copy_(torch.tensor([-100.0, 1.0, 2.0, 3.0]))
    cfg = SpecConfig.preset("layerskip", vocab="dynaspec", dynaspec_k_max=m - 1, dynaspec_budget="fixed", **base)
    fitted = FittedDynaSpec(assign=assign, router=router.eval(),
                            meta={"model": "random-llama", "head_fingerprint": head_fingerprint(weight),
                                  "drafter_config": drafter_key(cfg)})          # the drafter it runs with
    path = save_dynaspec(fitted, tmp_path / "dynaspec.safetensors")
    return cfg.replace(dynaspec_file=str(path))


def _second_token_counts(model, prompt, cfg, runs: int = RUNS) -> tuple[np.ndarray, set[int]]:
    """Counts of the second committed token over `runs` seeds, and every token the drafter proposed at the
    root of that step."""
    drafter = make_drafter(model, cfg)
    counts = np.zeros(V, dtype=np.int64)
    proposed: set[int] = set()
    real_propose = drafter.propose

    def propose(ids):
        tree = real_propose(ids)
        proposed.update(tree.tokens[1:][tree.parents[1:] == 0].tolist())       # the root's children
        return tree

    drafter.propose = propose
    for seed in range(runs):
        out = generate(model, prompt, cfg.replace(seed=seed), drafter=drafter, eos_ids=[])
        assert out.steps == 2                                                  # prefill token + one verify step
        counts[int(out.output_ids[1])] += 1
    return counts, proposed


@pytest.mark.parametrize("kind", ["frspec", "microspec", "dynaspec"])
def test_sampling_with_a_shortlist_that_excludes_likely_tokens_is_lossless(kind, target, tmp_path, monkeypatch):
    model, prompt, p, top = target
    cfg = _config(kind, tmp_path, model, top, p)
    counts, proposed = _second_token_counts(model, prompt, cfg)
    assert proposed and not proposed & set(top.tolist())            # the shortlist really left them out
    assert p[sorted(proposed)].sum() < 1 - p[top].sum() + 1e-9
    assert_fits(counts, p, f"{kind}: second token")

    # power: the same run with a broken verifier is rejected
    def accept_first(p_, kids, tok_host, tokens, generator):       # no ratio test: the first draft always
        return kids[0], p_

    def residual_is_p(p_, kids, tok_host, tokens, generator):      # ratio test, but recover from P itself
        chosen, _ = real_walk(p_, kids, tok_host, tokens, generator)
        return chosen, p_

    real_walk = verify._walk_deterministic
    for name, wrong in (("accept without the ratio test", accept_first), ("residual = P", residual_is_p)):
        monkeypatch.setattr(verify, "_walk_deterministic", wrong)
        bad, _ = _second_token_counts(model, prompt, cfg)
        monkeypatch.setattr(verify, "_walk_deterministic", real_walk)
        assert chi2_pvalue(bad, p) < ALPHA, f"{kind}: the test does not catch a verifier with {name}"
