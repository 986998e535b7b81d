// libjcoccl_nccl.so's takeover half: ncclAllReduce (sum), ncclReduceScatter (sum) and
// ncclAllGather on float32 / bfloat16 / float16 buffers, where the policy has a rule for the
// communicator's size, the op, the dtype and the message size, run as jcoccl's fused engine
// (engine/engine.h) on the caller's communicator; everything else goes to the real NCCL
// unchanged. The engine talks to the real NCCL only through the pointers forward.cc resolved
// (the nccl* names in this library are the interposer itself).
//
// Ordering, per communicator: three lanes (encode, communicate, decode: streams of the
// communicator's device) as in cuda/gpu/fused.cu. A call forks them off the caller's stream
// (each lane waits for it), runs the engine, and joins them back (the caller's stream waits
// for the decode lane, which waited for the other two). The next call's lanes also wait for
// the previous call's decode lane, as its workspace is reused. Nothing waits on the host, and
// under stream capture the same calls record the fork and join into the graph; a call that
// would need to allocate while capturing is forwarded instead.
//
// Counters per communicator and op (bytes taken over and forwarded, payload bytes this rank
// handed to NCCL) are printed at exit with JCOCCL_NCCL_REPORT=1 and readable through
// jcoccl_nccl_counters (jcoccl.nccl.counters()).
#include "nccl_interposer/interposer.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/descriptor.h"
#include "engine/comms.h"
#include "engine/engine.h"

#define JCN_EXPORT extern "C" __attribute__((visibility("default")))
#ifdef JCN_HOST_SHIM
typedef struct jcnSimInfo ncclSimInfo_t;  // the emulation's nccl.h has no simulation API
#endif

extern "C" {
#define JCN_API(name, kind) extern void* jcn_real_##name;
#define JCN_TAKEN(name) extern void* jcn_real_##name;
#include "nccl_interposer/nccl_api.inc"
#undef JCN_API
#undef JCN_TAKEN
}

namespace jcn {
namespace {

namespace je = jcoccl::engine;
namespace jc = jcoccl::codecs;
using jcoccl::transport::CallCtx;
using jcoccl::transport::Status;

// ---- the real NCCL's functions that the engine and the bookkeeping call --------------------
using AllReduceFn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t);
using AllGatherFn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                                     cudaStream_t);
using SendFn = ncclResult_t (*)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
using RecvFn = ncclResult_t (*)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
using GroupFn = ncclResult_t (*)();
using CommFn = ncclResult_t (*)(ncclComm_t);
using CommIntFn = ncclResult_t (*)(const ncclComm_t, int*);
using AsyncFn = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
using VersionFn = ncclResult_t (*)(int*);
using ErrorStringFn = const char* (*)(ncclResult_t);
using SimulateFn = ncclResult_t (*)(ncclSimInfo_t*);

#define JCN_REAL(type, name) reinterpret_cast<type>(jcn_real_##name)

const char* ErrorString(ncclResult_t r) { return JCN_REAL(ErrorStringFn, ncclGetErrorString)(r); }

// ---- the policy ------------------------------------------------------------------------------
enum OpKind : int { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kNumOps = 3 };
const char* const kOpNames[kNumOps] = {"all_reduce", "reduce_scatter", "all_gather"};
const char* const kDTypeNames[3] = {"float32", "bfloat16", "float16"};
enum Algorithm : int { kOneShot = 0, kTwoShot = 1, kAuto = 2 };

// One line of the resolved policy (jcoccl/_src/nccl_policy.py writes them).
struct Rule {
  int size = 0;      // communicator size; 0: any
  unsigned ops = 0;  // bit per OpKind
  unsigned dtypes = 0;
  int64_t min_bytes = 0;
  int algorithm = kAuto;
  int chunks = 1;
  jc::CodecSpec spec;
  std::string name;
};

struct Policy {
  std::vector<Rule> rules;
  std::string source, error;
};

// Function statics, not globals: Init (a load-time constructor) may run before this file's
// dynamic initializers.
std::mutex g_mu;  // the policy, the communicator table and the forwarding reasons
Policy& Pol() {
  static auto* p = new Policy();
  return *p;
}
bool g_takeover_ok = false;  // the real NCCL opened and its version is one this was built for
std::string& VersionNote() {
  static auto* s = new std::string();
  return *s;
}

