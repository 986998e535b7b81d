// The "real NCCL" of the interposer's tests: the NCCL emulation (cuda/emul/nccl_emul.h) as a
// shared library of its own with SONAME libnccl.so.2, built with g++ against the host shim
// (cuda/nccl_interposer/test/emul_build.py). Besides the emulation's nccl* calls it exports
// the few communicator queries the interposer needs that the emulation lacks, and C controls
// for the tests: devices, streams and memory of the shim, failure injection, delays.
//
// The shim's state (the current device, delays) lives in inline variables, which g++ emits
// as unique symbols that this library and libjcoccl_nccl.so share when built with default
// visibility; the streams' lock and condition variable are found once per process, test
// programs included (streams.h FindRuntime).
#include <cstdlib>
#include <string>

#include "cuda_runtime.h"
#include "nccl.h"
#include "nccl_emul.h"

#define JCT_API extern "C" __attribute__((visibility("default")))

JCT_API ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommCount");
  if (u != ncclSuccess || count == nullptr) return u != ncclSuccess ? u : ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}
JCT_API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommUserRank");
  if (u != ncclSuccess || rank == nullptr) return u != ncclSuccess ? u : ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}
JCT_API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommCuDevice");
  if (u != ncclSuccess || device == nullptr) return u != ncclSuccess ? u : ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

// Ends a group as ncclGroupEnd does, but runs none of its calls (NCCL only estimates them).
JCT_API ncclResult_t ncclGroupSimulateEnd(void*) {
  auto& g = jcoccl_emul::g_group;
  if (g.depth == 0) return ncclInvalidUsage;
  if (--g.depth == 0) g = jcoccl_emul::GroupState();
  return ncclSuccess;
}

// ---- controls ---------------------------------------------------------------------------------
JCT_API void emul_set_device(int d) { cudaSetDevice(d); }
JCT_API void* emul_stream() {
  cudaStream_t s = nullptr;
  cudaStreamCreate(&s);
  return s;
}
JCT_API int emul_sync(void* s) { return cudaStreamSynchronize(static_cast<cudaStream_t>(s)); }
JCT_API void* emul_alloc(size_t bytes) { return std::calloc(bytes + 64, 1); }
JCT_API void emul_free(void* p) { std::free(p); }
// Queues a copy on `s` (a producer of the collective's input, as XLA's kernels are).
JCT_API int emul_copy(void* dst, const void* src, size_t bytes, void* s) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(s));
}
// Whether `s` counts as being captured into a CUDA graph (the shim records nothing).
JCT_API void emul_set_capturing(void* s, int on) {
  std::lock_guard<std::mutex> lk(jcoccl_shim::Rt().mu);
  static_cast<cudaStream_t>(s)->capturing = on != 0;
}
// Events and graph capture of the shim (cuda_runtime.h, streams.h), for tests.
JCT_API void* emul_event() {
  cudaEvent_t e = nullptr;
  cudaEventCreate(&e);
  return e;
}
JCT_API int emul_record(void* e, void* s) {
  return cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s));
}
JCT_API int emul_wait(void* s, void* e) {
  return cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0);
}
JCT_API int emul_begin_capture(void* s) {
  return cudaStreamBeginCapture(static_cast<cudaStream_t>(s), cudaStreamCaptureModeThreadLocal);
}
// Ends the capture of `s` and instantiates its graph into *exec; the CUDA error code.
JCT_API int emul_end_capture(void* s, void** exec) {
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(static_cast<cudaStream_t>(s), &g);
  if (e != cudaSuccess) return e;
  cudaGraphExec_t x = nullptr;
  const cudaError_t i = cudaGraphInstantiate(&x, g, 0);
  cudaGraphDestroy(g);
  *exec = x;
  return i;
}
JCT_API int emul_graph_launch(void* exec, void* s) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(s));
}

