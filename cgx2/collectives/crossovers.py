"""The crossovers and node mesh answers a group routes by, gathered: its first rank's
calibration file passed to the others through the store, else measured on its link at first use.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import config
from ..comm import GroupInfo, GroupState
from ..comm import store as stored
from . import calibration_file, decided, decision, regimes
from .call_settings import CallSettings

__all__ = [
    "LinkMeasurer",
    "calibrated_mesh",
    "calibration",
    "calibration_key",
    "measure_with",
    "measured",
    "time_mesh",
]

logger = logging.getLogger("cgx2")

_STORE_KEY = "cgx2/calibration/"


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
    beside_step = data.get("beside_crossover_bytes", {})
    mesh = data.get("node_mesh_faster", {})
    timed = f"; the node mesh faster than the flat allreduce: {mesh}" if mesh else ""
    logger.info(
        "cgx2: crossovers from %s: %s (beside the training step: %s)%s",
        path,
        crossovers,
        beside_step or "the same",
        timed,
    )
    return {
        "crossovers": {
            key: [value, beside_step.get(key, value)] for key, value in crossovers.items()
        },
        "node_mesh": mesh,
        "ignored": None,
    }


def calibration(group: dist.ProcessGroup | None = None) -> dict[str, list[int | None]]:
    """The measured crossovers that ``group``'s ranks route by, a pair a key (alone, beside the
    training step): the calibration file of the group's first rank, passed to the others
    through the default store, so that ranks whose files differ (or who have none) still decide
    alike. Read once per group."""
    return calibration_tables(group)["crossovers"]


def calibration_tables(group: dist.ProcessGroup | None) -> dict[str, dict]:
    """:func:`_read_calibration` of the group's first rank's file (:func:`calibration`), kept
    in the group's state."""
    state = decided.state(group)
    found = state.calibration
    if found is not None:
        return found
    path = config.tuning().calibration_file
    if group is None or not dist.is_initialized():
        found = _read_calibration(path)
        _log_ignored(found, None)
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
        _log_ignored(found, group)
    state.calibration = found
    return found


def _log_ignored(found: dict[str, object], group: dist.ProcessGroup | None) -> None:
    """Log, the same words on every rank, that the first rank's calibration file was not used."""
    if found.get("ignored"):
        path, reason = found["ignored"]
        whose = "" if group is None else f" (rank 0's, for the ranks of {group.group_name!r})"
        logger.warning(
            "cgx2: ignoring the calibration file %s%s: it %s; the built-in "
            "crossovers serve instead",
            path,
            whose,
            reason,
        )


def calibrated_mesh(
    device_type: str, dtype: torch.dtype, group: dist.ProcessGroup, backend: str, nccl: bool
) -> dict[int, bool] | None:
    """The calibration file's node mesh against the flat allreduce for ``device_type``
    tensors of ``dtype`` on ``group``, whose backend is ``backend`` (the ``cgx`` backend's:
    its carrier's, NCCL where ``nccl`` says it carries CUDA tensors, else gloo), where it has
    them."""
    tables = calibration_tables(group)["node_mesh"]
    carrier = "nccl" if device_type == "cuda" and nccl else "gloo"
    for name in dict.fromkeys((backend, carrier)):
        table = tables.get(calibration_key(device_type, name, dtype))
        if table:
            return {int(size): won for size, won in table.items()}
    return None


def time_mesh(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    mesh: DeviceMesh,
    settings: CallSettings,
    intra_broadcast: bool,
) -> dict[int, bool]:
    """Whether the node ``mesh`` beat the flat allreduce over ``group`` for tensors like ``t``
    coded by ``settings``, by size, timed now (:func:`.measure.mesh_against_flat`), at the
    first such call, which every rank makes alike."""
    dtype, device = t.dtype, t.device
    try:
        return _measurer().mesh_against_flat(
            dtype,
            group,
            mesh,
            settings.bits,
            settings.bucket_size,
            intra_broadcast,
            device=device,
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"cgx2: timing the node mesh against the flat allreduce on group "
            f"{group.group_name!r} (at the first compressed call of {dtype} {device.type} "
            "tensors, which every rank makes alike) failed: do the ranks make the same calls? "
            f"CGX2_NODE_MESH=0 or 1 spares this measurement: {e}"
        ) from e