// One line "rule key=value ...": the rule's own keys, and the codec descriptor's fields in
// their text form (codecs/descriptor.h FieldFromText; a field not given keeps CodecSpec's
// default). Python writes them: jcoccl/_src/nccl_interposer.py Rule.line.
std::string ParseRule(const std::string& line, Rule* r) {
  std::istringstream in(line);
  std::string word;
  in >> word;
  while (in >> word) {
    const size_t eq = word.find('=');
    if (eq == std::string::npos) return "expected key=value, got '" + word + "'";
    const std::string k = word.substr(0, eq), v = word.substr(eq + 1);
    try {
      if (k == "size")
        r->size = std::stoi(v);
      else if (k == "ops" || k == "dtypes") {
        std::stringstream items(v);
        std::string item;
        while (std::getline(items, item, ',')) {
          int bit = -1;
          for (int i = 0; i < 3; ++i)
            if (item == (k == "ops" ? kOpNames[i] : kDTypeNames[i])) bit = i;
          if (bit < 0) return k + " has unknown entry '" + item + "'";
          (k == "ops" ? r->ops : r->dtypes) |= 1u << bit;
        }
      } else if (k == "min_bytes")
        r->min_bytes = std::stoll(v);
      else if (k == "algorithm")
        r->algorithm = v == "one_shot" ? kOneShot : v == "two_shot" ? kTwoShot : kAuto;
      else if (k == "chunks")
        r->chunks = std::stoi(v);
      else if (k == "codec")
        r->name = v;
      else {
        bool field = false;
        const std::string e = jc::FieldFromText(k, v, &r->spec, &field);
        if (!field) return "unknown key '" + k + "'";
        if (!e.empty()) return "codec " + e;
      }
    } catch (const std::exception&) {
      return "bad value in '" + word + "'";
    }
  }
  if (r->spec.kind == jc::Kind::kPlugin) return "plugin codecs are not available here";
  if (const char* e = jc::Validate(r->spec)) return std::string("codec: ") + e;
  if (r->size < 0 || r->min_bytes < 0 || r->chunks < 1 || r->chunks > 64 || r->ops == 0 ||
      r->dtypes == 0)
    return "size, min_bytes >= 0, chunks in [1, 64], and some ops and dtypes are needed";
  return {};
}

// Reads a resolved policy; on any error no rule is kept (every call is forwarded).
Policy ReadPolicy(const std::string& path) {
  Policy p;
  p.source = path;
  std::ifstream f(path);
  if (!f) {
    p.error = "cannot read the policy file " + path;
    return p;
  }
  std::string line;
  for (int no = 1; std::getline(f, line); ++no) {
    if (line.empty() || line[0] == '#') continue;
    Rule r;
    std::string e = line.rfind("rule ", 0) == 0 ? ParseRule(line, &r) : "expected 'rule ...'";
    if (!e.empty()) {
      p.rules.clear();
      p.error = path + ":" + std::to_string(no) + ": " + e;
      return p;
    }
    p.rules.push_back(r);
  }
  return p;
}

// The first rule for this call (a copy: the policy may be replaced meanwhile).
bool Match(int size, OpKind op, int dtype, int64_t bytes, Rule* out) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (const Rule& r : Pol().rules) {
    if ((r.size == 0 || r.size == size) && (r.ops >> op & 1u) && (r.dtypes >> dtype & 1u) &&
        bytes >= r.min_bytes) {
      *out = r;
      return true;
    }
  }
  return false;
}

// ---- counters --------------------------------------------------------------------------------
struct OpCounters {
  uint64_t taken_calls = 0, taken_bytes = 0, taken_wire = 0;
  uint64_t fwd_calls = 0, fwd_bytes = 0, fwd_wire = 0;
};

enum Reason : int {
  kNoRule = 0,  // no rule for this size / op / dtype / size of message
  kOtherType,   // not a sum, or not float32 / bfloat16 / float16
  kCapture,     // would allocate while the stream is being captured
  kDisabled,    // no policy, or the real NCCL is not one this was built for
  kNumReasons
};
const char* const kReasonNames[kNumReasons] = {"no_rule", "other_type", "capture", "disabled"};
uint64_t g_reasons[kNumReasons] = {};

// ---- per communicator ------------------------------------------------------------------------
bool Capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) != cudaSuccess || st != cudaStreamCaptureStatusNone;
}
#ifdef JCN_HOST_SHIM
// The host shim has no device allocator: host memory.
void* DeviceAlloc(size_t b) { return std::aligned_alloc(256, (b + 255) / 256 * 256); }
// Stream and event creation need no guard.
struct RelaxedCapture {};
#else
// Another stream of this thread may be capturing (XLA records command buffers while other
// work runs): under the global or thread-local capture modes cudaMalloc would then fail and
// invalidate that capture, so this thread switches to the relaxed mode around it, as NCCL
// does for its own allocations.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
};
void* DeviceAlloc(size_t b) {
  RelaxedCapture relaxed;
  void* p = nullptr;
  return cudaMalloc(&p, b) == cudaSuccess ? p : nullptr;
}
#endif

struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 0, device = 0;
  cudaStream_t lane[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};  // one per source lane
  cudaEvent_t fork = nullptr;                       // recorded on the caller's stream
  uint8_t* ws = nullptr;
  int64_t cap = 0;
  std::vector<void*> retired;  // earlier workspaces: queued work may still use them
  std::atomic<int> async{ncclSuccess};
  OpCounters ops[kNumOps];
  std::mutex mu;
};

