"""Run by tests/comm/test_hosts.py under torchrun on two network-namespace hosts of two ranks
each (cgx2.testing.netlab): what users run across Ethernet-joined servers. Prints one line
``CHECK <rank> <name> <value>`` a check: True, or a digest that every rank prints alike
(``*_same``), or that ranks r and r + 2 print alike (``*_replica``: one shard, two hosts)."""

import os
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.collectives import hierarchical, reference_allreduce
from cgx2.comm import groups, shm


def say(name: str, value: object) -> None:
    print(f"CHECK {dist.get_rank()} {name} {value}", flush=True)


def digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def inputs(rank: int) -> torch.Tensor:
    return torch.randn(200_003, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say("spans_hosts", not shm.serves(dist.group.WORLD))
    with cgx2.config.tuned(crossover_bytes=0):
        # The flat quantized allreduce: the reference model's bytes on every rank.
        y = cgx2.quantized_allreduce(inputs(rank), 4, seed=5)
        model = reference_allreduce([inputs(r) for r in range(world)], 4, 512, 5)
        say("allreduce_is_model", torch.equal(y, model))
        say("allreduce_digest_same", digest(y))
        # Hierarchical: the node's plain reduce-scatter and all-gather by shared memory.
        mesh = hierarchical.node_mesh("cpu")
        say("node_on_shm", shm.serves(mesh.get_group("intra")))
        say(
            "hierarchical_digest_same",
            digest(cgx2.hierarchical_allreduce(inputs(rank), 4, mesh, seed=3)),
        )
        # The cgx backend, set up by CGX_* variables.
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = "4"
        group = dist.new_group(backend="cgx")
        t = inputs(rank)
        dist.all_reduce(t, group=group)
        say("backend_digest_same", digest(t))
        say("backend_close", bool((t - sum(inputs(r) for r in range(world))).abs().max() < 20))
        # The node mesh against the flat allreduce, timed on this link at the backend's first
        # compressed call: the same answer on every rank.
        (timed,) = [m for s in groups.states() for m in s.mesh_faster.values()]
        say("mesh_choice_same", zlib.crc32(repr(sorted(timed.items())).encode()))
        # Plain DDP on it: the buckets quantized on the group's worker during backward.
        say("backend_ddp_params_same", digest(train_ddp(rank, group)))
        del os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"]
    # DDP with CGX's hook on a compiled model: the replicas stay identical.
    from cgx2.ddp import CGXState, cgx_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = DDP(net)
    ddp.register_comm_hook(CGXState(None, 1024, {"bits": 4}, start_iter=0), cgx_hook)
    compiled = torch.compile(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with cgx2.config.tuned(crossover_bytes=0):  # the buckets are quantized, however small
        for step in range(4):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = compiled(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    say("ddp_compiled_params_same", digest(torch.cat([p.reshape(-1) for p in net.parameters()])))
    say("ddp_loss_finite", bool(torch.isfinite(loss).item()))
    # DDP with Global-QSGD's 4-bit standard dithering.
    from cgx2.ddp import GlobalQSGDState, standard_dithering_hook

    gqsgd = (GlobalQSGDState(dist.group.WORLD, bits=4), standard_dithering_hook)
    say("gqsgd_params_same", digest(train_ddp(rank, hook=gqsgd)))
    say("hsdp_replica", digest(train_hsdp(rank)))  # ranks r and r + 2: one shard, two hosts
    dist.destroy_process_group()


def train_ddp(
    rank: int, group: dist.ProcessGroup | None = None, hook: tuple | None = None
) -> torch.Tensor:
    """DDP over ``group`` (None: the world) with ``hook`` (its state and function; None: DDP's
    own allreduce, which the cgx backend quantizes): the parameters after three steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = DDP(net, process_group=group, bucket_cap_mb=0.02)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7 * step + rank))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def train_hsdp(rank: int) -> torch.Tensor:
    """FSDP2 on a (replicate across hosts) × (shard inside a host) mesh with cgx2's
    reduce-scatter, parameter all-gather and replica all-reduce, its blocks compiled: this
    rank's shards after three steps, the same on both hosts' rank of one shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import cgx2.fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
            layer.compile()
    fully_shard(net, mesh=mesh)
    cgx2.fsdp.compress(net, bits=4, param_bits=8, bucket_size=128, min_size=256)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with cgx2.config.tuned(crossover_bytes=0):
        for step in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(11 * step + rank))
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    return torch.cat([p.to_local().detach().reshape(-1) for p in net.parameters()])


if __name__ == "__main__":
    main()
