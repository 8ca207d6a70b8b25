"""Exponential dithering (Global-QSGD), plain-torch reference: it defines the exact codes.

A value x in [-1, 1] (in the hook, ``g / global max|g|``) becomes a code k: 0 stands for zero,
k > 0 for ``sign(x) * 2**-(k-1)``. With ``K = 2**(bits-1) - 1``, the levels are
``1, 1/2, ..., 2**-(K-1)`` down to fp32's smallest subnormal ``2**-149``: |x| between two
neighbouring levels ``lower < |x| <= upper`` is rounded up with probability
``(|x| - lower) / (upper - lower)`` (below the smallest level, ``lower`` is 0): unbiased, up
to the 2**-24 granularity of the uniforms.
Codes are int8 for bits <= 8, else int32 (they never exceed 150 in magnitude).

Every step is exact, so that the Triton kernels (:mod:`.exponential_triton`) write the same
codes: the binade of |x| comes from its fp32 bits (``log2`` rounds, and is approximate on
GPUs), powers of two are built from bits, the rounding probability is a difference scaled by
a power of two (exact), and ``u < p`` compares two exact floats. Only the scaling rounds:
``x = (g * pre) * fp32(1 / (norm * pre))``, one IEEE division per call and two products per
value, ``pre`` being 2**64 for norms under 2**-64 (so that 1 / norm stays finite; scaling by
it is exact) and 1 otherwise. A product rather than a division per value keeps the kernel's
one pass cheap, for a relative error under 2**-23 in x (a bias of that order, like the
uniforms' own).

Random numbers: ``u`` of value i is ``(w >> 8) * 2**-24`` (24 bits, as ``torch.rand``), w
being word ``i % 4`` of Philox4x32-10 (:func:`.philox.philox4x32`) at counter
``(q mod 2**32, q >> 32, 0, stream)`` with ``q = i // 4``, under the 64-bit ``key``. The
kernels compute the same words. 16-bit halves, as max-min uses, would round every
probability up to the next multiple of 2**-16: far below the smallest level, where p is
tiny, that bias dwarfs the value; 24 bits leave a bias under 2**-24 of a step.

Non-finite values: NaN and +-Inf encode to :func:`nan_code` (the dtype's minimum, which no
finite value produces) and decode to NaN, so that in the hook they reach the average as NaN
rather than as finite numbers (an Inf gradient also makes the global norm Inf, and with it
every value of the average NaN). Finite |x| > 1 is clamped to 1.

Runs on any device; used on the CPU and in tests. A :class:`~cgx2.codecs.base.GlobalNormCodec`,
as are its Triton kernels.
"""

from __future__ import annotations

import sys
from typing import cast

import torch

from . import codec_for
from .base import GlobalNormCodec
from .philox import philox4x32

__all__ = [
    "code_dtype",
    "decode",
    "decode_sum",
    "encode",
    "exponential_codec",
    "exponential_codes",
    "exponential_values",
    "nan_code",
    "scale_input",
    "uniforms",
]

_M32 = 0xFFFFFFFF
_SMALLEST = 149  # fp32's smallest subnormal is 2**-149
_I32 = torch.int32


def check_code_bits(bits: object) -> int:
    """``bits`` as validated by every entry point (2..16, like GlobalQSGDState)."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if not 2 <= bits <= 16:
        raise ValueError(f"bits must be in 2..16, got {bits}")
    return bits


def code_dtype(bits: int) -> torch.dtype:
    """The codes' dtype: int8 up to 8 bits, int32 above."""
    return torch.int8 if check_code_bits(bits) <= 8 else torch.int32


def nan_code(dtype: torch.dtype) -> int:
    """The code of NaN and +-Inf: the dtype's minimum (finite codes lie in [-150, 150])."""
    if dtype not in (torch.int8, torch.int32):
        raise TypeError(f"codes must be int8 or int32, got {dtype}")
    return torch.iinfo(dtype).min


def check_encode(g: torch.Tensor, norm: torch.Tensor | None, bits: int, key: int) -> None:
    """The checks both implementations make before encoding."""
    check_code_bits(bits)
    if not isinstance(g, torch.Tensor) or not g.dtype.is_floating_point:
        raise TypeError(f"g must be a floating-point tensor, got {getattr(g, 'dtype', g)}")
    if norm is not None:
        if not isinstance(norm, torch.Tensor) or norm.numel() != 1:
            raise ValueError("norm must be a one-element tensor (or None)")
        if not norm.dtype.is_floating_point or norm.device != g.device:
            raise TypeError(f"norm must be a floating-point tensor on {g.device}")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError(f"key must be an int in [0, 2**64), got {key!r}")


