"""A new EAGLE-3 head for a target, and its writer in the official EAGLE-3 checkpoint layout."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch

from specvocab.engine.artifacts import FINGERPRINT_KEY, atomic_write, head_fingerprint, save_safetensors
from specvocab.engine.drafters.eagle import eagle_config_dict, random_eagle_head
from specvocab.engine.drafters.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Head
from specvocab.engine.target import decoder


def new_eagle3_head(model, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0, lm_head_init: str = "random"
                    ) -> Eagle3Head:
    """An untrained head shaped after the target over the draft vocabulary of (d2t, t2d); lm_head_init="target":
    lm_head = the target's LM-head rows of the draft vocabulary, norm = the target's final-norm gain."""
    like = random_eagle_head(model, seed)                       # the Llama config shaped after the target
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = Eagle3Head(like.config, draft_vocab_size=d2t.numel())
        for p in head.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    if lm_head_init == "target":
        target_ids = torch.arange(d2t.numel()) + d2t
        with torch.no_grad():
            head.lm_head.weight.copy_(model.get_output_embeddings().weight[target_ids].float())
            final = getattr(decoder(model), "norm", None)
            if final is not None:
                d = head.hidden_size
                eps = getattr(final, "eps", None) or getattr(final, "variance_epsilon", 1e-6)
                ones = torch.ones(1, d, dtype=model.get_output_embeddings().weight.dtype)
                gain = final(ones).float()[0] * math.sqrt(1 + eps)      # g from norm(1) = g / sqrt(1 + eps)
                if gain.shape == head.norm.weight.shape and torch.isfinite(gain).all():
                    head.norm.weight.copy_(gain)
    return head


def eagle3_config_dict(head: Eagle3Head, feature_layers: Sequence[int]) -> dict:
    """config.json of an EAGLE-3 head as the official checkpoints write it (Llama-style, `draft_vocab_size`),
    with the feature layers under `eagle_config` as SGLang / vLLM read them."""
    c = eagle_config_dict(head)
    c.pop("bias", None)
    c.update(architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=head.draft_vocab_size, tie_word_embeddings=False,
             eagle_config={"eagle_aux_hidden_state_layer_ids": [int(i) for i in feature_layers]})
    if head.target_hidden_size != head.hidden_size:
        c["target_hidden_size"] = head.target_hidden_size
    return c


def save_eagle3_head(head: Eagle3Head, folder: str | Path, *, target_name: str, target_weight: torch.Tensor,
                     feature_layers: Sequence[int], training: dict | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write `folder/config.json` + `folder/model.safetensors` in the official EAGLE-3 layout (fc, midlayer.*,
    norm, lm_head, d2t int64, t2d bool; the target's embedding not stored), each atomically, with the `specvocab`
    block of `save_eagle_head` (target, vocabulary, hidden size, LM-head fingerprint, training)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in head.state_dict().items() if not k.startswith(("rotary_emb.", "embed_tokens."))}
    config = eagle3_config_dict(head, feature_layers)
    config["torch_dtype"] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    config["specvocab"] = {"target": target_name, "vocab_size": int(target_weight.shape[0]),
                           "hidden_size": int(target_weight.shape[1]),
                           FINGERPRINT_KEY: head_fingerprint(target_weight), "training": training or {}}
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    atomic_write(folder / "config.json", json.dumps(config, indent=1))
    return folder
