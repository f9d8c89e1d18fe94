"""Record traces: what a target model does, greedily, on a prompt set. The thin CLI that feeds `locality`.

    python -m specvocab.engine.jobs.record --model smollm2-135m-instruct --prompts spec_bench --per-category 2 \\
        --max-new-tokens 128 --topk 16 --out runs/traces/smollm2 [--report] [--resume]

writes `OUT/traces.parquet` (format: `locality.trace`) and prints a one-line summary; `--report` also prints
`locality.coverage_report` and writes it to `OUT/coverage.parquet`.

Per prompt turn, one run of the one decode loop: `engine.generate(model, ids, method="ar", record=True,
record_topk=topk).to_trace(meta)`. The prefill gives the top-K at every prompt position (row i predicts
prompt[i+1], rows 0..L-2 are `prefill_topk`; row L-1 produced the first generated token), then one token per
step with the KV cache until an eos (kept) or max_new_tokens. Multi-turn prompts give one trace per turn;
turn 2's prompt holds turn 1 and the model's own turn-1 answer (the MT-Bench protocol).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from specvocab.engine.harness import generate
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, check_out, run_main
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.prompts import decode_answer, encode_prompt, load_prompts
from specvocab.kernels.hardware import parse_device, parse_dtype
from specvocab.locality.coverage import coverage_report
from specvocab.locality.trace import Trace, read_traces, write_traces


class RecordError(ValueError):
    """A recording setting does not fit the model or the traces already in `out`; the message says the fix."""


def record_traces(model, tokenizer, info, prompts, *, max_new_tokens: int = 128, topk: int = 16,
                  progress: bool = True, eos_ids: Sequence[int] | None = None,
                  out: str | Path | None = None, resume: bool = False) -> list[Trace]:
    """One Trace per prompt turn (greedy, eos included). meta: model, tokenizer, prompt_set, category,
    language, prompt_id, turn (1-based), plus method ("ar"), max_new_tokens, topk and whether the system
    prompt was used.

    out: a Parquet path rewritten (atomically) after every finished prompt, so an interrupted run keeps
    what it finished; resume: start from the traces already in `out` and skip their prompts (the
    recording settings must match - model, max_new_tokens and topk are checked)."""
    if topk < 1 or topk > info.vocab_size:
        raise RecordError(f"topk must be in 1..{info.vocab_size} (the model's vocabulary), got {topk}")
    eos_ids = eos_token_ids(model, tokenizer) if eos_ids is None else list(eos_ids)
    model.eval()
    # Fail before hours of decoding when a first turn cannot fit; later turns are checked as they come.
    for p in prompts:
        encode_prompt(tokenizer, info, p.turns[:1], [], max_new_tokens=max_new_tokens,
                      system_prompt=p.system_prompt, name=p.name)
    traces: list[Trace] = []
    if out is not None and resume and Path(out).exists():
        traces = _resumable(read_traces(out), info, max_new_tokens, topk, out)
    done = {(t.meta.get("prompt_set"), str(t.meta.get("prompt_id"))) for t in traces}
    todo = [p for p in prompts if (p.prompt_set, str(p.prompt_id)) not in done]
    for p in tqdm(todo, desc=f"recording {info.name}", unit="prompt", disable=not progress):
        answers: list[str] = []
        for turn in range(1, len(p.turns) + 1):
            ids = encode_prompt(tokenizer, info, p.turns[:turn], answers, max_new_tokens=max_new_tokens,
                                system_prompt=p.system_prompt, name=p.name)
            run = generate(model, ids, method="ar", tokenizer=tokenizer, info=info, eos_ids=eos_ids,
                           max_new_tokens=max_new_tokens, record=True, record_topk=topk)
            traces.append(run.to_trace(dict(
                model=info.name, tokenizer=info.tokenizer_name, prompt_set=p.prompt_set, category=p.category,
                language=p.language, prompt_id=p.prompt_id, turn=turn, max_new_tokens=max_new_tokens, topk=topk,
                system_prompt=bool(info.has_chat_template and p.system_prompt))))
            answers.append(decode_answer(tokenizer, run.output_ids.tolist(), eos_ids))
        if out is not None:
            write_traces(traces, out)          # atomic rewrite: a crash loses at most the prompt in flight
    return traces


def _resumable(old: list[Trace], info, max_new_tokens: int, topk: int, path) -> list[Trace]:
    """Keep the traces of whole prompts (all turns) recorded with the same settings; refuse a mismatch."""
    for t in old:
        got = (t.meta.get("model"), t.meta.get("max_new_tokens"), t.meta.get("topk"))
        if got != (info.name, max_new_tokens, topk):
            raise RecordError(f"{path} holds traces recorded with (model, max_new_tokens, topk) = {got}, not "
                             f"{(info.name, max_new_tokens, topk)} — pass another --out or drop --resume")
    return old


def _split(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def record(*, model: str, prompts: str, out: str, per_category: int | None = None, categories=None,
         languages=None, max_new_tokens: int = 128, topk: int = 16, report: bool = False,
         dtype: str | None = None, device: str | None = None, progress: bool = True,
         resume: bool = False) -> Path:
    """Load, record, write `out/traces.parquet`, print a summary line (and the coverage report if asked).
    dtype / device: None = this machine's defaults (`kernels.hardware`)."""
    t0 = time.perf_counter()
    plist = load_prompts(prompts, per_category=per_category, categories=categories, languages=languages)
    m, tok, info = load_model(model, dtype=parse_dtype(dtype), device=parse_device(device))
    path = Path(out) / "traces.parquet"
    traces = record_traces(m, tok, info, plist, max_new_tokens=max_new_tokens, topk=topk, progress=progress,
                           out=path, resume=resume)
    write_traces(traces, path)
    n_gen = sum(len(t.generated) for t in traces)
    n_prompt = sum(len(t.prompt) for t in traces)
    print(f"recorded {len(traces)} traces ({len(plist)} prompts from {prompts}) on {info.name}: "
          f"{n_prompt} prompt tokens, {n_gen} generated tokens, top-{topk}, "
          f"{time.perf_counter() - t0:.1f} s -> {path}")
    if report:
        result = coverage_report(traces)          # prints the per-category table
        result.write_parquet(Path(out) / "coverage.parquet")
        print(f"coverage report -> {Path(out) / 'coverage.parquet'}")
    return path


def _parse(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.record", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="offline name, random-*, hub id or local folder")
    ap.add_argument("--prompts", required=True,
                    help="spec_bench | humaneval | multilingual | train_corpus | path.jsonl")
    ap.add_argument("--per-category", type=int, default=None, help="first N prompts per category (and language)")
    ap.add_argument("--categories", type=_split, default=None, help="comma-separated, e.g. qa,rag")
    ap.add_argument("--languages", type=_split, default=None, help="comma-separated, e.g. en,de")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--out", required=True, help="output folder; traces go to OUT/traces.parquet")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: this machine's)")
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: this machine's)")
    ap.add_argument("--report", action="store_true", help="print locality.coverage.coverage_report afterwards")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--resume", action="store_true", help="keep the prompts already in OUT/traces.parquet")
    add_debug(ap)
    return vars(ap.parse_args(argv))


def main(argv=None) -> Path:
    args = _parse(argv)
    check_model(args["model"])
    check_out("--out", args["out"])
    for flag in ("--per-category", "--max-new-tokens", "--topk"):
        check_at_least(flag, args[flag[2:].replace("-", "_")], 1)
    return record(**args)                    # loads the prompt set before the model


if __name__ == "__main__":
    sys.exit(run_main(main))
