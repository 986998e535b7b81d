#include "transport/nccl.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

namespace jcoccl::transport {

namespace {

// Where the entry points come from: the library's own symbols, or, when the library that
// answers for libnccl.so.2 is jcoccl's NCCL interposer (libjcoccl_nccl.so, loaded in front of
// the real NCCL), the real NCCL's functions behind it: jcoccl's exact collectives are never
// taken over and compressed.
struct Resolver {
  void* lib;
  void* (*real)(const char*);  // the interposer's jcoccl_nccl_real_symbol, or null
  template <class F>
  bool operator()(const char* name, F* fn) const {
    *fn = reinterpret_cast<F>(real != nullptr ? real(name) : dlsym(lib, name));
    return *fn != nullptr;
  }
};

NcclApi* LoadApi(std::string* error) {
  // RTLD_NOLOAD first: reuse a libnccl.so.2 the process already has (jcoccl/_src/native/_ffi.py
  // preloads the wheel's copy), so communicators and calls share one NCCL instance.
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    *error = std::string(
                 "jcoccl: cannot open libnccl.so.2 (install nvidia-nccl-cu13 or set "
                 "JCOCCL_NCCL_LIBRARY): ") +
             (e ? e : "");
    return nullptr;
  }
  auto* api = new NcclApi();
  const Resolver sym{
      lib, reinterpret_cast<void* (*)(const char*)>(dlsym(lib, "jcoccl_nccl_real_symbol"))};
  bool ok =
      sym("ncclGetUniqueId", &api->GetUniqueId) && sym("ncclCommInitRank", &api->CommInitRank) &&
      sym("ncclCommDestroy", &api->CommDestroy) && sym("ncclCommAbort", &api->CommAbort) &&
      sym("ncclCommGetAsyncError", &api->CommGetAsyncError) &&
      sym("ncclAllGather", &api->AllGather) && sym("ncclAllReduce", &api->AllReduce) &&
      sym("ncclReduceScatter", &api->ReduceScatter) && sym("ncclSend", &api->Send) &&
      sym("ncclRecv", &api->Recv) && sym("ncclGroupStart", &api->GroupStart) &&
      sym("ncclGroupEnd", &api->GroupEnd) && sym("ncclGetErrorString", &api->GetErrorString) &&
      sym("ncclGetVersion", &api->GetVersion);
  if (!ok) {
    *error = "jcoccl: libnccl.so.2 lacks a required symbol (need NCCL >= 2.18)";
    delete api;
    return nullptr;
  }
  return api;
}

}  // namespace

const NcclApi* Nccl(std::string* error) {
  static std::once_flag once;
  static NcclApi* api = nullptr;
  static std::string load_error;
  std::call_once(once, [] { api = LoadApi(&load_error); });
  if (api == nullptr && error != nullptr) *error = load_error;
  return api;
}

NcclTransport::NcclTransport(ncclComm_t comm, int rank, int size, int device)
    : comm_(comm), rank_(rank), size_(size), device_(device) {
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

NcclTransport::~NcclTransport() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  const NcclApi* api = Nccl(nullptr);
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  // jcoccl.shutdown aborts work still in flight first (CommRegistry::Remove -> Abort), so
  // this destroy does not wait for peers.
  if (api != nullptr && !aborted_) api->CommDestroy(comm_);
  for (const Pending& p : pending_) cudaEventDestroy(p.done);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  cudaSetDevice(prev);
}

Status NcclTransport::Check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  const NcclApi* api = Nccl(nullptr);
  return Status::Error(std::string("jcoccl NCCL ") + what +
                       " failed: " + (api ? api->GetErrorString(r) : "?"));
}

Status NcclTransport::UsableLocked() const { return aborted_ ? Status::Error(why_) : Status::Ok(); }

Status NcclTransport::Healthy() {
  std::lock_guard<std::mutex> lk(mu_);
  return UsableLocked();
}

