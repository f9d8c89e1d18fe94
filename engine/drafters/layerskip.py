"""`layerskip`: training-free self-drafting from a subset of the target's own layers.

The drafter runs the target's own modules - token embedding (Gemma's scaled embedding included), the
decoder layers chosen by `cfg.drafter_layers`, the final norm - and then the target's LM head through a
vocabulary policy (`engine.vocab`). Nothing is copied: the drafter holds references to the target's
layer modules and calls them with its own KV cache (`DraftKVCache`), its own position embeddings (per
layer type: Gemma 3's local layers use the local RoPE) and its own attention masks (sliding-window
layers see only the last `sliding_window` positions).

Where the target's forward runs natively (`cfg.backend`, `engine.target.resolve_backend`), the partial stack
runs on `engine.native` too: `NativeModel.forward(layer_ids=...)` over the same packed weights, with a
static KV cache of one entry per kept layer (`NativeDraftKV`), so a draft level costs the kept layers'
GEMMs and little else. On the hf backend it calls the target's own layer modules.

`drafter_layers` forms (target layer indices, 0-based):
    skip:12,14,16,18   every layer but these (the default, for SmolLM2-135M's 30 layers)
    first:15           layers 0..14
    every:2            layers 0, 2, 4, ...
    keep:0,1,5         exactly these
    all                every layer: the drafter is the target (self-speculation; every greedy draft is accepted)

Per step: the committed tokens the cache lacks are fed (the root and whatever of the accepted path was
not compacted), then the EAGLE-2 tree (`engine.drafters.lmhead`). After verification the accepted path's
tree rows that the backbone ran are compacted into the committed context (their KV was computed with
exactly the attention they would get as context: committed tokens + ancestors), the rest is dropped.
"""

from __future__ import annotations

import inspect

import torch

from specvocab.engine.drafters import register_drafter
from specvocab.engine.drafters.lmhead import DraftKVCache, DrafterError, Expansion, LMHeadDrafter, attention_bias
from specvocab.engine.methods import SAMPLING, TARGET, TREE, MethodSpec, eagle_candidates
from specvocab.engine.native import NativeModel
from specvocab.engine.target import cache_kwarg, native_model, resolve_backend
from specvocab.engine.tree import StepResult

# the method's description (engine.methods: read from this source without importing it); its drafter: LayerSkipDrafter.
# Uncalibrated g: 59 = EAGLE-2's 60 draft tokens (MicroSpec §4.1, FR-Spec §4.1) minus the root; cap: EAGLE-2's
# candidates at the config's depth and top-k.
METHOD = MethodSpec("layerskip", order=60, lm_head=True, default_draft_size=59, max_draft_size=eagle_candidates,
                    calibration_fields=(*SAMPLING, *TARGET, *TREE, "drafter_layers", "vocab"))


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """The kept target layers of a `drafter_layers` spec (see the module docstring)."""
    spec = spec.strip()
    forms = "skip:i,j,..., keep:i,j,..., first:n, every:s or all"
    kind, _, arg = spec.partition(":")
    try:
        if kind == "all" and not arg:
            kept = list(range(num_layers))
        elif kind in ("skip", "keep"):
            ids = [int(x) for x in arg.split(",") if x.strip()]
            bad = [i for i in ids if not 0 <= i < num_layers]
            if bad:
                raise DrafterError(f"drafter_layers={spec!r} names layer(s) {bad}, but the target has layers "
                                   f"0..{num_layers - 1}")
            kept = [i for i in range(num_layers) if i not in ids] if kind == "skip" else sorted(set(ids))
        elif kind == "first":
            n = int(arg)
            if not 1 <= n <= num_layers:
                raise DrafterError(f"drafter_layers={spec!r}: first:n needs 1 <= n <= {num_layers}")
            kept = list(range(n))
        elif kind == "every":
            s = int(arg)
            if s < 1:
                raise DrafterError(f"drafter_layers={spec!r}: every:s needs s >= 1")
            kept = list(range(0, num_layers, s))
        else:
            raise DrafterError(f"drafter_layers={spec!r} is not understood — use {forms}")
    except ValueError as e:
        if isinstance(e, DrafterError):
            raise
        raise DrafterError(f"drafter_layers={spec!r}: layer numbers must be integers — use {forms}") from None
    if not kept:
        raise DrafterError(f"drafter_layers={spec!r} keeps no layer of the target's {num_layers} — keep at least one")
    return kept


