"""FSDP2 with cgx2's quantized reduce-scatter on gloo: bit-exact against the single-process
model, exact segments exact, divide factors and mixed precision honoured, and compressed
training close to uncompressed."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from toy_task import backward, batch, shard

import cgx2
import cgx2.fsdp
from cgx2.collectives import CallSettings
from cgx2.fsdp import compress, premul_factor, reduce_scatter_quantized, reference_reduce_scatter
from cgx2.seeding import call_seed


def _seed_after(seed: int) -> int:
    return call_seed(seed, 0)


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


# ----------------------------------------------------------------- functions run on every rank


def _reduce_scatter(n: int, dtype: torch.dtype, scale: float | None, segments: list | None):
    world, rank = dist.get_world_size(), dist.get_rank()
    x = _input(rank, world * n, dtype)
    out = torch.empty(n, dtype=dtype)
    cgx2.manual_seed(9)
    sent = reduce_scatter_quantized(out, x, dist.group.WORLD, CallSettings(4, 128), scale, segments)
    exact = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(exact, x.clone())  # the name torch 2.11 has too
    return {"x": x, "out": out, "exact": exact, "sent": sent}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(32, 128), nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 4)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def train_mlp(model: nn.Module, steps: int) -> list[float]:
    """``steps`` AdamW steps of ``model`` (an :class:`_MLP`, sharded or not) on each rank's
    own batches, cgx2's seed stream from 1; the loss of each step, averaged over the ranks."""
    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cgx2.manual_seed(1)
    losses = []
    for step in range(steps):
        loss = backward(model, opt, *batch(10 * (step % 5) + rank, sign_column=5))
        opt.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _train_fsdp(bits: int | None, steps: int, mp: bool = False, divide: float | None = None):
    torch.manual_seed(0)
    model = _MLP()
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    shard(model, model.layers, mp_policy=policy)
    if divide is not None:  # per module: the root owns no parameters
        for layer in model.layers:
            layer.set_gradient_divide_factor(divide)
    comms = compress(model, bits=bits, bucket_size=128, min_size=1024) if bits else []
    seen = set()  # (scale, dtype) of every reduce-scatter, to see FSDP's op and reduce dtype
    real = cgx2.fsdp.reduce_scatter_quantized

    def recording(output, input, group, settings, scale, *args, **kwargs):
        seen.add((scale, input.dtype))
        return real(output, input, group, settings, scale, *args, **kwargs)

    # Patched for this run only: the pool's worker goes on to run other tests, also after a failure.
    with mock.patch.object(cgx2.fsdp, "reduce_scatter_quantized", recording):
        losses = train_mlp(model, steps)
    return {
        "losses": losses,
        "sent": sum(c.bytes_sent for c in comms),
        "comms": len(comms),
        "seen": seen,
    }


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.5, 0.125])
def test_reduce_scatter_matches_reference(dist2, dist4, dtype, scale):
    for pool in (dist2, dist4):
        results = pool.run(_reduce_scatter, 1000, dtype, scale, None)
        models = reference_reduce_scatter([r["x"] for r in results], 4, 128, _seed_after(9), scale)
        world = len(results)
        rows = [r["x"].float().view(world, -1) for r in results]
        for j, (r, model) in enumerate(zip(results, models, strict=True)):
            assert torch.equal(r["out"], model.to(dtype))
            # One quantization of every other rank's shard: within one of its steps each.
            exact = sum(x[j] for x in rows) * (scale or 1)
            bound = sum((x[j].max() - x[j].min()) / 15 for i, x in enumerate(rows) if i != j)
            bound = bound * (scale or 1) + exact.abs().max() * 2**-7  # + bf16 rounding
            assert (r["out"].float() - exact).abs().max() <= bound


def _default_bits(env: str | None) -> int:
    import os

    if env is not None:
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = env
    try:
        model = fully_shard(nn.Linear(64, 64), mesh=init_device_mesh("cpu", (2,)))
        return compress(model)[0].bits
    finally:
        os.environ.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)


def test_compress_defaults_to_four_bits_unless_the_variable_says(dist2):
    assert dist2.run(_default_bits, None) == [4, 4]
    assert dist2.run(_default_bits, "8") == [8, 8]


class _PickledOnly:
    """A PREMUL_SUM op as torch 2.11 gives it: the factor only in its pickled state."""

    def __init__(self, factor: object) -> None:
        self._factor = factor

    def __getstate__(self) -> tuple:
        return (dist.ReduceOp.RedOpType.PREMUL_SUM, self._factor)


