// The CPU codecs (cuda/cpu/codecs.cc, linked alongside) behind the C interface of
// codec_api.h: the reference the shim-run CUDA kernels are compared with.
#include <xmmintrin.h>

#include <string>

#include "codec_api.h"

namespace {
namespace jc = jcoccl::codecs;

thread_local std::string g_message;
thread_local bool g_daz = false;

// The codec of text descriptor `spec` into *s (validated) and the row length, checked as the
// CUDA launchers check them; false (jc_last_message says why) if either is wrong.
bool Check(const char* spec, int64_t n, jc::CodecSpec* s) {
  g_message = jc_api::Spec(spec, s);
  if (!g_message.empty()) return false;
  if (n <= 0 || n % jc::Granule(*s) != 0) {
    g_message = "row length is not a positive multiple of the granule";
    return false;
  }
  return true;
}

// Runs f(codec, dtype) for the codec of `spec` and rows of n elements, with MXCSR's DAZ and
// FTZ bits as XLA:CPU sets them (when jc_set_daz(1)); 0, or 1 if the codec or n is wrong.
template <class F>
int Run(const char* spec, int dtype, int64_t n, F&& f) {
  jc::CodecSpec s;
  if (!Check(spec, n, &s)) return 1;
  const unsigned saved = _mm_getcsr();
  if (g_daz) _mm_setcsr(saved | 0x8040u);
  f(s, static_cast<jc::DType>(dtype));
  _mm_setcsr(saved);
  return 0;
}
}  // namespace

JC_API int jc_encode(const char* spec, int dtype, const void* x, int64_t rows, int64_t n,
                     uint8_t* out) {
  return Run(spec, dtype, n, [&](const jc::CodecSpec& s, jc::DType d) {
    jc::EncodeRowsCpu(s, d, x, rows, n, out);
  });
}

JC_API int jc_decode(const char* spec, int dtype, const uint8_t* in, int64_t rows, int64_t n,
                     void* out) {
  return Run(spec, dtype, n, [&](const jc::CodecSpec& s, jc::DType d) {
    jc::DecodeRowsCpu(s, d, in, rows, n, out);
  });
}

JC_API int jc_decode_sum(const char* spec, int dtype, const uint8_t* in, int nrows, int64_t stride,
                         int64_t outs, int64_t n, void* out) {
  return Run(spec, dtype, n, [&](const jc::CodecSpec& s, jc::DType d) {
    jc::DecodeSumBatchCpu(s, d, in, nrows, stride, outs, n, out);
  });
}

JC_API int jc_decode_sum_encode(const char* spec, int dtype, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out) {
  return Run(spec, dtype, n, [&](const jc::CodecSpec& s, jc::DType d) {
    jc::DecodeSumEncodeBatchCpu(s, d, in, nrows, stride, outs, n, out);
  });
}

// -1 when `spec` is no codec (jc_last_message says why).
JC_API int64_t jc_payload_bytes(const char* spec, int dtype, int64_t n) {
  jc::CodecSpec s;
  g_message = jc_api::Spec(spec, &s);
  if (!g_message.empty()) return -1;
  return jc::PayloadBytes(s, n, static_cast<jc::DType>(dtype));
}

JC_API const char* jc_last_message() { return g_message.c_str(); }

// 1: run the CPU codecs with denormals-are-zero and flush-to-zero, as under XLA:CPU.
JC_API void jc_set_daz(int on) { g_daz = on != 0; }
