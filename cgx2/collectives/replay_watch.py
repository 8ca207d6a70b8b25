"""A watchdog for CUDA-graph replays (:mod:`.graphs`), which the process group's own cannot see:
a replayed allreduce not finished within its group's timeout (a peer died or stalled) aborts
the group, so that nothing waits on its stream forever, and the group's next replay raises.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["ReplayWatch"]

logger = logging.getLogger("cgx2")


@dataclass(slots=True)
class _Replay:
    done: Any  # a CUDA event recorded after the replay (anything with query())
    deadline: float
    group: weakref.ref
    name: str
    timeout_s: float


class ReplayWatch:
    """Replays in flight, oldest first; :meth:`check` (a daemon thread's, every ``poll_s``)
    forgets the finished ones and aborts the group of one overdue."""

    def __init__(self, poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 thread: bool = True) -> None:  # fmt: skip
        self.poll_s, self.clock, self.thread = poll_s, clock, thread
        self._replays: deque[_Replay] = deque()
        self._aborted: dict[int, str] = {}  # id(group) -> why
        self._lock = threading.Lock()
        self._started = False

    def replayed(self, group: dist.ProcessGroup, done: Any, timeout_s: float) -> None:
        """Watch a replay on ``group`` whose end ``done`` (an event recorded after it) marks."""
        with self._lock:
            self._replays.append(_Replay(done, self.clock() + timeout_s, weakref.ref(group),
                                         group.group_name, timeout_s))  # fmt: skip
            if self.thread and not self._started:
                self._started = True
                threading.Thread(target=self._loop, name="cgx2-replay-watch", daemon=True).start()

    def raise_if_aborted(self, group: dist.ProcessGroup) -> None:
        """Raise where this watch aborted ``group``."""
        why = self._aborted.get(id(group))
        if why is not None:
            raise RuntimeError(why)

    def check(self) -> None:
        """Forget finished replays; abort the group of the oldest overdue one."""
        with self._lock:
            while self._replays and (self._replays[0].group() is None
                                     or self._replays[0].done.query()):  # fmt: skip
                self._replays.popleft()
            if not self._replays or self.clock() < self._replays[0].deadline:
                return
            late = self._replays.popleft()
            group = late.group()
            self._replays = deque(r for r in self._replays if r.group() is not group)
        if group is None:
            return
        why = (f"cgx2: a quantized allreduce replayed as a CUDA graph on group {late.name!r} did "
               f"not finish within the group's timeout ({late.timeout_s:.0f} s): a peer died or "
               "stalled. The group was aborted; make a new one (or restart the job)")  # fmt: skip
        self._aborted[id(group)] = why
        weakref.finalize(group, self._aborted.pop, id(group), None)
        logger.error("%s", why)
        try:
            group.abort()  # its kernels exit: the streams waiting on them go on
        except (AttributeError, RuntimeError) as e:
            logger.error("cgx2: aborting group %r failed: %s", late.name, e)

    def _loop(self) -> None:
        while True:
            time.sleep(self.poll_s)
            try:
                self.check()
            except Exception:  # a watchdog must outlive a bad check
                logger.exception("cgx2: the replay watch failed a check")
