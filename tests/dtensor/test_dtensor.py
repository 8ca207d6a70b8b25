"""cgx2.dtensor: QuantizedPartial redistributes through cgx2's ops (bit-equal to them, identical
on every rank), partitions like Partial, works on 1-D and 2-D meshes and compiled; the
placement's fields all count; QuantizedRowwiseParallel trains a TP MLP."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import cgx2
from cgx2.dtensor import QuantizedPartial, QuantizedRowwiseParallel


def test_placements_compare_hash_and_print_by_every_field():
    a = QuantizedPartial(bits=4, bucket_size=512, reduce_op="sum")
    assert a == QuantizedPartial() and hash(a) == hash(QuantizedPartial())
    for other in (
        QuantizedPartial(8),
        QuantizedPartial(4, 256),
        QuantizedPartial(4, 512, "avg"),
        Partial("sum"),
    ):
        assert a != other and other != a
    assert len({a, QuantizedPartial(8), QuantizedPartial(4, 256), Partial("sum")}) == 4
    assert repr(a) == "QuantizedPartial(bits=4, bucket_size=512, reduce_op='sum')"
    assert str(QuantizedPartial(8, 128, "avg")) == "QP(avg, 8b, 128)"
    text, globals_ = a.__fx_repr__()
    assert eval(text, globals_) == a
    assert a.is_partial() and not a.is_replicate()


@pytest.mark.parametrize(
    ("args", "match"), [((0,), "bits"), ((4, 0), "bucket"), ((4, 512, "max"), "'sum' or 'avg'")]
)
def test_bad_fields_fail_clearly(args, match):
    with pytest.raises(ValueError, match=match):
        QuantizedPartial(*args)


def _local(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7 + rank)) * (rank + 1)


def _to_replicate() -> tuple[torch.Tensor, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = _local(dist.get_rank(), (3000, 4))
    with cgx2.config.tuned(crossover_bytes=0):
        cgx2.manual_seed(3)
        dt = DTensor.from_local(x, mesh, [QuantizedPartial(4, 256, "avg")], run_check=False)
        got = dt.redistribute(mesh, [Replicate()]).to_local()
        cgx2.manual_seed(3)
        want = cgx2.quantized_allreduce(x, 4, op="avg", bucket_size=256)
    return got, want


def test_to_replicate_is_the_quantized_allreduce_identical_everywhere(dist2, dist4):
    for pool in (dist2, dist4):
        results = pool.run(_to_replicate)
        for got, want in results:
            assert torch.equal(got, want)
        assert all(torch.equal(got, results[0][0]) for got, _ in results)


def _to_shard(dim: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The shard this rank gets, and the op's reduce-scatter of the same values padded and moved
    as DTensor would pad them."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _local(rank, shape)
    with cgx2.config.tuned(crossover_bytes=0):
        cgx2.manual_seed(4)
        dt = DTensor.from_local(x, mesh, [QuantizedPartial(4, 128)], run_check=False)
        got = dt.redistribute(mesh, [Shard(dim)])
        cgx2.manual_seed(4)
        rows = x.movedim(dim, 0)
        part = -(-rows.shape[0] // world)
        rows = torch.cat([rows, rows.new_zeros(part * world - rows.shape[0], *rows.shape[1:])])
        want = cgx2.quantized_reduce_scatter(rows.contiguous(), 4, bucket_size=128)
        want = want[: max(0, min(part, x.shape[dim] - rank * part))].movedim(0, dim)
    exact = sum(_local(r, shape) for r in range(world)).chunk(world, dim)[rank]
    # One 4-bit step of each other rank's buckets (at most its whole range) a value.
    bound = sum(
        float(_local(r, shape).max() - _local(r, shape).min()) / 15
        for r in range(world)
        if r != rank
    )
    return got.to_local(), want, (tuple(got.shape), exact, bound)


@pytest.mark.parametrize(("dim", "shape"), [(0, (2048, 3)), (1, (40, 1000)), (0, (1001, 5))])
def test_to_shard_is_the_quantized_reduce_scatter(dist2, dist4, dim, shape):
    for pool in (dist2, dist4):
        for got, want, (global_shape, exact, bound) in pool.run(_to_shard, dim, shape):
            assert global_shape == shape
            assert got.shape == exact.shape and torch.equal(got, want)
            assert 0 < (got - exact).abs().max() <= bound


def _partition_and_back() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    v = _local(0, (4096,))  # the same on every rank
    placement = QuantizedPartial(8)
    with cgx2.config.tuned(crossover_bytes=0):
        # What DTensor calls for Replicate → Partial (its public redistribute keeps that
        # direction for its own operators).
        local = placement._partition_value(v, mesh, 0)
        partial = DTensor.from_local(local, mesh, [placement], run_check=False)
        back = partial.redistribute(mesh, [Replicate()]).to_local()
    return v, local, back


def test_replicate_to_quantized_partial_partitions_like_partial(dist2):
    for v, local, back in dist2.run(_partition_and_back):
        assert torch.equal(local, v / 2)
        span = float(v.max() - v.min())
        assert (back - v).abs().max() <= 2 * span / 255  # two 8-bit steps


def _two_d() -> torch.Tensor:
    """A 2×2 mesh: pending a quantized sum over dim 0 and a plain one over dim 1."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _local(dist.get_rank(), (4096,))
    with cgx2.config.tuned(crossover_bytes=0):
        cgx2.manual_seed(9)
        dt = DTensor.from_local(x, mesh, [QuantizedPartial(4), Partial()], run_check=False)
        return dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()


