"""Write an EAGLE-1/2 head again in the portable layout of `engine.drafters.eagle.save_eagle_head`.

    python -m specvocab.engine.jobs.export_eagle --model gemma-3-270m --head specvocab:gemma-3-270m --out DIR [--with-embedding]

What it changes, and what it keeps: the head's weights and behaviour in this package are kept; a head trained
here on a Gemma target gets its embedding scale sqrt(d) folded into fc (so EAGLE's and SGLang's plain embedding
lookup draft with it correctly); config.json gets the LM-head fingerprint (`engine.artifacts.head_fingerprint`) and the weights id of the pair;
`--with-embedding` also writes `embed_tokens.weight` (the target's raw table), which EAGLE checkpoints from
before March 2025 load with strict=True. Files other than config.json and model.safetensors in DIR (the model
card, a DynaSpec fit) are left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specvocab.engine.drafters.eagle import check_head_target, embed_scale, load_eagle_head, save_eagle_head
from specvocab.engine.jobs.args import add_debug, check_model, check_out, run_main
from specvocab.engine.models import load_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def export_eagle(model_name: str, head_source: str, out: str | Path, *, with_embedding: bool = False,
                 dtype: str | None = None) -> Path:
    """Load `head_source` for target `model_name` (checked against it), write it to `out`; returns `out`."""
    model, _, _ = load_model(model_name, dtype="fp32")
    head = load_eagle_head(head_source)
    block = getattr(head, "target_block", None) or {}
    check_head_target(head_source, block or None, model)
    if head.embed_scale is None:                    # unexported head of this package: trained on get_input_embeddings()
        head.embed_scale = embed_scale(model)
    config_dtype = getattr(head, "stored_dtype", None) or "float32"
    table = model.get_input_embeddings().weight if with_embedding else None
    return save_eagle_head(head, out, target_name=block.get("target", model_name),
                           target_weight=model.get_output_embeddings().weight, training=block.get("training"),
                           dtype=_DTYPES[dtype or config_dtype], embed_tokens=table)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.export_eagle", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the target the head was trained for")
    ap.add_argument("--head", required=True, help="a head folder, specvocab:<model> or a hub id")
    ap.add_argument("--out", required=True, help="the folder to write (may be the head's own)")
    ap.add_argument("--with-embedding", action="store_true", help="also write embed_tokens.weight")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the dtype it was stored in")
    add_debug(ap)
    args = ap.parse_args(argv)
    check_model(args.model)
    check_out("--out", args.out)
    out = export_eagle(args.model, args.head, args.out, with_embedding=args.with_embedding, dtype=args.dtype)
    print(f"[export eagle] {args.head} -> {out}")
    return out


if __name__ == "__main__":
    sys.exit(run_main(main))
