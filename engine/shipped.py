"""The trained draft heads that ship with the package (`engine/heads/<model>/`), found by their target's LM head.

Which heads ship (`shipped_heads`, `SHIPPED_HEADS`, `SHIPPED_PREFIX`) is listed in `engine.catalog`, without
torch; this module matches them to a loaded target. Below the drafters and the harness: the harness resolves
`eagle_head=None` to a shipped head here (`default_eagle_head`) without importing any drafter;
`engine.drafters.eagle` loads the checkpoint. A shipped head's config.json carries a `specvocab` block (target
name, vocabulary, hidden size, LM-head fingerprint), written by `engine.drafters.eagle.save_eagle_head` and
checked by `engine.artifacts.head_matches`.
"""

from __future__ import annotations

import json
from pathlib import Path

from specvocab.engine.artifacts import head_fingerprint, head_matches, same_shape
# The listing of the shipped heads is in engine.catalog (no torch: a sweep's config checks it); re-exported.
from specvocab.engine.catalog import SHIPPED_HEADS, SHIPPED_PREFIX, shipped_eagle3_heads, shipped_heads  # noqa: F401


def _target_block(path: Path) -> dict | None:
    try:
        return json.loads((path / "config.json").read_text()).get("specvocab")
    except (OSError, json.JSONDecodeError):
        return None


def default_eagle_head(target) -> str | None:
    """`specvocab:<model>` of the shipped EAGLE-1/2 head trained for this target (matched by its LM head), else
    None."""
    return _matching(target, shipped_heads())


def default_eagle3_head(target) -> str | None:
    """`specvocab:<model>` of the shipped EAGLE-3 head trained for this target (matched by its LM head), else
    None."""
    return _matching(target, shipped_eagle3_heads())


def _matching(target, heads: dict[str, Path]) -> str | None:
    weight = target.get_output_embeddings().weight.detach()
    fingerprint = None
    for name, path in heads.items():
        block = _target_block(path)
        if same_shape(block, weight):                     # the fingerprint only for heads of this shape
            fingerprint = fingerprint or head_fingerprint(weight)
            if head_matches(block, weight, fingerprint):
                return SHIPPED_PREFIX + name
    return None
