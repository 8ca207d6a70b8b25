"""The one place that decides a call's route: compress or plain, how chunks are swapped, how
large the pipeline's pieces are, and whether a CUDA graph replays it. Every entry point asks here.

The decision itself is :mod:`.decision`'s, a function of plain facts; this module gathers them
and keeps what it decided (:mod:`.decided`): the interconnect ("regime", :mod:`.regimes`), the
transport (:mod:`.transports`) and the crossovers (:mod:`.crossovers`): those
``python -m cgx2.bench calibrate`` measured on this machine where a file of them exists (rank
0's copy, so ranks decide alike), else, for a group across hosts (CPU tensors, and CUDA tensors
on NCCL), those measured on its link at first use, else the built-in tables, measured on H200s
(BENCHMARKS.md, "The crossover").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import config, cpu_threads
from ..checks import UNCOMPRESSED_BITS
from ..comm import group_info, groups
from . import calibration_file, crossovers, decided, decision, graphs, regimes, transports
from .call_settings import CallSettings
from .crossovers import calibration, calibration_key

# The decision's tables and routes, re-exported: the policy's readers find them here too.
from .decision import CPU_ACROSS_NODES_PIECE_NUMEL as CPU_ACROSS_NODES_PIECE_NUMEL
from .decision import CROSSOVER_BYTES as CROSSOVER_BYTES
from .decision import CROSSOVER_BYTES_GRAPHS as CROSSOVER_BYTES_GRAPHS
from .decision import GRAPHS_AUTO_MAX_BYTES as GRAPHS_AUTO_MAX_BYTES
from .decision import PIECE_NUMEL as PIECE_NUMEL
from .decision import PIECE_NUMEL_PAIR as PIECE_NUMEL_PAIR
from .decision import Route as Route
from .regimes import detect_regime, group_regime, regime, spans_hosts
from .transports import coalesces_exact, runs_on_worker, transport

__all__ = [
    "CALIBRATION_FORMAT",
    "by_node_mesh",
    "calibration",
    "calibration_key",
    "coalesces_exact",
    "compresses",
    "crossover_bytes",
    "detect_regime",
    "gathers_all",
    "group_regime",
    "hierarchical",
    "piece_numel",
    "regime",
    "reset",
    "route",
    "runs_on_worker",
    "spans_hosts",
    "transport",
    "uses_pair_gather",
]

logger = logging.getLogger("cgx2")

CALIBRATION_FORMAT = calibration_file.FORMAT
"""The ``format`` of a calibration file (``python -m cgx2.bench calibrate``)."""


def hierarchical(group: dist.ProcessGroup | None, bits: int) -> bool:
    """Whether an entry point that may reduce hierarchically (the DDP hook with
    ``mesh="auto"``, the ``cgx`` backend) builds the node mesh: ``bits`` below 32, the launcher
    says the job spans several nodes (``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) of more than
    one rank each, ``group`` (None: the default) is the whole world, and ``CGX2_NODE_MESH`` is
    not 0. With one rank a node the flat allreduce already is the one between nodes: the
    node's steps would only copy the tensor through groups of one. Which calls then go over
    the mesh is :func:`by_node_mesh`'s choice."""
    launch = config.launch()
    if bits == UNCOMPRESSED_BITS or not launch.spans_nodes or launch.local_world_size < 2:
        return False
    if config.tuning().node_mesh is False:
        return False
    return (group.size() if group is not None else dist.get_world_size()) == launch.world_size


