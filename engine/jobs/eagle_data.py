"""Training data for draft heads: the target's features over training prompts, in resumable shards.

    python -m specvocab.engine.jobs.eagle_data --model smollm2-135m-instruct --source teacher,greedy --num-prompts 768
    python -m specvocab.engine.jobs.eagle_data --model smollm2-135m-instruct --num-prompts all --eagle3-features --no-store-features
    specvocab train data --model smollm2-135m-instruct ...                  # the same

What a sample holds, the batched prefill, the shards and how a rerun resumes: `engine.train.data`. Options: the
fields of `engine.train.data.DataConfig`; `--num-prompts all` takes every usable prompt of the corpus,
`--no-store-features` writes the tokens only (a training run then computes the features of each batch).
The heads are trained on it by `engine.jobs.train_eagle` and `engine.jobs.train_eagle3`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specvocab.engine.jobs.args import ArgumentError, add_debug, add_fields, check_model, check_out, run_main, split_csv
from specvocab.engine.train.data import DataConfig, make_data


def _num_prompts(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise ArgumentError(f"--num-prompts {text!r}: expected a number of prompts or 'all' — e.g. --num-prompts "
                            f"512") from None


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.eagle_data", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    # ---- what is made
    ap.add_argument("--source", default="teacher", help="teacher | greedy | teacher,greedy")
    ap.add_argument("--num-prompts", default="512", help="prompts used, held-out ones included, or 'all'")
    ap.add_argument("--no-store-features", action="store_true", help="tokens only: features computed in training")
    # ---- the rest of DataConfig
    add_fields(ap, DataConfig, {"model", "sources", "progress", "num_prompts", "store_features"})
    ap.add_argument("--no-progress", action="store_true")
    add_debug(ap)
    args = vars(ap.parse_args(argv))
    progress = not args.pop("no_progress")
    args["store_features"] = not args.pop("no_store_features")
    args["num_prompts"] = _num_prompts(args["num_prompts"])
    args["sources"] = split_csv(args.pop("source"))
    for k in ("languages", "tasks"):
        args[k] = split_csv(args[k]) if args[k] else None
    check_model(args["model"])
    if args["out"]:
        check_out("--out", args["out"])
    return make_data(DataConfig(**args, progress=progress))     # checks its settings and prompts, then loads


if __name__ == "__main__":
    sys.exit(run_main(main))
