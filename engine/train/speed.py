"""What an EAGLE-3 training step costs on this machine, and how close it runs to the machine's GEMM bound
(`train_speed`).

On an EAGLE-3 data folder (`engine.train.data`, `eagle3_features`), in one run:

1. **Packing.** Over one epoch of the training split, the rows and the attention scores a batch pads to its
   longest sequence, against the real ones, for random packing (`group_batches=0`) and for the loop's
   length-grouped batches (`engine.train.loop.length_grouped_batches`).
2. **Steps.** The first `steps` length-grouped batches, their features made as the loop makes them (computed
   by the target now for a tokens-only folder), then one optimiser step's forward and backward
   (`engine.train.ttt.ttt_loss`) per batch under each compute dtype, the dtypes interleaved `repeats` times.
3. **The bound.** The step's matmul FLOPs (forward and backward of the midlayer's linears and of the LM head over
   `ttt_steps` steps) at the GEMM rates this machine reaches now: the LM head's shape in `head_dtype` (the loss's
   matmul dtype whatever the compute dtype), the MLP's shape in each compute dtype. A step's time then reads as
   a multiple of what its matmuls alone need.

Printed as tables and returned as one DataFrame (a row per measurement).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from specvocab.engine.drafters.eagle3 import DraftVocab
from specvocab.engine.models import load_model
from specvocab.engine.train.batch3 import Batch3, draft_vocabulary, make_batch3
from specvocab.engine.train.data import featurizer
from specvocab.engine.train.eagle3_head import new_eagle3_head
from specvocab.engine.train.loop import length_grouped_batches, pack_samples, step_dtype
from specvocab.engine.train.sample import DTYPES, TrainError
from specvocab.engine.train.shards import load_split, read_manifest
from specvocab.engine.train.ttt import scored_rows, ttt_loss
from specvocab.engine.vocab.frspec import eagle3_maps


@dataclass(frozen=True)
class SpeedConfig:
    model: str
    data: str = ""                          # an EAGLE-3 data folder
    batch_tokens: int = 2048                # as Train3Config
    group_batches: int = 64
    draft_vocab_size: int = 32768
    draft_vocab_coverage: float | None = None
    vocab_count: str = "top1"
    ttt_steps: int = 7
    loss_on: str = "all"                    # as Train3Config: "response" runs fewer rows (ttt.scored_rows)
    head_dtype: str = "bf16"
    steps: int = 4                          # batches timed
    repeats: int = 2                        # rounds of every dtype over the batches, interleaved
    threads: int | None = None
    progress: bool = True


def padding(lengths: np.ndarray, batches: list[list[int]]) -> tuple[float, float]:
    """(padded rows / real rows, padded attention scores / real ones) of batches padded to their longest."""
    rows = sum(len(b) * int(lengths[b].max()) for b in batches)
    scores = sum(len(b) * int(lengths[b].max()) ** 2 for b in batches)
    return rows / int(lengths.sum()), scores / int((lengths.astype(np.int64) ** 2).sum())


def gemm_rate(rows: int, cols: int, inner: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of [rows, inner] @ [inner, cols] in dtype on this machine, timed for about `seconds`."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(cols, inner, dtype=dtype)
    a @ b.T
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        a @ b.T
        n += 1
    return 2 * rows * cols * inner * n / (time.perf_counter() - t0)


def step_flops(head, batch: Batch3) -> tuple[int, int]:
    """Matmul FLOPs of one TTT forward and backward (3x the forward) of a batch, as `ttt_loss` runs it: (fc and
    the midlayer's linears over every row at step 0, the linears over `scored_rows` at each later step; the LM
    head over each step's loss rows)."""
    steps = batch.tokens.shape[0]
    linear = sum(m.weight.numel() for m in head.midlayer.modules() if isinstance(m, torch.nn.Linear))
    keep = scored_rows(batch, steps)
    later = batch.rows if keep is None else keep.numel()
    mid = 6 * (batch.rows * (linear + head.fc.weight.numel()) + later * (steps - 1) * linear)
    return mid, 6 * int(batch.mask.sum()) * head.lm_head.weight.numel()


def train_speed(cfg: SpeedConfig) -> pl.DataFrame:
    """The measurements of the module docstring, printed; one row each."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if cfg.head_dtype not in DTYPES:
        raise TrainError(f"head_dtype {cfg.head_dtype!r} is not a dtype — choose one of {list(DTYPES)}")
    manifest = read_manifest(cfg.data)
    if not manifest["settings"].get("eagle3_features"):
        raise TrainError(f"the data in {cfg.data} has no EAGLE-3 features — make it with `python -m "
                         f"specvocab.engine.jobs.eagle_data --model {cfg.model} --eagle3-features`")
    train = load_split(cfg.data, "train")
    lengths = np.array([s.input_ids.numel() for s in train])
    rows = []
    for name, group in (("random", 0), ("length-grouped", cfg.group_batches)):
        pad_rows, pad_scores = padding(lengths, length_grouped_batches(lengths, np.random.default_rng(0),
                                                                        cfg.batch_tokens, group))
        rows.append({"measure": "packing", "setting": name, "padded_rows": pad_rows, "padded_scores": pad_scores})

    model, _, _ = load_model(cfg.model, dtype="fp32")
    model.requires_grad_(False)
    V = model.get_output_embeddings().weight.shape[0]
    ids, _ = draft_vocabulary(train, V, cfg.draft_vocab_size, cfg.vocab_count, cfg.loss_on,
                              cfg.draft_vocab_coverage)
    head = new_eagle3_head(model, *eagle3_maps(ids, V)).float().train()
    maps, embed = DraftVocab.of(head, "cpu"), model.get_input_embeddings()
    featured = featurizer(manifest, cfg.model, eagle3=True, loss_on=cfg.loss_on)
    chosen = length_grouped_batches(lengths, np.random.default_rng(0), cfg.batch_tokens, cfg.group_batches)
    chosen = chosen[:cfg.steps]
    t0 = time.perf_counter()
    batches = [make_batch3(featured([train[i] for i in b]), maps, cfg.ttt_steps, cfg.loss_on) for b in chosen]
    feature_s = (time.perf_counter() - t0) / len(batches)
    tokens = sum(int(lengths[b].sum()) for b in chosen) / len(batches)
    mid_flops, head_flops = (sum(f) / len(batches) for f in zip(*(step_flops(head, b) for b in batches)))

    dtypes = ("fp32", "bf16")
    spent = dict.fromkeys(dtypes, 0.0)
    for _ in tqdm(range(cfg.repeats), desc="train speed", disable=not cfg.progress):
        for name in dtypes:
            t0 = time.perf_counter()
            for b in batches:
                with torch.autocast("cpu", dtype=DTYPES[name], enabled=name != "fp32"):
                    ttt_loss(head, embed, b, head_dtype=DTYPES[cfg.head_dtype])
                head.zero_grad(set_to_none=True)
            spent[name] += time.perf_counter() - t0
    widest, (n_vocab, d) = max(b.rows for b in batches), head.lm_head.weight.shape
    mlp = head.midlayer.mlp.gate_proj.weight.shape[0]
    head_bound = head_flops / gemm_rate(widest, n_vocab, d, DTYPES[cfg.head_dtype])   # the LM head: head_dtype
    for name in dtypes:
        step_s = spent[name] / (cfg.repeats * len(batches))
        bound = head_bound + mid_flops / gemm_rate(widest, mlp, d, DTYPES[name])
        rows.append({"measure": "step", "setting": name, "step_s": step_s, "feature_s": feature_s,
                     "tokens_per_s": tokens / (step_s + feature_s), "gemm_bound_s": bound,
                     "share_of_bound": bound / step_s, "speedup_vs_fp32": spent["fp32"] / spent[name]})
    out = pl.DataFrame(rows, infer_schema_length=None)
    default = {torch.bfloat16: "bf16", torch.float32: "fp32"}[step_dtype(None, torch.device("cpu"))]
    print(f"train speed: {cfg.model}, EAGLE-3 head over a {ids.size:,}-token draft vocabulary, {cfg.ttt_steps} TTT "
          f"steps, loss on {cfg.loss_on}, {torch.get_num_threads()} thread(s); {len(batches)} batches of {tokens:,.0f} tokens on average, "
          f"features {'computed by the target' if not manifest['settings'].get('store_features', True) else 'read'}"
          f" in {feature_s:.2f} s per batch; the loop's default compute dtype here: {default}")
    print("packing over one epoch (padded / real): rows and attention scores")
    print(out.filter(pl.col("measure") == "packing").select("setting", "padded_rows", "padded_scores"))
    print(f"one step's forward and backward per compute dtype; bound = its matmul FLOPs at this machine's GEMM "
          f"rates measured now (LM head in {cfg.head_dtype}, midlayer in the compute dtype)")
    print(out.filter(pl.col("measure") == "step").select("setting", "step_s", "feature_s", "tokens_per_s",
                                                         "gemm_bound_s", "share_of_bound", "speedup_vs_fp32"))
    return out
