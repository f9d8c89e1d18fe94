"""`engine.artifacts`: the one atomic-write rule, sidecars, and the LM-head fingerprint with its one check.

- atomic_write: bytes, text or a writer; a writer that raises leaves the old file (and sidecar) as they were
  and no temporary file behind; the file is fsynced before the rename and the folder after; a sidecar lands
  with its file;
- the fingerprint check accepts a bf16 / fp16 copy of an fp32 head (and the other way round), even one built
  so that rounding moves every element by nearly bf16's unit roundoff, and refuses another head of the same
  shape, the same head scaled by 2^-7, and a fine-tune-like change of 1-2%; the old key
  (`target_fingerprint`) and the old row-norm fingerprints are still read.
"""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specvocab.engine import atomic
from specvocab.engine.artifacts import (FINGERPRINT_KEY, FINGERPRINT_RTOL, atomic_dir, atomic_write, fingerprint_matches,
                              fingerprint_distance, head_fingerprint, head_matches, old_head_fingerprint,
                              save_safetensors, save_torch, sidecar_path, stored_fingerprint)
from specvocab.engine.drafters.eagle import check_head_target, random_eagle_head, save_eagle_head
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.models import load_model
from specvocab.engine.shipped import SHIPPED_HEADS, default_eagle_head


# --- atomic_write ----------------------------------------------------------------------------------------------

def test_atomic_write_writes_bytes_text_and_a_writers_file(tmp_path):
    assert atomic_write(tmp_path / "sub" / "a.bin", b"\x00\x01").read_bytes() == b"\x00\x01"   # folders made
    assert atomic_write(tmp_path / "b.txt", "héllo").read_text(encoding="utf-8") == "héllo"
    atomic_write(tmp_path / "c.txt", lambda tmp: tmp.write_text("by the writer"))
    assert (tmp_path / "c.txt").read_text() == "by the writer"
    atomic_write(tmp_path / "c.txt", "replaced")
    assert (tmp_path / "c.txt").read_text() == "replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "c.txt", "sub"]     # no temporary file left


def test_a_writer_that_raises_leaves_the_old_file_and_sidecar_intact(tmp_path):
    path = tmp_path / "x.parquet"
    atomic_write(path, "old", sidecar={"v": 1})

    def half_then_crash(tmp):
        tmp.write_text("half of the new con")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic_write(path, half_then_crash, sidecar={"v": 2})
    assert path.read_text() == "old" and json.loads(sidecar_path(path).read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet", "x.parquet.json"]
    with pytest.raises(Exception):                      # torch.save of something it cannot pickle, half written
        save_torch({"f": lambda: 0}, path)
    assert path.read_text() == "old" and len(list(tmp_path.iterdir())) == 2


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode)
                                                               else "fsync file"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"replace {os.path.basename(b)}"),
                                                     real_replace(a, b))[1])
    atomic_write(tmp_path / "f.bin", b"x", sidecar={"k": 1})
    assert events == ["fsync file", "fsync file", "replace f.bin.json", "replace f.bin", "fsync dir"]


def test_a_sidecar_lands_with_its_file(tmp_path):
    path = save_safetensors({"a": torch.arange(3)}, tmp_path / "t.safetensors", metadata={"m": "1"},
                            sidecar={"model": "x"})
    assert torch.equal(load_file(str(path))["a"], torch.arange(3))
    assert json.loads(sidecar_path(path).read_text()) == {"model": "x"}
    # sidecar=True: the writer writes the sidecar beside the temporary file itself (locality's save_ranking)
    atomic_write(tmp_path / "r.bin", lambda tmp: (tmp.write_text("r"), sidecar_path(tmp).write_text("{}")))
    assert not sidecar_path(tmp_path / "r.bin").exists()             # not asked for: not kept
    atomic_write(tmp_path / "r.bin", lambda tmp: (tmp.write_text("r"), sidecar_path(tmp).write_text("{}")),
                 sidecar=True)
    assert sidecar_path(tmp_path / "r.bin").read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="did not write the sidecar"):
        atomic_write(tmp_path / "s.bin", "s", sidecar=True)
    assert not (tmp_path / "s.bin").exists()
    assert save_torch([1, 2], tmp_path / "l.pt") and torch.load(tmp_path / "l.pt") == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.pt", "r.bin", "r.bin.json", "t.safetensors",
                                                          "t.safetensors.json"]


def test_atomic_dir_keeps_a_finished_rival_only_when_told_it_is_finished(tmp_path):
    final = tmp_path / "d"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(OSError):                          # final exists, nobody said it is complete
        with atomic_dir(final) as tmp:
            (tmp / "a").write_text("second")
    with atomic_dir(final, finished=lambda f: (f / "a").is_file()) as tmp:
        (tmp / "a").write_text("third")
    assert (final / "a").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# --- the fingerprint -----------------------------------------------------------------------------------------

