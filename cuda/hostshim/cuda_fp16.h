// Host shim of <cuda_fp16.h>: the float16 conversions the codec kernels use. Rounding is
// done by the compiler's _Float16 conversion (IEEE round to nearest even, overflow to Inf,
// subnormals kept), independently of jcoccl's own host conversion in codecs/format.h; NaN
// gives 0x7fff, the canonical NaN of cvt.rn.f16.f32.
#pragma once

#include "cuda_runtime.h"

struct __half {
  unsigned short x;
};

inline __half __float2half_rn(float f) {
  if (std::isnan(f)) return {0x7fff};
  const _Float16 h = static_cast<_Float16>(f);
  unsigned short u;
  std::memcpy(&u, &h, 2);
  return {u};
}

inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.x, 2);
  return static_cast<float>(v);
}

inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short v) { return {v}; }