std::map<ncclComm_t, std::unique_ptr<Comm>>& Comms() {
  static auto* m = new std::map<ncclComm_t, std::unique_ptr<Comm>>();
  return *m;
}

Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("jcoccl nccl: CUDA ") + what + ": " + cudaGetErrorString(e));
}

// The communicator's record, made at its first collective (size, rank, device, lanes).
Comm* CommOf(ncclComm_t comm, std::string* err) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto& m = Comms();
  auto it = m.find(comm);
  if (it != m.end()) return it->second.get();
  auto c = std::make_unique<Comm>();
  c->comm = comm;
  if (JCN_REAL(CommIntFn, ncclCommCount)(comm, &c->size) != ncclSuccess ||
      JCN_REAL(CommIntFn, ncclCommUserRank)(comm, &c->rank) != ncclSuccess ||
      JCN_REAL(CommIntFn, ncclCommCuDevice)(comm, &c->device) != ncclSuccess) {
    *err = "ncclCommCount / ncclCommUserRank / ncclCommCuDevice failed";
    return nullptr;
  }
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(c->device);
  RelaxedCapture relaxed;
  int lo = 0, hi = 0;
  Status s = Cuda(cudaDeviceGetStreamPriorityRange(&lo, &hi), "priority range");
  for (int l = 0; l < 3 && s.ok(); ++l)
    s = Cuda(
        cudaStreamCreateWithPriority(&c->lane[l], cudaStreamNonBlocking, l == je::kComm ? hi : lo),
        "stream");
  for (cudaEvent_t* e : {&c->ev[0], &c->ev[1], &c->ev[2], &c->fork})
    if (s.ok()) s = Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event");
  cudaSetDevice(prev);
  if (!s.ok()) {
    *err = s.msg;
    return nullptr;
  }
  Comm* out = c.get();
  m[comm] = std::move(c);
  return out;
}

// `to` waits for everything queued on `from` so far, through `ev`.
Status Wait(cudaEvent_t ev, cudaStream_t from, cudaStream_t to) {
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaEventRecord(ev, from), "event record"));
  return Cuda(cudaStreamWaitEvent(to, ev, 0), "stream wait");
}

class Lanes final : public je::Lanes {
 public:
  explicit Lanes(Comm* c) : c_(c) {}
  void* stream(je::Lane l) override { return c_->lane[l]; }
  Status Handoff(je::Lane from, je::Lane to) override {
    if (from == to) return Status::Ok();
    return Wait(c_->ev[from], c_->lane[from], c_->lane[to]);
  }
  Status Zero(je::Lane l, void* p, int64_t bytes) override {
    return Cuda(cudaMemsetAsync(p, 0, bytes, c_->lane[l]), "memset");
  }

 private:
  Comm* c_;
};

class Codec final : public je::Codec {
 public:
  using je::Codec::Codec;
  Status EncodeRows(void* s, const void* x, int64_t rows, int64_t n, uint8_t* out) override {
    return Cuda(jc::EncodeRowsCuda(spec_, dtype_, x, rows, n, out, St(s)), "encode");
  }
  Status DecodeRows(void* s, const uint8_t* in, int64_t rows, int64_t n, void* out) override {
    return Cuda(jc::DecodeRowsCuda(spec_, dtype_, in, rows, n, out, St(s)), "decode");
  }
  Status DecodeSum(void* s, const uint8_t* in, int nrows, int64_t n, void* out) override {
    return Cuda(jc::DecodeSumCuda(spec_, dtype_, in, nrows, Payload(n), n, out, St(s)),
                "decode_sum");
  }
  Status DecodeSumEncode(void* s, const uint8_t* in, int nrows, int64_t n, uint8_t* out) override {
    return Cuda(jc::DecodeSumEncodeCuda(spec_, dtype_, in, nrows, Payload(n), n, out, St(s)),
                "decode_sum_encode");
  }

 private:
  static cudaStream_t St(void* s) { return static_cast<cudaStream_t>(s); }
};

