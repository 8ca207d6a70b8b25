"""torch.ops.cgx.quantized_reduce_scatter(_out): bit-equal to the reference model, the out form
equal to the functional one, compiled equal to eager, opcheck, its gradient, clear errors."""

import pytest
import torch
import torch.distributed as dist

import cgx2
from cgx2.collectives import reference_reduce_scatter


def _inputs(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(world * 1000, 3, generator=g) * (rank + 1)).to(dtype)


def _reduce_scatter(dtype: torch.dtype, op: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _inputs(rank, world, dtype)
    with cgx2.config.tuned(crossover_bytes=0):
        out = cgx2.quantized_reduce_scatter(x, 4, op=op, bucket_size=128, seed=11)
        into = torch.empty(1000, 3, dtype=dtype)
        returned = cgx2.quantized_reduce_scatter(x, 4, op=op, bucket_size=128, seed=11, out=into)
    return {"x": x, "out": out, "into": into, "same_object": returned is into}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_op_is_the_reference_model_bit_for_bit(dist2, dist4, dtype, op):
    for pool in (dist2, dist4):
        results = pool.run(_reduce_scatter, dtype, op)
        world = len(results)
        scale = 1.0 / world if op == "avg" else None
        models = reference_reduce_scatter([r["x"] for r in results], 4, 128, 11, scale)
        for rank, (r, model) in enumerate(zip(results, models, strict=True)):
            assert r["out"].shape == (1000, 3) and r["out"].dtype == dtype
            assert torch.equal(r["out"].reshape(-1), model), f"rank {rank} of {world}"
            assert torch.equal(r["into"], r["out"]) and r["same_object"]
            exact = sum(x["x"].view(world, -1)[rank].double() for x in results)
            exact = exact / world if op == "avg" else exact
            assert not torch.equal(r["out"].reshape(-1).double(), exact)  # it did quantize


def _compiled_and_opcheck() -> tuple[bool, bool]:
    x = _inputs(dist.get_rank(), dist.get_world_size(), torch.float32)
    name, world = dist.group.WORLD.group_name, dist.get_world_size()

    def f(t: torch.Tensor) -> torch.Tensor:
        return cgx2.quantized_reduce_scatter(t * 2, 4, seed=5) + 1

    with cgx2.config.tuned(crossover_bytes=0):
        same = torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
        torch.library.opcheck(
            torch.ops.cgx.quantized_reduce_scatter.default, (x, 4, 512, world, name, "avg", 7)
        )
        out = torch.empty(1000, 3)
        torch.library.opcheck(
            torch.ops.cgx.quantized_reduce_scatter_out.default,
            (x, out, 4, 512, world, name, "sum", 7),
        )
    return same, True


def test_compiled_fullgraph_equals_eager_and_opcheck_passes(dist2):
    assert dist2.run(_compiled_and_opcheck) == [(True, True), (True, True)]


def _gradient(op: str) -> torch.Tensor:
    x = torch.ones(2000, requires_grad=True)
    with cgx2.config.tuned(crossover_bytes=0):
        (cgx2.quantized_reduce_scatter(x, 4, op=op) * (dist.get_rank() + 1)).sum().backward()
    return x.grad


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_gradient_is_the_all_gather_of_the_outputs_gradients(dist2, op):
    for grad in dist2.run(_gradient, op):
        want = torch.cat([torch.full((1000,), 1.0), torch.full((1000,), 2.0)])
        assert torch.equal(grad, want / 2 if op == "avg" else want)


def _errors() -> list[str]:
    messages = []
    for call in (
        lambda: cgx2.quantized_reduce_scatter(torch.ones(5), 4),  # 5 rows for 2 ranks
        lambda: cgx2.quantized_reduce_scatter(torch.ones(4, dtype=torch.int32), 4),
        lambda: cgx2.quantized_reduce_scatter(torch.ones(4), 9),
        lambda: cgx2.quantized_reduce_scatter(torch.ones(4), 4, out=torch.empty(3)),
        lambda: cgx2.quantized_reduce_scatter(torch.ones(4), 4, op="max"),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_bad_arguments_fail_clearly(dist2):
    for messages in dist2.run(_errors):
        assert "first dimension into 2 equal parts" in messages[0]
        assert "int32" in messages[1] or "float" in messages[1]
        assert "bits" in messages[2]
        assert "out must be a contiguous" in messages[3]
        assert "max" in messages[4]


def _disagree() -> str:
    n = 2048 if dist.get_rank() == 0 else 2000
    try:
        cgx2.quantized_reduce_scatter(torch.ones(n), 4)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_all_raise(dist2):
    for message in dist2.run(_disagree):
        assert "quantized_reduce_scatter disagree on numel=[rank 0: 2048, rank 1: 2000]" in message
