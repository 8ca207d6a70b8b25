"""Property-based: ``cgx2.quantized_allreduce`` (and its in-place form) on 2 gloo ranks, over drawn
shapes, dtypes, layouts, widths, bucket sizes, ops and values, against the plain allreduce.

Each call returns the same bytes on both ranks and the input's shape and dtype; at 32 bits it
is the plain allreduce, bit for bit; quantized, each value is within the documented bound of
the exact sum (one step of its bucket per stage, tests/bounds.py), NaN where a rank's bucket
held NaN or ±Inf, ±Inf where the plain sum overflows (never NaN beside it); or the call raises
a ValueError or TypeError naming the argument it refuses. Never an error from inside.
"""

import math

import torch
import torch.distributed as dist
from bounds import allreduce_bound
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cgx2

WORLD = 2
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REFUSED_DTYPES = (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)
LAYOUTS = (
    "contiguous",
    "transposed",
    "sliced",
    "strided",
    "offset",
    "expanded",
    "negative",
    "channels_last",
)
DISTRIBUTIONS = ("normal", "constant", "huge", "overflow", "subnormal", "nonfinite", "mixed")
EXAMPLES = 100  # each a batch of cases, one dispatch to the pool
SUBNORMAL_STEP = 1.5e-45  # what rounding an fp32 subnormal step costs, a level (guarantees.md)


def _top(dtype: torch.dtype) -> float:
    """The largest value drawn as "huge": near the dtype's max, except fp64's, which cgx2
    codes in fp32 (values past fp32's range are outside what it carries: see the report)."""
    if dtype == torch.float64:
        return torch.finfo(torch.float32).max
    return torch.finfo(dtype).max if dtype.is_floating_point else 1e6


