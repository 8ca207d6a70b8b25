"""Quantized collectives over a ``torch.distributed`` process group.

The allreduce is scatter-reduce-allgather on packed payloads: encode the W chunks, one
``all_to_all_single`` (an all-gather between two ranks), decode-and-sum into the owned chunk
(fused) and encode it once more, one ``all_gather_into_tensor``, decode. All ranks decode the
same bytes, so they return bit-identical tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from . import graphs
from .checks import (
    UNCOMPRESSED_BITS,
    check_bits,
    check_bucket_size,
    check_float_tensor,
    check_reduce_op,
)
from .codecs import ChunkedLayout, maxmin, maxmin_codec, triton_kernels
from .crossover import crossover_bytes, regime
from .seeding import derive_key, extend_key, next_seed

__all__ = [
    "allreduce_plain",
    "allreduce_plain_",
    "allreduce_quantized",
    "allreduce_quantized_",
    "compression_pays",
    "exchange",
    "group_size_and_rank",
    "reference_allreduce",
    "wait",
]

# torch >= 2.13 renamed all_gather_into_tensor; both exist in between.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_STAGE_SCATTER = 1
_STAGE_GATHER = 2


def allreduce_plain(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """The uncompressed allreduce of a copy of ``t``. AVG uses the backend's own AVG where it
    has one (NCCL); elsewhere (gloo) it sums and divides by the world size."""
    return allreduce_plain_(t.clone(memory_format=torch.contiguous_format), group, reduce_op)


def allreduce_plain_(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """:func:`allreduce_plain` in place, on a contiguous ``t``; returns ``t``."""
    exact, nccl = _plain_route(group)
    if exact is not None:  # the cgx backend, which would otherwise quantize dist.all_reduce
        exact(t, reduce_op).wait()
        return t
    native_avg = reduce_op == "avg" and nccl and t.is_cuda
    op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
    if group is dist.GroupMember.NON_GROUP_MEMBER or torch.compiler.is_compiling():
        dist.all_reduce(t, op=op, group=group)
    else:
        # The process group's own allreduce, which dist.all_reduce calls after its checks
        # and logging: below the crossover this runs instead of a plain allreduce, where NCCL
        # takes 40-100 us, so each microsecond of Python here is 1-2% of the fallback.
        wait(group.allreduce([t], _AVG_OPTIONS if native_avg else _SUM_OPTIONS))
    if reduce_op == "avg" and not native_avg:
        t.div_(dist.get_world_size(group))
    return t


def _options(kind: type, async_op: bool, **fields: object) -> object:
    """Collective options as ``torch.distributed``'s own wrappers make them (``asyncOp``:
    on NCCL's stream, or, where torch has the field and it is False, on the current one)."""
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    if hasattr(options, "asyncOp"):
        options.asyncOp = async_op
    return options


_SUM_OPTIONS = _options(dist.AllreduceOptions, False, reduceOp=dist.ReduceOp.SUM)
_AVG_OPTIONS = _options(dist.AllreduceOptions, False, reduceOp=dist.ReduceOp.AVG)
# Asynchronous (on NCCL's stream, overlapping the caller's), or not (on the caller's stream:
# 4-18 us less host time a call on an H200 machine, bench/nccl_host_cost.py).
_ALL_TO_ALL_OPTIONS = {a: _options(dist.AllToAllOptions, a) for a in (True, False)}
_ALL_GATHER_OPTIONS = {
    a: _options(dist.distributed_c10d.AllgatherOptions, a) for a in (True, False)
}


def _direct(group: dist.ProcessGroup) -> bool:
    """Whether to call ``group``'s collectives directly, as ``torch.distributed``'s wrappers
    do after their checks and logging (7-10 us a call on a CPU, per pipeline piece twice)."""
    return not torch.compiler.is_compiling() and isinstance(group, dist.ProcessGroup)


def wait(work: dist.Work | None) -> None:
    """Wait on a collective's Work, if it returned one: NCCL returns none for a synchronous
    call (asyncOp False), on the caller's stream; gloo returns one that must still be waited."""
    if work is not None:
        work.wait()


