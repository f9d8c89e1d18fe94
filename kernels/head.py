"""The draft LM head over a small active vocab: packed (dense) and indexed (gather-GEMM).

`packed_head(h, packed, tok_of_slot)`: logits [r, W] = h [r, d] @ packed [W, d].T with fp32 accumulation;
slots whose `tok_of_slot` is negative are set to -inf, so a softmax renormalises over the active vocab
(MicroSpec §3.3: a fixed W_max-row GEMM, unused slots masked). Rows are contiguous: this is what
MicroSpec runs after gathering the active rows into the packed buffer.
Bytes moved: W*d*itemsize (weights) + r*d*itemsize + r*W*4 (logits).

`indexed_head(h, weight, idx)`: logits [r, m] = h @ weight[idx].T, reading the rows of the full head
through the index on every call (no packed buffer): the "Indexed GEMM" ablation (MicroSpec §4.5). idx < 0 gives -inf, so `indexed_head(h, weight, tok_of_slot)` equals
`packed_head(h, packed, tok_of_slot)` for a consistent packed buffer. Bytes moved: m*d*itemsize + m*8 + r*m*4.

`dense_head(h, weight, bias)`: the full LM head (the target's, for verification), h @ weight.T in the
weight's dtype. On CPU with at most `SMALL_ROWS` rows it computes (weight @ h.T).T: one pass over the
[V, d] weight for all rows, which a CPU's fp32 BLAS runs 2.4-3.4x faster than `F.linear`'s small-M GEMM
at 2-8 rows on a large head (PERFORMANCE.md, "The target's LM head"); from about 10 rows on neither order wins,
so 8 rows (a draft tree of up to 7 nodes plus its root) is where it stops. Both orders sum the same d
products per logit; only the accumulation order differs.

One Triton kernel serves both (a constexpr picks the row address); `packed_head_ref` /
`indexed_head_ref` are the plain-torch references (and the CPU path).
"""

from __future__ import annotations

import torch

from specvocab.kernels import hardware  # noqa: F401  (sets TRITON_INTERPRET before the kernels below are defined)
from specvocab.kernels.hardware import check_triton_can_run, triton_enabled, triton_interpreted
from specvocab.kernels import cpu
from specvocab.kernels.tensor_ops import row_chunks

import triton
import triton.language as tl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class HeadError(ValueError):
    """Bad arguments to a head op; the message names the tensor and the expected shape/dtype."""


@triton.jit
def _head_kernel(h_ptr, w_ptr, idx_ptr, out_ptr, r, n_cols, d, stride_h, stride_w, stride_o,
                 INDEXED: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid = (cdiv(n_cols, BLOCK_C), cdiv(r, BLOCK_R)); out[r, n_cols] fp32
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)          # [BLOCK_C] slot / index position
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)          # [BLOCK_R] rows of h
    col_ok = cols < n_cols
    if HAS_MASK:
        tok = tl.load(idx_ptr + cols, mask=col_ok, other=-1).to(tl.int64)
        live = col_ok & (tok >= 0)
    else:
        tok = cols.to(tl.int64)
        live = col_ok
    if INDEXED:
        w_rows = tl.where(live, tok, 0)                                # rows of the full head
    else:
        w_rows = cols.to(tl.int64)                                     # rows of the packed buffer
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        k_ok = ks < d
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :],
                    mask=(rows < r)[:, None] & k_ok[None, :], other=0.0)          # [BLOCK_R, BLOCK_D]
        b = tl.load(w_ptr + w_rows[None, :] * stride_w + ks[:, None],
                    mask=live[None, :] & k_ok[:, None], other=0.0)                # [BLOCK_D, BLOCK_C]
        if UPCAST:   # the interpreter's bf16 tl.dot is wrong (measured with Triton 3.7's interpreter): multiply in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:     # fp32 inputs: exact fp32 products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    acc = tl.where(live[None, :], acc, float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc,
             mask=(rows < r)[:, None] & col_ok[None, :])


def _flatten_h(h: torch.Tensor, d: int) -> torch.Tensor:
    if h.dim() == 0 or h.shape[-1] != d:
        raise HeadError(f"h must be [..., d] with d={d} (the head's width), got {tuple(h.shape)}")
    return h.reshape(-1, d)


