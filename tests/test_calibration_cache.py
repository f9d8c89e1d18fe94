"""The calibration cache (engine.calibration): records round-trip through the JSON file and resolve a run's draft
size; a record's code stamp (`code_stamp`) - s(g) belongs to the code that measured it, so a g* measured by other
code is used with a warning that names the command re-measuring it."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from specvocab.engine import calibration as calib
from specvocab.engine.config import SpecConfig
from tests.calibration_testing import cache_dir, tiny  # noqa: F401 (fixtures: a private cache, a tiny model)


def test_a_g_star_measured_by_other_code_is_used_with_one_warning_naming_the_command(cache_dir, tiny):
    """s(g) belongs to the code that measured it: a record whose `code` is not this decoder's `code_stamp` (or
    has none: an older version) still gives its g* (a better guess than the fallback), with one warning per
    key that names the command re-measuring it; a record of this code gives it silently."""
    model, _ = tiny
    cfg = SpecConfig.preset("unispec")
    key = calib.model_key(model, cfg)
    for code in ("0123456789ab", None):
        rec = {"g_star": 9} if code is None else {"g_star": 9, "code": code}
        calib.save_calibration(key, rec)
        calib._warned.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert [calib.resolve_draft_size(cfg, model) for _ in range(3)] == [9, 9, 9]
        msgs = [str(x.message) for x in w]
        assert len(msgs) == 1 and "measured by other code" in msgs[0], msgs
        assert calib.calibrate_command(cfg, model) in msgs[0] and calib.code_stamp() in msgs[0]
        assert (code or "no code stamp") in msgs[0]
    calib.save_calibration(key, {"g_star": 9, "code": calib.code_stamp()})
    calib._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert calib.resolve_draft_size(cfg, model) == 9
    assert not w


def test_the_code_stamp_follows_the_decoders_sources_not_its_jobs(tmp_path, monkeypatch):
    """`code_stamp` hashes engine/ and kernels/ (Python and C) without engine/jobs, and torch's version: a copy
    of them stamps the same; an edit to the C kernels or a drafter, or another torch, changes the stamp; an
    edit to a job does not."""
    root = Path(calib.__file__).resolve().parent.parent
    skip = shutil.ignore_patterns("heads", "__pycache__", "*.safetensors", "*.so")

    def stamp_of_copy(name, edit=None):
        dst = tmp_path / name
        for d in calib.CODE_DIRS:
            shutil.copytree(root / d, dst / d, ignore=skip)
        if edit:
            with open(dst / edit, "a") as f:
                f.write("\n")
        return calib.code_stamp(dst)

    assert stamp_of_copy("same") == calib.code_stamp()
    assert stamp_of_copy("c", "kernels/cpu.c") != calib.code_stamp()
    assert stamp_of_copy("drafter", "engine/drafters/unispec.py") != calib.code_stamp()
    assert stamp_of_copy("job", "engine/jobs/bench.py") == calib.code_stamp()
    assert stamp_of_copy("c2", "kernels/cpu_portable.c") != calib.code_stamp()       # #included by both builds
    assert sorted(f.name for f in calib.code_files(root) if f.suffix == ".c") == ["cpu.c", "cpu_avx2.c",
                                                                                   "cpu_portable.c"]
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert stamp_of_copy("torch") != calib.code_stamp()


def test_cache_round_trip_and_resolve(cache_dir, tiny):
    model, info = tiny
    cfg = SpecConfig.preset("unispec")
    key = calib.model_key(model, cfg)
    assert key.startswith("llama-V300-d32-L1|cpu:") and "|float32|unispec|" in key
    assert key.endswith(f"|{calib.config_fingerprint(cfg)}|{calib.kernel_build(model, cfg)}")
    assert calib.cached_draft_size(key) is None
    with pytest.raises(calib.CalibrationError, match="specvocab.engine.jobs.calibrate"):
        calib.resolve_draft_size(cfg, model, on_missing="error")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert calib.resolve_draft_size(cfg, model) == calib.FALLBACK_DRAFT_SIZE["cpu"]
    assert any("no calibrated draft size" in str(x.message) for x in w)
    path = calib.save_calibration(key, {"g_star": 13, "rows": [{"g": 13, "tau": 1.5}]})
    assert path == cache_dir / "calibration.json"
    other = calib.model_key(model, cfg.replace(method="recycling"))
    calib.save_calibration(other, {"g_star": 40})
    data = json.loads(path.read_text())
    assert data[key]["g_star"] == 13 and data[other]["g_star"] == 40
    assert calib.resolve_draft_size(cfg, model) == 13
    assert calib.resolve_draft_size(cfg.replace(method="recycling"), model) == 40
    assert calib.resolve_draft_size(cfg.replace(draft_size=5), model) == 5
    path.write_text("{not json")
    with pytest.raises(calib.CalibrationError, match="corrupt"):
        calib.cached_draft_size(key)


def test_specvocab_calibration_names_the_cache_file_and_nothing_else_moves(tmp_path, monkeypatch, tiny):
    model, _ = tiny
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECVOCAB_CALIBRATION", str(tmp_path / "elsewhere" / "mine.json"))
    key = calib.model_key(model, SpecConfig.preset("unispec"))
    path = calib.save_calibration(key, {"g_star": 9})
    assert path == tmp_path / "elsewhere" / "mine.json" and calib.cached_draft_size(key) == 9
    assert not (tmp_path / "cache" / "calibration.json").exists()
    monkeypatch.delenv("SPECVOCAB_CALIBRATION")
    assert calib.cache_file() == tmp_path / "cache" / "calibration.json" and calib.cached_draft_size(key) is None
