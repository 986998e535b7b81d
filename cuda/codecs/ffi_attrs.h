// The argument checks the CPU and CUDA codec handlers share, and the decoding of the codec
// descriptor's FFI form: the dictionary attribute "codec" (and "outer"), decoded by
// SpecFromAttrs from the field table of codecs/descriptor.h; bind the attributes with
// `.Attrs()` (an ffi::Dictionary).
//
// Example:
//   auto spec = SpecFromAttrs(attrs);  // attrs: the handler's ffi::Dictionary
//   if (spec.has_error()) return spec.error();
#pragma once

#include <string>
#include <type_traits>

#include "codecs/codec.h"
#include "codecs/descriptor.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

namespace detail {

// One field from an FFI dictionary into its member; "" or what is wrong.
template <class M>
std::string FieldFromFfi(const xla::ffi::Dictionary& d, const char* name, M& m) {
  namespace ffi = xla::ffi;
  const std::string what = std::string("field '") + name + "' (" + WireName<M>() + ")";
  if (!d.contains(name)) return what + " is missing";
  if constexpr (std::is_same_v<M, float>) {
    auto v = d.get<float>(name);
    if (v.has_error()) return what + " has another type: " + v.error().message();
    m = *v;
  } else if constexpr (std::is_array_v<M>) {
    auto v = d.get<ffi::Span<const double>>(name);
    if (v.has_error()) return what + " has another type: " + v.error().message();
    if (v->size() > static_cast<size_t>(kMaxPluginParams))
      return what + " holds " + std::to_string(v->size()) + " values";
    for (size_t i = 0; i < v->size(); ++i) m[i] = (*v)[i];
  } else {
    auto v = d.get<int32_t>(name);
    if (v.has_error()) return what + " has another type: " + v.error().message();
    m = Wire<M>::From(*v);
  }
  return {};
}

}  // namespace detail

// The codec in dictionary `d`, validated; errors start with `who`.
inline xla::ffi::ErrorOr<CodecSpec> SpecFromDict(const xla::ffi::Dictionary& d, const char* who) {
  namespace ffi = xla::ffi;
  auto bad = [&](const std::string& msg) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(who) + msg));
  };
  for (auto it = d.begin(); it != d.end(); ++it) {
    if (!IsField(*it))
      return bad("unknown codec field '" + std::string(*it) + "'; the fields are " + FieldList());
  }
  CodecSpec s;
  std::string err;
  ForEachField(s, [&](const char* name, auto& m) {
    if (err.empty()) err = detail::FieldFromFfi(d, name, m);
  });
  if (!err.empty()) return bad("codec " + err + "; the fields are " + FieldList());
  if (const char* msg = Validate(s)) return bad(msg);
  return s;
}

// The codec of dictionary attribute `name` ("codec"; "outer" for a hierarchical
// all-reduce's outer codec) of a handler's attributes.
inline xla::ffi::ErrorOr<CodecSpec> SpecFromAttrs(const xla::ffi::Dictionary& attrs,
                                                  const char* name = "codec",
                                                  const char* who = "jcoccl codec: ") {
  namespace ffi = xla::ffi;
  auto bad = [&](const std::string& msg) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(who) + msg));
  };
  if (!attrs.contains(name))
    return bad(std::string("attribute '") + name + "' (the codec descriptor: a dictionary of " +
               FieldList() + ") is missing");
  auto d = attrs.get<ffi::Dictionary>(name);
  if (d.has_error())
    return bad(std::string("attribute '") + name + "' must be a dictionary of " + FieldList() +
               ": " + d.error().message());
  return SpecFromDict(*d, who);
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
