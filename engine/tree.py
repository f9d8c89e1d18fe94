"""Draft trees and the drafter interface every method plugs into the harness through.

Words as in the glossary (`locality.__doc__`): node 0 of a draft tree is the root, the last committed
token, which is not yet in the target's KV cache. Nodes are stored in topological order (every parent
index is smaller than its child's), BFS by depth is what the drafters produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TreeError(ValueError):
    """A draft tree is malformed or too large; the message says how."""


@dataclass
class DraftTree:
    tokens: torch.Tensor                    # [n] int64 token ids (full-vocabulary ids), tokens[0] = root
    parents: torch.Tensor                   # [n] int64, parents[0] = -1, parents[i] < i
    scores: torch.Tensor | None = None      # [n] float, drafter confidence of each node (root 1.0)
    draft_probs: torch.Tensor | None = None  # [n, V] q at node i over its children; only when the children
                                             # of i were *sampled* from q (model drafts, sampling mode).
                                             # None = deterministic proposals (one-hot q).

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1)
        n = self.tokens.numel()
        if n == 0 or self.parents.numel() != n:
            raise TreeError(f"a draft tree needs >= 1 node and one parent per node; got {n} tokens, "
                            f"{self.parents.numel()} parents")
        if self.parents[0].item() != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        if n > 1 and not bool((self.parents[1:] < torch.arange(1, n, device=self.parents.device)).all() and (self.parents[1:] >= 0).all()):
            raise TreeError("parents must be in topological order: 0 <= parents[i] < i for i >= 1")
        if self.scores is None:
            self.scores = torch.ones(n)

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return self.tokens.numel()

    @property
    def num_draft(self) -> int:
        """g: draft tokens (root excluded)."""
        return self.tokens.numel() - 1

    @staticmethod
    def chain(root: int, draft: list[int] | torch.Tensor, scores=None) -> "DraftTree":
        draft = torch.as_tensor(draft, dtype=torch.long).reshape(-1)
        tokens = torch.cat([torch.tensor([int(root)]), draft])
        parents = torch.arange(-1, draft.numel())
        return DraftTree(tokens, parents, scores)

    def depths(self) -> torch.Tensor:
        """[n] depth of each node (root 0)."""
        d = torch.zeros(self.size, dtype=torch.long)
        p = self.parents.tolist()
        for i in range(1, self.size):          # n <= a few hundred; topological order makes one pass enough
            d[i] = d[p[i]] + 1
        return d

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] = node j is node i or one of its ancestors (tree attention)."""
        n = self.size
        m = torch.eye(n, dtype=torch.bool)
        p = self.parents.tolist()
        for i in range(1, n):
            m[i] |= m[p[i]]
        return m

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        out, p = [], self.parents.tolist()
        while node != -1:
            out.append(node)
            node = p[node]
        return out[::-1]

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            ch[p].append(i)
        return ch


@dataclass
class StepResult:
    """What the target did with one draft tree; handed to `Drafter.observe`."""

    tree: DraftTree
    logits: torch.Tensor            # [n, V] fp32 target logits at every node (row i predicts i's child)
    hidden: torch.Tensor | None     # [n, d] target last hidden state at every node (EAGLE needs it)
    accepted: torch.Tensor          # [a] node indices of the accepted path, root first (a >= 1)
    new_tokens: torch.Tensor        # [a] tokens committed this step: accepted draft tokens + the bonus token


@dataclass(frozen=True)
class PrefillTopK:
    """What `Drafter.begin` gets as prefill_logits when the drafter sets `prefill_topk = K`: the top-K token
    ids [r, K] int64 of each prompt row's logits (best first), computed chunk by chunk so no [L, V] logits are
    ever held (Gemma-3: 1.5 GB fp32 for a 1400-token prompt)."""
    ids: torch.Tensor


class Drafter:
    """A method = a drafter plugged into `engine.harness`. Subclasses override the three hooks.

    begin(prompt_ids, prefill_logits, prefill_hidden): once per prompt, after the target's prefill.
    propose(ids): ids = every committed token so far (prompt + generated, last = root) -> DraftTree.
    observe(step): after verification; update stores, windows, caches.

    What `begin` gets as prefill_logits [r, V] (the LM head over a long prompt is the prefill's costliest
    part on a large vocabulary: Gemma-3's 262k rows):
      uses_prefill_logits   False: the last row alone (r = 1); True (default): the rows `prefill_rows` names
      prefill_rows(prompt)  the prompt positions wanted, ascending, the last position last; None: all L
      prefill_topk          K: only each row's top-K ids are read, passed as a `PrefillTopK` (MicroSpec Eq. 2)
    """

    name = "base"
    uses_prefill_logits = True
    prefill_topk: int | None = None

    def prefill_rows(self, prompt_ids: torch.Tensor) -> torch.Tensor | None:
        """[r] int64 prompt positions whose logits `begin` needs (ascending, ending at L - 1), or None for
        every position. Read only when `uses_prefill_logits`."""
        return None

    def __init__(self, target, cfg):
        self.target = target
        self.cfg = cfg

    def begin(self, prompt_ids: torch.Tensor, prefill_logits: torch.Tensor,
              prefill_hidden: torch.Tensor | None) -> None:
        pass

    def propose(self, ids: torch.Tensor) -> DraftTree:
        return DraftTree(ids[-1:], torch.tensor([-1]))

    def observe(self, step: StepResult) -> None:
        pass

    def timings(self) -> dict[str, float]:
        """Seconds spent in drafter phases since `begin` (e.g. backbone / gather / lm_head)."""
        return {}
