"""The ``cgx`` backend on gloo: compressed allreduce bit-equal to the reference model, exact
delegation of everything it does not compress, fusion, DDP with and without the hook."""

import contextlib
import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import toy_task
from env_vars import setenv
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.collectives import reference_allreduce
from cgx2.collectives.fusion import fuse_padded, fusion_batches, quantized_bytes_sent
from cgx2.ddp import CGXState, cgx_hook
from cgx2.seeding import call_seed

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _cgx_group(**env: str):
    """A ``cgx`` group over the pool's ranks, made and used with ``env`` set."""
    with setenv(**env):
        group = dist.new_group(backend="cgx")
        try:
            yield group
        finally:
            dist.destroy_process_group(group)


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


def _call_seeds(seed: int, count: int) -> list[int]:
    """The call seeds cgx2 draws after ``cgx2.manual_seed(seed)``."""
    return [call_seed(seed, k) for k in range(count)]


def _padded_reference(
    inputs: list[list[torch.Tensor]], bits: int, bucket: int, seed: int, op: str = "sum"
) -> list[torch.Tensor]:
    """What a fused quantized allreduce of the layers ``inputs[rank]`` returns."""
    fused = [fuse_padded(layers, bucket) for layers in inputs]
    out = reference_allreduce([f for f, _ in fused], bits, bucket, seed, op)
    starts = fused[0][1]
    return [out[s : s + t.numel()].view(t.shape) for s, t in zip(starts, inputs[0], strict=True)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------- functions run on every rank


def _compressed_all_reduce(dtype: torch.dtype, op: str) -> dict:
    rank = dist.get_rank()
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="4", CGX_COMPRESSION_BUCKET_SIZE="128") as g:
        assert dist.get_backend(g) == "cgx" and isinstance(g, cgx2.CGXProcessGroup)
        x = _input(rank, 1000, dtype)
        cgx2.manual_seed(3)
        y = x.clone()
        work = dist.all_reduce(
            y, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM, group=g, async_op=True
        )
        work.wait()
        future_value = work.get_future().value()[0]
        return {
            "x": x,
            "y": y,
            "same_tensor": future_value is y,
            "sent": g.bytes_sent,
            "plain": g.bytes_uncompressed,
        }


def _in_rank_order(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x`` in rank order: the plain allreduce through shared memory."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def _delegated_exactly() -> list[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = []
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="2", CGX_COMPRESSION_MINIMAL_SIZE="64") as g:
        cases = [
            (torch.arange(100, dtype=torch.int64) * (rank + 1), dist.ReduceOp.SUM),
            (torch.arange(100, dtype=torch.int32) - rank, dist.ReduceOp.SUM),
            (_input(rank, 300), dist.ReduceOp.MAX),
            (_input(rank, 300), dist.ReduceOp.MIN),
            (_input(rank, 300), dist.ReduceOp.PRODUCT),
            (_input(rank, 300, torch.float64), dist.ReduceOp.SUM),
            (_input(rank, 63), dist.ReduceOp.SUM),  # under CGX_COMPRESSION_MINIMAL_SIZE
        ]
        for x, op in cases:
            expected, got = x.clone(), x.clone()
            if op == dist.ReduceOp.SUM:  # through shared memory: the sum in rank order
                expected = _in_rank_order(x)
            else:
                dist.all_reduce(expected, op=op)  # the pool's own gloo group
            dist.all_reduce(got, op=op, group=g)
            checks.append(torch.equal(got, expected))
        x = _input(rank, 63)
        got = x.clone()
        dist.all_reduce(got, op=dist.ReduceOp.AVG, group=g)
        checks.append(torch.equal(got, _in_rank_order(x) / world))
        checks.append(g.bytes_sent == g.bytes_uncompressed > 0)
    return checks


