"""tau of an EAGLE-2 head against an EAGLE-3 head at the same tree on held-out prompts (`compare_heads`).

One run, printed and returned as a table: `ar`, `eagle` (the EAGLE-2 head, default the one shipped for the model)
and `eagle3` (default the EAGLE-3 head shipped for it) on the first `prompts` held-out prompts of an EAGLE-3 data
folder (`engine.train.data`, `eagle3_features`: the prompts neither head was trained on), greedy, full
vocabulary, both heads at one tree (`eagle_depth`, `draft_size`). Per method: tau (new tokens / steps, EAGLE's
tau), tokens/s (wall time of this run, on whatever else shares the machine: compare tau), and how many outputs
equal ar's. The last line prints tau(eagle3) / tau(eagle), the EAGLE-3 work's target being >= 1.3. With
`candidate` (an EAGLE-3 head folder: a training run's `--out`, stopped or finished) a fourth row runs it at the
same tree, and a line says whether it beats the `eagle3` head on these prompts: the test a new head passes
before it replaces a shipped one.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
import torch
from tqdm.auto import tqdm

from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate, resolve_config
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.train.sample import TrainError, heldout_prompts
from specvocab.engine.train.shards import load_split, read_manifest


@dataclass(frozen=True)
class CompareConfig:
    model: str
    data: str = ""                     # an EAGLE-3 data folder (its held-out split)
    eagle_head: str | None = None      # None: the EAGLE-2 head shipped for the model
    eagle3_head: str | None = None     # None: the EAGLE-3 head shipped for the model
    candidate: str | None = None       # an EAGLE-3 head measured against eagle3_head (None: no fourth row)
    prompts: int = 24
    new_tokens: int = 48
    eagle_depth: int = 5               # SpecConfig's default depth
    draft_size: int = 16               # one tree for both heads
    dtype: str | None = None           # the target's dtype (None: the machine's default)
    threads: int | None = None
    progress: bool = True


def compare_heads(cfg: CompareConfig, loaded=None) -> pl.DataFrame:
    """The table described in the module docstring; `loaded` = (model, tokenizer, info) skips loading."""
    if not cfg.data:
        raise TrainError("--data is required: an EAGLE-3 data folder (`python -m specvocab.engine.jobs.eagle_data "
                         "--eagle3-features`), whose held-out prompts neither head was trained on")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tok, info = loaded or load_model(cfg.model, dtype=cfg.dtype)
    eos = eos_token_ids(model, tok)
    prompts = heldout_prompts(load_split(cfg.data, "heldout"), read_manifest(cfg.data), cfg.prompts)
    if not prompts:
        raise TrainError(f"{cfg.data} has no held-out prompts — make the data with --heldout-prompts N")
    tree = dict(max_new_tokens=cfg.new_tokens, eagle_depth=cfg.eagle_depth, draft_size=cfg.draft_size)
    runs = {"ar": SpecConfig.preset("ar", max_new_tokens=cfg.new_tokens),
            "eagle": SpecConfig.preset("eagle", eagle_head=cfg.eagle_head, **tree),
            "eagle3": SpecConfig.preset("eagle3", eagle3_head=cfg.eagle3_head, **tree)}
    if cfg.candidate:
        runs["eagle3 candidate"] = SpecConfig.preset("eagle3", eagle3_head=cfg.candidate, **tree)
    outputs, rows = {}, []
    for method, spec in runs.items():
        spec = resolve_config(spec, model=model)
        head = spec.eagle_head if method == "eagle" else spec.eagle3_head if method.startswith("eagle3") else None
        tokens = steps = 0
        wall = 0.0
        outs = []
        for ids in tqdm(prompts, desc=f"compare {method}", disable=not cfg.progress):
            r = generate(model, torch.as_tensor(ids), spec, tokenizer=tok, info=info, eos_ids=eos)
            tokens, steps, wall = tokens + r.new_tokens, steps + r.steps, wall + r.wall_s
            outs.append(r.output_ids.tolist())
        outputs[method] = outs
        rows.append({"method": method, "head": head, "prompts": len(prompts), "new_tokens": tokens, "steps": steps,
                     "tau": tokens / steps, "tokens_per_s": tokens / wall,
                     "eagle_depth": None if method == "ar" else cfg.eagle_depth,
                     "draft_size": None if method == "ar" else cfg.draft_size})
    frame = pl.DataFrame(rows).with_columns(
        equal_to_ar=pl.Series([sum(a == b for a, b in zip(outputs[m], outputs["ar"])) for m in runs]))
    print(f"{cfg.model}: {len(prompts)} held-out prompts of {cfg.data} x {cfg.new_tokens} new tokens, greedy, "
          f"depth {cfg.eagle_depth}, draft size {cfg.draft_size}, {next(model.parameters()).dtype}")
    for r in frame.iter_rows(named=True):
        print(f"  {r['method']:16s} tau {r['tau']:.3f}  {r['tokens_per_s']:.1f} tok/s  equal to ar "
              f"{r['equal_to_ar']}/{r['prompts']}  head {r['head']}")
    tau = dict(zip(frame["method"], frame["tau"]))
    print(f"  tau eagle3 / eagle = {tau['eagle3'] / tau['eagle']:.2f} (target: >= 1.3)")
    if cfg.candidate:
        new, old = tau["eagle3 candidate"], tau["eagle3"]
        print(f"  the candidate {'beats' if new > old else 'does not beat'} the eagle3 head: tau {new:.3f} against "
              f"{old:.3f} ({new / old:.3f}x) on these {len(prompts)} prompts")
    return frame
