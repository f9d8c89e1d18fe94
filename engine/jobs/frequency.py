"""Frequency lists for FR-Spec's static draft vocabulary, beside the vocabulary policies (`engine.vocab`).

FR-Spec (§3.2) drafts over the K most frequent tokens of a corpus tokenised with the target's tokenizer; its
§4.2 counts a pretraining corpus (SlimPajama) or the drafter's training data (ShareGPT) at K = 8k/16k/32k/64k.
Offline, the training corpus stands in for both. This module turns text and the target's own generations into
token ids and writes the lists; counting ids is `locality.shortlist` (pure, token-only).

Words:
- ranking: `locality.shortlist`'s frame `token_id, count, rank` over every id of the vocabulary.
- frequency list: token ids in the order a shortlist takes them - the kept special tokens first (EOS and the
  special tokens the chat template writes: a drafter that cannot propose EOS never ends an answer), then every
  id the corpus showed, most frequent first. Ids the corpus never showed are not in it, so a K larger than
  the list is clipped to its length: the true size (distinct tokens seen + kept specials), which is printed
  and stored. The shortlist of size K is `ids[:K]`.

What is counted (never benchmark data, which would fit the list on the prompts it is evaluated on):
- the training corpus (`train_corpus` in the data root: prompts and their reference responses), tokenised
  without special tokens (`corpus_texts`, `tokenize_texts`);
- optionally the target's own greedy generations on training prompts (`target_generations`, or recorded
  traces: `generation_arrays`) - VocabTrim's recipe: the drafter's vocabulary follows what the target writes.

Files (`write_frequency_lists`, one per size K; each with a JSON sidecar `<file>.json`: tokenizer, vocab
size, requested K, true size, kept specials, tokens counted, source):
- `frspec-k<K>.pt`: a `torch.save`d list of ints, most frequent first. It is SGLang's
  `--speculative-token-map` file (SGLang reads it with `torch.load` and indexes the LM head's rows with it) and
  what `vocab="frspec"` loads (`frequency_file=...`).
- `eagle3-k<K>.pt`: a `torch.save`d dict of EAGLE-3's draft-vocabulary maps: `d2t` int64 [K], the offsets
  with target id = draft id + d2t[draft id], draft ids ordered by ascending target id; `t2d` bool
  [vocab_size], True at the K target ids (t2d.sum() == K).
`load_token_map` / `load_eagle3_maps` refuse a file made for another tokenizer or vocabulary size.

`default_frequency_file(tokenizer, tokenizer_name, vocab_size)` is what `vocab="frspec"` uses without a
`frequency_file`: the whole list counted on the training corpus, cached in `<specvocab cache>/rankings/`
keyed by tokenizer, vocabulary size and a digest of the corpus and the kept specials.

CLI: `python -m specvocab.engine.jobs.frequency --model NAME --out-dir DIR` counts the training corpus (`--languages`,
`--tasks`), optionally the target's generations (`--generations N`) or recorded traces (`--traces`) and text
files (`--texts FILE.jsonl --text-field turns`), and writes the lists for `--sizes` (8k/16k/32k/64k) with
their exports.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import pickle
import sys
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import polars as pl

from specvocab.engine.artifacts import atomic_write, sidecar_path
from specvocab.engine.harness import generate
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, check_out, run_main
from specvocab.engine.models import cache_root, eos_token_ids, load_model
from specvocab.engine.prompts import ByteTokenizer, Prompt, data_file, encode_prompt, load_prompts
from specvocab.engine.vocab.frspec import FrequencyError, load_token_map, save_eagle3_maps, save_token_map
from specvocab.locality.shortlist import ShortlistError, count_tokens, save_ranking
from specvocab.locality.trace import Trace, read_traces

# name -> (data set folder, file, dotted field of the texts or None for the prompt set's own reader, what it is)
CORPORA = {
    "train_corpus": ("train_corpus", "prompts.jsonl", None,
                     "training corpus prompts + reference responses (23.5k rows, 26 languages, permissive licenses, "
                     "disjoint from the evaluation sets)"),
    "rest_vicuna7b_mtbench": ("rest_vicuna7b_mtbench", "baseline-vicuna-7b-v1.5-temperature-0.0-top_p-0.jsonl",
                              "choices.*.turns", "Vicuna-7B-v1.5 greedy answers to the 80 MT-Bench questions (REST)"),
    "multilingual": ("multilingual", "prompts.jsonl", "turns", "the 980 multilingual evaluation prompts"),
}
DEFAULT_CORPORA = ("train_corpus",)
# Sets that are (or answer) evaluation prompts: a list counted on them is fitted on what it is evaluated on.
EVALUATION_SETS = ("spec_bench", "humaneval", "multilingual", "rest_vicuna7b_mtbench")
DEFAULT_SIZES = (8192, 16384, 32768, 65536)        # FR-Spec §4.2, Table 1
LIST_FORMAT = 2          # bump when what a cached list holds changes



# --- texts -----------------------------------------------------------------------------------------------------

def _pluck(value, parts: Sequence[str], where: str) -> list:
    """The values at a dotted path: dict keys, list indices (digits) and `*` (every list element)."""
    if not parts:
        return [value]
    head, rest = parts[0], parts[1:]
    if isinstance(value, dict):
        if head not in value:
            raise FrequencyError(f"{where} has no field {head!r} (keys: {sorted(value)}); pass --text-field / "
                                 "field= as a dotted path, e.g. turns or choices.*.turns")
        return _pluck(value[head], rest, where)
    if isinstance(value, list):
        if head == "*":
            return [v for item in value for v in _pluck(item, rest, where)]
        if head.lstrip("-").isdigit():
            if not -len(value) <= int(head) < len(value):
                raise FrequencyError(f"{where}: a list of {len(value)} has no index {head}; use * for every element")
            return _pluck(value[int(head)], rest, where)
    raise FrequencyError(f"{where}: cannot take {head!r} of a {type(value).__name__}; use a key for objects, "
                         "an index or * for lists")


def read_texts(path: str | Path, field: str = "turns") -> list[str]:
    """The texts of a JSONL file (optionally .gz) at `field`, a dotted path (`turns`, `choices.*.turns`,
    `text`); a list of strings (e.g. the turns of a conversation) gives one text per element."""
    path = Path(path)
    if not path.exists():
        raise FrequencyError(f"text file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    texts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FrequencyError(f"{where} is not JSON ({e}); pass a JSONL file, one object per line") from None
            for v in _pluck(row, field.split("."), where):
                vals = v if isinstance(v, list) else [v]
                bad = [x for x in vals if not isinstance(x, str)]
                if bad:
                    raise FrequencyError(f"{where}: field {field!r} holds a {type(bad[0]).__name__}, not text; "
                                         "point --text-field at strings or lists of strings")
                texts.extend(vals)
    return texts


def corpus_texts(name: str = "train_corpus", *, languages: Sequence[str] | None = None,
                 tasks: Sequence[str] | None = None, responses: bool = True) -> list[str]:
    """The texts of one corpus of `CORPORA`, read from the data root. For `train_corpus`: every prompt and,
    with `responses`, every reference response, filtered by language and task."""
    if name not in CORPORA:
        raise FrequencyError(f"unknown corpus {name!r}; choose from {sorted(CORPORA)}")
    if name == "train_corpus":
        prompts = load_prompts("train_corpus", languages=languages, tasks=tasks)
        return [t for p in prompts for t in (*p.turns, *([p.reference] if responses and p.reference else []))]
    if languages is not None or tasks is not None:
        raise FrequencyError(f"languages= / tasks= filter only the train_corpus corpus, not {name!r}")
    folder, file, field, _ = CORPORA[name]
    return read_texts(data_file(folder, file), field)


def _encode(tokenizer, text: str) -> list[int]:
    if callable(getattr(tokenizer, "encode", None)):
        try:
            return tokenizer.encode(text, add_special_tokens=False)        # Hugging Face tokenizers
        except TypeError:
            return tokenizer.encode(text)                                   # e.g. engine.prompts.ByteTokenizer
    if callable(tokenizer):
        return tokenizer(text)
    raise FrequencyError(f"tokenizer {type(tokenizer).__name__} has no encode(text) and is not callable; pass a "
                         "Hugging Face tokenizer, an object with encode(text) -> ids, or a function text -> ids")


def tokenize_texts(texts: Iterable[str], tokenizer, batch: int = 512) -> list[np.ndarray]:
    """Token ids [n_i] of each text, without special tokens (a corpus count should not count BOS per text).
    `tokenizer`: a Hugging Face tokenizer (encoded in batches), anything with `encode(text) -> ids`, or a
    function text -> ids."""
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise FrequencyError(f"text {i} is a {type(text).__name__}, not a str; pass strings (read_texts "
                                 "flattens lists of turns)")
    if callable(tokenizer) and callable(getattr(tokenizer, "batch_decode", None)):     # Hugging Face: batched
        ids = [row for s in range(0, len(texts), batch)
               for row in tokenizer(texts[s: s + batch], add_special_tokens=False)["input_ids"]]
    else:
        ids = [_encode(tokenizer, text) for text in texts]
    return [np.asarray(row, dtype=np.int64).reshape(-1) for row in ids]


def ranking_from_texts(texts: Iterable[str], tokenizer, vocab_size: int) -> pl.DataFrame:
    """FR-Spec's frequency ranking: count the tokens of a text corpus tokenised with the target's tokenizer
    (`tokenize_texts`) over a `vocab_size` vocabulary (the target's LM-head rows). Ids the tokenizer yields
    outside [0, vocab_size) raise: the tokenizer and the model do not belong together."""
    try:
        return count_tokens(tokenize_texts(texts, tokenizer), vocab_size)
    except ShortlistError as e:
        raise FrequencyError(str(e)) from None


# --- the target's own generations ------------------------------------------------------------------------------

def target_generations(model, tokenizer, info, prompts: Sequence[Prompt], *, max_new_tokens: int = 128,
                       eos_ids: Sequence[int] | None = None, progress: bool = True) -> list[np.ndarray]:
    """[T_i] the target's greedy continuation of each prompt's first turn (the `ar` decode of
    `engine.harness.generate`): what a VocabTrim-style list counts. Prompts from an evaluation set raise."""
    _refuse_evaluation({p.prompt_set for p in prompts}, "prompts")
    out = []
    for i, p in enumerate(prompts):
        ids = encode_prompt(tokenizer, info, p.turns[:1], [], max_new_tokens=max_new_tokens,
                            system_prompt=p.system_prompt, name=p.name)
        res = generate(model, ids, method="ar", max_new_tokens=max_new_tokens, tokenizer=tokenizer, info=info,
                       eos_ids=eos_ids)
        out.append(res.output_ids.numpy().astype(np.int64))
        if progress and ((i + 1) % 10 == 0 or i + 1 == len(prompts)):
            print(f"[specvocab] generations: {i + 1}/{len(prompts)} prompts, "
                  f"{sum(len(a) for a in out)} tokens", flush=True)
    return out


def generation_arrays(traces: Sequence[Trace], tokenizer_name: str | None = None) -> list[np.ndarray]:
    """[T_i] the generated tokens of recorded traces (`python -m specvocab.engine.jobs.record --prompts train_corpus`).
    Traces of an evaluation set, or recorded with another tokenizer, raise."""
    _refuse_evaluation({str(t.meta.get("prompt_set", "")) for t in traces}, "traces")
    if tokenizer_name is not None:
        other = sorted({str(t.meta["tokenizer"]) for t in traces
                        if t.meta.get("tokenizer") and t.meta["tokenizer"] != tokenizer_name})
        if other:
            raise FrequencyError(f"traces were recorded with tokenizer(s) {other}, not {tokenizer_name!r}; their ids "
                                 f"mean other tokens: record them again with the target")
    return [np.asarray(t.generated, dtype=np.int64) for t in traces]


def _refuse_evaluation(sets: set[str], what: str) -> None:
    bad = sorted(sets & set(EVALUATION_SETS))
    if bad:
        raise FrequencyError(f"{what} come from the evaluation set(s) {bad}: a list counted on them is fitted on the "
                             f"prompts it is evaluated on. Use the training corpus (load_prompts('train_corpus'))")


# --- the list ------------------------------------------------------------------------------------------------

def kept_special_ids(tokenizer, eos_ids: Sequence[int] = ()) -> list[int]:
    """Token ids every frequency list keeps: `eos_ids`, the tokenizer's EOS, and the special tokens the chat
    template writes (for ChatML: <|im_start|>, <|im_end|>). Sorted. A tokenizer without a template keeps EOS."""
    keep = {int(e) for e in eos_ids}
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return sorted(keep)
    eos = getattr(tokenizer, "eos_token_id", None)
    keep.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    if getattr(tokenizer, "chat_template", None):
        special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
        special.update(int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                       if getattr(tok, "special", False))
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:   # a template without a system role raises (jinja TemplateError or its own exception)
            text = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
        keep.update(i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in special)
    return sorted(keep)


def frequency_list(ranking: pl.DataFrame, keep: Sequence[int] = ()) -> np.ndarray:
    """[R] the kept ids (in order, once), then every id the ranking counted (count > 0), by rank. Never-seen ids
    are left out: R = distinct seen + kept not seen is the largest shortlist the corpus supports."""
    vocab_size = ranking.height
    keep = list(dict.fromkeys(int(k) for k in keep))
    bad = [k for k in keep if not 0 <= k < vocab_size]
    if bad:
        raise FrequencyError(f"kept token id(s) {bad} are outside the vocabulary of {vocab_size}; the tokenizer "
                             f"and the ranking do not belong together")
    ranked = ranking.filter(pl.col("count") > 0).sort("rank")["token_id"].to_numpy()
    rest = ranked[~np.isin(ranked, np.asarray(keep, dtype=np.int64))]
    return np.concatenate([np.asarray(keep, dtype=np.int64), rest]).astype(np.int64)


# --- lists of several sizes, and the default one ---------------------------------------------------------------

def check_lists(sizes: Sequence[int], exports: Sequence[str]) -> None:
    """FrequencyError unless every list size is >= 1 and every export is known (what `write_frequency_lists`
    writes; the CLI checks it before the model loads)."""
    unknown = sorted(set(exports) - {"eagle3"})
    if unknown:
        raise FrequencyError(f"unknown export(s) {unknown}; choose from ['eagle3'] (the SGLang token map is the "
                             f"frspec-k<K>.pt list itself)")
    for k in sizes:
        if isinstance(k, bool) or int(k) < 1:
            raise FrequencyError(f"list sizes must be >= 1, got {k!r}")


def write_frequency_lists(ids: np.ndarray, out_dir: str | Path, *, tokenizer: str, vocab_size: int,
                          sizes: Sequence[int] = DEFAULT_SIZES, exports: Sequence[str] = ("eagle3",),
                          meta: dict | None = None, verbose: bool = True) -> dict[int, dict[str, Path]]:
    """For each K of `sizes`: `frspec-k<K>.pt` (the frequency list's first K ids; SGLang's token map) and, with
    "eagle3" in `exports`, `eagle3-k<K>.pt`. A K above the list's length gets the whole list and says so."""
    ids = np.asarray(ids, dtype=np.int64)
    check_lists(sizes, exports)
    out, out_dir = {}, Path(out_dir)
    for k in sizes:
        top = ids[: int(k)]
        extra = {**(meta or {}), "list_size": int(ids.size)}
        files = {"frspec": save_token_map(top, out_dir / f"frspec-k{k}.pt", tokenizer=tokenizer,
                                          vocab_size=vocab_size, requested_k=int(k), meta=extra)}
        if "eagle3" in exports:
            files["eagle3"] = save_eagle3_maps(top, out_dir / f"eagle3-k{k}.pt", tokenizer=tokenizer,
                                               vocab_size=vocab_size, requested_k=int(k), meta=extra)
        if verbose:
            note = "" if top.size == int(k) else (f" (K={k} exceeds the {ids.size} tokens the corpus supports: "
                                                  f"true size {top.size})")
            print(f"[specvocab] K={k}: {top.size} ids{note} -> {', '.join(str(p) for p in files.values())}")
        out[int(k)] = files
    return out


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:12]


