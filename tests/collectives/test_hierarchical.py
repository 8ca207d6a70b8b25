"""Hierarchical allreduce on 4 gloo ranks as 2 "nodes" of 2: bit-equal to the model built from
the reference allreduce of the node sums, identical on every rank, both variants."""

import os

import pytest
import torch
import torch.distributed as dist

from cgx2.collectives import reference_allreduce
from cgx2.collectives.hierarchical import hierarchical_allreduce, node_mesh
from cgx2.config import refresh


def _input(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(n, generator=g) * (rank + 1) + rank


def _run(n: int, intra_broadcast: bool, op: str) -> dict:
    from unittest import mock

    from cgx2.comm import shm

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    refresh()  # cgx2 reads the variables once
    try:
        mesh = node_mesh("cpu")
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
        refresh()
    x = _input(dist.get_rank(), n)
    inside = mock.Mock(wraps=shm.reduce_scatter_plain)
    with mock.patch.object(shm, "reduce_scatter_plain", inside):
        out = hierarchical_allreduce(
            x, 4, mesh, op=op, bucket_size=128, intra_broadcast=intra_broadcast, seed=5
        )
    groups = tuple(dist.get_process_group_ranks(mesh.get_group(d)) for d in ("inter", "intra"))
    inside_shm = inside.call_count == 1 and shm.serves(mesh.get_group("intra"))
    return {"x": x, "out": out, "groups": groups, "inside_shm": inside_shm}


def _model(xs: list[torch.Tensor], intra_broadcast: bool, op: str, seed: int = 5) -> torch.Tensor:
    """Nodes {0,1} and {2,3}; a sum of two fp32 values does not depend on order."""
    node_sums = [xs[0] + xs[1], xs[2] + xs[3]]
    if intra_broadcast:
        out = reference_allreduce(node_sums, 4, 128, seed)
    else:
        n, local = xs[0].numel(), 2
        half = -(-n // local)
        padded = [torch.cat([s, s.new_zeros(half * local - n)]) for s in node_sums]
        shards = [
            reference_allreduce([p[j * half : (j + 1) * half] for p in padded], 4, 128, seed)
            for j in range(local)
        ]
        out = torch.cat(shards)[:n]
    return out / 4 if op == "avg" else out


@pytest.mark.parametrize("intra_broadcast", [False, True])
@pytest.mark.parametrize(("n", "op"), [(5001, "sum"), (1000, "avg")])
def test_hierarchical_allreduce_matches_model(dist4, intra_broadcast, n, op):
    results = dist4.run(_run, n, intra_broadcast, op)
    assert results[0]["groups"] == ([0, 2], [0, 1])
    assert results[3]["groups"] == ([1, 3], [2, 3])
    model = _model([r["x"] for r in results], intra_broadcast, op)
    exact = sum(r["x"] for r in results) / (4 if op == "avg" else 1)
    for r in results:
        assert torch.equal(r["out"], model)
        # The node's reduce-scatter rides shared memory (where the variant has one).
        assert r["inside_shm"] or intra_broadcast
    assert not torch.equal(model, exact)
    assert (model - exact).abs().max() < 0.3 * exact.abs().max()


def test_node_mesh_needs_a_divisor(dist2):
    assert dist2.run(_bad_local) == ["LOCAL_WORLD_SIZE=3 does not divide"] * 2


def _bad_local() -> str:
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    refresh()  # cgx2 reads the variables once
    try:
        node_mesh("cpu")
    except ValueError as e:
        return str(e)[:34]
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
        refresh()
    return "no error"


def _hook_on_two_nodes() -> dict:
    """4 ranks, LOCAL_WORLD_SIZE=2: CGXState builds the node mesh itself."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cgx2
    from cgx2.ddp import CGXState, cgx_hook

    # Compressing at every size, over the mesh: the path is tested here, not where it pays.
    os.environ.update(LOCAL_WORLD_SIZE="2", WORLD_SIZE="4", CGX2_CROSSOVER_BYTES="0")
    refresh()  # cgx2 reads the variables once
    try:
        with cgx2.config.tuned(node_mesh=True):
            grads = {}
            for mesh in ("auto", None):
                torch.manual_seed(0)
                model = DDP(nn.Linear(128, 64))
                params = {"bits": 4, "bucket_size": 128}
                state = CGXState(None, 1024, params, mesh=mesh, start_iter=0)
                model.register_comm_hook(state, cgx_hook)
                cgx2.manual_seed(1)
                model(_input(dist.get_rank(), 8 * 128).view(8, 128)).square().sum().backward()
                grads[str(mesh)] = model.module.weight.grad.clone()
                shape = None if state.mesh is None else tuple(state.mesh.shape)
                grads[f"{mesh}-mesh"] = shape
            return grads
    finally:
        for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "CGX2_CROSSOVER_BYTES"):
            del os.environ[k]
        refresh()


def test_cgx_hook_goes_hierarchical_across_nodes(dist4):
    results = dist4.run(_hook_on_two_nodes)
    for r in results:
        assert r["auto-mesh"] == (2, 2) and r["None-mesh"] is None
        assert torch.equal(r["auto"], results[0]["auto"])  # identical on every rank
        assert not torch.equal(r["auto"], r["None"])  # another path than the flat allreduce
        scale = r["None"].abs().max()
        assert (r["auto"] - r["None"]).abs().max() < 0.2 * scale


def _mesh_timed_at_first_use() -> dict:
    """4 ranks, LOCAL_WORLD_SIZE=2, CGX2_NODE_MESH=auto: the hook's first compressed bucket
    times the mesh against the flat allreduce (at two small sizes here), once."""
    import importlib
    from unittest import mock

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cgx2
    from cgx2.collectives import measure
    from cgx2.ddp import CGXState, cgx_hook

    hook_module = importlib.import_module("cgx2.ddp.cgx_hook")  # (the package's name: the hook)

    answers = []

    def recorded(*args, **kwargs):
        answers.append(real(*args, **kwargs))
        return answers[-1]

    real = measure.mesh_against_flat
    over_mesh = mock.Mock(wraps=hook_module.hierarchical_allreduce_fused_)
    os.environ.update(LOCAL_WORLD_SIZE="2", WORLD_SIZE="4", CGX2_CROSSOVER_BYTES="0")
    refresh()  # cgx2 reads the variables once
    try:
        with (
            cgx2.config.tuned(node_mesh=None),
            mock.patch.object(measure, "MESH_SIZES", (1 << 12, 1 << 16)),
            mock.patch.object(measure, "mesh_against_flat", recorded),
            mock.patch.object(hook_module, "hierarchical_allreduce_fused_", over_mesh),
        ):
            torch.manual_seed(0)
            model = DDP(nn.Linear(128, 64))
            state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=0)
            model.register_comm_hook(state, cgx_hook)
            for _ in range(2):
                model(_input(dist.get_rank(), 8 * 128).view(8, 128)).square().sum().backward()
        return {
            "answers": answers,
            "over_mesh": over_mesh.call_count,
            "grad": model.module.weight.grad.clone(),
        }
    finally:
        for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "CGX2_CROSSOVER_BYTES"):
            del os.environ[k]
        refresh()


def test_the_hook_times_the_node_mesh_against_the_flat_allreduce_at_first_use(dist4):
    """mesh="auto" across nodes, CPU tensors: timed once, every rank the same answer, and the
    bucket (33 kB: nearest the 64 KiB size) goes the way that won there, alike everywhere."""
    results = dist4.run(_mesh_timed_at_first_use)
    (answer,) = results[0]["answers"]
    assert sorted(answer) == [1 << 12, 1 << 16]
    for r in results:
        assert r["answers"] == [answer]
        assert r["over_mesh"] == (2 if answer[1 << 16] else 0)
        assert torch.equal(r["grad"], results[0]["grad"])


def _backend_on_two_nodes(
    intra_broadcast: bool, op: str, n: int = 5001, algorithm: str = "auto"
) -> dict:
    """A ``cgx`` group over the 4 ranks of a job that the launcher says spans 2 nodes."""
    import cgx2

    env = {
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "CGX_COMPRESSION_QUANTIZATION_BITS": "4",
        "CGX_COMPRESSION_BUCKET_SIZE": "128",
        "CGX_INTRA_BROADCAST": str(int(intra_broadcast)),
        "CGX2_CROSSOVER_BYTES": "0",  # the path is tested here, not where compression pays
    }
    os.environ.update(env)
    refresh()  # cgx2 reads the variables once
    try:
        # the mesh's path, wherever it pays
        with cgx2.config.tuned(node_mesh=True, algorithm=algorithm):
            group = dist.new_group(backend="cgx")
            x = _input(dist.get_rank(), n)
            y = x.clone()
            cgx2.manual_seed(7)
            dist.all_reduce(
                y, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM, group=group
            )
            mesh = group.node_mesh("cpu")
            out = {"x": x, "y": y, "mesh": tuple(mesh.shape), "sent": group.bytes_sent}
            dist.destroy_process_group(group)
            return out
    finally:
        for k in env:
            del os.environ[k]
        refresh()


@pytest.mark.parametrize(("intra_broadcast", "op"), [(False, "sum"), (True, "avg")])
def test_cgx_backend_goes_hierarchical_across_nodes(dist4, intra_broadcast, op):
    """dist.all_reduce on a cgx world group of a 2-node job: plain inside the nodes, quantized
    between them, bit-equal to the model of the fused (bucket-padded) tensor."""
    from cgx2.collectives.fusion import fuse_padded
    from cgx2.seeding import call_seed

    results = dist4.run(_backend_on_two_nodes, intra_broadcast, op)
    seed = call_seed(7, 0)  # cgx2's first call seed after manual_seed(7)
    padded = [fuse_padded([r["x"]], 128)[0] for r in results]
    model = _model(padded, intra_broadcast, op, seed)[:5001]
    for r in results:
        assert r["mesh"] == (2, 2) and r["sent"] > 0
        assert torch.equal(r["y"], model)


def test_between_nodes_gathering_all_is_its_model_and_counts_its_bytes(dist4):
    """CGX2_ALGORITHM=allgather between the nodes: the model of the node sums' gather-all
    allreduce, bit for bit; the bytes counted as it sends them (each shard's whole payload to
    the other node, not two chunks' rows)."""
    from cgx2.codecs import ChunkedLayout
    from cgx2.collectives.fusion import fuse_padded, ring_bytes_sent
    from cgx2.config import tuned
    from cgx2.seeding import call_seed

    n = 5300  # 42 buckets of 128: a shard of 21 each node, chunks of 11 and 10 buckets
    results = dist4.run(_backend_on_two_nodes, False, "sum", n, "allgather")
    padded = [fuse_padded([r["x"]], 128)[0] for r in results]
    with tuned(algorithm="allgather"):
        model = _model(padded, False, "sum", call_seed(7, 0))[:n]
    whole = ChunkedLayout.split(21 * 128, 1, 4, 128, False).payload_nbytes
    rows = 2 * ChunkedLayout.split(21 * 128, 2, 4, 128, False).payload_nbytes
    assert whole != rows  # the count tells the algorithms apart at this size
    for r in results:
        assert torch.equal(r["y"], model)
        assert r["sent"] == ring_bytes_sent(42 * 128 * 4, 2) + whole


def _meshes_with_options() -> list:
    from cgx2.ddp import CGXState

    os.environ.update(LOCAL_WORLD_SIZE="2", WORLD_SIZE="4")
    refresh()  # cgx2 reads the variables once
    try:
        params = {"bits": 4}
        return [
            CGXState(None, compression_params=params, **kw).mesh is None
            for kw in ({}, {"error_feedback": True}, {"adaptive_bits": (2, 4, 8)})
        ]
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["WORLD_SIZE"]
        refresh()


def test_auto_mesh_steps_aside_for_error_feedback_and_adaptive_widths(dist4):
    """On several nodes mesh="auto" builds the node mesh, except with error feedback or
    adaptive widths, which do not combine with it yet: those keep the flat allreduce."""
    for r in dist4.run(_meshes_with_options):
        assert r == [False, True, True]
