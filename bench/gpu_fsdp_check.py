"""GPU check of cgx2's FSDP2 collectives under torchrun: the quantized reduce-scatter on NCCL
equals the single-process model bit for bit, and FSDP2 training with ``cgx2.fsdp.compress``
tracks uncompressed FSDP2: the reduce-scatter alone, with the parameters' quantized all-gather,
and HSDP (2 replicas) with the all-reduce across replicas quantized.

Run: ``torchrun --nproc-per-node N bench/gpu_fsdp_check.py``; exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["CGX2_CROSSOVER_BYTES"] = "0"  # quantize whatever the size

import torch
import torch.distributed as dist
from common import finish_checks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cgx2
import cgx2.fsdp
from cgx2.fsdp import compress, reduce_scatter_quantized, reference_reduce_scatter
from cgx2.seeding import call_seed

REPLICA_CALLS = [0]  # quantized all-reduces across replicas in the last _train


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _first_seed(seed: int) -> int:
    """cgx2's first call seed after ``cgx2.manual_seed(seed)``."""
    return call_seed(seed, 0)


def _train(
    bits: int | None,
    bf16: bool,
    steps: int = 30,
    param_bits: int | None = None,
    replicas: int = 1,
    keep: bool = False,
) -> list[float]:
    rank, dev = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh(
            "cuda", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)], nn.Linear(512, 8)
    ).to(dev)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.bfloat16 if bf16 else None
    )
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if bits:
        compress(model, bits=bits, param_bits=param_bits, keep_quantized_params=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cgx2.manual_seed(0)
    losses = []
    real = cgx2.fsdp.allreduce_

    def counting(*args, **kwargs):  # the all-reduces across replicas that were quantized
        REPLICA_CALLS[0] += 1
        return real(*args, **kwargs)

    patch = mock.patch.object(cgx2.fsdp, "allreduce_", counting)
    REPLICA_CALLS[0] = 0
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * (step % 5) + rank)
        x = torch.randn(256, 512, generator=g).to(dev)
        y = (x[:, :8].argmax(dim=1)).to(dev)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with patch:
            loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok: dict[str, bool] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for scale in (None, 1 / world, 0.25):
            n = 100_003
            x = _input(rank, world * n, dtype).cuda()
            out = torch.empty(n, dtype=dtype, device="cuda")
            cgx2.manual_seed(9)
            reduce_scatter_quantized(
                out, x, dist.group.WORLD, cgx2.collectives.CallSettings(4, 512), scale
            )
            if rank == 0:
                inputs = [_input(r, world * n, dtype) for r in range(world)]
                model = reference_reduce_scatter(inputs, 4, 512, _first_seed(9), scale)[0]
                ok[f"reduce-scatter {dtype} scale={scale} == reference"] = torch.equal(
                    out.cpu(), model.to(dtype)
                )
    runs = [(bf16, None, 1) for bf16 in (False, True)] + [(bf16, 8, 1) for bf16 in (False, True)]
    if world % 2 == 0:
        runs += [(False, 8, 2)]
    for bf16, param_bits, replicas in runs:
        plain = _train(None, bf16, replicas=replicas)
        four = _train(4, bf16, param_bits=param_bits, replicas=replicas)
        if replicas > 1:
            ok[f"HSDP: the all-reduce across replicas quantized ({REPLICA_CALLS[0]} calls)"] = (
                REPLICA_CALLS[0] > 0
            )
        late_plain, late_four = sum(plain[-10:]) / 10, sum(four[-10:]) / 10
        what = (
            f"{'HSDP 2 replicas' if replicas > 1 else 'FSDP2'} {'bf16' if bf16 else 'fp32'}"
            f"{f', {param_bits}-bit all-gather' if param_bits else ''}"
        )
        ok[
            f"{what}: 4-bit loss (mean of the last 10 steps) within 2% of the first loss from "
            f"plain's ({late_four:.4f} vs {late_plain:.4f}, first {plain[0]:.4f})"
        ] = abs(late_four - late_plain) <= 0.02 * plain[0] and late_plain < 0.5 * plain[0]
    # The 8-bit parameters kept for the backward: the backward decodes the forward's rows, so
    # the steps are the same, bit for bit.
    for bf16 in (False, True):
        gathered = _train(4, bf16, steps=10, param_bits=8)
        kept = _train(4, bf16, steps=10, param_bits=8, keep=True)
        ok[
            f"FSDP2 {'bf16' if bf16 else 'fp32'}, 8-bit parameters kept for the backward: "
            "losses == gathered twice"
        ] = kept == gathered
    return finish_checks(
        ok,
        lambda failed: (
            f"FSDP2 check on {world} x {torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}: {'FAILURES' if failed else 'all ok'}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
