"""The quantized all-gather behind FSDP2's parameter all-gather: each rank encodes its row's
compressed segments once, rounding to the nearest level, and every rank decodes every row, its
own included, so that all ranks hold the same values. Uncompressed segments travel exactly.

Weights are read, not summed: rounding to the nearest level halves the worst error of
stochastic rounding, and the bias it leaves is not accumulated over ranks (docs/fsdp.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs import maxmin_codec
from ..codecs.layout import MaxMinLayout
from ..comm import group_size_and_rank
from . import policy
from .fusion import padded_numel
from .reduce_scatter import Segment, _Plan, _plan, _split

__all__ = ["GatheredRows", "all_gather", "decode_rows", "gather_rows"]


@dataclass(frozen=True)
class GatheredRows:
    """What a quantized all-gather received, before decoding: every rank's row of bytes
    (``recv``, W rows of ``row_bytes``: the max-min payload of its compressed values, then its
    exact values) and how to decode them. :func:`decode_rows` decodes it, as often as asked,
    into the same values: FSDP's parameter all-gather keeps one to decode again in the
    backward (:class:`cgx2.fsdp.QuantizedAllGather`)."""

    recv: torch.Tensor
    plan: _Plan
    bits: int
    bucket_size: int
    head: int
    """Where a row's exact values start: after its payload, 16-byte aligned."""
    exact_bytes: int

    @property
    def held_bytes(self) -> int:
        """The memory the received rows hold."""
        return self.recv.numel()


def gather_rows(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    segments: Sequence[Segment] | None,
    *,
    bits: int,
    bucket_size: int,
) -> tuple[GatheredRows | None, int]:
    """The communication of :func:`all_gather` (its arguments): where it is quantized, every
    rank's row of bytes, undecoded (``output`` untouched); where it is exact, None, the values
    gathered into ``output``. With the bytes this rank sent."""
    (world, rank), n = group_size_and_rank(group), input.numel()
    flat_in = input.reshape(-1)
    compressed, exact = _split(segments, n)
    padded = sum(padded_numel(k, bucket_size) for _, k, _ in compressed)
    route = policy.route(input, group, bits, bucket_size, world * padded)
    if not (compressed and route.compress and input.is_floating_point()):
        route.transport.wait(route.transport.all_gather(output.view(-1), flat_in, group, False))
        return None, (world - 1) * n * input.element_size()
    # The reduce-scatter's index plan for one row: the segments padded, fused and put back.
    plan = _plan(n, 1, (tuple(compressed),), tuple(exact), bucket_size, input.device)
    fused = plan.widths[0]
    layout = MaxMinLayout(numel=fused, bits=bits, bucket_size=bucket_size)
    # Every row and its exact values start 16-byte aligned, as the kernels' payloads do.
    head = -(-layout.nbytes // 16) * 16
    exact_bytes = plan.exact.numel() * input.element_size()
    row_bytes = -(-(head + exact_bytes) // 16) * 16
    send = torch.zeros(row_bytes, dtype=torch.uint8, device=input.device)
    codec = maxmin_codec(input.device)
    codec.encode(
        flat_in.index_select(0, plan.gather),
        bits,
        bucket_size,
        0,
        out=send[: layout.nbytes],
        nearest=True,
    )
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
    gathered = GatheredRows(
        recv=recv,
        plan=plan,
        bits=bits,
        bucket_size=bucket_size,
        head=head,
        exact_bytes=exact_bytes,
    )
    return gathered, (world - 1) * row_bytes


def decode_rows(output: torch.Tensor, gathered: GatheredRows) -> None:
    """Decode every rank's row of ``gathered`` into ``output`` (W rows, in rank order), the
    compressed values in ``output``'s dtype and the exact ones as they were sent."""
    g, world = gathered, gathered.recv.shape[0]
    rows, fused = output.view(world, -1), g.plan.widths[0]
    nbytes = MaxMinLayout(numel=fused, bits=g.bits, bucket_size=g.bucket_size).nbytes
    codec = maxmin_codec(output.device)
    for r in range(world):
        values = codec.decode(g.recv[r, :nbytes], fused, g.bits, g.bucket_size, output.dtype)
        rows[r].index_copy_(0, g.plan.out, values.index_select(0, g.plan.src))
        if g.exact_bytes:
            exact = g.recv[r, g.head : g.head + g.exact_bytes].view(output.dtype)
            rows[r].index_copy_(0, g.plan.exact, exact)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    bits: int,
    bucket_size: int,
    segments: Sequence[Segment] | None = None,
) -> int:
    """All-gather ``input`` (this rank's row) into ``output`` (W rows of ``input.numel()``, in
    rank order), its ``segments`` marked compressed sent as ``bits``-bit max-min payloads
    rounded to the nearest level, the others exactly; everything exactly where compression
    does not pay (:mod:`.policy`), or for dtypes other than floats. Every rank's output is
    the same, this rank's row decoded from its own payload too. Returns the bytes this rank
    sent."""
    gathered, sent = gather_rows(output, input, group, segments, bits=bits, bucket_size=bucket_size)
    if gathered is not None:
        decode_rows(output, gathered)
    return sent
