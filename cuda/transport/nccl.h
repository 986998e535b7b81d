// NCCL transport: libnccl.so.2 is opened at run time with dlopen (by SONAME) and the few
// functions jcoccl needs are resolved with dlsym; NCCL is never linked or bundled.
//
// Only nccl.h's types are used at compile time (headers from the nvidia-nccl-cu13 wheel).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"

namespace jcoccl::transport {

// The resolved NCCL entry points; Load() fails cleanly if libnccl.so.2 cannot be opened.
struct NcclApi {
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  ncclResult_t (*GetVersion)(int*) = nullptr;
};

// Loads NCCL once; null with `*error` set if it cannot (message names the library).
const NcclApi* Nccl(std::string* error);

// One rank's NCCL communicator. Collectives are enqueued on the caller's stream and the
// call returns: nothing here waits on the host for the GPU. Peer loss is watched off the
// critical path: Watch() hands each fused call's completion event to this communicator's
// watchdog thread, which polls it together with ncclCommGetAsyncError and aborts the
// communicator (ncclCommAbort, which ends the blocked NCCL kernels) on an asynchronous
// error or when a call has waited longer than its timeout. The aborted call's outputs are
// undefined; the next call on the communicator fails with the reason (Healthy()).
class NcclTransport final : public Transport {
 public:
  NcclTransport(ncclComm_t comm, int rank, int size, int device);
  ~NcclTransport() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  Status AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override;
  Status AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override;
  Status SendRecv(const CallCtx& ctx, const void* send, int dst, void* recv, int src,
                  int64_t bytes) override;
  Status AllReduceSum(const CallCtx& ctx, const float* send, int64_t count, float* recv) override;
  Status ReduceScatterSum(const CallCtx& ctx, const float* send, int64_t count_per_rank,
                          float* recv) override;
  // Ok, or why the communicator was aborted (a lost peer, an NCCL error, destruction).
  Status Healthy();
  // Records an event on `stream` after a call's work and gives it to the watchdog: the call
  // may take `timeout` seconds from the moment the communicator's previous call finished
  // (or from now, if later). Never waits.
  Status Watch(cudaStream_t stream, double timeout);
  // The communicator is being destroyed (jcoccl.shutdown / init): work still in flight on
  // it is aborted at once (its streams drain instead of waiting for the timeout).
  void Abort(const std::string& why) override;
  bool aborted();

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    cudaEvent_t done;
    Clock::time_point since;  // when its wait began (enqueue, or the previous call's end)
    double timeout;
  };
  Status Check(ncclResult_t r, const char* what);
  Status UsableLocked() const;
  void PollLocked();  // retires finished calls; aborts on an error or a late call
  void AbortLocked(const std::string& why);
  void WatchdogLoop();
  ncclComm_t comm_;
  int rank_, size_, device_;
  std::mutex mu_;  // everything below; held while enqueueing, so an abort never races a call
  std::condition_variable cv_;
  bool aborted_ = false, stop_ = false;
  std::string why_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::thread watchdog_;
};

// ncclGetUniqueId as 128 raw bytes.
Status NcclUniqueId(std::string* out);
// Creates the communicators of this process's members of one group (grouped init).
// members: (device ordinal, rank) pairs.
Status NcclInit(const std::string& uid, int nranks, const std::vector<std::pair<int, int>>& members,
                std::vector<ncclComm_t>* comms);

}  // namespace jcoccl::transport
