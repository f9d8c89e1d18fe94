"""Speed and losslessness of decoding methods on a prompt set: `python -m engine.bench` / `run_bench(...)`.

    python -m engine.bench --model smollm2-135m-instruct --methods ar,pld,hf-prompt-lookup \\
        --prompts spec_bench --per-category 1 --max-new-tokens 64 --repeats 1 --out runs/bench

Writes `OUT/results.parquet`, one row per (method, prompt, turn, repeat) - MT-Bench prompts have two turns,
each method answering the second turn after its own first answer - rewritten after every finished prompt so
a crash loses nothing finished (`--resume` skips what is there). Then prints, per category and overall:
tokens/s (mean over rows of new_tokens / wall_s), speedup (ratio of that mean to `ar`'s), tau
(sum new_tokens / sum steps; ar = 1.00) and `lossless` (every output equals `ar`'s; greedy only).

`run_bench(**kwargs)` is what the CLI calls and what a Ray sweep cell calls: one call per cell.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

import polars as pl
import torch
from tqdm.auto import tqdm

from engine.config import ConfigError, SpecConfig
from engine.drafters import available_methods
from engine.harness import generate
from engine.models import eos_token_ids, load_model
from engine.prompts import decode_answer, encode_prompt, load_prompts

RESULTS_FILE = "results.parquet"
ROW_SCHEMA = {
    "model": pl.String, "device": pl.String, "method": pl.String, "prompt_set": pl.String,
    "question_id": pl.String, "category": pl.String, "language": pl.String, "turn": pl.Int32,
    "repeat": pl.Int32, "prompt_tokens": pl.Int64, "new_tokens": pl.Int64, "steps": pl.Int64,
    "tau": pl.Float64, "g": pl.Float64, "wall_s": pl.Float64, "prefill_s": pl.Float64, "draft_s": pl.Float64,
    "verify_s": pl.Float64, "tokens_per_s": pl.Float64, "stop_reason": pl.String, "temperature": pl.Float64,
    "seed": pl.Int64, "output_ids": pl.List(pl.Int64),
}
RUN_KEY = ("method", "question_id", "repeat")


class BenchError(ValueError):
    """A bench argument is unusable; the message says which and what to pass instead."""


def _methods(methods: str | Sequence[str]) -> list[str]:
    names = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not names:
        raise BenchError("no methods given; pass e.g. --methods ar,pld")
    have = available_methods()
    missing = [m for m in names if m not in have]
    if missing:
        raise BenchError(f"method(s) {missing} cannot run yet (no drafter registered); available: {have}")
    return list(dict.fromkeys(names))


def _dtype(x) -> torch.dtype | None:
    if x is None or isinstance(x, torch.dtype):
        return x
    table = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if x not in table:
        raise BenchError(f"unknown dtype {x!r}; choose one of {sorted(table)}")
    return table[x]


def _write(frame: pl.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    frame.write_parquet(tmp)
    os.replace(tmp, path)                                        # atomic: the file is always complete


def run_bench(model: str = "smollm2-135m-instruct", methods: str | Sequence[str] = ("ar", "pld"),
              prompts: str = "spec_bench", *, per_category: int | None = None,
              categories: Sequence[str] | None = None, languages: Sequence[str] | None = None,
              max_new_tokens: int = 128, repeats: int = 1, warmup: int = 1, out: str | Path | None = None,
              temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, device: str | None = None,
              dtype=None, config: dict | None = None, loaded=None, resume: bool = False,
              progress: bool = True, show: bool = True) -> pl.DataFrame:
    """Run every method on every prompt `repeats` times; returns (and writes) one row per run and turn.

    model: a name for `load_model`, or pass `loaded=(model, tokenizer, info)` to reuse a loaded one.
    config: further SpecConfig fields for every method (e.g. {"pld_num_draft": 5}).
    """
    names = _methods(methods)
    if repeats < 1 or warmup < 0:
        raise BenchError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    try:
        cfgs = {m: SpecConfig.preset(m, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     seed=seed, **(config or {})) for m in names}
    except ConfigError as e:
        raise BenchError(f"bad configuration: {e}") from e
    if loaded is None:
        from kernels.hardware import DEFAULT_DTYPE, DEVICE
        loaded = load_model(model, device=device or DEVICE, dtype=_dtype(dtype) or DEFAULT_DTYPE)
    target, tokenizer, info = loaded
    dev = str(next(target.parameters()).device)
    eos = eos_token_ids(target, tokenizer)
    prompt_list = load_prompts(prompts, per_category=per_category, categories=categories, languages=languages)
    if not prompt_list:
        raise BenchError(f"prompt set {prompts!r} with these filters is empty")

    path = None if out is None else Path(out) / RESULTS_FILE
    rows: list[dict] = []
    done: set[tuple] = set()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            old = pl.read_parquet(path)
            rows = old.to_dicts()
            done = {tuple(str(r[k]) for k in RUN_KEY) for r in rows}

    def run_turns(p, method: str, repeat: int, cfg: SpecConfig, limit: int | None = None) -> list[dict]:
        answers, got = [], []
        for turn in range(len(p.turns)):
            ids = encode_prompt(tokenizer, info, p.turns[:turn + 1], answers, max_new_tokens=cfg.max_new_tokens,
                                system_prompt=p.system_prompt, name=p.name)
            res = generate(target, ids, cfg.replace(seed=cfg.seed + repeat), tokenizer=tokenizer, info=info,
                           eos_ids=eos)
            answers.append(decode_answer(tokenizer, res.output_ids.tolist(), eos))
            got.append({
                "model": info.name, "device": dev, "method": method, "prompt_set": p.prompt_set,
                "question_id": str(p.question_id), "category": p.category, "language": p.language,
                "turn": turn, "repeat": repeat, "prompt_tokens": len(ids), "new_tokens": res.new_tokens,
                "steps": res.steps, "tau": res.tau, "g": res.g, "wall_s": res.wall_s,
                "prefill_s": res.prefill_s, "draft_s": res.draft_s, "verify_s": res.verify_s,
                "tokens_per_s": res.new_tokens / res.wall_s, "stop_reason": res.stop_reason,
                "temperature": cfg.temperature, "seed": cfg.seed + repeat, "output_ids": res.output_ids.tolist()})
            if limit is not None:
                break
        return got

    first = prompt_list[0]
    for _ in range(warmup):                                      # untimed: first calls allocate and compile
        for m in names:
            run_turns(first, m, 0, cfgs[m].replace(max_new_tokens=min(16, max_new_tokens)), limit=1)

    todo = [(p, r, m) for p in prompt_list for r in range(repeats) for m in names
            if (m, str(p.question_id), str(r)) not in done]
    for p, r, m in tqdm(todo, desc=f"bench {info.name}", unit="run", disable=not progress):
        rows.extend(run_turns(p, m, r, cfgs[m]))
        if path is not None:
            _write(pl.DataFrame(rows, schema=ROW_SCHEMA), path)
    frame = pl.DataFrame(rows, schema=ROW_SCHEMA)
    if show:
        print_summary(frame)
    return frame


def summarize(frame: pl.DataFrame) -> pl.DataFrame:
    """Per (category incl. "all", method): runs, tokens_per_s, speedup over ar, tau, lossless."""
    both = pl.concat([frame, frame.with_columns(category=pl.lit("all"))])
    agg = (both.group_by("category", "method")
           .agg(rows=pl.len(), tokens_per_s=pl.col("tokens_per_s").mean(),
                tau=pl.col("new_tokens").sum() / pl.col("steps").sum(), g=pl.col("g").mean()))
    ar_speed = agg.filter(pl.col("method") == "ar").select("category", ar_tokens_per_s="tokens_per_s")
    agg = (agg.join(ar_speed, on="category", how="left")
           .with_columns(speedup=pl.col("tokens_per_s") / pl.col("ar_tokens_per_s")).drop("ar_tokens_per_s"))
    key = ["question_id", "turn", "repeat"]
    ar_out = frame.filter(pl.col("method") == "ar").select(*key, ar_output=pl.col("output_ids"))
    if ar_out.height and bool((frame["temperature"] == 0).all()):
        same = (frame.join(ar_out, on=key, how="left")
                .with_columns(same=pl.col("output_ids") == pl.col("ar_output")))
        same = pl.concat([same, same.with_columns(category=pl.lit("all"))])
        lossless = same.group_by("category", "method").agg(lossless=pl.col("same").all())
        agg = agg.join(lossless, on=["category", "method"], how="left")
    else:                                                        # no ar rows, or sampling: not token-comparable
        agg = agg.with_columns(lossless=pl.lit(None, dtype=pl.Boolean))
    order = {m: i for i, m in enumerate(frame["method"].unique(maintain_order=True).to_list())}
    return (agg.with_columns(_cat_all=pl.col("category") == "all",
                             _m=pl.col("method").replace_strict(order, return_dtype=pl.Int64))
            .sort("_cat_all", "category", "_m").drop("_cat_all", "_m")
            .select("category", "method", "rows", "tokens_per_s", "speedup", "tau", "g", "lossless"))


def print_summary(frame: pl.DataFrame) -> pl.DataFrame:
    table = summarize(frame).with_columns(pl.col("tokens_per_s", "speedup", "tau", "g").round(2))
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
                   tbl_width_chars=120):
        print(table)
    return table


def main(argv: Sequence[str] | None = None) -> pl.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="ar,pld,hf-prompt-lookup", help="comma-separated method names")
    ap.add_argument("--prompts", default="spec_bench", help="a prompt set name or a .jsonl path")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    ap.add_argument("--languages", default=None, help="comma-separated languages (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 (default: kernels.hardware)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further SpecConfig field for every method, e.g. --set pld_num_draft=5")
    ap.add_argument("--out", default=None, help="folder for results.parquet")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in OUT/results.parquet")
    a = ap.parse_args(argv)
    split = (lambda s: None if s is None else [x for x in s.split(",") if x])
    return run_bench(model=a.model, methods=a.methods, prompts=a.prompts, per_category=a.per_category,
                     categories=split(a.categories), languages=split(a.languages),
                     max_new_tokens=a.max_new_tokens, repeats=a.repeats, warmup=a.warmup, out=a.out,
                     temperature=a.temperature, top_p=a.top_p, seed=a.seed, device=a.device, dtype=a.dtype,
                     config=_parse_sets(a.set), resume=a.resume)


def _parse_sets(items: list[str]) -> dict:
    import dataclasses
    import json

    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise BenchError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value                                     # a bare string, e.g. --set vocab=microspec
    return out


if __name__ == "__main__":
    main()
