"""Files the package writes and reads back: one rule for writing them, their JSON sidecars, and the LM-head
fingerprint that ties a fitted or trained artifact to the target it was made for.

- Writing (`atomic_write`): the content goes to a temporary file in the same folder (`.<name>.<pid>.<random>.tmp`:
  hidden, and matched by no `*.parquet` / `*.json` / `*.safetensors` glob), the file is fsynced, `os.replace`d
  onto its final name, and the folder is fsynced where the OS allows. A file at its final path is complete; if
  the writer raises, the temporary file is removed and a file already at `path` is left as it was.
  `save_safetensors` and `save_torch` are that rule for two writers, `atomic_dir` for a whole folder.
- Sidecars: `<path>.json` beside a file (`sidecar_path`). `atomic_write(..., sidecar=meta)` commits both, the
  sidecar first, so a file at its final path always has its sidecar.
- Fingerprint: `head_fingerprint(weight [V, d])`, stored under `FINGERPRINT_KEY` beside the vocabulary and
  hidden sizes, and one check, `fingerprint_matches` (`head_matches` with the sizes), used for EAGLE heads,
  DynaSpec fits and training data alike. `stored_fingerprint` also reads the key EAGLE heads were saved with
  before (`target_fingerprint`, the shipped heads' config.json), so files written then still load.

Below everything else in `engine`: imports nothing from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from engine.atomic import atomic_dir, atomic_write, sidecar_path  # noqa: F401 (the writing rule, re-exported)
from kernels.tensor_ops import row_chunks

# --- writing: one rule (engine.atomic; the torch writers below) -----------------------------------------


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None, *,
                     sidecar: Mapping | None = None) -> Path:
    """`safetensors.torch.save_file` by the atomic rule (with an optional JSON sidecar)."""
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), sidecar=sidecar)


def save_torch(obj, path: str | Path, *, sidecar: Mapping | None = None) -> Path:
    """`torch.save` by the atomic rule (with an optional JSON sidecar)."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp), sidecar=sidecar)


# --- the LM-head fingerprint and its one check ------------------------------------------------------------------

FINGERPRINT_KEY = "head_fingerprint"          # written by every artifact tied to a target's LM head
_OLD_FINGERPRINT_KEYS = ("target_fingerprint",)   # EAGLE heads' config.json before #17 (the shipped heads)

# |have - stored| <= RTOL * |stored| + ATOL for every entry. RTOL is bf16's unit roundoff 2^-8: rounding a head
# to bf16 moves each element by at most that fraction, so each row norm too (| ||x~|| - ||x|| | <= ||x~ - x||),
# and a bf16 (or fp16) copy of the model an fp32 fingerprint was stored from always matches, and the other way
# round. Measured on the shipped heads: 1.6e-4 (SmolLM2) and 3.1e-4 (Gemma-3, dequantised Q4) in bf16. Another
# head of the same shape differs by percents. ATOL only keeps rows of norm ~0 from failing on their own.
FINGERPRINT_RTOL = 2.0 ** -8
FINGERPRINT_ATOL = 1e-6


def head_fingerprint(weight: torch.Tensor, n: int = 32) -> list[float]:
    """Norms of n evenly spaced rows of the LM head and the mean row norm: enough to tell two heads of the
    same shape apart (a model and another one, or another checkpoint) without hashing V x d values."""
    weight = weight.detach()
    rows = torch.linspace(0, weight.shape[0] - 1, min(n, weight.shape[0])).long().to(weight.device)
    sample = torch.linalg.vector_norm(weight[rows].double(), dim=1)
    total = torch.zeros((), dtype=torch.float64, device=weight.device)
    for a, b in row_chunks(weight.shape[0], weight.shape[1] * 8):      # fp64 copies of a few MB at a time
        total += torch.linalg.vector_norm(weight[a:b].double(), dim=1).sum()
    return [float(v) for v in sample.cpu()] + [float(total) / weight.shape[0]]


def stored_fingerprint(meta: Mapping | None) -> list[float] | None:
    """The fingerprint an artifact's metadata holds, under `FINGERPRINT_KEY` or an older key; None if none."""
    for key in (FINGERPRINT_KEY, *_OLD_FINGERPRINT_KEYS):
        if meta and meta.get(key) is not None:
            return [float(v) for v in meta[key]]
    return None


def fingerprint_matches(stored: Sequence[float] | None, weight: torch.Tensor,
                        fingerprint: Sequence[float] | None = None) -> bool:
    """The one check: `stored` was taken from LM head `weight [V, d]` (or a copy of it in another dtype).
    `fingerprint` = `head_fingerprint(weight)` when the caller already has it (several files, one head)."""
    if stored is None:
        return False
    want = np.asarray(stored, dtype=np.float64)
    have = np.asarray(fingerprint if fingerprint is not None else head_fingerprint(weight), dtype=np.float64)
    return want.shape == have.shape and bool(np.all(np.abs(have - want) <= FINGERPRINT_RTOL * np.abs(want)
                                                    + FINGERPRINT_ATOL))


def same_shape(meta: Mapping | None, weight: torch.Tensor) -> bool:
    """The metadata's `vocab_size` and `hidden_size` are the LM head's [V, d]."""
    return bool(meta) and (meta.get("vocab_size"), meta.get("hidden_size")) == tuple(weight.shape)


def head_matches(meta: Mapping | None, weight: torch.Tensor, fingerprint: Sequence[float] | None = None) -> bool:
    """An artifact whose metadata holds `vocab_size`, `hidden_size` and a fingerprint was made for `weight`."""
    return same_shape(meta, weight) and fingerprint_matches(stored_fingerprint(meta), weight, fingerprint)
