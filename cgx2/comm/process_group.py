"""The process-group transport: ``torch.distributed``'s collectives on the user's group, called
directly where that is safe (eager, a real ProcessGroup), and what a group is (backend, size).

Every blocking wait goes through :func:`wait`, so the group's timeout applies.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import cpu_threads
from .groups import GroupInfo, group_state

__all__ = [
    "CompletedWork",
    "GroupInfo",
    "all_gather",
    "all_gather_in_parts",
    "all_gather_single",
    "all_to_all",
    "allreduce_plain_",
    "allreduce_plain_async_",
    "group_info",
    "group_size_and_rank",
    "group_store",
    "reduce_scatter_plain",
    "reduce_scatter_single",
    "shift",
    "wait",
]

# torch >= 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor; both exist between.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_info(group: dist.ProcessGroup) -> GroupInfo:
    """:class:`GroupInfo` of ``group``, looked up at its first call and kept in its
    :class:`~.group_state.GroupState`."""
    state = group_state(group)
    info = state.info
    if info is not None:
        return info
    backend = dist.get_backend(group)
    if isinstance(group, dist.ProcessGroup):
        size, rank = group.size(), group.rank()
    else:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    nccl = backend == "nccl" or bool(getattr(group, "cuda_on_nccl", False))
    info = state.info = GroupInfo(
        backend=backend,
        size=size,
        rank=rank,
        cuda_on_nccl=nccl,
        has_exact_allreduce=hasattr(group, "allreduce_exact"),
        timeout_s=_timeout_s(group),
    )
    return info


def _timeout_s(group: dist.ProcessGroup) -> float:
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.distributed_c10d.default_pg_timeout.total_seconds()


def group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The c10d store ``group`` was made with (torch gives each group a prefix of its own), or
    None where torch does not know the group."""
    entry = dist.distributed_c10d._world.pg_map.get(group)  # (backend, store)
    if entry is None:
        return None
    _, store = entry
    return store


def group_size_and_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    """``group``'s size and this process's rank in it (:func:`group_info`)."""
    info = group_info(group)
    return info.size, info.rank


def wait(work: dist.Work | None) -> None:
    """Wait on a collective's Work, if it returned one: NCCL returns none for a synchronous
    call (asyncOp False), on the caller's stream; gloo returns one that must still be waited."""
    if work is not None:
        work.wait()


def _options(kind: type, async_op: bool, **fields: object) -> object:
    """Collective options as ``torch.distributed``'s own wrappers make them (``asyncOp``:
    on NCCL's stream, or, where torch has the field and it is False, on the current one)."""
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    if hasattr(options, "asyncOp"):
        options.asyncOp = async_op
    return options


_SUM_OPTIONS = _options(dist.AllreduceOptions, False, reduceOp=dist.ReduceOp.SUM)
_AVG_OPTIONS = _options(dist.AllreduceOptions, False, reduceOp=dist.ReduceOp.AVG)
_ALL_TO_ALL_OPTIONS = {a: _options(dist.AllToAllOptions, a) for a in (True, False)}
_ALL_GATHER_OPTIONS = {
    a: _options(dist.distributed_c10d.AllgatherOptions, a) for a in (True, False)
}


def _calls_directly(group: dist.ProcessGroup) -> bool:
    """Whether to call ``group``'s collectives directly, as ``torch.distributed``'s wrappers
    do after their checks and logging (host time the allreduce's pieces wait on)."""
    return not torch.compiler.is_compiling() and isinstance(group, dist.ProcessGroup)


