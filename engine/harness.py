"""One lossless draft-verify loop for every method: `generate(model, prompt_ids, cfg) -> GenerateResult`.

Words as in the glossary (`locality.__doc__`). Per prompt:

    prefill   the target runs the whole prompt once; the last row gives the first token - step 0, so
              autoregressive decoding has tau = 1.00. The KV cache holds the prompt. Drafters get the
              logits at the prompt positions they name in `begin` (`Drafter.prefill_rows`: all L by
              default; UniSpec and Token Recycling the last occurrence of each token, which is what their
              store keeps), or the last row [1, V] alone where they set `uses_prefill_logits = False` (ar,
              pld, and the LM-head drafters except under MicroSpec: their timings should not pay for a
              [L, V] LM head they do not read).
    step      the drafter proposes a draft tree rooted at the last committed token (the root, not yet in
              the cache); the target forwards root + draft nodes in one pass with a tree attention mask
              and positions P + depth (`forward_tree`); `engine.verify` picks the accepted path and the
              bonus token; the target's `compact` keeps exactly the root + accepted nodes in the cache.
              The target runs behind `engine.target` (`cfg.backend`: native where it applies, else
              transformers; fixed-shape verification on the native path, `cfg.fixed_shape`).
    stop      at an eos token (kept) or after max_new_tokens (the last step's tokens are cut to fit).

`ar` runs through the same loop (its drafter proposes root-only trees). `hf-prompt-lookup` is the outside
anchor: transformers' own `generate(prompt_lookup_num_tokens=...)`, timed here, its steps counted by a
forward hook.

One device->host sync per step is intended: the accept length (and the committed tokens) decide the
cache compaction, the stop test and what the drafter sees next. Phase timings add a synchronize per
phase on CUDA (`_clock`), the price of attributing time to draft and verify.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specvocab.engine.calibration import CalibrationSource, resolve_draft_size_source
from specvocab.engine.config import DRAFTING_METHODS, HF_METHODS, SpecConfig
from specvocab.engine.drafters import make_drafter
from specvocab.engine.methods import method_spec
from specvocab.engine.models import eos_token_ids
from specvocab.engine.shipped import default_eagle3_head, default_eagle_head
from specvocab.engine.native import bucket_rows
from specvocab.engine.target import (BackendError, forward_tree, head_topk, lm_logits, make_target,  # noqa: F401
                           max_tree_nodes, native_model, pads_rows, prefill, resolve_backend, rows_error)
from specvocab.engine.tree import DraftTree, Drafter, PrefillTopK, StepResult
from specvocab.engine.verify import sample_token, tree_layout, verify_greedy, verify_sampling, warp_probs
from specvocab.locality.trace import Trace

# Histogram of the drafted nodes' confidence scores (`DraftTree.scores`, UniSpec §3.2, Fig. 3): SCORE_BINS equal
# bins over [0, 1], bin b = [b / SCORE_BINS, (b + 1) / SCORE_BINS), a score of 1.0 (or above) in the last one
SCORE_BINS = 20


class ContextError(ValueError):
    """The prompt is empty or holds ids outside the vocabulary, or prompt + new tokens + draft tree do not fit
    the model's context; the message says which and by how much."""


class HarnessError(RuntimeError):
    """A drafter broke the harness contract (wrong root, malformed tree); the message says which."""


@dataclass
class StepRecord:
    """One verify step, kept when `cfg.record`."""

    tree_tokens: list[int]          # [n] draft tree, root first
    tree_parents: list[int]         # [n]
    tree_scores: list[float]        # [n]
    accepted: list[int]             # [a] node indices of the accepted path, root first
    new_tokens: list[int]           # [a] committed tokens (accepted draft tokens + bonus), before truncation
    topk: np.ndarray                # [a, K] target top-K at the accepted nodes' rows; last row = bonus position


