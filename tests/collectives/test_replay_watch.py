"""cgx2.collectives.replay_watch: replays that end are forgotten; one overdue aborts its group,
whose next replay raises, and leaves other groups be. Events and groups are stand-ins (a CUDA
graph needs a GPU)."""

import gc
import time

import pytest
from stand_ins import CudaEvent

from cgx2.collectives.replay_watch import ReplayWatch


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


def test_finished_replays_are_forgotten_and_abort_nothing():
    clock, group = _Clock(), _Group("g")
    watch = ReplayWatch(clock=clock, thread=False)
    events = [CudaEvent() for _ in range(3)]
    for e in events:
        watch.replayed(group, e, timeout_s=10)
    for e in events:
        e.done = True
    clock.now = 100
    watch.check()
    assert group.aborted == 0 and not watch._replays
    watch.raise_if_aborted(group)


def test_an_overdue_replay_aborts_its_group_whose_next_replay_raises():
    clock, stuck, other = _Clock(), _Group("stuck"), _Group("other")
    watch = ReplayWatch(clock=clock, thread=False)
    late, fine = CudaEvent(), CudaEvent()
    watch.replayed(stuck, late, timeout_s=30)
    watch.replayed(other, fine, timeout_s=30)
    watch.replayed(stuck, CudaEvent(), timeout_s=30)
    clock.now = 29
    watch.check()
    assert stuck.aborted == 0  # not yet overdue
    clock.now = 31
    watch.check()
    assert stuck.aborted == 1 and other.aborted == 0
    with pytest.raises(RuntimeError, match=r"group 'stuck' did not finish within .*\(30 s\)"):
        watch.raise_if_aborted(stuck)
    watch.raise_if_aborted(other)
    assert [r.name for r in watch._replays] == ["other"]  # the stuck group's others dropped
    fine.done = True
    watch.check()
    assert other.aborted == 0 and not watch._replays


def test_a_group_gone_is_forgotten_not_aborted():
    clock, group = _Clock(), _Group("gone")
    watch = ReplayWatch(clock=clock, thread=False)
    watch.replayed(group, CudaEvent(), timeout_s=1)
    del group
    gc.collect()
    clock.now = 10
    watch.check()
    assert not watch._replays and not watch._aborted


def test_its_thread_aborts_an_overdue_replay_unasked():
    group = _Group("g")
    watch = ReplayWatch(poll_s=0.01)
    watch.replayed(group, CudaEvent(), timeout_s=0.05)
    for _ in range(500):
        if group.aborted:
            break
        time.sleep(0.01)
    assert group.aborted == 1
    with pytest.raises(RuntimeError, match="a peer died or stalled"):
        watch.raise_if_aborted(group)
