// The CUDA codec kernels (cuda/gpu/codecs.cu, translated by tools/gpu_shim.py into
// JCOCCL_SHIM_KERNELS) run through the host shim, behind the C interface of codec_api.h.
#include "as_nvcc.h"  // nvcc's macros, before any CUDA source
#include "cuda_runtime.h"

#include JCOCCL_SHIM_KERNELS

#include <string>

#include "codec_api.h"

namespace {
namespace jc = jcoccl::codecs;

int Done(cudaError_t e) {
  if (e != cudaSuccess && jcoccl_shim::g_last_message.empty())
    jcoccl_shim::g_last_message = cudaGetErrorString(e);
  return static_cast<int>(e);
}

void Begin() {
  jcoccl_shim::g_last_error = cudaSuccess;
  jcoccl_shim::g_last_message.clear();
}

// The codec of text descriptor `spec` into *s; false (jc_last_message says why) if it is none.
bool Parse(const char* spec, jc::CodecSpec* s) {
  std::string e = jc_api::Spec(spec, s);
  if (e.empty()) return true;
  jcoccl_shim::g_last_message = std::move(e);
  return false;
}

// f(codec, dtype)'s cudaError_t for the codec of `spec`, or cudaErrorInvalidValue if it is none.
template <class F>
int Run(const char* spec, int dtype, F&& f) {
  Begin();
  jc::CodecSpec s;
  if (!Parse(spec, &s)) return cudaErrorInvalidValue;
  return Done(f(s, static_cast<jc::DType>(dtype)));
}
}  // namespace

JC_API int jc_encode(const char* spec, int dtype, const void* x, int64_t rows, int64_t n,
                     uint8_t* out) {
  return Run(spec, dtype, [&](const jc::CodecSpec& s, jc::DType d) {
    return jc::EncodeRowsCuda(s, d, x, rows, n, out, nullptr);
  });
}

JC_API int jc_decode(const char* spec, int dtype, const uint8_t* in, int64_t rows, int64_t n,
                     void* out) {
  return Run(spec, dtype, [&](const jc::CodecSpec& s, jc::DType d) {
    return jc::DecodeRowsCuda(s, d, in, rows, n, out, nullptr);
  });
}

JC_API int jc_decode_sum(const char* spec, int dtype, const uint8_t* in, int nrows, int64_t stride,
                         int64_t outs, int64_t n, void* out) {
  return Run(spec, dtype, [&](const jc::CodecSpec& s, jc::DType d) {
    return jc::DecodeSumBatch(s, d, in, nrows, stride, outs, n, out, nullptr);
  });
}

JC_API int jc_decode_sum_encode(const char* spec, int dtype, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out) {
  return Run(spec, dtype, [&](const jc::CodecSpec& s, jc::DType d) {
    return jc::DecodeSumEncodeBatch(s, d, in, nrows, stride, outs, n, out, nullptr);
  });
}

// -1 when `spec` is no codec (jc_last_message says why).
JC_API int64_t jc_payload_bytes(const char* spec, int dtype, int64_t n) {
  Begin();
  jc::CodecSpec s;
  if (!Parse(spec, &s)) return -1;
  return jc::PayloadBytes(s, n, static_cast<jc::DType>(dtype));
}

JC_API const char* jc_last_message() { return jcoccl_shim::g_last_message.c_str(); }

// Caps the grid of every launch (0: no cap): the kernels are grid-stride loops, so any grid
// must give the same bytes; a small cap exercises the strided iterations.
JC_API void jc_set_max_grid(unsigned blocks) { jcoccl_shim::g_max_grid = blocks; }

// Selects one of tools/gpu_shim.py's deliberate defects in a mutant build (0: none).
JC_API void jc_set_mutation(int id) { jcoccl_shim::g_mutation = id; }
