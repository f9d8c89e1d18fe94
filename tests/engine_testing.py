"""Test-only helpers for the engine tests: random draft trees, test drafters and a naive reference decoder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specvocab.engine.harness import generate
from specvocab.engine.tree import DraftTree, Drafter

ARCHS = ("random-llama", "random-gemma3", "random-qwen3")


def untie_head(model, seed: int = 0, scale: float = 4.0):
    """Give a tiny random model its own random LM head. With the tied head of `load_random_model` greedy
    text repeats one token forever (each token's embedding scores itself highest), which hides bugs that
    depend on context; an untied head gives varied text with cycles. `scale` sets the logit spread
    (4: clear argmax margins, top-1 probability ~0.4-0.6 on 512 tokens)."""
    d, v = model.config.hidden_size, model.config.vocab_size
    head = torch.nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=torch.Generator().manual_seed(seed)) * scale / d ** 0.5)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def random_parents(n: int, rng: np.random.Generator, chain_bias: float = 0.5) -> list[int]:
    """Topologically ordered parents of an n-node tree; with prob chain_bias a node hangs off its predecessor."""
    parents = [-1]
    for i in range(1, n):
        parents.append(i - 1 if rng.random() < chain_bias else int(rng.integers(0, i)))
    return parents


def random_tree(root: int, n: int, vocab: int, rng: np.random.Generator) -> DraftTree:
    tokens = [int(root)] + rng.integers(0, vocab, n - 1).tolist()
    return DraftTree(torch.tensor(tokens), torch.tensor(random_parents(n, rng)))


def naive_greedy(model, prompt_ids, max_new_tokens: int, eos_ids=()) -> list[int]:
    """Autoregressive greedy decoding with a full forward per token and no cache: the plain reference."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
    out = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in set(eos_ids):
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


class OracleTreeDrafter(Drafter):
    """Random trees in which one branch follows the known greedy continuation for a random number of
    tokens; other nodes are random tokens, or correct tokens hung in wrong places."""

    name = "test-oracle-tree"

    def __init__(self, target, cfg, full_ids: list[int], vocab: int, seed: int = 0, max_nodes: int = 12):
        super().__init__(target, cfg)
        self.full_ids, self.vocab, self.max_nodes = list(full_ids), vocab, max_nodes
        self.rng = np.random.default_rng(seed)

    def propose(self, ids):
        rng, cur = self.rng, ids.numel()
        truth = self.full_ids[cur:cur + self.max_nodes]          # the greedy continuation after the root
        n = int(rng.integers(1, self.max_nodes + 1))
        tokens, parents = [int(ids[-1])], [-1]
        good = int(rng.integers(0, min(len(truth), n - 1) + 1))  # length of the correct branch
        node = 0
        for j in range(good):
            # random siblings before the correct child, so the correct one is not always first
            if rng.random() < 0.4 and len(tokens) < n - (good - j):
                tokens.append(int(rng.integers(0, self.vocab)))
                parents.append(node)
            tokens.append(truth[j])
            parents.append(node)
            node = len(tokens) - 1
        while len(tokens) < n:
            misplaced = truth and rng.random() < 0.3             # a correct token at a wrong place
            tokens.append(truth[int(rng.integers(0, len(truth)))] if misplaced else int(rng.integers(0, self.vocab)))
            parents.append(int(rng.integers(0, len(tokens) - 1)))
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


class SelfDrafter(Drafter):
    """Self-speculation: drafts the target's own greedy continuation (cache-free full forwards), as a chain
    or as one branch of a tree with a decoy sibling in front; every draft token must be accepted."""

    name = "test-self"

    def __init__(self, target, cfg, num_draft: int = 4, decoy: bool = False):
        super().__init__(target, cfg)
        self.num_draft, self.decoy = num_draft, decoy

    def propose(self, ids):
        seq = ids[None].clone()
        draft = []
        for _ in range(self.num_draft):
            nxt = self.target(seq).logits[0, -1].argmax()
            draft.append(int(nxt))
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        if not self.decoy:
            return DraftTree.chain(int(ids[-1]), draft)
        decoy = (draft[0] + 1) % self.target.config.vocab_size
        tokens = [int(ids[-1]), decoy] + draft
        parents = [-1, 0, 0] + list(range(2, 1 + len(draft)))
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


class SampledChainDrafter(Drafter):
    """Chains / small trees whose children are i.i.d. draws from a random q (draft_probs set)."""

    name = "test-sampled"

    def __init__(self, target, cfg, vocab: int, seed: int = 0, depth: int = 3, width: int = 2,
                 sharpness: float = 2.0):
        super().__init__(target, cfg)
        self.vocab, self.depth, self.width, self.sharpness = vocab, depth, width, sharpness
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, ids):
        tokens, parents, q_rows = [int(ids[-1])], [-1], []
        frontier = [0]
        for _ in range(self.depth):
            nxt = []
            for node in frontier:
                q = torch.softmax(self.sharpness * torch.randn(self.vocab, generator=self.gen), -1)
                while len(q_rows) <= node:
                    q_rows.append(torch.zeros(self.vocab))
                q_rows[node] = q
                for _ in range(self.width):
                    tokens.append(int(torch.multinomial(q, 1, generator=self.gen)))
                    parents.append(node)
                    nxt.append(len(tokens) - 1)
            frontier = nxt[:1]                                   # keep the tree small: expand the first child
        while len(q_rows) < len(tokens):
            q_rows.append(torch.zeros(self.vocab))               # leaves: no children sampled
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), draft_probs=torch.stack(q_rows))