@dataclass
class GenerateResult:
    method: str
    prompt_ids: torch.Tensor        # [L] int64, host
    output_ids: torch.Tensor        # [T] int64, host: new tokens only
    steps: int                      # target forwards that produced tokens; the prefill is step 0
    wall_s: float
    prefill_s: float
    draft_s: float                  # drafter begin + propose + observe
    verify_s: float                 # tree forward + acceptance + cache compaction
    draft_tokens: int = 0           # draft tokens proposed over all steps (root excluded)
    begin_s: float = 0.0            # the drafter's pass over the prompt (`Drafter.begin`), part of draft_s: with
                                    # prefill_s, the one-time cost a long generation amortises
    stop_reason: str = "max_new_tokens"     # "eos" or "max_new_tokens"
    drafter_timings: dict = field(default_factory=dict)
    drafter_stats: dict = field(default_factory=dict)   # `drafter.stats()` if it has one (active vocab, coverage)
    records: list[StepRecord] | None = None
    prefill_topk: np.ndarray | None = None  # [L, K] target top-K at every prompt position (when recorded)
    # per confidence-score bin (SCORE_BINS over [0, 1]): draft nodes proposed (root excluded) and accepted by
    # verification (before the eos / max_new_tokens cut); None for hf-prompt-lookup
    score_bins_proposed: list[int] | None = None
    score_bins_accepted: list[int] | None = None
    # tokens committed by each step: step 0 (the prefill) commits one, each draft-verify step its accepted draft
    # tokens plus the bonus, the last step what was kept after the eos / max_new_tokens cut; sums to new_tokens,
    # one entry per step (Spec-Bench's and EAGLE's per-step `accept_lengths`; tau is their mean)
    step_sizes: list[int] | None = None

    @property
    def new_tokens(self) -> int:
        return int(self.output_ids.numel())

    @property
    def tau(self) -> float:
        """Mean tokens committed per step, bonus included (ar = 1.00)."""
        return self.new_tokens / max(self.steps, 1)

    @property
    def g(self) -> float:
        """Mean draft tokens per verify step (the prefill proposes none)."""
        return self.draft_tokens / max(self.steps - 1, 1)

    def to_trace(self, meta: dict | None = None) -> Trace:
        """A `locality.Trace` of this run (needs `cfg.record=True`), with what `locality.candidate_stream`
        needs for either event order: `step_topk[t]` = the target's top-K at the row that produced
        generated[t]; and, when any step drafted, `draft_tokens` = one list per step (the tree's tokens in
        node order, root excluded; the prefill's step 0 drafts none) with `meta["step_sizes"]`. A run that
        never drafted (ar, or a drafter that found nothing) committed one token per step and keeps
        `draft_tokens=None`, like a plain greedy recording. meta: merged over {"method": ...}."""
        if self.records is None or self.prefill_topk is None:
            raise HarnessError("to_trace needs per-step records: run generate(..., record=True)")
        t = self.new_tokens
        step_topk = np.concatenate([self.prefill_topk[-1:]] + [r.topk for r in self.records])[:t]   # [T, K]
        meta = {"method": self.method, **(meta or {})}
        drafts = None
        if any(len(r.tree_tokens) > 1 for r in self.records):
            drafts = [np.zeros(0, dtype=np.int64)] + [np.asarray(r.tree_tokens[1:], dtype=np.int64)
                                                      for r in self.records]
            meta["step_sizes"] = self.step_sizes
        return Trace(prompt=self.prompt_ids.numpy(), prefill_topk=self.prefill_topk[:-1],
                     generated=self.output_ids.numpy(), step_topk=step_topk, draft_tokens=drafts, meta=meta)


def prefill_topk(model, hidden: torch.Tensor, k: int, chunk: int = 256) -> np.ndarray:
    """[L, k] the target's top-k token ids at every prompt position, LM head in chunks of rows."""
    k = min(k, model.get_output_embeddings().weight.shape[0])
    rows = [lm_logits(model, hidden[i:i + chunk]).topk(k, dim=-1).indices for i in range(0, hidden.shape[0], chunk)]
    return torch.cat(rows).cpu().numpy()


