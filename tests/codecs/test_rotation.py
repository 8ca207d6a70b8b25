"""The rotated max-min codec (rotation="hadamard"): the rotation as docs/wire-format.md writes
it, its C loops' bits, the codec's bytes on every CPU path, round trip, unbiasedness, ranks."""

import math
import shutil

import numpy as np
import pytest
import torch
from bounds import allreduce_bound, quantize_bound

from cgx2.codecs import maxmin, native
from cgx2.codecs.layout import ChunkedLayout
from cgx2.codecs.philox import philox4x32
from cgx2.codecs.rotation import (
    Rotation,
    hadamard_rotate,
    hadamard_unrotate,
    rotation_for,
    rotation_scale,
    rotation_signs,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BUCKET = 512
ROT = Rotation(key=0xFEDCBA9876543210)  # both halves of the key matter


@pytest.fixture
def torch_only(monkeypatch):
    """Run a function with the C loops (rotation and codec) turned off: the reference's own."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            return fn(*args, **kwargs)

    return run


@pytest.fixture
def built():
    if native.library() is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: cgx2._C was not built, the CPU codec runs in torch")
    assert hasattr(native.library(), "hadamard_rotate"), "cgx2._C was not rebuilt"


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _x(n: int, seed: int = 0, outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    if outliers:  # one value a bucket 100 times the others'
        x[::BUCKET] = 300.0
    return x


# ----------------------------------------------------------------------------- the rotation


def _spec_rotate(x: np.ndarray, key: int, block: int, inverse: bool) -> np.ndarray:
    """docs/wire-format.md's "Rotation", written out value by value in numpy fp32."""
    x = x.astype(np.float32)
    out = x.copy()
    s = np.float32(1.0 / math.sqrt(block))

    def sign(i: int) -> np.float32:
        g = i >> 7
        words = philox4x32(*(torch.tensor([c]) for c in (g, 0, 0x48414441, 0x524F5441)), key)
        bit = (int(words[(i >> 5) & 3]) >> (i & 31)) & 1
        return np.float32(-1.0 if bit else 1.0)

    for start in range(0, len(x) - block + 1, block):
        signs = [sign(start + j) for j in range(block)]
        t = x[start : start + block].copy()
        if not inverse:
            t = np.array([t[j] * signs[j] for j in range(block)], dtype=np.float32)
        h = 1
        while h < block:
            for j in range(block):
                if j & h == 0:
                    a, b = t[j], t[j + h]
                    t[j], t[j + h] = a + b, a - b
            h *= 2
        t = t * s
        if inverse:
            t = np.array([t[j] * signs[j] for j in range(block)], dtype=np.float32)
        out[start : start + block] = t
    return out


@pytest.mark.parametrize(("block", "n"), [(8, 21), (128, 300), (256, 256)])
def test_the_rotation_is_the_spec_written_out(block, n):
    x = _x(n, seed=block)
    key = 0x0123456789ABCDEF
    y = hadamard_rotate(x, key, block)
    want = torch.from_numpy(_spec_rotate(x.numpy(), key, block, inverse=False))
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
    back = hadamard_unrotate(y, key, block)
    want = torch.from_numpy(_spec_rotate(y.numpy(), key, block, inverse=True))
    assert torch.equal(back.view(torch.int32), want.view(torch.int32))
    assert torch.equal(y[n - n % block :], x[n - n % block :])  # the part block: as it is


def test_signs_are_balanced_and_depend_on_the_key_and_index_alone():
    s = rotation_signs(5, 1 << 16)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(s.sum().item()) < 5 * 256  # 5 sigma of 65536 fair signs
    assert not torch.equal(s, rotation_signs(6, 1 << 16))
    assert torch.equal(rotation_signs(5, 1000), s[:1000])
    # The same signs whatever the block: a one-hot block's rotation has them, times s.
    for block in (8, 128, 1024):
        e = torch.zeros(2048)
        e[0] = 1.0
        y = hadamard_rotate(e, 5, block)
        assert torch.equal(y[:block], rotation_scale(block) * s[0] * torch.ones(block))


def test_the_scale_is_fp32_of_the_float64_root():
    s = torch.tensor(rotation_scale(128), dtype=torch.float32)
    assert s.view(torch.int32).item() == 0x3DB504F3
    assert rotation_scale(256) == 0.0625


@pytest.mark.parametrize("block", [2, 8, 128, 1024])
def test_the_inverse_rotation_round_trips(block):
    """unrotate(rotate(x)) is x within (2 log2 B + 4) * 2**-24 * |block|_2 per value: each of
    the 2 log2 B stages and the two scalings rounds once, relative to the block's norm (the
    rotation is orthogonal), and s*s*B is 1 within 2 * 2**-24."""
    n = 8 * block + 3
    for x in (_x(n, seed=block), _x(n, seed=block, outliers=True) * 1e-30):
        y = hadamard_rotate(x, 99, block)
        back = hadamard_unrotate(y, 99, block)
        whole = n - n % block
        norms = x[:whole].double().view(-1, block).norm(dim=1).repeat_interleave(block)
        bound = (2 * math.log2(block) + 4) * 2.0**-24 * norms
        assert ((back[:whole].double() - x[:whole].double()).abs() <= bound).all()
        assert torch.equal(back[whole:], x[whole:])
        # Orthogonal: each block's norm is kept (to rounding), and the values are mixed.
        rotated = y[:whole].double().view(-1, block).norm(dim=1).repeat_interleave(block)
        assert torch.allclose(rotated, norms, rtol=1e-5)
        assert (y[:whole] - x[:whole]).abs().max() > 0.1 * x.abs().max()


def test_bad_rotations_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="must divide bucket_size 64"):
        maxmin.encode(_x(256), 4, 64, 1, rotation=ROT)
    with pytest.raises(ValueError, match="power of two"):
        Rotation(key=1, block=96)
    with pytest.raises(ValueError, match="power of two"):
        Rotation(key=1, block=1)
    with pytest.raises(TypeError, match="rotation key"):
        Rotation(key=1.5)
    with pytest.raises(ValueError, match="rotation must be None or one of"):
        rotation_for("walsh", 1)
    assert rotation_for(None, 1) is None
    assert rotation_for("hadamard", 3, 256).block == 256


