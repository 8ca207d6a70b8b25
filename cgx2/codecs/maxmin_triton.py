"""Max-min codec as Triton kernels: encode, decode and fused decode-sum-encode.

They write the same bytes as the torch reference (:mod:`.maxmin`) and take the same
arguments: a :class:`~cgx2.codecs.base.Codec`. A tile is ``BUCKETS`` buckets x ``BLOCK``
values; encode and decode-sum-encode programs walk a few tiles each in grid strides, loading
the next while coding one; buckets wider than ``BLOCK`` are walked a tile at a time
(statistics first, then levels). A thread holds whole groups of eight values: each group is
one Philox call (computed in-kernel) and one packed field, so neither crosses threads. With
``rotation`` (:mod:`.rotation`), the same kernels rotate each tile in registers after loading
it (encode; own's values in decode-sum-encode) or before storing it (decode): a constexpr,
whose unrotated builds hold none of it. Runs on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (tests)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import config
from . import maxmin, rotation
from .direct_launch import Launcher
from .layout import ChunkedLayout, MaxMinLayout
from .rotation import Rotation

__all__ = [
    "chunked_layout",
    "decode",
    "decode_chunks",
    "decode_sum",
    "decode_sum_encode",
    "encode",
    "encode_chunks",
]

chunked_layout = maxmin.chunked_layout  # one payload layout: the reference's

# Values per program (BUCKETS * BLOCK) and warps, per kernel and bytes per value of its fp
# tensor (2: bf16/fp16; 4 and more: fp32, fp64): the fastest for 4-bit data, measured on an
# H200 (fp32 decode ran fastest with more threads than groups). A tuning script may set them.
_SHAPE: dict[tuple[str, int], tuple[int, int]] = {
    ("encode", 2): (512, 1),
    ("encode", 4): (512, 1),
    ("decode", 2): (1024, 2),
    ("decode", 4): (512, 4),
    ("decode_sum_encode", 2): (512, 1),
    ("decode_sum_encode", 4): (512, 1),
}
# The rotated kernels' tile and warps, whatever the dtype: one warp a tile of 512 holds its
# rotation blocks whole, so the butterflies between groups are shuffles; with more warps a
# tile (the unrotated decoder's 4), sm_90 builds moved values through shared memory behind
# barriers. Not yet tuned on a GPU.
_ROTATED_SHAPE: tuple[int, int] = (512, 1)
_MAX_BLOCK = 1024
# Tiles each program of a strided kernel walks (the grid is sized from it). A few: the loads
# of all but the first are in flight while the one before is coded, and each program still
# ends soon, leaving SMs to the NCCL kernels that run beside the coding; one tile a program
# was clearly slower, 2 to 8 alike.
_TILES_PER_PROGRAM = 4
# A grid has at least this many programs (up to one a tile): walking 4 tiles each, a small
# tensor's few programs would leave SMs idle; 512 and 8192 each lost somewhere, measured
# with bench/kernel_ab.py.
_MIN_PROGRAMS = 2048
# Decode-sum-encode's grid instead holds this many programs a multiprocessor, one resident
# wave, each walking its share of the tiles: faster than the grid above for large fp32
# tensors, no slower elsewhere; fewer a multiprocessor were slower, more no faster (measured
# with bench/kernel_ab.py).
_DSE_PROGRAMS_PER_SM = 16
# The rotated decode-sum-encode's: its build for sm_90 takes 255 registers a thread at 4 rows
# (the unrotated 128), so 8 one-warp programs fill a multiprocessor's registers; 16 would run
# as two waves, the second mostly idle. Not yet measured.
_DSE_ROTATED_PROGRAMS_PER_SM = 8
# The saturated coding's powers of two and the most ulps a step moves (maxmin's own).
_TWO_127 = tl.constexpr(maxmin._TWO_127)
_TWO_126 = tl.constexpr(maxmin._TWO_126)
_TWO_106 = tl.constexpr(maxmin._TWO_106)
_NUDGES = tl.constexpr(maxmin._NUDGES)
# Fused multiply-adds would round differently from the reference's separate operations.
_LAUNCH: dict[str, object] = {"enable_fp_fusion": False}


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, as Triton itself decides."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return config.triton_interpret()


_INTERPRET = tl.constexpr(_interpreting())


@triton.jit
def _mulhilo(a, M: tl.constexpr):
    """High and low words of uint32 ``a`` times ``M``: one widening multiply, not two."""
    p = a.to(tl.uint64) * M
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr = 10):
    """Philox4x32 on uint32 tensors; the codecs' 10 rounds and constants are the reference's
    (other counts only price the rounds)."""
    for _ in tl.static_range(ROUNDS):
        hi_b, lo_b = _mulhilo(c2, 0xCD9E8D57)
        hi_a, lo_a = _mulhilo(c0, 0xD2511F53)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _random_halves(rng, q, c, BLOCK: tl.constexpr):
    """16-bit random integers (uint32) for a tile of buckets ``q`` (c % 8 == 0), as the halves
    of :func:`_tile`, from ``rng``, the random stream ``(stream, key0, key1)``: one Philox
    call per group of 8 values, whose value 8g + 4i + 2k + h takes half h of word 2k + i (the
    order is defined in :mod:`.philox`)."""
    stream, k0, k1 = rng
    BUCKETS: tl.constexpr = q.shape[0]
    G: tl.constexpr = BLOCK // 8
    zero = tl.zeros((BUCKETS, G), dtype=tl.uint32)
    c0 = zero + (c // 8 + tl.arange(0, G)).to(tl.uint32)[None, :]
    c1 = zero + (q & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = zero + (q >> 32).to(tl.uint32)[:, None]
    c3 = zero + stream.to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, c2, c3, k0, k1)
    return _group_halves(r0, r2, BUCKETS, G), _group_halves(r1, r3, BUCKETS, G)


@triton.jit
def _group_halves(a, b, BUCKETS: tl.constexpr, G: tl.constexpr):
    """[BUCKETS, G, 4]: the low and high halves of word a, then of word b."""
    halves = tl.join(tl.join(a & 0xFFFF, b & 0xFFFF), tl.join(a >> 16, b >> 16))  # [.., k, h]
    return tl.reshape(halves, (BUCKETS, G, 4))


# --------------------------------------------------------------------------- rotation
# The randomized Hadamard rotation (:mod:`.rotation` defines it), in registers: a tile's
# whole blocks rotated after loading, before the statistics (encode, own's values in
# decode-sum-encode), or after decoding, before the store (decode, inversely). ``ROT`` is the
# block, 0 for none: the unrotated kernels compile as they did. Blocks divide the bucket and
# never exceed the tile (the launch makes ``BLOCK`` at least ``ROT``), so a tile holds whole
# blocks; only the payload's trailing ``n % ROT`` values, at and past ``rot_end``, stay as
# they are.

# How the forward rotation's butterflies between groups move values (:func:`_butterfly_groups`):
# by exchange (True) or by split and join (False: fewer instructions in decode-sum-encode's
# sm_90 build). The same bits either way; an A/B on a GPU (bench/kernel_ab.py --rotation, a
# copy of this module with it flipped) settles it. The inverse always exchanges.
_EXCHANGE_FORWARD = tl.constexpr(False)
_SIGN_C2 = tl.constexpr(rotation._SIGN_C2)
_SIGN_C3 = tl.constexpr(rotation._SIGN_C3)
_SIGN_GROUP = tl.constexpr(rotation.SIGN_GROUP)


@triton.jit
def _sign_words(i, sk0, sk1):
    """The Philox word holding the sign of value ``i`` (int64, its index in the payload) at
    bit ``i & 31``: word ``(i >> 5) & 3`` of the call at counter ``(g_lo, g_hi, C2, C3)``,
    ``g = i >> 7`` (:mod:`.rotation`)."""
    g = i // _SIGN_GROUP
    zero = tl.zeros(i.shape, tl.uint32)
    c0 = (g & 0xFFFFFFFF).to(tl.uint32)
    c1 = (g >> 32).to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, zero + _SIGN_C2, zero + _SIGN_C3, sk0, sk1)
    w = (i >> 5) & 3
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def _tile_signs(
    q, c, signs, B: tl.constexpr, BLOCK: tl.constexpr, ROT: tl.constexpr, GROUPED: tl.constexpr
):
    """The signs of a tile's halves (:func:`_tile`), values ``base + q * B + col``, as sign
    bits (uint32, 0 or 0x80000000: xored into a float, a product with +-1 but for NaN's
    bits), and which values lie before ``rot_end``; ``signs`` is ``(sk0, sk1, base,
    rot_end)``, the signs' key first. ``GROUPED`` (every group's first index a multiple of 8,
    and ``base`` one of 16): a group's eight signs are one byte of one Philox word, one call a
    pair of groups (a group where B is no multiple of 16); else one call a value."""
    sk0, sk1, base, rot_end = signs
    G: tl.constexpr = BLOCK // 8
    TOP: tl.constexpr = 0x80000000
    if GROUPED:
        first = base + q[:, None] * B + c + 8 * tl.arange(0, G)[None, :]
        # The group's bits lowest; shifted left, bit k of them lands on the sign bit. Two
        # groups, 16 values, share a word: one Philox call a pair (a thread holds groups a
        # warp apart, so the pairs' bits then move to their groups' threads). ``base`` is a
        # multiple of 16 where the bucket is.
        if G >= 2 and B % 16 == 0:
            pair = base + q[:, None] * B + c + 16 * tl.arange(0, G // 2)[None, :]
            word = _sign_words(pair, sk0, sk1) >> (pair & 31).to(tl.uint32)
            bits = tl.reshape(tl.join(word, word >> 8), (first.shape[0], G))
        else:
            bits = _sign_words(first, sk0, sk1) >> (first & 31).to(tl.uint32)
        m0 = _group_signs(bits, 0)
        m1 = _group_signs(bits, 4)
        slot = tl.arange(0, 4)[None, None, :]
        if ROT >= 8:  # rot_end is a multiple of 8: a group lies before it or not
            inside0 = (first < rot_end)[:, :, None]
            inside1 = inside0
        else:
            i0 = first[:, :, None] + slot
            inside0 = i0 < rot_end
            inside1 = i0 + 4 < rot_end
    else:
        col = c + 8 * tl.arange(0, G)[:, None] + tl.arange(0, 4)[None, :]
        i0 = base + q[:, None, None] * B + col[None, :, :]
        i1 = i0 + 4
        m0 = (_sign_words(i0, sk0, sk1) << (31 - (i0 & 31)).to(tl.uint32)) & TOP
        m1 = (_sign_words(i1, sk0, sk1) << (31 - (i1 & 31)).to(tl.uint32)) & TOP
        inside0 = i0 < rot_end
        inside1 = i1 < rot_end
    return m0, m1, inside0, inside1


@triton.jit
def _group_signs(bits, K: tl.constexpr):
    """[BUCKETS, G, 4]: bits K..K+3 of each group's ``bits`` on the sign bit. Joined as
    :func:`_group_halves` joins, so that a thread holds its groups' four (built by
    broadcasting, they took a layout of their own, four threads computing each group's
    Philox call)."""
    TOP: tl.constexpr = 0x80000000
    s0 = (bits << (31 - K)) & TOP
    s1 = (bits << (30 - K)) & TOP
    s2 = (bits << (29 - K)) & TOP
    s3 = (bits << (28 - K)) & TOP
    return tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (bits.shape[0], bits.shape[1], 4))


@triton.jit
def _xor_sign(v, m):
    """fp32 ``v`` with its sign bit xored with ``m``'s."""
    return (v.to(tl.uint32, bitcast=True) ^ m).to(tl.float32, bitcast=True)


