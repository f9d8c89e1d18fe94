"""Verification of a draft tree against the target: pure functions on tensors.

Words as in the glossary (`locality.__doc__`). Inputs are one step's draft tree (`tokens [n]`,
`parents [n]`, node 0 = the root) and the target's logits at every node (`logits [n, V]`, row i is the
next-token distribution after the path root -> i). Every function returns

    accepted    [a] int64 node indices of the accepted path, root first (a >= 1)
    new_tokens  [a] int64 tokens committed this step: the a-1 accepted draft tokens, then the bonus token

so `new_tokens[j]` is what row `accepted[j]` produced and `tau` counts `a` tokens for the step.

Greedy (`verify_greedy`): the longest root path whose every draft token equals the target's argmax at its
parent, plus the argmax after it (the bonus token). Vectorised over nodes.

Sampling (`verify_sampling`) preserves the target distribution `P = warp(logits)` exactly
(`warp_probs`: temperature, then top-p):
- deterministic proposals (`draft_probs is None`, or a zero row for that node): the children of a node are
  examined in a fixed order (descending score); child x is accepted with probability P(x); on rejection
  P <- normalise(P with x removed) and the next child is tried. If every child is rejected (or the node is
  a leaf), the bonus token is sampled from the current P - a *recovered token* after a rejection.
  (SpecInfer / Lookahead multi-candidate sampling with point-mass drafts; UniSpec §3.3.)
- sampled proposals (`draft_probs[i]` = q, the children of node i are i.i.d. draws from q): child x is
  accepted with probability min(1, P(x)/q(x)); on rejection P <- normalise(max(P - q, 0)); the recovered
  token is sampled from the final residual. (Recursive rejection sampling, SpecInfer's MSS.)
Sampling walks the tree on the host: one small device->host copy per visited node (the probabilities of
that node's children), which is the price of an exact sequential acceptance rule.
"""

from __future__ import annotations

import torch

from specvocab.kernels import cpu as cpu_kernels


class VerifyError(ValueError):
    """Inputs to verification are inconsistent; the message says which and how."""


# --- tree layout ---------------------------------------------------------------------------------------

def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestor mask of a tree in topological order, without a per-node Python loop.

    parents [n] int64 (parents[0] = -1). Returns depths [n] int64 and anc [n, n] bool with
    anc[i, j] = j is i or an ancestor of i. Walks all nodes up one level at a time: depth-many vector
    steps. Meant for host tensors (draft trees live on the host); move the results to the device.
    """
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    anc = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    depths = torch.zeros(n, dtype=torch.long, device=parents.device)
    cur = rows                                                   # [n] current ancestor of every node, -1 = done
    while True:
        live = cur >= 0
        anc[rows[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], -1)
        step = cur >= 0
        if not bool(step.any()):                                 # on the host: free; depth-many iterations
            return depths, anc
        depths += step


# --- target distribution ------------------------------------------------------------------------------

def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of the target: softmax(logits / T), then top-p (nucleus) truncation.

    logits [..., V] -> probs [..., V] fp32. The nucleus keeps the smallest set of most likely tokens whose
    mass reaches top_p (the token that crosses top_p is kept), like transformers' TopPLogitsWarper.
    """
    if temperature <= 0:
        raise VerifyError(f"warp_probs needs temperature > 0 (got {temperature}) — use verify_greedy for T = 0")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p             # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p                       # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from probs [V]; returns a 0-d int64 tensor on probs' device (no host sync)."""
    return torch.multinomial(probs, 1, generator=generator)[0]


# --- greedy --------------------------------------------------------------------------------------------

