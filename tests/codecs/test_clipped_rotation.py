"""The clipped rotation (``rotation="hadamard-clipped"``): each bucket's rotated values coded
over the middle of its range, rounded to the nearest level. The bytes follow the definition
(the range, the clamp, the rounding), C loops and torch alike; it errs several times less than
the unclipped rotation at 2 bits; non-finite buckets stay NaN; the allreduce equals its
reference on every rank; ranks that disagree are told so."""

import pytest
import torch
import torch.distributed as dist

import cgx2
from cgx2.codecs import maxmin, native
from cgx2.codecs.rotation import Rotation, hadamard_rotate, rotation_for
from cgx2.collectives import reference_allreduce
from cgx2.collectives.agreement import DisagreementError
from cgx2.config import tuned

BUCKET = 512
CLIPPED = Rotation(key=0x0123456789ABCDEF, clipped=True)
ROTATED = Rotation(key=0x0123456789ABCDEF)


def _gradient_like(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values (Student's t, 3 degrees of freedom), as gradients are."""
    g = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(3, n, generator=g).pow(2).sum(0)
    return torch.randn(n, generator=g) / (chi2 / 3).sqrt()


def test_the_fraction_by_bits():
    assert [maxmin.clip_fraction(b) for b in (1, 2, 3, 4, 8)] == [0.5, 0.5, 0.75, 0.875, 0.9921875]
    assert rotation_for("hadamard-clipped", 5).clipped
    assert not rotation_for("hadamard", 5).clipped


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_values_in_the_middle_round_to_nearest_and_the_rest_take_its_ends(bits):
    """Decoded in the rotated domain: inside each bucket's kept range [mid - r, mid + r]
    (mid, r from the halves of its ends), a value is within half a step (and an ulp's
    slack) of itself; beyond it, within half a step of the nearer end."""
    x = _gradient_like(8 * BUCKET + 100, seed=bits)
    rotated = hadamard_rotate(x, CLIPPED.key)
    payload = maxmin.encode(x, bits, BUCKET, key=1, rotation=CLIPPED)
    decoded = maxmin.decode(payload, x.numel(), bits, BUCKET)  # still rotated
    whole = x.numel() // BUCKET * BUCKET
    rows = rotated[:whole].view(-1, BUCKET)
    lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
    mid, reach = lo * 0.5 + hi * 0.5, (hi * 0.5 - lo * 0.5) * maxmin.clip_fraction(bits)
    kept_lo, kept_hi = torch.maximum(lo, mid - reach), torch.minimum(hi, mid + reach)
    step = (kept_hi - kept_lo) / (2**bits - 1)
    target = torch.minimum(torch.maximum(rows, kept_lo), kept_hi)
    err = (decoded[:whole].view(-1, BUCKET) - target).abs()
    assert (err <= step * 0.5 * (1 + 1e-5) + 1e-6).all(), (err / step).max()
    assert ((rows < kept_lo) | (rows > kept_hi)).any()  # the clamp was exercised
    # Nearest: no randomness, the key is unused; the tail (< one bucket) as the codec has it.
    assert torch.equal(payload, maxmin.encode(x, bits, BUCKET, key=99, rotation=CLIPPED))


def _edges(n: int, seed: int) -> torch.Tensor:
    """Gradient-like values with a bucket of each edge: constant, a span too small for
    lmax / span, ends whose span overflows (half scale), a NaN, an Inf."""
    x = _gradient_like(n, seed)
    x[0:BUCKET] = 0.25
    x[BUCKET : 2 * BUCKET] = 1e-38 + torch.arange(BUCKET) * 1e-45
    x[2 * BUCKET : 3 * BUCKET] *= 3e37
    x[3 * BUCKET + 7] = float("nan")
    x[4 * BUCKET + 9] = float("inf")
    return x


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("rotated", [False, True])
def test_the_c_loops_and_torch_write_the_same_bytes(bits, rotated):
    """encode and decode_sum_encode (a sum that overflows coded saturated among them), the C
    loops (vector and scalar min/max) against torch alone. Unrotated, the edge
    buckets reach the coder as they are."""
    rotation = CLIPPED if rotated else None
    n = 9 * BUCKET + 77
    x, own = _edges(n, seed=7), _edges(n, seed=8)
    own[5 * BUCKET : 6 * BUCKET] = 3e38  # with a row of the same: a sum past FLT_MAX

    def coded() -> list[torch.Tensor]:
        clip = maxmin.clip_fraction(bits)
        layout = maxmin.MaxMinLayout.of(n, bits, BUCKET, False)
        if rotated:
            payload = maxmin.encode(x, bits, BUCKET, 1, rotation=rotation)
        else:  # the clipped coding of unrotated values: _encode itself
            payload, _ = maxmin._encode(x, layout, 1, 0, None, nearest=True, clip=clip)
        rows = torch.stack([payload, maxmin.encode(own, bits, BUCKET, 2)])
        summed = maxmin.decode_sum_encode(rows, n, own, 0, None, bits, BUCKET, 3, rotation=CLIPPED)
        return [payload, summed]

    with tuned(native_codec=False):
        want = coded()
    lib = native.library()
    assert lib is not None, "cgx2._C was not built"
    had = lib.maxmin_simd()
    try:
        for simd in (0, 1):  # the scalar min/max, then the vector one where the CPU has it
            lib.maxmin_simd(simd)
            with tuned(native_codec=True):
                got = coded()
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (simd, (g != w).nonzero()[:5])
    finally:
        lib.maxmin_simd(had)


def test_it_errs_several_times_less_than_the_rotation_alone_at_2_bits():
    x = _gradient_like(64 * BUCKET, seed=3)
    errors = {}
    for name, rotation in (("rotated", ROTATED), ("clipped", CLIPPED)):
        total = 0.0
        for key in range(8):
            r = Rotation(key=1000 + key, clipped=rotation.clipped)
            y = maxmin.decode(
                maxmin.encode(x, 2, BUCKET, key, rotation=r), x.numel(), 2, BUCKET, rotation=r
            )
            total += (y - x).pow(2).sum().item()
        errors[name] = total
    assert errors["clipped"] < 0.35 * errors["rotated"], errors


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_bucket_stays_nan_and_the_others_finite(bad):
    x = _gradient_like(4 * BUCKET, seed=4)
    x[BUCKET + 5] = bad
    y = maxmin.decode(
        maxmin.encode(x, 2, BUCKET, 1, rotation=CLIPPED), x.numel(), 2, BUCKET, rotation=CLIPPED
    )
    assert y[BUCKET : 2 * BUCKET].isnan().all()
    assert y[:BUCKET].isfinite().all() and y[2 * BUCKET :].isfinite().all()
    huge = _gradient_like(4 * BUCKET, seed=5)
    huge = huge / huge.abs().max() * torch.finfo(torch.float32).max / 128**1.5 / 2
    z = maxmin.decode(
        maxmin.encode(huge, 2, BUCKET, 1, rotation=CLIPPED),
        huge.numel(),
        2,
        BUCKET,
        rotation=CLIPPED,
    )
    assert z.isfinite().all()


def _clipped_allreduce(algorithm: str, n: int) -> torch.Tensor:
    x = _gradient_like(n, seed=dist.get_rank())
    with tuned(algorithm=algorithm, pipeline_bytes=4 * BUCKET * 4):
        return cgx2.quantized_allreduce(x, 2, op="avg", seed=11, rotation="hadamard-clipped")


@pytest.mark.parametrize("algorithm", ["sra", "allgather"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_allreduce_is_its_reference_on_every_rank(dist2, dist4, world, algorithm):
    pool = dist2 if world == 2 else dist4
    n = 6 * BUCKET + 300
    outs = pool.run(_clipped_allreduce, algorithm, n)
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)
    inputs = [_gradient_like(n, seed=r) for r in range(world)]
    with tuned(algorithm=algorithm, pipeline_bytes=4 * BUCKET * 4):
        model = reference_allreduce(inputs, 2, BUCKET, 11, "avg", rotation="hadamard-clipped")
        rotated = reference_allreduce(inputs, 2, BUCKET, 11, "avg", rotation="hadamard")
    assert torch.equal(outs[0].view(torch.int32), model.view(torch.int32))
    exact = torch.stack(inputs).mean(0)
    assert (outs[0] - exact).norm() < 0.7 * (rotated - exact).norm()


def _disagreeing() -> str:
    rotation = "hadamard-clipped" if dist.get_rank() == 0 else "hadamard"
    try:
        cgx2.quantized_allreduce(_gradient_like(4000, 0), 4, rotation=rotation)
    except DisagreementError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_clipping_are_told_so(dist2):
    for message in dist2.run(_disagreeing):
        assert "rotation=[rank 0: hadamard-clipped, rank 1: hadamard]" in message, message
