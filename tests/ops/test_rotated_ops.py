"""The ops and DTensor's placement with ``rotation="hadamard"``: torch.compile(fullgraph=True)
traces them with no graph break and gives the eager bytes, the rotated reference's; opcheck
passes with the rotation's arguments; old call signatures keep working."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import cgx2
from cgx2.collectives import reference_allreduce, reference_reduce_scatter
from cgx2.dtensor import QuantizedPartial


def _input(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(n, generator=g) * (rank + 1)
    x[::61] *= 25
    return x


def _compiled() -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank = dist.get_rank()
    name = dist.group.WORLD.group_name
    x = _input(rank, 4096)

    def op_step(t: torch.Tensor) -> torch.Tensor:
        y = torch.ops.cgx.quantized_allreduce(t * 2, 2, 512, name, "avg", 99, False, "hadamard", 64)
        return y + 1

    def wrapper_step(t: torch.Tensor) -> torch.Tensor:
        return cgx2.quantized_allreduce(t * 2, bits=3, seed=7, rotation="hadamard") - 1

    def in_place_step(t: torch.Tensor) -> torch.Tensor:
        y = t * 2
        cgx2.quantized_allreduce_(y, bits=2, seed=5, rotation="hadamard", rotation_block=256)
        return y

    def scatter_step(t: torch.Tensor) -> torch.Tensor:
        return cgx2.quantized_reduce_scatter(t, bits=2, seed=3, rotation="hadamard") * 3

    found = {}
    with cgx2.config.tuned(crossover_bytes=0):
        for label, fn in (
            ("op", op_step),
            ("wrapper", wrapper_step),
            ("in_place", in_place_step),
            ("scatter", scatter_step),
        ):
            found[label] = (torch.compile(fn, fullgraph=True)(x), fn(x))
        # The unrotated call traces to the op's old schema, and old positional calls work.
        old = torch.ops.cgx.quantized_allreduce(x, 4, 512, name, "sum", 5, False)
        found["old"] = (old, cgx2.quantized_allreduce(x, 4, seed=5))
        name_ = dist.group.WORLD.group_name
        torch.library.opcheck(
            torch.ops.cgx.quantized_allreduce.default,
            (x, 2, 512, name_, "sum", 5, False, "hadamard", 128),
        )
        torch.library.opcheck(
            torch.ops.cgx.quantized_reduce_scatter.default,
            (x, 2, 512, 2, name_, "sum", 5, "hadamard", 128),
        )
    found["graph_breaks"] = sum(counters["graph_break"].values())
    return found


def test_compiled_rotated_ops_are_the_eager_bytes_and_the_reference(dist2):
    results = dist2.run(_compiled)
    for r in results:
        assert r["graph_breaks"] == 0
        for label in ("op", "wrapper", "in_place", "scatter", "old"):
            compiled, eager = r[label]
            assert torch.equal(compiled, eager), label
    inputs = [_input(r, 4096) for r in range(2)]
    doubled = [2 * x for x in inputs]
    model = reference_allreduce(doubled, 2, 512, 99, "avg", rotation="hadamard", rotation_block=64)
    assert torch.equal(results[0]["op"][0], model + 1)
    assert torch.equal(results[1]["op"][0], model + 1)
    model = reference_allreduce(doubled, 3, 512, 7, rotation="hadamard")
    assert torch.equal(results[0]["wrapper"][0], model - 1)
    assert not torch.equal(results[0]["wrapper"][0], reference_allreduce(doubled, 3, 512, 7) - 1)
    parts = reference_reduce_scatter(inputs, 2, 512, 3, rotation="hadamard")
    for rank, r in enumerate(results):
        assert torch.equal(r["scatter"][0], parts[rank] * 3)


def _placement() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    x = _input(rank, 4096).view(1024, 4)
    placement = QuantizedPartial(2, 512, "avg", rotation="hadamard", rotation_block=64)
    found = {}
    with cgx2.config.tuned(crossover_bytes=0):
        cgx2.manual_seed(3)
        dt = DTensor.from_local(x, mesh, [placement], run_check=False)
        found["replicate"] = dt.redistribute(mesh, [Replicate()]).to_local()
        cgx2.manual_seed(3)
        found["allreduce"] = cgx2.quantized_allreduce(
            x, 2, op="avg", rotation="hadamard", rotation_block=64
        )
        cgx2.manual_seed(3)
        dt = DTensor.from_local(x, mesh, [placement], run_check=False)
        found["shard"] = dt.redistribute(mesh, [Shard(0)]).to_local()
        cgx2.manual_seed(3)
        found["reduce_scatter"] = cgx2.quantized_reduce_scatter(
            x, 2, op="avg", rotation="hadamard", rotation_block=64
        )
        cgx2.manual_seed(3)
        dt = DTensor.from_local(x, mesh, [QuantizedPartial(2, 512, "avg")], run_check=False)
        found["unrotated"] = dt.redistribute(mesh, [Replicate()]).to_local()

        def f(t: torch.Tensor, placement: QuantizedPartial) -> torch.Tensor:
            dt = DTensor.from_local(t, mesh, [placement], run_check=False)
            return dt.redistribute(mesh, [Replicate()]).to_local() * 2

        torch._dynamo.reset()
        cgx2.manual_seed(3)
        found["compiled"] = torch.compile(f, fullgraph=True)(x, placement)
    return found


def test_quantized_partial_with_rotation(dist2):
    for r in dist2.run(_placement):
        assert torch.equal(r["replicate"], r["allreduce"])
        assert torch.equal(r["shard"], r["reduce_scatter"])
        assert not torch.equal(r["replicate"], r["unrotated"])
        assert torch.equal(r["compiled"], r["replicate"] * 2)
    rotated = QuantizedPartial(4, rotation="hadamard")
    assert rotated != QuantizedPartial(4) and hash(rotated) != hash(QuantizedPartial(4))
    assert rotated != QuantizedPartial(4, rotation="hadamard", rotation_block=256)
    assert rotated == QuantizedPartial(4, rotation="hadamard", rotation_block=128)
    assert repr(rotated) == (
        "QuantizedPartial(bits=4, bucket_size=512, reduce_op='sum', rotation='hadamard', "
        "rotation_block=128)"
    )
    assert repr(QuantizedPartial()) == "QuantizedPartial(bits=4, bucket_size=512, reduce_op='sum')"
