// XLA FFI handlers of the CUDA codecs (kernels in codecs.cu).
// The handlers may call cudaMemcpyAsync (codec `none`), so none is declared
// command-buffer compatible.
#include <cuda_runtime.h>

#include <string>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/ffi_attrs.h"
#include "codecs/plugin.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

// ---- XLA FFI handlers ----------------------------------------------------------------------
namespace ffi = xla::ffi;
namespace jc = jcoccl::codecs;
using jc::BadArg;
using jc::CheckRow;
using jc::LastDim;
using jc::SumShape;
using jc::SumShapeOf;

namespace {

ffi::Error CudaStatus(cudaError_t e) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jcoccl codec: CUDA error ") + cudaGetErrorString(e));
}

ffi::Error PluginStatus(const std::string& e) {
  return e.empty() ? ffi::Error::Success() : ffi::Error::Internal(e);
}

ffi::Error EncodeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
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
    return BadArg("output must be uint8[rows, " + std::to_string(p) + "]");
  }
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginEncodeCuda(*spec, d, x.untyped_data(), rows, n,
                                             static_cast<uint8_t*>(out->untyped_data()), stream));
  return CudaStatus(jc::EncodeRowsCuda(*spec, d, x.untyped_data(), rows, n,
                                       static_cast<uint8_t*>(out->untyped_data()), stream));
}

ffi::Error DecodeRowsImpl(cudaStream_t stream, ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
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
    return BadArg("payload must be uint8[rows, " + std::to_string(p) + "]");
  }
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginDecodeCuda(*spec, d,
                                             static_cast<const uint8_t*>(buf.untyped_data()), rows,
                                             n, out->untyped_data(), stream));
  return CudaStatus(jc::DecodeRowsCuda(*spec, d, static_cast<const uint8_t*>(buf.untyped_data()),
                                       rows, n, out->untyped_data(), stream));
}

ffi::Error DecodeSumImpl(cudaStream_t stream, ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
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
  if (sh.nrows > (1 << 30)) return BadArg("too many rows");
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginDecodeSumCuda(
        *spec, d, static_cast<const uint8_t*>(buf.untyped_data()), static_cast<int>(sh.nrows), sh.p,
        sh.batch, n, out->untyped_data(), stream));
  return CudaStatus(jc::DecodeSumBatch(*spec, d, static_cast<const uint8_t*>(buf.untyped_data()),
                                       static_cast<int>(sh.nrows), sh.p, sh.batch, n,
                                       out->untyped_data(), stream));
}

ffi::Error DecodeSumEncodeImpl(cudaStream_t stream, ffi::AnyBuffer buf,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  int64_t n;
  SumShape sh;
  if (auto e = jc::SumEncodeArgs(attrs, *spec, buf, *out, &d, &n, &sh); e.failure()) return e;
  if (sh.nrows > (1 << 30)) return BadArg("too many rows");
  if (spec->kind == jc::Kind::kPlugin)
    return PluginStatus(jc::PluginDecodeSumEncodeCuda(
        *spec, d, static_cast<const uint8_t*>(buf.untyped_data()), static_cast<int>(sh.nrows), sh.p,
        sh.batch, n, static_cast<uint8_t*>(out->untyped_data()), stream));
  return CudaStatus(jc::DecodeSumEncodeBatch(
      *spec, d, static_cast<const uint8_t*>(buf.untyped_data()), static_cast<int>(sh.nrows), sh.p,
      sh.batch, n, static_cast<uint8_t*>(out->untyped_data()), stream));
}

}  // namespace

#define JCOCCL_CODEC_BINDING                    \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Arg<ffi::AnyBuffer>()                    \
      .Ret<ffi::AnyBuffer>()                    \
      .Attrs()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclGpuEncodeRows, EncodeRowsImpl, JCOCCL_CODEC_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclGpuDecodeRows, DecodeRowsImpl, JCOCCL_CODEC_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclGpuDecodeSum, DecodeSumImpl, JCOCCL_CODEC_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclGpuDecodeSumEncode, DecodeSumEncodeImpl, JCOCCL_CODEC_BINDING);
JCOCCL_REGISTER_HANDLER(JcocclGpuEncodeRows, "jcoccl_encode_rows");
JCOCCL_REGISTER_HANDLER(JcocclGpuDecodeRows, "jcoccl_decode_rows");
JCOCCL_REGISTER_HANDLER(JcocclGpuDecodeSum, "jcoccl_decode_sum");
JCOCCL_REGISTER_HANDLER(JcocclGpuDecodeSumEncode, "jcoccl_decode_sum_encode");
