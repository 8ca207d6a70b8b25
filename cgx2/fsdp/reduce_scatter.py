"""The quantized reduce-scatter behind FSDP2's gradient reduction: each rank encodes the W−1
shards it does not own once, one ``all_to_all``, and each owner decodes and sums its shard in
fp32 onto its own (kept in full precision) — one quantization per value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs import ChunkedLayout, maxmin, maxmin_codec
from ..collectives import compression_pays
from ..fusion import fuse_padded
from ..seeding import derive_key, next_seed

__all__ = ["reduce_scatter_quantized", "reference_reduce_scatter"]

_STAGE_REDUCE_SCATTER = 3
# torch >= 2.13 renamed reduce_scatter_tensor; both exist in between.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
Segment = tuple[int, int, bool]
"""(offset, numel, compressed) of one parameter's slice in every row of the input."""


def _split(segments: Sequence[Segment] | None, n: int) -> tuple[list[Segment], list[Segment]]:
    segments = list(segments) if segments else [(0, n, True)]
    if sum(k for _, k, _ in segments) != n:
        raise ValueError(f"segments cover {sum(k for _, k, _ in segments)} values of a row of {n}")
    return [s for s in segments if s[2]], [s for s in segments if not s[2]]


def _fused_rows(rows: torch.Tensor, compressed: list[Segment],
                bucket_size: int) -> tuple[torch.Tensor, list[int], int]:  # fmt: skip
    """Every row's compressed segments, each padded to whole buckets, rows one after another:
    chunk j of the flat result is row j. Returns it, the segments' starts and the row size."""
    fused = [fuse_padded([row[o : o + k] for o, k, _ in compressed], bucket_size) for row in rows]
    starts, width = fused[0][1], fused[0][0].numel()
    return torch.cat([f for f, _ in fused]), starts, width


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    bits: int,
    bucket_size: int,
    scale: float | None = None,
    segments: Sequence[Segment] | None = None,
    seed: int | None = None,
) -> int:
    """Reduce-scatter ``input`` (W rows of ``output.numel()``) into ``output``: the sum times
    ``scale`` (None: 1). Segments marked uncompressed, and everything when compression does
    not pay on this interconnect (:mod:`cgx2.crossover`), go through the plain reduce-scatter.
    Returns the bytes this rank sent."""
    world, rank, n = dist.get_world_size(group), dist.get_rank(group), output.numel()
    rows = input.view(world, n)
    compressed, exact = _split(segments, n)
    padded = sum(-(-k // bucket_size) * bucket_size for _, k, _ in compressed)
    if compressed and not compression_pays(input, world * padded):
        compressed, exact = [], [(0, n, False)]
    sent = 0
    plan = _plan(n, world, tuple(compressed), tuple(exact), bucket_size, input.device)
    if compressed:
        seed = next_seed() if seed is None else seed
        # One gather builds every row's padded compressed segments: chunk j is row j.
        flat = input.index_select(0, plan.gather)
        width = plan.width
        layout = ChunkedLayout(flat.numel(), world, width, bits, bucket_size)
        codec = maxmin_codec(input.device)
        send = codec.encode_chunks(
            flat, layout, derive_key(seed, _STAGE_REDUCE_SCATTER, rank), skip_chunk=rank
        )
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        own = flat[rank * width : (rank + 1) * width]
        reduced = codec.decode_sum(recv, width, own, rank, scale, bits, bucket_size)
        output.index_copy_(0, plan.out, reduced.index_select(0, plan.src).to(output.dtype))
        sent += (world - 1) * layout.payload_nbytes
    if exact:
        part = rows.index_select(1, plan.exact)
        reduced = torch.empty(part.shape[1], dtype=output.dtype, device=output.device)
        _reduce_scatter_single(reduced, part.reshape(-1), group=group)
        if scale is not None:
            reduced.mul_(scale)
        output.index_copy_(0, plan.exact, reduced)
        sent += (world - 1) * part.shape[1] * part.element_size()
    return sent


@dataclass(frozen=True)
class _Plan:
    """Index tensors that move a reduction's segments with one op each, made once per shape:
    ``gather`` builds the fused rows from the flat input, ``src``/``out`` place the reduced
    compressed values, ``exact`` lists the uncompressed positions of a row."""

    width: int
    gather: torch.Tensor
    src: torch.Tensor
    out: torch.Tensor
    exact: torch.Tensor


@functools.lru_cache(maxsize=256)
def _plan(n: int, world: int, compressed: tuple[Segment, ...], exact: tuple[Segment, ...],
          bucket_size: int, device: torch.device) -> _Plan:  # fmt: skip
    row, src, out, at = [], [], [], 0
    for o, k, _ in compressed:
        pad = -k % bucket_size
        row.append(torch.cat([torch.arange(o, o + k), torch.full((pad,), o + k - 1)]))
        src.append(torch.arange(at, at + k))
        out.append(torch.arange(o, o + k))
        at += k + pad
    empty = torch.empty(0, dtype=torch.int64)
    row_index = torch.cat(row) if row else empty
    gather = torch.cat([row_index + r * n for r in range(world)]) if row else empty
    exact_index = torch.cat([torch.arange(o, o + k) for o, k, _ in exact]) if exact else empty
    return _Plan(
        at,
        gather.to(device),
        (torch.cat(src) if src else empty).to(device),
        (torch.cat(out) if out else empty).to(device),
        exact_index.to(device),
    )


def reference_reduce_scatter(
    inputs: list[torch.Tensor],
    bits: int,
    bucket_size: int,
    seed: int,
    scale: float | None = None,
    segments: Sequence[Segment] | None = None,
) -> list[torch.Tensor]:
    """What :func:`reduce_scatter_quantized` writes on every rank when rank r holds
    ``inputs[r]`` and compression pays, for its compressed segments (the exact ones are left
    zero), computed in one process with the reference codec: a bit-exact model for tests."""
    world = len(inputs)
    n = inputs[0].numel() // world
    compressed, _ = _split(segments, n)
    fused = [_fused_rows(x.reshape(world, n).cpu(), compressed, bucket_size) for x in inputs]
    starts, width = fused[0][1], fused[0][2]
    layout = ChunkedLayout(world * width, world, width, bits, bucket_size)
    sent = [maxmin.encode_chunks(f, layout, derive_key(seed, _STAGE_REDUCE_SCATTER, r), r)
            for r, (f, _, _) in enumerate(fused)]  # fmt: skip
    outputs = []
    for j in range(world):
        received = torch.stack([sent[r][j] for r in range(world)])
        own = fused[j][0][j * width : (j + 1) * width]
        reduced = maxmin.decode_sum(received, width, own, j, scale, bits, bucket_size)
        out = torch.zeros(n, dtype=inputs[0].dtype)
        for (o, k, _), at in zip(compressed, starts, strict=True):
            out[o : o + k] = reduced[at : at + k]
        outputs.append(out)
    return outputs
