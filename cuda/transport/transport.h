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

// Seconds a rank waits for its peers when JCOCCL_TIMEOUT_S is unset or empty.
constexpr double kDefaultTimeoutSeconds = 300.0;
// Longer waits (about 3 years; "inf" included) are clamped to this: it means "no limit" in
// practice while now + timeout still fits every clock's duration type (int64 nanoseconds
// overflow after 292 years, and an overflowed deadline lies in the past).
constexpr double kMaxTimeoutSeconds = 1e8;

// Per custom call facts the transports need.
struct CallCtx {
  void* stream = nullptr;                     // cudaStream_t of the communication lane (NCCL only)
  int64_t run_id = 0;                         // XLA RunId: equal on every device of one execution
  double timeout_s = kDefaultTimeoutSeconds;  // TimeoutSeconds() when the call started
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

// Parses a JCOCCL_TIMEOUT_S value: a positive decimal number of seconds ("300", "0.5",
// "1e3", surrounding blanks allowed), or "inf" / "infinity" (any case, optional "+").
// Values above kMaxTimeoutSeconds are clamped to it. False for anything else: empty
// text, zero, negatives, nan, hexadecimal, trailing characters.
inline bool ParseTimeoutSeconds(const char* text, double* out) {
  std::string v(text);
  const size_t b = v.find_first_not_of(" \t\n\r\f\v");
  if (b == std::string::npos) return false;
  v = v.substr(b, v.find_last_not_of(" \t\n\r\f\v") - b + 1);
  std::string lower;
  for (char ch : v) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (!lower.empty() && lower[0] == '+') lower.erase(0, 1);
  if (lower == "inf" || lower == "infinity") {
    *out = kMaxTimeoutSeconds;
    return true;
  }
  // Decimal only: strtod alone would also take hexadecimal and nan.
  if (v.find_first_not_of("0123456789.eE+-") != std::string::npos) return false;
  char* end = nullptr;
  const double s = std::strtod(v.c_str(), &end);
  if (end != v.c_str() + v.size() || !(s > 0)) return false;
  *out = std::min(s, kMaxTimeoutSeconds);
  return true;
}

// Seconds a rank waits for its peers before failing the call: JCOCCL_TIMEOUT_S (unset or
// empty: kDefaultTimeoutSeconds). Read at the start of every call, so a process can change
// it between collectives. An invalid value is an error naming the variable.
inline Status TimeoutSeconds(double* out) {
  const char* v = std::getenv("JCOCCL_TIMEOUT_S");
  if (v == nullptr || *v == '\0') {
    *out = kDefaultTimeoutSeconds;
    return Status::Ok();
  }
  if (ParseTimeoutSeconds(v, out)) return Status::Ok();
  return Status::Error(
      "JCOCCL_TIMEOUT_S must be a positive number of seconds, or inf for no "
      "limit (clamped to 1e8 s); got '" +
      std::string(v) + "'");
}

}  // namespace jcoccl::transport
