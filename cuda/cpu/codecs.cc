// CPU codecs (cuda/WIRE_FORMAT.md) and their XLA FFI handlers.
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
#include "codecs/ffi_attrs.h"
#include "codecs/format.h"
#include "codecs/plugin.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

}  // namespace jcoccl::codecs

// ---- XLA FFI handlers ----------------------------------------------------------------------
namespace ffi = xla::ffi;
namespace jc = jcoccl::codecs;
using jc::BadArg;
using jc::CheckRow;
using jc::LastDim;
using jc::SumShape;
using jc::SumShapeOf;

namespace {

// XLA:CPU allocates large results with malloc, which maps fresh pages for every call above
// 32 MiB: filling a 64 MiB decode output spent ~80% of its time in 4 KiB page faults here.
// Asking for transparent huge pages on the result's aligned interior cuts that to a few
// 2 MiB faults (Linux, THP "madvise" or "always"); elsewhere, or if refused, nothing changes.
void AdviseHugePages(ffi::Result<ffi::AnyBuffer>& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(out->untyped_data());
  const uintptr_t end = begin + out->size_bytes();
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = end & ~(kHuge - 1);
  if (hi >= lo + 2 * kHuge) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)out;
#endif
}

// A plugin kernel's failure as the handler's error ("" is success).
ffi::Error PluginStatus(const std::string& e) {
  return e.empty() ? ffi::Error::Success() : ffi::Error::Internal(e);
}

// x: [..., n] -> out: uint8[..., P].
ffi::Error EncodeRowsImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(x.element_type(), &d))
    return BadArg("x must be float32, bfloat16 or float16");
  const int64_t n = LastDim(x);
  if (auto e = CheckRow(*spec, n); e.failure()) return e;
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  const int64_t p = jc::PayloadBytes(*spec, n, d);
  if (out->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(out->element_count()) != rows * p) {
    return BadArg(jc::PluginContext(*spec, d, n) + "output must be uint8[rows, " +
                  std::to_string(p) + "], got " + std::to_string(out->element_count()) +
                  " bytes for " + std::to_string(rows) + " rows");
  }
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  AdviseHugePages(out);
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginEncodeCpu(*spec, d, xp, rows, n, op));
  for (int64_t r = 0; r < rows; ++r) {
    jc::EncodeRowCpu(*spec, d, xp + r * n * jc::DTypeBytes(d), n, op + r * p);
  }
  return ffi::Error::Success();
}

// buf: uint8[..., P] -> out: dtype[..., n].
ffi::Error DecodeRowsImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(out->element_type(), &d))
    return BadArg("output must be float32, bfloat16 or float16");
  const int64_t n = LastDim(*out);
  if (auto e = CheckRow(*spec, n); e.failure()) return e;
  const int64_t rows = static_cast<int64_t>(out->element_count()) / n;
  const int64_t p = jc::PayloadBytes(*spec, n, d);
  if (buf.element_type() != ffi::DataType::U8 || LastDim(buf) != p ||
      static_cast<int64_t>(buf.element_count()) != rows * p) {
    return BadArg(jc::PluginContext(*spec, d, n) + "payload must be uint8[rows, " +
                  std::to_string(p) + "], got uint8[..., " + std::to_string(LastDim(buf)) + "]");
  }
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  AdviseHugePages(out);
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginDecodeCpu(*spec, d, bp, rows, n, op));
  for (int64_t r = 0; r < rows; ++r) {
    jc::DecodeRowCpu(*spec, d, bp + r * p, n, op + r * n * jc::DTypeBytes(d));
  }
  return ffi::Error::Success();
}

ffi::Error DecodeSumImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(out->element_type(), &d))
    return BadArg("output must be float32, bfloat16 or float16");
  const int64_t n = LastDim(*out);
  SumShape sh;
  if (auto e = SumShapeOf(*spec, d, buf, n, &sh); e.failure()) return e;
  if (static_cast<int64_t>(out->element_count()) != sh.batch * n)
    return BadArg("output must be dtype[..., n]");
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  AdviseHugePages(out);
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  std::vector<const uint8_t*> rows(sh.nrows);
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t r = 0; r < sh.nrows; ++r) rows[r] = bp + (b * sh.nrows + r) * sh.p;
    void* dst = op + b * n * jc::DTypeBytes(d);
    if (spec->kind == jc::Kind::kPlugin) {
      auto e = jc::PluginDecodeSumCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), n, dst);
      if (!e.empty()) return PluginStatus(e);
      continue;
    }
    jc::DecodeSumCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), n, dst);
  }
  return ffi::Error::Success();
}

ffi::Error DecodeSumEncodeImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  int64_t n;
  SumShape sh;
  if (auto e = jc::SumEncodeArgs(attrs, *spec, buf, *out, &d, &n, &sh); e.failure()) return e;
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  AdviseHugePages(out);
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  std::vector<const uint8_t*> rows(sh.nrows);
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t r = 0; r < sh.nrows; ++r) rows[r] = bp + (b * sh.nrows + r) * sh.p;
    if (spec->kind == jc::Kind::kPlugin) {
      auto e = jc::PluginDecodeSumEncodeCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), n,
                                            op + b * sh.p);
      if (!e.empty()) return PluginStatus(e);
      continue;
    }
    jc::DecodeSumEncodeCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), n, op + b * sh.p);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclEncodeRows, EncodeRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeRows, DecodeRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeSum, DecodeSumImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeSumEncode, DecodeSumEncodeImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
JCOCCL_REGISTER_HANDLER(JcocclEncodeRows, "jcoccl_encode_rows");
JCOCCL_REGISTER_HANDLER(JcocclDecodeRows, "jcoccl_decode_rows");
JCOCCL_REGISTER_HANDLER(JcocclDecodeSum, "jcoccl_decode_sum");
JCOCCL_REGISTER_HANDLER(JcocclDecodeSumEncode, "jcoccl_decode_sum_encode");
