"""How bytes move between ranks: the transport interface the collectives use.

:class:`Transport` is the interface. Today one transport implements it, the process group the
user has (:mod:`cgx2.comm.process_group`: NCCL on GPUs, gloo on CPUs, or the ``cgx``
backend's); the C++ transports plug in beside it.
"""

from . import process_group
from .base import Transport
from .process_group import (
    CompletedWork,
    GroupInfo,
    all_gather,
    all_gather_single,
    all_to_all,
    allreduce_plain_,
    group_info,
    group_size_and_rank,
    reduce_scatter_single,
    wait,
)

__all__ = [
    "CompletedWork",
    "GroupInfo",
    "Transport",
    "all_gather",
    "all_gather_single",
    "all_to_all",
    "allreduce_plain_",
    "group_info",
    "group_size_and_rank",
    "process_group",
    "reduce_scatter_single",
    "wait",
]
