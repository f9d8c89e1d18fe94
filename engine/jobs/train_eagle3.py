"""Train an EAGLE-3 draft head on a data folder made by `engine.jobs.eagle_data --eagle3-features`.

    python -m specvocab.engine.jobs.eagle_data --model smollm2-135m-instruct --source greedy --eagle3-features
    python -m specvocab.engine.jobs.train_eagle3 --model smollm2-135m-instruct --tokens 2000000 --out <dir>
    specvocab train eagle3 --model smollm2-135m-instruct ...                # the same

The recipe (draft vocabulary, training-time test, loss, and where it differs from the official EAGLE-3 code) is
`engine.train.eagle3`; the loop, checkpoints and resume are `engine.train.loop`. Options: the fields of
`engine.train.eagle3.Train3Config`.
"""

from __future__ import annotations

import sys

from specvocab.engine.jobs.args import config_job, run_main
from specvocab.engine.train.eagle3 import Train3Config, train_eagle3

main = config_job("specvocab.engine.jobs.train_eagle3", __doc__, Train3Config, train_eagle3,
                  skip={"model", "betas", "progress"})

if __name__ == "__main__":
    sys.exit(run_main(main))
