"""The `[V, k]` successor store of Token Recycling and UniSpec (UniSpec §3.1, Token Recycling).

For every vocabulary token `v`, row `v` holds the `k` tokens the target itself ranked most probable
right after `v` the last time `v` went through a forward pass (as a prompt position, a draft-tree node,
accepted or not), and their probabilities:

    tok[v, j] = argtopk_k(softmax(z_u))[j]        # [V, k] int64
    con[v, j] = softmax(z_u)[tok[v, j]]           # [V, k] float32, descending in j; 0 = empty slot
                                                  # (sampling: the warped distribution, see `topk_probs`)

where `u` is the latest processed position whose token is `v`. Updates overwrite whole rows (no
averaging, Alg. 1 l.41-43). When one update holds the same token several times, the LAST occurrence
wins, deterministically; the drafters pass non-accepted nodes first and the accepted path last, so the
rows of tokens on the true context win ([C]: UniSpec Alg. 1 l.41-43 does not say which write wins).

Pure tensors: no model inside. `deployment_store` keeps one store per (target, method, k) for the life
of the target object - the paper's hot start (Alg. 1 initialises the store before calibration and all
prompts; `store_persistence="per_prompt"` resets it in `Drafter.begin` instead). A drafter given a
store of its own (`store=...`) checks it against the target's vocabulary (`drafter_store`).

Token ids are checked against the vocabulary wherever they enter a store (`check_token_ids`), so a wrong
id gives a `StoreError` that names it instead of an `IndexError` deep inside a tree build.
"""

from __future__ import annotations

import weakref

import torch

from specvocab.engine.verify import warp_probs
from specvocab.kernels import cpu as cpu_kernels


class StoreError(ValueError):
    """A store update has inconsistent shapes or ids; the message says which and how to fix it."""


