// XLA FFI handlers of the CUDA codecs (codecs/handlers.h over the kernels of codecs.cu).
// The handlers may call cudaMemcpyAsync (codec `none`), so none is declared
// command-buffer compatible.
#include <cuda_runtime.h>

#include <string>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/handlers.h"
#include "codecs/plugin.h"
#include "xla/ffi/api/ffi.h"

namespace {
namespace ffi = xla::ffi;
namespace jc = jcoccl::codecs;

// Every operation is enqueued on XLA's stream.
struct CudaPlatform {
  using Stream = cudaStream_t;
  using CodecSpec = jc::CodecSpec;
  using DType = jc::DType;

  struct Kernels {
    cudaError_t Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                       uint8_t* out, Stream st) {
      return jc::EncodeRowsCuda(s, d, x, rows, n, out, st);
    }
    cudaError_t Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                       void* out, Stream st) {
      return jc::DecodeRowsCuda(s, d, in, rows, n, out, st);
    }
    cudaError_t DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                          int64_t outs, int64_t n, void* out, Stream st) {
      return jc::DecodeSumBatch(s, d, in, nrows, stride, outs, n, out, st);
    }
    cudaError_t DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out, Stream st) {
      return jc::DecodeSumEncodeBatch(s, d, in, nrows, stride, outs, n, out, st);
    }
  };

  struct Plugin {
    std::string Encode(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                       uint8_t* out, Stream st) {
      return jc::PluginEncodeCuda(s, d, x, rows, n, out, st);
    }
    std::string Decode(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                       void* out, Stream st) {
      return jc::PluginDecodeCuda(s, d, in, rows, n, out, st);
    }
    std::string DecodeSum(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                          int64_t outs, int64_t n, void* out, Stream st) {
      return jc::PluginDecodeSumCuda(s, d, in, nrows, stride, outs, n, out, st);
    }
    std::string DecodeSumEncode(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t stride, int64_t outs, int64_t n, uint8_t* out, Stream st) {
      return jc::PluginDecodeSumEncodeCuda(s, d, in, nrows, stride, outs, n, out, st);
    }
  };

  static ffi::Error Status(cudaError_t e) {
    if (e == cudaSuccess) return ffi::Error::Success();
    return ffi::Error::Internal(std::string("jcoccl codec: CUDA error ") + cudaGetErrorString(e));
  }

  static void PrepareOutput(ffi::Result<ffi::AnyBuffer>&) {}
};

}  // namespace

JCOCCL_DEFINE_CODEC_HANDLERS(JcocclGpu, CudaPlatform, JCOCCL_WITH_STREAM,
                             ffi::Ffi::Bind()
                                 .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                 .Arg<ffi::AnyBuffer>()
                                 .Ret<ffi::AnyBuffer>()
                                 .Attrs());
