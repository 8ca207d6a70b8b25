"""The shared-memory transport: the ranks of a group on one host swap payloads through host
memory that each maps (``cgx2._C``'s segments and flags); CUDA tensors stage through it pinned.

Each rank owns one segment per group: a page of flags, then :data:`SLOTS` slots that calls use
in turn. A call writes its payload into its slot of the caller's segment and raises the slot's
``written`` flag to the call's epoch (its number in the group's sequence of calls); peers wait
for that epoch, copy what is theirs, and raise their ``consumed`` flag, which the owner waits
for before it writes that slot again. Waits watch each peer's process and honour the group's
timeout: a peer that died or stalled is an error naming it, never a hang.

Segments are anonymous memory files (memfd, mode 0600) that never have a name: their owner
announces its descriptor through the c10d store, its peers open it through the owner's
``/proc/<pid>/fd``, and the memory goes with the last process that maps it, however the job
ends: nothing is ever in /dev/shm. Groups that span hosts, or whose segments cannot be made or
opened, use the process group (:mod:`.process_group`), decided alike on every rank.

A call that fails on a rank after it has begun still ends there: the rank raises its flags for
the call, marked void where its payload was not written whole, and a peer that would read it
raises instead. Every rank thus leaves the call at once and the group's next call works. A call
whose Work was dropped unwaited (its caller failed) is released when its slot comes round; the
tags each payload carries (its operation and size) turn ranks whose calls no longer match into
an error that closes the group at once, never a wrong sum or a wait.
"""

from __future__ import annotations

import datetime
import functools
import gc
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import cpu_threads, extension
from . import process_group
from . import store as stored
from .base import TRANSPORT_FUNCTIONS
from .groups import group_state
from .process_group import group_info, group_size_and_rank

__all__ = ["SLOTS", "ShmError", "available", "serves", *TRANSPORT_FUNCTIONS]

log = logging.getLogger("cgx2")

SLOTS = 4
"""Calls in flight per group before a rank waits for its peers to read its oldest: the
allreduce's pipeline keeps three (a piece's all-to-all, the next one's, an all-gather)."""

PLAIN_PIECE_BYTES = 16 << 20
"""The uncompressed allreduce's piece: larger tensors are reduced a piece at a time, so that a
segment's slots stay this size."""

_LINE = 64  # one flag a cache line: each is written by one process only
_WRITTEN, _REDUCED, _CONSUMED = 0, 1, 2
_VOID = 3  # the epoch of a call this rank gave up on in the slot: its payload is not one
_TAG = 4  # what the slot holds: the operation and size of the call (_tag)
_OPERATIONS = {"all_to_all": 1, "all_gather": 2, "shift": 3, "allreduce": 4, "reduce_scatter": 5}
_HEADER_BYTES = 4096  # the flags' page; slots start page-aligned, so any dtype views them
_MIN_SLOT_BYTES = 64 << 10
_EPOCH_MASK = 0xFFFFFFFF
_GONE = 2  # cgx2._C's kPeerGone


class ShmError(RuntimeError):
    """A peer of the shared-memory transport died, stalled past the group's timeout, or
    failed before: the group cannot go on."""


class _Fallback(Exception):
    """Every rank of the group agreed that its segments cannot be made: use the process
    group from now on."""


def available() -> bool:
    """Whether the transport can run here at all (the extension is built)."""
    return extension.load() is not None


