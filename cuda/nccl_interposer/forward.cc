// libjcoccl_nccl.so's forwarding half: every NCCL entry point of nccl_api.inc (generated
// from the pinned nccl.h by tools/gen_nccl_api.py) is exported here as a one-instruction
// trampoline that jumps through a pointer into the real libnccl.so.2, so the caller's
// arguments and return value pass untouched whatever their types (struct returns included).
//
// The real library is opened by path (JCOCCL_NCCL_REAL, which jcoccl.nccl.enable and
// `python -m jcoccl.nccl` set) when this library loads. A name the real library lacks (an
// older NCCL) jumps to a stub that says so on stderr once and fails as NCCL fails: an
// ncclResult_t function returns ncclInvalidUsage, a string function a message, others 0.
// The calls interposer.cc takes over (JCN_TAKEN) get a pointer but no trampoline.
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "nccl_interposer/interposer.h"

#define JCN_VISIBLE __attribute__((visibility("default")))

// ---- the pointers ---------------------------------------------------------------------------
extern "C" {
#define JCN_API(name, kind) __attribute__((visibility("hidden"))) void* jcn_real_##name = nullptr;
#define JCN_TAKEN(name) __attribute__((visibility("hidden"))) void* jcn_real_##name = nullptr;
#include "nccl_interposer/nccl_api.inc"
#undef JCN_API
#undef JCN_TAKEN
}

// ---- the trampolines ------------------------------------------------------------------------
#if defined(__x86_64__)
#define JCN_TRAMPOLINE(name)                                                   \
  asm(".text\n.globl " #name "\n.type " #name ",@function\n.p2align 4\n" #name \
      ":\n  jmp *jcn_real_" #name "(%rip)\n.size " #name ",.-" #name "\n");
#elif defined(__aarch64__)
#define JCN_TRAMPOLINE(name)                                                      \
  asm(".text\n.globl " #name "\n.type " #name ",%function\n.p2align 4\n" #name    \
      ":\n  adrp x16, jcn_real_" #name "\n  ldr x16, [x16, :lo12:jcn_real_" #name \
      "]\n  br x16\n.size " #name ",.-" #name "\n");
#else
#error "libjcoccl_nccl.so's trampolines are written for x86-64 and aarch64"
#endif
#define JCN_API(name, kind) JCN_TRAMPOLINE(name)
#define JCN_TAKEN(name)
#include "nccl_interposer/nccl_api.inc"
#undef JCN_API
#undef JCN_TAKEN

namespace jcn {
namespace {

void Missing(const char* name) {
  static std::atomic<int> said{0};
  if (said.fetch_add(1) < 8)
    std::fprintf(stderr, "jcoccl nccl: %s is not in the real NCCL (%s); the call fails\n", name,
                 RealPath().c_str());
}

// One stub per name and kind, so the message can name the call.
#define JCN_STUB_R(name) \
  extern "C" int jcn_missing_##name() { return Missing(#name), 5; /* ncclInvalidUsage */ }
#define JCN_STUB_S(name)                                     \
  extern "C" const char* jcn_missing_##name() {              \
    Missing(#name);                                          \
    return "jcoccl nccl: " #name " is not in the real NCCL"; \
  }
#define JCN_STUB_V(name) \
  extern "C" long jcn_missing_##name() { return Missing(#name), 0; }
#define JCN_API(name, kind) JCN_STUB_##kind(name)
#define JCN_TAKEN(name) JCN_STUB_R(name)
#include "nccl_interposer/nccl_api.inc"
#undef JCN_API
#undef JCN_TAKEN

struct Entry {
  const char* name;
  void** slot;
  void* missing;
};

const Entry kEntries[] = {
#define JCN_API(name, kind) {#name, &jcn_real_##name, reinterpret_cast<void*>(&jcn_missing_##name)},
#define JCN_TAKEN(name) {#name, &jcn_real_##name, reinterpret_cast<void*>(&jcn_missing_##name)},
#include "nccl_interposer/nccl_api.inc"
#undef JCN_API
#undef JCN_TAKEN
};

std::string& PathStore() {
  static auto* s = new std::string();
  return *s;
}
std::string& ErrorStore() {
  static auto* s = new std::string();
  return *s;
}
int g_missing = 0;
// The real library's mapped segments [lo, hi).
uintptr_t g_real_lo = 0, g_real_hi = 0;

// Finds the segments of the object loaded at `base` (the real library's link map).
void RecordRange(void* lib) {
  struct link_map* lm = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &lm) != 0 || lm == nullptr) return;
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        auto* map = static_cast<struct link_map*>(data);
        if (info->dlpi_addr != map->l_addr || std::strcmp(info->dlpi_name, map->l_name) != 0)
          return 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr) & ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
          if (g_real_lo == 0 || lo < g_real_lo) g_real_lo = lo;
          if (hi > g_real_hi) g_real_hi = hi;
        }
        return 1;
      },
      lm);
}

}  // namespace

const std::string& RealPath() { return PathStore(); }
bool CalledFromReal(const void* addr) {
  const auto a = reinterpret_cast<uintptr_t>(addr);
  return a >= g_real_lo && a < g_real_hi;
}
const std::string& LoadError() { return ErrorStore(); }
int MissingCount() { return g_missing; }

void* Real(const char* name) {
  for (const Entry& e : kEntries)
    if (std::strcmp(e.name, name) == 0) return *e.slot == e.missing ? nullptr : *e.slot;
  return nullptr;
}

bool OpenReal() {
  for (const Entry& e : kEntries) *e.slot = e.missing;
  const char* path = std::getenv("JCOCCL_NCCL_REAL");
  if (path == nullptr || *path == '\0') {
    ErrorStore() =
        "JCOCCL_NCCL_REAL is not set: libjcoccl_nccl.so needs the path of the real "
        "libnccl.so.2 (jcoccl.nccl.enable and python -m jcoccl.nccl set it)";
    return false;
  }
  PathStore() = path;
  // By path: the real library has our SONAME, and a lookup by name would find us.
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    ErrorStore() = std::string("cannot open the real NCCL ") + path + ": " + (e ? e : "?");
    return false;
  }
  RecordRange(lib);
  for (const Entry& e : kEntries) {
    void* f = dlsym(lib, e.name);
    if (f != nullptr) {
      *e.slot = f;
    } else {
      ++g_missing;
    }
  }
  return true;
}

}  // namespace jcn
