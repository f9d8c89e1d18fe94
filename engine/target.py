"""The target model behind one interface: `make_target(model, cfg) -> Target`, the `hf` or `native` backend.

The harness runs the target only through a `Target`:

    begin(capacity)                      a fresh KV cache for one prompt (capacity: slots it will need)
    prefill(prompt, all_logits, rows)    -> hidden [L, d], logits [L, V] (the last row; the rows asked for) fp32
    forward_tree(tokens, parents, depths, anc)
                                         -> hidden [n, d], logits [n, V] fp32 of a draft tree over the cache
    compact(num_new, keep)               keep the accepted path; returns the committed length
    committed                            tokens in the cache

Backends (`SpecConfig.backend`):
- `native` (`engine.native`): packed weights, a static cache compacted in place, and - with
  `cfg.fixed_shape` (the default) - fixed-shape verification: every decode forward at a bucket of rows and a
  row's attention folded over its keys in logical order, so a token's logits are bitwise the same whether an
  `ar` step or any draft tree computed them (`engine.native` says how, tests/test_native.py checks it).
- `hf`: transformers' own forward with a `DynamicCache` and a 4D tree mask (`engine.kv`): the reference,
  and the path for every architecture the native forward does not know.
- `auto` (default): native where it applies, else hf with one line saying why.

`lm_logits`, `prefill` and `forward_tree` are the hf backend's functions, kept as functions (tests and
`engine.jobs.train_eagle` call them on a bare HF model).
"""

from __future__ import annotations

import inspect
import sys
from abc import ABC, abstractmethod

import torch

from specvocab.engine import kv
from specvocab.engine.native import NativeError, NativeModel, bucket_rows, tail_index, unsupported_reason
from specvocab.engine.verify import tree_layout
from specvocab.kernels import cpu
from specvocab.kernels.head import dense_head

BACKENDS = ("auto", "native", "hf")
# On an accelerator the fixed-shape forward runs at one row count for every decode (`verify_rows=None`):
# a GPU GEMM may pick its kernel, and so a row's rounding, by the number of rows, and rows cost little there
# (the forward reads the weights once whatever the rows). A tree of more nodes is a clear error.
DEVICE_ROWS = 128              # UniSpec's GPU draft sizes (60-110 nodes) fit; a tree of more is a clear error
GRAPH_DEVICES = ("cuda",)      # where the fixed-shape decode is replayed as graphs (a CPU only in tests: eagerly)


class BackendError(ValueError):
    """The backend asked for cannot run this model or dtype here; the message says why and what to use."""


# --- hf: transformers' forward --------------------------------------------------------------------------

def lm_logits(model, hidden: torch.Tensor, softcap: bool = True) -> torch.Tensor:
    """The target's logits [.., V] fp32 from final hidden states (LM head + Gemma's soft-capping, unless not
    `softcap`: tanh is monotonic, so a top-k needs no cap)."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:        # a plain head: the small-row CPU path of `kernels.head.dense_head`
        logits = dense_head(hidden, head.weight, head.bias).float()
    else:
        logits = head(hidden).float()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap is not None and softcap:
        logits = logits.div_(cap).tanh_().mul_(cap)            # tanh(z / cap) * cap, in place
    return logits


PREFILL_HEAD_ROWS = 256     # the prefill's LM head runs in chunks of this many rows (`prefill_logits`)


def prefill_logits(head, hidden: torch.Tensor, all_logits: bool = True,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill's fp32 logits from hidden [L, d] through head(h [r, d]) -> [r, V]: the last row [1, V]
    (not `all_logits`), every row [L, V], or the rows at positions `rows` ([r] int64, ascending, the last
    position last). The last row - the first token of every method - is always computed alone (a head over
    many rows may take another path: kernels.cpu up to KERNEL_MAX_ROWS rows, oneDNN above; `ar` asks for one
    row). The others run PREFILL_HEAD_ROWS at a time into one buffer: Gemma-3's [1400, 262k] fp32 logits are
    1.5 GB, which one call held twice (and the soft-cap's temporaries more); in chunks its head over a
    1400-token prompt took 3.7 s instead of 6.4."""
    L = hidden.shape[0]
    last = head(hidden[-1:])
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() == 0 or int(rows[-1]) != L - 1 or (rows.numel() > 1 and bool((rows.diff() <= 0).any())) \
                or int(rows[0]) < 0:
            raise BackendError(f"prefill rows must be ascending prompt positions in [0, {L}) ending at the last one "
                               f"({L - 1}); got {rows.tolist()[:8]}{' ...' if rows.numel() > 8 else ''}")
        others = rows[:-1].to(hidden.device)
    elif not all_logits or L == 1:
        return last
    else:
        others = None
    r = L - 1 if others is None else others.numel()
    out = last.new_empty(r + 1, last.shape[-1])
    for a in range(0, r, PREFILL_HEAD_ROWS):
        b = min(r, a + PREFILL_HEAD_ROWS)
        out[a:b] = head(hidden[a:b] if others is None else hidden[others[a:b]])
    out[r:] = last
    return out


