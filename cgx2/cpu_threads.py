"""How cgx2's CPU work is spread over threads: its own pool, whose idle threads sleep, sized by
torch's intra-op count (or, on a worker thread beside the training loop, the count it was lent).

A thread that runs torch's CPU ops gets an OpenMP team of its own, whose threads by default
spin for milliseconds after every parallel region, on the cores the backward pass computes on
(BENCHMARKS.md, "Training across the hosts"). So cgx2's threads (a group's worker, this pool)
run torch's ops on themselves alone, and a worker's large copies and sums are split over the
pool; other threads keep torch's own.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from . import config

__all__ = ["add_", "beside_compute", "copy_", "count", "div_", "lend", "split", "warn_if_spinning"]

logger = logging.getLogger("cgx2")

_local = threading.local()
_warned = threading.Event()

MIN_SPLIT_BYTES = 1 << 20
"""Copies and sums of fewer bytes a thread run on the calling thread alone: below, a thread's
start costs more than it saves."""


def count() -> int:
    """The threads cgx2 may work with on this thread: what :func:`lend` gave it, else torch's
    intra-op count."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


def _torch_on_this_thread_alone(process_threads: int) -> None:
    torch.get_num_threads()  # torch's first use on a thread sets its count: before, not after
    torch.set_num_threads(1)
    # torch gives a thread started later the last count set anywhere: set the process's back,
    # on a thread of its own.
    restore = threading.Thread(target=torch.set_num_threads, args=(process_threads,))
    restore.start()
    restore.join()


def beside_compute() -> bool:
    """Whether the calling thread is a worker beside the training loop (:func:`lend`): the
    training step's computation competes with its CPU work for the cores."""
    return getattr(_local, "threads", None) is not None


def lend(threads: int) -> None:
    """Make the calling thread (a worker's, at its start) run torch's CPU ops on itself alone,
    and split cgx2's work over ``threads``."""
    _local.threads = threads
    _torch_on_this_thread_alone(threads)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    # count(), not torch's count of this thread: a worker's is 1, the process's is lent to it.
    pool = ThreadPoolExecutor(
        workers,
        thread_name_prefix="cgx2-cpu",
        initializer=_torch_on_this_thread_alone,
        initargs=(count(),),
    )
    # Every thread started and through its initializer before the pool is used: one still in
    # it would set torch's count to 1 for whichever thread the process starts meanwhile.
    started = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(_meet, started)
    _meet(started)
    return pool


def _meet(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=_START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        logger.warning("cgx2: a CPU pool's threads did not all start within %ss", _START_TIMEOUT_S)


_START_TIMEOUT_S = 60


# A forked child has none of its parent's threads: it starts pools of its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def split(fn: Callable[[int, int], None], n: int, min_per_thread: int) -> None:
    """``fn(begin, end)`` over ranges of ``[0, n)``: :func:`count` parts at most, of
    ``min_per_thread`` at least, the first on the calling thread and the others on cgx2's pool
    (``fn`` should release the GIL: torch's ops and the extension's loops do)."""
    parts = max(1, min(count(), n // max(1, min_per_thread)))
    if parts == 1:
        fn(0, n)
        return
    bounds = [n * i // parts for i in range(parts + 1)]
    ranges = list(itertools.pairwise(bounds))
    futures = [_pool(parts - 1).submit(fn, a, b) for a, b in ranges[1:]]
    try:
        fn(*ranges[0])
    finally:
        for future in futures:
            future.result()


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors as flat views, to split over the pool, where the calling thread is a worker
    beside the training loop and all are contiguous CPU tensors of one size, else None. Any
    other thread has torch's own threads, which start sooner than the pool's."""
    if not beside_compute():
        return None
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    flat = [t.view(-1) for t in tensors]
    return flat if len({t.numel() for t in flat}) == 1 else None


def _per_thread(t: torch.Tensor) -> int:
    return max(1, MIN_SPLIT_BYTES // t.element_size())


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, split over cgx2's threads on a worker where both are contiguous CPU
    tensors of one size (the same bytes either way)."""
    flat = _flat(dst, src)
    if flat is None:
        return dst.copy_(src)
    d, s = flat
    split(lambda a, b: d[a:b].copy_(s[a:b]), d.numel(), _per_thread(d))
    return dst


def add_(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out = parts[0] + parts[1] + ...`` (two parts at least), added in that order, split
    over cgx2's threads where all are contiguous CPU tensors of one size: each value is summed
    alike either way, so the bits are torch's. Split on a worker only, as :func:`copy_`."""

    def add(o: torch.Tensor, ps: Sequence[torch.Tensor]) -> None:
        torch.add(ps[0], ps[1], out=o)
        for p in ps[2:]:
            o.add_(p)

    flat = _flat(out, *parts)
    if flat is None:
        add(out, parts)
        return out
    o, *ps = flat
    split(lambda a, b: add(o[a:b], [p[a:b] for p in ps]), o.numel(), _per_thread(o))
    return out


def div_(t: torch.Tensor, divisor: int) -> torch.Tensor:
    """``t.div_(divisor)``, split over cgx2's threads on a worker where ``t`` is a contiguous CPU
    tensor."""
    flat = _flat(t)
    if flat is None:
        return t.div_(divisor)
    (f,) = flat
    split(lambda a, b: f[a:b].div_(divisor), f.numel(), _per_thread(f))
    return t


def warn_if_spinning() -> None:
    """Once a process: say that OpenMP's default wait policy (its threads spin between parallel
    regions) slows CPU training that communicates beside the backward pass; not where torch
    runs one thread (no team to spin) or the policy is passive."""
    if _warned.is_set() or config.launch().omp_wait_policy == "passive":
        return
    if torch.get_num_threads() == 1:
        return
    _warned.set()
    logger.warning(
        "cgx2: CPU gradients are reduced beside the backward pass, whose OpenMP threads spin "
        "between their parallel regions on the cores the reduction needs; set "
        "OMP_WAIT_POLICY=PASSIVE in the environment of every rank (before Python starts) for "
        'faster CPU training, plain or compressed (BENCHMARKS.md, "Training across the hosts")'
    )
