"""The quantized ring allreduce: a reduce-scatter whose every hop decodes, adds its own chunk
and encodes again, then an all-gather that forwards the reduced chunks' bytes as they are.

Each rank sends 2(W − 1) payloads of 1/W of the tensor to one neighbour only, as NCCL's ring
does, where the scatter-reduce-allgather (:mod:`.allreduce`) sends the same bytes to every
peer. The price is accuracy: a value is quantized once per hop, W times in all (twice in the
scatter-reduce-allgather), so its error grows with W (docs/transports.md states the bound).
All ranks decode the same bytes, so the result is bit-identical on every rank. Tensors are cut
into the pipeline's pieces; each hop sends piece k while piece k + 1 is coded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..codecs import ChunkedLayout, maxmin_codec
from ..comm import Transport, group_info
from ..seeding import derive_key, extend_key
from . import policy
from .call_settings import CallSettings
from .rotations import rotation_key, rotation_of

__all__ = ["STAGE_RING", "ring_allreduce"]

STAGE_RING = 3
"""The random stream of the ring's quantizations (each hop's and the reduced chunks')."""


def ring_allreduce(
    route: policy.Route,
    flat: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    seed: int,
) -> None:
    """The ring allreduce (``"sum"``/``"avg"``) of ``flat`` into ``out`` (which may be
    ``flat``) over ``group``, by ``route.transport``'s :meth:`shift`, with ``seed`` (drawn
    where ``settings.seed`` is None). Chunk j of a piece is coded with stream j; hop h of rank
    r's piece k with key (seed, ring, r, k, h). A rotation: piece k rotated by the signs of
    (seed, rotation, k) on every rank, as in :mod:`.allreduce`; every hop sums in the rotated
    domain, the final decode rotates back."""
    info = group_info(group)
    world, rank = info.size, info.rank
    codec, transport = maxmin_codec(flat.device), route.transport
    scale = 1.0 / world if settings.reduce_op == "avg" else None
    step = route.piece_numel
    starts = range(0, flat.numel(), step)
    pieces = [(flat[s : s + step], out[s : s + step]) for s in starts]
    layouts = [
        ChunkedLayout.split(
            x.numel(), world, settings.bits, settings.bucket_size, settings.skip_incomplete
        )
        for x, _ in pieces
    ]
    rank_key = derive_key(seed, STAGE_RING, rank)
    rotations = [rotation_of(settings.rotation, rotation_key(seed), k) for k in range(len(pieces))]

    def chunk(k: int, j: int) -> torch.Tensor:
        layout = layouts[k]
        return pieces[k][0].narrow(0, layout.chunk_start(j), layout.chunk_size(j))

    def empty_rows(k: int, rows: int) -> torch.Tensor:
        return torch.empty(rows, layouts[k].payload_nbytes, dtype=torch.uint8, device=flat.device)

    # The reduce-scatter: hop h sends chunk (r - h), receives chunk (r - h - 1) and adds ours.
    sending = []
    for k in range(len(pieces)):
        payload = empty_rows(k, 1)[0]
        if layouts[k].chunk_size(rank):  # a tensor of fewer buckets than ranks has empty ones
            codec.encode(
                chunk(k, rank),
                settings.bits,
                settings.bucket_size,
                extend_key(rank_key, k, 0),
                rank,
                settings.skip_incomplete,
                payload,
                rotation=rotations[k],
            )
        sending.append(payload)
    gathered = [empty_rows(k, world) for k in range(len(pieces))]
    for hop in range(world - 1):
        held = (rank - hop - 1) % world
        last = hop == world - 2
        received = [empty_rows(k, 2) for k in range(len(pieces))]  # row 1: ours, never read

        def add_ours(
            k: int, held: int = held, last: bool = last, received=received, hop: int = hop
        ) -> None:
            # The last hop completes chunk r + 1: encoded into its row of the all-gather.
            target = gathered[k][held] if last else empty_rows(k, 1)[0]
            sending[k] = target
            if not layouts[k].chunk_size(held):
                return
            codec.decode_sum_encode(
                received[k],
                layouts[k].chunk_size(held),
                chunk(k, held),
                1,
                scale if last else None,
                settings.bits,
                settings.bucket_size,
                extend_key(rank_key, k, hop + 1),
                held,
                settings.skip_incomplete,
                out=target,
                rotation=rotations[k],
            )

        buffers = lambda k, r=received: (r[k][0], sending[k])
        _pipelined(transport, group, len(pieces), buffers, add_ours, "reduce-scatter")
    # The all-gather: hop h forwards chunk (r + 1 - h), receives chunk (r - h).
    for hop in range(world - 1):
        send_row, recv_row = (rank + 1 - hop) % world, (rank - hop) % world
        _pipelined(
            transport,
            group,
            len(pieces),
            lambda k, s=send_row, r=recv_row: (gathered[k][r], gathered[k][s]),
            lambda k: None,
            "all-gather",
        )
    for k, (_, result) in enumerate(pieces):
        codec.decode_chunks(
            gathered[k], layouts[k], result.dtype, out=result, rotation=rotations[k]
        )


def _pipelined(
    transport: Transport,
    group: dist.ProcessGroup,
    count: int,
    buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    after: Callable[[int], None],
    phase: str,
) -> None:
    """One hop of every piece: piece k's shift starts before piece k - 1's result is used, so
    that coding one overlaps sending the next (two in flight at most: the shared-memory
    transport's slots bound it)."""
    pending = None
    try:
        for k in range(count):
            recv, send = buffers(k)
            work = transport.shift(recv, send, group, True)
            if pending is not None:
                transport.wait(pending[1])
                after(pending[0])
            pending = (k, work)
        if pending is not None:
            transport.wait(pending[1])
            after(pending[0])
    except RuntimeError as e:  # a transport's error (a peer died or stalled): say where
        raise RuntimeError(f"cgx2: the ring allreduce failed in its {phase}: {e}") from e
