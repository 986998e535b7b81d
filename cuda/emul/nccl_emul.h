// An emulation of the NCCL API that jcoccl's transport (cuda/transport/nccl.cc) uses, over
// threads in one process and the host shim's streams (cuda/hostshim/streams.h). Included
// once, into the library that tools/cuda_ext.py builds (cuda_ext.cc), whose exported nccl*
// functions these are; nccl.cc's dlopen("libnccl.so.2") is answered with that library.
//
// Semantics kept from NCCL:
//   - collectives and send/recv are queued on the caller's stream and run in stream order;
//     a rank's operation completes once its peers have joined it (a peer that never comes
//     leaves the stream blocked until ncclCommAbort);
//   - between ncclGroupStart and ncclGroupEnd operations are collected, and ncclGroupEnd
//     queues them as one unit (sends posted before receives, so an all-to-all of sends and
//     receives cannot deadlock); ncclGroupEnd without a start is ncclInvalidUsage;
//   - send/recv match in issue order per (sender, receiver) pair, with equal byte counts;
//   - the stream must belong to the communicator's device (cudaSetDevice at init).
// Sums (ncclSum on ncclFloat32) fold in rank order, (((x0 + x1) + x2) + ...), like jcoccl's
// host transport, so the two transports give identical bits (real NCCL's order differs).
//
// For tests: the return gate (ReturnGate below) holds queued NCCL work until the fused
// handler that queued it has returned; InjectFailure makes the next `count` calls of one entry
// point fail at once with ncclInternalError (an operation NCCL refuses to queue); GroupDepth tells
// whether a thread left a group open. ncclGetVersion reports kEmulatedVersion, which no real NCCL
// has.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nccl.h"

namespace jcoccl_emul {

constexpr int kEmulatedVersion = 99999;

struct Msg {
  const void* data;
  size_t bytes;
  bool taken = false;
};

struct Coll {
  int arrived = 0, left = 0, gone = 0;
  std::vector<const void*> send;
  std::vector<void*> recv;
};

// The ranks that share one unique id.
struct Clique {
  int nranks = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Coll> colls;                                        // by sequence number
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Msg>>> chan;  // (src, dst) FIFO
  bool aborted = false;
};

}  // namespace jcoccl_emul

struct ncclComm {
  std::shared_ptr<jcoccl_emul::Clique> clique;
  int rank = 0, nranks = 0, device = 0;
  uint64_t seq = 0;  // collectives run so far (on the stream's worker)
  std::atomic<int> async{ncclSuccess};
};

