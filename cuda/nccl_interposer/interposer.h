// libjcoccl_nccl.so: an NCCL-compatible library (SONAME libnccl.so.2) that forwards every
// call to the real NCCL and runs the all-reduces, reduce-scatters and all-gathers its policy
// names with jcoccl's fused engine on the caller's communicator and stream. See docs/nccl.md.
//
//   forward.cc     the generated API (nccl_api.inc): trampolines into the real library
//   interposer.cc  the calls it takes over, the policy, the counters, the C control API
#pragma once
#include <string>

namespace jcn {

// Opens the real NCCL (JCOCCL_NCCL_REAL) and points every trampoline at it; false with
// LoadError() set if it cannot (the trampolines then point at failing stubs).
bool OpenReal();
// The real library's function `name`, or null (not opened, or it lacks the name).
void* Real(const char* name);
const std::string& RealPath();
const std::string& LoadError();
// How many generated names the real library lacks.
int MissingCount();
// Whether `addr` (a return address) lies in the real library's code: a call the real NCCL
// makes to one of its own public names, which binds to this library when it is preloaded.
bool CalledFromReal(const void* addr);

}  // namespace jcn
