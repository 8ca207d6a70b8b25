"""torch.ops.cgx.quantize / dequantize: validation, opcheck, torch.compile."""

import itertools

import pytest
import torch

import cgx2
from cgx2.codecs import maxmin
from cgx2.codecs.layout import MaxMinLayout
from cgx2.seeding import derive_key


def test_quantize_op_is_the_reference_codec_keyed_by_seed():
    x = torch.randn(3000)
    payload = torch.ops.cgx.quantize(x, 4, 512, 7)
    assert torch.equal(payload, maxmin.encode(x, 4, 512, derive_key(7)))
    y = torch.ops.cgx.dequantize(payload, 3000, 4, 512, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, maxmin.decode(payload, 3000, 4, 512, torch.bfloat16))


def test_unseeded_calls_follow_cgx2_manual_seed():
    x = torch.randn(3000)
    cgx2.manual_seed(3)
    a, b = cgx2.quantize(x, 2), cgx2.quantize(x, 2)
    cgx2.manual_seed(3)
    assert torch.equal(a, cgx2.quantize(x, 2))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("bits", [0, 9, 16, 33, -1])
def test_bits_out_of_range(bits):
    with pytest.raises(ValueError, match="bits"):
        torch.ops.cgx.quantize(torch.randn(10), bits)
    with pytest.raises(ValueError, match="bits"):
        torch.ops.cgx.dequantize(torch.zeros(64, dtype=torch.uint8), 10, bits)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
)
def test_non_float_tensor_is_a_type_error_naming_it(dtype):
    with pytest.raises(TypeError, match="x must have dtype"):
        torch.ops.cgx.quantize(torch.zeros(10, dtype=dtype), 4)


@pytest.mark.parametrize("bucket_size", [0, -512])
def test_bucket_size_must_be_positive(bucket_size):
    with pytest.raises(ValueError, match="bucket_size"):
        torch.ops.cgx.quantize(torch.randn(10), 4, bucket_size)


def test_dequantize_rejects_wrong_payloads():
    with pytest.raises(TypeError, match="payload"):
        torch.ops.cgx.dequantize(torch.zeros(64), 10, 4)
    with pytest.raises(ValueError, match="need 32"):
        torch.ops.cgx.dequantize(torch.zeros(16, dtype=torch.uint8), 10, 4)
    with pytest.raises(ValueError, match="numel"):
        torch.ops.cgx.dequantize(torch.zeros(16, dtype=torch.uint8), -1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_quantize_and_dequantize(dtype):
    x = torch.randn(1500).to(dtype)
    torch.library.opcheck(torch.ops.cgx.quantize.default, (x, 3, 512, 11))
    torch.library.opcheck(torch.ops.cgx.quantize.default, (x, 4, 100, 11, True))
    payload = torch.ops.cgx.quantize(x, 3, 512, 11)
    torch.library.opcheck(torch.ops.cgx.dequantize.default, (payload, 1500, 3, 512, dtype))


def test_fake_payload_size_matches_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        payload = torch.ops.cgx.quantize(torch.empty(5000), 5, 256)
    assert payload.shape == (MaxMinLayout(5000, 5, 256).nbytes,)
    assert payload.dtype == torch.uint8


def test_compiled_roundtrip_fullgraph_matches_eager():
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        payload = torch.ops.cgx.quantize(x * 2, 4, 512, 5)
        return torch.ops.cgx.dequantize(payload, x.numel(), 4, 512, x.dtype).view_as(x) + 1

    x = torch.randn(64, 48)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="inductor")
    assert torch.equal(compiled(x), roundtrip(x))


def test_the_ops_kernels_do_not_ask_whether_compiling(monkeypatch):
    """The dispatcher calls an op's kernel only to run it (traced, the fake implementation
    answers): asking torch.compiler.is_compiling() there is host time spent at every call."""
    asked = []
    real = torch.compiler.is_compiling
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: asked.append(1) or real())
    payload = torch.ops.cgx.quantize(torch.randn(100), 4, 512, 1)
    torch.ops.cgx.dequantize(payload, 100, 4, 512)
    assert not asked
    cgx2.quantize(torch.randn(100), 4, 512, 1)  # the public function does: compiled, the op
    assert asked


@pytest.mark.parametrize("op", ["quantized_allreduce", "quantized_allreduce_"])
def test_seeded_collectives_stay_out_of_cuda_graphs(op):
    """Each call draws a fresh seed on the host: a CUDA graph of torch.compile's
    "reduce-overhead" would replay its capture's seed (the same rounding at every step), so the
    ops are tagged for Inductor to run them outside its graphs."""
    tags = getattr(torch.ops.cgx, op).default.tags
    assert torch.Tag.nondeterministic_seeded in tags
    if hasattr(torch.Tag, "cudagraph_unsafe"):
        assert torch.Tag.cudagraph_unsafe in tags


def test_quantize_may_be_captured():
    """Unseeded, it draws its key on the device inside a capture (the next test): Inductor may
    keep it in its CUDA graphs."""
    tags = torch.ops.cgx.quantize.default.tags
    assert torch.Tag.nondeterministic_seeded in tags
    assert getattr(torch.Tag, "cudagraph_unsafe", None) not in tags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_unseeded_quantize_rounds_afresh_at_every_replay_of_reduce_overhead():
    x = torch.randn(65536, device="cuda")

    def round_trip(t: torch.Tensor, seed: int) -> torch.Tensor:
        return cgx2.dequantize(cgx2.quantize(t, 4, 512, seed), t.numel(), 4, 512)

    graphed = torch.compile(round_trip, fullgraph=True, mode="reduce-overhead")
    unseeded = [graphed(x, -1).clone() for _ in range(6)]  # warm-up, capture, then replays
    for a, b in itertools.pairwise(unseeded):
        assert not torch.equal(a, b)
    step = (x.view(-1, 512).amax(1) - x.view(-1, 512).amin(1)) / 15
    for y in unseeded:
        assert ((y - x).view(-1, 512).abs() <= step[:, None] * 1.001 + 1e-6).all()
    seeded = [graphed(x, 7).clone() for _ in range(4)]
    assert all(torch.equal(y, round_trip(x, 7)) for y in seeded)  # a seed's bytes, replayed
