// The C interface the host-shim libraries export (loaded with ctypes by tools/gpu_shim.py):
// the same four codec operations over host buffers, once from the CUDA kernels compiled
// through the shim (shim_api.cc) and once from the CPU codecs (ref_api.cc).
//
// `spec` is the codec descriptor in its text form ("kind=2 bits=4 block=32 ...", decoded by
// codecs/descriptor.h SpecFromText; Python: tools/gpu_shim.py Spec.text). Every function
// returns 0 on success, else a nonzero code and jc_last_message() says why.
#pragma once

#include <cstdint>
#include <string>

#include "codecs/codec.h"
#include "codecs/descriptor.h"

#define JC_API extern "C" __attribute__((visibility("default")))

JC_API int jc_encode(const char* spec, int dtype, const void* x, int64_t rows, int64_t n,
                     uint8_t* out);
JC_API int jc_decode(const char* spec, int dtype, const uint8_t* in, int64_t rows, int64_t n,
                     void* out);
// outs reductions; reduction o reads the nrows payloads at in + (o * nrows + r) * stride.
JC_API int jc_decode_sum(const char* spec, int dtype, const uint8_t* in, int nrows, int64_t stride,
                         int64_t outs, int64_t n, void* out);
JC_API int jc_decode_sum_encode(const char* spec, int dtype, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out);
JC_API const char* jc_last_message();
// PayloadBytes of the spec for a row of n elements of dtype.
JC_API int64_t jc_payload_bytes(const char* spec, int dtype, int64_t n);

namespace jc_api {
// The codec of text descriptor `spec`, validated; "" or what is wrong.
inline std::string Spec(const char* spec, jcoccl::codecs::CodecSpec* s) {
  if (spec == nullptr) return "spec is null";
  return jcoccl::codecs::SpecFromText(spec, s);
}
}  // namespace jc_api
