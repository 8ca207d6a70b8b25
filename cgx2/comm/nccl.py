"""The NCCL transport: grouped ``ncclSend``/``ncclRecv`` on the communicator of the user's NCCL
process group (``cgx2._C``, calling the NCCL library torch loaded), queued on the caller's stream.

Chosen by ``CGX2_TRANSPORT=nccl`` (docs/transports.md). Calls on CPU tensors, or on a group
whose CUDA collectives are not NCCL's, take the process group's transport instead. The
transfers are queued on the current CUDA stream, as NCCL's synchronous collectives are, so
no call returns a Work. Like torch's own collectives on the group, they must be issued in the
same order on every rank.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from .. import extension
from . import process_group
from .base import TRANSPORT_FUNCTIONS
from .groups import group_state
from .process_group import group_info, group_size_and_rank

__all__ = ["available", *TRANSPORT_FUNCTIONS]

log = logging.getLogger("cgx2")


# Asked once: whether the extension and torch's NCCL are there does not change in a process.
@functools.cache
def available() -> bool:
    """Whether NCCL transfers can run here: the extension is built and torch loaded NCCL
    (logged once where not)."""
    lib = extension.load()
    if lib is None or not hasattr(lib, "nccl_available"):
        return False
    ok, why = lib.nccl_available()
    if not ok:
        log.info("cgx2: the NCCL transport is unavailable: %s", why)
    return bool(ok)


def _comm(group: dist.ProcessGroup) -> int:
    """The address of ``group``'s NCCL communicator, made by its first collective where torch
    has not made it yet (every rank reaches this call alike: it is collective)."""
    state = group_state(group)
    if state.nccl_comm:
        return state.nccl_comm
    backend = group._get_backend(torch.device("cuda"))
    address = backend._comm_ptr()
    if not address:  # torch makes communicators lazily, at a group's first collective
        dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
        address = backend._comm_ptr()
    if not address:
        raise RuntimeError(f"cgx2: group {group.group_name!r} has no NCCL communicator")
    state.nccl_comm = address
    return address


def _raw_current_stream() -> int:
    """The current CUDA stream's handle (torch.cuda.current_stream() cost microseconds)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _carries(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return t.is_cuda and group_info(group).cuda_on_nccl and available()


def _transfers(
    group: dist.ProcessGroup,
    sends: list[tuple[int, int, int]],
    receives: list[tuple[int, int, int]],
    operation: str,
) -> None:
    """One grouped set of transfers, each (address, bytes, peer) sent or received."""
    try:
        extension.load().nccl_transfers(
            _comm(group),
            _raw_current_stream(),
            [a for a, _, _ in sends],
            [n for _, n, _ in sends],
            [p for _, _, p in sends],
            [a for a, _, _ in receives],
            [n for _, n, _ in receives],
            [p for _, _, p in receives],
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"cgx2: the NCCL transport's {operation} on group {group.group_name!r}: {e}"
        ) from e


def all_to_all(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Row j of ``send`` (``[world, P]``, contiguous) to rank j; rank j's row for us into row
    j of ``out``, but for our own (left as it was: nobody reads it)."""
    if not _carries(send, group):
        return process_group.all_to_all(out, send, group, async_op)
    world, rank = group_size_and_rank(group)
    # Rows by address, not as tensor views: each view costs microseconds of host time.
    row = send.numel() * send.element_size() // world
    sent, got = send.data_ptr(), out.data_ptr()
    peers = [p for p in range(world) if p != rank]
    _transfers(
        group,
        [(sent + p * row, row, p) for p in peers],
        [(got + p * row, row, p) for p in peers],
        "all_to_all",
    )
    return None


def all_gather(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Every rank's ``send`` (contiguous) into its slot of ``out``, in rank order."""
    if not _carries(send, group):
        return process_group.all_gather(out, send, group, async_op)
    world, rank = group_size_and_rank(group)
    nbytes = send.numel() * send.element_size()
    lib = extension.load()
    if lib.nccl_has_all_gather():  # one collective: less host time than grouped transfers
        try:
            lib.nccl_all_gather(
                _comm(group), _raw_current_stream(), send.data_ptr(), out.data_ptr(), nbytes
            )
        except RuntimeError as e:
            raise RuntimeError(
                f"cgx2: the NCCL transport's all_gather on group {group.group_name!r}: {e}"
            ) from e
        return None
    got = out.data_ptr()
    peers = [p for p in range(world) if p != rank]
    _transfers(
        group,
        [(send.data_ptr(), nbytes, p) for p in peers],
        [(got + p * nbytes, nbytes, p) for p in peers],
        "all_gather",
    )
    if got + rank * nbytes != send.data_ptr():
        out.view(world, -1)[rank].copy_(send.reshape(-1))
    return None


def shift(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """``send`` to the next rank of the ring (rank + 1); the previous rank's into ``out``."""
    if not _carries(send, group):
        return process_group.shift(out, send, group, async_op)
    world, rank = group_size_and_rank(group)
    _transfers(
        group,
        [(send.data_ptr(), send.numel() * send.element_size(), (rank + 1) % world)],
        [(out.data_ptr(), out.numel() * out.element_size(), (rank - 1) % world)],
        "shift",
    )
    return None


def wait(work: dist.Work | None) -> None:
    """Wait for a call's Work, if it returned one (only the process group's fallback does)."""
    if work is not None:
        work.wait()


def allreduce_plain_(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """The uncompressed allreduce: NCCL's own, through the process group."""
    return process_group.allreduce_plain_(t, group, reduce_op)


def allreduce_plain_async_(
    t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
) -> torch.futures.Future[torch.Tensor]:
    """The process group's, as :func:`allreduce_plain_`."""
    return process_group.allreduce_plain_async_(t, group, reduce_op)


def reduce_scatter_plain(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The uncompressed reduce-scatter: NCCL's own, through the process group."""
    process_group.reduce_scatter_plain(out, inp, group)
