"""Record traces: what a target model does, greedily, on a prompt set. The thin CLI at `locality`'s edge.

    python -m locality.record --model smollm2-135m-instruct --prompts spec_bench --per-category 2 \\
        --max-new-tokens 128 --topk 16 --out runs/traces/smollm2 [--report]

writes `OUT/traces.parquet` (format: `locality.trace`) and prints a one-line summary. Everything else in
`locality` is pure and reads these files; this module is the only one that loads a model.

Per prompt turn: one prefill forward over the L prompt tokens gives the top-K at every position (row i predicts
prompt[i+1], rows 0..L-2 are `prefill_topk`; row L-1 produced the first generated token), then one token per
forward with the KV cache until an eos (kept) or max_new_tokens. Multi-turn prompts give one trace per turn;
turn 2's prompt holds turn 1 and the model's own turn-1 answer (the MT-Bench protocol).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from locality.trace import Trace, read_traces, write_traces

_TOPK_CHUNK_ELEMS = 1 << 26   # logits computed per chunk in the prefill top-K (256 MiB of fp32)


@torch.no_grad()
def greedy_with_topk(model, prompt_ids: Sequence[int], *, max_new_tokens: int, topk: int,
                     eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy decoding with the KV cache, keeping the top-K ids of every distribution the target computed.

    Returns (prefill_topk [L-1, K], generated [T], step_topk [T, K]) as int64 CPU tensors, with
    step_topk[t, 0] == generated[t]. Stops after the first eos (included) or max_new_tokens.
    The engine harness replaces this with `engine.generate(..., method="ar", record=True)`.
    """
    device = model.get_input_embeddings().weight.device
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)[None]   # [1, L]
    lm_head = model.get_output_embeddings()
    # Prefill through the decoder body, so the [L, V] logits can be formed chunk by chunk (V = 262k on Gemma).
    out = model.base_model(input_ids=ids, use_cache=True)
    hidden = out.last_hidden_state[0]                                               # [L, d]
    past = out.past_key_values
    rows = max(1, _TOPK_CHUNK_ELEMS // lm_head.weight.shape[0])
    body = hidden[:-1]                                                              # [L-1, d]
    prefill_topk = torch.cat([lm_head(body[i:i + rows]).topk(topk, dim=-1).indices
                              for i in range(0, body.shape[0], rows)]
                             or [hidden.new_zeros((0, topk), dtype=torch.long)])  # [L-1, K]
    # The last row exactly as the model's own forward forms it (one row through the head, then the model's
    # final logit transform if any); monotone transforms such as soft-capping keep the top-K.
    logits = lm_head(hidden[-1:])[0]                                                # [V]
    eos = set(int(e) for e in eos_ids)
    generated, step_topk = [], []
    for _ in range(max_new_tokens):
        top = logits.topk(topk).indices                                             # [K]
        step_topk.append(top)
        # Host sync, once per token: the loop must know whether the token is an eos to stop.
        token = int(top[0])
        generated.append(token)
        if token in eos or len(generated) == max_new_tokens:
            break
        out = model(input_ids=top[:1].view(1, 1), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]                                                  # [V]
    step = torch.stack(step_topk).cpu() if step_topk else torch.zeros((0, topk), dtype=torch.long)
    return prefill_topk.cpu(), torch.tensor(generated, dtype=torch.long), step


def record_traces(model, tokenizer, info, prompts, *, max_new_tokens: int = 128, topk: int = 16,
                  progress: bool = True, eos_ids: Sequence[int] | None = None,
                  out: str | Path | None = None, resume: bool = False) -> list[Trace]:
    """One Trace per prompt turn (greedy, eos included). meta: model, tokenizer, prompt_set, category,
    language, prompt_id, turn (1-based), plus max_new_tokens, topk and whether the system prompt was used.

    out: a Parquet path rewritten (atomically) after every finished prompt, so an interrupted run keeps
    what it finished; resume: start from the traces already in `out` and skip their prompts (the
    recording settings must match - model, max_new_tokens and topk are checked)."""
    from engine.models import eos_token_ids
    from engine.prompts import decode_answer, encode_prompt

    if topk < 1 or topk > info.vocab_size:
        raise ValueError(f"topk must be in 1..{info.vocab_size} (the model's vocabulary), got {topk}")
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
    todo = [p for p in prompts if (p.prompt_set, str(p.question_id)) not in done]
    for p in tqdm(todo, desc=f"recording {info.name}", unit="prompt", disable=not progress):
        answers: list[str] = []
        for turn in range(1, len(p.turns) + 1):
            ids = encode_prompt(tokenizer, info, p.turns[:turn], answers, max_new_tokens=max_new_tokens,
                                system_prompt=p.system_prompt, name=p.name)
            prefill, generated, step = greedy_with_topk(model, ids, max_new_tokens=max_new_tokens, topk=topk,
                                                        eos_ids=eos_ids)
            traces.append(Trace(prompt=ids, prefill_topk=prefill.numpy(), generated=generated.numpy(),
                                step_topk=step.numpy(),
                                meta=dict(model=info.name, tokenizer=info.tokenizer_name, prompt_set=p.prompt_set,
                                          category=p.category, language=p.language, prompt_id=p.question_id,
                                          turn=turn, max_new_tokens=max_new_tokens, topk=topk,
                                          system_prompt=bool(info.has_chat_template and p.system_prompt))))
            answers.append(decode_answer(tokenizer, generated.tolist(), eos_ids))
        if out is not None:
            write_traces(traces, out)          # atomic rewrite: a crash loses at most the prompt in flight
    return traces


def _resumable(old: list[Trace], info, max_new_tokens: int, topk: int, path) -> list[Trace]:
    """Keep the traces of whole prompts (all turns) recorded with the same settings; refuse a mismatch."""
    for t in old:
        got = (t.meta.get("model"), t.meta.get("max_new_tokens"), t.meta.get("topk"))
        if got != (info.name, max_new_tokens, topk):
            raise ValueError(f"{path} holds traces recorded with (model, max_new_tokens, topk) = {got}, not "
                             f"{(info.name, max_new_tokens, topk)}; pass another --out or drop --resume")
    return old


def _split(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def main(*, model: str, prompts: str, out: str, per_category: int | None = None, categories=None,
         languages=None, max_new_tokens: int = 128, topk: int = 16, report: bool = False,
         dtype: str = "float32", device: str = "cpu", progress: bool = True, resume: bool = False) -> Path:
    """Load, record, write `out/traces.parquet`, print a summary line (and the coverage report if asked)."""
    from engine.models import load_model
    from engine.prompts import load_prompts

    t0 = time.perf_counter()
    plist = load_prompts(prompts, per_category=per_category, categories=categories, languages=languages)
    m, tok, info = load_model(model, dtype=getattr(torch, dtype), device=device)
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
        _report(traces, Path(out))
    return path


def _report(traces, out: Path) -> None:
    from locality.coverage import coverage_report

    result = coverage_report(traces)          # prints the per-category table
    result.write_parquet(out / "coverage.parquet")
    print(f"coverage report -> {out / 'coverage.parquet'}")


def _parse(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m locality.record", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="offline name, random-*, hub id or local folder")
    ap.add_argument("--prompts", required=True, help="spec_bench | humaneval | multilingual | path.jsonl")
    ap.add_argument("--per-category", type=int, default=None, help="first N prompts per category (and language)")
    ap.add_argument("--categories", type=_split, default=None, help="comma-separated, e.g. qa,rag")
    ap.add_argument("--languages", type=_split, default=None, help="comma-separated, e.g. en,de")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--out", required=True, help="output folder; traces go to OUT/traces.parquet")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--report", action="store_true", help="print locality.coverage.coverage_report afterwards")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--resume", action="store_true", help="keep the prompts already in OUT/traces.parquet")
    return vars(ap.parse_args(argv))


if __name__ == "__main__":
    main(**_parse())
