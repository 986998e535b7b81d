// The codec descriptor's field table: the one description of CodecSpec's fields (name and
// member; the wire type follows from the member's C++ type) that every decoder, encoder and
// the schema exported to Python (bind_descriptor.h) are derived from.
//
// Wire types: "int32" (int32_t, an enum over int32 or a bool as 0/1), "float32" (float) and
// "float64[8]" (the plugin params; fewer values are zero-padded). A codec travels in one of
// two forms, each decoded by one function generated from the table:
//   - to an XLA FFI handler, as ONE dictionary attribute ("codec", and "outer" for the outer
//     codec of a hierarchical all-reduce) holding exactly these fields: SpecFromAttrs
//     (codecs/ffi_attrs.h; Python: jcoccl/_src/compressors/native.py codec_attrs);
//   - through a C interface or a file (the host shim's jc_* functions, jcoccl_codec_time,
//     the NCCL interposer's rules), as text: space-separated name=value pairs, SpecFromText
//     below (Python: native.py codec_text).
//
// Adding a field: a member of CodecSpec, a line in ForEachField, and its value in the Python
// builder (tests/test_codec_abi.py fails until both sides agree).
//
// Example:
//   CodecSpec spec;
//   std::string err = SpecFromText("kind=2 bits=4 block=32", &spec);  // "" or what is wrong
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

#include "codecs/codec.h"

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

// The whole of `v` as a number (strtol / strtof / strtod); false if anything is left over or
// an integer is out of range. A float is what strto* rounds it to (a subnormal included).
template <class T>
bool NumberFromText(std::string_view v, T* out) {
  const std::string s(v);
  if (s.empty() || s.find_first_of(" \t\n") != std::string::npos) return false;
  char* end = nullptr;
  if constexpr (std::is_same_v<T, int32_t>) {
    const long x = std::strtol(s.c_str(), &end, 10);
    if (x < INT32_MIN || x > INT32_MAX) return false;
    *out = static_cast<int32_t>(x);
  } else if constexpr (std::is_same_v<T, float>) {
    *out = std::strtof(s.c_str(), &end);
  } else {
    *out = std::strtod(s.c_str(), &end);
  }
  return end == s.c_str() + s.size();
}

// One field's text into its member; "" or what is wrong.
template <class M>
std::string FieldFromText(const char* name, std::string_view v, M& m) {
  const std::string bad = std::string("field '") + name + "' (" + WireName<M>() + ") cannot be '" +
                          std::string(v) + "'";
  if constexpr (std::is_same_v<M, float>) {
    if (!NumberFromText(v, &m)) return bad;
  } else if constexpr (std::is_array_v<M>) {
    // Comma-separated, zero-padded ("" is every value zero).
    size_t i = 0;
    for (double& x : m) x = 0.0;
    while (!v.empty()) {
      const size_t comma = v.find(',');
      if (i == static_cast<size_t>(kMaxPluginParams) || !NumberFromText(v.substr(0, comma), &m[i]))
        return bad;
      ++i;
      v = comma == std::string_view::npos ? std::string_view() : v.substr(comma + 1);
    }
  } else {
    int32_t i = 0;
    if (!NumberFromText(v, &i)) return bad;
    m = Wire<M>::From(i);
  }
  return {};
}

}  // namespace detail

// Sets the field `name` of `s` from its text `value` (int32: a decimal integer; float32 and
// float64: what strtof / strtod read; float64[8]: up to 8 of them, comma-separated).
// Returns "" when set, else what is wrong; `*known` says whether `name` is a field at all
// (a caller with keys of its own, the interposer's rules, checks those when it is not).
inline std::string FieldFromText(std::string_view name, std::string_view value, CodecSpec* s,
                                 bool* known) {
  std::string err;
  *known = false;
  ForEachField(*s, [&](const char* f, auto& m) {
    if (*known || name != f) return;
    *known = true;
    err = detail::FieldFromText(f, value, m);
  });
  if (!*known)
    return "unknown codec field '" + std::string(name) + "'; the fields are " + FieldList();
  return err;
}

// The codec of `text` ("kind=2 bits=4 block=32 ...": name=value pairs separated by spaces),
// validated into `*s`. A field not given keeps CodecSpec's default. Returns "" or what is
// wrong, naming the field.
inline std::string SpecFromText(std::string_view text, CodecSpec* s) {
  *s = CodecSpec{};
  while (!text.empty()) {
    const size_t start = text.find_first_not_of(' ');
    if (start == std::string_view::npos) break;
    text = text.substr(start);
    const size_t stop = text.find(' ');
    const std::string_view word = text.substr(0, stop);
    text = stop == std::string_view::npos ? std::string_view() : text.substr(stop);
    const size_t eq = word.find('=');
    if (eq == std::string_view::npos)
      return "expected name=value, got '" + std::string(word) + "'; the fields are " + FieldList();
    bool known = false;
    std::string err = FieldFromText(word.substr(0, eq), word.substr(eq + 1), s, &known);
    if (!err.empty()) return "codec " + err;
  }
  if (const char* msg = Validate(*s)) return msg;
  return {};
}

}  // namespace jcoccl::codecs