def head_topk(head, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """[L, k] int64: the top-k token ids of every row's logits, best first, through head(h, softcap=False)
    PREFILL_HEAD_ROWS rows at a time, each chunk's logits dropped after its top-k: no [L, V] is ever held. The
    soft-cap is skipped (tanh is monotonic: the same order, up to ties its rounding could make)."""
    out = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    for a in range(0, hidden.shape[0], PREFILL_HEAD_ROWS):
        b = min(hidden.shape[0], a + PREFILL_HEAD_ROWS)
        out[a:b] = cpu.topk(head(hidden[a:b], softcap=False), k)[1]
    return out


def decoder(model):
    """The decoder stack of an HF causal LM (`model.model` or `get_decoder()`)."""
    return model.model if hasattr(model, "model") else model.get_decoder()


def cache_kwarg(module) -> str:
    """A transformers module's name for the KV cache argument (a decoder, a decoder layer): `cache` from
    transformers 5.24 on (`past_key_values` is deprecated there and removed in 5.40), `past_key_values` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kw(model) -> str:
    return cache_kwarg(decoder(model))


def prefill(model, prompt: torch.Tensor, cache, all_logits: bool = True,
            rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run prompt [L] into an empty cache; returns hidden [L, d] and logits fp32: [L, V], only the last row
    [1, V] when not `all_logits`, or the rows at positions `rows` (`prefill_logits`: the LM head over a long
    prompt is costly, Gemma's 262k rows)."""
    out = decoder(model)(input_ids=prompt[None], use_cache=True, **{_cache_kw(model): cache})
    hidden = out.last_hidden_state[0]                            # [L, d]
    kv.compact(cache, 0, prompt.numel(), None)                   # trims sliding-window layers to W-1
    return hidden, prefill_logits(lambda h: lm_logits(model, h), hidden, all_logits, rows)


def forward_tree(model, cache, committed: int, tokens: torch.Tensor, parents: torch.Tensor,
                 depths: torch.Tensor | None = None, anc: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a draft tree over a cache holding `committed` tokens.

    tokens [n], parents [n] on the model's device. Appends n entries to the cache (call `kv.compact`
    next). Returns hidden [n, d] and logits [n, V] fp32; row i = distribution after the path root -> i.
    """
    if depths is None or anc is None:
        depths, anc = (t.to(parents.device) for t in tree_layout(parents.cpu()))
    mask = kv.tree_attention_masks(model, cache, committed, depths, anc)
    position_ids = (committed + depths)[None]                    # [1, n] siblings share a position
    out = decoder(model)(input_ids=tokens[None], attention_mask=mask, position_ids=position_ids,
                         use_cache=True, **{_cache_kw(model): cache})
    hidden = out.last_hidden_state[0]                            # [n, d]
    return hidden, lm_logits(model, hidden)


class Target(ABC):
    """The interface (module docstring); `name` is the backend, `fixed_shape` whether rows are bucketed."""

    name = "base"
    fixed_shape = False

    def __init__(self, model):
        self.model = model
        self.committed = 0

    @abstractmethod
    def begin(self, capacity: int) -> None:
        """A fresh cache for one prompt: prompt + new tokens + one tree fit in `capacity` slots."""

    @abstractmethod
    def prefill(self, prompt: torch.Tensor, all_logits: bool = True,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run prompt [L] into the cache: (hidden [L, d], fp32 logits [L, V], the last row [1, V] when not
        all_logits, or the rows at positions `rows`: `prefill_logits`)."""

    @abstractmethod
    def head(self, hidden: torch.Tensor, softcap: bool = True) -> torch.Tensor:
        """The LM head: fp32 logits [r, V] of final hidden states [r, d] (soft-capped unless not `softcap`)."""

    @abstractmethod
    def forward_tree(self, tokens, parents, depths, anc) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft tree (root first) over the cache: (hidden [n, d], fp32 logits [n, V])."""

    @abstractmethod
    def compact(self, num_new: int, keep: list[int] | None) -> int:
        """Keep tree rows `keep` (the accepted path; None = all) after the committed prefix; returns the
        committed length."""


class HFTarget(Target):
    name = "hf"

    def begin(self, capacity: int) -> None:
        self.cache = kv.new_cache(self.model)
        self.committed = 0

    def head(self, hidden, softcap=True):
        return lm_logits(self.model, hidden, softcap)

    def prefill(self, prompt, all_logits=True, rows=None):
        out = prefill(self.model, prompt, self.cache, all_logits, rows)
        self.committed = prompt.numel()
        return out

    def forward_tree(self, tokens, parents, depths, anc):
        return forward_tree(self.model, self.cache, self.committed, tokens, parents, depths, anc)

    def compact(self, num_new, keep):
        self.committed = kv.compact(self.cache, self.committed, num_new, keep)
        return self.committed


class NativeTarget(Target):
    name = "native"

    def __init__(self, model, fixed_shape: bool = True, rows: int | None = None, compile: bool = False,
                 cuda_graphs: bool = True, cpu_kernels: bool = True):
        super().__init__(model)
        self.net = native_model(model)
        self.net.use_cpu_kernels(cpu_kernels)                      # the CPU small-row kernel, where it runs
        self.fixed_shape = fixed_shape
        self.rows = decode_rows(self.net.device, fixed_shape, rows)   # None: bucket_rows(n) per step
        self.verify_rows = rows
        self.compile = compile                                   # torch.compile the fixed-shape decode layer
        # CUDA graphs of the fixed-shape forward (`GraphedDecode`, the compiled layer too when `compile`); not
        # while a feature tap (EAGLE-3) reads the layers' inputs from Python
        self.graphs = (self.net.graphs() if cuda_graphs and fixed_shape
                       and self.net.device.type in GRAPH_DEVICES else None)
        self.cache = None

    def begin(self, capacity: int) -> None:
        need = capacity + (self.rows or 0)
        # graphed: the model's one static cache, reused by every decode so its graphs stay valid
        self.cache = self.net.new_cache(need) if self.graphs is None else self.graphs.static_cache(need)
        self.committed = 0

    def _ensure(self, slots: int) -> None:
        if slots > self.cache.capacity:              # a graphed decode sees the new tensors and recaptures
            self.cache.grow(max(slots, self.cache.capacity + self.cache.capacity // 2))

    def head(self, hidden, softcap=True):
        return self.net.logits(hidden, softcap=softcap)

    def prefill(self, prompt, all_logits=True, rows=None):
        L = prompt.numel()
        self._ensure(L)
        vis = torch.ones(L, L, dtype=torch.bool, device=prompt.device).tril_()
        hidden = self.net.forward(prompt, torch.arange(L, device=prompt.device), self.cache, vis)
        self.committed = self.cache.committed = L
        return hidden, prefill_logits(self.net.logits, hidden, all_logits, rows)

    def forward_tree(self, tokens, parents, depths, anc):
        n, P = tokens.numel(), self.committed
        if not self.fixed_shape:
            self._ensure(P + n)
            hidden = self.net.forward(tokens, P + depths, self.cache, anc)
            return hidden, self.net.logits(hidden)
        # a CPU's per-step bucket pads the tree (rule 1), unless the CPU kernels run: then every op is per row
        # by construction and the step runs exactly its tree (`pads_rows`)
        rows = (self.rows if self.rows is not None
                else n if self.net.kernel_on else bucket_rows(n, self.net.row_floor()))
        if n > rows:
            raise BackendError(rows_error(n, rows, self.verify_rows))
        self._ensure(P + rows)
        dev = tokens.device
        pad = rows - n                                           # padding rows: token 0 at depth 0, alone
        tok = torch.cat([tokens, tokens.new_zeros(pad)])
        dep = torch.cat([depths, depths.new_zeros(pad)])
        a = torch.eye(rows, dtype=torch.bool, device=dev)
        a[:n, :n] = anc
        tail = tail_index(P, P + dep, a, dep)
        if self.graphs is not None and self.net.feature_tap is None:
            hidden, logits = self.graphs(self.cache, tok, P + dep, tail, compiled=self.compile)
            return hidden[:n].clone(), logits[:n].clone()       # the graph's buffers are rewritten next step
        hidden = self.net.forward(tok, P + dep, self.cache, a, exact=True, tail=tail, compiled=self.compile)
        return hidden[:n], self.net.logits(hidden, exact=True)[:n]

    def compact(self, num_new, keep):
        self.committed = self.cache.compact(num_new, keep)
        return self.committed


def native_model(model) -> NativeModel:
    """The `NativeModel` of an HF model, packed once and kept on the model (rebuilt if its weights moved)."""
    net = getattr(model, "_specvocab_native", None)
    if net is not None and net.layers and _same_storage(model, net):
        return net
    net = NativeModel(model)
    model._specvocab_native = net
    return net


def _same_storage(model, net: NativeModel) -> bool:
    q = decoder(model).layers[0].self_attn.q_proj.weight
    return q.data_ptr() == net.layers[0].qkv_w.data_ptr() and q.dtype == net.dtype and \
        model.get_output_embeddings().weight.data_ptr() == net.head_w.data_ptr()


_warned: set[str] = set()


def resolve_backend(model, backend: str = "auto") -> str:
    """"native" or "hf" for this model: `auto` picks native where it applies (one line when it cannot);
    `native` on a model it cannot run is an error naming the supported families."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r} — choose one of {list(BACKENDS)}")
    if backend == "hf":
        return "hf"
    why = unsupported_reason(model)
    if why is None:
        return "native"
    if backend == "native":
        raise NativeError(f"backend='native': {why} — use backend='hf' or 'auto'")
    if why not in _warned:
        _warned.add(why)
        print(f"[specvocab] native forward unavailable ({why}); using transformers (backend='hf')",
              file=sys.stderr)
    return "hf"