def default_frequency_file(tokenizer, tokenizer_name: str, vocab_size: int,
                           corpora: Sequence[str] = DEFAULT_CORPORA, cache_dir: str | Path | None = None,
                           verbose: bool = True, eos_ids: Sequence[int] = (),
                           allow_evaluation_data: bool = False) -> Path:
    """The frequency list (`frspec-*.pt`, see module doc) of `corpora` tokenised with `tokenizer` over
    `vocab_size` ids, EOS and the template's specials kept - what `vocab='frspec'` uses when no
    `frequency_file` is given. Counted once and cached in `<specvocab cache>/rankings/` (`cache_root`) with the
    full ranking beside it (`.parquet`, for coverage analyses), keyed by tokenizer name, vocab size, corpus
    names and a digest of the corpus files and the kept ids. `tokenizer` None = a random model's bytes.
    `allow_evaluation_data` admits an evaluation set (for before/after comparisons only)."""
    if tokenizer is None:
        tokenizer, tokenizer_name = ByteTokenizer(), tokenizer_name or "bytes"
    if not tokenizer_name:
        raise FrequencyError("default_frequency_file needs the tokenizer's name (ModelInfo.tokenizer_name) to key its "
                             "cache; pass tokenizer_name=...")
    corpora = tuple(corpora)
    unknown = [c for c in corpora if c not in CORPORA]
    if unknown or not corpora:
        raise FrequencyError(f"unknown corpus {unknown or '(none)'}; choose from {sorted(CORPORA)}")
    if not allow_evaluation_data:
        _refuse_evaluation(set(corpora), "corpora")
    keep = kept_special_ids(tokenizer, eos_ids)
    digest = _digest([*(data_file(*CORPORA[c][:2]).read_bytes() for c in corpora),
                      json.dumps({"keep": keep, "format": LIST_FORMAT}).encode()])
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tokenizer_name)
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "rankings"
    stem = f"{safe}-v{vocab_size}-{'+'.join(corpora)}-{digest}"
    path, ranking_path = folder / f"frspec-{stem}.pt", folder / f"{stem}.parquet"
    source = "; ".join(f"{c}: {CORPORA[c][3]}" for c in corpora)
    try:
        ids = load_token_map(path, tokenizer=tokenizer_name, vocab_size=vocab_size)
        meta = json.loads(sidecar_path(path).read_text())
        built = False
    except (FrequencyError, OSError, RuntimeError, EOFError, pickle.UnpicklingError, json.JSONDecodeError):
        # missing or unreadable: count (seconds)
        texts = [t for c in corpora for t in corpus_texts(c)]
        ranking = ranking_from_texts(texts, tokenizer, vocab_size)
        ids = frequency_list(ranking, keep)
        # save_ranking writes the Parquet file and its sidecar; both land together. Same content whoever
        # writes last: concurrent builders cannot disagree
        atomic_write(ranking_path, lambda tmp: save_ranking(ranking, tmp, tokenizer=tokenizer_name, source=source),
                     sidecar=True)
        meta = {"source": source, "corpora": list(corpora), "kept": keep, "tokens": int(ranking["count"].sum()),
                "seen": int((ranking["count"] > 0).sum()), "ranking": ranking_path.name}
        save_token_map(ids, path, tokenizer=tokenizer_name, vocab_size=vocab_size, meta=meta)
        built = True
    if verbose:
        print(f"[specvocab] frspec list {'counted' if built else 'cached'}: {meta['tokens']} tokens, {meta['seen']} "
              f"distinct of {vocab_size} + kept specials {meta['kept']} = {ids.size} ids (the largest K this corpus "
              f"supports), tokenizer {tokenizer_name}; corpus {source} -> {path}")
    return path


