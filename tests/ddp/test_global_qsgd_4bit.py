"""Packed 4-bit standard dithering on gloo: nibble sums equal the sum of every rank's levels,
no carry at the edge, more than 7 ranks refused, unbiased, identical on every rank."""

import pytest
import torch
import torch.distributed as dist

import cgx2
from cgx2.codecs import global_norm
from cgx2.ddp import global_qsgd as gq
from cgx2.ddp.global_qsgd import GlobalQSGDState

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _grad(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(n, generator=g) * (rank + 1)


# ----------------------------------------------------------------- functions run on every rank


def _exact_sums(n: int) -> dict:
    state = GlobalQSGDState()
    g = _grad(dist.get_rank(), n)
    cgx2.manual_seed(11)
    q, norm, levels, world = gq.levels_4bit(g, state)
    everyone = torch.empty(world * n, dtype=q.dtype)
    _all_gather_single(everyone, q.clone())
    level_sum = everyone.view(world, n).to(torch.int32).sum(0)
    packed = global_norm.pack_offset_levels(q, levels)
    dist.all_reduce(packed)
    nibble_sum = global_norm.unpack_offset_sums(packed, n, levels, world)
    cgx2.manual_seed(11)
    residual = torch.empty(n)
    out = gq.standard_dithering_4bit(g, state, residual=residual)
    return {
        "level_sum": level_sum,
        "nibble_sum": nibble_sum,
        "out": out,
        "levels": levels,
        "expected": level_sum.float() * (norm / (levels * world)),
        "q": q,
        "norm": norm,
        "packed": packed,
        "sent": state.bytes_sent,
        "residual": residual,
        "g": g,
        "mean": sum(_grad(r, n) for r in range(world)) / world,
    }


def _edge() -> dict:
    """Every rank at +L and at -L: the nibble sums 2LW and 0, in both halves of a byte."""
    world = dist.get_world_size()
    levels = 15 // (2 * world)
    q = torch.tensor([levels, levels, -levels, -levels, levels, -levels, levels], dtype=torch.int8)
    packed = global_norm.pack_offset_levels(q, levels)
    dist.all_reduce(packed)
    g = torch.tensor([2.5, -2.5, 0.0, 2.5, -2.5])
    sums = global_norm.unpack_offset_sums(packed, q.numel(), levels, 0)  # the fields as sent
    return {
        "sums": sums,
        "packed": packed,
        "levels": levels,
        "out": gq.standard_dithering_4bit(g, GlobalQSGDState()),
    }


def _means(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _grad(dist.get_rank(), 201)
    outs = torch.stack([gq.standard_dithering_4bit(g, GlobalQSGDState()) for _ in range(samples)])
    exact = g.clone()
    dist.all_reduce(exact)
    return outs, exact / dist.get_world_size()


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("n", [3000, 3001])  # odd: one padding nibble
def test_nibble_sums_are_the_level_sums(dist2, dist4, n):
    for pool in (dist2, dist4):
        world = pool.world_size
        results = pool.run(_exact_sums, n)
        for r in results:
            assert r["levels"] == 15 // (2 * world)
            assert r["q"].abs().max() <= r["levels"]
            assert torch.equal(r["nibble_sum"], r["level_sum"])  # exact, no carries
            assert torch.equal(r["out"], r["expected"])  # the integer sum, decoded once
            assert torch.equal(r["out"], results[0]["out"])  # identical on every rank
            assert r["packed"].dtype == torch.uint8 and r["packed"].numel() == (n + 1) // 2
            assert r["sent"] == 2 * (world - 1) * ((n + 1) // 2 + 4) // world  # half of int8
            step = r["norm"] / r["levels"]
            assert torch.allclose(r["residual"], r["g"] - r["q"].float() * step)
            # each rank within one step (global norm / L) of its value: so is the average
            assert (r["out"] - r["mean"]).abs().max() <= step * 1.0001
        assert max(int(r["q"].abs().max()) for r in results) == results[0]["levels"]


def test_no_carry_at_the_edge(dist2, dist4):
    for pool in (dist2, dist4):
        world = pool.world_size
        for r in pool.run(_edge):
            top = 2 * r["levels"] * world  # 12 for 2 ranks, 8 for 4: within a nibble
            assert top <= 15
            assert r["sums"].tolist() == [top, top, 0, 0, top, 0, top]
            assert r["packed"].tolist() == [top | top << 4, 0, top, top]
            assert torch.allclose(r["out"], torch.tensor([2.5, -2.5, 0.0, 2.5, -2.5]))


@pytest.mark.parametrize("world", range(1, 8))
def test_sums_never_carry_up_to_seven_ranks(world):
    """The allreduce's byte-wise sum, done here in uint8: every rank at +L, -L or mixed."""
    levels = 15 // (2 * world)
    gen = torch.Generator().manual_seed(world)
    qs = [
        torch.randint(-levels, levels + 1, (301,), generator=gen, dtype=torch.int8)
        for _ in range(world - 2)
    ]
    qs += [torch.full((301,), levels, dtype=torch.int8)] * min(world, 2)
    total = sum(global_norm.pack_offset_levels(q, levels) for q in qs)
    assert total.dtype == torch.uint8
    expected = torch.stack(qs).to(torch.int32).sum(0)
    assert torch.equal(global_norm.unpack_offset_sums(total, 301, levels, world), expected)


def test_more_than_seven_ranks_refused(monkeypatch):
    monkeypatch.setattr(gq.dist, "get_world_size", lambda group=None: 8)
    with pytest.raises(ValueError, match="W=8"):
        gq.levels_4bit(torch.ones(4), GlobalQSGDState())


def test_unbiased(dist2):
    outs, exact = dist2.run(_means, 400)[0]
    err = outs.mean(0) - exact
    spread = outs.std(0) / 400**0.5
    assert (err.abs() <= 6 * spread + 1e-7).all()
    assert not torch.equal(outs[0], outs[1])  # fresh random numbers per call
