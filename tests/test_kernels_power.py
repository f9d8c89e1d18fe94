"""Tests with the power to fail for the claim every lossless method rests on: a row's bits are a function of that
row and its logical context alone (engine.native rules 1-3), at the real models' shapes, on data where the order
of a sum decides its bits.

- The linears (kernels/cpu.c `sv_linear_bf16`, `sv_linear_f32`; kernels/cpu_avx2.c `sv2_linear_f32`) at every
  product of SmolLM2-135M and Gemma-3-270M (K up to 2048): a row alone equals that row inside products of up to 67
  rows and on 1-3 threads, bitwise; and the output equals the kernel's documented order written out in torch
  (`kernel_order_linear`: one accumulator per lane, K chunks in order, then hsum16's / hsum4x8's tree), bitwise,
  on data where the same products summed in two halves of K give other bits (shown in the test).
- The attentions (`attention`, `attention_f32`) at the models' head sizes over a 394-token cache, with sharply
  peaked scores (two planted keys dominate, the other weights reach e^-44) and values of mixed magnitudes, where
  the same keys folded in another order give other bits (shown in the test): a tree's rows equal the same rows
  run alone over an `ar` layout of their context, on 1 or 2 threads, and a context whose tail is gathered from
  shuffled slots, bitwise; and the reference to fp32 rounding.
- Compaction of the native static cache (`StaticKV.compact`) after trees whose accepted path moves nodes: the
  cache equals, bitwise, the cache of a sequential (`ar`) run of the accepted tokens.

Mutants these tests were checked against (each applied to a copy of the source, each fails a test here):
- every linear tile summing K in another order (the chunks rotated by half of K)     -> kernel order (bf16, fp32,
  AVX2)
- the 1-row tile summing K in two halves                                              -> kernel order, rows
- rows past 32 left unwritten (a row limit of 32)                                     -> rows
- the bf16 attention folding the tail keys in slot order                              -> shuffled slots
- the bf16 attention folding its value blocks last-first in rows after the first      -> tree rows
- the fp32 attention folding the tail keys in slot order                              -> shuffled slots
- the fp32 attention summing its weights last-first in rows after the first           -> tree rows
- `StaticKV.compact` copying nothing; copying from one slot too early (keep + P - 1)   -> compaction
(the K rotation and the row limit pass tests/test_kernels_cpu_linear.py's linear tests, the slot-order mutants the
attention tests in tests/test_kernels_cpu_attention.py, the compaction ones tests/test_native.py's compaction test)
"""

from __future__ import annotations

import pytest
import torch

from specvocab.engine.native import BLOCK, tail_index
from specvocab.engine.verify import tree_layout
from specvocab.kernels import cpu
from specvocab.kernels.hardware import cpu_flags
from specvocab.kernels.testing import rel_rms

# the decoder shapes of the real models (their HF configs): hidden size, query / KV heads, head size, MLP width
MODELS = {
    "smollm2-135m": dict(d=576, heads=9, kv_heads=3, head_dim=64, mlp=1536),
    "gemma-3-270m": dict(d=640, heads=4, kv_heads=1, head_dim=256, mlp=2048),
}


def _linears(d, heads, kv_heads, head_dim, mlp) -> dict[str, tuple[int, int]]:
    """Each linear of a decoder layer as (N, K), the way engine.native fuses them."""
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, d), "o": (d, heads * head_dim), "gate_up": (2 * mlp, d),
            "down": (d, mlp)}


def _isa_here() -> str:
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "amx")))
    return ", ".join(flags) or "none of avx*, fma, amx*"


