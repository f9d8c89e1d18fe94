"""FR-Spec's frequency lists counted from text, and the list a run resolves to (FR-Spec §3.2, §4.2).

FR-Spec drafts over the K most frequent tokens of a corpus tokenised with the target's tokenizer; its §4.2
counts a pretraining corpus (SlimPajama) or the drafter's training data (ShareGPT) at K = 8k/16k/32k/64k.
Offline, the training corpus stands in for both. Counting ids is `locality.shortlist` (pure, token-only); the
files are `engine.vocab.frspec`'s.

Words:
- ranking: `locality.shortlist`'s frame `token_id, count, rank` over every id of the vocabulary.
- frequency list: token ids in the order a shortlist takes them - the kept special tokens first (EOS and the
  special tokens the chat template writes: a drafter that cannot propose EOS never ends an answer), then every
  id the corpus showed, most frequent first. Ids the corpus never showed are not in it, so a K larger than
  the list is clipped to its length: the true size (distinct tokens seen + kept specials). The shortlist of
  size K is `ids[:K]`.

What is counted is never benchmark data (`EVALUATION_SETS`), which would fit the list on the prompts it is
evaluated on: the training corpus (`train_corpus` in the data root: prompts and their reference responses),
tokenised without special tokens (`corpus_texts`, `tokenize_texts`).

`default_frequency_file(tokenizer, tokenizer_name, vocab_size)` is the list `vocab="frspec"` runs on without a
`frequency_file`: the whole list counted on the training corpus, cached in `<specvocab cache>/rankings/` keyed
by tokenizer, vocabulary size and a digest of the corpus and the kept specials. `with_default_ranking` is the
one rule a run's resolution (`engine.resolve.resolve_run`) follows. The job `engine.jobs.frequency` writes
lists of several sizes, and counts the target's own generations too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import polars as pl

from specvocab.engine.artifacts import atomic_write, sidecar_path
from specvocab.engine.atomic import safe_filename
from specvocab.engine.models import cache_root
from specvocab.engine.prompts import ByteTokenizer, data_file, load_prompts
from specvocab.engine.vocab.frspec import FrequencyError, load_token_map, save_token_map
from specvocab.locality.shortlist import ShortlistError, count_tokens, save_ranking

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
LIST_FORMAT = 2          # bump when what a cached list holds changes

# --- texts -----------------------------------------------------------------------------------------------------

def _pluck(value, parts: Sequence[str], where: str) -> list:
    """The values at a dotted path: dict keys, list indices (digits) and `*` (every list element)."""
    if not parts:
        return [value]
    head, rest = parts[0], parts[1:]
    if isinstance(value, dict):
        if head not in value:
            raise FrequencyError(f"{where} has no field {head!r} (keys: {sorted(value)}) — pass --text-field / "
                                 "field= as a dotted path, e.g. turns or choices.*.turns")
        return _pluck(value[head], rest, where)
    if isinstance(value, list):
        if head == "*":
            return [v for item in value for v in _pluck(item, rest, where)]
        if head.lstrip("-").isdigit():
            if not -len(value) <= int(head) < len(value):
                raise FrequencyError(f"{where}: a list of {len(value)} has no index {head} — use * for every element")
            return _pluck(value[int(head)], rest, where)
    raise FrequencyError(f"{where}: cannot take {head!r} of a {type(value).__name__} — use a key for objects, "
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
                raise FrequencyError(f"{where} is not JSON ({e}) — pass a JSONL file, one object per line") from None
            for v in _pluck(row, field.split("."), where):
                vals = v if isinstance(v, list) else [v]
                bad = [x for x in vals if not isinstance(x, str)]
                if bad:
                    raise FrequencyError(f"{where}: field {field!r} holds a {type(bad[0]).__name__}, not text — "
                                         "point --text-field at strings or lists of strings")
                texts.extend(vals)
    return texts


def corpus_texts(name: str = "train_corpus", *, languages: Sequence[str] | None = None,
                 tasks: Sequence[str] | None = None, responses: bool = True) -> list[str]:
    """The texts of one corpus of `CORPORA`, read from the data root. For `train_corpus`: every prompt and,
    with `responses`, every reference response, filtered by language and task."""
    if name not in CORPORA:
        raise FrequencyError(f"unknown corpus {name!r} — choose from {sorted(CORPORA)}")
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
    raise FrequencyError(f"tokenizer {type(tokenizer).__name__} has no encode(text) and is not callable — pass a "
                         "Hugging Face tokenizer, an object with encode(text) -> ids, or a function text -> ids")


def tokenize_texts(texts: Iterable[str], tokenizer, batch: int = 512) -> list[np.ndarray]:
    """Token ids [n_i] of each text, without special tokens (a corpus count should not count BOS per text).
    `tokenizer`: a Hugging Face tokenizer (encoded in batches), anything with `encode(text) -> ids`, or a
    function text -> ids."""
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise FrequencyError(f"text {i} is a {type(text).__name__}, not a str — pass strings (read_texts "
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


def refuse_evaluation(sets: set[str], what: str) -> None:
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
        raise FrequencyError(f"kept token id(s) {bad} are outside the vocabulary of {vocab_size} — the tokenizer "
                             f"and the ranking do not belong together")
    ranked = ranking.filter(pl.col("count") > 0).sort("rank")["token_id"].to_numpy()
    rest = ranked[~np.isin(ranked, np.asarray(keep, dtype=np.int64))]
    return np.concatenate([np.asarray(keep, dtype=np.int64), rest]).astype(np.int64)


# --- the default list, and a run's --------------------------------------------------------------------------

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
                             "cache — pass tokenizer_name=...")
    corpora = tuple(corpora)
    unknown = [c for c in corpora if c not in CORPORA]
    if unknown or not corpora:
        raise FrequencyError(f"unknown corpus {unknown or '(none)'} — choose from {sorted(CORPORA)}")
    if not allow_evaluation_data:
        refuse_evaluation(set(corpora), "corpora")
    keep = kept_special_ids(tokenizer, eos_ids)
    digest = _digest([*(data_file(*CORPORA[c][:2]).read_bytes() for c in corpora),
                      json.dumps({"keep": keep, "format": LIST_FORMAT}).encode()])
    safe = safe_filename(tokenizer_name)
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
