"""Compiled models with cgx2 on gloo: torch.compile under DDP with cgx_hook (DDPOptimizer) and
under FSDP2 with the quantized reduce-scatter give eager's losses; graph breaks are counted."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from toy_task import shard

import cgx2
from cgx2.ddp import CGXState, cgx_hook


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x = torch.randn(32, 64, generator=g)
        out.append((x, x[:, :4].argmax(dim=1)))
    return out


def _run(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cgx2.manual_seed(3)
    losses = []
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp(compiled: bool, hook: bool = True) -> tuple[list[float], dict, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DDP(_Net())
    state = CGXState(None, 1024, {"bits": 4, "bucket_size": 64})
    if hook:
        model.register_comm_hook(state, cgx_hook)
    runner = torch.compile(model) if compiled else model
    losses = _run(runner, 6)
    return losses, dict(counters["graph_break"]), state.bytes_sent


def _fsdp(compiled: bool) -> tuple[list[float], dict, int]:
    from torch._dynamo.utils import counters

    import cgx2.fsdp

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Net()
    shard(model, model.blocks)
    comms = cgx2.fsdp.compress(model, bits=4, bucket_size=64, min_size=1024)
    if compiled:
        for block in model.blocks:
            block.compile()
    losses = _run(model, 6)
    return losses, dict(counters["graph_break"]), sum(c.bytes_sent for c in comms)


@pytest.mark.slow
def test_compiled_ddp_with_cgx_hook_matches_eager(dist2):
    """DDPOptimizer path. Compiling DDP breaks the graph in DDP's own forward (functions
    dynamo skips), hook or no hook: the hook adds no break."""
    plain_breaks = dist2.run(_ddp, True, False)[0][1]
    for (eager, _, _), (compiled, breaks, sent) in zip(
        dist2.run(_ddp, False), dist2.run(_ddp, True), strict=True
    ):
        assert compiled == pytest.approx(eager, rel=1e-4)
        assert sent > 0  # the compiled model's buckets went through cgx_hook
        assert breaks == plain_breaks, breaks


@pytest.mark.slow
def test_compiled_fsdp2_with_quantized_reduce_scatter_matches_eager(dist2):
    for (eager, _, _), (compiled, breaks, sent) in zip(
        dist2.run(_fsdp, False), dist2.run(_fsdp, True), strict=True
    ):
        assert compiled == pytest.approx(eager, rel=1e-4)
        assert not breaks, breaks
        assert sent > 0


def _compiled_autograd() -> dict:
    """DDP's Python reducer under compiled autograd calls hook(state, (grad, param)) for each
    parameter; cgx_hook averages it in place, traced into the compiled backward."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        torch.manual_seed(0)
        model = DDP(_Net())
        model.register_comm_hook(CGXState(None, 1024, {"bits": 4, "bucket_size": 64}), cgx_hook)
        x, y = _batches(1)[0]
        cgx2.manual_seed(2)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            nn.functional.cross_entropy(torch.compile(model)(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    local = _Net()
    local.load_state_dict(model.module.state_dict())
    nn.functional.cross_entropy(local(x), y).backward()
    exact = {n: p.grad.clone() for n, p in local.named_parameters()}
    for g in exact.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return {"grads": grads, "exact": exact}


@pytest.mark.slow
def test_compiled_autograd_python_reducer(dist2):
    a, b = dist2.run(_compiled_autograd)
    for name, g in a["grads"].items():
        assert torch.equal(g, b["grads"][name]), name  # identical on every rank
        exact = a["exact"][name]
        if g.dim() > 1 and g.numel() >= 1024:  # the 64x64 weights: quantized
            assert not torch.equal(g, exact)
            step = (exact.max() - exact.min()) / 15
            assert (g - exact).abs().max() <= 4 * step, name
        else:  # biases and the 4x64 head: exact
            torch.testing.assert_close(g, exact, rtol=1e-5, atol=1e-7)