def with_default_ranking(cfg, tokenizer, info, eos_ids: Sequence[int] = ()):
    """cfg as a run needs it: for vocab='frspec' without a `frequency_file`, the default ranking of the model's
    tokenizer (`default_frequency_file`, counted on the training corpus and cached); any other cfg unchanged.
    The one rule the bench and the calibration both follow, so that a calibrated frspec draft size is measured
    on the list the bench then runs."""
    if cfg.vocab != "frspec" or cfg.frequency_file is not None:
        return cfg
    if info is None:
        raise FrequencyError("vocab='frspec' without frequency_file runs on the default ranking of the model's "
                             "tokenizer: pass tokenizer= and info= (what load_model returns), or frequency_file=")
    path = default_frequency_file(tokenizer, info.tokenizer_name, info.vocab_size, eos_ids=list(eos_ids or ()))
    return cfg.replace(frequency_file=str(path))


# --- CLI -------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict[int, dict[str, Path]]:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.frequency",
                                 description="FR-Spec frequency lists from the training corpus and the target's "
                                             "own generations, with SGLang and EAGLE-3 exports")
    ap.add_argument("--model", required=True, help="the target (engine.models name): its tokenizer counts")
    ap.add_argument("--corpus", nargs="*", default=list(DEFAULT_CORPORA),
                    help=f"corpora to count, from {sorted(CORPORA)} (default: train_corpus; --corpus alone: none)")
    ap.add_argument("--languages", nargs="+", help="train_corpus languages (ISO 639-1), default all")
    ap.add_argument("--tasks", nargs="+", help="train_corpus tasks, default all")
    ap.add_argument("--no-responses", action="store_true", help="count train_corpus prompts only")
    ap.add_argument("--generations", type=int, default=0,
                    help="also count the target's greedy continuations of N train_corpus prompts (seeded draw)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--traces", nargs="+", default=[], help="also count the generated tokens of recorded traces "
                                                            "(of training prompts)")
    ap.add_argument("--texts", nargs="+", default=[], help="also count JSONL text files")
    ap.add_argument("--text-field", default="turns", help="dotted path of the texts in each JSONL object")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    ap.add_argument("--export", nargs="*", default=["eagle3"], help="exports beside each list (eagle3)")
    ap.add_argument("--allow-evaluation-data", action="store_true",
                    help="admit evaluation sets as corpora (comparisons only: the list is then fitted on them)")
    ap.add_argument("--out-dir", required=True)
    add_debug(ap)
    a = ap.parse_args(argv)

    # what needs no model first: the arguments, then every text (a bad corpus, file or data root stops here)
    check_model(a.model)
    check_out("--out-dir", a.out_dir)
    check_at_least("--generations", a.generations, 0)
    check_at_least("--max-new-tokens", a.max_new_tokens, 1)
    check_lists(a.sizes, a.export)
    if not (a.corpus or a.texts or a.generations or a.traces):
        ap.error("nothing to count: give --corpus, --texts, --generations or --traces")
    if not a.allow_evaluation_data:
        _refuse_evaluation(set(a.corpus), "corpora")
    filters = dict(languages=a.languages, tasks=a.tasks)
    texts, sources = [], []
    for c in a.corpus:
        got = corpus_texts(c, **filters, responses=not a.no_responses) if c == "train_corpus" else corpus_texts(c)
        texts += got
        sources.append(f"{c} ({len(got)} texts)")
    for p in a.texts:
        texts += read_texts(p, a.text_field)
        sources.append(f"texts {p} ({a.text_field})")
    pool = load_prompts("train_corpus", **filters) if a.generations else []
    traces = read_traces(a.traces) if a.traces else []

    model, tokenizer, info = load_model(a.model)
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    tok_name = info.tokenizer_name or "bytes"
    arrays = tokenize_texts(texts, tok)
    if a.generations:
        pick = sorted(np.random.default_rng(0).permutation(len(pool))[: a.generations].tolist())
        arrays += target_generations(model, tokenizer, info, [pool[i] for i in pick], max_new_tokens=a.max_new_tokens)
        sources.append(f"{a.model}'s greedy continuations of {len(pick)} train_corpus prompts")
    if traces:
        arrays += generation_arrays(traces, tok_name)
        sources.append(f"generated tokens of traces {a.traces}")
    if not arrays:
        ap.error("nothing to count: the corpora, files and traces given hold no text")
    ranking = count_tokens(arrays, info.vocab_size)
    keep = kept_special_ids(tokenizer, eos_token_ids(model, tokenizer))   # generation config's EOS too
    ids = frequency_list(ranking, keep)
    source = "; ".join(sources)
    out_dir = Path(a.out_dir)
    save_ranking(ranking, out_dir / "ranking.parquet", tokenizer=tok_name, source=source)
    print(f"[specvocab] {int(ranking['count'].sum())} tokens, {int((ranking['count'] > 0).sum())} distinct of "
          f"{info.vocab_size}, kept specials {keep}: a list of {ids.size} ids; {source}")
    meta = {"source": source, "kept": keep, "tokens": int(ranking["count"].sum()),
            "seen": int((ranking["count"] > 0).sum())}
    return write_frequency_lists(ids, out_dir, tokenizer=tok_name, vocab_size=info.vocab_size, sizes=a.sizes,
                                 exports=a.export, meta=meta)


if __name__ == "__main__":
    sys.exit(run_main(main))
