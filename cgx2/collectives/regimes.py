"""Where a call's bytes go: the interconnect ("regime") of a device's tensors over a group, and
whether the group spans hosts, as the launcher and the GPUs say (the policy's inputs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import config
from ..comm import GroupInfo, group_info

__all__ = [
    "Carrier",
    "carrier",
    "detect_regime",
    "forget",
    "group_regime",
    "in_trace",
    "regime",
    "spans_hosts",
]


class Carrier(NamedTuple):
    """What carries a group's collectives of a device's tensors (:func:`carrier`)."""

    backend: str  # the group's
    cuda_on_nccl: bool  # whether NCCL carries its CUDA tensors
    regime: str  # of the device's tensors over it (:func:`regime`)


def detect_regime(device: torch.device, backend: str = "nccl", cuda_on_nccl: bool = True) -> str:
    """``cpu`` (CPU tensors), ``socket`` (several nodes, NCCL limited to sockets, or CUDA
    tensors on a group whose CUDA collectives are not NCCL's: gloo moves them through host
    memory and TCP), ``shm`` (NCCL without peer-to-peer) or ``nvlink`` (GPUs that reach each
    other directly; also assumed when one GPU is visible per process: it compresses least)."""
    if device.type != "cuda":
        return "cpu"
    if not cuda_on_nccl:
        return "socket"
    launch = config.launch()
    if launch.spans_nodes:
        return "socket"
    if launch.nccl_p2p_disabled:
        return "socket" if launch.nccl_shm_disabled else "shm"
    return "nvlink" if _peers_reachable() else "shm"


# Asked once: which GPUs reach each other does not change in a process.
@functools.cache
def _peers_reachable() -> bool:
    """Whether every visible GPU reaches every other directly (NVLink or PCIe P2P)."""
    n = torch.cuda.device_count()
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b
    )


# Detected once per device and backend, as NCCL reads its variables once; forgotten where the
# launcher's settings change (:func:`forget`: the policy's reset, a group's settings anew).
@functools.cache
def regime(device: torch.device, backend: str = "nccl", cuda_on_nccl: bool = True) -> str:
    """:func:`detect_regime`, once per device and backend: NCCL too reads its variables once."""
    return detect_regime(device, backend, cuda_on_nccl)


def forget() -> None:
    """Detect the regimes anew at their next use."""
    regime.cache_clear()


def group_regime(device: torch.device, group: dist.ProcessGroup | None = None) -> str:
    """The regime of ``device``'s tensors over ``group`` (None: the default group, where one
    exists): what :func:`route` decides by."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return carrier(device, None if group is None else group_info(group)).regime


def carrier(device: torch.device, info: GroupInfo | None) -> Carrier:
    """The group's backend, whether NCCL carries its CUDA tensors, and the regime of
    ``device``'s tensors over it (no group: NCCL's)."""
    backend = "nccl" if info is None else info.backend
    nccl = True if info is None else info.cuda_on_nccl
    return Carrier(backend=backend, cuda_on_nccl=nccl, regime=regime(device, backend, nccl))


def spans_hosts(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s ranks (None: the default group's) lie on several hosts, as the
    launcher says: ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``, and the group's global ranks on
    more than one host, the launcher numbering them host by host (torchrun and
    :mod:`cgx2.launch` do; the node mesh assumes it too). Every rank reads the same variables
    and ranks, so all answer alike, without communicating."""
    launch = config.launch()
    if not launch.spans_nodes:
        return False
    ranks = _global_ranks(group)
    if ranks is None:  # a group torch.distributed does not know (a stand-in): the job's
        return True
    local = launch.local_world_size
    return len({rank // local for rank in ranks}) > 1


def _global_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """``group``'s ranks in the default group (None: all of them), or None where
    ``torch.distributed`` does not know the group."""
    if group is None or not dist.is_initialized():
        return None
    try:
        return dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return None


def in_trace(device: torch.device) -> bool:
    """Whether the calling code is being traced (``torch.compile``) or captured into a CUDA
    graph: there nothing may be measured, since measuring runs and waits for collectives."""
    if torch.compiler.is_compiling():
        return True
    capturing = device.type == "cuda" and torch.cuda.is_available()
    return capturing and torch.cuda.is_current_stream_capturing()
