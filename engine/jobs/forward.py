"""Forward benchmark: what one target forward of n new tokens costs, against this machine's limit.

    python -m specvocab.engine.jobs.forward --model smollm2-135m-instruct --dtype fp32,bf16
    python -m specvocab.engine.jobs.forward --device cuda --dtype bf16 --random-weights --model DIR_WITH_CONFIG_JSON

Per model, dtype, threads and backend it prints, in one run on one machine:
- ms per forward of n = 1, 2, 4, 8, 16, 32 new tokens over a `--context`-token KV cache (median of --repeats,
  taken round-robin over the sizes, so a shared machine's slow spells fall on every n alike);
- achieved GB/s (weight bytes / time) and its share of the copy-bandwidth bound measured in the same run
  (a `--copy-mb` tensor copy at the same thread count: weights must at least be read once per forward);
- the bare-matmul time of the same weight matrices (`F.linear` over every layer's packed matrices and the
  LM head, nothing else; on a CPU also the small-row kernel's, kernels.cpu, over the same weights, in bf16
  or fp32), and forward / bare matmul of the path the backend ran;
- verify(n) / verify(1);
- ar tokens/s: a greedy `ar` decode of `--ar-tokens` tokens on `native` at each thread count (by default 1 and 2),
  against the copy bound in tokens/s (the copy bandwidth measured at that thread count / the weight bytes a
  token reads), and 2 threads' tokens/s over 1 thread's.
Backends: `hf` (transformers, the reference), `native` (engine.native, fixed-shape verification: rows padded to
the bucket, so n = 1 runs at 4 rows - except on a CPU where the kernels of kernels.cpu run, and a forward takes
exactly its n rows: bf16 with AVX512-BF16, fp32 with AVX-512F or AVX2 + FMA; `kernel_isa` in the table names the
build of kernels.cpu's chain, and `SPECVOCAB_CPU_ISA=avx2` times what a CPU without AVX-512 runs), `native-blas`
(the same with oneDNN's `F.linear` and the torch attention, `SpecConfig.cpu_kernels=False`), `native-compiled`
(the same under torch.compile, `SpecConfig.compile`; its first forward per bucket, the compile, is printed apart as
`compile s`), `native-graph` (the fixed-shape forward replayed as a CUDA graph: the default on CUDA; its captures are in
`compile s` too) and `native-sdpa` (engine.native without the fixed shape). On an accelerator the fixed-shape
backends run every n at the one row count a decode there uses (`engine.target.DEVICE_ROWS`), as a decode would;
the bound is a device-memory copy, and every time is taken after a device synchronize. `--random-weights` times a
model of the named architecture with random weights (`engine.models.load_architecture`): same cost, no weights
needed.
Results go to `--out` as Parquet when given. Timings, not asserts: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import sys
import time

import polars as pl
import torch
import torch.nn.functional as F

from specvocab.engine.harness import generate
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, check_out, parse_ints, run_main
from specvocab.engine.models import load_architecture, load_model
from specvocab.engine.native import row_invariance as native_row_invariance, weight_bytes
from specvocab.engine.target import DEVICE_ROWS, make_target, native_model
from specvocab.kernels import cpu
from specvocab.kernels.hardware import parse_device, parse_dtype
from specvocab.engine.verify import tree_layout

SIZES = (1, 2, 4, 8, 16, 32)
BACKENDS = ("hf", "native", "native-blas", "native-compiled", "native-graph", "native-compiled-graph", "native-sdpa")
GRAPHED = ("native-graph", "native-compiled-graph")


def target_options(backend: str) -> dict:
    """The `make_target` / `generate` options of one of BACKENDS (the benchmark's names, `backend_label`'s)."""
    return dict(backend="hf" if backend == "hf" else "native", fixed_shape=backend != "native-sdpa",
                compile="compiled" in backend, cuda_graphs=backend in GRAPHED,
                cpu_kernels=backend != "native-blas")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(mb: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """GB/s of a tensor copy (read + write counted once each) at the current thread count, or in the
    device's memory: the bound."""
    device = torch.device(device)
    src = torch.empty(mb << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + (device.type != "cpu")):               # on a GPU the first copy warms up
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def _median(fn, repeats: int, device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """(median seconds of `repeats` calls, seconds of the warm-up call before them), each synchronized."""
    _sync(device)
    t0 = time.perf_counter()
    fn()                                                         # warm-up (and compile / capture)
    _sync(device)
    first = time.perf_counter() - t0
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], first


