"""cgx2's CPU threads: split work covers every range once; split copies, sums and divisions
give torch's bits; the pool's threads run torch's ops on themselves alone."""

import threading

import pytest
import torch

from cgx2 import cpu_threads


@pytest.fixture
def four_threads(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    monkeypatch.setattr(cpu_threads, "MIN_SPLIT_BYTES", 4096)  # split small tensors too
    yield
    torch.set_num_threads(before)


def test_split_covers_every_range_once_on_several_threads(four_threads):
    seen, threads = [], set()

    def fn(a: int, b: int) -> None:
        seen.append((a, b))
        threads.add(threading.get_ident())

    cpu_threads.split(fn, 1000, 100)
    assert sorted(seen) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert threading.get_ident() in threads and len(threads) > 1
    seen.clear()
    cpu_threads.split(fn, 150, 100)  # too few for two parts: the caller alone
    assert seen == [(0, 150)]


def _on_a_worker(fn) -> None:
    """``fn()`` on a thread lent four threads, as a group's worker is; its error re-raised."""
    errors = []

    def run() -> None:
        cpu_threads.lend(4)
        try:
            fn()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_workers_copies_sums_and_divisions_are_split_and_torchs_bits(four_threads, monkeypatch):
    used = []
    split = cpu_threads.split
    monkeypatch.setattr(cpu_threads, "split", lambda *a: (used.append(a[1]), split(*a)))
    _on_a_worker(_copies_sums_and_divisions)
    assert used == [100_003] * 3  # the add, the division and the contiguous copy
    used.clear()
    _copies_sums_and_divisions()  # off a worker: torch's own threads, the same bits
    assert used == []


def _copies_sums_and_divisions() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(100_003, generator=g) * 10**k for k in range(3)]
    out = torch.empty(100_003)
    expected = parts[0] + parts[1] + parts[2]
    assert torch.equal(cpu_threads.add_(out, parts), expected)
    assert torch.equal(cpu_threads.div_(out, 3), expected / 3)
    copy = torch.empty(100_003)
    assert torch.equal(cpu_threads.copy_(copy, parts[1]), parts[1])
    strided = torch.zeros(200_006)[::2]  # not contiguous: torch's own op
    assert torch.equal(cpu_threads.copy_(strided, parts[2]), parts[2])


def test_the_pool_runs_torch_on_each_thread_alone(four_threads):
    counts = {}

    def fn(a: int, b: int) -> None:
        counts[threading.get_ident()] = torch.get_num_threads()

    cpu_threads.split(fn, 4, 1)
    caller = threading.get_ident()
    assert counts.pop(caller) == 4 and set(counts.values()) == {1}
    assert torch.get_num_threads() == 4


def test_a_pool_first_used_by_a_worker_leaves_later_threads_the_process_count(four_threads):
    """A worker runs torch alone, but the pool it starts (and threads started after) keep the
    process's count."""
    from cgx2 import cpu_threads

    cpu_threads._pool.cache_clear()
    later = []

    def worker() -> None:
        cpu_threads.lend(4)
        cpu_threads.split(lambda a, b: None, 4, 1)  # starts the pool from the worker

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    probe = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    assert later == [4]