# --- generate -------------------------------------------------------------------------------------------

def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)                           # phase timing needs the queue drained
    return time.perf_counter()


def resolve_config(cfg: SpecConfig | None, method: str | None = None, overrides: dict | None = None,
                   model=None, *, calibration: CalibrationSource | None = None,
                   with_source: bool = False) -> SpecConfig | tuple[SpecConfig, str | None]:
    """The run's config: cfg (default `SpecConfig.preset(method or "ar")`) with `method` and `overrides`
    applied, validated; with `model`, `draft_size=None` is replaced by the method's calibrated size
    (`default_draft_size`: the g* of this model, device, dtype and config in `calibration` - default this
    machine's cache - else the uncalibrated default with a warning) and, first, for `eagle` / `eagle3`,
    `eagle_head=None` / `eagle3_head=None` by the head shipped for this model (`engine.shipped.default_eagle_head`
    / `default_eagle3_head`, left None when none ships), so the size is the calibration of the head that runs.
    What `generate` does with a config left open; a run's whole resolution (its vocabulary list or fit, an
    on-the-spot calibration, the provenance of each value) is `engine.resolve.resolve_run`.
    with_source: return (cfg, where its draft size came from: "config", the calibration's label - e.g.
    "calibration-cache:<sha8>" - or "default"; None for a method that drafts nothing)."""
    overrides = dict(overrides or {})
    if cfg is None:
        cfg = SpecConfig.preset(method or "ar", **overrides)
    else:
        if method is not None:
            overrides = {"method": method, **overrides}
        cfg = cfg.replace(**overrides) if overrides else cfg.validate()
    source = "config" if cfg.draft_size is not None and cfg.method in DRAFTING_METHODS else None
    # the head first: it is part of the calibration key (`eagle_head`, `eagle3_head`), so the size is looked up
    # under the head that runs, as a calibration of that head keyed it
    if model is not None and cfg.method == "eagle" and cfg.eagle_head is None:
        head = default_eagle_head(model)
        if head is not None:
            cfg = cfg.replace(eagle_head=head)
    if model is not None and cfg.method == "eagle3" and cfg.eagle3_head is None:
        head = default_eagle3_head(model)
        if head is not None:
            cfg = cfg.replace(eagle3_head=head)
    if model is not None and cfg.draft_size is None:
        g, source = default_draft_size(cfg, model, calibration=calibration, with_source=True)
        if g is not None:
            cfg = cfg.replace(draft_size=g)
    return (cfg, source) if with_source else cfg


def max_draft_size(cfg: SpecConfig, model=None) -> int | None:
    """The largest draft size cfg.method can propose, None where it has no bound of its own
    (`engine.methods.MethodSpec.max_draft_size`): recycling its template's nodes; layerskip / eagle EAGLE-2's
    candidates at the config's depth, topk + topk^2 (depth - 1); unispec its candidate pool, (2 with the
    broadened first level, else 1) k + k^2 (d - 1); pld / hf-prompt-lookup none. With `model`, the target's
    bounds too: on the native fixed-shape path (`engine.target`) a tree of at most `verify_rows` rows when that
    is set (on an accelerator `DEVICE_ROWS` when it is not). A tree's depth is no bound: the fixed-shape
    attention's tail takes as many BLOCK-position blocks as it reaches (`engine.native.tail_blocks`)."""
    spec = method_spec(cfg.method)
    caps = [] if (own := spec.draft_size_cap(cfg)) is None else [own]
    if model is not None and cfg.method in DRAFTING_METHODS and cfg.method not in HF_METHODS and cfg.fixed_shape \
            and resolve_backend(model, cfg.backend) == "native":
        nodes = max_tree_nodes(model, cfg.backend, cfg.fixed_shape, cfg.verify_rows)
        if nodes is not None:
            caps.append(nodes)                              # rows: the root + the draft nodes
    return min(caps) if caps else None



