"""Run by tests/comm/test_shm_hosts.py on each of two network-namespace hosts under torchrun:
prints whether the world group rides shared memory, whether the node's group does, and whether
the hierarchical allreduce is identical on every rank."""

import torch
import torch.distributed as dist

import cgx2
from cgx2.collectives import hierarchical
from cgx2.comm import shm

dist.init_process_group("gloo")
r = dist.get_rank()
world = dist.group.WORLD
spans = not shm.serves(world)
mesh = hierarchical.node_mesh("cpu")
intra = mesh.get_group("intra")
inside = shm.serves(intra)
x = torch.randn(100_000, generator=torch.Generator().manual_seed(r))
y = cgx2.hierarchical_allreduce(x, 4, mesh, seed=3)
ys = [torch.empty_like(y) for _ in range(dist.get_world_size())]
dist.all_gather(ys, y)
identical = all(torch.equal(a, ys[0]) for a in ys)
print(f"rank {r}: world spans hosts={spans}, node group on shm={inside}, identical={identical}",
      flush=True)  # fmt: skip
dist.destroy_process_group()
