"""What an EAGLE-3 training step costs on this machine, against its GEMM bound.

    python -m specvocab.engine.jobs.train_speed --model smollm2-135m-instruct --data DIR --threads 1

Packing (padded rows and attention scores of random against length-grouped batches), then one step's forward
and backward in fp32 and under bf16 autocast, interleaved, with the matmul bound measured in the same run
(`engine.train.speed`). Options: the fields of `engine.train.speed.SpeedConfig`.
"""

from __future__ import annotations

import sys

import polars as pl

from specvocab.engine.jobs.args import config_main, run_main
from specvocab.engine.train.speed import SpeedConfig, train_speed


def main(argv: list[str] | None = None) -> pl.DataFrame:
    return config_main(argv, prog="python -m specvocab.engine.jobs.train_speed", description=__doc__.split("\n")[0],
                       cls=SpeedConfig, run=train_speed, skip={"model", "progress"})


if __name__ == "__main__":
    sys.exit(run_main(main))
