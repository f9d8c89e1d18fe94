"""The wheel: `pip wheel .` builds one holding the whole package under one import name, `specvocab`, and nothing
beside it; installed (not editable) into a fresh virtual environment and run from outside the checkout, it
decodes with the C kernels it compiles from its own sources; Hugging Face's `kernels` and a distribution that
owns the generic top-level names `engine`, `sweeps` and `locality` install beside it, each side's files intact,
and each keeps working when the other is uninstalled.

Slow: the wheel carries the shipped heads (~100 MB) and is built once per module; the C kernels compile once
per module in a fresh $SPECVOCAB_CACHE; Hugging Face's `kernels` and its missing dependencies come from PyPI.
Each virtual environment takes torch and transformers from this one (`--system-site-packages`).
"""

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from specvocab.engine import calibration
from specvocab.kernels import cpu
from specvocab.kernels.hardware import cpu_flags
from specvocab.sweeps import render

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]          # {"specvocab.engine": "engine", ...}
VERSION = PYPROJECT["project"]["version"]
GENERIC = ("engine", "kernels", "locality", "sweeps")                    # our parts' names, as top-level names
KERNEL_FILE = {"avx512": cpu.SOURCE.stem, "avx2": cpu.SOURCE_AVX2.stem}   # isa() -> the C file built for it