def bucket_edge(cfg: SpecConfig, model, g: int) -> int:
    """The draft size that costs what g costs and drafts the most: on the native fixed-shape path with a
    bucket of rows per step (`verify_rows=None` on a CPU, `engine.native.bucket_rows`), a tree of g + 1 nodes
    runs at bucket_rows(g + 1) rows whatever g is inside the bucket, so the bucket's largest tree costs the
    same forward; its tau is no lower (every drafter's tree of g + 1 draft nodes holds its tree of g: the top
    nodes by score, a longer chain, more of a template), and its draft step costs about the same (measured:
    UniSpec g = 2 -> 3 on SmolLM2, tau 1.26 -> 1.33 at 71.8 -> 73.1 ms per step, PERFORMANCE.md). Capped by
    `max_draft_size`. Elsewhere (hf, a fixed row count, no fixed shape, the CPU kernels running: no padding,
    `engine.target.pads_rows`) g itself."""
    if (cfg.method not in DRAFTING_METHODS or cfg.method in HF_METHODS
            or not pads_rows(model, cfg.backend, cfg.fixed_shape, cfg.verify_rows, cfg.cpu_kernels)):
        return g
    edge = bucket_rows(g + 1, native_model(model).row_floor()) - 1
    cap = max_draft_size(cfg, model)
    return max(g, edge if cap is None else min(edge, cap))


def default_draft_size(cfg: SpecConfig, model, *, calibration: CalibrationSource | None = None,
                       with_source: bool = False) -> int | None | tuple[int | None, str | None]:
    """The draft size of cfg.method when `draft_size` is None: for every drafting method
    (`engine.config.DRAFTING_METHODS`: unispec, recycling, layerskip, eagle, pld, hf-prompt-lookup) the
    calibrated size of this model, device, dtype and config (UniSpec §3, App. F; `resolve_draft_size`),
    else the method's uncalibrated default with one warning naming the command that calibrates it:
    unispec a per-device FALLBACK_DRAFT_SIZE, recycling its whole static template, the others
    `DEFAULT_DRAFT_SIZE` (`engine.methods.MethodSpec.default_draft_size`); either at most the draft nodes one
    fixed-shape forward holds (`engine.target.max_tree_nodes`), then raised to its bucket's edge (`bucket_edge`). None for methods
    that draft nothing (ar). calibration: the records looked up (default this machine's cache,
    `engine.calibration.calibration_source`); with_source: return (g, its source as `resolve_config` names it)."""
    if cfg.method not in DRAFTING_METHODS:
        return (None, None) if with_source else None
    # the method's uncalibrated default; None (unispec): FALLBACK_DRAFT_SIZE[device type]
    fallback = method_spec(cfg.method).draft_size_default(cfg)
    g, source = resolve_draft_size_source(cfg, model, fallback=fallback, source=calibration)
    if model is not None and g is not None:
        cap = max_tree_nodes(model, cfg.backend, cfg.fixed_shape, cfg.verify_rows)
        g = g if cap is None else min(g, cap)                   # the rows a fixed-shape forward has
        g = bucket_edge(cfg, model, g)                          # the largest tree at that forward's cost
    return (g, source) if with_source else g


def max_context(model, info=None) -> int:
    if info is not None:
        return int(info.max_context)
    return int(model.config.get_text_config(decoder=True).max_position_embeddings)


