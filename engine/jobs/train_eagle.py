"""Train an EAGLE-2 draft head on a data folder made by `engine.jobs.eagle_data`.

    python -m specvocab.engine.jobs.train_eagle --model smollm2-135m-instruct --tokens 2000000 --out engine/heads/smollm2-135m-instruct
    specvocab train eagle --model smollm2-135m-instruct ...                 # the same

The recipe (EAGLE §4.2-4.3, and where it differs from EAGLE's code) is `engine.train.eagle2`; the loop,
checkpoints and resume are `engine.train.loop`. Options: the fields of `engine.train.eagle2.TrainConfig`.
"""

from __future__ import annotations

import sys

from specvocab.engine.jobs.args import config_job, run_main
from specvocab.engine.train.eagle2 import TrainConfig, train_eagle

main = config_job("specvocab.engine.jobs.train_eagle", __doc__, TrainConfig, train_eagle,
                  skip={"model", "betas", "progress"})

if __name__ == "__main__":
    sys.exit(run_main(main))
