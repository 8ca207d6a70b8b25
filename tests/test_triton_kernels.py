"""Triton kernels write the reference codec's bytes (on the CPU under TRITON_INTERPRET=1)."""

import pytest
import torch

from cgx2.codecs import maxmin as ref
from cgx2.codecs.layout import ChunkedLayout

tri = pytest.importorskip("cgx2.codecs.maxmin_triton", reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
