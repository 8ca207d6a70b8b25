"""The quantized all-gather behind FSDP2's parameter all-gather: each rank encodes its row's
compressed segments once, rounding to the nearest level, and every rank decodes every row, its
own included, so that all ranks hold the same values. Uncompressed segments travel exactly.

Weights are read, not summed: rounding to the nearest level halves the worst error of
stochastic rounding, and the bias it leaves is not accumulated over ranks (docs/fsdp.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs import maxmin_codec
from ..codecs.layout import MaxMinLayout
from ..comm import group_size_and_rank
from . import policy
from .fusion import padded_numel
from .reduce_scatter import Segment, _split

__all__ = ["all_gather"]


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, bits: int,
               bucket_size: int, segments: Sequence[Segment] | None = None) -> int:  # fmt: skip
    """All-gather ``input`` (this rank's row) into ``output`` (W rows of ``input.numel()``, in
    rank order), its ``segments`` marked compressed sent as ``bits``-bit max-min payloads
    rounded to the nearest level, the others exactly; everything exactly where compression
    does not pay (:mod:`.policy`), or for dtypes other than floats. Every rank's output is
    the same, this rank's row decoded from its own payload too. Returns the bytes this rank
    sent."""
    (world, rank), n = group_size_and_rank(group), input.numel()
    flat_in, rows = input.reshape(-1), output.view(world, n)
    compressed, exact = _split(segments, n)
    padded = sum(padded_numel(k, bucket_size) for _, k, _ in compressed)
    route = policy.route(input, group, bits, bucket_size, world * padded)
    if not (compressed and route.compress and input.is_floating_point()):
        route.transport.wait(route.transport.all_gather(output.view(-1), flat_in, group, False))
        return (world - 1) * n * input.element_size()
    plan = _plan(n, tuple(compressed), tuple(exact), bucket_size, input.device)
    layout = MaxMinLayout(plan.fused, bits, bucket_size)
    # Every row and its exact values start 16-byte aligned, as the kernels' payloads do.
    head = -(-layout.nbytes // 16) * 16
    exact_bytes = plan.exact.numel() * input.element_size()
    row_bytes = -(-(head + exact_bytes) // 16) * 16
    send = torch.zeros(row_bytes, dtype=torch.uint8, device=input.device)
    codec = maxmin_codec(input.device)
    codec.encode(flat_in.index_select(0, plan.gather), bits, bucket_size, 0,
                 out=send[: layout.nbytes], nearest=True)  # fmt: skip
    if exact_bytes:
        send[head : head + exact_bytes] = flat_in.index_select(0, plan.exact).view(torch.uint8)
    recv = torch.empty(world, send.numel(), dtype=torch.uint8, device=input.device)
    try:
        route.transport.wait(route.transport.all_gather(recv.view(-1), send, group, False))
    except RuntimeError as e:  # a transport's error (a peer died or stalled): say where
        raise RuntimeError(
            f"cgx2: the quantized all-gather of {n} values a rank over {world} ranks (this is "
            f"rank {rank}) failed: {e}"
        ) from e
    for r in range(world):
        values = codec.decode(recv[r, : layout.nbytes], plan.fused, bits, bucket_size,
                              output.dtype)  # fmt: skip
        rows[r].index_copy_(0, plan.out, values.index_select(0, plan.src))
        if exact_bytes:
            exact = recv[r, head : head + exact_bytes].view(output.dtype)
            rows[r].index_copy_(0, plan.exact, exact)
    return (world - 1) * send.numel()


@dataclass(frozen=True)
class _Plan:
    """Index tensors of one row's segments, made once per shape: ``gather`` builds the fused
    compressed values (each segment padded to whole buckets with its last value), ``src`` and
    ``out`` put them back, ``exact`` lists the uncompressed positions."""

    fused: int
    gather: torch.Tensor
    src: torch.Tensor
    out: torch.Tensor
    exact: torch.Tensor


@functools.lru_cache(maxsize=256)
def _plan(n: int, compressed: tuple[Segment, ...], exact: tuple[Segment, ...],
          bucket_size: int, device: torch.device) -> _Plan:  # fmt: skip
    empty = torch.empty(0, dtype=torch.int64)
    gather, src, out, at = [], [], [], 0
    for o, k, _ in compressed:
        pad = -k % bucket_size
        gather.append(torch.cat([torch.arange(o, o + k), torch.full((pad,), o + k - 1)]))
        src.append(torch.arange(at, at + k))
        out.append(torch.arange(o, o + k))
        at += k + pad
    cat = lambda parts: torch.cat(parts) if parts else empty
    exact_index = cat([torch.arange(o, o + k) for o, k, _ in exact])
    return _Plan(at, cat(gather).to(device), cat(src).to(device), cat(out).to(device),
                 exact_index.to(device))  # fmt: skip
