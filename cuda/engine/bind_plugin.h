// nanobind functions shared by jcoccl._cpu and jcoccl._cuda for codec plugins: open a
// plugin library, describe it, and install it in this module's plugin table under the id
// Python chose (jcoccl/_src/compressors/plugins.py). Included by cuda/bindings_*.cc only.
#pragma once
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "codecs/codec.h"

namespace jcoccl::engine {

namespace nb = nanobind;

// Opens `path` and reads its entry point. The result's "status" is "ok" or says what is
// wrong ("open", "symbol", "null", "abi", "incomplete"), with "detail"; Python words the error.
inline nb::dict DescribePlugin(const std::string& path, const jcoccl_codec_plugin** out) {
  nb::dict d;
  *out = nullptr;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    d["status"] = "open";
    d["detail"] = e != nullptr ? e : "dlopen failed";
    return d;
  }
  dlerror();
  void* sym = dlsym(lib, JCOCCL_PLUGIN_ENTRY_SYMBOL);
  if (sym == nullptr) {
    const char* e = dlerror();
    d["status"] = "symbol";
    d["detail"] = e != nullptr ? e : "symbol not found";
    return d;
  }
  const jcoccl_codec_plugin* p = reinterpret_cast<jcoccl_codec_plugin_entry_fn>(sym)();
  d["abi_version"] = p != nullptr ? p->abi_version : 0u;
  if (p == nullptr) {
    d["status"] = "null";
    d["detail"] = "the entry function returned NULL";
    return d;
  }
  // Nothing past abi_version is read from a plugin of another ABI: its layout may differ.
  if (p->abi_version != JCOCCL_PLUGIN_ABI_VERSION || p->struct_size < sizeof(jcoccl_codec_plugin)) {
    d["status"] = "abi";
    d["detail"] = "abi_version " + std::to_string(p->abi_version) + ", struct_size " +
                  std::to_string(p->struct_size);
    return d;
  }
  d["jcoccl_version"] = p->jcoccl_version != nullptr ? p->jcoccl_version : "";
  d["name"] = p->name != nullptr ? p->name : "";
  nb::list names;
  const int np = p->num_params;
  for (int i = 0; i < np && i < JCOCCL_PLUGIN_MAX_PARAMS; ++i)
    names.append(p->param_names[i] != nullptr ? p->param_names[i] : "");
  d["num_params"] = np;
  d["param_names"] = names;
  std::string missing;
  auto need = [&](const void* f, const char* what) {
    if (f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + what;
  };
  need(reinterpret_cast<const void*>(p->validate), "validate");
  need(reinterpret_cast<const void*>(p->granule), "granule");
  need(reinterpret_cast<const void*>(p->payload_bytes), "payload_bytes");
  need(reinterpret_cast<const void*>(p->cpu_encode), "cpu_encode");
  need(reinterpret_cast<const void*>(p->cpu_decode), "cpu_decode");
  need(reinterpret_cast<const void*>(p->cpu_decode_sum), "cpu_decode_sum");
  need(reinterpret_cast<const void*>(p->cpu_decode_sum_encode), "cpu_decode_sum_encode");
  need(reinterpret_cast<const void*>(p->last_error), "last_error");
  if (p->name == nullptr || p->jcoccl_version == nullptr) need(nullptr, "name/jcoccl_version");
  const int ncuda = (p->cuda_encode != nullptr) + (p->cuda_decode != nullptr) +
                    (p->cuda_decode_sum != nullptr) + (p->cuda_decode_sum_encode != nullptr);
  if (ncuda != 0 && ncuda != 4) need(nullptr, "all four cuda_* kernels (or none)");
  d["has_cuda"] = ncuda == 4;
  d["status"] = missing.empty() ? "ok" : "incomplete";
  d["detail"] = missing.empty() ? "" : "NULL: " + missing;
  if (missing.empty()) *out = p;
  return d;
}

inline void BindPlugins(nb::module_& m) {
  m.def(
      "plugin_load",
      [](const std::string& path, int id, bool install) {
        if (id < 0 || id >= codecs::kMaxPlugins)
          throw std::invalid_argument("plugin id must be in [0, " +
                                      std::to_string(codecs::kMaxPlugins) + ")");
        const jcoccl_codec_plugin* p = nullptr;
        nb::dict d = DescribePlugin(path, &p);
        if (install && p != nullptr) {
          codecs::PluginPaths()[id] = path;
          codecs::PluginTable()[id].store(p, std::memory_order_release);
        }
        return d;
      },
      nb::arg("path"), nb::arg("id"), nb::arg("install"),
      "Opens a codec plugin library and describes it (dict with 'status'); with install=True "
      "and status 'ok', its kernels serve plugin id `id` in this module.");
  m.def(
      "plugin_shape",
      [](const std::string& path, const std::vector<double>& params, int64_t n, int dtype) {
        const jcoccl_codec_plugin* p = nullptr;
        nb::dict d = DescribePlugin(path, &p);
        if (p == nullptr) return d;
        double args[JCOCCL_PLUGIN_MAX_PARAMS] = {};
        for (size_t i = 0; i < params.size() && i < JCOCCL_PLUGIN_MAX_PARAMS; ++i)
          args[i] = params[i];
        int64_t granule = 0, bytes = 0;
        nb::dict out;
        const char* step = p->validate(args) != 0                          ? "validate"
                           : p->granule(args, &granule) != 0               ? "granule"
                           : p->payload_bytes(args, n, dtype, &bytes) != 0 ? "payload_bytes"
                                                                           : nullptr;
        out["status"] = step == nullptr ? "ok" : "refused";
        out["detail"] =
            step == nullptr ? std::string() : std::string(step) + ": " + codecs::PluginError(p);
        out["granule"] = granule;
        out["bytes"] = bytes;
        return out;
      },
      nb::arg("path"), nb::arg("params"), nb::arg("n"), nb::arg("dtype"),
      "Calls a plugin library's validate, granule and payload_bytes for one row shape: dict "
      "with 'status' ('ok', 'refused', or DescribePlugin's), 'detail', 'granule', 'bytes'.");
  m.def(
      "plugin_max", []() { return codecs::kMaxPlugins; },
      "How many plugin libraries a native module can hold.");
}

}  // namespace jcoccl::engine
