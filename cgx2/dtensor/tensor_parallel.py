"""``QuantizedRowwiseParallel``: torch's ``RowwiseParallel`` whose output reduction (the
allreduce, or reduce-scatter, of the layer's partial sums) cgx2 quantizes.

When compressing activations is safe: docs/dtensor.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from .placement import QuantizedPartial

__all__ = ["QuantizedRowwiseParallel"]


class QuantizedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Linear`` (or ``nn.Embedding``), its output's pending sum
    sent as ``bits``-bit max-min payloads in buckets of ``bucket_size``
    (:class:`QuantizedPartial`). The other arguments are ``RowwiseParallel``'s. The forward
    output is bit-identical on every rank; the backward pass is ``RowwiseParallel``'s (the
    replicated gradient needs no reduction).

    Example::

        >>> from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        >>> from cgx2.dtensor import QuantizedRowwiseParallel
        >>> parallelize_module(mlp, mesh, {"up": ColwiseParallel(),
        ...                                "down": QuantizedRowwiseParallel(bits=8)})
    """

    def __init__(
        self,
        bits: int = 8,
        bucket_size: int = 512,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts,
            use_local_output=use_local_output,
        )
        self.placement = QuantizedPartial(bits, bucket_size, "sum")

    def _prepare_output_fn(
        self,
        output_layouts: Sequence[Placement],
        use_local_output: bool,
        mod: nn.Module,
        outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> object:
        # The layer's sum is pending as torch's Partial: the same local values, marked as ours.
        placements = [
            self.placement if p.is_partial() and p.reduce_op == "sum" else p
            for p in outputs.placements
        ]
        if list(placements) != list(outputs.placements):
            local = outputs.to_local(grad_placements=[Replicate()] * len(placements))
            outputs = DTensor.from_local(
                local,
                device_mesh,
                placements,
                run_check=False,
                shape=outputs.shape,
                stride=outputs.stride(),
            )
        if outputs.placements != tuple(output_layouts):
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", placement={self.placement!r})"
