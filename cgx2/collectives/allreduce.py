"""The quantized allreduce: scatter-reduce-allgather on packed payloads, pipelined in pieces.

Per piece: encode the W chunks, one all-to-all (an all-gather between two ranks), decode-and-sum
into the owned chunk and encode it once more (fused), one all-gather, decode. All ranks decode
the same bytes, so they return bit-identical tensors. :mod:`.policy` decides every route; its
``gather_all`` (``CGX2_ALGORITHM=allgather``) instead encodes each rank's piece whole, gathers
every rank's and sums their decodings on every rank: one collective and one quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import scratch
from ..codecs import ChunkedLayout, Codec, Rotation, maxmin_codec, triton_kernels
from ..codecs.maxmin import fp32_scalar
from ..comm import Transport, group_info, process_group
from ..seeding import derive_key, extend_key, next_seed
from . import agreement, graphs, policy, ring
from .call_settings import CallSettings
from .rotations import STAGE_ROTATION, rotation_key, rotation_of

__all__ = ["STAGE_GATHER", "STAGE_SCATTER", "allreduce", "allreduce_", "exchange"]

STAGE_SCATTER = 1
"""The random stream of the first quantization (each rank's chunks, on their way to owners)."""
STAGE_GATHER = 2
"""The random stream of the second (each reduced chunk, before the all-gather)."""


def allreduce(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    *,
    check_agreement: bool = False,
    route_numel: int | None = None,
) -> torch.Tensor:
    """Allreduce (``settings.reduce_op``: ``"sum"``/``"avg"``) of ``t`` across ``group``,
    quantized to ``settings.bits`` where :func:`.policy.route` says compression pays, else the
    plain allreduce, exactly. Returns a new tensor of ``t``'s shape and dtype, bit-identical
    on every rank; ``t`` is unchanged.

    The settings are the entry points' to check (they are, once). Each value is quantized
    twice (on the way to its owner, and once reduced); the owner's own contribution stays
    exact; on a route that gathers all (``CGX2_ALGORITHM=allgather``), once, every rank's.
    Tensors larger than a piece are cut into whole buckets per rank; while one piece is on
    the wire the next is coded.

    ``route_numel``: the size the route is decided by (:func:`allreduce_`'s).

    ``check_agreement``: where the route says so, first make sure every rank called alike
    (:mod:`.agreement`): for the entry points users call. DDP's and FSDP's hooks leave it
    off: their wrappers make every rank's buckets alike.

    ``settings.rotation`` codes each piece's randomized Hadamard rotation, its signs from the
    call's seed and the piece (:mod:`.rotations`), the same on every rank; the owners sum
    rotated values and the final decode rotates back (docs/wire-format.md, "Rotation").
    """
    t = t.resolve_neg()  # the codecs and the process group read stored values, not the view's
    route = policy.route(t, group, settings.bits, settings.bucket_size, route_numel)
    agreed = None
    if check_agreement and route.check:
        agreed = _check_agreement(route, t, group, settings)
    if not route.compress:
        out = route.transport.allreduce_plain_(
            t.clone(memory_format=torch.contiguous_format), group, settings.reduce_op
        )
        return agreement.settle(agreed, out, group)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    _run_pieces(route, t.reshape(-1), out.view(-1), group, settings)
    return agreement.settle(agreed, out, group)


def allreduce_(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    *,
    error: torch.Tensor | None = None,
    check_agreement: bool = False,
    route_numel: int | None = None,
) -> torch.Tensor:
    """:func:`allreduce` in place: the result (the same bytes) is written into ``t`` and ``t``
    is returned. No copy is made where ``t`` is contiguous, below the crossover either.

    ``route_numel``: the size the route is decided by, where ``t`` is a part of a larger
    reduction decided as a whole (a DDP bucket's layers of one width): its own otherwise.

    ``error`` (a contiguous tensor of ``t``'s shape and dtype), when given, receives ``t``
    minus this rank's contribution as its peers decode it in the first stage: the
    quantization error of the chunks it sends, zero on the chunk it owns (kept exact) and
    everywhere when nothing is quantized (gathering all, no chunk is kept exact). Error
    feedback carries it into the next step. The
    second stage's error (each reduced chunk quantized once more) is common to all ranks and
    not in it. With a rotation, the error is measured in the values' own domain (what was
    put in minus the rotated payload decoded and rotated back), so it adds to the next
    step's gradient as it is."""
    if error is not None and (
        error.shape != t.shape or error.dtype != t.dtype or not error.is_contiguous()
    ):
        raise ValueError("error must be a contiguous tensor of the input's shape and dtype")
    if not t.is_contiguous() or t.is_neg():  # reduced as a copy, written back through the view
        if error is not None:
            raise ValueError(
                "tensor must be contiguous, not a negative view, for an allreduce that returns "
                "its error"
            )
        reduced = allreduce(
            t, group, settings, check_agreement=check_agreement, route_numel=route_numel
        )
        return t.copy_(reduced)
    route = policy.route(t, group, settings.bits, settings.bucket_size, route_numel)
    agreed = None
    if check_agreement and route.check:
        agreed = _check_agreement(route, t, group, settings)
    if not route.compress:
        if error is not None:
            error.zero_()
        return agreement.settle(
            agreed, route.transport.allreduce_plain_(t, group, settings.reduce_op), group
        )
    flat = t.view(-1)
    _run_pieces(route, flat, flat, group, settings, None if error is None else error.view(-1))
    return agreement.settle(agreed, t, group)


def _check_agreement(
    route: policy.Route, t: torch.Tensor, group: dist.ProcessGroup, settings: CallSettings
) -> torch.Tensor | None:
    fields = {
        "bits": settings.bits,
        "bucket_size": settings.bucket_size,
        "reduce_op": settings.reduce_op,
        "skip_incomplete": settings.skip_incomplete,
        "rotation": settings.rotation_name,
        "rotation_block": settings.rotation_block,
        "compressed": route.compress,
    }
    return agreement.check(
        group, "quantized_allreduce", t, fields, deferred=route.check == "deferred", route=route
    )


def exchange(
    recv: torch.Tensor,
    send: torch.Tensor,
    group: dist.ProcessGroup,
    world: int,
    rank: int,
    pair_gather: bool,
    async_op: bool = True,
    transport: Transport = process_group,
) -> dist.Work | None:
    """Start sending row j of ``send`` (``[world, P]``) to rank j, each rank's row for us
    landing in its row of ``recv``; our own row of ``recv`` is left undefined (nobody reads
    it). With ``pair_gather`` (two ranks: :func:`.policy.uses_pair_gather`), that is an
    all-gather of the row for the other rank: the same bytes by NCCL's collective path."""
    if pair_gather:
        return transport.all_gather(recv.view(-1), send[1 - rank], group, async_op)
    return transport.all_to_all(recv, send, group, async_op)


def _run_pieces(
    route: policy.Route,
    flat: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    error: torch.Tensor | None = None,
) -> None:
    """The pipelined scatter-reduce-allgather of ``flat`` into ``out`` (which may be
    ``flat``: a piece is written only after its last read); ``error`` as in
    :func:`allreduce_`. Where the route says so, a CUDA graph's replay."""
    seed = next_seed() if settings.seed is None else settings.seed
    if route.ring and error is None:  # the ring's error is not one rank's to feed back
        ring.ring_allreduce(route, flat, out, group, settings, seed)
        return
    rotation = settings.rotation
    # The clipped rotation is coded by the torch reference until its kernels exist: eagerly.
    if not route.graphs or (rotation is not None and rotation.clipped):
        _pipeline(_make_run(route, flat, group, settings, seed), flat, out, error)
        return
    signature = (
        flat.data_ptr(),
        out.data_ptr(),
        0 if error is None else error.data_ptr(),
        flat.numel(),
        flat.dtype,
        settings.bits,
        settings.bucket_size,
        settings.reduce_op,
        settings.skip_incomplete,
        route,
        None if rotation is None else rotation.block,
    )

    def pipeline(device_seed: torch.Tensor) -> None:
        # Seed 0: the host's keys go unused; the kernels read those derived from device_seed.
        run = _make_run(route, flat, group, settings, 0)
        pieces = -(-flat.numel() // run.step)
        piece_keys = triton_kernels("keys_triton").piece_keys  # graphs.usable checked it
        run.keys = piece_keys(device_seed, run.rank, pieces, STAGE_SCATTER, STAGE_GATHER)
        if rotation is not None:
            # The rotation's keys are rank-free: the gather half of piece_keys's output (at
            # 2i + 1, derive_key(seed, STAGE_ROTATION, i)), so a replay rotates as the eager
            # call of its seed does, fresh signs every step.
            run.rotation_keys = piece_keys(device_seed, 0, pieces, STAGE_ROTATION, STAGE_ROTATION)
        _pipeline(run, flat, out, error)

    graphs.run(group, signature, seed, flat.device, pipeline)


def _make_run(
    route: policy.Route,
    flat: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    seed: int,
) -> _Run:
    info = group_info(group)
    world, rank = info.size, info.rank
    return _Run(
        group=group,
        world=world,
        rank=rank,
        scale=1.0 / world if settings.reduce_op == "avg" else None,
        codec=maxmin_codec(flat.device),
        bits=settings.bits,
        bucket_size=settings.bucket_size,
        skip_incomplete=settings.skip_incomplete,
        scatter_key=derive_key(seed, STAGE_SCATTER, rank),
        gather_key=derive_key(seed, STAGE_GATHER),
        step=route.piece_numel,
        gather_in_place=route.gather_in_place,
        pair_gather=route.pair_gather,
        gather_all=route.gather_all,
        transport=route.transport,
        rotation=settings.rotation,
        rotation_key=rotation_key(seed),
    )


def _pipeline(run: _Run, flat: torch.Tensor, out: torch.Tensor, error: torch.Tensor | None) -> None:
    step = run.step
    starts = range(0, flat.numel(), step)
    if len(starts) == 1:  # narrow() and slicing cost microseconds of host time each
        pieces = [_Piece(run, flat, out, 0)]
        pieces[0].error = error
        pieces[0].overlap = error is not None
    else:
        pieces = [
            _Piece(run, _slice_within(flat, s, step), _slice_within(out, s, step), i)
            for i, s in enumerate(starts)
        ]
        if error is not None:
            for piece, s in zip(pieces, starts, strict=True):
                piece.error = _slice_within(error, s, step)
    # A two-deep software pipeline: scatter piece i, reduce piece i-1, finish piece i-2.
    stage = "sending its chunks"
    try:
        for i in range(len(pieces) + 2):
            if i < len(pieces):
                stage = "sending its chunks"
                pieces[i].scatter()
            if 0 <= i - 1 < len(pieces):
                stage = "receiving the chunks it owns"  # reduce() waits for them first
                pieces[i - 1].reduce()
            if 0 <= i - 2 < len(pieces):
                stage = "gathering the reduced chunks"
                pieces[i - 2].finish()
    except RuntimeError as e:  # a transport's error (a peer died or stalled): say where
        raise RuntimeError(
            f"cgx2: the quantized allreduce of {flat.numel()} values over {run.world} ranks "
            f"(this is rank {run.rank}) failed {stage}: {e}"
        ) from e


def _slice_within(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.narrow(0, start, min(length, t.numel() - start))


@dataclass(slots=True)
class _Run:
    """What every piece of one allreduce shares, looked up once per call (the host's time per
    piece is what pipelining a tensor into pieces costs; a frozen dataclass's __init__ alone
    took microseconds)."""

    group: dist.ProcessGroup
    world: int
    rank: int
    bits: int
    bucket_size: int
    skip_incomplete: bool
    scale: float | None
    codec: Codec
    scatter_key: int  # derive_key(seed, STAGE_SCATTER, rank): extended by the piece index
    gather_key: int  # derive_key(seed, STAGE_GATHER): likewise
    step: int  # values per piece
    gather_in_place: bool  # the reduced chunk encoded straight into its slot (NCCL)
    pair_gather: bool  # two ranks swap chunks by all-gather (exchange)
    gather_all: bool  # every rank's piece gathered whole and summed by all (no owners)
    transport: Transport
    rotation: Rotation | None  # the call's (its block; None: none)
    rotation_key: int  # derive_key(seed, STAGE_ROTATION): extended by the piece index
    keys: torch.Tensor | None = None  # in device memory instead (for a CUDA graph): piece i's
    # scatter key at 2i, its gather key at 2i + 1 (keys_triton.piece_keys)
    rotation_keys: torch.Tensor | None = None  # likewise, piece i's rotation key at 2i + 1

    def rotation_of(self, index: int) -> Rotation | None:
        if self.rotation_keys is None:
            return rotation_of(self.rotation, self.rotation_key, index)
        key = self.rotation_keys[2 * index + 1 : 2 * index + 2]
        return rotation_of(self.rotation, key)

    def scatter_key_of(self, index: int) -> int | torch.Tensor:
        if self.keys is None:
            return extend_key(self.scatter_key, index)
        return self.keys[2 * index : 2 * index + 1]

    def gather_key_of(self, index: int) -> int | torch.Tensor:
        if self.keys is None:
            return extend_key(self.gather_key, index)
        return self.keys[2 * index + 1 : 2 * index + 2]


class _Piece:
    """One pipeline piece of the scatter-reduce-allgather: its buffers and pending work."""

    def __init__(self, run: _Run, x: torch.Tensor, out: torch.Tensor, index: int) -> None:
        self.run, self.x, self.out, self.index = run, x, out, index
        chunks = 1 if run.gather_all else run.world  # gathering all, no rank owns a chunk
        self.layout = ChunkedLayout.split(
            x.numel(), chunks, run.bits, run.bucket_size, run.skip_incomplete
        )
        self.error: torch.Tensor | None = None
        self.rotation = run.rotation_of(index)  # the same on every rank
        # Buffers of the CPU path's scratch (:mod:`cgx2.scratch`), given back once done with.
        self.send = self.recv = self.reduced = self.gathered = None
        # Collectives on NCCL's stream, beside the coding of other pieces; with nothing to
        # overlap (one piece, no error to decode meanwhile), on the caller's: less host time.
        self.overlap = True

    def scatter(self) -> None:
        """Encode the chunks other ranks own; start sending chunk j to rank j. Gathering all:
        encode the whole piece, start gathering every rank's."""
        run, layout = self.run, self.layout
        if run.gather_all:
            self._gather_all()
            return
        nbytes = layout.num_chunks * layout.payload_nbytes
        send = scratch.take(nbytes, torch.uint8, self.x.device).view(layout.num_chunks, -1)
        key = run.scatter_key_of(self.index)
        run.codec.encode_chunks(
            self.x, layout, key, skip_chunk=run.rank, out=send, rotation=self.rotation
        )
        self.send = send
        self.recv = scratch.take(nbytes, torch.uint8, self.x.device).view(send.shape)
        self.work = exchange(
            self.recv,
            send,
            run.group,
            run.world,
            run.rank,
            run.pair_gather,
            self.overlap,
            run.transport,
        )
        if self.error is not None:
            # Decoding what was sent (while it travels) gives exactly what the owners add, in
            # fp32 as they sum; our own chunk (its row unwritten, decoded to garbage) stays
            # exact, so its error is zero. Rotated, the decoding is rotated back: the error is
            # the values' own, which the next step's gradient takes as it is.
            sent = run.codec.decode_chunks(send, layout, torch.float32, rotation=self.rotation)
            torch.sub(self.x, sent, out=self.error)  # in fp32, stored in the input's dtype
            start, size = layout.chunk_start(run.rank), layout.chunk_size(run.rank)
            self.error.narrow(0, start, size).zero_()

    def _gather_all(self) -> None:
        """Encode the whole piece and start gathering every rank's; with an error, what the
        others decode of ours."""
        run, layout = self.run, self.layout
        nbytes = layout.payload_nbytes
        self.gathered = scratch.take(run.world * nbytes, torch.uint8, self.x.device)
        if run.gather_in_place:  # our row of the gather's output, as in reduce()
            mine = self.gathered[run.rank * nbytes : (run.rank + 1) * nbytes].view(1, nbytes)
        else:
            mine = self.reduced = scratch.take(nbytes, torch.uint8, self.x.device).view(1, -1)
        key = run.scatter_key_of(self.index)
        run.codec.encode_chunks(self.x, layout, key, out=mine, rotation=self.rotation)
        self.work = run.transport.all_gather(self.gathered, mine.view(-1), run.group, self.overlap)
        if self.error is not None:
            sent = run.codec.decode_chunks(mine, layout, torch.float32, rotation=self.rotation)
            torch.sub(self.x, sent, out=self.error)

    def _sum_gathered(self) -> None:
        """Every rank's row decoded, times the scale, summed in rank order in fp32 (the same
        bytes and order on every rank), into the output."""
        run, layout = self.run, self.layout
        run.transport.wait(self.work)
        rows = self.gathered.view(run.world, layout.payload_nbytes)
        # An fp32 output is the sum itself (its piece of the input was encoded already).
        acc = self.out if self.out.dtype == torch.float32 else None
        for w in range(run.world):
            first = w == 0
            row = run.codec.decode_chunks(
                rows[w : w + 1],
                layout,
                torch.float32,
                out=acc if first else None,
                rotation=self.rotation,
            )
            if run.scale is not None:  # as the plain allreduce: each divided, then summed
                row.mul_(fp32_scalar(run.scale))
            acc = row if first else acc.add_(row)
        if acc is not self.out:
            self.out.copy_(acc)
        scratch.give(self.gathered, self.reduced)
        self.gathered = self.reduced = None

    def reduce(self) -> None:
        """Sum the received chunks onto our own (kept in full precision), encode the sum once
        more, and start gathering every rank's reduced chunk. Gathering all: sum every rank's
        decoded piece."""
        run, layout = self.run, self.layout
        if run.gather_all:
            self._sum_gathered()
            return
        run.transport.wait(self.work)
        scratch.give(self.send)  # sent: the exchange is done with it
        self.send = None
        start, size = layout.chunk_start(run.rank), layout.chunk_size(run.rank)
        nbytes = layout.payload_nbytes
        self.gathered = scratch.take(run.world * nbytes, torch.uint8, self.x.device)
        if run.gather_in_place:
            # NCCL gathers in place when our contribution already lies in our slot of the
            # output: one allocation and one copy of it fewer.
            reduced = self.gathered[run.rank * nbytes : (run.rank + 1) * nbytes]
        else:
            reduced = scratch.take(nbytes, torch.uint8, self.x.device)
        run.codec.decode_sum_encode(
            self.recv,
            size,
            self.x.narrow(0, start, size),
            run.rank,
            run.scale,
            run.bits,
            run.bucket_size,
            run.gather_key_of(self.index),
            run.rank,
            layout.skip_incomplete,
            out=reduced,
            rotation=self.rotation,
        )
        scratch.give(self.recv)
        self.recv = None
        self.reduced = None if run.gather_in_place else reduced
        self.work = run.transport.all_gather(self.gathered, reduced, run.group, self.overlap)

    def finish(self) -> None:
        """Decode every rank's reduced chunk (ours too: all ranks decode the same bytes).
        Gathering all: done in :meth:`reduce`."""
        if self.run.gather_all:
            return
        self.run.transport.wait(self.work)
        rows = self.gathered.view(self.run.world, self.layout.payload_nbytes)
        self.run.codec.decode_chunks(
            rows, self.layout, self.out.dtype, out=self.out, rotation=self.rotation
        )
        scratch.give(self.gathered, self.reduced)
        self.gathered = self.reduced = None
