// The CPU codecs (cuda/cpu/codecs.cc, linked alongside) behind the C interface of
// codec_api.h: the reference the shim-run CUDA kernels are compared with.
#include <xmmintrin.h>

#include <string>

#include "codec_api.h"

namespace {
namespace jc = jcoccl::codecs;

thread_local std::string g_message;
thread_local bool g_daz = false;

// Validates the spec and row length as the CUDA launchers do.
bool Check(const jc::CodecSpec& s, int64_t n) {
  g_message.clear();
  if (const char* m = jc::Validate(s)) {
    g_message = m;
    return false;
  }
  if (n <= 0 || n % jc::Granule(s) != 0) {
    g_message = "row length is not a positive multiple of the granule";
    return false;
  }
  return true;
}

// Runs f with MXCSR's DAZ and FTZ bits as XLA:CPU sets them (when jc_set_daz(1)).
template <class F>
void WithMxcsr(F f) {
  const unsigned saved = _mm_getcsr();
  if (g_daz) _mm_setcsr(saved | 0x8040u);
  f();
  _mm_setcsr(saved);
}
}  // namespace

JC_API int jc_encode(const int32_t* spec, float abs_error, int dtype, const void* x, int64_t rows,
                     int64_t n, uint8_t* out) {
  const jc::CodecSpec s = jc_api::Spec(spec, abs_error);
  if (!Check(s, n)) return 1;
  const auto d = static_cast<jc::DType>(dtype);
  WithMxcsr([&] { jc::EncodeRowsCpu(s, d, x, rows, n, out); });
  return 0;
}

JC_API int jc_decode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                     int64_t rows, int64_t n, void* out) {
  const jc::CodecSpec s = jc_api::Spec(spec, abs_error);
  if (!Check(s, n)) return 1;
  const auto d = static_cast<jc::DType>(dtype);
  WithMxcsr([&] { jc::DecodeRowsCpu(s, d, in, rows, n, out); });
  return 0;
}

JC_API int jc_decode_sum(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                         int nrows, int64_t stride, int64_t outs, int64_t n, void* out) {
  const jc::CodecSpec s = jc_api::Spec(spec, abs_error);
  if (!Check(s, n)) return 1;
  const auto d = static_cast<jc::DType>(dtype);
  WithMxcsr([&] { jc::DecodeSumBatchCpu(s, d, in, nrows, stride, outs, n, out); });
  return 0;
}

JC_API int jc_decode_sum_encode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                                int nrows, int64_t stride, int64_t outs, int64_t n, uint8_t* out) {
  const jc::CodecSpec s = jc_api::Spec(spec, abs_error);
  if (!Check(s, n)) return 1;
  const auto d = static_cast<jc::DType>(dtype);
  WithMxcsr([&] { jc::DecodeSumEncodeBatchCpu(s, d, in, nrows, stride, outs, n, out); });
  return 0;
}

JC_API int64_t jc_payload_bytes(const int32_t* spec, float abs_error, int dtype, int64_t n) {
  return jcoccl::codecs::PayloadBytes(jc_api::Spec(spec, abs_error), n,
                                      static_cast<jcoccl::codecs::DType>(dtype));
}

JC_API const char* jc_last_message() { return g_message.c_str(); }

// 1: run the CPU codecs with denormals-are-zero and flush-to-zero, as under XLA:CPU.
JC_API void jc_set_daz(int on) { g_daz = on != 0; }