def generate(model, prompt_ids, cfg: SpecConfig | None = None, *, method: str | None = None,
             tokenizer=None, info=None, drafter: Drafter | None = None, eos_ids=None,
             **overrides) -> GenerateResult:
    """Decode `cfg.max_new_tokens` tokens after prompt_ids [L] with `cfg.method`, losslessly.

    cfg: a SpecConfig (default: `SpecConfig.preset(method or "ar")`); overrides: SpecConfig fields. The run's
    config is `resolve_config(cfg, method, overrides, model)`: draft_size None becomes the method's default.
    drafter: a ready Drafter instead of `make_drafter(model, cfg)`. eos_ids: token ids that stop decoding
    (default: `engine.models.eos_token_ids` - generation config and tokenizer; [] = never stop early).
    """
    cfg = resolve_config(cfg, method, overrides, model)
    eos = eos_token_ids(model, tokenizer) if eos_ids is None else [int(e) for e in eos_ids]
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(device)    # [L]
    L, T = prompt.numel(), cfg.max_new_tokens
    if L == 0:
        raise ContextError("the prompt is empty — give at least one token (e.g. the BOS token)")
    rows = model.get_input_embeddings().num_embeddings
    lo, hi = torch.stack([prompt.min(), prompt.max()]).tolist()             # one host sync per prompt
    if lo < 0 or hi >= rows:
        raise ContextError(f"the prompt holds token ids outside the model's vocabulary [0, {rows}) (min {lo}, "
                           f"max {hi}) — encode it with the model's own tokenizer")
    ctx = max_context(model, info)
    if L + T > ctx:
        raise ContextError(f"prompt ({L}) + max_new_tokens ({T}) = {L + T} exceeds the model's context of "
                           f"{ctx} tokens — shorten the prompt or lower max_new_tokens")
    if cfg.method in HF_METHODS:
        if drafter is not None:
            raise HarnessError(f"{cfg.method} runs transformers' generate; it takes no drafter")
        return _generate_hf_prompt_lookup(model, prompt, cfg, eos)
    drafter = drafter if drafter is not None else make_drafter(model, cfg)
    with torch.inference_mode():
        return _decode(model, prompt, cfg, drafter, eos, ctx, device)