@triton.jit
def _butterfly_slots(v, H: tl.constexpr):
    """One butterfly stage among each group's four slots of a half, [BUCKETS, G, 4]: slots
    j and j + H (j & H == 0, H 1 or 2) become (a + b, a - b)."""
    S0: tl.constexpr = v.shape[0]
    S1: tl.constexpr = v.shape[1]
    w = tl.reshape(v, (S0, S1, 2, 2))  # [.., slot // 2, slot % 2]
    if H == 2:
        w = tl.permute(w, (0, 1, 3, 2))
    a, b = tl.split(w)
    w = tl.join(a + b, a - b)
    if H == 2:
        w = tl.permute(w, (0, 1, 3, 2))
    return tl.reshape(w, (S0, S1, 4))


@triton.jit
def _butterfly_groups(v, M: tl.constexpr, EXCHANGE: tl.constexpr):
    """One butterfly stage between groups g and g + M (g & M == 0) of a half, [BUCKETS, G,
    4]: the stage h = 8 M of the values. ``EXCHANGE``: each value meets its partner (one
    shuffle a value; the first of a pair is a + b, the second -b + a, which is a - b
    exactly), else pairs are split and joined (a layout conversion and a select a value).
    The same bits either way; on sm_90 the exchange built the shorter decoder, the split
    the shorter encoders (decode-sum-encode's exchanges cost shuffles by the hundred)."""
    S0: tl.constexpr = v.shape[0]
    S1: tl.constexpr = v.shape[1]
    w = tl.reshape(v, (S0, S1 // (2 * M), 2, M, 4))
    if EXCHANGE:
        second = (tl.arange(0, 2) == 1).to(tl.uint32)[None, None, :, None, None] << 31
        w = _xor_sign(w, second) + tl.flip(w, 2)
    else:
        a, b = tl.split(tl.permute(w, (0, 1, 3, 4, 2)))
        w = tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3))
    return tl.reshape(w, (S0, S1, 4))


@triton.jit
def _butterflies(v0, v1, ROT: tl.constexpr, EXCHANGE: tl.constexpr = False):
    """The unnormalized Walsh-Hadamard transform of each block of ``ROT`` values of a tile's
    halves, in the reference's stage order h = 1, 2, ..., ROT / 2: h = 1 and 2 within a
    group's halves, h = 4 between the halves, h = 8 and up between groups."""
    if ROT >= 2:
        v0 = _butterfly_slots(v0, 1)
        v1 = _butterfly_slots(v1, 1)
    if ROT >= 4:
        v0 = _butterfly_slots(v0, 2)
        v1 = _butterfly_slots(v1, 2)
    if ROT >= 8:
        a = v0 + v1
        v1 = v0 - v1
        v0 = a
    if ROT >= 16:
        LOG: tl.constexpr = ROT.bit_length() - 1
        for k in tl.static_range(LOG - 3):
            v0 = _butterfly_groups(v0, 1 << k, EXCHANGE)
            v1 = _butterfly_groups(v1, 1 << k, EXCHANGE)
    return v0, v1


