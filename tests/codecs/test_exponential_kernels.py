"""Exponential dithering: the Triton kernels write the torch reference's codes and values bit
for bit (on the CPU under TRITON_INTERPRET=1, set in conftest), the codes are the neighbouring
powers of two, rounding is unbiased, NaN/Inf become NaN, and bad arguments fail clearly."""

import math
import socket

import pytest
import torch
import torch.distributed as dist
from fp32_edges import EDGES, INF, NAN, NON_FINITE

import cgx2
from cgx2.codecs import exponential as ref
from cgx2.codecs.philox import philox4x32
from cgx2.ddp import global_qsgd as gq

tri = pytest.importorskip("cgx2.codecs.exponential_triton", reason="Triton is not installed")
import triton  # noqa: E402  (after the skip: Triton is optional)
import triton.language as tl  # noqa: E402

_codes = tri._codes
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KEY = 0xFEDCBA98_76543210  # both halves >= 2**31


def _x(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Edge values first, then [-1, 1] scaled by 2**-(0..159): every binade, subnormals too."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g) * 2 - 1) * torch.exp2(
        -torch.randint(0, 160, (n,), generator=g).float()
    )
    edges = torch.tensor(EDGES + NON_FINITE)[:n]
    x[: edges.numel()] = edges
    return x.to(dtype).to(DEVICE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits; any NaN equals any NaN (a GPU's sum canonicalizes them)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a[~nan].view(torch.int32), b[~nan].view(torch.int32)
    )


def test_uniforms_are_philox_words():
    """Value 4q + j: the top 24 bits of word j of Philox at counter (q, 0, 0, stream)."""
    n = 4 * 300 + 3
    u = ref.uniforms(KEY, n, stream=5)
    q = torch.arange(301)
    zero = torch.zeros_like(q)
    words = torch.stack(philox4x32(q, zero, zero, zero + 5, KEY), -1).reshape(-1)[:n]
    assert torch.equal(u, (words >> 8).float() * 2.0**-24)
    assert u.min() >= 0 and u.max() < 1 and torch.equal(u[:7], ref.uniforms(KEY, 7, stream=5))


@pytest.mark.parametrize("bits", [2, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("n", [1, 7, 4096 + 25])  # 4096: a whole block, then a masked tail
def test_encode_matches_reference(bits, n):
    x = _x(n, seed=bits)
    norm = torch.tensor([0.75], device=DEVICE)  # some |x| / norm > 1: clamped to 1
    for nrm in (norm, None):
        codes = ref.encode(x, nrm, bits, KEY, stream=3)
        assert codes.dtype == (torch.int8 if bits <= 8 else torch.int32)
        assert _same(tri.encode(x, nrm, bits, KEY, stream=3), codes)
        assert _same(tri.decode(codes), ref.decode(codes))


@pytest.mark.parametrize(
    ("dtype", "norm"),
    [
        (torch.bfloat16, 3.0),
        (torch.float16, 2.0**-10),
        (torch.float64, 1.0),
        (torch.float32, 0.0),  # norm <= 0 or NaN divides by 1
        (torch.float32, NAN),
        (torch.float32, 2.0**-140),  # a subnormal norm
        (torch.float32, 2.0**-70),  # 1 / norm overflows fp32 without the 2**64
    ],
)
def test_encode_other_dtypes_and_norms_match_reference(dtype, norm):
    x = _x(2000, seed=1, dtype=dtype)
    norm = torch.tensor([norm], device=DEVICE)
    expected = ref.encode(x, norm, 8, 12345, stream=1)
    assert _same(tri.encode(x.view(40, 50), norm, 8, 12345, stream=1), expected)


def test_decode_every_code_matches_reference():
    int8 = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    int32 = torch.cat(
        [torch.arange(-200, 201), torch.tensor([-(2**31), 2**31 - 1, -(2**31) + 1])]
    ).to(DEVICE, torch.int32)
    for codes in (int8, int32):
        values = ref.decode(codes)
        assert _same(tri.decode(codes), values)
        assert torch.isnan(values).tolist() == (codes == codes.min()).tolist()  # only nan_code
        k = codes.tolist()
        for c, v in zip(k[1:], values[1:].tolist(), strict=True):
            if abs(c) <= 150:  # the codes encode can produce
                assert v == math.copysign(2.0 ** (1 - abs(c)), c) if c else v == 0.0
    assert _same(tri.decode(int8.view(16, 16)), ref.decode(int8.view(16, 16)))


@triton.jit
def _codes_kernel(
    x_ptr, h_ptr, out_ptr, CAP: tl.constexpr, CODE: tl.constexpr, BLOCK: tl.constexpr
):
    o = tl.arange(0, BLOCK)
    x, h = tl.load(x_ptr + o), tl.load(h_ptr + o)
    tl.store(out_ptr + o, _codes(x, h, CAP, CODE))


@pytest.mark.parametrize("bits", [2, 3, 5, 8, 9, 16])
def test_integer_decision_matches_reference_at_every_threshold(bits):
    """The kernels decide u < p on integers; with u = h * 2**-24 on both sides of each value's
    threshold ceil(p * 2**24), over every exponent, they decide as the reference's floats."""
    g = torch.Generator().manual_seed(bits)
    mantissas = torch.cat(
        [
            torch.tensor([0, 1, 2, 3, 5, 2**22, 2**23 - 2, 2**23 - 1]),
            torch.randint(0, 2**23, (4,), generator=g),
        ]
    )
    ints = (torch.arange(128)[:, None] << 23 | mantissas[None, :]).reshape(-1)
    x = torch.cat([ints, ints | -(2**31)]).to(torch.int32).view(torch.float32)
    x = x[x != 0]
    thresholds = []
    for a in x.abs().clamp(max=1).double().tolist():  # exponent 127: [1, 2), clamped to 1
        lower, upper = _levels(a, bits)
        thresholds.append(math.ceil((a - lower) / (upper - lower) * 2**24))  # exact in float64
    t = torch.tensor(thresholds, dtype=torch.int32)
    x, h = torch.cat([x, x]), torch.cat([t - 1, t]).clamp(0, 2**24 - 1)
    expected = ref.exponential_codes(x, bits, h.float() * 2.0**-24)
    block = triton.next_power_of_2(x.numel())
    pad = block - x.numel()
    out = torch.empty(block, dtype=torch.int32, device=DEVICE)
    _codes_kernel[(1,)](
        torch.cat([x, x[:pad]]).to(DEVICE),
        torch.cat([h, h[:pad]]).to(DEVICE),
        out,
        CAP=min(2 ** (bits - 1) - 2, 149),
        CODE=tl.int32 if ref.code_dtype(bits) == torch.int32 else tl.int8,  # int32 stored
        BLOCK=block,
    )
    assert torch.equal(out[: x.numel()].cpu().to(expected.dtype), expected)
    # h = threshold - 1 rounds up (to the level above), h = threshold down, where both exist.
    values = ref.exponential_values(expected).abs()
    up, down = values[: x.numel() // 2], values[x.numel() // 2 :]
    inside = (t > 0) & (t < 2**24)
    assert (up[inside] > down[inside]).all() and inside.float().mean() > 0.5


@pytest.mark.parametrize(("bits", "rows", "n"), [(8, 3, 4096 + 3), (12, 2, 999), (4, 1, 5)])
def test_decode_sum_matches_reference(bits, rows, n):
    codes = torch.stack(
        [ref.encode(_x(n, seed=s) * (s + 1), None, bits, KEY + s) for s in range(rows)]
    )
    for scale in (None, torch.tensor([0.3], device=DEVICE), torch.tensor([0.0], device=DEVICE)):
        assert _same(tri.decode_sum(codes, scale), ref.decode_sum(codes, scale))
    strided = torch.cat([codes, codes], 1)[:, :n]  # rows not contiguous with each other
    assert _same(tri.decode_sum(strided), ref.decode_sum(codes))


def _levels(a: float, bits: int) -> tuple[float, float]:
    """The levels either side of |a| > 0, (lower, upper); lower is 0 below the smallest."""
    smallest = 2.0 ** -min(2 ** (bits - 1) - 2, 149)
    mantissa, exponent = math.frexp(abs(a))  # |a| = mantissa * 2**exponent, in [0.5, 1)
    upper = max(2.0 ** (exponent - (mantissa == 0.5)), smallest)  # a power of two >= |a|
    return (upper / 2 if upper > smallest else 0.0), upper


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_codes_are_the_neighbouring_levels(bits):
    x = _x(3000, seed=bits)
    x = x[torch.isfinite(x)].clamp(-1, 1)
    values = ref.decode(ref.encode(x, None, bits, KEY)).double().tolist()
    for a, v in zip(x.double().tolist(), values, strict=True):
        if a == 0:
            assert v == 0
        else:
            lower, upper = _levels(a, bits)
            assert lower <= abs(a) <= upper and (v == 0 or (v < 0) == (a < 0))
            assert abs(v) in (lower, upper), (a, v, lower, upper)


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_unbiased(impl, bits):
    codec = ref if impl == "reference" else tri
    values = [
        1.0,
        -0.75,
        0.3,
        -0.1,
        -1e-3,
        0.01,
        2.0**-100 * 1.7,
        2.0**-130,
        1e-40,
        -(2.0**-126) / 3,
    ]
    x = torch.tensor(values, device=DEVICE)
    reps = 4096
    out = codec.decode(codec.encode(x.repeat(reps), None, bits, KEY)).view(reps, -1).double()
    mean, spread = out.mean(0), out.std(0) / reps**0.5
    # 24-bit uniforms round each probability up by < 2**-24: a bias under 2**-24 of a step.
    steps = [upper - lower for lower, upper in (_levels(a, bits) for a in values)]
    bias = torch.tensor(steps, dtype=torch.float64) * 2.0**-24
    assert ((mean.cpu() - x.double().cpu()).abs() <= 6 * spread.cpu() + bias + 1e-45).all()
    assert set(out.abs().unique().tolist()) <= {0.0} | {2.0**-k for k in range(150)}


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_non_finite_become_nan(impl):
    codec = ref if impl == "reference" else tri
    x = torch.tensor([NAN, INF, -INF, 0.5, -2.0, 0.0], device=DEVICE)
    for bits, nan_code in ((8, -128), (16, -(2**31))):
        codes = codec.encode(x, None, bits, KEY)
        assert codes[:3].tolist() == [nan_code] * 3 and codes[3:].abs().tolist() == [2, 1, 0]
        values = codec.decode(codes)
        assert torch.isnan(values[:3]).all() and values[3:].tolist() == [0.5, -1.0, 0.0]
        total = codec.decode_sum(torch.stack([codes, codes.flip(0)]))
        assert torch.isnan(total).tolist() == [True, True, True, True, True, True]
    # As in the hook: an Inf gradient makes the global norm Inf, then the average all NaN.
    g = torch.tensor([INF, 1.0, -2.0], device=DEVICE)
    norm = g.abs().amax().reshape(1)
    codes = codec.encode(g, norm, 8, KEY)
    assert codes.tolist() == [-128, 0, 0]
    assert torch.isnan(codec.decode_sum(codes[None], norm / 2)).all()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_arguments(impl):
    codec = ref if impl == "reference" else tri
    x = torch.ones(4, device=DEVICE)
    for bits in (1, 17):
        with pytest.raises(ValueError, match="bits"):
            codec.encode(x, None, bits, KEY)
    for bits in (True, 4.0):
        with pytest.raises(TypeError, match="bits"):
            codec.encode(x, None, bits, KEY)
    with pytest.raises(TypeError, match="g must be a floating-point"):
        codec.encode(x.int(), None, 8, KEY)
    with pytest.raises(ValueError, match="norm"):
        codec.encode(x, torch.ones(2, device=DEVICE), 8, KEY)
    with pytest.raises(TypeError, match="norm"):
        codec.encode(x, torch.ones(1, dtype=torch.int32, device=DEVICE), 8, KEY)
    for key in (-1, 2**64, 1.5):
        with pytest.raises(ValueError, match="key"):
            codec.encode(x, None, 8, key)
    with pytest.raises(TypeError, match="int8 or int32"):
        codec.decode(x)
    with pytest.raises(TypeError, match="int8 or int32"):
        codec.decode(torch.ones(4, dtype=torch.int16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        codec.decode_sum(torch.ones(4, dtype=torch.int8, device=DEVICE))
    with pytest.raises(ValueError, match="scale"):
        codec.decode_sum(torch.ones(2, 4, dtype=torch.int8, device=DEVICE), torch.ones(2))
    with pytest.raises(ValueError, match="u must be"):
        ref.exponential_codes(x, 8, torch.rand(5))
    with pytest.raises(TypeError, match="x must be"):
        ref.exponential_codes(x.int(), 8, torch.rand(4))


def test_dispatch_and_reexports():
    assert ref.exponential_codec(torch.device("cpu")) is ref
    assert ref.exponential_codec(torch.device("cuda")) is tri  # Triton imports here
    assert gq.exponential_codes is ref.exponential_codes
    assert gq.exponential_values is ref.exponential_values
    x = _x(100).cpu()
    u = ref.uniforms(KEY, 100, 2)
    assert torch.equal(ref.encode(x, None, 8, KEY, 2), ref.exponential_codes(x, 8, u))


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process (a pool of ranks would cost seconds to start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("bits", [3, 8])
def test_hook_is_identical_with_either_codec(world_of_one, monkeypatch, bits):
    g = _x(5000, seed=bits) * 3
    g = torch.where(torch.isfinite(g), g, 0.25)
    out = []
    for codec in (ref, tri):
        monkeypatch.setattr(gq, "exponential_codec", lambda device, codec=codec: codec)
        cgx2.manual_seed(11)
        out.append(gq.exponential_dithering(g, gq.GlobalQSGDState(bits=bits)))
    assert _same(out[0], out[1]) and torch.isfinite(out[0]).all()
    assert out[0].abs().max() == g.abs().max()  # |g| / max|g| = 1 is a level: exact
