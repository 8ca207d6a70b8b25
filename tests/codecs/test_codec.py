"""Max-min reference codec: wire format, Philox stream, error bound, unbiasedness, NaN."""

import pytest
import torch
from bounds import FP32_EPS, bucket_absmax, quantize_bound
from hypothesis import given, settings
from hypothesis import strategies as st

import cgx2.config
from cgx2.codecs import maxmin
from cgx2.codecs.layout import ChunkedLayout, MaxMinLayout
from cgx2.codecs.packing import (
    pack_levels,
    pack_stream,
    stream_nbytes,
    unpack_levels,
    unpack_stream,
)
from cgx2.codecs.philox import bucket_halves, philox4x32

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS = [0, 1, 7, 1009, 3 * 512 + 5]


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3 + 1).to(dtype)


# ----------------------------------------------------------------------------- format


def test_layout_of_4_bit_buckets_is_7_76x_smaller_than_fp32():
    layout = MaxMinLayout(512 * 1000, bits=4, bucket_size=512)
    assert layout.num_buckets == 1000
    assert layout.bucket_stride == 256
    assert layout.levels_offset == 8000
    assert layout.nbytes == 8000 + 256 * 1000
    assert 512 * 1000 * 4 / layout.nbytes == pytest.approx(7.757, abs=1e-3)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_bit_width_packs_8_values_into_bits_bytes(bits):
    levels = torch.arange(8) % (1 << bits)
    expected = sum(int(v) << (bits * k) for k, v in enumerate(levels)).to_bytes(bits, "little")
    assert bytes(pack_levels(levels.view(1, 8), bits).view(-1).tolist()) == expected


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("m", [1, 8, 13, 512])
def test_pack_unpack_roundtrip(bits, m):
    levels = torch.randint(0, 1 << bits, (3, m))
    packed = pack_levels(levels, bits)
    assert packed.shape == (3, -(-m // 8) * bits)
    assert torch.equal(unpack_levels(packed, bits, m), levels)


def test_payload_regions():
    """Meta (min, step) as fp32 pairs first, raw tail next, levels 16-byte aligned."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0] * 4 + [5.0, 6.0, 7.0])  # 2 buckets of 8, tail of 3
    layout = MaxMinLayout(19, bits=2, bucket_size=8, skip_incomplete=True)
    payload = maxmin.encode(x, 2, 8, key=1, skip_incomplete=True)
    assert payload.numel() == layout.nbytes == 48
    meta = payload[:16].view(torch.float32).view(2, 2)
    assert torch.equal(meta, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    assert torch.equal(payload[16:28].view(torch.float32), torch.tensor([5.0, 6.0, 7.0]))
    assert layout.levels_offset == 32
    # step 1, values on the grid: r < 1 never rounds them up, so levels are the values.
    assert payload[32:36].tolist() == [0b11100100] * 4


# ----------------------------------------------------------------------------- philox


def test_philox_matches_random123_known_answers():
    def run(ctr, key):
        c = [torch.tensor([v]) for v in ctr]
        return [int(w) for w in philox4x32(*c, key)]

    assert run((0, 0, 0, 0), 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    assert run((ones,) * 4, (ones << 32) | ones) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert run(pi, (0x299F31D0 << 32) | 0xA4093822) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]


def test_halves_cover_16_bits_and_depend_on_key_and_stream():
    h = bucket_halves(key=7, num_buckets=64, bucket_size=512)
    assert h.dtype == torch.int64 and h.shape == (64, 512)
    assert 0 <= h.min() and h.max() < 2**16
    assert abs(h.float().mean().item() / 2**16 - 0.5) < 0.005
    assert not torch.equal(h, bucket_halves(8, 64, 512))
    assert not torch.equal(h, bucket_halves(7, 64, 512, stream=1))
    assert torch.equal(h, bucket_halves(7, 64, 512))


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skip", [False, True])
def test_error_within_one_step_of_its_bucket(bits, dtype, skip):
    for n in LENGTHS:
        x = _x(n, dtype, seed=n)
        payload = maxmin.encode(x, bits, 512, key=n, skip_incomplete=skip)
        assert payload.numel() == MaxMinLayout(n, bits, 512, skip).nbytes
        y = maxmin.decode(payload, n, bits, 512, torch.float32, skip)
        err = (y.double() - x.double()).abs()
        assert (err <= quantize_bound(x, bits, 512)).all(), (n, err.max())
        if skip:  # the incomplete tail is sent raw: exact
            tail = n - n // 512 * 512
            assert torch.equal(y[n - tail :], x[n - tail :].float())


def test_a_few_million_values():
    x = _x(3_000_017, torch.float32)
    y = maxmin.decode(maxmin.encode(x, 4, 512, key=3), x.numel(), 4, 512)
    assert ((y.double() - x.double()).abs() <= quantize_bound(x, 4, 512)).all()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """K copies of x land in different buckets, hence get independent random numbers."""
    n, copies = 1024, 2048
    x = _x(n, torch.float32, seed=5)
    y = maxmin.decode(maxmin.encode(x.repeat(copies), bits, 512, key=11), n * copies, bits, 512)
    err = (y.view(copies, n).double() - x.double()).mean(0)
    # Stochastic rounding to a grid of step s has variance <= s^2/4 per value.
    sigma = quantize_bound(x, bits, 512) / 2 / copies**0.5
    assert (err.abs() <= 6 * sigma).all()
    assert abs(err.sum().item()) <= 6 * (sigma**2).sum().sqrt().item()


@pytest.mark.parametrize(("bits", "top"), [(4, 5e-40), (8, 5e-37), (8, 1e-39), (2, 3e-38)])
def test_a_bucket_too_narrow_for_an_fp32_scale_stays_unbiased(bits, top):
    """Where (2**bits - 1) / range overflows fp32 (subnormal and tiny normal ranges), the
    levels still average to the input: the differences are scaled by 2**64 first."""
    n, copies = 512, 2048
    x = torch.linspace(0, top, n)
    y = maxmin.decode(maxmin.encode(x.repeat(copies), bits, n, key=3), n * copies, bits, n)
    mean = y.view(copies, n).double().mean(0)
    # What rounding a subnormal step costs: half fp32's smallest subnormal, times the level.
    rounding = 2**bits * 1.5e-45
    assert (y >= 0).all() and (y <= x.max() + rounding).all()
    # Each mean is within a few of its standard errors (step / 2 / sqrt(copies)).
    step = x.max().double() / (2**bits - 1)
    slack = 6 * step / 2 / copies**0.5 + rounding
    assert ((mean - x.double()).abs() <= slack).all(), (mean - x.double()).abs().max()


@pytest.mark.parametrize("lmax", [1.0, 15.0, 255.0])
def test_scale_is_the_largest_fp32_whose_product_with_the_span_stays_within_lmax(lmax):
    """So no level needs a clamp: (v - min) * scale <= span * scale <= lmax, rounding
    included. Spans from subnormal (the quotient overflows: FLT_MAX) to huge."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-149, 128, (20000,), generator=g).double()
    span = (torch.rand(20000, generator=g, dtype=torch.float64) + 1) * 2**exponents
    span = span.float()
    span = span[(span > 0) & torch.isfinite(span)]
    scale = maxmin.scale_toward_zero(torch.full_like(span, lmax), span)
    assert (scale.double() * span.double() <= lmax).all()
    above = torch.nextafter(scale, torch.full_like(scale, torch.inf))
    assert (
        (above.double() * span.double() > lmax) | (scale == torch.finfo(torch.float32).max)
    ).all()
    assert (scale == torch.finfo(torch.float32).max).any() and (scale < 1).any()


@pytest.mark.parametrize("bits", [1, 4, 7, 8])
def test_level_is_the_exact_floor_of_a_plus_the_random_fraction(bits):
    """floor(a + h / 2**F) in exact arithmetic (fp64 holds the sum: a has 24 significant bits
    at most 2**-F * 2**24 apart from h's grid), not of a rounded fp32 sum."""
    x = _x(4 * 512, torch.float32, seed=bits)
    payload = maxmin.encode(x, bits, 512, key=5, stream=2)
    layout = MaxMinLayout(x.numel(), bits, 512)
    got = unpack_levels(
        payload[layout.levels_offset :].view(layout.num_buckets, -1), bits, 512
    ).double()
    rows = x.view(4, 512)
    lo, hi = rows.amin(1), rows.amax(1)
    scale = maxmin.scale_toward_zero(torch.full_like(lo, 2.0**bits - 1), hi - lo)
    a = ((rows - lo[:, None]) * scale[:, None]).double()
    frac = maxmin.random_fraction_bits(bits)
    h = (bucket_halves(5, 4, 512, stream=2) >> (16 - frac)).double()
    assert torch.equal(got, torch.floor(a + h * 2.0**-frac))


def test_deterministic_rounding_would_fail_the_unbiasedness_check():
    """The statistic above detects a bias of a fraction of a step."""
    x = _x(1024, torch.float32, seed=5)
    step = quantize_bound(x, 2, 512)
    lo = x.view(2, 512).amin(1).repeat_interleave(512)
    floored = lo + torch.floor((x - lo) / step) * step
    sigma = step / 2 / 2048**0.5
    assert abs((floored - x).double().sum().item()) > 6 * (sigma**2).sum().sqrt().item()


def test_constant_bucket_is_exact():
    x = torch.full((1000,), 3.25)
    assert torch.equal(maxmin.decode(maxmin.encode(x, 1, 512, key=0), 1000, 1, 512), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_makes_its_bucket_nan_and_leaves_others_alone(bad):
    x = _x(2048, torch.float32)
    x[700] = bad
    y = maxmin.decode(maxmin.encode(x, 4, 512, key=0), 2048, 4, 512)
    assert torch.isnan(y[512:1024]).all()
    assert torch.isfinite(y[:512]).all() and torch.isfinite(y[1024:]).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_finite_bucket_whose_range_overflows_fp32_decodes_finite_and_unbiased(bits):
    """max - min past FLT_MAX (values near both ends of fp32): coded at half scale, flagged by
    a negative step; finite, within one (full-scale) step, and unbiased."""
    flt_max = torch.finfo(torch.float32).max
    n, copies = 512, 1024
    x = torch.linspace(-1, 1, n) * flt_max
    payload = maxmin.encode(x.repeat(copies), bits, n, key=9)
    assert payload[:8].view(torch.float32)[1] < 0  # the flag
    y = maxmin.decode(payload, n * copies, bits, n).view(copies, n)
    assert torch.isfinite(y).all()
    step = 2 * (flt_max / 2 - -flt_max / 2) / (2**bits - 1)  # in float64: no overflow
    assert ((y.double() - x.double()).abs() <= step * (1 + 1e-6)).all()
    mean = y.double().mean(0)
    assert ((mean - x.double()).abs() <= 6 * step / 2 / copies**0.5).all()


@pytest.mark.parametrize("bits", range(1, 9))
def test_a_range_ending_near_flt_max_decodes_finite(bits):
    """A top level whose step times L rounds past FLT_MAX: the step is an ulp smaller, so
    no finite value decodes to Inf, at full scale or half."""
    flt_max = torch.finfo(torch.float32).max
    for lo in (-flt_max, -3e38, 0.0, 1.0, 1e38, -flt_max / 3):
        x = torch.tensor([lo, flt_max] * 256)
        for key in range(8):
            y = maxmin.decode(maxmin.encode(x, bits, 512, key=key), 512, bits, 512)
            assert torch.isfinite(y).all(), (lo, key)
            assert (y >= x.min()).all()


def _overflowing_sum(bits: int, bucket: int = 512) -> tuple:
    """Three rows whose sum overflows fp32, bucket by bucket: past +FLT_MAX, past -FLT_MAX,
    both ways, +Inf in own's (the exact row's) input, and an ordinary bucket; the payloads,
    own and the sum as decode_sum takes it."""
    huge, n = 3e38, 5 * bucket
    parts = [_x(n, torch.float32, seed=s) for s in range(3)]
    for p in parts:
        p[1:9] = p[2 * bucket + 1 : 2 * bucket + 9] = p[3 * bucket + 1 : 3 * bucket + 9] = huge
        p[bucket + 3 : bucket + 5] = p[2 * bucket + 20 : 2 * bucket + 22] = -huge
    parts[1][3 * bucket + 30] = float("inf")
    payloads = torch.stack([maxmin.encode(p, bits, bucket, key=s) for s, p in enumerate(parts)])
    return payloads, parts[1], maxmin.decode_sum(payloads, n, parts[1], 1, None, bits, bucket)


@pytest.mark.parametrize("bits", range(1, 9))
def test_a_sum_that_overflows_decodes_to_inf_where_it_does(bits):
    """decode-sum-encode of a sum past fp32's range: that bucket coded saturated (no longer
    all NaN), +-Inf exactly where the fp32 sum is, finite values finite and within a step of
    the bucket's decoded range; +-Inf in own's input (not an overflow) still NaN, and so is a
    bucket overflowing both ways at one bit."""
    payloads, own, total = _overflowing_sum(bits)
    n = total.numel()
    y = maxmin.decode(
        maxmin.decode_sum_encode(payloads, n, own, 1, None, bits, 512, 7), n, bits, 512
    )
    nan = torch.zeros(n, dtype=torch.bool)
    nan[3 * 512 : 4 * 512] = True
    if bits == 1:
        nan[2 * 512 : 3 * 512] = True
    assert y[nan].isnan().all() and not y[~nan].isnan().any()
    infinite = total.isinf() & ~nan
    assert infinite.sum() >= 10 and torch.equal(y[infinite], total[infinite])
    finite = ~nan & ~infinite
    assert y[finite].isfinite().all()
    # Finite values err by less than a step of the widest saturated range, +-2**128.
    step = 2.0**129 / ((1 << bits) - 1)
    assert ((y[finite].double() - total[finite].double()).abs() <= step).all()


def test_only_a_sums_infinities_are_saturated():
    """encode itself, given the same values, still codes their +-Inf as NaN."""
    total = _overflowing_sum(4)[2]
    y = maxmin.decode(maxmin.encode(total, 4, 512, key=7), total.numel(), 4, 512)
    assert y[:512].isnan().all() and y[512:1024].isnan().all()


@pytest.mark.parametrize("native_codec", [True, False], ids=["c_loops", "torch"])
def test_the_saturation_check_runs_only_where_a_sum_overflowed(monkeypatch, native_codec):
    """decode-sum-encode looks through its payload for saturated buckets (a host cost at every
    call) only where its encode coded one, by the C loops or in torch (issue 43), with the
    bytes of checking at every call: NaN where own's input is +-Inf, +-Inf where the sum is."""
    payloads, own, total = _overflowing_sum(4)
    n = total.numel()
    g = torch.Generator().manual_seed(1)
    fine = torch.stack([maxmin.encode(torch.randn(n, generator=g), 4, 512, key=s) for s in (0, 1)])
    encode, saturated_buckets, checked = maxmin._encode, maxmin.saturated_buckets, []

    def spy(payload, layout):
        checked.append(saturated_buckets(payload, layout))
        return checked[-1]

    def checked_always(*args, **kwargs):  # as before issue 43: the check at every call
        with monkeypatch.context() as m:
            m.setattr(maxmin, "_encode", lambda *a, **k: (encode(*a, **k)[0], True))
            m.setattr(maxmin, "saturated_buckets", saturated_buckets)
            return maxmin.decode_sum_encode(*args, **kwargs)

    monkeypatch.setattr(maxmin, "saturated_buckets", spy)
    with cgx2.config.tuned(native_codec=native_codec):
        for scale in (None, 0.5):
            args = (fine, n, torch.randn(n, generator=g), 0, scale, 4, 512, 7)
            got = maxmin.decode_sum_encode(*args)
            assert checked == []
            assert torch.equal(got, checked_always(*args))
        checked.clear()
        got = maxmin.decode_sum_encode(payloads, n, own, 1, None, 4, 512, 7)
        assert checked == [[0, 1, 2, 3]]  # every bucket but the ordinary last one
        assert torch.equal(got, checked_always(payloads, n, own, 1, None, 4, 512, 7))
    y = maxmin.decode(got, n, 4, 512)
    assert y[3 * 512 : 4 * 512].isnan().all()  # +Inf in own's input: NaN
    assert not y[: 3 * 512].isnan().any() and not y[4 * 512 :].isnan().any()
    infinite = total.isinf()
    infinite[3 * 512 : 4 * 512] = False
    assert infinite.sum() >= 10 and torch.equal(y[infinite], total[infinite])


def test_negative_zero_minimum_is_stored_as_positive_zero():
    x = torch.tensor([0.0, -0.0, 1.0, 2.0] * 2)
    payload = maxmin.encode(x, 2, 8, key=0)
    assert payload[:4].view(torch.int32).item() == 0  # +0.0, not 0x80000000


def test_same_seed_same_bytes_other_seed_other_bytes():
    x = _x(5000, torch.float32)
    a = maxmin.encode(x, 3, 512, key=42)
    assert torch.equal(a, maxmin.encode(x.clone(), 3, 512, key=42))
    assert not torch.equal(a, maxmin.encode(x, 3, 512, key=43))
    assert not torch.equal(a, maxmin.encode(x, 3, 512, key=42, stream=1))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_decode_returns_requested_dtype(dtype):
    x = _x(600, dtype)
    y = maxmin.decode(maxmin.encode(x, 8, 512, key=0), 600, 8, 512, dtype)
    ref = maxmin.decode(maxmin.encode(x, 8, 512, key=0), 600, 8, 512).to(dtype)
    assert y.dtype == dtype and torch.equal(y, ref)


def test_bucket_size_not_multiple_of_8_and_larger_than_a_tile():
    for bucket in (3, 100, 3000):
        x = _x(7001, torch.float32)
        y = maxmin.decode(maxmin.encode(x, 5, bucket, key=1), 7001, 5, bucket)
        assert ((y.double() - x.double()).abs() <= quantize_bound(x, 5, bucket)).all()


# ----------------------------------------------------------------------------- chunks & sums


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 1000, 4 * 512 + 7])
def test_chunks_split_at_bucket_boundaries_and_roundtrip(world, n):
    layout = ChunkedLayout.split(n, world, 4, 512, skip_incomplete=False)
    sizes = [layout.chunk_size(j) for j in range(world)]
    assert sum(sizes) == n
    assert all(layout.chunk_start(j) % 512 == 0 for j in range(world) if sizes[j])
    x = _x(n, torch.float32)
    rows = maxmin.encode_chunks(x, layout, key=9)
    assert rows.shape == (world, layout.payload_nbytes)
    y = maxmin.decode_chunks(rows, layout, torch.float32)
    assert ((y.double() - x.double()).abs() <= quantize_bound(x, 4, 512)).all()


def test_decode_sum_encode_sums_rows_in_fp32_then_quantizes():
    n, rows = 3000, 3
    parts = [_x(n, torch.float32, seed=s) for s in range(rows)]
    own = _x(n, torch.bfloat16, seed=9)
    payloads = torch.stack([maxmin.encode(p, 8, 512, key=s) for s, p in enumerate(parts)])
    decoded = [maxmin.decode(p, n, 8, 512) for p in payloads]
    out = maxmin.decode_sum_encode(payloads, n, own, 1, 0.25, 8, 512, key=5)
    total = (own.float() + decoded[0] + decoded[2]) * 0.25  # row 1 is "own"
    y = maxmin.decode(out, n, 8, 512)
    assert ((y.double() - total.double()).abs() <= quantize_bound(total, 8, 512)).all()


# ----------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 3000),
    bits=st.integers(1, 8),
    bucket=st.integers(1, 700),
    skip=st.booleans(),
    scale=st.floats(1e-30, 1e30),
    key=st.integers(0, 2**64 - 1),
)
def test_any_shape_roundtrips_within_one_step(n, bits, bucket, skip, scale, key):
    x = _x(n, torch.float32, seed=n) * scale
    payload = maxmin.encode(x, bits, bucket, key=key, skip_incomplete=skip)
    assert payload.numel() == MaxMinLayout(n, bits, bucket, skip).nbytes
    assert payload.numel() % 16 == 0
    y = maxmin.decode(payload, n, bits, bucket, torch.float32, skip)
    assert ((y.double() - x.double()).abs() <= quantize_bound(x, bits, bucket)).all()


