"""The forward job (`python -m specvocab.engine.jobs.forward`): what it prints about ar decoding at each thread
count. Its tables, targets and argument checks are tested in tests/test_native.py.

Mutants checked (each fails the test here): the ar bound taken from a second copy measurement instead of the
forward table's; the default thread counts back to 1 only.
"""

from __future__ import annotations

import polars as pl


def test_the_forward_benchmark_prints_ar_tokens_per_second_at_1_and_2_threads_against_that_runs_bound(tmp_path,
                                                                                                    capsys):
    """By default 1 and 2 threads; at each, an `ar` decode's tokens/s on `native` beside the copy bound in tokens/s
    (the copy bandwidth measured at that thread count in the same run / the weight bytes a token reads: the
    forward table's `copy_gbs` and `weight_bytes`), and 2 threads' tokens/s over 1 thread's."""
    from specvocab.engine.jobs import forward
    out = tmp_path / "fwd.parquet"
    forward.main(["--model", "random-llama", "--dtype", "bf16", "--backends", "native", "--sizes", "1",
                  "--context", "40", "--repeats", "1", "--copy-mb", "8", "--ar-tokens", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    table, ar = pl.read_parquet(out), pl.read_parquet(tmp_path / "fwd.decode.parquet")
    assert sorted(table["threads"].unique()) == [1, 2] and ar["threads"].to_list() == [1, 2]
    for r in ar.iter_rows(named=True):
        fwd = table.filter(pl.col("threads") == r["threads"]).row(0, named=True)
        assert r["bound_tok_s"] == fwd["copy_gbs"] * 1e9 / fwd["weight_bytes"] and r["tok_s"] > 0
        assert r["new_tokens"] == 4 and r["backend"] == "native"
        line = (f"ar tokens/s (native, {r['threads']} thread(s), 4 tokens after 40): {r['tok_s']:.1f}, "
                f"{100 * r['tok_s'] / r['bound_tok_s']:.0f}% of the copy bound ({r['bound_tok_s']:.1f} tokens/s")
        assert line in printed
    ratio = ar["tok_s"][1] / ar["tok_s"][0]
    assert f"2 thread(s): {ar['tok_s'][1]:.1f} tokens/s" in printed and f"{ratio:.2f}x 1 thread's" in printed
