"""The CPU kernels of the native bf16 decode (kernels.cpu): each against its plain-torch reference, and the
property the decode needs from them - a row's bits are a function of that row (and its logical context)
alone.

Mutants these tests were checked against (each fails at least one test here):
- the linear's leftover rows (M % 4) summed in another order than the 4-row tile    -> row invariance
  (the 2-row tile's second row reduced lane by lane; hsum4 pairing 128-bit lanes (0,1),(2,3) instead of
  hsum16's (0,2),(1,3); rows_linear's 4-row tile reduced lane by lane                -> row invariance)
- threads splitting K instead of the outputs                                         -> thread invariance
- the partial last K chunk of x read unmasked (the next row's values leak in)        -> masked tail
- bias dropped, or added after rounding to bf16                                       -> reference (fp32 out)
- bf16 output truncated instead of rounded to nearest even                            -> rounding
- the packed layout's block and chunk axes swapped                                    -> reference
- the fp32 linear: its partial last chunk read unmasked; the 2-row tile's second row reduced lane by lane;
  bias dropped; packed at bf16's 32-wide chunks                                        -> fp32 linear
- attention ignoring `ok` (the tree's ancestry) or the sliding window                  -> reference
- attention folding the two tail blocks as one 64-key block                           -> committed vs tail
- attention reading the tail in slot order (idx ignored)                               -> slots moved
- attention's shared value loop weighting every head by the first head's probabilities;
  the fold's rescale of the running output skipped (fa = 1)                           -> reference
- route_linears serving the first packed copy after the weights changed in place      -> weight updates
- rows_linear reading the weight's or x's partial last chunk unmasked                  -> row-major tails
- topk: the masked last vector skipped; ties inserted ahead of the incumbent (>= for >) -> topk
- topk_lse: the masked last vector left out of the sum; the high half of each 16 (s1) dropped; lse without
  the max added back                                                                   -> topk_lse
  (exp_ps's polynomial one term short passes, here and in the attention's tests: its error, ~2e-6 relative at
  the edge of the reduced interval and ~3e-7 of a sum, is under every tolerance these outputs are held to)
  (the vector pre-filter's > made >= passes, rightly: the scalar check after it decides)
  (computing every row with the 1-row tile instead of the 4-row one passes: the same sums, in the same order)
- the fused layer: RoPE's rotate-half sign flipped; the activation taken before the gate/up split's
  other half (SiLU for Gemma's GELU); the norm weight multiplied before rounding h (Llama's order);
  the post-attention / post-MLP norms skipped; k and v swapped in the cache write; the act rows not
  compacted (row r > 0 reads the wrong values); the q norm skipping the first head    -> layer reference
"""

from __future__ import annotations

import pytest
import torch

from specvocab.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.available() is not None,
                                reason=f"needs AVX512-BF16 (this CPU: {cpu.cpu_isa()}): {cpu.available()}")


def _weights(N, K, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    return w, b


@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576)])
def test_the_linear_equals_its_reference(N, K):
    w, b = _weights(N, K)
    p = cpu.pack(w, b)
    x = torch.randn(9, K).bfloat16()
    got = p(x, torch.float32)
    ref = cpu.linear_reference(x, w, b, torch.float32)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    # bf16 output: the fp32 result rounded to nearest even (what torch's cast does), bitwise
    assert torch.equal(p(x), got.to(torch.bfloat16))


def test_the_linear_gives_a_row_the_same_bits_for_every_row_count_and_thread_count():
    w, b = _weights(1001, 577, seed=1)
    p = cpu.pack(w, b)
    x = torch.randn(11, 577).bfloat16()
    f32 = torch.float32                         # fp32 out: no rounding to bf16 hides a changed last bit
    full = p(x, f32, threads=1)
    for M in range(1, 12):                      # every position of a row inside 4-row tiles and leftovers
        got = p(x[:M], f32, threads=1)
        assert torch.equal(got, full[:M]), M
        for r in range(M):
            assert torch.equal(p(x[r:r + 1], f32)[0], full[r])
    for threads in (2, 3):
        assert torch.equal(p(x, f32, threads=threads), full)
    perm = torch.randperm(11)
    assert torch.equal(p(x[perm], f32), full[perm])