namespace jcoccl_emul {

enum OpKind { kAllGather, kAllReduce, kReduceScatter, kSend, kRecv, kNumOps };
inline const char* const kOpNames[kNumOps] = {"ncclAllGather", "ncclAllReduce", "ncclReduceScatter",
                                              "ncclSend", "ncclRecv"};

struct Op {
  OpKind kind;
  ncclComm_t comm;
  cudaStream_t stream;
  const void* send;
  void* recv;
  size_t bytes;  // per rank (collectives) or of the message (send/recv)
  int peer;
};

struct GroupState {
  int depth = 0;
  std::vector<Op> pending;
};
inline thread_local GroupState g_group;

inline std::atomic<int> g_fail_kind{-1};
inline std::atomic<int> g_fail_count{0};

// The next `count` calls of `op` (an entry point's name) fail with ncclInternalError.
inline bool InjectFailure(const std::string& op, int count) {
  for (int k = 0; k < kNumOps; ++k) {
    if (op == kOpNames[k]) {
      g_fail_count = count;
      g_fail_kind = k;
      return true;
    }
  }
  return false;
}

inline bool Injected(OpKind k) {
  if (g_fail_kind.load() != k) return false;
  return g_fail_count.fetch_sub(1) > 0;
}

inline int GroupDepth() { return g_group.depth; }
inline void ResetGroup() { g_group = GroupState(); }

inline std::mutex& RegistryMu() {
  static auto* m = new std::mutex();
  return *m;
}
inline std::map<std::string, std::weak_ptr<Clique>>& Registry() {
  static auto* r = new std::map<std::string, std::weak_ptr<Clique>>();
  return *r;
}

// Waits on the clique until pred() holds or the clique is aborted; false if aborted.
template <class P>
bool Await(Clique& c, std::unique_lock<std::mutex>& lk, P pred) {
  while (!pred()) {
    if (c.aborted) return false;
    c.cv.wait_for(lk, std::chrono::milliseconds(20));
  }
  return true;
}

inline void Fail(ncclComm_t comm, ncclResult_t r) {
  int expected = ncclSuccess;
  comm->async.compare_exchange_strong(expected, r);
}

// One collective of `comm`'s rank, on the stream's worker.
inline void RunCollective(const Op& op) {
  ncclComm_t comm = op.comm;
  Clique& c = *comm->clique;
  const int n = comm->nranks, me = comm->rank;
  const uint64_t seq = comm->seq++;
  std::unique_lock<std::mutex> lk(c.mu);
  Coll& k = c.colls[seq];
  if (k.send.empty()) {
    k.send.assign(n, nullptr);
    k.recv.assign(n, nullptr);
  }
  k.send[me] = op.send;
  k.recv[me] = op.recv;
  ++k.arrived;
  c.cv.notify_all();
  if (!Await(c, lk, [&] { return k.arrived == n; })) return Fail(comm, ncclSystemError);
  std::vector<const void*> send = k.send;
  lk.unlock();
  auto* out = static_cast<uint8_t*>(op.recv);
  if (op.kind == kAllGather) {
    for (int r = 0; r < n; ++r) std::memcpy(out + r * op.bytes, send[r], op.bytes);
  } else {
    // float32 sums in rank order; reduce-scatter takes this rank's block of each input.
    const size_t count = op.bytes / sizeof(float);
    const size_t off = op.kind == kReduceScatter ? me * count : 0;
    auto* o = reinterpret_cast<float*>(out);
    for (size_t i = 0; i < count; ++i) {
      float acc = reinterpret_cast<const float*>(send[0])[off + i];
      for (int r = 1; r < n; ++r) acc = acc + reinterpret_cast<const float*>(send[r])[off + i];
      o[i] = acc;
    }
  }
  lk.lock();
  ++k.left;
  c.cv.notify_all();
  // Peers read this rank's input until they leave: wait for them before finishing.
  if (!Await(c, lk, [&] { return k.left == n; })) return Fail(comm, ncclSystemError);
  if (++k.gone == n) c.colls.erase(seq);
}

// The sends and receives of one group, on the stream's worker.
inline void RunP2P(const std::vector<Op>& ops) {
  std::vector<std::pair<ncclComm_t, std::shared_ptr<Msg>>> posted;
  for (const Op& op : ops) {
    if (op.kind != kSend) continue;
    Clique& c = *op.comm->clique;
    std::lock_guard<std::mutex> lk(c.mu);
    auto m = std::make_shared<Msg>(Msg{op.send, op.bytes});
    c.chan[{op.comm->rank, op.peer}].push_back(m);
    posted.emplace_back(op.comm, m);
    c.cv.notify_all();
  }
  for (const Op& op : ops) {
    if (op.kind != kRecv) continue;
    Clique& c = *op.comm->clique;
    std::unique_lock<std::mutex> lk(c.mu);
    auto& q = c.chan[{op.peer, op.comm->rank}];
    if (!Await(c, lk, [&] { return !q.empty(); })) return Fail(op.comm, ncclSystemError);
    std::shared_ptr<Msg> m = q.front();
    q.pop_front();
    lk.unlock();
    if (m->bytes != op.bytes) {
      jcoccl_shim::Report("NCCL emulation: rank " + std::to_string(op.comm->rank) + " receives " +
                          std::to_string(op.bytes) + " bytes from rank " + std::to_string(op.peer) +
                          ", which sent " + std::to_string(m->bytes));
      Fail(op.comm, ncclInvalidUsage);
    }
    std::memcpy(op.recv, m->data, m->bytes < op.bytes ? m->bytes : op.bytes);
    lk.lock();
    m->taken = true;
    c.cv.notify_all();
  }
  for (auto& [comm, m] : posted) {
    Clique& c = *comm->clique;
    std::unique_lock<std::mutex> lk(c.mu);
    if (!Await(c, lk, [&] { return m->taken; })) return Fail(comm, ncclSystemError);
  }
}

// Return gate (for tests): while on, NCCL work that a fused handler queues runs only after
// that handler has returned, so a handler that waits on the host for its own collective
// stalls until the gate gives up (after g_gate_timeout_ms) and reports it. The XLA adaptor
// (xla_adaptor.h) numbers each handler call of a device and says when it returned.
struct ReturnGate {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, uint64_t> started, returned;  // per device: handler calls begun / returned
};
inline ReturnGate& Gate() {
  static auto* g = new ReturnGate();
  return *g;
}
inline std::atomic<bool> g_gate_on{false};
inline std::atomic<int> g_gate_timeout_ms{3000};
inline std::atomic<int> g_gate_held{0};   // operations that passed the gate (held or not)
inline thread_local uint64_t g_call = 0;  // the handler call this thread is in (0: none)

inline uint64_t BeginCall(int device) {
  std::lock_guard<std::mutex> lk(Gate().mu);
  return g_call = ++Gate().started[device];
}

inline void EndCall(int device, uint64_t call) {
  g_call = 0;
  std::lock_guard<std::mutex> lk(Gate().mu);
  Gate().returned[device] = call;
  Gate().cv.notify_all();
}

// On a stream's worker: holds the operation until handler call `call` of `device` returned.
inline void HoldUntilReturned(int device, uint64_t call) {
  ++g_gate_held;  // whether the handler has returned yet is a race: count both
  std::unique_lock<std::mutex> lk(Gate().mu);
  if (Gate().returned[device] >= call) return;
  const auto limit = std::chrono::milliseconds(g_gate_timeout_ms.load());
  if (!Gate().cv.wait_for(lk, limit, [&] { return Gate().returned[device] >= call; }))
    jcoccl_shim::Report("NCCL emulation: device " + std::to_string(device) +
                        "'s fused handler had not returned " + std::to_string(limit.count()) +
                        " ms after queueing its NCCL work (the gate held that work until the "
                        "handler returned): the handler waits on the host for its collective");
}

// Queues a group's operations: one unit per stream, collectives first, in issue order.
inline void Launch(std::vector<Op> ops) {
  const bool gated = g_gate_on.load() && g_call != 0;
  const uint64_t call = g_call;
  std::vector<cudaStream_t> streams;
  for (const Op& op : ops) {
    bool seen = false;
    for (cudaStream_t s : streams) seen |= s == op.stream;
    if (!seen) streams.push_back(op.stream);
  }
  for (cudaStream_t s : streams) {
    std::vector<Op> mine;
    for (const Op& op : ops)
      if (op.stream == s) mine.push_back(op);
    jcoccl_shim::Enqueue(s, jcoccl_shim::kCollectiveWork, [mine, gated, call] {
      if (gated) HoldUntilReturned(mine[0].comm->device, call);
      for (const Op& op : mine)
        if (op.kind != kSend && op.kind != kRecv) RunCollective(op);
      RunP2P(mine);
    });
  }
}

inline ncclResult_t Submit(const Op& op) {
  if (op.comm == nullptr || op.stream == nullptr) return ncclInvalidArgument;
  if (op.stream->device != op.comm->device) {
    jcoccl_shim::Report("NCCL emulation: " + std::string(kOpNames[op.kind]) +
                        " on a stream of device " + std::to_string(op.stream->device) +
                        " with the communicator of device " + std::to_string(op.comm->device));
    return ncclInvalidArgument;
  }
  if ((op.kind == kSend || op.kind == kRecv) && (op.peer < 0 || op.peer >= op.comm->nranks))
    return ncclInvalidArgument;
  if (Injected(op.kind)) return ncclInternalError;
  if (g_group.depth > 0) {
    g_group.pending.push_back(op);
  } else {
    Launch({op});
  }
  return ncclSuccess;
}

inline size_t TypeBytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

}  // namespace jcoccl_emul

