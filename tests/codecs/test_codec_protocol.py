"""Every codec implementation that runs here satisfies its protocol (cgx2.codecs.base): the
functions and parameters the collectives call, and the reference's bytes through them."""

import os
import subprocess
import sys
import types

import pytest
import torch

import cgx2.codecs
import cgx2.config
from cgx2.codecs import Codec, GlobalNormCodec, exponential, maxmin, maxmin_codec, triton_kernels
from cgx2.codecs.base import mismatches
from cgx2.codecs.exponential import exponential_codec
from cgx2.codecs.rotation import Rotation

MAXMIN = [
    pytest.param("maxmin", id="torch+C"),
    pytest.param("torch", id="torch"),
    pytest.param("maxmin_triton", id="triton"),
]


def _maxmin(name: str) -> types.ModuleType:
    if name in ("maxmin", "torch"):
        return maxmin
    module = triton_kernels(name)
    if module is None:
        pytest.skip("Triton is not installed")
    return module


@pytest.mark.parametrize("name", ["maxmin", "maxmin_triton"])
def test_maxmin_implementations_conform(name):
    codec = _maxmin(name)
    assert isinstance(codec, Codec)
    assert mismatches(codec, Codec) == []


@pytest.mark.parametrize("name", ["exponential", "exponential_triton"])
def test_exponential_implementations_conform(name):
    codec = exponential if name == "exponential" else triton_kernels(name)
    if codec is None:
        pytest.skip("Triton is not installed")
    assert isinstance(codec, GlobalNormCodec)
    assert mismatches(codec, GlobalNormCodec) == []


def test_the_codec_for_a_device():
    assert maxmin_codec(torch.device("cpu")) is maxmin
    assert exponential_codec(torch.device("cpu")) is exponential
    cuda = triton_kernels("maxmin_triton") or maxmin
    assert maxmin_codec(torch.device("cuda")) is cuda


class _CountedDevice:
    """A device that counts the reads of its type: a torch.device's builds a string a read."""

    def __init__(self, kind: str) -> None:
        self.kind, self.reads = kind, 0

    @property
    def type(self) -> str:
        self.reads += 1
        return self.kind


@pytest.mark.parametrize("kind", ["cuda", "meta"])
def test_a_device_codec_is_found_once(monkeypatch, kind):
    """Beside the CPU, a device's codec is decided at its first call and kept: every call of
    the ops asks, and a GPU's would read its device type each time (issue 43)."""
    monkeypatch.setattr(cgx2.codecs, "_KERNELS_FOR", {})
    device = _CountedDevice(kind)
    expected = (triton_kernels("maxmin_triton") or maxmin) if kind == "cuda" else maxmin
    assert [maxmin_codec(device) for _ in range(3)] == [expected] * 3  # type: ignore[arg-type]
    assert device.reads == 1
    assert exponential_codec(device) is (  # type: ignore[arg-type]
        (triton_kernels("exponential_triton") or exponential) if kind == "cuda" else exponential
    )
    assert device.reads == 2  # its own kernels, decided apart


def test_mismatches_names_what_a_caller_could_not_pass():
    def encode_chunks(x, layout, key, skip_chunk=-1, stream0=0, out=None, *, rotation=None): ...
    def decode_chunks(payloads, dtype, layout, out=None, *, rotation=None): ...  # swapped
    def decode_sum(
        payloads, numel, own, own_index, scale, bits, bucket_size, skip_incomplete=True, extra=None
    ): ...  # no rotation
    def decode_sum_encode(
        payloads,
        numel,
        own,
        own_index,
        scale,
        bits,
        bucket_size,
        key,
        stream=0,
        skip_incomplete=False,
        *,
        out=None,
        needed,
        rotation=None,
    ): ...

    fake = types.SimpleNamespace(
        encode_chunks=encode_chunks,
        decode_chunks=decode_chunks,
        decode_sum=decode_sum,
        decode_sum_encode=decode_sum_encode,
        chunked_layout=maxmin.chunked_layout,
        encode=maxmin.encode,
    )
    assert sorted(mismatches(fake, Codec)) == [
        "decode: missing",
        "decode_chunks: parameter 1 must be 'layout'",
        "decode_chunks: parameter 2 must be 'dtype'",
        "decode_sum: no keyword parameter 'rotation'",
        "decode_sum: skip_incomplete's default must be False, got True",
        "decode_sum_encode: its own parameter 'needed' needs a default",
        "decode_sum_encode: parameter 10 must be 'out'",  # keyword-only here, positional there
    ]  # encode_chunks' stream0 has a default and out is taken by name: it conforms


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("name", MAXMIN)
def test_the_chunked_path_writes_the_references_bytes(name, rotated):
    """What an allreduce does through the protocol: encode the chunks, decode-sum-encode one,
    decode; the torch reference (packing.py's levels) with the C loops off is the answer.
    Rotated: blocks of 32 in buckets of 64, a part block at the end of the last chunk."""
    codec = _maxmin(name)
    device = "cuda" if name == "maxmin_triton" and torch.cuda.is_available() else "cpu"
    world, bits, bucket, numel = 3, 4, 64, 1000
    x = torch.randn(world, numel, generator=torch.Generator().manual_seed(1)).to(device)

    rotation = {"rotation": Rotation(key=0xFEDCBA9876543210, block=32)} if rotated else {}

    def run(c):
        layout = c.chunked_layout(numel, world, bits, bucket)
        rows = torch.zeros(world, world, layout.payload_nbytes, dtype=torch.uint8, device=device)
        for w in range(world):  # row w of rank w stays zero: its owner keeps it
            c.encode_chunks(x[w], layout, key=7 + w, skip_chunk=w, out=rows[w], **rotation)
        own = 1
        size, start = layout.chunk_size(own), layout.chunk_start(own)
        mine = x[own, start : start + size]
        reduced = torch.zeros(world, layout.payload_nbytes, dtype=torch.uint8, device=device)
        # rows[:, own] is chunk own from every rank: a view with a pitch of world rows
        args = (rows[:, own], size, mine, own, 1 / world, bits, bucket, 11, own)
        c.decode_sum_encode(*args, out=reduced[own], **rotation)
        summed = c.decode_sum(rows[:, own], size, mine, own, None, bits, bucket, **rotation)
        payloads = reduced[:, : layout.payload_nbytes]
        decoded = c.decode_chunks(payloads, layout, torch.float32, **rotation)
        return rows, reduced, summed, decoded

    with cgx2.config.tuned(native_codec=False):
        want = run(maxmin)
    if name == "torch":
        with cgx2.config.tuned(native_codec=False):
            got = run(codec)
    else:
        got = run(codec)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    assert got[0].dtype == torch.uint8 and got[0].shape[-1] == want[0].shape[-1]


def test_the_codecs_import_without_triton():
    """Triton hidden: every codec module but the kernels imports, the launcher's module too
    (the benchmarks import it), and CUDA tensors get the torch reference."""
    script = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch
from cgx2.codecs import base, direct_launch, exponential, global_norm, layout, maxmin, native
from cgx2.codecs import maxmin_codec, packing, philox, triton_kernels
assert maxmin_codec(torch.device("cuda")) is maxmin
assert exponential.exponential_codec(torch.device("cuda")) is exponential
assert triton_kernels("maxmin_triton") is None and direct_launch.Launcher is not None
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