def _host_identity() -> str:
    """What ranks that can share segments have in common: the boot, the /dev/shm mount, and
    the PID and network namespaces (a network namespace stands for a host: tests make hosts
    of them, and a peer's liveness is read from /proc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat("/dev/shm")
        pid_ns, net_ns = (os.stat(f"/proc/self/ns/{n}").st_ino for n in ("pid", "net"))
    except OSError as e:
        return f"unknown:{os.getpid()}:{e}"  # unique: never shares
    return f"{boot}:{shm.st_dev}:{shm.st_ino}:{pid_ns}:{net_ns}"


class _Channel:
    """One group's segments, flags and sequence of calls."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        lib: Any,
        store: dist.Store,
        prefix: str,
        pids: list[int],
        starts: list[int],
    ) -> None:
        self.lib, self.store, self.prefix = lib, store, prefix
        self.world, self.rank = group_size_and_rank(group)
        self.name = group.group_name
        self.timeout = group_info(group).timeout_s
        self.pids, self.starts = pids, starts
        self.peer_ranks = [r for r in range(self.world) if r != self.rank]
        self.seq = 0
        self.base_seq = 0  # the last call before this generation of segments
        self.generation = 0
        self.capacity = 0  # bytes a slot
        self.segments: list[Any] = []  # every rank's, by rank
        self.views: list[torch.Tensor] = []  # their bytes
        self.registered: list[int] = []  # addresses registered with CUDA
        self.broken: str | None = None
        # This rank's calls whose payloads it has yet to read, by epoch: their Works (weakly:
        # one dropped unwaited is a call given up) and the views they read from.
        self.pending: dict[int, tuple[weakref.ref[_Work], list[torch.Tensor]]] = {}
        self.lock = threading.Lock()  # calls may come from the group's worker and the caller

    # -- segments --------------------------------------------------------------------------

    def _agree(self, step: str, mine: str) -> list[str]:
        """Every rank's answer to ``step``: a rendezvous through the store."""
        key = f"{self.prefix}/g{self.generation}/{step}/"
        self.store.set(key + str(self.rank), mine)
        keys = [key + str(r) for r in range(self.world)]
        try:
            # Asked, not waited for: a blocking wait holds the process's one store client,
            # which another thread opening another group may need meanwhile.
            stored.wait(self.store, keys, self.timeout)
        except RuntimeError as e:
            raise ShmError(
                f"cgx2: the shared-memory transport of group {self.name!r} (rank {self.rank}): "
                f"a peer did not reach the same call within the group's timeout ({step}): {e}"
            ) from e
        return [self.store.get(k).decode() for k in keys]

    def grow(self, nbytes: int) -> None:
        """Segments whose slots hold ``nbytes``: every rank makes its own at the same call
        (their sizes agree) and maps its peers' through their descriptors; its own descriptor
        is closed once all have mapped it."""
        capacity = max(_MIN_SLOT_BYTES, 1 << (nbytes - 1).bit_length())
        self.generation += 1
        total = _HEADER_BYTES + SLOTS * capacity
        mine, status = None, ""
        try:
            mine = self.lib.Segment.create(total)
            status = f"ok {mine.fd} {mine.inode}"
        except OSError as e:
            status = f"rank {self.rank}: {e}"
        try:
            statuses = self._agree("created", status)
            failed = [s for s in statuses if not s.startswith("ok ")]
            segments, status = [], "ok"
            if not failed:
                try:
                    for r, announced in enumerate(statuses):
                        _, fd, inode = announced.split()
                        segments.append(
                            mine
                            if r == self.rank
                            else self.lib.Segment.open(self.pids[r], int(fd), total, int(inode))
                        )
                except OSError as e:
                    status = f"rank {self.rank}: {e}"
                failed = [s for s in self._agree("mapped", status) if s != "ok"]
        finally:
            if mine is not None:
                mine.release()
        if failed:
            raise _Fallback("; ".join(failed))
        self._unregister()
        self.segments = segments
        self.views = [torch.frombuffer(s.memoryview(), dtype=torch.uint8) for s in segments]
        self.capacity = capacity
        self.base_seq = self.seq - 1

    def register_cuda(self) -> None:
        """Pin every segment (cudaHostRegister) so that CUDA copies to and from it are DMA."""
        if self.registered or not self.segments:
            return
        cudart = torch.cuda.cudart()
        for s in self.segments:
            code = cudart.cudaHostRegister(s.address, s.nbytes, 0)
            if int(code) != 0:
                raise ShmError(f"cgx2: cudaHostRegister of a shared-memory segment failed: {code}")
            self.registered.append(s.address)

    def _unregister(self) -> None:
        if self.registered:
            cudart = torch.cuda.cudart()
            for address in self.registered:
                cudart.cudaHostUnregister(address)
            self.registered = []

    def close(self) -> None:
        self._unregister()
        self.views, self.segments = [], []

    # -- calls -----------------------------------------------------------------------------

    def begin(self, nbytes: int, operation: str) -> tuple[int, int, list[torch.Tensor]]:
        """The next call's epoch, slot and every rank's segment (the ones it must use, even
        after a later call grows them), once this rank may write the slot."""
        if self.broken is not None:
            raise ShmError(
                f"cgx2: the shared-memory transport of group {self.name!r} failed "
                f"earlier: {self.broken}"
            )
        self.seq += 1
        slot, last = self.seq % SLOTS, self.seq - SLOTS
        if last in self.pending:
            self._release_if_dropped(last, slot)
        try:
            if nbytes > self.capacity:
                self.grow(nbytes)
            if last > self.base_seq:  # its last use must have been read by all
                self.wait_peers(_CONSUMED, slot, last, operation)
        except _Fallback:
            raise
        except BaseException as e:  # the ranks' segments or sequences may differ from now on
            self.broken = self.broken or f"{operation} (call {self.seq}) could not begin: {e}"
            raise
        return self.seq, slot, self.views

    def _release_if_dropped(self, epoch: int, slot: int) -> None:
        """The call ``epoch`` in ``slot``, not waited for yet, is given up if its Work is gone
        (its caller failed after it began): this rank will never read it, and its peers may
        reuse their slots. A Work still held is waited for by its holder, as before."""
        work, views = self.pending[epoch]
        if work() is not None:
            # A failed caller's frames hold it in a cycle (its traceback's) until collected.
            gc.collect()
        if work() is None:
            del self.pending[epoch]
            self.signal(views, _CONSUMED, slot, epoch)

    def abandon(self, views: list[torch.Tensor], slot: int, epoch: int) -> None:
        """End this rank's part of a call it cannot finish: mark the slot void (a peer that
        would read it raises instead), then raise every flag, so that no peer waits."""
        self.pending.pop(epoch, None)
        if views:
            self.signal(views, _VOID, slot, epoch)
            for kind in (_WRITTEN, _REDUCED, _CONSUMED):
                self.signal(views, kind, slot, epoch)

    def check_peers(
        self, views: list[torch.Tensor], slot: int, epoch: int, operation: str, nbytes: int
    ) -> None:
        """After a wait for the peers' payloads: raise where a peer gave this call up, or
        where its slot holds another operation or size (the ranks' calls no longer match)."""
        epoch &= _EPOCH_MASK
        tag = _tag(operation, nbytes)
        for r in self.peer_ranks:
            if self.lib.load_flag(self._flag(views, r, _VOID, slot)) == epoch:
                raise ShmError(
                    f"cgx2: the shared-memory transport: rank {r} of group "
                    f"{self.name!r} failed during {operation} (call {epoch}; this "
                    f"is rank {self.rank}); the group goes on"
                )
            theirs = self.lib.load_flag(self._flag(views, r, _TAG, slot))
            if theirs != tag:
                self.broken = (
                    f"rank {r} of group {self.name!r} is at another call than this rank's "
                    f"{operation} of {nbytes} bytes (call {epoch}; this is rank {self.rank}; "
                    f"{_untag(theirs)} there): the ranks' calls no longer match (did a call "
                    f"fail on some ranks only?)"
                )
                raise ShmError(f"cgx2: the shared-memory transport: {self.broken}")

    def region(self, views: list[torch.Tensor], rank: int, slot: int, nbytes: int) -> torch.Tensor:
        start = _HEADER_BYTES + slot * (views[0].numel() - _HEADER_BYTES) // SLOTS
        return views[rank][start : start + nbytes]

    def _flag(self, views: list[torch.Tensor], rank: int, kind: int, slot: int) -> int:
        return views[rank].data_ptr() + (kind * SLOTS + slot) * _LINE

    def signal(self, views: list[torch.Tensor], kind: int, slot: int, epoch: int) -> None:
        self.lib.signal_flag(self._flag(views, self.rank, kind, slot), epoch & _EPOCH_MASK)

    def wait_peers(
        self,
        kind: int,
        slot: int,
        epoch: int,
        operation: str,
        views: list[torch.Tensor] | None = None,
    ) -> None:
        views = self.views if views is None else views
        peers = self.peer_ranks
        status, index = self.lib.wait_flags(
            [self._flag(views, r, kind, slot) for r in peers],
            epoch & _EPOCH_MASK,
            self.timeout,
            [self.pids[r] for r in peers],
            [self.starts[r] for r in peers],
        )
        if status == 0:
            return
        peer = peers[index]
        why = (
            f"exited (pid {self.pids[peer]})"
            if status == _GONE
            else f"did not arrive within the group's timeout ({self.timeout:g} s)"
        )
        self.broken = (
            f"rank {peer} of group {self.name!r} {why} during {operation} "
            f"(call {epoch}; this is rank {self.rank})"
        )
        raise ShmError(f"cgx2: the shared-memory transport: {self.broken}")


