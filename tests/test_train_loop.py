"""The training loop's batching and step dtype (`engine.train.loop`).

- `length_grouped_batches`: every sample exactly once per epoch, no batch over its token budget unless it is one
  sample, fewer padded tokens than random packing on lengths as skewed as the corpus's, batches in shuffled order,
  and `group_batches=0` is plain random packing;
- `step_dtype`: the named dtype, else bf16 exactly where the machine has bf16 dot products, and a step under it
  runs the head's linears in that dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specvocab.engine.train.loop import length_grouped_batches, pack_samples, step_dtype
from specvocab.engine.train.sample import TrainError
from specvocab.kernels.hardware import CPU_BF16


def skewed_lengths(n: int, seed: int = 1) -> np.ndarray:
    """Sequence lengths like the training corpus's: log-normal, mean about 180, a long tail to about 1000."""
    return np.clip(np.random.default_rng(seed).lognormal(5.0, 0.6, n).astype(int), 8, 1100)


def padded_tokens(lengths: np.ndarray, batches: list[list[int]]) -> int:
    """Rows attention sees when each batch pads its sequences to its longest."""
    return sum(len(b) * int(lengths[b].max()) for b in batches)


@pytest.mark.parametrize("group", [1, 8, 64, 10_000])
def test_every_sample_once_and_batches_within_budget(group):
    lengths = skewed_lengths(2000)
    batches = length_grouped_batches(lengths, np.random.default_rng(0), 2048, group)
    seen = np.concatenate([np.asarray(b) for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))          # a dropped or repeated sample fails
    assert all(len(b) == 1 or lengths[b].sum() <= 2048 for b in batches)


def test_grouping_pads_less_than_random_packing():
    lengths = skewed_lengths(4000)
    plain = length_grouped_batches(lengths, np.random.default_rng(0), 2048, 0)
    grouped = length_grouped_batches(lengths, np.random.default_rng(0), 2048, 64)
    real = int(lengths.sum())
    # the grouped batches pad far less (a sort that does nothing pads as random packing does); a sort of the
    # whole epoch would pad least, and grouping is close to it
    whole = pack_samples(lengths, np.argsort(lengths, kind="stable"), 2048)
    assert padded_tokens(lengths, grouped) < 0.6 * padded_tokens(lengths, plain)
    assert padded_tokens(lengths, grouped) <= 1.25 * padded_tokens(lengths, whole)
    assert padded_tokens(lengths, whole) >= real


def test_batches_come_in_shuffled_order_and_epochs_differ():
    lengths = skewed_lengths(4000)
    batches = length_grouped_batches(lengths, np.random.default_rng(0), 2048, 64)
    longest = [int(lengths[b].max()) for b in batches]
    # unshuffled, each group's batches run from short to long: the longest-of-batch sequence would rise within
    # every run of about 64 batches; shuffled, it rises about half the time
    rises = np.mean(np.diff(longest) > 0)
    assert 0.3 < rises < 0.7
    other = length_grouped_batches(lengths, np.random.default_rng(1), 2048, 64)
    assert batches != other


def test_group_zero_is_plain_random_packing():
    lengths = skewed_lengths(500)
    order = np.random.default_rng(3).permutation(len(lengths))
    assert length_grouped_batches(lengths, np.random.default_rng(3), 2048, 0) == pack_samples(lengths, order, 2048)


def test_step_dtype_named_and_default():
    cpu = torch.device("cpu")
    assert step_dtype("fp32", cpu) == torch.float32
    assert step_dtype("bf16", cpu) == torch.bfloat16
    assert step_dtype(None, cpu) == (torch.bfloat16 if CPU_BF16 else torch.float32)
    with pytest.raises(TrainError, match="compute_dtype 'fp16'.* — pass bf16 or fp32"):
        step_dtype("fp16", cpu)


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_a_training_step_runs_the_linears_in_the_step_dtype(name, tmp_path):
    """train_loop's step runs under autocast in step_dtype: a linear inside the recipe's step computes in it
    (a loop that never enables autocast, or enables it for fp32, fails), and the master weights stay fp32."""
    from specvocab.engine.train.loop import Recipe, RunSettings, train_loop
    from dataclasses import dataclass

    @dataclass(frozen=True, kw_only=True)
    class Cfg(RunSettings):
        tokens: int = 64
        max_epochs: int = 1
        batch_tokens: int = 32
        lr: float = 1e-3
        warmup_steps: int = 1
        weight_decay: float = 0.0
        betas: tuple = (0.9, 0.95)
        grad_clip: float = 1.0

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 8)
    seen = []

    def step(batch):
        y = head(torch.randn(4, 8))
        seen.append(y.dtype)
        loss = y.float().square().mean()
        loss.backward()
        return {"loss": float(loss.detach())}

    recipe = Recipe(name="toy", head=head, batch=lambda idx: idx, step=step, tokens=lambda b, idx: 16,
                    evaluate=lambda s, t: {"step": s, "tokens": t}, describe=lambda p: "")
    cfg = Cfg(compute_dtype=name, eval_every=10**9, save_every=10**6, progress=False)
    train_loop(cfg, recipe, [16] * 4, {"toy": 1}, tmp_path, "toy")
    assert seen and set(seen) == {step_dtype(name, torch.device("cpu"))}
    assert head.weight.dtype == torch.float32
