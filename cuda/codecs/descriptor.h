// The codec descriptor's field table: the one description of CodecSpec's fields (name and
// member; the wire type follows from the member's C++ type) that every decoder, encoder and
// the schema exported to Python (bind_descriptor.h) are derived from.
//
// Wire types: "int32" (int32_t, an enum over int32 or a bool as 0/1), "float32" (float) and
// "float64[8]" (the plugin params; fewer values are zero-padded). A codec travels to an XLA
// FFI handler as ONE dictionary attribute ("codec", and "outer" for the outer codec of a
// hierarchical all-reduce) holding exactly these fields (Python:
// jcoccl/_src/compressors/native.py codec_attrs).
//
// Adding a field: a member of CodecSpec, a line in ForEachField, and its value in the Python
// builder (tests/test_codec_abi.py fails until both sides agree).
//
// Example:
//   auto spec = SpecFromAttrs(attrs);  // attrs: the handler's ffi::Dictionary
//   if (spec.has_error()) return spec.error();
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "codecs/codec.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {

// THE field table: f(name, member) for every field, in the schema's order. `S` is CodecSpec
// or const CodecSpec.
template <class S, class F>
void ForEachField(S& s, F&& f) {
  f("kind", s.kind);
  f("bits", s.bits);
  f("block", s.block);
  f("symmetric", s.symmetric);
  f("fp8", s.fp8);
  f("cast_dtype", s.cast_dtype);
  f("abs_error", s.abs_error);
  f("hadamard", s.hadamard);
  f("spike", s.spike);
  f("plugin", s.plugin);
  f("params", s.params);
}

// A member type and its wire form.
template <class T>
struct Wire;
template <>
struct Wire<float> {
  static constexpr const char* kName = "float32";
};
template <>
struct Wire<double[kMaxPluginParams]> {
  static constexpr const char* kName = "float64[8]";
  static_assert(kMaxPluginParams == 8, "the wire name states the params length");
};
namespace detail {
template <class T, bool = std::is_enum_v<T>>
struct IsInt32Enum : std::false_type {};
template <class T>
struct IsInt32Enum<T, true> : std::is_same<std::underlying_type_t<T>, int32_t> {};
}  // namespace detail

// int32_t, bool and the int32 enums (Kind, Fp8Format, DType) travel as int32.
template <class T>
struct Wire {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, bool> ||
                    detail::IsInt32Enum<T>::value,
                "a descriptor field must be int32_t, bool, an int32 enum, float or double[8]");
  static constexpr const char* kName = "int32";
  static T From(int32_t v) {
    if constexpr (std::is_same_v<T, bool>) {
      return v != 0;
    } else {
      return static_cast<T>(v);
    }
  }
  static int32_t To(T v) { return static_cast<int32_t>(v); }
};

template <class M>
constexpr const char* WireName() {
  return Wire<std::remove_cv_t<M>>::kName;
}

// "kind (int32), bits (int32), ...": the fields, for error messages.
inline std::string FieldList() {
  std::string out;
  const CodecSpec defaults;
  ForEachField(defaults, [&](const char* name, const auto& m) {
    out += (out.empty() ? "" : ", ") + std::string(name) + " (" +
           WireName<std::remove_reference_t<decltype(m)>>() + ")";
  });
  return out;
}

inline bool IsField(std::string_view name) {
  bool found = false;
  const CodecSpec defaults;
  ForEachField(defaults, [&](const char* f, const auto&) { found = found || name == f; });
  return found;
}

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

}  // namespace jcoccl::codecs
