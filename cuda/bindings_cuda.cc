// nanobind module jcoccl._cuda: exposes the CUDA XLA FFI handlers as capsules.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include "engine/bind_module.h"
#include "engine/bind_nccl.h"

NB_MODULE(_cuda, m) {
  m.doc() = "jcoccl CUDA custom calls (XLA FFI handlers) and NCCL engine";
  jcoccl::engine::BindModuleCommon(m);
  m.def("cuda_runtime_version", []() {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  });
  jcoccl::engine::BindNcclComms(m);
}
