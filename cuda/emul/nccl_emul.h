// A strict emulation of the NCCL API over threads in one process and the host shim's streams
// (cuda/hostshim/streams.h). Included once into each library that exports it: the test
// build of jcoccl's CUDA extension (cuda_ext.cc, whose dlopen("libnccl.so.2") is answered
// with that library) and the interposer tests' "real NCCL" (nccl_interposer/test/emul_nccl.cc).
//
// Semantics kept from NCCL:
//   - collectives and send/recv are queued on the caller's stream and run in stream order;
//     a rank's operation completes once its peers have joined it;
//   - the ranks must agree: the n-th collective of every rank of a communicator must be the
//     same op with the same count, datatype, reduction and root, and a send must meet a
//     receive of the same count and datatype. A disagreement is an error on every rank
//     involved (ncclInvalidUsage as the asynchronous error, and a finding that names both
//     ranks' calls), never a hang and never a result;
//   - every datatype (int8 ... bfloat16, the two fp8 types) and reduction (sum, prod, max,
//     min, avg, and ncclRedOpCreatePreMulSum's operators). Floating-point reductions fold
//     in rank order, (((x0 + x1) + x2) + ...), rounding to the datatype after every step, as
//     NCCL's kernels do for each of fp16/bf16/fp8 (an fp16 sum is a chain of fp16 additions,
//     not a float32 sum rounded once; each step is computed exactly in double and rounded
//     once, which equals the datatype's own correctly rounded operation). fp8 results
//     saturate to the largest finite value, as CUDA's __nv_fp8 conversions do; max/min of
//     floats ignore a NaN operand (fmax). ncclAvg: floating types premultiply every input by
//     1/nranks (rounded to the datatype) and sum, as NCCL's PreMulSum does; integer types sum
//     (wrapping) and divide by nranks, truncating toward zero. PreMulSum multiplies each
//     rank's input by that rank's own scalar. float32 sums therefore give the bits of
//     jcoccl's host transport (real NCCL's order differs);
//   - between ncclGroupStart and ncclGroupEnd operations are collected, and the outermost
//     ncclGroupEnd queues them as one unit (sends posted before receives). A call that fails
//     inside a group makes ncclGroupEnd return that error, drop the group's calls and close
//     the group; a group that mixes blocking and nonblocking communicators is
//     ncclInvalidUsage, also closed. ncclGroupEnd without a start is ncclInvalidUsage;
//   - nonblocking communicators (ncclConfig_t.blocking = 0, from ncclCommInitRankConfig or
//     ncclCommSplit): init, split, group end and single calls return ncclInProgress and
//     finish later on another thread (after g_nonblocking_delay_ms); meanwhile
//     ncclCommGetAsyncError says ncclInProgress, and any other use of the communicator is
//     ncclInvalidArgument with a finding;
//   - ncclCommSplit is a collective of the parent (inside a group it completes at the group
//     end); NCCL_SPLIT_NOCOLOR gives a null communicator;
//   - ncclCommAbort ends every wait of its clique (the waiter's call or queued operation
//     fails with ncclSystemError). A communicator object is never freed: any call on it after
//     ncclCommDestroy / ncclCommAbort (a use after free in NCCL) is ncclInvalidArgument, a
//     finding and a line on stderr;
//   - the stream must belong to the communicator's device (cudaSetDevice at init).
// Departures, for tests: a blocking ncclCommInitRank returns without waiting for its peers
// (NCCL waits; tests init the ranks of one clique from one thread); a wait for peers gives up
// after g_timeout_ms with a finding and ncclSystemError (NCCL would hang).
//
// Test controls: the return gate (ReturnGate below) holds queued NCCL work until the fused
// handler that queued it has returned; InjectFailure makes the next `count` calls of one
// entry point fail at once with ncclInternalError; GroupDepth tells whether a thread left a
// group open. ncclGetVersion reports kEmulatedVersion, which no real NCCL has.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "nccl.h"

namespace jcoccl_emul {

constexpr int kEmulatedVersion = 99999;

enum OpKind {
  kAllGather,
  kAllReduce,
  kReduceScatter,
  kReduce,
  kBroadcast,
  kAlltoAll,
  kSend,
  kRecv,
  kNumOps
};
inline const char* const kOpNames[kNumOps] = {"ncclAllGather", "ncclAllReduce", "ncclReduceScatter",
                                              "ncclReduce",    "ncclBroadcast", "ncclAlltoAll",
                                              "ncclSend",      "ncclRecv"};

struct Op {
  OpKind kind;
  ncclComm_t comm;
  cudaStream_t stream;
  const void* send;
  void* recv;
  size_t count;  // elements: per rank (as the entry point's count) or of the message
  ncclDataType_t type;
  int red;   // ncclRedOp_t (reductions), else -1
  int root;  // reduce / broadcast, else -1
  int peer;  // send / recv, else -1
};

// A PreMulSum operator of one communicator (ncclRedOpCreatePreMulSum).
struct PreMul {
  bool live = false;
  ncclDataType_t type = ncclFloat32;
  bool on_device = false;  // ncclScalarDevice: read at run time from `ptr`
  const void* ptr = nullptr;
  uint8_t bytes[8] = {};  // ncclScalarHostImmediate: the value at creation
};

enum : uint32_t { kLive = 0x4c495645u, kDestroyed = 0xdead0001u, kAborted = 0xdead0002u };

struct Clique;

}  // namespace jcoccl_emul

