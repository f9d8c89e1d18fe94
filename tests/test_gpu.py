"""The native decode path on CUDA: parity with transformers, CUDA graphs, bitwise rows,
lossless decoding. `pytest -m gpu` runs these; they skip (needs CUDA) elsewhere.

On a GPU the fixed-shape forward runs every decode at one row count (`engine.target.DEVICE_ROWS`), folds the
attention blocks with a fixed-length reduction (`engine.native._group_fold`) and replays as CUDA graphs
(`engine.native.GraphedDecode`). What would pass without them and fails here:
- graphs silently off (every step eager)                         -> the capture count
- a graph keyed by rows alone, or write slots left at the capture's P -> graphed logits differ from eager
- rows bucketed per step on the device (a GEMM kernel per row count) -> the bitwise row test can show it
- the fold as a parallel cumsum over a growing block count       -> the bitwise row test can show it
Random models only: the offline models' weights (93-253 MB) do not travel to a lent GPU machine.
`SPECVOCAB_GPU_TESTS_DEVICE=cpu` runs the same code on a CPU (graphs replayed eagerly) to check a change
before spending GPU time.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import specvocab.engine.target as target_mod
from specvocab.engine import generate
from specvocab.engine.models import load_model
from specvocab.engine.native import BLOCK
from specvocab.engine.target import DEVICE_ROWS, BackendError, HFTarget, NativeTarget, native_model
from specvocab.engine.tree import DraftTree
from specvocab.engine.verify import tree_layout
from tests.engine_testing import random_parents, untie_head

DEV = torch.device(os.environ.get("SPECVOCAB_GPU_TESTS_DEVICE", "cuda"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]
FAMILIES = ("random-llama", "random-qwen3", "random-gemma3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _graphs_on_this_device(monkeypatch):
    if DEV.type != "cuda":                                       # the CPU dry run: graphs replayed eagerly
        monkeypatch.setattr(target_mod, "GRAPH_DEVICES", ("cuda", DEV.type))


def _model(name: str, dtype: str = "fp32"):
    model = untie_head(load_model(name, dtype=dtype)[0]).to(DTYPES[dtype])
    return model.to(DEV)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _tree_logits(target, prompt, tree: DraftTree):
    target.begin(prompt.numel() + 80)
    with torch.inference_mode():
        _, pre = target.prefill(prompt.to(DEV))
        d, a = tree_layout(tree.parents)
        _, lg = target.forward_tree(tree.tokens.to(DEV), tree.parents.to(DEV), d.to(DEV), a.to(DEV))
    return pre.clone(), lg.clone()


@pytest.mark.parametrize("fixed_shape", [True, False])
@pytest.mark.parametrize("name", FAMILIES)
def test_native_logits_equal_transformers_on_cuda(name, fixed_shape):
    model = _model(name)
    rng = np.random.default_rng(0)
    prompt = torch.as_tensor(rng.integers(0, 512, 70))           # past two blocks and gemma3's 16-token window
    tree = DraftTree(torch.as_tensor(rng.integers(0, 512, 9)), torch.tensor(random_parents(9, rng)))
    hf = _tree_logits(HFTarget(model), prompt, tree)
    native = _tree_logits(NativeTarget(model, fixed_shape=fixed_shape), prompt, tree)
    assert _rel(native[0], hf[0]) <= 1e-5
    assert _rel(native[1], hf[1]) <= 1e-5


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_native_logits_near_transformers_in_half_precision_on_cuda(dtype):
    model = _model("random-gemma3", dtype)
    rng = np.random.default_rng(1)
    prompt = torch.as_tensor(rng.integers(0, 512, 50))
    tree = DraftTree(torch.as_tensor(rng.integers(0, 512, 7)), torch.tensor([-1, 0, 0, 1, 1, 3, 5]))
    hf = _tree_logits(HFTarget(model), prompt, tree)
    native = _tree_logits(NativeTarget(model), prompt, tree)
    assert _rel(native[1], hf[1]) <= 3e-2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["random-llama", "random-gemma3"])
def test_graph_replay_is_bitwise_the_eager_forward(name, dtype):
    """Step by step over 100 tokens (three committed-block counts): the graphed forward's logits are the eager
    fixed-shape forward's, bit for bit, and one graph is captured per committed-block count."""
    model = _model(name, dtype)
    rng = np.random.default_rng(2)
    prompt = torch.as_tensor(rng.integers(0, 512, BLOCK - 3))
    trees = [DraftTree(torch.as_tensor(rng.integers(0, 512, 8)), torch.tensor(random_parents(8, rng)))
             for _ in range(40)]
    out = {}
    for graphs in (False, True):
        t = NativeTarget(model, cuda_graphs=graphs)
        t.begin(300)
        rows = []
        with torch.inference_mode():
            t.prefill(prompt.to(DEV), all_logits=False)
            for tree in trees:
                d, a = tree_layout(tree.parents)
                _, lg = t.forward_tree(tree.tokens.to(DEV), tree.parents.to(DEV), d.to(DEV), a.to(DEV))
                rows.append(lg.clone())
                keep = [0] + ([1] if tree.parents[1] == 0 else [])
                t.compact(8, keep)
        out[graphs] = rows
        if graphs:
            assert t.graphs is not None
            rows_run = t.rows or 8                               # DEVICE_ROWS on CUDA; the bucket of 8 nodes on a CPU
            assert sorted(t.graphs.graphs) == [(rows_run, b, False) for b in range(t.committed // BLOCK + 1)]
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)


def _row_alone_and_in_trees(model, prompt, path):
    """The last path token's logits from one-node forwards (`ar`) and from trees of several shapes."""
    L = prompt.numel()
    rng = np.random.default_rng(3)

    def fresh():
        t = NativeTarget(model)
        t.begin(L + 80)
        t.prefill(prompt[:L - 1].to(DEV), all_logits=False)
        return t

    def forward(t, toks, pars):
        d, a = tree_layout(torch.tensor(pars))
        return t.forward_tree(torch.tensor(toks, device=DEV), torch.tensor(pars, device=DEV), d.to(DEV),
                              a.to(DEV))[1]

    with torch.inference_mode():
        t = fresh()
        for tok in [int(prompt[-1])] + path:
            ref = forward(t, [tok], [-1])[0].clone()
            t.compact(1, [0])
        rows = []
        for n_decoys, width in ((0, 0), (3, 1), (9, 3), (30, 2)):
            toks, pars, chain = [int(prompt[-1])], [-1], [0]
            for tok in path:
                for _ in range(width):
                    toks.append(int(rng.integers(0, 512)))
                    pars.append(chain[-1])
                toks.append(tok)
                pars.append(chain[-1])
                chain.append(len(toks) - 1)
            while len(toks) < len(path) + 1 + n_decoys:
                toks.append(int(rng.integers(0, 512)))
                pars.append(int(rng.integers(0, len(toks) - 1)))
            rows.append(forward(fresh(), toks, pars)[chain[-1]].clone())
    return ref, rows


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", ["random-llama", "random-gemma3"])
def test_a_row_is_bitwise_the_same_alone_and_inside_trees_on_cuda(name, dtype):
    """Fixed-shape verification's promise on the device: a token's logits do not depend on the tree around
    it, for trees that cross a block boundary and trees that do not."""
    model = _model(name, dtype)
    rng = np.random.default_rng(4)
    for L in (BLOCK - 2, 3 * BLOCK + 1, 5 * BLOCK - 1):
        prompt = torch.as_tensor(rng.integers(0, 512, L))
        ref, rows = _row_alone_and_in_trees(model, prompt, rng.integers(0, 512, 4).tolist())
        for r in rows:
            assert torch.equal(r, ref), (L, float((r - ref).abs().max()))


LOSSLESS = [("pld", {}), ("recycling", {}), ("unispec", {"draft_size": 30}),
            ("layerskip", {"drafter_layers": "keep:0", "draft_size": 6}),
            ("eagle", {"eagle_head": "random", "draft_size": 20, "eagle_depth": 4}),
            ("eagle", {"eagle_head": "random", "draft_size": 20, "eagle_depth": 4, "vocab": "microspec"}),
            ("eagle", {"eagle_head": "random", "draft_size": 20, "eagle_depth": 4, "vocab": "oracle"})]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_method_equals_ar_on_cuda(name, dtype):
    """The sacred test on the device, graphs on (the default) and its kernels compiled (Triton, not the
    interpreter): every method's greedy output is `ar`'s, token for token."""
    model = _model(name, dtype)
    rng = np.random.default_rng(5)
    for ids in (rng.integers(0, 512, 20).tolist(), rng.integers(0, 512, 75).tolist()):
        ar = generate(model, ids, method="ar", max_new_tokens=48, eos_ids=[], backend="native")
        for method, kw in LOSSLESS:
            res = generate(model, ids, method=method, max_new_tokens=48, eos_ids=[], backend="native", w_max=128,
                           **kw)
            assert res.output_ids.tolist() == ar.output_ids.tolist(), (method, kw)
    if DEV.type == "cuda":
        assert native_model(model).graphs().captures > 0


def test_hf_and_native_ar_agree_on_cuda_in_fp32():
    model = _model("random-llama")
    ids = np.random.default_rng(6).integers(0, 512, 40).tolist()
    native = generate(model, ids, method="ar", max_new_tokens=40, eos_ids=[], backend="native")
    hf = generate(model, ids, method="ar", max_new_tokens=40, eos_ids=[], backend="hf")
    assert native.output_ids.tolist() == hf.output_ids.tolist()


def test_a_tree_beyond_the_device_rows_is_a_clear_error():
    model = _model("random-llama")
    t = NativeTarget(model, rows=DEVICE_ROWS if DEV.type == "cpu" else None)    # the device's default
    assert t.rows == DEVICE_ROWS
    t.begin(200)
    n = DEVICE_ROWS + 1
    parents = torch.arange(-1, n - 1) // 2
    parents[0] = -1
    d, a = tree_layout(parents)
    with torch.inference_mode():
        t.prefill(torch.arange(10, device=DEV), all_logits=False)
        with pytest.raises(BackendError, match="verify_rows"):
            t.forward_tree(torch.zeros(n, dtype=torch.long, device=DEV), parents.to(DEV), d.to(DEV), a.to(DEV))


def test_the_compiled_graphed_decode_keeps_rows_bitwise_and_methods_equal_to_ar():
    """SpecConfig.compile on the device: inductor's fused layer captured in the CUDA graphs. Compiled rows are
    not eager rows bitwise (fusion rounds differently), so compiled runs are compared with the compiled `ar`;
    one prompt length keeps the compiles few."""
    model = _model("random-llama", "bf16")
    prompt = torch.as_tensor(np.random.default_rng(4).integers(0, 512, BLOCK + 3))
    ids = prompt.tolist()
    ar = generate(model, ids, method="ar", max_new_tokens=20, eos_ids=[], compile=True)
    for method, kw in [("unispec", {"draft_size": 30}), ("eagle", {"eagle_head": "random", "draft_size": 20,
                                                                   "eagle_depth": 4, "vocab": "microspec"})]:
        res = generate(model, ids, method=method, max_new_tokens=20, eos_ids=[], compile=True, w_max=128, **kw)
        assert res.output_ids.tolist() == ar.output_ids.tolist(), method
    if DEV.type == "cuda":
        assert any(key[2] for key in native_model(model).graphs().graphs)     # compiled graphs were captured
