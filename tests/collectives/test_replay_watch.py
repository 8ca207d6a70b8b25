"""cgx2.collectives.replay_watch: replays that end are forgotten; one overdue aborts its group,
whose next replay raises, and leaves other groups be; a replay behind one that ended is still
watched. Events, streams and groups are stand-ins (a CUDA graph needs a GPU)."""

import gc
import time

import pytest
from stand_ins import CudaEvent

from cgx2.collectives.replay_watch import ReplayWatch

STREAM = 0  # the device's index: its current stream's handle is 100 + it


class _Group:
    def __init__(self, name: str) -> None:
        self.group_name, self.aborted = name, 0

    def abort(self) -> None:
        self.aborted += 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(**kwargs) -> tuple[ReplayWatch, list[CudaEvent]]:
    """A watch whose events the test holds, in the order it made them."""
    events: list[CudaEvent] = []

    def new_event() -> CudaEvent:
        events.append(CudaEvent())
        return events[-1]

    return ReplayWatch(
        new_event=new_event,
        raw_stream=lambda index: 100 + index,
        stream=lambda index: f"stream {index}",
        **kwargs,
    ), events


def test_replays_behind_a_pending_one_record_nothing_and_are_forgotten_once_done():
    clock, group = _Clock(), _Group("g")
    watch, events = _watch(clock=clock, thread=False)
    for _ in range(3):
        watch.replayed(group, STREAM, timeout_s=10)
    assert len(events) == 1 and events[0].records == 1  # one event for the three
    events[0].done = True
    watch.check()  # done, but replays came after it: recorded again behind them
    assert events[0].records == 2 and len(watch._replays) == 1
    events[0].done = True
    clock.now = 100
    watch.check()
    assert group.aborted == 0 and not watch._replays and not watch._open
    watch.raise_if_aborted(group)
    watch.replayed(group, STREAM, timeout_s=10)  # a new replay: a new watch
    assert len(events) == 2 and len(watch._replays) == 1


def test_a_stuck_replay_behind_one_that_ended_is_caught_a_timeout_after_it_was_seen():
    clock, group = _Clock(), _Group("g")
    watch, events = _watch(clock=clock, thread=False)
    watch.replayed(group, STREAM, timeout_s=30)
    clock.now = 5
    watch.replayed(group, STREAM, timeout_s=30)  # this one will never end
    clock.now = 6
    events[0].done = True
    watch.check()
    clock.now = 35  # past the first replay's deadline, not the re-recorded event's (36)
    watch.check()
    assert group.aborted == 0
    clock.now = 37
    watch.check()
    assert group.aborted == 1
    with pytest.raises(RuntimeError, match=r"group 'g' did not finish within .*\(30 s\)"):
        watch.raise_if_aborted(group)


def test_an_overdue_replay_aborts_its_group_whose_next_replay_raises():
    clock, stuck, other = _Clock(), _Group("stuck"), _Group("other")
    watch, events = _watch(clock=clock, thread=False)
    watch.replayed(stuck, STREAM, timeout_s=30)
    watch.replayed(other, STREAM, timeout_s=30)
    watch.replayed(stuck, 1, timeout_s=30)  # another stream: watched apart
    assert len(events) == 3
    clock.now = 29
    watch.check()
    assert stuck.aborted == 0  # not yet overdue
    clock.now = 31
    watch.check()
    assert stuck.aborted == 1 and other.aborted == 0
    with pytest.raises(RuntimeError, match=r"group 'stuck' did not finish within .*\(30 s\)"):
        watch.raise_if_aborted(stuck)
    watch.raise_if_aborted(other)
    assert [w.name for w in watch._replays] == ["other"]  # the stuck group's others dropped
    assert list(watch._open) == [(id(other), 100)]
    events[1].done = True
    watch.check()
    assert other.aborted == 0 and not watch._replays and not watch._open


def test_a_group_gone_is_forgotten_not_aborted():
    clock, group = _Clock(), _Group("gone")
    watch, _ = _watch(clock=clock, thread=False)
    watch.replayed(group, STREAM, timeout_s=1)
    watch.replayed(group, STREAM, timeout_s=1)
    del group
    gc.collect()
    clock.now = 10
    watch.check()
    assert not watch._replays and not watch._open and not watch._aborted


def test_its_thread_aborts_an_overdue_replay_unasked():
    group = _Group("g")
    watch, _ = _watch(poll_s=0.01)
    watch.replayed(group, STREAM, timeout_s=0.05)
    for _ in range(500):
        if group.aborted:
            break
        time.sleep(0.01)
    assert group.aborted == 1
    with pytest.raises(RuntimeError, match="a peer died or stalled"):
        watch.raise_if_aborted(group)
