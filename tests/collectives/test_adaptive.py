"""Layer-wise bits (L-GreCo): the planners against brute force (fewest bytes within an error,
least error within bits a value), the error model (rotated too), and DDP training with adaptive
widths sending fewer bytes than uniform 4 bits at about the same loss, or within a bits budget."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from toy_task import backward, batch

import cgx2
from cgx2.codecs.rotation import hadamard_rotate
from cgx2.collectives.adaptive import (
    layer_errors,
    plan_bits,
    plan_bits_within_bytes,
    plan_widths,
)
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


def _train(adaptive: bool, steps: int, bits: int = 4, settings: dict | None = None) -> dict:
    """Train _Net with CGXState at ``bits`` (``settings``: more of its keywords), adaptive
    widths (``OPTIONS``, re-planned every 5 calls unless ``settings`` says) or not: the losses,
    the averaged gradients and the plans in force at every step, the bytes sent and the
    compressed layers' sizes by bucket."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    cgx2.manual_seed(0)
    model = DDP(_Net())
    state = CGXState(
        None,
        1024,
        {"bits": bits, "bucket_size": 128},
        **{"adaptive_bits": OPTIONS if adaptive else None, "replan_every": 5, **(settings or {})},
    )
    model.register_comm_hook(state, cgx_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads, plans = [], [], []
    for step in range(steps):
        loss = backward(model, opt, *batch(10 * (step % 8) + rank))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        plans.append(dict(state._bit_plans))
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "sent": state.bytes_sent,
        "plans": plans,
        "numels": {i: [n for _, n in plan.compressed] for i, plan in state._plans.items()},
    }


@pytest.mark.slow
def test_adaptive_bits_send_less_at_about_the_same_loss(dist2):
    uniform = dist2.run(_train, False, 60)
    adaptive = dist2.run(_train, True, 60)
    a, b = adaptive
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert torch.equal(ga, gb)  # every rank chose the same widths
    assert a["plans"] == b["plans"] and a["plans"][-1]
    assert a["sent"] < 0.95 * uniform[0]["sent"]
    late = lambda r: sum(r["losses"][-10:]) / 10
    assert late(a) <= 1.03 * late(uniform[0]), (late(a), late(uniform[0]))


def test_bad_adaptive_arguments():
    with pytest.raises(ValueError, match=r"must include bits \(4\)"):
        CGXState(None, compression_params={"bits": 4}, adaptive_bits=(2, 8))
    with pytest.raises(ValueError, match="replan_every"):
        CGXState(None, compression_params={"bits": 4}, adaptive_bits=(2, 4), replan_every=0)


# ------------------------------------------------------- least error within bits a value


def _table(seed: int, layers: int, options: tuple[int, ...]) -> tuple[list, list]:
    rng = random.Random(seed)
    numels = [rng.choice([rng.randint(1, 5000), 128 * rng.randint(1, 40)]) for _ in range(layers)]
    errors = [[rng.uniform(0.1, 10) / (2**b - 1) ** 2 for b in options] for _ in range(layers)]
    return numels, errors


