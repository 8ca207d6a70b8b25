"""The policy's decision itself: a call's facts, as plain values, to a :class:`Route`, with no
I/O; :mod:`.policy` gathers the facts (regime, crossovers, settings) and caches the routes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..checks import UNCOMPRESSED_BITS
from ..comm import Transport, process_group

__all__ = [
    "CPU_ACROSS_NODES_PIECE_NUMEL",
    "CROSSOVER_BYTES",
    "CROSSOVER_BYTES_GRAPHS",
    "GRAPHS_AUTO_MAX_BYTES",
    "PIECE_NUMEL",
    "PIECE_NUMEL_PAIR",
    "CallFacts",
    "GroupFacts",
    "Route",
    "Routes",
    "agreement_check",
    "compressed_route",
    "compresses",
    "decide",
    "for_thread",
    "graphed",
    "may_compress",
    "nearest_size",
    "pair_gather",
    "piece_numel",
    "plan",
    "table_crossover",
]

CROSSOVER_BYTES: dict[str, tuple[int | None, int | None]] = {
    # regime: (fp32 input, 16-bit input) in bytes; None: compression never reliably won.
    # Over NVLink, 16-bit input lost to NCCL at every size measured. CPU users ask for
    # compression: on one host gloo is faster, but over links slower than the codec it wins,
    # and the link between CPU nodes is unknown here (BENCHMARKS.md, "CPU").
    "cpu": (0, 0),
    "socket": (4 << 20, 4 << 20),
    "shm": (16 << 20, 16 << 20),
    "nvlink": (256 << 20, None),
}
"""The smallest tensor the quantized allreduce compresses, per regime and input width, where
no calibration file says otherwise (BENCHMARKS.md, "The crossover")."""

CROSSOVER_BYTES_GRAPHS: dict[str, tuple[int | None, int | None]] = {
    "cpu": (0, 0),
    "socket": (4 << 20, 4 << 20),
    "shm": (4 << 20, 16 << 20),
    "nvlink": (64 << 20, 256 << 20),
}
""":data:`CROSSOVER_BYTES` with CUDA-graph replay, whose host time is a fraction of the
launches': smaller where the host bounded the eager call."""

GRAPHS_AUTO_MAX_BYTES = 64 << 20
"""With ``CGX2_CUDA_GRAPHS=auto`` (the default), compressed GPU allreduces on NCCL of at most
this many bytes replay CUDA graphs: there the host's launches are a large share of a call
(BENCHMARKS.md, "Host time"), and each graph's buffers (about half the input's bytes at 4
bits) stay small beside the GPU's memory. Larger ones launch eagerly; the crossovers stay the
eager ones' (:data:`CROSSOVER_BYTES`): graphs make a compressed call cheaper, not more calls
compressed."""

PIECE_NUMEL = {"nvlink": 64 << 20, "shm": 32 << 20, "socket": 16 << 20, "cpu": 64 << 20}
"""Values per pipeline piece in each regime: values, not bytes, since both the coding and the
bytes on the wire grow with the values whatever the input dtype. Each piece has a fixed host
cost; smaller pieces overlap more coding with sending. Where the transfer is short against the
coding (NVLink) large pieces win; over sockets overlapping more pays (BENCHMARKS.md,
"Pipeline pieces")."""

CPU_ACROSS_NODES_PIECE_NUMEL = 1 << 20
"""Values per piece for CPU tensors of a job that spans nodes, called alone, in place of
:data:`PIECE_NUMEL`'s: there the link, not the codec, bounds the call, and smaller pieces keep
it busy while the next is coded. Beside the training step (DDP's hooks) one piece a bucket
trained faster (BENCHMARKS.md, "CPU hosts over Ethernet")."""

PIECE_NUMEL_PAIR = {"shm": 64 << 20, "socket": 64 << 20}
"""Values per piece where two ranks swap their chunks by all-gather, in place of
:data:`PIECE_NUMEL`: there each collective's fixed cost outweighs the coding that smaller
pieces overlap (BENCHMARKS.md, "Pipeline pieces")."""