def _values(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` values of the distribution ``kind`` in fp64, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    normal = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (seed % 7 - 3)
    top = _top(dtype)
    tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 1.0
    if kind == "normal":
        return normal
    if kind == "constant":
        return torch.full((n,), float(normal[0]) if n else 1.0, dtype=torch.float64)
    if kind == "huge":  # two ranks' sum stays within range
        return sign * top * (0.25 + 0.25 * u)
    if kind == "overflow" and dtype != torch.float64:  # one sign: two ranks' sum passes the max
        return top * (0.6 + 0.4 * u)
    if kind == "overflow":  # fp64's sum of fp32-sized values does not overflow: see _top
        return top * (0.2 + 0.3 * u)
    if kind == "subnormal":
        return sign * tiny * u
    if kind == "nonfinite":
        special = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        picks = torch.randint(0, max(n, 1), (1 + seed % 3,), generator=g)
        out = normal.clone()
        if n:
            out[picks] = special[torch.arange(len(picks)) % 3]
        return out
    assert kind == "mixed"
    return torch.where(u < 0.05, sign * top * 0.25, normal)


def _tensor(case: dict, rank: int) -> torch.Tensor:
    """This rank's input: the drawn values, in the drawn layout (its logical values are the
    same whatever the layout)."""
    shape, layout, dtype = case["shape"], case["layout"], case["dtype"]
    n = math.prod(shape)
    rows, last = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    count = max(rows * (2 * last + 3), math.prod(shape[1:])) + 8  # every layout's base
    vals = _values(case["dists"][rank], count, dtype, case["value_seed"] + 1000 * rank)
    if dtype.is_complex:
        vals = torch.complex(vals, vals.flip(0))
    vals = vals.to(dtype)
    nd = len(shape)
    if layout == "transposed" and nd >= 2:
        return vals[:n].view(shape[::-1]).permute(*reversed(range(nd)))
    if layout in ("sliced", "strided") and nd >= 1:
        last = shape[-1] + 3 if layout == "sliced" else 2 * shape[-1]
        base = vals[: math.prod(shape[:-1]) * last].view(*shape[:-1], last)
        return base[..., 1 : shape[-1] + 1] if layout == "sliced" else base[..., ::2]
    if layout == "offset":
        return vals[5 : 5 + n].view(shape)
    if layout == "expanded" and nd >= 1:
        rows = math.prod(shape[1:])
        return vals[:rows].view(1, *shape[1:]).expand(shape)
    if layout == "negative" and dtype.is_floating_point:
        return (-vals[:n]).view(shape)._neg_view()
    if layout == "channels_last" and nd == 4:
        return vals[:n].view(shape).contiguous(memory_format=torch.channels_last)
    return vals[:n].view(shape)


def _expected_refusal(case: dict, t: torch.Tensor) -> tuple[type, str] | None:
    """The error a call must raise, and the argument it must name, or None."""
    if case["dtype"] not in FLOATS:
        return TypeError, "tensor"
    if not (1 <= case["bits"] <= 8 or case["bits"] == 32):
        return ValueError, "bits"
    if not 1 <= case["bucket_size"] <= 1 << 20:
        return ValueError, "bucket_size"
    if case["op"] not in ("sum", "avg"):
        return ValueError, "op"
    if (
        case["inplace"]
        and t.numel() > 1
        and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape, strict=True))
    ):
        return ValueError, "tensor"
    return None


def _run_cases(cases: list[dict]) -> list[dict]:
    """On each rank: every case's call, or its error, and the plain allreduce beside it."""
    rank = dist.get_rank()
    results = []
    for case in cases:
        t = _tensor(case, rank)
        dense = t.clone(memory_format=torch.contiguous_format).resolve_neg()
        result = {"dense": dense}
        try:
            with cgx2.config.tuned(crossover_bytes=0, pipeline_bytes=case["pipeline_bytes"]):
                kwargs = {
                    "bits": case["bits"],
                    "op": case["op"],
                    "bucket_size": case["bucket_size"],
                    "seed": case["seed"],
                }
                if case["inplace"]:
                    returned = cgx2.quantized_allreduce_(t, **kwargs)
                    result["same_object"] = returned is t
                    out = t.clone(memory_format=torch.contiguous_format).resolve_neg()
                else:
                    out = cgx2.quantized_allreduce(t, **kwargs)
                    result["contiguous"] = out.is_contiguous()
            result["out"] = out
        except Exception as e:  # the oracle tells a refusal from a crash
            result["error"] = (type(e), str(e))
        if "out" in result:
            # The plain allreduce, averaging as cgx2's plain path does: divide, then sum.
            plain = dense / WORLD if case["op"] == "avg" else dense.clone()
            dist.all_reduce(plain)
            result["plain"] = plain
        results.append(result)
    return results


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.reshape(-1).view(ints), b.reshape(-1).view(ints))


def _bucket_any(mask: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Per element: whether ``mask`` holds anywhere in its bucket (buckets of the flat tensor
    from 0, as the allreduce's chunks are whole buckets)."""
    n = mask.numel()
    pad = -n % bucket_size
    padded = torch.cat([mask, mask.new_zeros(pad)]).view(-1, bucket_size)
    return padded.any(1).repeat_interleave(bucket_size)[:n]


def _check_case(case: dict, per_rank: list[dict]) -> None:
    t0 = _tensor(case, 0)
    refusal = _expected_refusal(case, t0)
    where = f"case {case}"
    if refusal is not None:
        event(f"refused: {refusal[1]}")
        error, name = refusal
        for r in per_rank:
            assert "error" in r, f"{where}: accepted, {error.__name__} naming {name} expected"
            got, message = r["error"]
            assert got is error and message.startswith(name), f"{where}: {got}: {message}"
        return
    for r in per_rank:
        assert "error" not in r, f"{where}: raised {r['error'][0].__name__}: {r['error'][1]}"
    outs = [r["out"] for r in per_rank]
    assert _same_bytes(outs[0], outs[1]), f"{where}: the ranks' results differ"
    out, plain = outs[0], per_rank[0]["plain"]
    assert out.shape == t0.shape and out.dtype == case["dtype"], where
    if case["inplace"]:
        assert per_rank[0]["same_object"], where
    else:
        assert per_rank[0]["contiguous"], where
    flat, plain = out.reshape(-1).double(), plain.reshape(-1).double()
    event("empty" if not out.numel() else "exact" if case["bits"] == 32 else "quantized")
    if case["bits"] == 32:
        is_plain = _same_bytes(out, per_rank[0]["plain"])
        assert is_plain, f"{where}: not the plain allreduce's bytes"
        return
    inputs = [r["dense"].reshape(-1).double() for r in per_rank]
    bucket = case["bucket_size"]
    nonfinite = _bucket_any(sum(~x.isfinite() for x in inputs).bool(), bucket)
    assert flat[nonfinite].isnan().all(), f"{where}: a non-finite input's bucket is not NaN"
    scale = 1 / WORLD if case["op"] == "avg" else 1
    scaled = [x * scale for x in inputs]
    exact = sum(scaled)
    bound = allreduce_bound(scaled, case["bits"], bucket, case["dtype"])
    bound += (WORLD + 1) * 2 ** case["bits"] * SUBNORMAL_STEP
    # Rounding to a 16-bit output's subnormals: its smallest subnormal, absolute.
    bound += torch.finfo(case["dtype"]).tiny * torch.finfo(case["dtype"]).eps
    # ±Inf where the sum passes the largest value carried (fp32's for fp64, which cgx2 codes in
    # fp32) by more than the bound, as the plain sum does; within the bound of it, either.
    limit = _top(case["dtype"])
    must_inf = ~nonfinite & ((exact - bound > limit) | (exact + bound < -limit))
    event(f"overflowing sums: {bool(must_inf.any())}")
    assert torch.equal(flat[must_inf], plain[must_inf]), f"{where}: the plain sum is ±Inf there"
    inf_ok = ((flat == math.inf) & (exact + bound >= limit)) | (
        (flat == -math.inf) & (exact - bound <= -limit)
    )
    # A bucket whose reduced sum overflowed is coded saturated (±Inf at its end levels, its
    # step infinite): the rest of it is never NaN, and not held to a step.
    saturated = ~nonfinite & _bucket_any(flat.isinf() | plain.isinf(), bucket)
    assert not flat[saturated].isnan().any(), f"{where}: NaN beside an overflowing sum"
    err = (flat - exact).abs()
    bad = ~nonfinite & ~(err <= bound) & ~inf_ok & ~(saturated & ~flat.isinf())
    assert not bad.any(), (
        f"{where}: {int(bad.sum())} values beyond the bound, first at {int(bad.nonzero()[0])}: "
        f"got {flat[bad][0].item()}, exact {exact[bad][0].item()}, bound {bound[bad][0].item()}"
    )


@st.composite
def _cases(draw: st.DrawFn) -> dict:
    """One call's arguments and values; what must be refused drawn now and then, not often,
    so that most examples reach the collective."""
    dtype = draw(st.sampled_from(FLOATS * 10 + REFUSED_DTYPES))
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 37), min_size=nd, max_size=nd)))
    if math.prod(shape) > 3000:  # keep each call small: CI time
        shape = tuple(min(s, 7) for s in shape)
    bucket_kind = draw(st.sampled_from(("listed",) * 6 + ("any",) * 6 + ("refused",)))
    bucket_size = draw(
        st.sampled_from((1, 2, 3, 7, 64, 100, 512))
        if bucket_kind == "listed"
        else st.integers(1, 700)
        if bucket_kind == "any"
        else st.sampled_from((0, -4, 2**21))
    )
    first = draw(st.sampled_from(DISTRIBUTIONS))
    # Both ranks alike half the time: how sums overflow (and constant buckets stay exact).
    second = first if draw(st.booleans()) else draw(st.sampled_from(DISTRIBUTIONS))
    return {
        "dtype": dtype,
        "shape": shape,
        "layout": draw(st.sampled_from(LAYOUTS)),
        "bits": draw(st.sampled_from((*range(1, 9), 32) * 6 + (0, 9, 16))),
        "bucket_size": bucket_size,
        "op": draw(st.sampled_from(("sum", "avg") * 12 + ("max",))),
        "inplace": draw(st.booleans()),
        # None: one piece at these sizes; else several, pipelined.
        "pipeline_bytes": draw(st.sampled_from((None, None, 512, 4096))),
        "seed": draw(st.integers(0, 2**63 - 1)),
        "value_seed": draw(st.integers(0, 2**31)),
        "dists": [first, second],
    }


_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples every run: CI is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_SETTINGS
@given(cases=st.lists(_cases(), min_size=1, max_size=4))
def test_quantized_allreduce_matches_the_plain_allreduce_or_refuses(dist2, cases):
    for case, *per_rank in zip(cases, *dist2.run(_run_cases, cases), strict=True):
        _check_case(case, per_rank)


def _plain_average_near_the_max() -> torch.Tensor:
    with cgx2.config.tuned(crossover_bytes=0):
        return cgx2.quantized_allreduce(torch.full((5,), 3e38), 32, op="avg")


def test_a_plain_average_near_the_max_is_finite(dist2):
    for out in dist2.run(_plain_average_near_the_max):
        assert torch.equal(out, torch.full((5,), 3e38))