def _all_to_all(out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup,
                async_op: bool = True) -> dist.Work | None:  # fmt: skip
    """Start ``dist.all_to_all_single(out, send, async_op=async_op)`` of equal splits. The
    Work, if any, must be waited on (gloo returns one even when ``async_op`` is False)."""
    if _direct(group):
        return group.alltoall_base(out, send, [], [], _ALL_TO_ALL_OPTIONS[async_op])
    return dist.all_to_all_single(out, send, group=group, async_op=async_op)


def _all_gather(out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup,
                async_op: bool = True) -> dist.Work | None:  # fmt: skip
    """Start the all-gather of every rank's ``send`` into ``out``; its Work as
    :func:`_all_to_all`'s."""
    if _direct(group):
        return group._allgather_base(out, send, _ALL_GATHER_OPTIONS[async_op])
    return all_gather_single(out, send, group=group, async_op=async_op)


PAIR_GATHER = True
"""Whether two ranks swap their chunks by an all-gather rather than an all-to-all, outside
NVLink (:func:`exchange`); False for the all-to-all everywhere, to compare them."""


def exchange(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, world: int,
             rank: int, async_op: bool = True) -> dist.Work | None:  # fmt: skip
    """Start sending row j of ``send`` (``[world, P]``) to rank j, each rank's row for us
    landing in its row of ``recv``; our own row of ``recv`` is left undefined (nobody reads
    it). Between two ranks, outside NVLink, that is an all-gather of the row for the other
    rank: the same bytes, through NCCL's collective path rather than its point-to-point one
    (all-to-all), which took 1-34% longer over sockets on 2 H200s (median 23%); over NVLink
    the all-to-all was the faster by about 5% (BENCHMARKS.md, "Two ranks swap by
    all-gather")."""
    if world == 2 and PAIR_GATHER and regime(send.device) != "nvlink":
        return _all_gather(recv.view(-1), send[1 - rank], group, async_op)
    return _all_to_all(recv, send, group, async_op)


_ROUTES: dict[int, tuple[Callable | None, bool]] = {}


