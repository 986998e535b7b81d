// CPU codecs (cuda/WIRE_FORMAT.md) and their XLA FFI handlers (codecs/handlers.h).
//
// Single-threaded per call: XLA:CPU already runs each device's program on its own thread.
// The handlers call no kernels of their own, so they declare no command-buffer traits.
//
// The row kernels (cpu/codec_kernels.inc) are compiled twice: for the baseline x86-64 ISA
// and, on x86, for AVX2 (+F16C); the public entry points pick one at run time. Both builds compute
// the same bits (IEEE float32 operations, no FMA: the build uses -ffp-contract=off).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "codecs/codec.h"
#include "codecs/format.h"
#include "codecs/handlers.h"
#include "cpu/platform.h"
#include "xla/ffi/api/ffi.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define JCOCCL_CPU_AVX2 1
#include <immintrin.h>
#endif

namespace jcoccl::codecs {

namespace base {
#include "cpu/codec_kernels.inc"
}  // namespace base

#if defined(JCOCCL_CPU_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,f16c,bmi,bmi2,popcnt,lzcnt")
#define JCOCCL_KERNELS_F16C 1  // GCC defines no __F16C__ under a target pragma
namespace avx2 {
#include "cpu/codec_kernels.inc"
}  // namespace avx2
#undef JCOCCL_KERNELS_F16C
#pragma GCC pop_options
#endif

namespace {
bool UseAvx2() {
#if defined(JCOCCL_CPU_AVX2)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}
}  // namespace

#if defined(JCOCCL_CPU_AVX2)
#define JCOCCL_DISPATCH(fn, ...) (UseAvx2() ? avx2::fn(__VA_ARGS__) : base::fn(__VA_ARGS__))
#else
#define JCOCCL_DISPATCH(fn, ...) base::fn(__VA_ARGS__)
#endif

void EncodeRowCpu(const CodecSpec& s, DType d, const void* x, int64_t n, uint8_t* out) {
  JCOCCL_DISPATCH(EncodeRow, s, d, x, n, out);
}

void DecodeRowCpu(const CodecSpec& s, DType d, const uint8_t* in, int64_t n, void* out) {
  JCOCCL_DISPATCH(DecodeRow, s, d, in, n, out);
}

void DecodeSumCpu(const CodecSpec& s, DType d, const uint8_t* const* rows, int nrows, int64_t n,
                  void* out) {
  JCOCCL_DISPATCH(DecodeSum, s, d, rows, nrows, n, out);
}

void DecodeSumEncodeCpu(const CodecSpec& s, DType d, const uint8_t* const* rows, int nrows,
                        int64_t n, uint8_t* out) {
  JCOCCL_DISPATCH(DecodeSumEncode, s, d, rows, nrows, n, out);
}

void EncodeRowsCpu(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                   uint8_t* out) {
  const int64_t p = PayloadBytes(s, n, d), rb = n * DTypeBytes(d);
  for (int64_t r = 0; r < rows; ++r)
    EncodeRowCpu(s, d, static_cast<const uint8_t*>(x) + r * rb, n, out + r * p);
}

void DecodeRowsCpu(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                   void* out) {
  const int64_t p = PayloadBytes(s, n, d), rb = n * DTypeBytes(d);
  for (int64_t r = 0; r < rows; ++r)
    DecodeRowCpu(s, d, in + r * p, n, static_cast<uint8_t*>(out) + r * rb);
}

std::vector<const uint8_t*> RowPointers(const uint8_t* in, int nrows, int64_t row_stride,
                                        int64_t o) {
  std::vector<const uint8_t*> rows(nrows);
  for (int r = 0; r < nrows; ++r) rows[r] = in + (o * nrows + r) * row_stride;
  return rows;
}

void DecodeSumBatchCpu(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                       int64_t row_stride, int64_t outs, int64_t n, void* out) {
  for (int64_t o = 0; o < outs; ++o)
    DecodeSumCpu(s, d, RowPointers(in, nrows, row_stride, o).data(), nrows, n,
                 static_cast<uint8_t*>(out) + o * n * DTypeBytes(d));
}

void DecodeSumEncodeBatchCpu(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                             int64_t row_stride, int64_t outs, int64_t n, uint8_t* out) {
  const int64_t p = PayloadBytes(s, n, d);
  for (int64_t o = 0; o < outs; ++o)
    DecodeSumEncodeCpu(s, d, RowPointers(in, nrows, row_stride, o).data(), nrows, n, out + o * p);
}

}  // namespace jcoccl::codecs

// ---- XLA FFI handlers (codecs/handlers.h over cpu/platform.h) --------------------------
namespace ffi = xla::ffi;

JCOCCL_DEFINE_CODEC_HANDLERS(Jcoccl, ::jcoccl::codecs::CpuPlatform, JCOCCL_NO_STREAM,
                             ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
