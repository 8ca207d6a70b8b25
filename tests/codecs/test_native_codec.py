"""The max-min codec's compiled loops for CPU tensors (cgx2._C): the torch reference's bytes,
in threads too, and the torch code where they are off."""

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cgx2
import cgx2.config
from cgx2.codecs import maxmin, native
from cgx2.codecs.layout import ChunkedLayout, MaxMinLayout


@pytest.fixture
def torch_only(monkeypatch):
    """Run a function with the C loops turned off: the torch reference's own result."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            return fn(*args)

    return run


@pytest.fixture(autouse=True)
def _built():
    if native.library() is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: cgx2._C was not built, the CPU codec runs in torch")
    assert native.library() is not None, "a C++ compiler is here, but cgx2._C was not built"


@pytest.fixture(params=["vector", "scalar"])
def loops(request):
    """The C loops as the CPU runs them (AVX2's vector loops where it has them), then the
    scalar loops alone: the same bytes either way."""
    lib = native.library()
    had = lib.maxmin_simd()
    if request.param == "vector" and not had:
        pytest.skip("this CPU has no AVX2: the scalar loops run")
    lib.maxmin_simd(request.param == "vector")
    yield request.param
    lib.maxmin_simd(had)


def test_the_vector_loops_run_where_the_cpu_has_avx2():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    avx2 = sys.platform.startswith("linux") and " avx2" in flags and os.uname().machine == "x86_64"
    assert bool(native.library().maxmin_simd()) == avx2


def _awkward(n: int, bits: int, bucket: int, seed: int) -> torch.Tensor:
    """Gaussian values with a non-finite one, a bucket whose minimum is -0.0, a constant
    bucket and a subnormal."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    if n > 4 * bucket:
        x[3] = float("nan") if bits % 2 else float("inf")
        x[bucket : 2 * bucket] = x[bucket : 2 * bucket].abs()
        x[bucket + 5] = -0.0
        x[2 * bucket : 3 * bucket] = 2.5
        x[-1] = 1e-40
    return x


@pytest.mark.parametrize("bits", range(1, 9))
def test_encode_and_decode_write_the_references_bytes(bits, torch_only, loops):
    cases = itertools.product([8, 13, 100, 512], [1, 7, 1000, 4099], [False, True])
    for bucket, n, skip in cases:
        x = _awkward(n, bits, bucket, seed=bits)
        key, stream = 0xFEDCBA9876543210 + bits, 2**33 + 5  # both halves of each matter
        args = (x, bits, bucket, key, stream, skip)
        payload = maxmin.encode(*args)
        assert torch.equal(payload, torch_only(maxmin.encode, *args)), (bucket, n, skip)
        for dtype in (torch.float32, torch.bfloat16):
            decode_args = (payload, n, bits, bucket, dtype, skip)
            got = maxmin.decode(*decode_args)
            want = torch_only(maxmin.decode, *decode_args)
            assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_threads_split_the_buckets_without_changing_a_byte(monkeypatch, torch_only, loops):
    monkeypatch.setattr(native, "_MIN_BUCKETS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    calls = []
    encode = native.library().maxmin_encode

    def spy(rows, begin, end, *rest):
        calls.append((begin, end))
        return encode(rows, begin, end, *rest)

    monkeypatch.setattr(native.library(), "maxmin_encode", spy)
    x = _awkward(100 * 64 + 3, 4, 64, seed=7)
    payload = maxmin.encode(x, 4, 64, key=11)
    assert sorted(calls) == [(0, 33), (33, 67), (67, 101)]
    assert torch.equal(payload, torch_only(maxmin.encode, x, 4, 64, 11))
    decoded = maxmin.decode(payload, x.numel(), 4, 64)
    want = torch_only(maxmin.decode, payload, x.numel(), 4, 64)
    assert torch.equal(decoded.view(torch.int32), want.view(torch.int32))


def test_decode_sum_encode_and_chunks_match_the_reference(torch_only, loops):
    x = _awkward(4 * 1000 + 17, 4, 128, seed=3)
    layout = ChunkedLayout.split(x.numel(), 4, 4, 128, False)
    rows = maxmin.encode_chunks(x, layout, key=5)
    assert torch.equal(rows, torch_only(maxmin.encode_chunks, x, layout, 5))
    for dtype in (torch.float32, torch.bfloat16):
        got = maxmin.decode_chunks(rows, layout, dtype)
        want = torch_only(maxmin.decode_chunks, rows, layout, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    size = layout.chunk_size(0)
    for own, own_index in ((x[:size], 0), (x[:size], 2), (None, -1)):
        # own + the first row decoded in one pass, then the others added in place
        args = (rows, size, own, own_index, 0.25, 4, 128, 9, 0)
        got = maxmin.decode_sum_encode(*args)
        assert torch.equal(got, torch_only(maxmin.decode_sum_encode, *args)), own_index
        want = torch_only(maxmin.decode_sum, *args[:7])
        assert torch.equal(maxmin.decode_sum(*args[:7]).view(torch.int32), want.view(torch.int32))


def _overflowing(n: int, bucket: int, rows: int, seed: int) -> list[torch.Tensor]:
    """``rows`` inputs whose sum, bucket by bucket in turn: passes +FLT_MAX, -FLT_MAX, both,
    everywhere; meets +-Inf or NaN in row 0's input; passes FLT_MAX by a hair; stays finite
    with a range past FLT_MAX; stays ordinary."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g) * 3 for _ in range(rows)]
    huge, flt_max = 3e38, torch.finfo(torch.float32).max
    for q, start in enumerate(range(0, n, bucket)):
        idx = start + torch.randint(0, min(bucket, n - start), (3,), generator=g)
        kind = q % 10
        for r, p in enumerate(parts):
            if kind in (0, 2):
                p[idx[0]] = huge
            if kind in (1, 2):
                p[idx[1]] = -huge
            if kind == 3:
                p[start : start + bucket] = huge
            if kind == 6:
                p[idx[0]] = flt_max / rows * 1.0001
            if kind == 7 and r == 1:
                p[idx[0]], p[idx[1]] = huge, -huge
        if kind == 4:
            parts[0][idx[2]] = float("inf") if q % 20 < 10 else -float("inf")
            parts[1][idx[0]] = parts[2 % rows][idx[0]] = huge
        if kind == 5:
            parts[0][idx[2]] = float("nan")
            parts[1][idx[0]] = huge
    return parts


@pytest.mark.parametrize("bits", range(1, 9))
def test_an_overflowing_sum_is_coded_as_the_reference_codes_it(bits, torch_only, loops):
    """Decode-sum-encode of sums past fp32's range (coded saturated, or NaN where own's input
    is not finite) and of ranges ending near FLT_MAX: the reference's bytes."""
    cases = ((8, 203, 0, None), (100, 1050, 1, 0.5), (512, 5000, 0, None), (13, 300, 2, 1 / 3))
    for bucket, n, own_index, scale in cases:
        parts = _overflowing(n, bucket, 3, seed=bits)
        payloads = torch.stack([maxmin.encode(p, bits, bucket, key=r) for r, p in enumerate(parts)])
        layout = MaxMinLayout.of(n, bits, bucket, False)
        for own in (parts[own_index], None):
            index = own_index if own is not None else -1
            args = (payloads, n, own, index, scale, bits, bucket, 3)
            got = maxmin.decode_sum_encode(*args)
            assert torch.equal(got, torch_only(maxmin.decode_sum_encode, *args)), (bucket, own)
            y = maxmin.decode(got, n, bits, bucket)
            if scale is None:
                total = maxmin.decode_sum(*args[:7])
            else:  # each term scaled first
                total = maxmin._scaled_sum(payloads, layout, own, index, maxmin.fp32_scalar(scale))
            assert torch.equal(y.isposinf(), total.isposinf() & ~y.isnan())
            assert torch.equal(y.isneginf(), total.isneginf() & ~y.isnan())
            if scale != 1 / 3:  # three rows of 3e38 times 1/3: no overflow
                assert y.isposinf().any() and y.isneginf().any() and y.isnan().any()
        x = parts[1].clone()
        x[: n // 2] = torch.finfo(torch.float32).max  # a range ending at FLT_MAX
        payload = maxmin.encode(x, bits, bucket, key=5)
        assert torch.equal(payload, torch_only(maxmin.encode, x, bits, bucket, 5))
        assert maxmin.decode(payload, n, bits, bucket).isfinite().all()


def test_the_loops_count_the_buckets_they_code_saturated(monkeypatch, loops):
    """encode_rows returns how many buckets it coded saturated, summed over its threads (for
    decode-sum-encode, which checks its payload only where there are any): none without
    saturate, none where a bucket holds NaN, none overflowing both ways at one bit."""
    monkeypatch.setattr(native, "_MIN_BUCKETS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    rows = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    rows[[1, 4, 8], 5] = float("inf")
    rows[4, 6] = rows[9, 0] = float("-inf")
    rows[7, 3], rows[7, 4] = float("inf"), float("nan")
    rows[6, 0] = float("nan")
    for bits, want in ((4, 4), (1, 3)):
        meta, levels = torch.empty(80, dtype=torch.uint8), torch.empty(80 * bits, dtype=torch.uint8)
        assert native.encode_rows(rows, bits, 1, 0, 640, meta, levels, True) == want
        assert native.encode_rows(rows, bits, 1, 0, 640, meta, levels) == 0
        assert native.encode_rows(rows[[0, 2, 3]], bits, 1, 0, 192, meta, levels, True) == 0


def test_turned_off_means_torch():
    with cgx2.config.tuned(native_codec=False):
        assert native.library() is None  # at once, though the extension is loaded
        x = torch.randn(1000)
        assert not native.encode_rows(x.view(-1, 8), 4, 1, 0, 1000, x[:2], x[:2].byte())
    assert native.library() is not None


def test_the_environment_is_read_through_the_config(monkeypatch):
    """``CGX2_NATIVE`` reaches the loops through :func:`cgx2.config.tuning`, once
    :func:`cgx2.config.reload` reads it; anything but 0/1/true/false/... is refused."""
    monkeypatch.setenv("CGX2_NATIVE", "no")
    try:
        cgx2.config.reload()
        assert native.library() is None
    finally:
        monkeypatch.undo()
        cgx2.config.reload()
    assert native.library() is not None


def test_nothing_is_compiled_or_loaded_from_a_cache_at_run_time(tmp_path):
    """The loops are the installed extension's: with no compiler on the PATH and an empty
    cache folder, a fresh process codes with them and writes nothing into the folder."""
    script = (
        "import torch, cgx2\n"
        "from cgx2.codecs import maxmin, native\n"
        "x = torch.randn(4096)\n"
        "assert native.library() is not None\n"
        "print(native.library().__file__)\n"
        "maxmin.encode(x, 4, 512, key=1)\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CGX2_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent == Path(cgx2.__file__).parent
    assert not (tmp_path / "cache").exists()


def test_spans_from_subnormal_to_huge_scale_as_the_reference(torch_only, loops):
    """Buckets [0, span, ...] over every exponent: the scale rounded toward zero (FLT_MAX where
    the quotient overflows) gives the reference's levels."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-149, 127, (4000,), generator=g).double()
    span = ((torch.rand(4000, generator=g, dtype=torch.float64) + 1) * 2**exponents).float()
    x = torch.rand(4000, 8, generator=g) * span[:, None]
    x[:, 0], x[:, 1] = 0.0, span
    for bits in (1, 4, 8):
        payload = maxmin.encode(x.view(-1), bits, 8, key=3)
        assert torch.equal(payload, torch_only(maxmin.encode, x.view(-1), bits, 8, 3))


def test_a_forked_child_codes_in_threads_of_its_own(monkeypatch):
    """The parent's pool has threads; a fork has none of them, so it must not queue on it."""
    import multiprocessing

    monkeypatch.setattr(native, "_MIN_BUCKETS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x = torch.randn(64 * 100)
    want = maxmin.encode(x, 4, 64, key=1)  # the parent's pool now runs
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(maxmin.encode, (x, 4, 64, 1)).get(timeout=60)
    assert torch.equal(got, want)


def test_an_unaligned_out_buffer_gets_the_same_bytes(monkeypatch, torch_only):
    """The C loops write the (lo, step) pairs byte-wise: a payload at an odd offset is coded
    by them too, to the reference's bytes."""
    encode_rows, used = native.encode_rows, []

    def spy(*args):
        used.append(encode_rows(*args))
        return used[-1]

    x = _awkward(5000, 4, 512, seed=1)
    want = torch_only(maxmin.encode, x, 4, 512, 1)
    monkeypatch.setattr(native, "encode_rows", spy)
    buffer = torch.zeros(want.numel() + 1, dtype=torch.uint8)
    assert torch.equal(maxmin.encode(x, 4, 512, key=1, out=buffer[1:])[: want.numel()], want)
    assert used == [0]  # the C loops ran (None where not), no bucket coded saturated
