"""The group's worker thread: results and errors through the future, first in first out, one
thread a group, gone with its group."""

import gc
import threading
import time

import pytest
import torch

from cgx2.comm import groups, worker


class Group:
    """Stands for a process group: the worker needs only its identity and a weak reference."""


def test_returns_before_the_work_is_done_and_delivers_its_result():
    group, go = Group(), threading.Event()
    x = torch.zeros(3)

    def work() -> torch.Tensor:
        go.wait(10)
        return x.add_(1)

    future = worker.submit(group, work, [x])
    assert not future.done()
    go.set()
    assert future.wait() is x
    assert torch.equal(x, torch.ones(3))


def test_runs_first_in_first_out_on_one_thread_per_group():
    a, b = Group(), Group()
    order, threads = [], {}
    x = torch.zeros(1)

    def work(name: str, group: str, pause: float):
        def run() -> torch.Tensor:
            time.sleep(pause)  # a later submission must still wait for this one
            order.append(name)
            threads.setdefault(group, set()).add(threading.get_ident())
            return x

        return run

    futures = [worker.submit(a, work(f"a{i}", "a", 0.02 * (3 - i)), [x]) for i in range(3)]
    futures.append(worker.submit(b, work("b0", "b", 0), [x]))
    for f in futures:
        f.wait()
    assert [n for n in order if n.startswith("a")] == ["a0", "a1", "a2"]
    assert len(threads["a"]) == len(threads["b"]) == 1
    assert threads["a"] != threads["b"]
    assert threading.get_ident() not in threads["a"]


def test_an_error_reaches_the_waiter_and_the_worker_goes_on():
    group = Group()
    x = torch.zeros(1)

    def fail() -> torch.Tensor:
        raise ValueError("the bucket's plan is wrong")

    # As an error of the future itself (DDP's C++ reducer reads it so), quoting the original.
    with pytest.raises(RuntimeError, match="ValueError: the bucket's plan is wrong"):
        worker.submit(group, fail, [x]).wait()
    assert worker.submit(group, lambda: x + 1, [x]).wait().item() == 1


def test_a_future_returned_by_the_work_is_followed_while_the_worker_goes_on():
    """A call left running (a future): the worker takes the next one at once, and the future
    submit returned ends as that one does, with its value or its error."""
    group = Group()
    x = torch.zeros(1)
    running = [torch.futures.Future(), torch.futures.Future()]
    first = worker.submit(group, lambda: running[0], [x])
    second = worker.submit(group, lambda: running[1], [x])
    after = worker.submit(group, lambda: x + 2, [x])
    assert after.wait().item() == 2  # ran while the two before it were still running
    assert not first.done() and not second.done()
    running[1].set_exception(RuntimeError("peer 1 closed the connection"))
    with pytest.raises(RuntimeError, match="peer 1 closed the connection"):
        second.wait()
    assert not first.done()
    running[0].set_result(x.add_(1))
    assert first.wait() is x and x.item() == 1


def test_the_worker_goes_with_its_group():
    group = Group()
    x = torch.zeros(1)
    worker.submit(group, lambda: x, [x]).wait()
    state = groups.group_state(group)
    assert state.worker.value is not None
    thread = state.worker.value.executor._threads.copy().pop()
    del group, state
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_even_a_system_exit_on_the_worker_completes_the_future():
    """A future left unset would leave DDP waiting forever."""
    x = torch.zeros(1)

    def leave() -> torch.Tensor:
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match="SystemExit"):
        worker.submit(Group(), leave, [x]).wait()


def test_runs_torch_on_itself_alone_and_lends_the_callers_threads_to_the_codec():
    """The worker's torch ops start no OpenMP team of its own (whose idle threads would spin
    beside the backward pass); the codec still gets the caller's count, and threads started
    afterwards keep the process's."""
    from cgx2 import cpu_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}

        def work() -> torch.Tensor:
            seen["torch"], seen["codec"] = torch.get_num_threads(), cpu_threads.count()
            return x

        x = torch.zeros(1)
        worker.submit(Group(), work, [x]).wait()
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == {"torch": 1, "codec": 2}
        assert torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)


def test_warns_once_where_openmp_threads_spin(monkeypatch, caplog):
    from cgx2 import cpu_threads

    monkeypatch.setattr(cpu_threads, "_warned", threading.Event())
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.zeros(1)
    try:
        with caplog.at_level("WARNING", logger="cgx2"):
            for _ in range(2):
                worker.submit(Group(), lambda: x, [x]).wait()
        assert [r.getMessage().count("OMP_WAIT_POLICY=PASSIVE") for r in caplog.records] == [1]
        for passive, threads in ((True, 2), (False, 1)):  # no team spins: nothing to say
            monkeypatch.setattr(cpu_threads, "_warned", threading.Event())
            if passive:
                monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
            else:
                monkeypatch.delenv("OMP_WAIT_POLICY")
            torch.set_num_threads(threads)
            caplog.clear()
            with caplog.at_level("WARNING", logger="cgx2"):
                worker.submit(Group(), lambda: x, [x]).wait()
            assert not caplog.records, (passive, threads)
    finally:
        torch.set_num_threads(before)