def forward_step(model, backend: str, n: int, context: int):
    """A function running one forward of an n-node chain over a `context`-token cache on `backend` (the cache
    is not advanced), its target prefilled."""
    t = make_target(model, **target_options(backend))
    device = next(model.parameters()).device
    t.begin(context + 64)
    g = torch.Generator().manual_seed(0)
    V = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, V, (context,), generator=g).to(device)
    tokens = torch.randint(0, V, (n,), generator=g).to(device)
    parents = torch.arange(-1, n - 1)
    depths, anc = (x.to(device) for x in tree_layout(parents))
    parents = parents.to(device)
    with torch.inference_mode():
        t.prefill(prompt, all_logits=False)

    @torch.inference_mode()
    def step():
        t.forward_tree(tokens, parents, depths, anc)
        if backend == "hf":                                      # the HF cache grows: drop the n entries again
            t.compact(n, [])
    return step


def forward_ms(model, backend: str, sizes, context: int, repeats: int) -> dict[int, tuple[float, float]]:
    """{n: (median ms of one forward of an n-node chain over a `context`-token cache, seconds of the first
    forward: the compile for `native-compiled`, the capture for `native-graph`)} for each n of `sizes`. After
    each n's first forward, the repeats run round-robin over the sizes (n = 1, 2, .., then again), so a slow
    spell of a shared machine falls on every n alike and verify(n) / verify(1) compares like with like."""
    device = next(model.parameters()).device
    steps = {n: forward_step(model, backend, n, context) for n in sizes}
    first, times = {}, {n: [] for n in sizes}
    for n, step in steps.items():
        _sync(device)
        t0 = time.perf_counter()
        step()                                                   # warm-up (and compile / capture)
        _sync(device)
        first[n] = time.perf_counter() - t0
    for _ in range(repeats):
        for n, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[n].append(time.perf_counter() - t0)
    return {n: (sorted(v)[len(v) // 2] * 1e3, first[n]) for n, v in times.items()}


def bare_matmul_ms(model, n: int, repeats: int, kernel: bool = False) -> float:
    """Median ms of F.linear over every weight matrix a forward reads (packed as the native path packs them),
    or with `kernel` of the CPU small-row kernel over the same weights in its layout (kernels.cpu;
    the LM head in fp32 as the forward runs it)."""
    net = native_model(model)
    mats = [m for L in net.layers for m in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w)]
    x = {d: torch.randn(n, d, dtype=net.dtype, device=net.device)
         for d in {m.shape[1] for m in mats} | {net.head_w.shape[1]}}
    if kernel:
        net.use_cpu_kernels(True)
        packs = [k for L in net.layers for k in L.kernel.values()]

        def run():
            for k in packs:
                k(x[k.in_features])
            net.head_kernel(x[net.head_w.shape[1]], torch.float32)
    else:
        def run():
            for m in mats:
                F.linear(x[m.shape[1]], m)
            F.linear(x[net.head_w.shape[1]], net.head_w)
    with torch.inference_mode():
        return _median(run, repeats, net.device)[0] * 1e3


def decode_tok_s(model, backend: str, context: int, new_tokens: int) -> float:
    """Tokens per second of a greedy `ar` decode (`engine.generate`: the harness's one sync per step
    included, the prefill not) of `new_tokens` after a random `context`-token prompt, on `backend`; one
    warm-up decode first (compiles, captures)."""
    V = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, V, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(method="ar", eos_ids=[], **target_options(backend))
    generate(model, prompt, max_new_tokens=new_tokens, **kw)
    res = generate(model, prompt, max_new_tokens=new_tokens, **kw)
    return res.output_ids.numel() / (res.wall_s - res.prefill_s)


def row_invariance(model) -> dict[str, list[int]]:
    """For each distinct weight shape a forward reads (and the LM head): the row counts M at which
    `F.linear(x[:M], W)` does not give a row the bits it has at the largest M (`engine.native.row_invariance`,
    whose floor the CPU's fixed-shape decode uses without the kernels, `engine.native.row_floor`)."""
    return native_row_invariance(native_model(model).linear_weights())


def print_ar_scaling(ar: list[dict]) -> None:
    """Each `ar` row of this run (native, per model, dtype and thread count): tokens/s against the copy bound at
    its thread count, and against 1 thread's tokens/s (the target on a CPU with matrix units: 2 threads >= 1.7x).
    Printed, never asserted."""
    print("\nar tokens/s by thread count (measured above, in this run):")
    one = {(r["model"], r["dtype"]): r["tok_s"] for r in ar if r["threads"] == 1}
    for r in ar:
        base = one.get((r["model"], r["dtype"]))
        scale = f"; {r['tok_s'] / base:.2f}x 1 thread's" if base and r["threads"] > 1 else ""
        print(f"  {r['model']}, {r['dtype']}, {r['threads']} thread(s): {r['tok_s']:.1f} tokens/s, "
              f"{100 * r['tok_s'] / r['bound_tok_s']:.0f}% of the copy bound ({r['bound_tok_s']:.1f} tokens/s){scale}")


def print_targets(rows: list[dict]) -> None:
    """The forward's targets, from this run's rows: an `ar` step (n = 1) on native bf16 against hf fp32
    (>= 2x), the native forward against its bare matmuls (<= 1.25x; the bare matmuls of the path it ran),
    verify(8) / verify(1) <= 1.15 and verify(16) / verify(1) <= 1.4 on native bf16, and the stretch: a
    one-token native bf16 forward at >= 50% of the copy bound. Printed, never asserted; only what this run
    measured."""
    if not rows:
        return
    frame = pl.DataFrame(rows)
    ms = {(r["model"], r["threads"], r["dtype"], r["backend"], r["n"]): r["ms"] for r in frame.iter_rows(named=True)}
    bare = {(r["model"], r["threads"], r["dtype"], r["n"]): r["bare_ms"] for r in frame.iter_rows(named=True)
            if r["backend"] in ("hf", "native")}
    bound = {(r["model"], r["threads"], r["dtype"]): r["weight_bytes"] / r["copy_gbs"] / 1e6
             for r in frame.iter_rows(named=True)}
    verdict = (lambda ok: "met" if ok else "MISSED")
    print("\ntargets (measured above, in this run):")
    for model, threads in frame.select("model", "threads").unique(maintain_order=True).iter_rows():
        nb = lambda n: ms.get((model, threads, "bf16", "native", n))
        hf32 = ms.get((model, threads, "fp32", "hf", 1))
        if nb(1) and hf32:
            r = hf32 / nb(1)
            print(f"  {model}, {threads} thread(s): ar step native bf16 {nb(1):.1f} ms vs hf fp32 {hf32:.1f} ms = "
                  f"{r:.2f}x (>= 2x {verdict(r >= 2)}; the bare matmuls alone give "
                  f"{bare[(model, threads, 'fp32', 1)] / bare[(model, threads, 'bf16', 1)]:.2f}x)")
        nf = ms.get((model, threads, "fp32", "native", 1))
        if nf and hf32:
            print(f"  {model}, {threads} thread(s): ar step native fp32 {nf:.1f} ms vs hf fp32 {hf32:.1f} ms = "
                  f"{hf32 / nf:.2f}x (no target: what a CPU without bf16 dot products runs by default)")
        if nb(1):
            r = nb(1) / bare[(model, threads, "bf16", 1)]
            print(f"  {model}, {threads} thread(s): native bf16 forward / bare matmuls (n=1) = {r:.2f} "
                  f"(<= 1.25 {verdict(r <= 1.25)})")
        for n, goal in ((8, 1.15), (16, 1.4)):
            if nb(1) and nb(n):
                r = nb(n) / nb(1)
                print(f"  {model}, {threads} thread(s): native bf16 verify({n}) / verify(1) = {r:.2f} "
                      f"(<= {goal} {verdict(r <= goal)})")
        if nb(1):
            r = bound[(model, threads, "bf16")] / nb(1)
            print(f"  {model}, {threads} thread(s): native bf16 one-token forward at {100 * r:.0f}% of the copy "
                  f"bound (stretch >= 50% {verdict(r >= 0.5)})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_argument_group("what to measure")
    g.add_argument("--model", default="smollm2-135m-instruct", help="model name (engine.models.load_model), or with "
                   "--random-weights a folder with its config.json")
    g.add_argument("--random-weights", action="store_true", help="random weights of the model's architecture "
                   "(engine.models.load_architecture): the same cost without the weights")
    g.add_argument("--device", default=None, help="cpu | cuda (default: this machine's, kernels.hardware)")
    g.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes")
    g.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    g.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {BACKENDS}")
    g.add_argument("--sizes", default=",".join(map(str, SIZES)), help="new tokens per forward")
    g = ap.add_argument_group("how")
    g.add_argument("--context", type=int, default=400, help="tokens already in the KV cache")
    g.add_argument("--repeats", type=int, default=5, help="forwards per point (median)")
    g.add_argument("--copy-mb", type=int, default=256, help="size of the bandwidth-bound copy")
    g.add_argument("--decode", type=int, default=0, help="also time a whole greedy ar decode of this many "
                   "tokens per backend (tokens/s; 0 = no)")
    g.add_argument("--ar-tokens", type=int, default=32, help="tokens of the ar decode timed on `native` at each "
                   "thread count, against the copy bound (0 = no)")
    g.add_argument("--out", default=None, help="write the table here as Parquet (the decode table beside it, "
                   "<out stem>.decode.parquet)")
    add_debug(ap)
    a = ap.parse_args(argv)
    # every argument checked before the first model loads (a bad second dtype would stop it after the first)
    check_model(a.model)
    sizes, thread_counts = parse_ints("--sizes", a.sizes), parse_ints("--threads", a.threads)
    dtypes = [d for d in a.dtype.split(",") if d]
    for d in dtypes:
        parse_dtype(d)
    for flag, value, least in (("--context", a.context, 0), ("--repeats", a.repeats, 1),
                               ("--copy-mb", a.copy_mb, 1), ("--decode", a.decode, 0), ("--ar-tokens", a.ar_tokens, 0)):
        check_at_least(flag, value, least)
    if a.out:
        check_out("--out", a.out, file=True)
    rows, decodes, ar = [], [], []
    device = parse_device(a.device)
    on_device = device.type != "cpu"
    unknown = [b for b in a.backends.split(",") if b not in BACKENDS]
    if unknown:                                              # a typo would otherwise time `native` under its name
        ap.error(f"unknown backend(s) {', '.join(map(repr, unknown))}: --backends takes {', '.join(BACKENDS)} "
                 f"(the dtype is --dtype, e.g. --backends hf,native --dtype fp32,bf16)")
    backends = [b for b in a.backends.split(",") if on_device or b not in GRAPHED]   # graphs: CUDA only
    for dtype in dtypes:
        loader = load_architecture if a.random_weights else load_model
        model, _, info = loader(a.model, dtype=dtype, device=device)
        wbytes = weight_bytes(native_model(model))
        for threads in thread_counts:
            torch.set_num_threads(threads)
            bw = copy_bandwidth(a.copy_mb, device=device)
            bound_ms = wbytes / bw / 1e6
            bare = {n: bare_matmul_ms(model, n, a.repeats) for n in sizes}
            why_not = cpu.linear_reason(device, native_model(model).dtype)
            bare_k = {n: bare_matmul_ms(model, n, a.repeats, kernel=True) for n in sizes} if why_not is None else {}
            op = "linear_bf16" if native_model(model).dtype == torch.bfloat16 else "linear_f32"
            build = cpu.provider(op).name if bare_k else None                  # kernels.cpu's build that runs
            where = (torch.cuda.get_device_name(device) if device.type == "cuda" else f"{threads} thread(s)")
            print(f"\n{info.name} {dtype}, {where}, {a.context}-token cache: weights {wbytes / 1e6:.0f} MB, "
                  f"copy bandwidth {bw:.1f} GB/s -> bound {bound_ms:.3f} ms per forward"
                  + (f"; fixed-shape backends run {DEVICE_ROWS} rows for every n (a decode there does)"
                     if on_device else ""))
            print(f"{'backend':15s} " + " ".join(f"{'n=' + str(n):>8s}" for n in sizes)
                  + "   GB/s(n=1)  %bound  fwd/bare(n=1)  v8/v1  v16/v1")
            fmt = "8.3f" if on_device else "8.1f"
            inv = row_invariance(model)
            print("row bits of F.linear vs M (rows at M rows against M = 128): " + "; ".join(
                f"{k}: {'same for every M' if not v else 'differs at M = ' + ','.join(map(str, v))}"
                for k, v in inv.items()))
            print(f"{'bare matmul':15s} " + " ".join(f"{bare[n]:{fmt}}" for n in sizes) + "   (F.linear)")
            if bare_k:
                print(f"{'bare kernel':15s} " + " ".join(f"{bare_k[n]:{fmt}}" for n in sizes)
                      + f"   (kernels.cpu, its {build} build: what `native` runs; `native-blas` runs F.linear)")
            elif dtype in ("bf16", "bfloat16") and not on_device:
                print(f"(no CPU small-row kernel here: {why_not}; `native` runs F.linear)")
            for backend in backends:
                if backend == "native-blas" and not bare_k:
                    continue                                     # the same as `native` where the kernel is off
                path_bare = bare_k if (bare_k and backend == "native") else bare
                timed = forward_ms(model, backend, sizes, a.context, a.repeats)
                ms = {n: v[0] for n, v in timed.items()}
                first = sum(v[1] for v in timed.values())
                gbs = wbytes / (ms[sizes[0]] / 1e3) / 1e9
                ratio = lambda k: (f"{ms[k] / ms[sizes[0]]:6.2f}" if k in ms else "     -")
                print(f"{backend:15s} " + " ".join(f"{ms[n]:{fmt}}" for n in sizes)
                      + f"   {gbs:9.1f}  {100 * gbs / bw:5.0f}%  {ms[sizes[0]] / path_bare[sizes[0]]:13.2f}  "
                      f"{ratio(8)}  {ratio(16)}"
                      + (f"   compile {first:.1f} s" if "compiled" in backend or backend in GRAPHED else ""))
                if a.decode:
                    tps = decode_tok_s(model, backend, a.context, a.decode)
                    print(f"{'':15s} ar decode of {a.decode} tokens after {a.context}: {tps:.1f} tokens/s")
                    decodes.append(dict(model=info.name, device=str(device), dtype=dtype, threads=threads,
                                        backend=backend, kernel_isa=build if backend == "native" else None,
                                        context=a.context, new_tokens=a.decode, tok_s=tps,
                                        bound_tok_s=bw * 1e9 / wbytes))
                for n in sizes:
                    rows.append(dict(model=info.name, device=str(device), dtype=dtype, threads=threads,
                                     backend=backend, kernel_isa=build if backend == "native" else None, n=n,
                                     context=a.context, ms=ms[n], bare_ms=path_bare[n], weight_bytes=wbytes,
                                     copy_gbs=bw, gbs=wbytes / (ms[n] / 1e3) / 1e9, first_s=timed[n][1]))
            if a.ar_tokens and "native" in backends:      # the decode's own path, at this thread count
                tps = decode_tok_s(model, "native", a.context, a.ar_tokens)
                bound_tps = bw * 1e9 / wbytes                                   # a token reads every weight once
                print(f"ar tokens/s (native, {threads} thread(s), {a.ar_tokens} tokens after {a.context}): "
                      f"{tps:.1f}, {100 * tps / bound_tps:.0f}% of the copy bound ({bound_tps:.1f} tokens/s at "
                      f"{bw:.1f} GB/s)")
                ar.append(dict(model=info.name, device=str(device), dtype=dtype, threads=threads, backend="native",
                               kernel_isa=build, context=a.context, new_tokens=a.ar_tokens, tok_s=tps,
                               bound_tok_s=bound_tps))
        del model
    print_targets(rows)
    if ar:
        print_ar_scaling(ar)
    decodes += ar
    if a.out:
        pl.DataFrame(rows).write_parquet(a.out)
        print(f"\nwrote {a.out}")
        if decodes:
            path = a.out.removesuffix(".parquet") + ".decode.parquet"
            pl.DataFrame(decodes).write_parquet(path)
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(run_main(main))
