// nanobind functions shared by jcoccl._cpu and jcoccl._cuda for the fused engine:
// communicator bookkeeping and workspace sizing. Included by cuda/bindings_*.cc only.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "codecs/codec.h"
#include "engine/comms.h"
#include "engine/engine.h"

namespace jcoccl::engine {

namespace nb = nanobind;

inline CodecSpec SpecFromPyDict(const nb::dict& d, const char* prefix) {
  auto geti = [&](const char* k) {
    std::string key = std::string(prefix) + k;
    if (!d.contains(key.c_str())) throw std::invalid_argument("codec attribute missing: " + key);
    return nb::cast<int32_t>(d[key.c_str()]);
  };
  CodecSpec s;
  s.kind = static_cast<codecs::Kind>(geti("kind"));
  s.bits = geti("bits");
  s.block = geti("block");
  s.symmetric = geti("symmetric") != 0;
  s.fp8 = static_cast<codecs::Fp8Format>(geti("fp8"));
  s.cast_dtype = static_cast<DType>(geti("cast_dtype"));
  s.hadamard = geti("hadamard");
  std::string spike = std::string(prefix) + "spike";
  s.spike = d.contains(spike.c_str()) ? nb::cast<int32_t>(d[spike.c_str()]) : 0;
  std::string eps = std::string(prefix) + "abs_error";
  s.abs_error = d.contains(eps.c_str()) ? nb::cast<float>(d[eps.c_str()]) : 0.0f;
  std::string plugin = std::string(prefix) + "plugin", params = std::string(prefix) + "params";
  if (d.contains(plugin.c_str())) s.plugin = nb::cast<int32_t>(d[plugin.c_str()]);
  if (d.contains(params.c_str())) {
    auto v = nb::cast<std::vector<double>>(d[params.c_str()]);
    if (v.size() > static_cast<size_t>(codecs::kMaxPluginParams))
      throw std::invalid_argument("at most 8 plugin params");
    for (size_t i = 0; i < v.size(); ++i) s.params[i] = v[i];
  }
  if (const char* msg = codecs::Validate(s)) throw std::invalid_argument(msg);
  return s;
}

// Codec stand-in for sizing: the engine only asks it for payload sizes.
class SizingCodec final : public Codec {
 public:
  using Codec::Codec;
  Status EncodeRows(void*, const void*, int64_t, int64_t, uint8_t*) override { return Err(); }
  Status DecodeRows(void*, const uint8_t*, int64_t, int64_t, void*) override { return Err(); }
  Status DecodeSum(void*, const uint8_t*, int, int64_t, void*) override { return Err(); }
  Status DecodeSumEncode(void*, const uint8_t*, int, int64_t, uint8_t*) override { return Err(); }

 private:
  static Status Err() { return Status::Error("sizing codec cannot run"); }
};

inline void BindFusedCommon(nb::module_& m) {
  m.def(
      "fused_workspace_bytes",
      [](int op, int64_t k, int64_t mlen, int size, int outer_size, nb::dict codec,
         nb::dict outer_codec, int dtype) {
        SizingCodec c(SpecFromPyDict(codec, ""), static_cast<DType>(dtype));
        SizingCodec oc(outer_size > 0 ? SpecFromPyDict(outer_codec, "o_") : CodecSpec{},
                       static_cast<DType>(dtype));
        SizeOnlyTransport t(size), ot(outer_size > 0 ? outer_size : 1);
        Call call;
        call.op = static_cast<Op>(op);
        call.k = k;
        call.m = mlen;
        call.codec = &c;
        call.comm = &t;
        call.outer_codec = &oc;
        call.outer_comm = &ot;
        return WorkspaceBytes(call);
      },
      nb::arg("op"), nb::arg("k"), nb::arg("m"), nb::arg("size"), nb::arg("outer_size"),
      nb::arg("codec"), nb::arg("outer_codec"), nb::arg("dtype"),
      "Workspace bytes a fused collective needs (its extra uint8 output).");
  m.def(
      "fused_comm_destroy", [](int64_t comm) { return Comms().Remove(comm); }, nb::arg("comm"),
      "Drops every member of communicator `comm`; returns their count.");
  m.def(
      "fused_comm_keys", []() { return Comms().Keys(); },
      "(communicator id, device ordinal) pairs currently registered.");
  m.def(
      "fused_check_timeout",
      [](double s) {
        double out = transport::kDefaultTimeoutSeconds;
        if (!transport::CheckTimeoutSeconds(s, &out))
          throw std::invalid_argument("timeout_s must be a positive number of seconds");
        return out;
      },
      nb::arg("seconds"),
      "The timeout a fused call runs with for a timeout_s attribute of `seconds` (clamped to "
      "1e8); ValueError where the engine would refuse it.");
}

}  // namespace jcoccl::engine
