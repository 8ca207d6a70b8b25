"""One first-in-first-out worker thread per process group, for entry points that return a future
(DDP's hooks): where a transport's collectives block the calling thread, they block this one.

Gloo's collectives hold the thread that waits on them until the bytes have crossed the wire.
Called from a DDP hook, that thread is autograd's: the backward pass stops at every bucket.
Run on the worker, the bucket's collectives travel while the backward pass computes the next
bucket's gradients. One thread per group keeps the collectives in the order they were
submitted, which DDP makes the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .. import cpu_threads
from .groups import group_state
from .streams import coding_stream

__all__ = ["submit"]


class _Worker:
    """A group's thread, and the side stream of each device it codes on."""

    def __init__(self) -> None:
        # Made on the caller's thread: its intra-op count is the one the codec gets.
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="cgx2-comm",
            initializer=cpu_threads.lend,
            initargs=(torch.get_num_threads(),),
        )
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def close(self) -> None:
        self.executor.shutdown(wait=False)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = coding_stream(device)
        return self.streams[device]


def _worker(group: dist.ProcessGroup) -> _Worker:
    """``group``'s worker, started at its first call; it goes with the group (an idle thread
    exits)."""
    worker = group_state(group).worker
    return worker.value if worker.made else worker.get(_Worker)


def submit(
    group: dist.ProcessGroup,
    fn: Callable[[], torch.Tensor | torch.futures.Future[torch.Tensor]],
    tensors: Sequence[torch.Tensor],
) -> torch.futures.Future[torch.Tensor]:
    """Run ``fn()`` on ``group``'s worker after everything submitted before it, and return a
    future of its result; if ``fn`` raises, waiting on the future raises a ``RuntimeError``
    that quotes the exception and where it came from. On CPU tensors ``fn`` may return a
    future of a collective it left running (:func:`.process_group.allreduce_plain_async_`):
    the worker goes on to the next call, its collectives started in submission order all the
    same, and the future returned here follows that one.

    ``tensors`` are those ``fn`` reads and writes; they must outlive its run (DDP's bucket
    buffers do). On CUDA, ``fn`` runs on the worker's side stream of their device, which first
    waits for the caller's current stream: the kernels enqueued so far, which produced them.
    The future's CUDA event, recorded on that stream when ``fn`` returns, is what a waiter's
    stream then waits for.
    """
    device = tensors[0].device
    worker = _worker(group)
    if device.type != "cuda":
        cpu_threads.warn_if_spinning()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # the waiter raises it, on its own thread
                future.set_exception(_as_exception(e))
                return
            if isinstance(result, torch._C.Future):  # torch.futures.Future, or a Work's
                result.add_done_callback(lambda running: _follow(future, running))
            else:
                future.set_result(result)

        worker.executor.submit(run)
        return future.then(_result)
    side = worker.stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    for t in tensors:
        t.record_stream(side)
    future = torch.futures.Future(devices=[device])

    def run_on_stream() -> None:
        # The current device and stream are the thread's own: set both here.
        with torch.cuda.device(device), torch.cuda.stream(side):
            try:
                result = fn()
            except BaseException as e:
                future.set_exception(_as_exception(e))
                return
            future.set_result(result)

    worker.executor.submit(run_on_stream)
    return future.then(_result)


def _follow(
    future: torch.futures.Future[torch.Tensor], running: torch.futures.Future[torch.Tensor]
) -> None:
    """Set ``future`` as ``running`` (done) ended: its value, or its exception."""
    try:
        result = running.value()
    except BaseException as e:
        future.set_exception(_as_exception(e))
        return
    future.set_result(result)


def _result(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """``future``'s value, or its exception raised: a callback's exception marks the future
    ``then`` returns as failed in C++, which is how DDP's reducer reads an error (a Python
    future holding an exception would reach it as a value it cannot cast to a tensor)."""
    return future.value()


def _as_exception(e: BaseException) -> Exception:
    """``e``, or an ``Exception`` naming it (a future holds only those): never a future left
    unset, on which DDP would wait forever."""
    return e if isinstance(e, Exception) else RuntimeError(f"cgx2's worker thread: {e!r}")
