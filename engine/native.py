"""The target's forward without transformers: packed weights, a static KV cache, fixed-shape verification.

(Over 600 lines on purpose: the decoder, its fixed-shape attention, the cache and the CUDA graphs that replay
the forward all read one packed layout and one cache layout; apart, each would restate them.)

`NativeModel(hf_model)` reads the weights `engine.models.load_model` loaded (no copy: the HF model's q/k/v and
gate/up parameters are re-pointed at views of the fused matrices this module packs, so both stay usable and
share memory) and runs the decoder itself for the families below. `engine.target` wraps it as the `native`
backend; transformers stays the reference (`backend="hf"`) and the path for every other architecture.

Families (`FAMILIES`): llama (SmolLM2, Llama-3), qwen2 (q/k/v bias), qwen3 (q/k RMSNorm on the head dim),
gemma3_text (sliding-window layers with their own RoPE base, (1 + w) RMSNorms around attention and MLP,
q/k norms, the sqrt(d) embedding scale, query_pre_attn_scalar, gelu-tanh, final logit soft-capping).
RoPE tables come from the model's own rotary module (so every rope_scaling variant transformers knows is
honoured), evaluated once per cache capacity.

KV cache (`StaticKV`): k, v [layers, kv_heads, capacity, head_dim], zero-filled once per prompt; a forward of
n rows writes slots [P, P + n); `compact` keeps the accepted path in place (one gather per tensor for all
layers). Sliding-window layers keep every slot too (the window is a mask): compaction stays one rule.

Fixed-shape verification (`exact=True`). A token's logits must not depend on how the step that computed
them was shaped, or greedy speculative output drifts from `ar` on near-ties (bf16 in particular). Three
rules make a row's result a function of its own logical context only:
1. Rows: every decode forward runs at a bucket of `bucket_rows(n, floor)` >= MIN_ROWS rows (padding rows
   are harmless: they see only themselves). On the AMD EPYC CI runs on, bf16 GEMMs give a row the same bits
   for every M and fp32 GEMMs do for M >= 4 (M = 1, 2 take a GEMV path); on an Intel Xeon (AMX) the fp32 GEMM
   (MKL) changes a row's bits at larger M too (tests/test_native.py's fp32 row test, kernels off, on an
   H200 machine's Xeon). So the floor is measured, not assumed: `row_floor`, once per process for the model's
   shapes, dtype and threads, the smallest bucket from which F.linear gives every row the bits it has at
   ROW_PROBE rows. (The exact attention's GEMMs below have K = head_dim or BLOCK, one K block each; they
   are not probed.) The LM head
   is `F.linear` in this mode (`weight @ h.T`, the fast small-row order of `kernels.head.dense_head`, changes
   its bits between 8 and 16 rows in fp32).
2. Keys in logical order. Attention is computed over blocks of BLOCK logical positions (position = index in
   the token sequence, not cache slot). Blocks wholly inside the committed prefix are read where they lie,
   for all rows at once; the blocks after them - those a draft tree can reach, the tail - are gathered per row in
   logical order (committed slots, then the row's ancestors by depth), so an ancestor's key sits at the same
   place whether an `ar` step or a tree put it in the cache. The tail is two blocks, or as many as a deep
   tree reaches (`tail_blocks`: a chain of 40 drafts takes two or three, by where the context ends): a row's
   later blocks are all masked, so the tail's width changes no bit of any row (rule 3). Each block gives (max, sum, unnormalised
   output) with the same fixed-shape ops either way (GEMMs with M >= 4: the query heads of a KV group are
   padded to 4 rows where a model has fewer).
3. One fold over blocks. Blocks are merged by a running sum in block order (`cumsum`, a sequential fold on
   CPU): blocks a row cannot see add exact zeros, so an `ar` step (fewer blocks) and a tree (more) fold the
   same non-zero terms in the same order.
`exact=False` runs plain `scaled_dot_product_attention` over the cache with a tree mask: fewer ops, but the
bits then depend on where ancestors sit (what transformers does, and why bf16 trees diverged from `ar`).

On a CPU in bf16 (`use_cpu_kernels`, on by default through `SpecConfig.cpu_kernels`), the linears and the
exact attention run the C kernels of `kernels.cpu` where they build (x86 with AVX512-BF16): a row's result
there is a function of that row by construction (each output summed in its own register in a fixed order;
attention one row at a time over its logical context), so rules 1-3 hold without relying on oneDNN's
behaviour, and the forward reads its weights at about twice oneDNN's rate at 1-8 rows. Their bits differ from
the torch path's; a decode's forwards all take one path (exact mode always takes the kernels when they are on).
With them a step needs no padding rows either (`engine.target.pads_rows`): it runs exactly its tree, n rows.
In exact mode each layer is then one call, `kernels.cpu.layer` (norms, RoPE, the cache write, the attention,
residuals and the gated MLP around the four linears, rounded to bf16 where `_layer` rounds), which spares the
~25 small torch ops a layer has around them (PERFORMANCE.md, section 1).

On an accelerator (tests/test_gpu.py, run on an H100 and an H200): rule 1 becomes one row count for every decode
(`engine.target.DEVICE_ROWS`: cuBLAS picks its kernel, and so a row's fp32 rounding, by the number of rows);
rule 3's fold is `_group_fold` (CUDA's cumsum is a parallel scan); and the forward is replayed as CUDA graphs
(`GraphedDecode`: a decode forward there is hundreds of kernels whose launches cost more than their work).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specvocab.kernels import cpu
from specvocab.kernels.cpu import PackedLinear
from specvocab.kernels.head import dense_head

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")
GRAPH_CACHE_SLOTS = 4096  # the graphed decode's static cache (`GraphedDecode.static_cache`; grown when short)
MIN_ROWS = 4          # the least bucket floor: fp32 GEMMs take a GEMV path at M = 1, 2 (rule 1; `row_floor`)
BLOCK = 32            # logical positions per attention block (rule 2); a deeper tree takes more tail blocks
TAIL_BLOCKS = 2       # the least tail (rule 2): a node up to BLOCK below the root fits two, wherever the context ends
FUSED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
                      # config activation -> what kernels.cpu.layer computes (others: the per-op path)
KERNEL_MAX_ROWS = cpu.SMALL_ROWS   # outside exact mode (a prefill, native-sdpa) the CPU kernel takes forwards
                                   # up to this many rows; above, oneDNN's blocked GEMM is as fast

CAUSAL_KERNEL = "causal-kernel"   # a forward's mask for a prompt over an empty cache that the CPU attention takes


def _causal_run(P: int, positions: torch.Tensor, visible: torch.Tensor, key_positions) -> bool:
    """Whether a forward is a plain causal run over an empty cache (a prompt): row i at position i sees rows
    0..i and nothing else."""
    n = positions.numel()
    return (P == 0 and visible.shape == (n, n) and key_positions is None
            and torch.equal(positions, torch.arange(n, device=positions.device))
            and torch.equal(visible, torch.ones(n, n, dtype=torch.bool, device=positions.device).tril_()))


class NativeError(ValueError):
    """The native forward cannot run this model or input; the message names the supported families / fix."""


def text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def unsupported_reason(model) -> str | None:
    """None when `NativeModel(model)` can run it, else why not (one line)."""
    cfg = text_config(model)
    fam = getattr(cfg, "model_type", None)
    if fam not in FAMILIES:
        return f"architecture {fam!r} is not one the native forward knows (supported: {', '.join(FAMILIES)})"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping (Gemma 2) is not implemented natively"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(types)} include ones the native forward does not know"
    return None


def bucket_rows(n: int, floor: int = MIN_ROWS) -> int:
    """Rows a forward of n tree nodes runs at: the next power of two, at least MIN_ROWS and `floor` (the
    model's `NativeModel.row_floor` on this machine)."""
    return max(MIN_ROWS, floor, 1 << max(0, n - 1).bit_length())


ROW_PROBE = 128       # the largest bucket `row_invariance` checks (a CPU tree of more rows is not probed)
_ROW_FLOORS: dict[tuple, int] = {}


def row_invariance(mats: dict[str, torch.Tensor], counts=(1, 2, 4, 8, 16, 32, 64, ROW_PROBE)) -> dict[str, list]:
    """For each weight (name -> [N, K]): the row counts M at which `F.linear(x[:M], W)` does not give rows
    0..M-1 the bits they have at the largest M (x fixed, random). Empty lists: a row's GEMM bits do not depend
    on the rows beside it (then per-step row buckets are safe, rule 1)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for name, w in mats.items():
            x = torch.randn(max(counts), w.shape[1], generator=g).to(dtype=w.dtype, device=w.device)
            ref = F.linear(x, w)
            out[name] = [m for m in counts if not torch.equal(F.linear(x[:m], w), ref[:m])]
    return out


def row_floor(mats: dict[str, torch.Tensor]) -> int:
    """Rule 1's floor for these weights here: the smallest power of two m >= MIN_ROWS such that every bucket
    from m to ROW_PROBE gives each row the bits it has at ROW_PROBE rows (`row_invariance`); ROW_PROBE where
    none smaller does. Measured once per process for the weights' shapes and dtype, the device, the thread
    count and the F.linear in use."""
    w0 = next(iter(mats.values()))
    key = (F.linear, tuple(sorted((tuple(w.shape)) for w in mats.values())), w0.dtype, str(w0.device),
           torch.get_num_threads())
    if key not in _ROW_FLOORS:
        bad = [m for ms in row_invariance(mats).values() for m in ms]
        floor = MIN_ROWS
        while floor < ROW_PROBE and any(m >= floor for m in bad):
            floor *= 2
        _ROW_FLOORS[key] = floor
    return _ROW_FLOORS[key]


@dataclass
class _Layer:
    kind: str                     # "full_attention" | "sliding_attention"
    qkv_w: torch.Tensor           # [(H + 2 kvh) hd, d]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor             # [d, H hd]
    gate_up_w: torch.Tensor       # [2 I, d]
    down_w: torch.Tensor          # [d, I]
    in_norm: torch.Tensor
    post_attn_norm: torch.Tensor | None     # gemma3: after attention; llama/qwen: None
    pre_mlp_norm: torch.Tensor              # llama/qwen: post_attention_layernorm; gemma3: pre_feedforward
    post_mlp_norm: torch.Tensor | None      # gemma3 only
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    # the same four weights packed for the CPU small-row kernel (`NativeModel.use_cpu_kernels`); None = off
    kernel: dict[str, PackedLinear] | None = None
    fused: cpu.LayerKernel | None = None    # the same packs, with the norms: the whole layer in one call


class StaticKV:
    """k, v [layers, kv_heads, capacity, head_dim]; `committed` slots hold the committed tokens."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        self.k = torch.zeros(layers, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.committed = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def grow(self, capacity: int) -> None:
        """Reallocate to `capacity` slots, keeping the committed ones (a tree beyond the planned size)."""
        if capacity <= self.capacity:
            return
        k = torch.zeros(*self.k.shape[:2], capacity, self.k.shape[3], dtype=self.k.dtype, device=self.k.device)
        v = torch.zeros_like(k)
        k[:, :, :self.committed] = self.k[:, :, :self.committed]
        v[:, :, :self.committed] = self.v[:, :, :self.committed]
        self.k, self.v = k, v

    def compact(self, num_new: int, keep: list[int] | None) -> int:
        """Keep new rows `keep` (ascending, the accepted path; None = all) after the committed prefix."""
        P = self.committed
        n = num_new if keep is None else len(keep)
        if keep is not None and keep != list(range(n)):
            idx = torch.as_tensor(keep, dtype=torch.long, device=self.k.device) + P
            for t in (self.k, self.v):
                t[:, :, P:P + n] = t[:, :, idx]          # advanced indexing copies first: no aliasing
        self.committed = P + n
        return self.committed


class NativeModel:
    """The decoder of an HF causal LM of a supported family, run with plain torch ops (module docstring)."""

    def __deepcopy__(self, memo):
        # Kept on the model it packs (`engine.target.native_model`); its C kernels hold raw pointers into that
        # model's packed weights, so a copied model packs its own on first use instead of sharing these.
        return None

    def __init__(self, model):
        why = unsupported_reason(model)
        if why:
            raise NativeError(f"backend='native': {why} — use backend='hf' (transformers) for this model")
        cfg = text_config(model)
        self.config = cfg
        self.family = cfg.model_type
        self.gemma = self.family == "gemma3_text"
        dec = model.model if hasattr(model, "model") else model.get_decoder()
        self.embed = model.get_input_embeddings()            # Gemma's scaled embedding included
        head = model.get_output_embeddings()
        self.head_w, self.head_b = head.weight, getattr(head, "bias", None)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.eps = float(cfg.rms_norm_eps)
        self.d = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.d // self.heads)
        self.scale = (float(cfg.query_pre_attn_scalar) ** -0.5 if self.gemma else self.head_dim ** -0.5)
        self.window = getattr(cfg, "sliding_window", None)
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        self.rotary = dec.rotary_emb
        self.final_norm = self._norm_weight(dec.norm)
        self.act = dec.layers[0].mlp.act_fn
        self.dtype = self.head_w.dtype
        self.device = self.head_w.device
        self.layers = [self._pack(layer, t) for layer, t in zip(dec.layers, types)]
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_len = 0
        self._compiled = None
        self.head_kernel: PackedLinear | None = None      # `use_cpu_kernels`
        self.kernel_on = False
        self.fused_calls = 0                                # layers run by kernels.cpu.layer (tests, benchmark)
        # feature_tap(layer index, x [n, d]): called with the residual stream entering each layer a forward runs
        # (EAGLE-3's target features: engine.drafters.eagle3 sets it); None = nothing called
        self.feature_tap = None

    def graphs(self) -> "GraphedDecode":
        """The model's `GraphedDecode` (CUDA graphs of the fixed-shape decode forward), made once."""
        if getattr(self, "_graphs", None) is None:
            self._graphs = GraphedDecode(self)
        return self._graphs

    def compiled_layer(self):
        """`_layer` under torch.compile (inductor), made once per model: the decode forward's layer with its
        elementwise ops (norms, RoPE, the block softmax and fold) fused around the GEMMs, which stay
        library calls. Shapes that change every step (committed length, blocks) compile as dynamic after
        their first change; each row bucket compiles once per process."""
        if self._compiled is None:
            self._compiled = torch.compile(self._layer, dynamic=True, fullgraph=True)
        return self._compiled

    # -- weights -------------------------------------------------------------------------------------
    def cpu_kernels_reason(self) -> str | None:
        """None when the CPU kernels (kernels.cpu) can run this model's linears (bf16, or fp32 on AVX-512F), else
        why not."""
        return cpu.linear_reason(self.device, self.dtype)

    def linear_weights(self) -> dict[str, torch.Tensor]:
        """One weight of each distinct shape a decode forward multiplies by ("NxK"), the LM head included."""
        mats = {f"{m.shape[0]}x{m.shape[1]}": m for L in self.layers for m in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w)}
        mats[f"{self.head_w.shape[0]}x{self.head_w.shape[1]}"] = self.head_w
        return mats

    def row_floor(self) -> int:
        """Rule 1's bucket floor for this model on this machine (`row_floor`: measured once per process)."""
        return row_floor(self.linear_weights())

    @torch.no_grad()
    def use_cpu_kernels(self, on: bool = True) -> bool:
        """Run this model's linears (every layer's four and the LM head) through the CPU small-row kernel
        (`on`, where `cpu_kernels_reason()` is None) or `F.linear` (oneDNN). Returns whether the kernel runs.
        The first switch on packs the weights for it: a copy, so the model then holds its weight bytes twice.
        bf16: the fused layer and the attention kernel too; rule 1 holds either way (both give a row the same
        bits for every M, the kernel by construction). fp32: the linears and the attention (kernels/cpu_avx2.c),
        and on the AVX2 build the whole layer in one call; with them a row's bits no longer need M >= 4, so a
        step runs unpadded."""
        cpu.decode_reason(self.device, self.dtype, on)     # one line, once, where the decode runs torch here
        if on and self.cpu_kernels_reason() is None and self.head_kernel is None:
            act = FUSED_ACTIVATIONS.get(getattr(self.config, "hidden_activation", None)
                                        or getattr(self.config, "hidden_act", None))
            for L in self.layers:
                if act is not None and self._fusable():
                    L.fused = cpu.pack_layer(L.qkv_w, L.qkv_b, L.o_w, L.gate_up_w, L.down_w, heads=self.heads,
                                             kv_heads=self.kv_heads, head_dim=self.head_dim, eps=self.eps,
                                             in_norm=L.in_norm, pre_mlp_norm=L.pre_mlp_norm,
                                             post_attn_norm=L.post_attn_norm, post_mlp_norm=L.post_mlp_norm,
                                             q_norm=L.q_norm, k_norm=L.k_norm, gemma_norm=self.gemma, act=act)
                    L.kernel = {k: getattr(L.fused, k) for k in ("qkv", "o", "gate_up", "down")}
                else:
                    L.kernel = {"qkv": cpu.pack(L.qkv_w, L.qkv_b), "o": cpu.pack(L.o_w),
                                "gate_up": cpu.pack(L.gate_up_w), "down": cpu.pack(L.down_w)}
            self.head_kernel = cpu.pack(self.head_w, self.head_b)
        self.kernel_on = bool(on and self.head_kernel is not None)
        return self.kernel_on

    def _fusable(self) -> bool:
        # the whole layer in one C call: bf16 (kernels/cpu.c), or fp32 where the AVX2 build runs the linears
        # (kernels/cpu_avx2.c; its layer calls that build's linear, so the weights must be packed for it)
        if self.dtype == torch.bfloat16:
            return cpu.takes_head_dim(self.head_dim)
        return (self.dtype == torch.float32 and cpu.isa() == "avx2"
                and cpu.attention_f32_reason(self.head_dim) is None)

    def _bf16_kernels(self) -> bool:
        # the attention kernel and the fused layer: bf16 only (fp32 runs the packed linears alone)
        return self.kernel_on and self.dtype == torch.bfloat16

    def _attention_kernel(self, hd: int) -> bool:
        return self._bf16_kernels() and cpu.takes_head_dim(hd)

    def _attention_kernel_f32(self, hd: int) -> bool:
        # the exact decode's attention of an fp32 model in C (kernels.cpu.attention_f32: AVX2 + FMA, AVX-512 CPUs
        # too), where its packed linears run
        return self.kernel_on and self.dtype == torch.float32 and cpu.attention_f32_reason(hd) is None

    def _kernel(self, rows: int, exact: bool) -> bool:
        # exact mode: always (a decode's forwards must share one implementation whatever their rows); else up to
        # KERNEL_MAX_ROWS; never inside torch.compile (a foreign call would break its graph)
        return self.kernel_on and (exact or rows <= KERNEL_MAX_ROWS) and not torch.compiler.is_compiling()

    def _norm_weight(self, norm) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by (1 + w) in fp32; Llama's by w in the model dtype (after the cast)
        return (1.0 + norm.weight.detach().float()) if self.gemma else norm.weight.detach()

    @torch.no_grad()
    def _pack(self, layer, kind: str) -> _Layer:
        at, mlp = layer.self_attn, layer.mlp
        qkv = _fuse([at.q_proj, at.k_proj, at.v_proj])
        bias = None
        if at.q_proj.bias is not None:
            bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        qn = getattr(at, "q_norm", None)
        kn = getattr(at, "k_norm", None)
        g = self.gemma
        return _Layer(kind=kind, qkv_w=qkv, qkv_b=bias, o_w=at.o_proj.weight.detach(), gate_up_w=gate_up,
                      down_w=mlp.down_proj.weight.detach(), in_norm=self._norm_weight(layer.input_layernorm),
                      post_attn_norm=self._norm_weight(layer.post_attention_layernorm) if g else None,
                      pre_mlp_norm=self._norm_weight(layer.pre_feedforward_layernorm if g
                                                     else layer.post_attention_layernorm),
                      post_mlp_norm=self._norm_weight(layer.post_feedforward_layernorm) if g else None,
                      q_norm=None if qn is None else self._norm_weight(qn),
                      k_norm=None if kn is None else self._norm_weight(kn))

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * w).to(x.dtype)
        return w * h.to(x.dtype)

    def rope_tables(self, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer type: (cos, sin) [length, head_dim]} from the model's own rotary module (grown on demand)."""
        if length > self._rope_len:
            length = max(length, 2 * self._rope_len)
            pos = torch.arange(length, device=self.device)[None]
            x = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
            takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
            self._rope = {}
            for t in dict.fromkeys(layer.kind for layer in self.layers):
                cos, sin = self.rotary(x, pos, t) if takes_type else self.rotary(x, pos)
                self._rope[t] = (cos[0].to(self.dtype), sin[0].to(self.dtype))
            self._rope_len = length
        return self._rope

    def new_cache(self, capacity: int, layers: int | None = None) -> StaticKV:
        self.rope_tables(capacity)
        return StaticKV(layers or len(self.layers), self.kv_heads, capacity, self.head_dim, self.dtype,
                        self.device)

    # -- forward -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticKV, visible: torch.Tensor, *,
                exact: bool = False, tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                layer_ids: list[int] | None = None, collect: tuple[int, ...] = (),
                compiled: bool = False, key_positions: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Run n new tokens over `cache` (committed slots [0, P)); they are written to slots [P, P + n).

        ids [n], positions [n] (logical), visible [n, n] bool: which new rows each row attends to (causal for
        a prefill, ancestor-or-self for a tree; every committed slot is visible), or [n, P + n]: which cached
        and new rows (a drafter whose cache holds tree rows between levels); key_positions [P]: the logical
        position of each cached slot where it is not the slot's index (sliding-window masks; default
        arange(P)). exact: fixed-shape attention (module docstring); then
        `tail` = (idx [n, T BLOCK] cache slot of each logical position of the row's tail blocks, ok [n, T BLOCK]
        which are real) from `tail_index`, T = `tail_blocks`. layer_ids: run only these layers (the layer-skip
        drafter's partial stack; its cache has one entry per listed layer). collect: also return the
        hidden states after these layers (EAGLE-3's low/mid/high features). compiled: run the layers through
        `compiled_layer` (exact mode only: the fixed shapes of a decode; a prefill's length varies per prompt).
        slots [n]: the cache slots the rows are written to, as a tensor (P + arange(n)); then nothing in the
        forward but the committed block count P // BLOCK depends on P as a number (what `GraphedDecode`
        captures). Returns the final-normed hidden states [n, d] (and the collected ones, [len(collect), n, d]).
        """
        P, n = cache.committed, ids.numel()
        if P + n > cache.capacity:
            raise NativeError(f"the KV cache holds {cache.capacity} slots, {P} committed; {n} more do not fit "
                              f"(grow it with cache.grow)")
        rope = self.rope_tables(P + n)
        x = self.embed(ids[None])[0]                                   # [n, d]
        ids_run = range(len(self.layers)) if layer_ids is None else layer_ids
        feats = []
        masks = {}
        prompt_kernel = (not exact and self._attention_kernel(self.head_dim) and not torch.compiler.is_compiling()
                         and _causal_run(P, positions, visible, key_positions))   # every layer: `_causal_attention`
        layer = self.compiled_layer() if compiled and exact else self._layer
        tap = self.feature_tap
        fused_slots = None
        rope_rows = {}
        for slot, li in enumerate(ids_run):
            if tap is not None:
                tap(li, x)
            L = self.layers[li]
            if L.kind not in rope_rows:                                 # once per forward and layer type
                rope_rows[L.kind] = tuple(t[positions] for t in rope[L.kind])
            cos, sin = rope_rows[L.kind]                                # [n, hd]
            if L.kind not in masks:                                     # once per forward and layer type
                masks[L.kind] = (self._exact_masks(P, positions, tail, L.kind) if exact else
                                 CAUSAL_KERNEL if prompt_kernel else
                                 self._sdpa_mask(positions, cache, visible, L.kind, key_positions))
            m = masks.get(L.kind)
            if exact and L.fused is not None and m[2] is not None and self._kernel(n, exact):
                if fused_slots is None:
                    fused_slots = slots if slots is not None else torch.arange(P, P + n, device=ids.device)
                pos, ok, window = m[2]                                 # the whole layer in one call (kernels.cpu)
                x = cpu.layer(x, L.fused, cos, sin, cache.k[slot], cache.v[slot], fused_slots, P // BLOCK, pos,
                              tail[0], ok, window, self.scale)
                self.fused_calls += 1
            else:
                x = layer(L, x, cos, sin, cache.k[slot], cache.v[slot], P, m, exact,
                          None if tail is None else tail[0], slots)
            if li in collect:
                feats.append(x)
        out = self._rmsnorm(x, self.final_norm)
        return (out, torch.stack(feats)) if collect else out

    def _layer(self, L: _Layer, x, cos, sin, kc, vc, P, mask, exact, tail_idx, slots=None):
        """One decoder layer over n new rows; kc, vc [kvh, C, hd]: this layer's cache (rows written at P, or
        at `slots`); mask: the SDPA mask, or in exact mode `_exact_masks` with tail_idx the tail's cache slots."""
        n, H, kvh, hd = x.shape[0], self.heads, self.kv_heads, self.head_dim
        kern = L.kernel if self._kernel(n, exact) else None
        h = self._rmsnorm(x, L.in_norm)
        qkv = kern["qkv"](h) if kern else F.linear(h, L.qkv_w, L.qkv_b)
        qk, v = qkv.split([(H + kvh) * hd, kvh * hd], dim=-1)
        qk, v = qk.view(n, H + kvh, hd), v.view(n, kvh, hd)
        if L.q_norm is not None:
            qk = torch.cat([self._rmsnorm(qk[:, :H], L.q_norm), self._rmsnorm(qk[:, H:], L.k_norm)], dim=1)
        c, s = cos[:, None], sin[:, None]
        qk = qk * c + _rotate_half(qk) * s                             # RoPE on q and k in one pass
        q, k = qk[:, :H], qk[:, H:]
        if slots is None:
            kc[:, P:P + n] = k.transpose(0, 1)
            vc[:, P:P + n] = v.transpose(0, 1)
        else:
            kc.index_copy_(1, slots, k.transpose(0, 1))
            vc.index_copy_(1, slots, v.transpose(0, 1))
        if exact:
            a = self._attention_exact(q, kc, vc, P, tail_idx, mask)
        elif mask is CAUSAL_KERNEL:         # a prompt over an empty cache, where the CPU kernel runs
            a = self._causal_attention(q, kc, vc, n, L.kind)
        else:                               # mask None: a causal run over an empty cache (`_sdpa_mask`)
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :P + n], vc[None, :, :P + n],
                                               attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=kvh != H)[0].transpose(0, 1).reshape(n, H * hd)
        a = kern["o"](a) if kern else F.linear(a, L.o_w)
        if L.post_attn_norm is not None:
            a = self._rmsnorm(a, L.post_attn_norm)
        x = x + a
        h = self._rmsnorm(x, L.pre_mlp_norm)
        gate, up = (kern["gate_up"](h) if kern else F.linear(h, L.gate_up_w)).chunk(2, dim=-1)
        h = self.act(gate) * up
        h = kern["down"](h) if kern else F.linear(h, L.down_w)
        if L.post_mlp_norm is not None:
            h = self._rmsnorm(h, L.post_mlp_norm)
        return x + h

    def _causal_attention(self, q, kc, vc, n, kind) -> torch.Tensor:
        """A causal run over an empty cache (a prompt, `_causal_run`) by the decode's attention kernel, a block
        of BLOCK rows per call (rows in block a see blocks [0, a) where they lie and their own block up to
        themselves; a sliding layer's window cuts inside the kernel). q [n, H, hd], the n rows' keys and values
        already in kc / vc -> [n, H hd]. The weights are rounded to bf16 before the values, as in the decode.
        Used instead of SDPA's causal kernel, which is slow in bf16 on a CPU and, past a sliding layer's window,
        needs a mask and then computes every masked score (PERFORMANCE.md, "The prefill")."""
        H, hd = q.shape[1], q.shape[2]
        window = self.window if kind == "sliding_attention" else None
        out = torch.empty(n, H, hd, dtype=torch.float32)
        for a in range(0, n, BLOCK):
            b = min(n, a + BLOCK)
            rows = torch.arange(a, b)
            keys = torch.arange(a, a + 2 * BLOCK)                      # the row's block and the next (empty)
            out[a:b] = cpu.attention(q[a:b], kc, vc, a // BLOCK, rows, keys.expand(b - a, -1),
                                     keys[None] <= rows[:, None], window, self.scale)
        return out.view(n, H * hd).to(q.dtype)

    def _sdpa_mask(self, positions, cache, visible, kind, key_positions=None) -> torch.Tensor | None:
        """[1, 1, n, P + n] bool: committed slots (within the window on sliding layers) + `visible`; None for a
        causal run over an empty cache that no window cuts (a prefill): SDPA's `is_causal`, whose kernel skips
        the masked half instead of computing it (SmolLM2, a 1400-token prefill on one thread: 4.2 -> 3.3-3.7 s,
        of which the masked attention had been 2.3 s)."""
        P, n = cache.committed, positions.numel()
        dev = positions.device
        if ((kind != "sliding_attention" or self.window is None or n <= self.window)
                and _causal_run(P, positions, visible, key_positions)):
            return None
        if visible.shape == (n, P + n):
            mask = visible.clone()
        elif visible.shape == (n, n):
            mask = torch.cat([torch.ones(n, P, dtype=torch.bool, device=dev), visible], dim=1)
        else:
            raise NativeError(f"visible is {tuple(visible.shape)} — give [n, n] (new rows) or [n, P + n] (cached "
                              f"and new rows) with n = {n}, P = {P}")
        if kind == "sliding_attention" and self.window is not None:
            cached = torch.arange(P, device=dev) if key_positions is None else key_positions[:P].to(dev)
            k_pos = torch.cat([cached, positions])
            mask &= (positions[:, None] - k_pos[None, :]) < self.window
        return mask[None, None]

    def _exact_masks(self, P, positions, tail, kind):
        """The keys each row must not see in exact mode, per forward and layer type (not per layer):
        committed [1, n, 1, b0, BLOCK] bool (outside a sliding window; None on full layers or with no
        committed block) and tail [1, n, 1, T BLOCK] (not the row's context, or outside the window); then
        what the CPU attention kernel reads instead (positions, the tail's visible keys [n, T BLOCK] uint8,
        the window or 0)."""
        n, dev = positions.numel(), positions.device
        window = self.window if kind == "sliding_attention" else None
        b0 = P // BLOCK
        committed = None
        allowed = tail[1]
        if window is not None:
            if b0:
                k_pos = torch.arange(b0 * BLOCK, device=dev)
                committed = ~(positions[:, None] - k_pos[None, :] < window).view(1, n, 1, b0, BLOCK)
            k_pos = b0 * BLOCK + torch.arange(allowed.shape[1], device=dev)
            allowed = allowed & (positions[:, None] - k_pos[None, :] < window)
        kernel_args = ((positions.contiguous(), allowed.to(torch.uint8).contiguous(), window or 0)
                       if self._bf16_kernels() or self._attention_kernel_f32(self.head_dim) else None)
        return committed, ~allowed[None, :, None, :], kernel_args

    def _attention_exact(self, q, kc, vc, P, idx, masked) -> torch.Tensor:
        """Fixed-shape attention (rules 2 and 3 of the module docstring). q [n, H, hd] -> [n, H hd];
        idx [n, T BLOCK]: the tail's cache slots (`tail_index`); masked: `_exact_masks`."""
        n, H, hd = q.shape
        kvh = kc.shape[0]
        if masked[2] is not None and self._attention_kernel(hd) and not torch.compiler.is_compiling():
            pos, ok, window = masked[2]                                # kernels.cpu: the same rules, per row
            return cpu.attention(q, kc, vc, P // BLOCK, pos, idx, ok, window, self.scale).view(
                n, H * hd).to(q.dtype)
        if masked[2] is not None and self._attention_kernel_f32(hd) and not torch.compiler.is_compiling():
            pos, ok, window = masked[2]                                # the same rules in fp32, per row
            return cpu.attention_f32(q, kc, vc, P // BLOCK, pos, idx, ok, window, self.scale).view(n, H * hd)
        g = H // kvh
        gp = max(g, MIN_ROWS)                                          # query rows per KV group per token
        qg = q.view(n, kvh, g, hd).transpose(0, 1)                     # [kvh, n, g, hd]
        if gp > g:
            qg = torch.cat([qg, qg.new_zeros(kvh, n, gp - g, hd)], dim=2)
        b0 = P // BLOCK
        committed_masked, tail_masked = masked[:2]
        ms, ls, os_ = [], [], []
        if b0:                                                         # committed blocks, shared by all rows
            keys = b0 * BLOCK
            s = torch.matmul(qg.reshape(kvh, n * gp, hd), kc[:, :keys].transpose(1, 2))   # [kvh, n gp, keys]
            s = s.float().mul_(self.scale).view(kvh, n, gp, b0, BLOCK)
            if committed_masked is not None:
                s = s.masked_fill(committed_masked, float("-inf"))
            m, l, e = _block_softmax(s)                                 # [kvh, n, gp, b0] x2, e like s
            e = e.to(vc.dtype).permute(0, 3, 1, 2, 4).reshape(kvh, b0, n * gp, BLOCK)
            o = torch.matmul(e, vc[:, :keys].view(kvh, b0, BLOCK, hd))  # [kvh, b0, n gp, hd]
            ms.append(m)
            ls.append(l)
            os_.append(o.view(kvh, b0, n, gp, hd).permute(0, 2, 3, 1, 4).float())
        flat = idx.reshape(-1)
        T = idx.shape[1] // BLOCK                                      # tail blocks (`tail_blocks`)
        kt = kc.index_select(1, flat).view(kvh, n, T * BLOCK, hd)      # logical order
        vt = vc.index_select(1, flat).view(kvh, n, T * BLOCK, hd)
        s = torch.matmul(qg, kt.transpose(-1, -2)).float().mul_(self.scale)     # [kvh, n, gp, T BLOCK]
        s = s.masked_fill(tail_masked, float("-inf")).view(kvh, n, gp, T, BLOCK)
        m, l, e = _block_softmax(s)
        e = e.to(vt.dtype).transpose(2, 3)                             # [kvh, n, T, gp, BLOCK]
        o = torch.matmul(e, vt.view(kvh, n, T, BLOCK, hd))             # [kvh, n, T, gp, hd]
        ms.append(m)
        ls.append(l)
        os_.append(o.transpose(2, 3).float())                          # [kvh, n, gp, T, hd]
        m = torch.cat(ms, dim=-1)                                      # [kvh, n, gp, blocks]
        l = torch.cat(ls, dim=-1)
        o = torch.cat(os_, dim=-2)                                     # [kvh, n, gp, blocks, hd]
        top = m.amax(-1, keepdim=True)
        w = torch.exp(m - top)                                         # 0 for blocks a row cannot see
        if q.device.type == "cpu":
            total = torch.cumsum(w * l, dim=-1)[..., -1:]              # sequential fold (rule 3)
            out = torch.cumsum(w[..., None] * o, dim=-2)[..., -1, :] / total   # [kvh, n, gp, hd]
        else:
            total, out = _group_fold(w * l, w[..., None] * o)
            out = out / total
        return out[:, :, :g].permute(1, 0, 2, 3).reshape(n, H * hd).to(q.dtype)

    # -- LM head -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, exact: bool = False, softcap: bool = True) -> torch.Tensor:
        """fp32 logits [.., V]: the LM head (F.linear in exact mode: row-invariant; the CPU kernel where it is on),
        then soft-capping."""
        if self._kernel(hidden[..., 0].numel(), exact):
            out = self.head_kernel(hidden, torch.float32)
        elif exact:
            out = F.linear(hidden, self.head_w, self.head_b).float()
        else:
            out = dense_head(hidden, self.head_w, self.head_b).float()
        if self.softcap is not None and softcap:
            out = out.div_(self.softcap).tanh_().mul_(self.softcap)      # tanh(z / cap) * cap, in place
        return out


class GraphedDecode:
    """The fixed-shape decode forward (exact mode, LM head included) replayed as CUDA graphs.

    A decode forward on a GPU is hundreds of small kernels (SmolLM2: 30 layers x ~25), whose launches cost
    more than their work; a graph launches them as one. Every input that changes per step lives in a static
    buffer (tokens, positions, the tail's slots and mask, the slots rows are written to), so one graph serves
    every step with the same (rows, committed blocks P // BLOCK, compiled, tail blocks): a decode at fixed
    `verify_rows` captures one graph per BLOCK tokens of context (and per tail width a tree deeper than BLOCK
    takes), all writing one output buffer per row count (a graph's own outputs would stay allocated: Gemma's [128, 262k] fp32 logits are 134 MB). The graphs hold the cache's and the RoPE
    tables' addresses: they are dropped when either is reallocated. `capture` builds the graph; `torch.cuda.CUDAGraph` on CUDA, and -
    for the tests of the buffer plumbing on a CPU - a recording that re-runs the captured call (`eager=True`).
    """

    def __init__(self, net: NativeModel, eager: bool = False):
        self.net = net
        self.eager = eager
        self.graphs: dict[tuple[int, int, bool, int], dict] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}     # per row count, shared by its graphs
        self.pool = None
        self._cache_id = None
        self.captures = 0                                               # graphs built (tests, benchmark)
        self.cache: StaticKV | None = None                              # the one static cache they run over

    def static_cache(self, slots: int) -> StaticKV:
        """The cache every graphed decode of this model runs over (at least GRAPH_CACHE_SLOTS, reused so the
        graphs stay valid); a new one, and so new graphs, when it is shorter than `slots`."""
        if self.cache is None or self.cache.capacity < slots:
            self.cache = self.net.new_cache(max(slots, GRAPH_CACHE_SLOTS))
        self.cache.committed = 0
        return self.cache

    def reset(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self._cache_id = None

    @torch.inference_mode()
    def __call__(self, cache: StaticKV, tokens, positions, tail: tuple[torch.Tensor, torch.Tensor],
                 compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [R, d], fp32 logits [R, V]) of the R rows over `cache`; the outputs are the graph's own
        buffers, overwritten by the next call (copy what must outlive it). compiled: capture the
        torch.compile'd layer (`NativeModel.compiled_layer`: inductor's fused kernels, compiled during the
        warm-up before the capture)."""
        state = (id(cache.k), cache.capacity, self.net._rope_len)      # what the graphs hold the addresses of
        if self._cache_id != state:
            self.reset()
            self._cache_id = state
        P, R, T = cache.committed, tokens.numel(), tail[0].shape[1] // BLOCK
        key = (R, P // BLOCK, compiled, T)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(cache, R, compiled, T)
        g["tok"].copy_(tokens)
        g["pos"].copy_(positions)
        g["idx"].copy_(tail[0])
        g["ok"].copy_(tail[1])
        torch.add(g["base"], P, out=g["slots"])
        g["replay"]()
        return g["hidden"], g["logits"]

    def _capture(self, cache: StaticKV, R: int, compiled: bool = False, T: int = TAIL_BLOCKS) -> dict:
        net, dev = self.net, cache.k.device
        net.rope_tables(cache.capacity)                                 # no table grows inside a graph
        if R not in self.outputs:                                       # one output buffer per row count: a
            self.outputs[R] = (torch.empty(R, net.d, dtype=net.dtype, device=dev),   # graph's own outputs would
                               torch.empty(R, net.head_w.shape[0], device=dev))      # stay allocated per graph
        out_h, out_lg = self.outputs[R]
        g = dict(tok=torch.zeros(R, dtype=torch.long, device=dev),
                 pos=torch.full((R,), cache.committed, dtype=torch.long, device=dev),
                 idx=torch.zeros(R, T * BLOCK, dtype=torch.long, device=dev),
                 ok=torch.zeros(R, T * BLOCK, dtype=torch.bool, device=dev),
                 base=torch.arange(R, device=dev), slots=torch.zeros(R, dtype=torch.long, device=dev))
        g["ok"][:, 0] = True                                            # a valid (if meaningless) warm-up input
        torch.add(g["base"], cache.committed, out=g["slots"])

        g["hidden"], g["logits"] = out_h, out_lg

        def run():
            h = net.forward(g["tok"], g["pos"], cache, None, exact=True, tail=(g["idx"], g["ok"]),
                            slots=g["slots"], compiled=compiled)
            out_h.copy_(h)
            out_lg.copy_(net.logits(h, exact=True))

        self.captures += 1
        if self.eager or dev.type != "cuda":
            g["replay"] = run
            return g
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                                   # warm-up: cuBLAS workspaces, autotune
            for _ in range(2):
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        if self.pool is None:
            self.pool = graph.pool()
        g["graph"] = graph
        g["replay"] = graph.replay
        return g


def tail_blocks(committed: int, max_depth: int) -> int:
    """Blocks of BLOCK logical positions the tail needs (rule 2): from the block holding position `committed`
    (the root) to the one holding the deepest node, P + max_depth; at least TAIL_BLOCKS, so every tree up to
    BLOCK deep takes the same shape."""
    return max(TAIL_BLOCKS, (committed % BLOCK + max_depth) // BLOCK + 1)


def tail_index(committed: int, positions: torch.Tensor, anc: torch.Tensor, parents_depth: torch.Tensor,
               blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the cache slot of every logical position in the tail's attention blocks (rule 2).

    committed P; positions [n] = P + depth; anc [n, n] ancestor-or-self mask of the (padded) tree;
    parents_depth [n] = depth; blocks: the tail's block count T (default `tail_blocks(P, max depth)`: what the
    deepest row reaches). Returns idx [n, T BLOCK] int64 (slot 0 where nothing is there) and ok [n, T BLOCK]
    bool. Logical position p < P lies in slot p; p = P + j is the row's ancestor at depth j, which lies in
    slot P + (its node index).
    """
    n = positions.numel()
    dev = positions.device
    base = (committed // BLOCK) * BLOCK
    depth = parents_depth
    deepest = int(depth.max())
    need = tail_blocks(committed, deepest)
    T = need if blocks is None else blocks
    if T < need:
        raise NativeError(f"a draft tree {deepest + 1} deep after {committed} committed tokens needs {need} tail "
                          f"blocks of {BLOCK} positions; got blocks={T} (leave it None)")
    logical = base + torch.arange(T * BLOCK, device=dev)               # [T B]
    # node_at[i, j] = the ancestor of row i at depth j (or -1)
    node_at = torch.full((n, n), -1, dtype=torch.long, device=dev)
    rows, cols = anc.nonzero(as_tuple=True)                            # (row, one of its ancestors)
    node_at[rows, depth[cols]] = cols
    j = (logical - committed)                                           # [T B] depth a tree position has
    in_tree = (j >= 0)[None, :] & (j[None, :] <= depth[:, None])        # [n, T B]
    jj = j.clamp(0, n - 1)
    tree_slot = committed + node_at[:, jj]                              # [n, T B]
    committed_ok = (logical < committed)[None, :].expand(n, -1)
    ok = committed_ok | in_tree
    idx = torch.where(in_tree, tree_slot, torch.where(committed_ok, logical[None, :].expand(n, -1), 0))
    return idx.clamp(min=0), ok


def _block_softmax(s: torch.Tensor):
    """Per block of the last dim: max m, sum l of exp(s - m), and exp(s - m). A wholly masked block (-inf)
    gets m = -1e30 (finite, so exp(s - m) = 0 rather than NaN) and l = 0; its fold weight exp(m - top) is 0."""
    m = s.amax(-1).clamp_min(-1e30)
    e = torch.exp(s - m[..., None])
    return m, e.sum(-1), e


FOLD_GROUP = 64       # blocks summed by one fixed-length reduction on an accelerator (`_group_fold`)


def _group_fold(wl: torch.Tensor, wo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 3 on an accelerator, where `cumsum` is a parallel scan whose association depends on the length:
    blocks are padded with exact zeros to a multiple of FOLD_GROUP, each group is summed by one reduction of
    that fixed length (the same kernel and order whatever the committed length), and the groups are folded
    in order. wl [.., blocks], wo [.., blocks, hd] -> ([.., 1], [.., hd])."""
    blocks = wl.shape[-1]
    pad = -blocks % FOLD_GROUP
    wl = F.pad(wl, (0, pad)).unflatten(-1, (-1, FOLD_GROUP)).sum(-1)            # [.., groups]
    wo = F.pad(wo, (0, 0, 0, pad)).unflatten(-2, (-1, FOLD_GROUP)).sum(-2)      # [.., groups, hd]
    total, out = wl[..., :1], wo[..., 0, :]
    for g in range(1, wl.shape[-1]):                                # a group of padding adds exact zeros
        total = total + wl[..., g:g + 1]
        out = out + wo[..., g, :]
    return total, out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.no_grad()
def _fuse(linears) -> torch.Tensor:
    """One [sum out, in] weight for several nn.Linear; the modules' weights become views of it."""
    fused = torch.cat([m.weight.detach() for m in linears])
    at = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[at:at + rows]
        at += rows
    return fused


def weight_bytes(model: NativeModel) -> int:
    """Bytes of the weight matrices one forward reads (every layer's + the LM head): the bandwidth bound's
    numerator in `engine.jobs`' forward benchmark."""
    total = model.head_w.numel()
    for L in model.layers:
        total += L.qkv_w.numel() + L.o_w.numel() + L.gate_up_w.numel() + L.down_w.numel()
    return total * model.head_w.element_size()

