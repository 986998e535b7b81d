// Host shim for CUDA kernels: lets g++ compile cuda/gpu/codecs.cu as C++ and run its
// `__global__` kernels on the CPU, so CI checks the device code without a GPU.
//
// Execution model. A launch runs its blocks one after another on the calling thread; the
// threads of a block are user-level fibers, scheduled warp by warp. A fiber runs
// until it reaches a warp collective (__shfl_xor_sync, __all_sync), __syncthreads or its end:
//   - a warp collective completes once all 32 lanes of the warp have reached it; a lane that
//     reaches __syncthreads or exits instead is reported as warp divergence (an error);
//   - __syncthreads completes once every thread of the block has reached it; a thread that
//     exits while others wait there is reported as an error.
// Each block gets its own zeroed dynamic shared memory. Launch configurations are checked as
// the GPU checks them (block <= 1024 threads, grid >= 1, dynamic shared memory <= 48 KiB
// without an opt-in); a bad one sets the error cudaGetLastError returns.
//
// Device arithmetic: float32 operations are the host's IEEE operations (build with
// -ffp-contract=off and without -ffast-math, like nvcc --fmad=false; run without DAZ/FTZ,
// as the kernels are compiled without .ftz). Conversions model the PTX instructions:
// cvt.rn.{bf16,f16}.f32 round to nearest even and give the canonical NaN 0x7fff.
//
// Streams (streams.h): a launch or cudaMemcpyAsync on the null stream runs at once on the
// calling thread; on a stream made by cudaStreamCreate* it is queued, and the stream's own
// worker thread runs its queue in order. Events record and wait across streams as on the GPU.
//
// Only the subset of CUDA that jcoccl's codec kernels use is provided. The source is
// compiled unchanged except for two syntax forms C++ lacks, rewritten by tools/gpu_shim.py:
// `K<<<cfg>>>(args)` -> `::jcoccl_shim::LaunchCfg(cfg).Run(K, args)` and
// `extern __shared__ T name[];` -> `T* name = ::jcoccl_shim::DynamicShared<T>();`.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)  // an occupancy hint to ptxas: nothing to do on the host
#define __forceinline__ inline
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
namespace jcoccl_shim {
// Records a misaligned vector access of `align` bytes at p as the kernel's fault.
inline void CheckAligned(const void* p, size_t align, const char* type);
}  // namespace jcoccl_shim

// The vector types check every load and store through them: the GPU faults (misaligned
// address) on a float4 / uint2 access that is not 16- / 8-byte aligned, where x86 would
// just read. The copy constructor is a load, the assignment a store.
struct alignas(16) float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  float4(const float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {
    ::jcoccl_shim::CheckAligned(&o, 16, "float4 load");
  }
  float4& operator=(const float4& o) {
    ::jcoccl_shim::CheckAligned(this, 16, "float4 store");
    x = o.x, y = o.y, z = o.z, w = o.w;
    return *this;
  }
};
struct alignas(8) uint2 {
  unsigned x, y;
  uint2() = default;
  uint2(unsigned a, unsigned b) : x(a), y(b) {}
  uint2(const uint2& o) : x(o.x), y(o.y) { ::jcoccl_shim::CheckAligned(&o, 8, "uint2 load"); }
  uint2& operator=(const uint2& o) {
    ::jcoccl_shim::CheckAligned(this, 8, "uint2 store");
    x = o.x, y = o.y;
    return *this;
  }
};

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureIsolation = 905,
};
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyDeviceToDevice = 3 };

namespace jcoccl_shim {

enum class Wait { kRun, kWarp, kBlock, kDone };

// ---- context switching -------------------------------------------------------------------
// x86-64: a minimal switch (callee-saved registers, MXCSR and the x87 control word), with no
// system call; elsewhere, or with -DJCOCCL_SHIM_UCONTEXT, ucontext (slower: swapcontext
// saves the signal mask). The switch is defined here: include this header in one
// translation unit per library.
#if defined(__x86_64__) && !defined(JCOCCL_SHIM_UCONTEXT)
extern "C" void jcoccl_shim_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type jcoccl_shim_switch, @function
  .hidden jcoccl_shim_switch
jcoccl_shim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size jcoccl_shim_switch, .-jcoccl_shim_switch
)");