struct ncclComm {
  std::atomic<uint32_t> magic{jcoccl_emul::kLive};
  std::shared_ptr<jcoccl_emul::Clique> clique;  // null until a split completes
  int rank = 0, nranks = 0, device = 0;
  bool blocking = true;
  uint64_t seq = 0;     // collectives run so far (on the stream's worker)
  uint64_t splits = 0;  // ncclCommSplit calls so far (their order matches the ranks')
  std::atomic<int> async{ncclSuccess};
  std::atomic<int> in_progress{0};  // init, split or group work not finished yet
  std::mutex mu;                    // premul
  std::vector<jcoccl_emul::PreMul> premul;
};

namespace jcoccl_emul {

inline size_t TypeBytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
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

inline const char* TypeName(int t) {
  static const char* const names[ncclNumTypes] = {
      "ncclInt8",    "ncclUint8",    "ncclInt32",      "ncclUint32",
      "ncclInt64",   "ncclUint64",   "ncclFloat16",    "ncclFloat32",
      "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
  return t >= 0 && t < ncclNumTypes ? names[t] : "ncclDataType?";
}

inline std::string RedName(int r) {
  static const char* const names[ncclNumOps] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin",
                                                "ncclAvg"};
  if (r >= 0 && r < ncclNumOps) return names[r];
  return "PreMulSum#" + std::to_string(r - ncclNumOps);
}

// "ncclAllReduce(count 256, ncclFloat32, ncclSum)": a call as the findings name it.
inline std::string Describe(const Op& op) {
  std::string s = std::string(kOpNames[op.kind]) + "(count " + std::to_string(op.count) + ", " +
                  TypeName(op.type);
  if (op.red >= 0) s += ", " + RedName(op.red);
  if (op.root >= 0) s += ", root " + std::to_string(op.root);
  if (op.peer >= 0) s += ", peer " + std::to_string(op.peer);
  return s + ")";
}

// ---- findings ---------------------------------------------------------------------------------
inline std::atomic<int> g_misuse{0};  // uses after destroy/abort seen (tests read it)

// A misuse the tests must see: a finding and a line on stderr.
inline void Loud(const std::string& what) {
  ++g_misuse;
  std::fprintf(stderr, "NCCL emulation: %s\n", what.c_str());
  jcoccl_shim::Report("NCCL emulation: " + what);
}

// The communicator can be used by `fn`: ncclSuccess, or ncclInvalidArgument (reported) for a
// null, destroyed, aborted or (unless `ready` is false) still in-progress communicator.
inline ncclResult_t Usable(ncclComm_t c, const char* fn, bool ready = true) {
  if (c == nullptr) return ncclInvalidArgument;
  const uint32_t m = c->magic.load();
  if (m != kLive) {
    Loud(std::string(fn) + " on a communicator after its " +
         (m == kAborted     ? "ncclCommAbort"
          : m == kDestroyed ? "ncclCommDestroy"
                            : "free?") +
         " (a use after free in NCCL)");
    return ncclInvalidArgument;
  }
  if (ready && c->in_progress.load() > 0) {
    jcoccl_shim::Report(std::string("NCCL emulation: ") + fn + " on rank " +
                        std::to_string(c->rank) +
                        "'s communicator while its init, split or group is still in progress "
                        "(ncclCommGetAsyncError says ncclInProgress): NCCL refuses it");
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

inline void Fail(ncclComm_t comm, ncclResult_t r) {
  int expected = ncclSuccess;
  comm->async.compare_exchange_strong(expected, r);
}

// ---- datatypes ---------------------------------------------------------------------------------
// A small binary floating-point format: `p` significand bits (with the implicit one),
// exponent bias, the smallest normal exponent, the largest finite value; `inf`: whether the
// format has infinities (else its all-ones exponent is a normal binade, except the NaN code).
struct Mini {
  int p, bias, emin, ebits;
  double max;
  bool inf;
};
inline const Mini kF16{11, 15, -14, 5, 65504.0, true};
inline const Mini kBF16{8, 127, -126, 8, 3.3895313892515355e38, true};
inline const Mini kE4M3{4, 7, -6, 4, 448.0, false};
inline const Mini kE5M2{3, 15, -14, 5, 57344.0, true};

inline const Mini* MiniOf(ncclDataType_t t) {
  switch (t) {
    case ncclFloat16:
      return &kF16;
    case ncclBfloat16:
      return &kBF16;
    case ncclFloat8e4m3:
      return &kE4M3;
    case ncclFloat8e5m2:
      return &kE5M2;
    default:
      return nullptr;
  }
}

inline bool IsFloat(ncclDataType_t t) {
  return t == ncclFloat32 || t == ncclFloat64 || MiniOf(t) != nullptr;
}

// v rounded to format f (round to nearest even). Overflow gives infinity for fp16/bf16 and
// the largest finite value for the fp8 types (CUDA's __nv_fp8 conversions saturate).
inline double RoundMini(const Mini& f, double v, bool saturate) {
  if (std::isnan(v) || v == 0 || std::isinf(v))
    return saturate && std::isinf(v) ? std::copysign(f.max, v) : v;
  int e;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const int q = std::max(e - 1, f.emin) - (f.p - 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(v, -q)), q);
  if (std::fabs(r) > f.max) return saturate ? std::copysign(f.max, v) : std::copysign(INFINITY, v);
  return r;
}

inline double DecodeMini(const Mini& f, unsigned bits) {
  const int mbits = f.p - 1;
  const bool neg = (bits >> (mbits + f.ebits)) & 1;
  const unsigned e = (bits >> mbits) & ((1u << f.ebits) - 1), m = bits & ((1u << mbits) - 1);
  double v;
  if (f.inf && e == (1u << f.ebits) - 1) {
    v = m ? NAN : INFINITY;
  } else if (!f.inf && e == (1u << f.ebits) - 1 && m == (1u << mbits) - 1) {
    v = NAN;
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), f.emin - mbits);
  } else {
    v = std::ldexp(static_cast<double>(m | (1u << mbits)), static_cast<int>(e) - f.bias - mbits);
  }
  return neg ? -v : v;
}