@dataclass(frozen=True, slots=True)
class Route:
    """How one allreduce (or reduce-scatter) runs.

    - ``compress``: quantize, or run the plain collective.
    - ``regime``: the interconnect it crosses (:func:`cgx2.collectives.policy.regime`).
    - ``pair_gather``: two ranks swap their chunks by an all-gather rather than an all-to-all.
    - ``piece_numel``: values per pipeline piece (whole buckets for every rank).
    - ``graphs``: replay the pipeline as a CUDA graph (NCCL groups, CUDA tensors, Triton).
    - ``gather_in_place``: encode each reduced chunk straight into its slot of the gather's
      output (NCCL gathers in place: one allocation and copy fewer).
    - ``check``: how to make sure every rank called it alike (:mod:`.agreement`): ``"now"``
      (before the call), ``"deferred"`` (compared on the device in stream order; the result
      is poisoned and the error raised later), or ``""`` (not at all).
    - ``transport``: what moves the bytes (a :class:`cgx2.comm.Transport`):
      :func:`cgx2.collectives.policy.transport`.
    - ``ring``: the pipelined ring (:mod:`.ring`) instead of the scatter-reduce-allgather:
      ``CGX2_ALGORITHM=ring`` only. Its error grows with the world size, and where it was
      measured it was no faster (BENCHMARKS.md, "Transports").
    - ``gather_all``: every rank's piece quantized once, all-gathered whole, and the rows
      decoded and summed by every rank, instead of the scatter-reduce-allgather:
      ``CGX2_ALGORITHM=allgather`` only. One collective a piece and no second quantization,
      for the same bytes between two ranks (W / 2 times the bytes among W).
    - ``settings``: what the route was decided under that every rank must share, as JSON: the
      variables that change the bytes (:func:`cgx2.config.wire_settings`) and what this route
      made of them (``route.*``); ``fingerprint``: its CRC, which the agreement check compares.
    """

    compress: bool
    regime: str
    pair_gather: bool
    piece_numel: int
    graphs: bool
    gather_in_place: bool
    check: str = ""
    transport: Transport = process_group
    ring: bool = False
    gather_all: bool = False
    settings: str = "{}"
    fingerprint: int = 0


@dataclass(frozen=True, slots=True)
class GroupFacts:
    """What a call's route depends on that is fixed for its group, device, dtype and bucket
    size: the facts :func:`plan` decides from, gathered by :mod:`.policy`.

    - ``regime``: the interconnect (``cpu``, ``socket``, ``shm``, ``nvlink``).
    - ``world``: the group's size; ``element_size``: bytes a value; ``bucket_size``: values
      a bucket.
    - ``nccl_cuda``: CUDA tensors on a group whose CUDA collectives are NCCL's.
    - ``transport``: what moves the bytes (:func:`cgx2.collectives.policy.transport`).
    - ``pair_gather``, ``pipeline_bytes``, ``algorithm``, ``check_agreement``: the
      ``CGX2_*`` settings of those names (:class:`cgx2.config.TuningConfig`).
    - ``spans_nodes``: the launcher says the job spans several nodes.
    - ``wire_settings``: the variables that change the bytes (:func:`cgx2.config.wire_settings`).
    """

    regime: str
    world: int
    element_size: int
    bucket_size: int
    nccl_cuda: bool = False
    transport: Transport = process_group
    pair_gather: bool = True
    pipeline_bytes: int | None = None
    spans_nodes: bool = False
    algorithm: str = "auto"
    check_agreement: str = "auto"
    wire_settings: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Routes:
    """What :func:`plan` decides once per group, device, dtype and bucket size."""

    plain: Route
    compressed: Route
    compressed_beside: Route  # for calls beside the training step (its pieces may differ)
    graphs: Route | None  # the compressed route replayed as a CUDA graph, where it may be
    size: int  # the group's