def decoder_of(model):
    dec = model.model if hasattr(model, "model") else model.get_decoder()
    for name in ("layers", "norm", "embed_tokens"):
        if not hasattr(dec, name):
            raise DrafterError(f"{type(model).__name__} has no decoder with `{name}` — layerskip/eagle support "
                               f"decoder-only transformers models laid out like Llama, Qwen and Gemma 3")
    return dec


def text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def rotary_for(rotary, hidden: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
    """(cos, sin) for one layer type; Gemma 3's rotary module takes the layer type, Llama/Qwen's do not."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(hidden, position_ids, layer_type)
    return rotary(hidden, position_ids)


@register_drafter("layerskip")
class LayerSkipDrafter(LMHeadDrafter):
    name = "layerskip"

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        cfg.require_draft_size()                     # fail before building: the harness resolves it
        dec = decoder_of(target)
        tcfg = text_config(target)
        n = len(dec.layers)
        self.layer_ids = parse_layers(cfg.drafter_layers, n)
        self.layers = [dec.layers[i] for i in self.layer_ids]       # the target's own modules
        self.embed = target.get_input_embeddings()
        self.norm = dec.norm
        self.rotary = dec.rotary_emb
        types = getattr(tcfg, "layer_types", None) or ["full_attention"] * n
        self.layer_types = [types[i] for i in self.layer_ids]
        self.sliding_window = getattr(tcfg, "sliding_window", None)
        self.head_weight = target.get_output_embeddings().weight    # [V, d]
        self.softcap = getattr(tcfg, "final_logit_softcapping", None)
        self.dtype = self.head_weight.dtype
        self._make_policy()
        self.net = native_model(target) if resolve_backend(target, cfg.backend) == "native" else None
        self.cache_kw = cache_kwarg(self.layers[0])                  # hf path: `cache` (transformers >= 5.24)
        self.cache = self._new_cache(256)
        self.n_ctx = 0                                               # committed tokens in the cache

    def _new_cache(self, capacity: int):
        if self.net is not None:
            return NativeDraftKV(self.net, self.layer_ids, capacity)
        return DraftKVCache(self.layer_ids, capacity=capacity)

    # backbone ---------------------------------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """tokens [q], positions [q], visible [q, length + q] bool -> normed hidden [q, d]; appends q rows."""
        q = tokens.numel()
        self.cache.reserve(q, tokens.device)
        if self.net is not None:
            return self.cache.run(tokens, positions, visible)
        x = self.embed(tokens[None])                                 # [1, q, d]
        pos = positions[None]                                        # [1, q]
        kv_pos = torch.cat([self.cache.positions[: self.cache.length].to(positions.device), positions])
        pe, masks = {}, {}
        for t in set(self.layer_types):
            pe[t] = rotary_for(self.rotary, x, pos, t)
            window = self.sliding_window if t == "sliding_attention" else None
            masks[t] = attention_bias(positions, kv_pos, visible, x.dtype, window)
        for layer, t in zip(self.layers, self.layer_types):
            out = layer(x, attention_mask=masks[t], position_ids=pos, **{self.cache_kw: self.cache},
                        position_embeddings=pe[t], use_cache=True)
            x = out[0] if isinstance(out, tuple) else out
        self.cache.advance(q, positions)
        return self.norm(x)[0]                                       # [q, d]

    def _feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append committed tokens (causal over the cached context); returns their hidden states."""
        q, p0 = tokens.numel(), self.cache.length
        positions = torch.arange(p0, p0 + q, device=tokens.device)
        visible = torch.ones(q, p0 + q, dtype=torch.bool, device=tokens.device)
        visible[:, p0:] = torch.tril(visible[:, p0:])
        h = self._run(tokens, positions, visible)
        self.n_ctx = self.cache.length
        return h

    def _backbone_begin(self, prompt_ids, prefill_hidden):
        self.cache = self._new_cache(max(256, 2 * prompt_ids.numel()))
        self.n_ctx = 0
        self._feed(prompt_ids)

    def _catch_up(self, ids):
        self.cache.crop(self.n_ctx)                                  # drop any tree rows left over
        if ids.numel() <= self.n_ctx:
            raise DrafterError(f"propose got {ids.numel()} committed ids but the drafter already holds "
                               f"{self.n_ctx} — call begin() for a new prompt")
        return self._feed(ids[self.n_ctx:])[-1:]                     # [1, d] at the root

    def _forward_tree(self, tokens, parent_h, tree_mask, depth):
        r = tokens.numel()
        positions = torch.full((r,), self.n_ctx - 1 + depth, dtype=torch.long, device=tokens.device)
        visible = torch.cat([torch.ones(r, self.n_ctx, dtype=torch.bool, device=tokens.device), tree_mask], dim=1)
        return self._run(tokens, positions, visible)

    def _after_step(self, step: StepResult, expansion: Expansion | None) -> None:
        if expansion is None:
            self.cache.crop(self.n_ctx)
            return
        # The accepted path's leading nodes that the backbone ran keep their KV rows (host: a few ints).
        rows = expansion.tree_row[step.accepted.to(expansion.tree_row.device)[1:]].tolist()
        keep = []
        for r in rows:
            if r < 0:
                break
            keep.append(self.n_ctx + r)
        self.cache.keep_rows(self.n_ctx, torch.tensor(keep, dtype=torch.long, device=self.device))
        self.n_ctx = self.cache.length


class NativeDraftKV:
    """`DraftKVCache`'s bookkeeping (reserve / advance / crop / keep_rows, slot positions) over a native
    `StaticKV` with one entry per kept layer: the layer-skip drafter's cache on the native backend. Slots
    [0, length) are live: the committed context, then this step's tree rows (which hold positions other
    than their slot index, hence `positions`)."""

    def __init__(self, net: NativeModel, layer_ids: list[int], capacity: int):
        self.net = net
        self.layer_ids = list(layer_ids)
        self.kv = net.new_cache(capacity, layers=len(self.layer_ids))
        self.positions = torch.zeros(capacity, dtype=torch.long, device=net.device)

    @property
    def length(self) -> int:
        return self.kv.committed

    def reserve(self, q: int, device) -> None:
        need = self.length + q
        if need > self.kv.capacity:
            cap = max(need, 2 * self.kv.capacity)
            self.kv.grow(cap)
            self.net.rope_tables(cap)
            pos = torch.zeros(cap, dtype=torch.long, device=self.positions.device)
            pos[:self.positions.numel()] = self.positions
            self.positions = pos

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The kept layers over q new rows (visible [q, length + q]); appends them. -> normed hidden [q, d]."""
        self.net.rope_tables(int(positions.max()) + 1)
        h = self.net.forward(tokens, positions, self.kv, visible, layer_ids=self.layer_ids,
                             key_positions=self.positions[:self.length])
        self.advance(tokens.numel(), positions)
        return h

    def advance(self, q: int, positions: torch.Tensor) -> None:
        self.positions[self.length:self.length + q] = positions.to(self.positions.device)
        self.kv.committed += q

    def crop(self, n: int) -> None:
        self.kv.committed = min(self.kv.committed, n)

    def keep_rows(self, n_ctx: int, rows: torch.Tensor) -> None:
        """As `DraftKVCache.keep_rows`: the context [0, n_ctx), then the given slots (ascending, >= n_ctx)."""
        m = rows.numel()
        self.kv.committed = n_ctx
        if m:
            keep = (rows.to(self.positions.device) - n_ctx).tolist()
            self.positions[n_ctx:n_ctx + m] = self.positions[rows.to(self.positions.device)]
            self.kv.compact(m, keep)
