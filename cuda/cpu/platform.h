// The CPU platform of the codec handlers (codecs/handlers.h) and of the fused engine's codec
// adapter (engine/platform_codec.h): the built-in CPU codecs (cpu/codecs.cc) and a loaded
// plugin's CPU kernels (codecs/plugin.h) as the four row operations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "codecs/codec.h"
#include "codecs/plugin.h"
#include "xla/ffi/api/ffi.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jcoccl::codecs {

// XLA:CPU runs each call synchronously on the device's thread: no stream.
struct CpuPlatform {
  using Stream = std::nullptr_t;

  struct Kernels {
    int Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n, uint8_t* out,
               Stream) {
      EncodeRowsCpu(s, d, x, rows, n, out);
      return 0;
    }
    int Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n, void* out,
               Stream) {
      DecodeRowsCpu(s, d, in, rows, n, out);
      return 0;
    }
    int DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                  int64_t outs, int64_t n, void* out, Stream) {
      DecodeSumBatchCpu(s, d, in, nrows, stride, outs, n, out);
      return 0;
    }
    int DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                        int64_t outs, int64_t n, uint8_t* out, Stream) {
      DecodeSumEncodeBatchCpu(s, d, in, nrows, stride, outs, n, out);
      return 0;
    }
  };

  // The CPU plugin ABI takes one reduction at a time, as row pointers.
  struct Plugin {
    std::string Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                       uint8_t* out, Stream) {
      return PluginEncodeCpu(s, d, x, rows, n, out);
    }
    std::string Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                       void* out, Stream) {
      return PluginDecodeCpu(s, d, in, rows, n, out);
    }
    std::string DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                          int64_t outs, int64_t n, void* out, Stream) {
      for (int64_t o = 0; o < outs; ++o) {
        std::string e = PluginDecodeSumCpu(s, d, RowPointers(in, nrows, stride, o).data(), nrows, n,
                                           static_cast<uint8_t*>(out) + o * n * DTypeBytes(d));
        if (!e.empty()) return e;
      }
      return {};
    }
    std::string DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out, Stream) {
      const int64_t p = PayloadBytes(s, n, d);
      for (int64_t o = 0; o < outs; ++o) {
        std::string e = PluginDecodeSumEncodeCpu(s, d, RowPointers(in, nrows, stride, o).data(),
                                                 nrows, n, out + o * p);
        if (!e.empty()) return e;
      }
      return {};
    }
  };

  static std::string Message(int) { return {}; }
  static Stream StreamOf(void*) { return nullptr; }

  // XLA:CPU allocates large results with malloc, which maps fresh pages for every call above
  // 32 MiB: filling a 64 MiB decode output spent ~80% of its time in 4 KiB page faults here.
  // Asking for transparent huge pages on the result's aligned interior cuts that to a few
  // 2 MiB faults (Linux, THP "madvise" or "always"); elsewhere, or if refused, nothing changes.
  static void PrepareOutput(xla::ffi::Result<xla::ffi::AnyBuffer>& out) {
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
};

}  // namespace jcoccl::codecs