struct Context {
  void* sp = nullptr;
  // A fresh context that starts in entry() on the given stack (entry must never return).
  void Make(char* stack, size_t size, void (*entry)()) {
    auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15};
    auto* w = reinterpret_cast<uint64_t*>(top);
    w[-1] = 0;                                  // entry's (never used) return address
    w[-2] = reinterpret_cast<uint64_t>(entry);  // popped by `ret`
    for (int r = 3; r <= 8; ++r) w[-r] = 0;     // rbp rbx r12 r13 r14 r15
    unsigned csr;
    asm volatile("stmxcsr %0" : "=m"(csr));
    w[-9] = uint64_t{csr} | (uint64_t{0x37f} << 32);  // MXCSR, x87 control word
    sp = &w[-9];
  }
};
inline void Switch(Context& from, Context& to) { jcoccl_shim_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
  void Make(char* stack, size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = stack;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, entry, 0);
  }
};
inline void Switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

constexpr size_t kStack = 32 * 1024;  // per thread; the kernels' frames are small

struct Fiber {
  Context ctx;
  Wait wait = Wait::kRun;
  dim3 tid;
  int lane = 0, warp = 0;
  int phase = 0;  // number of warp collectives this lane has completed (buffer parity)
};

struct Block {
  dim3 grid, block, idx;
  Context sched;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;          // block.x stacks of kStack bytes
  std::vector<uint64_t> slots[2];  // per-thread values exchanged by warp collectives
  std::vector<char> smem;
  const std::function<void()>* body = nullptr;
  std::string error;
};

inline thread_local Block* g_block = nullptr;
inline thread_local Fiber* g_fiber = nullptr;
inline thread_local cudaError_t g_last_error = cudaSuccess;
inline thread_local std::string g_last_message;
inline thread_local unsigned g_max_grid = 0;  // 0: launch the grid as configured
inline int g_mutation = 0;                    // tools/gpu_shim.py's deliberate defects (0: none)

inline void SetError(cudaError_t e, const std::string& why) {
  if (g_last_error == cudaSuccess) {
    g_last_error = e;
    g_last_message = why;
  }
}

inline void CheckAligned(const void* p, size_t align, const char* type) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % align == 0) return;
  char where[32];
  std::snprintf(where, sizeof(where), "%#llx", static_cast<unsigned long long>(a));
  SetError(cudaErrorMisalignedAddress, std::string("misaligned address: ") + type + " at " + where +
                                           " (needs " + std::to_string(align) +
                                           "-byte alignment; the GPU faults here)");
}

// Work kinds of a stream's queue (streams.h), for the delay mode.
enum WorkKind : unsigned { kKernelWork = 1, kCopyWork = 2, kCollectiveWork = 4, kXlaWork = 8 };
// Queues fn on stream s (streams.h); fn runs on the stream's worker thread.
inline void Enqueue(cudaStream_t s, unsigned kind, std::function<void()> fn);

inline void Yield(Wait w) {
  g_fiber->wait = w;
  Switch(g_fiber->ctx, g_block->sched);
}

inline void FiberEntry() {
  (*g_block->body)();
  g_fiber->wait = Wait::kDone;
  Switch(g_fiber->ctx, g_block->sched);  // never resumed
  std::abort();
}