def _tag(operation: str, nbytes: int) -> int:
    return (_OPERATIONS[operation] << 29 | nbytes & ((1 << 29) - 1)) & _EPOCH_MASK


def _untag(tag: int) -> str:
    names = {code: name for name, code in _OPERATIONS.items()}
    name = names.get(tag >> 29)
    return f"{name} of {tag & ((1 << 29) - 1)} bytes (modulo 2**29)" if name else "nothing"


# Channels opened so far per group name, the same on every rank: it outlives the groups, so
# that a group made again under a name (the default one, after destroy and init) has new keys.
_OPENED: dict[str, int] = {}
_OPENED_LOCK = threading.Lock()  # guards _OPENED


def _open(group: dist.ProcessGroup) -> _Channel | None:
    """The group's channel, made collectively at its first call; None where the process group
    serves instead (one rank, ranks on several hosts, no extension), decided alike on all."""
    lib = extension.load()
    world, _ = group_size_and_rank(group)
    if lib is None or world < 2:
        return None
    store = dist.distributed_c10d._get_default_store()
    with _OPENED_LOCK:
        count = _OPENED.get(group.group_name, 0)
        _OPENED[group.group_name] = count + 1
    prefix = f"cgx2/shm/{group.group_name}/{count}"
    mine = {
        "host": _host_identity(),
        "pid": os.getpid(),
        "start": lib.process_start_time(os.getpid()),
    }
    channel = _Channel(group, lib, store, prefix, [], [])
    peers = [json.loads(a) for a in channel._agree("hello", json.dumps(mine))]
    if len({p["host"] for p in peers}) > 1:
        log.info(
            "cgx2: group %r spans hosts: its collectives use the process group's "
            "transport, not shared memory",
            group.group_name,
        )
        return None
    channel.pids = [p["pid"] for p in peers]
    channel.starts = [p["start"] for p in peers]
    return channel


