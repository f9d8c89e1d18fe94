"""Command-line helpers shared by the jobs: a config dataclass's fields as `--flags`."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def add_fields(parser: argparse.ArgumentParser, cls, skip) -> None:
    """One `--flag` per field of dataclass `cls` (not in `skip`), typed and defaulted from the field; tuples and
    the `languages` / `tasks` filters are comma-separated (`split_csv`)."""
    for fld in dataclasses.fields(cls):
        if fld.name in skip:
            continue
        default = fld.default
        flag = "--" + fld.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default)
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            parser.add_argument(flag, type=type(default), default=default, help=f"default {default}")
        elif isinstance(default, tuple) or fld.name in ("languages", "tasks"):
            parser.add_argument(flag, default=default, help=f"comma-separated; default {default}")
        else:
            typ = int if fld.type.startswith("int") else float if fld.type.startswith("float") else str
            parser.add_argument(flag, type=typ, default=default, help=f"default {default}")


def split_csv(v):
    """"a,b" -> ("a", "b"); a tuple stays as it is."""
    return tuple(x for x in v.split(",") if x) if isinstance(v, str) else v


def config_main(argv, *, prog: str, description: str, cls, run, skip, errors=()):
    """`main(argv)` of a job that is one config dataclass and one function: `--model` plus a flag per field of
    `cls` (not in `skip`) and `--no-progress`; `run(cls(...))`'s result is returned; an error of `errors`
    exits with its message."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--model", required=True)
    add_fields(ap, cls, skip)
    ap.add_argument("--no-progress", action="store_true")
    args = vars(ap.parse_args(argv))
    progress = not args.pop("no_progress")
    try:
        return run(cls(**args, progress=progress))
    except errors as err:
        sys.exit(f"error: {err}")
