"""Test-only helpers for `eagle3`: hand-built checkpoints in the official EAGLE-3 layout and a plain-torch
reference forward of the head that reads the raw tensors by their official names (no engine code)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HEADS, KV_HEADS = 4, 2


def official_state(target, *, draft_ids, seed: int = 0, hidden: int | None = None, scale: float = 1.0,
                   with_embedding: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json dict) of a random EAGLE-3 head for `target`, named and shaped as the official
    checkpoints: fc [d, 3 d_t], midlayer q/k/v [*, 2d], d2t / t2d of the draft ids (ascending target ids)."""
    d_t, V = target.config.hidden_size, target.config.vocab_size
    d = hidden or d_t
    hd = d // HEADS
    inter = 2 * d
    ids = np.sort(np.asarray(draft_ids, dtype=np.int64))
    K = ids.size
    g = torch.Generator().manual_seed(seed)

    def w(out, inp, gain=1.0):
        return torch.randn(out, inp, generator=g) * gain * scale / inp ** 0.5

    state = {
        "fc.weight": w(d, 3 * d_t),
        "midlayer.self_attn.q_proj.weight": w(HEADS * hd, 2 * d, 2.0),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * hd, 2 * d, 2.0),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": w(d, HEADS * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, d),
        "midlayer.mlp.up_proj.weight": w(inter, d),
        "midlayer.mlp.down_proj.weight": w(d, inter),
        "midlayer.hidden_norm.weight": 1 + 0.3 * torch.randn(d, generator=g),
        "midlayer.input_layernorm.weight": 1 + 0.3 * torch.randn(d, generator=g),
        "midlayer.post_attention_layernorm.weight": 1 + 0.3 * torch.randn(d, generator=g),
        "norm.weight": 1 + 0.3 * torch.randn(d, generator=g),
        "lm_head.weight": w(K, d, 4.0),
        "d2t": torch.as_tensor(ids - np.arange(K)),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.as_tensor(ids), True),
    }
    if with_embedding:
        state["embed_tokens.weight"] = torch.randn(V, d, generator=g)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": d, "intermediate_size": inter, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 2048, "rope_theta": 500000.0, "vocab_size": V, "draft_vocab_size": K,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if d != d_t:
        config["target_hidden_size"] = d_t
    return state, config


def write_checkpoint(folder: Path, state: dict, config: dict, fmt: str = "safetensors") -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.bin")):
        f.unlink()
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.clone().contiguous() for k, v in state.items()}      # no shared storage (safetensors)
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


# --- the plain reference ------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [H, n, hd] rotated by positions [n] (the rotate-half convention of Llama)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def midlayer_reference(S: dict, C: dict, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The midlayer over n rows from scratch (causal, positions 0..n-1): emb, h [n, d] -> [n, d]."""
    eps, n = C["rms_norm_eps"], h.shape[0]
    x = torch.cat([_rms(emb, S["midlayer.input_layernorm.weight"], eps), _rms(h, S["midlayer.hidden_norm.weight"], eps)], -1)
    hd = C["hidden_size"] // C["num_attention_heads"]
    H, KV = C["num_attention_heads"], C["num_key_value_heads"]
    q = (x @ S["midlayer.self_attn.q_proj.weight"].T).view(n, H, hd).transpose(0, 1)
    k = (x @ S["midlayer.self_attn.k_proj.weight"].T).view(n, KV, hd).transpose(0, 1)
    v = (x @ S["midlayer.self_attn.v_proj.weight"].T).view(n, KV, hd).transpose(0, 1)
    pos = torch.arange(n)
    q, k = _rope(q, pos, C["rope_theta"]), _rope(k, pos, C["rope_theta"])
    k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
    scores = q @ k.transpose(1, 2) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, H * hd) @ S["midlayer.self_attn.o_proj.weight"].T
    h = h + a
    m = _rms(h, S["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = m @ S["midlayer.mlp.gate_proj.weight"].T, m @ S["midlayer.mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ S["midlayer.mlp.down_proj.weight"].T


def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """[N, 3 d_t]: the residual stream entering decoder layers 2, L//2, L-3 (HF's hidden_states[i] is the input
    of layer i), concatenated low / mid / high."""
    L = target.config.num_hidden_layers
    with torch.inference_mode():
        hs = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in (2, L // 2, L - 3)], -1)


def reference_logp(S: dict, C: dict, target, ids: torch.Tensor, path: list[int]) -> torch.Tensor:
    """[V] log p over TARGET ids of the head's next token after committed `ids` (root last) and then `path`
    (draft tokens below the root): pairs (features of position i, ids[i + 1]) over the context, then along the
    path (the previous row's midlayer output, the path token); ids outside the draft vocabulary get -inf."""
    S = {k: v.double() if v.is_floating_point() else v for k, v in S.items()}
    embed = S.get("embed_tokens.weight", target.get_input_embeddings().weight.detach().double())
    feats = target_features(target, ids).double()
    h = feats[:-1] @ S["fc.weight"].T                                   # [N-1, d]
    toks = ids[1:].tolist()
    out = midlayer_reference(S, C, embed[toks], h)
    for t in path:
        h = torch.cat([h, out[-1:]])
        toks.append(int(t))
        out = midlayer_reference(S, C, embed[toks], h)
    logits = _rms(out[-1], S["norm.weight"], C["rms_norm_eps"]) @ S["lm_head.weight"].T      # [K] draft ids
    full = torch.full((C["vocab_size"],), float("-inf"), dtype=torch.float64)
    full[torch.arange(logits.numel()) + S["d2t"]] = torch.log_softmax(logits, -1)
    return full
