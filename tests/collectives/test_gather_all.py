"""The gather-all allreduce (CGX2_ALGORITHM=allgather): each rank's piece quantized once, every
rank's gathered and summed by every rank. Equal to its reference bit for bit on both codecs and
both transports, every rank alike, rotated too; within one quantization step of each rank;
unbiased; less error than the scatter-reduce-allgather between two ranks for the same bytes;
its error feedback is what the others decode of this rank; NaN propagates, finite stays finite."""

import pytest
import torch
import torch.distributed as dist
from bounds import OUTPUT_ROUNDING, quantize_bound

import cgx2
from cgx2 import collectives
from cgx2.codecs import ChunkedLayout, maxmin
from cgx2.collectives import CallSettings, policy, reference_allreduce
from cgx2.collectives.allreduce import STAGE_SCATTER
from cgx2.collectives.fusion import quantized_bytes_sent
from cgx2.config import tuned
from cgx2.seeding import derive_key

BUCKET = 512
CASES = [
    (bits, dtype, n, op, rotation)
    for bits, dtype in ((4, torch.float32), (2, torch.bfloat16))
    for n, op, rotation in ((1, "sum", None), (3000, "avg", None), (2125, "sum", "hadamard"))
]


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g) * (rank + 1) + rank
    x[::97] *= 40
    return x.to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _cases(native: bool, transport: str, piece_bytes: int | None) -> list[torch.Tensor]:
    settings = {"native_codec": native, "transport": transport, "pipeline_bytes": piece_bytes}
    inputs = [_input(dist.get_rank(), n, dtype) for _, dtype, n, _, _ in CASES]
    with tuned(algorithm="allgather", crossover_bytes=0, **settings):
        assert all(policy.route(x, dist.group.WORLD, 4, BUCKET).gather_all for x in inputs)
        return [
            cgx2.quantized_allreduce(x, bits, op=op, seed=17, rotation=rotation)
            for x, (bits, _, _, op, rotation) in zip(inputs, CASES, strict=True)
        ]


@pytest.mark.parametrize("native", [True, False], ids=["c_loops", "torch"])
@pytest.mark.parametrize("world, piece_bytes", [(2, None), (2, 2 * 512 * 4), (4, None)])
def test_gather_all_is_its_reference_bit_for_bit_on_every_rank(
    dist2, dist4, native, world, piece_bytes
):
    pool = dist2 if world == 2 else dist4
    by_transport = {t: pool.run(_cases, native, t, piece_bytes) for t in ("shm", "process_group")}
    with tuned(pipeline_bytes=piece_bytes):
        for i, (bits, dtype, n, op, rotation) in enumerate(CASES):
            got = [r[i] for r in by_transport["shm"]]
            assert all(_bits_equal(g, got[0]) for g in got), f"ranks differ: {CASES[i]}"
            assert _bits_equal(by_transport["process_group"][0][i], got[0]), CASES[i]
            inputs = [_input(r, n, dtype) for r in range(world)]
            model = reference_allreduce(
                inputs, bits, BUCKET, 17, op, rotation=rotation, gather_all=True
            )
            assert _bits_equal(got[0], model), f"differs from its reference: {CASES[i]}"
            if n > 1:  # not the scatter-reduce-allgather's bytes
                sra = reference_allreduce(
                    inputs, bits, BUCKET, 17, op, rotation=rotation, gather_all=False
                )
                assert not torch.equal(got[0], sra), CASES[i]


