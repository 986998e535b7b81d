// What jcoccl._cpu and jcoccl._cuda both export (nanobind): the module's FFI handler table,
// the C++ enums and codec descriptor schema, the fused engine's sizing and bookkeeping, and
// the plugin loader. Each module adds its own transport (bindings_cpu.cc, bindings_cuda.cc).
#pragma once
#include <nanobind/nanobind.h>

#include "engine/bind_enums.h"
#include "engine/bind_fused.h"
#include "engine/bind_plugin.h"
#include "registry.h"

namespace jcoccl::engine {

inline void BindModuleCommon(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "registrations",
      []() {
        nb::dict d;
        for (const auto& [name, fn] : Handlers()) d[name.c_str()] = nb::capsule(fn);
        return d;
      },
      "Dict of FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  BindEnums(m);
  BindFusedCommon(m);
  BindPlugins(m);
}

}  // namespace jcoccl::engine