def by_node_mesh(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    mesh: DeviceMesh,
    settings: CallSettings,
    intra_broadcast: bool,
    numel: int | None = None,
) -> bool:
    """Whether a compressed allreduce of ``t`` (or of ``numel`` of its values) coded by
    ``settings`` over ``group``, for which :func:`hierarchical` built the node ``mesh``, goes
    over the mesh rather than flat. ``CGX2_NODE_MESH`` decides where set. Otherwise CPU tensors,
    and CUDA tensors on NCCL, take what was faster on this job's link at the measured size
    nearest theirs (the calibration file's, else :func:`.measure.mesh_against_flat` at the first
    such call, which every rank makes alike): the mesh sends a node's bytes between hosts once
    but fewer ranks code them, so it wins where the link bounds the call and may lose where the
    codec does (BENCHMARKS.md, "Flat against the node mesh"). Where nothing may be measured (a
    trace, a CUDA graph's capture; logged), and for CUDA tensors that NCCL does not carry, GPUs
    take the mesh (between hosts the link is far slower than a GPU's codec) and CPUs the flat
    allreduce, until an eager call times them."""
    found = decided.state(group)
    forced = config.tuning().node_mesh
    if forced is not None:
        return forced
    backend, nccl, regime_now = regimes.carrier(t.device, group_info(group))
    key = (t.device, t.dtype, settings.bits, settings.bucket_size, intra_broadcast)
    faster = found.mesh_faster.get(key)
    if faster is None:
        faster = crossovers.calibrated_mesh(t.device.type, t.dtype, group, backend, nccl)
        if faster is None:
            timed = regime_now == "cpu" or nccl
            untimed = t.device.type != "cpu"
            if not timed:
                return untimed
            if regimes.in_trace(t.device):
                logger.info(
                    "cgx2: the node mesh against the flat allreduce is not timed inside "
                    "a trace or a CUDA graph's capture: %s here, timed at the first "
                    "eager call (make one before compiling or capturing to decide "
                    "there)",
                    "the mesh" if untimed else "flat",
                )
                return untimed
            faster = crossovers.time_mesh(t, group, mesh, settings, intra_broadcast)
        found.mesh_faster[key] = faster
    return decision.nearest_size(faster, (t.numel() if numel is None else numel) * t.element_size())


def reset() -> None:
    """Take the settings from the environment again (:func:`cgx2.config.refresh`) and forget
    the regimes, calibrations, crossovers and routes decided so far for every group (they are
    decided once per device or group, as NCCL reads its variables once): the next call decides
    anew. For tests, which change the variables and stand in for the GPUs."""
    config.refresh()
    groups.reset()
    regimes.forget()


def crossover_bytes(
    device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup | None = None
) -> int | None:
    """The smallest tensor, in bytes, that is compressed on ``device`` over ``group`` (None:
    never): ``CGX2_CROSSOVER_BYTES`` (read at every call) or :func:`cgx2.config.tuned`'s value,
    else the calibration file's (:func:`calibration`), else, for a group across hosts, the
    one measured on its link at the first call that asks (every rank alike; a call made
    eagerly before compiling or capturing decides there), else the regime's table entry. Of
    the crossovers for calls alone and beside the training step, the calling thread's: a
    worker beside the training loop takes the second."""
    found = decided.state(group)
    tuning = config.tuning()
    if tuning.crossover_bytes is not None:
        return tuning.crossover_bytes
    info = None if group is None else group_info(group)
    with_graphs = tuning.cuda_graphs is True
    both = crossovers.measured(found, device, dtype, info, group, with_graphs)
    return decision.for_thread(both, cpu_threads.beside_compute())


def compresses(
    t: torch.Tensor, group: dist.ProcessGroup, bits: int, bucket_size: int, numel: int | None = None
) -> bool:
    """Whether a collective of ``t`` (or of ``numel`` values of its dtype on its device) over
    ``group`` at ``bits`` is quantized (:func:`route`): ``bits`` below 32, more than one
    rank, something to send, and at least the crossover's bytes."""
    return route(t, group, bits, bucket_size, numel).compress


