/* The randomized Hadamard rotation's loops for CPU tensors: the same values as the torch
 * reference (cgx2/codecs/rotation.py), whose docstring and docs/wire-format.md ("Rotation")
 * define them. Built with -ffp-contract=off: each step is one IEEE fp32 operation, in the
 * reference's order, so the bits are the reference's. */
#include "rotation.h"

#include <math.h>
#include <string.h>

namespace {

const uint32_t SIGN_C2 = 0x48414441u, SIGN_C3 = 0x524F5441u;

/* Philox4x32-10 (cgx2/codecs/philox.py) at counter (g_lo, g_hi, SIGN_C2, SIGN_C3): the signs
 * of values 128 g .. 128 g + 127, value 128 g + 32 w + b taking bit b of word w. */
void sign_words(uint64_t g, uint32_t k0, uint32_t k1, uint32_t w[4]) {
    uint32_t c0 = (uint32_t)g, c1 = (uint32_t)(g >> 32), c2 = SIGN_C2, c3 = SIGN_C3;
    for (int r = 0; r < 10; r++) {
        uint64_t a = (uint64_t)c0 * 0xD2511F53u;
        uint64_t b = (uint64_t)c2 * 0xCD9E8D57u;
        uint32_t n0 = (uint32_t)(b >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(a >> 32) ^ c3 ^ k1;
        c0 = n0;
        c1 = (uint32_t)b;
        c2 = n2;
        c3 = (uint32_t)a;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    w[0] = c0;
    w[1] = c1;
    w[2] = c2;
    w[3] = c3;
}

/* NaN as 0x7FC00000, the reference's. */
inline float canonical(float x) {
    uint32_t u = 0x7FC00000u;
    float nan;
    memcpy(&nan, &u, sizeof nan);
    return x == x ? x : nan;
}

/* x with its sign bit flipped where mask has it: x * -1.0f for every x but NaN (whose bits
 * the caller makes canonical). */
inline float flip(float x, uint32_t mask) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u ^= mask;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The sign masks (0 or 0x80000000: -1 where set) of values i0 .. i0 + len - 1, i0 a
 * multiple of len or of 128, len <= 128 or a multiple of 128. */
void sign_masks(int64_t i0, int64_t len, uint32_t k0, uint32_t k1, uint32_t *mask) {
    for (int64_t k = 0; k < len; k += 128) {
        uint64_t i = (uint64_t)(i0 + k);
        uint32_t w[4];
        sign_words(i >> 7, k0, k1, w);
        int64_t m = len - k < 128 ? len - k : 128;
        int64_t first = (int64_t)(i & 127); /* a block shorter than 128 starts inside a group */
        for (int64_t j = 0; j < m; j++) {
            int64_t b = first + j;
            mask[k + j] = ((w[b >> 5] >> (b & 31)) & 1u) << 31;
        }
    }
}

/* The unnormalized Walsh-Hadamard stages h = 1, 2, ..., B/2 on t, in place; the first three
 * fused per group of eight values (the same operations on the same values). */
void butterflies(float *t, int64_t B) {
    int64_t h = 1;
    if (B >= 8) {
        for (int64_t g = 0; g < B; g += 8) {
            float *v = t + g;
            float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
            float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
            float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
            float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
            v[0] = b0 + b4;
            v[4] = b0 - b4;
            v[1] = b1 + b5;
            v[5] = b1 - b5;
            v[2] = b2 + b6;
            v[6] = b2 - b6;
            v[3] = b3 + b7;
            v[7] = b3 - b7;
        }
        h = 8;
    }
    for (; h < B; h *= 2) {
        for (int64_t j0 = 0; j0 < B; j0 += 2 * h) {
            float *__restrict lo = t + j0;
            float *__restrict hi = t + j0 + h;
            for (int64_t j = 0; j < h; j++) {
                float a = lo[j], b = hi[j];
                lo[j] = a + b;
                hi[j] = a - b;
            }
        }
    }
}

#define MASKS_AT_ONCE 1024

}  // namespace

namespace cgx2 {

/* Blocks [b_begin, b_end) of n fp32 values (blocks of `block` from index 0; the last, if
 * shorter, is copied unrotated) from src into dst (which may be src): forward, per block,
 * t = x * sign, the stages, t * scale; inverse, the stages, * scale, * sign. Every NaN out is
 * 0x7FC00000. Ranges of blocks may run in threads. */
void hadamard_rotate(const float *src, float *dst, int64_t b_begin, int64_t b_end, int64_t n,
                     int64_t block, uint64_t key, float scale, int inverse) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    uint32_t mask[MASKS_AT_ONCE];
    for (int64_t q = b_begin; q < b_end; q++) {
        const int64_t i0 = q * block;
        const float *x = src + i0;
        float *t = dst + i0;
        if (i0 + block > n) { /* the trailing part block: left as it is */
            for (int64_t i = 0; i < n - i0; i++) t[i] = canonical(x[i]);
            continue;
        }
        if (!inverse) {
            for (int64_t k = 0; k < block; k += MASKS_AT_ONCE) {
                int64_t len = block - k < MASKS_AT_ONCE ? block - k : MASKS_AT_ONCE;
                sign_masks(i0 + k, len, k0, k1, mask);
                for (int64_t j = 0; j < len; j++) t[k + j] = flip(x[k + j], mask[j]);
            }
            butterflies(t, block);
            for (int64_t j = 0; j < block; j++) t[j] = canonical(t[j] * scale);
        } else {
            if (t != x) memcpy(t, x, sizeof(float) * (size_t)block);
            butterflies(t, block);
            for (int64_t k = 0; k < block; k += MASKS_AT_ONCE) {
                int64_t len = block - k < MASKS_AT_ONCE ? block - k : MASKS_AT_ONCE;
                sign_masks(i0 + k, len, k0, k1, mask);
                for (int64_t j = 0; j < len; j++)
                    t[k + j] = canonical(flip(t[k + j] * scale, mask[j]));
            }
        }
    }
}

}  // namespace cgx2