def greedy_topk_reference(model, prompt_ids, max_new_tokens: int, topk: int, eos_ids=()):
    """What a recorded greedy trace must hold, written plainly: the model's own forward (its own LM head and
    KV cache), one token at a time. Returns (prefill_topk [L-1, K], generated [T], step_topk [T, K]) as int64
    numpy arrays; step_topk[t] is the top-K of the distribution that produced generated[t]."""
    eos = set(int(e) for e in eos_ids)
    with torch.inference_mode():
        out = model(input_ids=torch.as_tensor(list(prompt_ids), dtype=torch.long)[None], use_cache=True)
        logits = out.logits[0]                                   # [L, V]
        prefill = logits[:-1].topk(topk, dim=-1).indices          # [L-1, K]
        row, past = logits[-1], out.past_key_values
        generated, step = [], []
        for _ in range(max_new_tokens):
            top = row.topk(topk).indices                           # [K]
            step.append(top.tolist())
            generated.append(int(top[0]))
            if generated[-1] in eos or len(generated) == max_new_tokens:
                break
            out = model(input_ids=top[:1].view(1, 1), past_key_values=past, use_cache=True)
            row, past = out.logits[0, -1], out.past_key_values
    return (prefill.numpy().astype(np.int64), np.array(generated, dtype=np.int64),
            np.array(step, dtype=np.int64).reshape(len(step), topk))


# --- one lossless check over every vocabulary policy, for each drafter with an LM head ----------------------------

# every vocabulary policy and the switches that change what it admits (engine.vocab's docstring)
VOCAB_VARIANTS = (
    dict(vocab="full"),
    dict(vocab="frspec", frspec_k=96),
    dict(vocab="microspec", w_max=64),
    dict(vocab="microspec", w_max=24, window_mode="fifo_unique", ver_rows="all_tree", draft_tree_tokens="all_expanded",
         prefill_order="last"),
    dict(vocab="microspec", w_max=48, sources="ext", ver_rows="last"),
    dict(vocab="oracle", w_max=32),
)


def assert_lossless_under_every_policy(model, prompt, ar, method: dict, variants=VOCAB_VARIANTS, check=None,
                                       max_new_tokens: int = 20) -> None:
    """Greedy decoding with `method` (generate's method fields: method, its head, ...) under each policy of
    `variants` gives ar's tokens, token for token: the i-th variant decodes `prompt(i)` and must equal `ar(i)`
    (ar's output ids for that prompt; a test may cache them). A draft tree of depth 4 and 19 nodes: several
    levels, each wider than one. `check(variant, out)` adds the method's own asserts on each result."""
    for i, variant in enumerate(variants):
        out = generate(model, prompt(i), max_new_tokens=max_new_tokens, eos_ids=[], eagle_depth=4, draft_size=19,
                       **method, **variant)
        assert out.output_ids.tolist() == ar(i), variant
        if check is not None:
            check(variant, out)


