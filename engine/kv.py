"""The target's KV cache during tree verification: creation, tree attention masks, compaction.

The harness keeps a transformers `DynamicCache` whose committed part holds exactly the committed tokens
(prompt + accepted tokens, the root excluded). One step appends the n tree nodes; `compact` then keeps
the committed prefix plus the accepted path and drops the rest (tree attention: Miao et al. 2024, as
in UniSpec §2).

Layer types of transformers 5.23's `DynamicCache` handled here:
- `DynamicLayer` (full attention): keys [1, h, P, d] hold every committed token.
- `DynamicSlidingWindowLayer` (Gemma 3's local layers; Qwen2/3 with `use_sliding_window`): keeps only the
  last W-1 committed tokens. `new_cache` switches on its past recording so a tree forward cannot push
  committed entries out before we know which nodes survive; `compact` trims it back to W-1 afterwards.
Other layer types (indexed, chunked, linear attention, KV sharing) raise `CacheError`.

Masks (`tree_attention_masks`): one additive float mask per layer type, [1, 1, n, kv_len] where kv_len is
what that layer type will attend over (its `get_mask_sizes`): committed columns visible to every tree
row (within the sliding window for local layers), tree columns visible iff ancestor-or-self.
Position ids are P + depth (siblings share a position).

Attention implementations: only those that apply a custom 4D mask can verify a tree - `sdpa` and `eager`
(`TREE_MASK_ATTENTION`). Flash-attention builds its own causal mask from the sequence and ignores ours,
so it would verify every node as if the tree were one chain; `new_cache` refuses such models before any
forward runs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
TREE_MASK_ATTENTION = ("sdpa", "eager")       # attention implementations that honour a 4D tree mask


class CacheError(RuntimeError):
    """The KV cache cannot be used for tree verification; the message says why and what to do."""


class AttentionImplementationError(CacheError):
    """The model's attention implementation ignores the 4D tree mask; the message says how to switch."""


def check_attention(config) -> None:
    """Raise unless the model's attention applies a custom 4D mask (`TREE_MASK_ATTENTION`)."""
    cfgs = [config]
    if hasattr(config, "get_text_config"):
        cfgs.append(config.get_text_config(decoder=True))
    for c in cfgs:
        impl = getattr(c, "_attn_implementation", None)
        if impl is not None and impl not in TREE_MASK_ATTENTION:
            raise AttentionImplementationError(
                f"the model's attention implementation is {impl!r}, which ignores the custom 4D attention mask "
                f"that tree verification passes (it would verify a tree as one chain) — use one of "
                f"{list(TREE_MASK_ATTENTION)}: load with attn_implementation='sdpa' (engine.models.load_model "
                f"does) or call model.set_attn_implementation('sdpa')")


def layer_types(config) -> list[str]:
    """Attention type of every decoder layer ("full_attention" when the config does not say)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            types = ["sliding_attention"] * cfg.num_hidden_layers
        else:
            types = ["full_attention"] * cfg.num_hidden_layers
    bad = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if bad:
        raise CacheError(f"layer type(s) {bad} are not supported by tree verification (supported: "
                         f"{list(SUPPORTED_LAYER_TYPES)}) — use a model with full or sliding-window attention")
    return list(types)


def new_cache(model) -> DynamicCache:
    """An empty cache laid out like the model's own (sliding layers where the config has them). Refuses a
    model whose attention ignores the tree mask (`check_attention`)."""
    check_attention(model.config)
    types = layer_types(model.config)
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(types):
        raise CacheError(f"DynamicCache built {len(cache.layers)} layers for a {len(types)}-layer model — "
                         f"this transformers version lays caches out differently than engine.kv expects")
    for layer, t in zip(cache.layers, types):
        expected = DynamicSlidingWindowLayer if t == "sliding_attention" else DynamicLayer
        if type(layer) is not expected:
            raise CacheError(f"cache layer {type(layer).__name__} for a {t} layer — engine.kv handles "
                             f"DynamicLayer and DynamicSlidingWindowLayer only")
        if t == "sliding_attention":
            layer.activate_past_recording()                      # keep tree entries until `compact`
    return cache


def sliding_window(config) -> int | None:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(cfg, "sliding_window", None)


def tree_attention_masks(model, cache: DynamicCache, committed: int, depths: torch.Tensor,
                         anc: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive masks for a tree forward over a cache holding `committed` tokens.

    depths [n], anc [n, n] (from `engine.verify.tree_layout`). Returns one [1, 1, n, kv_len] tensor when
    every layer is full attention, else {layer type: mask} (the form Gemma 3 / Qwen accept).
    """
    check_attention(model.config)
    types = layer_types(model.config)
    dtype = model.dtype
    neg = torch.finfo(dtype).min
    n = depths.numel()
    dev = depths.device
    q_pos = committed + depths                                   # [n] RoPE position of every node
    masks = {}
    for t in dict.fromkeys(types):                               # each type once, in layer order
        layer = cache.layers[types.index(t)]
        kv_len, kv_off = layer.get_mask_sizes(n)
        slot = kv_off + torch.arange(kv_len, device=dev)         # [kv_len] absolute cache slot of each column
        in_tree = slot >= committed
        node = (slot - committed).clamp(min=0)                   # [kv_len] tree node of tree columns
        k_pos = torch.where(in_tree, committed + depths[node.clamp(max=n - 1)], slot)   # [kv_len]
        allowed = torch.where(in_tree[None, :], anc[:, node.clamp(max=n - 1)], True)    # [n, kv_len]
        if t == "sliding_attention":
            allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window(model.config)
        masks[t] = torch.zeros(n, kv_len, dtype=dtype, device=dev).masked_fill(~allowed, neg)[None, None]
    if set(masks) == {"full_attention"}:
        return masks["full_attention"]
    return masks


def compact(cache: DynamicCache, committed: int, num_new: int, keep: list[int] | None) -> int:
    """Keep the committed prefix plus new entries `keep`; returns the new committed length.

    committed: tokens in the cache before the forward that appended `num_new` entries (the tree, or the
    prompt at prefill). keep: ascending indices into those entries (the accepted path), None = all.
    Sliding-window layers are trimmed back to their last W-1 entries.
    """
    keep_n = num_new if keep is None else len(keep)
    prefix = keep is None or keep == list(range(keep_n))         # a chain's accepted path needs no copy
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            raise CacheError(f"cache layer {i} was never written — run the prefill before compacting")
        stored = layer.keys.shape[-2]
        old = stored - num_new                                   # entries before the forward
        if isinstance(layer, DynamicSlidingWindowLayer):
            if layer.cumulative_length != committed + num_new:
                raise CacheError(f"sliding layer {i} has seen {layer.cumulative_length} tokens, expected "
                                 f"{committed + num_new} — the cache is out of step with the harness")
        elif old != committed:
            raise CacheError(f"layer {i} holds {stored} entries, expected {committed + num_new} — "
                             f"the cache is out of step with the harness")
        for name in ("keys", "values"):
            t = getattr(layer, name)                             # [1, h, stored, d]
            if not prefix:
                idx = torch.as_tensor(keep, dtype=torch.long, device=t.device) + old
                t[:, :, old:old + keep_n] = t.index_select(2, idx)   # gather first, then write: no aliasing
            t = t[:, :, :old + keep_n]
            if isinstance(layer, DynamicSlidingWindowLayer):
                t = t[:, :, -(layer.sliding_window - 1):]
            setattr(layer, name, t)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = committed + keep_n
    return committed + keep_n