// v, already representable in f (RoundMini), as f's bits; NaN as the all-ones code.
inline unsigned EncodeMini(const Mini& f, double v) {
  const int mbits = f.p - 1;
  const unsigned sign = std::signbit(v) ? 1u << (mbits + f.ebits) : 0u;
  const unsigned all = (1u << (mbits + f.ebits)) - 1;
  if (std::isnan(v)) return all;  // positive NaN with every bit set below the sign
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | (((1u << f.ebits) - 1) << mbits);
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  if (e - 1 < f.emin) return sign | static_cast<unsigned>(std::ldexp(a, mbits - f.emin));
  const unsigned m = static_cast<unsigned>(std::ldexp(a, mbits - (e - 1))) & ((1u << mbits) - 1);
  return sign | (static_cast<unsigned>(e - 1 + f.bias) << mbits) | m;
}

// Element i of a floating-point buffer of type t, as a double (exact).
inline double LoadF(ncclDataType_t t, const void* p, size_t i) {
  if (t == ncclFloat64) return static_cast<const double*>(p)[i];
  if (t == ncclFloat32) return static_cast<const float*>(p)[i];
  const Mini& f = *MiniOf(t);
  unsigned bits = 0;
  std::memcpy(&bits, static_cast<const uint8_t*>(p) + i * TypeBytes(t), TypeBytes(t));
  return DecodeMini(f, bits);
}

// v rounded to type t, as a double (each step of a reduction rounds so).
inline double RoundF(ncclDataType_t t, double v) {
  if (t == ncclFloat64) return v;
  if (t == ncclFloat32) return static_cast<float>(v);
  return RoundMini(*MiniOf(t), v, t == ncclFloat8e4m3 || t == ncclFloat8e5m2);
}

inline void StoreF(ncclDataType_t t, void* p, size_t i, double v) {
  if (t == ncclFloat64) {
    static_cast<double*>(p)[i] = v;
  } else if (t == ncclFloat32) {
    static_cast<float*>(p)[i] = static_cast<float>(v);
  } else {
    const unsigned bits = EncodeMini(*MiniOf(t), v);
    std::memcpy(static_cast<uint8_t*>(p) + i * TypeBytes(t), &bits, TypeBytes(t));
  }
}

// ---- reductions --------------------------------------------------------------------------------
// The inputs of one reduction: each rank's buffer (from element `off`) and, for a PreMulSum,
// each rank's scalar (bytes of the datatype).
struct Inputs {
  std::vector<const void*> src;
  std::vector<std::vector<uint8_t>> scalar;  // empty unless PreMulSum or avg
};

inline void ReduceFloat(ncclDataType_t t, int red, const Inputs& in, size_t off, size_t count,
                        void* out) {
  const int n = static_cast<int>(in.src.size());
  std::vector<double> s(n, 1.0);
  for (int r = 0; r < n && !in.scalar.empty(); ++r) s[r] = LoadF(t, in.scalar[r].data(), 0);
  const bool premul = !in.scalar.empty();
  for (size_t i = 0; i < count; ++i) {
    auto term = [&](int r) {
      const double x = LoadF(t, in.src[r], off + i);
      return premul ? RoundF(t, x * s[r]) : x;
    };
    double acc = term(0);
    for (int r = 1; r < n; ++r) {
      const double x = term(r);
      switch (red) {
        case ncclProd:
          acc = RoundF(t, acc * x);
          break;
        case ncclMax:
          acc = std::fmax(acc, x);
          break;
        case ncclMin:
          acc = std::fmin(acc, x);
          break;
        default:  // sum, avg (premultiplied), PreMulSum
          acc = RoundF(t, acc + x);
      }
    }
    StoreF(t, out, i, acc);
  }
}

template <class T>
void ReduceInt(int red, const Inputs& in, size_t off, size_t count, void* out) {
  using U = std::make_unsigned_t<T>;
  const int n = static_cast<int>(in.src.size());
  std::vector<U> s(n, 1);
  for (int r = 0; r < n && !in.scalar.empty(); ++r)
    std::memcpy(&s[r], in.scalar[r].data(), sizeof(T));
  const bool premul = !in.scalar.empty() && red >= ncclNumOps;
  for (size_t i = 0; i < count; ++i) {
    auto term = [&](int r) {
      const U x = static_cast<const U*>(in.src[r])[off + i];
      return premul ? static_cast<U>(x * s[r]) : x;
    };
    U acc = term(0);
    for (int r = 1; r < n; ++r) {
      const U x = term(r);
      switch (red) {
        case ncclProd:
          acc = static_cast<U>(acc * x);
          break;
        case ncclMax:
          acc = static_cast<T>(x) > static_cast<T>(acc) ? x : acc;
          break;
        case ncclMin:
          acc = static_cast<T>(x) < static_cast<T>(acc) ? x : acc;
          break;
        default:  // sum, avg, PreMulSum: wrapping
          acc = static_cast<U>(acc + x);
      }
    }
    T v = static_cast<T>(acc);
    if (red == ncclAvg) v = static_cast<T>(v / static_cast<T>(n));  // truncates toward zero
    static_cast<T*>(out)[i] = v;
  }
}

