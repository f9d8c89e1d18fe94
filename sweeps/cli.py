"""The `specvocab` command: one entry point whose verbs run the jobs and the sweeps.

    specvocab bench --model smollm2-135m-instruct --methods ar,unispec,eagle     # = python -m specvocab.engine.jobs.bench ...
    specvocab train data --model smollm2-135m-instruct                           # = python -m specvocab.engine.jobs.eagle_data
    specvocab sweep sweeps/configs/quick.toml --out results/quick                # = python -m specvocab.sweeps.run ...
    specvocab render results/quick                                               # = python -m specvocab.sweeps.render ...
    specvocab <verb> --help

Each verb hands the rest of the command line to its module's `main(argv)`; `python -m <module>` runs the same
code. The module is imported only when its verb runs, so `specvocab --help` loads neither torch nor Ray.

An error of the package (an unknown prompt set, model, method, a bad `--set`, ...) prints one line,
`error: <what is wrong and the fix>`, on stderr and exits 2 (`engine.jobs.args.run_main`); with `--debug`
anywhere before a `--` (or `SPECVOCAB_DEBUG=1`) it prints its traceback as well. A bug keeps its traceback.

It lives here, at the top of the layers (locality <- engine <- engine.jobs <- sweeps), because it is the one
place that dispatches to both the jobs and the sweeps; nothing imports it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from specvocab.engine.jobs.args import DEBUG_FLAG, run_main

# verb -> (module whose main(argv) runs it, one line for the help); a dict value groups sub-verbs
VERBS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "bench": ("specvocab.engine.jobs.bench", "Table 2 / methods benchmark: methods x vocabulary policies against ar"),
    "record": ("specvocab.engine.jobs.record", "record traces (prompt, generated tokens, the target's top-k) for coverage"),
    "coverage": ("specvocab.locality.__main__", "coverage report of recorded traces (pure, token-only)"),
    "calibrate": ("specvocab.engine.jobs.calibrate", "measure a drafting method's draft size g* on this machine (UniSpec App. F)"),
    "frequency": ("specvocab.engine.jobs.frequency", "FR-Spec frequency lists from the training corpus, with SGLang / EAGLE-3 "
                                           "exports"),
    "specbench": ("specvocab.engine.jobs.specbench", "Spec-Bench model-answer .jsonl files of a bench folder (a sweep folder: "
                                           "render writes them)"),
    "forward": ("specvocab.engine.jobs.forward", "the target's forward against the machine's copy bound and bare matmuls"),
    "train": {
        "data": ("specvocab.engine.jobs.eagle_data", "the target's features over training prompts, in resumable shards"),
        "eagle": ("specvocab.engine.jobs.train_eagle", "train an EAGLE-2 draft head on a data folder"),
        "eagle3": ("specvocab.engine.jobs.train_eagle3", "train an EAGLE-3 draft head (TTT, own draft vocabulary) on a data folder"),
        "speed": ("specvocab.engine.jobs.train_speed", "what an EAGLE-3 training step costs here, against the GEMM bound"),
    },
    "dynaspec": {
        "fit": ("specvocab.engine.jobs.fit_dynaspec", "fit DynaSpec's clusters and router for a model and drafter"),
        "choices": ("specvocab.engine.jobs.dynaspec_choices", "sweep M, router width and L on a fit's logged rows"),
    },
    "sweep": ("specvocab.sweeps.run", "run a sweep config on Ray (local, or --address of a cluster)"),
    "render": ("specvocab.sweeps.render", "draw every figure of a sweep folder (PNG + HTML + executed notebooks)"),
}


class CliError(ValueError):
    """An unknown verb; the message lists the known ones."""


def _usage(verbs: dict, prefix: str = "specvocab") -> str:
    lines = [f"usage: {prefix} [--debug] <verb> [args ...]   ({prefix} <verb> --help for a verb's options; --debug: "
             f"the traceback of an error too)", "", "verbs:"]
    for name, value in verbs.items():
        if isinstance(value, dict):
            for sub, (module, text) in value.items():
                lines.append(f"  {name + ' ' + sub:18s} {text}")
        else:
            lines.append(f"  {name:18s} {value[1]}")
    return "\n".join(lines)


def resolve(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(module, the arguments left for its main(argv)) for a command line; CliError naming the known verbs."""
    argv = list(argv)
    table: dict = VERBS
    named: list[str] = []
    while argv and argv[0] in table:
        named.append(argv.pop(0))
        value = table[named[-1]]
        if isinstance(value, tuple):
            return value[0], argv
        table = value
    said = " ".join(["specvocab", *named, *argv[:1]])
    raise CliError(f"unknown command {said!r}: choose one of {sorted(table)}\n\n"
                   + _usage(table, " ".join(["specvocab", *named])))


def split_debug(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(whether `--debug` is given, the arguments without it): the global flag may stand anywhere before a `--`."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    return DEBUG_FLAG in argv[:end], [a for a in argv[:end] if a != DEBUG_FLAG] + argv[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command line `[--debug] <verb> [args ...]`: the verb's module's `main(args)` under `run_main`;
    returns the exit status."""
    debug, argv = split_debug(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(VERBS))
        return 0
    try:
        module, rest = resolve(argv)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_main(importlib.import_module(module).main, rest, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
