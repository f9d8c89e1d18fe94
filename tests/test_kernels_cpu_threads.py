"""Threads: every threaded CPU kernel gives a row the same bits on 1, 2 and 3 threads, in fp32 and bf16, on each
build this CPU has - what lets a decode use any thread count without changing its tokens (engine.native rule 1).
The ops are the decode's: the linear (`PackedLinear`), the LM head's logits with their top-k and argmax, the
gathered head (MicroSpec's window buffer read where it lies, `rows_linear` / `kernels.head.packed_head`), the
attention and the fused layer. Shapes are odd and large enough that 2 and 3 threads split the output blocks
(or rows, or (row, KV head) pairs) unevenly, and each row is also run alone on each thread count.

Mutants these tests were checked against (each fails at least one test here):
- the linear's threads splitting K (each a partial sum, added after)                 -> linear, LM head
- the fp32 linear (AVX2) reducing a thread's first block with another lane order     -> linear (fp32)
- the attention's threads taking the keys in two halves, folded after               -> attention
- the top-k's thread count deciding a tie (the later index on threads > 1)          -> LM head
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu
from specvocab.kernels.head import packed_head
from tests.kernels_cpu_testing import LAYERS, attn_case, builds_with, layer_case, run_layer, use_build

THREADS = (1, 2, 3)
DTYPES = {"linear_bf16": torch.bfloat16, "linear_f32": torch.float32, "attention_bf16": torch.bfloat16,
          "attention_f32": torch.float32, "layer_bf16": torch.bfloat16, "layer_f32": torch.float32}


def _cases(*ops):
    return [pytest.param(op, b, id=f"{op}-{b}") for op in ops for b in builds_with(op)]


@pytest.fixture
def torch_threads():
    """Set torch's thread count (what topk, topk_lse and packed_head use); restored after the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _same_rows(outs: dict[int, torch.Tensor], alone: dict[int, list[torch.Tensor]] | None = None) -> None:
    """Every thread count's output equals the 1-thread one bitwise, and each row run alone equals its row."""
    one = outs[1]
    for t, out in outs.items():
        assert torch.equal(out, one), f"{t} threads"
        for r, row in enumerate((alone or {}).get(t, [])):
            assert torch.equal(row, one[r]), (t, r)


@pytest.mark.parametrize("op,build", _cases("linear_bf16", "linear_f32"))
def test_the_linear_gives_a_row_the_same_bits_on_1_2_and_3_threads(op, build, monkeypatch):
    """A decoder-sized product (N = 1539 outputs: blocks of 4 split 385 ways) over 7 rows; bf16 weights give
    fp32 and bf16 outputs."""
    use_build(monkeypatch, build, op)
    dtype = DTYPES[op]
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1539, 577, generator=g).to(dtype), torch.randn(1539, generator=g).to(dtype)
    p = cpu.pack(w, b)
    x = torch.randn(7, 577, generator=g).to(dtype)
    for out_dtype in ((torch.float32, torch.bfloat16) if dtype == torch.bfloat16 else (torch.float32,)):
        outs = {t: p(x, out_dtype, threads=t) for t in THREADS}
        alone = {t: [p(x[r:r + 1], out_dtype, threads=t)[0] for r in range(7)] for t in THREADS}
        _same_rows(outs, alone)


@pytest.mark.parametrize("op,build", _cases("linear_bf16", "linear_f32"))
def test_the_lm_heads_logits_top_k_and_argmax_are_the_same_on_1_2_and_3_threads(op, build, monkeypatch,
                                                                              torch_threads):
    """The verify's LM head as the decode runs it: fp32 logits of a packed [V, d] head (V = 4099), then `topk`
    (k = 8) and `argmax` over them at the same thread count; the logits are quantised to a few levels so ties
    are common and the top-k's tie rule is exercised."""
    use_build(monkeypatch, build, op)
    dtype = DTYPES[op]
    g = torch.Generator().manual_seed(1)
    head = cpu.pack((torch.randn(4099, 320, generator=g) / 8).to(dtype))
    h = torch.randn(5, 320, generator=g).to(dtype)
    logits, top, arg = {}, {}, {}
    for t in THREADS:
        torch_threads(t)
        z = head(h, torch.float32, threads=t)
        logits[t] = z
        top[t] = cpu.topk(z.round(decimals=1), 8)                          # ties: the lower index, always
        arg[t] = cpu.argmax(z.round(decimals=1))
    _same_rows(logits)
    for t in THREADS:
        assert torch.equal(top[t][0], top[1][0]) and torch.equal(top[t][1], top[1][1]), t
        assert torch.equal(arg[t], arg[1]) and torch.equal(arg[t], top[1][1][:, 0]), t
    lse = {}
    for t in THREADS:
        torch_threads(t)
        lse[t] = cpu.topk_lse(logits[1], 8)
    for t in THREADS:
        assert all(torch.equal(a, b) for a, b in zip(lse[t], lse[1])), t


@pytest.mark.parametrize("build", builds_with("rows_linear_bf16"))
def test_the_gathered_head_is_the_same_on_1_2_and_3_threads(build, monkeypatch, torch_threads):
    """MicroSpec's gathered head over its window buffer (3073 slots, some empty: -inf), read where it lies:
    `rows_linear` at each thread count and `kernels.head.packed_head` (what the drafter calls) under torch's
    thread count."""
    use_build(monkeypatch, build, "rows_linear_bf16")
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(3073, 576, generator=g).bfloat16()
    tok = torch.arange(3073)
    tok[::5] = -1
    h = torch.randn(3, 576, generator=g).bfloat16()
    _same_rows({t: cpu.rows_linear(h, buf, threads=t) for t in THREADS},
               {t: [cpu.rows_linear(h[r:r + 1], buf, threads=t)[0] for r in range(3)] for t in THREADS})
    heads = {}
    for t in THREADS:
        torch_threads(t)
        heads[t] = packed_head(h, buf, tok)
    _same_rows(heads)
    assert torch.isinf(heads[1][:, tok < 0]).all()


@pytest.mark.parametrize("op,build", _cases("attention_bf16", "attention_f32"))
def test_the_attention_gives_a_row_the_same_bits_on_1_2_and_3_threads(op, build, monkeypatch):
    """7 rows x 3 KV heads (21 pairs split 3 ways unevenly), a sliding window, each row alone too."""
    use_build(monkeypatch, build, op)
    fn = cpu.attention if op == "attention_bf16" else cpu.attention_f32
    q, kc, vc, b0, pos, idx, ok = attn_case(n=7, dtype=DTYPES[op])
    outs = {t: fn(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=t) for t in THREADS}
    alone = {t: [fn(q[r:r + 1], kc, vc, b0, pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], 40, 0.125, threads=t)[0]
                 for r in range(7)] for t in THREADS}
    _same_rows(outs, alone)


@pytest.mark.parametrize("op,build", _cases("layer_bf16", "layer_f32"))
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_the_fused_layer_gives_a_row_the_same_bits_on_1_2_and_3_threads(op, build, name, monkeypatch):
    use_build(monkeypatch, build, op)
    spec, x, args, attn_in = layer_case(**LAYERS[name], dtype=DTYPES[op])
    outs, caches = {}, {}
    for t in THREADS:
        out, kc, vc = run_layer(cpu.layer, spec, x, args, attn_in, threads=t)
        outs[t], caches[t] = out, torch.cat([kc.flatten(), vc.flatten()])
    _same_rows(outs)
    _same_rows(caches)
