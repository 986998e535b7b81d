// nanobind module jcoccl._cpu: exposes the CPU XLA FFI handlers as capsules.
#include <nanobind/nanobind.h>

#include "engine/bind_host.h"
#include "engine/bind_module.h"

NB_MODULE(_cpu, m) {
  m.doc() = "jcoccl CPU custom calls (XLA FFI handlers)";
  jcoccl::engine::BindModuleCommon(m);
  jcoccl::engine::BindHostComms(m);
}
