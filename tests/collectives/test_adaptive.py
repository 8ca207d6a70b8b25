"""Layer-wise bits (L-GreCo): the planner against brute force, the error model, and DDP
training with adaptive widths sending fewer bytes than uniform 4 bits at about the same loss."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from toy_task import backward, batch

import cgx2
from cgx2.collectives.adaptive import layer_errors, plan_bits
from cgx2.ddp import CGXState, cgx_hook

OPTIONS = (2, 3, 4, 6, 8)


@pytest.mark.parametrize("seed", range(20))
def test_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    layers = rng.randint(1, 4)
    numels = [rng.randint(100, 10_000) for _ in range(layers)]
    errors = [
        sorted((rng.uniform(0.1, 10) / (2**b - 1) ** 2 for b in OPTIONS), reverse=True)
        for _ in range(layers)
    ]
    budget = sum(row[OPTIONS.index(4)] for row in errors)
    resolution = 20_000
    plan = plan_bits(errors, numels, OPTIONS, budget, resolution, baseline=4)
    cost = lambda p: sum(n * b for n, b in zip(numels, p, strict=True))
    err = lambda p: sum(row[OPTIONS.index(b)] for row, b in zip(errors, p, strict=True))
    feasible = [p for p in itertools.product(OPTIONS, repeat=layers) if err(p) <= budget]
    assert err(plan) <= budget * (1 + layers / resolution)  # rounding: < one step per layer
    assert cost(plan) <= min(cost(p) for p in feasible) * 1.01  # optimal up to the rounding
    assert cost(plan) <= cost([4] * layers)


def test_plan_edges():
    assert plan_bits([], [], OPTIONS, 1.0) == []
    assert plan_bits([[1.0] * 5], [10], OPTIONS, 0.0) == [8]  # nothing fits: the widest
    assert plan_bits([[0.0] * 5], [10], OPTIONS, 0.0) == [2]  # a constant layer: the narrowest


def test_layer_errors_follow_the_step():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    errs = layer_errors(x, 512, (2, 4, 8)).tolist()
    assert errs[0] / errs[1] == pytest.approx((2**4 - 1) ** 2 / (2**2 - 1) ** 2)
    assert layer_errors(x * 3, 512, (4,)).item() == pytest.approx(9 * errs[1])
    assert layer_errors(torch.ones(1000), 512, (4,)).tolist() == [0.0]


class _Net(nn.Module):
    """Layers of different sizes and scales, so that widths can differ."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(32, 64)
        self.big = nn.Linear(64, 256)
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.big(torch.relu(self.small(x)))))


def _train(adaptive: bool, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    cgx2.manual_seed(0)
    model = DDP(_Net())
    state = CGXState(
        None,
        1024,
        {"bits": 4, "bucket_size": 128},
        adaptive_bits=OPTIONS if adaptive else None,
        replan_every=5,
    )
    model.register_comm_hook(state, cgx_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for step in range(steps):
        loss = backward(model, opt, *batch(10 * (step % 8) + rank))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "sent": state.bytes_sent,
        "plans": dict(state._bit_plans),
    }


@pytest.mark.slow
def test_adaptive_bits_send_less_at_about_the_same_loss(dist2):
    uniform = dist2.run(_train, False, 60)
    adaptive = dist2.run(_train, True, 60)
    a, b = adaptive
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert torch.equal(ga, gb)  # every rank chose the same widths
    assert a["plans"] == b["plans"] and a["plans"]
    assert a["sent"] < 0.95 * uniform[0]["sent"]
    late = lambda r: sum(r["losses"][-10:]) / 10
    assert late(a) <= 1.03 * late(uniform[0]), (late(a), late(uniform[0]))


def test_bad_adaptive_arguments():
    with pytest.raises(ValueError, match=r"must include bits \(4\)"):
        CGXState(None, compression_params={"bits": 4}, adaptive_bits=(2, 8))
    with pytest.raises(ValueError, match="replan_every"):
        CGXState(None, compression_params={"bits": 4}, adaptive_bits=(2, 4), replan_every=0)
