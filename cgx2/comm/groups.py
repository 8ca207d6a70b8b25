"""What cgx2 keeps for a process group, in one object a group (:class:`GroupState`): made at the
group's first call (:func:`group_state`), dropped with the group, cleared for tests by one reset.

Every layer's per-group state is a field here: what the group is and what moves its bytes
(:mod:`cgx2.comm`), the agreement check's sequence and what the policy decided
(:mod:`cgx2.collectives`). It lives in the lowest layer that knows process groups so that the
transports' resources can be in it too; the fields an upper layer fills hold its values, which
this module never looks into.

The registry is a dict keyed by ``id(group)`` whose entry a ``weakref.finalize`` on the group
pops when the group is collected, before its id can be reused: the lifetime of a
``weakref.WeakKeyDictionary`` (torch's ``ProcessGroup`` takes weak references), without the
weak reference that dictionary builds at every lookup, which runs before every collective.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["GroupInfo", "GroupState", "MadeOnce", "group_state", "reset", "states"]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What the collectives need to know of a process group, looked up once per group.

    - ``backend``: ``dist.get_backend(group)`` ("nccl", "gloo", "cgx", ...).
    - ``size`` and ``rank``: the group's size and this process's rank in it.
    - ``cuda_on_nccl``: whether its CUDA tensors' collectives are NCCL's (an NCCL group, or a
      ``cgx`` one with NCCL under it); otherwise CUDA tensors cross through host memory.
    - ``has_exact_allreduce``: whether the group has an uncompressed ``allreduce_exact`` (the
      ``cgx`` backend, whose ``all_reduce`` would quantize) for the plain path to call.
    - ``timeout_s``: the group's timeout in seconds (its backend's options; else torch's
      default), which every wait of cgx2's own on the group honours.
    """

    backend: str
    size: int
    rank: int
    cuda_on_nccl: bool
    has_exact_allreduce: bool
    timeout_s: float


class Closable(Protocol):
    """A resource a group holds until it goes: a transport's channel, sockets, a thread."""

    def close(self) -> None: ...


@dataclass(slots=True, eq=False)
class MadeOnce:
    """A group's resource, made at the group's first call for it (:meth:`get`) and kept while
    the group lives. Its own lock: making a channel or sockets waits on the group's peers,
    which another thread's calls, on this group's other resource or on another group, must not
    wait for (ranks may make them in different orders)."""

    value: Closable | None = None
    made: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, make: Callable[[], Closable | None]) -> Closable | None:
        """The resource, ``make()``'s at the first call (None, where the group has none, is
        kept too: it is not made again)."""
        if self.made:
            return self.value
        with self.lock:
            if not self.made:
                self.value, self.made = make(), True
        return self.value


