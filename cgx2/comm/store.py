"""Waits on the c10d store that never block its client: each group's store is a prefix of the
one TCPStore client a process has, whose calls run one at a time, waits included.

A blocking ``get`` or ``wait`` holds that client until its keys arrive: a thread waiting so on
one group's peers holds up another thread's ``set`` for another group, which those peers may be
waiting for in turn (two groups used from two threads, in different orders on different
ranks). These helpers ask the store only whether the keys are there, and sleep between asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

__all__ = ["StoreTimeout", "get", "pop", "wait"]

FIRST_SLEEP_S = 1e-4
"""The first pause between two asks; each next one doubles, up to :data:`LONGEST_SLEEP_S`."""
LONGEST_SLEEP_S = 0.02
"""The longest pause between two asks: what a wait may add to the arrival of its keys."""


class StoreTimeout(RuntimeError):
    """The keys did not all arrive within the timeout (a ``RuntimeError``, as c10d's own)."""


def wait(store: dist.Store, keys: Sequence[str], timeout_s: float) -> None:
    """Return once every key of ``keys`` is set in ``store``; :class:`StoreTimeout` naming the
    missing ones after ``timeout_s``. Other threads' calls on the store run meanwhile."""
    _wait_until(
        lambda: store.check(list(keys)),
        timeout_s,
        lambda: [k for k in keys if not store.check([k])],
    )


def get(store: dist.Store, key: str, timeout_s: float) -> bytes:
    """``key``'s value once it is set (:func:`wait`)."""
    wait(store, [key], timeout_s)
    return store.get(key)


def pop(store: dist.Store, key: str, timeout_s: float) -> bytes:
    """The first entry of queue ``key`` once it has one (``queue_pop`` that never blocks)."""
    _wait_until(lambda: store.queue_len(key) > 0, timeout_s, lambda: [key])
    return store.queue_pop(key, False)


def _wait_until(
    ready: Callable[[], bool], timeout_s: float, missing: Callable[[], list[str]]
) -> None:
    deadline = time.monotonic() + timeout_s
    pause = FIRST_SLEEP_S
    while not ready():
        if time.monotonic() > deadline:
            raise StoreTimeout(
                f"wait timeout after {timeout_s:g} s, keys not set: {', '.join(missing())}"
            )
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_SLEEP_S)