def all_to_all(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Start ``dist.all_to_all_single(out, send, async_op=async_op)`` of equal splits. The
    Work, if any, must be waited on (gloo returns one even when ``async_op`` is False)."""
    if _calls_directly(group):
        return group.alltoall_base(out, send, [], [], _ALL_TO_ALL_OPTIONS[async_op])
    return dist.all_to_all_single(out, send, group=group, async_op=async_op)


GLOO_SPLIT_BYTES = 4 << 20
"""gloo's all-gathers of at least this many bytes a rank run as :data:`GLOO_SPLITS` concurrent
ones: the GPU hosts' allreduce over gloo gains from it (BENCHMARKS.md, "GPU hosts over
Ethernet")."""
GLOO_SPLITS = 4


def all_gather(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Start the all-gather of every rank's ``send`` into ``out``; its Work as
    :func:`all_to_all`'s."""
    if _calls_directly(group):
        splits = _gloo_splits(send, group)
        if splits > 1 and not _overlaps(out, send):
            return all_gather_in_parts(out, send, group, splits)
        return group._allgather_base(out, send, _ALL_GATHER_OPTIONS[async_op])
    return all_gather_single(out, send, group=group, async_op=async_op)


def _gloo_splits(send: torch.Tensor, group: dist.ProcessGroup) -> int:
    info = group_info(group)
    if info.backend != "gloo" or info.size < 2:
        return 1
    return GLOO_SPLITS if send.numel() * send.element_size() >= GLOO_SPLIT_BYTES else 1


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_end


def all_gather_in_parts(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, splits: int
) -> dist.Work:
    """The all-gather of a 1-D ``send`` into ``out`` (``world`` slots of its size, none of them
    ``send``'s memory) as ``splits`` concurrent ones over consecutive parts of ``send``, each
    landing in its part of every rank's slot (gloo's list form takes the slots as views). The
    returned Work waits for them all."""
    world, numel = group_info(group).size, send.numel()
    slots = out.view(world, numel)
    step = -(-numel // splits)
    works = []
    for start in range(0, numel, step):
        parts = [slot[start : start + step] for slot in slots]
        works.append(
            group.allgather([parts], [send[start : start + step]], _ALL_GATHER_OPTIONS[True])
        )
    return _AllWorks(works)


def allreduce_plain_(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """The uncompressed allreduce of a contiguous ``t`` in place; returns ``t``. AVG uses the
    backend's own AVG where it has one (NCCL); elsewhere (gloo) it divides by the world size
    and sums, as DDP's own allreduce does (the same bits as DDP's, and a 16-bit sum that
    cannot overflow where the average does not)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return t
    info = group_info(group)
    if info.has_exact_allreduce:  # the cgx backend, whose all_reduce would quantize
        group.allreduce_exact(t, reduce_op).wait()
        return t
    native_avg = reduce_op == "avg" and info.cuda_on_nccl and t.is_cuda
    op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
    if reduce_op == "avg" and not native_avg:
        cpu_threads.div_(t, info.size)
    if torch.compiler.is_compiling():
        dist.all_reduce(t, op=op, group=group)
    else:
        # The process group's own allreduce, which dist.all_reduce calls after its checks
        # and logging: below the crossover this is the whole call, so its host time counts.
        wait(group.allreduce([t], _AVG_OPTIONS if native_avg else _SUM_OPTIONS))
    return t


def allreduce_plain_async_(
    t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_plain_` of a CPU ``t`` left running on gloo's threads, as DDP's own
    allreduce is: a future of ``t``, set once the sum has landed. AVG divides first, on the
    calling thread (a thread of gloo's dividing afterwards would compete with the backward
    pass). Elsewhere (NCCL, the cgx backend, a traced call) the call runs at once and the
    future is already set."""
    info = None if group is dist.GroupMember.NON_GROUP_MEMBER else group_info(group)
    if (
        info is None
        or info.has_exact_allreduce
        or t.is_cuda
        or torch.compiler.is_compiling()
        or not isinstance(group, dist.ProcessGroup)
    ):
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(allreduce_plain_(t, group, reduce_op))
        return done
    if reduce_op == "avg":
        cpu_threads.div_(t, info.size)
    work = group.allreduce([t], _SUM_OPTIONS)

    def reduced(future: torch.futures.Future) -> torch.Tensor:
        future.value()  # raises what the collective raised
        return t

    return work.get_future().then(reduced)


def shift(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Send ``send`` to the next rank of the ring (rank + 1) while the previous one's lands in
    ``out``: one grouped send/receive (``dist.batch_isend_irecv``)."""
    world, rank = group_size_and_rank(group)
    following = dist.get_global_rank(group, (rank + 1) % world)
    preceding = dist.get_global_rank(group, (rank - 1) % world)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, following, group),
            dist.P2POp(dist.irecv, out, preceding, group),
        ]
    )
    work = _AllWorks(works)
    if async_op:
        return work
    work.wait()
    return None


class _AllWorks(dist.Work):
    """Several Works as one: :meth:`wait` waits for each."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True


def reduce_scatter_plain(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The uncompressed reduce-scatter (sum) of ``inp`` (``world`` equal chunks) into ``out``
    (this rank's chunk)."""
    reduce_scatter_single(out, inp, group=group)


class CompletedWork(dist.Work):
    """A collective whose result is already enqueued: on CUDA, its future's event stands for
    the kernels on the stream that issued them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        cuda = [t.device for t in tensors if t.is_cuda]
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(
            devices=cuda[:1] or None
        )
        self._future.set_result(tensors)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future
