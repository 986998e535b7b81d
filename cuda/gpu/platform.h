// The CUDA platform of the codec handlers (codecs/handlers.h) and of the fused engine's codec
// adapter (engine/platform_codec.h): the CUDA codecs (gpu/codecs.cu) and a loaded plugin's
// CUDA kernels (codecs/plugin.h) as the four row operations, each enqueued on a stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/plugin.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

// Every operation is enqueued on the stream it is given (XLA's, or a fused engine lane's).
struct CudaPlatform {
  using Stream = cudaStream_t;

  struct Kernels {
    cudaError_t Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                       uint8_t* out, Stream st) {
      return EncodeRowsCuda(s, d, x, rows, n, out, st);
    }
    cudaError_t Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                       void* out, Stream st) {
      return DecodeRowsCuda(s, d, in, rows, n, out, st);
    }
    cudaError_t DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                          int64_t outs, int64_t n, void* out, Stream st) {
      return DecodeSumBatch(s, d, in, nrows, stride, outs, n, out, st);
    }
    cudaError_t DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out, Stream st) {
      return DecodeSumEncodeBatch(s, d, in, nrows, stride, outs, n, out, st);
    }
  };

  struct Plugin {
    std::string Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                       uint8_t* out, Stream st) {
      return PluginEncodeCuda(s, d, x, rows, n, out, st);
    }
    std::string Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                       void* out, Stream st) {
      return PluginDecodeCuda(s, d, in, rows, n, out, st);
    }
    std::string DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                          int64_t outs, int64_t n, void* out, Stream st) {
      return PluginDecodeSumCuda(s, d, in, nrows, stride, outs, n, out, st);
    }
    std::string DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out, Stream st) {
      return PluginDecodeSumEncodeCuda(s, d, in, nrows, stride, outs, n, out, st);
    }
  };

  static std::string Message(cudaError_t e) {
    if (e == cudaSuccess) return {};
    return std::string("jcoccl codec: CUDA error ") + cudaGetErrorString(e);
  }
  static Stream StreamOf(void* s) { return static_cast<cudaStream_t>(s); }

  static void PrepareOutput(xla::ffi::Result<xla::ffi::AnyBuffer>&) {}
};

}  // namespace jcoccl::codecs
