"""Files the package writes and reads back: one rule for writing them, their JSON sidecars, and the LM-head
fingerprint that ties a fitted or trained artifact to the target it was made for.

- Writing (`atomic_write`): the content goes to a temporary file in the same folder (`.<name>.<pid>.<random>.tmp`:
  hidden, and matched by no `*.parquet` / `*.json` / `*.safetensors` glob), the file is fsynced, `os.replace`d
  onto its final name, and the folder is fsynced where the OS allows. A file at its final path is complete; if
  the writer raises, the temporary file is removed and a file already at `path` is left as it was.
  `save_safetensors` and `save_torch` are that rule for two writers, `atomic_dir` for a whole folder.
- Sidecars: `<path>.json` beside a file (`sidecar_path`). `atomic_write(..., sidecar=meta)` commits both, the
  sidecar first, so a file at its final path always has its sidecar.
- Fingerprint: `head_fingerprint(weight [V, d])` (the head's directions: sampled rows times fixed probe vectors,
  see `FINGERPRINT_RTOL`), stored under `FINGERPRINT_KEY` beside the vocabulary and hidden sizes, and one check,
  `fingerprint_matches` (`head_matches` with the sizes), used for EAGLE heads, DynaSpec fits and training data
  alike. `stored_fingerprint` also reads the older key of EAGLE heads' config.json (`target_fingerprint`), and
  the check also reads the older row-norm kind of fingerprint (a list; with a warning), so files holding either load.

Below everything else in `engine`: imports nothing from it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from safetensors.torch import save_file

from specvocab.engine.atomic import atomic_dir, atomic_write, sidecar_path  # noqa: F401 (the writing rule, re-exported)
from specvocab.kernels.tensor_ops import row_chunks

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
_OLD_FINGERPRINT_KEYS = ("target_fingerprint",)   # the older key of EAGLE heads' config.json

# The fingerprint is the head's *directions*, not its row norms: F = W[rows] @ P, `FINGERPRINT_ROWS` evenly
# spaced rows of W [V, d] times `FINGERPRINT_PROBES` fixed Gaussian probe vectors P [d, p] (drawn in fp64 from
# `FINGERPRINT_SEED`). Two heads match when ||F_have - F_stored||_F <= RTOL * ||F_stored||_F.
# Why this tells a copy from a fine-tune: for a probe p ~ N(0, I) independent of W, E[(x . p)^2] = ||x||^2, so
# ||F' - F||_F / ||F||_F estimates ||W'[rows] - W[rows]||_F / ||W[rows]||_F (Johnson-Lindenstrauss; with 64 x 8
# = 512 entries the estimate is within ~6% of it). Rounding a head to bf16 moves every element by at most bf16's
# unit roundoff u = 2^-8 of itself, so that ratio is <= u for a bf16 (or fp16, u = 2^-11) copy; RTOL = 1.25 u
# leaves room for the estimate's spread (4 standard deviations). Measured on the shipped heads' targets in bf16:
# 1.3e-3 (SmolLM2) and 1.6e-3 (Gemma-3). A fine-tune, another checkpoint or noise of 1% of the weights' spread
# moves it by ~1e-2, and another head of the same shape by ~1.4 (sqrt 2): refused.
# The older, row-norm kind (a list: norms of 32 rows and the mean row norm) tells only the norms apart, and a
# same-shape fine-tune keeps them within 0.3%. Files that still hold one are read (`fingerprint_matches`
# checks it the old way, with a warning naming the command that rewrites the file); every writer writes the
# new kind.
FINGERPRINT_ROWS = 64
FINGERPRINT_PROBES = 8
FINGERPRINT_SEED = 18
FINGERPRINT_RTOL = 1.25 * 2.0 ** -8
_OLD_RTOL = 2.0 ** -8                         # the old check: |have - stored| <= RTOL |stored| + ATOL per norm
FINGERPRINT_ATOL = 1e-6


def _fingerprint_rows(vocab_size: int, n: int) -> torch.Tensor:
    return torch.linspace(0, vocab_size - 1, min(n, vocab_size), dtype=torch.float64).round().long().unique()


def _probes(hidden_size: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(hidden_size, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def head_fingerprint(weight: torch.Tensor, n: int = FINGERPRINT_ROWS, probes: int = FINGERPRINT_PROBES) -> dict:
    """The LM head's fingerprint: {"kind": "probe", "rows": [...], "probes": p, "seed": s, "values": W[rows] @ P
    flattened row-major} (module comment above); enough to tell two heads of the same shape apart - another
    model, another checkpoint, a fine-tune - without hashing V x d values, while any dtype copy matches."""
    weight = weight.detach()
    rows = _fingerprint_rows(weight.shape[0], n)
    sample = weight[rows.to(weight.device)].to("cpu", torch.float64)                 # [n, d]
    values = sample @ _probes(weight.shape[1], probes, FINGERPRINT_SEED)            # [n, p]
    return {"kind": "probe", "rows": [int(r) for r in rows], "probes": int(probes), "seed": FINGERPRINT_SEED,
            "values": [float(v) for v in values.reshape(-1)]}


def old_head_fingerprint(weight: torch.Tensor, n: int = 32) -> list[float]:
    """The older, row-norm fingerprint (norms of n evenly spaced rows and the mean row norm); only to check
    files that hold one."""
    weight = weight.detach()
    rows = torch.linspace(0, weight.shape[0] - 1, min(n, weight.shape[0])).long().to(weight.device)
    sample = torch.linalg.vector_norm(weight[rows].double(), dim=1)
    total = torch.zeros((), dtype=torch.float64, device=weight.device)
    for a, b in row_chunks(weight.shape[0], weight.shape[1] * 8):      # fp64 copies of a few MB at a time
        total += torch.linalg.vector_norm(weight[a:b].double(), dim=1).sum()
    return [float(v) for v in sample.cpu()] + [float(total) / weight.shape[0]]


def is_old_fingerprint(stored) -> bool:
    """A fingerprint of the older, row-norm kind (a list of row norms)."""
    return isinstance(stored, (list, tuple))


def stored_fingerprint(meta: Mapping | None):
    """The fingerprint an artifact's metadata holds, under `FINGERPRINT_KEY` or an older key; None if none. A
    dict (`head_fingerprint`), or a list of floats for a file holding the older row-norm kind."""
    for key in (FINGERPRINT_KEY, *_OLD_FINGERPRINT_KEYS):
        if meta and meta.get(key) is not None:
            value = meta[key]
            return dict(value) if isinstance(value, Mapping) else [float(v) for v in value]
    return None


def fingerprint_distance(stored: Mapping, weight: torch.Tensor) -> float:
    """||F_have - F_stored||_F / ||F_stored||_F for a `head_fingerprint` dict (inf when it cannot apply)."""
    rows = torch.as_tensor(stored.get("rows", []), dtype=torch.long)
    want = torch.as_tensor(stored.get("values", []), dtype=torch.float64)
    p = int(stored.get("probes", 0))
    if (stored.get("kind") != "probe" or rows.numel() == 0 or p < 1 or want.numel() != rows.numel() * p
            or int(rows.max()) >= weight.shape[0] or int(rows.min()) < 0):
        return float("inf")
    sample = weight.detach()[rows.to(weight.device)].to("cpu", torch.float64)
    have = (sample @ _probes(weight.shape[1], p, int(stored["seed"]))).reshape(-1)
    norm = float(torch.linalg.vector_norm(want))
    return float(torch.linalg.vector_norm(have - want)) / norm if norm > 0 else float("inf")


def fingerprint_matches(stored, weight: torch.Tensor, fingerprint=None) -> bool:
    """The one check: `stored` was taken from LM head `weight [V, d]` (or a copy of it in another dtype).
    `fingerprint`: this head's fingerprint of the stored kind, when the caller already has it (several files,
    one head): an old-kind list (`old_head_fingerprint`) spares the pass over all V rows; a dict is not needed
    (the check recomputes only the sampled rows). An old-kind `stored` is checked the old way, with a warning."""
    if stored is None:
        return False
    if isinstance(stored, Mapping):
        return fingerprint_distance(stored, weight) <= FINGERPRINT_RTOL
    warnings.warn("an artifact holds an LM-head fingerprint of the older row-norm kind, which cannot tell a fine-tune "
                  "of the same model from it — write the file again to store the new kind (EAGLE heads: "
                  "`python -m specvocab.engine.jobs.export_eagle`; DynaSpec fits: `python -m "
                  "specvocab.engine.jobs.fit_dynaspec`; EAGLE data: `python -m specvocab.engine.jobs.eagle_data`)", stacklevel=2)
    want = np.asarray(stored, dtype=np.float64)
    if not isinstance(fingerprint, (list, tuple)):
        fingerprint = old_head_fingerprint(weight)
    have = np.asarray(fingerprint, dtype=np.float64)
    return want.shape == have.shape and bool(np.all(np.abs(have - want) <= _OLD_RTOL * np.abs(want)
                                                    + FINGERPRINT_ATOL))


def same_shape(meta: Mapping | None, weight: torch.Tensor) -> bool:
    """The metadata's `vocab_size` and `hidden_size` are the LM head's [V, d]."""
    return bool(meta) and (meta.get("vocab_size"), meta.get("hidden_size")) == tuple(weight.shape)


def head_matches(meta: Mapping | None, weight: torch.Tensor, fingerprint=None) -> bool:
    """An artifact whose metadata holds `vocab_size`, `hidden_size` and a fingerprint was made for `weight`."""
    return same_shape(meta, weight) and fingerprint_matches(stored_fingerprint(meta), weight, fingerprint)
