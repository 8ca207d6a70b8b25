"""Ten thousand quantized allreduces of mixed sizes and widths, on two groups from two threads a
rank: memory and file descriptors stay flat, and nothing is left in /dev/shm (``-m soak``)."""

import ctypes
import datetime
import glob
import os
import random
import threading

import pytest
import torch
import torch.distributed as dist
from dist_pool import DistPool

CALLS = 10_000  # a rank's, over its two threads
WARM = 2_000  # after these, caches, pools and threads exist: the footprint is measured from here
SIZES = (1, 7, 513, 4_097, 65_537, 262_145, 1_048_577, 4_194_305)  # values a call
WEIGHTS = (4, 4, 8, 8, 8, 4, 2, 1)
HUNG_S = 600  # a thread that has not finished by then is stuck, not slow

pytestmark = pytest.mark.soak


def _footprint() -> tuple[int, int, int]:
    """Resident KiB but for cgx2's kept buffers (bounded apart), threads and open file
    descriptors of this process, between calls: the allocator's free pages returned first, so
    that what is measured is what is held."""
    from cgx2 import scratch

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measured as it is
        pass
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    rss -= scratch.cached_bytes() // 1024
    return rss, len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _plan(thread: int) -> list[tuple[int, int, str]]:
    """The calls of one thread, alike on every rank: every size and width in the first ones."""
    rng = random.Random(thread)
    first = [(n, bits, "sum") for n in SIZES for bits in (2, 4, 8)]
    rest = [
        (rng.choices(SIZES, WEIGHTS)[0], rng.choice((2, 4, 8)), rng.choice(("sum", "avg")))
        for _ in range(CALLS // 2 - len(first))
    ]
    return first + rest


def _soak() -> dict[str, object]:
    import cgx2
    from cgx2 import scratch
    from cgx2.comm import shm

    timeout = datetime.timedelta(seconds=60)  # a wait that never ends fails within minutes
    groups = [dist.new_group([0, 1], timeout=timeout) for _ in range(2)]
    inputs = {n: torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in SIZES}
    errors: list[str] = []
    checkpoints = [threading.Barrier(3) for _ in range(2)]

    def calls(thread: int) -> None:
        try:
            for i, (n, bits, op) in enumerate(_plan(thread)):
                if i == WARM // 2:
                    checkpoints[0].wait()  # warm: the main thread measures
                    checkpoints[1].wait()
                out = cgx2.quantized_allreduce(inputs[n], bits, op=op, group=groups[thread])
                if not out.isfinite().all():
                    raise AssertionError(f"call {i} ({n} values, {bits} bits): not finite")
        except Exception as e:  # reported by the main thread
            errors.append(f"thread {thread}: {type(e).__name__}: {e}")
            for barrier in checkpoints:
                barrier.abort()

    threads = [threading.Thread(target=calls, args=(t,), daemon=True) for t in range(2)]
    with cgx2.config.tuned(crossover_bytes=0):  # every call quantized
        # Started in opposite orders on the two ranks: their first calls (each group's peer
        # sockets and agreement) interleave both ways.
        for t in threads if dist.get_rank() == 0 else threads[::-1]:
            t.start()
        warm = None
        try:
            checkpoints[0].wait(HUNG_S)
            warm = _footprint()
            checkpoints[1].wait(HUNG_S)
        except threading.BrokenBarrierError:
            pass
        for t in threads:
            t.join(HUNG_S)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    end = _footprint()
    kept, peak = scratch.cached_bytes(), scratch.peak_bytes()
    served = all(shm.serves(g) for g in groups)
    for g in groups:
        dist.destroy_process_group(g)
    return {
        "errors": errors,
        "hung": hung,
        "warm": warm,
        "end": end,
        "kept": kept,
        "peak": peak,
        "served": served,
    }


def test_ten_thousand_calls_on_two_groups_from_two_threads_stay_flat():
    before = set(glob.glob("/dev/shm/cgx2-*"))
    pool = DistPool(2, timeout=2 * HUNG_S + 600)
    try:
        results = pool.run(_soak)
    finally:
        pool.close()
    for rank, r in enumerate(results):
        assert r["hung"] == [], f"rank {rank}: threads {r['hung']} did not finish: {r['errors']}"
        assert r["errors"] == [], f"rank {rank}: {r['errors']}"
        assert r["served"], "the calls did not ride shared memory"
        (rss0, threads0, fds0), (rss1, threads1, fds1) = r["warm"], r["end"]
        # After warm-up every size and width has run: what grows from there is a leak. Between
        # two quiet points the allocator's pages differ by tens of MiB either way; a leak of one
        # call's buffers a call passes the bound within a few dozen calls.
        assert rss1 - rss0 < 64 * 1024, f"rank {rank}: resident memory grew {rss1 - rss0} KiB"
        assert fds1 <= fds0 and threads1 <= threads0, (rank, r["warm"], r["end"])
        # cgx2's kept buffers: within the most two calls at once have used
        assert r["kept"] <= r["peak"] <= 128 << 20, (rank, r["kept"], r["peak"])
    assert set(glob.glob("/dev/shm/cgx2-*")) - before == set()
