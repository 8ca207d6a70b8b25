"""``torch.ops.cgx.*``: every public computation as a ``torch.library`` custom op.

Each op has a fake implementation, so ``torch.compile(fullgraph=True)`` traces through it.
Importing this package registers them.
"""

import torch

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


def _refuse_nested(first_arg: str) -> object:
    def refuse(t: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise TypeError(f"{first_arg} must be a dense (torch.strided) tensor, got a nested one")

    return refuse


# A nested tensor never reaches the ops' kernels (registered for dense tensors): the dispatcher
# would refuse it naming a dispatch key, these name the argument.
_NESTED = torch.library.Library("cgx", "IMPL")
for _op, _arg, _keys in (
    ("quantize", "x", ("AutogradNestedTensor",)),
    ("dequantize", "payload", ("AutogradNestedTensor",)),
    ("quantized_allreduce", "input", ("NestedTensorCPU", "NestedTensorCUDA")),
    ("quantized_allreduce_", "input", ("NestedTensorCPU", "NestedTensorCUDA")),
    ("quantized_reduce_scatter", "input", ("NestedTensorCPU", "NestedTensorCUDA")),
    ("quantized_reduce_scatter_out", "input", ("NestedTensorCPU", "NestedTensorCUDA")),
):
    for _key in _keys:
        _NESTED.impl(_op, _refuse_nested(_arg), _key)