def piece_numel(
    element_size: int,
    world: int,
    bucket_size: int,
    regime: str,
    pair_gather: bool,
    beside_compute: bool | None = None,
) -> int:
    """Values per pipeline piece: whole buckets for every rank, about
    ``CGX2_PIPELINE_BYTES`` of input, or the ``regime``'s :data:`PIECE_NUMEL` (CPU tensors
    across nodes, called alone: :data:`CPU_ACROSS_NODES_PIECE_NUMEL`). ``beside_compute``: for
    a call beside the training step (None: whether the calling thread is a worker there). The
    pieces fix which values share a random key, so every rank, and the reference model, cut
    alike."""
    if beside_compute is None:
        beside_compute = cpu_threads.beside_compute()
    facts = decision.GroupFacts(
        regime=regime,
        world=world,
        element_size=element_size,
        bucket_size=bucket_size,
        pipeline_bytes=config.tuning().pipeline_bytes,
        spans_nodes=config.launch().spans_nodes,
    )
    return decision.piece_numel(facts, pair_gather, beside_compute)


def uses_pair_gather(world: int, regime: str) -> bool:
    """Whether two ranks swap their chunks by all-gather: the same bytes through NCCL's
    collective path rather than its point-to-point one, which was the slower outside NVLink
    and the faster over it (BENCHMARKS.md, "Two ranks swap by all-gather")."""
    return decision.pair_gather(world, regime, config.tuning().pair_gather)


def gathers_all() -> bool:
    """Whether the quantized allreduce's pieces are quantized once and gathered by every rank
    under the settings in force (``CGX2_ALGORITHM``): :attr:`Route.gather_all`'s rule, for
    the reference model."""
    return decision.gathers_all(config.tuning().algorithm)


def route(
    t: torch.Tensor, group: dist.ProcessGroup, bits: int, bucket_size: int, numel: int | None = None
) -> Route:
    """The whole route of a collective of ``t`` (or ``numel`` of its values) over ``group``:
    decided once per group, device, dtype and bucket size (:mod:`.decided`), but for what
    the size decides; this runs before every call."""
    found = decided.state(group)
    key = (t.device, t.dtype, bucket_size)
    routes = found.routes.get(key)
    if routes is None:
        routes = found.routes[key] = decision.plan(_group_facts(t, group, bucket_size))
    if not decision.may_compress(routes, bits):
        return routes.plain
    numel = t.numel() if numel is None else numel
    tuning = config.tuning()
    threshold = tuning.crossover_bytes
    beside_compute = None
    if threshold is None:  # asked only here: a plain call never measures
        with_graphs = tuning.cuda_graphs is True
        info = group_info(group)
        measured = crossovers.measured(found, t.device, t.dtype, info, group, with_graphs)
        beside_compute = cpu_threads.beside_compute()
        threshold = decision.for_thread(measured, beside_compute)
    elif found.calibration is None:
        # Read at the same call as on ranks without the variable (whose crossovers come from
        # the first rank's file): ranks whose CGX2_CROSSOVER_BYTES differ then reach the
        # agreement check, which names it, rather than one waiting for the file alone.
        calibration(group)
    nbytes = numel * t.element_size()
    if not decision.compresses(routes, bits, nbytes, threshold):
        return routes.plain
    # NCCL's CUDA tensors only (where routes.graphs is not None)
    replay = (
        routes.graphs is not None
        and decision.graphed(nbytes, tuning.cuda_graphs)
        and graphs.usable(t)
    )
    if beside_compute is None:
        beside_compute = cpu_threads.beside_compute()
    return decision.compressed_route(routes, replay, beside_compute)


def _group_facts(
    t: torch.Tensor, group: dist.ProcessGroup, bucket_size: int
) -> decision.GroupFacts:
    """What the routes of ``t``'s collectives over ``group`` are decided by (:func:`route`)."""
    info = group_info(group)
    tuning = config.tuning()
    return decision.GroupFacts(
        regime=regimes.carrier(t.device, info).regime,
        world=info.size,
        element_size=t.element_size(),
        bucket_size=bucket_size,
        nccl_cuda=t.is_cuda and info.cuda_on_nccl,
        transport=transports.transport(t.device, group),
        pair_gather=tuning.pair_gather,
        pipeline_bytes=tuning.pipeline_bytes,
        spans_nodes=config.launch().spans_nodes,
        algorithm=tuning.algorithm,
        check_agreement=tuning.check_agreement,
        wire_settings=config.wire_settings(),
    )
