"""specvocab: speculative decoding with large vocabularies.

The package's one import name. Its parts live in the repository's top-level folders and import as
`specvocab.locality`, `specvocab.engine`, `specvocab.kernels` and `specvocab.sweeps` (and the figure notebooks'
folder as `specvocab.notebooks`), so that installing it beside another distribution that owns a generic
top-level name (Hugging Face's `kernels`, say) overwrites no file of either.

A wheel holds the parts inside this folder. A checkout keeps them beside it: a finder then maps exactly those
names onto the checkout's folders, so `python -m specvocab.<part>...` runs from a checkout with or without an
install, and nothing else of the checkout (tests/, this folder again) becomes a subpackage.
"""

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

PARTS = ("locality", "engine", "kernels", "sweeps", "notebooks")
__version__ = "0.1.0"

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)


class _CheckoutParts(_abc.MetaPathFinder):
    """Finds `specvocab.<part>` in a checkout's top-level folder of that name (packages below it are found
    through the part's own `__path__`)."""

    def find_spec(self, name, path=None, target=None):
        prefix, _, part = name.partition(".")
        if prefix != __name__ or part not in PARTS:
            return None
        folder = _os.path.join(_root, part)
        init = _os.path.join(folder, "__init__.py")
        if _os.path.isfile(init):
            return _util.spec_from_file_location(name, init, submodule_search_locations=[folder])
        if _os.path.isdir(folder):                      # notebooks/: a folder of scripts, no __init__
            spec = _util.spec_from_loader(name, None, is_package=True)
            spec.submodule_search_locations = [folder]
            return spec
        return None


if not _os.path.isdir(_os.path.join(_here, "engine")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")) \
        and all(_os.path.isfile(_os.path.join(_root, p, "__init__.py")) for p in PARTS[:4]):
    if not any(isinstance(f, _CheckoutParts) for f in _sys.meta_path):   # a checkout: its parts sit beside us
        _sys.meta_path.append(_CheckoutParts())