def backend_label(model, backend: str = "auto", fixed_shape: bool = True, compile: bool = False,
                  cuda_graphs: bool = True, cpu_kernels: bool = True) -> str:
    """How a decode's target runs, in the forward benchmark's words: "hf", "native" (fixed-shape),
    "native-blas" (fixed-shape, bf16 or fp32 on a CPU without the small-row kernels of kernels.cpu: oneDNN's
    GEMMs), "native-compiled", "native-graph" (fixed-shape under CUDA graphs: the default on CUDA),
    "native-compiled-graph" (both) or "native-sdpa" (native without the fixed shape). Results and figures
    carry it."""
    if resolve_backend(model, backend) == "hf":
        return "hf"
    if not fixed_shape:
        return "native-sdpa"
    p = next(model.parameters())
    graphed = cuda_graphs and p.device.type in GRAPH_DEVICES
    blas = (not compile and p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32)
            and not cpu_kernels_run(model, backend, cpu_kernels))   # bf16 / fp32 on a CPU, the kernels off
    return "native" + ("-compiled" if compile else "") + ("-graph" if graphed else "") + ("-blas" if blas else "")


def cpu_kernels_run(model, backend: str = "auto", cpu_kernels: bool = True) -> bool:
    """Whether a decode of `model` runs the CPU kernels (kernels.cpu): asked for, the native backend, bf16 (on a
    CPU with AVX512-BF16) or fp32 (AVX-512F: the linears only) on a CPU, and the kernels built here."""
    p = next(model.parameters())
    return cpu_kernels and cpu.linear_reason(p.device, p.dtype) is None and resolve_backend(model, backend) == "native"