bool NcclTransport::aborted() {
  std::lock_guard<std::mutex> lk(mu_);
  return aborted_;
}

Status NcclTransport::AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  const NcclApi* api = Nccl(nullptr);
  return Check(api->AllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_,
                              static_cast<cudaStream_t>(ctx.stream)),
               "ncclAllGather");
}

Status NcclTransport::AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  const NcclApi* api = Nccl(nullptr);
  auto s = static_cast<cudaStream_t>(ctx.stream);
  JCOCCL_RETURN_IF_ERROR(Check(api->GroupStart(), "ncclGroupStart"));
  Status st;
  for (int r = 0; r < size_ && st.ok(); ++r) {
    st = Check(api->Send(static_cast<const char*>(send) + r * bytes, bytes, ncclUint8, r, comm_, s),
               "ncclSend");
    if (st.ok())
      st = Check(api->Recv(static_cast<char*>(recv) + r * bytes, bytes, ncclUint8, r, comm_, s),
                 "ncclRecv");
  }
  Status end = Check(api->GroupEnd(), "ncclGroupEnd");
  return st.ok() ? end : st;
}

Status NcclTransport::SendRecv(const CallCtx& ctx, const void* send, int dst, void* recv, int src,
                               int64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  if (dst < 0 && src < 0) return Status::Ok();
  const NcclApi* api = Nccl(nullptr);
  auto s = static_cast<cudaStream_t>(ctx.stream);
  JCOCCL_RETURN_IF_ERROR(Check(api->GroupStart(), "ncclGroupStart"));
  Status st;
  if (dst >= 0) st = Check(api->Send(send, bytes, ncclUint8, dst, comm_, s), "ncclSend");
  if (st.ok() && src >= 0) st = Check(api->Recv(recv, bytes, ncclUint8, src, comm_, s), "ncclRecv");
  Status end = Check(api->GroupEnd(), "ncclGroupEnd");
  return st.ok() ? end : st;
}

Status NcclTransport::AllReduceSum(const CallCtx& ctx, const float* send, int64_t count,
                                   float* recv) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  const NcclApi* api = Nccl(nullptr);
  return Check(api->AllReduce(send, recv, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_,
                              static_cast<cudaStream_t>(ctx.stream)),
               "ncclAllReduce");
}

Status NcclTransport::ReduceScatterSum(const CallCtx& ctx, const float* send,
                                       int64_t count_per_rank, float* recv) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  const NcclApi* api = Nccl(nullptr);
  return Check(api->ReduceScatter(send, recv, static_cast<size_t>(count_per_rank), ncclFloat32,
                                  ncclSum, comm_, static_cast<cudaStream_t>(ctx.stream)),
               "ncclReduceScatter");
}

Status NcclTransport::Watch(cudaStream_t stream, double timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  JCOCCL_RETURN_IF_ERROR(UsableLocked());
  cudaEvent_t e = nullptr;
  if (!free_events_.empty()) {
    e = free_events_.back();
    free_events_.pop_back();
  } else if (cudaError_t c = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
             c != cudaSuccess) {
    return Status::Error(std::string("jcoccl CUDA event create: ") + cudaGetErrorString(c));
  }
  if (cudaError_t c = cudaEventRecord(e, stream); c != cudaSuccess) {
    free_events_.push_back(e);
    return Status::Error(std::string("jcoccl CUDA event record: ") + cudaGetErrorString(c));
  }
  pending_.push_back({e, Clock::now(), timeout});
  cv_.notify_all();
  return Status::Ok();
}

void NcclTransport::AbortLocked(const std::string& why) {
  if (aborted_) return;
  const NcclApi* api = Nccl(nullptr);
  api->CommAbort(comm_);
  aborted_ = true;
  why_ = why;
  // The aborted calls' events complete as their streams drain; nobody waits for them.
  for (const Pending& p : pending_) free_events_.push_back(p.done);
  pending_.clear();
}

