"""LM-head micro-benchmark: full head vs packed head vs indexed head vs gather.

    python -m specvocab.kernels.bench [--json] [--quick] [--rows 1] [--repeats 5] [--mem-budget-gb 2.5] [--threads N]

For every (V, d, |I|): the full head over V rows, the packed head over |I| contiguous rows (MicroSpec),
the indexed head reading |I| rows of the full head through an index on every call (the "Indexed GEMM"
ablation), and the gather that fills the packed buffer (a full re-gather of |I| rows; MicroSpec's
incremental gather copies only the rows that entered, usually a few). Bytes moved per call are written
down first and printed next to the achieved GB/s and % of the bandwidth of a device-to-device copy
measured in the same run. Times are medians over repeats. A packed buffer of a few MB stays in the
CPU's last-level cache between calls, so its GB/s can exceed the DRAM copy "peak" (as it would during
decoding, where the same buffer serves every draft depth).

On CPU it times the torch reference path in fp32 (the Triton interpreter is not a timing target); on
CUDA the Triton kernels in fp16 and bf16, with cuBLAS/torch timings alongside. Weights over the memory
budget are skipped and reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from specvocab.kernels import hardware
from specvocab.kernels.gather import gather_rows
from specvocab.kernels.hardware import using_triton
from specvocab.kernels.head import indexed_head, indexed_head_ref, packed_head, packed_head_ref

VOCAB_SIZES = (49152, 128256, 262144)      # SmolLM2, Llama-3, Gemma-3
DIMS = (576, 640, 4096)                    # SmolLM2-135M, Gemma-3-270M, Llama-3-8B
ACTIVE = (1024, 3072, 8192, 32768)         # |I|: MicroSpec's W_max = 3072, FR-Spec's 32k
QUICK = dict(vocab_sizes=(49152, 262144), dims=(576, 640), actives=(1024, 3072), repeats=3)


def _time_cpu(fn: Callable[[], object], repeats: int) -> float:
    """Median ms per call; calls are batched so that one sample takes >= ~5 ms."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    number = max(1, min(200, int(5e-3 / max(once, 1e-7))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return 1e3 * statistics.median(samples)