def _head(seed: int) -> torch.Tensor:
    return torch.randn(1000, 64, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_a_bf16_or_fp16_copy_matches_and_another_head_does_not():
    w = _head(0)
    stored = head_fingerprint(w)
    assert stored["kind"] == "probe" and len(stored["values"]) == len(stored["rows"]) * stored["probes"]
    assert json.loads(json.dumps(stored)) == stored                           # what a sidecar holds
    for copy in (w, w.bfloat16(), w.half()):
        assert fingerprint_matches(stored, copy)
        assert fingerprint_matches(head_fingerprint(copy), w)                 # stored from the copy, checked on fp32
    assert not fingerprint_matches(stored, _head(1))                          # same shape, other weights
    assert not fingerprint_matches(stored, w * 1.01)                          # another checkpoint, say
    assert not fingerprint_matches({**stored, "values": stored["values"][:-1]}, w)
    assert not fingerprint_matches(None, w)


def test_the_tolerance_is_bf16s_unit_roundoff():
    """Every element 1 + 2^-8 - 2^-20 (random signs) rounds to 1 in bf16: the head moves by nearly 2^-8 of itself,
    the most rounding to bf16 can move it. That copy must match (a tolerance of 1e-3 would refuse it), while the
    same head scaled by 1 + 2^-7 is another head (the old tolerance, 2e-2, took it for this one)."""
    assert FINGERPRINT_RTOL == 1.25 * 2.0 ** -8
    signs = torch.where(torch.rand(64, 32, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    w = signs * (1 + 2.0 ** -8 - 2.0 ** -20)
    assert torch.equal(w.bfloat16().float().abs(), torch.ones(64, 32))
    assert 1e-3 < fingerprint_distance(head_fingerprint(w), w.bfloat16()) < FINGERPRINT_RTOL
    assert fingerprint_matches(head_fingerprint(w), w.bfloat16())
    assert fingerprint_matches(head_fingerprint(w.bfloat16()), w)
    assert not fingerprint_matches(head_fingerprint(w), w * (1 + 2.0 ** -7))


def test_a_fine_tune_of_the_same_head_is_refused_and_its_bf16_copy_accepted():
    """The row-norm fingerprint takes any same-shape fine-tune for the head (the shipped Gemma's norms span
    0.3%). On a copy of a model: noise of 1% of the weights' spread, or a low-rank change of 2% (what a
    fine-tune does), is refused; the same weights in bf16 are accepted. The row-norm kind takes the noisy copy."""
    model = load_model("random-llama", seed=3)[0]
    w = model.get_output_embeddings().weight.detach().clone()
    stored = head_fingerprint(w)
    g = torch.Generator().manual_seed(7)
    noisy = w + 1e-2 * w.std() * torch.randn(w.shape, generator=g)
    u, v = torch.randn(w.shape[0], 4, generator=g), torch.randn(4, w.shape[1], generator=g)
    low_rank = u @ v
    tuned = w + 0.02 * low_rank * (w.norm() / low_rank.norm())
    assert not fingerprint_matches(stored, noisy) and not fingerprint_matches(stored, tuned)
    with pytest.warns(UserWarning, match="older row-norm kind"):                     # the old kind took the noisy one for it
        assert fingerprint_matches(old_head_fingerprint(w), noisy)
    assert fingerprint_matches(stored, w.bfloat16()) and fingerprint_matches(head_fingerprint(w.bfloat16()), w)
    # through a whole drafter: a head saved for this model refuses the fine-tuned copy of the model
    other = load_model("random-llama", seed=3)[0]
    with torch.no_grad():
        other.get_output_embeddings().weight.copy_(noisy)
    block = {"target": "random-llama", "vocab_size": w.shape[0], "hidden_size": w.shape[1], FINGERPRINT_KEY: stored}
    check_head_target("h", block, model)
    with pytest.raises(DrafterError, match="not for this target"):
        check_head_target("h", block, other)


def test_an_old_row_norm_fingerprint_is_still_read_with_a_warning():
    w = _head(0)
    old = old_head_fingerprint(w)
    assert len(old) == 33 and stored_fingerprint({FINGERPRINT_KEY: old}) == old
    with pytest.warns(UserWarning, match="write the file again"):
        assert fingerprint_matches(old, w.bfloat16())
    with pytest.warns(UserWarning):
        assert not fingerprint_matches(old, _head(1))


def test_old_and_new_keys_are_read_and_the_new_one_is_written(tmp_path):
    w = _head(0)
    fp = head_fingerprint(w)
    sizes = {"vocab_size": 1000, "hidden_size": 64}
    assert stored_fingerprint({"target_fingerprint": fp}) == fp == stored_fingerprint({FINGERPRINT_KEY: fp})
    assert stored_fingerprint({FINGERPRINT_KEY: fp, "target_fingerprint": [0.0]}) == fp       # the new key wins
    assert stored_fingerprint({}) is None and stored_fingerprint(None) is None
    assert head_matches({**sizes, "target_fingerprint": fp}, w) and head_matches({**sizes, FINGERPRINT_KEY: fp}, w)
    assert not head_matches({**sizes, "vocab_size": 999, FINGERPRINT_KEY: fp}, w)
    assert not head_matches(sizes, w) and not head_matches(None, w)

    # an EAGLE head saved carries the new key; one holding the old key still loads for its target
    model = load_model("random-llama")[0]
    other = load_model("random-llama", seed=1)[0]
    folder = save_eagle_head(random_eagle_head(model), tmp_path / "head", target_name="random-llama",
                             target_weight=model.get_output_embeddings().weight)
    block = json.loads((folder / "config.json").read_text())["specvocab"]
    assert FINGERPRINT_KEY in block and "target_fingerprint" not in block
    old = {k: v for k, v in block.items() if k != FINGERPRINT_KEY} | {"target_fingerprint": block[FINGERPRINT_KEY]}
    for b in (block, old):
        check_head_target("h", b, model)
        with pytest.raises(DrafterError, match="trained for 'random-llama'.*not for this target"):
            check_head_target("h", b, other)


def test_the_shipped_heads_and_their_fits_store_the_new_fingerprint():
    """The shipped heads and their fits both hold the direction fingerprint of the same LM head, under the new
    key."""
    heads = sorted(SHIPPED_HEADS.glob("*/config.json"))
    assert len(heads) == 2
    for cfg in heads:
        block = json.loads(cfg.read_text())["specvocab"]
        assert FINGERPRINT_KEY in block and "target_fingerprint" not in block
        fits = sorted(cfg.parent.glob("dynaspec-eagle*.safetensors.json"))
        assert fits
        for side in fits:
            fit = json.loads(side.read_text())
            a, b = stored_fingerprint(block), stored_fingerprint(fit)      # the same head's (fp32 or bf16), same kind
            assert {k: v for k, v in a.items() if k != "values"} == {k: v for k, v in b.items() if k != "values"}
            va, vb = torch.tensor(a["values"], dtype=torch.float64), torch.tensor(b["values"], dtype=torch.float64)
            assert float((va - vb).norm() / va.norm()) <= FINGERPRINT_RTOL, side


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_real_models_match_their_shipped_heads_in_fp32_and_bf16(name):
    """The shipped fingerprints were stored from fp32 heads; bf16 (this CPU's default dtype) matches too."""
    block = json.loads((SHIPPED_HEADS / name / "config.json").read_text())["specvocab"]
    for dtype in ("fp32", "bf16"):
        model = load_model(name, dtype=dtype)[0]
        weight = model.get_output_embeddings().weight
        assert head_matches(block, weight)
        assert default_eagle_head(model) == f"specvocab:{name}"
        rel = fingerprint_distance(stored_fingerprint(block), weight)
        assert rel < FINGERPRINT_RTOL / 2, (dtype, rel)             # measured: <= 1.6e-3 (Gemma, bf16)
        del model


def test_temporary_names_are_hidden_unique_and_match_no_finished_files_glob():
    names = {atomic._temp_path(Path("/x/a.parquet")).name for _ in range(3)}
    assert len(names) == 3 and all(n.startswith(".a.parquet.") and n.endswith(".tmp") for n in names)


# --- safe_filename: a name as one file or folder name (engine.atomic) -------------------------------------------

@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "../../etc", "a\\b:c*d?", "..", ".", "",
                                  "modèle · 3072", "...", "x/"])
def test_safe_filename_names_one_entry_inside_its_folder(tmp_path, name):
    """Whatever the name, the result is one non-empty entry of the folder it is joined to: only the safe
    characters, never the folder itself or its parent."""
    for fill in ("_", "-"):
        out = atomic.safe_filename(name, fill)
        assert out and set(out) <= atomic.SAFE_FILENAME_CHARS
        assert (tmp_path / out).resolve().parent == tmp_path.resolve()
        assert len(out) == max(1, len(name))                     # one character for one: names stay distinct
        assert [a for a, b in zip(name, out) if a != b] == [c for c in name if c not in atomic.SAFE_FILENAME_CHARS] \
            or not name.strip(".")


def test_safe_filename_keeps_a_safe_name_and_fills_the_rest():
    assert atomic.safe_filename("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert atomic.safe_filename("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB_SmolLM2-135M-Instruct"
    assert atomic.safe_filename("layerskip · microspec 3072", "-") == "layerskip---microspec-3072"
    assert atomic.safe_filename(3072) == "3072"
    assert atomic.safe_filename("v1.2_final") == "v1.2_final"