// The engine's byte collectives over the caller's communicator, through the real NCCL.
class Transport final : public jcoccl::transport::Transport {
 public:
  explicit Transport(Comm* c) : c_(c) {}
  int rank() const override { return c_->rank; }
  int size() const override { return c_->size; }
  uint64_t sent() const { return sent_; }
  Status AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override {
    sent_ += static_cast<uint64_t>(bytes) * (c_->size - 1);
    return Check(
        JCN_REAL(AllGatherFn, ncclAllGather)(send, recv, bytes, ncclUint8, c_->comm, St(ctx)),
        "ncclAllGather");
  }
  Status AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override {
    sent_ += static_cast<uint64_t>(bytes) * (c_->size - 1);
    JCOCCL_RETURN_IF_ERROR(Check(JCN_REAL(GroupFn, ncclGroupStart)(), "ncclGroupStart"));
    Status st;
    for (int r = 0; r < c_->size && st.ok(); ++r) {
      st = Check(JCN_REAL(SendFn, ncclSend)(static_cast<const char*>(send) + r * bytes, bytes,
                                            ncclUint8, r, c_->comm, St(ctx)),
                 "ncclSend");
      if (st.ok())
        st = Check(JCN_REAL(RecvFn, ncclRecv)(static_cast<char*>(recv) + r * bytes, bytes,
                                              ncclUint8, r, c_->comm, St(ctx)),
                   "ncclRecv");
    }
    // Closed on every path: a group left open would swallow the caller's next calls.
    Status end = Check(JCN_REAL(GroupFn, ncclGroupEnd)(), "ncclGroupEnd");
    return st.ok() ? end : st;
  }
  Status SendRecv(const CallCtx&, const void*, int, void*, int, int64_t) override {
    return Status::Error("jcoccl nccl: send/recv is never taken over");
  }
  Status AllReduceSum(const CallCtx&, const float*, int64_t, float*) override {
    return Status::Error("jcoccl nccl: plain reductions are forwarded, not run by the engine");
  }
  Status ReduceScatterSum(const CallCtx&, const float*, int64_t, float*) override {
    return Status::Error("jcoccl nccl: plain reductions are forwarded, not run by the engine");
  }
  ncclResult_t code() const { return code_; }

 private:
  static cudaStream_t St(const CallCtx& c) { return static_cast<cudaStream_t>(c.stream); }
  Status Check(ncclResult_t r, const char* what) {
    // A nonblocking communicator: the call is being queued; NCCL wants no other call on the
    // communicator until its state leaves ncclInProgress (host time of the enqueue only).
    while (r == ncclInProgress) {
      ncclResult_t state = ncclSuccess;
      if (JCN_REAL(AsyncFn, ncclCommGetAsyncError)(c_->comm, &state) != ncclSuccess) break;
      r = state;
    }
    if (r == ncclSuccess) return Status::Ok();
    if (code_ == ncclSuccess) code_ = r;
    return Status::Error(std::string("jcoccl nccl: ") + what + ": " + ErrorString(r));
  }
  Comm* c_;
  uint64_t sent_ = 0;
  ncclResult_t code_ = ncclSuccess;
};

// ---- one taken-over call -----------------------------------------------------------------------
int64_t Align(int64_t b) { return (b + 255) / 256 * 256; }
int64_t PaddedLen(int64_t len, int64_t multiple) {
  return std::max<int64_t>(1, (len + multiple - 1) / multiple) * multiple;
}

// How a message of `count` elements per rank becomes the engine's [k, (size,) m] rows, as
// jcoccl/_src/layout.py cuts it (slices of whole units, zero padding at the end of a row).
struct Plan {
  je::Op op;
  int64_t k = 1, m = 0, padded = 0;  // padded: elements of one rank's padded row (k * m)
  bool stage_in = false, stage_out = false;
  int64_t in_bytes = 0, out_bytes = 0;  // staging sizes
};

Plan MakePlan(OpKind op, const Rule& r, int n, int64_t count, int64_t eb) {
  Plan p;
  const int64_t g = jc::Granule(r.spec);
  int algo = r.algorithm == kAuto ? (n > 2 ? kTwoShot : kOneShot) : r.algorithm;
  const bool split = op == kAllReduce && algo == kTwoShot;  // a row is split over the ranks
  const int64_t unit = split ? g * n : g;
  p.k = std::min<int64_t>(r.chunks, std::max<int64_t>(1, (count + unit - 1) / unit));
  p.padded = PaddedLen(count, p.k * unit);
  p.m = p.padded / p.k / (split ? n : 1);
  if (op == kAllReduce) {
    p.op = split ? je::Op::kAllReduceTwoShot : je::Op::kAllReduceOneShot;
    p.stage_in = p.stage_out = p.padded != count;
    p.in_bytes = p.out_bytes = p.padded * eb;
  } else {
    const bool direct = p.k == 1 && p.padded == count;
    p.op = op == kReduceScatter ? je::Op::kReduceScatter : je::Op::kAllGather;
    p.stage_in = op == kReduceScatter ? !direct : p.padded != count;
    p.stage_out = op == kAllGather ? !direct : p.padded != count;
    p.in_bytes = (op == kReduceScatter ? n : 1) * p.padded * eb;
    p.out_bytes = (op == kAllGather ? n : 1) * p.padded * eb;
  }
  return p;
}

// Copies between the caller's [n, count] blocks and the engine's [k, n, m] rows, on `s`.
Status Restage(bool to_rows, const uint8_t* src, uint8_t* dst, int n, int64_t count, const Plan& p,
               int64_t eb, cudaStream_t s) {
  for (int r = 0; r < n; ++r) {
    for (int64_t sl = 0; sl < p.k; ++sl) {
      const int64_t first = sl * p.m, len = std::min(p.m, count - first);
      if (len <= 0) break;
      const int64_t user = (r * count + first) * eb, rows = ((sl * n + r) * p.m) * eb;
      JCOCCL_RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(to_rows ? dst + rows : dst + user, to_rows ? src + user : src + rows,
                               len * eb, cudaMemcpyDeviceToDevice, s),
               "copy"));
    }
  }
  return Status::Ok();
}