def _check(h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None, name: str) -> None:
    if w.dim() != 2 or w.shape[1] == 0:
        raise HeadError(f"{name} must be [rows, d] with d > 0, got {tuple(w.shape)}")
    if h.dtype not in _FLOATS or w.dtype not in _FLOATS:
        raise HeadError(f"h and {name} must be fp32/fp16/bf16, got {h.dtype} and {w.dtype}")
    if h.dtype != w.dtype:
        raise HeadError(f"h ({h.dtype}) and {name} ({w.dtype}) must share a dtype — cast h with .to({w.dtype})")
    if idx is not None and (idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool):
        raise HeadError(f"index/tok_of_slot must be a 1-d integer tensor, got {tuple(idx.shape)} {idx.dtype}")
    devices = {t.device for t in (h, w) + ((idx,) if idx is not None else ())}
    if len(devices) != 1:
        raise HeadError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _launch(h2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None, n_cols: int, indexed: bool):
    check_triton_can_run(h2, w)
    r, d = h2.shape
    h2 = h2.contiguous()
    if w.stride(1) != 1:
        raise HeadError("the weight/packed buffer needs contiguous rows (stride 1 along d) — call .contiguous()")
    out = torch.empty(r, n_cols, dtype=torch.float32, device=h2.device)
    if r == 0 or n_cols == 0:
        return out
    idx_arg = idx.contiguous() if idx is not None else out
    # Untuned defaults: tl.dot needs every block dim >= 16. Small BLOCK_C keeps enough programs in
    # flight for a GEMV (r = 1) over a few thousand rows, which is memory-bound.
    block_r = 16 if r <= 16 else 32
    block_c = 32 if n_cols <= 8192 else 64
    block_d = max(16, min(128, triton.next_power_of_2(d)))
    grid = (triton.cdiv(n_cols, block_c), triton.cdiv(r, block_r))
    _head_kernel[grid](h2, w, idx_arg, out, r, n_cols, d, h2.stride(0), w.stride(0), out.stride(0),
                       INDEXED=indexed, HAS_MASK=idx is not None,
                       UPCAST=triton_interpreted() and w.dtype == torch.bfloat16,
                       IEEE=w.dtype == torch.float32, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_D=block_d,
                       num_warps=4)
    return out


# --- packed head ----------------------------------------------------------------------------------------

def _as_slot_tokens(tok_of_slot: torch.Tensor | None) -> torch.Tensor | None:
    """A bool valid-mask [W] (True = live) becomes 0 / -1 in int32, the slot tokens' own dtype
    (`kernels.window`), so one code path - and on a GPU one compiled kernel - masks both forms (an int8 mask
    compiled a second kernel whose logits differed from the int32 one's in the last bits on an H100)."""
    if tok_of_slot is not None and tok_of_slot.dtype == torch.bool:
        return tok_of_slot.to(torch.int32) - 1
    return tok_of_slot


