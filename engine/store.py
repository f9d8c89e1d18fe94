"""The `[V, k]` successor store of Token Recycling and UniSpec (specs/unispec.md section 3.1).

For every vocabulary token `v`, row `v` holds the `k` tokens the target itself ranked most probable
right after `v` the last time `v` went through a forward pass (as a prompt position, a draft-tree node,
accepted or not), and their probabilities:

    tok[v, j] = argtopk_k(softmax(z_u))[j]        # [V, k] int64
    con[v, j] = softmax(z_u)[tok[v, j]]           # [V, k] float32, descending in j; 0 = empty slot

where `u` is the latest processed position whose token is `v`. Updates overwrite whole rows (no
averaging, Alg. 1 l.41-43). When one update holds the same token several times, the LAST occurrence
wins, deterministically; the drafters pass non-accepted nodes first and the accepted path last, so the
rows of tokens on the true context win (spec section 3.1 [C]).

Pure tensors: no model inside. `deployment_store` keeps one store per (target, method, k) for the life
of the target object - the paper's hot start (Alg. 1 initialises the store before calibration and all
prompts; `store_persistence="per_prompt"` resets it in `Drafter.begin` instead).
"""

from __future__ import annotations

import weakref

import torch


class StoreError(ValueError):
    """A store update has inconsistent shapes or ids; the message says which and how to fix it."""


def topk_probs(logits: torch.Tensor, k: int, temperature: float = 0.0,
               chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their softmax probabilities, per row, without materialising softmax.

    logits [n, V] -> (ids [n, k] int64, probs [n, k] float32), probs descending. `temperature` > 0
    divides the logits first (sampling mode: confidences come from the same warped distribution the
    verifier samples from, spec section 4.7 [C]); 0 = greedy = plain softmax. Rows are processed in
    chunks of `chunk`, so a long prefill's [L, V] logits never get a second [L, V] fp32 copy.
    """
    if logits.dim() != 2:
        raise StoreError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    k = min(k, vocab)
    ids = torch.empty(n, k, dtype=torch.long, device=logits.device)       # [n, k]
    probs = torch.empty(n, k, dtype=torch.float32, device=logits.device)  # [n, k]
    for lo in range(0, n, chunk):
        z = logits[lo:lo + chunk].float()                                  # [c, V]
        if temperature > 0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)                     # [c, 1]
        vals, idx = z.topk(k, dim=-1)                                      # [c, k] each, descending
        ids[lo:lo + chunk] = idx
        probs[lo:lo + chunk] = (vals - lse).exp()
    return ids, probs


def last_occurrence(tokens: torch.Tensor) -> torch.Tensor:
    """[n] ids -> [n] bool: True at the last position of each distinct id (the write that wins)."""
    n = tokens.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=tokens.device)
    uniq, inv = torch.unique(tokens, return_inverse=True)                  # [u], [n]
    pos = torch.arange(n, device=tokens.device)                            # [n]
    last = torch.full((uniq.numel(),), -1, dtype=torch.long, device=tokens.device)
    last = last.scatter_reduce(0, inv, pos, reduce="amax")                 # [u] last position per id
    return last[inv] == pos


class SuccessorStore:
    """`tok [V, k]` / `con [V, k]`; zeros = empty. See the module docstring for the update rule."""

    def __init__(self, vocab_size: int, k: int, device: torch.device | str = "cpu"):
        if vocab_size <= 0 or k <= 0:
            raise StoreError(f"a store needs vocab_size > 0 and k > 0, got vocab_size={vocab_size}, k={k}")
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.tok = torch.zeros(vocab_size, k, dtype=torch.long, device=device)      # [V, k]
        self.con = torch.zeros(vocab_size, k, dtype=torch.float32, device=device)   # [V, k]

    @property
    def device(self) -> torch.device:
        return self.tok.device

    def reset(self) -> None:
        self.tok.zero_()
        self.con.zero_()

    def num_filled(self) -> int:
        """Rows written at least once (a host sync; for reports, not for the decode loop)."""
        return int((self.con[:, 0] > 0).sum())

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [...] -> (successor ids [..., k], confidences [..., k])."""
        return self.tok[tokens], self.con[tokens]

    def update_topk(self, tokens: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor) -> None:
        """Overwrite rows `tokens [n]` with `top_ids [n, k']` / `top_probs [n, k']` (k' >= k; the first k
        columns are kept). Duplicate ids: the last occurrence in `tokens` wins."""
        tokens = tokens.reshape(-1).to(self.device, torch.long)
        n = tokens.numel()
        if top_ids.shape[0] != n or top_probs.shape[0] != n:
            raise StoreError(f"update of {n} rows got top_ids {tuple(top_ids.shape)} and top_probs "
                             f"{tuple(top_probs.shape)}; pass one top-k row per token")
        if top_ids.shape[-1] < self.k:
            raise StoreError(f"store has k={self.k} slots but the update has only {top_ids.shape[-1]} "
                             f"candidates per row; compute top-{self.k} (or build the store with a smaller k)")
        if n == 0:
            return
        keep = last_occurrence(tokens)                                      # [n] bool
        rows = tokens[keep]                                                 # [u]
        self.tok[rows] = top_ids[keep, :self.k].to(self.device, torch.long)
        self.con[rows] = top_probs[keep, :self.k].to(self.device, torch.float32)

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, temperature: float = 0.0) -> None:
        """Overwrite rows `tokens [n]` with the top-k of softmax(`logits [n, V]`); last occurrence wins."""
        if logits.dim() != 2 or logits.shape[-1] != self.vocab_size:
            raise StoreError(f"logits must be [n, {self.vocab_size}] for this store, got {tuple(logits.shape)}; "
                             f"was the store built for another vocabulary?")
        ids, probs = topk_probs(logits, self.k, temperature)
        self.update_topk(tokens, ids, probs)


# One store per deployment: keyed weakly by the target object, so it lives as long as the model does.
_DEPLOYMENT_STORES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def deployment_store(target, method: str, vocab_size: int, k: int,
                     device: torch.device | str = "cpu") -> SuccessorStore:
    """The store shared by every drafter of `method` on this `target` in this process (hot start).

    A new store is made when none exists for (method, vocab_size, k, device). `target` must be weak-
    referenceable (any `torch.nn.Module` is); other objects get a fresh store every call."""
    key = (method, int(vocab_size), int(k), str(torch.device(device)))
    try:
        stores = _DEPLOYMENT_STORES.setdefault(target, {})
    except TypeError:                      # not weak-referenceable: no persistence possible
        return SuccessorStore(vocab_size, k, device)
    if key not in stores:
        stores[key] = SuccessorStore(vocab_size, k, device)
    return stores[key]