@dataclass(frozen=True, slots=True)
class CallFacts:
    """One call's facts: its group's (:class:`GroupFacts`) and its own.

    - ``bits``: the width asked for (32: uncompressed); ``numel``: the values reduced.
    - ``crossovers``: the smallest bytes compressed, for calls alone and for calls beside the
      training step (None: never); ``beside_compute``: the call runs beside the training step.
    - ``cuda_graphs``: ``CGX2_CUDA_GRAPHS`` (None: auto); ``graphs_usable``: a graph may
      replay this call (:func:`cgx2.collectives.graphs.usable`).
    """

    group: GroupFacts
    bits: int
    numel: int
    crossovers: tuple[int | None, int | None] = (0, 0)
    beside_compute: bool = False
    cuda_graphs: bool | None = None
    graphs_usable: bool = False


def table_crossover(regime: str, itemsize: int, with_graphs: bool) -> int | None:
    """The built-in crossover of ``regime`` for values of ``itemsize`` bytes
    (:data:`CROSSOVER_BYTES`, or :data:`CROSSOVER_BYTES_GRAPHS` ``with_graphs``)."""
    table = CROSSOVER_BYTES_GRAPHS if with_graphs else CROSSOVER_BYTES
    return table[regime][0 if itemsize >= 4 else 1]


def for_thread(crossovers: tuple[int | None, int | None], beside_compute: bool) -> int | None:
    """Of a pair of crossovers (for calls alone, for calls beside the training step), the one
    for a call beside the training step (``beside_compute``) or not."""
    alone, beside_step = crossovers
    return beside_step if beside_compute else alone


def pair_gather(world: int, regime: str, allowed: bool) -> bool:
    """Whether two ranks swap their chunks by all-gather (``allowed``: ``CGX2_PAIR_GATHER``):
    the same bytes through NCCL's collective path rather than its point-to-point one, which was
    the slower outside NVLink and the faster over it (BENCHMARKS.md, "Two ranks swap by
    all-gather")."""
    return world == 2 and regime != "nvlink" and allowed


def gathers_all(algorithm: str) -> bool:
    """Whether ``CGX2_ALGORITHM=algorithm`` asks each rank's piece quantized once and gathered
    by all (:class:`Route`'s ``gather_all``): only when named, until it is timed on GPUs
    (docs/transports.md, "The algorithms")."""
    return algorithm == "allgather"