@dataclass(slots=True, eq=False)
class GroupState:
    """Everything cgx2 keeps for one process group (or, for the policy's calls without one,
    for ``None``). Nothing here refers to the group itself: the state must not keep it alive.

    What the group is, and what moves its bytes (:mod:`cgx2.comm`), each made at the group's
    first use of it and kept while the group lives:

    - ``info``: :class:`GroupInfo` (:func:`cgx2.comm.process_group.group_info`).
    - ``shm_channel``: the shared-memory channel (None: the process group serves the group)
      (:mod:`cgx2.comm.shm`), a :class:`MadeOnce`.
    - ``peers``: the peer sockets (:mod:`cgx2.comm.peers`), a :class:`MadeOnce`.
    - ``nccl_comm``: the address of the group's NCCL communicator, 0 until looked up
      (:mod:`cgx2.comm.nccl`).
    - ``worker``: the group's worker thread (:mod:`cgx2.comm.worker`), a :class:`MadeOnce`
      made when a call is first submitted.

    The agreement check's (:mod:`cgx2.collectives.agreement`, and the entry points'), kept while
    the group lives:

    - ``agreement_calls``: the numbers of the group's checked calls, in order.
    - ``agreement_early``: a peer's queued entries of a later call, popped early.
    - ``agreement_pending``: the deferred comparisons not yet read.
    - ``agreement_values``: the values a checked call compares, kept on its GPU by device,
      stream and values (read again by the calls that compare the same, never written).
    - ``settings_agreed``: the entry points whose settings the group's ranks compared once for
      the group (:mod:`cgx2.ddp.global_qsgd`'s hooks, for states made for one call).

    What the policy decided (:mod:`cgx2.collectives.decided`), valid for the settings they
    were decided under and dropped when those change (:func:`reset` drops them for tests):

    - ``decided_under``: the :class:`cgx2.config.TuningConfig` snapshot that ``routes`` and
      ``transports`` were decided under.
    - ``measured_under``: the settings the measurements below were made under (those that
      change what a measurement finds).
    - ``routes``: the routes (:class:`cgx2.collectives.decision.Routes`) by device, dtype and
      bucket size.
    - ``transports``: the transport of each device's tensors (:mod:`.base`'s ``Transport``).
    - ``calibration``: the group's first rank's calibration file as read for the policy
      (None: not read yet).
    - ``crossovers``: the crossovers (alone, beside the training step) by device, dtype and
      whether CUDA graphs replay.
    - ``mesh_faster``: whether the node mesh beat the flat allreduce, by measured size, by
      device, dtype, bits, bucket size and intra-node broadcast.
    """

    info: GroupInfo | None = None
    shm_channel: MadeOnce = field(default_factory=MadeOnce)
    peers: MadeOnce = field(default_factory=MadeOnce)
    nccl_comm: int = 0
    worker: MadeOnce = field(default_factory=MadeOnce)
    agreement_calls: itertools.count = field(default_factory=itertools.count)
    agreement_early: dict[int, bytes] = field(default_factory=dict)
    agreement_pending: deque[Any] = field(default_factory=deque)
    agreement_values: dict[tuple, Any] = field(default_factory=dict)
    settings_agreed: set[str] = field(default_factory=set)
    decided_under: object = None
    measured_under: object = None
    routes: dict[tuple, Any] = field(default_factory=dict)
    transports: dict[Any, Any] = field(default_factory=dict)
    calibration: dict[str, dict] | None = None
    crossovers: dict[tuple, tuple[int | None, int | None]] = field(default_factory=dict)
    mesh_faster: dict[tuple, dict[int, bool]] = field(default_factory=dict)

    def forget_decisions(self) -> None:
        """Drop what the policy decided: the next call decides anew."""
        self.decided_under = self.measured_under = self.calibration = None
        self.routes.clear()
        self.transports.clear()
        self.crossovers.clear()
        self.mesh_faster.clear()

    def close(self) -> None:
        """Release the group's resources (its channel, sockets and thread)."""
        for resource in (self.shm_channel, self.peers, self.worker):
            if resource.value is not None:
                resource.value.close()


# The one registry of per-group state (module docstring): a process has one set of groups.
_STATES: dict[int, GroupState] = {}


def group_state(group: dist.ProcessGroup | None) -> GroupState:
    """``group``'s :class:`GroupState`, made at its first call and dropped with the group."""
    state = _STATES.get(id(group))
    return _new(group) if state is None else state


def _new(group: dist.ProcessGroup | None) -> GroupState:
    """``group``'s state, made now: of threads making it at once, one ``setdefault`` wins (one
    operation on a dict of int keys, atomic) and registers its drop; the others take its."""
    key = id(group)
    made = GroupState()
    state = _STATES.setdefault(key, made)
    if state is made and group is not None:  # None's is the process's, for calls without one
        weakref.finalize(group, _drop, key)
    return state


def _drop(key: int) -> None:
    state = _STATES.pop(key, None)
    if state is not None:
        state.close()


def states() -> list[GroupState]:
    """The states of the groups alive now (and of ``None``, where made)."""
    return list(_STATES.copy().values())  # a copy: a group collected meanwhile pops its entry


def reset() -> None:
    """Forget what was decided for every group (tests; :func:`cgx2.collectives.policy.reset`
    adds the policy's own): the groups' resources stay, their next calls decide anew."""
    for state in states():
        state.forget_decisions()


def _after_fork() -> None:
    """A child has its own peers, if any, and none of its parent's threads (which may have held
    the locks when it forked)."""
    for state in states():
        state.shm_channel.lock, state.worker.lock = threading.Lock(), threading.Lock()
        state.peers = MadeOnce()


os.register_at_fork(after_in_child=_after_fork)