def _decode(model, prompt, cfg, drafter, eos, ctx, device) -> GenerateResult:
    L, T, K = prompt.numel(), cfg.max_new_tokens, cfg.record_topk
    eos_set = set(eos)
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    ids = torch.empty(L + T + 1, dtype=torch.long, device=device)    # committed ids + root
    ids[:L] = prompt
    records: list[StepRecord] | None = [] if cfg.record else None
    # a draft size over the largest fixed-shape bucket fails here, before the prefill, not at the first step
    nodes = max_tree_nodes(model, cfg.backend, cfg.fixed_shape, cfg.verify_rows)
    if nodes is not None and cfg.method in DRAFTING_METHODS and (cfg.draft_size or 0) > nodes:
        raise BackendError(rows_error(cfg.draft_size + 1, nodes + 1, cfg.verify_rows))

    t_start = _clock(device)
    target = make_target(model, cfg.backend, fixed_shape=cfg.fixed_shape, rows=cfg.verify_rows,
                         compile=cfg.compile, cuda_graphs=cfg.cuda_graphs, cpu_kernels=cfg.cpu_kernels)
    target.begin(L + T + 1)
    # the drafter sees logits at the prompt positions it names (`Drafter.prefill_rows`; every one by default),
    # or the last row alone where it says it does not use them
    wants = getattr(drafter, "uses_prefill_logits", True)
    topk = getattr(drafter, "prefill_topk", None) if wants else None      # only each row's top-K ids (MicroSpec)
    rows = drafter.prefill_rows(prompt) if wants and not topk and hasattr(drafter, "prefill_rows") else None
    hidden, logits = target.prefill(prompt, all_logits=wants and not topk, rows=rows)
    committed = L
    if cfg.greedy:
        first = logits[-1].argmax()
    else:
        first = sample_token(warp_probs(logits[-1], cfg.temperature, cfg.top_p), gen)
    ids[L] = first
    out = [int(first)]                                           # host sync: the first token (stop test)
    top_rows = prefill_topk(model, hidden, K) if cfg.record else None      # [L, K]
    prefill_ids = head_topk(target.head, hidden, topk) if topk else None    # [L, topk]
    t_prefill = _clock(device)
    prefill_s = t_prefill - t_start

    drafter.begin(prompt, PrefillTopK(prefill_ids) if topk else logits, hidden)
    del hidden, logits
    draft_s = begin_s = _clock(device) - t_prefill
    verify_s, steps, num_draft = 0.0, 1, 0
    bins_proposed = torch.zeros(SCORE_BINS, dtype=torch.long, device=device)
    bins_accepted = torch.zeros(SCORE_BINS, dtype=torch.long, device=device)
    stop = "eos" if out[0] in eos_set else None
    sizes = [1]                                                  # step_sizes: the prefill's token
    while stop is None and len(out) < T:
        t0 = _clock(device)
        tree = drafter.propose(ids[:L + len(out)])
        _check_tree(tree, out[-1], drafter)
        n = tree.size
        if committed + n > ctx:
            raise ContextError(f"draft tree of {n} nodes after {committed} cached tokens exceeds the model's "
                               f"context of {ctx} — lower draft_size or "
                               f"max_new_tokens")
        t1 = _clock(device)
        tokens = tree.tokens.to(device, non_blocking=True)     # [n]
        parents = tree.parents.to(device, non_blocking=True)   # [n]
        depths, anc = tree_layout(tree.parents)                # on the host, where the tree was built
        depths, anc = depths.to(device, non_blocking=True), anc.to(device, non_blocking=True)
        hidden, logits = target.forward_tree(tokens, parents, depths, anc)
        if cfg.greedy:
            accepted, new_tokens = verify_greedy(tokens, parents, logits, anc, depths)
        else:
            accepted, new_tokens = verify_sampling(
                tokens, parents, logits, temperature=cfg.temperature, top_p=cfg.top_p, generator=gen,
                draft_probs=None if tree.draft_probs is None else tree.draft_probs.to(device),
                scores=tree.scores)
        acc, new = torch.stack([accepted, new_tokens]).tolist()  # the one sync per step: accept length
                                                                 # and committed tokens (stop test, drafter)
        committed = target.compact(n, acc)
        if n > 1:                                                # acceptance by confidence, on the device
            b = score_bins(tree.scores[1:].to(device, non_blocking=True))
            bins_proposed.scatter_add_(0, b, torch.ones_like(b))
            hit = b[accepted[1:] - 1]
            bins_accepted.scatter_add_(0, hit, torch.ones_like(hit))
        t2 = _clock(device)
        verify_s += t2 - t1
        steps += 1
        num_draft += n - 1
        if records is not None:
            topk = logits[accepted].topk(min(K, logits.shape[-1]), dim=-1).indices.cpu().numpy()
            records.append(StepRecord(tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist(),
                                      acc, new, topk))
        keep = new[:T - len(out)]
        hit = next((j for j, t in enumerate(keep) if t in eos_set), None)
        if hit is not None:
            keep, stop = keep[:hit + 1], "eos"
        ids[L + len(out): L + len(out) + len(keep)] = new_tokens[:len(keep)]
        out.extend(keep)
        sizes.append(len(keep))
        # new_tokens: the kept ones (the last step may be cut at an eos or max_new_tokens), so a drafter's
        # coverage counts generated tokens only; nothing is drafted after a cut step
        drafter.observe(StepResult(tree=tree, logits=logits, hidden=hidden, accepted=accepted,
                                   new_tokens=new_tokens[:len(keep)]))
        draft_s += (t1 - t0) + (_clock(device) - t2)
    wall_s = _clock(device) - t_start
    method = cfg.method if drafter.name in ("base", cfg.method) else drafter.name   # a hand-made drafter
    return GenerateResult(method=method, prompt_ids=prompt.cpu(), output_ids=torch.tensor(out[:T]),
                          steps=steps, wall_s=wall_s, prefill_s=prefill_s, draft_s=draft_s, verify_s=verify_s,
                          draft_tokens=num_draft, begin_s=begin_s, stop_reason=stop or "max_new_tokens",
                          drafter_timings=dict(drafter.timings()), records=records, prefill_topk=top_rows,
                          drafter_stats=dict(drafter.stats()) if hasattr(drafter, "stats") else {},
                          score_bins_proposed=bins_proposed.tolist(), score_bins_accepted=bins_accepted.tolist(),
                          step_sizes=sizes)


