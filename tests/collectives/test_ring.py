"""The pipelined ring allreduce (CGX2_ALGORITHM=ring): bit-identical on every rank, the same
bytes through both transports, within its documented error bound, unbiased."""

import pytest
import torch
import torch.distributed as dist

from cgx2 import collectives
from cgx2.collectives import CallSettings, policy
from cgx2.config import tuned

BITS, BUCKET = 4, 512


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


def _ring(cases, pipeline_bytes) -> list[dict]:
    rank, group = dist.get_rank(), dist.group.WORLD
    found = []
    for n, dtype, op in cases:
        x = _input(rank, n, dtype)
        results = {}
        for transport in ("shm", "process_group"):
            with tuned(
                transport=transport,
                crossover_bytes=0,
                algorithm="ring",
                pipeline_bytes=pipeline_bytes,
            ):
                assert policy.route(x, group, BITS, BUCKET).ring
                results[transport] = collectives.allreduce(
                    x, group, CallSettings(BITS, BUCKET, op, 11)
                )
        found.append(results)
    return found


def _bound(inputs: list[torch.Tensor], bits: int, bucket: int) -> torch.Tensor:
    """Per value, the ring's bound: W quantizations, the k-th of a partial sum whose bucket
    range is at most S + 2 E_{k-1} (S: the ranks' ranges summed, E: the steps so far), each
    off by less than one step, step = range / (2**bits - 1)."""
    n = inputs[0].numel()
    pad = -n % bucket

    def bucket_ranges(x: torch.Tensor) -> torch.Tensor:
        buckets = torch.cat([x.double(), x.new_zeros(pad).double()]).view(-1, bucket)
        return buckets.amax(1) - buckets.amin(1)

    ranges = sum(bucket_ranges(x) for x in inputs)
    levels, accumulated = 2**bits - 1, torch.zeros_like(ranges)
    for _ in inputs:  # W quantizations
        accumulated = accumulated + (ranges + 2 * accumulated) / levels
    return accumulated.repeat_interleave(bucket)[:n]


@pytest.mark.parametrize("pipeline_bytes", [None, 4 * BUCKET * 4 * 3])
def test_ring_is_identical_on_every_rank_and_within_its_bound(dist4, pipeline_bytes):
    cases = [
        (n, dtype, op)
        for n in (1, 700, 40_001)
        for dtype in (torch.float32, torch.bfloat16)
        for op in ("sum", "avg")
    ]
    by_rank = dist4.run(_ring, cases, pipeline_bytes)
    world = len(by_rank)
    for i, (n, dtype, op) in enumerate(cases):
        shm = [r[i]["shm"] for r in by_rank]
        assert all(torch.equal(s, shm[0]) for s in shm), (n, dtype, op)
        assert torch.equal(shm[0], by_rank[0][i]["process_group"]), (n, dtype, op)
        inputs = [_input(r, n, dtype) for r in range(world)]
        exact = sum(x.double() for x in inputs)
        bound = _bound(inputs, BITS, BUCKET)
        if op == "avg":
            exact, bound = exact / world, bound / world
        slack = 1e-5 * exact.abs() + (1e-2 * exact.abs() if dtype == torch.bfloat16 else 0)
        error = (shm[0].double() - exact).abs()
        assert (error <= bound + slack + 1e-6).all(), (n, dtype, op, (error - bound).max())
        assert n < 4 * BUCKET or error.max() > 0  # it quantizes


def _ring_samples(n: int, samples: int) -> torch.Tensor:
    x = _input(dist.get_rank(), n, torch.float32)
    with tuned(crossover_bytes=0, algorithm="ring"):
        return torch.stack(
            [
                collectives.allreduce(x, dist.group.WORLD, CallSettings(2, BUCKET, seed=s))
                for s in range(samples)
            ]
        )


def test_ring_is_unbiased(dist4):
    n, samples = 2048, 300
    got = dist4.run(_ring_samples, n, samples)[0].double()
    inputs = [_input(r, n, torch.float32) for r in range(4)]
    exact = sum(x.double() for x in inputs)
    sigma = _bound(inputs, 2, BUCKET) / 2 / samples**0.5  # each error below one bound's width
    error = got.mean(0) - exact
    assert (error.abs() <= 6 * sigma).all()
    assert abs(error.sum().item()) <= 6 * (sigma**2).sum().sqrt().item()


def _two_ranks_keep_sra() -> bool:
    x = torch.randn(1000)
    with tuned(algorithm="ring", crossover_bytes=0):
        return not policy.route(x, dist.group.WORLD, 4, BUCKET).ring


def test_two_ranks_keep_the_scatter_reduce_allgather(dist2):
    """With two ranks the ring would only quantize as often for the same bytes."""
    assert all(dist2.run(_two_ranks_keep_sra))