def test_the_linear_reads_no_further_than_each_row():
    """K = 40: the last chunk is partial; the next row's first values (inf here) must not leak in."""
    w, b = _weights(8, 40, seed=2)
    p = cpu.pack(w, b)
    x = torch.randn(6, 40).bfloat16()
    x[1, :8] = float("inf")
    x[3, :] = float("nan")
    got = p(x, torch.float32)
    ok = [0, 2, 4, 5]
    assert torch.isfinite(got[ok]).all()
    ref = cpu.linear_reference(x[ok], w, b, torch.float32)
    assert float((got[ok] - ref).abs().max() / ref.abs().max()) < 1e-5


def test_the_linear_refuses_what_it_cannot_multiply():
    w, _ = _weights(8, 32)
    with pytest.raises(cpu.CpuKernelError, match="bf16 or fp32"):
        cpu.pack(w.half())
    p = cpu.pack(w)
    with pytest.raises(cpu.CpuKernelError, match="features"):
        p(torch.randn(2, 33).bfloat16())
    with pytest.raises(cpu.CpuKernelError, match="packed in torch.bfloat16"):
        p(torch.randn(2, 32))
    with pytest.raises(cpu.CpuKernelError, match="packed in torch.float32"):
        cpu.pack(w.float())(torch.randn(2, 32).bfloat16())