inline void Reduce(ncclDataType_t t, int red, const Inputs& in, size_t off, size_t count,
                   void* out) {
  switch (t) {
    case ncclInt8:
      return ReduceInt<int8_t>(red, in, off, count, out);
    case ncclUint8:
      return ReduceInt<uint8_t>(red, in, off, count, out);
    case ncclInt32:
      return ReduceInt<int32_t>(red, in, off, count, out);
    case ncclUint32:
      return ReduceInt<uint32_t>(red, in, off, count, out);
    case ncclInt64:
      return ReduceInt<int64_t>(red, in, off, count, out);
    case ncclUint64:
      return ReduceInt<uint64_t>(red, in, off, count, out);
    default:
      return ReduceFloat(t, red, in, off, count, out);
  }
}

// ---- cliques -----------------------------------------------------------------------------------
struct Msg {
  Op op;
  bool taken = false;
  std::string bad;  // the receiver's disagreement, if any
};

struct Coll {
  int arrived = 0, computed = 0, gone = 0;
  std::vector<Op> ops;  // by rank
  std::vector<bool> here;
};

// One ncclCommSplit of a parent clique: what each parent rank asked for.
struct SplitRv {
  int arrived = 0;
  bool done = false;
  std::vector<ncclComm_t> child;  // by parent rank (null: NCCL_SPLIT_NOCOLOR)
  std::vector<int> color, key;
};

// The ranks that share one unique id (or one split).
struct Clique {
  int nranks = 0;
  int joined = 0;  // ranks that called init
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Coll> colls;                                        // by sequence number
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Msg>>> chan;  // (src, dst) FIFO
  std::map<uint64_t, SplitRv> splits;                                    // by split number
  bool aborted = false;
};

inline std::atomic<int> g_timeout_ms{60000};
inline std::atomic<int> g_nonblocking_delay_ms{20};

// Waits on the clique until pred() holds: ncclSuccess, or ncclSystemError when the clique is
// aborted or g_timeout_ms passes (then a finding says what `what()` waited for).
template <class P>
ncclResult_t Await(Clique& c, std::unique_lock<std::mutex>& lk, P pred,
                   const std::function<std::string()>& what) {
  const auto limit =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(g_timeout_ms.load());
  while (!pred()) {
    if (c.aborted) return ncclSystemError;
    if (std::chrono::steady_clock::now() > limit) {
      jcoccl_shim::Report("NCCL emulation: gave up after " + std::to_string(g_timeout_ms.load()) +
                          " ms waiting for " + what() + " (NCCL would hang)");
      return ncclSystemError;
    }
    c.cv.wait_for(lk, std::chrono::milliseconds(20));
  }
  return ncclSuccess;
}

// Why the ranks' calls of collective `seq` disagree (as seen by rank `me`), or "".
inline std::string Disagreement(const std::vector<Op>& ops, int me, uint64_t seq) {
  const Op& a = ops[me];
  for (int r = 0; r < static_cast<int>(ops.size()); ++r) {
    const Op& b = ops[r];
    if (a.kind == b.kind && a.count == b.count && a.type == b.type && a.red == b.red &&
        a.root == b.root)
      continue;
    return "NCCL emulation: the ranks disagree on collective #" + std::to_string(seq) +
           " of their communicator: rank " + std::to_string(me) + " called " + Describe(a) +
           ", rank " + std::to_string(r) + " called " + Describe(b);
  }
  return "";
}

// Each rank's scalar of reduction `red` (PreMulSum, or avg of a floating type), else none.
inline std::vector<std::vector<uint8_t>> Scalars(const std::vector<Op>& ops) {
  const Op& a = ops[0];
  const int n = static_cast<int>(ops.size());
  std::vector<std::vector<uint8_t>> out;
  if (a.red == ncclAvg && IsFloat(a.type)) {
    std::vector<uint8_t> s(8);
    StoreF(a.type, s.data(), 0, RoundF(a.type, 1.0 / n));
    out.assign(n, s);
  } else if (a.red >= ncclNumOps) {
    for (const Op& op : ops) {
      std::lock_guard<std::mutex> lk(op.comm->mu);
      const PreMul& p = op.comm->premul[a.red - ncclNumOps];
      std::vector<uint8_t> s(8);
      std::memcpy(s.data(), p.on_device ? p.ptr : p.bytes, TypeBytes(a.type));
      out.push_back(s);
    }
  }
  return out;
}

// Rank me's result of a collective on which all ranks agree (empty: it writes nothing).
inline std::vector<uint8_t> Compute(const std::vector<Op>& ops, int me) {
  const Op& op = ops[me];
  const int n = static_cast<int>(ops.size());
  const size_t bytes = op.count * TypeBytes(op.type);
  std::vector<uint8_t> out;
  auto src = [&](int r) { return static_cast<const uint8_t*>(ops[r].send); };
  switch (op.kind) {
    case kAllGather:
      out.resize(bytes * n);
      for (int r = 0; r < n; ++r) std::memcpy(out.data() + r * bytes, src(r), bytes);
      break;
    case kAlltoAll:
      out.resize(bytes * n);
      for (int r = 0; r < n; ++r) std::memcpy(out.data() + r * bytes, src(r) + me * bytes, bytes);
      break;
    case kBroadcast:
      out.assign(src(op.root), src(op.root) + bytes);
      break;
    case kAllReduce:
    case kReduceScatter:
    case kReduce: {
      if (op.kind == kReduce && me != op.root) break;
      Inputs in;
      for (int r = 0; r < n; ++r) in.src.push_back(ops[r].send);
      in.scalar = Scalars(ops);
      out.resize(bytes);
      Reduce(op.type, op.red, in, op.kind == kReduceScatter ? me * op.count : 0, op.count,
             out.data());
      break;
    }
    default:
      break;
  }
  return out;
}

