"""tau of a head being trained: real greedy speculative decoding with it on held-out prompts."""

from __future__ import annotations

from typing import Sequence

import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle import EagleDrafter
from specvocab.engine.drafters.eagle3 import Eagle3Drafter
from specvocab.engine.harness import generate, resolve_config

DRAFTERS = {"eagle": (EagleDrafter, "eagle_head"), "eagle3": (Eagle3Drafter, "eagle3_head")}


def heldout_tau(model, tokenizer, info, head, prompts: Sequence[Sequence[int]], new_tokens: int,
                eos: Sequence[int], method: str = "eagle", head_dir: str | None = None) -> float:
    """tau (new tokens per draft-verify step, EAGLE's tau) of greedy decoding with the `method` drafter (eagle |
    eagle3), full vocabulary, the package's default tree, with `head` (or, with head_dir, the checkpoint saved
    there) on the prompts. The head's train/eval mode is restored."""
    drafter_cls, field = DRAFTERS[method]
    cfg = resolve_config(SpecConfig.preset(method, vocab="full", max_new_tokens=new_tokens,
                                           **{field: head_dir or "random"}), model=model)
    was_training = head.training if head is not None else False
    tokens = steps = 0
    for ids in prompts:
        drafter = drafter_cls(model, cfg, head=None if head_dir else head)
        res = generate(model, torch.as_tensor(list(ids)), cfg, drafter=drafter, tokenizer=tokenizer, info=info,
                       eos_ids=eos)
        del drafter
        tokens += res.new_tokens
        steps += res.steps
    if head is not None:
        head.train(was_training)
    return tokens / max(steps, 1)