@pytest.mark.parametrize("N,K", [(64, 64), (1001, 577), (13, 40), (960, 576), (7, 9)])
def test_the_fp32_linear_equals_the_product_and_gives_a_row_the_same_bits_for_every_row_count(N, K):
    """The fp32 kernel (`pack` of an fp32 weight): the float64 product to fp32 rounding, bias included; a row's
    bits the same at every M (every place in the 4-row, 2-row and 1-row tiles), on any thread count, in any
    row order; the partial last K chunk masked (the next row's inf does not leak in)."""
    g = torch.Generator().manual_seed(N + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p = cpu.pack(w, b)
    assert p.packed.dtype == torch.float32
    x = torch.randn(11, K, generator=g)
    full = p(x, threads=1)
    assert full.dtype == torch.float32 and full.shape == (11, N)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert float((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for M in range(1, 12):
        assert torch.equal(p(x[:M], threads=1), full[:M]), M
        assert torch.equal(p(x[M - 1:M])[0], full[M - 1])
    for threads in (2, 3):
        assert torch.equal(p(x, threads=threads), full)
    perm = torch.randperm(11, generator=g)
    assert torch.equal(p(x[perm]), full[perm])
    leak = x.clone()
    leak[4, :] = float("inf")                             # row 3's partial chunk must not read row 4
    assert torch.equal(p(leak)[3], full[3])


def test_a_cpu_with_avx512_but_not_bf16_runs_the_fp32_kernels_and_says_why_not_the_bf16_ones(monkeypatch):
    """The library builds on AVX-512F/BW/VL alone; there `available_fp32()` is None (fp32 linear, top-k, window
    step), `available()` and `reason(.., bf16)` name avx512_bf16, `linear_reason` passes fp32 only; without
    AVX-512 the build names what is missing."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(cpu.BUILD_FLAGS))
    monkeypatch.setattr(cpu, "_bf16", cpu._bf16)                 # restored after the test, as the three below
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_why_not", None)
    assert cpu.available_fp32() is None and "avx512_bf16" in cpu.available()
    assert "avx512_bf16" in cpu.reason(torch.device("cpu"), torch.bfloat16)
    assert "avx512_bf16" in cpu.linear_reason(torch.device("cpu"), torch.bfloat16)
    assert cpu.linear_reason(torch.device("cpu"), torch.float32) is None
    assert "bf16 or fp32" in cpu.linear_reason(torch.device("cpu"), torch.float16)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 20, generator=g)
    # another order of the same fp32 sum: within a few ulps of the terms (a relative bound alone failed on a
    # sum that cancelled to 2e-3)
    assert torch.allclose(cpu.pack(w)(torch.ones(1, 20)), w.sum(1)[None], rtol=1e-5, atol=1e-5)
    z = torch.randn(2, 100, generator=g)
    assert torch.equal(cpu.topk(z, 3)[1], torch.topk(z, 3).indices)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert "avx512bw" in cpu.available_fp32() and "avx512bw" in cpu.available()


@pytest.mark.parametrize("N,K", [(3072, 576), (101, 45), (7, 64)])
def test_the_row_major_linear_equals_its_reference_and_keeps_rows_invariant(N, K):
    """`rows_linear` (a weight read where it lies: MicroSpec's window buffer): the fp32 product; a row's bits
    the same at every M; the partial K chunk masked on both sides (the weight row after it holds inf here, and
    so does the next row of x)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(N + 1, K, generator=g).bfloat16()
    w[-1] = float("inf")                               # right after the weight's last row
    w = w[:N]
    x = torch.randn(10, K, generator=g).bfloat16()
    x[9] = float("inf")                                # right after the rows multiplied
    got = cpu.rows_linear(x[:9], w)
    ref = cpu.linear_reference(x[:9], w, None, torch.float32)
    assert torch.isfinite(got).all()
    x2 = x[:5].clone()                                 # a 4-row tile and one row left over
    x2[1, 0] = float("inf")                            # what row 0's partial chunk must not read
    assert torch.isfinite(cpu.rows_linear(x2, w)[[0, 2, 3, 4]]).all()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    for M in (1, 2, 4, 5, 9):
        assert torch.equal(cpu.rows_linear(x[:M], w), got[:M])
    assert torch.equal(cpu.rows_linear(x[:9], w, threads=2), got)
    assert torch.equal(cpu.rows_linear(x[:3], w, torch.bfloat16), got[:3].to(torch.bfloat16))
    with pytest.raises(cpu.CpuKernelError, match="bf16 CPU"):
        cpu.rows_linear(x.float(), w)


def test_the_window_head_runs_the_row_major_kernel_in_bf16():
    from specvocab.kernels.head import packed_head_ref, packed_head_torch
    w = torch.randn(300, 64).bfloat16()
    tok = torch.arange(300)
    tok[::7] = -1
    h = torch.randn(3, 64).bfloat16()
    got = packed_head_torch(h, w, tok)
    assert torch.equal(got, cpu.rows_linear(h, w).masked_fill(tok < 0, float("-inf")))
    ref = packed_head_ref(h, w, tok)
    live = tok >= 0
    assert float((got[:, live] - ref[:, live]).abs().max() / ref[:, live].abs().max()) < 1e-5
    assert torch.isinf(got[:, ~live]).all()


def test_topk_is_torchs_topk_and_argmax_keeps_the_first_maximum():
    """`topk` (the verify's argmax, MicroSpec's and UniSpec's top-k over the vocabulary): torch's values and
    indices; ties go to the lower index (torch.argmax's rule); NaN rows and rows with fewer than k values
    above -inf are answered by torch."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(5, 70001, generator=g)                  # not a multiple of 16: the masked last vector
    z[2, -1] = 50.0                                          # the maximum in the masked tail
    for k in (1, 3, 17):
        v, i = cpu.topk(z, k)
        tv, ti = torch.topk(z, k)
        assert torch.equal(v, tv) and torch.equal(i, ti), k
    assert int(cpu.argmax(z)[2]) == 70000
    ties = torch.randint(0, 4, (64, 333), generator=g).float()     # many equal maxima per row
    assert torch.equal(cpu.argmax(ties), ties.argmax(-1))
    v, i = cpu.topk(ties, 5)
    assert torch.equal(v, torch.topk(ties, 5).values)
    for r in range(64):                                      # equal values: ascending indices
        for a in range(4):
            if v[r, a] == v[r, a + 1]:
                assert i[r, a] < i[r, a + 1]
    z[1, 7] = float("nan")
    assert torch.equal(cpu.argmax(z), z.argmax(-1))          # torch ranks NaN first; so does the fallback
    short = torch.full((2, 40), float("-inf"))
    short[:, 3] = 1.0
    assert cpu.topk(short, 2)[1][:, 0].tolist() == [3, 3]
    assert torch.equal(cpu.topk(z.double(), 2)[1], torch.topk(z.double(), 2)[1])   # other dtypes: torch


def test_topk_lse_gives_topk_and_each_rows_logsumexp():
    """`topk_lse` (the successor store's confidences): `topk`'s values and indices, and a log-sum-exp within a
    few ulp of float64's - over the masked last vector too, on rows with -inf entries, on any thread count; rows
    C declines (NaN, +inf, fewer than k finite values) get the torch reference's answer."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(6, 70001, generator=g) * 8              # not a multiple of 16: the masked last vector
    z[2, -1] = 90.0                                          # the maximum in the masked tail: lse = 90 + ...
    z[3, 5:] = -torch.inf                                    # a masked vocabulary: 5 finite logits
    z[4, 70001 - 9:] = 60.0                                  # the tail's mass decides the row's lse
    want = torch.logsumexp(z.double(), dim=-1)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        v, i, lse = cpu.topk_lse(z, 5)
        tv, ti = cpu.topk(z, 5)
        assert torch.equal(v, tv) and torch.equal(i, ti)
        assert lse.dtype == torch.float32 and lse.shape == (6,)
        assert torch.allclose(lse.double(), want, rtol=0, atol=4 * 90 * 2.0 ** -23), (lse.double() - want).abs().max()
    torch.set_num_threads(1)
    p = (v - lse[:, None]).exp()                            # the top-k probabilities
    assert torch.allclose(p.double(), (tv.double() - want[:, None]).exp(), rtol=1e-5, atol=0)
    odd = torch.full((4, 40), 0.5)
    odd[0, 7] = float("nan")
    odd[1, 3] = float("inf")
    odd[2, 2:] = -torch.inf                                  # 2 finite values, k = 3
    v, i, lse = cpu.topk_lse(odd, 3)
    rv, ri, rl = cpu.topk_lse_reference(odd, 3)
    assert torch.equal(i, ri) and torch.equal(lse.isnan(), rl.isnan()) and lse[1] == torch.inf
    assert torch.equal(lse[2:], rl[2:])


# --- attention -------------------------------------------------------------------------------------------

def _attn_case(n=5, H=9, kvh=3, hd=64, cap=300, P=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, hd, generator=g).bfloat16()
    kc = torch.randn(kvh, cap, hd, generator=g).bfloat16()
    vc = torch.randn(kvh, cap, hd, generator=g).bfloat16()
    pos = P + torch.randint(0, 8, (n,), generator=g)
    idx = torch.randint(0, cap, (n, 2 * cpu.BLOCK), generator=g)
    ok = torch.rand(n, 2 * cpu.BLOCK, generator=g) > 0.3
    return q, kc, vc, P // cpu.BLOCK, pos, idx, ok


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("shape", [dict(H=9, kvh=3, hd=64), dict(H=4, kvh=1, hd=256), dict(H=4, kvh=4, hd=16),
                                   dict(H=10, kvh=2, hd=48)])   # 5 heads a KV head: groups of 3 and 2, a half chunk
def test_the_attention_equals_its_reference(window, shape):
    q, kc, vc, b0, pos, idx, ok = _attn_case(**shape)
    got = cpu.attention(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    ref = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, window, 0.125)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    if window:                                   # the window matters in this case (the test's power)
        no_window = cpu.attention_reference(q, kc, vc, b0, pos, idx, ok, None, 0.125)
        assert float((no_window - ref).abs().max()) > 1e-3
    flipped = ok.clone()
    flipped[:, 3] = ~flipped[:, 3]
    assert not torch.equal(cpu.attention(q, kc, vc, b0, pos, idx, flipped, window, 0.125), got)


def test_the_attention_gives_a_row_the_same_bits_alone_among_others_and_on_any_thread_count():
    q, kc, vc, b0, pos, idx, ok = _attn_case(n=7)
    full = cpu.attention(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=1)
    for r in range(7):
        alone = cpu.attention(q[r:r + 1], kc, vc, b0, pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], 40, 0.125)
        assert torch.equal(alone[0], full[r])
    assert torch.equal(cpu.attention(q, kc, vc, b0, pos, idx, ok, 40, 0.125, threads=2), full)


def test_the_attention_depends_on_logical_positions_not_on_where_keys_lie():
    """The `ar`-step-versus-tree property: the same logical context read (a) with block 2 committed and (b)
    with block 2 in the gathered tail, its keys copied to other cache slots, gives the same bits."""
    B = cpu.BLOCK
    n, H, kvh, hd, cap = 1, 9, 3, 64, 400
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, H, hd, generator=g).bfloat16()
    kc = torch.randn(kvh, cap, hd, generator=g).bfloat16()
    vc = torch.randn(kvh, cap, hd, generator=g).bfloat16()
    pos = torch.tensor([3 * B + 5])                  # the row sees positions 0 .. 3B + 5
    # (a) three committed blocks; the tail is block 3 (positions 3B .. 3B + 5 in their own slots) and block 4
    idx_a = torch.cat([torch.arange(3 * B, 5 * B)])[None]
    ok_a = (torch.arange(3 * B, 5 * B) <= pos)[None]
    a = cpu.attention(q, kc, vc, 3, pos, idx_a, ok_a, None, 0.125)
    # (b) two committed blocks; block 2's keys moved to slots 300.., block 3's to 340..
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, 300:300 + B], vc2[:, 300:300 + B] = kc[:, 2 * B:3 * B], vc[:, 2 * B:3 * B]
    kc2[:, 340:340 + 6], vc2[:, 340:340 + 6] = kc[:, 3 * B:3 * B + 6], vc[:, 3 * B:3 * B + 6]
    kc2[:, 2 * B:3 * B + 6] = 0                     # the old places now hold something else
    vc2[:, 2 * B:3 * B + 6] = 0
    idx_b = torch.cat([torch.arange(300, 300 + B), torch.arange(340, 340 + B)])[None]
    ok_b = torch.cat([torch.ones(B, dtype=torch.bool), torch.arange(B) < 6])[None]
    b = cpu.attention(q, kc2, vc2, 2, pos, idx_b, ok_b, None, 0.125)
    assert torch.equal(a, b)


def test_the_attention_refuses_a_cache_it_cannot_read():
    q, kc, vc, b0, pos, idx, ok = _attn_case()
    with pytest.raises(cpu.CpuKernelError, match="bf16 cache"):
        cpu.attention(q, kc.float(), vc.float(), b0, pos, idx, ok, None, 0.125)
    with pytest.raises(cpu.CpuKernelError, match="contiguous"):
        cpu.attention(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, b0, pos, idx, ok, None, 0.125)


# --- the fused decoder layer ------------------------------------------------------------------------------

LAYERS = {   # (family-like options) -> what they exercise
    "llama": dict(),
    "qwen": dict(bias=True, qk_norm=True),
    "gemma": dict(gemma=True, act="gelu_tanh", qk_norm=True, H=4, kvh=1, hd=64),
    "eagle1": dict(in_norm=False),                  # EAGLE-1/2's layer: no input norm
    "eagle3": dict(in_norm=False, din=192),         # EAGLE-3's midlayer: a 2 d attention input given
    "odd": dict(d=100, I=200),                      # widths that are not a multiple of 16
}


def _layer_case(d=96, H=6, kvh=2, hd=32, I=160, gemma=False, act="silu", qk_norm=False, in_norm=True, bias=False,
                din=None, n=6, P=45, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (0.3 * torch.randn(*s, generator=g)).to(dtype)
    if gemma:                                      # norm weights as the norm multiplies them (pack_layer)
        nw = lambda k: 0.2 * torch.randn(k, generator=g)                                      # noqa: E731
    else:
        nw = lambda k: (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)                     # noqa: E731
    spec = cpu.pack_layer(r((H + 2 * kvh) * hd, din or d), r((H + 2 * kvh) * hd) if bias else None, r(d, H * hd),
                          r(2 * I, d), r(d, I), heads=H, kv_heads=kvh, head_dim=hd, eps=1e-6,
                          in_norm=nw(d) + gemma if in_norm else None, pre_mlp_norm=nw(d) + gemma,
                          post_attn_norm=nw(d) + 1 if gemma else None, post_mlp_norm=nw(d) + 1 if gemma else None,
                          q_norm=nw(hd) + gemma if qk_norm else None, k_norm=nw(hd) + gemma if qk_norm else None,
                          gemma_norm=gemma, act=act)
    cap, B = 128, cpu.BLOCK
    kc, vc = r(kvh, cap, hd) / 0.3, r(kvh, cap, hd) / 0.3
    x = torch.randn(n, d, generator=g).to(dtype)
    pos = torch.arange(P, P + n)
    angle = pos[:, None].float() * (1e-2 ** (torch.arange(hd // 2) / (hd // 2)))[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    base = (P // B) * B                           # a causal run of n rows after P committed ones
    logical = base + torch.arange(2 * B)
    ok = logical[None, :] <= pos[:, None]
    idx = torch.where(ok, logical[None, :], 0)
    attn_in = torch.randn(n, din, generator=g).to(dtype) if din else None
    args = (cos, sin, kc, vc, pos.clone(), P // B, pos, idx, ok, None, hd ** -0.5)
    return spec, x, args, attn_in


def _run_layer(fn, spec, x, args, attn_in, rows=None):
    cos, sin, kc, vc, slots, b0, pos, idx, ok, window, scale = args
    kc, vc = kc.clone(), vc.clone()
    sel = slice(None) if rows is None else rows
    out = fn(x[sel], spec, cos[sel], sin[sel], kc, vc, slots[sel], b0, pos[sel], idx[sel], ok[sel], window, scale,
             attn_in=None if attn_in is None else attn_in[sel])
    return out, kc, vc


def _close(a, b):
    """Within rounding: the norms' sums of squares and the activations' exp / tanh run in other orders than
    torch's, and the attention's exp differs from torch's in the last fp32 bit, which can move a bf16-rounded
    weight by one step; so a value may land a bf16 step or more away. A real error moves many values by more:
    under 5% may differ by more than one bf16 step of their own size (the power test below checks it)."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)     # one bf16 step at b
    return float(diff.max() / b.abs().max()) < 2e-2 and float((diff > step * 1.01).float().mean()) < 0.05


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_fused_layer_equals_its_reference(name):
    spec, x, args, attn_in = _layer_case(**LAYERS[name])
    got, kc, vc = _run_layer(cpu.layer, spec, x, args, attn_in)
    ref, kr, vr = _run_layer(cpu.layer_reference, spec, x, args, attn_in)
    assert _close(got, ref) and _close(kc, kr) and _close(vc, vr)
    # the bound's power: the layer's own update is large against it (a skipped step would show)
    assert not _close(x, ref)


def test_the_fused_layers_reference_catches_a_wrong_step(monkeypatch):
    """Each wrong step, made in the reference, falls outside `_close`: the equality above can see it."""
    spec, x, args, attn_in = _layer_case(**LAYERS["gemma"])
    ref, _, _ = _run_layer(cpu.layer_reference, spec, x, args, attn_in)
    flip = lambda t: torch.cat((t.chunk(2, dim=-1)[1], -t.chunk(2, dim=-1)[0]), dim=-1)
    spec.act = "silu"                                                         # GELU taken as SiLU
    assert not _close(_run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref)
    spec.act = "gelu_tanh"
    monkeypatch.setattr(cpu, "_rotate_half", flip)                            # RoPE's sign
    assert not _close(_run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref)
    monkeypatch.undo()
    spec.norms["post_mlp_norm"] = torch.ones_like(spec.norms["post_mlp_norm"])   # a norm skipped
    assert not _close(_run_layer(cpu.layer_reference, spec, x, args, attn_in)[0], ref)


def test_the_fused_layer_gives_a_row_the_same_bits_alone_and_on_any_thread_count():
    """Rule 1 for the whole layer: row r run alone (the rows before it already in the cache) is row r of the
    6-row run, bitwise; and so is the run on 1 or 2 threads."""
    for name in ("llama", "gemma", "odd"):
        spec, x, args, attn_in = _layer_case(**LAYERS[name])
        full, kc, vc = _run_layer(cpu.layer, spec, x, args, attn_in)
        cos, sin, _, _, slots, b0, pos, idx, ok, window, scale = args
        for r in range(x.shape[0]):
            alone = cpu.layer(x[r:r + 1], spec, cos[r:r + 1], sin[r:r + 1], kc.clone(), vc.clone(), slots[r:r + 1],
                              b0, pos[r:r + 1], idx[r:r + 1], ok[r:r + 1], window, scale,
                              attn_in=None if attn_in is None else attn_in[r:r + 1])
            assert torch.equal(alone[0], full[r]), (name, r)
        kc1, vc1 = args[2].clone(), args[3].clone()
        one = cpu.layer(x, spec, cos, sin, kc1, vc1, slots, b0, pos, idx, ok, window, scale, attn_in=attn_in,
                        threads=1)
        assert torch.equal(one, full) and torch.equal(kc1, kc)


def test_the_fused_layer_refuses_what_it_cannot_run():
    spec, x, args, _ = _layer_case()
    with pytest.raises(cpu.CpuKernelError, match="bf16"):
        _run_layer(cpu.layer, spec, x.float(), args, None)
    with pytest.raises(cpu.CpuKernelError, match="attn_in"):
        _run_layer(cpu.layer, spec, x, args, torch.zeros(x.shape[0], 7).bfloat16())
    w = torch.zeros(8, 8).bfloat16()
    with pytest.raises(cpu.CpuKernelError, match="act="):
        cpu.pack_layer(w, None, w, w, w, heads=1, kv_heads=1, head_dim=16, eps=1e-6, in_norm=None,
                       pre_mlp_norm=torch.ones(8), act="relu")
    with pytest.raises(cpu.CpuKernelError, match="head_dim"):
        cpu.pack_layer(w, None, w, w, w, heads=1, kv_heads=1, head_dim=8, eps=1e-6, in_norm=None,
                       pre_mlp_norm=torch.ones(8))


# --- where the kernels cannot run --------------------------------------------------------------------------

def test_a_cpu_without_avx512_gets_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx512f", "avx2"})
    with pytest.raises(cpu.CpuKernelError, match="avx512bw, avx512vl"):
        cpu._build()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(cpu.REQUIRED_FLAGS))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("SPECVOCAB_CACHE", "/tmp/specvocab-test-no-cc")
    with pytest.raises(cpu.CpuKernelError, match="compiler /nonexistent/cc did not run"):
        cpu._build()


def test_route_linears_runs_a_modules_small_row_linears_on_the_kernel_and_follows_weight_updates():
    """`route_linears` (a drafter's own layers): small bf16 inputs go through the kernel, large ones and
    training through F.linear; a weight changed in place (an optimizer step) is packed again, not served stale."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40, bias=False))
    net = net.to(torch.bfloat16)
    assert cpu.route_linears(net, max_rows=8) == 2
    lin = net[0]
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu.pack(lin.weight, lin.bias)(x))                  # the kernel's bits
        big = torch.randn(20, 64).bfloat16()
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))
    with torch.no_grad():
        lin.weight.mul_(2.0)                                                            # in place: _version moves
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu.pack(lin.weight, lin.bias)(x))
    y = net(torch.randn(2, 64).bfloat16())                                              # grad on: F.linear, autograd
    y.float().sum().backward()
    assert lin.weight.grad is not None
    with torch.inference_mode():                     # a head made in inference mode (no version counter)
        frozen = torch.nn.Linear(64, 8).to(torch.bfloat16)
    assert cpu.route_linears(frozen) == 1
    with torch.inference_mode():
        assert torch.equal(frozen(x), cpu.pack(frozen.weight, frozen.bias)(x))
    assert torch.equal(frozen(x), cpu.pack(frozen.weight, frozen.bias)(x))