def pads_rows(model, backend: str = "auto", fixed_shape: bool = True, rows: int | None = None,
              cpu_kernels: bool = True) -> bool:
    """Whether each decode step pads its tree to a row bucket (`engine.native.bucket_rows`): the native
    fixed-shape path with per-step buckets (a CPU, `verify_rows=None`), unless the CPU kernels run - every op
    is then per row by construction and a step runs exactly its tree. Where it pads, a bucket's largest tree
    costs what its smallest does (`engine.harness.bucket_edge`)."""
    if not fixed_shape or resolve_backend(model, backend) != "native":
        return False
    if decode_rows(next(model.parameters()).device, fixed_shape, rows) is not None:
        return False                                              # one row count for every step
    return not cpu_kernels_run(model, backend, cpu_kernels)


def max_tree_nodes(model, backend: str = "auto", fixed_shape: bool = True, rows: int | None = None) -> int | None:
    """Draft nodes (root excluded) one decode forward can take: `rows - 1` on the native fixed-shape path where
    the row count is fixed (`verify_rows`, or `DEVICE_ROWS` on an accelerator); None where the rows grow
    with the tree (a CPU's buckets, the hf backend)."""
    if not fixed_shape or resolve_backend(model, backend) != "native":
        return None
    rows = decode_rows(next(model.parameters()).device, fixed_shape, rows)
    return None if rows is None else rows - 1