@settings(max_examples=40, deadline=None)
@given(levels=st.lists(st.integers(0, 255), min_size=1, max_size=70), bits=st.integers(1, 8))
def test_packing_is_a_little_endian_bit_stream(levels, bits):
    """Level j of a row sits at bits [j*bits, (j+1)*bits) of the row's bytes."""
    lv = torch.tensor([v % (1 << bits) for v in levels]).view(1, -1)
    stream = int.from_bytes(bytes(pack_levels(lv, bits).view(-1).tolist()), "little")
    assert [(stream >> (j * bits)) & ((1 << bits) - 1) for j in range(lv.numel())] == lv.view(
        -1
    ).tolist()


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 301])
def test_pack_stream_is_pack_levels_cut_after_the_last_level(bits, n):
    levels = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_stream(levels, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == stream_nbytes(n, bits)
    assert packed.numel() == -(-n * bits // 8)
    assert torch.equal(packed, pack_levels(levels.view(1, n), bits).view(-1)[: packed.numel()])
    assert torch.equal(unpack_stream(packed, bits, n), levels)
    with pytest.raises(ValueError, match="at least"):
        unpack_stream(packed[:-1], bits, n)


def test_four_bit_stream_puts_the_even_level_in_the_low_nibble():
    """Global-QSGD's 4-bit wire: two fields a byte, an odd count ends with a zero nibble."""
    assert pack_stream(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
    with pytest.raises(ValueError, match=r"bits must be an int in 1\.\.8"):
        pack_levels(torch.zeros(1, 8, dtype=torch.int64), 9)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_nearest_rounding_is_within_half_a_step_and_needs_no_key(bits):
    from cgx2.codecs import maxmin as reference

    x = torch.randn(5000, generator=torch.Generator().manual_seed(bits)) * 3
    payload = reference.encode(x, bits, 512, 7, nearest=True)
    assert torch.equal(payload, reference.encode(x, bits, 512, 8, stream=3, nearest=True))
    y = reference.decode(payload, 5000, bits, 512)
    rows = torch.cat([x, x[4608:4609].expand(120)]).view(-1, 512)  # the last bucket's padding
    step = ((rows.amax(1) - rows.amin(1)) / (2**bits - 1)).repeat_interleave(512)[:5000]
    # fp32 rounding in decoding: a few ulps of the bucket's largest value (tells at 8 bits)
    slack = 8 * FP32_EPS * bucket_absmax(x, 512)
    assert ((y - x).abs().double() <= 0.5 * step.double() * (1 + 1e-5) + slack).all()
    stochastic = reference.decode(reference.encode(x, bits, 512, 7), 5000, bits, 512)
    assert (y - x).abs().mean() < (stochastic - x).abs().mean()
