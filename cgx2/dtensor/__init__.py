"""DTensor-native compression: a ``Partial`` placement whose reduction cgx2 quantizes, and a
tensor-parallel style that compresses a row-parallel layer's output reduction.

Example::

    >>> from cgx2.dtensor import QuantizedPartial, QuantizedRowwiseParallel
"""

from .placement import QuantizedPartial
from .tensor_parallel import QuantizedRowwiseParallel

__all__ = ["QuantizedPartial", "QuantizedRowwiseParallel"]
