// The four codec FFI handlers (encode_rows, decode_rows, decode_sum, decode_sum_encode),
// written once for every platform, and the one choice between a plugin's kernels and the
// built-in ones (RunRowOps), which the fused engine's codec adapter shares
// (engine/platform_codec.h). A platform is a traits struct P (cpu/platform.h,
// gpu/platform.h):
//
//   using Stream = ...;                   // what the row operations run on
//   struct Kernels { ... };               // the built-in codecs' row operations
//   struct Plugin { ... };                // the same four, through a loaded plugin
//   static std::string Message(K);        // a Kernels result: "" or what failed
//   static Stream StreamOf(void*);        // a fused engine lane's stream
//   static void PrepareOutput(ffi::Result<ffi::AnyBuffer>&);  // before an output is written
//
// Kernels and Plugin each have, with the semantics of codecs/codec_cuda.h's batched forms:
//   Encode(spec, dtype, x, rows, n, out, stream)
//   Decode(spec, dtype, in, rows, n, out, stream)
//   DecodeSum(spec, dtype, in, nrows, row_stride, outs, n, out, stream)
//   DecodeSumEncode(spec, dtype, in, nrows, row_stride, outs, n, out, stream)
// Plugin's return "" or the plugin's message (codecs/plugin.h); Kernels' return what
// P::Message maps. Which of the two runs is decided in one place, RunRowOps.
//
// Example (a platform whose handlers take no stream context):
//   JCOCCL_DEFINE_CODEC_HANDLERS(Jcoccl, CpuPlatform, JCOCCL_NO_STREAM,
//                                ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
#pragma once

#include <string>
#include <utility>

#include "codecs/codec.h"
#include "codecs/ffi_attrs.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

// Runs `f` on the plugin's row operations for a plugin codec, else on the built-in kernels;
// "" or what failed. The one plugin branch of the handlers and the fused engine.
template <class P, class F>
std::string RunRowOps(const CodecSpec& s, F&& f) {
  if (s.kind == Kind::kPlugin) return f(typename P::Plugin{});
  return P::Message(f(typename P::Kernels{}));
}

// RunRowOps as an FFI error.
template <class P, class F>
xla::ffi::Error RunOps(const CodecSpec& s, F&& f) {
  const std::string e = RunRowOps<P>(s, std::forward<F>(f));
  return e.empty() ? xla::ffi::Error::Success() : xla::ffi::Error::Internal(e);
}

template <class P>
struct CodecHandlers {
  using Stream = typename P::Stream;
  using Buffer = xla::ffi::AnyBuffer;
  using Out = xla::ffi::Result<xla::ffi::AnyBuffer>;

  // The codec of `attrs` and the row dtype of `rows` (the float buffer; `what` names it).
  static xla::ffi::Error CodecAndDType(const xla::ffi::Dictionary& attrs, const Buffer& rows,
                                       const char* what, CodecSpec* spec, DType* d) {
    auto s = SpecFromAttrs(attrs);
    if (s.has_error()) return s.error();
    *spec = *s;
    if (!DTypeFromFfi(rows.element_type(), d))
      return BadArg(std::string(what) + " must be float32, bfloat16 or float16");
    return xla::ffi::Error::Success();
  }

  // x: [..., n] -> out: uint8[..., P].
  static xla::ffi::Error EncodeRows(Stream stream, Buffer x, Out out, xla::ffi::Dictionary attrs) {
    CodecSpec spec;
    DType d;
    if (auto e = CodecAndDType(attrs, x, "x", &spec, &d); e.failure()) return e;
    const int64_t n = LastDim(x);
    if (auto e = CheckRow(spec, n); e.failure()) return e;
    const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
    const int64_t p = PayloadBytes(spec, n, d);
    if (out->element_type() != xla::ffi::DataType::U8 ||
        static_cast<int64_t>(out->element_count()) != rows * p) {
      return BadArg(PluginContext(spec, d, n) + "output must be uint8[rows, " + std::to_string(p) +
                    "], got " + std::to_string(out->element_count()) + " bytes for " +
                    std::to_string(rows) + " rows");
    }
    P::PrepareOutput(out);
    auto* o = static_cast<uint8_t*>(out->untyped_data());
    return RunOps<P>(
        spec, [&](auto ops) { return ops.Encode(spec, d, x.untyped_data(), rows, n, o, stream); });
  }

