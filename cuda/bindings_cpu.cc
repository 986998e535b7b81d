// nanobind module jcoccl._cpu: exposes the CPU XLA FFI handlers as capsules.
#include <nanobind/nanobind.h>

#include "engine/bind_enums.h"
#include "engine/bind_fused.h"
#include "engine/bind_host.h"
#include "engine/bind_plugin.h"
#include "registry.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.doc() = "jcoccl CPU custom calls (XLA FFI handlers)";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        for (const auto& [name, fn] : jcoccl::Handlers()) d[name.c_str()] = nb::capsule(fn);
        return d;
      },
      "Dict of FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  jcoccl::engine::BindEnums(m);
  jcoccl::engine::BindFusedCommon(m);
  jcoccl::engine::BindPlugins(m);
  jcoccl::engine::BindHostComms(m);
}