def check_codes(codes: torch.Tensor, rows: bool, scale: torch.Tensor | None = None) -> None:
    """The checks both implementations make before decoding."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a tensor, got {type(codes).__name__}")
    nan_code(codes.dtype)
    if rows and codes.dim() != 2:
        raise ValueError(f"codes must be [rows, n] for decode_sum, got shape {tuple(codes.shape)}")
    if scale is not None and (
        not isinstance(scale, torch.Tensor)
        or scale.numel() != 1
        or scale.dtype != torch.float32
        or scale.device != codes.device
    ):
        raise ValueError(f"scale must be a one-element fp32 tensor on {codes.device} (or None)")


def uniforms(
    key: int, numel: int, stream: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """Uniform [0, 1) float32 of shape ``[numel]``, multiples of 2**-24 (see module doc)."""
    q = torch.arange(-(-numel // 4), dtype=torch.int64, device=device)
    zero = torch.zeros_like(q)
    words = philox4x32(q & _M32, q >> 32, zero, zero + (stream & _M32), key)
    return (torch.stack(words, -1).reshape(-1)[:numel] >> 8).to(torch.float32) * 2.0**-24


def _pow2_neg(e: torch.Tensor) -> torch.Tensor:
    """2**-e for int32 e >= 0 as fp32, exact down to subnormals, 0 below 2**-149."""
    normal = (127 - e.clamp(max=126)) << 23
    subnormal = torch.ones_like(e) << (_SMALLEST - e).clamp(0, 22)
    bits = torch.where(e <= 126, normal, torch.where(e <= _SMALLEST, subnormal, 0))
    return bits.view(torch.float32)


def _times_pow2(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """v * 2**s for 0 <= s <= 150, exact while it does not overflow: two factors, since 2**150
    is no fp32."""
    s1 = s.clamp(max=100)
    return v * ((127 + s1) << 23).view(torch.float32) * ((127 + s - s1) << 23).view(torch.float32)


def _binade(a: torch.Tensor) -> torch.Tensor:
    """e with a in (2**-(e+1), 2**-e] for fp32 a > 0, from the bits (subnormals included)."""
    ai = a.view(_I32)
    exp, man = ai >> 23, ai & 0x7FFFFF
    # A subnormal is man * 2**-149; man converts to fp32 exactly (< 2**23) and gives its binade.
    mi = man.float().view(_I32)
    e_normal = 127 - exp - (man != 0).to(_I32)
    e_subnormal = 127 + _SMALLEST - (mi >> 23) - ((mi & 0x7FFFFF) != 0).to(_I32)
    return torch.where(exp > 0, e_normal, e_subnormal)


def exponential_codes(x: torch.Tensor, bits: int, u: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` (taken as fp32, meant to lie in [-1, 1]) on powers of two: code k > 0
    stands for sign * 2^-(k-1), 0 for zero, rounded stochastically (with ``u``, uniform [0, 1)
    of x's shape) between neighbouring levels: unbiased. See the module doc."""
    kmax = 2 ** (check_code_bits(bits) - 1) - 1  # smallest level 2^-(kmax-1)
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if not isinstance(u, torch.Tensor) or u.shape != x.shape:
        raise ValueError(f"u must be a tensor of x's shape {tuple(x.shape)}")
    x = x.float()
    finite = torch.isfinite(x)
    a = torch.where(finite, x.abs().clamp(max=1.0), 0.0)
    e = _binade(a).clamp(max=min(kmax - 1, _SMALLEST))  # zero lands on the cap, masked below
    has_lower = (e < kmax - 1) & (e < _SMALLEST)  # 2^-(e+1) is a level and an fp32
    lower = torch.where(has_lower, _pow2_neg(e + 1), 0.0)
    # (a - lower) / step with step = 2^-(e+1) or 2^-e: the difference is exact (Sterbenz), and
    # so is the product by a power of two that this division is.
    p = _times_pow2(a - lower, torch.where(has_lower, e + 1, e))
    k = torch.where(u.float() < p, e + 1, torch.where(has_lower, e + 2, 0))
    k = torch.where(a > 0, k, 0)
    codes = torch.where(x < 0, -k, k)
    dtype = code_dtype(bits)
    return torch.where(finite, codes, nan_code(dtype)).to(dtype)


def exponential_values(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`exponential_codes`: fp32 ``sign * 2^-(|k|-1)``, 0 for 0, NaN for
    :func:`nan_code`."""
    nan = codes == nan_code(codes.dtype)
    c = torch.where(nan, 0, codes.to(_I32))
    k = c.abs()
    magnitude = torch.where(k > 0, _pow2_neg((k - 1).clamp(min=0)), 0.0)
    values = torch.where(c < 0, -magnitude, magnitude)
    return torch.where(nan, float("nan"), values)


def scale_input(g: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
    """Flat fp32 ``x = (g * pre) * fp32(1 / (norm * pre))`` (see the module doc); a norm <= 0
    or NaN counts as 1, None means x = g."""
    x = g.reshape(-1).float()
    if norm is None:
        return x
    n = norm.reshape(1).float()
    n = torch.where(n > 0, n, 1.0)
    pre = torch.where(n < 2.0**-64, 2.0**64, 1.0)
    return (x * pre) * (torch.ones_like(n) / (n * pre))


def encode(
    g: torch.Tensor, norm: torch.Tensor | None, bits: int, key: int, stream: int = 0
) -> torch.Tensor:
    """Flat codes of ``g / norm`` (as :func:`scale_input` computes it) with uniforms
    ``uniforms(key, g.numel(), stream)``."""
    check_encode(g, norm, bits, key)
    x = scale_input(g, norm)
    return exponential_codes(x, bits, uniforms(key, x.numel(), stream, x.device))


def decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (any shape)."""
    check_codes(codes, rows=False)
    return exponential_values(codes)


def decode_sum(codes: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(0 + values(row 0) + values(row 1) + ...) * scale`` over the rows of ``[W, n]`` codes,
    in fp32 and in row order (the order is part of the result)."""
    check_codes(codes, rows=True, scale=scale)
    acc = torch.zeros(codes.shape[1], dtype=torch.float32, device=codes.device)
    for row in codes:
        acc = acc + exponential_values(row)
    return acc if scale is None else acc * scale.reshape(1)


def exponential_codec(device: torch.device) -> GlobalNormCodec:
    """The implementation for tensors on ``device`` (same codes either way): the Triton
    kernels for CUDA where Triton imports, this module elsewhere."""
    return codec_for(device, "exponential_triton", cast(GlobalNormCodec, sys.modules[__name__]))