// One collective of `comm`'s rank, on the stream's worker. The result is computed into a
// temporary and written once every rank has read its inputs: in-place calls stay correct.
inline void RunCollective(const Op& op) {
  ncclComm_t comm = op.comm;
  Clique& c = *comm->clique;
  const int n = comm->nranks, me = comm->rank;
  const uint64_t seq = comm->seq++;
  std::unique_lock<std::mutex> lk(c.mu);
  Coll& k = c.colls[seq];
  if (k.ops.empty()) {
    k.ops.resize(n);
    k.here.assign(n, false);
  }
  k.ops[me] = op;
  k.here[me] = true;
  ++k.arrived;
  c.cv.notify_all();
  auto missing = [&] {
    std::string s = "the peers of rank " + std::to_string(me) + "'s " + Describe(op) +
                    " (collective #" + std::to_string(seq) + "); missing ranks:";
    for (int r = 0; r < n; ++r)
      if (!k.here[r]) s += " " + std::to_string(r);
    return s;
  };
  ncclResult_t w = Await(c, lk, [&] { return k.arrived == n; }, missing);
  if (w != ncclSuccess) return Fail(comm, w);
  const std::string why = Disagreement(k.ops, me, seq);
  const std::vector<Op> ops = k.ops;
  lk.unlock();
  std::vector<uint8_t> result;
  if (why.empty()) {
    result = Compute(ops, me);
  } else {
    jcoccl_shim::Report(why);
    Fail(comm, ncclInvalidUsage);
  }
  lk.lock();
  ++k.computed;
  c.cv.notify_all();
  w = Await(c, lk, [&] { return k.computed == n; }, missing);
  if (w != ncclSuccess) return Fail(comm, w);
  if (++k.gone == n) c.colls.erase(seq);
  lk.unlock();
  if (!result.empty()) std::memcpy(op.recv, result.data(), result.size());
}

// The sends and receives of one group, on the stream's worker.
inline void RunP2P(const std::vector<Op>& ops) {
  std::vector<std::pair<ncclComm_t, std::shared_ptr<Msg>>> posted;
  for (const Op& op : ops) {
    if (op.kind != kSend) continue;
    Clique& c = *op.comm->clique;
    std::lock_guard<std::mutex> lk(c.mu);
    auto m = std::make_shared<Msg>(Msg{op});
    c.chan[{op.comm->rank, op.peer}].push_back(m);
    posted.emplace_back(op.comm, m);
    c.cv.notify_all();
  }
  for (const Op& op : ops) {
    if (op.kind != kRecv) continue;
    Clique& c = *op.comm->clique;
    std::unique_lock<std::mutex> lk(c.mu);
    auto& q = c.chan[{op.peer, op.comm->rank}];
    const ncclResult_t w = Await(
        c, lk, [&] { return !q.empty(); },
        [&] {
          return "rank " + std::to_string(op.peer) + "'s send to rank " +
                 std::to_string(op.comm->rank) + "'s " + Describe(op);
        });
    if (w != ncclSuccess) return Fail(op.comm, w);
    std::shared_ptr<Msg> m = q.front();
    q.pop_front();
    lk.unlock();
    if (m->op.count != op.count || m->op.type != op.type) {
      m->bad = "NCCL emulation: rank " + std::to_string(op.comm->rank) + " called " + Describe(op) +
               " and its peer, rank " + std::to_string(op.peer) + ", called " + Describe(m->op) +
               " (count and datatype must match)";
      jcoccl_shim::Report(m->bad);
      Fail(op.comm, ncclInvalidUsage);
    } else {
      std::memcpy(op.recv, m->op.send, op.count * TypeBytes(op.type));
    }
    lk.lock();
    m->taken = true;
    c.cv.notify_all();
  }
  for (auto& [comm, m] : posted) {
    Clique& c = *comm->clique;
    std::unique_lock<std::mutex> lk(c.mu);
    const ncclResult_t w = Await(
        c, lk, [&] { return m->taken; },
        [&] {
          return "rank " + std::to_string(m->op.peer) + "'s receive of rank " +
                 std::to_string(comm->rank) + "'s " + Describe(m->op);
        });
    if (w != ncclSuccess) return Fail(comm, w);
    if (!m->bad.empty()) {
      jcoccl_shim::Report(m->bad);
      Fail(comm, ncclInvalidUsage);
    }
  }
}

// ---- return gate -------------------------------------------------------------------------------
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
// `call`: the gated handler call that issued them (0: not gated).
inline void Launch(const std::vector<Op>& ops, uint64_t call) {
  std::vector<cudaStream_t> streams;
  for (const Op& op : ops)
    if (std::find(streams.begin(), streams.end(), op.stream) == streams.end())
      streams.push_back(op.stream);
  for (cudaStream_t s : streams) {
    std::vector<Op> mine;
    for (const Op& op : ops)
      if (op.stream == s) mine.push_back(op);
    jcoccl_shim::Enqueue(s, jcoccl_shim::kCollectiveWork, [mine, call] {
      if (call != 0) HoldUntilReturned(mine[0].comm->device, call);
      for (const Op& op : mine)
        if (op.kind != kSend && op.kind != kRecv) RunCollective(op);
      RunP2P(mine);
    });
  }
}

// ---- groups, init and split --------------------------------------------------------------------
struct SplitReq {
  ncclComm_t parent;
  ncclComm_t child;  // null: NCCL_SPLIT_NOCOLOR
  uint64_t number;   // the parent's split number
  int color, key;
};

// What one outermost group (or one call outside a group) leaves to its end.
struct Unit {
  std::vector<Op> ops;
  std::vector<SplitReq> splits;
  std::vector<ncclComm_t> inits;  // nonblocking inits
};

