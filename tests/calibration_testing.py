"""Test-only fixtures of the calibration tests: a private specvocab cache and a tiny model."""

from __future__ import annotations

import pytest

from specvocab.engine.models import load_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    return tmp_path


@pytest.fixture(scope="module")
def tiny():
    model, _, info = load_model("random-llama", vocab_size=300, hidden_size=32, num_layers=1)
    return model, info
