"""`eagle`: an EAGLE-1/2 draft head (one decoder layer over fc([token embedding; target feature])).

The head predicts the target's next feature from pairs (f_i, x_{i+1}): f_i is the target's last hidden
state at position i (after its final norm: the input of its LM head, `StepResult.hidden`,
`prefill_hidden`) and x_{i+1} the token that followed. The pair for position i runs at position id i:

    x = fc([embed(x_{i+1}); f_i])        fc: Linear(2d -> d), bias unless config.json says "bias": false
    h = decoder_layer(x)                 a Llama decoder layer without input_layernorm (index 0)
    logits = W_head h                    the target's LM head (no norm in between), via a vocab policy

In the draft tree a node's feature is the head's own output at its parent. After each step the head's
tree rows are dropped and the accepted path is re-run with the target's features (they differ from
the drafted ones), as EAGLE does.

Checkpoints (`cfg.eagle_head`): a hub id or a local directory in the official EAGLE-1/2 layout - a
Llama-style `config.json` (num_hidden_layers 1; optional `bias`, `qkv_bias`) and `pytorch_model.bin` or
`*.safetensors` (possibly sharded) with keys `fc.weight`, `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.*`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight` and, in most
releases, `embed_tokens.weight` (used when present; else the target's input embedding). `"random"` builds
a randomly initialised head shaped after the target (tests). EAGLE-3 heads (three-layer features,
their own small vocabulary) are a different layout, rejected here and read by `engine.drafters.eagle3`, which
shares this module's tree and cache machinery (`EagleTreeDrafter`).

Embedding scale: EAGLE's code (cnets1.py) and SGLang embed with a plain table lookup. Gemma's
`get_input_embeddings()` multiplies by sqrt(d) (~25 at d = 640), and the package trains and drafts through it,
so a head trained here on Gemma expects embeddings ~25x larger than the raw table (`EagleHead.embed_scale`).
`save_eagle_head` folds that scale into fc's token half, so the exported head is right for a raw lookup, and
`load_eagle_head` divides it out again, so the package's own drafting does not change. A head with scale 1
(every official checkpoint) is drafted with the raw lookup here too.

Shipped heads: `engine/heads/<model>/` holds a head trained by `python -m specvocab.engine.jobs.train_eagle` for each offline model
(its model card says on what, how long and with which tau). `eagle_head=None` resolves to the shipped head
whose target LM head matches the model's (`default_eagle_head`, called where the run's config is resolved);
`"specvocab:<model>"` names one explicitly. A head saved by `save_eagle_head` records its target's name and
LM-head fingerprint in config.json (`specvocab` block), so loading it for another model fails clearly.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specvocab.engine.artifacts import FINGERPRINT_KEY, atomic_write, head_fingerprint, head_matches, save_safetensors
from specvocab.engine.drafters import register_drafter
from specvocab.engine.catalog import SHIPPED_PREFIX, shipped_heads
from specvocab.engine.drafters.lmhead import DraftKVCache, DrafterError, Expansion, LMHeadDrafter, attention_bias
from specvocab.engine.drafters.layerskip import text_config
from specvocab.engine.methods import SAMPLING, TARGET, TREE, MethodSpec, eagle_candidates
from specvocab.engine.target import cache_kwarg
from specvocab.engine.vocab.dynaspec import drafter_key as dynaspec_drafter_key
from specvocab.engine.tree import StepResult
from specvocab.kernels import cpu as cpu_kernels
from specvocab.engine.native import BLOCK, TAIL_BLOCKS

# the method's description (engine.methods: read from this source without importing it); its drafter: EagleDrafter.
# Uncalibrated g: 59 = EAGLE-2's 60 draft tokens (MicroSpec §4.1, FR-Spec §4.1) minus the root; cap: EAGLE-2's
# candidates at the config's depth and top-k.
METHOD = MethodSpec("eagle", order=70, lm_head=True, default_draft_size=59, max_draft_size=eagle_candidates,
                    calibration_fields=(*SAMPLING, *TARGET, *TREE, "eagle_head", "vocab"))

FUSED_CHUNK = 32      # rows of a causal run (the prompt) per fused call: the kernel reads a row's last 2 BLOCKs by slot

_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act", "head_dim")


class EagleHead(nn.Module):
    """The EAGLE-1/2 draft network. State-dict keys match the official checkpoints."""

    def __init__(self, config, *, bias: bool = True, qkv_bias: bool = False, with_embedding: bool = False):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()                     # EAGLE's layer 0 has no input norm
        if qkv_bias:                                              # Qwen2-based heads: q/k/v with bias, o without
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if with_embedding else None
        # the scale of the token embeddings fc expects, relative to the raw embedding table: 1 for EAGLE's own
        # heads (cnets1.py: a plain nn.Embedding lookup); sqrt(d) for a head trained here on a Gemma target,
        # whose `get_input_embeddings()` scales (module docstring, "Embedding scale")
        self.embed_scale = 1.0

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features


def llama_config(values: dict):
    kept = {k: values[k] for k in _CONFIG_KEYS if values.get(k) is not None}
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in kept]
    if missing:
        raise DrafterError(f"the EAGLE config.json lacks {missing} — it must be a Llama-style config of the draft head")
    cfg = LlamaConfig(num_hidden_layers=1, **kept)
    cfg._attn_implementation = "sdpa"
    return cfg


def random_eagle_head(target, seed: int = 0) -> EagleHead:
    """A randomly initialised head shaped after the target (hidden size, heads, vocab, RoPE base)."""
    t = text_config(target)
    d = t.hidden_size
    heads = t.num_attention_heads if d % t.num_attention_heads == 0 else 1
    kv = t.num_key_value_heads if heads % t.num_key_value_heads == 0 else heads
    rope = getattr(t, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if isinstance(rope, dict) and "full_attention" in rope:       # Gemma 3: per-layer-type RoPE
        theta = rope["full_attention"].get("rope_theta")
    cfg = llama_config(dict(hidden_size=d, intermediate_size=t.intermediate_size, num_attention_heads=heads,
                             num_key_value_heads=kv, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
                             rope_theta=theta or 10000.0, max_position_embeddings=t.max_position_embeddings,
                             vocab_size=t.vocab_size))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(cfg, bias=True)
        for name, p in head.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif "norm" not in name:
                nn.init.zeros_(p)
    head.embed_scale = embed_scale(target)          # trained and drafted through get_input_embeddings()
    return head


def embed_scale(target) -> float:
    """The factor the target's `get_input_embeddings()` multiplies its table rows by: sqrt(d) for Gemma
    (`Gemma3TextScaledWordEmbedding`, as a Python float: the value of an fp32 model), else 1."""
    emb = target.get_input_embeddings()
    scale = getattr(emb, "scalar_embed_scale", None)
    if scale is None and getattr(emb, "embed_scale", None) is not None:
        scale = float(emb.embed_scale)
    return float(scale) if scale is not None else 1.0


def head_digest(head: EagleHead) -> str:
    """sha256 (16 hex digits) of a head's weights (fp32, the embedding table and RoPE buffers left out) and its
    embedding scale: what names the drafter a DynaSpec router was trained on (a head retrained into the same
    folder gets another digest). Cached on the head; recomputed when its weights change in place is not
    tracked, so training code must not rely on it."""
    # an EAGLE-3 head (engine.drafters.eagle3) has no embed_scale: its lm_head, d2t and t2d are hashed with the rest
    scale = getattr(head, "embed_scale", None)
    digest = hashlib.sha256(f"embed_scale={scale!r}".encode() if scale is not None else b"eagle3")
    for name, t in sorted(head.state_dict().items()):
        if name.startswith(("rotary_emb.", "embed_tokens.")):
            continue
        digest.update(name.encode())
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def resolve_head_dir(source: str, field: str = "eagle_head", layout: str = "EAGLE-1/2",
                     shipped: dict[str, Path] | None = None) -> Path:
    """The local directory of a checkpoint named by a `specvocab:` name (one of `shipped`, default the
    EAGLE-1/2 heads), a path or a hub id (downloaded)."""
    if source.startswith(SHIPPED_PREFIX):
        name = source[len(SHIPPED_PREFIX):]
        shipped = shipped_heads() if shipped is None else shipped
        if name not in shipped:
            raise DrafterError(f"{field}={source!r}: no {layout} head ships for {name!r} — shipped: "
                               f"{[SHIPPED_PREFIX + n for n in shipped] or 'none'}")
        return shipped[name]
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(source, allow_patterns=["config.json", "*.bin", "*.safetensors", "*.json"]))
    except Exception as e:   # offline, unknown repo, auth: all end here
        raise DrafterError(f"{field}={source!r} is neither a local directory nor a downloadable hub repo "
                           f"({type(e).__name__}: {e}) — download the {layout} checkpoint where a hub is reachable "
                           f"and pass its local directory") from None


_STATE_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}    # the last checkpoint read: a bench builds a drafter
                                                           # per prompt, and a GPU-sized head is ~1 GB of reads


def read_state_dict(path: Path, layout: str = "EAGLE-1/2") -> dict[str, torch.Tensor]:
    # model*.safetensors (sharded or not); other .safetensors beside a head (a DynaSpec fit for it) are not its weights
    files = (sorted(path.glob("model*.safetensors"))
             or [f for f in sorted(path.glob("*.safetensors")) if not f.name.startswith("dynaspec")]
             or sorted(path.glob("pytorch_model*.bin")))
    if not files:
        raise DrafterError(f"{path} holds no *.safetensors or pytorch_model*.bin — an {layout} checkpoint "
                           f"directory has config.json plus pytorch_model.bin or model.safetensors")
    key = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    if key in _STATE_CACHE:
        return dict(_STATE_CACHE[key])
    state = {}
    for f in files:
        if f.suffix == ".safetensors":
            state.update(load_file(str(f)))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    _STATE_CACHE.clear()
    _STATE_CACHE[key] = state
    return dict(state)


def eagle_config_dict(head: EagleHead) -> dict:
    """The Llama-style config.json of a head, as the official EAGLE-1/2 checkpoints write it."""
    c = head.config
    rope = getattr(c, "rope_parameters", None) or {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0),
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "hidden_act": c.hidden_act, "bias": head.fc.bias is not None, "torch_dtype": "float32"}


def save_eagle_head(head: EagleHead, folder: str | Path, *, target_name: str, target_weight: torch.Tensor,
                    training: dict | None = None, dtype: torch.dtype = torch.float32,
                    embed_tokens: torch.Tensor | None = None) -> Path:
    """Write `folder/config.json` + `folder/model.safetensors` in the EAGLE-1/2 layout (official tensor names:
    fc.*, layers.0.*), as a pair. config.json carries a `specvocab` block: the target's name, vocabulary, hidden
    size and LM-head fingerprint (`FINGERPRINT_KEY`), and `training`.

    - Portable: a head trained on scaled embeddings (`head.embed_scale` s != 1, Gemma's sqrt(d)) is written with
      s folded into the token half of fc, fc.weight[:, :d] * s (fc's input is [embed(x); f], embedding first),
      so that EAGLE's code and SGLang, which embed with a plain table lookup, compute the same fc output;
      the block records `embed_scale_folded: s` and `load_eagle_head` divides it out again. A folded
      fc.weight is stored in fp32 whatever `dtype` (its rounding would otherwise change the head's output).
    - `embed_tokens` (the target's raw input-embedding table [V, d], `get_input_embeddings().weight`): also
      written as `embed_tokens.weight`, which EAGLE checkpoints from before March 2025 load with strict=True.
    - A pair: the weights are written first, then config.json, each atomically; both carry the same
      `weights_id`, and `load_eagle_head` refuses a config.json whose id is not its weights' (a save that died
      between the two renames)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()
             if not k.startswith("rotary_emb.") and not k.startswith("embed_tokens.")}
    d = head.hidden_size
    if head.embed_scale is None:
        raise DrafterError("this head's embedding scale is unknown (its config.json records neither "
                           "embed_scale_folded nor weights_id) — set head.embed_scale = "
                           "specvocab.engine.drafters.eagle.embed_scale(target) first (python -m specvocab.engine.jobs.export_eagle does)")
    scale = float(head.embed_scale)
    if scale != 1.0:       # the stored-dtype values, scaled in fp32: loading divides and rounds back exactly
        fc = head.fc.weight.detach().to("cpu", dtype).float().clone()
        fc[:, :d] *= scale
        state["fc.weight"] = fc.contiguous()
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != (head.config.vocab_size, d):
            raise DrafterError(f"embed_tokens must be the target's input embedding table [{head.config.vocab_size}, "
                               f"{d}], got {tuple(embed_tokens.shape)}")
        state["embed_tokens.weight"] = embed_tokens.detach().to("cpu", dtype).contiguous()
    pair_id = uuid.uuid4().hex
    config = eagle_config_dict(head)
    config["torch_dtype"] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    config["specvocab"] = {"target": target_name, "vocab_size": int(target_weight.shape[0]),
                           "hidden_size": int(target_weight.shape[1]),
                           FINGERPRINT_KEY: head_fingerprint(target_weight), "weights_id": pair_id,
                           **({"embed_scale_folded": scale} if scale != 1.0 else {}),
                           "training": training or {}}
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt", "specvocab_weights_id": pair_id})
    atomic_write(folder / "config.json", json.dumps(config, indent=1))
    return folder


def _weights_ids(path: Path) -> set[str]:
    ids = set()
    for f in sorted(path.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            ids.add((g.metadata() or {}).get("specvocab_weights_id"))
    return ids


def check_head_target(head_source: str, block: dict | None, target, *, field: str = "eagle_head",
                      retrain: str = "`python -m specvocab.engine.jobs.train_eagle --model <name>`") -> None:
    """Raise unless a head whose config.json has `specvocab` block `block` was trained for `target` (its LM-head
    fingerprint, `engine.artifacts.head_matches`). `field` names the config field in the message, which also
    says how to take the head shipped for the target (the run's resolution fills an unset field with it)."""
    if not block:
        return                                  # an official checkpoint: only the shapes can be checked
    weight = target.get_output_embeddings().weight.detach()
    if not head_matches(block, weight):
        raise DrafterError(f"{field}={head_source!r} was trained for {block.get('target')!r} (vocabulary "
                           f"{block.get('vocab_size')}, hidden {block.get('hidden_size')}), not for this target "
                           f"(LM head {tuple(weight.shape)}, other weights) — leave {field} unset to take the head "
                           f"shipped for this target, if one ships (engine.resolve.resolve_run), or train one with "
                           f"{retrain}")


def load_eagle_head(source: str) -> EagleHead:
    """An EAGLE-1/2 head from a local directory, `specvocab:<model>` or a hub id (see the module docstring)."""
    path = resolve_head_dir(source)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DrafterError(f"{path} has no config.json — an EAGLE-1/2 checkpoint directory needs one")
    values = json.loads(cfg_file.read_text())
    if values.get("num_hidden_layers", 1) != 1:
        raise DrafterError(f"{source}: config.json has num_hidden_layers={values['num_hidden_layers']} — "
                           f"this loader reads one-layer EAGLE-1/2 heads")
    state = read_state_dict(path)
    if any(k.startswith("midlayer.") or k == "d2t" for k in state):
        raise DrafterError(f"{source} is an EAGLE-3 checkpoint (midlayer/d2t keys) — eagle here reads EAGLE-1/2 heads")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    head = EagleHead(llama_config(values), bias="fc.bias" in state, qkv_bias=bool(values.get("qkv_bias", False))
                     or "layers.0.self_attn.q_proj.bias" in state, with_embedding="embed_tokens.weight" in state)
    result = head.load_state_dict(state, strict=False)
    block = values.get("specvocab")
    head.target_block = block
    head.stored_dtype = values.get("torch_dtype")
    if result.missing_keys or result.unexpected_keys:
        raise DrafterError(f"{source} does not match the EAGLE-1/2 layout: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    if block and block.get("weights_id") and _weights_ids(path) != {block["weights_id"]}:
        raise DrafterError(f"{source}: config.json and the weights beside it come from different saves (a save "
                           f"stopped between the two files) — save the head again (save_eagle_head)")
    scale = float((block or {}).get("embed_scale_folded", 1.0))
    if scale != 1.0:                                # undo save_eagle_head's folding (its docstring)
        stored = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(values.get("torch_dtype"), torch.float32)
        with torch.no_grad():
            w = head.fc.weight[:, : head.hidden_size] / scale
            head.fc.weight[:, : head.hidden_size] = w.to(stored).float()   # the values before folding, exactly
        head.embed_scale = scale
    elif block and "weights_id" not in block:
        # a head of this package without weights_id or embed_scale_folded: trained through
        # get_input_embeddings(), its scale not recorded - the target's own
        head.embed_scale = None
    return head


class EagleTreeDrafter(LMHeadDrafter):
    """The backbone bookkeeping EAGLE-1/2 and EAGLE-3 share: one decoder layer over pairs (target feature f_i,
    token x_{i+1}) at position i in a `DraftKVCache`, tree levels fed the head's own output at the parent, the
    tree rows dropped after each step and the accepted path re-run with the target's features.

    Subclasses set `self.feature_dtype` and implement
      `_run(tokens [q], feats [q, *], positions [q], visible [q, length + q], own) -> h [q, d]`
          (own: feats are the head's own outputs, not target features),
      `_prompt_features(prompt_ids, prefill_hidden) -> [L, *]`   the target's features at the prompt,
      `_step_features(step) -> [n, *]`                           ... at every node of a verified tree."""

    fused: cpu_kernels.LayerKernel | None = None     # the decoder layer as one kernels.cpu.layer call (`_fuse`)
    fused_calls = 0

    def _fuse(self, layer) -> None:
        """Run the head's decoder layer as one `kernels.cpu.layer` call per forward (bf16 on a CPU with the
        kernels, `SpecConfig.cpu_kernels`): the transformers layer, its 4-D mask and its cache protocol cost
        ~1.5 ms per call at SmolLM2's sizes, its 7 MB of weights ~0.5 ms to read. The layer's attention input is
        x itself (EAGLE-1/2: no input norm) or given (EAGLE-3: [norm(embedding); norm(h)], 2 d wide). The packed
        weights are a copy made here: the drafter drafts with the head as it was built (training goes through
        the module, not a drafter). Left on the transformers layer where the kernels do not run or the layer is
        not the plain Llama one."""
        at, mlp = layer.self_attn, layer.mlp
        c = self.eagle.config
        hd = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        w = at.q_proj.weight
        if (not self.cfg.cpu_kernels or cpu_kernels.reason(w.device, w.dtype) is not None
                or getattr(c, "hidden_act", "silu") != "silu" or at.o_proj.bias is not None
                or any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
                or not cpu_kernels.takes_head_dim(hd)):
            return
        with torch.no_grad():
            qkv = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            bias = (torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]) if at.q_proj.bias is not None
                    else None)
            self.fused = cpu_kernels.pack_layer(
                qkv, bias, at.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=hd,
                eps=c.rms_norm_eps, in_norm=None, pre_mlp_norm=layer.post_attention_layernorm.weight, act="silu")
        self.fused_scale = float(at.scaling)

    def _backbone(self, layer, x, positions, visible, own, attn_in=None, **hf):
        """The decoder layer over q rows x [q, d] at positions [q], visible [q, length + q] (the cache, then the
        new rows); writes their keys and values to the cache and returns the layer's output [q, d]. `own`: tree
        rows (the committed context is [0, n_ctx)); else a causal run right after the cache. hf: what the
        transformers layer takes besides x (EAGLE-3: the embedding)."""
        q = x.shape[0]
        self.cache.reserve(q, x.device)
        if self.fused is None:
            kv_pos = torch.cat([self.cache.positions[: self.cache.length].to(positions.device), positions])
            pe = self.eagle.rotary_emb(x, positions[None])
            mask = attention_bias(positions, kv_pos, visible, x.dtype, None)
            out = layer(x[None], pe, mask, **hf)
            self.cache.advance(q, positions)
            return out[0]
        if not own and q > FUSED_CHUNK:          # a long causal run (the prompt): in chunks the kernel's tail holds
            length, outs = self.cache.length, []
            for a in range(0, q, FUSED_CHUNK):
                b = min(q, a + FUSED_CHUNK)
                outs.append(self._backbone(layer, x[a:b], positions[a:b], visible[a:b, :length + b],
                                           own, None if attn_in is None else attn_in[a:b]))
            return torch.cat(outs)
        P = self.n_ctx if own else self.cache.length          # committed: slot = position, seen by every row
        B = BLOCK
        base = (P // B) * B
        kv_pos = torch.cat([self.cache.positions[: self.cache.length].to(positions.device), positions])
        rows, cols = visible[:, P:].nonzero(as_tuple=True)     # the rows' visible keys after the committed ones
        offset = kv_pos[P + cols] - base
        # the tail: two blocks, or as many as the deepest row reaches (engine.native.tail_blocks)
        T = max(TAIL_BLOCKS, int(offset.max()) // B + 1) if offset.numel() else TAIL_BLOCKS
        idx = torch.zeros(q, T * B, dtype=torch.long)
        ok = torch.zeros(q, T * B, dtype=torch.bool)
        idx[:, : P - base] = torch.arange(base, P)
        ok[:, : P - base] = True
        idx[rows, offset] = P + cols
        ok[rows, offset] = True
        if 0 not in self.cache.k:                              # the cache's tensors, made as transformers would
            shape = (1, self.fused.kv_heads, self.cache.capacity, self.fused.head_dim)
            self.cache.k[0] = x.new_zeros(shape)
            self.cache.v[0] = x.new_zeros(shape)
        cos, sin = self.eagle.rotary_emb(x, positions[None])
        slots = torch.arange(self.cache.length, self.cache.length + q)
        out = cpu_kernels.layer(x, self.fused, cos[0], sin[0], self.cache.k[0][0], self.cache.v[0][0], slots,
                                P // B, positions, idx, ok, None, self.fused_scale, attn_in=attn_in)
        self.fused_calls += 1
        self.cache.advance(q, positions)
        return out

    def _reset_backbone(self):
        self.cache = DraftKVCache([0])
        self.n_ctx = 0                         # pairs (f_i, x_{i+1}) in the cache: positions 0..n_ctx-1
        self.pending: torch.Tensor | None = None   # target features at positions n_ctx.. not yet paired

    def _feed(self, tokens, feats):
        q, p0 = tokens.numel(), self.cache.length
        positions = torch.arange(p0, p0 + q, device=tokens.device)
        visible = torch.ones(q, p0 + q, dtype=torch.bool, device=tokens.device)
        visible[:, p0:] = torch.tril(visible[:, p0:])
        h = self._run(tokens, feats, positions, visible, own=False)
        self.n_ctx = self.cache.length
        return h

    def _backbone_begin(self, prompt_ids, prefill_hidden):
        feats = self._prompt_features(prompt_ids, prefill_hidden).to(self.feature_dtype)
        self.cache = DraftKVCache([0], capacity=max(256, 2 * prompt_ids.numel()))
        self.n_ctx = 0
        if prompt_ids.numel() > 1:
            self._feed(prompt_ids[1:], feats[:-1])
        self.pending = feats[-1:]

    def _catch_up(self, ids):
        self.cache.crop(self.n_ctx)
        tokens = ids[self.n_ctx + 1:]
        if self.pending is None or tokens.numel() != self.pending.shape[0]:
            raise DrafterError(f"{self.name} holds target features for "
                               f"{0 if self.pending is None else self.pending.shape[0]} positions but "
                               f"{tokens.numel()} new committed tokens arrived — propose() must follow begin() or "
                               f"observe()")
        h = self._feed(tokens, self.pending)
        self.pending = None
        return h[-1:]

    def _forward_tree(self, tokens, parent_h, tree_mask, depth):
        r = tokens.numel()
        positions = torch.full((r,), self.n_ctx - 1 + depth, dtype=torch.long, device=tokens.device)
        visible = torch.cat([torch.ones(r, self.n_ctx, dtype=torch.bool, device=tokens.device), tree_mask], dim=1)
        return self._run(tokens, parent_h, positions, visible, own=True)

    def _after_step(self, step: StepResult, expansion: Expansion | None) -> None:
        self.cache.crop(self.n_ctx)
        feats = self._step_features(step)
        self.pending = feats[step.accepted.to(feats.device)].to(self.feature_dtype)   # [a, *]


@register_drafter("eagle")
class EagleDrafter(EagleTreeDrafter):
    name = "eagle"

    def __init__(self, target, cfg, head: EagleHead | None = None):
        super().__init__(target, cfg)
        cfg.require_draft_size()                     # fail before loading a head: the harness resolves it
        self.head_source = "(passed in)" if head is not None else cfg.eagle_head
        if head is None:
            source = cfg.eagle_head                  # resolved with the run (a shipped head for None), never here
            if source is None:
                raise DrafterError("method 'eagle' needs a draft head and none ships for this target (or the config "
                                   "was not resolved: engine.resolve.resolve_run, engine.harness.resolve_config): pass "
                                   "eagle_head=<hub id or local EAGLE-1/2 checkpoint directory>, train one with "
                                   "`python -m specvocab.engine.jobs.train_eagle --model <name>`, or eagle_head='random' for an "
                                   "untrained head (tests)")
            head = random_eagle_head(target, cfg.seed) if source == "random" else load_eagle_head(source)
            check_head_target(source, getattr(head, "target_block", None), target)
        t = text_config(target)
        out_emb = target.get_output_embeddings().weight                # [V, d]
        if head.hidden_size != t.hidden_size or head.fc.in_features != 2 * t.hidden_size:
            raise DrafterError(f"the EAGLE head has hidden size {head.hidden_size} but the target's is "
                               f"{t.hidden_size} — use the EAGLE checkpoint trained for this target")
        if head.config.vocab_size != out_emb.shape[0]:
            raise DrafterError(f"the EAGLE head's vocabulary ({head.config.vocab_size}) differs from the target's "
                               f"({out_emb.shape[0]}) — use the EAGLE checkpoint trained for this target")
        self.head_sha = head_digest(head)                              # before the cast: the file's weights
        self.eagle = head.to(device=self.device, dtype=out_emb.dtype).eval()
        if cfg.cpu_kernels:                                            # bf16 / fp32 on a CPU: kernels.cpu's linear
            cpu_kernels.route_linears(self.eagle)
        self._fuse(self.eagle.layers[0])                               # ... and the layer as one call
        self.cache_kw = cache_kwarg(self.eagle.layers[0])              # `cache` from transformers 5.24 on
        self.embed = self._embedding(target, head)
        self.head_weight = out_emb
        self.feature_dtype = out_emb.dtype
        self.softcap = getattr(t, "final_logit_softcapping", None)
        self._make_policy()
        self._reset_backbone()

    def drafter_key(self) -> dict:
        return dynaspec_drafter_key(self.cfg, head_sha=self.head_sha)

    @staticmethod
    def _embedding(target, head: EagleHead):
        """tokens -> the embeddings the head's fc expects. EAGLE's heads (embed_scale 1): a plain table lookup, as
        EAGLE's cnets1.py embeds - the head's own embed_tokens, else the target's raw table (for Gemma this is
        not `get_input_embeddings()`, which scales by sqrt(d)). A head trained here on scaled embeddings
        (embed_scale s != 1): the target's `get_input_embeddings()`, which must scale by s."""
        if head.embed_scale is None:                  # an unexported head of this package (load_eagle_head)
            return target.get_input_embeddings()
        if head.embed_scale != 1.0:
            have = embed_scale(target)
            if abs(have / head.embed_scale - 1) > 1e-6:
                raise DrafterError(f"the EAGLE head was trained on token embeddings scaled by {head.embed_scale:g} but "
                                   f"this target's input embedding scales by {have:g} — use the head trained for it")
            return target.get_input_embeddings()
        if head.embed_tokens is not None:
            return head.embed_tokens
        table = target.get_input_embeddings()
        if embed_scale(target) == 1.0:
            return table
        return lambda ids: nn.functional.embedding(ids, table.weight)

    def _run(self, tokens, feats, positions, visible, own=False):
        """Pairs (feats [q, d], tokens [q]) at positions [q]; visible [q, length + q] -> h [q, d]. EAGLE-1/2
        runs fc over [embedding; feature] whether the feature is the target's or its own (`own`)."""
        x = self.eagle.fc(torch.cat([self.embed(tokens).to(feats.dtype), feats], dim=-1))     # [q, d]

        def layer(x, pe, mask):
            out = self.eagle.layers[0](x, attention_mask=mask, position_ids=positions[None], position_embeddings=pe,
                                       **{self.cache_kw: self.cache}, use_cache=True)
            return out[0] if isinstance(out, tuple) else out
        return self._backbone(layer, x, positions, visible, own)

    def _prompt_features(self, prompt_ids, prefill_hidden):
        if prefill_hidden is None or prefill_hidden.shape[0] != prompt_ids.numel():
            raise DrafterError("eagle needs the target's hidden states at every prompt position (prefill_hidden "
                               "[L, d]) — run it through engine.harness.generate, which passes them")
        return prefill_hidden

    def _step_features(self, step):
        if step.hidden is None:
            raise DrafterError("eagle needs the target's hidden state at every tree node (StepResult.hidden)")
        return step.hidden