// Room for the engine's workspace and the staging rows; false if it would have to allocate
// while `stream` is being captured.
bool Reserve(Comm* c, int64_t need, cudaStream_t stream, Status* err) {
  if (need <= c->cap) return true;
  if (Capturing(stream)) return false;
  const int64_t cap = std::max<int64_t>(need, 2 * c->cap);
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(c->device);
  void* p = DeviceAlloc(static_cast<size_t>(cap));
  cudaSetDevice(prev);
  if (p == nullptr) {
    *err = Status::Error("jcoccl nccl: cannot allocate a workspace of " + std::to_string(cap) +
                         " bytes");
    return false;
  }
  if (c->ws != nullptr) c->retired.push_back(c->ws);
  c->ws = static_cast<uint8_t*>(p);
  c->cap = cap;
  return true;
}

Status RunTaken(Comm* c, OpKind op, const Rule& rule, const void* send, void* recv, int64_t count,
                jc::DType dtype, cudaStream_t stream, const Plan& p, int64_t ws_bytes,
                Transport* t) {
  const int64_t eb = jc::DTypeBytes(dtype);
  uint8_t* ws = c->ws;
  uint8_t* in = p.stage_in ? ws + Align(ws_bytes) : nullptr;
  uint8_t* out = p.stage_out ? ws + Align(ws_bytes) + Align(p.in_bytes) : nullptr;
  Lanes lanes(c);
  // Fork: the lanes start after the caller's stream (its inputs) and after the previous
  // call's decode lane (which joined that call's other lanes: its workspace is reused).
  Status s = Status::Ok();
  for (int l = 0; l < 3 && s.ok(); ++l) s = Wait(c->fork, stream, c->lane[l]);
  if (s.ok()) s = lanes.Handoff(je::kDecode, je::kEncode);
  if (s.ok()) s = lanes.Handoff(je::kDecode, je::kComm);
  cudaStream_t enc = c->lane[je::kEncode], dec = c->lane[je::kDecode];
  const int n = op == kReduceScatter ? c->size : 1;
  if (s.ok() && p.stage_in) {
    s = Cuda(cudaMemsetAsync(in, 0, p.in_bytes, enc), "memset");
    if (s.ok() && op == kAllReduce) {
      s = Cuda(cudaMemcpyAsync(in, send, count * eb, cudaMemcpyDeviceToDevice, enc), "copy");
    } else if (s.ok()) {
      s = Restage(true, static_cast<const uint8_t*>(send), in, n, count, p, eb, enc);
    }
  }
  if (s.ok()) {
    Codec codec(rule.spec, dtype);
    je::Call call;
    call.op = p.op;
    call.k = p.k;
    call.m = p.m;
    call.x = p.stage_in ? in : send;
    call.out = p.stage_out ? out : recv;
    call.codec = &codec;
    call.comm = t;
    s = je::Run(call, &lanes, ws, ws_bytes);
  }
  if (s.ok() && p.stage_out) {
    if (op == kAllGather) {
      s = Restage(false, out, static_cast<uint8_t*>(recv), c->size, count, p, eb, dec);
    } else {
      s = Cuda(cudaMemcpyAsync(recv, out, count * eb, cudaMemcpyDeviceToDevice, dec), "copy");
    }
  }
  // Join on every path, a failed one included: the caller may reuse its buffers once its
  // stream passes this point.
  for (int l : {je::kEncode, je::kComm}) {
    Status j = lanes.Handoff(static_cast<je::Lane>(l), je::kDecode);
    if (s.ok()) s = j;
  }
  Status j = Wait(c->ev[je::kDecode], dec, stream);
  return s.ok() ? j : s;
}

// Payload bytes this rank sends in NCCL's own algorithm for the same call (ring).
uint64_t PlainWire(OpKind op, int n, uint64_t bytes) {
  if (op == kAllReduce) return 2 * bytes * (n - 1) / n;
  return bytes * (n - 1);  // reduce_scatter: recvcount bytes per peer; all_gather: sendcount
}

thread_local int g_group_depth = 0;

int DTypeOf(ncclDataType_t t) {
  return t == ncclFloat32 ? 0 : t == ncclBfloat16 ? 1 : t == ncclFloat16 ? 2 : -1;
}

void Forwarded(Comm* c, OpKind op, int64_t bytes, Reason why) {
  std::lock_guard<std::mutex> lk(g_mu);
  ++g_reasons[why];
  if (c == nullptr) return;
  OpCounters& k = c->ops[op];
  ++k.fwd_calls;
  k.fwd_bytes += bytes;
  k.fwd_wire += PlainWire(op, c->size, bytes);
}

