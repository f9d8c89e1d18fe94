"""FR-Spec frequency lists of several sizes, with their exports: `python -m specvocab.engine.jobs.frequency`.

Counting text and the default list a run resolves to are library code (`engine.vocab.frspec_lists`: the
corpora, the tokenisation, the kept specials, `default_frequency_file`, `with_default_ranking`; re-exported
here); the list files are `engine.vocab.frspec`'s. This job adds what a run never needs:
- the target's own greedy generations on training prompts (`target_generations`, or recorded traces:
  `generation_arrays`) - VocabTrim's recipe: the drafter's vocabulary follows what the target writes;
- lists of several sizes (`write_frequency_lists`, one per size K; each with a JSON sidecar `<file>.json`:
  tokenizer, vocab size, requested K, true size, kept specials, tokens counted, source):
  - `frspec-k<K>.pt`: a `torch.save`d list of ints, most frequent first. It is SGLang's
    `--speculative-token-map` file (SGLang reads it with `torch.load` and indexes the LM head's rows with it)
    and what `vocab="frspec"` loads (`frequency_file=...`).
  - `eagle3-k<K>.pt`: a `torch.save`d dict of EAGLE-3's draft-vocabulary maps: `d2t` int64 [K], the offsets
    with target id = draft id + d2t[draft id], draft ids ordered by ascending target id; `t2d` bool
    [vocab_size], True at the K target ids (t2d.sum() == K).
  `load_token_map` / `load_eagle3_maps` refuse a file made for another tokenizer or vocabulary size.

CLI: `python -m specvocab.engine.jobs.frequency --model NAME --out-dir DIR` counts the training corpus (`--languages`,
`--tasks`), optionally the target's generations (`--generations N`) or recorded traces (`--traces`) and text
files (`--texts FILE.jsonl --text-field turns`), and writes the lists for `--sizes` (8k/16k/32k/64k) with
their exports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from specvocab.engine.harness import generate
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, check_out, run_main
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.prompts import ByteTokenizer, Prompt, encode_prompt, load_prompts
from specvocab.engine.vocab.frspec import FrequencyError, save_eagle3_maps, save_token_map
# the counting and the default list are library code; re-exported for the CLI and its users
from specvocab.engine.vocab.frspec_lists import (CORPORA, DEFAULT_CORPORA, EVALUATION_SETS, LIST_FORMAT,  # noqa: F401
                                                 refuse_evaluation, corpus_texts, default_frequency_file,
                                                 frequency_list, kept_special_ids, ranking_from_texts, read_texts,
                                                 tokenize_texts, with_default_ranking)
from specvocab.locality.shortlist import count_tokens, save_ranking
from specvocab.locality.trace import Trace, read_traces

DEFAULT_SIZES = (8192, 16384, 32768, 65536)        # FR-Spec §4.2, Table 1

# --- the target's own generations ------------------------------------------------------------------------------

def target_generations(model, tokenizer, info, prompts: Sequence[Prompt], *, max_new_tokens: int = 128,
                       eos_ids: Sequence[int] | None = None, progress: bool = True) -> list[np.ndarray]:
    """[T_i] the target's greedy continuation of each prompt's first turn (the `ar` decode of
    `engine.harness.generate`): what a VocabTrim-style list counts. Prompts from an evaluation set raise."""
    refuse_evaluation({p.prompt_set for p in prompts}, "prompts")
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
    refuse_evaluation({str(t.meta.get("prompt_set", "")) for t in traces}, "traces")
    if tokenizer_name is not None:
        other = sorted({str(t.meta["tokenizer"]) for t in traces
                        if t.meta.get("tokenizer") and t.meta["tokenizer"] != tokenizer_name})
        if other:
            raise FrequencyError(f"traces were recorded with tokenizer(s) {other}, not {tokenizer_name!r} — their ids "
                                 f"mean other tokens: record them again with the target")
    return [np.asarray(t.generated, dtype=np.int64) for t in traces]


# --- lists of several sizes, and the default one ---------------------------------------------------------------

def check_lists(sizes: Sequence[int], exports: Sequence[str]) -> None:
    """FrequencyError unless every list size is >= 1 and every export is known (what `write_frequency_lists`
    writes; the CLI checks it before the model loads)."""
    unknown = sorted(set(exports) - {"eagle3"})
    if unknown:
        raise FrequencyError(f"unknown export(s) {unknown} — choose from ['eagle3'] (the SGLang token map is the "
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
        refuse_evaluation(set(a.corpus), "corpora")
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