// Runs the lanes [first, last) of one warp until each waits at __syncthreads or is done.
inline bool RunWarp(Block& b, int first, int last) {
  for (;;) {
    bool any_runnable = false;
    for (int t = first; t < last; ++t) {
      Fiber& f = b.fibers[t];
      if (f.wait != Wait::kRun) continue;
      any_runnable = true;
      g_fiber = &f;
      Switch(b.sched, f.ctx);
    }
    if (!any_runnable) return true;
    int at_warp = 0, alive = 0;
    for (int t = first; t < last; ++t) {
      at_warp += b.fibers[t].wait == Wait::kWarp;
      alive += b.fibers[t].wait != Wait::kDone;
    }
    if (at_warp == 0) return true;
    if (at_warp != last - first) {
      b.error = "warp divergence: a warp collective was reached by " + std::to_string(at_warp) +
                " of " + std::to_string(last - first) + " lanes (warp " +
                std::to_string(first / 32) + " of block " + std::to_string(b.idx.x) + ")";
      return false;
    }
    for (int t = first; t < last; ++t) b.fibers[t].wait = Wait::kRun;
  }
}

// Runs one block to completion; false (with b.error) on a synchronisation error.
inline bool RunBlock(Block& b) {
  const int nt = static_cast<int>(b.block.x);
  for (int t = 0; t < nt; ++t) {
    Fiber& f = b.fibers[t];
    f = Fiber();
    f.tid = dim3(t);
    f.lane = t & 31;
    f.warp = t >> 5;
    f.ctx.Make(b.stacks + t * kStack, kStack, FiberEntry);
  }
  std::fill(b.smem.begin(), b.smem.end(), 0);
  for (;;) {
    for (int w = 0; w < nt; w += 32) {
      if (!RunWarp(b, w, w + 32 < nt ? w + 32 : nt)) return false;
    }
    int waiting = 0, done = 0;
    for (int t = 0; t < nt; ++t) {
      waiting += b.fibers[t].wait == Wait::kBlock;
      done += b.fibers[t].wait == Wait::kDone;
    }
    if (done == nt) return true;
    if (waiting != nt) {
      b.error = "__syncthreads reached by " + std::to_string(waiting) + " of " +
                std::to_string(nt) + " threads (block " + std::to_string(b.idx.x) + ")";
      return false;
    }
    for (int t = 0; t < nt; ++t) b.fibers[t].wait = Wait::kRun;
  }
}

inline void RunGrid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  // Fiber stacks, kept (uninitialised) across launches: allocating and zeroing them per
  // launch would cost more than running the kernels.
  Block b;
  b.grid = grid;
  b.block = block;
  b.body = &body;
  b.fibers.resize(block.x);
  static thread_local std::unique_ptr<char[]> stacks;
  static thread_local size_t stack_count = 0;
  if (stack_count < block.x) {
    stacks.reset(new char[block.x * kStack]);
    stack_count = block.x;
  }
  b.stacks = stacks.get();
  b.slots[0].assign(block.x, 0);
  b.slots[1].assign(block.x, 0);
  b.smem.assign(smem + 16, 0);
  Block* saved_block = g_block;
  Fiber* saved_fiber = g_fiber;
  g_block = &b;
  for (unsigned i = 0; i < grid.x; ++i) {
    b.idx = dim3(i);
    if (!RunBlock(b)) {
      SetError(cudaErrorLaunchFailure, b.error);
      break;
    }
  }
  g_block = saved_block;
  g_fiber = saved_fiber;
}

struct LaunchCfg {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  LaunchCfg(dim3 g, dim3 b, size_t shared = 0, cudaStream_t s = nullptr)
      : grid(g), block(b), smem(shared), stream(s) {}