def tiny_dynaspec_fit(folder: Path, out: Path, *, epochs: int = 2):
    """A DynaSpec `FitConfig` on the random Llama: 5 one-turn prompts written to `folder/prompts.jsonl`, 4 of
    them logged (1 held out) with the layer-skip drafter, 16 clusters, a router of width 16; fits to `out`."""
    from specvocab.engine.jobs.fit_dynaspec import FitConfig

    prompts = Path(folder) / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(5):
            f.write(json.dumps({"question_id": f"p{i}", "category": "chat",
                                "turns": [f"Tell me about topic {i} and then topic {i + 1}. " * 2]}) + "\n")
    return FitConfig(model="random-llama", spec=(("drafter_layers", "skip:1"), ("eagle_depth", 3)),
                     prompts=str(prompts), num_prompts=4, heldout=0.25, max_new_tokens=12, num_clusters=16,
                     kmeans_iters=5, router_width=16, top_l=4, epochs=epochs, batch_size=32, k_max=4, out=str(out),
                     threads=None, progress=False)


def greedy_accept(tree: DraftTree, logits: torch.Tensor):
    """(accepted node indices, new tokens) of greedy verification (`engine.verify.verify_greedy`)."""
    from specvocab.engine.verify import verify_greedy
    return verify_greedy(tree.tokens, tree.parents, logits)


def deepest_accept(tree: DraftTree, logits: torch.Tensor):
    """(accepted, new) forced to the path to the tree's deepest node plus the target's next token there, so that
    several draft tokens enter the context every step whatever the target says."""
    from specvocab.engine.verify import tree_layout
    accepted = torch.tensor(tree.path_to(int(tree_layout(tree.parents)[0].argmax())))
    return accepted, torch.cat([tree.tokens[accepted[1:]], logits[accepted[-1]].argmax()[None]])


def drive_steps(model, drafter: Drafter, prompt: torch.Tensor, steps: int, accept=greedy_accept):
    """Decode step by step through the harness's hf pieces (prefill, forward_tree, KV compaction, observe), the
    accepted path chosen by `accept(tree, logits) -> (accepted, new)`; yields (committed ids, tree, target logits
    [n, V]) before each step's observe."""
    from specvocab.engine import kv
    from specvocab.engine.harness import forward_tree, prefill
    from specvocab.engine.tree import StepResult
    with torch.inference_mode():
        cache = kv.new_cache(model)
        hidden, logits = prefill(model, prompt, cache)
        drafter.begin(prompt, logits, hidden)
        ids = torch.cat([prompt, logits[-1].argmax()[None]])
        committed = prompt.numel()
        for _ in range(steps):
            tree = drafter.propose(ids)
            h, lg = forward_tree(model, cache, committed, tree.tokens, tree.parents)
            accepted, new = accept(tree, lg)
            yield ids, tree, lg
            committed = kv.compact(cache, committed, tree.size, accepted.tolist())
            drafter.observe(StepResult(tree=tree, logits=lg, hidden=h, accepted=accepted, new_tokens=new))
            ids = torch.cat([ids, new])


def dies_at_call(real, n: int, counts=lambda *a, **k: True):
    """A stand-in for `real` that raises KeyboardInterrupt (a killed run) at its n-th call that `counts(*args,
    **kwargs)` accepts, and otherwise calls `real`."""
    calls = {"n": 0}

    def stand_in(*a, **k):
        if counts(*a, **k):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
        return real(*a, **k)
    return stand_in


def assert_trained_head_lossless(model, method: str, head: str, vocabs=("full", "microspec")):
    """A trained head loaded through its drafter (`method`: eagle | eagle3, `head`: its folder) decodes exactly
    `ar`'s tokens on model under each draft vocabulary."""
    prompt = torch.arange(3, 40)
    ar = generate(model, prompt, method="ar", max_new_tokens=20, eos_ids=[])
    for vocab in vocabs:
        res = generate(model, prompt, method=method, **{f"{method}_head": head}, vocab=vocab, w_max=64,
                       max_new_tokens=20, eos_ids=[])
        assert res.output_ids.tolist() == ar.output_ids.tolist(), vocab
