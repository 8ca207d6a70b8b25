// The randomized Hadamard rotation's CPU loops (rotation.cc): the values of
// cgx2/codecs/rotation.py.
#pragma once

#include <stdint.h>

namespace cgx2 {

void hadamard_rotate(const float *src, float *dst, int64_t b_begin, int64_t b_end, int64_t n,
                     int64_t block, uint64_t key, float scale, int inverse);

}  // namespace cgx2
