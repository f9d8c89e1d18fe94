"""The policy protocol (`VocabPolicy`), the two policies with no state of their own (full, oracle), and what
every policy shares: the drafter's LM-head top-k over slots and the softcap. See `engine.vocab` for the words.

A module of its own (not `engine/vocab/__init__.py`) because the policy modules subclass `VocabPolicy` and the
package's `__init__` imports them to build its registry: the base sits below both, so the arrows run one way
(base <- frspec, microspec, dynaspec <- __init__)."""

from __future__ import annotations

import torch

from specvocab.engine.timing import PhaseTimer
from specvocab.kernels.head import packed_head


class VocabError(ValueError):
    """A vocabulary policy cannot be built or fed as asked; the message names the problem and the fix."""


# --- the drafter's LM-head step ----------------------------------------------------------------------------

def head_topk(logits: torch.Tensor, slot_to_token: torch.Tensor | None, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [r, m] -> (log-probs [r, k'], full-vocabulary token ids [r, k']), k' = min(k, m).
    The log-softmax renormalises over the m slots (empty slots are -inf and get probability 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(max=0.0)   # [r, m]; <= 0 keeps scores monotone
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    ids = top.indices if slot_to_token is None else slot_to_token[top.indices]
    # a -inf candidate (fewer live slots than k) may map to an empty slot (-1): give it a harmless id;
    # it is dropped from the tree, and so are its descendants (their scores are -inf too)
    ids = torch.where(torch.isfinite(top.values), ids.long(), torch.zeros_like(ids, dtype=torch.long))
    return top.values, ids


# --- policies ----------------------------------------------------------------------------------------------

def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.where(torch.isfinite(logits), torch.tanh(logits / cap) * cap, logits)   # keeps -inf slots


class VocabPolicy:
    """Base: the full head. Subclasses restrict it. See the module docstring for the protocol."""

    name = "full"
    uses_prefill_logits = False          # begin() reads the target's logits at every prompt position (MicroSpec)
    prefill_topk: int | None = None      # ... only their top-K ids (`engine.tree.PrefillTopK`)

    def __init__(self, weight: torch.Tensor, cfg, *, softcap: float | None = None, timer=None):
        if weight.dim() != 2:
            raise VocabError(f"the LM head weight must be [V, d], got {tuple(weight.shape)}")
        self.weight = weight                                   # [V, d]
        self.cfg = cfg
        self.softcap = softcap
        self.timer = timer or PhaseTimer(weight.device)
        self.vocab_size, self.hidden_size = weight.shape
        self.device = weight.device
        self._sizes: list[torch.Tensor] = []                   # per step |I_t| (0-d device tensors)
        self._hits = torch.zeros(2, dtype=torch.float64, device=self.device)   # committed tokens covered, bonus covered
        self._n = torch.zeros(2, dtype=torch.float64, device=self.device)

    # protocol ---------------------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor, prefill_logits: torch.Tensor | None) -> None:
        self._sizes = []
        self._hits.zero_()
        self._n.zero_()

    def observe(self, step, tried_tokens: torch.Tensor | None = None) -> None:
        self._count_coverage(step.new_tokens)

    def route(self, tokens: torch.Tensor, parent_h: torch.Tensor, t: int) -> None:
        """Called by the drafter before its backbone runs the rows whose head call comes next (draft step t;
        t = 0: the root, with h_root): their tokens [r] and the hidden states that proposed them [r, d].
        Only DynaSpec's router reads them (DynaSpec §4.2-4.3)."""

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self._check_h(h)
        return softcap(torch.nn.functional.linear(h, self.weight).float(), self.softcap), None

    def head_topk(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's LM-head step: log-probs [r, k'] and full-vocabulary ids [r, k']."""
        return head_topk(*self.logits(h), k)

    def active_size(self) -> torch.Tensor | int:
        return self.vocab_size

    def active_mask(self) -> torch.Tensor | None:
        """[V] bool membership of the current active vocab (None = every token)."""
        return None

    def record_step(self) -> None:
        """Called once per drafted step, after drafting: remembers |I_t| (no sync)."""
        size = self.active_size()
        self._sizes.append(size if isinstance(size, torch.Tensor) else torch.tensor(size))

    def stats(self) -> dict[str, float]:
        """mean/max active vocab over steps, coverage of committed / bonus tokens. Syncs: call after decoding."""
        out = {"vocab_size": float(self.vocab_size)}
        if self._sizes:
            sizes = torch.stack([s.to("cpu", torch.float64) for s in self._sizes])
            out.update(mean_active_vocab=float(sizes.mean()), max_active_vocab=float(sizes.max()))
        n, hits = self._n.cpu(), self._hits.cpu()
        if n[0] > 0:
            out.update(coverage=float(hits[0] / n[0]), bonus_coverage=float(hits[1] / n[1]))
        return out

    # helpers ----------------------------------------------------------------------------------------
    def _check_h(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.hidden_size:
            raise VocabError(f"hidden states have width {h.shape[-1]} but the LM head expects d={self.hidden_size} — "
                             f"the drafter's hidden size must match the head it projects with")
        return h.to(self.weight.dtype)

    def _count_coverage(self, new_tokens: torch.Tensor) -> None:
        """Coverage (glossary): committed tokens of this step that were in the vocabulary the drafter had;
        the bonus token (last) is the non-trivial part (accepted draft tokens are in I by construction)."""
        mask = self.active_mask()
        if mask is None:
            inside = torch.ones(new_tokens.numel(), dtype=torch.float64, device=self.device)
        else:
            inside = mask[new_tokens.to(mask.device).long()].double()
        self._hits += torch.stack([inside.sum(), inside[-1]])
        self._n += torch.tensor([float(new_tokens.numel()), 1.0], dtype=torch.float64, device=self.device)


class FullVocab(VocabPolicy):
    name = "full"




class OracleVocab(VocabPolicy):
    """Full-vocabulary proposals, tiny-head cost (module docstring)."""

    name = "oracle"

    def __init__(self, weight, cfg, *, softcap=None, timer=None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        check_w_max(cfg.w_max, self.vocab_size)
        self.w_max = cfg.w_max
        self.tiny = weight[: cfg.w_max].contiguous()                                 # [w_max, d]
        self.tiny_tok = torch.arange(cfg.w_max, dtype=torch.int32, device=self.device)  # [w_max]

    def head_topk(self, h, k):
        h = self._check_h(h)
        head_topk(softcap(packed_head(h, self.tiny, self.tiny_tok), self.softcap), self.tiny_tok.long(), k)  # charged
        with self.timer.phase("oracle_uncharged"):
            return head_topk(*self.logits(h), k)

    def active_size(self):
        return self.w_max



def check_w_max(w_max: int, vocab_size: int) -> None:
    if w_max <= 0 or w_max > vocab_size:
        raise VocabError(f"w_max={w_max} must be in [1, V={vocab_size}] (the window can never hold more distinct "
                         f"tokens than the vocabulary) — the paper uses 3072 for V of 128k-152k")
