"""Spec-Bench model-answer files from bench rows, so Spec-Bench's own scripts read our runs.

Written by the job `engine.jobs.specbench` (a bench --out folder), by `engine.jobs.bench --specbench-answers`
(while benching) and by `sweeps.render` (a sweep folder's bench cells), all through `write_answer_files`:

    python -m specvocab.engine.jobs.specbench runs/bench --out runs/bench/spec_bench_answers        # a bench --out folder
    python -m specvocab.sweeps.render results/quick      # a sweep folder: its figures and results/quick/spec_bench_answers
    python -m specvocab.engine.jobs.bench ... --out runs/bench --specbench-answers runs/bench/answers  # while benching

Spec-Bench (Xia et al., 2024, github.com/hemingkx/Spec-Bench) compares methods through one answer `.jsonl` per
method: its `evaluation/speed.py` takes a method's file and the baseline's and prints the mean accepted tokens
and the speedup, `evaluation/equal.py` compares two files' answer texts. One line per question, in Spec-Bench's
field names:

    question_id   the prompt set's id (an int where it is one)
    category      the row's category (Spec-Bench's: writing ... humanities, translation, summarization, qa,
                  math_reasoning, rag)
    answer_id     a stable hash of the file key and question (Spec-Bench: a random uuid)
    model_id      "<model>-<method>", or "<model>-<method>-<run>" for a vocabulary policy other than full
    tstamp        when the file was written
    choices       one per (seed, repeat) of the run, in that order, index = position; each holds, per turn,
                  turns           the answer's text (`engine.prompts.decode_answer`: cut at eos, specials dropped)
                  decoding_steps  target forwards (`steps`; the prefill is step 0)
                  new_tokens      tokens generated
                  wall_time       seconds charged to the turn (wall_s - uncharged_s, as tokens_per_s)
                  and, over all turns, accept_lengths: the tokens each step committed (`step_sizes`, the bonus
                  token included; Spec-Bench's baseline writes 1 per step, as our `ar` does)

One file per (model, prompt set, method, run), at OUT/<model>/<prompt set>/<method>[-<run>].jsonl (the run -
the vocabulary policy, `frspec:1024` - where it is not full; characters other than letters,
digits, `.`, `_` and `-` in a name become `-`); in a sweep folder several configs of one run (a `config`
column that differs) get the config's hash appended. `OUT/index.json` names each file's model, prompt set,
method, run, vocabulary size and config. Spec-Bench's speed.py counts the *baseline's* tokens by re-tokenising its text
(`len(tokenizer(text).input_ids) - 1`, which assumes a BOS token): for tokenizers without one (SmolLM2) it
undercounts ar by one token per turn; `new_tokens` here is exact.

Rows without `step_sizes` (null in results.parquet) have no accept lengths: such a run's file is refused,
naming it, unless it committed one token per step (ar), whose sizes are known.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import polars as pl

from specvocab.engine.atomic import atomic_write, safe_filename
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.prompts import decode_answer

FILE_KEY = ("model", "prompt_set", "method", "run", "vocab_size", "config")   # the columns a file is one value of
CHOICE_KEY = ("seed", "repeat")
NEEDS = ("model", "prompt_set", "method", "run", "prompt_id", "category", "turn", "repeat", "seed", "new_tokens",
         "steps", "wall_s", "uncharged_s", "output_ids", "step_sizes")


class SpecBenchError(ValueError):
    """Rows that cannot make a Spec-Bench answer file; the message names them and the fix."""


def _question_id(prompt_id: str):
    return int(prompt_id) if str(prompt_id).lstrip("-").isdigit() else prompt_id


def _sizes(row: dict) -> list[int]:
    sizes = row["step_sizes"]
    if sizes is not None:
        return [int(s) for s in sizes]
    if row["steps"] == row["new_tokens"]:                         # one token per step: ar's sizes are known
        return [1] * int(row["new_tokens"])
    raise SpecBenchError(f"{row['method']} run {row['run']!r} of {row['model']} ({row['prompt_set']} "
                         f"{row['prompt_id']} turn {row['turn']}) has no step_sizes (its results.parquet holds none) — "
                         f"bench it again (python -m specvocab.engine.jobs.bench ... --out NEW) to write its answer file")


def _label(named: dict) -> str:
    """"<method>" for the full vocabulary, else "<method>-<run>", the run with its size (a sweep's run is the
    bare policy, its size in `vocab_size`)."""
    run = str(named["run"])
    if run == "full":
        return str(named["method"])
    if ":" not in run and named.get("vocab_size") is not None:
        run = f"{run}:{named['vocab_size']}"
    return f"{named['method']}-{run}"


def answer_files(frame: pl.DataFrame, decode: Callable[[str, list[int]], str],
                 stamp: float | None = None) -> dict[str, tuple[dict, list[dict]]]:
    """{relative path: (the file's key, its answer lines)} of bench rows (`ROW_SCHEMA`, or a sweep's bench
    rows with their cell columns). `decode(model, output_ids)` gives an answer's text."""
    missing = [c for c in NEEDS if c not in frame.columns]
    if missing:
        raise SpecBenchError(f"the rows lack {missing}: Spec-Bench answers are made from engine.jobs.bench's rows "
                             f"(OUT/results.parquet) or a sweep's bench cells (sweeps.load(DIR, 'bench'))")
    if frame.is_empty():
        raise SpecBenchError("no bench rows: nothing to write")
    key = [c for c in FILE_KEY if c in frame.columns]
    stamp = time.time() if stamp is None else stamp
    groups = frame.partition_by(key, as_dict=True, maintain_order=True)
    labels = {k: _label(dict(zip(key, k))) for k in groups}
    stems = {k: "/".join(safe_filename(v, "-") for v in (dict(zip(key, k))["model"], dict(zip(key, k))["prompt_set"], labels[k]))
             for k in groups}
    out: dict[str, tuple[dict, list[dict]]] = {}
    for k, rows in groups.items():
        named = dict(zip(key, k))
        path = stems[k]
        if list(stems.values()).count(path) > 1:                   # one run label under several configs
            path += "-" + hashlib.sha1(str(named.get("config")).encode()).hexdigest()[:8]
        path += ".jsonl"
        model_id = f"{named['model']}-{labels[k]}"
        choices_of = sorted({tuple(r[c] for c in CHOICE_KEY) for r in rows.select(CHOICE_KEY).iter_rows(named=True)})
        lines = []
        for prompt_id, q in rows.sort("turn").group_by("prompt_id", maintain_order=True):
            q = q.sort(["seed", "repeat", "turn"])
            choices = []
            for i, ck in enumerate(choices_of):
                turns = [r for r in q.iter_rows(named=True) if tuple(r[c] for c in CHOICE_KEY) == ck]
                if not turns:
                    continue
                choices.append({
                    "index": i,
                    "turns": [decode(named["model"], list(r["output_ids"])) for r in turns],
                    "decoding_steps": [int(r["steps"]) for r in turns],
                    "new_tokens": [int(r["new_tokens"]) for r in turns],
                    "wall_time": [float(r["wall_s"]) - float(r["uncharged_s"] or 0.0) for r in turns],
                    "accept_lengths": [s for r in turns for s in _sizes(r)],
                })
            qid = prompt_id[0]
            digest = hashlib.sha1(f"{path}|{qid}".encode()).hexdigest()[:22]
            lines.append({"question_id": _question_id(qid), "category": q["category"][0], "answer_id": digest,
                          "model_id": model_id, "choices": choices, "tstamp": stamp})
        lines.sort(key=lambda a: (isinstance(a["question_id"], str), a["question_id"]))  # Spec-Bench's reorg order
        out[path] = (named, lines)
    return out


def write_answer_files(frame: pl.DataFrame, out: str | Path, decode: Callable[[str, list[int]], str]) -> list[Path]:
    """Write `answer_files(frame, decode)` under `out` (each file atomically) and `out/index.json`."""
    out = Path(out)
    files = answer_files(frame, decode)
    written = []
    for rel, (_, lines) in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(line) + "\n" for line in lines)
        atomic_write(path, lambda tmp, t=text: Path(tmp).write_text(t))
        written.append(path)
    index = {rel: {k: (v if isinstance(v, (str, int, float)) or v is None else str(v)) for k, v in key.items()}
             for rel, (key, _) in files.items()}
    atomic_write(out / "index.json", lambda tmp: Path(tmp).write_text(json.dumps(index, indent=1) + "\n"))
    return written


def tokenizer_decoder(names: dict[str, str] | None = None) -> Callable[[str, list[int]], str]:
    """decode(model, ids) with each model's own tokenizer, loaded once (`names`: a results `model` label -> the
    name `load_model` takes, where they differ, e.g. a sweep's `label`)."""
    cache: dict[str, tuple] = {}

    def decode(model: str, ids: list[int]) -> str:
        if model not in cache:
            m, tok, _ = load_model((names or {}).get(model, model))
            cache[model] = (tok, eos_token_ids(m, tok))
        tok, eos = cache[model]
        return decode_answer(tok, ids, eos)
    return decode