@pytest.mark.parametrize(
    "op",
    [
        dist._make_nccl_premul_sum(0.25),
        dist._make_nccl_premul_sum(torch.tensor(0.25)),
        _PickledOnly(0.25),
        _PickledOnly(torch.tensor(0.25)),
    ],
)
def test_premul_factor_read_as_every_torch_gives_it(op):
    assert premul_factor(op) == 0.25


def test_compress_without_fsdp_modules_is_refused():
    with pytest.raises(ValueError, match="no fully_shard module"):
        compress(nn.Linear(2, 2))


def test_exact_segments_stay_exact(dist2):
    segments = [(0, 300, True), (300, 50, False), (350, 650, True)]
    results = dist2.run(_reduce_scatter, 1000, torch.float32, 0.5, segments)
    models = reference_reduce_scatter(
        [r["x"] for r in results], 4, 128, _seed_after(9), 0.5, segments
    )
    for r, model in zip(results, models, strict=True):
        assert torch.equal(r["out"][300:350], r["exact"][300:350] * 0.5)
        assert torch.equal(r["out"][:300], model[:300])
        assert torch.equal(r["out"][350:], model[350:])
        assert not torch.equal(r["out"][:300], r["exact"][:300] * 0.5)


@pytest.mark.slow
def test_fsdp2_training_close_to_uncompressed(dist2):
    plain = dist2.run(_train_fsdp, None, 40)[0]["losses"]
    four = dist2.run(_train_fsdp, 4, 40)
    assert four[0]["losses"] == four[1]["losses"]
    losses = four[0]["losses"]
    assert four[0]["comms"] == 4  # the four layers; the root owns no parameter
    assert losses[0] == pytest.approx(plain[0], rel=1e-6)
    assert plain[-1] < 0.7 * plain[0]
    late = lambda ls: sum(ls[-10:]) / 10
    assert abs(late(losses) - late(plain)) <= 0.05 * late(plain)


@pytest.mark.slow
def test_fsdp2_divide_factor_and_bf16_reduce(dist2):
    """set_gradient_divide_factor gives PREMUL_SUM; a bf16 reduce_dtype reduces bf16."""
    for mp, divide, seen in (
        (False, 4.0, {(0.25, torch.float32)}),
        (True, None, {(0.5, torch.bfloat16)}),
    ):
        # gloo has no PREMUL_SUM: the uncompressed baseline is cgx2's reduce-scatter at 32 bits
        plain = dist2.run(_train_fsdp, 32 if divide else None, 15, mp, divide)[0]["losses"]
        four = dist2.run(_train_fsdp, 4, 15, mp, divide)[0]
        assert four["seen"] == seen
        losses = four["losses"]
        assert losses[0] == pytest.approx(plain[0], rel=1e-6)
        assert abs(losses[-1] - plain[-1]) <= 0.1 * plain[-1], (mp, divide, losses, plain)


def _settings_differ(kind: str, steps: int = 1) -> tuple[str, str, int]:
    """``steps`` of FSDP2 with cgx2's reduce-scatter, whose ``kind`` of setting (None: none)
    differs between the ranks: the error's type and message ("", "" where none), and how many
    times the ranks' settings were compared."""
    from cgx2.collectives import agreement

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _MLP()
    shard(model, model.layers)
    settings = {"bits": 4, "min_size": 1024}
    if kind is not None:
        settings[kind] = {"bits": (4, 8), "min_size": (1024, 100_000)}[kind][rank]
    compress(model, bucket_size=128, **settings)
    compared = mock.patch.object(agreement, "check_settings", wraps=agreement.check_settings)
    with compared as check:
        try:
            train_mlp(model, steps)
        except Exception as e:  # reported to the test
            return type(e).__name__, str(e), check.call_count
    return "", "", check.call_count


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("bits", "bits=[rank 0: 4, rank 1: 8]"), ("min_size", "row_params=[rank 0: [[")],
)
def test_ranks_whose_settings_differ_raise_at_the_first_reduce_scatter(dist2, kind, expected):
    """Before, ranks that compressed differently (other bits, other layers) decoded each
    other's payloads as theirs: wrong gradients, different on each rank, and no error."""
    for rank, (error, message, _) in enumerate(dist2.run(_settings_differ, kind)):
        assert error == "DisagreementError", message
        assert expected in message and f"this rank {rank}:" in message, message


def test_ranks_that_agree_compare_once_a_reduce_scatter(dist2):
    for result in dist2.run(_settings_differ, None, 3):
        assert result == ("", "", 4)  # the four layers' reduce-scatters, at their first call