# Run by each virtual environment's python from a folder outside the checkout; prints one JSON line.
PROBE = r'''
import ast, base64, hashlib, importlib, importlib.metadata, importlib.util, json, pkgutil, subprocess, sys, sysconfig
from pathlib import Path

GENERIC = ("engine", "kernels", "locality", "sweeps")


def record(dist):
    """`dist`'s files by its RECORD, those whose bytes no longer match their RECORD hash, and where it lies;
    None when it is not installed."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    files, changed = [], []
    for f in d.files:
        path = Path(d.locate_file(f)).resolve()
        files.append(str(path))
        if f.hash is not None:
            data = path.read_bytes() if path.is_file() else b""
            digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b"=").decode()
            if digest != f.hash.value:
                changed.append(str(path))
    return {"files": files, "changed": changed, "location": str(d.locate_file(""))}


def origins():
    """Where each generic top-level name imports from (None: nowhere)."""
    return {name: getattr(importlib.util.find_spec(name), "origin", None) for name in GENERIC}


out = {"purelib": sysconfig.get_paths()["purelib"], "origins": origins(),
       "records": {d: record(d) for d in ("specvocab", "kernels", "generic-names")}}


def ours():
    """A packed fp32 linear through the C kernels against its plain-torch reference."""
    import torch
    import specvocab
    from specvocab.kernels import cpu

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(37, 70, generator=g), torch.randn(3, 70, generator=g)
    ref = cpu.linear_reference(x, w, out_dtype=torch.float32)
    err = float((cpu.pack(w)(x) - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    return {"file": specvocab.__file__, "isa": cpu.isa(), "linear_rel_rms": err,
            "generic_loaded": sorted({m.split(".")[0] for m in sys.modules} & set(GENERIC))}


def every_module():
    """Every module of the installed package imported (the notebooks are scripts, not modules), and the
    top-level generic names that loaded."""
    import specvocab

    names = [m.name for m in pkgutil.walk_packages(specvocab.__path__, "specvocab.")
             if not m.name.startswith("specvocab.notebooks") and not m.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    return {"modules": len(names), "generic_loaded": sorted({m.split(".")[0] for m in sys.modules} & set(GENERIC))}


def hf():
    """Hugging Face's `kernels` imported, and what transformers' probe of it reads (import name, version)."""
    import kernels
    from kernels import get_kernel

    return {"file": kernels.__file__, "get_kernel": f"{get_kernel.__module__}.{get_kernel.__qualname__}",
            "callable": callable(get_kernel), "version": kernels.__version__,
            "metadata_version": importlib.metadata.version("kernels")}


def decode():
    """A short greedy decode of a random model on the native path, `ar` and `unispec`, with what the library
    says about the kernels that ran and about where it reads its own files."""
    import torch
    import specvocab
    from specvocab.engine import calibration
    from specvocab.engine.harness import generate
    from specvocab.engine.models import load_model
    from specvocab.engine.target import native_model
    from specvocab.kernels import cpu
    from specvocab.kernels.hardware import DEFAULT_DTYPE, cache_root
    from specvocab.sweeps import provenance, render

    model = load_model("random-llama", dtype=DEFAULT_DTYPE)[0]
    d, v = model.config.hidden_size, model.config.vocab_size
    head = torch.nn.Linear(d, v, bias=False, dtype=model.dtype)        # an untied head: varied greedy text
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=torch.Generator().manual_seed(1)) * 4 / d ** 0.5)
    model.lm_head, model.config.tie_word_embeddings = head, False
    prompt = torch.randint(0, v, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ar = generate(model, prompt, method="ar", max_new_tokens=16, eos_ids=[], backend="native")
    spec = generate(model, prompt, method="unispec", max_new_tokens=16, eos_ids=[], backend="native", draft_size=12)
    net = native_model(model)
    home = Path(specvocab.__file__).parent
    with render._this_checkout_first():                        # what a notebook kernel `render` starts imports
        seen = subprocess.run([sys.executable, "-c", f"import importlib.util as u; print([getattr(u.find_spec(n), "
                               f"'origin', None) for n in {GENERIC!r} + ('specvocab',)])"],
                              capture_output=True, text=True, check=True).stdout
    return {
        "files": {m.__name__: m.__file__ for m in (specvocab, calibration, cpu, render, provenance)},
        "version": specvocab.__version__, "dist_version": importlib.metadata.version("specvocab"),
        "dtype": str(model.dtype).removeprefix("torch."), "isa": cpu.isa(),
        "decode_reason": cpu.decode_reason(torch.device("cpu"), model.dtype), "broken": cpu.broken(),
        "kernel_on": net.kernel_on,
        "sources": [str(p) for p in (cpu.SOURCE, cpu.SOURCE_AVX2, cpu.PORTABLE)],
        "cache": str(cache_root()),
        "ar": ar.output_ids.tolist(), "spec": spec.output_ids.tolist(), "drafted": spec.draft_tokens,
        "code_files": [p.relative_to(home).as_posix() for p in calibration.code_files()],
        "code_stamp": calibration.code_stamp(),
        "notebooks": [str(p) for p in render.notebooks()], "checkout": provenance.checkout(),
        "notebook_kernel_sees": dict(zip(GENERIC + ("specvocab",), ast.literal_eval(seen))),
    }


for part in sys.argv[1:]:
    try:
        out[part] = {"ours": ours, "every_module": every_module, "hf": hf, "decode": decode}[part]()
    except Exception as e:                                              # reported, asserted on by the test
        out[part] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out, default=str))
'''


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def _sources() -> list[Path]:
    """What a build reads, relative to the checkout: pyproject.toml, README.md and the package-dir folders;
    from a git checkout the files git tracks or would track (ignored ones stay out), else all but caches."""
    roots = ["pyproject.toml", "README.md", *PACKAGE_DIRS.values()]
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = _run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "-z", "--", *roots]).stdout
        return sorted(Path(p) for p in set(listed.split("\0")) if p and (ROOT / p).is_file())
    return sorted(p.relative_to(ROOT) for r in roots for p in ([ROOT / r] if (ROOT / r).is_file() else
                  (ROOT / r).rglob("*")) if p.is_file() and "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout's build inputs: the build writes build/ and *.egg-info beside its sources."""
    src = tmp_path_factory.mktemp("source")
    for rel in _sources():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    """`pip wheel --no-deps` of the checkout, built by this environment's setuptools (no isolated build env)."""
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", source, "-w", out])
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """This module's $SPECVOCAB_CACHE: empty at first, so the C kernels compile from an installed wheel."""
    return tmp_path_factory.mktemp("specvocab-cache")


@pytest.fixture(scope="module")
def hf_kernels_wheel(tmp_path_factory) -> Path:
    """Hugging Face's `kernels` (PyPI), downloaded once."""
    out = tmp_path_factory.mktemp("hf-kernels")
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "kernels", "-d", out])
    (got,) = out.glob("kernels-*.whl")
    return got


class Venv:
    """A fresh virtual environment over this one's site-packages, with the wheel installed."""

    def __init__(self, folder: Path, cache: Path):
        self.folder, self.work = folder / "venv", folder / "elsewhere"     # `elsewhere`: cwd outside the checkout
        self.work.mkdir()
        _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", self.folder])
        self.python = self.folder / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env.update(SPECVOCAB_CACHE=str(cache), SPECVOCAB_REQUIRE_KERNELS="1")
        (self.work / "probe.py").write_text(PROBE)

    def pip(self, *args) -> str:
        """pip of this environment (pip itself comes from the system site-packages)."""
        return _run([self.python, "-m", "pip", *args], cwd=self.work, env=self.env).stdout

    def pip_check(self) -> list[str]:
        done = subprocess.run([self.python, "-m", "pip", "check"], capture_output=True, text=True, cwd=self.work,
                              env=self.env)
        return done.stdout.splitlines()

    def probe(self, *parts: str) -> dict:
        return json.loads(_run([self.python, "probe.py", *parts], cwd=self.work, env=self.env).stdout.splitlines()[-1])


