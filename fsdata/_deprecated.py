"""Old flat module paths (``fsdata.plan``, ``fsdata.balance``, ...) kept importable for one release.

Each old path is a thin module that calls :func:`alias` and becomes the new module itself (the
same object in ``sys.modules``), so every public and private name, and monkeypatching, behave as
before. Importing it warns once with a :class:`DeprecationWarning` naming the new path.
docs/architecture.md lists the new places.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` and warn once that ``old`` is deprecated.

    Args:
        old: the deprecated dotted module path (the caller's ``__name__``).
        new: the dotted path of the module that now holds the code.
    """
    warnings.warn(f"{old} is deprecated and will be removed in the next release; import {new} instead",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