def _functional_collective_is_quantized() -> bool:
    """torch's functional all_reduce (what compiled graphs call) on a cgx group."""
    import torch.distributed._functional_collectives as funcol

    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="3") as g:
        x = _input(dist.get_rank(), 2000)
        cgx2.manual_seed(8)
        functional = funcol.wait_tensor(funcol.all_reduce(x, "sum", g))
        cgx2.manual_seed(8)
        eager = x.clone()
        dist.all_reduce(eager, group=g)
        exact = x.clone()
        dist.all_reduce(exact)
        return _bits_equal(functional, eager) and not torch.equal(functional, exact)


def _bits_read_at_every_call() -> list[int]:
    rank = dist.get_rank()
    exact = []
    with _cgx_group() as g:
        for bits in ("32", "8", "32"):
            with setenv(CGX_COMPRESSION_QUANTIZATION_BITS=bits):
                x = _input(rank, 4096)
                got, expected = x.clone(), x.clone()
                dist.all_reduce(got, group=g)
                dist.all_reduce(expected)
                exact.append(int(torch.equal(got, expected)))
    return exact


def _coalesced(fusion_mb: str) -> dict:
    rank = dist.get_rank()
    sizes = [200_000, 50_000, 1000, 10, 300_000]  # 1 MiB: the first three, then the last
    with _cgx_group(
        CGX_COMPRESSION_QUANTIZATION_BITS="4",
        CGX_FUSION_BUFFER_SIZE_MB=fusion_mb,
        CGX_COMPRESSION_BUCKET_SIZE="512",
    ) as g:
        xs = [_input(rank, n, seed=i) for i, n in enumerate(sizes)]
        xs.append(torch.arange(7) * rank)  # integers: delegated
        ys = [x.clone() for x in xs]
        cgx2.manual_seed(11)
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            for y in ys:
                dist.all_reduce(y, group=g)
        cm.wait()
        return {"xs": xs, "ys": ys, "sent": g.bytes_sent}


def _collectives_delegated() -> list[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = []
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="4") as g:
        t = torch.full((5,), float(rank))
        dist.broadcast(t, src=1, group=g)
        ok.append(torch.equal(t, torch.full((5,), 1.0)))
        parts = [torch.empty(3) for _ in range(world)]
        dist.all_gather(parts, torch.full((3,), float(rank)), group=g)
        ok.append(all(torch.equal(p, torch.full((3,), float(r))) for r, p in enumerate(parts)))
        out = torch.empty(2 * world)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=g)
        ok.append(torch.equal(out, torch.arange(world).repeat_interleave(2).float()))
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * world), group=g)
        ok.append(torch.equal(out, torch.arange(2.0 * rank, 2.0 * rank + 2) * world))
        out = torch.empty(world)
        dist.all_to_all_single(out, torch.arange(world) + 10.0 * rank, group=g)
        ok.append(torch.equal(out, torch.arange(world) * 10.0 + rank))
        t = torch.full((4,), float(rank + 1))
        dist.reduce(t, dst=0, group=g)
        ok.append(rank != 0 or torch.equal(t, torch.full((4,), world * (world + 1) / 2)))
        parts = [torch.empty(2) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank)), parts, dst=0, group=g)
        ok.append(
            rank != 0
            or all(torch.equal(p, torch.full((2,), float(r))) for r, p in enumerate(parts))
        )
        out = torch.empty(2)
        sources = [torch.full((2,), r + 0.5) for r in range(world)] if rank == 0 else None
        dist.scatter(out, sources, src=0, group=g)
        ok.append(torch.equal(out, torch.full((2,), rank + 0.5)))
        objects = [None] * world
        dist.all_gather_object(objects, {"rank": rank}, group=g)
        ok.append(objects == [{"rank": r} for r in range(world)])
        if rank == 0:
            dist.send(torch.arange(3.0), dst=1, group=g)
        elif rank == 1:
            got = torch.empty(3)
            dist.recv(got, src=0, group=g)
            ok.append(torch.equal(got, torch.arange(3.0)))
        dist.barrier(group=g)
    return ok


