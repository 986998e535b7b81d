// The one place that turns XLA FFI attributes into a CodecSpec.
//
// Attributes (all scalars; Python: jcoccl/_src/compressors/native.py):
//   kind: int32 (Kind), bits: int32, block: int32, symmetric: int32 (0/1),
//   fp8: int32 (Fp8Format), cast_dtype: int32 (DType), hadamard: int32 (0 = none),
//   abs_error: float32.
// Bind them with `.Attrs()` (an ffi::Dictionary) and call SpecFromAttrs.
#pragma once

#include <string>

#include "codecs/codec.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

inline xla::ffi::ErrorOr<CodecSpec> SpecFromAttrs(const xla::ffi::Dictionary& attrs) {
  namespace ffi = xla::ffi;
  CodecSpec s;
  auto kind = attrs.get<int32_t>("kind");
  auto bits = attrs.get<int32_t>("bits");
  auto block = attrs.get<int32_t>("block");
  auto sym = attrs.get<int32_t>("symmetric");
  auto fp8 = attrs.get<int32_t>("fp8");
  auto cast = attrs.get<int32_t>("cast_dtype");
  auto had = attrs.get<int32_t>("hadamard");
  auto eps = attrs.get<float>("abs_error");
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
  if (const char* msg = Validate(s)) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("jcoccl codec: ") + msg));
  }
  return s;
}

// Maps an FFI element type to DType; false if unsupported.
inline bool DTypeFromFfi(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::F32: *out = DType::kF32; return true;
    case xla::ffi::DataType::BF16: *out = DType::kBF16; return true;
    case xla::ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

}  // namespace jcoccl::codecs
