"""The `>>>` examples in `specvocab.locality`'s docstrings run and give the values they print.

Each module of the package is collected (so a new module's examples run without editing this file); the
modules whose public entry points carry examples must have some, so deleting them fails here too.
"""

import doctest
import importlib
import pkgutil
import types

import pytest

from specvocab import locality

MODULES = [locality.__name__] + [f"{locality.__name__}.{m.name}" for m in pkgutil.iter_modules(locality.__path__)]
# the entry points a reader starts from: each module must hold at least one example
WITH_EXAMPLES = {"specvocab.locality.trace", "specvocab.locality.coverage", "specvocab.locality.temporal",
                 "specvocab.locality.shortlist"}


def _run(module) -> doctest.TestResults:
    """(failed, attempted) of every docstring example in `module`, its failures printed as doctest reports them."""
    return doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=False)


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(name):
    module = importlib.import_module(name)
    result = _run(module)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest(s) in {name} failed (run " \
                               f"`python -m doctest -v {module.__file__}` to see which)"
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} lost its docstring examples"


def test_the_entry_points_carry_examples():
    """The public analyses a reader calls first each show an example in their own docstring."""
    finder = doctest.DocTestFinder()
    for name in ("coverage.coverage", "trace.Trace.from_tokens", "trace.as_traces", "temporal.token_distances",
                 "temporal.distance_histograms", "temporal.miss_ratio_curves", "shortlist.shortlist_coverage"):
        module, _, attr = name.partition(".")
        obj = importlib.import_module(f"specvocab.locality.{module}")
        for part in attr.split("."):
            obj = getattr(obj, part)
        tests = finder.find(obj, name, globs={})
        assert sum(len(t.examples) for t in tests) > 0, f"{name} has no >>> example"


SOURCE = '''
def f():
    """
    >>> from specvocab.locality import coverage
    >>> coverage([1, 2, 1, 3, 2, 1], w_max=[2], stream="generated")["coverage"].to_list()
    [{value}]
    """
'''


@pytest.mark.parametrize("value, failed", [("0.2", 0), ("0.4", 1)])
def test_the_doctest_run_can_fail(value, failed):
    """The runner reads the printed values: a docstring that prints a wrong coverage is reported failed."""
    module = types.ModuleType(f"fake_locality_{failed}")
    exec(SOURCE.replace("{value}", value), module.__dict__)
    result = _run(module)
    assert (result.attempted, result.failed) == (2, failed)
