// Byte-level group communication used by the fused engine (cuda/engine/engine.h).
//
// A Transport is one rank's handle on a communicator of `size()` ranks. Every op moves
// opaque byte buffers; all members must issue the same ops in the same order (SPMD).
// On CPU the host transport runs each op synchronously; on GPU the NCCL transport
// enqueues the op on `ctx.stream` and returns.
#pragma once
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace jcoccl::transport {

// Empty message = success. Kept trivial so engine code reads like the algorithm.
struct Status {
  std::string msg;
  bool ok() const { return msg.empty(); }
  static Status Ok() { return {}; }
  static Status Error(std::string m) { return {m.empty() ? std::string("unknown error") : m}; }
};

#define JCOCCL_RETURN_IF_ERROR(expr)         \
  do {                                       \
    ::jcoccl::transport::Status _s = (expr); \
    if (!_s.ok()) return _s;                 \
  } while (0)

// Seconds a rank waits for its peers unless the call says otherwise.
constexpr double kDefaultTimeoutSeconds = 300.0;
// Longer waits (about 3 years; "inf" included) are clamped to this: it means "no limit" in
// practice while now + timeout still fits every clock's duration type (int64 nanoseconds
// overflow after 292 years, and an overflowed deadline lies in the past).
constexpr double kMaxTimeoutSeconds = 1e8;

// Per custom call facts the transports need.
struct CallCtx {
  void* stream = nullptr;                     // cudaStream_t of the communication lane (NCCL only)
  int64_t run_id = 0;                         // XLA RunId: equal on every device of one execution
  double timeout_s = kDefaultTimeoutSeconds;  // the call's timeout_s attribute
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // recv[r * bytes, (r + 1) * bytes) = rank r's send[0, bytes).
  virtual Status AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) = 0;
  // recv[r * bytes, ...) = rank r's send[rank() * bytes, (rank() + 1) * bytes).
  virtual Status AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) = 0;
  // Sends `send` to rank `dst` and receives `recv` from rank `src` (-1: none).
  // Every rank takes part in the call, even one that neither sends nor receives.
  virtual Status SendRecv(const CallCtx& ctx, const void* send, int dst, void* recv, int src,
                          int64_t bytes) = 0;
  // Uncompressed float32 reductions (the plain baseline ops; NCCL: ncclSum on ncclFloat32).
  // The host transport folds in rank order (((x_0 + x_1) + x_2) + ...), so every rank gets
  // identical bits; NCCL uses its own order (ring/tree), so its bits may differ from the fold.
  // recv[0, count) = sum over ranks r of rank r's send[0, count).
  virtual Status AllReduceSum(const CallCtx& ctx, const float* send, int64_t count,
                              float* recv) = 0;
  // recv[0, count_per_rank) = sum over ranks r of rank r's
  // send[rank() * count_per_rank, (rank() + 1) * count_per_rank).
  virtual Status ReduceScatterSum(const CallCtx& ctx, const float* send, int64_t count_per_rank,
                                  float* recv) = 0;
  // The communicator is being destroyed: collectives still waiting for peers on it fail with
  // `why` instead of waiting out the timeout. Default: nothing (the transport decides).
  virtual void Abort(const std::string& why) { (void)why; }
};

// The timeout a fused call was given (its "timeout_s" attribute, which Python takes from
// jcoccl.config / JCOCCL_TIMEOUT_S): positive, not nan; longer waits ("inf" included) are
// clamped to kMaxTimeoutSeconds. False for zero, negatives and nan.
inline bool CheckTimeoutSeconds(double s, double* out) {
  if (!(s > 0)) return false;
  *out = std::min(s, kMaxTimeoutSeconds);
  return true;
}

}  // namespace jcoccl::transport