def rows_error(nodes: int, rows: int, verify_rows: int | None) -> str:
    """The one-line error for a draft tree of `nodes` nodes (root included) over fixed-shape forwards of `rows`
    rows, the largest bucket there (`verify_rows`, or DEVICE_ROWS on an accelerator when it is None)."""
    where = f"verify_rows={verify_rows}" if verify_rows is not None else "DEVICE_ROWS on an accelerator"
    return (f"a draft tree of {nodes} nodes (root included) exceeds the largest verify bucket, {rows} rows "
            f"({where}) — lower draft_size to at most {rows - 1} or set verify_rows to at least {nodes}")


def decode_rows(device: torch.device, fixed_shape: bool, rows: int | None) -> int | None:
    """The row count of every fixed-shape decode forward: `rows` (`verify_rows`) when given, DEVICE_ROWS on
    an accelerator, else None (a CPU: the bucket of each step's tree)."""
    if rows is None and fixed_shape and device.type != "cpu":
        return DEVICE_ROWS
    return rows


def make_target(model, backend: str = "auto", fixed_shape: bool = True, rows: int | None = None,
                compile: bool = False, cuda_graphs: bool = True, cpu_kernels: bool = True) -> Target:
    """The Target for one decode (a fresh cache per `begin`)."""
    if resolve_backend(model, backend) == "native":
        if compile and not fixed_shape:
            raise BackendError("compile=True compiles the fixed-shape decode forward — set fixed_shape=True "
                               "or compile=False")
        return NativeTarget(model, fixed_shape=fixed_shape, rows=rows, compile=compile, cuda_graphs=cuda_graphs,
                            cpu_kernels=cpu_kernels)
    return HFTarget(model)
