// Every CUDA handler registers itself here; bindings_cuda.cc exports the table.
#pragma once
#include <map>
#include <string>

namespace jcoccl::gpu {

using HandlerTable = std::map<std::string, void*>;

inline HandlerTable& Handlers() {
  static HandlerTable table;
  return table;
}

struct Register {
  Register(const char* name, void* fn) { Handlers()[name] = fn; }
};

}  // namespace jcoccl::gpu

#define JCOCCL_GPU_REGISTER(name, symbol) \
  static ::jcoccl::gpu::Register jcoccl_reg_##symbol(name, reinterpret_cast<void*>(symbol))
