// Host shim of CUDA streams and events (included by cuda_runtime.h).
//
// Each cudaStream_t is a queue with its own worker thread, which runs the queued work in
// order: kernel launches, cudaMemcpyAsync / cudaMemsetAsync, stream-event waits, and
// whatever else a library queues with jcoccl_shim::Enqueue (the NCCL emulation queues its
// collectives so). cudaEventRecord captures "everything queued on the stream so far";
// cudaStreamWaitEvent queues a wait for the record captured when it is called, as on the
// GPU; synchronize calls block. Worker threads run with IEEE subnormals (MXCSR 0x1f80), as
// the kernels do on the GPU, whatever the creating thread's floating-point state.
//
// Checks, for tests (a finding is kept in a log that Findings() drains):
//   - an event recorded again, on another stream, while nobody has waited on, queried or
//     synchronised with its previous record: that record is lost to whoever meant to wait
//     for it (a record on the same stream covers the earlier one: waiting is longer, never
//     wrong, so it is not reported);
//   - a kernel that fails on a worker (warp divergence, ...) makes the stream's error sticky.
// Graph capture (cudaStreamBeginCapture ... cudaStreamEndCapture, cudaGraphInstantiate,
// cudaGraphLaunch): work queued on a capturing stream is recorded, not run, and runs at each
// launch of the instantiated graph. A stream that waits on an event recorded in a capture
// joins it (a fork); cudaStreamEndCapture fails with cudaErrorStreamCaptureUnjoined, as CUDA
// does, when a forked stream's last work was never waited on by the origin (directly or
// through other joined streams). Synchronising a capturing stream invalidates the capture.
// A launch runs each captured stream's work on a stream of its own, with the recorded event
// waits between them, after the work queued before it on the launching stream, and the
// launching stream's later work waits for all of it.
// Tests may also set a stream's `capturing` flag: cudaStreamIsCapturing then says so, but
// work runs as it is queued.
// Delay mode (SetDelay): queued work of the chosen kinds sleeps a fixed time before it runs,
// so a missing wait turns into a wrong result every time instead of once in a while.
#pragma once

#include <unistd.h>
#include <xmmintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

struct CaptureState;

struct CUstream_st {
  int device = 0;
  int id = 0;
  int priority = 0;
  std::condition_variable work;  // the queue is non-empty
  std::deque<std::pair<unsigned, std::function<void()>>> queue;
  uint64_t enqueued = 0;   // items ever queued
  uint64_t completed = 0;  // items finished (in order)
  cudaError_t error = cudaSuccess;
  bool capturing = false;           // as if a CUDA graph capture were under way (tests set it)
  CaptureState* capture = nullptr;  // the graph capture this stream records into
  int lane = -1;                    // its lane in that capture's graph
};

struct CUevent_st {
  CUstream_st* stream = nullptr;    // stream of the last record (null: none, or the null stream)
  uint64_t target = 0;              // its `completed` count once the recorded work is done
  bool observed = true;             // the last record was waited on, queried or synchronised
  CaptureState* capture = nullptr;  // recorded inside this capture (then lane, pos)
  int lane = -1;
  size_t pos = 0;
};

// One captured operation: work, or (wait_lane >= 0) a wait until lane `wait_lane` of the same
// graph has run its first `wait_pos` nodes.
struct GraphNode {
  unsigned kind = 0;
  std::function<void()> fn;
  int wait_lane = -1;
  size_t wait_pos = 0;
};

// A captured graph: one lane of nodes per stream that took part, lane 0 the origin's.
struct CUgraph_st {
  std::vector<std::vector<GraphNode>> lanes;
  std::vector<int> device;  // of each lane's stream
};

struct CaptureState {
  CUgraph_st* graph = nullptr;
  std::vector<CUstream_st*> streams;  // by lane
  cudaError_t invalid = cudaSuccess;  // set once an operation broke the capture
};

// An instantiated graph: a stream per lane, on which launches run.
struct CUgraphExec_st {
  CUgraph_st graph;
  std::vector<CUstream_st*> lanes;
};

enum { cudaStreamDefault = 0, cudaStreamNonBlocking = 1 };
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
enum { cudaEventDefault = 0, cudaEventDisableTiming = 2 };

