// nanobind module jcoccl._cuda: exposes the CUDA XLA FFI handlers as capsules.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include "engine/bind_enums.h"
#include "engine/bind_fused.h"
#include "engine/bind_nccl.h"
#include "engine/bind_plugin.h"
#include "registry.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.doc() = "jcoccl CUDA custom calls (XLA FFI handlers) and NCCL engine";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        for (const auto& [name, fn] : jcoccl::Handlers()) d[name.c_str()] = nb::capsule(fn);
        return d;
      },
      "Dict of FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("cuda_runtime_version", []() {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  });
  jcoccl::engine::BindEnums(m);
  jcoccl::engine::BindFusedCommon(m);
  jcoccl::engine::BindPlugins(m);
  jcoccl::engine::BindNcclComms(m);
}
