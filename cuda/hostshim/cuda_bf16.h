// Host shim of <cuda_bf16.h>: the bfloat16 conversions the codec kernels use, with the
// results of the PTX instructions (cvt.rn.bf16.f32: round to nearest even, NaN -> 0x7fff).
#pragma once

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  unsigned short x;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  // Adding 0x7fff plus the lowest kept bit, then truncating, rounds half to even; a carry
  // out of the mantissa correctly rounds up into the exponent (and to Inf).
  return {static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return {v}; }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned{h.x} << 16); }