namespace jcoccl_shim {

// One lock for every stream's queue and counters; `progress` wakes whoever waits for work
// of any stream to finish. Both live forever (workers may still wait at exit).
struct Runtime {
  std::mutex mu;
  std::condition_variable progress;
  std::vector<CUstream_st*> streams;
  std::vector<std::pair<int, std::string>> findings;  // (device, what)
};
// One Runtime per process. The shim is compiled into several objects of one process (the
// NCCL emulation, libjcoccl_nccl.so, a test program such as xla_patterns), and a stream's
// worker and whoever waits for it from another object must share one lock and condition
// variable, else a wake-up is lost and the waiter hangs. g++'s unique symbols do not ensure
// it: an executable binds its own copy of Rt's static, the libraries another (with a group
// that mixes taken and forwarded calls, most xla_patterns runs hung so). So the first object
// to ask makes the Runtime and leaves its address, after the process id (children inherit
// the environment), in an environment variable named after the struct's size; the others
// use it. Objects ask first from one thread (when they make their first stream).
inline Runtime* FindRuntime() {
  const std::string name = "JCOCCL_SHIM_RUNTIME_" + std::to_string(sizeof(Runtime));
  const std::string pid = std::to_string(static_cast<long long>(getpid())) + ":";
  if (const char* v = std::getenv(name.c_str());
      v != nullptr && std::strncmp(v, pid.c_str(), pid.size()) == 0)
    return reinterpret_cast<Runtime*>(std::strtoull(v + pid.size(), nullptr, 16));
  auto* rt = new Runtime();
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(rt)));
  setenv(name.c_str(), (pid + hex).c_str(), 1);
  return rt;
}
inline Runtime& Rt() {
  static Runtime* rt = FindRuntime();
  return *rt;
}

inline thread_local int g_device = 0;
inline std::atomic<unsigned> g_delay_kinds{0};
inline std::atomic<int> g_delay_us{0};

inline void SetDelay(unsigned kinds, int microseconds) {
  g_delay_kinds = kinds;
  g_delay_us = microseconds;
}

// Findings are kept per device (the current device of the thread that makes them), so
// each device's caller sees its own.
inline void Report(const std::string& what) {
  std::lock_guard<std::mutex> lk(Rt().mu);
  Rt().findings.emplace_back(g_device, what);
}

