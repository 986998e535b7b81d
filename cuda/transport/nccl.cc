#include "transport/nccl.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

namespace jcoccl::transport {

namespace {

template <class F>
bool Sym(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

NcclApi* LoadApi(std::string* error) {
  // RTLD_NOLOAD first: reuse a libnccl.so.2 the process already has (jcoccl/_src/_ffi.py
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
  bool ok =
      Sym(lib, "ncclGetUniqueId", &api->GetUniqueId) &&
      Sym(lib, "ncclCommInitRank", &api->CommInitRank) &&
      Sym(lib, "ncclCommDestroy", &api->CommDestroy) &&
      Sym(lib, "ncclCommAbort", &api->CommAbort) &&
      Sym(lib, "ncclCommGetAsyncError", &api->CommGetAsyncError) &&
      Sym(lib, "ncclAllGather", &api->AllGather) && Sym(lib, "ncclAllReduce", &api->AllReduce) &&
      Sym(lib, "ncclReduceScatter", &api->ReduceScatter) && Sym(lib, "ncclSend", &api->Send) &&
      Sym(lib, "ncclRecv", &api->Recv) && Sym(lib, "ncclGroupStart", &api->GroupStart) &&
      Sym(lib, "ncclGroupEnd", &api->GroupEnd) &&
      Sym(lib, "ncclGetErrorString", &api->GetErrorString) &&
      Sym(lib, "ncclGetVersion", &api->GetVersion);
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

NcclTransport::~NcclTransport() {
  const NcclApi* api = Nccl(nullptr);
  if (api == nullptr || aborted_) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  api->CommDestroy(comm_);
  cudaSetDevice(prev);
}

Status NcclTransport::Check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  const NcclApi* api = Nccl(nullptr);
  return Status::Error(std::string("jcoccl NCCL ") + what +
                       " failed: " + (api ? api->GetErrorString(r) : "?"));
}

Status NcclTransport::AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  if (aborted_) return Status::Error("jcoccl NCCL communicator was aborted; re-run jcoccl.init");
  const NcclApi* api = Nccl(nullptr);
  return Check(api->AllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_,
                              static_cast<cudaStream_t>(ctx.stream)),
               "ncclAllGather");
}

Status NcclTransport::AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  if (aborted_) return Status::Error("jcoccl NCCL communicator was aborted; re-run jcoccl.init");
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
  if (aborted_) return Status::Error("jcoccl NCCL communicator was aborted; re-run jcoccl.init");
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
  if (aborted_) return Status::Error("jcoccl NCCL communicator was aborted; re-run jcoccl.init");
  const NcclApi* api = Nccl(nullptr);
  return Check(api->AllReduce(send, recv, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_,
                              static_cast<cudaStream_t>(ctx.stream)),
               "ncclAllReduce");
}

Status NcclTransport::ReduceScatterSum(const CallCtx& ctx, const float* send,
                                       int64_t count_per_rank, float* recv) {
  if (aborted_) return Status::Error("jcoccl NCCL communicator was aborted; re-run jcoccl.init");
  const NcclApi* api = Nccl(nullptr);
  return Check(api->ReduceScatter(send, recv, static_cast<size_t>(count_per_rank), ncclFloat32,
                                  ncclSum, comm_, static_cast<cudaStream_t>(ctx.stream)),
               "ncclReduceScatter");
}

Status NcclTransport::Wait(cudaEvent_t done, double timeout) {
  const NcclApi* api = Nccl(nullptr);
  const auto start = std::chrono::steady_clock::now();
  for (int spin = 0;; ++spin) {
    cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady)
      return Status::Error(std::string("jcoccl: CUDA error while waiting: ") +
                           cudaGetErrorString(q));
    ncclResult_t async = ncclSuccess;
    api->CommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      api->CommAbort(comm_);
      aborted_ = true;
      return Status::Error(std::string("jcoccl NCCL asynchronous error: ") +
                           api->GetErrorString(async) + "; the communicator was aborted");
    }
    if (abort_requested_.load()) {
      api->CommAbort(comm_);
      aborted_ = true;
      std::lock_guard<std::mutex> lk(abort_mu_);
      return Status::Error(abort_why_);
    }
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout) {
      api->CommAbort(comm_);
      aborted_ = true;
      return Status::Error("jcoccl NCCL: collective did not finish within " +
                           std::to_string(timeout) +
                           " s (jcoccl.config timeout_s / JCOCCL_TIMEOUT_S); a peer is probably "
                           "lost. The communicator "
                           "was aborted: call jcoccl.shutdown() and jcoccl.init(mesh).");
    }
    if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclTransport::Abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(abort_mu_);
    abort_why_ = why;
  }
  abort_requested_ = true;
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