def _need(kind: str, monkeypatch) -> None:
    """Skip unless `kind`'s kernel runs here, naming the ISA it needs (kind: bf16, fp32, avx2)."""
    if kind == "avx2":
        monkeypatch.setenv(cpu.ISA_ENV, "avx2")
        if cpu.isa() != "avx2":
            pytest.skip(f"needs AVX2 + FMA (kernels/cpu_avx2.c); this CPU has {_isa_here()}: "
                        f"{cpu.builds.library_reason('avx2')}")
    elif kind == "fp32":
        monkeypatch.setenv(cpu.ISA_ENV, "avx512")
        if cpu.available_fp32() is not None:
            pytest.skip(f"needs AVX-512F/BW/VL (kernels/cpu.c); this CPU has {_isa_here()}: {cpu.available_fp32()}")
    elif cpu.available() is not None:
        pytest.skip(f"needs AVX512-BF16 (kernels/cpu.c); this CPU has {_isa_here()}: {cpu.available()}")


# --- the linears -------------------------------------------------------------------------------------------------

def _tree(acc: torch.Tensor) -> torch.Tensor:
    """The kernels' fixed reduction of a register's lanes acc [..., 16 or 8] (fp32): each group of four lanes
    e0..e3 as (e0 + e2) + (e1 + e3), then the groups as (G0 + G1) + (G2 + G3) (kernels/cpu.c `hsum16`) or
    G0 + G1 (kernels/cpu_avx2.c `hsum4x8`)."""
    g = (acc[..., 0::4] + acc[..., 2::4]) + (acc[..., 1::4] + acc[..., 3::4])
    return (g[..., 0] + g[..., 1]) + (g[..., 2] + g[..., 3]) if g.shape[-1] == 4 else g[..., 0] + g[..., 1]


def kernel_order_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, chunk: int, lanes: int,
                        halves: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias) in fp32, summed in the small-row kernels' order: K in chunks of `chunk`
    (zero-padded), lane l of output (m, n) accumulating its chunk elements l * (chunk / lanes) .. in order, the
    chunks in order, then `_tree`, then the bias. x and w hold bf16 values (as fp32), so every product is exact
    in fp32 and each FMA / VDPBF16PS step is one fp32 rounding of a sum. For the bf16 kernel (chunk 32, 16 lanes
    of element pairs) give x zeros at even K: a pair's order inside VDPBF16PS then changes no bit on any CPU.
    halves: K summed in two halves, each from zero, then added (the test's power: another order of the same
    products). Returns fp32 [M, N]."""
    M, K = x.shape
    kc = -(-K // chunk)
    pad = kc * chunk - K
    # [kc, chunk / lanes, rows, lanes]: step (c, j) adds element j of each lane's share of chunk c
    xs = torch.nn.functional.pad(x.float(), (0, pad)).view(M, kc, lanes, chunk // lanes).permute(1, 3, 0, 2)
    ws = torch.nn.functional.pad(w.float(), (0, pad)).view(-1, kc, lanes, chunk // lanes).permute(1, 3, 0, 2)
    xs, ws = xs.contiguous()[:, :, :, None], ws.contiguous()[:, :, None]
    parts = [range(kc // 2), range(kc // 2, kc)] if halves else [range(kc)]
    total = None
    for part in parts:
        acc = torch.zeros(M, w.shape[0], lanes)
        for c in part:
            for j in range(chunk // lanes):
                acc = acc + xs[c, j] * ws[c, j]                    # an exact product, one rounding
        s = _tree(acc)
        total = s if total is None else total + s
    return total if bias is None else total + bias.float()


def _mixed(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values of mixed magnitudes (normal times 2^[-4, 4]): sums whose rounding depends on their order."""
    return (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-4, 5, shape, generator=g).float())).bfloat16()