@triton.jit
def _rotation_scale(ROT: tl.constexpr):
    """fp32(1 / sqrt(ROT)) (:func:`.rotation.rotation_scale`), from its bits: 2**-(k/2) for
    ROT = 2**k, k even, else fp32(1/sqrt(2)) (0x3F3504F3) times 2**-((k-1)/2), exactly."""
    K: tl.constexpr = ROT.bit_length() - 1
    ODD: tl.constexpr = K % 2
    BITS: tl.constexpr = (0x3F3504F3 - ((K - 1) // 2 << 23)) * ODD + ((127 - K // 2) << 23) * (
        1 - ODD
    )
    return tl.full((), BITS, tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _rotate_tile(
    v0,
    v1,
    q,
    c,
    signs,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    ROT: tl.constexpr,
    INVERSE: tl.constexpr,
    GROUPED: tl.constexpr,
    CANONICAL_NAN: tl.constexpr,
):
    """A tile's halves (fp32) rotated, or with ``INVERSE`` rotated back, where their index in
    the payload, ``base + q * B + col``, is below ``rot_end`` (the end of the last whole
    block; ``signs`` as :func:`_tile_signs` takes them); the values at and past it as they
    are. Each step one fp32 operation in the reference's order. ``CANONICAL_NAN``: every NaN
    out is 0x7FC00000, the reference's (hardware's NaN bits differ), for values stored; a NaN
    only coded needs no such care."""
    m0, m1, inside0, inside1 = _tile_signs(q, c, signs, B, BLOCK, ROT, GROUPED)
    scale = _rotation_scale(ROT)
    if INVERSE:  # (r * scale) * sign is r * (scale * sign), exactly: rounding is symmetric
        r0, r1 = _butterflies(v0, v1, ROT, True)
        r0 = r0 * _xor_sign(scale, m0)
        r1 = r1 * _xor_sign(scale, m1)
    else:
        r0, r1 = _butterflies(_xor_sign(v0, m0), _xor_sign(v1, m1), ROT, _EXCHANGE_FORWARD)
        r0 = r0 * scale
        r1 = r1 * scale
    r0 = tl.where(inside0, r0, v0)
    r1 = tl.where(inside1, r1, v1)
    if CANONICAL_NAN:
        nan = (tl.zeros(r0.shape, tl.uint32) + 0x7FC00000).to(tl.float32, bitcast=True)
        r0 = tl.where(r0 != r0, nan, r0)
        r1 = tl.where(r1 != r1, nan, r1)
    return r0, r1


@triton.jit
def _rotate_values(v0, v1, q, c, signs, B: tl.constexpr, BLOCK: tl.constexpr, ROT: tl.constexpr):
    """A tile's values to code, rotated by ``signs`` (:func:`_rotate_tile`) where ``ROT`` is
    not 0; as they are otherwise."""
    if ROT > 0:
        v0, v1 = _rotate_tile(v0, v1, q, c, signs, B, BLOCK, ROT, False, B % 8 == 0, False)
    return v0, v1


@triton.jit
def _minus_2_23(bits):
    """fp32 with ``bits`` (2**23 + k, k < 2**23) less 2**23: exactly k."""
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _small_to_float(k):
    """uint32 k < 2**23 as fp32, exactly, with no conversion instruction: 2**23 + k has k in
    its mantissa."""
    return _minus_2_23(k | 0x4B000000)


@triton.jit
def _round_level(a, h, BITS: tl.constexpr):
    """floor(a + h * 2**-F) of a in [-0, 2**BITS - 1], exactly (see :mod:`.maxmin`), under
    bits above the level that the caller masks off; no conversion instruction (a slow pipe, and
    the kernels are issue-bound). Rounding a + 2**(23 - F) down leaves floor(a * 2**F) in the
    mantissa, under an exponent field that is a multiple of 2**F; adding h and shifting
    right by F is the floor of the exact sum. The interpreter has no directed rounding:
    there, the sum rounds to nearest, one less where that rounded up."""
    F: tl.constexpr = 16 if BITS <= 7 else 15
    ANCHOR: tl.constexpr = 128.0 if BITS <= 7 else 256.0
    if _INTERPRET:
        y = a + ANCHOR
        up = ((y - ANCHOR) > a).to(tl.uint32)
    else:
        y = libdevice.add_rd(a, ANCHOR)
        up = 0
    return (y.to(tl.uint32, bitcast=True) - up + (h >> (16 - F))) >> F


@triton.jit
def _load_key(k0, k1, keys_ptr, KEYS_IN_MEMORY: tl.constexpr):
    """The Philox key's 32-bit halves: the arguments' low bits, or the int64 at ``keys_ptr``
    (written before a CUDA graph's replay, which freezes arguments)."""
    if KEYS_IN_MEMORY:
        key = tl.load(keys_ptr)
        return key.to(tl.uint32), (key >> 32).to(tl.uint32)
    else:
        return k0.to(tl.uint32), k1.to(tl.uint32)


@triton.jit
def _chunk_signs(
    sign_k0,
    sign_k1,
    signs_ptr,
    numel,
    start,
    chunk_numel,
    ROT: tl.constexpr,
    SIGNS_IN_MEMORY: tl.constexpr,
):
    """The rotation of the chunk from ``start`` as :func:`_tile_signs` takes it, the signs'
    key from ``sign_k0, sign_k1`` or the int64 at ``signs_ptr`` (:func:`_load_key`); None
    where ``ROT`` is 0."""
    signs = None
    if ROT > 0:  # the chunk's last whole block ends at rot_end
        sk0, sk1 = _load_key(sign_k0, sign_k1, signs_ptr, SIGNS_IN_MEMORY)
        rot_end = tl.minimum(tl.maximum(numel - start, 0), chunk_numel) // ROT * ROT
        signs = (sk0, sk1, 0, rot_end)
    return signs


@triton.jit
def _geometry(
    j, numel, chunk_numel, B: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr, ALIGN: tl.constexpr
):
    """Chunk j's first element, quantized buckets, quantized values and levels offset.
    ``chunk_numel`` is a multiple of ``ALIGN``; spelling that out lets loads vectorize."""
    start = j.to(tl.int64) * (chunk_numel // ALIGN) * ALIGN
    size = tl.minimum(tl.maximum(numel - start, 0), chunk_numel)
    if SKIP_INCOMPLETE:
        nq = size // B
        raw = size - nq * B
    else:
        nq = (size + B - 1) // B
        raw = size * 0
    levels_at = (8 * nq + 4 * raw + 15) // 16 * 16
    return start, nq, tl.minimum(size, nq * B), levels_at


@triton.jit
def _tile(q, qmask, quant, c, B: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    """A tile as two halves of shape [BUCKETS, BLOCK // 8, 4]: values 8g..8g+3 and 8g+4..8g+7
    of each group g of eight, so that one thread holds a whole group and its random words and
    packed levels never move between threads. Returns the first half's element indices
    within the chunk (the second's are 4 more) and which elements of each half hold data
    (all, given ``FULL``: a tile of complete buckets, none of them past the end)."""
    col = c + 8 * tl.arange(0, BLOCK // 8)[:, None] + tl.arange(0, 4)[None, :]
    e = q[:, None, None] * B + col[None, :, :]
    if FULL:  # spelled out: the compiler cannot always prove these masks true
        valid = tl.full(e.shape, 1, tl.int1)
        return e, valid, valid
    inside = qmask[:, None, None]
    valid0 = inside & (col[None, :, :] < B) & (e < quant)
    valid1 = inside & (col[None, :, :] + 4 < B) & (e + 4 < quant)
    return e, valid0, valid1


@triton.jit
def _group_grid(
    q,
    qmask,
    quant,
    c,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    AS_TILE: tl.constexpr = True,
):
    """Group indices [BUCKETS, BLOCK // 8] of a tile (global: bucket q's groups are
    q * ceil(B / 8) + g) and which groups hold data. ``AS_TILE``: laid out over the threads
    as :func:`_tile` lays out its groups, a warp apart. Seen contiguous, Triton gave each
    thread adjacent groups, to load them as one vector, then shuffled them between threads to
    meet the tile: 48 of decode-sum-encode's 690 instructions a tile, and 8 registers. The
    decoder, which stores its tile as it loaded the fields, keeps the vector loads."""
    g = c // 8 + tl.arange(0, BLOCK // 8)
    group = q[:, None] * ((B + 7) // 8) + g[None, :]
    if AS_TILE:
        group = tl.max_contiguous(group, [1, 1])
    if FULL:
        return group, tl.full(group.shape, 1, tl.int1)
    mask = qmask[:, None] & (g[None, :] * 8 < B) & (q[:, None] * B + g[None, :] * 8 < quant)
    return group, mask


@triton.jit
def _field_ptr(ptr, BITS: tl.constexpr):
    """``ptr`` as a pointer to a group's BITS bytes as one integer (BITS a power of two)."""
    if BITS == 1:
        return ptr.to(tl.pointer_type(tl.uint8))
    elif BITS == 2:
        return ptr.to(tl.pointer_type(tl.uint16))
    elif BITS == 4:
        return ptr.to(tl.pointer_type(tl.uint32))
    else:
        return ptr.to(tl.pointer_type(tl.uint64))


@triton.jit
def _meta_ptr(row_ptr):
    """A payload row's (lo, step) fp32 pairs, from the row's uint8 pointer. Cast here, not as
    a float32 view of each payload on the host: a view costs about a microsecond a launch."""
    return row_ptr.to(tl.pointer_type(tl.float32))


@triton.jit
def _pack_store(
    ptr,
    l0,
    l1,
    keep,
    q,
    qmask,
    quant,
    c,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
):
    """Store a tile's levels (the halves of :func:`_tile`, zero outside the data): each
    group's eight levels are one little-endian BITS-byte field, zero for buckets not kept.
    This is :mod:`cgx2.codecs.packing`'s format (``pack_levels``), which a kernel cannot
    call; tests/codecs/test_triton_kernels.py holds these bytes to it."""
    WIDE: tl.constexpr = BITS > 4
    wt = tl.uint64 if WIDE else tl.uint32
    shift = (tl.arange(0, 4) * BITS).to(wt)[None, None, :]
    field = tl.sum(l0.to(wt) << shift, axis=2) + tl.sum(l1.to(wt) << (shift + 4 * BITS), axis=2)
    field = tl.where(keep[:, None], field, 0)  # disjoint bits: the sums are ors
    group, mask = _group_grid(q, qmask, quant, c, B, BLOCK, FULL)
    if BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8:
        fields = _field_ptr(ptr, BITS) + group
        tl.store(fields, field.to(fields.dtype.element_ty), mask=mask)
    else:
        k = tl.arange(0, 8)
        byte = (field[:, :, None] >> (k * 8).to(wt)[None, None, :]) & 0xFF
        off = group[:, :, None] * BITS + k[None, None, :]
        tl.store(ptr + off, byte.to(tl.uint8), mask=mask[:, :, None] & (k < BITS)[None, None, :])


@triton.jit
def _load_fields(
    ptr,
    q,
    qmask,
    quant,
    c,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    AS_TILE: tl.constexpr = True,
):
    """A tile's packed groups [BUCKETS, BLOCK // 8], one field each (see :func:`_pack_store`;
    ``AS_TILE`` as in :func:`_group_grid`)."""
    wt = tl.uint64 if BITS > 4 else tl.uint32
    group, mask = _group_grid(q, qmask, quant, c, B, BLOCK, FULL, AS_TILE)
    if BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8:
        return tl.load(_field_ptr(ptr, BITS) + group, mask=mask, other=0).to(wt)
    k = tl.arange(0, 8)
    off = group[:, :, None] * BITS + k[None, None, :]
    byte = tl.load(ptr + off, mask=mask[:, :, None] & (k < BITS)[None, None, :], other=0)
    return tl.sum(byte.to(wt) << (k * 8).to(wt)[None, None, :], axis=2)


@triton.jit
def _byte_float(word, byte):
    """2**23 + byte ``byte`` of uint32 ``word``, as fp32 bits: one byte permute, where a shift,
    a mask and an or would be three instructions (decode-sum-encode decodes K - 1 rows a
    value)."""
    if _INTERPRET:
        return ((word >> (byte * 8).to(tl.uint32)) & 0xFF) | 0x4B000000
    return tl.inline_asm_elementwise(
        "prmt.b32 $0, $1, 0x4B000000, $2;",
        "=r,r,r",
        [word, 0x7440 + byte],
        dtype=tl.uint32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _unpack(field, BITS: tl.constexpr):
    """Packed groups' levels as fp32, the halves of :func:`_tile`."""
    if BITS == 4:
        # Byte i of `even` holds level 2i, of `odd` level 2i + 1; joined, they interleave.
        even = (field & 0x0F0F0F0F)[:, :, None]
        odd = ((field >> 4) & 0x0F0F0F0F)[:, :, None]
        i = tl.arange(0, 2)[None, None, :]
        shape: tl.constexpr = (field.shape[0], field.shape[1], 4)
        b0 = tl.reshape(tl.join(_byte_float(even, i), _byte_float(odd, i)), shape)
        b1 = tl.reshape(tl.join(_byte_float(even, i + 2), _byte_float(odd, i + 2)), shape)
        return _minus_2_23(b0), _minus_2_23(b1)
    # Byte permutes for 8 bits made Triton move the bf16 decode's values through shared memory,
    # which was slower.
    wt = tl.uint64 if BITS > 4 else tl.uint32
    shift = (tl.arange(0, 4) * BITS).to(wt)[None, None, :]
    lmax: tl.constexpr = (1 << BITS) - 1
    l0 = ((field[:, :, None] >> shift) & lmax).to(tl.uint32)
    l1 = ((field[:, :, None] >> (shift + 4 * BITS)) & lmax).to(tl.uint32)
    return _small_to_float(l0), _small_to_float(l1)


@triton.jit
def _to_bf16(v):
    """fp32 -> bf16 rounding to nearest even, NaN -> 0x7FC0, exactly as torch does. The GPU
    rounds so itself (its NaN differs); the interpreter's own cast truncates."""
    if _INTERPRET:
        bits = v.to(tl.uint32, bitcast=True)
        half = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    else:
        half = v.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    return tl.where(v != v, 0x7FC0, half).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _min_with_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _stats(v0, v1, valid0, valid1):
    """Per-bucket min and max of a tile's halves; the min is NaN where a NaN is, so that any
    non-finite value shows as a non-finite span (see :func:`_params`)."""
    lo = _min_with_nan(tl.where(valid0, v0, float("inf")), tl.where(valid1, v1, float("inf")))
    hi = tl.maximum(tl.where(valid0, v0, float("-inf")), tl.where(valid1, v1, float("-inf")))
    lo = tl.reduce(tl.reduce(lo, 2, _min_with_nan), 1, _min_with_nan)
    return lo, tl.max(tl.max(hi, axis=2), axis=1)


@triton.jit
def _no_stats(q):
    """The per-bucket min and max of buckets ``q`` before any value: +Inf and -Inf."""
    return (
        tl.full((q.shape[0],), float("inf"), tl.float32),
        tl.full((q.shape[0],), float("-inf"), tl.float32),
    )


@triton.jit
def _add_stats(lo, hi, v0, v1, valid0, valid1):
    """Per-bucket min and max of the tiles so far, ``lo`` and ``hi``, and a tile's halves
    (:func:`_stats`)."""
    t_lo, t_hi = _stats(v0, v1, valid0, valid1)
    return _min_with_nan(lo, t_lo), tl.maximum(hi, t_hi)


@triton.jit
def _params(lo, hi, BITS: tl.constexpr):
    lmax = tl.full(lo.shape, (1 << BITS) - 1, tl.float32)
    nan = (tl.zeros(lo.shape, tl.uint32) + 0x7FC00000).to(tl.float32, bitcast=True)
    lo = lo + 0.0  # signed zeros become +0.0, as in the reference
    hi = hi + 0.0
    span = hi - lo
    inf = float("inf")
    # Finite ends whose span overflows: half scale, flagged by a negative step; a NaN or
    # +-Inf value leaves the span non-finite (maxmin.encode).
    halved = (lo > -inf) & (lo < inf) & (hi > -inf) & (hi < inf) & (span == inf)
    finite = (span < inf) | halved
    positive = finite & (span > 0)
    # A span so small that lmax / span overflows: differences are scaled by 2**64 first
    # (exactly), else the scale would clamp and bias the levels.
    tiny = positive & (tl.math.div_rn(lmax, span) == inf) & ~halved
    pre = tl.where(halved, 0.5, tl.where(tiny, 18446744073709551616.0, 1.0))
    lo_p = lo * pre
    span_p = hi * pre - lo_p
    step = tl.where(finite, tl.math.div_rn(span, lmax), nan)
    step = tl.where(halved, -tl.math.div_rn(span_p, lmax), step)
    scale = tl.where(positive, _div_toward_zero(lmax, span_p), 0.0)
    stored_lo = tl.where(halved, lo_p, tl.where(finite, lo, nan))
    return stored_lo, step, scale, finite, pre, lo_p


@triton.jit
def _finite_top(stored_lo, step, hi, BITS: tl.constexpr):
    """The step an ulp less where the top level would decode past FLT_MAX
    (maxmin._finite_top): the bits less one are the next float toward zero, of either sign.
    Only the stored step changes, not the levels: the kernels call this once a tile's levels
    are stored, and only where its max passes 2**127 (below, the top level, the max a few
    ulps of the span off, is far from FLT_MAX): a branch before the levels cost more."""
    if tl.max((hi > _TWO_127).to(tl.int32), axis=0) > 0:
        lmax = tl.full(step.shape, (1 << BITS) - 1, tl.float32)
        for _ in tl.static_range(_NUDGES):
            top = (stored_lo + tl.abs(step) * lmax) * tl.where(step < 0, 2.0, 1.0)
            smaller = (step.to(tl.uint32, bitcast=True) - 1).to(tl.float32, bitcast=True)
            step = tl.where(tl.abs(top) == float("inf"), smaller, step)
    return step


@triton.jit
def _saturated_params(lo, hi, BITS: tl.constexpr):
    """A saturated bucket's stored min, step (positive), scale and bounds of its finite values'
    a, from its min and max: maxmin._saturated_params, operation for operation."""
    L: tl.constexpr = (1 << BITS) - 1
    lmax = tl.full(lo.shape, L, tl.float32)
    inf = float("inf")
    top = hi == inf
    bottom = lo == -inf
    m = tl.minimum(lo * 0.5, _TWO_127 - L * _TWO_106)
    if BITS == 1:
        m = tl.maximum(m, -_TWO_126)
    m = tl.where(bottom, -_TWO_127, m)
    s_up = tl.math.div_rn(_TWO_126 - m * 0.5, lmax) * 2.0
    s_down = tl.maximum(tl.math.div_rn(hi * 0.25 + _TWO_126, lmax) * 2.0, _TWO_106)
    s = tl.where(top, s_up, s_down)
    for _ in tl.static_range(_NUDGES):
        end = (m + s * lmax) * 2.0
        bits = s.to(tl.uint32, bitcast=True)  # s > 0: one more, one less are its neighbours
        s_next = tl.where(~top & (tl.abs(end) == inf), (bits - 1).to(tl.float32, bitcast=True), s)
        s = tl.where(top & (tl.abs(end) < inf), (bits + 1).to(tl.float32, bitcast=True), s_next)
    span_q = tl.where(top, _TWO_126, hi * 0.25) - m * 0.5
    scale = tl.where(span_q > 0, _div_toward_zero(lmax * 0.5, span_q), 0.0)
    a_lo = tl.where(bottom, 1.0, 0.0)
    a_hi = tl.where(top, L - 1.0, L * 1.0)
    return m, s, scale, a_lo, a_hi


@triton.jit
def _saturating(lo, hi, finite, BITS: tl.constexpr):
    """Buckets whose sum overflowed (:func:`.maxmin._encode`): no NaN (the min is NaN where
    one is) and an infinite end; at one bit, not both ends."""
    sat = ~finite & (lo == lo)
    if BITS == 1:
        sat = sat & ~((lo == -float("inf")) & (hi == float("inf")))
    return sat


@triton.jit
def _all_finite(v0, v1, valid0, valid1):
    """Per bucket of a tile's halves: whether every value is finite."""
    ok0 = tl.where(valid0, tl.abs(v0) < float("inf"), 1).to(tl.int32)
    ok1 = tl.where(valid1, tl.abs(v1) < float("inf"), 1).to(tl.int32)
    return tl.min(tl.min(tl.minimum(ok0, ok1), axis=2), axis=1) > 0


@triton.jit
def _div_toward_zero(lmax, span):
    """lmax / span for span > 0, rounded toward zero (see :func:`.maxmin.scale_toward_zero`):
    the round-to-nearest quotient, one step less where its exact product with span exceeds
    lmax, whose sign a fused multiply-add gives exactly. Not libdevice's div_rd: Triton builds
    libdevice flushing subnormals, so a subnormal span became 0 and the scale infinite."""
    q = tl.math.div_rn(lmax, span)
    over = (tl.fma(q, span, -lmax) > 0.0).to(tl.uint32)
    return (q.to(tl.uint32, bitcast=True) - over).to(tl.float32, bitcast=True)


@triton.jit
def _levels(v, valid, h, coding, BITS: tl.constexpr, saturation=None):
    """One half's levels (zero outside the data) by ``coding``: :func:`_params`' ``lo_p``,
    ``scale`` and ``pre``, and which buckets are kept (:func:`_quantize_store`). The scale is
    rounded toward zero, so that no level needs a clamp; a non-finite bucket's are garbage,
    zeroed when packed. ``saturation`` (:func:`_saturation`):
    buckets ``sat`` coded saturated, from ``(v / 2 - m) * sat_scale`` held to ``[a_lo,
    a_hi]``, +-Inf at the end levels exactly."""
    L: tl.constexpr = (1 << BITS) - 1
    lo_p, scale, pre, _ = coding
    a = (v * pre[:, None, None] - lo_p[:, None, None]) * scale[:, None, None]
    if saturation is not None:
        sat, m, sat_scale, a_lo, a_hi = saturation
        b = (v * 0.5 - m[:, None, None]) * sat_scale[:, None, None]
        b = tl.minimum(tl.maximum(b, a_lo[:, None, None]), a_hi[:, None, None])
        b = tl.where(v == -float("inf"), 0.0, b)
        b = tl.where(v == float("inf"), L * 1.0, b)
        a = tl.where(sat[:, None, None], b, a)
    return tl.where(valid, _round_level(a, h, BITS) & L, 0)


@triton.jit
def _saturation(lo, hi, sat, stored_lo, step, BITS: tl.constexpr):
    """Buckets ``sat`` of a sum, which overflowed, coded saturated (:func:`_saturated_params`):
    the stored min and step (the other buckets' as given) and the ``saturation`` that
    :func:`_levels` codes them by."""
    m, s, sat_scale, a_lo, a_hi = _saturated_params(lo, hi, BITS)
    stored_lo = tl.where(sat, m, stored_lo)
    step = tl.where(sat, -s, step)
    return stored_lo, step, (sat, m, sat_scale, a_lo, a_hi)


@triton.jit
def _quantize_store(
    ptr,
    tile,
    coding,
    q,
    qmask,
    quant,
    c,
    rng,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    saturation=None,
    NEAREST: tl.constexpr = False,
):
    """Store the levels of ``tile`` (the halves of :func:`_tile` and which of them hold data)
    by ``coding``, ``(lo_p, scale, pre, keep)``, and ``saturation`` (:func:`_levels`), rounded
    by the random stream ``rng`` (``NEAREST``: to the nearest); the levels of buckets not
    ``keep`` are zero."""
    v0, v1, valid0, valid1 = tile
    if NEAREST:  # half of every random half's range: the level rounded to nearest, ties up
        h0 = tl.full((q.shape[0], BLOCK // 8, 4), 1 << 15, tl.uint32)
        h1 = h0
    else:
        h0, h1 = _random_halves(rng, q, c, BLOCK)
    l0 = _levels(v0, valid0, h0, coding, BITS, saturation)
    l1 = _levels(v1, valid1, h1, coding, BITS, saturation)
    # A non-finite bucket's levels are zeroed a group at a time.
    _pack_store(ptr, l0, l1, coding[3], q, qmask, quant, c, BITS, B, BLOCK, FULL)


@triton.jit
def _store_meta(meta_ptr, q, qmask, lo, step):
    tl.store(meta_ptr + 2 * q, lo, mask=qmask)
    tl.store(meta_ptr + 2 * q + 1, step, mask=qmask)


@triton.jit
def _load_tile(x_ptr, q, qmask, quant, c, B: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    """A tile of fp32 values as the halves of :func:`_tile`, and which of them hold data."""
    e, valid0, valid1 = _tile(q, qmask, quant, c, B, BLOCK, FULL)
    v0 = tl.load(x_ptr + e, mask=valid0, other=0.0).to(tl.float32)
    v1 = tl.load(x_ptr + e + 4, mask=valid1, other=0.0).to(tl.float32)
    return v0, v1, valid0, valid1


@triton.jit
def _encode_loaded(
    tile,
    payload,
    q,
    nq,
    quant,
    rng,
    signs,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    NEAREST: tl.constexpr = False,
    ROT: tl.constexpr = 0,
    own_ptr=None,
    HAS_OWN: tl.constexpr = False,
):
    """Encode buckets q (B <= BLOCK) from their loaded values, ``tile`` as :func:`_load_tile`
    returns it, into ``payload``: the pointers to its levels and its (lo, step) pairs
    (``ROT``: the values rotated first, :func:`_rotate_values`).

    Given ``own_ptr``, the values are a sum (rotated already), whose buckets that overflowed
    are coded saturated, unless own's values there (``HAS_OWN``; rotated by ``ROT`` as the
    sum's are) are not all finite: input +-Inf, which stays NaN. A tile with such a bucket
    stores its levels twice, the second time saturated, and loads own's values again: a
    branch before the levels, or own's values kept, cost every tile."""
    v0, v1, valid0, valid1 = tile
    lev_ptr, meta_ptr = payload
    qmask = q < nq
    if own_ptr is None:
        v0, v1 = _rotate_values(v0, v1, q, 0, signs, B, BLOCK, ROT)
    lo, hi = _stats(v0, v1, valid0, valid1)
    stored_lo, step, scale, finite, pre, lo_p = _params(lo, hi, BITS)
    tile = (v0, v1, valid0, valid1)
    coding = (lo_p, scale, pre, finite)
    _quantize_store(
        lev_ptr, tile, coding, q, qmask, quant, 0, rng, BITS, B, BLOCK, FULL, NEAREST=NEAREST
    )
    step = _finite_top(stored_lo, step, hi, BITS)
    if own_ptr is not None:
        sat = _saturating(lo, hi, finite, BITS)
        if tl.max(sat.to(tl.int32), axis=0) > 0:  # the tile's levels once more, saturated
            if HAS_OWN:
                own0, own1, _, _ = _load_tile(own_ptr, q, qmask, quant, 0, B, BLOCK, FULL)
                own0, own1 = _rotate_values(own0, own1, q, 0, signs, B, BLOCK, ROT)
                sat = sat & _all_finite(own0, own1, valid0, valid1)
            stored_lo, step, saturation = _saturation(lo, hi, sat, stored_lo, step, BITS)
            coding = (lo_p, scale, pre, finite | sat)
            _quantize_store(
                lev_ptr, tile, coding, q, qmask, quant, 0, rng, BITS, B, BLOCK, FULL, saturation
            )
    _store_meta(meta_ptr, q, qmask, stored_lo, step)


@triton.jit
def _encode_wide(
    x_ptr,
    payload,
    q,
    nq,
    quant,
    rng,
    signs,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    NEAREST: tl.constexpr = False,
    ROT: tl.constexpr = 0,
):
    """Encode buckets q wider than BLOCK, a tile at a time: statistics, then levels (each tile
    rotated, given ``ROT``, as it is loaded)."""
    lev_ptr, meta_ptr = payload
    qmask = q < nq
    NUM_TILES: tl.constexpr = (B + BLOCK - 1) // BLOCK
    lo, hi = _no_stats(q)
    for t in range(NUM_TILES):
        v0, v1, valid0, valid1 = _load_tile(x_ptr, q, qmask, quant, t * BLOCK, B, BLOCK, FULL)
        v0, v1 = _rotate_values(v0, v1, q, t * BLOCK, signs, B, BLOCK, ROT)
        lo, hi = _add_stats(lo, hi, v0, v1, valid0, valid1)
    lo, step, scale, finite, pre, lo_p = _params(lo, hi, BITS)
    for t in range(NUM_TILES):
        c = t * BLOCK
        v0, v1, valid0, valid1 = _load_tile(x_ptr, q, qmask, quant, c, B, BLOCK, FULL)
        v0, v1 = _rotate_values(v0, v1, q, c, signs, B, BLOCK, ROT)
        tile = (v0, v1, valid0, valid1)
        coding = (lo_p, scale, pre, finite)
        _quantize_store(
            lev_ptr, tile, coding, q, qmask, quant, c, rng, BITS, B, BLOCK, FULL, NEAREST=NEAREST
        )
    _store_meta(meta_ptr, q, qmask, lo, _finite_top(lo, step, hi, BITS))


@triton.jit
def _zero_gaps(
    row_ptr,
    start,
    numel,
    chunk_numel,
    nq,
    quant,
    levels_at,
    BITS: tl.constexpr,
    B: tl.constexpr,
    SKIP_INCOMPLETE: tl.constexpr,
):
    """Zero a payload row's gaps: after the (lo, step) pairs and raw tail up to the levels,
    and after the levels up to the payload's end (each under 16 bytes: layout.ALIGN)."""
    offs = tl.arange(0, 16)
    zeros = tl.zeros([16], dtype=tl.uint8)
    size = tl.minimum(tl.maximum(numel - start, 0), chunk_numel)
    raw = size - quant if SKIP_INCOMPLETE else size * 0
    meta_end = 8 * nq + 4 * raw
    tl.store(row_ptr + meta_end + offs, zeros, mask=meta_end + offs < levels_at)
    stride: tl.constexpr = (B + 7) // 8 * BITS
    last = quant - (nq - 1) * B  # values in the last bucket
    levels_end = levels_at + tl.where(nq > 0, (nq - 1) * stride + (last + 7) // 8 * BITS, 0)
    end = (levels_end + 15) // 16 * 16
    tl.store(row_ptr + levels_end + offs, zeros, mask=levels_end + offs < end)


@triton.jit(
    do_not_specialize=[
        "numel",
        "chunk_numel",
        "k0",
        "k1",
        "stream0",
        "skip_chunk",
        "sign_k0",
        "sign_k1",
    ]
)
def _encode_kernel(
    x_ptr,
    out_u8,
    numel,
    chunk_numel,
    row_nbytes,
    k0,
    k1,
    keys_ptr,
    stream0,
    skip_chunk,
    sign_k0,
    sign_k1,
    signs_ptr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    SKIP_INCOMPLETE: tl.constexpr,
    ALIGN: tl.constexpr,
    KEYS_IN_MEMORY: tl.constexpr,
    BUCKETS: tl.constexpr,
    BLOCK: tl.constexpr,
    ZERO_GAPS: tl.constexpr = False,
    NEAREST: tl.constexpr = False,
    ROT: tl.constexpr = 0,
    SIGNS_IN_MEMORY: tl.constexpr = False,
):
    """Program i encodes tiles i, i + P, ... of chunk program_id(1) (P programs per chunk).
    Buckets that fit a tile are loaded one tile ahead, so that the next tile's loads are in
    flight while this one is coded. ``ZERO_GAPS``: program 0 of each chunk also zeroes the
    alignment gaps before and after the levels (a payload allocated uninitialized: one
    memset launch fewer). ``NEAREST``: levels rounded to the nearest, not stochastically.
    ``ROT``: each chunk's values rotated first (:func:`_rotate_tile`), the signs' key
    ``sign_k0, sign_k1`` or the int64 at ``signs_ptr``; 0 (no rotation, the signs' key None)
    compiles with none of the rotation's code or parameters."""
    j = tl.program_id(1)
    start, nq, quant, levels_at = _geometry(j, numel, chunk_numel, B, SKIP_INCOMPLETE, ALIGN)
    nq = tl.where(j == skip_chunk, 0, nq)
    quant = tl.where(j == skip_chunk, 0, quant)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    row = j.to(tl.int64) * row_nbytes
    if ZERO_GAPS:
        if pid == 0:
            row_ptr = out_u8 + row
            _zero_gaps(
                row_ptr, start, numel, chunk_numel, nq, quant, levels_at, BITS, B, SKIP_INCOMPLETE
            )
    x_ptr += start
    payload = (out_u8 + row + levels_at, _meta_ptr(out_u8 + row))
    key0, key1 = _load_key(k0, k1, keys_ptr, KEYS_IN_MEMORY)
    rng = (stream0 + j, key0, key1)
    signs = _chunk_signs(
        sign_k0, sign_k1, signs_ptr, numel, start, chunk_numel, ROT, SIGNS_IN_MEMORY
    )
    lanes = tl.arange(0, BUCKETS).to(tl.int64)
    tiles = ((nq + BUCKETS - 1) // BUCKETS).to(tl.int32)
    # Tiles of complete buckets come first: given bounds that are multiples of the tile, the
    # masks fold to constants, so that loads and stores vectorize.
    full = (quant // (BUCKETS * B)).to(tl.int32)
    full_nq = full.to(tl.int64) * BUCKETS
    FULL: tl.constexpr = B % BLOCK == 0
    if B <= BLOCK:
        if pid < full:
            q = pid * BUCKETS + lanes
            v0, v1, valid0, valid1 = _load_tile(
                x_ptr, q, q < full_nq, full_nq * B, 0, B, BLOCK, FULL
            )
            for t in range(pid, full, programs):
                q = tl.cast(t, tl.int64) * BUCKETS + lanes
                ahead = tl.minimum(t + programs, full - 1).to(tl.int64) * BUCKETS + lanes
                n0, n1, _, _ = _load_tile(
                    x_ptr, ahead, ahead < full_nq, full_nq * B, 0, B, BLOCK, FULL
                )
                tile = (v0, v1, valid0, valid1)
                _encode_loaded(
                    tile,
                    payload,
                    q,
                    full_nq,
                    full_nq * B,
                    rng,
                    signs,
                    BITS,
                    B,
                    BLOCK,
                    FULL,
                    NEAREST,
                    ROT,
                )
                v0 = n0
                v1 = n1
        if (full < tiles) & (pid == full % programs):
            q = full.to(tl.int64) * BUCKETS + lanes
            tile = _load_tile(x_ptr, q, q < nq, quant, 0, B, BLOCK, False)
            _encode_loaded(
                tile, payload, q, nq, quant, rng, signs, BITS, B, BLOCK, False, NEAREST, ROT
            )
    else:
        for t in range(pid, tiles, programs):
            q = tl.cast(t, tl.int64) * BUCKETS + lanes
            if t < full:
                _encode_wide(
                    x_ptr,
                    payload,
                    q,
                    full_nq,
                    full_nq * B,
                    rng,
                    signs,
                    BITS,
                    B,
                    BLOCK,
                    FULL,
                    NEAREST,
                    ROT,
                )
            else:
                _encode_wide(
                    x_ptr, payload, q, nq, quant, rng, signs, BITS, B, BLOCK, False, NEAREST, ROT
                )


@triton.jit
def _decode_tiles(
    payload,
    out_ptr,
    q,
    nq,
    quant,
    signs,
    BITS: tl.constexpr,
    B: tl.constexpr,
    OUT_BF16: tl.constexpr,
    FULL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROT: tl.constexpr = 0,
):
    """Decode buckets q of ``payload`` (the pointers to its levels and its (lo, step) pairs), a
    tile at a time (``ROT``: each rotated back by ``signs`` before it is cast)."""
    lev_ptr, meta_ptr = payload
    qmask = q < nq
    lo = tl.load(meta_ptr + 2 * q, mask=qmask, other=0.0)[:, None, None]
    signed_step = tl.load(meta_ptr + 2 * q + 1, mask=qmask, other=0.0)[:, None, None]
    step = tl.abs(signed_step)
    post = tl.where(signed_step < 0, 2.0, 1.0)  # a half-scale bucket
    NUM_TILES: tl.constexpr = (B + BLOCK - 1) // BLOCK
    for t in tl.static_range(NUM_TILES):
        c = t * BLOCK
        fields = _load_fields(lev_ptr, q, qmask, quant, c, BITS, B, BLOCK, FULL, False)
        l0, l1 = _unpack(fields, BITS)
        e, valid0, valid1 = _tile(q, qmask, quant, c, B, BLOCK, FULL)
        v0 = (lo + step * l0) * post
        v1 = (lo + step * l1) * post
        if ROT > 0:
            v0, v1 = _rotate_tile(v0, v1, q, c, signs, B, BLOCK, ROT, True, B % 8 == 0, True)
        if OUT_BF16:
            v0 = _to_bf16(v0)
            v1 = _to_bf16(v1)
        v0 = v0.to(out_ptr.dtype.element_ty)
        v1 = v1.to(out_ptr.dtype.element_ty)
        if FULL:
            tl.store(out_ptr + e, v0)
            tl.store(out_ptr + e + 4, v1)
        else:
            tl.store(out_ptr + e, v0, mask=valid0)
            tl.store(out_ptr + e + 4, v1, mask=valid1)


@triton.jit(do_not_specialize=["numel", "chunk_numel", "sign_k0", "sign_k1"])
def _decode_kernel(
    in_u8,
    out_ptr,
    numel,
    chunk_numel,
    row_nbytes,
    sign_k0,
    sign_k1,
    signs_ptr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    SKIP_INCOMPLETE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ALIGN: tl.constexpr,
    BUCKETS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROT: tl.constexpr = 0,
    SIGNS_IN_MEMORY: tl.constexpr = False,
):
    """Program (i, j) decodes tile i of chunk j (``ROT``: and rotates it back, the signs' key
    as :func:`_encode_kernel` takes it)."""
    j = tl.program_id(1)
    start, nq, quant, levels_at = _geometry(j, numel, chunk_numel, B, SKIP_INCOMPLETE, ALIGN)
    q = tl.program_id(0).to(tl.int64) * BUCKETS + tl.arange(0, BUCKETS)
    row = j.to(tl.int64) * row_nbytes
    payload = (in_u8 + row + levels_at, _meta_ptr(in_u8 + row))
    end = (tl.program_id(0).to(tl.int64) + 1) * BUCKETS
    signs = _chunk_signs(
        sign_k0, sign_k1, signs_ptr, numel, start, chunk_numel, ROT, SIGNS_IN_MEMORY
    )
    if end * B <= quant:
        # Every value of the tile exists: stores with no mask (and a start known to be
        # aligned) vectorize to 16 bytes; a mask, even a provably full one, keeps them scalar.
        out = out_ptr + start
        _decode_tiles(
            payload, out, q, end, end * B, signs, BITS, B, OUT_BF16, B % BLOCK == 0, BLOCK, ROT
        )
    else:
        out = out_ptr + start
        _decode_tiles(payload, out, q, nq, quant, signs, BITS, B, OUT_BF16, False, BLOCK, ROT)


@triton.jit
def _load_rows(
    src,
    q,
    qmask,
    quant,
    c,
    NUM_ROWS: tl.constexpr,
    SKIP_OWN: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
):
    """The packed fields of a tile and its buckets' lo and step in each row but own's, as
    tuples in row order (``src`` as :func:`_decode_sum_encode_kernel` gathers it)."""
    in_u8, row_nbytes, own_index, levels_at, _, _ = src
    fields = ()
    los = ()
    steps = ()
    for r in tl.static_range(NUM_ROWS - SKIP_OWN):
        # The r-th row other than own_index, by arithmetic: no branch stands between the rows'
        # loads, so that they are all in flight together.
        w = r + (r >= own_index).to(tl.int64) if SKIP_OWN else r
        row = row_nbytes.to(tl.int64) * w
        meta = _meta_ptr(in_u8 + row) + 2 * q
        # Triton builds tuples by concatenation, not unpacking.
        los = los + (tl.load(meta, mask=qmask, other=0.0),)  # noqa: RUF005
        steps = steps + (tl.load(meta + 1, mask=qmask, other=0.0),)  # noqa: RUF005
        lev = in_u8 + row + levels_at
        field = _load_fields(lev, q, qmask, quant, c, BITS, B, BLOCK, FULL)
        fields = fields + (field,)  # noqa: RUF005
    return fields, los, steps


@triton.jit
def _load_sum_inputs(
    src,
    q,
    qmask,
    quant,
    c,
    SUM: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
):
    """All that a tile's sum reads: own's values (as the halves of :func:`_tile`, zeros
    without own) and the other rows' (:func:`_load_rows`)."""
    own_ptr = src[4]
    if SUM[2]:  # HAS_OWN
        own0, own1, _, _ = _load_tile(own_ptr, q, qmask, quant, c, B, BLOCK, FULL)
    else:
        own0 = tl.zeros((q.shape[0], BLOCK // 8, 4), tl.float32)
        own1 = tl.zeros((q.shape[0], BLOCK // 8, 4), tl.float32)
    fields, los, steps = _load_rows(src, q, qmask, quant, c, SUM[0], SUM[1], BITS, B, BLOCK, FULL)
    return own0, own1, fields, los, steps


@triton.jit
def _sum_loaded(
    inputs,
    scale,
    q,
    c,
    signs,
    SUM: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    ROT: tl.constexpr = 0,
):
    """own + the rows decoded (``inputs``, :func:`_load_sum_inputs`), summed in row order, in
    fp32; with a scale, own and each row's values times it (folded into its buckets' post:
    :func:`.maxmin._scaled_sum`). ``ROT``: own's values (tile ``q, c``) rotated first, as the
    rows' are."""
    own0, own1, fields, los, steps = inputs
    HAS_SCALE: tl.constexpr = SUM[3]
    acc0, acc1 = _rotate_values(own0, own1, q, c, signs, B, BLOCK, ROT)
    if HAS_SCALE:
        acc0 = acc0 * scale
        acc1 = acc1 * scale
    for r in tl.static_range(SUM[0] - SUM[1]):
        l0, l1 = _unpack(fields[r], BITS)
        lo = los[r][:, None, None]
        step = tl.abs(steps[r])[:, None, None]
        post = tl.where(steps[r] < 0, 2.0, 1.0)  # a half-scale bucket
        if HAS_SCALE:
            post = post * scale
        post = post[:, None, None]
        acc0 = acc0 + (lo + step * l0) * post
        acc1 = acc1 + (lo + step * l1) * post
    return acc0, acc1


@triton.jit
def _sum_tile(
    src,
    q,
    qmask,
    quant,
    c,
    signs,
    ROT: tl.constexpr,
    SUM: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
):
    """A tile of the sum, as :func:`_load_tile` returns a tile: its values
    (:func:`_sum_loaded`, own's rotated by ``signs`` and ``ROT``) and which of them hold
    data."""
    inputs = _load_sum_inputs(src, q, qmask, quant, c, SUM, BITS, B, BLOCK, FULL)
    v0, v1 = _sum_loaded(inputs, src[5], q, c, signs, SUM, BITS, B, BLOCK, ROT)
    _, valid0, valid1 = _tile(q, qmask, quant, c, B, BLOCK, FULL)
    return v0, v1, valid0, valid1


@triton.jit
def _decode_sum_encode_wide(
    src,
    payload,
    q,
    nq,
    quant,
    rng,
    signs,
    SUM: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
    FULL: tl.constexpr,
    ROT: tl.constexpr = 0,
):
    """Buckets q wider than BLOCK, a tile at a time: the sums for the statistics, then again
    for the levels (``ROT``: own's values rotated, each time they are loaded), saturated as
    :func:`_encode_loaded` codes a sum."""
    lev_ptr, meta_ptr = payload
    qmask = q < nq
    NUM_TILES: tl.constexpr = (B + BLOCK - 1) // BLOCK
    lo, hi = _no_stats(q)
    for t in range(NUM_TILES):
        v0, v1, valid0, valid1 = _sum_tile(
            src, q, qmask, quant, t * BLOCK, signs, ROT, SUM, BITS, B, BLOCK, FULL
        )
        lo, hi = _add_stats(lo, hi, v0, v1, valid0, valid1)
    stored_lo, step, scale, finite, pre, lo_p = _params(lo, hi, BITS)
    step = _finite_top(stored_lo, step, hi, BITS)
    sat = _saturating(lo, hi, finite, BITS)
    if tl.max(sat.to(tl.int32), axis=0) > 0:  # as _encode_loaded, a tile at a time
        if SUM[2]:  # HAS_OWN
            for t in range(NUM_TILES):
                c = t * BLOCK
                own0, own1, valid0, valid1 = _load_tile(src[4], q, qmask, quant, c, B, BLOCK, FULL)
                own0, own1 = _rotate_values(own0, own1, q, c, signs, B, BLOCK, ROT)
                sat = sat & _all_finite(own0, own1, valid0, valid1)
        stored_lo, step, saturation = _saturation(lo, hi, sat, stored_lo, step, BITS)
        for t in range(NUM_TILES):
            c = t * BLOCK
            tile = _sum_tile(src, q, qmask, quant, c, signs, ROT, SUM, BITS, B, BLOCK, FULL)
            coding = (lo_p, scale, pre, finite | sat)
            _quantize_store(
                lev_ptr, tile, coding, q, qmask, quant, c, rng, BITS, B, BLOCK, FULL, saturation
            )
    else:
        for t in range(NUM_TILES):
            c = t * BLOCK
            tile = _sum_tile(src, q, qmask, quant, c, signs, ROT, SUM, BITS, B, BLOCK, FULL)
            coding = (lo_p, scale, pre, finite)
            _quantize_store(lev_ptr, tile, coding, q, qmask, quant, c, rng, BITS, B, BLOCK, FULL)
    _store_meta(meta_ptr, q, qmask, stored_lo, step)


@triton.jit(do_not_specialize=["numel", "own_index", "k0", "k1", "stream", "sign_k0", "sign_k1"])
def _decode_sum_encode_kernel(
    in_u8,
    own_ptr,
    out_u8,
    numel,
    row_nbytes,
    own_index,
    scale,
    k0,
    k1,
    keys_ptr,
    stream,
    sign_k0,
    sign_k1,
    signs_ptr,
    NUM_ROWS: tl.constexpr,
    SKIP_OWN: tl.constexpr,
    BITS: tl.constexpr,
    B: tl.constexpr,
    SKIP_INCOMPLETE: tl.constexpr,
    HAS_OWN: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    KEYS_IN_MEMORY: tl.constexpr,
    BUCKETS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROT: tl.constexpr = 0,
    SIGNS_IN_MEMORY: tl.constexpr = False,
):
    """Program i sums and encodes tiles i, i + P, ... (P programs); as in
    :func:`_encode_kernel`, the next tile's inputs load while this one is coded. ``ROT``:
    own's values rotated (the rows' are), the signs' key as :func:`_encode_kernel` takes
    it; the sum is coded as it is, in the rotated domain. What the sum reads is ``src``,
    ``(in_u8, row_nbytes, own_index, levels_at, own_ptr, scale)``, and its shape ``SUM``,
    ``(NUM_ROWS, SKIP_OWN, HAS_OWN, HAS_SCALE)``."""
    _start, nq, quant, levels_at = _geometry(tl.program_id(1), numel, numel, B, SKIP_INCOMPLETE, 1)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    payload = (out_u8 + levels_at, _meta_ptr(out_u8))
    key0, key1 = _load_key(k0, k1, keys_ptr, KEYS_IN_MEMORY)
    rng = (stream, key0, key1)
    OWN_ROT: tl.constexpr = ROT * HAS_OWN
    signs = None
    if OWN_ROT > 0:  # the payload's last whole block ends there
        sk0, sk1 = _load_key(sign_k0, sign_k1, signs_ptr, SIGNS_IN_MEMORY)
        signs = (sk0, sk1, 0, numel // ROT * ROT)
    lanes = tl.arange(0, BUCKETS).to(tl.int64)
    tiles = ((nq + BUCKETS - 1) // BUCKETS).to(tl.int32)
    full = (quant // (BUCKETS * B)).to(tl.int32)  # tiles of complete buckets, first
    full_nq = full.to(tl.int64) * BUCKETS
    FULL: tl.constexpr = B % BLOCK == 0
    src = (in_u8, row_nbytes, own_index, levels_at, own_ptr, scale)
    SUM: tl.constexpr = (NUM_ROWS, SKIP_OWN, HAS_OWN, HAS_SCALE)
    if B <= BLOCK:
        if pid < full:
            q = pid * BUCKETS + lanes
            inputs = _load_sum_inputs(
                src, q, q < full_nq, full_nq * B, 0, SUM, BITS, B, BLOCK, FULL
            )
            for t in range(pid, full, programs):
                q = tl.cast(t, tl.int64) * BUCKETS + lanes
                ahead = tl.minimum(t + programs, full - 1).to(tl.int64) * BUCKETS + lanes
                ahead_inputs = _load_sum_inputs(
                    src, ahead, ahead < full_nq, full_nq * B, 0, SUM, BITS, B, BLOCK, FULL
                )
                v0, v1 = _sum_loaded(inputs, scale, q, 0, signs, SUM, BITS, B, BLOCK, OWN_ROT)
                _, valid0, valid1 = _tile(q, q < full_nq, full_nq * B, 0, B, BLOCK, FULL)
                tile = (v0, v1, valid0, valid1)
                _encode_loaded(
                    tile,
                    payload,
                    q,
                    full_nq,
                    full_nq * B,
                    rng,
                    signs,
                    BITS,
                    B,
                    BLOCK,
                    FULL,
                    False,
                    OWN_ROT,
                    own_ptr,
                    HAS_OWN,
                )
                inputs = ahead_inputs
        if (full < tiles) & (pid == full % programs):
            q = full.to(tl.int64) * BUCKETS + lanes
            tile = _sum_tile(src, q, q < nq, quant, 0, signs, OWN_ROT, SUM, BITS, B, BLOCK, False)
            _encode_loaded(
                tile,
                payload,
                q,
                nq,
                quant,
                rng,
                signs,
                BITS,
                B,
                BLOCK,
                False,
                False,
                OWN_ROT,
                own_ptr,
                HAS_OWN,
            )
    else:
        for t in range(pid, tiles, programs):
            q = tl.cast(t, tl.int64) * BUCKETS + lanes
            if t < full:
                _decode_sum_encode_wide(
                    src,
                    payload,
                    q,
                    full_nq,
                    full_nq * B,
                    rng,
                    signs,
                    SUM,
                    BITS,
                    B,
                    BLOCK,
                    FULL,
                    OWN_ROT,
                )
            else:
                _decode_sum_encode_wide(
                    src, payload, q, nq, quant, rng, signs, SUM, BITS, B, BLOCK, False, OWN_ROT
                )


@triton.jit(do_not_specialize=["n", "base", "rot_end", "sign_k0", "sign_k1"])
def _rotate_kernel(
    x_ptr,
    out_ptr,
    n,
    base,
    rot_end,
    sign_k0,
    sign_k1,
    signs_ptr,
    ROT: tl.constexpr,
    INVERSE: tl.constexpr,
    SIGNS_IN_MEMORY: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The rotation (or with ``INVERSE`` its inverse) of ``n`` values (any float dtype) into
    fp32 ``out_ptr`` (which may be ``x_ptr``): values ``base``.. of a payload whose last whole
    block ends at ``rot_end`` (``base`` a multiple of ``ROT``; ``GROUPED``: of 16 too). For
    what the coding kernels do not fuse: own's values in the unfused sum, the sum rotated
    back, raw tails."""
    q = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    e, valid0, valid1 = _tile(q, q >= 0, n, 0, BLOCK, BLOCK, False)
    v0 = tl.load(x_ptr + e, mask=valid0, other=0.0).to(tl.float32)
    v1 = tl.load(x_ptr + e + 4, mask=valid1, other=0.0).to(tl.float32)
    sk0, sk1 = _load_key(sign_k0, sign_k1, signs_ptr, SIGNS_IN_MEMORY)
    signs = (sk0, sk1, base, rot_end)
    v0, v1 = _rotate_tile(v0, v1, q, 0, signs, BLOCK, BLOCK, ROT, INVERSE, GROUPED, True)
    tl.store(out_ptr + e, v0, mask=valid0)
    tl.store(out_ptr + e + 4, v1, mask=valid1)


# --------------------------------------------------------------------------- launchers

_launch_encode = Launcher(_encode_kernel)
_launch_decode = Launcher(_decode_kernel)
_launch_decode_sum_encode = Launcher(_decode_sum_encode_kernel)
_launch_rotate = Launcher(_rotate_kernel)
# Values a program of the standalone rotation takes (at least a block).
_ROTATE_BLOCK = 1024


def _launch(
    kernel: str, bucket_size: int, dtype: torch.dtype, rotation: Rotation | None = None
) -> dict[str, object]:
    """``kernel``'s launch for values of ``dtype``: its tile (``BUCKETS`` buckets of ``BLOCK``
    values each), warps and compile options; a rotation's blocks fit a tile whole."""
    tile, warps = _SHAPE[kernel, min(dtype.itemsize, 4)] if rotation is None else _ROTATED_SHAPE
    # Plain arithmetic: triton.next_power_of_2 and triton.cdiv are @jit functions, whose calls
    # from Python take microseconds each.
    block = min(max(1 << (bucket_size - 1).bit_length(), 8), _MAX_BLOCK)
    if rotation is not None:
        block = max(block, rotation.block)
    return {"BUCKETS": max(1, tile // block), "BLOCK": block, "num_warps": warps, **_LAUNCH}


def _programs(tiles: int) -> int:
    """Programs for a kernel that walks its tiles in grid strides."""
    return min(tiles, max(_MIN_PROGRAMS, -(-tiles // _TILES_PER_PROGRAM)))


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _resident_programs(tiles: int, device: torch.device, rotated: bool = False) -> int:
    """Programs for decode-sum-encode: ``_DSE_PROGRAMS_PER_SM`` (rotated:
    ``_DSE_ROTATED_PROGRAMS_PER_SM``) on each multiprocessor of a GPU (:func:`_programs`
    elsewhere, as under the interpreter)."""
    if device.type != "cuda":
        return _programs(tiles)
    per_sm = _DSE_ROTATED_PROGRAMS_PER_SM if rotated else _DSE_PROGRAMS_PER_SM
    return min(tiles, per_sm * _multiprocessors(device.index))


def _key(key: int) -> tuple[int, int]:
    """The key's 32-bit halves, each with bit 32 set: Triton types a Python int argument by
    its value (i32 below 2**31, i64 above), so random halves would select among four
    compiled variants per kernel, the first launch of each loading it (milliseconds). The
    kernels keep the low 32 bits."""
    return (key & 0xFFFFFFFF) | 1 << 32, (key >> 32) & 0xFFFFFFFF | 1 << 32


def _key_args(key: int | torch.Tensor, other: torch.Tensor) -> tuple[int, int, torch.Tensor, bool]:
    """``(k0, k1, keys_ptr, KEYS_IN_MEMORY)`` for ``key``: a Python int, passed by value, or an
    int64 tensor on the device holding it, read by the kernel (what a CUDA graph replays with
    fresh keys); ``other``, any tensor of the launch, stands in for the unused pointer."""
    if isinstance(key, torch.Tensor):
        if key.dtype != torch.int64 or key.numel() != 1 or key.device != other.device:
            raise ValueError("a key tensor must hold one int64 on the data's device")
        return 1 << 32, 1 << 32, key, True
    k0, k1 = _key(key)
    return k0, k1, other, False


def _sign_args(rotation: Rotation, other: torch.Tensor) -> tuple[int, int, torch.Tensor, bool]:
    """The signs' key as :func:`_key_args` passes a key: ``(sign_k0, sign_k1, signs_ptr,
    SIGNS_IN_MEMORY)``."""
    if isinstance(rotation.key, torch.Tensor):
        return _key_args(rotation.key, other)
    k0, k1 = _key(rotation.key & 0xFFFFFFFFFFFFFFFF)
    return k0, k1, other, False


# The coding kernels' signs' key where they do not rotate: None, which Triton builds as a
# constant, so that the unrotated build takes no parameter for it.
_NO_SIGNS = (None, None, None)


def _rotation_args(rotation: Rotation | None, other: torch.Tensor) -> tuple[tuple, dict]:
    """A coding kernel's rotation: the signs' key ``(sign_k0, sign_k1, signs_ptr)`` and the
    constexprs ``ROT`` and ``SIGNS_IN_MEMORY`` (none without a rotation: their defaults)."""
    if rotation is None:
        return _NO_SIGNS, {}
    sk0, sk1, signs, in_memory = _sign_args(rotation, other)
    return (sk0, sk1, signs), {"ROT": rotation.block, "SIGNS_IN_MEMORY": in_memory}


def _rotated(
    x: torch.Tensor,
    rotation: Rotation,
    payload_numel: int,
    base: int = 0,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat ``x`` (any float dtype), values ``base``.. of a payload of ``payload_numel``, rotated
    (or with ``inverse`` rotated back) into fp32 ``out`` (new, or given: it may be ``x``):
    :mod:`.rotation`'s values, NaN as 0x7FC00000. ``base`` is a multiple of the block."""
    n = x.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    block = max(_ROTATE_BLOCK, rotation.block)
    k0, k1, signs, in_memory = _sign_args(rotation, x)
    _launch_rotate(
        (-(-n // block),),
        x,
        out,
        n,
        base,
        payload_numel // rotation.block * rotation.block,
        k0,
        k1,
        signs,
        ROT=rotation.block,
        INVERSE=inverse,
        SIGNS_IN_MEMORY=in_memory,
        GROUPED=base % 16 == 0,
        BLOCK=block,
        num_warps=4,
        **_LAUNCH,
    )
    return out


def _raw_region(row: torch.Tensor, layout: MaxMinLayout) -> torch.Tensor:
    """The fp32 raw tail of one payload row (empty unless skip_incomplete leaves one)."""
    start = layout.raw_offset // 4
    return row.view(torch.float32)[start : start + layout.raw_numel]


def _row_pitch(rows: torch.Tensor) -> int:
    """Bytes from one payload row to the next: the rows may be a view with a longer pitch (a
    column of a ``[W, K, P]`` buffer, as the reference takes them), each row contiguous."""
    if rows.stride(1) != 1:
        raise ValueError(f"payload rows must be contiguous, got strides {rows.stride()}")
    return rows.stride(0)


def _encode_call(
    flat: torch.Tensor,
    rows: torch.Tensor,
    layout: ChunkedLayout,
    key: int | torch.Tensor,
    stream0: int,
    skip_chunk: int,
    zero_gaps: bool,
    nearest: bool = False,
    rotation: Rotation | None = None,
) -> tuple[tuple[int, int], tuple, dict]:
    """The encode kernel's grid, positional arguments and constexprs."""
    launch = _launch("encode", layout.bucket_size, flat.dtype, rotation)
    max_nq = -(-layout.chunk_numel // layout.bucket_size)
    grid = (_programs(-(-max_nq // launch["BUCKETS"])), layout.num_chunks)
    k0, k1, keys, in_memory = _key_args(key, rows)
    signs, rotating = _rotation_args(rotation, rows)
    args = (
        flat,
        rows,
        layout.numel,
        layout.chunk_numel,
        _row_pitch(rows),
        k0,
        k1,
        keys,
        stream0,
        skip_chunk,
        *signs,
    )
    constexprs = dict(
        BITS=layout.bits,
        B=layout.bucket_size,
        SKIP_INCOMPLETE=layout.skip_incomplete,
        ALIGN=math.gcd(layout.chunk_numel, 16),
        KEYS_IN_MEMORY=in_memory,
        ZERO_GAPS=zero_gaps,
        **launch,
        **rotating,
    )
    if nearest:  # absent otherwise: the variants compiled so far stay the ones launched
        constexprs["NEAREST"] = True
    return grid, args, constexprs


def encode_chunks(
    x: torch.Tensor,
    layout: ChunkedLayout,
    key: int | torch.Tensor,
    skip_chunk: int = -1,
    stream0: int = 0,
    out: torch.Tensor | None = None,
    nearest: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Encode each chunk j of flat ``x`` into row j of ``[K, P]`` with stream ``stream0 + j``
    (``nearest``: rounded to the nearest level, as :func:`cgx2.codecs.maxmin.encode`);
    row ``skip_chunk`` is left zero. Given ``out`` (uint8 ``[K, P]``, for the collectives,
    which then need no memset), the rows are written there; row ``skip_chunk`` and the
    padding between a row's regions, which no decoder reads, are not touched. ``key`` may be
    a one-element int64 tensor on the device that holds it (:func:`_key_args`).
    ``rotation``: each chunk's values rotated first, in the kernel (:mod:`.rotation`)."""
    if rotation is not None and rotation.clipped:  # no kernel yet: the reference's bytes
        return maxmin.encode_chunks(x, layout, 0, skip_chunk, out, rotation=rotation)
    if rotation is not None:
        rotation.check(layout.bucket_size)
    flat = x if x.dim() == 1 else x.reshape(-1)  # reshape costs host time even then
    # One row whose every byte the kernel writes (gaps too): no memset first.
    zero_gaps = out is None and layout.num_chunks == 1
    if out is not None:
        rows = out
    elif zero_gaps:
        rows = x.new_empty((1, layout.payload_nbytes), dtype=torch.uint8)
    else:
        rows = x.new_zeros((layout.num_chunks, layout.payload_nbytes), dtype=torch.uint8)
    if rows.numel() == 0:
        return rows
    grid, args, constexprs = _encode_call(
        flat, rows, layout, key, stream0, skip_chunk, zero_gaps, nearest, rotation
    )
    _launch_encode(grid, *args, **constexprs)
    for j in range(layout.num_chunks if layout.skip_incomplete else 0):
        chunk = layout.chunk(j)
        if chunk.raw_numel and j != skip_chunk:
            quant = chunk.num_buckets * layout.bucket_size
            tail = layout.chunk_start(j) + quant
            raw = flat[tail : tail + chunk.raw_numel]
            if rotation is not None:  # the raw values are rotated ones too
                raw = _rotated(raw, rotation, chunk.numel, quant)
            _raw_region(rows[j], chunk).copy_(raw)
    return rows


def _decode_call(
    payloads: torch.Tensor,
    out: torch.Tensor,
    layout: ChunkedLayout,
    dtype: torch.dtype,
    rotation: Rotation | None = None,
) -> tuple[tuple[int, int], tuple, dict]:
    """The decode kernel's grid, positional arguments and constexprs."""
    launch = _launch("decode", layout.bucket_size, dtype, rotation)
    max_nq = -(-layout.chunk_numel // layout.bucket_size)
    grid = (-(-max_nq // launch["BUCKETS"]), layout.num_chunks)
    signs, rotating = _rotation_args(rotation, payloads)
    args = (payloads, out, layout.numel, layout.chunk_numel, _row_pitch(payloads), *signs)
    constexprs = dict(
        BITS=layout.bits,
        B=layout.bucket_size,
        SKIP_INCOMPLETE=layout.skip_incomplete,
        OUT_BF16=dtype == torch.bfloat16,
        ALIGN=math.gcd(layout.chunk_numel, 16),
        **launch,
        **rotating,
    )
    return grid, args, constexprs


def decode_chunks(
    payloads: torch.Tensor,
    layout: ChunkedLayout,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_chunks`: the flat tensor of ``layout.numel`` values (written
    into ``out``, a contiguous tensor of that size and ``dtype``, when given); ``rotation``:
    each chunk rotated back in the kernel, before the cast to ``dtype``."""
    if rotation is not None:
        rotation.check(layout.bucket_size)
    if out is None:
        out = payloads.new_empty(layout.numel, dtype=dtype)
    if layout.numel == 0:
        return out
    grid, args, constexprs = _decode_call(payloads, out, layout, dtype, rotation)
    _launch_decode(grid, *args, **constexprs)
    for j in range(layout.num_chunks if layout.skip_incomplete else 0):
        chunk = layout.chunk(j)
        if chunk.raw_numel:
            quant = chunk.num_buckets * layout.bucket_size
            tail = layout.chunk_start(j) + quant
            raw = _raw_region(payloads[j], chunk)
            if rotation is not None:
                raw = _rotated(raw, rotation, chunk.numel, quant, inverse=True)
            out[tail : tail + chunk.raw_numel] = maxmin._cast(raw, dtype)
    return out


def _bound_variant(
    bound: dict[tuple, tuple], shape: tuple, tensor: torch.Tensor, device: int, launcher: Launcher
) -> tuple | None:
    """What ``bound`` holds for ``shape``, where its variant may launch ``tensor``: contiguous,
    16-byte aligned, on the current device, with launches direct."""
    found = bound.get(shape)
    if (
        found is not None
        and tensor.is_contiguous()
        and tensor.data_ptr() % 16 == 0
        and device == torch._C._cuda_getDevice()
        and launcher.direct()
    ):
        return found
    return None


def _bound_signs(rotation: Rotation | None, other: torch.Tensor, address: int) -> tuple:
    """The signs' key as a bound variant takes it (:func:`_rotation_args`'s, by value): the
    address of ``other`` stands in for the unused pointer. The callers pass its three values
    one by one: a starred argument would make each bound launch a slower call (issue 43)."""
    if rotation is None:
        return _NO_SIGNS
    return (*_sign_args(rotation, other)[:2], address)


def encode(
    x: torch.Tensor,
    bits: int,
    bucket_size: int,
    key: int,
    stream: int = 0,
    skip_incomplete: bool = False,
    out: torch.Tensor | None = None,
    nearest: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.maxmin.encode`."""
    if rotation is not None and rotation.clipped:  # no kernel yet: the reference's bytes
        return maxmin.encode(
            x, bits, bucket_size, 0, stream, skip_incomplete, out, nearest, rotation=rotation
        )
    fast = out is None and not skip_incomplete and type(key) is int and x.is_cuda and not nearest
    block = None
    if rotation is not None:
        fast = fast and type(rotation.key) is int
        block = rotation.block
    if fast:  # the public op's case: once launched, the same variant again with no dispatch
        device = x.get_device()
        shape = (x.numel(), x.dtype, bits, bucket_size, device, block)
        found = _bound_variant(_BOUND_ENCODE, shape, x, device, _launch_encode)
        if found is not None:
            bound, n, nbytes = found
            payload = x.new_empty(nbytes, dtype=torch.uint8)
            k0, k1 = _key(key)
            address = payload.data_ptr()
            sk0, sk1, signs = _bound_signs(rotation, payload, address)
            cuda_stream = torch._C._cuda_getCurrentRawStream(device)
            bound.run(
                cuda_stream,
                x.data_ptr(),
                address,
                n,
                n,
                nbytes,
                k0,
                k1,
                address,
                stream,
                -1,
                sk0,
                sk1,
                signs,
            )
            return payload
    n = x.numel()
    layout = ChunkedLayout.split(n, 1, bits, bucket_size, skip_incomplete)
    rows = encode_chunks(x, layout, key, stream0=stream, nearest=nearest, rotation=rotation)
    payload = rows.view(-1)
    if fast and n and x.is_contiguous() and x.data_ptr() % 16 == 0:
        flat = x.reshape(-1)
        grid, args, constexprs = _encode_call(
            flat, rows, layout, key, stream, -1, True, rotation=rotation
        )
        bound = _launch_encode.bound(grid, *args, **constexprs)
        if bound is not None:
            shape = (n, x.dtype, bits, bucket_size, x.get_device(), block)
            _BOUND_ENCODE[shape] = (bound, n, layout.payload_nbytes)
    if out is None:
        return payload
    out[: payload.numel()] = payload
    return out


# The one-payload encode and decode of each shape, bound to their compiled kernel variant:
# the public ops' calls, whose host time is mostly launching (BENCHMARKS.md, "Host time").
# Keyed by the values' count, dtype, bits, bucket size, device and rotation's block (None).
_BOUND_ENCODE: dict[tuple, tuple] = {}
_BOUND_DECODE: dict[tuple, tuple] = {}


def decode(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    bucket_size: int,
    dtype: torch.dtype = torch.float32,
    skip_incomplete: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.maxmin.decode`; bound as :func:`encode` is."""
    fast = not skip_incomplete and payload.is_cuda
    block = None
    if rotation is not None:
        fast = fast and type(rotation.key) is int
        block = rotation.block
    if fast:
        device = payload.get_device()
        shape = (numel, dtype, bits, bucket_size, device, block)
        found = _bound_variant(_BOUND_DECODE, shape, payload, device, _launch_decode)
        if found is not None:
            bound, nbytes = found
            out = payload.new_empty(numel, dtype=dtype)
            address = payload.data_ptr()
            sk0, sk1, signs = _bound_signs(rotation, payload, address)
            cuda_stream = torch._C._cuda_getCurrentRawStream(device)
            bound.run(cuda_stream, address, out.data_ptr(), numel, numel, nbytes, sk0, sk1, signs)
            return out
    layout = ChunkedLayout.split(numel, 1, bits, bucket_size, skip_incomplete)
    nbytes = layout.payload_nbytes
    rows = payload[:nbytes].view(1, nbytes)
    out = decode_chunks(rows, layout, dtype, rotation=rotation)
    if fast and numel and payload.is_contiguous() and payload.data_ptr() % 16 == 0:
        grid, args, constexprs = _decode_call(rows, out, layout, dtype, rotation)
        bound = _launch_decode.bound(grid, *args, **constexprs)
        if bound is not None:
            shape = (numel, dtype, bits, bucket_size, payload.get_device(), block)
            _BOUND_DECODE[shape] = (bound, nbytes)
    return out


def decode_sum(
    payloads: torch.Tensor,
    numel: int,
    own: torch.Tensor | None,
    own_index: int,
    scale: float | None,
    bits: int,
    bucket_size: int,
    skip_incomplete: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Same contract (and bits) as :func:`cgx2.codecs.maxmin.decode_sum`: each row decoded by
    the kernel, the fp32 sum taken in the same row order by torch. ``rotation``: own's values
    rotated first (as the rows' are), the sum rotated back."""
    if rotation is not None:
        rotation.check(bucket_size)
        if own is not None:
            own = _rotated(own.reshape(-1), rotation, numel)
    acc = maxmin.sum_rows(
        payloads,
        numel,
        own,
        own_index,
        scale,
        lambda out, base, row: torch.add(
            base, decode(row, numel, bits, bucket_size, torch.float32, skip_incomplete), out=out
        ),
    )
    if rotation is None:
        return acc
    return _rotated(acc, rotation, numel, inverse=True, out=acc)


def decode_sum_encode(
    payloads: torch.Tensor,
    numel: int,
    own: torch.Tensor | None,
    own_index: int,
    scale: float | None,
    bits: int,
    bucket_size: int,
    key: int | torch.Tensor,
    stream: int = 0,
    skip_incomplete: bool = False,
    out: torch.Tensor | None = None,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Same contract as :func:`cgx2.codecs.maxmin.decode_sum_encode`, fused: the fp32 sum
    never leaves the chip. ``key`` may be a tensor, as in :func:`encode_chunks`.
    ``rotation``: own's values rotated in the kernel, as the rows' are; the sum is coded as
    it is (in the rotated domain: the final decode rotates back)."""
    if rotation is not None and rotation.clipped:  # no kernel yet: the reference's bytes
        return maxmin.decode_sum_encode(
            payloads,
            numel,
            own,
            own_index,
            scale,
            bits,
            bucket_size,
            0,
            stream,
            skip_incomplete,
            out,
            rotation=rotation,
        )
    if rotation is not None:
        rotation.check(bucket_size)
        if own is None:  # nothing to rotate: the rows are, and the sum stays so
            rotation = None
    layout = MaxMinLayout.of(numel, bits, bucket_size, skip_incomplete)
    if out is None:
        out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=payloads.device)
    if numel == 0:
        return out
    own_flat = payloads if own is None else own if own.dim() == 1 else own.reshape(-1)
    launch = _launch(
        "decode_sum_encode",
        bucket_size,
        own_flat.dtype if own is not None else torch.float32,
        rotation,
    )
    tiles = -(-layout.num_buckets // launch["BUCKETS"])
    grid = (_resident_programs(tiles, out.device, rotation is not None), 1)
    k0, k1, keys, in_memory = _key_args(key, out)
    if layout.num_buckets:
        signs, rotating = _rotation_args(rotation, out)
        _launch_decode_sum_encode(
            grid,
            payloads,
            own_flat,
            out,
            numel,
            _row_pitch(payloads),
            own_index,
            1.0 if scale is None else scale,
            k0,
            k1,
            keys,
            stream,
            *signs,
            NUM_ROWS=payloads.shape[0],
            SKIP_OWN=0 <= own_index < payloads.shape[0],
            BITS=bits,
            B=bucket_size,
            SKIP_INCOMPLETE=skip_incomplete,
            HAS_OWN=own is not None,
            HAS_SCALE=scale is not None,
            KEYS_IN_MEMORY=in_memory,
            **launch,
            **rotating,
        )
    if layout.raw_numel:
        tail = layout.num_buckets * bucket_size
        if own is None:
            acc = torch.zeros(layout.raw_numel, dtype=torch.float32, device=out.device)
        elif rotation is None:
            acc = own_flat[tail:numel].to(torch.float32)
        else:
            acc = _rotated(own_flat[tail:numel], rotation, numel, tail)
        factor = None if scale is None else maxmin.fp32_scalar(scale)
        if factor is not None:  # each term scaled, as the reference's _scaled_sum
            acc = acc * factor
        for w in range(payloads.shape[0]):
            if w != own_index:
                raw = _raw_region(payloads[w], layout)
                acc = acc + (raw if factor is None else raw * factor)
        _raw_region(out, layout).copy_(acc)
    return out
