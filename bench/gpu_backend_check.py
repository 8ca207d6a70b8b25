"""GPU check of the ``cgx`` backend under torchrun: ``init_process_group("cgx")`` with CUDA
tensors on NCCL and CPU tensors on gloo in one group; the compressed all_reduce equals the
reference model bit for bit; everything else is exact; plain DDP gives identical gradients;
a cgx group in a job that says it spans nodes reduces hierarchically with
``LOCAL_WORLD_SIZE=2`` and flat with 1, bit-equal to its model either way; replaying CUDA
graphs gives the eager bytes.

Run: ``torchrun --nproc-per-node N bench/gpu_backend_check.py``; exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.update(CGX_COMPRESSION_QUANTIZATION_BITS="4", CGX2_CROSSOVER_BYTES="0")

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from common import finish_checks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.collectives import reference_allreduce
from cgx2.collectives.fusion import fuse_padded
from cgx2.seeding import call_seed


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


def _first_seed(seed: int) -> int:
    """cgx2's first call seed after ``cgx2.manual_seed(seed)``."""
    return call_seed(seed, 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def hierarchical_model(n: int, world: int, local: int, seed: int) -> torch.Tensor:
    """What a cgx group of ``world`` ranks as nodes of ``local`` returns for ``_input(r, n)``
    (default variant, SUM). Exact for ``local`` <= 2, where a node's sum has one order."""
    padded = [fuse_padded([_input(r, n)], 512)[0] for r in range(world)]
    nodes = [sum(padded[k * local : (k + 1) * local]) for k in range(world // local)]
    size = nodes[0].numel()
    shard = -(-size // local)
    nodes = [torch.cat([s, s.new_zeros(shard * local - size)]) for s in nodes]
    parts = [
        reference_allreduce([s[j * shard : (j + 1) * shard] for s in nodes], 4, 512, seed)
        for j in range(local)
    ]
    return torch.cat(parts)[:n]


def hierarchical_checks(rank: int, world: int, dev: torch.device) -> dict[str, bool]:
    ok = {}
    for local in (1, 2):
        if world % local or world // local < 2:
            continue
        saved = os.environ.get("LOCAL_WORLD_SIZE")
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        try:
            group = dist.new_group(backend="cgx")
            y = _input(rank, 1_000_003).to(dev)
            cgx2.manual_seed(4)
            dist.all_reduce(y, group=group)
            mesh = group.node_mesh(dev.type)
            model = hierarchical_model(1_000_003, world, local, _first_seed(4))
            # One rank a node has no node to reduce inside: the flat allreduce, the same bytes.
            name = "hierarchical" if local > 1 else "flat (one rank a node)"
            ok[f"{name} ({world // local} nodes of {local}) == model"] = (mesh is not None) == (
                local > 1
            ) and torch.equal(_bits(y.cpu()), _bits(model))
            dist.destroy_process_group(group)
        finally:
            if saved is None:
                del os.environ["LOCAL_WORLD_SIZE"]
            else:
                os.environ["LOCAL_WORLD_SIZE"] = saved
    return ok


def ddp_grads_identical(rank: int, world: int, dev: torch.device, width: int, steps: int) -> bool:
    """Plain DDP on the default (cgx) group, a two-layer MLP ``width`` wide, each rank its own
    batches for ``steps`` steps: whether every rank ends with the same gradients."""
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 8)).to(dev)
    )
    for step in range(steps):
        x = torch.randn(64, width, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x.to(dev)).square().mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(gathered, grads)
    return all(torch.equal(g, grads) for g in gathered)


def graph_checks(rank: int, world: int, dev: torch.device) -> dict[str, bool]:
    """The cgx group's compressed all_reduce replaying CUDA graphs: five calls
    on one buffer (eager, capture, three replays), each equal bit for bit to the eager one of
    its seed; DDP's buckets on it give every rank the same gradients."""
    from cgx2 import config
    from cgx2.collectives import graphs

    ok = {}
    x = _input(rank, 4_000_037).to(dev)
    eager = []
    with config.tuned(cuda_graphs=False):
        for k in range(5):
            y = x.clone()
            cgx2.manual_seed(10 + k)
            dist.all_reduce(y)
            eager.append(y)
    before = graphs.stats()
    try:
        with config.tuned(cuda_graphs=True):
            y, same = torch.empty_like(x), True
            for k in range(5):
                y.copy_(x)
                cgx2.manual_seed(10 + k)
                dist.all_reduce(y)
                same = same and torch.equal(_bits(y), _bits(eager[k]))
            after = graphs.stats()
            replays = after["replays"] - before["replays"]
            ok["all_reduce under CUDA graphs == eager, seed for seed"] = (
                same and replays == 4 and not torch.equal(eager[0], eager[1])
            )
            same = ddp_grads_identical(rank, world, dev, width=1024, steps=4)
            replays = graphs.stats()["replays"] - after["replays"]
            ok[f"DDP under CUDA graphs: grads identical on ranks ({replays} replays)"] = (
                same and replays > 0
            )
            ok["no capture failed"] = not graphs._CACHE.failed
    finally:
        graphs.clear()
    return ok


def checks(rank: int, world: int) -> dict[str, bool]:
    dev = torch.device("cuda", torch.cuda.current_device())
    ok: dict[str, bool] = {}
    group = dist.group.WORLD
    ok["backend is cgx"] = dist.get_backend() == "cgx" and isinstance(group, cgx2.CGXProcessGroup)
    for dtype in (torch.float32, torch.bfloat16):
        n = 1_000_003
        x = _input(rank, n, dtype)
        y = x.to(dev)
        cgx2.manual_seed(4)
        dist.all_reduce(y)
        inputs = [fuse_padded([_input(r, n, dtype)], 512)[0] for r in range(world)]
        model = reference_allreduce(inputs, 4, 512, _first_seed(4))[:n]
        ok[f"all_reduce {dtype} == reference"] = torch.equal(_bits(y.cpu()), _bits(model))
        z = x.to(dev)
        cgx2.manual_seed(4)
        z = funcol.wait_tensor(funcol.all_reduce(z, "sum", group))
        ok[f"functional all_reduce {dtype} == reference"] = torch.equal(
            _bits(z.cpu()), _bits(model)
        )
    i = torch.arange(1000, device=dev) * (rank + 1)
    dist.all_reduce(i)
    ok["int64 sum exact"] = torch.equal(i.cpu(), torch.arange(1000) * world * (world + 1) // 2)
    m = _input(rank, 5000).to(dev)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    ok["max exact"] = torch.equal(
        m.cpu(), torch.stack([_input(r, 5000) for r in range(world)]).amax(0)
    )
    c = _input(rank, 5000)  # a CPU tensor in the same group: gloo, compressed too
    cgx2.manual_seed(4)
    dist.all_reduce(c)
    inputs = [fuse_padded([_input(r, 5000)], 512)[0] for r in range(world)]
    ok["cpu all_reduce == reference"] = torch.equal(
        c, reference_allreduce(inputs, 4, 512, _first_seed(4))[:5000]
    )
    out = torch.empty(world * 3, device=dev)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=dev))
    ok["all_gather exact"] = torch.equal(
        out.cpu(), torch.arange(world).repeat_interleave(3).float()
    )
    b = torch.full((7,), float(rank), device=dev)
    dist.broadcast(b, src=world - 1)
    ok["broadcast exact"] = torch.equal(b.cpu(), torch.full((7,), world - 1.0))
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=dev))
    ok["reduce_scatter exact"] = torch.equal(
        out.cpu(), torch.arange(2.0 * rank, 2.0 * rank + 2) * world
    )
    out = torch.empty(world, device=dev)
    dist.all_to_all_single(out, torch.arange(world, device=dev) + 10.0 * rank)
    ok["all_to_all exact"] = torch.equal(out.cpu(), torch.arange(world) * 10.0 + rank)
    ok["DDP grads identical on ranks"] = ddp_grads_identical(rank, world, dev, width=256, steps=3)
    ok["DDP compressed"] = group.bytes_sent * 4 < group.bytes_uncompressed
    ok |= hierarchical_checks(rank, world, dev)
    ok |= graph_checks(rank, world, dev)
    dist.barrier()
    return ok


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("cgx")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = checks(rank, world)
    return finish_checks(
        ok,
        lambda failed: (
            f"cgx backend check on {world} x {torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}: {sum(ok.values())} of {len(ok)} ok on rank 0, "
            f"{'FAILURES on some rank' if failed else 'all ranks ok'}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