// One collective as its caller issued it.
struct Args {
  OpKind op;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t red;
  ncclComm_t comm;
  cudaStream_t stream;
};

ncclResult_t ForwardReal(const Args& a) {
  if (a.op == kAllGather)
    return JCN_REAL(AllGatherFn, ncclAllGather)(a.send, a.recv, a.count, a.type, a.comm, a.stream);
  void* fn = a.op == kAllReduce ? jcn_real_ncclAllReduce : jcn_real_ncclReduceScatter;
  return reinterpret_cast<AllReduceFn>(fn)(a.send, a.recv, a.count, a.type, a.red, a.comm,
                                           a.stream);
}

// Runs a matched call with the engine; false: it must be forwarded (`*res` unset).
bool Execute(Comm* c, const Rule& rule, const Args& a, ncclResult_t* res) {
  const int dt = DTypeOf(a.type);
  const int64_t eb = dt == 0 ? 4 : 2;
  const int64_t bytes = static_cast<int64_t>(a.count) * eb;
  std::lock_guard<std::mutex> lk(c->mu);
  const jc::DType dtype = static_cast<jc::DType>(dt);
  const Plan p = MakePlan(a.op, rule, c->size, static_cast<int64_t>(a.count), eb);
  Codec sizing(rule.spec, dtype);
  je::SizeOnlyTransport st(c->size);
  je::Call call;
  call.op = p.op;
  call.k = p.k;
  call.m = p.m;
  call.codec = &sizing;
  call.comm = &st;
  const int64_t ws_bytes = je::WorkspaceBytes(call);
  const int64_t need = Align(ws_bytes) + Align(p.in_bytes) + Align(p.out_bytes);
  Status s = Status::Ok();
  if (!Reserve(c, need, a.stream, &s)) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s; the call is forwarded\n", s.msg.c_str());
      return Forwarded(c, a.op, bytes, kDisabled), false;
    }
    return Forwarded(c, a.op, bytes, kCapture), false;
  }
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(c->device);
  Transport t(c);
  s = RunTaken(c, a.op, rule, a.send, a.recv, static_cast<int64_t>(a.count), dtype, a.stream, p,
               ws_bytes, &t);
  cudaSetDevice(prev);
  {
    std::lock_guard<std::mutex> g(g_mu);
    OpCounters& k = c->ops[a.op];
    ++k.taken_calls;
    k.taken_bytes += bytes;
    k.taken_wire += t.sent();
  }
  if (s.ok()) {
    *res = ncclSuccess;
  } else {
    // Part of the call may be queued while peers wait for the rest: NCCL's answer to that is
    // an asynchronous error, which XLA polls and then aborts the communicator.
    *res = t.code() != ncclSuccess ? t.code() : ncclInternalError;
    int expected = ncclSuccess;
    c->async.compare_exchange_strong(expected, *res);
    std::fprintf(stderr, "%s\n", s.msg.c_str());
  }
  return true;
}

// Calls taken over inside ncclGroupStart / ncclGroupEnd, run when the outermost group ends.
struct Deferred {
  Comm* comm;
  Rule rule;
  Args args;
};
thread_local std::vector<Deferred> g_deferred;
uint64_t g_grouped = 0;  // calls taken over at their group's end

// Decides a call: forwarded (false), run now, or (inside a group) queued for the group's end.
// XLA issues every collective inside a group, so the group is where the calls are.
bool Take(const Args& a, ncclResult_t* res) {
  const int dt = DTypeOf(a.type);
  if (!g_takeover_ok) return Forwarded(nullptr, a.op, 0, kDisabled), false;
  if (dt < 0 || (a.op != kAllGather && a.red != ncclSum))
    return Forwarded(nullptr, a.op, 0, kOtherType), false;
  std::string err;
  Comm* c = CommOf(a.comm, &err);
  if (c == nullptr) return Forwarded(nullptr, a.op, 0, kDisabled), false;
  // The message: what one rank contributes (all_reduce, all_gather) or receives (reduce_scatter).
  const int64_t bytes = static_cast<int64_t>(a.count) * (dt == 0 ? 4 : 2);
  Rule rule;
  if (c->size < 2 || a.count == 0 || !Match(c->size, a.op, dt, bytes, &rule))
    return Forwarded(c, a.op, bytes, kNoRule), false;
  if (g_group_depth > 0) {
    // NCCL would start it at the group's end too; every rank defers the same calls (the rule
    // depends only on what all ranks pass), so they stay in step.
    g_deferred.push_back({c, rule, a});
    *res = ncclSuccess;
    return true;
  }
  return Execute(c, rule, a, res);
}

