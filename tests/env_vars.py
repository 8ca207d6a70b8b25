"""Environment variables set for a block of code, where pytest's monkeypatch does not reach
(a distributed pool's worker processes), and put back as they were after it; cgx2, which reads
them once, takes them again on entering and leaving (:func:`cgx2.config.refresh`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import cgx2.config


@contextlib.contextmanager
def setenv(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    cgx2.config.refresh()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cgx2.config.refresh()
