// Every XLA FFI handler of a native module registers itself here under its target names;
// the module's bindings (bindings_cpu.cc, bindings_cuda.cc) export the table to Python.
// jcoccl._cpu and jcoccl._cuda are separate shared objects, each with its own table.
#pragma once
#include <initializer_list>
#include <map>
#include <string>

namespace jcoccl {

using HandlerTable = std::map<std::string, void*>;

inline HandlerTable& Handlers() {
  static HandlerTable table;
  return table;
}

struct RegisterHandler {
  RegisterHandler(std::initializer_list<const char*> names, void* fn) {
    for (const char* name : names) Handlers()[name] = fn;
  }
};

}  // namespace jcoccl

// JCOCCL_REGISTER_HANDLER(symbol, "target", ...): `symbol` from XLA_FFI_DEFINE_HANDLER_SYMBOL
// serves every listed target name.
#define JCOCCL_REGISTER_HANDLER(symbol, ...)                          \
  static ::jcoccl::RegisterHandler jcoccl_reg_##symbol({__VA_ARGS__}, \
                                                       reinterpret_cast<void*>(symbol))
