"""Writing a file by one rule, with no torch: `atomic_write`, `atomic_dir` and `sidecar_path`; and naming one
(`safe_filename`: a model, tokenizer or run name as one file or folder name).

The rule (temporary file beside the target, fsync, `os.replace`, fsync the folder) is described in
`engine.artifacts`, which re-exports these three and adds the writers that need torch (`save_safetensors`,
`save_torch`) and the LM-head fingerprint. They live here so that what only writes files - the sweeps'
results (`sweeps.results`), the calibration cache - loads without torch (`sweeps.tables` draws from a
results folder in a process without torch). Below everything in `engine`: imports nothing from it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

SAFE_FILENAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


def safe_filename(name: object, fill: str = "_") -> str:
    """`name` (its `str`) as one file or folder name, the same on every file system: each character outside
    SAFE_FILENAME_CHARS (ASCII letters and digits, '-', '_', '.') becomes `fill`, so a path separator never
    survives ("HuggingFaceTB/SmolLM2-135M-Instruct" -> "HuggingFaceTB_SmolLM2-135M-Instruct"). A name that
    would leave nothing or only dots ("", ".", "..") - no name, or the folder itself or its parent - is
    `fill` per character instead (at least one)."""
    text = str(name)
    out = "".join(ch if ch in SAFE_FILENAME_CHARS else fill for ch in text)
    return out if out.strip(".") else fill * max(1, len(text))


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of a file: `<path>.json`."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable. Windows has no directory handle to fsync, and some file systems
    refuse fsync on a directory (EINVAL): the rename is still atomic there, only not yet on disk."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, content: bytes | str | Callable[[Path], object], *,
                 sidecar: Mapping | bool | None = None) -> Path:
    """Write `path` by the rule in the module docstring and return it. `content` is bytes, text (UTF-8) or
    `write(tmp_path)`, which writes the file itself (`frame.write_parquet`, `torch.save`, ...).

    `sidecar`: a mapping is written as JSON to `sidecar_path(path)`; True means `write` wrote
    `sidecar_path(tmp_path)` itself (as `locality.shortlist.save_ranking` does). Either way the sidecar is
    committed with the file, before it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    side_tmp = sidecar_path(tmp)
    try:
        if callable(content):
            content(tmp)
        elif isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            tmp.write_bytes(content)
        moves = []
        if isinstance(sidecar, Mapping):
            side_tmp.write_text(json.dumps(dict(sidecar), indent=1, sort_keys=True), encoding="utf-8")
        if isinstance(sidecar, Mapping) or sidecar is True:
            if not side_tmp.is_file():
                raise FileNotFoundError(f"atomic_write({path}, sidecar=True): the writer did not write the sidecar "
                                        f"{side_tmp.name} beside the temporary file")
            moves.append((side_tmp, sidecar_path(path)))
        moves.append((tmp, path))
        for src, _ in moves:
            _fsync_file(src)
        for src, dst in moves:
            os.replace(src, dst)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    return path


@contextmanager
def atomic_dir(final: str | Path, *, finished: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; when the body returns, fsync what it wrote and rename the folder
    to `final` (then fsync the parent); on any error delete it. A folder cannot be renamed over a non-empty
    one: if `final` exists by then and `finished(final)` says it is complete (another process got there
    first), theirs is kept and ours deleted; otherwise the rename's error is raised."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                _fsync_file(f)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if finished is None or not finished(final):
                raise
        else:
            fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