def topk_probs(logits: torch.Tensor, k: int, temperature: float = 0.0, top_p: float = 1.0,
               chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their probabilities, per row.

    logits [n, V] -> (ids [n, k] int64, probs [n, k] float32), probs descending. `temperature` = 0
    (greedy): plain softmax, computed as exp(z - logsumexp(z)) on the top-k only. `temperature` > 0
    (sampling): the probabilities of the distribution the verifier samples from,
    `engine.verify.warp_probs(logits, temperature, top_p)` (temperature, then the top-p nucleus): the
    confidences are the verifier's token probabilities (UniSpec §3 "Confidence Score Estimation", App. A),
    and in sampling mode the verifier accepts by the warped distribution. Tokens outside the nucleus get
    probability 0: empty slots, never drafted (they could not be accepted).
    Rows are processed in chunks of `chunk` (a top-p nucleus sorts the whole row: chunk / 8 rows), so a
    long prefill's [L, V] logits never get a second [L, V] fp32 copy.
    """
    if logits.dim() != 2:
        raise StoreError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    k = min(k, vocab)
    ids = torch.empty(n, k, dtype=torch.long, device=logits.device)       # [n, k]
    probs = torch.empty(n, k, dtype=torch.float32, device=logits.device)  # [n, k]
    if temperature > 0 and top_p < 1.0:
        chunk = max(1, chunk // 8)        # warp_probs' sort keeps ~5 [c, V] temporaries alive
    for lo in range(0, n, chunk):
        if temperature > 0:
            vals, idx = warp_probs(logits[lo:lo + chunk], temperature, top_p).topk(k, dim=-1)  # [c, k]
        else:
            z = logits[lo:lo + chunk].float()                              # [c, V]
            vals, idx, lse = cpu_kernels.topk_lse(z, k)                    # [c, k] each, descending; [c]
            vals = (vals - lse[:, None]).exp()
        ids[lo:lo + chunk] = idx
        probs[lo:lo + chunk] = vals
    return ids, probs


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str,
                    fix: str = "use token ids of the target's tokenizer") -> None:
    """Raise StoreError naming `what` if any id is outside [0, vocab_size). One host sync for device ids."""
    if ids.numel() == 0:
        return
    lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
    if lo < 0 or hi >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)].unique()[:5].tolist()
        raise StoreError(f"{what} holds token ids outside the vocabulary [0, {vocab_size}), e.g. {bad} — {fix}")


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


def prompt_rows(prompt_ids: torch.Tensor) -> torch.Tensor:
    """[r] int64 ascending: the positions of the prompt whose logits a store built from the prompt reads - the
    last occurrence of each distinct token (`last_occurrence`), so the last position among them."""
    return last_occurrence(prompt_ids.reshape(-1)).nonzero().reshape(-1)


def rows_tokens(prompt_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The prompt tokens of `rows` prefill logit rows given to a store-building drafter: every position (rows =
    L), the positions `prompt_rows` names (rows = their count), or else the last `rows` positions."""
    prompt_ids = prompt_ids.reshape(-1)
    if rows == prompt_ids.numel():
        return prompt_ids
    pos = prompt_rows(prompt_ids)
    return prompt_ids[pos] if rows == pos.numel() else prompt_ids[-rows:]


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
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        check_token_ids(tokens, self.vocab_size, "the tokens whose rows were asked for")
        return self.tok[tokens], self.con[tokens]

    def update_topk(self, tokens: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor, *,
                    check_ids: bool = True) -> None:
        """Overwrite rows `tokens [n]` with `top_ids [n, k']` / `top_probs [n, k']` (k' >= k; the first k
        columns are kept). Duplicate ids: the last occurrence in `tokens` wins. Ids outside the store's
        vocabulary raise StoreError; the check costs a host sync for device tensors, so the decode loop
        passes `check_ids=False` for ids that are in range by construction (the target's own top-k)."""
        tokens = tokens.reshape(-1).to(self.device, torch.long)
        n = tokens.numel()
        if top_ids.shape[0] != n or top_probs.shape[0] != n:
            raise StoreError(f"update of {n} rows got top_ids {tuple(top_ids.shape)} and top_probs "
                             f"{tuple(top_probs.shape)} — pass one top-k row per token")
        if top_ids.shape[-1] < self.k:
            raise StoreError(f"store has k={self.k} slots but the update has only {top_ids.shape[-1]} "
                             f"candidates per row — compute top-{self.k} (or build the store with a smaller k)")
        if n == 0:
            return
        if check_ids:
            check_token_ids(torch.cat([tokens, top_ids[:, :self.k].reshape(-1).to(self.device, torch.long)]),
                            self.vocab_size, "a store update (its row tokens or top-k ids)")
        keep = last_occurrence(tokens)                                      # [n] bool
        rows = tokens[keep]                                                 # [u]
        self.tok[rows] = top_ids[keep, :self.k].to(self.device, torch.long)
        self.con[rows] = top_probs[keep, :self.k].to(self.device, torch.float32)

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, temperature: float = 0.0,
               top_p: float = 1.0) -> None:
        """Overwrite rows `tokens [n]` with the top-k of `logits [n, V]` (`topk_probs`); last occurrence wins."""
        if logits.dim() != 2 or logits.shape[-1] != self.vocab_size:
            raise StoreError(f"logits must be [n, {self.vocab_size}] for this store, got {tuple(logits.shape)} — "
                             f"was the store built for another vocabulary?")
        ids, probs = topk_probs(logits, self.k, temperature, top_p)
        self.update_topk(tokens, ids, probs)


# One store per deployment: keyed weakly by the target object, so it lives as long as the model does.
_DEPLOYMENT_STORES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def drafter_store(given: SuccessorStore | None, target, method: str, vocab_size: int, k: int,
                  device: torch.device | str = "cpu") -> SuccessorStore:
    """The store a drafter of `method` uses: the one its user gave it, checked against the target's
    vocabulary (`vocab_size`, the width of the target's logits), else the deployment store."""
    if given is None:
        return deployment_store(target, method, vocab_size, k, device)
    if not isinstance(given, SuccessorStore):
        raise StoreError(f"store must be an engine.store.SuccessorStore, got {type(given).__name__}")
    if given.vocab_size != vocab_size:
        raise StoreError(f"the store given to the {method} drafter has {given.vocab_size} rows but the target's "
                         f"vocabulary has {vocab_size} tokens — build it as SuccessorStore({vocab_size}, k) or "
                         f"pass store=None to use the deployment store")
    check_token_ids(given.tok, vocab_size, f"the store given to the {method} drafter",
                    fix="fill it with token ids of the target's vocabulary")
    return given


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
