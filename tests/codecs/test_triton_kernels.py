"""Triton kernels write the reference codec's bytes (on the CPU under TRITON_INTERPRET=1)."""

import pytest
import torch

import cgx2.config
from cgx2.codecs import maxmin as ref
from cgx2.codecs.layout import ChunkedLayout
from cgx2.codecs.rotation import Rotation, rotation_scale

tri = pytest.importorskip("cgx2.codecs.maxmin_triton", reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reference_in_torch():
    """The reference with the C loops off: its levels are packing.py's bytes, which the
    kernels' own packer (``_pack_store``) must write."""
    with cgx2.config.tuned(native_codec=False):
        yield


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 2 - 0.5).to(dtype).to(DEVICE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN == NaN)."""
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(ints), b.view(ints)
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


CASES = [
    # bits, dtype, n, bucket, skip_incomplete
    *[(b, torch.float32, 1000, 512, False) for b in range(1, 9)],
    (4, torch.float16, 1000, 512, False),
    (4, torch.bfloat16, 1000, 512, True),
    (3, torch.bfloat16, 4099, 128, False),
    (5, torch.float32, 1000, 100, True),  # bucket not a multiple of 8
    (6, torch.float32, 5000, 2048, False),  # bucket wider than a tile
    (7, torch.float32, 5000, 2048, True),
    (2, torch.float64, 777, 64, False),
    (8, torch.float32, 1, 512, False),
    (1, torch.float32, 0, 512, False),
]


@pytest.mark.parametrize(("bits", "dtype", "n", "bucket", "skip"), CASES)
def test_encode_and_decode_match_reference(bits, dtype, n, bucket, skip):
    x = _x(n, dtype, seed=bits)
    expected = ref.encode(x, bits, bucket, key=123456789123, stream=3, skip_incomplete=skip)
    payload = tri.encode(x, bits, bucket, key=123456789123, stream=3, skip_incomplete=skip)
    assert _same(payload, expected)
    assert _same(
        tri.decode(payload, n, bits, bucket, dtype, skip),
        ref.decode(expected, n, bits, bucket, dtype, skip),
    )


def test_bf16_decode_rounds_to_nearest_even_like_torch():
    x = _x(4096, torch.float32)
    payload = ref.encode(x, 8, 512, key=1)
    assert _same(
        tri.decode(payload, 4096, 8, 512, torch.bfloat16),
        ref.decode(payload, 4096, 8, 512, torch.bfloat16),
    )


def test_signed_zero_buckets_match_reference():
    x = torch.tensor([-0.0, 0.0, -0.0, 0.0] * 128 + [0.0, -0.0, 3.0, -0.0] * 128).to(DEVICE)
    assert _same(tri.encode(x, 4, 512, key=0), ref.encode(x.cpu(), 4, 512, key=0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_buckets_match_reference(bad):
    x = _x(2048, torch.float32)
    x[5] = bad
    payload = tri.encode(x, 4, 512, key=0)
    assert _same(payload, ref.encode(x, 4, 512, key=0))
    y = tri.decode(payload, 2048, 4, 512)
    assert torch.isnan(y[:512]).all() and torch.isfinite(y[512:]).all()


def _edge(bucket: int, dtype: torch.dtype) -> torch.Tensor:
    """One bucket of each kind the kernels' shortcuts must get right, then ordinary ones: a
    constant, +-inf, NaN (in the second tile of a wide bucket too), a span that overflows, a
    subnormal span (infinite scale: 0 * inf is NaN), a normal one too narrow for an fp32
    scale at 8 bits, signed zeros, a tiny span far from 0, a
    finite span near fp32's top."""
    specials = [
        lambda s: s.fill_(1.5),
        lambda s: s.__setitem__(len(s) // 3, float("inf")),
        lambda s: s.__setitem__(len(s) - 3, float("nan")),
        lambda s: s.__setitem__(0, float("-inf")),
        lambda s: s.copy_(torch.where(s > 0, 3e38, -3e38)),
        lambda s: s.mul_(1e-40),
        lambda s: s.mul_(1e-38),  # normal values, a span whose lmax / span overflows at 8 bits
        lambda s: s.copy_(torch.where(s > 0, 0.0, -0.0)),
        lambda s: s.mul_(1e-3).add_(1e4),
        lambda s: s.mul_(1e34),
    ]
    x = _x((len(specials) + 1) * bucket + bucket // 2 + 3, torch.float32, seed=7).cpu()
    for i, fill in enumerate(specials):
        fill(x[i * bucket : (i + 1) * bucket])
    return x.to(dtype).to(DEVICE)


def test_raw_tail_nan_decodes_to_the_reference_bf16_nan():
    """skip_incomplete's raw tail goes through the same NaN-canonicalising cast."""
    x = _x(1000, torch.float32)
    x[-1] = float("nan")
    payload = ref.encode(x, 4, 512, key=1, skip_incomplete=True)
    got = tri.decode(payload, 1000, 4, 512, torch.bfloat16, True)
    assert _same(got, ref.decode(payload, 1000, 4, 512, torch.bfloat16, True))
    assert got[-1:].view(torch.int16).item() == 0x7FC0


# fp32 inputs only: the interpreter misreads subnormal bf16 (bench/gpu_check.py covers bf16).
@pytest.mark.parametrize(("bits", "bucket"), [(1, 512), (4, 512), (8, 512), (4, 2048), (3, 128)])
def test_edge_buckets_match_reference(bits, bucket):
    x = _edge(bucket, torch.float32)
    n = x.numel()
    expected = ref.encode(x, bits, bucket, key=99, stream=1)
    assert _same(tri.encode(x, bits, bucket, key=99, stream=1), expected)
    for out in (torch.float32, torch.bfloat16):
        assert _same(
            tri.decode(expected, n, bits, bucket, out), ref.decode(expected, n, bits, bucket, out)
        )
    payloads = torch.stack([expected, ref.encode(x.flip(0), bits, bucket, key=5)])
    args = (n, x, 1, 0.5, bits, bucket, 11, 2)
    assert _same(tri.decode_sum_encode(payloads, *args), ref.decode_sum_encode(payloads, *args))


@pytest.mark.parametrize(
    ("world", "n", "skip"), [(2, 1000, False), (3, 4 * 512 + 7, True), (4, 5, False)]
)
def test_chunked_encode_decode_match_reference(world, n, skip):
    x = _x(n, torch.float32)
    layout = ChunkedLayout.split(n, world, 4, 512, skip)
    for skip_chunk in (-1, world - 1):
        rows = tri.encode_chunks(x, layout, key=77, skip_chunk=skip_chunk)
        assert _same(rows, ref.encode_chunks(x, layout, key=77, skip_chunk=skip_chunk).to(DEVICE))
    assert _same(
        tri.decode_chunks(rows, layout, torch.float16),
        ref.decode_chunks(rows, layout, torch.float16),
    )


@pytest.mark.parametrize(
    ("bits", "bucket", "own_index", "scale", "skip"),
    [
        (4, 512, 1, None, False),
        (2, 512, -1, 0.25, False),
        (8, 2048, 0, 1 / 3, True),
        (3, 100, 2, 0.5, True),
    ],
)
def test_decode_sum_encode_matches_reference(bits, bucket, own_index, scale, skip):
    n, rows = 3001, 3
    layout = ChunkedLayout(n, 1, n, bits, bucket, skip)
    payloads = torch.stack(
        [
            ref.encode(_x(n, torch.float32, seed=s), bits, bucket, key=s, skip_incomplete=skip)
            for s in range(rows)
        ]
    )
    assert payloads.shape[1] == layout.payload_nbytes
    own = _x(n, torch.bfloat16, seed=99) if own_index >= 0 else None
    args = (n, own, own_index, scale, bits, bucket, 5, 2, skip)
    assert _same(tri.decode_sum_encode(payloads, *args), ref.decode_sum_encode(payloads, *args))
    args = (n, own, own_index, scale, bits, bucket, skip)  # the reduce-scatter's last stage
    assert _same(tri.decode_sum(payloads, *args), ref.decode_sum(payloads, *args))


def _overflowing(n: int, bucket: int, seed: int) -> list[torch.Tensor]:
    """Three rows whose sum, bucket by bucket in turn, passes +FLT_MAX, -FLT_MAX, both, passes
    it everywhere, meets +-Inf or NaN in row 0's input, or stays ordinary."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g) * 3 for _ in range(3)]
    for q, start in enumerate(range(0, n, bucket)):
        i, j = (start + torch.randint(0, min(bucket, n - start), (2,), generator=g)).tolist()
        kind = q % 7
        for p in parts:
            if kind in (0, 2):
                p[i] = 3e38
            if kind in (1, 2):
                p[j] = -3e38
            if kind == 3:
                p[start : start + bucket] = 3e38
            if kind in (4, 5):
                p[i] = 3e38
        if kind == 4:
            parts[0][j] = float("inf") if q % 2 else -float("inf")
        if kind == 5:
            parts[0][j] = float("nan")
    return parts


@pytest.mark.parametrize(
    ("bits", "bucket", "own_dtype", "scale"),
    [
        (1, 512, torch.float32, None),
        (2, 100, torch.bfloat16, 0.5),
        (4, 512, None, None),
        (4, 2048, torch.float32, 1 / 3),
        (8, 13, torch.float32, None),
        (5, 2048, None, 0.25),
        (3, 100, torch.float32, None),
    ],
)
def test_an_overflowing_sum_is_coded_as_the_reference_codes_it(bits, bucket, own_dtype, scale):
    """Decode-sum-encode of sums past fp32's range, buckets of one and of several a tile and
    wider than one: saturated where the reference saturates them, NaN where own's input is
    not finite, byte for byte; and ranges ending near FLT_MAX, encoded as the reference."""
    n = 5 * bucket + 7
    parts = [p.to(DEVICE) for p in _overflowing(n, bucket, seed=bits)]
    payloads = torch.stack([ref.encode(p, bits, bucket, key=r) for r, p in enumerate(parts)])
    own = None if own_dtype is None else parts[0].to(own_dtype)
    args = (n, own, 0 if own is not None else -1, scale, bits, bucket, 5, 1)
    got = tri.decode_sum_encode(payloads, *args)
    assert _same(got, ref.decode_sum_encode(payloads, *args))
    if bits > 1 and scale in (None, 0.5):  # three rows of 3e38 times 1/3 or 1/4: no overflow
        assert ref.decode(got, n, bits, bucket).isinf().any()  # saturated, not NaN
    x = parts[1].clone()
    x[: n // 2] = torch.finfo(torch.float32).max
    assert _same(tri.encode(x, bits, bucket, key=3), ref.encode(x, bits, bucket, key=3))


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize(
    ("bits", "bucket", "skip"), [(4, 512, False), (3, 100, True), (2, 2048, False)]
)
def test_strided_programs_match_reference(monkeypatch, programs, bits, bucket, skip):
    """Encode and decode-sum-encode walk their tiles in strides of the grid, loading one tile
    ahead: any number of programs writes the reference's bytes, the incomplete last tile
    included, whichever program it falls to."""
    monkeypatch.setattr(tri, "_programs", lambda tiles: min(tiles, programs))
    n = 9 * bucket + 37
    x = _x(n, torch.float32, seed=programs)
    expected = ref.encode(x, bits, bucket, key=42, stream=1, skip_incomplete=skip)
    assert _same(tri.encode(x, bits, bucket, key=42, stream=1, skip_incomplete=skip), expected)
    layout = ChunkedLayout.split(n, 3, bits, bucket, skip)
    rows = tri.encode_chunks(x, layout, key=8, skip_chunk=1)
    assert _same(rows, ref.encode_chunks(x, layout, key=8, skip_chunk=1).to(DEVICE))
    payloads = torch.stack(
        [
            ref.encode(_x(n, torch.float32, seed=s), bits, bucket, key=s, skip_incomplete=skip)
            for s in range(3)
        ]
    )
    args = (n, x, 2, 0.5, bits, bucket, 6, 1, skip)
    assert _same(tri.decode_sum_encode(payloads, *args), ref.decode_sum_encode(payloads, *args))


def _key_tensor(key: int) -> torch.Tensor:
    return torch.tensor([key - (1 << 64) if key >= 1 << 63 else key], device=DEVICE)


@pytest.mark.parametrize("key", [77, 0xFEDCBA9876543210, (1 << 64) - 1])
def test_keys_read_from_memory_match_reference(key):
    """A key held in a device tensor (what a CUDA graph replays with) gives the bytes of the
    same key passed by value: both halves, the sign bit of the int64 included."""
    n, bits, bucket = 3 * 512 + 9, 4, 512
    x = _x(n, torch.float32, seed=3)
    layout = ChunkedLayout.split(n, 2, bits, bucket, False)
    rows = tri.encode_chunks(x, layout, key=_key_tensor(key), skip_chunk=0)
    assert _same(rows, ref.encode_chunks(x, layout, key=key, skip_chunk=0).to(DEVICE))
    payloads = torch.stack(
        [ref.encode(_x(n, torch.float32, seed=s), bits, bucket, key=s) for s in range(2)]
    ).to(DEVICE)
    args = (n, x, 1, 0.5, bits, bucket)
    assert _same(
        tri.decode_sum_encode(payloads, *args, _key_tensor(key), 1),
        ref.decode_sum_encode(payloads.cpu(), n, x.cpu(), 1, 0.5, bits, bucket, key, 1).to(DEVICE),
    )


def test_key_tensor_must_be_one_int64_on_the_device():
    x = _x(1024, torch.float32)
    layout = ChunkedLayout.split(1024, 2, 4, 512, False)
    for bad in (torch.tensor([1, 2], device=DEVICE), torch.tensor([1.0], device=DEVICE)):
        with pytest.raises(ValueError, match="one int64"):
            tri.encode_chunks(x, layout, key=bad)


@pytest.mark.parametrize("skip", [False, True])
def test_a_payload_allocated_uninitialized_gets_the_references_bytes(monkeypatch, skip):
    """``encode`` allocates its one row uninitialized and its kernel zeroes the alignment
    gaps itself (no memset): with the allocation poisoned, every byte is still the
    reference's."""
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(0xAB) if t.dtype == torch.uint8 else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    for n, bits, bucket in ((1, 3, 8), (511, 4, 100), (1000, 1, 512), (4099, 8, 100)):
        x = _x(n, torch.float32, seed=n)
        want = ref.encode(x, bits, bucket, 12345, 0, skip)
        assert _same(tri.encode(x, bits, bucket, 12345, 0, skip), want), (n, bits, bucket)


@pytest.mark.parametrize(
    ("bits", "dtype", "n", "bucket"),
    [
        (8, torch.float32, 1000, 512),
        (4, torch.bfloat16, 4099, 128),
        (2, torch.float32, 5000, 2048),
        (8, torch.bfloat16, 777, 100),
    ],
)
def test_nearest_rounding_matches_reference(bits, dtype, n, bucket):
    x = _x(n, dtype, seed=bits)
    expected = ref.encode(x, bits, bucket, key=0, nearest=True)
    payload = tri.encode(x, bits, bucket, key=0, nearest=True)
    assert _same(payload, expected)
    assert not _same(payload, tri.encode(x, bits, bucket, key=0))  # not the stochastic bytes


# ----------------------------------------------------------------- the rotated codec's kernels

ROTATED = [
    # bits, dtype, n, bucket, block, skip_incomplete: blocks of 128 and others, a last part
    # block and a last part bucket, raw tails of rotated values, a bucket wider than a tile
    (4, torch.float32, 1000, 512, 128, False),
    (2, torch.bfloat16, 4099, 128, 128, False),
    (3, torch.float16, 1000, 256, 64, True),
    (8, torch.float32, 5000, 2048, 128, False),
    (2, torch.float16, 777, 512, 128, True),
    (3, torch.float32, 700, 384, 128, True),  # a tile wider than the bucket
    (8, torch.bfloat16, 1500, 128, 16, False),
    (4, torch.float32, 777, 100, 4, True),  # blocks inside a group: a sign a Philox call
    (4, torch.float32, 1000, 24, 8, True),  # buckets of 3 groups: a Philox call a group
    (3, torch.bfloat16, 999, 40, 8, False),
    (5, torch.float32, 999, 8, 2, False),
    (4, torch.float32, 3000, 2048, 2048, False),  # a block wider than the widest tile
]


def _rotation(block: int, key: int = 0xFEDCBA9876543210) -> Rotation:
    return Rotation(key=key, block=block)


@pytest.mark.parametrize(("bits", "dtype", "n", "bucket", "block", "skip"), ROTATED)
def test_rotated_encode_and_decode_match_reference(bits, dtype, n, bucket, block, skip):
    """The rotation fused into the kernels (encode rotates in registers before the bucket's
    statistics, decode rotates back before the cast) writes the reference's bytes and
    values, bit for bit; the unrotated kernels are untouched by it."""
    x = _x(n, dtype, seed=bits)
    rot = _rotation(block)
    args = (x, bits, bucket, 123456789123, 3, skip)
    expected = ref.encode(*args, rotation=rot)
    payload = tri.encode(*args, rotation=rot)
    assert _same(payload, expected)
    assert not _same(payload, tri.encode(*args))
    assert _same(tri.encode(*args), ref.encode(*args))
    decoded = tri.decode(payload, n, bits, bucket, dtype, skip, rotation=rot)
    assert _same(decoded, ref.decode(expected, n, bits, bucket, dtype, skip, rotation=rot))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rotated_widths_and_dtypes_match_reference(bits, dtype):
    """Every width below and at 4 bits and 8, every input dtype: 777 values, whose last block
    (777 % 128 = 9 values) stays unrotated in a last, part bucket."""
    x = _x(777, dtype, seed=bits + 10)
    rot = _rotation(128, key=bits)
    expected = ref.encode(x, bits, 256, 5, 1, rotation=rot)
    assert _same(tri.encode(x, bits, 256, 5, 1, rotation=rot), expected)
    assert _same(
        tri.decode(expected, 777, bits, 256, dtype, rotation=rot),
        ref.decode(expected, 777, bits, 256, dtype, rotation=rot),
    )


@pytest.mark.parametrize(("world", "n", "skip"), [(2, 1000, False), (3, 4 * 512 + 7, True)])
def test_rotated_chunks_match_reference(world, n, skip):
    """Each chunk rotated as a payload of its own (indices from 0), rows skipped, keys read
    from device memory (a CUDA graph's) for the rounding and the signs alike."""
    x = _x(n, torch.bfloat16)
    layout = ChunkedLayout.split(n, world, 3, 512, skip)
    rot = _rotation(128, key=(1 << 64) - 1)
    in_memory = Rotation(key=_key_tensor(rot.key), block=128)
    for skip_chunk in (-1, world - 1):
        want = ref.encode_chunks(x, layout, key=77, skip_chunk=skip_chunk, rotation=rot)
        for key, signs in ((77, rot), (_key_tensor(77), in_memory)):
            rows = tri.encode_chunks(x, layout, key=key, skip_chunk=skip_chunk, rotation=signs)
            assert _same(rows, want.to(DEVICE))
    for signs in (rot, in_memory):
        assert _same(
            tri.decode_chunks(rows, layout, torch.float16, rotation=signs),
            ref.decode_chunks(rows, layout, torch.float16, rotation=rot),
        )


@pytest.mark.parametrize(
    ("bits", "bucket", "block", "own_index", "scale", "skip", "own_dtype"),
    [
        (4, 512, 128, 1, None, False, torch.float32),
        (2, 512, 128, -1, 0.25, False, None),
        (8, 2048, 128, 0, 1 / 3, True, torch.bfloat16),
        (3, 128, 64, 2, 0.5, True, torch.float16),
        (4, 100, 4, 1, None, True, torch.float32),
    ],
)
def test_rotated_decode_sum_encode_matches_reference(
    bits, bucket, block, own_index, scale, skip, own_dtype
):
    """Decode-sum-encode rotates own's values in the kernel and sums in the rotated domain
    (the rows are rotated payloads); the unfused sum rotates back: the reference's bytes."""
    n, rows = 3001, 3
    rot = _rotation(block, key=31337)
    payloads = torch.stack(
        [
            ref.encode(
                _x(n, torch.float32, seed=s),
                bits,
                bucket,
                key=s,
                skip_incomplete=skip,
                rotation=rot,
            )
            for s in range(rows)
        ]
    )
    own = _x(n, own_dtype, seed=99) if own_dtype is not None else None
    args = (n, own, own_index, scale, bits, bucket, 5, 2, skip)
    want = ref.decode_sum_encode(payloads, *args, rotation=rot)
    assert _same(tri.decode_sum_encode(payloads, *args, rotation=rot), want)
    if own is not None:  # own's values rotated: not the unrotated sum's bytes
        assert not _same(want, ref.decode_sum_encode(payloads, *args))
    args = (n, own, own_index, scale, bits, bucket, skip)
    want = ref.decode_sum(payloads, *args, rotation=rot)
    assert _same(tri.decode_sum(payloads, *args, rotation=rot), want)


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_rotated_edge_buckets_match_reference(bits):
    """The edge buckets (non-finite values, spans that overflow or underflow, signed zeros)
    rotated: NaN written as the reference writes it (0x7FC00000, 0x7FC0 in bf16), and an
    overflowing sum of rotated values coded saturated as the reference codes it."""
    bucket = 512
    x = _edge(bucket, torch.float32)
    n = x.numel()
    rot = _rotation(128)
    expected = ref.encode(x, bits, bucket, key=99, stream=1, rotation=rot)
    assert _same(tri.encode(x, bits, bucket, key=99, stream=1, rotation=rot), expected)
    for out in (torch.float32, torch.bfloat16):
        got = tri.decode(expected, n, bits, bucket, out, rotation=rot)
        assert _same(got, ref.decode(expected, n, bits, bucket, out, rotation=rot))
        assert got.isnan().any()
    payloads = torch.stack([expected, ref.encode(x.flip(0), bits, bucket, key=5, rotation=rot)])
    args = (n, x, 1, 0.5, bits, bucket, 11, 2)
    assert _same(
        tri.decode_sum_encode(payloads, *args, rotation=rot),
        ref.decode_sum_encode(payloads, *args, rotation=rot),
    )
    parts = [p.to(DEVICE) for p in _overflowing(5 * bucket + 7, bucket, seed=bits)]
    payloads = torch.stack(
        [ref.encode(p, bits, bucket, key=r, rotation=rot) for r, p in enumerate(parts)]
    )
    args = (parts[0].numel(), parts[0], 0, None, bits, bucket, 5, 1)
    assert _same(
        tri.decode_sum_encode(payloads, *args, rotation=rot),
        ref.decode_sum_encode(payloads, *args, rotation=rot),
    )


def test_rotated_nearest_and_strided_programs_match_reference(monkeypatch):
    """Rounding to the nearest, and any number of programs walking the tiles (the last, part
    tile to whichever program it falls), rotated as the reference rotates."""
    n, bits, bucket = 9 * 256 + 37, 4, 256
    x = _x(n, torch.float32, seed=5)
    rot = _rotation(128)
    want = ref.encode(x, bits, bucket, key=0, nearest=True, rotation=rot)
    assert _same(tri.encode(x, bits, bucket, key=0, nearest=True, rotation=rot), want)
    for programs in (1, 3):
        monkeypatch.setattr(tri, "_programs", lambda tiles, p=programs: min(tiles, p))
        want = ref.encode(x, bits, bucket, key=42, stream=1, rotation=rot)
        assert _same(tri.encode(x, bits, bucket, key=42, stream=1, rotation=rot), want)
        payloads = torch.stack([want, ref.encode(x.flip(0), bits, bucket, key=1, rotation=rot)])
        args = (n, x, 0, 0.5, bits, bucket, 6, 1)
        assert _same(
            tri.decode_sum_encode(payloads, *args, rotation=rot),
            ref.decode_sum_encode(payloads, *args, rotation=rot),
        )


def test_the_rotation_scale_is_the_references_for_every_block():
    """The kernels' scale, built from its bits, is rotation_scale's fp32(1/sqrt(block))."""
    for k in range(1, 13):
        block = 1 << k
        x = torch.zeros(block, device=DEVICE)
        x[0] = 1.0  # the transform of e0 is all ones: the rotation gives sign * scale
        got = tri._rotated(x, Rotation(key=0, block=block), block).abs()
        assert torch.equal(got.cpu(), torch.full((block,), rotation_scale(block))), block


def test_the_forward_butterflies_by_exchange_write_the_same_bytes(monkeypatch):
    """The forward rotation's other way of moving values between groups (``_EXCHANGE_FORWARD``,
    for an A/B on a GPU) writes the reference's bytes too."""
    monkeypatch.setattr(tri, "_EXCHANGE_FORWARD", tri.tl.constexpr(True))
    n, bits, bucket = 3 * 512 + 77, 3, 512
    x = _x(n, torch.bfloat16, seed=11)
    rot = _rotation(128)
    want = ref.encode(x, bits, bucket, key=4, rotation=rot)
    assert _same(tri.encode(x, bits, bucket, key=4, rotation=rot), want)
    payloads = torch.stack([want, ref.encode(x.flip(0), bits, bucket, key=1, rotation=rot)])
    args = (n, x, 0, 0.5, bits, bucket, 6, 1)
    assert _same(
        tri.decode_sum_encode(payloads, *args, rotation=rot),
        ref.decode_sum_encode(payloads, *args, rotation=rot),
    )
