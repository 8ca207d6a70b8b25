"""CUDA-graph replay of the quantized allreduce: a tensor allreduced before is done by one graph
launch of its kernels and collectives, with fresh random keys, instead of a dozen from Python.

Where the GPU outruns the host (NVLink), the allreduce waits on its host's launches; a replay
costs two: a fill of the call's seed, and the graph's. ``CGX2_CUDA_GRAPHS`` (auto: calls of at
most :data:`.policy.GRAPHS_AUTO_MAX_BYTES`) and :func:`.policy.route` decide which calls;
needs Triton. Each of at most :data:`MAX_GRAPHS` graphs keeps its buffers: about half an fp32
tensor's bytes at 4 bits (as many bytes as a bf16 one), plus an fp32 copy with error feedback.
:data:`WATCH` keeps an eye on replays, which the process group's watchdog cannot see.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import config
from ..codecs import triton_kernels
from ..comm import coding_stream, group_info
from .replay_watch import ReplayWatch

__all__ = ["MAX_GRAPHS", "STALE_CALLS", "WATCH", "clear", "run", "stats", "usable"]

logger = logging.getLogger("cgx2")


MAX_GRAPHS = 32
"""Captured graphs kept per process. When they are all in use, more signatures run eagerly:
evicting by recency alone would make a cycle of more signatures than this (DDP's buckets of a
large model) capture at every call."""

STALE_CALLS = 1000
"""A graph not replayed in this many calls (of the graph path) may be dropped, with a device
sync (its memory must not be reused while a replay may still run), for a new one."""

MAX_PENDING = 64
"""Signatures seen once (each holding only its seed's 8 bytes) kept per process, oldest
dropped first."""


@dataclass(slots=True)
class _Entry:
    seed: torch.Tensor  # one int64 on the device: the call's seed, which the graph reads
    graph: torch.cuda.CUDAGraph
    used: int  # the call (of _CACHE.calls) that last replayed it


class _Cache:
    """What :func:`run` keeps: per process, not per group, since :data:`MAX_GRAPHS` bounds the
    graphs of all groups together (a graph's key starts with its group's id)."""

    __slots__ = ("calls", "counts", "failed", "graphs", "guarded", "pending", "streams", "watched")

    def __init__(self) -> None:
        self.pending: OrderedDict[Hashable, torch.Tensor] = OrderedDict()  # signature: its seed
        self.graphs: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.watched: set[int] = set()  # ids of the groups whose graphs go with them
        self.failed = False  # a capture failed: eager from then on
        self.calls = 0  # of run(), for the graphs' staleness
        self.counts = {"eager": 0, "captures": 0, "replays": 0}  # what run() did
        self.streams: dict[int, torch.cuda.Stream] = {}  # the capturing side stream, by GPU
        self.guarded = False  # destroy_process_group drops the graphs first (_guard_teardown)


# The process's graphs: the GPU's memory they hold is the process's (MAX_GRAPHS, STALE_CALLS).
_CACHE = _Cache()


def stats() -> dict[str, int]:
    """What :func:`run` has done in this process: calls run eagerly (first sightings, no room,
    failed captures), graphs captured and replays (the capturing call's own included), and
    graphs held now."""
    return {**_CACHE.counts, "graphs": len(_CACHE.graphs)}


def usable(t: torch.Tensor) -> bool:
    """Whether an allreduce of ``t`` may replay a graph: not turned off, a CUDA tensor, Triton
    (whose kernels read keys from memory), not under ``torch.compile`` or inside a capture of
    the caller's own. The caller checks that its group is NCCL's, and the size."""
    if not t.is_cuda or config.tuning().cuda_graphs is False or _CACHE.failed:
        return False
    if torch.compiler.is_compiling():
        return False
    if triton_kernels("keys_triton") is None:
        return False
    return not torch.cuda.is_current_stream_capturing()


WATCH = ReplayWatch()
"""The replays in flight: NCCL's kernels in a graph are out of the process group's watchdog's
sight, so a peer that dies mid-replay would leave its stream waiting forever."""


def _watch(group: dist.ProcessGroup, device: torch.device) -> None:
    """Hand the replay just launched on ``group`` to :data:`WATCH`."""
    if device.type == "cuda":  # (the tests' stand-ins are on the CPU)
        index = device.index if device.index is not None else torch.cuda.current_device()
        WATCH.replayed(group, index, group_info(group).timeout_s)


def _forget_with(group: dist.ProcessGroup) -> None:
    """Drop ``group``'s graphs when it is garbage collected, before its id can name another."""
    if id(group) not in _CACHE.watched:
        _CACHE.watched.add(id(group))
        weakref.finalize(group, _forget_group, id(group))


def _forget_group(group_id: int) -> None:
    """Drop a destroyed group's graphs before its id can name another group."""
    _CACHE.watched.discard(group_id)
    for key in [k for k in _CACHE.pending if k[0] == group_id]:
        del _CACHE.pending[key]
    stale = [k for k in _CACHE.graphs if k[0] == group_id]
    if stale:
        torch.cuda.synchronize()
        for key in stale:
            del _CACHE.graphs[key]


def clear() -> None:
    """Drop every cached graph (after a device sync) and signature seen."""
    _CACHE.pending.clear()
    if _CACHE.graphs:
        torch.cuda.synchronize()
        _CACHE.graphs.clear()


def run(
    group: dist.ProcessGroup,
    signature: tuple,
    seed: int,
    device: torch.device,
    pipeline: Callable[[torch.Tensor], None],
) -> None:
    """Run ``pipeline(device_seed)``, which must take its random keys from the call seed in
    ``device_seed`` (one int64 on ``device``, holding ``seed`` when the launches run) and be
    the same launches over ``group`` for the same ``signature`` (the tensors' addresses among
    the rest).

    The first call of a signature runs it eagerly: that compiles the kernels' variants that
    read keys from memory and connects NCCL's channels for these sizes, neither of which may
    happen in a capture. The second captures it into a graph, if there is room
    (:data:`MAX_GRAPHS`, :data:`STALE_CALLS`; else it runs eagerly again, and later calls
    retry); every call after the capture replays the graph.
    A capture sends nothing, so ranks need not agree on it: one rank capturing a call that
    another ran eagerly (their tensors at addresses seen before on one only) worked over
    sockets and NVLink.
    """
    _CACHE.calls += 1
    WATCH.raise_if_aborted(group)
    signature = (id(group), *signature)
    entry = _CACHE.graphs.get(signature)
    if entry is not None:
        _CACHE.graphs.move_to_end(signature)
        entry.used = _CACHE.calls
        _write(entry.seed, seed)
        entry.graph.replay()
        _watch(group, device)
        _CACHE.counts["replays"] += 1
        return
    device_seed = _CACHE.pending.get(signature)
    if device_seed is None or not _room_for_a_graph(device):
        if device_seed is None:
            device_seed = _CACHE.pending[signature] = torch.empty(
                1, dtype=torch.int64, device=device
            )
            if len(_CACHE.pending) > MAX_PENDING:
                _CACHE.pending.popitem(last=False)
        else:
            _CACHE.pending.move_to_end(signature)
            if device_seed.is_cuda:  # (the tests' stand-ins are on the CPU)
                # Dropping a seed needs no sync once the allocator knows each stream using it.
                device_seed.record_stream(torch.cuda.current_stream(device))
        _write(device_seed, seed)
        pipeline(device_seed)
        _CACHE.counts["eager"] += 1
        return
    del _CACHE.pending[signature]
    try:
        graph = _capture(pipeline, device_seed)
    except Exception:
        _give_up()
        _write(device_seed, seed)
        pipeline(device_seed)
        _CACHE.counts["eager"] += 1
        return
    _guard_teardown()
    _forget_with(group)
    _CACHE.graphs[signature] = _Entry(device_seed, graph, _CACHE.calls)
    _write(device_seed, seed)
    graph.replay()
    _watch(group, device)
    _CACHE.counts["captures"] += 1
    _CACHE.counts["replays"] += 1


def _room_for_a_graph(device: torch.device) -> bool:
    """Whether a graph may be added: fewer than :data:`MAX_GRAPHS`, or the least recently used
    one stale (dropped here, after a device sync)."""
    if len(_CACHE.graphs) < MAX_GRAPHS:
        return True
    oldest = next(iter(_CACHE.graphs.values()))
    if _CACHE.calls - oldest.used <= STALE_CALLS:
        return False
    torch.cuda.synchronize(device)
    _CACHE.graphs.popitem(last=False)
    return True


def _guard_teardown() -> None:
    """Make ``dist.destroy_process_group`` (and the interpreter's exit) drop the graphs first:
    a graph holding a communicator's collectives kept NCCL from destroying it (both ranks hung
    in ``destroy_process_group`` at the end of a DDP run). Installed at the first
    capture, so that nothing of torch's is touched unless graphs are."""
    if _CACHE.guarded:
        return
    _CACHE.guarded = True
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            clear()  # every group goes with the default one
        else:
            _forget_group(id(group))
        original(group)

    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(clear)  # runs before torch's own exit handlers, registered earlier


def _write(device_seed: torch.Tensor, seed: int) -> None:
    """Set the unsigned 64-bit ``seed`` on the device, in stream order: a fill kernel, whose
    argument carries it (a copy from pinned memory cost twice the host time)."""
    seed &= (1 << 64) - 1
    device_seed.fill_(seed - (1 << 64) if seed >= 1 << 63 else seed)


def _capture(
    pipeline: Callable[[torch.Tensor], None], device_seed: torch.Tensor
) -> torch.cuda.CUDAGraph:
    """``pipeline(device_seed)`` captured (not run) into a graph with its own memory pool, on a
    side stream as ``torch.cuda.graph`` does; other threads' CUDA calls may go on meanwhile."""
    device = device_seed.device
    stream = _CACHE.streams.get(device.index)
    if stream is None:
        stream = _CACHE.streams[device.index] = coding_stream(device)
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            pipeline(device_seed)
        except BaseException:
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture is invalid already; the pipeline's error is the one to see
            raise
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def _give_up() -> None:
    _CACHE.failed = True
    logger.warning(
        "cgx2: capturing the allreduce into a CUDA graph failed; launching eagerly from now on",
        exc_info=True,
    )