ROWS = 67     # past SMALL_ROWS (32) and 64, and 67 = 16 four-row tiles + 3 (a 2-row and a 1-row tile after them)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", ["bf16", "fp32", "avx2"])
def test_the_linears_at_the_models_shapes_sum_in_the_kernel_order_and_keep_every_row(kind, model, monkeypatch):
    """Every linear of the model's decoder layer, on the kernel `kind` names (bf16: VDPBF16PS; fp32: AVX-512F;
    avx2: kernels/cpu_avx2.c): (1) bitwise `kernel_order_linear` (and so the kernel's documented order), on data
    where summing K in two halves gives other bits; (2) a row alone has the bits it has inside M = 1 .. 13,
    29 .. 36 and 60 .. 67 rows (every place in the 4-, 3-, 2- and 1-row tiles, around 32 and 64), starting at
    every offset of a tile, and on 1, 2 or 3 threads; (3) within fp32 rounding of `linear_reference`."""
    _need(kind, monkeypatch)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    g = torch.Generator().manual_seed(len(model) + len(kind))
    for name, (N, K) in _linears(**MODELS[model]).items():
        w, b = _mixed(g, N, K), torch.randn(N, generator=g)
        p = cpu.pack(w.to(dtype), b)
        chunk = p.packed.shape[-1]                       # 32 (bf16), 16 (AVX-512 fp32), 8 (AVX2)
        lanes = 16 if chunk >= 16 else 8
        # (1) the kernel's order, on rows whose products are exact in fp32 (bf16: even elements zero)
        xo = _mixed(g, 5, K)                                     # a 4-row tile and a 1-row one
        if kind == "bf16":
            xo[:, 0::2] = 0
        want = kernel_order_linear(xo, w, b, chunk, lanes)
        two_halves = kernel_order_linear(xo, w, b, chunk, lanes, halves=True)
        assert not torch.equal(two_halves, want), (name, "the data cannot tell summation orders apart")
        got = p(xo.to(dtype), torch.float32, threads=1)
        assert torch.equal(got, want), (name, int((got != want).sum()))
        # (2) rows: alone, inside every M, at every tile offset, on any thread count
        x = (_mixed(g, ROWS, K) if kind == "bf16" else torch.randn(ROWS, K, generator=g)).to(dtype)
        full = p(x, torch.float32, threads=1)
        for M in (*range(1, 14), *range(29, 37), *range(60, ROWS + 1)):   # every tile position; 32 and 64
            assert torch.equal(p(x[:M], torch.float32), full[:M]), (name, M)
        for r in range(ROWS):
            assert torch.equal(p(x[r:r + 1], torch.float32)[0], full[r]), (name, r)
        for s in range(1, 12):                                   # row s first in its tile, others after it
            assert torch.equal(p(x[s:], torch.float32), full[s:]), (name, s)
        for threads in (2, 3):
            assert torch.equal(p(x, torch.float32, threads=threads), full), (name, threads)
        # (3) the plain reference
        ref = cpu.linear_reference(x, w.to(dtype), b, torch.float32)
        assert rel_rms(full, ref) < 2e-6, (name, rel_rms(full, ref))      # ~3e-7: fp32 sums over K


# --- the attentions --------------------------------------------------------------------------------------------

B = BLOCK
COMMITTED = 12 * B + 10           # a 394-token prompt: 12 committed blocks, 10 positions into the tail's first
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 9]   # a 12-node draft tree, 6 deep, with siblings between ancestors


