"""Why an output differs from `ar`'s: where it parted, and whether the target's choice there was a near tie.

Greedy speculative decoding is lossless: every method's output equals autoregressive (`ar`) decoding token for
token - in exact arithmetic. In floating point a token's logits depend a little on the shape of the forward that
computed them (a one-token ar step, a verify pass over a draft tree of n rows, a prefill): another matmul
blocking, another order of the attention sums. Where the target's two best tokens are nearly tied, that rounding
can flip the argmax, and from that token on the two outputs part. The native backend's fixed-shape verification
(`engine.target`) removes the shape dependence; the hf backend in bf16, or a GPU without fixed-shape
verification, keeps it. A flip at a near tie is rounding; a difference where ar's token led clearly is a bug.

Per greedy bench row whose output differs from ar's for the same (prompt_id, turn, repeat) (`diagnose_rows`):

    first_divergence  pos: the first index into the new tokens where the two outputs differ (the shorter
                      length where one output is a prefix of the other)
    ar_margin         logit[ar's token] - the best other logit, in the target's logits for the token after
                      prompt + ar_output[:pos], where the two parted (`margin_at`). It is ar's top1 - top2
                      while the recomputed logits still rank ar's token first, negative where they do not (a
                      near tie that this forward broke the other way). Null where ar's output had ended there.
    ar_gap            logit[ar's token] - logit[the method's token] at pos (>= ar_margin; equal when the method
                      chose ar's runner-up); null where the method's output ended at pos.
    verdict           "exact" (same tokens), "near-tie" (both |ar_margin| and |ar_gap| within
                      `near_tie_bound`), "mismatch" (a clear margin: a bug) - `classify`
    prompt_differs    whether the row's prompt differs from ar's (a later turn after a diverged one, below)

The logits come from ONE prefill forward over prompt + ar_output[:pos] through the package's own target backend
(`next_logits`: `engine.target.make_target`, ar's backend), run only for rows that differ: equal rows cost a
list comparison. It is a third forward shape - neither ar's one-token step nor the method's verify pass - so it
measures ar's margin to within one rounding shift; the bound allows for that.

Two-turn prompts (MT-Bench): every run answers turn 2 after its OWN turn-1 answer (`engine.jobs.bench`), so once a
run's turn 1 diverged, its turn-2 prompt differs from ar's and the two turn-2 outputs were never given the same
context. Such a row is not compared token by token: it gets prompt_differs = True, first_divergence = 0 (the
conversation parted before this turn's first token), no margin, and the verdict of the earlier turn where the
conversation diverged - that turn's margin decides whether the difference is rounding. (Comparing the turn-2
tokens anyway would measure a margin at a position with two different contexts, and a rounding tie in turn 1
would come back as a "mismatch" in turn 2.) Whether the prompts differ is decided on the prompt ids each row
actually used, rebuilt the way the bench built them (the `prompt_ids` callback), not on the earlier outputs: two
different token sequences can decode to the same answer text and so feed the same next prompt.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Sequence

import torch

from specvocab.engine.metrics import VERDICTS, first_divergence, run_verdict  # noqa: F401 (the row verdicts, defined once)
from specvocab.engine.target import make_target

# Fraction bits stored per dtype: a float x has ulp(x) = 2^(floor(log2|x|) - FRACTION_BITS) - bf16 keeps 8
# significant bits (7 stored), fp16 11 (10), fp32 24 (23). Keys: torch's names, as the bench's `dtype` column.
FRACTION_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
SMALLEST_NORMAL_EXP = {"bfloat16": -126, "float16": -14, "float32": -126}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

# The near-tie bound in ulps of the top-1 logit, per dtype (see `near_tie_bound`). Measured: SmolLM2-135M-Instruct
# on CPU, hf backend, 3 chat prompts x 64 greedy tokens (192 positions), the target's top1 - top2 margin at each
# position from ar's one-token decode step against a prefill over the same tokens: the margin moved by at most
# 3.5 ulps of the top-1 logit in bf16 (p99 3.0, median 0.5), 3.0 in fp16 (p99 3.0), 19 in fp32 (p99 14,
# median 3; fp32 sums carry more of their rounding into the last place than a bf16 output keeps). A rounding
# flip needs ar's own margin to lie within one such shift of zero (the method's verify shape pushed it to <= 0),
# and `margin_at` measures in a third shape, one more shift away: a genuine tie shows at most twice the shift -
# 7 ulps bf16, 6 fp16, 38 fp32 - rounded up to a power of two for the larger models, longer contexts and GPU
# kernels (split-K matmuls, flash attention) that were not measured. In use: the same model in bf16 on the hf
# backend, 13 Spec-Bench prompts (21 turns) x 96 tokens, pld and recycling parted from ar in 31 of 42 turns;
# the 20 first divergences had |ar_margin| of 0-4 ulps of their top-1 logit (1 for most, 4 for one: a bound
# of 4 would have had it on the edge), each method's token ar's runner-up - near ties, inside 8. The price: a
# bug that picks ar's runner-up where it led by <= 8 bf16 ulps (1.0 at a logit of 16-32; over a third of
# greedy positions in the measured run) reads as a near tie there - but a bug hits many rows, and its others
# show as mismatches; fp32's 64 ulps are 1.2e-4 at a logit of 16-32, far below the margins greedy decoding
# has (the smallest of 40 positions measured: 0.097).
NEAR_TIE_ULPS = {"bfloat16": 8, "float16": 8, "float32": 64}


class DivergenceError(ValueError):
    """A dtype without a rounding bound, or rows that cannot be diagnosed; the message says which."""


def dtype_name(dtype) -> str:
    """torch's name of a dtype ("bfloat16") from a torch.dtype, "torch.bfloat16", "bfloat16" or "bf16"."""
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in FRACTION_BITS:
        raise DivergenceError(f"no rounding bound for dtype {dtype!r} — known: {list(FRACTION_BITS)} "
                              f"(or {list(DTYPE_ALIASES)})")
    return name