def score_bins(scores: torch.Tensor) -> torch.Tensor:
    """[n] confidence scores -> [n] int64 bin indices in [0, SCORE_BINS) (fp32 arithmetic, any device)."""
    return (scores.float().clamp(0.0, 1.0) * SCORE_BINS).long().clamp_(max=SCORE_BINS - 1)


def _check_tree(tree: DraftTree, root: int, drafter: Drafter) -> None:
    if not isinstance(tree, DraftTree):
        raise HarnessError(f"{type(drafter).__name__}.propose returned {type(tree).__name__}, not a DraftTree")
    if tree.tokens.device.type == "cpu" and int(tree.tokens[0]) != root:     # no sync: host tensor
        raise HarnessError(f"{type(drafter).__name__}.propose returned a tree rooted at token "
                           f"{int(tree.tokens[0])}, but the root must be the last committed token {root}")


# --- transformers' prompt lookup, the outside anchor -----------------------------------------------------

def _generate_hf_prompt_lookup(model, prompt, cfg, eos) -> GenerateResult:
    """transformers' `generate(prompt_lookup_num_tokens=...)`, greedy; steps = target forwards (hook).

    transformers has no separate prefill: its first forward runs the prompt plus the first draft, so
    prefill_s is that forward's time; verify_s sums the others; draft_s is the remainder of wall_s.
    """
    if not cfg.greedy:
        raise HarnessError("hf-prompt-lookup is greedy only (transformers' prompt lookup is a greedy "
                           "baseline here) — use temperature=0")
    device = prompt.device
    times: list[float] = []
    starts: list[float] = []
    lengths: list[int] = []                                      # tokens fed to each forward
    firsts: list[int | None] = []                                # the position of each forward's first token

    def pre_hook(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(0 if x is None else int(x.shape[-1]))
        pos = kwargs.get("position_ids")
        firsts.append(None if pos is None else int(pos.reshape(-1)[0]))
        starts.append(_clock(device))

    def post_hook(module, args, kwargs, output):
        times.append(_clock(device) - starts[-1])

    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = list(eos) if eos else None
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.prompt_lookup_num_tokens = cfg.require_draft_size()
    gc.max_new_tokens, gc.min_new_tokens = cfg.max_new_tokens, 0
    gc.max_length = None
    h1 = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    h2 = model.register_forward_hook(post_hook, with_kwargs=True)
    try:
        t0 = _clock(device)
        with torch.inference_mode():
            seq = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                 generation_config=gc)
        wall_s = _clock(device) - t0
    finally:
        h1.remove()
        h2.remove()
    out = seq[0, prompt.numel():].cpu()
    hit = (out[:, None] == torch.tensor(eos or [-1])[None]).any(1).nonzero()
    stop = "eos" if hit.numel() and int(hit[0]) == out.numel() - 1 else "max_new_tokens"
    # draft tokens: what each forward fed beyond its root (the first forward: beyond the prompt)
    num_draft = sum(lengths[1:]) - len(lengths[1:]) + (lengths[0] - prompt.numel() if lengths else 0)
    # step sizes: forward k (k >= 1) starts at the position of the last committed token, so the committed
    # length grows by the difference of consecutive starts; the last forward commits up to the output's end
    sizes = None
    if firsts and None not in firsts:
        ends = [f + 1 for f in firsts[1:]] + [prompt.numel() + out.numel()]
        sizes = [b - a for a, b in zip([prompt.numel()] + ends[:-1], ends)]
    return GenerateResult(method=cfg.method, prompt_ids=prompt.cpu(), output_ids=out, steps=len(times),
                          wall_s=wall_s, prefill_s=times[0] if times else 0.0,
                          draft_s=wall_s - sum(times), verify_s=sum(times[1:]), draft_tokens=num_draft,
                          stop_reason=stop, step_sizes=sizes)