def _peaked_case(heads, kv_heads, head_dim, dtype, seed=0):
    """q [n, H, hd], kc / vc [kvh, cap, hd] for PARENTS's tree verified after COMMITTED tokens (node i in slot
    COMMITTED + i); positions, idx, ok from engine.native.tail_index. Scores: the random keys' ~ N(0, 5^2), two
    planted keys per KV head scoring about 25 for every query head of its group (within a few units of each
    other), so beside the max ~97% of the weights are below e^-15, the least near e^-44; values normal times
    2^[-6, 6]."""
    g = torch.Generator().manual_seed(seed)
    n, H, kvh, hd = len(PARENTS), heads, kv_heads, head_dim
    cap = COMMITTED + n + 3 * B                       # room after the tree for a context moved to other slots
    scale = hd ** -0.5
    base = torch.randn(kvh, hd, generator=g)          # a query direction each KV head's group shares
    q = base.repeat_interleave(H // kvh, 0)[None] + 0.3 * torch.randn(n, H, hd, generator=g)
    kc = 5 * torch.randn(kvh, cap, hd, generator=g)   # scores ~ N(0, 5^2) against a unit-variance query
    for j in range(kvh):
        u = base[j] / (scale * base[j].pow(2).sum())  # q . u scale ~ 1 for the group's heads
        kc[j, 350] += 25 * u
        kc[j, 370] += 24.5 * u                        # two dominant keys, in block 10 and 11
    vc = torch.randn(kvh, cap, hd, generator=g) * torch.exp2(torch.randint(-6, 7, (kvh, cap, 1), generator=g).float())
    parents = torch.tensor(PARENTS)
    depth, anc = tree_layout(parents)
    pos = COMMITTED + depth
    idx, ok = tail_index(COMMITTED, pos, anc, depth)
    return q.to(dtype), kc.to(dtype), vc.to(dtype), pos, idx, ok, anc, scale


def _attend(kind: str):
    return cpu.attention if kind == "bf16" else cpu.attention_f32


def _ar_layout(kc, vc, r, pos, anc):
    """Row r's context as an `ar` run leaves it: its ancestor at depth j in slot COMMITTED + j (the tree puts it
    in COMMITTED + its node index); idx, ok the tail of that run (committed slot = logical position)."""
    kr, vr = kc.clone(), vc.clone()
    chain = anc[r].nonzero()[:, 0]                    # ascending node index = ascending depth
    kr[:, COMMITTED:COMMITTED + len(chain)] = kc[:, COMMITTED + chain]
    vr[:, COMMITTED:COMMITTED + len(chain)] = vc[:, COMMITTED + chain]
    logical = (COMMITTED // B) * B + torch.arange(2 * B)
    return kr, vr, logical[None], (logical <= pos[r])[None]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_peaked_attention_keeps_a_rows_bits_in_a_tree_alone_and_from_shuffled_slots(kind, model, monkeypatch):
    """The exact decode's attention (`attention` over a bf16 cache, `attention_f32` over an fp32 one) at the
    model's head shape, on peaked scores where the order of the keys decides the bits: (power) the same keys
    folded in another logical order give other bits; (1) each tree row equals the row run alone over the `ar`
    layout of its context, on 1 or 2 threads, with and without a sliding window, bitwise; (2) that context read
    with one committed block fewer and the tail gathered from shuffled slots gives the same bits; (3) the plain
    reference to fp32 rounding (bf16: of the bf16-rounded weights)."""
    if kind == "bf16":
        _need("bf16", monkeypatch)
    elif cpu.attention_f32_reason(64) is not None:
        pytest.skip(f"needs AVX2 + FMA (kernels/cpu_avx2.c); this CPU has {_isa_here()}: "
                    f"{cpu.attention_f32_reason(64)}")
    shape = MODELS[model]
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    attend = _attend(kind)
    q, kc, vc, pos, idx, ok, anc, scale = _peaked_case(shape["heads"], shape["kv_heads"], shape["head_dim"], dtype)
    b0 = COMMITTED // B
    tree = attend(q, kc, vc, b0, pos, idx, ok, None, scale, threads=1)

    # power: the committed keys in another logical order (the same set: no window) change the bits
    perm = torch.randperm(b0 * B, generator=torch.Generator().manual_seed(1))
    kp, vp = kc.clone(), vc.clone()
    kp[:, :b0 * B], vp[:, :b0 * B] = kc[:, perm], vc[:, perm]
    other = attend(q, kp, vp, b0, pos, idx, ok, None, scale, threads=1)
    assert not torch.equal(other, tree), "the data cannot tell key orders apart"
    assert rel_rms(other, tree) < 1e-5                        # ... and the difference is rounding

    for window in (None, 300):                                # 300: Gemma's sliding layers, half the context
        tree = attend(q, kc, vc, b0, pos, idx, ok, window, scale, threads=1)
        assert torch.equal(attend(q, kc, vc, b0, pos, idx, ok, window, scale, threads=2), tree), window
        for r in range(len(PARENTS)):
            kr, vr, idx_r, ok_r = _ar_layout(kc, vc, r, pos, anc)
            alone = attend(q[r:r + 1], kr, vr, b0, pos[r:r + 1], idx_r, ok_r, window, scale)
            assert torch.equal(alone[0], tree[r]), (window, r)
            # (2) block b0 - 1 uncommitted: the tail is blocks b0 - 1 and b0, each position from a shuffled slot
            logical = (b0 - 1) * B + torch.arange(2 * B)
            free = (b0 + 1) * B + torch.randperm(2 * B, generator=torch.Generator().manual_seed(r))   # past them
            ks, vs = kr.clone(), vr.clone()
            ks[:, free], vs[:, free] = kr[:, logical], vr[:, logical]
            ks[:, logical], vs[:, logical] = 0, 0                 # the old places now hold something else
            moved = attend(q[r:r + 1], ks, vs, b0 - 1, pos[r:r + 1], free[None], (logical <= pos[r])[None],
                           window, scale)
            assert torch.equal(moved[0], tree[r]), (window, r)
        ref = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, window, scale)
        assert rel_rms(tree, ref) < 1e-5, (window, rel_rms(tree, ref))


# --- compaction of the native static cache ---------------------------------------------------------------------

STEPS = (   # (parents, accepted path): every path moves nodes, one step crosses into the next attention block
    ([-1, 0, 0, 1, 2, 2, 4, 3], [0, 2, 5]),
    ([-1, 0, 1, 0, 3, 4, 3, 6, 7], [0, 3, 6, 7, 8]),
    ([-1, 0, 0, 0, 3, 1, 4], [0, 3, 4, 6]),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_that_moves_nodes_leaves_the_cache_of_a_sequential_run(dtype):
    """The native target's static cache after tree steps whose accepted paths are not the front of the tree
    (`StaticKV.compact` moves them down), bitwise equal on the committed slots to the cache of an `ar` run that
    fed the accepted tokens one at a time; the tree's logits of the accepted nodes equal the `ar` run's. On
    whichever fixed-shape path runs here (the C kernels, or torch's padded one)."""
    from specvocab.engine.models import load_model
    from specvocab.engine.target import make_target
    model = load_model("random-llama", dtype=dtype, seed=3)[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (27,), generator=g)
    tree_t, seq_t = make_target(model, "native"), make_target(model, "native")
    with torch.inference_mode():
        for t in (tree_t, seq_t):
            t.begin(96)
            t.prefill(prompt)
        for parents, path in STEPS:
            parents = torch.tensor(parents)
            n, P = len(parents), tree_t.committed
            tokens = torch.randint(0, 512, (n,), generator=g)
            depth, anc = tree_layout(parents)
            assert anc[path[-1]].nonzero()[:, 0].tolist() == path and path != list(range(len(path)))
            _, tree_logits = tree_t.forward_tree(tokens, parents, depth, anc)
            seq_logits = []
            for node in path:
                one = torch.tensor([-1])
                _, lg = seq_t.forward_tree(tokens[node:node + 1], one, *tree_layout(one))
                seq_t.compact(1, None)
                seq_logits.append(lg[0])
            assert torch.equal(tree_logits[path], torch.stack(seq_logits))
            # power: before compaction the path's entries are not where the sequential run has them
            assert not torch.equal(tree_t.cache.k[:, :, P:P + len(path)], seq_t.cache.k[:, :, P:P + len(path)])
            assert tree_t.compact(n, path) == seq_t.committed == P + len(path)
            c = seq_t.committed
            assert torch.equal(tree_t.cache.k[:, :, :c], seq_t.cache.k[:, :, :c])
            assert torch.equal(tree_t.cache.v[:, :, :c], seq_t.cache.v[:, :, :c])
    assert tree_t.committed > B                                # the steps crossed into the next block
