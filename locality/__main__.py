"""`python -m specvocab.locality {coverage,lru,successor} TRACES ...`: print locality tables of recorded traces.

- coverage : MicroSpec window coverage / mean active vocab per `--by` group and w_max (`coverage_report`)
- lru      : LRU vocabulary vs FIFO window at equal mean size (`miss_ratio_curves`)
- successor: UniSpec store coverage for k = 1..K (`successor_coverage`)
`--out FILE.parquet` also writes the (tidy) frame. TRACES is a trace Parquet file or a folder of them.
`--event-order engine` replays the live drafter's per-step window on speculative traces (`locality.stream`).
"""

from __future__ import annotations

import argparse

import polars as pl

from specvocab.locality.coverage import REPORT_W, coverage_by, coverage_report
from specvocab.locality.successor import successor_coverage
from specvocab.locality.temporal import DEFAULT_CAPACITIES, miss_ratio_curves
from specvocab.locality.trace import read_traces


def main(argv=None) -> pl.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m specvocab.locality", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["coverage", "lru", "successor"])
    ap.add_argument("traces", help="trace Parquet file or folder")
    ap.add_argument("--by", default="category", help="meta column to group by (category, language, model, ...)")
    ap.add_argument("--w-max", type=int, nargs="+", default=list(REPORT_W))
    ap.add_argument("--capacity", type=int, nargs="+", default=list(DEFAULT_CAPACITIES))
    ap.add_argument("--k-pre", type=int, default=3)
    ap.add_argument("--k-ver", type=int, default=3)
    ap.add_argument("--sources", default="ctx+ext", choices=["ctx+ext", "ctx", "ext"])
    ap.add_argument("--prefill-order", default="first", choices=["first", "last"])
    ap.add_argument("--event-order", default="token", choices=["token", "engine"],
                    help="token: the window moves after every token; engine: after every recorded step, as "
                         "the live drafter's (see locality.stream)")
    ap.add_argument("--persist", action="store_true", help="successor: one store per model across traces")
    ap.add_argument("--out", help="write the tidy frame to this Parquet file")
    a = ap.parse_args(argv)
    traces = read_traces(a.traces)
    kw = dict(k_pre=a.k_pre, k_ver=a.k_ver, sources=a.sources, prefill_order=a.prefill_order,
              event_order=a.event_order)
    if a.what == "coverage":
        coverage_report(traces, a.w_max, a.by, **kw)
        frame = coverage_by(traces, [a.by], a.w_max, **kw)
    elif a.what == "lru":
        frame = miss_ratio_curves(traces, a.capacity, by=[a.by], **kw)
    else:
        frame = successor_coverage(traces, persist=a.persist, by=[a.by])
    if a.what != "coverage":
        with pl.Config(tbl_cols=-1, tbl_rows=-1, tbl_width_chars=200, float_precision=3):
            print(frame)
    if a.out:
        frame.write_parquet(a.out)
        print(f"wrote {a.out}")
    return frame


if __name__ == "__main__":
    main()