def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                  anc: torch.Tensor | None = None, depths: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted path under greedy decoding, plus the bonus token.

    tokens [n], parents [n], logits [n, V]; anc [n, n] / depths [n] from `tree_layout` (computed when
    not given). Among equally deep accepted nodes (duplicate siblings) the lowest index wins.
    """
    _check(tokens, parents, logits)
    if anc is None or depths is None:
        depths, anc = (t.to(parents.device) for t in tree_layout(parents.cpu()))
    target = cpu_kernels.argmax(logits)                          # [n] argmax (first maximum) at every node
    match = tokens == target[parents.clamp(min=0)]               # [n] node i's token == argmax at its parent
    match[0] = True                                              # the root is committed already
    ok = ~(anc & ~match[None, :]).any(1)                         # [n] node and all its ancestors match
    key = torch.where(ok, depths + 1, 0)                         # [n] deepest accepted node wins
    best = key.argmax()                                          # first max = lowest index among ties
    accepted = anc[best].nonzero().squeeze(1)                    # [a] its path; nonzero syncs (a is data-dependent)
    return accepted, target[accepted]


# --- sampling ------------------------------------------------------------------------------------------

def verify_sampling(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, *,
                    temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None,
                    draft_probs: torch.Tensor | None = None, scores: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling over a draft tree (see the module docstring).

    tokens [n], parents [n], logits [n, V]; draft_probs [n, V] or None; scores [n] fix the order in
    which deterministic siblings are examined (descending; ties by index). Sampled siblings are examined
    in index order (the order they were drawn): sorting i.i.d. draws would bias the first one.
    The committed tokens are distributed as the target's `warp_probs(logits, temperature, top_p)`.
    """
    _check(tokens, parents, logits)
    if draft_probs is not None and draft_probs.shape != logits.shape:
        raise VerifyError(f"draft_probs must be [n, V] like logits {tuple(logits.shape)}, "
                          f"got {tuple(draft_probs.shape)}")
    probs = warp_probs(logits, temperature, top_p)               # [n, V] target distribution at each node
    par_host = parents.tolist()
    drawn_order = _children_in_order(par_host, None)             # i.i.d. draws: examine in drawn order
    score_order = drawn_order if scores is None else _children_in_order(par_host, scores.tolist())
    tok_host = tokens.tolist()

    node, accepted, out = 0, [0], []
    while True:
        p = probs[node]                                          # [V]
        q = None if draft_probs is None else draft_probs[node]
        if q is not None and drawn_order[node] and not bool(q.sum() > 0):  # host sync: zero row = point masses
            q = None
        kids = score_order[node] if q is None else drawn_order[node]
        chosen = None
        if kids and q is None:
            chosen, p = _walk_deterministic(p, kids, tok_host, tokens, generator)
        elif kids:
            chosen, p = _walk_sampled(p, q, kids, tok_host, generator)
        if chosen is None:                                       # leaf, or every child rejected
            out.append(sample_token(p, generator))
            break
        out.append(tokens[chosen])
        accepted.append(chosen)
        node = chosen
    dev = tokens.device
    return torch.tensor(accepted, dtype=torch.long, device=dev), torch.stack(out).to(torch.long)


def _walk_deterministic(p, kids, tok_host, tokens, generator):
    """Point-mass children: accept x with prob P(x) / (mass left after removing the rejected ones)."""
    kid_tokens = tokens[kids]                                    # [k]
    pk = p[kid_tokens].tolist()                                  # host sync: k probabilities
    u = torch.rand(len(kids), generator=generator, device=p.device).tolist()
    left, removed = 1.0, set()
    for j, c in enumerate(kids):
        x = tok_host[c]
        px = 0.0 if x in removed else pk[j]
        if left > 0 and u[j] * left < px:                        # u < P(x) / left
            return c, p
        if x not in removed:
            left -= px
            removed.add(x)
    residual = p.clone()
    residual[kid_tokens] = 0.0                                   # every child's token was rejected
    total = residual.sum()
    # All of P's mass sat on rejected tokens only through rounding; fall back to P then.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
    return None, residual


def _walk_sampled(p, q, kids, tok_host, generator):
    """Children drawn i.i.d. from q: accept x with min(1, P(x)/q(x)); residual max(P - q, 0)."""
    u = torch.rand(len(kids), generator=generator, device=p.device)
    for j, c in enumerate(kids):
        x = tok_host[c]
        if bool(u[j] * q[x] < p[x]):                             # host sync per examined child
            return c, p
        r = (p - q).clamp_min(0.0)
        total = r.sum()
        p = torch.where(total > 0, r / total.clamp_min(1e-30), p)
    return None, p


def _children_in_order(parents: list[int], scores: list[float] | None) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in parents]
    for i, par in enumerate(parents[1:], start=1):
        ch[par].append(i)
    if scores is not None:                                       # descending score, ties by index (stable)
        ch = [sorted(c, key=lambda i: -scores[i]) for c in ch]
    return ch


def _check(tokens, parents, logits):
    n = tokens.numel()
    if parents.numel() != n or logits.ndim != 2 or logits.shape[0] != n:
        raise VerifyError(f"need tokens [n], parents [n], logits [n, V]; got {tuple(tokens.shape)}, "
                          f"{tuple(parents.shape)}, {tuple(logits.shape)}")