// The group's own calls went to the real NCCL with its ncclGroupEnd; the deferred ones run
// now, in issue order, each as its own engine call. The first failure is the group's result.
ncclResult_t RunDeferred(ncclResult_t r) {
  std::vector<Deferred> todo;
  todo.swap(g_deferred);
  for (const Deferred& d : todo) {
    ncclResult_t x = ncclSuccess;
    if (!Execute(d.comm, d.rule, d.args, &x)) x = ForwardReal(d.args);
    {
      std::lock_guard<std::mutex> lk(g_mu);
      ++g_grouped;
    }
    if ((r == ncclSuccess || r == ncclInProgress) && x != ncclSuccess && x != ncclInProgress) r = x;
  }
  return r;
}

void DropComm(ncclComm_t comm) {
  std::lock_guard<std::mutex> lk(g_mu);
  // The record (lanes, workspace) is kept: work queued before the destroy may still use it.
  // A later communicator at the same address gets a fresh record.
  auto it = Comms().find(comm);
  if (it != Comms().end()) {
    static auto* graveyard = new std::vector<std::unique_ptr<Comm>>();
    graveyard->push_back(std::move(it->second));
    Comms().erase(it);
  }
}

std::string CountersText() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::ostringstream o;
  for (auto& [comm, c] : Comms()) {
    for (int op = 0; op < kNumOps; ++op) {
      const OpCounters& k = c->ops[op];
      if (k.taken_calls + k.fwd_calls == 0) continue;
      o << "comm=" << static_cast<const void*>(comm) << " size=" << c->size << " rank=" << c->rank
        << " op=" << kOpNames[op] << " taken_calls=" << k.taken_calls
        << " taken_bytes=" << k.taken_bytes << " taken_wire=" << k.taken_wire
        << " forwarded_calls=" << k.fwd_calls << " forwarded_bytes=" << k.fwd_bytes
        << " forwarded_wire=" << k.fwd_wire << "\n";
    }
  }
  o << "grouped taken_at_group_end=" << g_grouped << "\n";
  o << "forwarded";
  for (int r = 0; r < kNumReasons; ++r) o << " " << kReasonNames[r] << "=" << g_reasons[r];
  o << "\n";
  return o.str();
}

std::string StatusText() {
  std::ostringstream o;
  o << "real=" << (RealPath().empty() ? "-" : RealPath()) << "\n";
  if (!LoadError().empty()) o << "error=" << LoadError() << "\n";
  if (!VersionNote().empty()) o << "version=" << VersionNote() << "\n";
  std::lock_guard<std::mutex> lk(g_mu);
  o << "policy=" << (Pol().source.empty() ? "-" : Pol().source) << "\n";
  if (!Pol().error.empty()) o << "policy_error=" << Pol().error << "\n";
  o << "rules=" << Pol().rules.size() << "\n";
  o << "active=" << (g_takeover_ok && !Pol().rules.empty() ? 1 : 0) << "\n";
  return o.str();
}

void Say(const std::string& what) { std::fprintf(stderr, "jcoccl nccl: %s\n", what.c_str()); }

void LoadPolicy(const char* path) {
  Policy p = path != nullptr && *path ? ReadPolicy(path) : Policy();
  if (!p.error.empty()) Say(p.error + "; every call is forwarded uncompressed");
  std::lock_guard<std::mutex> lk(g_mu);
  Pol() = std::move(p);
}

__attribute__((constructor)) void Init() {
  if (!OpenReal()) {
    Say(LoadError());
    return;
  }
  int v = 0;
  JCN_REAL(VersionFn, ncclGetVersion)(&v);
  // NCCL >= 2.9 codes versions as major * 10000 + minor * 100 + patch; 99999 is the test
  // emulation (cuda/emul/nccl_emul.h).
  g_takeover_ok = v / 10000 == JCN_NCCL_VERSION_CODE / 10000 || v == 99999;
  VersionNote() =
      std::to_string(v) + " (generated from " + std::to_string(JCN_NCCL_VERSION_CODE) + ")";
  if (!g_takeover_ok)
    Say("the real NCCL is version " + std::to_string(v) +
        ", not NCCL 2.x, which this library "
        "was generated for (" +
        std::to_string(JCN_NCCL_VERSION_CODE) + "): every call is forwarded uncompressed");
  LoadPolicy(std::getenv("JCOCCL_NCCL_POLICY"));
}

__attribute__((destructor)) void Report() {
  const char* r = std::getenv("JCOCCL_NCCL_REPORT");
  if (r == nullptr || std::strcmp(r, "1") != 0) return;
  std::fprintf(stderr, "jcoccl nccl report (pid %d)\n%s%s", static_cast<int>(getpid()),
               StatusText().c_str(), CountersText().c_str());
}

thread_local std::string g_text;
const char* Text(std::string s) {
  g_text = std::move(s);
  return g_text.c_str();
}

}  // namespace

