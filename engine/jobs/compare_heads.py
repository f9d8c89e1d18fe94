"""tau of an EAGLE-2 head against an EAGLE-3 head at the same tree on held-out prompts.

    python -m specvocab.engine.jobs.compare_heads --model smollm2-135m-instruct --data DIR --prompts 24 --new-tokens 48

`ar`, `eagle` and `eagle3` (default: the heads shipped for the model) on the held-out prompts of an EAGLE-3 data
folder, greedy, one tree for both heads; tau, tokens/s and outputs equal to ar's per method
(`engine.train.compare`). Options: the fields of `engine.train.compare.CompareConfig`.
"""

from __future__ import annotations

import sys

from specvocab.engine.jobs.args import config_job, run_main
from specvocab.engine.train.compare import CompareConfig, compare_heads

main = config_job("specvocab.engine.jobs.compare_heads", __doc__, CompareConfig, compare_heads,
                  skip={"model", "progress"})

if __name__ == "__main__":
    sys.exit(run_main(main))