def _plain_route(group: dist.ProcessGroup) -> tuple[Callable | None, bool]:
    """The cgx backend's exact allreduce (None for other groups) and whether the group's CUDA
    collectives are NCCL's (an NCCL group, or a cgx one with NCCL under it), once per group:
    looking both up costs microseconds (a missing pybind attribute raises inside
    ``getattr``). Keyed by ``id`` (a weak-keyed dictionary's lookup builds a weak reference
    each time, microseconds again); a destroyed group's entry is dropped as it goes, before
    its id can be reused."""
    route = _ROUTES.get(id(group))
    if route is None:
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return None, False
        exact = getattr(group, "allreduce_exact", None)
        nccl = dist.get_backend(group) == "nccl" or getattr(group, "cuda_on_nccl", False)
        route = _ROUTES[id(group)] = (exact, nccl)
        weakref.finalize(group, _ROUTES.pop, id(group), None)
    return route


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
    stays in full precision. ``bits`` = 32 is the plain allreduce, exactly, and so is a GPU
    tensor too small for compression to pay on this interconnect (:mod:`cgx2.crossover`); a
    group of one returns a copy of ``t``. ``seed`` None draws the next seed from
    :mod:`cgx2.seeding`.

    Tensors larger than a piece (:data:`PIPELINE_BYTES`) are cut into whole buckets per rank;
    while one piece is on the wire the next one is encoded (collectives are issued
    asynchronously, so on GPUs they run on NCCL's stream beside the codec kernels).
    """
    reduce_op = _check_args(t, bits, bucket_size, reduce_op)
    if bits == UNCOMPRESSED_BITS or not compression_pays(t):
        return allreduce_plain(t, group, reduce_op)
    return quantized_copy(t, bits, bucket_size, group, reduce_op, seed, skip_incomplete)


def quantized_copy(t: torch.Tensor, bits: int, bucket_size: int, group: dist.ProcessGroup,
                   reduce_op: str, seed: int | None,
                   skip_incomplete: bool) -> torch.Tensor:  # fmt: skip
    """:func:`allreduce_quantized` once its arguments are checked and compression pays: the
    ops' eager path, whose host time counts (GPU allreduces over NVLink wait on it)."""
    if group_size_and_rank(group)[0] == 1 or t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    _run_pieces(t.reshape(-1), out.view(-1), bits, bucket_size, group, reduce_op, seed,
                skip_incomplete)  # fmt: skip
    return out


def allreduce_quantized_(
    t: torch.Tensor,
    bits: int,
    bucket_size: int,
    group: dist.ProcessGroup,
    reduce_op: str = "sum",
    seed: int | None = None,
    skip_incomplete: bool = False,
    *,
    error: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`allreduce_quantized` in place: the result (the same bytes) is written into
    ``t``, which must be contiguous; returns ``t``. No copy is made, below the crossover
    either (:mod:`cgx2.crossover`).

    ``error`` (a contiguous tensor of ``t``'s shape and dtype), when given, receives ``t``
    minus this rank's contribution as its peers decode it in the first stage: the
    quantization error of the chunks it sends, zero on the chunk it owns (kept exact) and
    everywhere when nothing is quantized. Error feedback carries it into the next step. The
    second stage's error (each reduced chunk quantized once more) is common to all ranks and
    not in it."""
    reduce_op = _check_args(t, bits, bucket_size, reduce_op)
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous for the in-place quantized allreduce")
    if error is not None and (
        error.shape != t.shape or error.dtype != t.dtype or not error.is_contiguous()
    ):
        raise ValueError("error must be a contiguous tensor of the input's shape and dtype")
    if bits == UNCOMPRESSED_BITS or not compression_pays(t):
        if error is not None:
            error.zero_()
        return allreduce_plain_(t, group, reduce_op)
    return quantized_inplace(t, bits, bucket_size, group, reduce_op, seed, skip_incomplete,
                             error)  # fmt: skip


def quantized_inplace(t: torch.Tensor, bits: int, bucket_size: int, group: dist.ProcessGroup,
                      reduce_op: str, seed: int | None, skip_incomplete: bool,
                      error: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`allreduce_quantized_` once its arguments are checked, ``t`` is contiguous and
    compression pays: the ops' eager path, as :func:`quantized_copy`."""
    if group_size_and_rank(group)[0] == 1 or t.numel() == 0:
        if error is not None:
            error.zero_()
        return t
    flat = t.view(-1)
    _run_pieces(flat, flat, bits, bucket_size, group, reduce_op, seed, skip_incomplete,
                None if error is None else error.view(-1))  # fmt: skip
    return t


def _check_args(t: torch.Tensor, bits: int, bucket_size: int, reduce_op: str) -> str:
    check_float_tensor(t, "tensor")
    check_bits(bits)
    check_bucket_size(bucket_size)
    return check_reduce_op(reduce_op)


def _run_pieces(flat: torch.Tensor, out: torch.Tensor, bits: int, bucket_size: int,
                group: dist.ProcessGroup, reduce_op: str, seed: int | None,
                skip_incomplete: bool, error: torch.Tensor | None = None) -> None:  # fmt: skip
    """The pipelined scatter-reduce-allgather of ``flat`` into ``out`` (which may be
    ``flat``: a piece is written only after its last read); ``error`` as in
    :func:`allreduce_quantized_`. With :data:`cgx2.graphs.ENABLED`, a CUDA graph's replay."""
    seed = next_seed() if seed is None else seed
    if not (graphs.usable(flat) and _plain_route(group)[1]):  # graphs replay NCCL only
        _pipeline(_make_run(flat, bits, bucket_size, group, reduce_op, skip_incomplete, seed),
                  flat, out, error)  # fmt: skip
        return
    signature = (flat.data_ptr(), out.data_ptr(), 0 if error is None else error.data_ptr(),
                 flat.numel(), flat.dtype, bits, bucket_size, reduce_op, skip_incomplete,
                 PIPELINE_BYTES, PAIR_GATHER)  # fmt: skip

    def pipeline(device_seed: torch.Tensor) -> None:
        # Seed 0: the host's keys go unused; the kernels read those derived from device_seed.
        run = _make_run(flat, bits, bucket_size, group, reduce_op, skip_incomplete, 0)
        pieces = -(-flat.numel() // run.step)
        piece_keys = triton_kernels("keys_triton").piece_keys  # graphs.usable checked it
        run.keys = piece_keys(device_seed, run.rank, pieces, _STAGE_SCATTER, _STAGE_GATHER)
        _pipeline(run, flat, out, error)

    graphs.run(group, signature, seed, flat.device, pipeline)


def _make_run(flat: torch.Tensor, bits: int, bucket_size: int, group: dist.ProcessGroup,
              reduce_op: str, skip_incomplete: bool, seed: int) -> _Run:  # fmt: skip
    world, rank = group_size_and_rank(group)
    return _Run(group, world, rank, bits, bucket_size, skip_incomplete,
                1.0 / world if reduce_op == "avg" else None, maxmin_codec(flat.device),
                derive_key(seed, _STAGE_SCATTER, rank), derive_key(seed, _STAGE_GATHER),
                _piece_numel(flat.element_size(), world, bucket_size, flat.device),
                flat.is_cuda and _plain_route(group)[1])  # fmt: skip


def _pipeline(run: _Run, flat: torch.Tensor, out: torch.Tensor,
              error: torch.Tensor | None) -> None:  # fmt: skip
    step = run.step
    starts = range(0, flat.numel(), step)
    if len(starts) == 1:  # narrow() and slicing cost microseconds of host time each
        pieces = [_Piece(run, flat, out, 0)]
        pieces[0].error = error
        pieces[0].overlap = error is not None
    else:
        pieces = [_Piece(run, _part(flat, s, step), _part(out, s, step), i)
                  for i, s in enumerate(starts)]  # fmt: skip
        if error is not None:
            for piece, s in zip(pieces, starts, strict=True):
                piece.error = _part(error, s, step)
    # A two-deep software pipeline: scatter piece i, reduce piece i-1, finish piece i-2.
    for i in range(len(pieces) + 2):
        if i < len(pieces):
            pieces[i].scatter()
        if 0 <= i - 1 < len(pieces):
            pieces[i - 1].reduce()
        if 0 <= i - 2 < len(pieces):
            pieces[i - 2].finish()


def _part(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.narrow(0, start, min(length, t.numel() - start))


def group_size_and_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    """``group``'s size and this process's rank in it, looked up once per ProcessGroup (each
    of its pybind methods costs microseconds, ``dist.get_world_size`` more), kept by ``id``
    and dropped with the group, as :func:`_plain_route`'s."""
    found = _SIZE_RANK.get(id(group))
    if found is not None:
        return found
    if not isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group), dist.get_rank(group)
    found = _SIZE_RANK[id(group)] = (group.size(), group.rank())
    weakref.finalize(group, _SIZE_RANK.pop, id(group), None)
    return found


_SIZE_RANK: dict[int, tuple[int, int]] = {}


PIPELINE_BYTES: int | None = None
"""Input bytes per pipeline piece of :func:`allreduce_quantized`; None: the regime's
(:data:`PIECE_NUMEL`). The pieces fix which values share a random key, so every rank, and
:func:`reference_allreduce`, must cut alike."""

PIECE_NUMEL = {"nvlink": 64 << 20, "shm": 32 << 20, "socket": 16 << 20, "cpu": 64 << 20}
"""Values per pipeline piece in each regime (:func:`cgx2.crossover.regime`): values, not
bytes, since both the coding and the bytes on the wire grow with the values whatever the
input dtype. Each piece has a fixed host cost (launches, collectives, allocations). Over
NVLink, where the transfer is shorter than the coding, 256 MiB fp32 pieces beat 64 MiB ones
(2 GPUs, 256 MiB at 4 bits: 0.77 vs 1.49 ms); over shared memory, 32M-value pieces beat 16M
(2 H200s, 256 MiB fp32 at 4 bits: 5.03x NCCL against 4.71x; 1 GiB on 4: 7.12x against
6.98x); over sockets, overlapping more pays: 4 H200s, 256 MiB of bf16 at 4 bits, 3.02x NCCL
with 16M-value pieces against 2.24x with 32M (BENCHMARKS.md)."""

PIECE_NUMEL_PAIR = {"shm": 64 << 20, "socket": 64 << 20}
"""Values per piece where two ranks swap their chunks by all-gather (:data:`PAIR_GATHER`),
in place of :data:`PIECE_NUMEL`. There each collective's fixed cost outweighs the coding
that smaller pieces overlap (2 H200s, 4 bits, calls back to back, against 32M (shm) and
16M (sockets) values: sockets 256 MiB fp32 10.5 against 12.7-12.8 ms, bf16 18.3 against
24.0 ms; shm 256 MiB fp32 1.63-1.65 against 1.68-1.70 ms, 1 GiB 6.32-6.34 against
6.56-6.58 ms; BENCHMARKS.md)."""


def compression_pays(t: torch.Tensor, numel: int | None = None) -> bool:
    """Whether ``t`` (or ``numel`` values of its dtype on its device) is large enough for the
    quantized allreduce to beat the plain one (:mod:`cgx2.crossover`)."""
    threshold = crossover_bytes(t.device, t.dtype)
    numel = t.numel() if numel is None else numel
    return threshold is not None and numel * t.element_size() >= threshold


def _piece_numel(element_size: int, world: int, bucket_size: int,
                 device: torch.device | None = None) -> int:  # fmt: skip
    """Values per pipeline piece: whole buckets for every rank, about :data:`PIPELINE_BYTES`
    (or the regime's :data:`PIECE_NUMEL` on ``device``)."""
    per_piece = world * bucket_size
    if PIPELINE_BYTES is not None:
        return max(1, PIPELINE_BYTES // (element_size * per_piece)) * per_piece
    where = regime(device if device is not None else torch.device("cpu"))
    numel = PIECE_NUMEL[where]
    if world == 2 and PAIR_GATHER:
        numel = PIECE_NUMEL_PAIR.get(where, numel)
    return max(1, numel // per_piece) * per_piece


def reference_allreduce(
    inputs: list[torch.Tensor],
    bits: int,
    bucket_size: int,
    seed: int,
    reduce_op: str = "sum",
    skip_incomplete: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """What :func:`allreduce_quantized` returns on every rank when rank r holds
    ``inputs[r]``, computed in one process with the torch reference codec (same pieces, keys
    and order of summation): a bit-exact model of the collective, for tests and checks.
    ``device`` is where the collective runs, whose regime sets the pieces (default: the
    inputs' device; name the GPU when modelling it from CPU copies)."""
    world, x0 = len(inputs), inputs[0]
    flats = [x.reshape(-1).cpu() for x in inputs]
    out = torch.empty(x0.numel(), dtype=x0.dtype)
    scale = 1.0 / world if check_reduce_op(reduce_op) == "avg" else None
    step = _piece_numel(x0.element_size(), world, bucket_size, device or x0.device)
    for index, s in enumerate(range(0, x0.numel(), step)):
        pieces = [f[s : s + step] for f in flats]
        layout = ChunkedLayout.split(pieces[0].numel(), world, bits, bucket_size, skip_incomplete)
        sent = [
            maxmin.encode_chunks(p, layout, derive_key(seed, _STAGE_SCATTER, r, index), r)
            for r, p in enumerate(pieces)
        ]
        reduced = torch.zeros(world, layout.payload_nbytes, dtype=torch.uint8)
        for j in range(world):
            start, size = layout.chunk_start(j), layout.chunk_size(j)
            received = torch.stack([sent[r][j] for r in range(world)])
            maxmin.decode_sum_encode(
                received, size, pieces[j][start : start + size], j, scale, bits, bucket_size,
                derive_key(seed, _STAGE_GATHER, index), j, skip_incomplete, out=reduced[j],
            )  # fmt: skip
        maxmin.decode_chunks(reduced, layout, x0.dtype, out=out[s : s + pieces[0].numel()])
    return out.view(x0.shape)


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
    codec: ModuleType
    scatter_key: int  # derive_key(seed, _STAGE_SCATTER, rank): extended by the piece index
    gather_key: int  # derive_key(seed, _STAGE_GATHER): likewise
    step: int  # values per piece
    gather_in_place: bool  # the reduced chunk encoded straight into its slot (NCCL)
    keys: torch.Tensor | None = None  # in device memory instead (for a CUDA graph): piece i's
    # scatter key at 2i, its gather key at 2i + 1 (keys_triton.piece_keys)

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
        self.layout = ChunkedLayout.split(x.numel(), run.world, run.bits, run.bucket_size,
                                          run.skip_incomplete)  # fmt: skip
        self.error: torch.Tensor | None = None
        # Collectives on NCCL's stream, beside the coding of other pieces; with nothing to
        # overlap (one piece, no error to decode meanwhile), on the caller's: less host time.
        self.overlap = True

    def scatter(self) -> None:
        """Encode the chunks other ranks own; start sending chunk j to rank j."""
        run, layout = self.run, self.layout
        send = torch.empty(layout.num_chunks, layout.payload_nbytes, dtype=torch.uint8,
                           device=self.x.device)  # fmt: skip
        key = run.scatter_key_of(self.index)
        run.codec.encode_chunks(self.x, layout, key, skip_chunk=run.rank, out=send)
        self.recv = torch.empty_like(send)
        self.work = exchange(self.recv, send, run.group, run.world, run.rank, self.overlap)
        if self.error is not None:
            # Decoding what was sent (while it travels) gives exactly what the owners add, in
            # fp32 as they sum; our own chunk (its row unwritten, decoded to garbage) stays
            # exact, so its error is zero.
            sent = run.codec.decode_chunks(send, layout, torch.float32)
            torch.sub(self.x, sent, out=self.error)  # in fp32, stored in the input's dtype
            start, size = layout.chunk_start(run.rank), layout.chunk_size(run.rank)
            self.error.narrow(0, start, size).zero_()

    def reduce(self) -> None:
        """Sum the received chunks onto our own (kept in full precision), encode the sum once
        more, and start gathering every rank's reduced chunk."""
        wait(self.work)
        run, layout = self.run, self.layout
        start, size = layout.chunk_start(run.rank), layout.chunk_size(run.rank)
        nbytes = layout.payload_nbytes
        self.gathered = torch.empty(run.world * nbytes, dtype=torch.uint8, device=self.x.device)
        if run.gather_in_place:
            # NCCL gathers in place when our contribution already lies in our slot of the
            # output: one allocation and one copy of it fewer.
            reduced = self.gathered[run.rank * nbytes : (run.rank + 1) * nbytes]
        else:
            reduced = torch.empty(nbytes, dtype=torch.uint8, device=self.x.device)
        run.codec.decode_sum_encode(
            self.recv, size, self.x.narrow(0, start, size), run.rank, run.scale, run.bits,
            run.bucket_size, run.gather_key_of(self.index), run.rank,
            layout.skip_incomplete, out=reduced,
        )  # fmt: skip
        self.recv = None
        self.work = _all_gather(self.gathered, reduced, run.group, self.overlap)

    def finish(self) -> None:
        """Decode every rank's reduced chunk (ours too: all ranks decode the same bytes)."""
        wait(self.work)
        rows = self.gathered.view(self.run.world, self.layout.payload_nbytes)
        self.run.codec.decode_chunks(rows, self.layout, self.out.dtype, out=self.out)
        self.gathered = None
