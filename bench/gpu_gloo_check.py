"""GPU check of CUDA tensors on a gloo group (ranks may share one GPU): the quantized allreduce
equals the reference model bit for bit through both transports (shared memory: pinned, mapped
segments; the process group); the plain one sums in rank order; ranks that disagree raise; the
gradient flows; DDP's hooks give the same gradients on the group's worker thread as on
autograd's (CUDA streams).

Run: ``torchrun --nproc-per-node 2 bench/gpu_gloo_check.py``; exits 1 on any failure. Rank 0
prints one line a check and writes gpu_gloo_check_<device>_<regime>_w<W>_<date>.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.bench import report
from cgx2.collectives import policy, reference_allreduce, reference_reduce_scatter
from cgx2.collectives.agreement import DisagreementError
from cgx2.comm import shm
from cgx2.ddp import CGXState, cgx_hook
from cgx2.ddp import global_qsgd as gq
from cgx2.seeding import call_seed


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def allreduce_checks(rank: int, world: int, dev: torch.device) -> dict[str, bool]:
    ok = {}
    for transport in ("shm", "process_group"):
        with cgx2.config.tuned(crossover_bytes=0, transport=transport):
            for dtype in (torch.float32, torch.bfloat16):
                # 20M fp32 values: payload halves of 5 MiB, which gloo gathers in parts.
                for n in (1000, 3_000_017) + ((20_000_033,) if dtype == torch.float32 else ()):
                    cgx2.manual_seed(7)
                    y = cgx2.quantized_allreduce(_input(rank, n, dtype).to(dev), 4)
                    model = reference_allreduce(
                        [_input(r, n, dtype) for r in range(world)], 4, 512, call_seed(7, 0)
                    )
                    ok[f"{transport}: allreduce {dtype} n={n} == model"] = torch.equal(
                        _bits(y.cpu()), _bits(model)
                    )
    group = dist.group.WORLD
    ok["shm: the route's transport for these tensors"] = policy.route(
        _input(rank, 8).to(dev), group, 4, 512
    ).transport is shm and shm.serves(group)
    channel = shm._channel(group)
    ok["shm: segments pinned (cudaHostRegister)"] = dev.type != "cuda" or all(
        v.is_pinned() for v in channel.views
    )
    for dtype in (torch.float32, torch.bfloat16):
        n = 5_000_011  # pieces of PLAIN_PIECE_BYTES
        parts = [_input(r, n, dtype) for r in range(world)]
        want = parts[0] + parts[1]
        for other in parts[2:]:
            want += other
        got = shm.allreduce_plain_(_input(rank, n, dtype).to(dev), group, "sum")
        ok[f"shm: plain allreduce {dtype} == the rank-order sum"] = torch.equal(
            _bits(got.cpu()), _bits(want)
        )
    with cgx2.config.tuned(crossover_bytes=0):
        try:
            cgx2.quantized_allreduce(torch.ones(1024 if rank == 0 else 1000, device=dev), 4)
            ok["disagreeing numel raises"] = False
        except DisagreementError as e:
            ok["disagreeing numel raises"] = "numel=[rank 0: 1024, rank 1: 1000]" in str(e)
        ok.update(_deferred_checks(rank, dev))
        x = _input(rank, 4096).to(dev).requires_grad_()
        (cgx2.quantized_allreduce(x, 32, op="avg") * (rank + 1)).sum().backward()
        want = sum(r + 1 for r in range(world)) / world
        ok["gradient == allreduce of the output's gradient"] = bool(
            torch.allclose(x.grad, torch.full_like(x, want))
        )
    return ok


def _deferred_checks(rank: int, dev: torch.device) -> dict[str, bool]:
    """The check as CUDA tensors on NCCL get it (CGX2_CHECK_AGREEMENT=deferred): compared on
    the GPU, the result poisoned, the error raised once the answer reaches the host."""
    ok = {}
    with cgx2.config.tuned(check_agreement="deferred"):
        x = _input(rank, 4096).to(dev)
        checked = cgx2.quantized_allreduce(x, 4, seed=5)
        with cgx2.config.tuned(check_agreement="off"):
            unchecked = cgx2.quantized_allreduce(x, 4, seed=5)
        ok["deferred: agreeing ranks get the unchecked result"] = torch.equal(checked, unchecked)
        y = torch.ones(1024 if rank == 0 else 1000, device=dev)
        message = ""
        try:  # raised by the call itself, or by the next one where the answer came late
            cgx2.quantized_allreduce_(y, 4)
            cgx2.quantized_allreduce(x, 4)
        except DisagreementError as e:
            message = str(e)
        ok["deferred: disagreeing numel raises"] = "numel=[rank 0: 1024, rank 1: 1000]" in message
        if dev.type == "cuda":
            ok["deferred: disagreeing ranks' results are NaN"] = bool(y.isnan().all())
        else:  # CPU tensors are checked at once: nothing moved, nothing written
            ok["deferred on CPU: raised before the call"] = bool((y == 1).all())
    return ok


def _train(hook: str, worker: bool, dev: torch.device, rank: int) -> torch.Tensor:
    """Three steps of a small MLP under DDP with ``hook``; the gradients of the last step."""
    cgx2.manual_seed(3)
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8)).to(dev), bucket_cap_mb=0.2
    )
    if hook == "cgx":
        state = CGXState(None, 16, {"bits": 4}, start_iter=0, error_feedback=True)
        model.register_comm_hook(state, cgx_hook)
    else:
        model.register_comm_hook(gq.GlobalQSGDState(error_feedback=True), getattr(gq, hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with cgx2.config.tuned(comm_worker=worker, crossover_bytes=0):
        for step in range(3):
            x = torch.randn(32, 256, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            model(x.to(dev)).square().mean().backward()
            opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()


def hook_checks(rank: int, world: int, dev: torch.device) -> dict[str, bool]:
    ok = {}
    for hook in ("cgx", "standard_dithering_4bit_hook", "qsgd_hook"):
        on, off = _train(hook, True, dev, rank), _train(hook, False, dev, rank)
        gathered = [torch.empty_like(on) for _ in range(world)]
        dist.all_gather(gathered, on)
        ok[f"{hook}: worker thread == autograd's thread, ranks equal"] = torch.equal(
            _bits(on), _bits(off)
        ) and all(torch.equal(g, gathered[0]) for g in gathered)
    return ok


def fsdp_dtensor_checks(rank: int, world: int, dev: torch.device) -> dict[str, bool]:
    """CUDA tensors through the parameter all-gather (the Triton nearest-rounding encoder), the
    reduce-scatter op and QuantizedPartial: the same bytes as the CPU reference codec's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from cgx2.collectives.all_gather import all_gather
    from cgx2.dtensor import QuantizedPartial

    ok = {}
    segments = [(0, 3000, True), (3000, 100, False), (3100, 900, True)]
    with cgx2.config.tuned(crossover_bytes=0):
        for dtype in (torch.float32, torch.bfloat16):
            x = _input(rank, 4000, dtype)
            got = torch.empty(world * 4000, dtype=dtype, device=dev)
            all_gather(got, x.to(dev), dist.group.WORLD, 8, 512, segments)
            want = torch.empty(world * 4000, dtype=dtype)
            all_gather(want, x, dist.group.WORLD, 8, 512, segments)  # the reference, on the CPU
            ok[f"param all-gather {str(dtype)[6:]} == the CPU reference"] = torch.equal(
                _bits(got.cpu()), _bits(want)
            )
        x = _input(rank, world * 5000)
        got = cgx2.quantized_reduce_scatter(x.to(dev), 4, seed=21)
        model = reference_reduce_scatter(
            [_input(r, world * 5000) for r in range(world)], 4, 512, 21
        )[rank]
        ok["quantized_reduce_scatter == the reference"] = torch.equal(
            _bits(got.cpu()), _bits(model)
        )
        mesh = init_device_mesh(dev.type, (world,))
        cgx2.manual_seed(8)
        dt = DTensor.from_local(x.to(dev), mesh, [QuantizedPartial(4)], run_check=False)
        replicated = dt.redistribute(mesh, [Replicate()]).to_local()
        cgx2.manual_seed(8)
        ok["QuantizedPartial -> Replicate == the quantized allreduce"] = torch.equal(
            replicated, cgx2.quantized_allreduce(x.to(dev), 4)
        )
    return ok


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:  # the same checks on CPU tensors, to try the script anywhere
        dev = torch.device("cpu")
    ok = {
        **allreduce_checks(rank, world, dev),
        **hook_checks(rank, world, dev),
        **fsdp_dtensor_checks(rank, world, dev),
    }
    failed = [name for name, good in ok.items() if not good]
    if rank == 0:
        for name, good in ok.items():
            print(f"{'ok  ' if good else 'FAIL'} {name}")
        env = report.environment(dev, world)
        path = report.write_json("gpu_gloo_check", {"env": env, "checks": ok}, "bench/results")
        print(f"gpu_gloo_check: {len(ok) - len(failed)} of {len(ok)} passed -> {path}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
