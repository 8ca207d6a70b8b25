"""FSDP2 with cgx2's quantized parameter all-gather (round-to-nearest, the same values on every
rank) and, on a 2-D mesh, the quantized all-reduce across replicas (HSDP): bytes against the
reference codec, training close to uncompressed, replicas identical."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from test_fsdp import _MLP, train_mlp  # the small model FSDP2's other tests train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cgx2
import cgx2.fsdp
from cgx2.codecs import maxmin
from cgx2.collectives import CallSettings
from cgx2.collectives.all_gather import all_gather
from cgx2.fsdp import QuantizedReplicaGroup, compress

SEGMENTS = [(0, 300, True), (300, 50, False), (350, 650, True)]


def _all_gather(dtype: torch.dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)).to(dtype)
    out = torch.empty(world * 1000, dtype=dtype)
    out[rank * 1000 : (rank + 1) * 1000] = x  # FSDP's copy-in: the input is our slot
    with cgx2.config.tuned(crossover_bytes=0):
        sent = all_gather(
            out, out[rank * 1000 : (rank + 1) * 1000], dist.group.WORLD, 8, 128, SEGMENTS
        )
    return {"x": x, "out": out, "sent": sent}


def _model_row(x: torch.Tensor) -> torch.Tensor:
    """A row as every rank decodes it: each compressed segment padded to whole buckets with its
    last value, fused, rounded to the nearest 8-bit level and decoded; the rest exact."""
    parts = []
    for o, k, c in SEGMENTS:
        if c:
            parts.append(torch.cat([x[o : o + k], x[o + k - 1 : o + k].expand(-k % 128)]))
    fused = torch.cat(parts)
    decoded = maxmin.decode(
        maxmin.encode(fused, 8, 128, 0, nearest=True), fused.numel(), 8, 128, x.dtype
    )
    row, at = x.clone(), 0
    for o, k, c in SEGMENTS:
        if c:
            row[o : o + k] = decoded[at : at + k]
            at += k + (-k % 128)
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_is_the_nearest_rounding_model_on_every_rank(dist2, dist4, dtype):
    for pool in (dist2, dist4):
        results = pool.run(_all_gather, dtype)
        world = len(results)
        want = torch.cat([_model_row(r["x"]) for r in results])
        for r in results:
            assert torch.equal(r["out"], want)  # every rank, its own row too
        for rank, r in enumerate(results):
            row = want[rank * 1000 : (rank + 1) * 1000]
            assert torch.equal(row[300:350], r["x"][300:350])  # exact segment exact
            assert not torch.equal(row[:300], r["x"][:300])
            # Half an 8-bit step of the widest bucket, and the output dtype's own rounding.
            x = r["x"].float()
            span = float(x.max() - x.min())
            rounding = torch.finfo(dtype).eps * x.abs() if dtype != torch.float32 else 0
            assert ((row.float() - x).abs() - rounding).max() <= 0.5 * span / 255 * (1 + 1e-5)
        assert results[0]["sent"] < (world - 1) * 1000 * 4 * 0.4


def _train(
    options: dict | None,
    steps: int,
    hsdp: bool = False,
    bf16: bool = False,
    compile_blocks: bool = False,
) -> dict:
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _MLP()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        if compile_blocks:
            layer.compile()
    fully_shard(model, mesh=mesh, mp_policy=policy)
    comms = compress(model, bucket_size=128, min_size=1024, **options) if options else []
    gathers = [m._get_fsdp_state()._fsdp_param_group._all_gather_comm for m in model.layers]
    replica_calls = []  # the all-reduces across replicas that were quantized
    real = cgx2.fsdp.allreduce_

    def counting(t, *args, **kwargs):
        replica_calls.append(t.numel())
        return real(t, *args, **kwargs)

    with mock.patch.object(cgx2.fsdp, "allreduce_", counting):
        losses = train_mlp(model, steps)
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    return {
        "losses": losses,
        "shards": shards,
        "replica_calls": len(replica_calls),
        "gathered": sum(getattr(g, "bytes_sent", 0) for g in gathers),
        "scattered": sum(c.bytes_sent for c in comms),
    }


def _replica_allreduce(op: str) -> dict:
    """One all-reduce through a QuantizedReplicaGroup with FSDP2's options (a ReduceOp in
    AllreduceOptions), against cgx2's collective on the same seed and the exact one."""
    rank = dist.get_rank()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, op.upper())
    got = x.clone()
    with cgx2.config.tuned(crossover_bytes=0):
        cgx2.manual_seed(5)
        QuantizedReplicaGroup(dist.group.WORLD, 4, 128).allreduce([got], opts).wait()
        cgx2.manual_seed(5)
        model = (
            cgx2.collectives.allreduce(x, dist.group.WORLD, CallSettings(4, 128, op))
            if op != "max"
            else None
        )
    exact = x.clone()
    dist.all_reduce(exact, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "avg":
        exact /= dist.get_world_size()
    return {"got": got, "model": model, "exact": exact}


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_the_replica_group_quantizes_sum_and_avg_as_fsdp_passes_them(dist2, op):
    results = dist2.run(_replica_allreduce, op)
    got, exact = results[0]["got"], results[0]["exact"]
    assert torch.equal(got, results[1]["got"])
    if op == "max":  # not a sum: the inner group's, exactly
        assert torch.equal(got, exact)
    else:
        assert torch.equal(got, results[0]["model"])
        assert not torch.equal(got, exact)


def _late(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_training_with_compressed_all_gather_and_reduce_scatter(dist2, bf16):
    plain = dist2.run(_train, None, 40, False, bf16)[0]["losses"]
    both = dist2.run(_train, {"bits": 4, "param_bits": 8}, 40, False, bf16)
    assert both[0]["losses"] == both[1]["losses"]
    assert both[0]["gathered"] > 0 and both[0]["scattered"] > 0
    losses = both[0]["losses"]
    assert losses != plain and plain[-1] < 0.7 * plain[0]
    assert abs(_late(losses) - _late(plain)) <= 0.05 * _late(plain), (losses, plain)


@pytest.mark.slow
def test_compiled_blocks_with_compressed_all_gather(dist2):
    eager = dist2.run(_train, {"bits": 4, "param_bits": 8}, 6)[0]["losses"]
    compiled = dist2.run(_train, {"bits": 4, "param_bits": 8}, 6, False, False, True)
    assert compiled[0]["gathered"] > 0
    assert compiled[0]["losses"] == pytest.approx(eager, rel=1e-4)


@pytest.mark.slow
def test_hsdp_compresses_the_all_reduce_across_replicas(dist4):
    plain = dist4.run(_train, None, 40, True)
    hsdp = dist4.run(_train, {"bits": 4}, 40, True)
    assert all(r["replica_calls"] > 0 for r in hsdp)
    assert plain[0]["replica_calls"] == 0
    # Ranks 0 and 2 (likewise 1 and 3) hold the same shard on two replicas: identical.
    for a, b in ((0, 2), (1, 3)):
        pairs = zip(hsdp[a]["shards"], hsdp[b]["shards"], strict=True)
        assert all(torch.equal(x, y) for x, y in pairs)
    losses, exact = hsdp[0]["losses"], plain[0]["losses"]
    assert losses != exact and _late(exact) < 0.3 * exact[0]
    # Each gradient quantized three times (reduce-scatter, then twice across replicas): the
    # late loss, a quarter of the first, within 2% of the first loss of uncompressed HSDP's.
    assert abs(_late(losses) - _late(exact)) <= 0.02 * exact[0], (losses, exact)