void NcclTransport::PollLocked() {
  while (!pending_.empty()) {
    cudaError_t q = cudaEventQuery(pending_.front().done);
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess)
      return AbortLocked(std::string("jcoccl: CUDA error in a collective's stream: ") +
                         cudaGetErrorString(q) + "; the NCCL communicator was aborted");
    free_events_.push_back(pending_.front().done);
    pending_.pop_front();
    // The next call's wait for its peers starts now, not when it was enqueued behind this one.
    if (!pending_.empty()) pending_.front().since = std::max(pending_.front().since, Clock::now());
  }
  if (pending_.empty()) return;
  const NcclApi* api = Nccl(nullptr);
  ncclResult_t async = ncclSuccess;
  api->CommGetAsyncError(comm_, &async);
  if (async != ncclSuccess && async != ncclInProgress)
    return AbortLocked(std::string("jcoccl NCCL asynchronous error: ") +
                       api->GetErrorString(async) +
                       "; the communicator was aborted (the outputs of the call in flight are "
                       "undefined): call jcoccl.shutdown() and jcoccl.init(mesh)");
  const Pending& p = pending_.front();
  const double waited = std::chrono::duration<double>(Clock::now() - p.since).count();
  if (waited > p.timeout)
    AbortLocked("jcoccl NCCL: a collective did not finish within " + std::to_string(p.timeout) +
                " s (jcoccl.config timeout_s / JCOCCL_TIMEOUT_S); a peer is probably lost. The "
                "communicator was aborted (the outputs of the call in flight are undefined): "
                "call jcoccl.shutdown() and jcoccl.init(mesh).");
}

void NcclTransport::WatchdogLoop() {
  cudaSetDevice(device_);
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (pending_.empty() || aborted_) {
      cv_.wait(lk, [&] { return stop_ || (!pending_.empty() && !aborted_); });
      continue;
    }
    PollLocked();
    // Off the critical path: a late check costs only detection latency.
    cv_.wait_for(lk, std::chrono::milliseconds(1), [&] { return stop_; });
  }
}

void NcclTransport::Abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  PollLocked();
  if (!pending_.empty()) AbortLocked(why);
}

Status NcclUniqueId(std::string* out) {
  std::string err;
  const NcclApi* api = Nccl(&err);
  if (api == nullptr) return Status::Error(err);
  ncclUniqueId id;
  ncclResult_t r = api->GetUniqueId(&id);
  if (r != ncclSuccess)
    return Status::Error(std::string("ncclGetUniqueId: ") + api->GetErrorString(r));
  out->assign(id.internal, sizeof(id.internal));
  return Status::Ok();
}

Status NcclInit(const std::string& uid, int nranks, const std::vector<std::pair<int, int>>& members,
                std::vector<ncclComm_t>* comms) {
  std::string err;
  const NcclApi* api = Nccl(&err);
  if (api == nullptr) return Status::Error(err);
  ncclUniqueId id;
  if (uid.size() != sizeof(id.internal))
    return Status::Error("jcoccl: NCCL unique id must be " + std::to_string(sizeof(id.internal)) +
                         " bytes");
  std::memcpy(id.internal, uid.data(), sizeof(id.internal));
  int prev = 0;
  cudaGetDevice(&prev);
  comms->assign(members.size(), nullptr);
  ncclResult_t r = api->GroupStart();
  for (size_t i = 0; i < members.size() && r == ncclSuccess; ++i) {
    cudaSetDevice(members[i].first);
    r = api->CommInitRank(&(*comms)[i], nranks, id, members[i].second);
  }
  ncclResult_t e = api->GroupEnd();
  cudaSetDevice(prev);
  if (r == ncclSuccess) r = e;
  if (r != ncclSuccess)
    return Status::Error(std::string("jcoccl: ncclCommInitRank failed: ") + api->GetErrorString(r));
  return Status::Ok();
}

}  // namespace jcoccl::transport
