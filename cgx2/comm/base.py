"""What the collectives need from a transport: :class:`Transport`, the seam where the
process group (:mod:`.process_group`) and later transports of cgx2's own plug in.

An implementation is a module of plain functions whose names and parameters are these.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["TRANSPORT_FUNCTIONS", "Transport"]

TRANSPORT_FUNCTIONS = (
    "all_gather",
    "all_to_all",
    "allreduce_plain_",
    "allreduce_plain_async_",
    "group_size_and_rank",
    "reduce_scatter_plain",
    "shift",
    "wait",
)
"""The functions of :class:`Transport`, which a transport module defines and exports."""


@runtime_checkable
class Transport(Protocol):
    """Moves packed payloads between the ranks of a group. The ``all_to_all`` and
    ``all_gather`` calls return a Work to :meth:`wait` on (or None where the call already
    finished on the caller's stream); every wait honours the group's timeout."""

    def all_to_all(
        self, out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
    ) -> dist.Work | None:
        """Row j of ``send`` (``[world, P]``) to rank j; rank j's row for us into row j of
        ``out``. Our own row of ``out`` is undefined afterwards (nobody reads it)."""
        ...

    def all_gather(
        self, out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
    ) -> dist.Work | None:
        """Every rank's ``send`` into its slot of ``out``, in rank order."""
        ...

    def shift(
        self, out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
    ) -> dist.Work | None:
        """``send`` to the next rank of the ring (rank + 1); the previous rank's into ``out``."""
        ...

    def wait(self, work: dist.Work | None) -> None:
        """Wait for a call's Work, if it returned one."""
        ...

    def allreduce_plain_(
        self, t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> torch.Tensor:
        """The uncompressed allreduce (``"sum"``/``"avg"``) of contiguous ``t``, in place."""
        ...

    def allreduce_plain_async_(
        self, t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`allreduce_plain_` started, not waited for: a future of ``t``, set once it
        holds the result (already set where the transport cannot leave the call running)."""
        ...

    def reduce_scatter_plain(
        self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """The uncompressed reduce-scatter (sum) of ``inp`` (``world`` equal chunks) into
        ``out`` (this rank's chunk)."""
        ...

    def group_size_and_rank(self, group: dist.ProcessGroup) -> tuple[int, int]:
        """The group's size and this process's rank in it."""
        ...
