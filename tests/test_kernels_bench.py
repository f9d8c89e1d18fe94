"""specvocab.kernels.bench on tiny shapes: records, bytes accounting, skips (timings themselves are not asserted)."""

import io
import json

from specvocab.kernels import bench

KEYS = {"v", "d", "active", "dtype", "full_ms", "packed_ms", "indexed_ms", "gather_ms", "full_bytes",
        "packed_bytes", "indexed_bytes", "gather_bytes", "full_gbps", "packed_gbps", "full_over_packed"}


def test_json_records_and_bytes(capsys):
    out = io.StringIO()
    records = bench.main(vocab_sizes=(300,), dims=(33, 64), actives=(16, 200, 1000), rows=2, repeats=1,
                         json_lines=True, out=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == records and len(records) == 4          # |I| = 1000 > V = 300 is not a case
    header = capsys.readouterr().err
    assert "torch reference path" in header or "triton" in header
    for rec in records:
        assert KEYS <= rec.keys()
        s = 4 if rec["dtype"] == "float32" else 2
        assert rec["packed_bytes"] >= rec["active"] * rec["d"] * s
        assert rec["full_bytes"] >= rec["v"] * rec["d"] * s and rec["full_bytes"] > rec["packed_bytes"]
        assert rec["gather_bytes"] >= 2 * rec["active"] * rec["d"] * s
        assert abs(rec["packed_gbps"] - rec["packed_bytes"] / rec["packed_ms"] / 1e6) < 1e-6 * rec["packed_gbps"]
        assert all(rec[k] > 0 for k in ("full_ms", "packed_ms", "indexed_ms", "gather_ms"))


def test_weights_over_the_memory_budget_are_skipped_and_reported():
    out = io.StringIO()
    records = bench.main(vocab_sizes=(4096,), dims=(512,), actives=(64,), repeats=1, mem_budget_gb=0.001, out=out)
    assert records == []
    assert "skipped V=4096 d=512" in out.getvalue()
