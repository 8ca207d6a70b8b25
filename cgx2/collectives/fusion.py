"""Tensor fusion: many tensors (layers) reduced by one quantized allreduce.

Each layer is padded with its own last value to whole quantization buckets, so no bucket mixes
two layers and the padding moves no bucket's min or max (CGX's layer-aware fusion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import cpu_threads
from ..checks import UNCOMPRESSED_BITS
from ..codecs import ChunkedLayout
from ..comm import group_size_and_rank
from . import policy
from .allreduce import allreduce_
from .call_settings import CallSettings

__all__ = [
    "Fused",
    "allreduce_fused_",
    "fuse_padded",
    "fusion_batches",
    "quantized_bytes_sent",
    "reduce_fused_",
    "ring_bytes_sent",
]


class Fused(NamedTuple):
    """Layers concatenated into one buffer, each padded to whole buckets."""

    buffer: torch.Tensor
    starts: list[int]  # where each layer starts in ``buffer``


def fuse_padded(layers: Sequence[torch.Tensor], bucket_size: int) -> Fused:
    """Concatenate the flattened ``layers``, each padded to whole buckets; return the buffer
    and where each layer starts in it."""
    parts, starts, at = [], [], 0
    for layer in layers:
        flat = layer.reshape(-1)
        pad = -flat.numel() % bucket_size
        parts.append(flat)
        if pad:
            parts.append(flat[-1:].expand(pad))
        starts.append(at)
        at += flat.numel() + pad
    if layers[0].device.type != "cpu" or not cpu_threads.beside_compute():
        return Fused(torch.cat(parts), starts)  # one kernel, on torch's threads
    fused = torch.empty(at, dtype=layers[0].dtype)
    at = 0
    for part in parts:  # on cgx2's threads: torch.cat on a worker would run on it alone
        cpu_threads.copy_(fused[at : at + part.numel()], part)
        at += part.numel()
    return Fused(fused, starts)


def padded_numel(numel: int, bucket_size: int) -> int:
    """Values a layer of ``numel`` takes in a fused buffer."""
    return numel + (-numel % bucket_size)


def fusion_batches(
    numels: Sequence[int], element_size: int, bucket_size: int, limit_bytes: int
) -> list[list[int]]:
    """Cut tensors, in order, into batches of at most ``limit_bytes`` once padded; a tensor
    larger than the limit goes alone, and ``limit_bytes`` = 0 puts every tensor alone."""
    batches: list[list[int]] = []
    size = 0
    for i, numel in enumerate(numels):
        nbytes = padded_numel(numel, bucket_size) * element_size
        if batches and limit_bytes > 0 and size + nbytes <= limit_bytes:
            batches[-1].append(i)
            size += nbytes
        else:
            batches.append([i])
            size = nbytes
    return batches


def quantized_bytes_sent(
    numel: int,
    world: int,
    bits: int,
    bucket_size: int,
    skip_incomplete: bool = False,
    gather_all: bool = False,
) -> int:
    """Bytes one rank sends in :func:`cgx2.collectives.allreduce` of ``numel``
    values: W-1 chunks to their owners, then its reduced chunk to W-1 ranks; ``gather_all``
    (its route's): its whole payload to W-1 ranks."""
    if gather_all:
        whole = ChunkedLayout.split(numel, 1, bits, bucket_size, skip_incomplete)
        return (world - 1) * whole.payload_nbytes
    layout = ChunkedLayout.split(numel, world, bits, bucket_size, skip_incomplete)
    return 2 * (world - 1) * layout.payload_nbytes


def ring_bytes_sent(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world


def reduce_fused_(
    layers: Sequence[torch.Tensor], bucket_size: int, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Apply ``reduce`` to the layers fused and padded to whole buckets (one contiguous layer
    of whole buckets is reduced as it is), and write the result back into each layer. Returns
    the fused buffer ``reduce`` received."""
    first = layers[0]
    if len(layers) == 1 and first.is_contiguous() and first.numel() % bucket_size == 0:
        reduced = reduce(first)
        if reduced.data_ptr() != first.data_ptr():
            cpu_threads.copy_(first, reduced.view(first.shape))
        return first
    fused, starts = fuse_padded(layers, bucket_size)
    reduced = reduce(fused)
    for layer, at in zip(layers, starts, strict=True):
        cpu_threads.copy_(layer, reduced[at : at + layer.numel()].view(layer.shape))
    return fused


def allreduce_fused_(
    layers: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    settings: CallSettings,
    errors: list[torch.Tensor] | None = None,
    *,
    route_numel: int | None = None,
) -> int:
    """Quantized allreduce of ``layers`` (same dtype and device) as one fused buffer, written
    back into each layer. Returns the bytes this rank sent (a buffer the policy does not
    compress goes plain: :func:`.policy.compresses`, by ``route_numel`` values where given,
    for layers that are part of a reduction decided as a whole). With ``errors`` (a list),
    each layer's first-stage error (``error`` of :func:`.allreduce.allreduce_`, zeros when
    nothing was quantized) is appended to it, flat, in layer order. A rotation: as
    :func:`.allreduce.allreduce_`'s (each layer padded to whole buckets keeps whole blocks)."""
    world, _ = group_size_and_rank(group)
    bits, bucket_size = settings.bits, settings.bucket_size
    numel = sum(padded_numel(x.numel(), bucket_size) for x in layers)
    decided_by = numel if route_numel is None else route_numel
    route = policy.route(layers[0], group, bits, bucket_size, decided_by)
    if not route.compress:
        bits = UNCOMPRESSED_BITS  # decided once here, for the reduction and the count alike
        settings = replace(settings, bits=bits)
    fused_error: list[torch.Tensor] = []

    def reduce(fused: torch.Tensor) -> torch.Tensor:
        if errors is not None:
            fused_error.append(torch.empty_like(fused))
        error = fused_error[0] if fused_error else None
        return allreduce_(fused, group, settings, error=error, route_numel=decided_by)

    reduce_fused_(layers, bucket_size, reduce)
    if errors is not None:
        at = 0  # each layer's place in the fused buffer: padded to whole buckets
        for layer in layers:
            errors.append(fused_error[0][at : at + layer.numel()])
            at += padded_numel(layer.numel(), bucket_size)
    if bits == UNCOMPRESSED_BITS:
        return ring_bytes_sent(numel * layers[0].element_size(), world)
    return quantized_bytes_sent(numel, world, bits, bucket_size, gather_all=route.gather_all)