  template <class... P, class... A>
  void Run(void (*kernel)(P...), A&&... args) const {
    if (grid.x < 1 || grid.x > 0x7fffffffu || grid.y != 1 || grid.z != 1 || block.x < 1 ||
        block.x > 1024 || block.y != 1 || block.z != 1 || smem > 48 * 1024) {
      SetError(cudaErrorInvalidConfiguration, "invalid launch: grid " + std::to_string(grid.x) +
                                                  ", block " + std::to_string(block.x) +
                                                  ", dynamic shared " + std::to_string(smem));
      return;
    }
    // Kernel parameters are copied by value, as a launch does.
    auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
    dim3 g = grid;
    if (g_max_grid > 0 && g.x > g_max_grid) g.x = g_max_grid;  // kernels are grid-stride
    auto run = [kernel, params, g, b = block, sm = smem] {
      const std::function<void()> body = [&] { std::apply(kernel, *params); };
      RunGrid(g, b, sm, body);
    };
    if (stream == nullptr) {
      run();
    } else {
      Enqueue(stream, kKernelWork, run);
    }
  }
};

template <class T>
T* DynamicShared() {
  return reinterpret_cast<T*>(g_block->smem.data());
}

// Warp synchronisation: the lane deposits `u`, waits for the whole warp, and gets the
// warp's 32 deposits. Two buffers alternate, so a fast lane's next deposit never overwrites
// a value a slower lane has still to read.
inline const uint64_t* WarpSync(uint64_t u) {
  Fiber& f = *g_fiber;
  const int parity = f.phase & 1;
  const int me = static_cast<int>(f.tid.x);
  g_block->slots[parity][me] = u;
  Yield(Wait::kWarp);
  ++f.phase;
  return g_block->slots[parity].data() + (me & ~31);
}

template <class T>
T Exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "warp exchange of at most 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  const uint64_t got = WarpSync(u)[src];
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

inline void CheckFullMask(unsigned mask) {
  if (mask != 0xffffffffu || g_block->block.x % 32 != 0) {
    g_block->error = "warp collective with a partial mask or a partial warp";
    SetError(cudaErrorLaunchFailure, g_block->error);
  }
}

}  // namespace jcoccl_shim

// ---- built-in variables ------------------------------------------------------------------
#define threadIdx (::jcoccl_shim::g_fiber->tid)
#define blockIdx (::jcoccl_shim::g_block->idx)
#define blockDim (::jcoccl_shim::g_block->block)
#define gridDim (::jcoccl_shim::g_block->grid)

inline void __syncthreads() { ::jcoccl_shim::Yield(::jcoccl_shim::Wait::kBlock); }

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::jcoccl_shim::CheckFullMask(mask);
  (void)width;
  return ::jcoccl_shim::Exchange(v, (::jcoccl_shim::g_fiber->lane ^ lane_mask) & 31);
}

inline int __all_sync(unsigned mask, int pred) {
  ::jcoccl_shim::CheckFullMask(mask);
  const uint64_t* lanes = ::jcoccl_shim::WarpSync(pred != 0 ? 1 : 0);
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] == 0) return 0;
  }
  return 1;
}

// ---- integer and bit intrinsics ------------------------------------------------------------
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __float_as_int(float f) {
  int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- runtime API (host side of the launchers) ----------------------------------------------
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ::jcoccl_shim::g_last_error;
  ::jcoccl_shim::g_last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return ::jcoccl_shim::g_last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorMisalignedAddress:
      return "misaligned address";
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnjoined:
      return "capture was not joined back into the origin stream";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    default:
      return "unspecified launch failure";
  }
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t stream = nullptr) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return cudaErrorInvalidValue;
  if (stream == nullptr) {
    std::memmove(dst, src, bytes);
  } else {
    ::jcoccl_shim::Enqueue(stream, ::jcoccl_shim::kCopyWork,
                           [=] { std::memmove(dst, src, bytes); });
  }
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes,
                                   cudaStream_t stream = nullptr) {
  if (bytes > 0 && dst == nullptr) return cudaErrorInvalidValue;
  if (stream == nullptr) {
    std::memset(dst, value, bytes);
  } else {
    ::jcoccl_shim::Enqueue(stream, ::jcoccl_shim::kCopyWork,
                           [=] { std::memset(dst, value, bytes); });
  }
  return cudaSuccess;
}

#include "streams.h"
