"""The `specvocab` command (`sweeps.cli`) and every command the documentation shows.

- each verb names a module whose `main(argv)` gets the rest of the command line; an unknown verb exits 2 with
  the known ones; `specvocab --help` loads neither torch nor Ray;
- every `python -m ...` / `specvocab ...` command written in README.md, sweeps/README.md, the model cards and
  the modules' docstrings parses with that module's own argument parser: the module exists, its required
  arguments are given, and no flag is unknown (the parser is stopped before the job runs).
"""

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import specvocab.engine.jobs.fit_dynaspec as fit_job
from specvocab.sweeps import cli

ROOT = Path(__file__).resolve().parents[1]


def _leaves(table=cli.VERBS, prefix=()):
    for name, value in table.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (name,))
        else:
            yield prefix + (name,), value[0]


def test_every_verb_names_a_module_with_main():
    leaves = dict(_leaves())
    assert {("bench",), ("record",), ("calibrate",), ("frequency",), ("train", "data"), ("train", "eagle"),
            ("dynaspec", "fit"), ("dynaspec", "choices"), ("sweep",), ("render",)} <= set(leaves)
    for words, module in leaves.items():
        assert cli.resolve([*words, "--x"]) == (module, ["--x"])
        assert callable(getattr(__import__(module, fromlist=["main"]), "main")), module


def test_a_verb_hands_the_rest_to_its_module(monkeypatch):
    seen = []
    monkeypatch.setattr(fit_job, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["dynaspec", "fit", "--model", "m", "--set", "eagle_depth=4"]) == 0
    assert seen == [["--model", "m", "--set", "eagle_depth=4"]]
    monkeypatch.setattr(fit_job, "main", lambda argv: 1)           # an exit status comes back as it is
    assert cli.main(["dynaspec", "fit"]) == 1


