// The codec descriptor on the Python side of the native modules (nanobind), from the field
// table of codecs/descriptor.h: the schema Python builds descriptors against, and the
// decoding of a descriptor dict into a CodecSpec. Included by cuda/bindings_*.cc only
// (through engine/bind_fused.h).
//
//   CODEC_FIELDS                      {"kind": "int32", ..., "params": "float64[8]"}
//   codec_descriptor(d) -> dict       d decoded and validated as the handlers do, encoded back
//   codec_descriptor_from_text(t)     the text form t decoded as the C interfaces do (SpecFromText)
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "codecs/codec.h"
#include "codecs/descriptor.h"

namespace jcoccl::codecs {

namespace nb = nanobind;

namespace detail {

// One field of a Python dict into its member; "" or what is wrong.
template <class M>
std::string FieldFromPy(const nb::dict& d, const char* name, M& m) {
  const std::string what = std::string("field '") + name + "' (" + WireName<M>() + ")";
  if (!d.contains(name)) return what + " is missing";
  nb::handle v = d[name];
  if constexpr (std::is_same_v<M, float>) {
    if (!nb::try_cast<float>(v, m)) return what + " is not a float: " + nb::repr(v).c_str();
  } else if constexpr (std::is_array_v<M>) {
    std::vector<double> vals;
    if (!nb::try_cast<std::vector<double>>(v, vals))
      return what + " is not a sequence of floats: " + nb::repr(v).c_str();
    if (vals.size() > static_cast<size_t>(kMaxPluginParams))
      return what + " holds " + std::to_string(vals.size()) + " values";
    for (size_t i = 0; i < vals.size(); ++i) m[i] = vals[i];
  } else {
    int32_t i = 0;
    // Integers only: a float here is a field typed differently on the two sides.
    if (PyFloat_Check(v.ptr()) || !nb::try_cast<int32_t>(v, i))
      return what + " is not an int32: " + nb::repr(v).c_str();
    m = Wire<M>::From(i);
  }
  return {};
}

template <class M>
nb::object FieldToPy(const M& m) {
  if constexpr (std::is_same_v<M, float>) {
    return nb::float_(m);
  } else if constexpr (std::is_array_v<M>) {
    nb::list out;
    for (double v : m) out.append(nb::float_(v));
    return out;
  } else {
    return nb::int_(Wire<M>::To(m));
  }
}

}  // namespace detail

// The codec of descriptor dict `d`, validated; ValueError naming `what` and the field.
inline CodecSpec SpecFromPy(const nb::dict& d, const char* what = "codec") {
  for (auto [key, value] : d) {
    (void)value;
    if (!nb::isinstance<nb::str>(key) || !IsField(nb::cast<std::string>(key)))
      throw std::invalid_argument(std::string(what) + ": unknown codec field " +
                                  nb::repr(key).c_str() + "; the fields are " + FieldList());
  }
  CodecSpec s;
  std::string err;
  ForEachField(s, [&](const char* name, auto& m) {
    if (err.empty()) err = detail::FieldFromPy(d, name, m);
  });
  if (!err.empty())
    throw std::invalid_argument(std::string(what) + ": codec " + err + "; the fields are " +
                                FieldList());
  if (const char* msg = Validate(s)) throw std::invalid_argument(std::string(what) + ": " + msg);
  return s;
}

inline nb::dict SpecToPy(const CodecSpec& s) {
  nb::dict d;
  ForEachField(s, [&](const char* name, const auto& m) { d[name] = detail::FieldToPy(m); });
  return d;
}

inline void BindDescriptor(nb::module_& m) {
  nb::dict fields;
  const CodecSpec defaults;
  ForEachField(defaults, [&](const char* name, const auto& member) {
    fields[name] = WireName<std::remove_reference_t<decltype(member)>>();
  });
  m.attr("CODEC_FIELDS") = fields;
  m.def(
      "codec_descriptor", [](nb::dict d) { return SpecToPy(SpecFromPy(d)); }, nb::arg("codec"),
      "The codec descriptor dict `codec` as this module decodes it (validated, every field, "
      "params zero-padded); ValueError naming the field where it is wrong.");
  m.def(
      "codec_descriptor_from_text",
      [](const std::string& text) {
        CodecSpec s;
        const std::string err = SpecFromText(text, &s);
        if (!err.empty()) throw std::invalid_argument("codec text: " + err);
        return SpecToPy(s);
      },
      nb::arg("text"),
      "The codec descriptor text `text` (\"kind=2 bits=4 ...\") as the C interfaces outside XLA "
      "decode it (the host shim, jcoccl_codec_time, the NCCL interposer's rules), as a "
      "descriptor dict; ValueError naming the field where it is wrong.");
}

}  // namespace jcoccl::codecs
