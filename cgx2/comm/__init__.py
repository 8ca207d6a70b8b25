"""How bytes move between ranks: the transport interface the collectives use.

:class:`Transport` is the interface. Three transports implement it: the process group the user
has (:mod:`cgx2.comm.process_group`: NCCL on GPUs, gloo on CPUs, or the ``cgx`` backend's),
shared memory between the ranks of one host (:mod:`cgx2.comm.shm`), and grouped NCCL
send/receive on the group's communicator (:mod:`cgx2.comm.nccl`), the last two in ``cgx2._C``.
What cgx2 keeps for each process group, in every layer, is one :class:`GroupState`; the CUDA
streams it codes and communicates on beside the training's come from :func:`coding_stream`.
"""

from . import groups, nccl, process_group, shm
from .base import Transport
from .groups import GroupState, group_state
from .process_group import (
    CompletedWork,
    GroupInfo,
    all_gather,
    all_gather_single,
    all_to_all,
    allreduce_plain_,
    group_info,
    group_size_and_rank,
    group_store,
    reduce_scatter_single,
    wait,
)
from .streams import coding_stream

__all__ = [
    "CompletedWork",
    "GroupInfo",
    "GroupState",
    "Transport",
    "all_gather",
    "all_gather_single",
    "all_to_all",
    "allreduce_plain_",
    "coding_stream",
    "group_info",
    "group_size_and_rank",
    "group_state",
    "group_store",
    "groups",
    "nccl",
    "process_group",
    "reduce_scatter_single",
    "shm",
    "wait",
]
