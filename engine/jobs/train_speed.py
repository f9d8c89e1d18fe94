"""What an EAGLE-3 training step costs on this machine, against its GEMM bound.

    python -m specvocab.engine.jobs.train_speed --model smollm2-135m-instruct --data DIR --threads 1

Packing (padded rows and attention scores of random against length-grouped batches), then one step's forward
and backward in fp32 and under bf16 autocast, interleaved, with the matmul bound measured in the same run
(`engine.train.speed`). Options: the fields of `engine.train.speed.SpeedConfig`.
"""

from __future__ import annotations

import sys

from specvocab.engine.jobs.args import config_job, run_main
from specvocab.engine.train.speed import SpeedConfig, train_speed

main = config_job("specvocab.engine.jobs.train_speed", __doc__, SpeedConfig, train_speed, skip={"model", "progress"})

if __name__ == "__main__":
    sys.exit(run_main(main))