// Drains the findings of `device` (-1: of every device).
inline std::vector<std::string> Findings(int device = -1) {
  std::lock_guard<std::mutex> lk(Rt().mu);
  std::vector<std::string> out;
  auto& all = Rt().findings;
  for (auto it = all.begin(); it != all.end();) {
    if (device < 0 || it->first == device) {
      out.push_back(std::move(it->second));
      it = all.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

inline void Worker(CUstream_st* s) {
  _mm_setcsr(0x1f80);  // IEEE: no DAZ/FTZ, all exceptions masked
  g_device = s->device;
  Runtime& rt = Rt();
  for (;;) {
    std::pair<unsigned, std::function<void()>> item;
    {
      std::unique_lock<std::mutex> lk(rt.mu);
      s->work.wait(lk, [&] { return !s->queue.empty(); });
      item = std::move(s->queue.front());
      s->queue.pop_front();
    }
    if ((g_delay_kinds.load() & item.first) != 0)
      std::this_thread::sleep_for(std::chrono::microseconds(g_delay_us.load()));
    g_last_error = cudaSuccess;
    g_last_message.clear();
    item.second();
    const cudaError_t e = g_last_error;
    std::string why = g_last_message;
    std::unique_lock<std::mutex> lk(rt.mu);
    if (e != cudaSuccess && s->error == cudaSuccess) {
      s->error = e;
      rt.findings.emplace_back(
          s->device, "stream " + std::to_string(s->id) + ": queued kernel failed: " + why);
    }
    ++s->completed;
    rt.progress.notify_all();
  }
}

inline void Enqueue(cudaStream_t s, unsigned kind, std::function<void()> fn) {
  std::lock_guard<std::mutex> lk(Rt().mu);
  if (s->capture != nullptr) {  // recorded into the graph: runs at each launch
    GraphNode node;
    node.kind = kind;
    node.fn = std::move(fn);
    s->capture->graph->lanes[s->lane].push_back(std::move(node));
    return;
  }
  s->queue.emplace_back(kind, std::move(fn));
  ++s->enqueued;
  s->work.notify_one();
}

// Blocks until stream s has finished its first `target` items.
inline void WaitFor(CUstream_st* s, uint64_t target) {
  std::unique_lock<std::mutex> lk(Rt().mu);
  Rt().progress.wait(lk, [&] { return s->completed >= target; });
}

inline CUstream_st* NewStream(int priority) {
  auto* s = new CUstream_st();
  s->device = g_device;
  s->priority = priority;
  {
    std::lock_guard<std::mutex> lk(Rt().mu);
    s->id = static_cast<int>(Rt().streams.size());
    Rt().streams.push_back(s);
  }
  std::thread(Worker, s).detach();
  return s;
}

// (stream, items queued so far) for every stream of `device`.
inline std::vector<std::pair<CUstream_st*, uint64_t>> Snapshot(int device) {
  std::lock_guard<std::mutex> lk(Rt().mu);
  std::vector<std::pair<CUstream_st*, uint64_t>> out;
  for (CUstream_st* s : Rt().streams)
    if (s->device == device) out.emplace_back(s, s->enqueued);
  return out;
}

inline uint64_t Completed(CUstream_st* s) {
  std::lock_guard<std::mutex> lk(Rt().mu);
  return s->completed;
}

}  // namespace jcoccl_shim

inline cudaError_t cudaSetDevice(int d) {
  if (d < 0) return cudaErrorInvalidValue;
  ::jcoccl_shim::g_device = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = ::jcoccl_shim::g_device;
  return cudaSuccess;
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned, int priority) {
  *s = ::jcoccl_shim::NewStream(priority);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithPriority(s, 0, 0);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
    if (s->capture != nullptr) {  // as CUDA: not allowed, and the capture is broken
      s->capture->invalid = cudaErrorStreamCaptureUnsupported;
      return cudaErrorStreamCaptureUnsupported;
    }
    target = s->enqueued;
  }
  ::jcoccl_shim::WaitFor(s, target);
  std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
  return s->error;
}
inline cudaError_t cudaDeviceSynchronize() {
  cudaError_t e = cudaSuccess;
  for (auto& [s, n] : ::jcoccl_shim::Snapshot(::jcoccl_shim::g_device)) {
    ::jcoccl_shim::WaitFor(s, n);
    std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
    if (e == cudaSuccess) e = s->error;
  }
  return e;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st();
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  ::jcoccl_shim::Runtime& rt = ::jcoccl_shim::Rt();
  std::lock_guard<std::mutex> lk(rt.mu);
  if (s != nullptr && s->capture != nullptr) {  // a node of the graph: where its lane stands
    e->capture = s->capture;
    e->lane = s->lane;
    e->pos = s->capture->graph->lanes[s->lane].size();
    e->stream = nullptr;
    e->observed = true;
    return cudaSuccess;
  }
  e->capture = nullptr;
  if (!e->observed && e->stream != s)
    rt.findings.emplace_back(
        ::jcoccl_shim::g_device,
        "event recorded again before anything waited on its previous record (stream " +
            std::to_string(e->stream ? e->stream->id : -1) + " -> " +
            std::to_string(s ? s->id : -1) + ")");
  e->stream = s;
  e->target = s == nullptr ? 0 : s->enqueued;
  e->observed = false;
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned = 0) {
  if (e == nullptr || s == nullptr) return cudaErrorInvalidResourceHandle;
  CUstream_st* src;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
    if (e->capture != nullptr) {
      CaptureState* c = e->capture;
      if (s->capture != nullptr && s->capture != c) return cudaErrorStreamCaptureIsolation;
      if (s->capture == nullptr) {  // a fork: s joins the capture
        s->capture = c;
        s->lane = static_cast<int>(c->streams.size());
        c->streams.push_back(s);
        c->graph->lanes.emplace_back();
        c->graph->device.push_back(s->device);
      }
      if (s->lane != e->lane) {
        GraphNode wait;
        wait.wait_lane = e->lane;
        wait.wait_pos = e->pos;
        c->graph->lanes[s->lane].push_back(std::move(wait));
      }
      return cudaSuccess;
    }
    e->observed = true;
    src = e->stream;
    target = e->target;
  }
  if (src == nullptr || src == s) return cudaSuccess;  // already ordered
  ::jcoccl_shim::Enqueue(s, 0, [src, target] { ::jcoccl_shim::WaitFor(src, target); });
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
  e->observed = true;
  if (e->stream == nullptr) return cudaSuccess;
  if (e->stream->error != cudaSuccess) return e->stream->error;
  return e->stream->completed >= e->target ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  CUstream_st* src;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
    e->observed = true;
    src = e->stream;
    target = e->target;
  }
  if (src != nullptr) ::jcoccl_shim::WaitFor(src, target);
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
  const bool on = s != nullptr && (s->capturing || s->capture != nullptr);
  *status = !on                                                ? cudaStreamCaptureStatusNone
            : s->capture && s->capture->invalid != cudaSuccess ? cudaStreamCaptureStatusInvalidated
                                                               : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (s == nullptr) return cudaErrorStreamCaptureUnsupported;  // the legacy null stream
  std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
  if (s->capture != nullptr) return cudaErrorIllegalState;
  auto* c = new CaptureState();
  c->graph = new CUgraph_st();
  c->graph->lanes.emplace_back();
  c->graph->device.push_back(s->device);
  c->streams.push_back(s);
  s->capture = c;
  s->lane = 0;
  return cudaSuccess;
}