namespace {
__global__ void VectorAccess(int kind, void* p) {
  if (kind == 0) {
    const float4 v = *static_cast<const float4*>(p);
    (void)v;
  } else if (kind == 1) {
    const uint2 v = *static_cast<const uint2*>(p);
    (void)v;
  } else {
    *static_cast<float4*>(p) = float4{1, 2, 3, 4};
  }
}
}  // namespace

// One thread of a kernel makes a float4 load (kind 0), uint2 load (1) or float4 store (2) at
// p, on the null stream; returns the launch's CUDA error (cudaErrorMisalignedAddress if p is
// not aligned as the GPU requires) and puts its message in *why.
JCT_API int emul_vector_access(int kind, void* p, const char** why) {
  cudaGetLastError();
  ::jcoccl_shim::LaunchCfg(dim3(1), dim3(1)).Run(VectorAccess, kind, p);
  static thread_local std::string text;
  text = ::jcoccl_shim::g_last_message;
  *why = text.c_str();
  return cudaGetLastError();
}

// Queued work of `kinds` (jcoccl_shim::WorkKind bits) sleeps `us` before it runs.
JCT_API void emul_set_delay(unsigned kinds, int us) { jcoccl_shim::SetDelay(kinds, us); }
// The next `count` calls of entry point `op` fail with ncclInternalError; 0 if unknown.
JCT_API int emul_inject(const char* op, int count) {
  return jcoccl_emul::InjectFailure(op, count) ? 1 : 0;
}
// What the shim and the emulation found since the last call (one per line), and forgets it.
JCT_API const char* emul_findings() {
  static thread_local std::string text;
  text.clear();
  for (const std::string& f : jcoccl_shim::Findings()) text += f + "\n";
  return text.c_str();
}
// Uses of a communicator after its destroy or abort seen so far.
JCT_API int emul_misuse() { return jcoccl_emul::g_misuse.load(); }
// How long a wait for peers lasts before it fails (NCCL would hang); returns the old value.
JCT_API int emul_set_timeout_ms(int ms) { return jcoccl_emul::g_timeout_ms.exchange(ms); }
// How long nonblocking init, split and group work stays in progress; returns the old value.
JCT_API int emul_set_nonblocking_delay_ms(int ms) {
  return jcoccl_emul::g_nonblocking_delay_ms.exchange(ms);
}
// This thread's open ncclGroupStart calls in the emulation.
JCT_API int emul_group_depth() { return jcoccl_emul::GroupDepth(); }
JCT_API void emul_reset_group() { jcoccl_emul::ResetGroup(); }

// The pnccl* profiling aliases a real libnccl.so.2 exports next to every nccl* name.
#define JCT_ALIAS(name) \
  asm(".globl p" #name "\n.type p" #name ",@function\n.set p" #name ", " #name);
JCT_ALIAS(ncclGetVersion)
JCT_ALIAS(ncclGetUniqueId)
JCT_ALIAS(ncclCommInitRank)
JCT_ALIAS(ncclCommInitRankConfig)
JCT_ALIAS(ncclCommSplit)
JCT_ALIAS(ncclRedOpCreatePreMulSum)
JCT_ALIAS(ncclRedOpDestroy)
JCT_ALIAS(ncclReduce)
JCT_ALIAS(ncclBroadcast)
JCT_ALIAS(ncclAlltoAll)
JCT_ALIAS(ncclCommDestroy)
JCT_ALIAS(ncclCommAbort)
JCT_ALIAS(ncclCommGetAsyncError)
JCT_ALIAS(ncclGetErrorString)
JCT_ALIAS(ncclGroupStart)
JCT_ALIAS(ncclGroupEnd)
JCT_ALIAS(ncclGroupSimulateEnd)
JCT_ALIAS(ncclAllGather)
JCT_ALIAS(ncclAllReduce)
JCT_ALIAS(ncclReduceScatter)
JCT_ALIAS(ncclSend)
JCT_ALIAS(ncclRecv)
JCT_ALIAS(ncclCommCount)
JCT_ALIAS(ncclCommUserRank)
JCT_ALIAS(ncclCommCuDevice)