def packed_head_triton(h: torch.Tensor, packed: torch.Tensor,
                       tok_of_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher. h [..., d], packed [W, d], tok_of_slot [W] (negative = empty slot, -inf; or a bool
    valid-mask) or None -> logits [..., W] fp32."""
    tok_of_slot = _as_slot_tokens(tok_of_slot)
    _check(h, packed, tok_of_slot, "packed")
    W, d = packed.shape
    if tok_of_slot is not None and tok_of_slot.numel() != W:
        raise HeadError(f"tok_of_slot must be [W]={W}, got {tuple(tok_of_slot.shape)}")
    out = _launch(_flatten_h(h, d), packed, tok_of_slot, W, indexed=False)
    return out.reshape(*h.shape[:-1], W)


def packed_head_ref(h: torch.Tensor, packed: torch.Tensor,
                    tok_of_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: (h @ packed.T) in fp32, empty slots -inf."""
    tok_of_slot = _as_slot_tokens(tok_of_slot)
    _check(h, packed, tok_of_slot, "packed")
    W, d = packed.shape
    if tok_of_slot is not None and tok_of_slot.numel() != W:
        raise HeadError(f"tok_of_slot must be [W]={W}, got {tuple(tok_of_slot.shape)}")
    logits = _flatten_h(h, d).float() @ packed.float().T                  # [r, W]
    if tok_of_slot is not None:
        logits = logits.masked_fill(tok_of_slot < 0, float("-inf"))
    return logits.reshape(*h.shape[:-1], W)


def packed_head_torch(h: torch.Tensor, packed: torch.Tensor, tok_of_slot: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The torch path where Triton does not run (the CPU): `packed_head_ref` in fp32; in bf16 / fp16 one GEMM
    in the buffer's dtype with the [r, W] output rounded once and cast (as `indexed_head_torch`), instead of an
    fp32 copy of the whole buffer per call; in bf16 on a CPU with kernels.cpu, its row-major small-row product
    (fp32 out, unrounded: SmolLM2's 3072-row window at 1-3 rows ~0.07-0.11 ms against F.linear's 0.16-0.18)."""
    if packed.dtype == torch.float32:
        return packed_head_ref(h, packed, tok_of_slot)
    tok_of_slot = _as_slot_tokens(tok_of_slot)
    _check(h, packed, tok_of_slot, "packed")
    W, d = packed.shape
    if tok_of_slot is not None and tok_of_slot.numel() != W:
        raise HeadError(f"tok_of_slot must be [W]={W}, got {tuple(tok_of_slot.shape)}")
    h2 = _flatten_h(h, d).to(packed.dtype)
    if cpu.rows_usable(h2, packed):       # bf16 on a CPU with the kernels: the buffer read where it lies, fp32 out
        logits = cpu.rows_linear(h2, packed, torch.float32)
    else:
        logits = torch.nn.functional.linear(h2, packed).float()                                 # [r, W]
    if tok_of_slot is not None:
        logits = logits.masked_fill(tok_of_slot < 0, float("-inf"))
    return logits.reshape(*h.shape[:-1], W)


def packed_head(h: torch.Tensor, packed: torch.Tensor, tok_of_slot: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., W] fp32 = h [..., d] @ packed [W, d].T, slots with tok_of_slot < 0 (or a False
    valid-mask entry) set to -inf."""
    if triton_enabled():
        return packed_head_triton(h, packed, tok_of_slot)
    return packed_head_torch(h, packed, tok_of_slot)


# --- the full head (verification) ------------------------------------------------------------------------

SMALL_ROWS = 8      # CPU fp32: rows up to this go through weight @ h.T (see the module docstring); in bf16 that
                    # order is the slow one (Gemma's head, 1 thread: 4-8 rows ~25 ms slower than F.linear)


def dense_head(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] (weight's dtype) = h [..., d] @ weight [V, d].T (+ bias), as `F.linear`."""
    d = weight.shape[1]
    rows = h.numel() // d if d else 0
    if h.device.type == "cpu" and weight.dtype == torch.float32 and 0 < rows <= SMALL_ROWS:
        out = torch.mm(weight, h.reshape(rows, d).T).T                          # [rows, V]
        if bias is not None:
            out = out + bias
        return out.reshape(*h.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(h, weight, bias)


# --- indexed head ---------------------------------------------------------------------------------------

def indexed_head_triton(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Launcher. h [..., d], weight [V, d], idx [m] (negative = -inf column) -> logits [..., m] fp32."""
    _check(h, weight, idx, "weight")
    d = weight.shape[1]
    out = _launch(_flatten_h(h, d), weight, idx, idx.numel(), indexed=True)
    return out.reshape(*h.shape[:-1], idx.numel())


def indexed_head_ref(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference: h @ weight[idx].T in fp32, negative idx -inf. Rows are gathered on every call, a few
    MB at a time (see `row_chunks`)."""
    _check(h, weight, idx, "weight")
    d = weight.shape[1]
    h2 = _flatten_h(h, d).float()                                         # [r, d]
    safe = idx.long().clamp(min=0)                                        # [m]
    logits = torch.empty(h2.shape[0], idx.numel(), dtype=torch.float32, device=h.device)   # [r, m]
    for a, b in row_chunks(idx.numel(), d * weight.element_size()):
        logits[:, a:b] = h2 @ weight.index_select(0, safe[a:b]).float().T
    logits = logits.masked_fill(idx < 0, float("-inf"))
    return logits.reshape(*h.shape[:-1], idx.numel())


def indexed_head_torch(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The torch path that runs where Triton does not (the CPU): `indexed_head_ref` in fp32; in bf16 / fp16
    one GEMM in the weights' dtype per chunk of gathered rows (the library accumulates in fp32, as the Triton
    kernel does) with only the [r, m] output rounded to that dtype and cast, instead of an fp32 copy of every
    gathered row per call. DynaSpec's ~10k-36k-row union head in bf16 cost 38 ms (SmolLM2) / 85 ms (Gemma)
    per drafted step the reference's way (the full head: 14 / 54 ms). Matches the reference to the dtype's
    output rounding (tests/test_kernels_head.py)."""
    if weight.dtype == torch.float32:
        return indexed_head_ref(h, weight, idx)
    _check(h, weight, idx, "weight")
    d = weight.shape[1]
    h2 = _flatten_h(h, d).to(weight.dtype)                                # [r, d]
    safe = idx.long().clamp(min=0)                                        # [m]
    logits = torch.empty(h2.shape[0], idx.numel(), dtype=torch.float32, device=h.device)   # [r, m]
    for a, b in row_chunks(idx.numel(), d * weight.element_size()):
        logits[:, a:b] = torch.nn.functional.linear(h2, weight.index_select(0, safe[a:b]))
    logits = logits.masked_fill(idx < 0, float("-inf"))
    return logits.reshape(*h.shape[:-1], idx.numel())


def indexed_head(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """logits [..., m] fp32 = h [..., d] @ weight[idx].T (rows read through the index each call)."""
    if triton_enabled():
        return indexed_head_triton(h, weight, idx)
    return indexed_head_torch(h, weight, idx)
