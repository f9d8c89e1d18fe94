"""specvocab: speculative decoding with large vocabularies.

The package's one import name. Its four parts live in the repository's top-level folders and import as
`specvocab.locality`, `specvocab.engine`, `specvocab.kernels` and `specvocab.sweeps`, so that installing it
beside another distribution that owns a generic top-level name (Hugging Face's `kernels`, say) overwrites no
file of either.

A wheel holds the parts inside this folder. A checkout keeps them beside it: `__path__` then also points at
the checkout's root, so `python -m specvocab.<part>...` runs from a checkout with or without an install.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "engine")) and all(
        _os.path.isfile(_os.path.join(_root, part, "__init__.py")) for part in ("engine", "kernels", "locality", "sweeps")) \
        and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)  # a checkout: the parts are the repository's top-level folders

PARTS = ("locality", "engine", "kernels", "sweeps")
__version__ = "0.1.0"