# ----------------------------------------------------------------------------- C loops


@pytest.mark.parametrize("block", [2, 8, 16, 128, 4096])
def test_the_c_loops_write_the_references_bits(block, built, torch_only):
    for n in (0, 1, block - 1, block, 3 * block + 5, 10000):
        x = _x(n, seed=n) * 5
        if n > 10:
            x[3], x[7], x[8] = float("nan"), float("inf"), -0.0
        for key in (0, 2**64 - 1, 0x123456789ABCDEF):
            y = hadamard_rotate(x, key, block)
            assert torch.equal(_bits_of(y), _bits_of(torch_only(hadamard_rotate, x, key, block)))
            got = hadamard_unrotate(y, key, block)
            want = torch_only(hadamard_unrotate, y, key, block)
            assert torch.equal(_bits_of(got), _bits_of(want)), (n, key)


def test_threads_split_the_blocks_without_changing_a_bit(monkeypatch, built, torch_only):
    monkeypatch.setattr(native, "_MIN_BLOCKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    calls = []
    rotate = native.library().hadamard_rotate

    def spy(src, dst, begin, end, *rest):
        calls.append((begin, end))
        return rotate(src, dst, begin, end, *rest)

    monkeypatch.setattr(native.library(), "hadamard_rotate", spy)
    x = _x(100 * 128 + 3)
    y = hadamard_rotate(x, 7)
    assert sorted(calls) == [(0, 33), (33, 67), (67, 101)]
    assert torch.equal(_bits_of(y), _bits_of(torch_only(hadamard_rotate, x, 7)))


# ----------------------------------------------------------------------------- the codec


def _codec_calls(x: torch.Tensor, bits: int, skip: bool) -> dict[str, torch.Tensor]:
    """Every coding function's output with ROT, for one input."""
    n = x.numel()
    out = {}
    payload = maxmin.encode(x, bits, BUCKET, 11, 2**33 + 5, skip, rotation=ROT)
    out["encode"] = payload
    for dtype in DTYPES:
        out[f"decode {dtype}"] = maxmin.decode(payload, n, bits, BUCKET, dtype, skip, rotation=ROT)
    layout = ChunkedLayout.split(n, 3, bits, BUCKET, skip)
    rows = maxmin.encode_chunks(x, layout, 5, rotation=ROT)
    out["encode_chunks"] = rows
    for dtype in DTYPES:
        out[f"decode_chunks {dtype}"] = maxmin.decode_chunks(rows, layout, dtype, rotation=ROT)
    size = layout.chunk_size(0)
    own = x[:size]
    for scale in (None, 0.25):
        args = (rows, size, own, 0, scale, bits, BUCKET)
        out[f"decode_sum {scale}"] = maxmin.decode_sum(*args, skip, rotation=ROT).clone()
        out[f"decode_sum_encode {scale}"] = maxmin.decode_sum_encode(
            *args, 9, 0, skip, rotation=ROT
        )
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_path_writes_the_references_bytes(bits, dtype, built, torch_only):
    """Every function, C loops against torch alone: fp32/fp16/bf16 input, whole and part
    blocks, a part bucket, skip_incomplete's raw tail."""
    for n, skip in ((4 * BUCKET, False), (4 * BUCKET + 77, False), (3 * BUCKET + 300, True)):
        x = _x(n, seed=bits, outliers=True).to(dtype)
        got = _codec_calls(x, bits, skip)
        want = torch_only(_codec_calls, x, bits, skip)
        for name, value in got.items():
            assert torch.equal(_bits_of(value), _bits_of(want[name])), (n, name)


def test_the_rotated_codec_codes_the_rotated_values():
    """encode(x, rotation) is encode(rotate(x)); decode rotates back, then casts."""
    x = _x(3 * BUCKET + 300, seed=1, outliers=True).to(torch.bfloat16)
    rotated = hadamard_rotate(x, ROT.key)
    for skip in (False, True):
        payload = maxmin.encode(x, 3, BUCKET, 4, 1, skip, rotation=ROT)
        assert torch.equal(payload, maxmin.encode(rotated, 3, BUCKET, 4, 1, skip))
        plain = maxmin.decode(payload, x.numel(), 3, BUCKET, torch.float32, skip)
        y = maxmin.decode(payload, x.numel(), 3, BUCKET, torch.bfloat16, skip, rotation=ROT)
        assert torch.equal(y, maxmin._cast(hadamard_unrotate(plain, ROT.key), torch.bfloat16))
    assert not torch.equal(payload, maxmin.encode(x, 3, BUCKET, 4, 1, True))  # None: unrotated


@pytest.mark.parametrize("bits", [2, 4])
def test_the_rotated_codec_is_unbiased(bits):
    """For fixed signs, the mean of many decodings (each chunk its own payload, with the
    same signs and its own stream of rounding) tends to x: each value's error mixes its
    block's rounding errors with weights +-1/sqrt(B), so its variance is at most one step of
    the block's rotated bucket, squared, over 4."""
    n, copies = 1024, 2048
    x = _x(n, seed=5, outliers=True)
    layout = ChunkedLayout(
        numel=n * copies, num_chunks=copies, chunk_numel=n, bits=bits, bucket_size=BUCKET
    )
    rows = maxmin.encode_chunks(x.repeat(copies), layout, 11, rotation=ROT)
    y = maxmin.decode_chunks(rows, layout, torch.float32, rotation=ROT)
    mean = y.view(copies, n).double().mean(0)
    sigma = quantize_bound(hadamard_rotate(x, ROT.key), bits, BUCKET) / 2 / copies**0.5
    # The rotation's own rounding: 2 log2 B + 4 roundings of each block's norm.
    norms = x.double().view(-1, 128).norm(dim=1).repeat_interleave(128)
    slack = 18 * 2.0**-24 * (norms + 4 * sigma * copies**0.5)
    err = mean - x.double()
    assert (err.abs() <= 6 * sigma + slack).all(), (err.abs() / sigma).max()
    # Rounding to the nearest, biased, fails the same check.
    nearest = maxmin.encode(x, bits, BUCKET, 11, nearest=True, rotation=ROT)
    biased = maxmin.decode(nearest, n, bits, BUCKET, rotation=ROT).double() - x.double()
    assert not (biased.abs() <= 6 * sigma + slack).all()


def _allreduce(inputs: list[torch.Tensor], bits: int, rotations: list) -> torch.Tensor:
    """The scatter-reduce-allgather of :func:`cgx2.collectives.reference_allreduce`, one piece,
    rank r encoding with ``rotations[r]`` and its own rounding key."""
    world, n = len(inputs), inputs[0].numel()
    layout = ChunkedLayout.split(n, world, bits, BUCKET, False)
    sent = [
        maxmin.encode_chunks(x, layout, 100 + r, r, rotation=rotations[r])
        for r, x in enumerate(inputs)
    ]
    reduced = torch.zeros(world, layout.payload_nbytes, dtype=torch.uint8)
    for j in range(world):
        start, size = layout.chunk_start(j), layout.chunk_size(j)
        received = torch.stack([sent[r][j] for r in range(world)])
        own = inputs[j][start : start + size]
        args = (received, size, own, j, None, bits, BUCKET, 7, j)
        maxmin.decode_sum_encode(*args, out=reduced[j], rotation=rotations[j])
    outputs = [maxmin.decode_chunks(reduced, layout, torch.float32, rotation=r) for r in rotations]
    for y, rotation in zip(outputs[1:], rotations[1:], strict=True):
        if rotation is rotations[0]:  # the same bytes and signs: the same bits
            assert torch.equal(y.view(torch.int32), outputs[0].view(torch.int32))
    return outputs[0]


@pytest.mark.parametrize("bits", [2, 4])
def test_ranks_with_one_rotation_key_sum_in_the_rotated_domain(bits):
    """Ranks whose rounding keys differ but whose rotation keys agree: the allreduce's result
    is the exact sum within the rotated sum's error bound (carried back by the orthogonal
    inverse: a value's error is at most its block's norm of rotated errors); ranks whose
    signs differ would sum unrelated rotations."""
    world, n = 3, 5 * BUCKET + 77
    inputs = [_x(n, seed=r, outliers=True) for r in range(world)]
    exact = torch.stack(inputs).double().sum(0)
    y = _allreduce(inputs, bits, [ROT] * world)
    whole = n - n % 128
    rotated = [hadamard_rotate(x, ROT.key) for x in inputs]
    bound = allreduce_bound(rotated, bits, BUCKET, torch.float32)
    per_block = bound[:whole].view(-1, 128).norm(dim=1).repeat_interleave(128)
    norms = exact[:whole].view(-1, 128).norm(dim=1).repeat_interleave(128)
    per_block = per_block + 18 * 2.0**-24 * norms
    assert ((y[:whole].double() - exact[:whole]).abs() <= per_block).all()
    assert ((y[whole:].double() - exact[whole:]).abs() <= bound[whole:]).all()
    # Same seed, same bytes: again gives the same bits; other signs on one rank do not sum.
    assert torch.equal(
        _allreduce(inputs, bits, [ROT] * world).view(torch.int32), y.view(torch.int32)
    )
    # At 8 bits, where coding costs little, one rank's other signs cost much more.
    right = _allreduce(inputs, 8, [ROT] * world).double() - exact
    wrong = _allreduce(inputs, 8, [ROT, Rotation(key=1), ROT]).double() - exact
    assert wrong.norm() > 10 * right.norm()


def test_rotation_cuts_the_2_bit_error_on_a_tensor_with_outliers():
    """One value a bucket 100 times the others' sets the max-min range; rotated, it is spread
    over its block as +-300/sqrt(128), and the range shrinks about fourfold."""
    x = _x(64 * BUCKET, seed=3, outliers=True)
    errors = {}
    for name, rotation in (("plain", None), ("rotated", ROT)):
        payload = maxmin.encode(x, 2, BUCKET, 21, rotation=rotation)
        y = maxmin.decode(payload, x.numel(), 2, BUCKET, rotation=rotation)
        errors[name] = (y - x).norm().item()
    assert errors["plain"] / errors["rotated"] > 3.0, errors


# ----------------------------------------------------------------------------- non-finite


def test_finite_stays_finite_up_to_the_documented_range():
    """max|x| <= FLT_MAX / B**1.5 decodes finite (docs/wire-format.md, "Range"), also through
    the allreduce's sum of two ranks."""
    top = torch.finfo(torch.float32).max / 128**1.5 / 2  # two ranks' sum within the range
    x = _x(4 * BUCKET, seed=2)
    x = x / x.abs().max() * top
    for bits in (1, 2, 4, 8):
        y = maxmin.decode(
            maxmin.encode(x, bits, BUCKET, 3, rotation=ROT), x.numel(), bits, BUCKET, rotation=ROT
        )
        assert y.isfinite().all()
        assert _allreduce([x, x.flip(0)], bits, [ROT, ROT]).isfinite().all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38])
