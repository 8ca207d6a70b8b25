"""Triton kernels of the exponential dithering codec (CUDA, or the CPU under TRITON_INTERPRET=1):
one-pass encode of g / norm, decode and decode-sum, bit for bit as the reference (.exponential).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .exponential import check_codes, check_encode, code_dtype
from .maxmin_triton import _key, _philox

__all__ = ["decode", "decode_sum", "encode"]

# Values per program: 16 per thread at 4 warps, so that every thread moves whole 16-byte
# vectors of fp32 and of int8 codes; the last block alone takes the masked path. The fastest
# of 1024..8192 values at 4..8 warps, measured on an H200.
_BLOCK = 2048
# Fused multiply-adds would round differently from the reference's separate operations.
_LAUNCH = {"enable_fp_fusion": False, "num_warps": 4}


@triton.jit
def _uniforms(k0, k1, q0, stream, BLOCK: tl.constexpr):
    """h for values 4*q0 .. 4*q0 + BLOCK: the uniforms are u = h * 2**-24 (the stream is in
    :mod:`.exponential`)."""
    q = q0 + tl.arange(0, BLOCK // 4).to(tl.int64)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = c2 + stream.to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, c2, c3, k0, k1)
    # [q, i, k] = r(2i + k): value 4q + j takes word j.
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))
    return (words >> 8).to(tl.int32)


@triton.jit
def _codes(x, h, CAP: tl.constexpr, CODE: tl.constexpr):
    """int32 codes of fp32 x, the reference's (:func:`.exponential.exponential_codes`) with
    u = h * 2**-24, deciding u < p on integers: with a = |x| clamped to 1, exponent field E,
    mantissa m and significand F (m plus the hidden bit), every p is F or m times a power of
    two, so u < p is h < an integer (ceil(p * 2**24)), and nothing rounds. ``CODE``, the
    dtype the codes are stored in, sets NaN's code (:func:`.exponential.nan_code`) and
    whether levels reach subnormals (int32)."""
    SUBNORMAL_LEVELS: tl.constexpr = CODE == tl.int32
    NAN_CODE: tl.constexpr = -2147483648 if SUBNORMAL_LEVELS else -128  # the dtype's minimum
    xi = x.to(tl.int32, bitcast=True)
    ai = xi & 0x7FFFFFFF
    finite = ai < 0x7F800000  # below the bits of +Inf: False for NaN too
    ai = tl.minimum(ai, 0x3F800000)  # the bits of 1.0: integer order is float order for a >= 0
    exp = ai >> 23
    man = ai & 0x7FFFFF
    # Normal a between two levels: a in (2**(E-127), 2**(E-126)], e = 126 - E, p = m * 2**-23:
    # up (k = e + 1) iff h < 2m, else k = e + 2; a power of two (m = 0) is a level, k = e + 1.
    k = 128 - exp - (h < 2 * man).to(tl.int32)
    if SUBNORMAL_LEVELS:
        # Levels reach 2**-149 (bits >= 9): a subnormal a = m * 2**-149 lies in (L, 2L] * 2**-149
        # with L = 2**(148 - e), e from m's own fp32 binade; p = (m - L) / L, so up iff
        # h < (m - L) * 2**(e - 124) (<= 2**24); a = 2**-149 (e = 149) is the last level.
        mi = man.to(tl.float32).to(tl.int32, bitcast=True)  # exact: m < 2**23
        e = 276 - (mi >> 23) - ((mi & 0x7FFFFF) != 0).to(tl.int32)
        e148 = tl.minimum(e, 148)
        lower = 1 << (148 - e148)
        up = (e >= 149) | (h < ((man - lower) << (e148 - 124)))
        k = tl.where(exp > 0, k, tl.where(man > 0, tl.where(up, e + 1, e + 2), 0))
    else:
        # a <= 2**-CAP, the smallest level: to it (k = CAP + 1) or to 0, with p = a * 2**CAP =
        # F * 2**(t - 24), t = max(E, 1) + CAP - 126 <= 1: up iff h < F * 2**t, that is
        # h < ceil(F / 2**-t) for t < 0 (1 once -t > 24). Zero has F = 0: never up.
        sig = man | ((exp > 0).to(tl.int32) << 23)
        t = tl.maximum(exp, 1) + CAP - 126
        s = tl.minimum(tl.maximum(-t, 0), 25)
        bound = tl.where(t >= 0, sig << tl.maximum(t, 0), (sig + (1 << s) - 1) >> s)
        bottom = tl.where(h < bound, CAP + 1, 0)
        k = tl.where(ai > ((127 - CAP) << 23), k, bottom)
    sign = xi >> 31  # 0 or -1
    return tl.where(finite, (k ^ sign) - sign, NAN_CODE)


@triton.jit
def _values(c, CODE: tl.constexpr):
    """fp32 values of codes ``c``, stored as ``CODE`` (:func:`_codes`), as
    :func:`.exponential.exponential_values`."""
    SUBNORMAL_LEVELS: tl.constexpr = CODE == tl.int32
    NAN_CODE: tl.constexpr = -2147483648 if SUBNORMAL_LEVELS else -128  # the dtype's minimum
    c = c.to(tl.int32)
    k = tl.abs(c)
    if SUBNORMAL_LEVELS:
        # 2**(1-k), subnormal from k = 128 on, built from bits (exp2 is approximate on GPUs).
        e = tl.maximum(k - 1, 0)
        normal = (127 - tl.minimum(e, 126)) << 23
        subnormal = tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(149 - e, 0), 22)
        magnitude = tl.where(e <= 126, normal, tl.where(e <= 149, subnormal, 0))
    else:
        magnitude = (128 - k) << 23  # int8 codes: |k| <= 127, all normal
    magnitude = tl.where(k == 0, 0, magnitude)
    bits = magnitude | ((c >> 31) << 31)
    return tl.where(c == NAN_CODE, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, value, n, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _encode_block(g_ptr, out_ptr, offs, n, norm, h, CAP: tl.constexpr, MASKED: tl.constexpr):
    """Codes of the values at ``offs``, divided first by the norm given (``norm``: the factors
    ``(pre, recip)`` of :func:`_encode_kernel`)."""
    x = _load(g_ptr, offs, n, MASKED)
    if g_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 is the top half of an fp32: the shift is exact, where the interpreter's cast
        # loses bf16 subnormals (the GPU's is the same shift).
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    if norm is not None:
        pre, recip = norm
        x = (x * pre) * recip
    code = _codes(x, h, CAP, out_ptr.dtype.element_ty)
    _store(out_ptr, offs, code.to(out_ptr.dtype.element_ty), n, MASKED)


@triton.jit(do_not_specialize=["n", "k0", "k1", "stream"])
def _encode_kernel(
    g_ptr,
    norm_ptr,
    out_ptr,
    n,
    k0,
    k1,
    stream,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Codes of ``g / norm``, the norm at ``norm_ptr`` (None: of ``g``), into ``out_ptr``, whose
    dtype sets the codes' format."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    norm = None
    if norm_ptr is not None:
        # As exponential.scale_input: pre = 2**64 below a norm of 2**-64, exact, so that the
        # reciprocal (one division per program) stays finite.
        nrm = tl.load(norm_ptr).to(tl.float32)
        nrm = tl.where(nrm > 0.0, nrm, 1.0)
        pre = tl.where(nrm < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        norm = (pre, tl.math.div_rn(pre * 0.0 + 1.0, nrm * pre))
    h = _uniforms(k0.to(tl.uint32), k1.to(tl.uint32), start // 4, stream, BLOCK)
    if start + BLOCK <= n:
        _encode_block(g_ptr, out_ptr, offs, n, norm, h, CAP, False)
    else:
        _encode_block(g_ptr, out_ptr, offs, n, norm, h, CAP, True)


@triton.jit
def _decode_block(codes, scale_ptr, out_ptr, offs, n, SUM: tl.constexpr, MASKED: tl.constexpr):
    """The values of ``codes``, ``(codes_ptr, rows, row_stride)``, at ``offs`` (``SUM``: the
    rows' summed in order), times the scale at ``scale_ptr`` where given."""
    codes_ptr, rows, row_stride = codes
    CODE: tl.constexpr = codes_ptr.dtype.element_ty
    if SUM:
        acc = tl.zeros(offs.shape, tl.float32)
        row_ptr = codes_ptr
        for _ in range(rows):
            acc = acc + _values(_load(row_ptr, offs, n, MASKED), CODE)
            row_ptr += row_stride  # a 64-bit pointer: no int32 product to overflow
    else:
        acc = _values(_load(codes_ptr, offs, n, MASKED), CODE)
    if scale_ptr is not None:
        acc = acc * tl.load(scale_ptr)
    _store(out_ptr, offs, acc, n, MASKED)


@triton.jit(do_not_specialize=["n", "rows"])
def _decode_kernel(
    codes_ptr,
    scale_ptr,
    out_ptr,
    n,
    rows,
    row_stride,
    SUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The fp32 values of the codes at ``codes_ptr`` (``SUM``: of ``rows`` rows, summed),
    times the scale at ``scale_ptr`` (None: no scale), into ``out_ptr``."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    codes = (codes_ptr, rows, row_stride)
    if start + BLOCK <= n:
        _decode_block(codes, scale_ptr, out_ptr, offs, n, SUM, False)
    else:
        _decode_block(codes, scale_ptr, out_ptr, offs, n, SUM, True)


def encode(
    g: torch.Tensor, norm: torch.Tensor | None, bits: int, key: int, stream: int = 0
) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.exponential.encode`."""
    check_encode(g, norm, bits, key)
    flat = g.reshape(-1)
    dtype = code_dtype(bits)
    out = torch.empty(flat.numel(), dtype=dtype, device=g.device)
    if flat.numel() == 0:
        return out
    if norm is not None:
        norm = norm.reshape(1).to(torch.float32)
    _encode_kernel[(-(-flat.numel() // _BLOCK),)](
        flat,
        norm,
        out,
        flat.numel(),
        *_key(key),
        stream & 0xFFFFFFFF,
        CAP=min(2 ** (bits - 1) - 2, 149),  # the smallest level is 2**-CAP
        BLOCK=_BLOCK,
        **_LAUNCH,
    )
    return out


def _decode_rows(rows: torch.Tensor, scale: torch.Tensor | None, summed: bool) -> torch.Tensor:
    """The fp32 values of ``rows`` (``[W, n]`` codes, each row contiguous), their rows summed
    in order given ``summed`` (else the one row's), times ``scale`` where given."""
    n = rows.shape[1]
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n:
        _decode_kernel[(-(-n // _BLOCK),)](
            rows,
            scale,
            out,
            n,
            rows.shape[0],
            rows.stride(0),
            SUM=summed,
            BLOCK=_BLOCK,
            **_LAUNCH,
        )
    return out


def decode(codes: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.exponential.decode`."""
    check_codes(codes, rows=False)
    return _decode_rows(codes.reshape(1, -1), None, False).view(codes.shape)


def decode_sum(codes: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.exponential.decode_sum`."""
    check_codes(codes, rows=True, scale=scale)
    return _decode_rows(codes if codes.stride(1) == 1 else codes.contiguous(), scale, True)