def _empty_collectives(bits: str | None) -> list[tuple[str, object]]:
    """Every collective the backend implements, of 0-element tensors, on a ``cgx`` group at
    ``bits`` (None: a gloo group): what each returns, or the error it raises."""
    rank, world = dist.get_rank(), dist.get_world_size()
    empty = lambda: torch.empty(0)
    calls = {
        "all_reduce sum": lambda g: dist.all_reduce(t := empty(), group=g) or t,
        "all_reduce avg": lambda g: dist.all_reduce(t := empty(), dist.ReduceOp.AVG, g) or t,
        "all_reduce max": lambda g: dist.all_reduce(t := empty(), dist.ReduceOp.MAX, g) or t,
        "all_reduce 2-d": lambda g: dist.all_reduce(t := torch.empty(0, 5), group=g) or t,
        "all_reduce float64": lambda g: dist.all_reduce(t := empty().double(), group=g) or t,
        "coalesced": lambda g: (
            dist.all_reduce_coalesced(ts := [empty(), torch.ones(3)], group=g) or ts
        ),
        "broadcast": lambda g: dist.broadcast(t := empty(), src=0, group=g) or t,
        "all_gather": lambda g: (
            dist.all_gather(ps := [empty() for _ in range(world)], empty(), group=g) or ps
        ),
        "all_gather_into_tensor": lambda g: (
            dist.all_gather_into_tensor(o := empty(), empty(), group=g) or o
        ),
        "reduce_scatter_tensor": lambda g: (
            dist.reduce_scatter_tensor(o := empty(), empty(), group=g) or o
        ),
        "reduce_scatter": lambda g: (
            dist.reduce_scatter(o := empty(), [empty()] * world, group=g) or o
        ),
        "all_to_all_single": lambda g: dist.all_to_all_single(o := empty(), empty(), group=g) or o,
        "reduce": lambda g: dist.reduce(t := empty(), dst=0, group=g) or t,
        "gather": lambda g: dist.gather(
            empty(), [empty() for _ in range(world)] if rank == 0 else None, dst=0, group=g
        ),
        "scatter": lambda g: (
            dist.scatter(o := empty(), [empty()] * world if rank == 0 else None, src=0, group=g)
            or o
        ),
    }
    if bits is None:
        context = contextlib.nullcontext(dist.new_group(backend="gloo"))
    else:
        context = _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS=bits)
    out = []
    with context as g:
        for name, call in calls.items():
            try:
                out.append((name, call(g)))
            except Exception as e:
                out.append((name, f"{type(e).__name__}: {str(e)[:200]}"))
        if rank == 0:
            dist.send(empty(), dst=1, group=g)
        elif rank == 1:
            dist.recv(t := empty(), src=0, group=g)
            out.append(("send/recv", t))
        dist.barrier(group=g)
    return out


class _Net(toy_task.TwoLayers):
    def __init__(self) -> None:
        super().__init__(64, 96)


def _train(group: dist.ProcessGroup, hook_bits: int | None, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(_Net(), process_group=group)
    state = None
    if hook_bits is not None:
        state = CGXState(group, 1024, {"bits": hook_bits, "bucket_size": 128})
        model.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        loss = toy_task.backward(model, opt, *toy_task.batch(100 * (step % 3) + rank, (32, 64)))
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "state": state and state.bytes_sent}


def _ddp_plain_on_cgx() -> dict:
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="4") as g:
        cgx2.manual_seed(0)
        compressed = _train(g, None, 30)
        sent, plain = g.bytes_sent, g.bytes_uncompressed
    reference = _train(dist.group.WORLD, None, 30)
    return {"compressed": compressed, "reference": reference, "sent": sent, "plain": plain}


