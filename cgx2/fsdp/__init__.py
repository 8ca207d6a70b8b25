"""FSDP2 with quantized gradients: ``cgx2.fsdp.compress(model, bits=4)`` sets a quantized
reduce-scatter on every ``fully_shard`` module, leaving small and 1-D parameters exact.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..backend import CompletedWork
from ..checks import UNCOMPRESSED_BITS, check_bits, check_bucket_size
from ..config import CGXConfig
from .reduce_scatter import Segment, reduce_scatter_quantized, reference_reduce_scatter

__all__ = ["QuantizedReduceScatter", "compress", "reduce_scatter_quantized",
           "reference_reduce_scatter"]  # fmt: skip


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, quantized to ``bits`` (the protocol of torch's ``_fsdp_api``).

    ``row_params`` lists, in FSDP's order, each parameter's values per rank (its padded shard
    size) and whether it is compressed; when a reduction's rows do not match it (a parameter
    without a gradient), the whole row is compressed. ``bytes_sent`` counts this rank's bytes.
    """

    def __init__(self, bits: int = 4, bucket_size: int = 512,
                 row_params: list[tuple[int, bool]] | None = None) -> None:  # fmt: skip
        self.bits = check_bits(bits)
        self.bucket_size = check_bucket_size(bucket_size)
        self.row_params = row_params or []
        self.bytes_sent = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self, n: int) -> list[Segment] | None:
        if sum(k for k, _ in self.row_params) != n:
            return None
        segments, at = [], 0
        for k, compressed in self.row_params:
            segments.append((at, k, compressed))
            at += k
        return segments

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> dist.Work | None:  # fmt: skip
        world = dist.get_world_size(group)
        if op == dist.ReduceOp.SUM:
            scale = None
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        elif op == dist.ReduceOp.PREMUL_SUM:
            scale = float(op.factor)
        else:
            raise ValueError(f"cgx2's FSDP reduce-scatter takes SUM, AVG or PREMUL_SUM, not {op}")
        if self.bits == UNCOMPRESSED_BITS:
            segments = [(0, output_tensor.numel(), False)]
        else:
            segments = self._segments(output_tensor.numel())
        self.bytes_sent += reduce_scatter_quantized(
            output_tensor, input_tensor, group, self.bits, self.bucket_size, scale, segments
        )
        if async_op:
            return CompletedWork([output_tensor])
        return None


def compress(model: nn.Module, bits: int | None = None, bucket_size: int | None = None,
             min_size: int = 1024) -> list[QuantizedReduceScatter]:  # fmt: skip
    """Set a :class:`QuantizedReduceScatter` on every FSDP2 module of ``model`` (call it after
    ``fully_shard``). Parameters with one dimension or fewer than ``min_size`` values are
    reduced exactly, as CGX's ``layer_min_size``. ``bits``/``bucket_size`` default to
    ``CGX_COMPRESSION_QUANTIZATION_BITS`` (4 when it is not set: this function is asked to
    compress)/``CGX_COMPRESSION_BUCKET_SIZE``. Returns the reduce-scatters set, whose
    ``bytes_sent`` add up to what this rank sent."""
    config = CGXConfig.from_env()
    if bits is None:
        unset = os.environ.get("CGX_COMPRESSION_QUANTIZATION_BITS", "").strip() == ""
        bits = 4 if unset else config.quantization_bits
    bucket_size = config.bucket_size if bucket_size is None else bucket_size
    min_size = max(min_size, config.minimal_size)
    comms = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # a module with no parameters of its own
            continue
        row_params = [
            (p.padded_sharded_param_size.numel(),
             len(p._orig_size) > 1 and p._orig_size.numel() >= min_size)
            for p in group.fsdp_params
        ]  # fmt: skip
        comm = QuantizedReduceScatter(bits, bucket_size, row_params)
        module.set_custom_reduce_scatter(comm)
        comms.append(comm)
    if not comms:
        raise ValueError("compress() found no fully_shard module with parameters in the model")
    return comms