namespace jcoccl_shim {
// The lanes of capture c whose last node the origin (lane 0) waits for, directly or through
// other such lanes.
inline std::vector<bool> JoinedLanes(const CUgraph_st& g) {
  const size_t n = g.lanes.size();
  std::vector<bool> joined(n, false);
  joined[0] = true;
  for (bool grew = true; grew;) {
    grew = false;
    for (size_t m = 0; m < n; ++m) {
      if (!joined[m]) continue;
      for (const GraphNode& node : g.lanes[m]) {
        const int l = node.wait_lane;
        if (l >= 0 && !joined[l] && node.wait_pos >= g.lanes[l].size()) joined[l] = grew = true;
      }
    }
  }
  return joined;
}
}  // namespace jcoccl_shim

inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (s == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  CaptureState* c;
  {
    std::lock_guard<std::mutex> lk(::jcoccl_shim::Rt().mu);
    c = s->capture;
    if (c == nullptr || s->lane != 0) return cudaErrorIllegalState;
    for (CUstream_st* x : c->streams) {
      x->capture = nullptr;
      x->lane = -1;
    }
  }
  *graph = nullptr;
  cudaError_t e = c->invalid;
  if (e == cudaSuccess) {
    const std::vector<bool> joined = ::jcoccl_shim::JoinedLanes(*c->graph);
    for (size_t l = 1; l < joined.size(); ++l) {
      if (joined[l]) continue;
      ::jcoccl_shim::Report("graph capture: stream " + std::to_string(c->streams[l]->id) +
                            " was forked into the capture of stream " + std::to_string(s->id) +
                            " and never joined back (cudaErrorStreamCaptureUnjoined)");
      e = cudaErrorStreamCaptureUnjoined;
    }
  } else {
    e = cudaErrorStreamCaptureInvalidated;
  }
  if (e == cudaSuccess) {
    *graph = c->graph;
  } else {
    delete c->graph;
  }
  delete c;
  return e;
}

inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                        unsigned long long = 0) {
  if (exec == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  auto* x = new CUgraphExec_st();
  x->graph = *graph;
  const int saved = ::jcoccl_shim::g_device;
  for (int d : graph->device) {
    ::jcoccl_shim::g_device = d;
    x->lanes.push_back(::jcoccl_shim::NewStream(0));
  }
  ::jcoccl_shim::g_device = saved;
  *exec = x;
  return cudaSuccess;
}

// Queues one run of the graph after the work queued so far on `s`.
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  if (exec == nullptr || s == nullptr) return cudaErrorInvalidValue;
  namespace js = ::jcoccl_shim;
  const size_t n = exec->lanes.size();
  std::vector<uint64_t> base(n);
  uint64_t start;
  {
    std::lock_guard<std::mutex> lk(js::Rt().mu);
    if (s->capture != nullptr) return cudaErrorStreamCaptureUnsupported;
    start = s->enqueued;
    for (size_t l = 0; l < n; ++l) base[l] = exec->lanes[l]->enqueued;
  }
  // A lane's node p completes as its stream's item base + 1 + p (item base + 0: the start).
  for (size_t l = 0; l < n; ++l) {
    CUstream_st* lane = exec->lanes[l];
    js::Enqueue(lane, 0, [s, start] { js::WaitFor(s, start); });
    for (const GraphNode& node : exec->graph.lanes[l]) {
      if (node.wait_lane < 0) {
        js::Enqueue(lane, node.kind, node.fn);
      } else {
        CUstream_st* other = exec->lanes[node.wait_lane];
        const uint64_t target = base[node.wait_lane] + 1 + node.wait_pos;
        js::Enqueue(lane, 0, [other, target] { js::WaitFor(other, target); });
      }
    }
  }
  for (size_t l = 0; l < n; ++l) {
    CUstream_st* lane = exec->lanes[l];
    const uint64_t end = base[l] + 1 + exec->graph.lanes[l].size();
    js::Enqueue(s, 0, [lane, end] { js::WaitFor(lane, end); });
  }
  return cudaSuccess;
}

inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

// The lane streams stay (their workers never end); the graph's nodes are freed.
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec != nullptr) exec->graph.lanes.clear();
  return cudaSuccess;
}
