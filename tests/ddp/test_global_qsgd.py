"""Global-QSGD's hooks on gloo: integer levels summed exactly, no overflow at the edge,
unbiased, identical on every rank, DDP training with each hook, and clear errors."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from toy_task import backward, batch

import cgx2
from cgx2.codecs import global_norm
from cgx2.comm import worker
from cgx2.ddp import global_qsgd as gq
from cgx2.ddp.global_qsgd import GlobalQSGDState, level_dtype

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _grad(rank: int, n: int = 3000) -> torch.Tensor:
    g = torch.Generator().manual_seed(30 + rank)
    return torch.randn(n, generator=g) * (rank + 1)


# ----------------------------------------------------------------- functions run on every rank


def _exact_sums(bits: int | None) -> dict:
    state = GlobalQSGDState(None, bits)
    g = _grad(dist.get_rank())
    cgx2.manual_seed(7)
    q, norm, levels, world = gq.linear_levels(g, state)
    everyone = torch.empty(world * q.numel(), dtype=q.dtype)
    _all_gather_single(everyone, q.clone())
    everyone = everyone.view(world, -1)
    cgx2.manual_seed(7)
    out = gq.standard_dithering(g, state)
    cgx2.manual_seed(7)
    out_thc = gq.thc(g, state)
    total = everyone.to(torch.int64).sum(0)
    return {
        "out": out,
        "thc": out_thc,
        "expected": total.float() * (norm / (levels * world)),
        "max_level": int(q.abs().max()),
        "levels": levels,
        "dtype": q.dtype,
        "norm": norm,
        "sum": sum(_grad(r) for r in range(world)) / world,
    }


def _edge(bits: int | None) -> torch.Tensor:
    """Every rank at +max and -max: each level is exactly L, the sum W*L."""
    g = torch.tensor([2.5, -2.5, 0.0, 2.5])
    return gq.standard_dithering(g, GlobalQSGDState(None, bits))


def _means(fn_name: str, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    fn = getattr(gq, fn_name)
    g = _grad(dist.get_rank(), 200)
    outs = torch.stack([fn(g, GlobalQSGDState()) for _ in range(samples)])
    exact = g.clone()
    dist.all_reduce(exact)
    return outs, exact / dist.get_world_size()


def _train(hook_name: str, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    hook = getattr(gq, hook_name)
    state = None
    if hook_name == "powerSGD_hook":
        state = gq.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
        )
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    losses, grads = [], []
    for step in range(steps):
        loss = backward(model, opt, *batch(10 * (step % 4) + rank, sign_column=None))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("bits", [None, 8, 3])
def test_levels_sum_exactly(dist2, dist4, bits):
    for pool in (dist2, dist4):
        results = pool.run(_exact_sums, bits)
        for r in results:
            assert torch.equal(r["out"], r["expected"])  # the integer sum, decoded once
            assert torch.equal(r["thc"], r["out"])  # same levels, parameter-server sum
            assert torch.equal(r["out"], results[0]["out"])
            assert r["max_level"] <= r["levels"]
            world = pool.world_size
            assert r["levels"] == (127 // world if bits is None else 2 ** (bits - 1) - 1)
            assert r["dtype"] == (torch.int8 if world * r["levels"] <= 127 else torch.int32)
            # each rank within one step (global norm / L) of its value: so is the average
            assert (r["out"] - r["sum"]).abs().max() <= r["norm"] / r["levels"] * 1.0001


def test_no_overflow_at_the_edge(dist4):
    """4 ranks, int8 wire: 31 levels each, all at +31 or -31: the sum 124 fits."""
    for bits in (None, 8):
        for out in dist4.run(_edge, bits):
            assert torch.equal(out, torch.tensor([2.5, -2.5, 0.0, 2.5]))


def test_level_dtype_edges():
    assert level_dtype(127, 1) == torch.int8
    assert level_dtype(63, 2) == torch.int8 and level_dtype(64, 2) == torch.int32
    assert level_dtype(1, 127) == torch.int8 and level_dtype(1, 128) == torch.int32
    assert level_dtype(2**15 - 1, 65_538) == torch.int32
    with pytest.raises(ValueError, match="overflow int32"):
        level_dtype(2**15 - 1, 2**17)
    with pytest.raises(ValueError, match="pass bits"):
        global_norm.levels_per_side(GlobalQSGDState().bits, 128)


@pytest.mark.parametrize("fn", ["standard_dithering", "thc", "qsgd", "exponential_dithering"])
def test_unbiased(dist2, fn):
    outs, exact = dist2.run(_means, fn, 400)[0]
    err = outs.mean(0) - exact
    spread = outs.std(0) / 400**0.5
    assert (err.abs() <= 6 * spread + 1e-7).all()
    assert not torch.equal(outs[0], outs[1])  # fresh random numbers per call


def test_exponential_codes_roundtrip_and_unbiased():
    x = torch.tensor([1.0, -1.0, 0.5, 0.75, -0.3, 1e-3, 0.0, 2.0**-126, 1e-40])
    u = torch.rand(20000, x.numel(), generator=torch.Generator().manual_seed(0))
    values = gq.exponential_values(gq.exponential_codes(x.expand_as(u), 8, u))
    assert set(values.abs().unique().tolist()) <= {0.0} | {2.0**-k for k in range(127)}
    assert torch.equal(values[:, :3], x[:3].expand(20000, 3))  # powers of two: exact
    spread = values.double().std(0) / len(u) ** 0.5
    assert ((values.double().mean(0) - x.double()).abs() <= 6 * spread + 1e-45).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "hook",
    [
        "default_hook",
        "standard_dithering_hook",
        "thc_hook",
        "qsgd_hook",
        "exponential_dithering_hook",
        "standard_dithering_4bit_hook",
        "powerSGD_hook",
    ],
)
def test_ddp_training_with_each_hook(dist2, hook):
    a, b = dist2.run(_train, hook, 20)
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert torch.equal(ga, gb)  # identical on every rank
    assert sum(a["losses"][-4:]) < 0.7 * sum(a["losses"][:4]), a["losses"]


def _train_with_worker(on: bool, hook_name: str) -> dict:
    cgx2.seeding.manual_seed(0)
    counted = mock.patch.object(worker, "submit", wraps=worker.submit)
    with cgx2.config.tuned(comm_worker=on), counted as submit:
        result = _train(hook_name, 3)
    result["submitted"] = submit.call_count
    return result


@pytest.mark.parametrize("hook", ["standard_dithering_4bit_hook", "qsgd_hook"])
def test_the_worker_thread_gives_the_same_bits_as_autograds(dist2, hook):
    """On gloo the hooks' collectives run on the group's worker thread; in the same order, so
    the gradients are bit for bit those of CGX2_COMM_WORKER=0."""
    on, off = dist2.run(_train_with_worker, True, hook), dist2.run(_train_with_worker, False, hook)
    assert on[0]["submitted"] == 3 and off[0]["submitted"] == 0  # one bucket a step
    for rank in range(2):
        for a, b in zip(on[rank]["grads"], off[rank]["grads"], strict=True):
            assert torch.equal(a, b)


def test_bad_state():
    with pytest.raises(ValueError, match="bits"):
        GlobalQSGDState(bits=1)
    with pytest.raises(TypeError, match="GlobalQSGDState"):
        gq._state("fast")


def test_state_dict_restores_bits_and_the_seed_stream():
    state = GlobalQSGDState(bits=5)
    cgx2.manual_seed(3)
    saved = state.state_dict()
    first = gq.seeding.next_seed()
    other = GlobalQSGDState()
    other.load_state_dict(saved)
    assert other.bits == 5 and gq.seeding.next_seed() == first


def test_gqsgd_drop_in():
    from gqsgd import powerSGD_hook
    from gqsgd.ddphook import THC_uniform_hook, exponential_dithering_hook

    assert THC_uniform_hook is gq.thc_hook
    assert exponential_dithering_hook is gq.exponential_dithering_hook
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    assert powerSGD_hook.powerSGD_hook is torch_powersgd.powerSGD_hook  # Global-QSGD's copy
