"""The rotated max-min codec through the collectives (``rotation="hadamard"``): the allreduce,
the ring and the reduce-scatter equal their rotated references bit for bit on the C loops and
the torch code, every rank alike; unbiased; error feedback measured in the values' own domain;
bad blocks refused before anything is sent, and ranks that disagree on the rotation named."""

import importlib

import pytest
import torch
import torch.distributed as dist
from bounds import allreduce_bound

import cgx2
from cgx2.codecs import ChunkedLayout, maxmin
from cgx2.codecs.rotation import Rotation, hadamard_rotate
from cgx2.collectives import CallSettings, reference_allreduce, reference_reduce_scatter
from cgx2.collectives.agreement import DisagreementError
from cgx2.collectives.reduce_scatter import reduce_scatter
from cgx2.collectives.rotations import check_rotation, rotation_key, rotation_of
from cgx2.config import tuned
from cgx2.seeding import derive_key

pipeline = importlib.import_module("cgx2.collectives.allreduce")


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g) * (rank + 1) + rank
    x[::97] *= 40  # outliers: what the rotation is for
    return x.to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


CASES = [
    (bits, dtype, n, op, block)
    for bits, dtype in ((2, torch.float32), (3, torch.bfloat16), (4, torch.float16))
    for n, op, block in ((1, "sum", 128), (3000, "avg", 128), (4 * 512 + 77, "sum", 512))
]


def _rotated_cases(
    native: bool, piece_bytes: int | None, algorithm: str, rotation: str | None = "hadamard"
) -> list[torch.Tensor]:
    rank = dist.get_rank()
    outs = []
    with tuned(native_codec=native, pipeline_bytes=piece_bytes, algorithm=algorithm):
        for bits, dtype, n, op, block in CASES:
            x = _input(rank, n, dtype)
            outs.append(
                cgx2.quantized_allreduce(
                    x, bits, op=op, seed=17, rotation=rotation, rotation_block=block
                )
            )
    return outs


@pytest.mark.parametrize("native", [True, False], ids=["c_loops", "torch"])
@pytest.mark.parametrize("world, piece_bytes", [(2, None), (2, 4 * 512 * 2), (4, None)])
def test_rotated_allreduce_is_the_rotated_reference_bit_for_bit(
    dist2, dist4, native, world, piece_bytes
):
    pool = dist2 if world == 2 else dist4
    outs = pool.run(_rotated_cases, native, piece_bytes, "sra")
    with tuned(pipeline_bytes=piece_bytes):
        for i, (bits, dtype, n, op, block) in enumerate(CASES):
            got = [r[i] for r in outs]
            assert all(_bits_equal(g, got[0]) for g in got), f"ranks differ: {CASES[i]}"
            inputs = [_input(r, n, dtype) for r in range(world)]
            model = reference_allreduce(
                inputs, bits, 512, 17, op, rotation="hadamard", rotation_block=block
            )
            assert _bits_equal(got[0], model), f"differs from the rotated reference: {CASES[i]}"
            if n > 1:  # the rotation is in it: the unrotated reference differs
                plain = reference_allreduce(inputs, bits, 512, 17, op)
                assert not torch.equal(got[0], plain), CASES[i]


def test_the_rotated_ring_agrees_on_every_rank_and_stays_within_the_bound(dist4):
    """The ring (a quantization a hop) rotated: every rank the same bits, the error within W
    steps of the rotated buckets a value, and not the unrotated ring's bytes."""
    outs = dist4.run(_rotated_cases, True, None, "ring")
    unrotated = dist4.run(_rotated_cases, True, None, "ring", None)[0]
    for i, (bits, dtype, n, op, _) in enumerate(CASES):
        got = [r[i] for r in outs]
        assert all(_bits_equal(g, got[0]) for g in got), f"ranks differ: {CASES[i]}"
        assert n == 1 or not torch.equal(got[0], unrotated[i]), CASES[i]
        inputs = [_input(r, n, dtype) for r in range(4)]
        exact = torch.stack([x.double() for x in inputs]).sum(0) / (4 if op == "avg" else 1)
        # Loose (the ring's own bound is docs/transports.md's): W = 4 quantizations, each
        # within a rotated step, which a block's norm bounds, far under 16 times the
        # two-stage unrotated bound's largest value on these inputs.
        loose = allreduce_bound(inputs, bits, 512, dtype).max() * 4 * 4
        assert (got[0].double() - exact).abs().max() <= loose, CASES[i]