struct GroupState {
  int depth = 0;
  Unit unit;
  ncclResult_t error = ncclSuccess;  // the first call that failed inside the group
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

// A call's result inside a group: the group's end will return the first error.
inline ncclResult_t Note(ncclResult_t r) {
  if (r != ncclSuccess && g_group.depth > 0 && g_group.error == ncclSuccess) g_group.error = r;
  return r;
}

// A nonblocking init: done once every rank of the clique has joined.
inline ncclResult_t FinishInit(ncclComm_t comm) {
  Clique& c = *comm->clique;
  std::unique_lock<std::mutex> lk(c.mu);
  return Await(
      c, lk, [&] { return c.joined == c.nranks; },
      [&] {
        return "the other ranks' ncclCommInitRankConfig of rank " + std::to_string(comm->rank) +
               "'s nonblocking communicator (" + std::to_string(c.joined) + " of " +
               std::to_string(c.nranks) + " joined)";
      });
}

// Registers a split with its parent's clique (the last rank to come builds the children).
inline void ArriveSplit(const SplitReq& q) {
  Clique& c = *q.parent->clique;
  std::lock_guard<std::mutex> lk(c.mu);
  SplitRv& rv = c.splits[q.number];
  if (rv.child.empty()) {
    rv.child.assign(c.nranks, nullptr);
    rv.color.assign(c.nranks, NCCL_SPLIT_NOCOLOR);
    rv.key.assign(c.nranks, 0);
  }
  const int me = q.parent->rank;
  rv.child[me] = q.child;
  rv.color[me] = q.color;
  rv.key[me] = q.key;
  if (++rv.arrived < c.nranks) return;
  std::map<int, std::vector<int>> by_color;  // parent ranks ordered by (key, parent rank)
  for (int r = 0; r < c.nranks; ++r)
    if (rv.color[r] != NCCL_SPLIT_NOCOLOR) by_color[rv.color[r]].push_back(r);
  for (auto& [color, members] : by_color) {
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return rv.key[a] < rv.key[b]; });
    auto child = std::make_shared<Clique>();
    child->nranks = static_cast<int>(members.size());
    child->joined = child->nranks;
    for (int i = 0; i < child->nranks; ++i) {
      ncclComm_t x = rv.child[members[i]];
      x->clique = child;
      x->rank = i;
      x->nranks = child->nranks;
    }
  }
  rv.done = true;
  c.cv.notify_all();
}

inline ncclResult_t AwaitSplit(const SplitReq& q) {
  Clique& c = *q.parent->clique;
  std::unique_lock<std::mutex> lk(c.mu);
  const ncclResult_t w = Await(
      c, lk, [&] { return c.splits[q.number].done; },
      [&] {
        return "the other ranks' ncclCommSplit #" + std::to_string(q.number) + " of rank " +
               std::to_string(q.parent->rank) + "'s communicator (" +
               std::to_string(c.splits[q.number].arrived) + " of " + std::to_string(c.nranks) +
               " came)";
      });
  return w;
}

// Finishes a unit: its inits and splits, then queues its operations. Blocks the caller (a
// blocking unit) or the unit's own thread (a nonblocking one).
inline ncclResult_t Finish(const Unit& u, uint64_t call) {
  ncclResult_t r = ncclSuccess;
  for (ncclComm_t c : u.inits) {
    const ncclResult_t x = FinishInit(c);
    if (x != ncclSuccess) {
      Fail(c, x);
      r = x;
    }
  }
  for (const SplitReq& q : u.splits) ArriveSplit(q);
  for (const SplitReq& q : u.splits) {
    const ncclResult_t x = AwaitSplit(q);
    if (x != ncclSuccess) {
      if (q.child) Fail(q.child, x);
      r = x;
    }
  }
  if (!u.ops.empty()) Launch(u.ops, call);
  return r;
}