def piece_numel(facts: GroupFacts, pair_gather: bool, beside_compute: bool) -> int:
    """Values per pipeline piece of a call that ``facts`` describe (whose chunks two ranks swap
    by all-gather where ``pair_gather``): whole buckets for every rank, about
    ``facts.pipeline_bytes`` of input where given, or the regime's :data:`PIECE_NUMEL` (CPU
    tensors of a job that spans nodes, called alone: :data:`CPU_ACROSS_NODES_PIECE_NUMEL`)."""
    regime = facts.regime
    per_piece = facts.world * facts.bucket_size
    if facts.pipeline_bytes is not None:
        return max(1, facts.pipeline_bytes // (facts.element_size * per_piece)) * per_piece
    numel = (
        PIECE_NUMEL_PAIR.get(regime, PIECE_NUMEL[regime]) if pair_gather else PIECE_NUMEL[regime]
    )
    if regime == "cpu" and facts.spans_nodes and not beside_compute:
        numel = CPU_ACROSS_NODES_PIECE_NUMEL
    return max(1, numel // per_piece) * per_piece


def agreement_check(setting: str, nccl_cuda: bool) -> str:
    """:class:`Route`'s ``check`` for ``CGX2_CHECK_AGREEMENT=setting``. CUDA tensors on NCCL:
    a check costs a fixed fraction of a millisecond a call, either way (BENCHMARKS.md, "The
    agreement check"), so there it is asked for, not given."""
    return {"on": "now", "off": "", "deferred": "deferred"}.get(setting, "" if nccl_cuda else "now")


def graphed(nbytes: int, cuda_graphs: bool | None) -> bool:
    """Whether ``CGX2_CUDA_GRAPHS=cuda_graphs`` (None: auto) asks a compressed call of
    ``nbytes`` to replay a graph."""
    return cuda_graphs is True or (cuda_graphs is None and nbytes <= GRAPHS_AUTO_MAX_BYTES)


def nearest_size(faster: Mapping[int, bool], nbytes: int) -> bool:
    """The answer of ``faster`` (measured sizes in bytes to whether the node mesh won) at the
    size nearest ``nbytes`` on a log scale."""
    nbytes = max(1, nbytes)
    return faster[min(faster, key=lambda size: abs(math.log(size / nbytes)))]


def plan(facts: GroupFacts) -> Routes:
    """The routes of every call that ``facts`` describe: plain, compressed (alone, beside the
    training step) and, where one may, compressed as a CUDA graph."""
    pair = pair_gather(facts.world, facts.regime, facts.pair_gather)
    pieces, pieces_beside = (piece_numel(facts, pair, beside) for beside in (False, True))
    ring = facts.algorithm == "ring" and facts.world > 2
    gather_all = gathers_all(facts.algorithm)
    compressed = Route(
        compress=True,
        regime=facts.regime,
        pair_gather=pair and not ring,
        piece_numel=pieces,
        graphs=False,
        gather_in_place=facts.nccl_cuda and not ring,
        check=agreement_check(facts.check_agreement, facts.nccl_cuda) if facts.world > 1 else "",
        transport=facts.transport,
        ring=ring,
        gather_all=gather_all,
    )
    # A CUDA graph captures the process group's NCCL kernels: a transport named instead (whose
    # waits may be on the host) keeps its calls eager.
    graphed_here = facts.nccl_cuda and not ring and facts.transport is process_group
    settings = facts.wire_settings
    return Routes(
        plain=_with_settings(dataclasses.replace(compressed, compress=False), settings),
        compressed=_with_settings(compressed, settings),
        compressed_beside=_with_settings(
            dataclasses.replace(compressed, piece_numel=pieces_beside), settings
        ),
        graphs=_with_settings(dataclasses.replace(compressed, graphs=True), settings)
        if graphed_here
        else None,
        size=facts.world,
    )


def _with_settings(route: Route, settings: Mapping[str, object]) -> Route:
    """``route`` with the settings it was decided under (:class:`Route`'s ``settings``)."""
    decided = {
        "route.regime": route.regime,
        "route.piece_numel": route.piece_numel,
        "route.pair_gather": route.pair_gather,
        "route.ring": route.ring,
        "route.gather_all": route.gather_all,
        "route.transport": route.transport.__name__.rpartition(".")[2],
    }
    text = json.dumps({**settings, **decided}, separators=(",", ":"))
    return dataclasses.replace(route, settings=text, fingerprint=zlib.crc32(text.encode()))


def may_compress(routes: Routes, bits: int) -> bool:
    """Whether a call of ``bits`` over the group of ``routes`` may be quantized at all: bits
    below 32 and more than one rank (what it sends decides the rest: :func:`compresses`)."""
    return bits != UNCOMPRESSED_BITS and routes.size != 1


def compresses(routes: Routes, bits: int, nbytes: int, crossover: int | None) -> bool:
    """Whether a call of ``bits`` and ``nbytes`` over the group of ``routes`` is quantized,
    ``crossover`` being the smallest bytes compressed (None: never): :func:`may_compress`,
    something to send, and at least the crossover's bytes."""
    if bits == UNCOMPRESSED_BITS or routes.size == 1 or nbytes == 0 or crossover is None:
        return False
    return nbytes >= crossover


def compressed_route(routes: Routes, graphs_replay: bool, beside_compute: bool) -> Route:
    """The compressed route: replayed as a CUDA graph where ``graphs_replay`` and the group's
    calls may be, else the one for calls beside the training step (``beside_compute``) or
    alone."""
    if routes.graphs is not None and graphs_replay:
        return routes.graphs
    return routes.compressed_beside if beside_compute else routes.compressed


def decide(facts: CallFacts) -> Route:
    """The route of the call ``facts`` describe (what :func:`cgx2.collectives.policy.route`
    decides, from the facts it gathers)."""
    routes = plan(facts.group)
    nbytes = facts.numel * facts.group.element_size
    crossover = for_thread(facts.crossovers, facts.beside_compute)
    if not compresses(routes, facts.bits, nbytes, crossover):
        return routes.plain
    replay = graphed(nbytes, facts.cuda_graphs) and facts.graphs_usable
    return compressed_route(routes, replay, facts.beside_compute)