def _unbiased(samples: int) -> torch.Tensor:
    x = _input(dist.get_rank(), 1024)
    return torch.stack(
        [cgx2.quantized_allreduce(x, 2, seed=s, rotation="hadamard") for s in range(samples)]
    )


def test_the_rotated_allreduce_is_unbiased(dist2):
    """Over many calls (each its own signs and rounding), the mean tends to the exact sum,
    within 6 sigma of the two stages' rounding. A rotated value is at most its block's norm,
    so a rotated bucket's range is at most twice its largest block norm (of the sum's, in the
    second stage), its 2-bit step a third of that; the inverse rotation mixes a block's
    rounding errors with weights 1/sqrt(B): a value's variance is at most a step squared / 4
    a stage. (The codec's own test holds the rotated rounding to a tighter bound.)"""
    samples = 300
    r0, r1 = dist2.run(_unbiased, samples)
    assert torch.equal(r0, r1)
    inputs = [_input(r, 1024) for r in range(2)]
    exact = inputs[0].double() + inputs[1].double()
    err = r0.double() - exact
    # Each bucket's (512 values, 4 blocks) largest block norm, for each of its values.
    norms = [
        x.double().view(-1, 4, 128).norm(dim=2).amax(dim=1).repeat_interleave(512) for x in inputs
    ]
    step = 2 * (norms[0] + norms[1]) / 3  # bounds either stage's step
    sigma = 2 * (step / 2) / samples**0.5  # two stages, each at most step / 2 a call
    assert (err.mean(0).abs() <= 6 * sigma).all()
    # Rounding biased toward the rotation's mean would show in the total.
    assert abs(err.mean(0).sum().item()) <= 6 * (sigma**2).sum().sqrt().item()