// Every communicator a unit touches, with whether it is blocking.
inline std::vector<ncclComm_t> Members(const Unit& u) {
  std::vector<ncclComm_t> out;
  auto add = [&](ncclComm_t c) {
    if (c != nullptr && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  for (const Op& op : u.ops) add(op.comm);
  for (const SplitReq& q : u.splits) add(q.child);
  for (ncclComm_t c : u.inits) add(c);
  return out;
}

// Ends a unit: blocking, it finishes now; nonblocking, every communicator it touches is in
// progress until a thread of its own finishes it, and the caller gets ncclInProgress.
inline ncclResult_t End(Unit u) {
  const std::vector<ncclComm_t> comms = Members(u);
  int nonblocking = 0;
  for (ncclComm_t c : comms) nonblocking += c->blocking ? 0 : 1;
  if (nonblocking != 0 && nonblocking != static_cast<int>(comms.size())) {
    jcoccl_shim::Report(
        "NCCL emulation: a group mixes blocking and nonblocking communicators: NCCL refuses it "
        "(ncclInvalidUsage) and drops the group's calls");
    for (const SplitReq& q : u.splits)
      if (q.child) q.child->in_progress = 0;
    return ncclInvalidUsage;
  }
  const uint64_t call = g_gate_on.load() ? g_call : 0;
  if (nonblocking == 0) {
    const ncclResult_t r = Finish(u, call);
    for (const SplitReq& q : u.splits)
      if (q.child) --q.child->in_progress;
    return r;
  }
  for (ncclComm_t c : comms) ++c->in_progress;
  std::thread([u = std::move(u), comms, call] {
    std::this_thread::sleep_for(std::chrono::milliseconds(g_nonblocking_delay_ms.load()));
    Finish(u, call);
    for (const SplitReq& q : u.splits)
      if (q.child) --q.child->in_progress;
    for (ncclComm_t c : u.inits) --c->in_progress;
    for (ncclComm_t c : comms) --c->in_progress;
  }).detach();
  return ncclInProgress;
}

// A unit's call: collected inside a group, else ended at once.
inline ncclResult_t Add(std::function<void(Unit&)> put) {
  if (g_group.depth > 0) {
    put(g_group.unit);
    return ncclSuccess;
  }
  Unit u;
  put(u);
  return End(std::move(u));
}

inline ncclResult_t Submit(const Op& op) {
  const ncclResult_t usable = Usable(op.comm, kOpNames[op.kind]);
  if (usable != ncclSuccess) return Note(usable);
  if (op.stream == nullptr) return Note(ncclInvalidArgument);
  if (op.stream->device != op.comm->device) {
    jcoccl_shim::Report("NCCL emulation: " + std::string(kOpNames[op.kind]) +
                        " on a stream of device " + std::to_string(op.stream->device) +
                        " with the communicator of device " + std::to_string(op.comm->device));
    return Note(ncclInvalidArgument);
  }
  bool bad_red = false;
  if (op.red >= ncclNumOps) {
    std::lock_guard<std::mutex> lk(op.comm->mu);
    const size_t i = static_cast<size_t>(op.red - ncclNumOps);
    bad_red = i >= op.comm->premul.size() || !op.comm->premul[i].live ||
              op.comm->premul[i].type != op.type;
  }
  const bool reduces = op.kind == kAllReduce || op.kind == kReduceScatter || op.kind == kReduce;
  if (op.type < 0 || op.type >= ncclNumTypes || bad_red || (reduces && op.red < 0) ||
      ((op.kind == kSend || op.kind == kRecv) && (op.peer < 0 || op.peer >= op.comm->nranks)) ||
      ((op.kind == kReduce || op.kind == kBroadcast) &&
       (op.root < 0 || op.root >= op.comm->nranks))) {
    jcoccl_shim::Report("NCCL emulation: invalid argument: rank " + std::to_string(op.comm->rank) +
                        " of " + std::to_string(op.comm->nranks) + " called " + Describe(op));
    return Note(ncclInvalidArgument);
  }
  if (op.count > 0 && ((op.kind != kRecv && op.send == nullptr) ||
                       (op.kind != kSend && op.recv == nullptr &&
                        !(op.kind == kReduce && op.root != op.comm->rank))))
    return Note(ncclInvalidArgument);
  if (Injected(op.kind)) return Note(ncclInternalError);
  return Add([&](Unit& u) { u.ops.push_back(op); });
}

}  // namespace jcoccl_emul

// ---- entry points ------------------------------------------------------------------------------
namespace jcoccl_emul {

inline std::mutex& RegistryMu() {
  static auto* m = new std::mutex();
  return *m;
}
inline std::map<std::string, std::weak_ptr<Clique>>& Registry() {
  static auto* r = new std::map<std::string, std::weak_ptr<Clique>>();
  return *r;
}

// A communicator's `blocking` from `config` (NCCL_CONFIG_UNDEF_INT or no config: `dflt`).
inline bool Blocking(const ncclConfig_t* config, bool dflt) {
  if (config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT) return dflt;
  return config->blocking != 0;
}

inline ncclResult_t CheckConfig(const ncclConfig_t* config, const char* fn) {
  if (config == nullptr) return ncclSuccess;
  if (config->magic != NCCL_API_MAGIC || config->size < offsetof(ncclConfig_t, cgaClusterSize)) {
    jcoccl_shim::Report(std::string("NCCL emulation: ") + fn +
                        " with an ncclConfig_t not set from NCCL_CONFIG_INITIALIZER");
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

inline ncclResult_t InitRank(ncclComm_t* comm, int nranks, const ncclUniqueId& id, int rank,
                             const ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return Note(ncclInvalidArgument);
  if (CheckConfig(config, "ncclCommInitRankConfig") != ncclSuccess)
    return Note(ncclInvalidArgument);
  std::shared_ptr<Clique> c;
  {
    std::lock_guard<std::mutex> lk(RegistryMu());
    const std::string key(id.internal, sizeof(id.internal));
    c = Registry()[key].lock();
    if (!c) {
      c = std::make_shared<Clique>();
      c->nranks = nranks;
      Registry()[key] = c;
    }
  }
  if (c->nranks != nranks) return Note(ncclInvalidArgument);
  auto* x = new ncclComm();
  x->clique = c;
  x->rank = rank;
  x->nranks = nranks;
  x->blocking = Blocking(config, true);
  cudaGetDevice(&x->device);
  {
    std::lock_guard<std::mutex> lk(c->mu);
    ++c->joined;
    c->cv.notify_all();
  }
  *comm = x;
  if (x->blocking) return ncclSuccess;
  ++x->in_progress;
  return Add([&](Unit& u) { u.inits.push_back(x); });
}

}  // namespace jcoccl_emul

JCE_NCCL_API ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = jcoccl_emul::kEmulatedVersion;
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::atomic<uint64_t> next{1};
  if (id == nullptr) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof(id->internal));
  const uint64_t v = next++;
  std::memcpy(id->internal, "jcoccl-emul", 11);
  std::memcpy(id->internal + 16, &v, sizeof(v));
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                           int rank) {
  return jcoccl_emul::InitRank(comm, nranks, id, rank, nullptr);
}

JCE_NCCL_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                 int rank, ncclConfig_t* config) {
  return jcoccl_emul::InitRank(comm, nranks, id, rank, config);
}

