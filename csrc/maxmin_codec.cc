/* The max-min codec's per-bucket loops for CPU tensors: the same bytes as the torch reference
 * (cgx2/codecs/maxmin.py), whose docstring defines them, in one pass over the data rather than
 * one tensor pass per operation. Built by setup.py with -ffp-contract=off: every operation is
 * one IEEE fp32 operation, as in the reference. On x86-64 CPUs with AVX2 (asked at run time),
 * whole groups of eight values take vector loops doing the same operations in the same order;
 * the scalar loops below define the bytes and do the rest. */
#include "maxmin_codec.h"

#include <math.h>
#include <string.h>

#include <atomic>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CGX2_AVX2 1
#endif

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

/* What a finite bucket's levels need, from its ends; with sat, a saturated one's (a sum that
 * overflowed: maxmin._saturated_params), whose +-Inf take the end levels and whose finite
 * values' a is held to [a_lo, a_hi]. */
struct Bucket {
    float lo_p, pre, scale;
    int sat;
    float a_lo, a_hi, lmax;
    /* The clipped rotation (maxmin._clipped): values clamped into [clip_lo, clip_hi] first,
     * and every level rounded to the nearest (h half of 2**frac: nearest). */
    int clamp, nearest;
    float clip_lo, clip_hi;
};

/* Value j's level in a finite bucket that clamps or rounds to nearest: level_of's steps. */
static inline uint64_t clipped_level_of(const uint32_t c[4], int j, float x, const Bucket *b,
                                        int frac) {
    uint32_t word = c[2 * ((j >> 1) & 1) + ((j >> 2) & 1)];
    int64_t h = b->nearest ? (int64_t)1 << (frac - 1)
                           : (int64_t)((j & 1) ? word >> 16 : word & 0xFFFFu) >> (16 - frac);
    if (b->clamp) { /* torch.maximum with the low end, then torch.minimum with the high one */
        x = x < b->clip_lo ? b->clip_lo : x;
        x = x > b->clip_hi ? b->clip_hi : x;
    }
    float a = (x * b->pre - b->lo_p) * b->scale;
    return (uint64_t)(((int64_t)(a * (float)(1 << frac)) + h) >> frac);
}

/* Value j's level in a saturated bucket (b->lo_p its m, b->scale its scale). */
static inline uint64_t saturated_level_of(const uint32_t c[4], int j, float x, const Bucket *b,
                                          int frac) {
    uint32_t word = c[2 * ((j >> 1) & 1) + ((j >> 2) & 1)];
    int64_t h = b->nearest ? (int64_t)1 << (frac - 1)
                           : (int64_t)((j & 1) ? word >> 16 : word & 0xFFFFu) >> (16 - frac);
    float a;
    if (x == INFINITY) {
        a = b->lmax;
    } else if (x == -INFINITY) {
        a = 0.0f;
    } else {
        a = (x * 0.5f - b->lo_p) * b->scale;
        a = a < b->a_lo ? b->a_lo : a; /* torch.clamp: max with a_lo, then min with a_hi */
        a = a > b->a_hi ? b->a_hi : a;
    }
    return (uint64_t)(((int64_t)(a * (float)(1 << frac)) + h) >> frac);
}

/* The step made smaller by an ulp, NUDGES times at most, where the top level would decode
 * past FLT_MAX: maxmin._finite_top. */
#define NUDGES 4
static float finite_top(float stored_lo, float step, float lmax) {
    for (int k = 0; k < NUDGES; k++) {
        float top = (stored_lo + fabsf(step) * lmax) * (step < 0.0f ? 2.0f : 1.0f);
        if (isinf(top)) step = nextafterf(step, 0.0f);
    }
    return step;
}

/* Group g (of a bucket whose values start at v) into its bits-byte field at out, up to
 * out_end: levels of values at or past `whole` (an index in the bucket) are zero. */