def test_unknown_verbs_exit_2_naming_the_known_ones(capsys):
    assert cli.main(["benchh"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'specvocab benchh'" in err and "'bench'" in err and "train data" in err
    assert cli.main(["train", "eagel"]) == 2
    assert f"unknown command 'specvocab train eagel': choose one of {list(cli.VERBS['train'])}" in capsys.readouterr().err
    assert cli.main([]) == 0 and "dynaspec choices" in capsys.readouterr().out


def test_help_loads_neither_torch_nor_ray():
    probe = ("import sys, sweeps.cli; sweeps.cli.main(['--help']); "
             "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_console_script_is_declared():
    assert 'specvocab = "specvocab.sweeps.cli:main"' in (ROOT / "pyproject.toml").read_text()


# --- every documented command parses --------------------------------------------------------------------------

DOCS = [ROOT / "README.md", ROOT / "sweeps" / "README.md", *sorted((ROOT / "engine" / "heads").glob("*/README.md")),
        *sorted(p for d in ("engine", "sweeps", "locality", "kernels") for p in (ROOT / d).rglob("*.py"))]
_START = re.compile(r"(?:^\s*|`|\$ (?:time )?|-- )((?:python -m|specvocab) [^`#]*)")


def documented_commands(text: str) -> list[str]:
    """Commands in a text: code lines starting with `python -m` / `specvocab` (a trailing backslash continues
    the line), and inline ones closed by a backtick on the same line. A `#` starts a comment."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        for m in _START.finditer(line):
            cmd = m.group(1)
            inline = m.start(1) > 0 and line[m.start(1) - 1] == "`"
            if inline and "`" not in line[m.end(1):m.end(1) + 1]:
                continue                                    # an inline command that runs over the line: skipped
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip().rstrip("\\") + " " + lines[i].strip().split("#")[0]
            out.append(" ".join(cmd.replace("\\\\", "\\").split()))
        i += 1
    return out


class _Parsed(Exception):
    pass


PLACEHOLDER = "X"                     # what `<name>`, `{x}` and a word in capitals (DIR, N) stand for


def _words(cmd: str) -> list[str]:
    """The command's words, placeholders made concrete: `<a b>` and an f-string's `{x}` -> X, a choice `{a,b}` -> a;
    optional parts `[...]` kept; `...` dropped."""
    cmd = re.sub(r"<[^>]*>", "X", cmd.replace("...", ""))
    cmd = re.sub(r"\{([^{},]*),[^{}]*\}", r"\1", cmd)
    cmd = re.sub(r"\{[^{}]*\}", "X", cmd)
    return [PLACEHOLDER if re.fullmatch(r"[A-Z][A-Z_]*", w) else w for w in shlex.split(re.sub(r"[\[\]]", "", cmd))]


def _check(cmd: str) -> None:
    """Parse `cmd` with its module's own parser and stop there. Commands in prose often show only the flags that
    matter, so required options and positionals are not demanded; every flag must exist and every value parse."""
    words = _words(cmd)
    if words[0] == "specvocab":
        module, args = cli.resolve(cli.split_debug(words[1:])[1])
    else:
        module, args = words[2], words[3:]
    unknown = []

    def parse_args(self, args=None, namespace=None):
        for parser in [self, *(sub for a in self._actions if isinstance(a, argparse._SubParsersAction)
                               for sub in a.choices.values())]:
            for action in parser._actions:
                action.required = False
                if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                    action.nargs = "*" if action.nargs in ("+", "*", argparse.REMAINDER) else "?"
            parser.error = lambda message, parser=parser: _refuse(parser, message)
        _, rest = self.parse_known_args(args, namespace)
        unknown.extend(rest)
        raise _Parsed

    def _refuse(parser, message):
        if f"'{PLACEHOLDER}'" in message:         # a placeholder where a number or a choice goes: not the doc's fault
            raise _Parsed
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    old_argv = sys.argv
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "parse_args", parse_args)
            sys.argv = [module, *args]
            if words[0] == "specvocab":
                __import__(module, fromlist=["main"]).main(args)
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
        raise AssertionError(f"{cmd!r}: {module} ran without parsing a command line")
    except _Parsed:
        pass
    except SystemExit as e:
        raise AssertionError(f"{cmd!r}: {module}'s parser refused it (exit {e.code})") from None
    finally:
        sys.argv = old_argv
    assert unknown == [], f"{cmd!r}: {module} does not know {unknown}"


def _all_documented() -> list[tuple[str, str]]:
    def concrete(cmd: str) -> bool:              # not pytest, and the module or verb is named, not a placeholder
        words = cmd.split()
        named = words[1:2] if words[0] == "specvocab" else words[2:3]
        return not cmd.startswith("python -m pytest") and all("<" not in w and w != "--help" for w in named)
    return sorted({(str(p.relative_to(ROOT)), c) for p in DOCS for c in documented_commands(p.read_text())
                   if concrete(c)})


def test_the_extractor_finds_commands_and_continuations():
    text = ("    python -m specvocab.engine.jobs.bench --model m \\\n        --methods ar   # comment\n"
            "see `python -m specvocab.sweeps.render DIR` and `specvocab bench --model m`; `python -m specvocab.engine.jobs.calibrate\n"
            "  --model m` runs over\n$ time python -m specvocab.sweeps.run a.toml --out o   # real 9m\n")
    assert documented_commands(text) == ["python -m specvocab.engine.jobs.bench --model m --methods ar",
                                         "python -m specvocab.sweeps.render DIR", "specvocab bench --model m",
                                         "python -m specvocab.sweeps.run a.toml --out o"]


def test_the_check_catches_a_wrong_flag_and_a_missing_module():
    with pytest.raises(AssertionError, match="does not know"):
        _check("python -m specvocab.engine.jobs.fit_dynaspec --model m --clusters 8")
    with pytest.raises(AssertionError, match="refused"):
        _check("python -m specvocab.engine.jobs.fit_dynaspec --model m --num-clusters eight")    # not an int
    with pytest.raises(ImportError):
        _check("python -m specvocab.engine.dynaspec fit --model m")                       # no such module


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # runpy: the module is already imported; harmless here
@pytest.mark.parametrize("where,cmd", _all_documented(), ids=lambda x: x if "/" in x or x.endswith(".md") else "")
def test_every_documented_command_parses(where, cmd):
    _check(cmd)