class _WithUnused(_Net):
    """_Net and a layer the loss never uses: DDP then allreduces which parameters were used,
    a collective of integers, at the end of every backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)


def _ddp_on_cgx_with_worker(on: bool) -> dict:
    """Plain DDP on the cgx backend, its buckets on the worker thread (or not), and calls made
    outside a backward pass (DDP's first broadcast) on the caller's thread."""
    from unittest import mock

    from cgx2 import config
    from cgx2.comm import worker

    submitted = mock.patch.object(worker, "submit", wraps=worker.submit)
    with (
        _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="4") as g,
        submitted as submit,
        config.tuned(comm_worker=on, crossover_bytes=0),
    ):
        cgx2.manual_seed(0)
        torch.manual_seed(0)
        model = DDP(_WithUnused(), process_group=g, bucket_cap_mb=0.01, find_unused_parameters=True)
        made = submit.call_count  # DDP's construction: broadcasts outside a backward pass
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        for step in range(4):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + g.rank()))
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            grads.append(
                {
                    n: p.grad.clone()
                    for n, p in model.module.named_parameters()
                    if p.grad is not None
                }
            )
            opt.step()
            losses.append(loss.item())
        return {
            "losses": losses,
            "grads": grads,
            "made": made,
            "submitted": submit.call_count,
            "sent": g.bytes_sent,
            "plain": g.bytes_uncompressed,
        }


def test_ddp_on_the_cgx_backend_reduces_on_the_worker_as_it_would_inline(dist2):
    """During the backward pass the cgx backend's CPU collectives run on the group's worker
    (DDP's buckets, and its count of used parameters), so autograd's thread goes on: the
    training is bit for bit what it is with CGX2_COMM_WORKER=0, and compressed."""
    on, off = dist2.run(_ddp_on_cgx_with_worker, True), dist2.run(_ddp_on_cgx_with_worker, False)
    for rank in range(2):
        assert on[rank]["made"] == 0 and on[rank]["submitted"] >= 4 * 3  # 2+ buckets, the map
        assert off[rank]["submitted"] == 0
        assert on[rank]["losses"] == off[rank]["losses"]
        for a, b in zip(on[rank]["grads"], off[rank]["grads"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        assert on[rank]["sent"] * 4 < on[rank]["plain"]
    assert all(
        torch.equal(on[0]["grads"][-1][n], on[1]["grads"][-1][n]) for n in on[0]["grads"][-1]
    )


def _hook_on_cgx_group() -> dict:
    """The hook's exact layers stay exact although the backend would compress all_reduce."""
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="2") as g:
        cgx2.manual_seed(5)
        on_cgx = _train(g, 4, 3)
    on_gloo_group = dist.new_group(backend="gloo")
    cgx2.manual_seed(5)
    on_gloo = _train(on_gloo_group, 4, 3)
    dist.destroy_process_group(on_gloo_group)
    return {"cgx": on_cgx, "gloo": on_gloo}


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_is_the_quantized_allreduce(dist2, dtype, op):
    results = dist2.run(_compressed_all_reduce, dtype, op)
    [seed] = _call_seeds(3, 1)
    [model] = _padded_reference([[r["x"]] for r in results], 4, 128, seed, op)
    for r in results:
        assert _bits_equal(r["y"], model)
        assert r["same_tensor"], "the work's future must hold the reduced tensor itself"
    expected = quantized_bytes_sent(1024, 2, 4, 128)
    assert results[0]["sent"] == expected
    assert results[0]["plain"] == 1000 * dtype.itemsize


def test_all_reduce_four_ranks(dist4):
    results = dist4.run(_compressed_all_reduce, torch.float32, "sum")
    [seed] = _call_seeds(3, 1)
    [model] = _padded_reference([[r["x"]] for r in results], 4, 128, seed)
    assert all(_bits_equal(r["y"], model) for r in results)


def test_what_cannot_be_compressed_is_delegated_exactly(dist2, dist4):
    for pool in (dist2, dist4):
        for checks in pool.run(_delegated_exactly):
            assert all(checks), checks


def test_functional_all_reduce_is_quantized(dist2):
    assert dist2.run(_functional_collective_is_quantized) == [True, True]


def test_torch_cgx_registers_the_backend():
    import torch_cgx

    assert "cgx" in dist.Backend.backend_list and torch_cgx.CGXProcessGroup is cgx2.CGXProcessGroup


def test_bits_are_read_at_every_allreduce(dist2):
    assert dist2.run(_bits_read_at_every_call) == [[1, 0, 1]] * 2


@pytest.mark.parametrize("fusion_mb", ["1", "0"])
def test_coalesced_allreduces_are_fused(dist2, fusion_mb):
    results = dist2.run(_coalesced, fusion_mb)
    xs = [r["xs"] for r in results]
    compressed = [0, 1, 2, 4]  # 10 values is under the minimal size 16; the ints are exact
    sizes = [xs[0][i].numel() for i in compressed]
    batches = fusion_batches(sizes, 4, 512, int(fusion_mb) << 20)
    assert len(batches) == (2 if fusion_mb == "1" else 4)
    seeds = _call_seeds(11, len(batches))
    expected_sent = 0
    for batch, seed in zip(batches, seeds, strict=True):
        layers = [[x[compressed[i]] for i in batch] for x in xs]
        models = _padded_reference(layers, 4, 512, seed)
        for i, model in zip(batch, models, strict=True):
            for r in results:
                assert _bits_equal(r["ys"][compressed[i]], model)
        expected_sent += quantized_bytes_sent(
            sum(-(-sizes[i] // 512) * 512 for i in batch), 2, 4, 512
        )
    for r in results:
        assert torch.equal(r["ys"][3], xs[0][3] + xs[1][3])
        assert torch.equal(r["ys"][5], xs[0][5] + xs[1][5])
    ring = 2 * 1 * (10 * 4 + 7 * 8) // 2
    assert results[0]["sent"] == expected_sent + ring


def test_fusion_batches():
    mb = 1 << 20
    assert fusion_batches([100, 100, 100], 4, 1, 800) == [[0, 1], [2]]
    assert fusion_batches([100, 100, 100], 4, 128, 1024) == [[0, 1], [2]]  # padded to 128
    assert fusion_batches([10, mb, 10, 10], 4, 512, mb) == [[0], [1], [2, 3]]
    assert fusion_batches([10, 10], 4, 512, 0) == [[0], [1]]
    assert fusion_batches([], 4, 512, mb) == []


def test_every_collective_is_delegated(dist2, dist4):
    for pool in (dist2, dist4):
        for checks in pool.run(_collectives_delegated):
            assert checks and all(checks), checks


def _described(results: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Each result as shapes and dtypes (tensors) or the error's text."""

    def describe(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        if isinstance(x, list):
            return [describe(y) for y in x]
        return x

    return [(name, describe(x)) for name, x in results]


@pytest.mark.parametrize("bits", ["4", "32"])
def test_empty_tensors_are_handled_as_gloo_does(dist2, bits):
    """A 0-element tensor through every collective the backend implements gives what gloo
    gives (the allreduce recursed between shared memory and the exact allreduce)."""
    gloo = [_described(r) for r in dist2.run(_empty_collectives, None)]
    cgx = [_described(r) for r in dist2.run(_empty_collectives, bits)]
    assert cgx == gloo
    assert not any(isinstance(x, str) for r in cgx for _, x in r), cgx


def _negative_view_against_its_values() -> list[bool]:
    """all_reduce and all_reduce_coalesced of negative views (which show ``x``, storing
    ``-x``) against the same calls on ``x`` itself, after the same seed: equal bits."""
    x = _input(dist.get_rank(), 4096)
    with _cgx_group(CGX_COMPRESSION_QUANTIZATION_BITS="4") as g:
        cgx2.manual_seed(7)
        plain = x.clone()
        dist.all_reduce(plain, group=g)
        coalesced_plain = [x.clone(), 2 * x]
        dist.all_reduce_coalesced(coalesced_plain, group=g)
        cgx2.manual_seed(7)
        view = (-x)._neg_view()
        dist.all_reduce(view, group=g)
        coalesced_views = [(-x)._neg_view(), (-2 * x)._neg_view()]
        dist.all_reduce_coalesced(coalesced_views, group=g)
    return [
        torch.equal(view, plain) and view.is_neg(),
        all(torch.equal(v, p) for v, p in zip(coalesced_views, coalesced_plain, strict=True)),
        not torch.equal(plain, x),  # it did reduce
    ]


def test_a_negative_view_is_reduced_as_the_values_it_shows(dist2):
    """The codecs read stored values: a negative view's are resolved first (before, its
    quantized sum rounded the stored values, not the ones it shows)."""
    for ok in dist2.run(_negative_view_against_its_values):
        assert ok == [True, True, True]


class _Barriers:
    """Stands in for a gloo or NCCL backend: records the barriers it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def barrier(self, opts: dist.BarrierOptions) -> str:
        self.calls += 1
        return "work"


@pytest.mark.parametrize(
    ("device", "runs_on"),
    [(torch.device("cpu"), "cpu"), (torch.device("cuda", 1), "cuda"), (None, "cuda")],
)
def test_barrier_runs_on_the_device_torch_names(device, runs_on):
    """dist.barrier() names the CPU for a group with a CPU backend (NCCL would put CPU ranks
    of a GPU host on one GPU), a GPU for a group bound to one; unnamed, the GPU as before."""
    group = cgx2.backend.CGXProcessGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    group._backends = {"cpu": _Barriers(), "cuda": _Barriers()}
    opts = dist.BarrierOptions()
    opts.device = device
    assert group.barrier(opts) == "work"
    assert {k: b.calls for k, b in group._backends.items()} == {
        "cpu": int(runs_on == "cpu"),
        "cuda": int(runs_on == "cuda"),
    }


def test_plain_ddp_on_the_cgx_backend_trains_compressed(dist2):
    results = dist2.run(_ddp_plain_on_cgx)
    a, b = results
    for ga, gb in zip(a["compressed"]["grads"], b["compressed"]["grads"], strict=True):
        assert all(torch.equal(ga[n], gb[n]) for n in ga), "ranks' gradients differ"
    assert a["sent"] * 5 < a["plain"]
    first = a["reference"]["grads"][0]["fc1.weight"]
    assert not torch.equal(a["compressed"]["grads"][0]["fc1.weight"], first)  # really quantized
    compressed, reference = a["compressed"]["losses"], a["reference"]["losses"]
    assert compressed[-1] < 0.8 * compressed[0]
    assert abs(sum(compressed[-5:]) - sum(reference[-5:])) / sum(reference[-5:]) < 0.05


def test_cgx_hook_on_the_cgx_backend(dist2):
    for r in dist2.run(_hook_on_cgx_group):
        for gc, gg in zip(r["cgx"]["grads"], r["gloo"]["grads"], strict=True):
            assert all(torch.equal(gc[n], gg[n]) for n in gc)
        assert r["cgx"]["losses"] == r["gloo"]["losses"]


_SEED_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
import torch_cgx

def main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group('cgx', init_method='env://', rank=rank, world_size=2)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    y = x.clone()
    dist.all_reduce(y)
    exact = x.clone()
    dist.all_reduce(exact, group=dist.new_group(backend="gloo"))
    err = (y - exact).abs().max().item()
    step = (exact.max() - exact.min()).item() / 15
    assert 0 < err < 2 * step, (err, step)
    assert dist.get_backend() == "cgx"
    dist.destroy_process_group()
    os.write(1, f"ok {rank}\\n".encode())  # one write: the two ranks share the pipe

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, nprocs=2)
"""


def _run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SEED_SCRIPT))
    return subprocess.run(
        [sys.executable, str(script), str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_init_process_group_cgx_as_in_the_usage_seed(tmp_path):
    done = _run_script(tmp_path, CGX_COMPRESSION_QUANTIZATION_BITS="4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n"))[-2:] == ["ok 0", "ok 1"]


@pytest.mark.slow
def test_bad_variable_fails_init_naming_it(tmp_path):
    done = _run_script(tmp_path, CGX_FUSION_BUFFER_SIZE_MB="lots")
    assert done.returncode != 0
    assert "CGX_FUSION_BUFFER_SIZE_MB='lots' is invalid" in done.stderr
