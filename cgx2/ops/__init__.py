"""``torch.ops.cgx.*``: every public computation as a ``torch.library`` custom op.

Each op has a fake implementation, so ``torch.compile(fullgraph=True)`` traces through it.
Importing this package registers them.
"""

from .allreduce import quantized_allreduce, quantized_allreduce_
from .codec import dequantize, quantize
from .reduce_scatter import quantized_reduce_scatter

__all__ = [
    "dequantize",
    "quantize",
    "quantized_allreduce",
    "quantized_allreduce_",
    "quantized_reduce_scatter",
]
