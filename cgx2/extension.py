"""cgx2's compiled extension, ``cgx2._C`` (``csrc/``, built by ``pip install``): the codec's
CPU loops and the shared-memory transport. :func:`load` returns it, or None where it is absent.

Where it is absent, logged once: the CPU codec runs in torch and the collectives use the
process group's transport. Nothing is compiled or loaded from elsewhere at run time.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

__all__ = ["ABI_VERSION", "load"]

log = logging.getLogger("cgx2")

ABI_VERSION = 2
"""The ``cgx2._C.ABI_VERSION`` this Python code calls; a stale build of another is not used."""


@functools.cache
def load() -> ModuleType | None:
    """``cgx2._C``, imported once; None (logged once, with why) where it was not built or is
    a build of other sources (reinstall cgx2: ``pip install -e .`` rebuilds it)."""
    try:
        module = importlib.import_module("cgx2._C")
    except ImportError as e:
        log.warning(
            "cgx2: the compiled extension cgx2._C is missing (%s): the CPU codec runs in torch "
            "and the shared-memory transport is off (collectives use the process group). "
            "Reinstall cgx2 where a C++ compiler is present to build it.",
            e,
        )
        return None
    found = getattr(module, "ABI_VERSION", None)
    if found != ABI_VERSION:
        log.warning(
            "cgx2: ignoring cgx2._C at %s: it was built from other sources (ABI %s, "
            "expected %s); reinstall cgx2 to rebuild it",
            module.__file__,
            found,
            ABI_VERSION,
        )
        return None
    return module
