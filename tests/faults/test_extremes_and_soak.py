"""Edge inputs give their documented outcome on every rank (guarantees.md), and thousands of
calls leak no memory, threads or file descriptors."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.ddp import CGXState, cgx_hook

FLT_MAX = torch.finfo(torch.float32).max


def _extremes() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    cases = {
        "empty": torch.zeros(0),
        "one value": torch.tensor([1.5 + rank]),
        "all equal": torch.full((2048,), 0.1 * (rank + 1)),
        # on rank 0 a bucket from -FLT_MAX to FLT_MAX (its range overflows), then an ordinary
        # one; rank 1 sends zeros there, so that the sum itself stays finite
        "range overflows": torch.cat(
            [torch.linspace(-1, 1, 512) * FLT_MAX * (rank == 0), torch.ones(512)]
        ),
        "huge, one sign": torch.full((1024,), 1e38) + torch.arange(1024.0) * 1e33,
        "subnormal": torch.linspace(0, 1e-40, 1024),
    }
    with cgx2.config.tuned(crossover_bytes=0):
        return {name: cgx2.quantized_allreduce(x, 4, op="avg") for name, x in cases.items()}


def test_edge_inputs_give_their_documented_outcome(dist2):
    out0, out1 = dist2.run(_extremes)
    for name in out0:
        assert torch.equal(out0[name].view(torch.int32), out1[name].view(torch.int32)), name
    assert out0["empty"].shape == (0,)
    assert out0["one value"].item() == 2.0  # a bucket of one value is exact: (1.5 + 2.5) / 2
    assert torch.equal(out0["all equal"], torch.full((2048,), 0.15))  # constant buckets exact
    # A bucket whose max - min overflows fp32 is coded at half scale: the average is finite,
    # within a step of each stage (2 FLT_MAX / 15 halved, then FLT_MAX / 15); its neighbour
    # is untouched.
    wide = out0["range overflows"][:512].double()
    want = (torch.linspace(-1, 1, 512) * FLT_MAX).double() / 2
    assert wide.isfinite().all() and (wide - want).abs().max() <= 2 * FLT_MAX / 15 * (1 + 1e-6)
    assert torch.equal(out0["range overflows"][512:], torch.ones(512))
    huge, want = out0["huge, one sign"], torch.full((1024,), 1e38) + torch.arange(1024.0) * 1e33
    assert huge.isfinite().all() and (huge - want).abs().max() < 2 * 1023e33 / 15  # two steps
    tiny = out0["subnormal"]
    # Within the range, but for the rounding of a subnormal step (guarantees.md).
    assert tiny.isfinite().all() and tiny.min() >= 0 and tiny.max() <= 1e-40 + 2**4 * 1.5e-45


def _process_footprint() -> tuple[int, int, int]:
    """Resident kilobytes, threads and open file descriptors of this process."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _soak(calls: int, steps: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    x = torch.randn(1 << 16)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)), bucket_cap_mb=0.1)
    model.register_comm_hook(CGXState(None, 16, {"bits": 4}, start_iter=0), cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def work(n_calls: int, n_steps: int) -> None:
        with cgx2.config.tuned(crossover_bytes=0):
            for _ in range(n_calls):
                cgx2.quantized_allreduce(x, 4)
            for _ in range(n_steps):
                opt.zero_grad()
                model(torch.randn(16, 256)).square().mean().backward()
                opt.step()

    work(calls // 10, steps // 10)  # warm: caches, pools and the worker thread exist after
    before = _process_footprint()
    work(calls, steps)
    return before, _process_footprint()


def test_thousands_of_calls_and_steps_leak_nothing(dist2):
    for before, after in dist2.run(_soak, 2000, 300):
        rss, threads, fds = (a - b for a, b in zip(after, before, strict=True))
        assert rss < 32 * 1024, f"resident memory grew by {rss} KiB"
        assert threads == 0 and fds == 0, (before, after)