@pytest.fixture
def venv(wheel, cache, tmp_path) -> Venv:
    env = Venv(tmp_path, cache)
    env.pip("install", "--no-deps", "--no-index", "-q", wheel)
    return env


def _needs_c_kernels():
    flags = cpu_flags()
    if not ({"avx512f", "avx512bw", "avx512vl"} <= flags or {"avx2", "fma"} <= flags):
        pytest.skip(f"the C kernels need AVX-512F/BW/VL or AVX2 + FMA; this CPU lacks "
                    f"{', '.join(sorted({'avx2', 'fma'} - flags))}")


def _inside(path, folder) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(Path(folder).resolve())


def _intact(probe: dict, dist: str) -> list[str]:
    rec = probe["records"][dist]
    assert rec is not None, f"{dist} is not installed"
    return rec["changed"]


def _problems(lines: list[str], dists) -> list[str]:
    """`pip check` lines about `dists`, as the requiring or the required distribution ("X 1.0 requires Y, which
    is not installed." / "X 1.0 has requirement Y>=2, but you have Y 1.0.")."""
    def name(word: str) -> str:
        return re.split(r"[<>=!~;,\[]", word.lower().replace("_", "-"))[0]

    return [ln for ln in lines if ln.split() and ({name(ln.split()[0])} | {
        name(w) for w in re.findall(r"(?:requires|requirement|you have) (\S+)", ln)}) & set(dists)]


# --- what the wheel holds ----------------------------------------------------------------------------------

def test_wheel_holds_every_file_of_the_package_folders_under_specvocab_and_nothing_else(wheel, source):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        dist_info = f"specvocab-{VERSION}.dist-info"
        top_level = z.read(f"{dist_info}/top_level.txt").decode().split()
    assert {n.split("/")[0] for n in names} == {"specvocab", dist_info}
    assert top_level == ["specvocab"]
    # every file of every folder the package maps (modules, kernels/*.c, engine/heads/**, sweeps/configs,
    # notebooks) at its import path, and no other file
    expected = {f"{package.replace('.', '/')}/{p.relative_to(source / folder).as_posix()}"
                for package, folder in PACKAGE_DIRS.items() for p in (source / folder).rglob("*") if p.is_file()}
    shipped = {n for n in names if n.startswith("specvocab/")}
    assert sorted(expected - shipped) == [], "in the package's folders but not in the wheel (pyproject package-data)"
    assert sorted(shipped - expected) == [], "in the wheel but in none of the package's folders"
    for must in (cpu.SOURCE, cpu.SOURCE_AVX2, cpu.PORTABLE):                  # what kernels.cpu compiles
        assert f"specvocab/kernels/{must.name}" in shipped


# --- the installed wheel, alone ----------------------------------------------------------------------------

def test_installed_wheel_decodes_from_site_packages_with_the_c_kernels_it_builds(venv, source, cache):
    _needs_c_kernels()
    out = venv.probe("decode")
    run = out["decode"]
    assert "error" not in run, run["error"]
    home = Path(out["purelib"]) / "specvocab"
    assert _inside(out["purelib"], venv.folder)
    for name, file in run["files"].items():                     # imported from the venv, not from the checkout
        assert _inside(file, home), (name, file)
    assert all(_inside(p, home / "kernels") for p in run["sources"])
    assert run["version"] == run["dist_version"] == VERSION
    # no top-level name of ours: each generic name imports from nowhere, or from another distribution
    assert not any(_inside(origin, out["purelib"]) for origin in out["origins"].values()), out["origins"]
    # the C kernels: built into this module's fresh cache from the installed sources, and used by the decode
    assert run["isa"] in KERNEL_FILE and run["kernel_on"] is True, run
    assert run["decode_reason"] is None and run["broken"] == [], run      # this machine's fastest path ran
    built = sorted(p.name for p in (cache / "kernels").glob("*.so"))
    assert run["cache"] == str(cache) and any(n.startswith(f"{KERNEL_FILE[run['isa']]}-") for n in built), built
    # lossless: unispec drafted and still decoded ar's tokens
    assert len(run["ar"]) == 16 and run["drafted"] > 0 and run["spec"] == run["ar"]
    # files read relative to the package: the decoder's sources that stamp a calibration record (the same
    # files and stamp as the checkout's), the figure notebooks `specvocab render` runs; a wheel is no checkout
    assert run["code_files"] == [p.relative_to(source).as_posix() for p in calibration.code_files(source)]
    assert run["code_stamp"] == calibration.code_stamp(source)
    assert [Path(p).name for p in run["notebooks"]] == [p.name for p in render.notebooks()]
    assert all(_inside(p, home / "notebooks") for p in run["notebooks"])
    sees = run["notebook_kernel_sees"]                         # the kernels `render` starts import this wheel
    assert _inside(sees.pop("specvocab"), home) and not any(_inside(o, out["purelib"]) for o in sees.values()), sees
    assert run["checkout"] is None


