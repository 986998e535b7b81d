// The test-only build of jcoccl's CUDA extension (tools/cuda_ext.py): cuda/gpu/*.cu,
// cuda/transport/nccl.cc and the engine, compiled unchanged as one C++ translation unit
// against the host shim (cuda/hostshim/) and the NCCL emulation (nccl_emul.h), to which
// nccl.cc's dlopen("libnccl.so.2") is redirected (OpenNccl below). It exports a
// C interface for ctypes: the handlers behind the XLA:CPU adaptor (xla_adaptor.h), what
// jcoccl._cuda's bindings do for communicators and workspace sizes, and the test controls.
//
// JCOCCL_EXT_CODECS, JCOCCL_EXT_FUSED and JCOCCL_EXT_NCCL name the sources to include (the
// codec kernels after tools/gpu_shim.py's launch rewrite; mutant copies in a mutant build).
// The codec handlers (gpu/codec_handlers.cu) launch no kernel: they are included as they are.
#include <dlfcn.h>

#include "as_nvcc.h"  // nvcc's macros, before any CUDA source
#include "cuda_runtime.h"
#include "nccl.h"

namespace jcoccl_emul {
// nccl.cc opens libnccl.so.2 with dlopen; its calls are renamed to this function (a macro
// around its #include: the source itself is unchanged), which answers with this library,
// whose exported nccl* functions are the emulation. A real libnccl.so.2 that something else
// loaded into the process is never picked up.
// An address inside this library. Not an nccl* function: with a real libnccl.so.2 loaded
// globally first, `&ncclGetVersion` here would resolve to that library's copy.
inline void Anchor() {}

inline void* OpenNccl(const char* file, int mode) {
  if (file == nullptr || std::strcmp(file, "libnccl.so.2") != 0) return dlopen(file, mode);
  Dl_info self;
  if (dladdr(reinterpret_cast<void*>(&Anchor), &self) == 0) return nullptr;
  return dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD);
}
}  // namespace jcoccl_emul

#include JCOCCL_EXT_CODECS
#include "gpu/codec_handlers.cu"
#include JCOCCL_EXT_FUSED
#define dlopen ::jcoccl_emul::OpenNccl
#include JCOCCL_EXT_NCCL
#undef dlopen

#include "codec_api.h"  // jc_api::Spec
#include "nccl_emul.h"
#include "xla_adaptor.h"

#define JCE_API extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string g_text;

const char* Text(std::string s) {
  g_text = std::move(s);
  return g_text.c_str();
}

}  // namespace

// The registered CUDA handlers, each behind its own adaptor entry point: fills up to `cap`
// names and function pointers; returns how many there are.
JCE_API int jce_handlers(const char** names, void** fns, int cap) {
  static const auto slots =
      jcoccl_emul::SlotTable(std::make_integer_sequence<int, jcoccl_emul::kSlots>());
  int i = 0;
  for (const auto& [name, fn] : jcoccl::Handlers()) {
    if (i >= jcoccl_emul::kSlots) return -1;
    jcoccl_emul::g_inner[i] = reinterpret_cast<XLA_FFI_Handler*>(fn);
    if (i < cap) {
      names[i] = name.c_str();
      fns[i] = reinterpret_cast<void*>(slots[i]);
    }
    ++i;
  }
  return i;
}

// Queued work of the kinds in `kinds` (jcoccl_shim::WorkKind bits) sleeps `us` first.
JCE_API void jce_set_delay(unsigned kinds, int us) { jcoccl_shim::SetDelay(kinds, us); }

// Return gate (nccl_emul.h): on, NCCL work runs only after the fused handler that queued it
// returned (a handler still in its call after `timeout_ms` is reported); returns how many
// operations passed the gate since it was last set.
JCE_API int jce_nccl_gate(int on, int timeout_ms) {
  jcoccl_emul::g_gate_timeout_ms = timeout_ms;
  jcoccl_emul::g_gate_on = on != 0;
  return jcoccl_emul::g_gate_held.exchange(0);
}

// Marks XLA's stream of `device` as capturing a CUDA graph (cudaStreamIsCapturing), or not.
JCE_API void jce_set_capturing(int device, int on) {
  cudaStream_t s = jcoccl_emul::XlaStream(device);
  std::lock_guard<std::mutex> lk(jcoccl_shim::Rt().mu);
  s->capturing = on != 0;
}

// Selects one of tools/cuda_ext.py's deliberate defects in a mutant build (0: none).
JCE_API void jce_set_mutation(int id) { jcoccl_shim::g_mutation = id; }

// The next `count` calls of NCCL entry point `op` fail; 0 if `op` is unknown.
JCE_API int jce_nccl_inject(const char* op, int count) {
  return jcoccl_emul::InjectFailure(op, count) ? 1 : 0;
}

// The version of the NCCL that jcoccl's transport loaded (the emulation's: 99999), or -1.
JCE_API int jce_nccl_version() {
  std::string err;
  const jcoccl::transport::NcclApi* api = jcoccl::transport::Nccl(&err);
  if (api == nullptr) return -1;
  int v = 0;
  api->GetVersion(&v);
  return v;
}

// As jcoccl._cuda.nccl_unique_id: 128 bytes into `out`; null, or the error text.
JCE_API const char* jce_nccl_unique_id(char* out) {
  std::string id;
  jcoccl::transport::Status s = jcoccl::transport::NcclUniqueId(&id);
  if (!s.ok()) return Text(s.msg);
  std::memcpy(out, id.data(), id.size());
  return nullptr;
}

// As jcoccl._cuda.nccl_comm_init: members (devices[i], ranks[i]); null, or the error text.
JCE_API const char* jce_nccl_comm_init(int64_t comm, const char* uid, int nranks, int nmembers,
                                       const int* devices, const int* ranks) {
  std::vector<std::pair<int, int>> members;
  for (int i = 0; i < nmembers; ++i) members.emplace_back(devices[i], ranks[i]);
  std::vector<ncclComm_t> comms;
  jcoccl::transport::Status s =
      jcoccl::transport::NcclInit(std::string(uid, NCCL_UNIQUE_ID_BYTES), nranks, members, &comms);
  if (!s.ok()) return Text(s.msg);
  for (size_t i = 0; i < members.size(); ++i)
    jcoccl::engine::Comms().Add(comm, members[i].first,
                                std::make_shared<jcoccl::transport::NcclTransport>(
                                    comms[i], members[i].second, nranks, members[i].first));
  return nullptr;
}

JCE_API int jce_comm_destroy(int64_t comm) { return jcoccl::engine::Comms().Remove(comm); }

// As fused_workspace_bytes; `spec` / `ospec` are codec descriptors in their text form
// (codecs/descriptor.h SpecFromText). -1 if either is no codec.
JCE_API int64_t jce_workspace_bytes(int op, int64_t k, int64_t m, int size, int outer_size,
                                    const char* spec, const char* ospec, int dtype) {
  namespace je = jcoccl::engine;
  je::CodecSpec s, o;
  if (!jc_api::Spec(spec, &s).empty() || !jc_api::Spec(ospec, &o).empty()) return -1;
  return je::FusedWorkspaceBytes(static_cast<je::Op>(op), k, m, size, outer_size, s, o,
                                 static_cast<je::DType>(dtype));
}

// What the shim found since the last call (one finding per line), and forgets it.
JCE_API const char* jce_findings() {
  std::string out;
  for (const std::string& f : jcoccl_shim::Findings()) out += f + "\n";
  return Text(out);
}