  // buf: uint8[..., P] -> out: dtype[..., n].
  static xla::ffi::Error DecodeRows(Stream stream, Buffer buf, Out out,
                                    xla::ffi::Dictionary attrs) {
    CodecSpec spec;
    DType d;
    if (auto e = CodecAndDType(attrs, *out, "output", &spec, &d); e.failure()) return e;
    const int64_t n = LastDim(*out);
    if (auto e = CheckRow(spec, n); e.failure()) return e;
    const int64_t rows = static_cast<int64_t>(out->element_count()) / n;
    const int64_t p = PayloadBytes(spec, n, d);
    if (buf.element_type() != xla::ffi::DataType::U8 || LastDim(buf) != p ||
        static_cast<int64_t>(buf.element_count()) != rows * p) {
      return BadArg(PluginContext(spec, d, n) + "payload must be uint8[rows, " + std::to_string(p) +
                    "], got uint8[..., " + std::to_string(LastDim(buf)) + "]");
    }
    P::PrepareOutput(out);
    const auto* in = static_cast<const uint8_t*>(buf.untyped_data());
    return RunOps<P>(spec, [&](auto ops) {
      return ops.Decode(spec, d, in, rows, n, out->untyped_data(), stream);
    });
  }

  // buf: uint8[batch..., nrows, P] -> out: dtype[batch..., n], each the sum of its nrows.
  static xla::ffi::Error DecodeSum(Stream stream, Buffer buf, Out out, xla::ffi::Dictionary attrs) {
    CodecSpec spec;
    DType d;
    if (auto e = CodecAndDType(attrs, *out, "output", &spec, &d); e.failure()) return e;
    const int64_t n = LastDim(*out);
    SumShape sh;
    if (auto e = SumShapeOf(spec, d, buf, n, &sh); e.failure()) return e;
    if (static_cast<int64_t>(out->element_count()) != sh.batch * n)
      return BadArg("output must be dtype[..., n]");
    if (sh.nrows > (1 << 30)) return BadArg("too many rows");
    P::PrepareOutput(out);
    const auto* in = static_cast<const uint8_t*>(buf.untyped_data());
    return RunOps<P>(spec, [&](auto ops) {
      return ops.DecodeSum(spec, d, in, static_cast<int>(sh.nrows), sh.p, sh.batch, n,
                           out->untyped_data(), stream);
    });
  }

  // buf: uint8[batch..., nrows, P] -> out: uint8[batch..., P], encode(decode_sum(rows)).
  static xla::ffi::Error DecodeSumEncode(Stream stream, Buffer buf, Out out,
                                         xla::ffi::Dictionary attrs) {
    auto s = SpecFromAttrs(attrs);
    if (s.has_error()) return s.error();
    const CodecSpec spec = *s;
    DType d;
    int64_t n;
    SumShape sh;
    if (auto e = SumEncodeArgs(attrs, spec, buf, *out, &d, &n, &sh); e.failure()) return e;
    if (sh.nrows > (1 << 30)) return BadArg("too many rows");
    P::PrepareOutput(out);
    const auto* in = static_cast<const uint8_t*>(buf.untyped_data());
    auto* o = static_cast<uint8_t*>(out->untyped_data());
    return RunOps<P>(spec, [&](auto ops) {
      return ops.DecodeSumEncode(spec, d, in, static_cast<int>(sh.nrows), sh.p, sh.batch, n, o,
                                 stream);
    });
  }
};

// A handler of a platform without a stream context (XLA:CPU), bound with no .Ctx<>().
template <auto F>
xla::ffi::Error NoStream(xla::ffi::AnyBuffer a, xla::ffi::Result<xla::ffi::AnyBuffer> r,
                         xla::ffi::Dictionary attrs) {
  return F(nullptr, a, r, attrs);
}

}  // namespace jcoccl::codecs

// WRAP for JCOCCL_DEFINE_CODEC_HANDLERS: the handler as it is, or without a stream.
#define JCOCCL_WITH_STREAM(f) f
#define JCOCCL_NO_STREAM(f) ::jcoccl::codecs::NoStream<f>

// Defines the four handler symbols <Name>EncodeRows ... <Name>DecodeSumEncode of
// CodecHandlers<P> (each wrapped by WRAP: JCOCCL_WITH_STREAM or JCOCCL_NO_STREAM) with
// `binding`, and registers them under the jcoccl_* target names.
#define JCOCCL_CODEC_HANDLER(Name, P, Op, WRAP, binding, target)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name##Op, WRAP(&::jcoccl::codecs::CodecHandlers<P>::Op), binding); \
  JCOCCL_REGISTER_HANDLER(Name##Op, target)
#define JCOCCL_DEFINE_CODEC_HANDLERS(Name, P, WRAP, binding)                      \
  JCOCCL_CODEC_HANDLER(Name, P, EncodeRows, WRAP, binding, "jcoccl_encode_rows"); \
  JCOCCL_CODEC_HANDLER(Name, P, DecodeRows, WRAP, binding, "jcoccl_decode_rows"); \
  JCOCCL_CODEC_HANDLER(Name, P, DecodeSum, WRAP, binding, "jcoccl_decode_sum");   \
  JCOCCL_CODEC_HANDLER(Name, P, DecodeSumEncode, WRAP, binding, "jcoccl_decode_sum_encode")
