"""The one place that decides a call's route: compress or plain, how chunks are swapped, how
large the pipeline's pieces are, and whether a CUDA graph replays it.

It reads the group's backend and the tensor's device, the interconnect ("regime"), and the
crossovers: those ``python -m cgx2.bench calibrate`` measured on this machine where a file of
them exists (rank 0's copy, so ranks decide alike), else, for a group across hosts (CPU
tensors, and CUDA tensors on NCCL), those measured on its link at first use, else the
built-in tables, measured on H200s (BENCHMARKS.md, "The crossover"). Every entry point asks
here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from types import ModuleType
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import config, cpu_threads
from ..checks import UNCOMPRESSED_BITS
from ..comm import GroupInfo, group_info, nccl, process_group, shm
from ..comm import store as stored
from . import calibration_file, decision, graphs, regimes
from .decision import (
    CPU_ACROSS_NODES_PIECE_NUMEL,
    CROSSOVER_BYTES,
    CROSSOVER_BYTES_GRAPHS,
    GRAPHS_AUTO_MAX_BYTES,
    PIECE_NUMEL,
    PIECE_NUMEL_PAIR,
    Route,
)
from .regimes import detect_regime, group_regime, regime, spans_hosts

__all__ = [
    "CALIBRATION_FORMAT",
    "CPU_ACROSS_NODES_PIECE_NUMEL",
    "CROSSOVER_BYTES",
    "CROSSOVER_BYTES_GRAPHS",
    "GRAPHS_AUTO_MAX_BYTES",
    "PIECE_NUMEL",
    "PIECE_NUMEL_PAIR",
    "Route",
    "by_node_mesh",
    "calibration",
    "calibration_key",
    "clear_caches",
    "compresses",
    "crossover_bytes",
    "detect_regime",
    "group_regime",
    "hierarchical",
    "piece_numel",
    "regime",
    "route",
    "runs_on_worker",
    "spans_hosts",
    "transport",
    "uses_pair_gather",
]

logger = logging.getLogger("cgx2")

CALIBRATION_FORMAT = calibration_file.FORMAT
"""The ``format`` of a calibration file (``python -m cgx2.bench calibrate``)."""

_STORE_KEY = "cgx2/calibration/"


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


def by_node_mesh(t: torch.Tensor, group: dist.ProcessGroup, mesh: DeviceMesh, bits: int,
                 bucket_size: int, intra_broadcast: bool,
                 numel: int | None = None) -> bool:  # fmt: skip
    """Whether a compressed allreduce of ``t`` (or of ``numel`` of its values) over ``group``,
    for which :func:`hierarchical` built the node ``mesh``, goes over the mesh rather than
    flat. ``CGX2_NODE_MESH`` decides where set. Otherwise CPU tensors, and CUDA tensors on
    NCCL, take what was faster on this job's link at the measured size nearest theirs (the
    calibration file's, else :func:`.measure.mesh_against_flat` at the first such call, which
    every rank makes alike): the mesh sends a node's bytes between hosts once but fewer ranks
    code them, so it wins where the link bounds the call and may lose where the codec does
    (BENCHMARKS.md, "Flat against the node mesh"). Where nothing may be measured (a trace, a
    CUDA graph's capture; logged), and for CUDA tensors that NCCL does not carry, GPUs take
    the mesh (between hosts the link is far slower than a GPU's codec) and CPUs the flat
    allreduce, until an eager call times them."""
    forced = _fresh().node_mesh
    if forced is not None:
        return forced
    backend, nccl, where = regimes.carrier(t.device, group_info(group))
    key = (id(group), t.device, t.dtype, bits, bucket_size, intra_broadcast)
    faster = _MESH_FASTER.get(key)
    if faster is None:
        faster = _calibrated_mesh(t.device.type, t.dtype, group, backend, nccl)
        if faster is None:
            timed = where == "cpu" or nccl
            untimed = t.device.type != "cpu"
            if not timed:
                return untimed
            if regimes.in_trace(t.device):
                logger.info("cgx2: the node mesh against the flat allreduce is not timed inside "
                            "a trace or a CUDA graph's capture: %s here, timed at the first "
                            "eager call (make one before compiling or capturing to decide "
                            "there)", "the mesh" if untimed else "flat")  # fmt: skip
                return untimed
            faster = _time_mesh(t.dtype, group, mesh, bits, bucket_size, intra_broadcast,
                                t.device)  # fmt: skip
        _MESH_FASTER[key] = faster
        weakref.finalize(group, _MESH_FASTER.pop, key, None)
    return decision.nearest_size(faster, (t.numel() if numel is None else numel) * t.element_size())


def _calibrated_mesh(device_type: str, dtype: torch.dtype, group: dist.ProcessGroup,
                     backend: str, nccl: bool) -> dict[int, bool] | None:  # fmt: skip
    """The calibration file's node mesh against the flat allreduce for ``device_type``
    tensors of ``dtype`` on ``group``, whose backend is ``backend`` (the ``cgx`` backend's:
    its carrier's, NCCL where ``nccl`` says it carries CUDA tensors, else gloo), where it has
    them."""
    tables = _calibration_file(group)["node_mesh"]
    carrier = "nccl" if device_type == "cuda" and nccl else "gloo"
    for name in dict.fromkeys((backend, carrier)):
        table = tables.get(calibration_key(device_type, name, dtype))
        if table:
            return {int(size): won for size, won in table.items()}
    return None


def _time_mesh(dtype: torch.dtype, group: dist.ProcessGroup, mesh: DeviceMesh, bits: int,
               bucket_size: int, intra_broadcast: bool,
               device: torch.device) -> dict[int, bool]:  # fmt: skip
    try:
        return _measurer().mesh_against_flat(dtype, group, mesh, bits, bucket_size, intra_broadcast,
                                         device=device)  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(
            f"cgx2: timing the node mesh against the flat allreduce on group "
            f"{group.group_name!r} (at the first compressed call of {dtype} {device.type} "
            "tensors, which every rank makes alike) failed: do the ranks make the same calls? "
            f"CGX2_NODE_MESH=0 or 1 spares this measurement: {e}"
        ) from e


class LinkMeasurer(Protocol):
    """What measures on a group's link at first use (:mod:`.measure`): it runs the quantized
    collectives, which are built on this module, so it is handed down (:func:`measure_with`)
    rather than imported."""

    def crossover_on_link(
        self, dtype: torch.dtype, group: dist.ProcessGroup, *, device: torch.device
    ) -> tuple[int | None, int | None]: ...

    def mesh_against_flat(
        self,
        dtype: torch.dtype,
        group: dist.ProcessGroup,
        mesh: DeviceMesh,
        bits: int,
        bucket_size: int,
        intra_broadcast: bool,
        *,
        device: torch.device,
    ) -> dict[int, bool]: ...


class _Measuring:
    """Holds the :class:`LinkMeasurer` in use: one per process, set once where the package is
    assembled (:mod:`cgx2.collectives`), above both it and this module."""

    measurer: LinkMeasurer | None = None


def measure_with(measurer: LinkMeasurer) -> None:
    """Measure at first use with ``measurer`` (:mod:`cgx2.collectives` hands down
    :mod:`.measure`)."""
    _Measuring.measurer = measurer


def _measurer() -> LinkMeasurer:
    if _Measuring.measurer is None:
        raise RuntimeError(
            "cgx2: nothing measures on the link at first use: import cgx2.collectives, which "
            "hands the policy its measurer"
        )
    return _Measuring.measurer


def calibration_key(device_type: str, backend: str, dtype: torch.dtype) -> str:
    """The key of a crossover in a calibration file: ``"cuda/nccl/fp32"``, ``"cpu/gloo/16bit"``."""
    return f"{device_type}/{backend}/{'fp32' if dtype.itemsize >= 4 else '16bit'}"


def _read_calibration(path: str) -> dict[str, dict]:
    """What a calibration file holds for the policy: ``"crossovers"``, a pair a key (for calls
    alone, for calls beside the training step: the first where the file has no second), and
    ``"node_mesh"``, where timed, whether the node mesh beat the flat allreduce, by size (as a
    decimal string) a key; empty where there is no file. A file that cannot be used
    (:func:`cgx2.collectives.calibration_file.load`: not a small regular file of this user's
    that no one else can write, or not the format) leaves them empty too, and ``"ignored"``
    says why, for every rank to log alike."""
    empty: dict[str, object] = {"crossovers": {}, "node_mesh": {}, "ignored": None}
    try:
        data = calibration_file.load(path)
    except calibration_file.CalibrationFileError as e:
        return {**empty, "ignored": [path, str(e)]}
    except Exception as e:  # whatever else went wrong, rank 0 must still publish
        return {**empty, "ignored": [path, f"could not be read: {e!r}"]}
    if data is None:
        return empty
    crossovers = data["crossover_bytes"]
    beside = data.get("beside_crossover_bytes", {})
    mesh = data.get("node_mesh_faster", {})
    timed = f"; the node mesh faster than the flat allreduce: {mesh}" if mesh else ""
    logger.info("cgx2: crossovers from %s: %s (beside the training step: %s)%s", path,
                crossovers, beside or "the same", timed)  # fmt: skip
    return {
        "crossovers": {key: [value, beside.get(key, value)] for key, value in crossovers.items()},
        "node_mesh": mesh,
        "ignored": None,
    }


_CALIBRATIONS: dict[int, dict[str, dict]] = {}
_MEASURED: dict[tuple, tuple[int | None, int | None]] = {}
_MESH_FASTER: dict[tuple, dict[int, bool]] = {}
_cached_for: list[config.TuningConfig | None] = [None]
_measured_under: list[tuple[config.TuningConfig, config.LaunchConfig] | None] = [None]
# Settings that change a call's route but not what was measured at first use (the crossovers,
# the node mesh's timing): changing only these keeps the measurements, which cost seconds. A
# reload that finds the launcher's variables changed (tests) decides everything anew.
_MEASUREMENT_NEUTRAL = {"check_agreement": "auto", "comm_worker": True, "crossover_bytes": None}


def _fresh() -> config.TuningConfig:
    """The settings in force, dropping what was decided under others (a calibration file
    named elsewhere, graphs turned on)."""
    tuning = config.tuning()
    if tuning is not _cached_for[0]:
        _ROUTES.clear()
        basis = (dataclasses.replace(tuning, **_MEASUREMENT_NEUTRAL), config.launch())
        if basis != _measured_under[0]:
            clear_caches()
            _measured_under[0] = basis
        _cached_for[0] = tuning
    return tuning


def clear_caches() -> None:
    """Forget the regimes, calibrations and crossovers decided so far (they are decided once
    per device or group, as NCCL reads its variables once); the next call decides anew."""
    regime.cache_clear()
    _CALIBRATIONS.clear()
    _MEASURED.clear()
    _MESH_FASTER.clear()
    _ROUTES.clear()


def calibration(group: dist.ProcessGroup | None = None) -> dict[str, list[int | None]]:
    """The measured crossovers that ``group``'s ranks route by, a pair a key (alone, beside the
    training step): the calibration file of the group's first rank, passed to the others
    through the default store, so that ranks whose files differ (or who have none) still decide
    alike. Read once per group."""
    return _calibration_file(group)["crossovers"]


def _calibration_file(group: dist.ProcessGroup | None) -> dict[str, dict]:
    """:func:`_read_calibration` of the group's first rank's file (:func:`calibration`)."""
    key = id(group)
    path = _fresh().calibration_file
    found = _CALIBRATIONS.get(key)
    if found is not None:
        return found
    if group is None or not dist.is_initialized():
        found = _read_calibration(path)
        _say_ignored(found, None)
    else:
        store = dist.distributed_c10d._get_default_store()
        name = _STORE_KEY + group.group_name
        if dist.get_rank(group) == 0:
            found = _read_calibration(path)
            store.set(name, json.dumps(found))
        else:
            try:  # within the store's timeout; asked, not waited for in the store, whose
                # one client other threads' calls on other groups need meanwhile
                found = json.loads(stored.get(store, name, store.timeout.total_seconds()))
            except RuntimeError as e:  # DistStoreError (a RuntimeError): rank 0 never came
                raise RuntimeError(
                    f"cgx2: rank 0 of group {group.group_name!r} did not publish its crossovers "
                    "before the group's timeout: it has not reached a compressible collective "
                    "that this rank has (do the ranks pass the same bits, sizes and "
                    f"CGX2_CROSSOVER_BYTES?): {e}"
                ) from e
        _say_ignored(found, group)
    _CALIBRATIONS[key] = found
    if group is not None:
        weakref.finalize(group, _CALIBRATIONS.pop, key, None)
    return found


def _say_ignored(found: dict[str, object], group: dist.ProcessGroup | None) -> None:
    """Log, the same words on every rank, that the first rank's calibration file was not used."""
    if found.get("ignored"):
        path, reason = found["ignored"]
        whose = "" if group is None else f" (rank 0's, for the ranks of {group.group_name!r})"
        logger.warning("cgx2: ignoring the calibration file %s%s: it %s; the built-in "
                       "crossovers serve instead", path, whose, reason)  # fmt: skip


def crossover_bytes(device: torch.device, dtype: torch.dtype,
                    group: dist.ProcessGroup | None = None) -> int | None:  # fmt: skip
    """The smallest tensor, in bytes, that is compressed on ``device`` over ``group`` (None:
    never): ``CGX2_CROSSOVER_BYTES`` (read at every call) or :func:`cgx2.config.tuned`'s value,
    else the calibration file's (:func:`calibration`), else, for a group across hosts, the
    one measured on its link at the first call that asks (every rank alike; a call made
    eagerly before compiling or capturing decides there), else the regime's table entry."""
    override = config.crossover_override()
    if override is not None:
        return override
    info = None if group is None else group_info(group)
    return _pick(_measured(device, dtype, info, group, _fresh().cuda_graphs is True))


def _pick(crossovers: tuple[int | None, int | None]) -> int | None:
    """Of a pair of crossovers (for calls alone, for calls beside the training step), the one
    for the calling thread: a worker beside the training loop takes the second."""
    return decision.for_thread(crossovers, cpu_threads.beside_compute())


def _measured(device: torch.device, dtype: torch.dtype, info: GroupInfo | None,
              group: dist.ProcessGroup | None,
              with_graphs: bool) -> tuple[int | None, int | None]:  # fmt: skip
    """The crossovers for calls alone and beside the training step (the same but where
    measured at first use on CPUs)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        # One key for "cuda" and the GPU it means: the measurement's tensors carry the index.
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, id(group), with_graphs)
    if key in _MEASURED:
        return _MEASURED[key]
    backend, nccl, where = regimes.carrier(device, info)
    # The cgx backend carries its collectives on NCCL or gloo: their calibration serves it
    # where it has none of its own.
    carrier = "nccl" if device.type == "cuda" and nccl else "gloo"
    found = calibration(group)
    keys = [calibration_key(device.type, name, dtype) for name in dict.fromkeys((backend, carrier))]
    measured = next((found[k] for k in keys if k in found), None)
    entry = decision.table_crossover(where, dtype.itemsize, with_graphs)
    if measured is not None:
        chosen, source = (measured[0], measured[1]), "the calibration file"
    elif _measures_on_link(device, backend, nccl, group):
        if regimes.in_trace(device):
            # Measuring runs collectives and waits for them: not inside a trace or a capture.
            # Not kept: the first eager call measures, on every rank alike.
            logger.info("cgx2: %s regime, %s on %s, inside a trace or a CUDA graph's capture: "
                        "the built-in table's crossover (%s) until an eager call measures the "
                        "link (make one before compiling or capturing to decide there)", where,
                        dtype, backend, "never" if entry is None else f"{entry} bytes")  # fmt: skip
            return entry, entry
        # The codec's cost against the link's saving depends on both: only measuring knows
        # them (BENCHMARKS.md, "CPU hosts over Ethernet"; loopback's tables say nothing of a
        # link between GPU hosts).
        chosen, source = _measure_now(dtype, group, key, device), "measured on this job's link"
    else:
        chosen, source = (entry, entry), "the built-in table"
    said = ["never" if n is None else f"{n} bytes" for n in chosen]
    logger.info(
        "cgx2: %s regime, %s on %s%s: quantized from %s%s (%s; CGX2_CROSSOVER_BYTES=0 always "
        "compresses)", where, dtype, backend, ", CUDA graphs" if with_graphs else "", said[0],
        f", beside the training step from {said[1]}" if said[1] != said[0] else "", source,
    )  # fmt: skip
    _MEASURED[key] = chosen
    if group is not None:
        weakref.finalize(group, _MEASURED.pop, key, None)
    return chosen


def _measures_on_link(
    device: torch.device, backend: str, nccl: bool, group: dist.ProcessGroup | None
) -> bool:
    """Whether the crossover of ``device``'s tensors over ``group`` (of ``backend``, whose CUDA
    tensors NCCL carries where ``nccl``) is measured on its link at first use, where no
    calibration file has it: a group whose ranks lie on several hosts (:func:`spans_hosts`),
    of CPU tensors on gloo or the cgx backend, or of CUDA tensors on NCCL (or the cgx backend
    over it). Inside one host the tables hold."""
    if group is None or config.crossover_override() is not None:
        return False
    if device.type == "cpu":
        carried = backend in ("gloo", "cgx")  # the cgx backend's CPU calls: gloo's
    else:
        carried = device.type == "cuda" and nccl and backend in ("nccl", "cgx")
    return carried and regimes.spans_hosts(group)


def _measure_now(dtype: torch.dtype, group: dist.ProcessGroup, key: tuple,
                 device: torch.device) -> tuple[int | None, int | None]:  # fmt: skip
    """The crossovers measured on ``group``'s link now (:func:`.measure.crossover_on_link`),
    at the first compressible call of ``dtype`` on ``device``, which every rank makes alike."""
    measure = _measurer()
    _MEASURED[key] = (0, 0)  # the measurement's own calls compress (and must not measure again)
    try:
        return measure.crossover_on_link(dtype, group, device=device)
    except RuntimeError as e:
        raise RuntimeError(
            f"cgx2: measuring where compression pays on group {group.group_name!r} (at the "
            f"first compressible call of {dtype} {device.type} tensors, which every rank makes "
            "alike) failed: do the ranks make the same calls? A calibration file "
            f"(`python -m cgx2.bench calibrate --device {device.type}`) spares this "
            f"measurement: {e}"
        ) from e
    finally:
        del _MEASURED[key]
        # The measurement's routes were decided under the stand-in crossover: decide anew.
        for stale in [k for k in _ROUTES if k[0] == id(group) and k[2] == dtype]:
            del _ROUTES[stale]


def compresses(t: torch.Tensor, group: dist.ProcessGroup, bits: int, bucket_size: int,
               numel: int | None = None) -> bool:  # fmt: skip
    """Whether a collective of ``t`` (or of ``numel`` values of its dtype on its device) over
    ``group`` at ``bits`` is quantized (:func:`route`): ``bits`` below 32, more than one
    rank, something to send, and at least the crossover's bytes."""
    return route(t, group, bits, bucket_size, numel).compress


def piece_numel(
    element_size: int,
    world: int,
    bucket_size: int,
    where: str,
    pair_gather: bool,
    beside: bool | None = None,
) -> int:
    """Values per pipeline piece: whole buckets for every rank, about
    ``CGX2_PIPELINE_BYTES`` of input, or the regime's :data:`PIECE_NUMEL` (CPU tensors across
    nodes, called alone: :data:`CPU_ACROSS_NODES_PIECE_NUMEL`). ``beside``: for a call beside
    the training step (None: whether the calling thread is a worker there). The pieces fix
    which values share a random key, so every rank, and the reference model, cut alike."""
    pipeline_bytes = config.tuning().pipeline_bytes
    if beside is None:
        beside = cpu_threads.beside_compute()
    spans_nodes = config.launch().spans_nodes
    return decision.piece_numel(
        element_size, world, bucket_size, where, pair_gather, beside, pipeline_bytes, spans_nodes
    )


def uses_pair_gather(world: int, where: str) -> bool:
    """Whether two ranks swap their chunks by all-gather: the same bytes through NCCL's
    collective path rather than its point-to-point one, which was the slower outside NVLink
    and the faster over it (BENCHMARKS.md, "Two ranks swap by all-gather")."""
    return decision.pair_gather(world, where, config.tuning().pair_gather)


def transport(device: torch.device, group: dist.ProcessGroup) -> ModuleType:
    """What moves the bytes of ``device``'s tensors over ``group`` (docs/transports.md):
    ``CGX2_TRANSPORT`` where it names one (``nccl``: cgx2's grouped send/receive on the NCCL
    group's communicator, opt-in until measured on several GPUs); else (``auto``) shared memory
    (:mod:`cgx2.comm.shm`, which itself falls back to the process group for a group that spans
    hosts) where ``CGX_INNER_COMMUNICATOR_TYPE`` is SHM and the process group would cross host
    memory anyway: CPU tensors, and CUDA tensors on a group whose CUDA collectives are not
    NCCL's. NCCL keeps CUDA tensors: its transfers are queued on the GPU, the shared-memory
    ones wait on the host. Without the compiled extension, the process group."""
    chosen = config.tuning().transport
    if chosen == "nccl":  # CUDA tensors on NCCL groups; anything else falls to the group's
        return nccl if nccl.available() else process_group
    if chosen == "process_group" or not shm.available():
        return process_group
    if chosen == "shm":
        return shm
    if config.CGXConfig.from_env().inner_communicator != "SHM":
        return process_group
    cuda_on_nccl = device.type == "cuda" and group_info(group).cuda_on_nccl
    return process_group if cuda_on_nccl else shm


def runs_on_worker(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether an entry point that returns a future (DDP's hooks) runs the collectives of
    ``t`` over ``group`` on the group's worker thread (:func:`cgx2.comm.worker.submit`): where
    they would hold the calling thread until the bytes have crossed (gloo's, for CPU tensors
    and for CUDA tensors staged through host memory) and ``CGX2_COMM_WORKER`` allows it.
    NCCL's are enqueued on a stream and return at once."""
    return config.tuning().comm_worker and not (t.is_cuda and group_info(group).cuda_on_nccl)


def route(
    t: torch.Tensor, group: dist.ProcessGroup, bits: int, bucket_size: int, numel: int | None = None
) -> Route:
    """The whole route of a collective of ``t`` (or ``numel`` of its values) over ``group``:
    decided once per group, device, dtype and bucket size, but for what the size and
    ``CGX2_CROSSOVER_BYTES`` (read at every call) decide; this runs before every call."""
    _fresh()
    key = (id(group), t.device, t.dtype, bucket_size)
    routes = _ROUTES.get(key)
    if routes is None:
        routes = _ROUTES[key] = decision.plan(_group_facts(t, group, bucket_size))
        weakref.finalize(group, _ROUTES.pop, key, None)
    if not decision.may_compress(routes, bits):
        return routes.plain
    numel = t.numel() if numel is None else numel
    threshold = config.crossover_override()
    if threshold is None:  # asked only here: a plain call never measures
        with_graphs = config.tuning().cuda_graphs is True
        threshold = _pick(_measured(t.device, t.dtype, group_info(group), group, with_graphs))
    elif id(group) not in _CALIBRATIONS:
        # Read at the same call as on ranks without the variable (whose crossovers come from
        # the first rank's file): ranks whose CGX2_CROSSOVER_BYTES differ then reach the
        # agreement check, which names it, rather than one waiting for the file alone.
        calibration(group)
    nbytes = numel * t.element_size()
    if not decision.compresses(routes, bits, nbytes, threshold):
        return routes.plain
    # NCCL's CUDA tensors only (where routes.graphs is not None)
    replay = routes.graphs is not None and _graphed(nbytes) and graphs.usable(t)
    return decision.compressed_route(routes, replay, cpu_threads.beside_compute())


def _graphed(nbytes: int) -> bool:
    """Whether ``CGX2_CUDA_GRAPHS`` asks a compressed call of ``nbytes`` to replay a graph."""
    return decision.graphed(nbytes, config.tuning().cuda_graphs)


_ROUTES: dict[tuple, decision.Routes] = {}


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
        transport=transport(t.device, group),
        pair_gather=tuning.pair_gather,
        pipeline_bytes=tuning.pipeline_bytes,
        spans_nodes=config.launch().spans_nodes,
        algorithm=tuning.algorithm,
        check_agreement=tuning.check_agreement,
        wire_settings=config.wire_settings(),
    )
