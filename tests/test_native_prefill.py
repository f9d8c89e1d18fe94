"""The native forward's prefill (`engine.native` behind `engine.target`): a prompt's attention by the decode's kernel,
block by block, and the last row's logits whatever rows the head ran.

Mutants these tests were checked against (each fails at least one test here):
- rows see their whole block (`ok = keys < a + BLOCK`)                   -> both attention tests
- committed blocks 0 (a row misses the blocks before its own)           -> both attention tests
- scale 1                                                                -> both attention tests
- the tail read from slots 0..63 instead of the row's block              -> the by-blocks test (the prefill's
  hidden states on a random model pass it: its attention is nearly uniform)
- a window of 8 on a full layer                                          -> the by-blocks test
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specvocab.engine.models import load_model
from specvocab.engine.native import BLOCK, NativeModel, _causal_run
from specvocab.engine.target import NativeTarget, native_model
from specvocab.kernels import cpu


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_prefills_last_logits_do_not_depend_on_how_many_rows_the_head_ran(cpu_kernels):
    """`ar` asks the prefill for the last row's logits only, a drafter that reads prefill logits for all rows;
    the first token comes from the last row, so it must have the same bits either way (a 70-row head takes
    oneDNN where one row takes the CPU kernel: a near-tie first token diverged before the last row ran alone)."""
    model = load_model("random-llama", dtype="bf16")[0]
    prompt = torch.as_tensor(np.random.default_rng(0).integers(0, 512, 70))
    rows = {}
    for all_logits in (True, False):
        t = NativeTarget(model, cpu_kernels=cpu_kernels)
        t.begin(80)
        with torch.inference_mode():
            rows[all_logits] = t.prefill(prompt, all_logits=all_logits)[1]
    assert rows[True].shape[0] == 70 and rows[False].shape[0] == 1
    assert torch.equal(rows[True][-1], rows[False][0])


@pytest.mark.skipif(cpu.available() is not None, reason=f"needs the bf16 CPU kernels: {cpu.available()}")
@pytest.mark.parametrize("name,length", [("random-llama", 70), ("random-gemma3", 14), ("random-gemma3", 70)])
def test_a_causal_prefill_runs_the_attention_kernel_block_by_block_and_equals_sdpa(name, length, monkeypatch):
    """A prefill over an empty cache takes the decode's attention kernel one block of rows at a time
    (`NativeModel._causal_attention`) on every layer, sliding ones included; every row's hidden state equals
    SDPA's (causal, or masked where random-gemma3's 16-token window cuts) to bf16 rounding. 70 rows: a partial
    third block whose rows see two committed blocks, most of them beyond the window; 14 rows: inside it."""
    model = load_model(name, dtype="bf16")[0]
    prompt = torch.as_tensor(np.random.default_rng(3).integers(0, 512, length))
    calls = []
    real = cpu.attention
    monkeypatch.setattr(cpu, "attention", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))

    def hidden():
        t = NativeTarget(model, cpu_kernels=True)
        t.begin(length + 8)
        with torch.inference_mode():
            return t.prefill(prompt, all_logits=False)[0]

    got = hidden()
    layers = model.config.num_hidden_layers
    assert calls == [min(BLOCK, length - a) for a in range(0, length, BLOCK)] * layers
    monkeypatch.setattr(NativeModel, "_attention_kernel", lambda self, hd: False)
    ref = hidden()
    assert len(calls) == layers * -(-length // BLOCK)                   # SDPA this time
    for r in range(length):                                              # each row: a causal bug shows in early rows
        assert _rel(got[r].float(), ref[r].float()) <= 3e-2, r


@pytest.mark.skipif(cpu.available() is not None, reason=f"needs the bf16 CPU kernels: {cpu.available()}")
def test_the_causal_attention_by_blocks_is_each_rows_softmax_over_itself_and_what_precedes_it():
    """`_causal_attention` on its own, with peaked scores (a random model's attention is nearly uniform, so a
    prefill's hidden states barely show which keys a row saw): row r attends to keys 0..r exactly - not its
    block's later rows, not another block's slots - in fp32 with the weights rounded to bf16 (as the kernel);
    on a sliding layer only keys r - window + 1 .. r."""
    net = native_model(load_model("random-llama", dtype="bf16")[0])
    n, H, kvh, hd = 75, net.heads, net.kv_heads, net.head_dim
    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(n, H, hd, generator=g)).bfloat16()
    kc = torch.randn(kvh, n + 16, hd, generator=g).bfloat16()          # 16 slots past the rows: never read
    vc = torch.randn(kvh, n + 16, hd, generator=g).bfloat16()
    kc[:, n:] = vc[:, n:] = float("nan")
    for kind, window in (("full_attention", None), ("sliding_attention", 40)):
        net.window = window                                              # a sliding layer's window (None: full)
        got = net._causal_attention(q, kc, vc, n, kind).view(n, H, hd).float()
        _check_rows(got, q, kc, vc, net.scale, window)


def _check_rows(got, q, kc, vc, scale, window):
    n, H, hd = q.shape
    kvh = kc.shape[0]
    ref = torch.empty(n, H, hd)
    for r in range(n):
        lo = 0 if window is None else max(0, r - window + 1)             # keys r - window + 1 .. r
        for h in range(H):
            k, v = kc[h // (H // kvh), lo: r + 1].float(), vc[h // (H // kvh), lo: r + 1].float()
            e = torch.softmax(k @ q[r, h].float() * scale, 0)
            e = (e / e.max()).bfloat16().float()                         # exp(s - max) in bf16
            ref[r, h] = e @ v / e.sum()
    assert torch.isfinite(got).all()
    assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_only_a_plain_causal_run_over_an_empty_cache_counts_as_a_prompt():
    """`_causal_run` decides which forwards take the prompt path (the kernel by blocks, or SDPA's is_causal): a
    tree, a cache already holding rows, shifted positions or remapped key positions must not."""
    n = 6
    pos, causal = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    assert _causal_run(0, pos, causal, None)
    tree = causal.clone()
    tree[3, 2] = False                                                   # node 3 is not a child of node 2
    assert not _causal_run(0, pos, tree, None)
    assert not _causal_run(0, pos, torch.ones(n, n, dtype=torch.bool), None)
    assert not _causal_run(4, pos, causal, None)
    assert not _causal_run(0, pos + 4, causal, None)
    assert not _causal_run(0, pos, torch.ones(n, n + 2, dtype=torch.bool).tril(2), None)
    assert not _causal_run(0, pos, causal, torch.arange(n))
