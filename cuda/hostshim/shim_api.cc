// The CUDA codec kernels (cuda/gpu/codecs.cu, translated by tools/gpu_shim.py into
// JCOCCL_SHIM_KERNELS) run through the host shim, behind the C interface of codec_api.h.
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
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
}  // namespace

JC_API int jc_encode(const int32_t* spec, float abs_error, int dtype, const void* x, int64_t rows,
                     int64_t n, uint8_t* out) {
  Begin();
  return Done(jc::EncodeRowsCuda(jc_api::Spec(spec, abs_error), static_cast<jc::DType>(dtype), x,
                                 rows, n, out, nullptr));
}

JC_API int jc_decode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                     int64_t rows, int64_t n, void* out) {
  Begin();
  return Done(jc::DecodeRowsCuda(jc_api::Spec(spec, abs_error), static_cast<jc::DType>(dtype), in,
                                 rows, n, out, nullptr));
}

JC_API int jc_decode_sum(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                         int nrows, int64_t stride, int64_t outs, int64_t n, void* out) {
  Begin();
  return Done(jc::DecodeSumBatch(jc_api::Spec(spec, abs_error), static_cast<jc::DType>(dtype), in,
                                 nrows, stride, outs, n, out, nullptr));
}

JC_API int jc_decode_sum_encode(const int32_t* spec, float abs_error, int dtype, const uint8_t* in,
                                int nrows, int64_t stride, int64_t outs, int64_t n, uint8_t* out) {
  Begin();
  return Done(jc::DecodeSumEncodeBatch(jc_api::Spec(spec, abs_error), static_cast<jc::DType>(dtype),
                                       in, nrows, stride, outs, n, out, nullptr));
}

JC_API int64_t jc_payload_bytes(const int32_t* spec, float abs_error, int dtype, int64_t n) {
  return jcoccl::codecs::PayloadBytes(jc_api::Spec(spec, abs_error), n,
                                      static_cast<jcoccl::codecs::DType>(dtype));
}

JC_API const char* jc_last_message() { return jcoccl_shim::g_last_message.c_str(); }

// Caps the grid of every launch (0: no cap): the kernels are grid-stride loops, so any grid
// must give the same bytes; a small cap exercises the strided iterations.
JC_API void jc_set_max_grid(unsigned blocks) { jcoccl_shim::g_max_grid = blocks; }

// Selects one of tools/gpu_shim.py's deliberate defects in a mutant build (0: none).
JC_API void jc_set_mutation(int id) { jcoccl_shim::g_mutation = id; }
