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
class _Watch:
    """The replays of one group on one stream since ``done`` was last recorded on it."""

    key: tuple[int, int]  # (id(group), the stream's raw handle)
    stream: Any
    done: Any  # an event recorded on ``stream`` after a replay (anything with query())
    deadline: float
    group: weakref.ref
    name: str
    timeout_s: float
    more: bool = False  # replays launched after ``done`` was recorded


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event()


def _raw_stream(device_index: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(device_index)  # no Stream object made


def _cuda_stream(device_index: int) -> Any:
    import torch

    return torch.cuda.current_stream(device_index)


class ReplayWatch:
    """Replays in flight, by group and stream, oldest deadline first; :meth:`check` (a daemon
    thread's, every ``poll_s``) forgets the finished ones and aborts the group of one overdue.

    A replay costs its caller a lookup: while a (group, stream) has an event pending, later
    replays there only mark it, and :meth:`check`, finding that event done, records it again
    behind them (an event records everything enqueued on its stream before it).
    """

    def __init__(
        self,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        thread: bool = True,
        new_event: Callable[[], Any] = _cuda_event,
        raw_stream: Callable[[int], int] = _raw_stream,
        stream: Callable[[int], Any] = _cuda_stream,
    ) -> None:
        self.poll_s, self.clock, self.thread = poll_s, clock, thread
        self.new_event, self.raw_stream, self.stream = new_event, raw_stream, stream
        self._replays: deque[_Watch] = deque()
        self._open: dict[tuple[int, int], _Watch] = {}
        self._aborted: dict[int, str] = {}  # id(group) -> why
        self._lock = threading.Lock()
        self._started = False

    def replayed(self, group: dist.ProcessGroup, device_index: int, timeout_s: float) -> None:
        """Watch a replay just launched on ``group`` on the current stream of the device."""
        key = (id(group), self.raw_stream(device_index))
        with self._lock:
            watch = self._open.get(key)
            if watch is not None and watch.group() is group:  # (not a dead group's, same id)
                watch.more = True
                return
        stream = self.stream(device_index)
        done = self.new_event()
        done.record(stream)
        watch = _Watch(
            key=key,
            stream=stream,
            done=done,
            deadline=self.clock() + timeout_s,
            group=weakref.ref(group),
            name=group.group_name,
            timeout_s=timeout_s,
        )
        with self._lock:
            self._open[key] = watch
            self._replays.append(watch)
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
            while self._replays and (
                self._replays[0].group() is None or self._replays[0].done.query()
            ):
                watch = self._replays.popleft()
                if watch.more and watch.group() is not None:  # re-armed behind the later ones
                    watch.more = False
                    watch.done.record(watch.stream)
                    watch.deadline = self.clock() + watch.timeout_s
                    self._replays.append(watch)
                elif self._open.get(watch.key) is watch:
                    del self._open[watch.key]
            if not self._replays or self.clock() < self._replays[0].deadline:
                return
            late = self._replays.popleft()
            group = late.group()
            self._replays = deque(w for w in self._replays if w.group() is not group)
            self._open = {w.key: w for w in self._replays}
        if group is None:
            return
        why = (
            f"cgx2: a quantized allreduce replayed as a CUDA graph on group {late.name!r} did "
            f"not finish within the group's timeout ({late.timeout_s:.0f} s): a peer died or "
            "stalled. The group was aborted; make a new one (or restart the job)"
        )
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
