"""The training sample, its error type and the small helpers every part of `engine.train` reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specvocab.engine.atomic import safe_filename
from specvocab.engine.models import cache_root

FEATURES = ("hidden_low", "hidden_mid", "hidden_high")     # the EAGLE-3 features: residual stream into 3 layers
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TrainError(ValueError):
    """Training data or a training run cannot be made as asked; the message names the problem and the fix."""


@dataclass
class Sample:
    """One training sequence. Position i holds token x_i and the target's feature after reading x_0..x_i.
    The feature fields are None in a folder that stores tokens only (features computed during training)."""

    prompt_id: str
    source: str
    input_ids: torch.Tensor                 # [L] long
    loss_mask: torch.Tensor                 # [L] bool: x_i is a response token
    hidden: torch.Tensor | None = None      # [L, d] the target's last hidden state (its LM head's input)
    topk_ids: torch.Tensor | None = None    # [L, k] long: the target's top-k next tokens after x_0..x_i
    topk_logits: torch.Tensor | None = None  # [L, k] fp32
    extra: dict[str, torch.Tensor] = field(default_factory=dict)   # FEATURES, each [L, d]


def cache_dir(kind: str, model: str) -> Path:
    """<specvocab cache>/<kind>/<model as a file name (`engine.atomic.safe_filename`)>: the default folder of data
    or a head."""
    return cache_root() / kind / safe_filename(model)


def default_data_dir(model: str) -> Path:
    return cache_dir("train", model)


def data_used(train: Sequence[Sample], held: Sequence[Sample]) -> dict:
    """What a training run read of a data folder (samples, prompts, tokens per split), for its summary and card."""
    out = {}
    for name, split in (("train", train), ("heldout", held)):
        out.update({f"{name}_samples": len(split), f"{name}_prompts": len({s.prompt_id for s in split}),
                    f"{name}_tokens": int(sum(s.input_ids.numel() for s in split))})
    return out


def heldout_prompts(held: Sequence[Sample], manifest: dict, n: int) -> list[list[int]]:
    """The prompts (the part before the loss positions) of the first n held-out samples; with teacher data in the
    folder, its teacher samples only (one per prompt)."""
    out = []
    for s in held:
        if len(out) == n:
            break
        if s.source == "teacher" or "teacher" not in manifest["settings"]["sources"]:
            out.append(s.input_ids[: int((~s.loss_mask).sum())].tolist())
    return out
