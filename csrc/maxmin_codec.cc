/* The max-min codec's per-bucket loops for CPU tensors: the same bytes as the torch reference
 * (cgx2/codecs/maxmin.py), whose docstring defines them, in one pass over the data rather than
 * one tensor pass per operation. Built by setup.py with -ffp-contract=off: every operation is
 * one IEEE fp32 operation, as in the reference. */
#include "maxmin_codec.h"

#include <math.h>
#include <string.h>

namespace {

/* An fp32 at any byte address (a payload's pairs need not be 4-byte aligned). */
static void put_f32(uint8_t *at, float x) { memcpy(at, &x, sizeof x); }

static float nan_bits(void) {
    uint32_t u = 0x7FC00000u; /* the reference's NaN */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Groups whose Philox words are computed together: one round over all of them at a time is a
 * loop the compiler vectorizes (ten rounds a group one after the other are not). */
#define GROUPS_AT_ONCE 64

/* Philox4x32-10 (cgx2/codecs/philox.py) of counters (g0 + k, q, q >> 32, stream), k < n. */
static void philox_groups(uint32_t w0[GROUPS_AT_ONCE], uint32_t w1[GROUPS_AT_ONCE],
                          uint32_t w2[GROUPS_AT_ONCE], uint32_t w3[GROUPS_AT_ONCE], int n,
                          int64_t g0, int64_t q, uint64_t stream, uint32_t k0, uint32_t k1) {
    for (int k = 0; k < n; k++) {
        w0[k] = (uint32_t)(g0 + k);
        w1[k] = (uint32_t)q;
        w2[k] = (uint32_t)((uint64_t)q >> 32);
        w3[k] = (uint32_t)stream;
    }
    for (int r = 0; r < 10; r++) {
        for (int k = 0; k < n; k++) {
            uint64_t a = (uint64_t)w0[k] * 0xD2511F53u;
            uint64_t b = (uint64_t)w2[k] * 0xCD9E8D57u;
            uint32_t c0 = (uint32_t)(b >> 32) ^ w1[k] ^ k0;
            uint32_t c2 = (uint32_t)(a >> 32) ^ w3[k] ^ k1;
            w0[k] = c0;
            w1[k] = (uint32_t)b;
            w2[k] = c2;
            w3[k] = (uint32_t)a;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* lmax / span (span > 0) rounded toward zero: maxmin.scale_toward_zero. */
static float scale_toward_zero(float lmax, float span) {
    float q = lmax / span;
    if ((double)q * (double)span > (double)lmax) q = nextafterf(q, 0.0f);
    return q;
}

/* Value j of a group whose Philox words are c, in a finite bucket: its level,
 * floor((x - lo) * scale + h * 2**-frac) with h its 16-bit half (value 8g + 4i + 2k + h takes
 * half h of word 2k + i); a = (x - lo) * scale >= 0, so truncation is the floor. */
static inline uint64_t level_of(const uint32_t c[4], int j, float x, float lo_p, float pre,
                                float scale, int frac) {
    uint32_t word = c[2 * ((j >> 1) & 1) + ((j >> 2) & 1)];
    int64_t h = (int64_t)((j & 1) ? word >> 16 : word & 0xFFFFu) >> (16 - frac);
    float a = (x * pre - lo_p) * scale;
    return (uint64_t)(((int64_t)(a * (float)(1 << frac)) + h) >> frac);
}

}  // namespace

namespace cgx2 {

/* Encode buckets [q_begin, q_end) of complete buckets of B fp32 values (rows, contiguous):
 * their (lo, step) pairs into meta and their packed levels, bucket q's at
 * q * ceil(B / 8) * bits, into levels (cgx2/codecs/packing.py's format, pack_levels: eight
 * levels a group as one little-endian bits-byte field; tests/codecs/test_native_codec.py
 * holds these bytes to it), of which only the first levels_nbytes bytes are written.
 * Levels of values at or past covered (a padded last bucket) are zero. Random halves: key,
 * bucket q of stream, as philox.py. Ranges of buckets may run in threads. */
void maxmin_encode(const float *rows, int64_t q_begin, int64_t q_end, int64_t B, int bits,
                        uint64_t key, uint64_t stream, int64_t covered, uint8_t *meta,
                        uint8_t *levels, int64_t levels_nbytes) {
    const float lmax = (float)((1 << bits) - 1);
    const int frac = bits <= 7 ? 16 : 15;
    const int64_t groups = (B + 7) / 8, stride = groups * bits;
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int64_t q = q_begin; q < q_end; q++) {
        const float *v = rows + q * B;
        float lo = INFINITY, hi = -INFINITY;
        int has_nan = 0;
        for (int64_t i = 0; i < B; i++) {
            float x = v[i];
            if (x != x) has_nan = 1;
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
        }
        if (has_nan) { /* a NaN counts as -inf in the min and makes the max NaN */
            lo = -INFINITY;
            hi = nan_bits();
        }
        lo = lo + 0.0f; /* -0.0 becomes +0.0 */
        hi = hi + 0.0f;
        float span = hi - lo;
        /* Finite ends whose span overflows: half scale, flagged by a negative step. */
        int halved = isfinite(lo) && isfinite(hi) && isinf(span);
        int finite = span < INFINITY || halved;
        int positive = finite && span > 0.0f;
        /* A span so small that lmax / span overflows: differences scaled by 2**64 first. */
        int tiny = positive && !halved && isinf(lmax / span);
        float pre = halved ? 0.5f : tiny ? 0x1p64f : 1.0f;
        float lo_p = lo * pre, span_p = hi * pre - lo_p;
        float scale = positive ? scale_toward_zero(lmax, span_p) : 0.0f;
        put_f32(meta + 8 * q, halved ? lo_p : finite ? lo : nan_bits());
        put_f32(meta + 8 * q + 4, halved ? -(span_p / lmax) : finite ? span / lmax : nan_bits());
        uint32_t w[4][GROUPS_AT_ONCE];
        for (int64_t g = 0; g < groups; g++) {
            int k = (int)(g % GROUPS_AT_ONCE);
            if (k == 0) {
                int64_t left = groups - g;
                int n = left < GROUPS_AT_ONCE ? (int)left : GROUPS_AT_ONCE;
                philox_groups(w[0], w[1], w[2], w[3], n, g, q, stream, k0, k1);
            }
            uint32_t c[4] = {w[0][k], w[1][k], w[2][k], w[3][k]};
            uint64_t field = 0; /* a non-finite bucket's levels are zero */
            const float *x = v + 8 * g;
            if (finite && 8 * g + 8 <= B && q * B + 8 * g + 8 <= covered) {
                for (int j = 0; j < 8; j++) /* a whole group: no checks, unrolled */
                    field |= level_of(c, j, x[j], lo_p, pre, scale, frac) << (bits * j);
            } else if (finite) {
                for (int j = 0; j < 8 && 8 * g + j < B && q * B + 8 * g + j < covered; j++)
                    field |= level_of(c, j, x[j], lo_p, pre, scale, frac) << (bits * j);
            }
            int64_t at = q * stride + g * bits;
            for (int b = 0; b < bits && at + b < levels_nbytes; b++)
                levels[at + b] = (uint8_t)(field >> (8 * b));
        }
    }
}

namespace {

/* fp32 -> bf16 rounding to nearest even, NaN -> 0x7FC0: maxmin._cast. */
static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

/* Decode buckets [q_begin, q_end) (meta and levels as written above; bytes past
 * levels_nbytes read as zero) into out, values below covered: (lo + |step| * level) * post
 * (post 2 where step < 0, a half-scale bucket, else 1), in fp32,
 * added to base[e] where base is not NULL (base == out accumulates: a row of a sum); with
 * out_bf16 (and no base), stored as bf16. */
void maxmin_decode(const float *meta, const uint8_t *levels, int64_t levels_nbytes,
                        int64_t q_begin, int64_t q_end, int64_t B, int bits, int64_t covered,
                        const float *base, void *out, int out_bf16) {
    float *out32 = (float *)out;
    uint16_t *out16 = (uint16_t *)out;
    const uint64_t mask = (1u << bits) - 1;
    const int64_t groups = (B + 7) / 8, stride = groups * bits;
    for (int64_t q = q_begin; q < q_end; q++) {
        const float lo = meta[2 * q], step = fabsf(meta[2 * q + 1]);
        const float post = meta[2 * q + 1] < 0.0f ? 2.0f : 1.0f; /* a half-scale bucket */
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = q * stride + g * bits;
            uint64_t field = 0;
            for (int b = 0; b < bits && at + b < levels_nbytes; b++)
                field |= (uint64_t)levels[at + b] << (8 * b);
            for (int j = 0; j < 8; j++) {
                int64_t i = 8 * g + j, e = q * B + i;
                if (i >= B || e >= covered) break;
                float level = (float)((field >> (bits * j)) & mask);
                float value = (lo + step * level) * post;
                if (out_bf16)
                    out16[e] = to_bf16(value);
                else
                    out32[e] = base ? base[e] + value : value;
            }
        }
    }
}

}  // namespace cgx2
