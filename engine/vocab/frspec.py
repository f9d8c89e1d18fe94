"""FR-Spec (§3.2): a static draft vocabulary, the top-K of a frequency list; and the list files themselves.

The files are read here, at decode time, and written by the job that counts them (`engine.jobs.frequency`):
- `save_token_map` / `load_token_map`: a `torch.save`d list of ints, most frequent first, with a JSON sidecar
  (tokenizer, vocabulary size, size). It is SGLang's `--speculative-token-map` file and what `vocab="frspec"`
  loads (`frequency_file=...`).
- `save_eagle3_maps` / `load_eagle3_maps`: EAGLE-3's draft-vocabulary maps `d2t` / `t2d` of a list.
- `load_frequency_ranking`: any of the above, or a `locality.shortlist` ranking (Parquet), .npy or .txt.
A file made for another tokenizer or vocabulary size is refused.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specvocab.engine.artifacts import save_torch, sidecar_path
from specvocab.engine.vocab.base import VocabError, VocabPolicy, softcap
from specvocab.locality.shortlist import load_ranking


class FrequencyError(VocabError):
    """A corpus, tokenizer, list or export is unusable as asked; the message names the problem and the fix."""



# --- list files: SGLang's token map and EAGLE-3's d2t / t2d ------------------------------------------------

def save_token_map(ids: Sequence[int], path: str | Path, *, tokenizer: str, vocab_size: int,
                   requested_k: int | None = None, meta: dict | None = None) -> Path:
    """Write a frequency list as SGLang's `--speculative-token-map` (a `torch.save`d list of ints), the file
    `vocab="frspec"` loads, with its sidecar."""
    ids = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
    check_ids(ids, vocab_size, str(path))
    info = {"format": "token_map", "tokenizer": tokenizer, "vocab_size": int(vocab_size), "size": len(ids),
            "requested_k": requested_k, **(meta or {})}
    return save_torch(ids, Path(path), sidecar=info)


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    a = np.asarray(ids, dtype=np.int64)
    if a.size == 0:
        raise FrequencyError(f"{what}: the list is empty — count a non-empty corpus")
    if a.min() < 0 or a.max() >= vocab_size:
        raise FrequencyError(f"{what}: token id {int(a.max() if a.max() >= vocab_size else a.min())} is outside the "
                             f"vocabulary of {vocab_size} — count with the target's own tokenizer")
    if np.unique(a).size != a.size:
        raise FrequencyError(f"{what}: the list repeats token ids — a shortlist holds each id once")


def read_map_meta(path: Path, tokenizer: str | None, vocab_size: int | None, fmt: str) -> dict:
    side = sidecar_path(path)
    if not path.exists():
        raise FrequencyError(f"{path} does not exist — write it with `python -m specvocab.engine.jobs.frequency`")
    meta = json.loads(side.read_text()) if side.exists() else {}
    if side.exists() and meta.get("format") != fmt:
        raise FrequencyError(f"{path} is a {meta.get('format')!r} file, not a {fmt!r} one")
    if tokenizer is not None and "tokenizer" in meta and meta["tokenizer"] != tokenizer:
        raise FrequencyError(f"{path} was made for tokenizer {meta['tokenizer']!r}, not {tokenizer!r}: its ids mean "
                             f"other tokens. Count a list with {tokenizer!r} (python -m specvocab.engine.jobs.frequency --model ...)")
    if vocab_size is not None and "vocab_size" in meta and meta["vocab_size"] != vocab_size:
        raise FrequencyError(f"{path} was made for a vocabulary of {meta['vocab_size']} ids but the target has "
                             f"{vocab_size} — count a list with the target's tokenizer "
                             f"(python -m specvocab.engine.jobs.frequency)")
    return meta


def load_token_map(path: str | Path, *, tokenizer: str | None = None, vocab_size: int | None = None) -> np.ndarray:
    """[K] the ids of a token map / frequency list (`save_token_map`, or any `torch.save`d list of ids such as
    FR-Spec's released lists); with `tokenizer` / `vocab_size`, refuse a file made for another vocabulary."""
    path = Path(path)
    meta = read_map_meta(path, tokenizer, vocab_size, "token_map")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    ids = np.asarray(obj.tolist() if hasattr(obj, "tolist") else obj, dtype=np.int64).reshape(-1)
    if vocab_size is not None:
        check_ids(ids, vocab_size, str(path))
    if meta and meta.get("size") != ids.size:
        raise FrequencyError(f"{path} holds {ids.size} ids but its sidecar says {meta.get('size')} — the files are out "
                             f"of sync, write them again")
    return ids


def eagle3_maps(ids: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft-vocabulary maps of a shortlist: d2t int64 [K] with target id = draft id + d2t[draft id],
    draft ids ordered by ascending target id; t2d bool [vocab_size], True at the K target ids."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    check_ids(ids, vocab_size, "eagle3_maps")
    target = np.sort(ids)                                               # [K] ascending target ids
    d2t = torch.as_tensor(target - np.arange(target.size), dtype=torch.int64)   # [K]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)                     # [V]
    t2d[torch.as_tensor(target)] = True
    return d2t, t2d


def save_eagle3_maps(ids: Sequence[int], path: str | Path, *, tokenizer: str, vocab_size: int,
                     requested_k: int | None = None, meta: dict | None = None) -> Path:
    """Write `{"d2t": ..., "t2d": ...}` (`eagle3_maps`) with `torch.save`, and its sidecar."""
    d2t, t2d = eagle3_maps(ids, vocab_size)
    info = {"format": "eagle3", "tokenizer": tokenizer, "vocab_size": int(vocab_size), "size": int(d2t.numel()),
            "requested_k": requested_k, **(meta or {})}
    return save_torch({"d2t": d2t, "t2d": t2d}, Path(path), sidecar=info)


def load_eagle3_maps(path: str | Path, *, tokenizer: str | None = None,
                     vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [K], t2d [V]) from a `save_eagle3_maps` file or an EAGLE-3 checkpoint's state dict, checked: t2d
    over `vocab_size` ids, t2d.sum() == K, d2t's target ids ascending and exactly t2d's."""
    path = Path(path)
    read_map_meta(path, tokenizer, vocab_size, "eagle3")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or "d2t" not in obj or "t2d" not in obj:
        raise FrequencyError(f"{path} holds no d2t / t2d tensors — write it with save_eagle3_maps")
    d2t, t2d = obj["d2t"].long().reshape(-1), obj["t2d"].bool().reshape(-1)
    if vocab_size is not None and t2d.numel() != vocab_size:
        raise FrequencyError(f"{path}: t2d covers {t2d.numel()} target ids but the target has {vocab_size} — export "
                             f"the maps with the target's tokenizer")
    target = d2t + torch.arange(d2t.numel())
    if int(t2d.sum()) != d2t.numel() or (target.numel() and (bool((target.diff() <= 0).any())
                                                              or int(target.max()) >= t2d.numel()
                                                              or not bool(t2d[target].all()))):
        raise FrequencyError(f"{path}: d2t and t2d disagree (t2d.sum()={int(t2d.sum())}, K={d2t.numel()}) — they must "
                             f"name the same target ids, d2t in ascending order")
    return d2t, t2d



# --- the policy ------------------------------------------------------------------------------------------

def load_frequency_ranking(path: str | Path, vocab_size: int | None = None, *,
                           tokenizer: str | None = None) -> np.ndarray:
    """Token ids, most frequent first, from a ranking written by `locality.shortlist.save_ranking` (Parquet +
    JSON sidecar; checked against `vocab_size`; ids it never counted are left out), or from .npy / .pt / .txt
    (one id per line) files, e.g. `engine.jobs.frequency`'s lists (a sidecar `<file>.json` is checked too:
    a list made for another `tokenizer` or vocabulary size is refused). A .pt list is a token map and loads
    through `load_token_map` (`torch.load(weights_only=True)`: no pickled code runs)."""
    path = Path(path)
    if not path.exists():
        raise VocabError(f"frequency file {path} does not exist — build one with "
                         f"`python -m specvocab.engine.jobs.frequency` and pass frequency_file=<path>")
    side = path.with_name(path.name + ".json")
    if path.suffix != ".parquet" and side.exists():
        meta = json.loads(side.read_text())
        made_for = meta.get("vocab_size")
        if vocab_size is not None and made_for not in (None, vocab_size):
            raise VocabError(f"frequency file {path} was made for a vocabulary of {made_for} ids but the model has "
                             f"{vocab_size} — count a list with the target's tokenizer "
                             f"(python -m specvocab.engine.jobs.frequency)")
        if tokenizer and meta.get("tokenizer") not in (None, tokenizer):
            raise FrequencyError(f"frequency file {path} was made for tokenizer {meta['tokenizer']!r}, not this "
                                 f"target's {tokenizer!r}: its ids mean other tokens. Count a list with "
                                 f"{tokenizer!r} (python -m specvocab.engine.jobs.frequency --model ...)")
    if path.suffix == ".parquet":
        frame = load_ranking(path, vocab_size=vocab_size).sort("rank")
        ranking = frame["token_id"].to_numpy()[frame["count"].to_numpy() > 0]   # never-seen ids are not ranked
    elif path.suffix == ".npy":
        ranking = np.load(path)
    elif path.suffix == ".pt":
        try:
            ranking = load_token_map(path, tokenizer=tokenizer or None, vocab_size=vocab_size)
        except pickle.UnpicklingError as e:
            raise FrequencyError(f"frequency file {path} is not a plain list of token ids (torch.load with "
                                 f"weights_only=True refused it: {str(e).splitlines()[0]}) — write it with "
                                 f"specvocab.engine.vocab.save_token_map") from None
    elif path.suffix == ".txt":
        ranking = np.loadtxt(path, dtype=np.int64, ndmin=1)
    else:
        raise VocabError(f"cannot read frequency file {path}: use a ranking written by locality.shortlist "
                         f"(.parquet), or .npy, .pt or .txt (token ids, most frequent first)")
    ranking = np.asarray(ranking.tolist() if hasattr(ranking, "tolist") else ranking, dtype=np.int64).reshape(-1)
    if ranking.size == 0:
        raise VocabError(f"frequency file {path} holds no token ids — rebuild it from a non-empty corpus")
    return ranking


class FrSpecVocab(VocabPolicy):
    """Static top-K of a frequency ranking (FR-Spec); the K rows are packed once at construction.

    `frspec_budget="position"` is FR-Spec-PA, the position-aware baseline of DynaSpec (App. A.1): draft step t
    (t = 0 the root's children) scores only the top floor(K / (t + 1)) ids of the list, as DynaSpec-PA
    shrinks its cluster budget with depth; the drafter's `route(tokens, parent_h, t)` call before each head
    call sets it. The active vocab and coverage of a step stay those of the whole list (the step's
    first head call reads all K; later ones a prefix of it)."""

    name = "frspec"

    def __init__(self, weight, cfg, *, softcap=None, timer=None, ranking=None, tokenizer: str | None = None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        if ranking is None:
            if cfg.frequency_file is None:
                raise VocabError("vocab='frspec' needs a frequency ranking: build one with "
                                 "`python -m specvocab.locality.shortlist` and pass frequency_file=<path>")
            ranking = load_frequency_ranking(cfg.frequency_file, self.vocab_size, tokenizer=tokenizer)
        ranking = torch.as_tensor(np.asarray(ranking), dtype=torch.long).reshape(-1)
        if ranking.numel() and (int(ranking.max()) >= self.vocab_size or int(ranking.min()) < 0):
            raise VocabError(f"the frequency ranking holds token id {int(ranking.max())} outside this model's "
                             f"vocabulary of {self.vocab_size} — build it with the same tokenizer as the target")
        _, first = np.unique(ranking.numpy(), return_index=True)
        ranking = ranking[np.sort(first)]                       # keep-first, in case of repeats
        self.k = min(cfg.frspec_k, self.vocab_size, ranking.numel())   # K clipped to V (and to what is ranked)
        if cfg.frspec_k > self.k < self.vocab_size:
            warnings.warn(f"frspec_k={cfg.frspec_k} exceeds the {ranking.numel()} ids the frequency list ranks "
                          f"(tokens its corpus showed + kept specials): the shortlist's true size is {self.k}",
                          stacklevel=2)
        self.ids = ranking[: self.k].to(self.device)            # [K] full-vocab ids, most frequent first
        self.packed = weight[self.ids].contiguous()             # [K, d]
        self.mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        self.mask[self.ids] = True
        self.budget = getattr(cfg, "frspec_budget", "fixed")
        if self.budget not in ("fixed", "position"):
            raise VocabError(f"frspec_budget must be 'fixed' (FR-Spec) or 'position' (FR-Spec-PA), got {self.budget!r}")
        self.k_step = self.k                                    # rows of `packed` the next head call reads
        self._step_max = 0                                      # the largest budget of this draft step

    def route(self, tokens, parent_h, t):
        """FR-Spec-PA (DynaSpec App. A.1): the next head call (draft step t) reads the top floor(K / (t + 1)) of the
        list, a prefix of the packed rows (no copy). Fixed (FR-Spec): K at every step."""
        self.k_step = self.k if self.budget == "fixed" else max(1, self.k // (t + 1))
        self._step_max = self.k_step if t == 0 else max(self._step_max, self.k_step)

    def logits(self, h):
        h = self._check_h(h)
        k = self.k_step
        return softcap(torch.nn.functional.linear(h, self.packed[:k]).float(), self.softcap), self.ids[:k]

    def step_sizes(self, depth: int) -> list[int]:
        """The shortlist size at draft steps t = 0..depth-1."""
        return [self.k if self.budget == "fixed" else max(1, self.k // (t + 1)) for t in range(depth)]

    def active_size(self):
        return self.k

    def active_mask(self):
        return self.mask
