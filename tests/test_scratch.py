"""Host buffers kept between calls (cgx2.scratch): reused by size class, never shared, no more
than the working set, and the CPU allreduce gives its buffers back and stays bit-exact with them."""

import random

import pytest
import torch
import torch.distributed as dist

from cgx2 import scratch

CPU = torch.device("cpu")
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _empty():
    scratch.clear()
    yield
    scratch.clear()


def test_a_buffer_given_back_is_taken_again_by_its_size_class():
    a = scratch.take(3 * MiB, torch.uint8, CPU)
    address = a.data_ptr()
    scratch.give(a)
    assert scratch.cached_bytes() == 3 * MiB
    assert scratch.take(4 * MiB, torch.uint8, CPU).data_ptr() != address  # another class
    again = scratch.take(3 * MiB // 4 - 1000, torch.float32, CPU)  # a little less, as floats
    assert again.data_ptr() == address and scratch.cached_bytes() == 0
    assert again.shape == (3 * MiB // 4 - 1000,) and again.is_contiguous()
    assert scratch.take(3 * MiB, torch.uint8, CPU).data_ptr() != address  # taken: not shared
    assert scratch.class_bytes(3 * MiB + 1) == 3.5 * MiB  # a class a quarter octave up


def test_views_small_buffers_and_tensors_not_taken_here_are_not_kept():
    scratch.give(scratch.take(4 * MiB, torch.uint8, CPU))  # a working set of 4 MiB
    scratch.clear()
    big = scratch.take(4 * MiB, torch.uint8, CPU)
    scratch.give(big[MiB:], big[: 2 * MiB], torch.empty(1000), torch.empty(3 * MiB + 1), None)
    assert scratch.cached_bytes() == 0


def test_calls_of_sizes_that_vary_keep_no_more_than_their_working_set():
    rng = random.Random(0)
    for _ in range(300):  # a call's three buffers (payloads and a sum), of 1 to 16 MiB
        sizes = [rng.randrange(MiB, 16 * MiB) for _ in range(3)]
        scratch.give(*[scratch.take(n, torch.uint8, CPU) for n in sizes])
        assert scratch.cached_bytes() <= 3 * 16 * MiB, "kept more than one call's buffers"
    assert 0 < scratch.cached_bytes() <= scratch.peak_bytes() <= 3 * 16 * MiB


def test_calls_of_one_size_reuse_their_buffers():
    addresses = []
    for _ in range(10):
        send, recv = (scratch.take(5 * MiB, torch.uint8, CPU) for _ in range(2))
        total = scratch.take(5 * MiB // 4, torch.float32, CPU)
        addresses.append({t.data_ptr() for t in (send, recv, total)})
        scratch.give(send, recv, total)
    assert all(a == addresses[0] for a in addresses) and len(addresses[0]) == 3
    assert scratch.cached_bytes() == scratch.peak_bytes() == 15 * MiB


def test_the_oldest_buffers_go_beyond_the_working_set_or_the_limit(monkeypatch):
    first, second = (scratch.take(2 * MiB, torch.uint8, CPU) for _ in range(2))
    scratch.give(first, second)  # a working set of 4 MiB, all kept
    assert scratch.cached_bytes() == 4 * MiB
    third = scratch.take(3 * MiB, torch.uint8, CPU)  # a new class: both 2 MiB go for it
    scratch.give(third)
    assert scratch.cached_bytes() == 3 * MiB
    assert scratch.take(3 * MiB, torch.uint8, CPU).data_ptr() == third.data_ptr()
    monkeypatch.setattr(scratch, "MAX_BYTES", 3 * MiB)
    scratch.give(*(scratch.take(2 * MiB, torch.uint8, CPU) for _ in range(2)))
    assert scratch.cached_bytes() == 2 * MiB


def _two_calls_and_what_is_kept() -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    import cgx2
    from cgx2.collectives import reference_allreduce

    got, want = [], []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
        x = torch.randn(1 << 20, generator=g)
        inputs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(inputs, x)
        with cgx2.config.tuned(crossover_bytes=0):
            got.append(cgx2.quantized_allreduce(x, 4, seed=seed))
        want.append(reference_allreduce(inputs, 4, 512, seed=seed))
    return got, want, scratch.cached_bytes()


def test_the_cpu_allreduce_reuses_its_buffers_and_stays_exact(dist2):
    for got, want, kept in dist2.run(_two_calls_and_what_is_kept):
        assert kept > 0  # the payloads and the sum were given back
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