class LinkMeasurer(Protocol):
    """What measures on a group's link at first use: :mod:`.measure`, whose functions of these
    names these are. It runs the quantized collectives, which the policy (above this module)
    routes, so it is handed down (:func:`measure_with`) rather than imported."""

    crossover_on_link: Callable[..., tuple[int | None, int | None]]
    mesh_against_flat: Callable[..., dict[int, bool]]


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


def measured(
    state: GroupState,
    device: torch.device,
    dtype: torch.dtype,
    info: GroupInfo | None,
    group: dist.ProcessGroup | None,
    with_graphs: bool,
) -> tuple[int | None, int | None]:
    """The crossovers for calls alone and beside the training step (the same but where
    measured at first use on CPUs) of ``group``, whose state (:func:`.decided.state`) is
    ``state`` and :class:`GroupInfo` ``info``: decided once, and kept there."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        # One key for "cuda" and the GPU it means: the measurement's tensors carry the index.
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, with_graphs)
    chosen = state.crossovers.get(key)
    if chosen is not None:
        return chosen
    backend, nccl, regime = regimes.carrier(device, info)
    # The cgx backend carries its collectives on NCCL or gloo: their calibration serves it
    # where it has none of its own.
    carrier = "nccl" if device.type == "cuda" and nccl else "gloo"
    found = calibration(group)
    keys = [calibration_key(device.type, name, dtype) for name in dict.fromkeys((backend, carrier))]
    measured = next((found[k] for k in keys if k in found), None)
    entry = decision.table_crossover(regime, dtype.itemsize, with_graphs)
    if measured is not None:
        chosen, source = (measured[0], measured[1]), "the calibration file"
    elif _measures_on_link(device, backend, nccl, group):
        if regimes.in_trace(device):
            # Measuring runs collectives and waits for them: not inside a trace or a capture.
            # Not kept: the first eager call measures, on every rank alike.
            logger.info(
                "cgx2: %s regime, %s on %s, inside a trace or a CUDA graph's capture: "
                "the built-in table's crossover (%s) until an eager call measures the "
                "link (make one before compiling or capturing to decide there)",
                regime,
                dtype,
                backend,
                "never" if entry is None else f"{entry} bytes",
            )
            return entry, entry
        # The codec's cost against the link's saving depends on both: only measuring knows
        # them (BENCHMARKS.md, "CPU hosts over Ethernet"; loopback's tables say nothing of a
        # link between GPU hosts).
        chosen = _measure_now(state, dtype, group, key, device)
        source = "measured on this job's link"
    else:
        chosen, source = (entry, entry), "the built-in table"
    alone, beside_step = ("never" if n is None else f"{n} bytes" for n in chosen)
    logger.info(
        "cgx2: %s regime, %s on %s%s: quantized from %s%s (%s; CGX2_CROSSOVER_BYTES=0 always "
        "compresses)",
        regime,
        dtype,
        backend,
        ", CUDA graphs" if with_graphs else "",
        alone,
        f", beside the training step from {beside_step}" if beside_step != alone else "",
        source,
    )
    state.crossovers[key] = chosen
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


def _measure_now(
    state: GroupState,
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    key: tuple,
    device: torch.device,
) -> tuple[int | None, int | None]:
    """The crossovers measured on ``group``'s link now (:func:`.measure.crossover_on_link`),
    at the first compressible call of ``dtype`` on ``device``, which every rank makes alike."""
    measure = _measurer()
    # The measurement's own calls compress (and must not measure again).
    state.crossovers[key] = (0, 0)
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
        state.crossovers.pop(key, None)
        # The measurement's routes were decided under the stand-in crossover: decide anew.
        for stale in [k for k in state.routes if k[1] == dtype]:
            del state.routes[stale]