static void encode_group(const float *v, int64_t g, int64_t B, int64_t whole, int bits,
                         int frac, const Bucket *b, int64_t q, uint64_t stream, uint32_t k0,
                         uint32_t k1, uint8_t *out, const uint8_t *out_end) {
    uint64_t field = 0; /* a non-finite bucket's levels are zero */
    if (b) {
        uint32_t c[4] = {0, 0, 0, 0}; /* rounding to the nearest reads no random words */
        if (!b->nearest) {
            uint32_t w[4][GROUPS_AT_ONCE];
            philox_groups(w[0], w[1], w[2], w[3], 1, g, q, stream, k0, k1);
            for (int i = 0; i < 4; i++) c[i] = w[i][0];
        }
        const float *x = v + 8 * g;
        for (int j = 0; j < 8 && 8 * g + j < B && 8 * g + j < whole; j++)
            field |= (b->sat                    ? saturated_level_of(c, j, x[j], b, frac)
                      : b->clamp || b->nearest ? clipped_level_of(c, j, x[j], b, frac)
                                               : level_of(c, j, x[j], b->lo_p, b->pre, b->scale,
                                                          frac))
                     << (bits * j);
    }
    for (int k = 0; k < bits && out + k < out_end; k++) out[k] = (uint8_t)(field >> (8 * k));
}

#ifdef CGX2_AVX2

#define AVX2 __attribute__((target("avx2")))

static int avx2_present(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
}

/* The low and high halves of the 64-bit products x * m of eight 32-bit lanes. */
AVX2 static inline void mulhilo8(__m256i x, __m256i m, __m256i *hi, __m256i *lo) {
    __m256i even = _mm256_mul_epu32(x, m);
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* lo and hi of n values (any NaN: has_nan), eight lanes at a time; a zero's sign may differ
 * from the scalar loop's, which the caller's + 0.0f erases. */
AVX2 static void minmax_avx2(const float *v, int64_t n, float *lo, float *hi, int *has_nan) {
    __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        vlo = _mm256_min_ps(x, vlo); /* x < lo ? x : lo, as the scalar loop */
        vhi = _mm256_max_ps(x, vhi);
    }
    float l[8], h[8];
    _mm256_storeu_ps(l, vlo);
    _mm256_storeu_ps(h, vhi);
    float a = INFINITY, b = -INFINITY;
    for (int k = 0; k < 8; k++) {
        a = l[k] < a ? l[k] : a;
        b = h[k] > b ? h[k] : b;
    }
    int any = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        float x = v[i];
        if (x != x) any = 1;
        a = x < a ? x : a;
        b = x > b ? x : b;
    }
    *lo = a;
    *hi = b;
    *has_nan = any;
}

/* Groups g0 .. g0 + 7 of a finite bucket, all their values whole, into 8 * bits bytes at out:
 * the Philox words of eight groups a lane each, the values transposed to match. */
