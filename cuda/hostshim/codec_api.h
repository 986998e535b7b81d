// The C interface the host-shim libraries export (loaded with ctypes by tools/gpu_shim.py):
// the same four codec operations over host buffers, once from the CUDA kernels compiled
// through the shim (shim_api.cc) and once from the CPU codecs (ref_api.cc).
//
// `spec` holds CodecSpec's integer fields in the order kind, bits, block, symmetric, fp8,
// cast_dtype, hadamard, spike; `abs_error` is its float field. Every function returns 0 on success,
// else a nonzero code and jc_last_message() says why.
#pragma once

#include <cstdint>

#include "codecs/codec.h"

#define JC_API extern "C" __attribute__((visibility("default")))

JC_API int jc_encode(const int32_t* spec, float abs_error, int dtype, const void* x, int64_t rows,
                     int64_t n, uint8_t* out);
JC_API int jc_decode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                     int64_t rows, int64_t n, void* out);
// outs reductions; reduction o reads the nrows payloads at in + (o * nrows + r) * stride.
JC_API int jc_decode_sum(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                         int nrows, int64_t stride, int64_t outs, int64_t n, void* out);
JC_API int jc_decode_sum_encode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                                int nrows, int64_t stride, int64_t outs, int64_t n, uint8_t* out);
JC_API const char* jc_last_message();
// PayloadBytes of the spec for a row of n elements of dtype.
JC_API int64_t jc_payload_bytes(const int32_t* spec, float abs_error, int dtype, int64_t n);

namespace jc_api {
inline jcoccl::codecs::CodecSpec Spec(const int32_t* f, float abs_error) {
  jcoccl::codecs::CodecSpec s;
  s.kind = static_cast<jcoccl::codecs::Kind>(f[0]);
  s.bits = f[1];
  s.block = f[2];
  s.symmetric = f[3] != 0;
  s.fp8 = static_cast<jcoccl::codecs::Fp8Format>(f[4]);
  s.cast_dtype = static_cast<jcoccl::codecs::DType>(f[5]);
  s.hadamard = f[6];
  s.spike = f[7];
  s.abs_error = abs_error;
  return s;
}
}  // namespace jc_api
