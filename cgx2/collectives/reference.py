"""Bit-exact models of the quantized collectives, computed in one process with the torch
reference codec: what every rank of the real collective returns, for tests and GPU checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_reduce_op
from ..codecs import ChunkedLayout, maxmin
from ..seeding import derive_key
from . import policy
from .allreduce import STAGE_GATHER, STAGE_SCATTER
from .reduce_scatter import Segment, _fused_rows, _group_key, _split, width_groups
from .rotations import DEFAULT_BLOCK, call_rotation, rotation_key, rotation_of

__all__ = ["reference_allreduce", "reference_reduce_scatter"]


def reference_allreduce(
    inputs: list[torch.Tensor],
    bits: int,
    bucket_size: int,
    seed: int,
    reduce_op: str = "sum",
    skip_incomplete: bool = False,
    device: torch.device | None = None,
    regime: str | None = None,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
    gather_all: bool | None = None,
) -> torch.Tensor:
    """What :func:`cgx2.collectives.allreduce` returns on every rank when rank r holds
    ``inputs[r]`` and it compresses, computed in one process with the torch reference codec
    (same pieces, keys and order of summation): a bit-exact model of the collective, for
    tests and checks. The pieces follow ``regime`` (default: that of ``device`` on NCCL, or
    of the inputs' device; name the GPU when modelling it from CPU copies). ``rotation`` and
    ``rotation_block`` as the collective's: piece i rotated by (seed, rotation, i).
    ``gather_all``: the route of ``CGX2_ALGORITHM=allgather`` (each rank's piece encoded
    whole, every row decoded, scaled and summed in rank order); None: as the settings in
    force route the call (:func:`.policy.gathers_all`)."""
    if gather_all is None:
        gather_all = policy.gathers_all()
    call_rotated = call_rotation(rotation, rotation_block, bucket_size)
    world, x0 = len(inputs), inputs[0]
    flats = [x.reshape(-1).cpu() for x in inputs]
    out = torch.empty(x0.numel(), dtype=x0.dtype)
    scale = 1.0 / world if check_reduce_op(reduce_op) == "avg" else None
    regime = regime or policy.regime(device or x0.device)
    pair = policy.uses_pair_gather(world, regime)
    step = policy.piece_numel(x0.element_size(), world, bucket_size, regime, pair)
    for index, s in enumerate(range(0, x0.numel(), step)):
        pieces = [f[s : s + step] for f in flats]
        rotated = rotation_of(call_rotated, rotation_key(seed), index)
        if gather_all:
            whole = ChunkedLayout.split(pieces[0].numel(), 1, bits, bucket_size, skip_incomplete)
            acc = None
            for r, p in enumerate(pieces):
                row = maxmin.encode_chunks(
                    p, whole, derive_key(seed, STAGE_SCATTER, r, index), rotation=rotated
                )
                decoded = maxmin.decode_chunks(row, whole, torch.float32, rotation=rotated)
                if scale is not None:
                    decoded.mul_(maxmin.fp32_scalar(scale))
                acc = decoded if acc is None else acc.add_(decoded)
            out[s : s + pieces[0].numel()] = acc
            continue
        layout = ChunkedLayout.split(pieces[0].numel(), world, bits, bucket_size, skip_incomplete)
        sent = [
            maxmin.encode_chunks(
                p, layout, derive_key(seed, STAGE_SCATTER, r, index), r, rotation=rotated
            )
            for r, p in enumerate(pieces)
        ]
        reduced = torch.zeros(world, layout.payload_nbytes, dtype=torch.uint8)
        for j in range(world):
            start, size = layout.chunk_start(j), layout.chunk_size(j)
            received = torch.stack([sent[r][j] for r in range(world)])
            maxmin.decode_sum_encode(
                received,
                size,
                pieces[j][start : start + size],
                j,
                scale,
                bits,
                bucket_size,
                derive_key(seed, STAGE_GATHER, index),
                j,
                skip_incomplete,
                out=reduced[j],
                rotation=rotated,
            )
        maxmin.decode_chunks(
            reduced, layout, x0.dtype, out=out[s : s + pieces[0].numel()], rotation=rotated
        )
    return out.view(x0.shape)


def reference_reduce_scatter(
    inputs: list[torch.Tensor],
    bits: int,
    bucket_size: int,
    seed: int,
    scale: float | None = None,
    segments: Sequence[Segment] | None = None,
    widths: Sequence[int] | None = None,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> list[torch.Tensor]:
    """What :func:`cgx2.collectives.reduce_scatter` writes on every rank when rank r holds
    ``inputs[r]`` and compression pays, for its compressed segments (the exact ones are left
    zero), computed in one process with the reference codec, one width group at a time: a
    bit-exact model for tests. ``rotation``: width group g rotated by (seed, rotation, g)."""
    call_rotated = call_rotation(rotation, rotation_block, bucket_size)
    world = len(inputs)
    n = inputs[0].numel() // world
    compressed, _ = _split(segments, n)
    outputs = [torch.zeros(n, dtype=inputs[0].dtype) for _ in range(world)]
    for g, (b, chosen) in enumerate(width_groups(compressed, bits, widths)):
        fused = [_fused_rows(x.reshape(world, n).cpu(), list(chosen), bucket_size) for x in inputs]
        starts, width = fused[0].starts, fused[0].width
        layout = ChunkedLayout(
            numel=world * width,
            num_chunks=world,
            chunk_numel=width,
            bits=b,
            bucket_size=bucket_size,
        )
        rotated = rotation_of(call_rotated, rotation_key(seed), g)
        sent = [
            maxmin.encode_chunks(f.flat, layout, _group_key(seed, r, g), r, rotation=rotated)
            for r, f in enumerate(fused)
        ]
        for j in range(world):
            received = torch.stack([sent[r][j] for r in range(world)])
            own = fused[j].flat[j * width : (j + 1) * width]
            reduced = maxmin.decode_sum(
                received, width, own, j, scale, b, bucket_size, rotation=rotated
            )
            for (o, k, _), at in zip(chosen, starts, strict=True):
                outputs[j][o : o + k] = reduced[at : at + k]
    return outputs