@pytest.mark.parametrize("seed", range(40))
def test_plan_within_bytes_matches_brute_force(seed):
    """Every plan whose payload fits the budget is tried: the planner's fits too and has the
    least error (layers of whole buckets: their common divisor makes the program exact)."""
    options = (2, 3, 4, 8)
    rng = random.Random(1000 + seed)
    numels, errors = _table(seed, rng.randint(1, 5), options)
    numels = [128 * -(-n // 128) for n in numels]
    average = rng.choice([2, 2.4, 2.5, 3, rng.uniform(2, 8), 8])
    plan = plan_bits_within_bytes(errors, numels, options, average)
    cost = lambda p: sum(n * b for n, b in zip(numels, p, strict=True))
    err = lambda p: sum(row[options.index(b)] for row, b in zip(errors, p, strict=True))
    fits = [
        p
        for p in itertools.product(options, repeat=len(numels))
        if cost(p) <= average * sum(numels)
    ]
    assert cost(plan) <= average * sum(numels)
    assert err(plan) == pytest.approx(min(err(p) for p in fits), rel=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_plan_within_bytes_rounded_never_exceeds_the_budget(seed):
    """Where the budget is cut into fewer units than the costs need (a coarse resolution),
    each cost is rounded up: the plan still fits, and its error is at most that of the best
    plan within a budget smaller by one unit a layer."""
    options = (2, 3, 4, 8)
    numels, errors = _table(seed, 4, options)
    numels = [n + 1 for n in numels]  # no common divisor: the rounded program
    total = sum(numels)
    plan = plan_bits_within_bytes(errors, numels, options, 2.5, resolution=40)
    cost = lambda p: sum(n * b for n, b in zip(numels, p, strict=True))
    err = lambda p: sum(row[options.index(b)] for row, b in zip(errors, p, strict=True))
    assert cost(plan) <= 2.5 * total
    smaller = 2 * total + (0.5 * total) * (1 - len(numels) / 40)
    inside = [p for p in itertools.product(options, repeat=4) if cost(p) <= smaller]
    assert err(plan) <= min(err(p) for p in inside)


def test_plan_within_bytes_spends_an_exact_budget():
    """2.3 bits a value over 50 values is 115 bits, met exactly by the 15-value layer at 3
    bits: the budget is the decimal written (2.3 * 50 is 114.99999999999999 in floats)."""
    errors = [[10.0, 1.0], [1.0, 0.5]]
    assert plan_bits_within_bytes(errors, [15, 35], (2, 3), 2.3) == [3, 2]
    assert plan_bits_within_bytes(errors, [15, 35], (2, 3), 2.29) == [2, 2]
    assert plan_bits_within_bytes(errors, [15, 35], (2, 3), 3) == [3, 3]
    # of plans with equal error, the cheaper one: a constant layer stays narrow
    assert plan_bits_within_bytes([[0.0, 0.0], [4.0, 1.0]], [10, 10], (2, 3), 3) == [2, 3]
    assert plan_bits_within_bytes([], [], (2, 3), 2.5) == []
    assert plan_bits_within_bytes([[1.0]], [10], (4,), 4) == [4]
    # the widest everywhere fits: chosen, though units rounded up would not have fitted it
    numels, errors = _table(4, 4, (2, 3, 4, 8))
    assert plan_bits_within_bytes(errors, numels, (2, 3, 4, 8), 8, resolution=40) == [8] * 4


def test_plan_within_bytes_bad_arguments():
    with pytest.raises(ValueError, match=r"below the narrowest option \(2 bits\)"):
        plan_bits_within_bytes([[1.0, 0.5]], [10], (2, 3), 1.9)
    with pytest.raises(TypeError, match="average_bits must be a number"):
        plan_bits_within_bytes([[1.0, 0.5]], [10], (2, 3), "2.5")
    with pytest.raises(ValueError, match="average_bits must be finite"):
        plan_bits_within_bytes([[1.0, 0.5]], [10], (2, 3), float("nan"))
    with pytest.raises(ValueError, match="one error per option"):
        plan_bits_within_bytes([[1.0]], [10], (2, 3), 2.5)
    with pytest.raises(ValueError, match="rows of errors"):
        plan_bits_within_bytes([[1.0, 0.5]], [10, 20], (2, 3), 2.5)
    with pytest.raises(ValueError, match="numels must be positive"):
        plan_bits_within_bytes([[1.0, 0.5]], [0], (2, 3), 2.5)
    with pytest.raises(ValueError, match="distinct widths"):
        plan_bits_within_bytes([[1.0, 0.5]], [10], (2, 2), 2.5)
    with pytest.raises(ValueError, match="resolution"):
        plan_bits_within_bytes([[1.0, 0.5]], [10], (2, 3), 2.5, resolution=0)


@pytest.mark.parametrize(
    "seed, plan",
    [
        (0, [4, 4, 4, 6, 4, 4, 4, 4, 3, 4]),
        (1, [4, 4, 4, 2, 6, 4, 4, 4, 4, 3]),
        (2, [3, 6, 6, 4, 4, 3, 4, 4, 4, 4]),
        (3, [4, 4, 3, 6, 4, 3, 4, 4, 4, 3]),
    ],
)
def test_fewest_bytes_plans_are_unchanged(seed, plan):
    """The fewest-bytes planner shares its dynamic program with the least-error one: its
    plans are those it made before (pinned from the implementation that had its own)."""
    rng = random.Random(seed)
    numels = [rng.randint(1, 100_000) for _ in range(10)]
    errors = [[rng.uniform(0, 10) / (2**b - 1) ** 2 for b in OPTIONS] for _ in range(10)]
    budget = sum(row[OPTIONS.index(4)] for row in errors)
    assert plan_bits(errors, numels, OPTIONS, budget, baseline=4) == plan


def test_rotated_layer_errors_are_those_of_the_rotated_values():
    """With a rotation block the error model measures the values the rotated codec codes: the
    layer padded with its last value to whole buckets, rotated in blocks; a layer with an
    outlier a block then measures far less error than unrotated."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    x[::128] += 40.0  # an outlier in every block
    padded = torch.cat([x, x[-1:].expand(24)])
    rotated = hadamard_rotate(padded, 0, 128)
    assert torch.equal(layer_errors(x, 512, (2, 4), 128), layer_errors(rotated, 512, (2, 4)))
    assert not torch.equal(layer_errors(x, 512, (2, 4), 64), layer_errors(rotated, 512, (2, 4)))
    plain, turned = layer_errors(x, 512, (2,)).item(), layer_errors(x, 512, (2,), 128).item()
    assert turned < plain / 10


def _plan_alike(average: float) -> tuple[int, ...]:
    """Every rank's errors differ; plan_widths sums them, so every rank plans alike."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    layers = [
        torch.randn(n, generator=g) * (1 + 3 * i * rank) for i, n in enumerate((512, 2048, 1024))
    ]
    errors = [layer_errors(x, 128, (2, 3, 4, 8)) for x in layers]
    numels = [x.numel() for x in layers]
    return plan_widths(errors, numels, (2, 3, 4, 8), 2, dist.group.WORLD, average)


def test_plan_widths_within_bytes_alike_on_every_rank(dist2):
    a, b = dist2.run(_plan_alike, 2.5)
    assert a == b and len(a) == 3
    assert sum(n * w for n, w in zip((512, 2048, 1024), a, strict=True)) <= 2.5 * 3584


def _train_at_crossover(crossover: int | None, *args: object) -> dict:
    with cgx2.config.tuned(crossover_bytes=crossover):
        return _train(*args)


@pytest.mark.slow
@pytest.mark.parametrize("crossover", [None, 16 << 10])
def test_average_bits_alike_on_every_rank_and_within_the_budget(dist2, crossover):
    """CGXState(average_bits=2.5): both ranks average to the same gradients and plan alike;
    every plan's payload stays within 2.5 bits a value; the bytes sent exceed 2 bits
    everywhere's by at most half a bit a compressed value a step (the payload's allgather and
    scatter send it once each in a 2-rank allreduce), and not by nothing (it spends room).
    With a crossover above a width's layers but below the bucket's, the bucket still goes
    quantized at every width (the plan counted them so; on CUDA over gloo they had gone plain)."""
    steps, rotated = 8, {"rotation": "hadamard", "replan_every": 3}
    adaptive = {"adaptive_bits": (2, 3, 4, 8), "average_bits": 2.5, **rotated}
    a, b = dist2.run(_train_at_crossover, crossover, True, steps, 2, adaptive)
    narrow, _ = dist2.run(_train_at_crossover, crossover, False, steps, 2, rotated)
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert torch.equal(ga, gb)
    assert a["plans"] == b["plans"] and a["plans"][-1]
    for plans in a["plans"]:
        for index, plan in plans.items():
            numels = a["numels"][index]
            assert sum(n * w for n, w in zip(numels, plan, strict=True)) <= 2.5 * sum(numels)
    compressed = sum(sum(n) for n in a["numels"].values())
    assert compressed == 64 * 32 + 256 * 64 + 4 * 256  # _Net's weights
    room = 0.5 * compressed / 8 * (steps - 1)  # the first step goes exact (start_iter=1)
    assert narrow["sent"] < a["sent"] <= narrow["sent"] + room


def test_bad_average_bits():
    with pytest.raises(ValueError, match="average_bits needs adaptive_bits"):
        CGXState(None, compression_params={"bits": 2}, average_bits=2.5)
    with pytest.raises(ValueError, match=r"between the narrowest and the widest .*got 1\.5"):
        CGXState(None, compression_params={"bits": 2}, adaptive_bits=(2, 4), average_bits=1.5)
    with pytest.raises(ValueError, match=r"\(2\.\.4\), got 5"):
        CGXState(None, compression_params={"bits": 2}, adaptive_bits=(2, 4), average_bits=5)
    with pytest.raises(TypeError, match="average_bits must be a number"):
        CGXState(None, compression_params={"bits": 2}, adaptive_bits=(2, 4), average_bits="3")
    with pytest.raises(ValueError, match="average_bits must be finite"):
        CGXState(
            None, compression_params={"bits": 2}, adaptive_bits=(2, 4), average_bits=float("inf")
        )
    state = CGXState(None, compression_params={"bits": 2}, adaptive_bits=(2, 4), average_bits=3)
    assert state.average_bits == 3.0 and CGXState(None).average_bits is None
