"""Command-line helpers shared by the jobs: a config dataclass's fields as `--flags`, the checks every job runs
on its arguments before a model loads, and `run_main`, which turns the package's own errors into one line.

Errors a person reads. A job's `main(argv)` raises; `run_main(main)` (each job's `python -m` entry, the
`specvocab` verbs, `sweeps.run`) prints an exception of a class the package defines - `BenchError`,
`PromptError`, `ModelError`, `ConfigError`, `SweepError`, `ArgumentError` below, ... each message naming the
problem and the fix - as `error: <message>` on stderr and exits 2, without a traceback; so does a main's own
`sys.exit("message")`. Anything else (a `TypeError`, an `IndexError` from torch) is a bug and keeps its
traceback. `--debug` or `SPECVOCAB_DEBUG=1` prints the traceback of the package's errors too. argparse's own
errors (`prog: error: ...` after the usage) exit 2 as they always do.

The checks (`check_model`, `check_out`, `check_at_least`, `parse_ints`) need no model, so each job runs them,
and loads its prompt set, before `load_model`: a typo costs a second, not the minutes an 8B model takes to load.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

from specvocab.engine.catalog import HUB_ID, known_models

DEBUG_ENV = "SPECVOCAB_DEBUG"
DEBUG_FLAG = "--debug"


class ArgumentError(ValueError):
    """A command-line argument is unusable; the message names it and the fix."""


# ---- flags -----------------------------------------------------------------------------------------------------

class _Debug(argparse.Action):
    """`--debug` parses and leaves no attribute: `run_main` reads it from the command line itself."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def add_debug(parser: argparse.ArgumentParser) -> None:
    """`--debug` in a job's parser (for its --help, and so that `main(argv)` accepts it; a direct call raises
    anyway). It sets nothing in the parsed arguments."""
    parser.add_argument(DEBUG_FLAG, action=_Debug,
                        help=f"print the traceback of an error, not just its message (also {DEBUG_ENV}=1)")


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


def config_job(module: str, doc: str, cls, run, skip):
    """The `main(argv=None)` of the job `module` (its `python -m` name) that is one config dataclass and one
    function (`config_main`), described by the first line of its docstring `doc`."""
    def main(argv: list[str] | None = None):
        return config_main(argv, prog=f"python -m {module}", description=doc.split("\n")[0], cls=cls, run=run,
                           skip=skip)
    return main


