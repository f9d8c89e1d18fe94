"""The EAGLE-3 head's recipe and run (`train_eagle3`), on the loop of `engine.train.loop`: the draft vocabulary
and batches in `engine.train.batch3`, the training-time test in `engine.train.ttt`, the head and its writer in
`engine.train.eagle3_head`.

**The head** is `engine.drafters.eagle3.Eagle3Head` (fc over the target's low / mid / high features, one
midlayer over [embedding; hidden], norm, lm_head over the draft vocabulary, d2t / t2d), trained with the recipe of
the official `SafeAILab/EAGLE` code (`eagle/traineagle3/cnets.py` `Model.forward`, `main.py`):

**Draft vocabulary.** The `draft_vocab_size` most frequent tokens of the training data (official `scandata`:
`Counter` over the response tokens, `most_common(N)`, sorted ascending into d2t / t2d), here
`engine.vocab.frspec.eagle3_maps`; with `draft_vocab_coverage`, the fewest of them covering that share of
the counted tokens. What is counted (`vocab_count`): `top1` (default) = the target's top-1 next
token at every position that gets a loss - the tokens the head is asked to predict and the verifier accepts, and
what the loss's position mask tests (below); `response` = the official choice, the response tokens. On the
target's own greedy continuations the two agree. Default size 32768 (EAGLE-3 ships 32k rows for Llama-3's 128k
vocabulary, the SGLang / SpecForge default), clipped to the vocabulary and to the number of distinct tokens the
data holds (ranking unseen tokens would be arbitrary; the official `most_common` does the same).

**Training-time test (TTT).** `ttt_steps` (default 7 = the official `self.length`) forward passes per batch.
Step 0 is EAGLE's: the pair (fc(g_i), x_{i+1}) at position i. Step k > 0 feeds back the head's own output: the
midlayer output of step k-1 at row i replaces fc(g) as the hidden input, the token is x_{i+1+k}, the position
i + k, and the row's query attends to the step-0 keys of its sequence up to i (causal) plus its own keys of
steps 1..k (the official attention keeps a list of per-step keys and adds the diagonal scores) - exactly the
attention a draft node at depth k sees in the tree (the committed context and its ancestors). Rows whose
shifted index leaves the sequence are masked (the official `padding(..., left=False)`).

**Loss.** At step k and row i the target is the target's next-token distribution after x_{i+1+k}, restricted to
the draft vocabulary and renormalised (official: `softmax(target_logits[..., t2d])`); the row counts only where
the target's top-1 is in the draft vocabulary (official `position_mask = t2d[argmax] * loss_mask`), so
out-of-vocabulary targets are masked, not mapped. Per step: -sum over masked rows of sum_j p_j log q_j, divided
by every row of the batch (the official `.mean()` over all positions); the total is sum_k 0.8^k loss_k (official
`ploss_weight`). No feature regression and no input noise (EAGLE-3 dropped both). Differences from the official
code, each said beside its default in `Train3Config`: the target distribution is the target's top-k (k stored in
the shards, 16 by default) within the draft vocabulary, not its full softmax (it saves the target's LM head at
training time and keeps the ranking a draft tree uses); learning rate, warmup and cosine decay as `train_eagle`
(the official 5e-5 with 12k warmup steps fine-tunes a 4096-wide layer over 40 epochs on 8 GPUs). The lm_head
starts random, as the official one (`lm_head_init="target"` starts it from the target's LM-head rows and norm
from the target's final-norm gain; on SmolLM2 that start was worse - cross-entropy 17 nats at step 0 against
7.7 for random rows over a 2k vocabulary - since the midlayer's untrained output makes the target's large rows
confidently wrong).

The learning curve (held-out loss, teacher-forced top-1 agreement at step 0 and at the last TTT step, and tau =
tokens per step of real greedy speculative decoding with the `eagle3` drafter on held-out prompts) is printed and
written as `learning_curve.parquet`. The head is saved in the official EAGLE-3 layout (`config.json` with
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`, `model.safetensors` with fc /
midlayer.* / norm / lm_head / d2t / t2d; the target's embedding is not stored) with a `specvocab` block naming
the target and its LM-head fingerprint, and a model card `README.md`. A run saves its state (head, optimiser,
step, RNG) every `save_every` steps; a rerun with the same settings resumes, bit-for-bit on the same machine.
On a tokens-only data folder (`store_features=False`) each batch's features come from one target prefill
when the batch is made (`engine.train.data.with_features`); the vocabulary is then counted over the response
tokens (`vocab_count="response"`).

**The loss on the response** (`loss_on="response"`, the official choice) costs less than the loss everywhere,
beyond the LM head's rows: TTT steps past 0 run only the rows scored at some later step
(`engine.train.ttt.scored_rows`: a row's step k reads the step-0 keys and its own earlier steps, nothing
else), so a prompt's rows stop after step 0, and features computed on the fly run the target's LM head only at
the response's positions. The training corpus's prompts are 70-78% of its tokens: there the heads of
SmolLM2-135M and Gemma-3-270M train at 2.0x and 2.1x the tokens per second (PERFORMANCE.md, section 6).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle3 import DraftVocab, eagle3_feature_layers
from specvocab.engine.models import eos_token_ids
from specvocab.engine.train.batch3 import counted_tokens, draft_vocabulary, make_batch3
from specvocab.engine.train.cards import eagle3_card, learning_curve_table
from specvocab.engine.train.eagle3_head import new_eagle3_head, save_eagle3_head
from specvocab.engine.train.evaluate import heldout_tau
from specvocab.engine.train.loop import Recipe, RunSettings, pack_samples, prepare_run, run_key, train_loop
from specvocab.engine.train.sample import DTYPES, TrainError, data_used, heldout_prompts
from specvocab.engine.train.shards import stores_features
from specvocab.engine.train.ttt import ttt_loss
from specvocab.engine.vocab.frspec import eagle3_maps


@dataclass(frozen=True)
class Train3Config(RunSettings):
    """One EAGLE-3 head training run; the official settings where they transfer, else said why."""

    model: str
    data: str | None = None                 # a folder made by `eagle_data --eagle3-features` (default: default_data_dir)
    out: str | None = None                  # the checkpoint folder (default: <specvocab cache>/eagle3/<model>)
    tokens: int = 1_000_000                 # the budget: sequence tokens processed (all epochs together)
    max_epochs: int = 8                     # passes over the data at most (the budget usually ends first)
    batch_tokens: int = 2048                # tokens per optimiser step (whole sequences, packed)
    draft_vocab_size: int = 32768           # EAGLE-3's 32k (for 128k vocabularies); clipped to V and to the
                                            # distinct tokens the data holds
    draft_vocab_coverage: float | None = None   # the fewest ids covering this share of the counted tokens
                                            # (None: draft_vocab_size, clipped as above)
    vocab_count: str = "top1"               # top1 | response: what the draft vocabulary is counted over
                                            # (module docstring; official: response)
    ttt_steps: int = 7                      # the official `length`: forward passes with the head's own hidden; it
                                            # covers the drafter's default depth (eagle_depth 5); the cost of a
                                            # step grows about linearly with it (--ttt-steps 5 on a tight CPU)
    step_weight: float = 0.8                # loss of TTT step k weighted step_weight ** k (official 0.8)
    lr: float = 1e-3                        # AdamW; as train_eagle (a small layer from scratch), not the official
                                            # 5e-5 / 12k warmup of a 4096-wide layer
    warmup_steps: int = 50
    weight_decay: float = 0.0               # official
    betas: tuple[float, float] = (0.9, 0.95)    # official
    grad_clip: float = 0.5                  # official
    loss_on: str = "all"                    # all | response: as train_eagle (the official code masks the prompt;
                                            # the target's distribution is a valid target everywhere); response
                                            # also runs fewer rows (module docstring)
    lm_head_init: str = "random"            # random (official) | target: lm_head from the target's LM-head rows of
                                            # the draft vocabulary, norm from its final-norm gain (worse at the
                                            # start on SmolLM2; module docstring)
    head_dtype: str = "bf16"                # the LM-head matmul of the loss (fp32 softmax; fp32 master weights)
    head_chunk: int = 512                   # rows of draft logits materialised at once

    def validate(self) -> "Train3Config":
        if self.vocab_count not in ("top1", "response"):
            raise TrainError(f"vocab_count must be 'top1' or 'response', got {self.vocab_count!r}")
        if self.loss_on not in ("all", "response"):
            raise TrainError(f"loss_on must be 'all' or 'response', got {self.loss_on!r}")
        if self.lm_head_init not in ("target", "random"):
            raise TrainError(f"lm_head_init must be 'target' or 'random', got {self.lm_head_init!r}")
        if self.head_dtype not in DTYPES:
            raise TrainError(f"head_dtype {self.head_dtype!r}: choose one of {list(DTYPES)}")
        for name in ("ttt_steps", "draft_vocab_size", "batch_tokens", "tokens", "save_every", "head_chunk"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab_coverage is not None and not 0 < self.draft_vocab_coverage <= 1:
            raise TrainError(f"draft_vocab_coverage must be in (0, 1], got {self.draft_vocab_coverage}")
        if not self.step_weight > 0:
            raise TrainError(f"step_weight must be > 0, got {self.step_weight}")
        return self


def train_eagle3(cfg: Train3Config) -> Path:
    """Train an EAGLE-3 head for `cfg.model` on a data folder; returns the checkpoint folder."""
    cfg.validate()
    run = prepare_run(cfg, "eagle3", eagle3=True)
    data, manifest, out, model, tokenizer, info = run.data, run.manifest, run.out, run.model, run.tokenizer, run.info
    weight, train, held, featured = run.weight, run.train, run.held, run.featured

    V = weight.shape[0]
    vocab_ids, vocab_counts = draft_vocabulary(train, V, cfg.draft_vocab_size, cfg.vocab_count, cfg.loss_on,
                                               cfg.draft_vocab_coverage)
    total_counted = int(sum(counted_tokens(s, cfg.vocab_count, cfg.loss_on).numel() for s in train))
    d2t, t2d = eagle3_maps(vocab_ids, V)
    covered = float(vocab_counts.sum() / max(total_counted, 1))
    print(f"[train eagle3] draft vocabulary: {d2t.numel():,} ids, covering {covered:.1%} of the {total_counted:,} "
          f"counted tokens ({cfg.vocab_count})", flush=True)
    embed = model.get_input_embeddings()
    layers = eagle3_feature_layers(info.num_layers)
    head = new_eagle3_head(model, d2t, t2d, cfg.seed, cfg.lm_head_init).float().train()
    maps = DraftVocab.of(head, "cpu")

    eos = eos_token_ids(model, tokenizer)
    held_prompts = heldout_prompts(held, manifest, cfg.eval_prompts)
    head_dtype = DTYPES[cfg.head_dtype]
    held_batches = [make_batch3(featured([held[i] for i in b]), maps, cfg.ttt_steps, cfg.loss_on)
                    for b in pack_samples([s.input_ids.numel() for s in held], range(len(held)), cfg.batch_tokens)]

    def evaluate(step: int, tokens_seen: int) -> dict:
        head.eval()
        with torch.no_grad():
            rows = [(b, ttt_loss(head, embed, b, step_weight=cfg.step_weight, head_dtype=head_dtype,
                                 chunk=cfg.head_chunk, backward=False)) for b in held_batches]
        n = sum(b.rows for b, _ in rows)
        counted = [sum(r["counted"][k] for _, r in rows) for k in range(cfg.ttt_steps)]
        acc = [sum(r["acc"][k] for _, r in rows) / max(counted[k], 1) for k in range(cfg.ttt_steps)]
        loss = sum(r["loss"] * b.rows for b, r in rows) / n if n else float("nan")
        # tau of the untrained head is ~1 by construction: not worth decoding the held-out prompts for
        tau = heldout_tau(model, tokenizer, info, head, held_prompts, cfg.eval_new_tokens, eos, method="eagle3") \
            if held_prompts and step > 0 else float("nan")
        head.train()
        return {"step": step, "tokens": tokens_seen, "heldout_loss": loss,
                "heldout_top1": acc[0] if acc else float("nan"),
                "heldout_top1_last_step": acc[-1] if acc else float("nan"), "heldout_top1_by_step": acc,
                "heldout_tau": tau}

    recipe = Recipe(
        name="eagle3", head=head, evaluate=evaluate,
        batch=lambda idx: make_batch3(featured([train[i] for i in idx]), maps, cfg.ttt_steps, cfg.loss_on),
        step=lambda batch: ttt_loss(head, embed, batch, step_weight=cfg.step_weight, head_dtype=head_dtype,
                                    chunk=cfg.head_chunk),
        tokens=lambda batch, idx: sum(train[i].input_ids.numel() for i in idx),
        describe=lambda p: (f"held-out top-1 {p['heldout_top1']:.3f} (step {cfg.ttt_steps - 1}: "
                            f"{p['heldout_top1_last_step']:.3f}), tau {p['heldout_tau']:.2f}, "
                            f"loss {p['heldout_loss']:.3f}"))
    res = train_loop(cfg, recipe, [s.input_ids.numel() for s in train], run_key(cfg, manifest), out, cfg.model)
    point = res.curve[-1]
    summary = {"target": cfg.model, "data": str(data), "data_settings": manifest["settings"],
               "data_used": data_used(train, held),
               "draft_vocab": {"size": int(d2t.numel()), "requested": cfg.draft_vocab_size, "counted": cfg.vocab_count,
                               "coverage": covered,
                               "coverage_asked": cfg.draft_vocab_coverage,
                               "distinct_seen": int(len(vocab_ids)) if len(vocab_ids) < cfg.draft_vocab_size
                               and cfg.draft_vocab_coverage is None else None},
               "feature_layers": list(layers), "features": "stored" if stores_features(manifest) else "on the fly",
               "tokens_seen": res.tokens_seen, "steps": res.step, "finished": res.finished,
               "train_seconds_this_run": round(res.seconds_this_run, 1),
               "train_seconds_total": round(res.seconds_total, 1),
               "heldout_top1": point["heldout_top1"], "heldout_top1_by_step": point["heldout_top1_by_step"],
               "heldout_tau": point["heldout_tau"],
               "eval": {"prompts": len(held_prompts), "new_tokens": cfg.eval_new_tokens, "vocab": "full",
                        "eagle_depth": SpecConfig().eagle_depth, "eagle_topk": SpecConfig().eagle_topk},
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress",)}}
    save_eagle3_head(head, out, target_name=cfg.model, target_weight=weight, feature_layers=layers, training=summary)
    pl.DataFrame(res.curve).write_parquet(out / "learning_curve.parquet")
    (out / "README.md").write_text(eagle3_card(cfg, summary, res.curve))
    print(learning_curve_table(res.curve))
    print(f"[train eagle3] {cfg.model}: {res.tokens_seen:,} tokens, {res.step} steps, draft vocabulary {d2t.numel():,} "
          f"(covers {summary['draft_vocab']['coverage']:.1%} of the counted tokens); held-out top-1 "
          f"{point['heldout_top1']:.3f}, tau {point['heldout_tau']:.2f} -> {out}")
    return out
