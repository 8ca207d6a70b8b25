// The max-min codec's CPU loops (maxmin_codec.cc): the bytes of cgx2/codecs/maxmin.py.
#pragma once

#include <stdint.h>

namespace cgx2 {

/* Returns how many buckets it coded saturated. clip < 1: each finite bucket coded over the
 * middle of its range (maxmin._clipped); nearest: levels rounded to the nearest. */
int64_t maxmin_encode(const float *rows, int64_t q_begin, int64_t q_end, int64_t B, int bits,
                      uint64_t key, uint64_t stream, int64_t covered, uint8_t *meta,
                      uint8_t *levels, int64_t levels_nbytes, int saturate, float clip,
                      int nearest);

void maxmin_decode(const float *meta, const uint8_t *levels, int64_t levels_nbytes,
                   int64_t q_begin, int64_t q_end, int64_t B, int bits, int64_t covered,
                   const float *base, void *out, int out_bf16, float factor);

/* Whether the vector loops (AVX2) run; enable 0 or 1 turns them off or back on where the CPU
 * has them, -1 only asks. The bytes are the same either way. */
int maxmin_simd(int enable);

}  // namespace cgx2