def ulp(x: float, dtype) -> float:
    """The unit in the last place of `dtype` at |x|: 2^(floor(log2|x|) - fraction bits) (bf16 at 20.0: 0.125;
    fp32 at 1.0: 2^-23). |x| below the smallest normal counts as the smallest normal."""
    name = dtype_name(dtype)
    exp = max(math.frexp(abs(float(x)))[1] - 1, SMALLEST_NORMAL_EXP[name]) if x else SMALLEST_NORMAL_EXP[name]
    return math.ldexp(1.0, exp - FRACTION_BITS[name])


def near_tie_bound(top1_logit: float, dtype) -> float:
    """The largest logit difference rounding can explain at this position: NEAR_TIE_ULPS[dtype] units in the
    last place of the run's dtype at the top-1 logit's magnitude (ulp(|top1|)). Rounding errors are relative,
    so the bound scales with the logits a forward produces; NEAR_TIE_ULPS says how many ulps and why."""
    name = dtype_name(dtype)
    return NEAR_TIE_ULPS[name] * ulp(top1_logit, name)


def margin_at(next_logits: Callable[[list[int]], torch.Tensor], prompt: Sequence[int], ar_output: Sequence[int],
              output: Sequence[int], pos: int) -> tuple[float | None, float | None, float | None]:
    """(ar_margin, ar_gap, top-1 logit) at new-token index `pos`, from the target's logits for the token after
    prompt + ar_output[:pos] (`next_logits`, one forward): ar_margin = logit[ar_output[pos]] - the best other
    logit, ar_gap = logit[ar_output[pos]] - logit[output[pos]] (None where `output` ended). All None where
    `ar_output` ended at `pos`: ar made no choice there to be a tie."""
    ar_output, output = list(ar_output), list(output)
    if pos >= len(ar_output):
        return None, None, None
    logits = next_logits([*prompt, *ar_output[:pos]]).float().reshape(-1)
    tok = ar_output[pos]
    best2 = logits.topk(2)
    vals, idx = best2.values.tolist(), best2.indices.tolist()
    other = vals[1] if idx[0] == tok else vals[0]               # the best logit of any token but ar's
    mine = float(logits[tok])
    gap = mine - float(logits[output[pos]]) if pos < len(output) else None
    return mine - other, gap, vals[0]


def classify(ar_margin: float | None, ar_gap: float | None, top1_logit: float | None, dtype) -> str:
    """"near-tie" where rounding can explain the divergence - |ar_margin| and |ar_gap| (when known) both within
    `near_tie_bound(top1_logit, dtype)`: ar's token and the method's were within rounding of the top - else
    "mismatch". The gap matters too: a method that took ar's third choice at a tie between the first two did
    not flip a tie. No margin (ar's output had ended) is a mismatch: a stopping difference is no rounding."""
    if ar_margin is None or top1_logit is None:
        return "mismatch"
    worst = max(abs(ar_margin), abs(ar_gap) if ar_gap is not None else 0.0)
    return "near-tie" if worst <= near_tie_bound(top1_logit, dtype) else "mismatch"


