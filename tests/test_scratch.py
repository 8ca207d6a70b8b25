"""Host buffers kept between calls (cgx2.scratch): reused by size and dtype, never shared,
bounded, and the CPU allreduce gives its buffers back and stays bit-exact with them."""

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


def test_a_buffer_given_back_is_taken_again_by_its_size_and_dtype_only():
    a = scratch.take(MiB, torch.uint8, CPU)
    address = a.data_ptr()
    scratch.give(a)
    assert scratch.cached_bytes() == MiB
    assert scratch.take(MiB, torch.float32, CPU).data_ptr() != address  # another dtype
    assert scratch.take(MiB + 1, torch.uint8, CPU).data_ptr() != address  # another size
    again = scratch.take(MiB, torch.uint8, CPU)
    assert again.data_ptr() == address and scratch.cached_bytes() == 0
    assert scratch.take(MiB, torch.uint8, CPU).data_ptr() != address  # taken: not shared


def test_views_small_buffers_and_gpu_tensors_are_not_kept():
    big = torch.empty(4 * MiB, dtype=torch.uint8)
    scratch.give(big[MiB:], big[: 2 * MiB], torch.empty(1000), None)
    assert scratch.cached_bytes() == 0


def test_the_oldest_buffers_go_when_more_than_the_limit_is_kept(monkeypatch):
    monkeypatch.setattr(scratch, "MAX_BYTES", 3 * MiB)
    first, second, third = (torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(3))
    scratch.give(first)
    scratch.give(second)  # 4 MiB: first goes
    assert scratch.cached_bytes() == 2 * MiB
    assert scratch.take(2 * MiB, torch.uint8, CPU).data_ptr() == second.data_ptr()
    scratch.give(third)
    assert scratch.take(2 * MiB, torch.uint8, CPU).data_ptr() == third.data_ptr()


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