def test_a_two_d_mesh_compresses_one_dimension_identically_everywhere(dist4):
    results = dist4.run(_two_d)
    assert all(torch.equal(r, results[0]) for r in results)
    exact = sum(_local(r, (4096,)) for r in range(4))
    error = (results[0] - exact).abs().max()
    assert 0 < error < 4 * 4 * exact.abs().max() / 15  # quantized, within a few 4-bit steps


def _compiled() -> tuple[bool, bool]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = _local(dist.get_rank(), (4096,))

    def f(t: torch.Tensor, placement: QuantizedPartial) -> torch.Tensor:
        dt = DTensor.from_local(t, mesh, [placement], run_check=False)
        return dt.redistribute(mesh, [Replicate()]).to_local() * 2

    with cgx2.config.tuned(crossover_bytes=0):
        compiled = torch.compile(f, fullgraph=True)
        results = []
        for bits in (4, 8):  # a recompile, never the other width's graph
            cgx2.manual_seed(5)
            a = compiled(x, QuantizedPartial(bits))
            cgx2.manual_seed(5)
            results.append(torch.equal(a, f(x, QuantizedPartial(bits))))
    return tuple(results)


def test_compiled_redistribute_equals_eager_for_each_width(dist2):
    assert dist2.run(_compiled) == [(True, True), (True, True)]


def _tp_mlp(bits: int | None) -> list[float]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    down = RowwiseParallel() if bits is None else QuantizedRowwiseParallel(bits)
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": down})
    opt = torch.optim.Adam(mlp.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 64, generator=data) / 8
    losses = []
    with cgx2.config.tuned(crossover_bytes=0):
        for _ in range(30):
            x = torch.randn(32, 64, generator=data)
            loss = ((mlp(x) - x @ teacher) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_tensor_parallel_mlp_trains_with_a_compressed_output_reduction(dist2):
    plain = dist2.run(_tp_mlp, None)
    exact = dist2.run(_tp_mlp, 32)
    eight = dist2.run(_tp_mlp, 8)
    assert plain[0] == plain[1] == exact[0] == exact[1]  # bits 32: RowwiseParallel exactly
    assert eight[0] == eight[1]  # identical on both ranks
    assert eight[0] != plain[0] and eight[0][-1] < 0.5 * eight[0][0]  # quantized, and learning
    assert abs(eight[0][-1] - plain[0][-1]) < 0.05 * plain[0][-1]
