"""Training-data shards on disk: one safetensors file per group of prompts, and the folder's manifest.

A shard holds the samples of `prompts_per_shard` prompts packed along one token axis: `offsets` [n + 1] int64,
`input_ids` / `loss_mask` [T], and, where the folder stores features, `hidden` [T, d], `topk_ids` /
`topk_logits` [T, k] and the EAGLE-3 features `hidden_low` / `hidden_mid` / `hidden_high` [T, d]. Its metadata
names its prompts and each sample's source. Every file is written atomically (temp + rename), so a shard on
disk is either whole or absent; one that does not read back raises `TrainError` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specvocab.engine.artifacts import save_safetensors
from specvocab.engine.train.sample import FEATURES, Sample, TrainError

FORMAT = 1
FEATURE_KEYS = ("hidden", "topk_ids", "topk_logits")        # per-token tensors of a folder that stores features


def save_shard(samples: list[Sample], path: Path, feature_dtype: torch.dtype, meta: dict) -> None:
    """Write `samples` as one shard at `path` (atomically); features in `feature_dtype`, top-k logits fp32."""
    lengths = [s.input_ids.numel() for s in samples]
    tensors = {
        "offsets": torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
    }
    if samples[0].hidden is not None:
        tensors.update(hidden=torch.cat([s.hidden for s in samples]).to(feature_dtype).contiguous(),
                       topk_ids=torch.cat([s.topk_ids for s in samples]).to(torch.int32),
                       topk_logits=torch.cat([s.topk_logits for s in samples]).float())
    for name in samples[0].extra:
        tensors[name] = torch.cat([s.extra[name] for s in samples]).to(feature_dtype).contiguous()
    meta = {**meta, "prompt_ids": [s.prompt_id for s in samples], "sources": [s.source for s in samples]}
    save_safetensors(tensors, path, metadata={"specvocab": json.dumps(meta)})


def load_shard(path: str | Path) -> list[Sample]:
    """The samples of one shard; a damaged or foreign file raises TrainError naming it and the fix."""
    path = Path(path)
    fix = (f"delete {path} and rerun `python -m specvocab.engine.jobs.eagle_data` with the same settings to "
           f"write it again")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("specvocab", "null"))
        t = load_file(str(path))
    except Exception as e:   # safetensors raises several error types for a truncated or damaged file
        raise TrainError(f"training shard {path} is not readable ({type(e).__name__}: {e}) — {fix}") from None
    need = {"offsets", "input_ids", "loss_mask"}
    has_features = "hidden" in t
    if has_features:
        need |= set(FEATURE_KEYS)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not need <= set(t):
        raise TrainError(f"{path} is not a specvocab training shard of format {FORMAT} (missing "
                         f"{sorted(need - set(t)) or 'metadata'}) — {fix}")
    off = t["offsets"].tolist()
    n = t["input_ids"].numel()
    if off[0] != 0 or off[-1] != n or any(b <= a for a, b in zip(off, off[1:])) \
            or len(off) - 1 != len(meta.get("prompt_ids", ())) or any(t[k].shape[0] != n for k in need - {"offsets"}):
        raise TrainError(f"{path}: offsets and tensor lengths disagree (a torn or edited shard) — {fix}")
    extra = [k for k in FEATURES if k in t]
    out = []
    for j, (a, b) in enumerate(zip(off, off[1:])):
        out.append(Sample(prompt_id=meta["prompt_ids"][j], source=meta["sources"][j],
                          input_ids=t["input_ids"][a:b].long(), loss_mask=t["loss_mask"][a:b].bool(),
                          hidden=t["hidden"][a:b] if has_features else None,
                          topk_ids=t["topk_ids"][a:b].long() if has_features else None,
                          topk_logits=t["topk_logits"][a:b] if has_features else None,
                          extra={k: t[k][a:b] for k in extra}))
    return out


def read_manifest(folder: str | Path) -> dict:
    """The folder's `manifest.json` (settings, vocabulary and hidden size, LM-head fingerprint)."""
    folder = Path(folder)
    path = folder / "manifest.json"
    if not path.is_file():
        raise TrainError(f"{folder} holds no training data (no manifest.json) — make it with "
                         f"`python -m specvocab.engine.jobs.eagle_data --model <name> --out {folder}`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TrainError(f"{path} is not valid JSON ({e}) — delete the folder and make the data again") from None


def load_split(folder: str | Path, split: str) -> list[Sample]:
    """Every sample of `split` (train | heldout) in a data folder, shards in order."""
    folder = Path(folder)
    read_manifest(folder)
    shards = sorted(folder.glob(f"{split}-*.safetensors"))
    return [s for path in shards for s in load_shard(path)]


def stores_features(manifest: dict) -> bool:
    """Whether a data folder's shards hold the target's features (else only tokens: features on the fly)."""
    return bool(manifest["settings"].get("store_features", True))