AVX2 static void encode_8_groups_avx2(const float *v, int64_t g0, int bits, int frac,
                                      const Bucket *b, int64_t q, uint64_t stream, uint32_t k0,
                                      uint32_t k1, uint8_t *out) {
    __m256i w0 = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(uint32_t)g0),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i w1 = _mm256_set1_epi32((int32_t)(uint32_t)q);
    __m256i w2 = _mm256_set1_epi32((int32_t)(uint32_t)((uint64_t)q >> 32));
    __m256i w3 = _mm256_set1_epi32((int32_t)(uint32_t)stream);
    const __m256i m0 = _mm256_set1_epi32((int32_t)0xD2511F53u);
    const __m256i m2 = _mm256_set1_epi32((int32_t)0xCD9E8D57u);
    for (int r = 0; r < 10; r++) {
        __m256i ahi, alo, bhi, blo;
        mulhilo8(w0, m0, &ahi, &alo);
        mulhilo8(w2, m2, &bhi, &blo);
        w0 = _mm256_xor_si256(_mm256_xor_si256(bhi, w1), _mm256_set1_epi32((int32_t)k0));
        w2 = _mm256_xor_si256(_mm256_xor_si256(ahi, w3), _mm256_set1_epi32((int32_t)k1));
        w1 = blo;
        w3 = alo;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    /* Row g of the values is group g0 + g; after the transpose, vector j holds value j of
     * each group. */
    const float *x = v + 8 * g0;
    __m256 r[8], t[8], s[8], c[8];
    for (int g = 0; g < 8; g++) r[g] = _mm256_loadu_ps(x + 8 * g);
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        s[4 * k + 0] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        s[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
        s[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        s[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x20);
        c[k + 4] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x31);
    }
    const __m256i words[4] = {w0, w1, w2, w3};
    const __m256 pre = _mm256_set1_ps(b->pre), lo_p = _mm256_set1_ps(b->lo_p);
    const __m256 scale = _mm256_set1_ps(b->scale), one = _mm256_set1_ps((float)(1 << frac));
    const __m128i low_shift = _mm_cvtsi32_si128(16 - frac), high_shift = _mm_cvtsi32_si128(32 - frac);
    const __m128i frac_shift = _mm_cvtsi32_si128(frac);
    __m256i field_lo = _mm256_setzero_si256(), field_hi = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i word = words[2 * ((j >> 1) & 1) + ((j >> 2) & 1)];
        __m256i h = (j & 1) ? _mm256_srl_epi32(word, high_shift)
                            : _mm256_srl_epi32(_mm256_and_si256(word, _mm256_set1_epi32(0xFFFF)),
                                               low_shift);
        __m256 a = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(c[j], pre), lo_p), scale);
        /* a * 2**frac < 2**31: the 32-bit truncation is the scalar loop's 64-bit one. */
        __m256i level = _mm256_srl_epi32(
            _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(a, one)), h), frac_shift);
        int at = bits * j; /* shifts of 32 or more give zero */
        field_lo = _mm256_or_si256(field_lo, _mm256_sll_epi32(level, _mm_cvtsi32_si128(at)));
        __m256i upper = at >= 32 ? _mm256_sll_epi32(level, _mm_cvtsi32_si128(at - 32))
                                 : _mm256_srl_epi32(level, _mm_cvtsi32_si128(32 - at));
        field_hi = _mm256_or_si256(field_hi, upper);
    }
    if (bits == 4) {
        _mm256_storeu_si256((__m256i *)out, field_lo);
    } else if (bits == 8) {
        __m256i a = _mm256_unpacklo_epi32(field_lo, field_hi);
        __m256i c2 = _mm256_unpackhi_epi32(field_lo, field_hi);
        _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(a, c2, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute2x128_si256(a, c2, 0x31));
    } else {
        uint32_t lo[8], hi[8];
        _mm256_storeu_si256((__m256i *)lo, field_lo);
        _mm256_storeu_si256((__m256i *)hi, field_hi);
        for (int g = 0; g < 8; g++) {
            uint64_t field = lo[g] | (uint64_t)hi[g] << 32;
            for (int k = 0; k < bits; k++) out[g * bits + k] = (uint8_t)(field >> (8 * k));
        }
    }
}

/* A whole group's eight values from its field: (lo + step * level) * post, plus base where
 * given, stored as fp32 or bf16. */
AVX2 static void decode_group_avx2(uint64_t field, int bits, float lo, float step, float post,
                                   const float *base, float *out32, uint16_t *out16) {
    const __m256i f = _mm256_set1_epi64x((long long)field);
    const long long b = bits;
    __m256i l0 = _mm256_srlv_epi64(f, _mm256_setr_epi64x(0, b, 2 * b, 3 * b));
    __m256i l1 = _mm256_srlv_epi64(f, _mm256_setr_epi64x(4 * b, 5 * b, 6 * b, 7 * b));
    __m256i mixed = _mm256_blend_epi32(l0, _mm256_slli_epi64(l1, 32), 0xAA); /* j 0 4 1 5 ... */
    __m256i levels = _mm256_and_si256(
        _mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)),
        _mm256_set1_epi32((1 << bits) - 1));
    __m256 value = _mm256_mul_ps(
        _mm256_add_ps(_mm256_set1_ps(lo),
                      _mm256_mul_ps(_mm256_set1_ps(step), _mm256_cvtepi32_ps(levels))),
        _mm256_set1_ps(post));
    if (out16) { /* maxmin._cast: nearest even, NaN -> 0x7FC0 */
        __m256i u = _mm256_castps_si256(value);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128((__m128i *)out16, _mm256_castsi256_si128(packed));
        return;
    }
    if (base) value = _mm256_add_ps(_mm256_loadu_ps(base), value);
    _mm256_storeu_ps(out32, value);
}

#endif  // CGX2_AVX2

/* Whether the vector loops run: present and not turned off (maxmin_simd); -1 until asked.
 * Atomic: threads coding ranges of buckets may ask first at once. */
static std::atomic<int> simd_state{-1};

static int use_simd(void) {
#ifdef CGX2_AVX2
    int state = simd_state.load(std::memory_order_relaxed);
    if (state < 0) {
        state = avx2_present();
        simd_state.store(state, std::memory_order_relaxed);
    }
    return state;
#else
    return 0;
#endif
}

}  // namespace

