"""Quantized collectives over a ``torch.distributed`` process group.

The allreduce is scatter-reduce-allgather on packed payloads: encode the W chunks, one
``all_to_all_single``, decode-and-sum into the owned chunk (fused) and encode it once more,
one ``all_gather_into_tensor``, decode. All ranks decode the same bytes, so they return
bit-identical tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import (
    UNCOMPRESSED_BITS,
    check_bits,
    check_bucket_size,
    check_float_tensor,
    check_reduce_op,
)
from .codecs import ChunkedLayout, maxmin_codec
from .seeding import derive_key, next_seed

__all__ = ["allreduce_plain", "allreduce_quantized"]

# torch >= 2.13 renamed all_gather_into_tensor; both exist in between.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_STAGE_SCATTER = 1
_STAGE_GATHER = 2


def allreduce_plain(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """The uncompressed allreduce of a copy of ``t``. AVG uses the backend's own AVG where it
    has one (NCCL); elsewhere (gloo) it sums and divides by the world size."""
    out = t.clone(memory_format=torch.contiguous_format)
    if reduce_op == "avg" and out.is_cuda and dist.get_backend(group) == "nccl":
        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
        return out
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if reduce_op == "avg":
        out.div_(dist.get_world_size(group))
    return out


def allreduce_quantized(
    t: torch.Tensor,
    bits: int,
    bucket_size: int,
    group: dist.ProcessGroup,
    reduce_op: str = "sum",
    seed: int | None = None,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Allreduce (SUM or AVG) of ``t`` across ``group`` with max-min quantization to ``bits``.

    Returns a new tensor of ``t``'s shape and dtype; ``t`` is not modified. Each value is
    quantized twice (on the way to its owner, and once reduced); the owner's own contribution
    stays in full precision. ``bits`` = 32 is the plain allreduce, exactly; a group of one
    returns a copy of ``t``. ``seed`` None draws the next seed from :mod:`cgx2.seeding`.
    """
    check_float_tensor(t, "tensor")
    check_bits(bits)
    check_bucket_size(bucket_size)
    reduce_op = check_reduce_op(reduce_op)
    world = dist.get_world_size(group)
    if bits == UNCOMPRESSED_BITS:
        return allreduce_plain(t, group, reduce_op)
    if world == 1 or t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)

    rank = dist.get_rank(group)
    seed = next_seed() if seed is None else seed
    codec = maxmin_codec(t.device)
    flat = t.reshape(-1)
    layout = ChunkedLayout.split(flat.numel(), world, bits, bucket_size, skip_incomplete)

    # Scatter-reduce: chunk j goes to rank j; our own chunk stays in full precision.
    send = codec.encode_chunks(flat, layout, derive_key(seed, _STAGE_SCATTER, rank), rank)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    start, size = layout.chunk_start(rank), layout.chunk_size(rank)
    scale = 1.0 / world if reduce_op == "avg" else None
    reduced = torch.zeros(layout.payload_nbytes, dtype=torch.uint8, device=t.device)
    codec.decode_sum_encode(
        recv, size, flat[start : start + size], rank, scale, bits, bucket_size,
        derive_key(seed, _STAGE_GATHER), rank, skip_incomplete, out=reduced,
    )  # fmt: skip

    # Allgather the reduced chunks; every rank (the owner too) decodes the same bytes.
    gathered = torch.empty(world * layout.payload_nbytes, dtype=torch.uint8, device=t.device)
    _all_gather_single(gathered, reduced, group=group)
    rows = gathered.view(world, layout.payload_nbytes)
    return codec.decode_chunks(rows, layout, t.dtype).view(t.shape)
