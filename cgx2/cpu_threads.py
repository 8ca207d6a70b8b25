"""How many threads cgx2's CPU work takes on the thread that runs it: torch's intra-op count,
or, on a worker thread beside the training loop, the count it was lent.

A thread that runs torch's CPU ops gets an OpenMP team of its own, whose threads by default
spin for milliseconds after every parallel region, on the cores the backward pass computes on
(BENCHMARKS.md, "Training across the hosts"). A worker thread therefore runs torch's ops on
itself alone (:func:`lend`) and keeps the count for the codec's own threads, which sleep when
idle.
"""

from __future__ import annotations

import logging
import threading

import torch

from . import config

__all__ = ["codec_threads", "lend", "warn_if_spinning"]

logger = logging.getLogger("cgx2")

_local = threading.local()
_warned = threading.Event()


def codec_threads() -> int:
    """The threads the codec may code with on this thread: what :func:`lend` gave it, else
    torch's intra-op count."""
    return getattr(_local, "codec_threads", None) or torch.get_num_threads()


def lend(threads: int) -> None:
    """Make the calling thread (a worker's, at its start) run torch's CPU ops on itself alone,
    with ``threads`` for the codec. Threads started later keep the process's intra-op count:
    torch gives a new thread the last count set anywhere, so it is set back on a thread of
    its own."""
    _local.codec_threads = threads
    torch.get_num_threads()  # torch's first use on a thread sets its count: before, not after
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(threads,), daemon=True)
    restore.start()
    restore.join()


def warn_if_spinning() -> None:
    """Once a process: say that OpenMP's default wait policy (its threads spin between parallel
    regions) slows CPU training that communicates beside the backward pass."""
    if _warned.is_set() or config.launch().omp_wait_policy == "passive":
        return
    _warned.set()
    logger.warning(
        "cgx2: CPU gradients are reduced beside the backward pass, whose OpenMP threads spin "
        "between their parallel regions on the cores the reduction needs; set "
        "OMP_WAIT_POLICY=PASSIVE in the environment of every rank (before Python starts) for "
        'faster CPU training, plain or compressed (BENCHMARKS.md, "Training across the hosts")'
    )
