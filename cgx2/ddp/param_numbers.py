"""Parameters numbered in the order a DDP hook first meets them: the keys under which the hooks
keep per-parameter state, stable across DDP's bucket rebuild and in a resumed run."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ParamNumbers"]


class ParamNumbers:
    """Each parameter's number: 0, 1, 2, ... in the order :meth:`number` first meets them.
    Under DDP that is the first iteration's buckets, which the model's parameter order fixes,
    so a parameter keeps its number when DDP rebuilds its buckets, and a run resumed into a
    freshly built model numbers its parameters as the run that saved it. Parameters are held
    weakly; a number is never given twice."""

    def __init__(self) -> None:
        self._numbers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next = 0

    def number(self, param: torch.Tensor) -> tuple[int, bool]:
        """``param``'s number, and whether it was given now (``param`` met the first time)."""
        number = self._numbers.get(param)
        if number is not None:
            return number, False
        number = self._numbers[param] = self._next
        self._next += 1
        return number, True

    def numbers(self, params: Iterable[torch.Tensor]) -> list[int]:
        """:meth:`number` of each parameter, in order."""
        return [self.number(p)[0] for p in params]