JCE_NCCL_API ncclResult_t ncclGetVersion(int* version) {
  *version = jcoccl_emul::kEmulatedVersion;
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::atomic<uint64_t> next{1};
  std::memset(id->internal, 0, sizeof(id->internal));
  const uint64_t v = next++;
  std::memcpy(id->internal, "jcoccl-emul", 11);
  std::memcpy(id->internal + 16, &v, sizeof(v));
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                           int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lk(jcoccl_emul::RegistryMu());
  const std::string key(id.internal, sizeof(id.internal));
  std::shared_ptr<jcoccl_emul::Clique> c = jcoccl_emul::Registry()[key].lock();
  if (!c) {
    c = std::make_shared<jcoccl_emul::Clique>();
    c->nranks = nranks;
    jcoccl_emul::Registry()[key] = c;
  }
  if (c->nranks != nranks) return ncclInvalidArgument;
  auto* x = new ncclComm();
  x->clique = c;
  x->rank = rank;
  x->nranks = nranks;
  cudaGetDevice(&x->device);
  *comm = x;
  return ncclSuccess;
}

// The communicator object stays allocated: work queued before the destroy may still use it.
JCE_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  jcoccl_emul::Clique& c = *comm->clique;
  std::lock_guard<std::mutex> lk(c.mu);
  c.aborted = true;
  c.cv.notify_all();
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  if (comm == nullptr) return ncclInvalidArgument;
  *err = static_cast<ncclResult_t>(comm->async.load());
  return ncclSuccess;
}

JCE_NCCL_API const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclSystemError:
      return "unhandled system error";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

JCE_NCCL_API ncclResult_t ncclGroupStart() {
  ++jcoccl_emul::g_group.depth;
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclGroupEnd() {
  auto& g = jcoccl_emul::g_group;
  if (g.depth == 0) return ncclInvalidUsage;
  if (--g.depth == 0) {
    std::vector<jcoccl_emul::Op> ops;
    ops.swap(g.pending);
    if (!ops.empty()) jcoccl_emul::Launch(std::move(ops));
  }
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
  return jcoccl_emul::Submit(
      {jcoccl_emul::kAllGather, comm, s, send, recv, count * jcoccl_emul::TypeBytes(type), -1});
}

JCE_NCCL_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t s) {
  if (type != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;  // all jcoccl uses
  return jcoccl_emul::Submit({jcoccl_emul::kAllReduce, comm, s, send, recv, count * 4, -1});
}

JCE_NCCL_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t s) {
  if (type != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
  return jcoccl_emul::Submit({jcoccl_emul::kReduceScatter, comm, s, send, recv, count * 4, -1});
}

JCE_NCCL_API ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s) {
  return jcoccl_emul::Submit(
      {jcoccl_emul::kSend, comm, s, send, nullptr, count * jcoccl_emul::TypeBytes(type), peer});
}

JCE_NCCL_API ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s) {
  return jcoccl_emul::Submit(
      {jcoccl_emul::kRecv, comm, s, nullptr, recv, count * jcoccl_emul::TypeBytes(type), peer});
}