def config_main(argv, *, prog: str, description: str, cls, run, skip):
    """`main(argv)` of a job that is one config dataclass and one function: `--model` plus a flag per field of
    `cls` (not in `skip`), `--no-progress` and `--debug`; the model name and an `out` folder are checked before
    `run(cls(...))` (which checks its config before it loads a model); its result is returned."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--model", required=True)
    add_fields(ap, cls, skip)
    ap.add_argument("--no-progress", action="store_true")
    add_debug(ap)
    args = vars(ap.parse_args(argv))
    progress = not args.pop("no_progress")
    check_model(args["model"])
    if args.get("out"):
        check_out("--out", args["out"])
    return run(cls(**args, progress=progress))


# ---- checks that need no model -----------------------------------------------------------------------------------

def check_model(name: str, flag: str = "--model") -> str:
    """`name` if `engine.models.load_model` takes it - a known name (`engine.catalog.known_models`), an existing
    folder or a hub id `owner/name` - else ArgumentError, before the loader runs."""
    if name in known_models() or Path(name).expanduser().is_dir() or HUB_ID.match(name):
        return name
    raise ArgumentError(f"{flag} {name!r}: unknown model — pass one of {', '.join(known_models())}, a folder "
                        f"holding a model, or a hub id owner/name")


def check_out(flag: str, path: str | Path, *, file: bool = False) -> Path:
    """`path` - a folder a job writes into (made if missing), or with `file` a file it writes - can be written:
    the nearest part of it that exists is a writable folder (for a file: `path` itself is not a folder).
    ArgumentError naming the flag otherwise. Returns the path, user-expanded."""
    path = Path(path).expanduser()
    if file and path.is_dir():
        raise ArgumentError(f"{flag} {path}: is a folder — pass a file path to write")
    folder = path.parent if file else path
    here = folder
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise ArgumentError(f"{flag} {path}: {here} is a file, not a folder — pass a path under a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ArgumentError(f"{flag} {path}: {here} is not writable — pass a folder you can write to")
    return path


def check_at_least(flag: str, value, minimum: int) -> None:
    """ArgumentError unless `value` (an int, or None = the job's default) is >= `minimum`."""
    if value is not None and value < minimum:
        raise ArgumentError(f"{flag} {value}: below {minimum} — pass {flag} {minimum} or more")


def parse_ints(flag: str, text: str | None, minimum: int = 1) -> list[int] | None:
    """"1,2,4" -> [1, 2, 4] (None stays None); ArgumentError naming the flag for a word that is not an integer
    >= `minimum`, or for no number at all."""
    if text is None:
        return None
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    try:
        values = [int(w) for w in words]
    except ValueError:
        raise ArgumentError(f"{flag} {text!r}: expected comma-separated integers — e.g. {flag} 1,2,4") from None
    if not values or min(values) < minimum:
        raise ArgumentError(f"{flag} {text!r}: every value must be an integer >= {minimum} — e.g. {flag} 1,2,4")
    return values


# ---- running a main as a command ---------------------------------------------------------------------------------

def debugging() -> bool:
    """Whether tracebacks were asked for: `SPECVOCAB_DEBUG` set to anything but "" or "0" (`--debug` sets it for
    the duration of a `run_main`)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _package_module(cls: type) -> str:
    """The module that defines `cls`, by its import name: for a module run with `python -m` (as `__main__`), whose
    classes say `__main__`, the name it was run under."""
    name = cls.__module__
    if name == "__main__":
        spec = getattr(sys.modules.get(name), "__spec__", None)
        name = spec.name if spec is not None else name
    return name


def is_package_error(exc: BaseException) -> bool:
    """Whether `exc` is one of the package's own errors: an instance of a class defined in a `specvocab` module
    (or derived from one). Those say what is wrong and what to do; everything else is a bug."""
    return any(_package_module(c) == "specvocab" or _package_module(c).startswith("specvocab.")
               for c in type(exc).__mro__ if c not in (BaseException, Exception))


def _report(exc: BaseException, message: str, debug: bool) -> int:
    if debug:
        traceback.print_exception(exc)
    message = message.removeprefix("error: ")
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_main(main: Callable[[list[str]], object], argv: Sequence[str] | None = None, *, debug: bool = False) -> int:
    """Run `main(argv)` (default: `sys.argv[1:]`) as a command and return its exit status: an int result as it
    is, any other result 0; an error of the package (`is_package_error`), or a `SystemExit` with a message,
    printed as `error: <message>` on stderr, status 2 (the traceback before it with `debug`, `--debug` in argv
    or `SPECVOCAB_DEBUG=1`); any other exception propagates with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug or debugging() or DEBUG_FLAG in argv[: argv.index("--") if "--" in argv else len(argv)]
    old = os.environ.get(DEBUG_ENV)
    if debug:
        os.environ[DEBUG_ENV] = "1"                    # nested mains (a verb's own) see it too
    try:
        result = main(argv)
    except SystemExit as e:                            # argparse's exit(2) and a main's sys.exit(status) pass
        if isinstance(e.code, str):
            return _report(e, e.code, debug)
        raise
    except Exception as e:  # noqa: BLE001 - the package's own errors only; the rest re-raised
        if not is_package_error(e):
            raise
        return _report(e, str(e) or type(e).__name__, debug)
    finally:
        if debug:
            if old is None:
                os.environ.pop(DEBUG_ENV, None)
            else:
                os.environ[DEBUG_ENV] = old
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
