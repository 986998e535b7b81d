// NCCL transport: libnccl.so.2 is opened at run time with dlopen (by SONAME) and the few
// functions jcoccl needs are resolved with dlsym; NCCL is never linked or bundled.
//
// Only nccl.h's types are used at compile time (headers from the nvidia-nccl-cu13 wheel).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <string>
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

class NcclTransport final : public Transport {
 public:
  NcclTransport(ncclComm_t comm, int rank, int size, int device)
      : comm_(comm), rank_(rank), size_(size), device_(device) {}
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
  // Waits for `done` (an event recorded after this call's work) while polling NCCL's
  // asynchronous error; aborts the communicator after `timeout` seconds (the call's
  // timeout_s, already checked by the handler), or at once once Abort() was called.
  Status Wait(cudaEvent_t done, double timeout);
  // The communicator is being destroyed (jcoccl.shutdown / init): a Wait in progress ends
  // now, aborting the communicator, and fails with `why` instead of waiting out the timeout.
  void Abort(const std::string& why) override;
  bool aborted() const { return aborted_; }

 private:
  Status Check(ncclResult_t r, const char* what);
  ncclComm_t comm_;
  int rank_, size_, device_;
  bool aborted_ = false;
  std::atomic<bool> abort_requested_{false};  // set by Abort from another thread
  std::mutex abort_mu_;
  std::string abort_why_;
};

// ncclGetUniqueId as 128 raw bytes.
Status NcclUniqueId(std::string* out);
// Creates the communicators of this process's members of one group (grouped init).
// members: (device ordinal, rank) pairs.
Status NcclInit(const std::string& uid, int nranks, const std::vector<std::pair<int, int>>& members,
                std::vector<ncclComm_t>* comms);

}  // namespace jcoccl::transport