# --- beside other distributions ----------------------------------------------------------------------------

def test_hugging_face_kernels_installs_beside_us_and_each_survives_the_others_uninstall(venv, hf_kernels_wheel):
    _needs_c_kernels()
    venv.pip("install", "-q", hf_kernels_wheel)                  # with whichever dependencies are missing here
    both = venv.probe("ours", "hf")
    purelib = Path(both["purelib"])
    assert "error" not in both["ours"] and "error" not in both["hf"], (both["ours"], both["hf"])
    assert _inside(both["ours"]["file"], purelib / "specvocab")
    assert both["ours"]["isa"] in KERNEL_FILE and both["ours"]["linear_rel_rms"] < 1e-5
    assert both["ours"]["generic_loaded"] == []                  # ours loaded no top-level `kernels`
    hf = both["hf"]
    assert Path(hf["file"]) == purelib / "kernels" / "__init__.py" and hf["callable"]
    assert hf["get_kernel"].startswith("kernels.") and hf["version"] == hf["metadata_version"]
    # transformers probes `kernels` by import name and distribution version: both are Hugging Face's
    assert both["origins"]["kernels"] == hf["file"]
    assert _problems(venv.pip_check(), ("specvocab", "kernels")) == []
    ours_files, theirs_files = (set(both["records"][d]["files"]) for d in ("specvocab", "kernels"))
    assert ours_files and theirs_files and not ours_files & theirs_files
    assert _intact(both, "specvocab") == [] and _intact(both, "kernels") == []

    venv.pip("uninstall", "-y", "-q", "kernels")
    alone = venv.probe("ours")
    assert "error" not in alone["ours"], alone["ours"]
    assert alone["ours"]["linear_rel_rms"] < 1e-5 and _intact(alone, "specvocab") == []
    assert not _inside(alone["origins"]["kernels"], purelib)

    venv.pip("install", "--no-deps", "--no-index", "-q", hf_kernels_wheel)
    venv.pip("uninstall", "-y", "-q", "specvocab")
    theirs = venv.probe("hf")
    assert not (purelib / "specvocab").exists()
    assert "error" not in theirs["hf"], theirs["hf"]
    assert theirs["hf"]["file"] == hf["file"] and theirs["hf"]["callable"] and _intact(theirs, "kernels") == []


def _generic_names_wheel(folder: Path) -> Path:
    """A wheel of `generic-names` 1.0 owning the top-level packages engine, sweeps and locality (each
    `__init__.py` sets OWNER)."""
    dist_info = "generic_names-1.0.dist-info"
    files = {f"{name}/__init__.py": b'OWNER = "generic-names"\n' for name in ("engine", "sweeps", "locality")}
    files[f"{dist_info}/METADATA"] = b"Metadata-Version: 2.1\nName: generic-names\nVersion: 1.0\n"
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist_info}/top_level.txt"] = b"engine\nlocality\nsweeps\n"
    rows = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
            for n, b in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join(rows + [f"{dist_info}/RECORD,,"]) + "\n").encode()
    path = folder / "generic_names-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
    return path


def test_a_distribution_owning_top_level_engine_sweeps_locality_does_not_shadow_ours(venv, tmp_path):
    _needs_c_kernels()
    venv.pip("install", "--no-deps", "--no-index", "-q", _generic_names_wheel(tmp_path))
    out = venv.probe("every_module", "ours")
    purelib = Path(out["purelib"])
    for name in ("engine", "sweeps", "locality"):                 # theirs is installed and importable ...
        assert Path(out["origins"][name]) == purelib / name / "__init__.py"
    every, ours = out["every_module"], out["ours"]
    assert "error" not in every and "error" not in ours, (every, ours)   # ... and every module of ours imports
    assert every["modules"] > 0 and ours["linear_rel_rms"] < 1e-5        # beside it and the kernels run,
    assert every["generic_loaded"] == ours["generic_loaded"] == []       # never reaching for a generic name
    assert _problems(venv.pip_check(), ("specvocab", "generic-names")) == []
    assert not set(out["records"]["specvocab"]["files"]) & set(out["records"]["generic-names"]["files"])
    assert _intact(out, "specvocab") == [] and _intact(out, "generic-names") == []