def _time_cuda(fn: Callable[[], object], repeats: int) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=max(20, 10 * repeats), return_mode="median"))


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth (read + write), the practical peak for memory-bound kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = _time_cuda if device.type == "cuda" else _time_cpu
    ms = timer(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def bench_case(weight: torch.Tensor, h: torch.Tensor, active: int, repeats: int, timer, on_cuda: bool,
               full_ms: float, full_bytes: int, peak: float | None, gen: torch.Generator) -> dict:
    V, d = weight.shape
    s = weight.element_size()
    r = h.shape[0]
    idx = torch.randperm(V, generator=gen)[:active].to(weight.device)   # [|I|] active token ids, unordered
    tok_of_slot = idx.to(torch.int32)                                    # [|I|]
    slots = torch.arange(active, device=weight.device)                   # [|I|]
    packed = weight[idx].contiguous()                                    # [|I|, d]
    rec = {"v": V, "d": d, "active": active, "dtype": str(weight.dtype).removeprefix("torch."), "rows": r,
           "full_ms": full_ms}
    rec["packed_ms"] = timer(lambda: packed_head(h, packed, tok_of_slot), repeats)
    rec["indexed_ms"] = timer(lambda: indexed_head(h, weight, idx), repeats)
    rec["gather_ms"] = timer(lambda: gather_rows(weight, packed, slots, idx), repeats)
    if on_cuda:   # the same maths through cuBLAS / torch indexing, for reference
        rec["packed_torch_ms"] = timer(lambda: packed_head_ref(h, packed, tok_of_slot), repeats)
        rec["indexed_torch_ms"] = timer(lambda: indexed_head_ref(h, weight, idx), repeats)
    # bytes moved per call: weights read + activations read + fp32 logits written (+ indices)
    rec["full_bytes"] = full_bytes
    rec["packed_bytes"] = active * d * s + r * d * s + r * active * 4 + active * 4
    rec["indexed_bytes"] = active * d * s + r * d * s + r * active * 4 + active * 8
    rec["gather_bytes"] = 2 * active * d * s + active * 16
    for k in ("full", "packed", "indexed", "gather"):
        rec[f"{k}_gbps"] = _gbps(rec[f"{k}_bytes"], rec[f"{k}_ms"])
        if peak:
            rec[f"{k}_pct_peak"] = 100 * rec[f"{k}_gbps"] / peak
    rec["full_over_packed"] = full_ms / rec["packed_ms"]
    rec["indexed_over_packed"] = rec["indexed_ms"] / rec["packed_ms"]
    rec["full_over_gather_plus_packed"] = full_ms / (rec["gather_ms"] + rec["packed_ms"])
    return rec


def main(vocab_sizes=VOCAB_SIZES, dims=DIMS, actives=ACTIVE, rows: int = 1, repeats: int = 5,
         mem_budget_gb: float = 2.5, json_lines: bool = False, quick: bool = False, seed: int = 0,
         out=sys.stdout) -> list[dict]:
    if quick:
        vocab_sizes, dims, actives, repeats = (QUICK["vocab_sizes"], QUICK["dims"], QUICK["actives"],
                                               min(repeats, QUICK["repeats"]))
    on_cuda = hardware.HAS_CUDA
    device = hardware.DEVICE
    dtypes = (torch.float16, torch.bfloat16) if on_cuda else (torch.float32,)
    timer = _time_cuda if on_cuda else _time_cpu
    note = sys.stderr if json_lines else out
    # the practical peak: a device-to-device copy (on CPU a 256 MiB memcpy with the current threads)
    peak = copy_bandwidth_gbps(device, nbytes=(1 << 30) if on_cuda else (1 << 28), repeats=repeats)
    with using_triton(on_cuda):   # CPU: the torch reference path (the interpreter is no timing target)
        print(f"# kernels.bench: {hardware.describe()}; threads={torch.get_num_threads()}; rows={rows}; "
              f"median of {repeats}; copy peak {peak:.1f} GB/s" +
              ("" if on_cuda else "; CPU: torch reference path (not the Triton kernels), fp32"), file=note)
        gen = torch.Generator().manual_seed(seed)
        records = []
        if not json_lines:
            print(f"{'V':>7} {'d':>5} {'|I|':>6} {'dtype':>8} | {'full ms':>8} {'MB':>7} {'GB/s':>6} {'%pk':>4} | "
                  f"{'packed ms':>9} {'MB':>6} {'GB/s':>6} {'%pk':>4} | {'indexed ms':>10} {'GB/s':>6} | "
                  f"{'gather ms':>9} {'GB/s':>6} | {'full/packed':>11} {'idx/packed':>10}", file=out)
        for dtype in dtypes:
            for V in vocab_sizes:
                for d in dims:
                    nbytes = V * d * torch.tensor([], dtype=dtype).element_size()
                    if nbytes > mem_budget_gb * 2**30:
                        print(f"# skipped V={V} d={d} {dtype}: weight {nbytes / 2**30:.1f} GiB > budget "
                              f"{mem_budget_gb} GiB (--mem-budget-gb)", file=note)
                        continue
                    weight = torch.empty(V, d, dtype=dtype, device=device).uniform_(-0.05, 0.05)
                    h = torch.randn(rows, d, generator=gen).to(device=device, dtype=dtype)
                    full_ms = timer(lambda: h @ weight.T, repeats)
                    s = weight.element_size()
                    out_size = s if on_cuda else 4
                    full_bytes = V * d * s + rows * d * s + rows * V * out_size
                    for active in actives:
                        if active > V:
                            continue
                        rec = bench_case(weight, h, active, repeats, timer, on_cuda, full_ms, full_bytes, peak, gen)
                        rec["device"] = torch.cuda.get_device_name() if on_cuda else "cpu"
                        rec["backend"] = "triton" if on_cuda else "torch"
                        records.append(rec)
                        if json_lines:
                            print(json.dumps(rec), file=out, flush=True)
                        else:
                            print(f"{V:>7} {d:>5} {active:>6} {rec['dtype']:>8} | {full_ms:>8.3f} "
                                  f"{full_bytes / 1e6:>7.1f} {rec['full_gbps']:>6.1f} {rec['full_pct_peak']:>4.0f} | "
                                  f"{rec['packed_ms']:>9.4f} {rec['packed_bytes'] / 1e6:>6.2f} "
                                  f"{rec['packed_gbps']:>6.1f} {rec['packed_pct_peak']:>4.0f} | "
                                  f"{rec['indexed_ms']:>10.4f} {rec['indexed_gbps']:>6.1f} | "
                                  f"{rec['gather_ms']:>9.4f} {rec['gather_gbps']:>6.1f} | "
                                  f"{rec['full_over_packed']:>10.1f}x {rec['indexed_over_packed']:>9.2f}x",
                                  file=out, flush=True)
                    del weight
    return records


def cli(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m specvocab.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON record per line on stdout")
    p.add_argument("--quick", action="store_true", help="a few shapes, 3 repeats")
    p.add_argument("--rows", type=int, default=1, help="rows of h (1 = draft depth 0; EAGLE-2 depths use 10)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mem-budget-gb", type=float, default=2.5, help="skip weights larger than this")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: as set); 1 is steadier on a shared machine")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    return main(rows=a.rows, repeats=a.repeats, mem_budget_gb=a.mem_budget_gb, json_lines=a.json, quick=a.quick)


if __name__ == "__main__":
    cli()