JCE_NCCL_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                        ncclConfig_t* config) {
  namespace je = jcoccl_emul;
  const ncclResult_t u = je::Usable(comm, "ncclCommSplit");
  if (u != ncclSuccess) return je::Note(u);
  if (newcomm == nullptr || (color < 0 && color != NCCL_SPLIT_NOCOLOR) ||
      je::CheckConfig(config, "ncclCommSplit") != ncclSuccess)
    return je::Note(ncclInvalidArgument);
  je::SplitReq q{comm, nullptr, comm->splits++, color, key};
  if (color != NCCL_SPLIT_NOCOLOR) {
    q.child = new ncclComm();
    q.child->device = comm->device;
    q.child->blocking = je::Blocking(config, comm->blocking);
    ++q.child->in_progress;  // until the split completes
  }
  *newcomm = q.child;
  if (q.child == nullptr) {
    // No communicator comes of it, but the parent's rank still takes part in the split.
    if (je::g_group.depth > 0) {
      je::g_group.unit.splits.push_back(q);
      return ncclSuccess;
    }
    je::ArriveSplit(q);
    return comm->blocking ? je::AwaitSplit(q) : ncclSuccess;
  }
  return je::Add([&](je::Unit& unit) { unit.splits.push_back(q); });
}

JCE_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommDestroy", false);
  if (u != ncclSuccess) return u;
  // Work queued before the destroy still runs; the object itself is never freed.
  comm->magic = jcoccl_emul::kDestroyed;
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommAbort", false);
  if (u != ncclSuccess) return u;
  comm->magic = jcoccl_emul::kAborted;
  if (comm->clique == nullptr) return ncclSuccess;  // a split still in progress
  jcoccl_emul::Clique& c = *comm->clique;
  std::lock_guard<std::mutex> lk(c.mu);
  c.aborted = true;
  c.cv.notify_all();
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclCommGetAsyncError", false);
  if (u != ncclSuccess) return u;
  if (err == nullptr) return ncclInvalidArgument;
  *err =
      comm->in_progress.load() > 0 ? ncclInProgress : static_cast<ncclResult_t>(comm->async.load());
  return ncclSuccess;
}

JCE_NCCL_API const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
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
  namespace je = jcoccl_emul;
  auto& g = je::g_group;
  if (g.depth == 0) return ncclInvalidUsage;
  if (--g.depth > 0) return ncclSuccess;
  je::Unit u = std::move(g.unit);
  const ncclResult_t error = g.error;
  g = je::GroupState();
  if (error == ncclSuccess) return je::End(std::move(u));
  // A call failed inside the group: NCCL drops the group's calls and closes it.
  for (const je::SplitReq& q : u.splits)
    if (q.child) {
      je::Fail(q.child, error);
      q.child->in_progress = 0;
    }
  for (ncclComm_t c : u.inits) {
    je::Fail(c, error);
    c->in_progress = 0;
  }
  return error;
}

JCE_NCCL_API ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                                   ncclDataType_t type,
                                                   ncclScalarResidence_t residence,
                                                   ncclComm_t comm) {
  namespace je = jcoccl_emul;
  const ncclResult_t u = je::Usable(comm, "ncclRedOpCreatePreMulSum");
  if (u != ncclSuccess) return u;
  if (op == nullptr || scalar == nullptr || type < 0 || type >= ncclNumTypes ||
      (residence != ncclScalarDevice && residence != ncclScalarHostImmediate))
    return ncclInvalidArgument;
  je::PreMul p;
  p.live = true;
  p.type = type;
  p.on_device = residence == ncclScalarDevice;
  p.ptr = scalar;
  std::memcpy(p.bytes, scalar, je::TypeBytes(type));
  std::lock_guard<std::mutex> lk(comm->mu);
  comm->premul.push_back(p);
  *op = static_cast<ncclRedOp_t>(ncclNumOps + comm->premul.size() - 1);
  return ncclSuccess;
}

JCE_NCCL_API ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  const ncclResult_t u = jcoccl_emul::Usable(comm, "ncclRedOpDestroy");
  if (u != ncclSuccess) return u;
  std::lock_guard<std::mutex> lk(comm->mu);
  const size_t i = static_cast<size_t>(op) - ncclNumOps;
  if (op < ncclNumOps || i >= comm->premul.size() || !comm->premul[i].live)
    return ncclInvalidArgument;
  comm->premul[i].live = false;
  return ncclSuccess;
}

#define JCE_SUBMIT(kind, send, recv, count, type, red, root, peer) \
  jcoccl_emul::Submit({jcoccl_emul::kind, comm, s, send, recv, count, type, red, root, peer})

JCE_NCCL_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
  return JCE_SUBMIT(kAllGather, send, recv, count, type, -1, -1, -1);
}

JCE_NCCL_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t s) {
  return JCE_SUBMIT(kAllReduce, send, recv, count, type, op, -1, -1);
}

JCE_NCCL_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t s) {
  return JCE_SUBMIT(kReduceScatter, send, recv, count, type, op, -1, -1);
}

JCE_NCCL_API ncclResult_t ncclReduce(const void* send, void* recv, size_t count,
                                     ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                                     cudaStream_t s) {
  return JCE_SUBMIT(kReduce, send, recv, count, type, op, root, -1);
}

JCE_NCCL_API ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, int root, ncclComm_t comm,
                                        cudaStream_t s) {
  return JCE_SUBMIT(kBroadcast, send, recv, count, type, -1, root, -1);
}

JCE_NCCL_API ncclResult_t ncclAlltoAll(const void* send, void* recv, size_t count,
                                       ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
  return JCE_SUBMIT(kAlltoAll, send, recv, count, type, -1, -1, -1);
}

JCE_NCCL_API ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s) {
  return JCE_SUBMIT(kSend, send, nullptr, count, type, -1, -1, peer);
}

JCE_NCCL_API ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s) {
  return JCE_SUBMIT(kRecv, nullptr, recv, count, type, -1, -1, peer);
}
#undef JCE_SUBMIT