def _channel(group: dist.ProcessGroup) -> _Channel | None:
    """The group's channel, opened at its first call (:func:`_open`) and closed with the group
    (:mod:`.group_state`). A lock a group, not one for all: two threads opening two groups (a
    hook's worker and the caller) in different orders on different ranks must not wait on
    each other."""
    channel = group_state(group).shm_channel
    return channel.value if channel.made else channel.get(lambda: _open(group))


def serves(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s calls ride shared memory (collective at the group's first call:
    every rank must ask, or call a collective of this module)."""
    return _channel(group) is not None


def _fall_back(group: dist.ProcessGroup, channel: _Channel, why: str) -> None:
    log.warning(
        "cgx2: the shared-memory transport of group %r is unavailable (%s); its "
        "collectives use the process group",
        channel.name,
        why,
    )
    channel.close()
    group_state(group).shm_channel.value = None


class _Work(dist.Work):
    """A call whose payload is written; :meth:`wait` receives the peers' (once)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        super().__init__()
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def wait(work: dist.Work | None) -> None:
    """Wait for a call's Work, if it returned one (the process group's too)."""
    if work is not None:
        work.wait()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _stage_in(region: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into shared memory; on return the bytes are there for the peers."""
    if source.is_cuda:
        region.copy_(source, non_blocking=True)
        torch.cuda.current_stream(source.device).synchronize()
    else:
        cpu_threads.copy_(region, source)


def _copy_out(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy out of shared memory (or from this rank's own input); on a GPU queued, on the host
    split over cgx2's threads."""
    if dst.is_cuda:
        dst.copy_(src, non_blocking=True)
    else:
        cpu_threads.copy_(dst, src)


def _finish_reads(device: torch.device) -> None:
    """Make copies out of shared memory complete before the slot is released to its owner."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _exchange(
    group: dist.ProcessGroup,
    send: torch.Tensor,
    operation: str,
    receive: Callable[[_Channel, list[torch.Tensor], int, int], None],
    fallback: Callable[[], dist.Work | None],
    async_op: bool,
) -> dist.Work | None:
    """Write ``send`` into this rank's slot and return the Work that ``receive``s the peers'."""
    channel = _channel(group)
    if channel is None:
        return fallback()
    data = _bytes_of(send)

    def finish() -> None:
        channel.pending.pop(epoch, None)
        try:
            channel.wait_peers(_WRITTEN, slot, epoch, operation, views)
            channel.check_peers(views, slot, epoch, operation, data.numel())
            receive(channel, views, slot, data.numel())
            _finish_reads(send.device)
        finally:
            channel.signal(views, _CONSUMED, slot, epoch)

    work = _Work(finish)
    with channel.lock:
        try:
            epoch, slot, views = channel.begin(data.numel(), operation)
        except _Fallback as e:
            _fall_back(group, channel, str(e))
            return fallback()
        try:
            if send.is_cuda:
                channel.register_cuda()
            _stage_in(channel.region(views, channel.rank, slot, data.numel()), data)
        except BaseException:
            channel.abandon(views, slot, epoch)
            raise
        channel.signal(views, _TAG, slot, _tag(operation, data.numel()))
        channel.signal(views, _WRITTEN, slot, epoch)
        channel.pending[epoch] = (weakref.ref(work), views)

    if async_op:
        return work
    work.wait()
    return None


def all_to_all(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Row j of ``send`` (``[world, P]``, contiguous) to rank j; rank j's row for us into row
    j of ``out``: each rank reads its row from the others' slots."""

    def receive(channel: _Channel, views: list[torch.Tensor], slot: int, nbytes: int) -> None:
        rows, rank, row = out.view(channel.world, -1), channel.rank, nbytes // channel.world
        for peer in channel.peer_ranks:
            block = channel.region(views, peer, slot, nbytes)[rank * row : (rank + 1) * row]
            _copy_out(rows[peer].view(torch.uint8), block)
        _copy_out(rows[rank], send.view(channel.world, -1)[rank])

    fallback = lambda: process_group.all_to_all(out, send, group, async_op)
    return _exchange(group, send, "all_to_all", receive, fallback, async_op)


def all_gather(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Every rank's ``send`` (contiguous) into its slot of ``out``, in rank order."""

    def receive(channel: _Channel, views: list[torch.Tensor], slot: int, nbytes: int) -> None:
        rows = out.view(channel.world, -1)
        for peer in channel.peer_ranks:
            _copy_out(rows[peer].view(torch.uint8), channel.region(views, peer, slot, nbytes))
        _copy_out(rows[channel.rank], send.reshape(-1))

    fallback = lambda: process_group.all_gather(out, send, group, async_op)
    return _exchange(group, send, "all_gather", receive, fallback, async_op)


def shift(
    out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> dist.Work | None:
    """Send ``send`` (contiguous) to the next rank of the ring (rank + 1) while the previous
    one's lands in ``out``: each rank reads its predecessor's slot."""

    def receive(channel: _Channel, views: list[torch.Tensor], slot: int, nbytes: int) -> None:
        preceding = (channel.rank - 1) % channel.world
        out.reshape(-1).view(torch.uint8).copy_(
            channel.region(views, preceding, slot, nbytes), non_blocking=out.is_cuda
        )

    fallback = lambda: process_group.shift(out, send, group, async_op)
    return _exchange(group, send, "shift", receive, fallback, async_op)


def allreduce_plain_(t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """The uncompressed allreduce (``"sum"``/``"avg"``) of contiguous ``t`` in place: each
    rank writes ``t`` into its slot, sums one W-th of it from every slot (in rank order, so
    the sum is the same bytes on every rank), publishes that, and copies the others' sums."""
    channel = _channel(group) if group is not dist.GroupMember.NON_GROUP_MEMBER else None
    if channel is None or not t.is_contiguous() or t.numel() == 0:
        return process_group.allreduce_plain_(t, group, reduce_op)
    flat = t.view(-1)
    step = max(1, PLAIN_PIECE_BYTES // t.element_size())
    with channel.lock:
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            nbytes = piece.numel() * piece.element_size()
            try:
                fill = functools.partial(_reduce_slot, channel, piece, reduce_op)
                _in_slot(channel, nbytes, "allreduce", fill)
            except _Fallback as e:
                _fall_back(group, channel, str(e))
                process_group.allreduce_plain_(flat[start:], group, reduce_op)
                break
    return t


def allreduce_plain_async_(
    t: torch.Tensor, group: dist.ProcessGroup, reduce_op: str
) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_plain_`, whose copies run on the calling thread: done at once, but for a
    group shared memory does not serve, whose process group's call is left running."""
    channel = _channel(group) if group is not dist.GroupMember.NON_GROUP_MEMBER else None
    if channel is None:
        return process_group.allreduce_plain_async_(t, group, reduce_op)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(allreduce_plain_(t, group, reduce_op))
    return done


def _in_slot(
    channel: _Channel,
    nbytes: int,
    operation: str,
    fill: Callable[[int, int, list[torch.Tensor], int], None],
) -> None:
    """``fill(epoch, slot, views, nbytes)`` in the channel's next slot for ``operation``, the
    slot abandoned if it raises; :class:`_Fallback` where the channel cannot begin one."""
    epoch, slot, views = channel.begin(nbytes, operation)
    try:
        fill(epoch, slot, views, nbytes)
    except BaseException:
        channel.abandon(views, slot, epoch)
        raise


def _reduce_slot(
    channel: _Channel,
    piece: torch.Tensor,
    reduce_op: str,
    epoch: int,
    slot: int,
    views: list[torch.Tensor],
    nbytes: int,
) -> None:
    operation, world, rank = "allreduce", channel.world, channel.rank
    if piece.is_cuda:
        channel.register_cuda()
    slots = [channel.region(views, r, slot, nbytes).view(piece.dtype) for r in range(world)]
    if reduce_op == "avg":
        # Divided before the sum, as the process group's plain average is: the same mean
        # on every transport, finite wherever the mean is.
        cpu_threads.div_(piece, world)
    _stage_in(slots[rank], piece)
    channel.signal(views, _TAG, slot, _tag(operation, nbytes))
    channel.signal(views, _WRITTEN, slot, epoch)
    bounds = [piece.numel() * r // world for r in range(world + 1)]
    chunks = list(itertools.pairwise(bounds))
    lo, hi = chunks[rank]
    channel.wait_peers(_WRITTEN, slot, epoch, operation, views)
    channel.check_peers(views, slot, epoch, operation, nbytes)
    if hi > lo:
        mine = piece[lo:hi]
        if piece.is_cuda:
            parts = [s[lo:hi].to(piece.device, non_blocking=True) for s in slots]
        else:
            parts = [s[lo:hi] for s in slots]
        cpu_threads.add_(mine, parts)
        _stage_in(slots[rank][lo:hi], mine)
    channel.signal(views, _REDUCED, slot, epoch)
    channel.wait_peers(_REDUCED, slot, epoch, operation, views)
    channel.check_peers(views, slot, epoch, operation, nbytes)
    for peer in channel.peer_ranks:
        a, b = chunks[peer]
        if b > a:
            if piece.is_cuda:
                piece[a:b].copy_(slots[peer][a:b], non_blocking=True)
            else:
                cpu_threads.copy_(piece[a:b], slots[peer][a:b])
    _finish_reads(piece.device)
    channel.signal(views, _CONSUMED, slot, epoch)


def reduce_scatter_plain(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The uncompressed reduce-scatter (sum) of contiguous ``inp`` (``world`` equal chunks)
    into ``out`` (one chunk): each rank writes ``inp`` into its slot and sums its own chunk
    from every slot, in rank order."""
    channel = _channel(group)
    if channel is None or not inp.is_contiguous() or inp.numel() == 0:
        process_group.reduce_scatter_plain(out, inp, group)
        return
    nbytes = inp.numel() * inp.element_size()
    with channel.lock:
        try:
            fill = functools.partial(_reduce_scatter_slot, channel, out, inp)
            _in_slot(channel, nbytes, "reduce_scatter", fill)
        except _Fallback as e:
            _fall_back(group, channel, str(e))
            process_group.reduce_scatter_plain(out, inp, group)


def _reduce_scatter_slot(
    channel: _Channel,
    out: torch.Tensor,
    inp: torch.Tensor,
    epoch: int,
    slot: int,
    views: list[torch.Tensor],
    nbytes: int,
) -> None:
    if inp.is_cuda:
        channel.register_cuda()
    m = out.numel()
    slots = [channel.region(views, r, slot, nbytes).view(inp.dtype) for r in range(channel.world)]
    _stage_in(slots[channel.rank], inp.reshape(-1))
    channel.signal(views, _TAG, slot, _tag("reduce_scatter", nbytes))
    channel.signal(views, _WRITTEN, slot, epoch)
    channel.wait_peers(_WRITTEN, slot, epoch, "reduce_scatter", views)
    channel.check_peers(views, slot, epoch, "reduce_scatter", nbytes)
    lo = channel.rank * m
    parts = [s[lo : lo + m] for s in slots]
    if inp.is_cuda:
        parts = [part.to(inp.device, non_blocking=True) for part in parts]
    cpu_threads.add_(out.view(-1), parts)
    _finish_reads(inp.device)
    channel.signal(views, _CONSUMED, slot, epoch)