// ---- the exported calls it defines -------------------------------------------------------------
ncclResult_t AllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                       ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  const Args a{kAllReduce, send, recv, count, type, op, comm, s};
  ncclResult_t r;
  return Take(a, &r) ? r : ForwardReal(a);
}
ncclResult_t ReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  const Args a{kReduceScatter, send, recv, count, type, op, comm, s};
  ncclResult_t r;
  return Take(a, &r) ? r : ForwardReal(a);
}
ncclResult_t AllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                       ncclComm_t comm, cudaStream_t s) {
  const Args a{kAllGather, send, recv, count, type, ncclSum, comm, s};
  ncclResult_t r;
  return Take(a, &r) ? r : ForwardReal(a);
}
ncclResult_t GroupStart() {
  ncclResult_t r = JCN_REAL(GroupFn, ncclGroupStart)();
  if (r == ncclSuccess) ++g_group_depth;
  return r;
}
ncclResult_t GroupEnd() {
  ncclResult_t r = JCN_REAL(GroupFn, ncclGroupEnd)();
  if (g_group_depth > 0 && r != ncclInvalidUsage) --g_group_depth;
  return g_group_depth == 0 && !g_deferred.empty() ? RunDeferred(r) : r;
}
// A simulated group's calls are not run (NCCL only estimates them): neither are the ones it
// queued.
ncclResult_t GroupSimulateEnd(ncclSimInfo_t* info) {
  ncclResult_t r = JCN_REAL(SimulateFn, ncclGroupSimulateEnd)(info);
  if (g_group_depth > 0 && r != ncclInvalidUsage) --g_group_depth;
  if (g_group_depth == 0) g_deferred.clear();
  return r;
}
ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  ncclResult_t r = JCN_REAL(AsyncFn, ncclCommGetAsyncError)(comm, err);
  if (r != ncclSuccess || *err != ncclSuccess) return r;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = Comms().find(comm);
  if (it != Comms().end()) *err = static_cast<ncclResult_t>(it->second->async.load());
  return r;
}
ncclResult_t CommDestroy(ncclComm_t comm) {
  DropComm(comm);
  return JCN_REAL(CommFn, ncclCommDestroy)(comm);
}
ncclResult_t CommAbort(ncclComm_t comm) {
  DropComm(comm);
  return JCN_REAL(CommFn, ncclCommAbort)(comm);
}

}  // namespace jcn

// The nccl* and pnccl* names call the functions above (never each other by name: with a real
// libnccl.so.2 loaded globally, such a call could bind to it).
#define JCN_DEFINE(ret, name, fn, params, args)       \
  JCN_EXPORT ret name params { return jcn::fn args; } \
  JCN_EXPORT ret p##name params { return jcn::fn args; }
JCN_DEFINE(ncclResult_t, ncclAllReduce, AllReduce,
           (const void* a, void* b, size_t n, ncclDataType_t t, ncclRedOp_t o, ncclComm_t c,
            cudaStream_t s),
           (a, b, n, t, o, c, s))
JCN_DEFINE(ncclResult_t, ncclReduceScatter, ReduceScatter,
           (const void* a, void* b, size_t n, ncclDataType_t t, ncclRedOp_t o, ncclComm_t c,
            cudaStream_t s),
           (a, b, n, t, o, c, s))
JCN_DEFINE(ncclResult_t, ncclAllGather, AllGather,
           (const void* a, void* b, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t s),
           (a, b, n, t, c, s))
JCN_DEFINE(ncclResult_t, ncclGroupStart, GroupStart, (), ())
JCN_DEFINE(ncclResult_t, ncclGroupEnd, GroupEnd, (), ())
JCN_DEFINE(ncclResult_t, ncclGroupSimulateEnd, GroupSimulateEnd, (ncclSimInfo_t * i), (i))
JCN_DEFINE(ncclResult_t, ncclCommGetAsyncError, CommGetAsyncError, (ncclComm_t c, ncclResult_t* e),
           (c, e))
JCN_DEFINE(ncclResult_t, ncclCommDestroy, CommDestroy, (ncclComm_t c), (c))
JCN_DEFINE(ncclResult_t, ncclCommAbort, CommAbort, (ncclComm_t c), (c))

// ---- the control API (jcoccl/_src/nccl_interposer.py)
// -------------------------------------------- One "key=value" per line: real, error, version,
// policy, policy_error, rules, active.
JCN_EXPORT const char* jcoccl_nccl_status() { return jcn::Text(jcn::StatusText()); }
// One line per communicator and op that saw a call, then the forwarding reasons.
JCN_EXPORT const char* jcoccl_nccl_counters() { return jcn::Text(jcn::CountersText()); }
// Replaces the policy with a resolved policy file (null or "": none); the status tells how it went.
JCN_EXPORT void jcoccl_nccl_load_policy(const char* path) { jcn::LoadPolicy(path); }
// This thread's depth of ncclGroupStart calls not yet ended.
JCN_EXPORT int jcoccl_nccl_group_depth() { return jcn::g_group_depth; }
