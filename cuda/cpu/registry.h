// Every CPU handler registers itself here; bindings_cpu.cc exports the table.
#pragma once
#include <map>
#include <string>

namespace jcoccl::cpu {

using HandlerTable = std::map<std::string, void*>;

inline HandlerTable& Handlers() {
  static HandlerTable table;
  return table;
}

struct Register {
  Register(const char* name, void* fn) { Handlers()[name] = fn; }
};

}  // namespace jcoccl::cpu

// JCOCCL_CPU_HANDLER(target_name, handler_symbol) defined by XLA_FFI_DEFINE_HANDLER*.
#define JCOCCL_CPU_REGISTER(name, symbol) \
  static ::jcoccl::cpu::Register jcoccl_reg_##symbol(name, reinterpret_cast<void*>(symbol))
