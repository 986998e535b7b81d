// The one place that turns XLA FFI attributes into a CodecSpec, and the argument checks
// the CPU and CUDA codec handlers share.
//
// Attributes (all scalars; Python: jcoccl/_src/compressors/native.py):
//   kind: int32 (Kind), bits: int32, block: int32, symmetric: int32 (0/1),
//   fp8: int32 (Fp8Format), cast_dtype: int32 (DType), hadamard: int32 (0 = none),
//   abs_error: float32; plugin codecs (kind 6) also plugin: int32 (the library's id) and
//   params: float64[<= 8] (both optional for the other kinds); spike: int32 (optional, 0 =
//   no spike reserving).
// Bind them with `.Attrs()` (an ffi::Dictionary) and call SpecFromAttrs.
#pragma once

#include <string>

#include "codecs/codec.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

// The plugin fields of a kPlugin spec: "plugin" (int32 id) and "params" (float64 array of
// at most kMaxPluginParams values); both optional, for codecs that are not plugins.
inline xla::ffi::Error PluginFromAttrs(const xla::ffi::Dictionary& attrs, const std::string& prefix,
                                       CodecSpec* s) {
  namespace ffi = xla::ffi;
  if (attrs.contains(prefix + "plugin")) {
    auto id = attrs.get<int32_t>(prefix + "plugin");
    if (id.has_error()) return id.error();
    s->plugin = *id;
  }
  if (attrs.contains(prefix + "params")) {
    auto params = attrs.get<ffi::Span<const double>>(prefix + "params");
    if (params.has_error()) return params.error();
    if (params->size() > static_cast<size_t>(kMaxPluginParams))
      return ffi::Error::InvalidArgument("jcoccl codec: at most 8 plugin params");
    for (size_t i = 0; i < params->size(); ++i) s->params[i] = (*params)[i];
  }
  return ffi::Error::Success();
}

// The codec described by the attributes named `prefix` + the names above ("o_" for the
// outer codec of a hierarchical all-reduce); `who` starts error messages.
inline xla::ffi::ErrorOr<CodecSpec> SpecFromAttrs(const xla::ffi::Dictionary& attrs,
                                                  const std::string& prefix = "",
                                                  const char* who = "jcoccl codec: ") {
  namespace ffi = xla::ffi;
  CodecSpec s;
  auto kind = attrs.get<int32_t>(prefix + "kind");
  auto bits = attrs.get<int32_t>(prefix + "bits");
  auto block = attrs.get<int32_t>(prefix + "block");
  auto sym = attrs.get<int32_t>(prefix + "symmetric");
  auto fp8 = attrs.get<int32_t>(prefix + "fp8");
  auto cast = attrs.get<int32_t>(prefix + "cast_dtype");
  auto had = attrs.get<int32_t>(prefix + "hadamard");
  auto eps = attrs.get<float>(prefix + "abs_error");
  for (const auto* e : {&kind, &bits, &block, &sym, &fp8, &cast, &had}) {
    if (e->has_error()) return ffi::Unexpected(e->error());
  }
  if (eps.has_error()) return ffi::Unexpected(eps.error());
  s.kind = static_cast<Kind>(*kind);
  s.bits = *bits;
  s.block = *block;
  s.symmetric = *sym != 0;
  s.fp8 = static_cast<Fp8Format>(*fp8);
  s.cast_dtype = static_cast<DType>(*cast);
  s.hadamard = *had;
  s.abs_error = *eps;
  if (ffi::Error e = PluginFromAttrs(attrs, prefix, &s); e.failure()) return ffi::Unexpected(e);
  if (attrs.contains(prefix + "spike")) {
    auto k = attrs.get<int32_t>(prefix + "spike");
    if (k.has_error()) return ffi::Unexpected(k.error());
    s.spike = *k;
  }
  if (const char* msg = Validate(s)) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(who) + msg));
  }
  return s;
}

// Maps an FFI element type to DType; false if unsupported.
inline bool DTypeFromFfi(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::F32:
      *out = DType::kF32;
      return true;
    case xla::ffi::DataType::BF16:
      *out = DType::kBF16;
      return true;
    case xla::ffi::DataType::F16:
      *out = DType::kF16;
      return true;
    default:
      return false;
  }
}

// The last dimension of a buffer (1 for a scalar).
inline int64_t LastDim(const xla::ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  return dims.size() == 0 ? 1 : dims.back();
}

inline xla::ffi::Error BadArg(const std::string& what) {
  return xla::ffi::Error::InvalidArgument("jcoccl codec: " + what);
}

// A row of n elements must be a positive multiple of the codec's granule.
inline xla::ffi::Error CheckRow(const CodecSpec& s, int64_t n) {
  if (n <= 0 || n % Granule(s) != 0) {
    return BadArg("row length " + std::to_string(n) +
                  " is not a positive multiple of the granule " + std::to_string(Granule(s)));
  }
  return xla::ffi::Error::Success();
}

// Shapes of a reduction: buf uint8[batch..., nrows, P], n elements per row.
struct SumShape {
  int64_t batch = 0, nrows = 0, p = 0;
};

inline xla::ffi::Error SumShapeOf(const CodecSpec& s, DType d, const xla::ffi::AnyBuffer& buf,
                                  int64_t n, SumShape* sh) {
  if (auto e = CheckRow(s, n); e.failure()) return e;
  auto dims = buf.dimensions();
  sh->p = PayloadBytes(s, n, d);
  if (buf.element_type() != xla::ffi::DataType::U8 || dims.size() < 2 || dims.back() != sh->p ||
      dims[dims.size() - 2] < 1) {
    return BadArg(PluginContext(s, d, n) + "payload must be uint8[..., nrows >= 1, " +
                  std::to_string(sh->p) + "], got a last dimension of " +
                  std::to_string(dims.size() == 0 ? 0 : dims.back()));
  }
  sh->nrows = dims[dims.size() - 2];
  sh->batch = static_cast<int64_t>(buf.element_count()) / (sh->nrows * sh->p);
  return xla::ffi::Error::Success();
}

// decode_sum_encode's arguments: the row dtype and length from the `dtype` (0 float32,
// 1 bfloat16, 2 float16) and `n` attributes, buf's reduction shape, and an output of
// uint8[batch..., P].
inline xla::ffi::Error SumEncodeArgs(const xla::ffi::Dictionary& attrs, const CodecSpec& s,
                                     const xla::ffi::AnyBuffer& buf, const xla::ffi::AnyBuffer& out,
                                     DType* d, int64_t* n, SumShape* sh) {
  auto dt = attrs.get<int32_t>("dtype");
  auto len = attrs.get<int64_t>("n");
  if (dt.has_error()) return dt.error();
  if (len.has_error()) return len.error();
  if (*dt < 0 || *dt > 2) return BadArg("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  *d = static_cast<DType>(*dt);
  *n = *len;
  if (auto e = SumShapeOf(s, *d, buf, *n, sh); e.failure()) return e;
  if (out.element_type() != xla::ffi::DataType::U8 ||
      static_cast<int64_t>(out.element_count()) != sh->batch * sh->p) {
    return BadArg(PluginContext(s, *d, *n) + "output must be uint8[..., " + std::to_string(sh->p) +
                  "], got " + std::to_string(out.element_count()) + " bytes for " +
                  std::to_string(sh->batch) + " payloads");
  }
  return xla::ffi::Error::Success();
}

}  // namespace jcoccl::codecs