def next_logits(model, ids: Sequence[int], *, backend: str = "auto", fixed_shape: bool = True,
                rows: int | None = None) -> torch.Tensor:
    """The target's fp32 logits [V] for the token after `ids`: one prefill forward through the package's target
    backend (`engine.target.make_target(model, backend, ...)`, a fresh cache), on the model's device."""
    device = next(model.parameters()).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    target = make_target(model, backend, fixed_shape=fixed_shape, rows=rows)
    with torch.inference_mode():
        target.begin(x.numel())
        _, logits = target.prefill(x, all_logits=False)          # [1, V] fp32: the last position's row
    return logits[-1]


def _greedy(row: dict) -> bool:
    t = row.get("temperature")
    return t is None or t == 0                                   # a hand-made frame without the column: greedy


def _clear(row: dict) -> None:
    row.update(verdict=None, first_divergence=None, ar_margin=None, ar_gap=None, prompt_differs=None)


def diagnose_rows(rows: list[dict], *, prompt_ids: Callable[[dict, list[list[int]]], list[int] | None],
                  next_logits: Callable[[list[int]], torch.Tensor], dtype=None, only_missing: bool = False) -> int:
    """Fill `verdict`, `first_divergence`, `ar_margin`, `ar_gap` and `prompt_differs` (module docstring) in place,
    on every greedy row with an `ar` row for its (prompt_id, turn, repeat); returns the forwards run.

    rows: bench rows (dicts with method, run, prompt_id, turn, repeat, output_ids, and dtype, temperature when
    known). prompt_ids(row, earlier_outputs): the prompt ids of `row`'s turn after those answers to its earlier
    turns, or None if unknown (the row is then left undiagnosed). next_logits(ids): the target's logits [V] after
    ids (`next_logits` bound to a model). dtype: for rows without a `dtype`. only_missing: keep rows that have a
    verdict already (the bench diagnoses as it goes); otherwise every comparable row is diagnosed afresh.
    Rows without an ar row, sampled rows, and rows whose prompt cannot be rebuilt keep null columns."""
    key = (lambda r: (str(r["prompt_id"]), int(r["turn"]), int(r["repeat"])))
    ar: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] == "ar":
            ar.setdefault(key(r), r)                              # the first ar row, as `summarize` takes
    conversations: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        conversations[(r["method"], r["run"], str(r["prompt_id"]), int(r["repeat"]))].append(r)
    forwards = 0
    for conv in conversations.values():
        conv.sort(key=lambda r: int(r["turn"]))                  # an earlier turn's verdict is known first
        for i, r in enumerate(conv):
            if only_missing and r.get("verdict") is not None:
                continue
            _clear(r)
            pid, turn, rep = key(r)
            a = ar.get((pid, turn, rep))
            if a is None or not _greedy(r) or not _greedy(a):
                continue
            earlier = conv[:i]
            ar_earlier = [ar.get((pid, t, rep)) for t in range(1, turn)]
            if [int(x["turn"]) for x in earlier] != list(range(1, turn)) or None in ar_earlier:
                continue                                          # an earlier turn is missing: nothing to rebuild
            own_prev = [list(x["output_ids"]) for x in earlier]
            ar_prev = [list(x["output_ids"]) for x in ar_earlier]
            ar_prompt = None
            if own_prev != ar_prev:                               # equal earlier answers give equal prompts
                own_prompt, ar_prompt = prompt_ids(r, own_prev), prompt_ids(r, ar_prev)
                if own_prompt is None or ar_prompt is None:
                    continue
                if own_prompt != ar_prompt:
                    cause = next((x["verdict"] for x in earlier if x.get("verdict") in VERDICTS[1:]), None)
                    r.update(verdict=cause, first_divergence=0, prompt_differs=True)
                    continue
            r["prompt_differs"] = False
            pos = first_divergence(a["output_ids"], r["output_ids"])
            if pos is None:
                r["verdict"] = "exact"
                continue
            if ar_prompt is None:
                ar_prompt = prompt_ids(r, ar_prev)
                if ar_prompt is None:
                    r["prompt_differs"] = None
                    continue
            bound_to = r.get("dtype") or dtype
            if bound_to is None:
                raise DivergenceError(f"row {r['method']} {r['run']} prompt {pid} turn {turn}: no dtype column and "
                                      f"no dtype given — pass dtype= (the model's)")
            margin, gap, top1 = margin_at(next_logits, ar_prompt, a["output_ids"], r["output_ids"], pos)
            forwards += top1 is not None
            r.update(first_divergence=pos, ar_margin=margin, ar_gap=gap,
                     verdict=classify(margin, gap, top1, bound_to))
    return forwards