def _error_feedback(world_rotation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    x = _input(rank, 3 * 512 + 40)
    error = torch.empty_like(x)
    y = x.clone()
    settings = CallSettings.of(2, 512, "sum", 9, rotation=world_rotation)
    cgx2.collectives.allreduce_(y, dist.group.WORLD, settings, error=error)
    return y, error


def _rotated_chunks(x: torch.Tensor, layout: ChunkedLayout, rotation) -> torch.Tensor:
    """Each chunk of ``x`` rotated as a payload of its own (counted from 0)."""
    return torch.cat(
        [
            hadamard_rotate(x.narrow(0, layout.chunk_start(j), layout.chunk_size(j)), rotation.key)
            for j in range(layout.num_chunks)
        ]
    )


def test_error_feedback_is_measured_in_the_values_own_domain(dist2):
    """The residual is the input minus what the owners decode of it, rotated back: the reference
    codec's encode and decode of the same key and signs, in the original domain (the rotated
    domain's error, R x - Q(R x), has the same norm but other values, and fails this)."""
    results = dist2.run(_error_feedback, "hadamard")
    n = 3 * 512 + 40
    layout = ChunkedLayout.split(n, 2, 2, 512, False)
    rotation = rotation_of(Rotation(key=0, block=128), rotation_key(9), 0)
    for rank, (_, error) in enumerate(results):
        x = _input(rank, n)
        key = derive_key(9, pipeline.STAGE_SCATTER, rank, 0)
        sent = maxmin.encode_chunks(x, layout, key, rank, rotation=rotation)
        decoded = maxmin.decode_chunks(sent, layout, torch.float32, rotation=rotation)
        expected = x - decoded
        start, size = layout.chunk_start(rank), layout.chunk_size(rank)
        expected[start : start + size] = 0
        assert torch.equal(error, expected)
        assert error.abs().sum() > 0
        # In the rotated domain, R x - Q(R x): another tensor, which this test tells apart.
        wrong = _rotated_chunks(x, layout, rotation) - maxmin.decode_chunks(
            sent, layout, torch.float32
        )
        wrong[start : start + size] = 0
        assert not torch.allclose(error, wrong, atol=1e-3)
    # Ranks end alike; the result is the rotated reference's.
    assert torch.equal(results[0][0], results[1][0])
    inputs = [_input(r, n) for r in range(2)]
    model = reference_allreduce(inputs, 2, 512, 9, rotation="hadamard")
    assert torch.equal(results[0][0], model)


SEGMENTS = [(0, 700, True), (700, 33, False), (733, 1024, True), (1757, 300, True)]
N = 2057


def _reduce_scatter(
    rotation: str | None, widths: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _input(rank, world * N)
    out = torch.empty(N)
    error = torch.empty_like(x)
    with tuned(crossover_bytes=0):
        reduce_scatter(
            out,
            x,
            dist.group.WORLD,
            CallSettings.of(3, 512, seed=5, rotation=rotation),
            None,
            SEGMENTS,
            widths,
            check_agreement=True,
            error=error,
        )
    return out, error


@pytest.mark.parametrize("widths", [None, [2, 8, 2]])
def test_rotated_reduce_scatter_is_its_reference_and_feeds_back_its_error(dist2, widths):
    results = dist2.run(_reduce_scatter, "hadamard", widths)
    inputs = [_input(r, 2 * N) for r in range(2)]
    model = reference_reduce_scatter(inputs, 3, 512, 5, None, SEGMENTS, widths, rotation="hadamard")
    plain = reference_reduce_scatter(inputs, 3, 512, 5, None, SEGMENTS, widths)
    compressed = torch.zeros(N, dtype=torch.bool)
    for o, k, c in SEGMENTS:
        compressed[o : o + k] = c
    for rank, (out, error) in enumerate(results):
        assert torch.equal(out[compressed], model[rank][compressed])
        assert not torch.equal(out[compressed], plain[rank][compressed])
        rows = error.view(2, N)
        assert torch.equal(rows[rank], torch.zeros(N))  # its own row stays exact
        assert torch.equal(rows[:, ~compressed], torch.zeros(2, int((~compressed).sum())))
    # Each owner's sum is the ranks' inputs less their errors (in the values' own domain),
    # up to the rotation's fp32 rounding: a residual of the rotated domain fails this.
    for j, (out, _) in enumerate(results):
        fed = sum(
            inputs[r].view(2, N)[j].double() - results[r][1].view(2, N)[j].double()
            for r in range(2)
        )
        diff = (out.double() - fed)[compressed].abs()
        assert diff.max() <= 1e-4 * fed[compressed].abs().max(), diff.max()


def _bad_block(block: int) -> str:
    try:
        cgx2.quantized_allreduce(torch.randn(1000), 4, rotation="hadamard", rotation_block=block)
    except ValueError as e:
        return str(e)
    return "no error"


def _bad_block_on_rank_0(block: int) -> str:
    return _bad_block(block) if dist.get_rank() == 0 else "not called"


def test_a_bad_block_is_the_same_value_error_on_every_rank_before_anything_is_sent(dist2):
    """Only rank 0 calls (alone, it would hang in any collective): it raises at once; with both
    calling, both raise the same message."""
    alone = dist2.run(_bad_block_on_rank_0, 1024)
    assert "rotation block 1024 must divide bucket_size 512" in alone[0]
    for block in (96, 1024, 1):
        messages = dist2.run(_bad_block, block)
        assert messages[0] == messages[1] != "no error"
        assert "rotation" in messages[0] and str(block) in messages[0]
    with pytest.raises(ValueError, match="rotation_block: rotation block 1024 must divide"):
        cgx2.quantized_allreduce(torch.randn(10), 4, rotation="hadamard", rotation_block=1024)
    with pytest.raises(ValueError, match="rotation must be None, 'none' or one of"):
        cgx2.quantized_allreduce(torch.randn(10), 4, rotation="fourier")
    with pytest.raises(TypeError, match="rotation must be a str"):
        cgx2.quantized_allreduce(torch.randn(10), 4, rotation=1)
    assert check_rotation("none", 128, 512) is None


def _mismatched() -> str:
    rotation = "hadamard" if dist.get_rank() == 0 else None
    try:
        cgx2.quantized_allreduce(_input(dist.get_rank(), 4000), 4, rotation=rotation)
    except DisagreementError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_the_rotation_are_told_so(dist2):
    messages = dist2.run(_mismatched)
    for message in messages:
        assert "rotation=[rank 0: hadamard, rank 1: None]" in message, message
