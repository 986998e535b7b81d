// Scaled sign codec ("sign1"): CPU kernels, parameter checks and the plugin's entry point.
// Built with sign_cuda.cu when CUDA is enabled (JCOCCL_PLUGIN_WITH_CUDA), alone otherwise.
#include <string>
#include <vector>

#include "jcoccl/codec_plugin.h"
#include "sign.h"

namespace {

thread_local std::string g_error;

const char* LastError() { return g_error.c_str(); }

// The block alone (4096 values: a multiple of every valid block).
int Validate(const double* params) {
  int64_t b;
  return sign1::CheckArgs(params, JCOCCL_DTYPE_F32, 4096, &b);
}

int Granule(const double* params, int64_t* granule) {
  if (Validate(params) != 0) return 1;
  *granule = static_cast<int64_t>(params[0]);
  return 0;
}

int PayloadBytes(const double* params, int64_t n, int32_t dtype, int64_t* bytes) {
  int64_t b;
  if (sign1::CheckArgs(params, dtype, n, &b) != 0) return 1;
  *bytes = sign1::PayloadBytes(n, b);
  return 0;
}

int EncodeCpu(const double* params, int32_t dtype, const void* x, int64_t rows, int64_t n,
              uint8_t* out) {
  int64_t B;
  if (sign1::CheckArgs(params, dtype, n, &B) != 0) return 1;
  const int64_t p = sign1::PayloadBytes(n, B), eb = jcoccl_dtype_bytes(dtype);
  for (int64_t r = 0; r < rows; ++r) {
    const sign1::RowValues v{dtype, static_cast<const uint8_t*>(x) + r * n * eb};
    for (int64_t b = 0; b < n / B; ++b) sign1::EncodeBlock(v, n, B, b, out + r * p);
  }
  return 0;
}

int DecodeCpu(const double* params, int32_t dtype, const uint8_t* in, int64_t rows, int64_t n,
              void* out) {
  int64_t B;
  if (sign1::CheckArgs(params, dtype, n, &B) != 0) return 1;
  const int64_t p = sign1::PayloadBytes(n, B);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i)
      jcoccl_store(dtype, out, r * n + i, sign1::DecodeAt(in + r * p, n, B, i));
  return 0;
}

int DecodeSumCpu(const double* params, int32_t dtype, const uint8_t* const* rows, int32_t nrows,
                 int64_t n, void* out) {
  int64_t B;
  if (sign1::CheckArgs(params, dtype, n, &B) != 0) return 1;
  if (nrows < 1) return sign1_fail("sign1: decode_sum needs nrows >= 1");
  for (int64_t i = 0; i < n; ++i)
    jcoccl_store(dtype, out, i, sign1::SumAt(rows, nullptr, 0, nrows, n, B, i));
  return 0;
}

int DecodeSumEncodeCpu(const double* params, int32_t dtype, const uint8_t* const* rows,
                       int32_t nrows, int64_t n, uint8_t* out) {
  int64_t B;
  if (sign1::CheckArgs(params, dtype, n, &B) != 0) return 1;
  if (nrows < 1) return sign1_fail("sign1: decode_sum_encode needs nrows >= 1");
  // The sum once per value (each is read twice: for the scale, then for the sign).
  std::vector<float> sum(n);
  const sign1::SumValues s{rows, nullptr, 0, nrows, n, B, dtype};
  for (int64_t i = 0; i < n; ++i) sum[i] = s(i);
  const sign1::RowValues v{JCOCCL_DTYPE_F32, sum.data()};
  for (int64_t b = 0; b < n / B; ++b) sign1::EncodeBlock(v, n, B, b, out);
  return 0;
}

}  // namespace

int sign1_fail(const char* message) {
  g_error = message;
  return 1;
}

#if defined(JCOCCL_PLUGIN_WITH_CUDA)
// sign_cuda.cu
int sign1_cuda_encode(const double*, int32_t, const void*, int64_t, int64_t, uint8_t*, void*);
int sign1_cuda_decode(const double*, int32_t, const uint8_t*, int64_t, int64_t, void*, void*);
int sign1_cuda_decode_sum(const double*, int32_t, const uint8_t*, int32_t, int64_t, int64_t,
                          int64_t, void*, void*);
int sign1_cuda_decode_sum_encode(const double*, int32_t, const uint8_t*, int32_t, int64_t, int64_t,
                                 int64_t, uint8_t*, void*);
#define SIGN1_CUDA(fn) fn
#else
#define SIGN1_CUDA(fn) nullptr
#endif

namespace {
const jcoccl_codec_plugin kPlugin = {
    JCOCCL_PLUGIN_ABI_VERSION,
    sizeof(jcoccl_codec_plugin),
    JCOCCL_VERSION_STRING,
    "sign1",
    1,
    {"block"},
    Validate,
    Granule,
    PayloadBytes,
    EncodeCpu,
    DecodeCpu,
    DecodeSumCpu,
    DecodeSumEncodeCpu,
    SIGN1_CUDA(sign1_cuda_encode),
    SIGN1_CUDA(sign1_cuda_decode),
    SIGN1_CUDA(sign1_cuda_decode_sum),
    SIGN1_CUDA(sign1_cuda_decode_sum_encode),
    LastError,
};
}  // namespace

extern "C" JCOCCL_PLUGIN_EXPORT const jcoccl_codec_plugin* jcoccl_codec_plugin_v1(void) {
  return &kPlugin;
}