def test_a_non_finite_value_or_an_overflow_makes_its_bucket_non_finite_only(bad):
    """NaN and +-Inf make their bucket NaN; a finite value whose inverse rotation overflows
    fp32 decodes non-finite in its bucket (never clipped into finite numbers); the other
    buckets decode as without it, in the allreduce too (the owner's value or another's)."""
    x = _x(4 * BUCKET + 77, seed=4)
    at, hit = BUCKET + 200, slice(BUCKET, 2 * BUCKET)

    def coded(v: torch.Tensor) -> torch.Tensor:
        payload = maxmin.encode(v, 4, BUCKET, 3, rotation=ROT)
        return maxmin.decode(payload, v.numel(), 4, BUCKET, rotation=ROT)

    def others(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v[: hit.start], v[hit.stop :]])

    def broken(v: torch.Tensor) -> bool:
        return bool(v.isnan().all()) if bad != 3e38 else not bool(v.isfinite().all())

    clean = coded(x)
    x[at] = bad
    y = coded(x)
    assert broken(y[hit])
    assert torch.equal(others(y), others(clean))
    for r in (0, 1):  # rank 0 owns the chunk of the bucket
        inputs = [_x(x.numel(), seed=9), _x(x.numel(), seed=8)]
        inputs[r][at] = bad
        out = _allreduce(inputs, 4, [ROT, ROT])
        assert broken(out[hit]) and others(out).isfinite().all(), r