namespace cgx2 {

int maxmin_simd(int enable) {
#ifdef CGX2_AVX2
    if (enable >= 0) simd_state.store(enable ? avx2_present() : 0, std::memory_order_relaxed);
#else
    (void)enable;
#endif
    return use_simd();
}

/* Encode buckets [q_begin, q_end) of complete buckets of B fp32 values (rows, contiguous):
 * their (lo, step) pairs into meta and their packed levels, bucket q's at
 * q * ceil(B / 8) * bits, into levels (cgx2/codecs/packing.py's format, pack_levels: eight
 * levels a group as one little-endian bits-byte field; tests/codecs/test_native_codec.py
 * holds these bytes to it), of which only the first levels_nbytes bytes are written.
 * Levels of values at or past covered (a padded last bucket) are zero. Random halves: key,
 * bucket q of stream, as philox.py. Ranges of buckets may run in threads. Returns how many
 * buckets of the range were coded saturated (only with saturate), so that the caller's check
 * for them (maxmin.unsaturate_input) runs only where there are any. */
int64_t maxmin_encode(const float *rows, int64_t q_begin, int64_t q_end, int64_t B, int bits,
                      uint64_t key, uint64_t stream, int64_t covered, uint8_t *meta,
                      uint8_t *levels, int64_t levels_nbytes, int saturate, float clip,
                      int nearest) {
    const float lmax = (float)((1 << bits) - 1);
    const int frac = bits <= 7 ? 16 : 15;
    const int64_t groups = (B + 7) / 8, stride = groups * bits;
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const int simd = use_simd();
    const uint8_t *levels_end = levels + (levels_nbytes > 0 ? levels_nbytes : 0);
    int64_t saturated = 0;
    for (int64_t q = q_begin; q < q_end; q++) {
        const float *v = rows + q * B;
        float lo = INFINITY, hi = -INFINITY;
        int has_nan = 0;
#ifdef CGX2_AVX2
        if (simd) minmax_avx2(v, B, &lo, &hi, &has_nan);
#endif
        if (!simd) {
            for (int64_t i = 0; i < B; i++) {
                float x = v[i];
                if (x != x) has_nan = 1;
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
        }
        if (has_nan) { /* a NaN counts as -inf in the min and makes the max NaN */
            lo = -INFINITY;
            hi = nan_bits();
        }
        lo = lo + 0.0f; /* -0.0 becomes +0.0 */
        hi = hi + 0.0f;
        const int clamp = clip < 1.0f && isfinite(lo) && isfinite(hi);
        if (clamp) { /* maxmin._clipped: the middle of the range, from halves of its ends */
            float mid = lo * 0.5f + hi * 0.5f;
            float reach = (hi * 0.5f - lo * 0.5f) * clip;
            float low = mid - reach, high = mid + reach;
            lo = low > lo ? low : lo;
            hi = high < hi ? high : hi;
        }
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
        float stored_lo = halved ? lo_p : finite ? lo : nan_bits();
        float step = halved ? -(span_p / lmax) : finite ? span / lmax : nan_bits();
        step = finite_top(stored_lo, step, lmax);
        Bucket bucket = {lo_p, pre, scale, 0, 0.0f, 0.0f, lmax, clamp, nearest, lo, hi};
        /* NaN-free with an infinite end: a sum that overflowed, coded saturated where asked
         * (one bit cannot tell -Inf, +Inf and finite apart: that bucket stays NaN). */
        if (saturate && !finite && !has_nan && !(bits == 1 && lo == -INFINITY && hi == INFINITY)) {
            const int top = hi == INFINITY, bottom = lo == -INFINITY;
            float m = fminf(lo * 0.5f, 0x1p127f - lmax * 0x1p106f);
            if (bits == 1) m = fmaxf(m, -0x1p126f);
            if (bottom) m = -0x1p127f;
            float s = top ? ((0x1p126f - m * 0.5f) / lmax) * 2.0f
                          : fmaxf(((hi * 0.25f + 0x1p126f) / lmax) * 2.0f, 0x1p106f);
            for (int k = 0; k < NUDGES; k++) {
                float end = (m + s * lmax) * 2.0f;
                if (top && isfinite(end))
                    s = nextafterf(s, INFINITY);
                else if (!top && isinf(end))
                    s = nextafterf(s, 0.0f);
            }
            float span_q = (top ? 0x1p126f : hi * 0.25f) - m * 0.5f;
            bucket = {m, 0.5f, span_q > 0.0f ? scale_toward_zero(lmax * 0.5f, span_q) : 0.0f,
                      1, bottom ? 1.0f : 0.0f, top ? lmax - 1.0f : lmax, lmax,
                      0, nearest, 0.0f, 0.0f};
            stored_lo = m;
            step = -s;
            saturated++;
        }
        put_f32(meta + 8 * q, stored_lo);
        put_f32(meta + 8 * q + 4, step);
        const Bucket *b = finite || bucket.sat ? &bucket : nullptr;
        /* Values of this bucket below `whole` are the caller's; past it, padding. */
        const int64_t whole = covered - q * B < B ? covered - q * B : B;
        uint8_t *out = levels + q * stride;
        int64_t g = 0;
#ifdef CGX2_AVX2
        const int plain = b && !b->sat && !b->clamp && !b->nearest; /* level_of's buckets */
        if (simd && plain) {
            for (; 8 * (g + 8) <= whole && out + (g + 8) * bits <= levels_end; g += 8)
                encode_8_groups_avx2(v, g, bits, frac, b, q, stream, k0, k1, out + g * bits);
        }
#endif
        if (plain && !simd) { /* the scalar loop: Philox words of 64 groups at once */
            uint32_t w[4][GROUPS_AT_ONCE];
            for (; g < groups; g++) {
                int k = (int)(g % GROUPS_AT_ONCE);
                if (k == 0) {
                    int64_t left = groups - g;
                    int n = left < GROUPS_AT_ONCE ? (int)left : GROUPS_AT_ONCE;
                    philox_groups(w[0], w[1], w[2], w[3], n, g, q, stream, k0, k1);
                }
                uint32_t c[4] = {w[0][k], w[1][k], w[2][k], w[3][k]};
                uint64_t field = 0;
                const float *x = v + 8 * g;
                if (8 * g + 8 <= whole) {
                    for (int j = 0; j < 8; j++) /* a whole group: no checks, unrolled */
                        field |= level_of(c, j, x[j], lo_p, pre, scale, frac) << (bits * j);
                } else {
                    for (int j = 0; j < 8 && 8 * g + j < whole; j++)
                        field |= level_of(c, j, x[j], lo_p, pre, scale, frac) << (bits * j);
                }
                uint8_t *at = out + g * bits;
                for (int k = 0; k < bits && at + k < levels_end; k++)
                    at[k] = (uint8_t)(field >> (8 * k));
            }
        }
        /* What the loops above left: a part group, a saturated bucket, or all zeros. */
        for (; g < groups; g++)
            encode_group(v, g, B, whole, bits, frac, b, q, stream, k0, k1, out + g * bits,
                         levels_end);
    }
    return saturated;
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
 * (post 2 where step < 0, a half-scale bucket, else 1, times factor), in fp32,
 * added to base[e] where base is not NULL (base == out accumulates: a row of a sum); with
 * out_bf16 (and no base), stored as bf16. */
void maxmin_decode(const float *meta, const uint8_t *levels, int64_t levels_nbytes,
                   int64_t q_begin, int64_t q_end, int64_t B, int bits, int64_t covered,
                   const float *base, void *out, int out_bf16, float factor) {
    float *out32 = (float *)out;
    uint16_t *out16 = (uint16_t *)out;
    const uint64_t mask = (1u << bits) - 1;
    const int64_t groups = (B + 7) / 8, stride = groups * bits;
    const int simd = use_simd();
    for (int64_t q = q_begin; q < q_end; q++) {
        const float lo = meta[2 * q], step = fabsf(meta[2 * q + 1]);
        /* A half-scale bucket's 2, times the factor: exactly (a power of two times it). */
        const float post = (meta[2 * q + 1] < 0.0f ? 2.0f : 1.0f) * factor;
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = q * stride + g * bits;
            int64_t e0 = q * B + 8 * g;
#ifdef CGX2_AVX2
            /* A whole group whose field can be read as eight bytes. */
            if (simd && 8 * g + 8 <= B && e0 + 8 <= covered && at + 8 <= levels_nbytes) {
                uint64_t field;
                memcpy(&field, levels + at, sizeof field);
                if (bits < 8) field &= (1ull << (8 * bits)) - 1;
                decode_group_avx2(field, bits, lo, step, post, base ? base + e0 : nullptr,
                                  out32 + e0, out_bf16 ? out16 + e0 : nullptr);
                continue;
            }
#endif
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