def _bounded(n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    x = _input(dist.get_rank(), n, dtype, seed=3)
    with tuned(algorithm="allgather", crossover_bytes=0):
        return collectives.allreduce(x, dist.group.WORLD, CallSettings(3, BUCKET, op, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gather_all_is_within_one_step_of_each_ranks_bucket(dist4, dtype, op):
    n = 5 * BUCKET + 3
    got = dist4.run(_bounded, n, dtype, op)
    inputs = [_input(r, n, dtype, seed=3) for r in range(4)]
    exact = sum(x.double() for x in inputs)
    bound = sum(quantize_bound(x, 3, BUCKET) for x in inputs)
    if op == "avg":
        exact, bound = exact / 4, bound / 4
    bound = bound + OUTPUT_ROUNDING[dtype] * exact.abs() * 2
    error = (got[0].double() - exact).abs()
    assert (error <= bound).all(), (error - bound).max()
    assert error.max() > 0  # it quantizes


def _samples(n: int, samples: int, algorithm: str) -> torch.Tensor:
    x = _input(dist.get_rank(), n, seed=4)
    with tuned(algorithm=algorithm, crossover_bytes=0):
        return torch.stack(
            [
                collectives.allreduce(x, dist.group.WORLD, CallSettings(2, BUCKET, seed=s))
                for s in range(samples)
            ]
        )


def test_gather_all_is_unbiased_with_less_error_than_sra_between_two_ranks(dist2):
    """The mean over seeds tends to the exact sum; between two ranks, for the same bytes, its
    squared error is below the scatter-reduce-allgather's, which quantizes twice."""
    n, samples = 2048, 200
    inputs = [_input(r, n, seed=4) for r in range(2)]
    exact = sum(x.double() for x in inputs)
    got = dist2.run(_samples, n, samples, "allgather")[0].double()
    sigma = sum(quantize_bound(x, 2, BUCKET) for x in inputs) / 2 / samples**0.5
    error = got.mean(0) - exact
    assert (error.abs() <= 6 * sigma).all()
    assert abs(error.sum().item()) <= 6 * (sigma**2).sum().sqrt().item()
    sra = dist2.run(_samples, n, samples, "sra")[0].double()
    mse = ((got - exact) ** 2).mean().item()
    mse_sra = ((sra - exact) ** 2).mean().item()
    assert mse < 0.9 * mse_sra, (mse, mse_sra)
    # Each sends its whole payload to the other: the scatter-reduce-allgather's bytes.
    whole = quantized_bytes_sent(n, 2, 2, BUCKET, gather_all=True)
    assert whole == ChunkedLayout.split(n, 1, 2, BUCKET, False).payload_nbytes
    assert abs(whole - quantized_bytes_sent(n, 2, 2, BUCKET)) <= 64


def _with_error(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _input(dist.get_rank(), n)
    t, error = x.clone(), torch.empty_like(x)
    with tuned(algorithm="allgather", crossover_bytes=0):
        collectives.allreduce_(t, dist.group.WORLD, CallSettings(4, BUCKET, seed=9), error=error)
    return x, t, error


def test_gather_all_error_feedback_is_what_the_others_decode(dist2):
    """The error is the input minus this rank's payload decoded, over the whole tensor (no
    rank keeps a chunk exact)."""
    n = 3 * BUCKET + 10
    for rank, (x, _, error) in enumerate(dist2.run(_with_error, n)):
        layout = ChunkedLayout.split(n, 1, 4, BUCKET, False)
        row = maxmin.encode_chunks(x, layout, derive_key(9, STAGE_SCATTER, rank, 0))
        assert torch.equal(error, x - maxmin.decode_chunks(row, layout, torch.float32))
        assert (error != 0).sum() > n // 2


def _edges() -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    nan = torch.randn(2 * BUCKET)
    if rank == 1:
        nan[BUCKET + 5] = float("nan")
    big = torch.full((BUCKET,), 3e38) * (1 if rank == 0 else 0.9)
    with tuned(algorithm="allgather", crossover_bytes=0):
        group = dist.group.WORLD
        return (
            collectives.allreduce(nan, group, CallSettings(4, BUCKET, seed=1)),
            collectives.allreduce(big, group, CallSettings(4, BUCKET, "avg", seed=1)),
        )


def test_gather_all_propagates_nan_and_keeps_a_finite_mean_finite(dist2):
    nan, big = dist2.run(_edges)[0]
    assert nan[BUCKET:].isnan().any() and not nan[:BUCKET].isnan().any()
    assert big.isfinite().all() and (big > 2.5e38).all()


def _route_of(algorithm: str) -> bool:
    with tuned(algorithm=algorithm, crossover_bytes=0):
        return policy.route(torch.randn(4096), dist.group.WORLD, 4, BUCKET).gather_all


def test_only_allgather_asks_for_it(dist2):
    assert dist2.run(_route_of, "allgather") == [True, True]
    assert dist2.run(_route_of, "auto") == [False, False]
    assert dist2.run(_route_of, "sra") == [False, False]
