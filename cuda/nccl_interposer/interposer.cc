// libjcoccl_nccl.so's takeover half: ncclAllReduce (sum), ncclReduceScatter (sum) and
// ncclAllGather on float32 / bfloat16 / float16 buffers (never a float16 all-gather: XLA sends
// 16-bit integers that way), where the policy has a rule for the communicator's size, the op,
// the dtype and the message size, run as jcoccl's fused engine (engine/engine.h) on the
// caller's communicator; everything else goes to the real NCCL unchanged. The engine talks to
// the real NCCL only through the pointers forward.cc resolved (the nccl* names in this library
// are the interposer itself).
//
// Every rank of a communicator must take or forward the same calls. So each decision depends
// only on what all ranks see alike: the op, count, dtype, reduction, the communicator's size,
// the policy and the workspace size fixed at the communicator's first call. A per-rank event
// (the workspace reservation failing) fails the call with a message and sets the
// communicator's asynchronous error; it never forwards on one rank.
//
// Ordering, per communicator: three lanes (encode, communicate, decode: streams of the
// communicator's device) as in cuda/gpu/fused.cu. A call forks them off the caller's stream
// (each lane waits for it), runs the engine, and joins them back (the caller's stream waits
// for the decode lane, which waited for the other two). The next call's lanes also wait for
// the previous call's decode lane, as its workspace is reused. Nothing waits on the host.
// Calls made while their stream is being captured into a CUDA graph use a second set of lanes
// and a second workspace, so a replay never shares them with eager calls.
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
#include <thread>
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

// One line of the resolved policy (jcoccl/_src/engine/nccl_interposer.py writes them).
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
// The policy in force; a communicator keeps the one it saw at its first call.
std::shared_ptr<const Policy>& Pol() {
  static auto* p = new std::shared_ptr<const Policy>(std::make_shared<Policy>());
  return *p;
}
bool g_takeover_ok = false;  // the real NCCL opened and its version is one this was built for
std::string& VersionNote() {
  static auto* s = new std::string();
  return *s;
}

// One line "rule key=value ...": the rule's own keys, and the codec descriptor's fields in
// their text form (codecs/descriptor.h FieldFromText; a field not given keeps CodecSpec's
// default). Python writes them: jcoccl/_src/engine/nccl_interposer.py Rule.line.
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

// The first rule of `pol` for this call.
bool Match(const Policy& pol, int size, OpKind op, int dtype, int64_t bytes, Rule* out) {
  for (const Rule& r : pol.rules) {
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
  // taken_calls counts calls as issued: a captured call once, at its capture (its replays
  // run no code of this library); captured_calls says how many of them were captured.
  uint64_t taken_calls = 0, taken_bytes = 0, taken_wire = 0, captured_calls = 0;
  uint64_t fwd_calls = 0, fwd_bytes = 0, fwd_wire = 0;
};

enum Reason : int {
  kNoRule = 0,  // no rule for this size / op / dtype / size of message, or its codec is none
  kOtherType,   // not a sum, not float32 / bfloat16 / float16, or a float16 all-gather
  kWorkspace,   // needs more than the communicator's workspace (JCOCCL_NCCL_WORKSPACE)
  kDisabled,    // no policy, or the real NCCL is not one this was built for
  kNumReasons
};
const char* const kReasonNames[kNumReasons] = {"no_rule", "other_type", "workspace", "disabled"};
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

// Bytes of workspace per communicator and lane set unless JCOCCL_NCCL_WORKSPACE says
// otherwise: calls needing more are forwarded. XLA preallocates 75% of the device by
// default, so this comes out of the rest (docs/nccl.md "Workspace").
constexpr int64_t kDefaultWorkspace = int64_t{256} << 20;

int64_t WorkspaceSetting() {
  const char* e = std::getenv("JCOCCL_NCCL_WORKSPACE");
  if (e == nullptr || *e == '\0') return kDefaultWorkspace;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (end == e || *end != '\0' || v < 0) {
    std::fprintf(stderr, "jcoccl nccl: JCOCCL_NCCL_WORKSPACE=%s is not a byte count; using %lld\n",
                 e, static_cast<long long>(kDefaultWorkspace));
    return kDefaultWorkspace;
  }
  return v;
}

// The lanes, their events and the workspace of one kind of call (eager or captured).
struct LaneSet {
  cudaStream_t lane[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};  // one per source lane
  cudaEvent_t fork = nullptr;                       // recorded on the caller's stream
  uint8_t* ws = nullptr;
  std::string error;  // why the lanes or the workspace could not be made ("": not tried yet)
  bool ready = false;
};

struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 0, device = 0;
  std::shared_ptr<const Policy> pol;  // fixed at the communicator's first call
  int64_t ws_bytes = 0;               // each lane set's workspace, fixed then too
  LaneSet sets[2];                    // [0] eager calls, [1] calls under stream capture
  std::atomic<int> async{ncclSuccess};
  std::atomic<bool> aborting{false};  // ncclCommAbort from another thread: stop waiting
  OpCounters ops[kNumOps];
  std::mutex mu;  // one taken call at a time; ncclCommAbort waits for it
};

std::map<ncclComm_t, std::unique_ptr<Comm>>& Comms() {
  static auto* m = new std::map<ncclComm_t, std::unique_ptr<Comm>>();
  return *m;
}

Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("jcoccl nccl: CUDA ") + what + ": " + cudaGetErrorString(e));
}

// The communicator's record, made at its first collective (size, rank, device, the policy
// and workspace size in force then); null if the communicator cannot be queried.
Comm* CommOf(ncclComm_t comm) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto& m = Comms();
  auto it = m.find(comm);
  if (it != m.end()) return it->second.get();
  auto c = std::make_unique<Comm>();
  c->comm = comm;
  if (JCN_REAL(CommIntFn, ncclCommCount)(comm, &c->size) != ncclSuccess ||
      JCN_REAL(CommIntFn, ncclCommUserRank)(comm, &c->rank) != ncclSuccess ||
      JCN_REAL(CommIntFn, ncclCommCuDevice)(comm, &c->device) != ncclSuccess)
    return nullptr;
  c->pol = Pol();
  c->ws_bytes = WorkspaceSetting();
  Comm* out = c.get();
  m[comm] = std::move(c);
  return out;
}

// The communicator's device is current while its work is enqueued (a held group may run on
// another device's thread, at its poll); the caller's device afterwards.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    cudaGetDevice(&prev_);
    cudaSetDevice(device);
  }
  ~OnDevice() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

// Makes the lanes, events and workspace of `set` once (the caller holds c->mu); false with
// set->error when they cannot be made. Relaxed capture mode: the caller's stream may be
// capturing.
bool Prepare(Comm* c, LaneSet* set) {
  if (set->ready || !set->error.empty()) return set->ready;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(c->device);
  RelaxedCapture relaxed;
  int lo = 0, hi = 0;
  Status s = Cuda(cudaDeviceGetStreamPriorityRange(&lo, &hi), "priority range");
  for (int l = 0; l < 3 && s.ok(); ++l)
    s = Cuda(cudaStreamCreateWithPriority(&set->lane[l], cudaStreamNonBlocking,
                                          l == je::kComm ? hi : lo),
             "stream");
  for (cudaEvent_t* e : {&set->ev[0], &set->ev[1], &set->ev[2], &set->fork})
    if (s.ok()) s = Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event");
  if (s.ok()) {
    set->ws = static_cast<uint8_t*>(DeviceAlloc(static_cast<size_t>(c->ws_bytes)));
    if (set->ws == nullptr)
      s = Status::Error("jcoccl nccl: cannot reserve the workspace of " +
                        std::to_string(c->ws_bytes) + " bytes on device " +
                        std::to_string(c->device) +
                        " (JCOCCL_NCCL_WORKSPACE; XLA_PYTHON_CLIENT_MEM_FRACTION leaves "
                        "the rest of the device to it)");
  }
  cudaSetDevice(prev);
  set->ready = s.ok();
  set->error = s.ok() ? "" : s.msg;
  return set->ready;
}

// `to` waits for everything queued on `from` so far, through `ev`.
Status Wait(cudaEvent_t ev, cudaStream_t from, cudaStream_t to) {
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaEventRecord(ev, from), "event record"));
  return Cuda(cudaStreamWaitEvent(to, ev, 0), "stream wait");
}

class Lanes final : public je::Lanes {
 public:
  explicit Lanes(LaneSet* s) : s_(s) {}
  void* stream(je::Lane l) override { return s_->lane[l]; }
  Status Handoff(je::Lane from, je::Lane to) override {
    if (from == to) return Status::Ok();
    return Wait(s_->ev[from], s_->lane[from], s_->lane[to]);
  }
  Status Zero(je::Lane l, void* p, int64_t bytes) override {
    return Cuda(cudaMemsetAsync(p, 0, bytes, s_->lane[l]), "memset");
  }

 private:
  LaneSet* s_;
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
    // communicator until its state leaves ncclInProgress (host time of the enqueue only; a
    // blocking communicator never answers so). ncclCommAbort from another thread ends the
    // wait before it frees the communicator (CommAbort waits for c_->mu).
    while (r == ncclInProgress) {
      if (c_->aborting.load()) {
        r = ncclInvalidUsage;
        break;
      }
      ncclResult_t state = ncclSuccess;
      if (JCN_REAL(AsyncFn, ncclCommGetAsyncError)(c_->comm, &state) != ncclSuccess) break;
      r = state;
      if (r == ncclInProgress) std::this_thread::yield();
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
// jcoccl/_src/compressors/layout.py cuts it (slices of whole units, zero padding at the end of a
// row).
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

bool Misaligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }

// Forks `set`'s lanes off every stream of `streams` (the caller's, or its group's): each lane
// waits for the work queued on them so far, and for the set's previous call (its decode lane
// joined that call's other lanes: the workspace is reused).
Status Fork(LaneSet* set, const std::vector<cudaStream_t>& streams) {
  Lanes lanes(set);
  Status s = Status::Ok();
  for (cudaStream_t st : streams)
    for (int l = 0; l < 3 && s.ok(); ++l) s = Wait(set->fork, st, set->lane[l]);
  if (s.ok()) s = lanes.Handoff(je::kDecode, je::kEncode);
  if (s.ok()) s = lanes.Handoff(je::kDecode, je::kComm);
  return s;
}

// Joins `set`'s lanes back into every stream of `streams`: the decode lane waits for the
// other two, and the streams for the decode lane. Done on every path, a failed one included:
// the caller may reuse its buffers once its stream passes this point.
Status Join(LaneSet* set, const std::vector<cudaStream_t>& streams) {
  Lanes lanes(set);
  Status s = Status::Ok();
  for (int l : {je::kEncode, je::kComm}) {
    Status j = lanes.Handoff(static_cast<je::Lane>(l), je::kDecode);
    if (s.ok()) s = j;
  }
  for (cudaStream_t st : streams) {
    Status j = Wait(set->ev[je::kDecode], set->lane[je::kDecode], st);
    if (s.ok()) s = j;
  }
  return s;
}

// The engine's work of one call on `set`'s lanes (forked and joined by the caller).
Status RunTaken(LaneSet* set, OpKind op, const Rule& rule, const void* send, void* recv,
                int64_t count, jc::DType dtype, int size, const Plan& p, int64_t ws_bytes,
                Transport* t) {
  const int64_t eb = jc::DTypeBytes(dtype);
  uint8_t* ws = set->ws;
  uint8_t* in = p.stage_in ? ws + Align(ws_bytes) : nullptr;
  uint8_t* out = p.stage_out ? ws + Align(ws_bytes) + Align(p.in_bytes) : nullptr;
  Lanes lanes(set);
  cudaStream_t enc = set->lane[je::kEncode], dec = set->lane[je::kDecode];
  const int n = op == kReduceScatter ? size : 1;
  Status s = Status::Ok();
  if (p.stage_in) {
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
      s = Restage(false, out, static_cast<uint8_t*>(recv), size, count, p, eb, dec);
    } else {
      s = Cuda(cudaMemcpyAsync(recv, out, count * eb, cudaMemcpyDeviceToDevice, dec), "copy");
    }
  }
  return s;
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

// A matched call's plan and the workspace it needs (the same on every rank).
struct Sized {
  Plan plan;
  int64_t ws_bytes = 0, need = 0;
};

Sized SizeOf(const Comm* c, const Rule& rule, const Args& a) {
  const int dt = DTypeOf(a.type);
  Sized z;
  z.plan = MakePlan(a.op, rule, c->size, static_cast<int64_t>(a.count), dt == 0 ? 4 : 2);
  Codec sizing(rule.spec, static_cast<jc::DType>(dt));
  je::SizeOnlyTransport st(c->size);
  je::Call call;
  call.op = z.plan.op;
  call.k = z.plan.k;
  call.m = z.plan.m;
  call.codec = &sizing;
  call.comm = &st;
  z.ws_bytes = je::WorkspaceBytes(call);
  z.need = Align(z.ws_bytes) + Align(z.plan.in_bytes) + Align(z.plan.out_bytes);
  return z;
}

// A taken call that failed on this rank after its peers may have started theirs: NCCL's
// answer is an asynchronous error, which XLA polls and then aborts the communicator.
ncclResult_t Failed(Comm* c, ncclResult_t r, const std::string& msg) {
  int expected = ncclSuccess;
  c->async.compare_exchange_strong(expected, r);
  std::fprintf(stderr, "%s\n", msg.c_str());
  return r;
}

// Enqueues a taken call's engine work on the lanes of its kind (eager or captured); the
// caller forks and joins them. `*set` is the lane set used (null if none could be made).
ncclResult_t Enqueue(Comm* c, const Rule& rule, const Args& a, LaneSet** set) {
  const int dt = DTypeOf(a.type);
  const int64_t bytes = static_cast<int64_t>(a.count) * (dt == 0 ? 4 : 2);
  const bool captured = Capturing(a.stream);
  *set = &c->sets[captured ? 1 : 0];
  if (!Prepare(c, *set)) {
    const std::string e = (*set)->error;
    *set = nullptr;
    return Failed(c, ncclSystemError, e + "; the call fails");
  }
  Sized z = SizeOf(c, rule, a);
  // Unaligned buffers go through the workspace: the codec kernels load 16 bytes at a time.
  z.plan.stage_in |= Misaligned(a.send);
  z.plan.stage_out |= Misaligned(a.recv);
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(c->device);
  Transport t(c);
  Status s = RunTaken(*set, a.op, rule, a.send, a.recv, static_cast<int64_t>(a.count),
                      static_cast<jc::DType>(dt), c->size, z.plan, z.ws_bytes, &t);
  cudaSetDevice(prev);
  {
    std::lock_guard<std::mutex> g(g_mu);
    OpCounters& k = c->ops[a.op];
    ++k.taken_calls;
    k.captured_calls += captured ? 1 : 0;
    k.taken_bytes += bytes;
    k.taken_wire += t.sent();
  }
  if (s.ok()) return ncclSuccess;
  return Failed(c, t.code() != ncclSuccess ? t.code() : ncclInternalError, s.msg);
}

// Runs one taken call now: fork off its stream, the engine, join back.
ncclResult_t Execute(Comm* c, const Rule& rule, const Args& a) {
  std::lock_guard<std::mutex> lk(c->mu);
  OnDevice on(c->device);
  const std::vector<cudaStream_t> streams{a.stream};
  LaneSet* set = &c->sets[Capturing(a.stream) ? 1 : 0];
  if (Prepare(c, set)) {
    Status f = Fork(set, streams);
    if (!f.ok()) return Failed(c, ncclInternalError, f.msg);
  }
  ncclResult_t r = Enqueue(c, rule, a, &set);
  if (set != nullptr) {
    Status j = Join(set, streams);
    if (!j.ok() && r == ncclSuccess) r = Failed(c, ncclInternalError, j.msg);
  }
  return r;
}

// Calls taken over inside ncclGroupStart / ncclGroupEnd, run when the outermost group ends.
struct Deferred {
  Comm* comm;
  Rule rule;
  Args args;
};
// One group's taken calls and the streams of all its calls that passed through here.
struct Group {
  std::vector<Deferred> calls;
  std::vector<cudaStream_t> streams;
};
thread_local Group g_group;
uint64_t g_grouped = 0;  // calls taken over at their group's end
// Groups whose real ncclGroupEnd answered ncclInProgress (nonblocking communicators): they
// run once every communicator of theirs has left that state, when the caller polls it
// (ncclCommGetAsyncError, as NCCL asks of it) or makes its next group.
std::vector<Group>& Held() {
  static auto* h = new std::vector<Group>();
  return *h;
}
std::mutex g_held_mu;

void AddStream(std::vector<cudaStream_t>* v, cudaStream_t s) {
  if (std::find(v->begin(), v->end(), s) == v->end()) v->push_back(s);
}

// Decides a call: forwarded (false), run now, or (inside a group) queued for the group's end.
// XLA issues every collective inside a group, so the group is where the calls are. Every
// input of the decision is the same on every rank (see the top of the file).
bool Take(const Args& a, ncclResult_t* res) {
  if (g_group_depth > 0) AddStream(&g_group.streams, a.stream);
  const int dt = DTypeOf(a.type);
  if (!g_takeover_ok) return Forwarded(nullptr, a.op, 0, kDisabled), false;
  // float16 all-gathers are forwarded: XLA sends S16/U16 data movement as ncclFloat16.
  if (dt < 0 || (a.op != kAllGather && a.red != ncclSum) || (a.op == kAllGather && dt == 2))
    return Forwarded(nullptr, a.op, 0, kOtherType), false;
  Comm* c = CommOf(a.comm);
  if (c == nullptr) return Forwarded(nullptr, a.op, 0, kDisabled), false;
  // The message: what one rank contributes (all_reduce, all_gather) or receives (reduce_scatter).
  const int64_t bytes = static_cast<int64_t>(a.count) * (dt == 0 ? 4 : 2);
  Rule rule;
  if (c->size < 2 || a.count == 0 || !Match(*c->pol, c->size, a.op, dt, bytes, &rule) ||
      rule.spec.kind == jc::Kind::kNone)
    return Forwarded(c, a.op, bytes, kNoRule), false;
  if (SizeOf(c, rule, a).need > c->ws_bytes) return Forwarded(c, a.op, bytes, kWorkspace), false;
  if (g_group_depth > 0) {
    // NCCL would start it at the group's end too.
    g_group.calls.push_back({c, rule, a});
    *res = ncclSuccess;
    return true;
  }
  *res = Execute(c, rule, a);
  return true;
}

// A group's taken calls, after the real ncclGroupEnd launched its other calls: each call's
// lanes fork off every stream of the group, all calls are enqueued, then every stream of
// the group waits for all of them (NCCL orders a group's streams so). The first failure is
// the group's result.
ncclResult_t RunGroup(Group& g, ncclResult_t r) {
  std::vector<Comm*> comms;
  for (const Deferred& d : g.calls)
    if (std::find(comms.begin(), comms.end(), d.comm) == comms.end()) comms.push_back(d.comm);
  std::vector<std::unique_lock<std::mutex>> locks;
  for (Comm* c : comms) locks.emplace_back(c->mu);
  std::vector<std::pair<LaneSet*, int>> used;  // with its communicator's device
  for (const Deferred& d : g.calls) {
    OnDevice on(d.comm->device);
    ncclResult_t x = ncclSuccess;
    LaneSet* set = &d.comm->sets[Capturing(d.args.stream) ? 1 : 0];
    const std::pair<LaneSet*, int> u{set, d.comm->device};
    if (Prepare(d.comm, set) && std::find(used.begin(), used.end(), u) == used.end())
      used.push_back(u);
    if (set->ready) {
      Status f = Fork(set, g.streams);
      x = f.ok() ? Enqueue(d.comm, d.rule, d.args, &set) : Failed(d.comm, ncclInternalError, f.msg);
    } else {
      x = Enqueue(d.comm, d.rule, d.args, &set);  // fails with the reason
    }
    {
      std::lock_guard<std::mutex> lk(g_mu);
      ++g_grouped;
    }
    if ((r == ncclSuccess || r == ncclInProgress) && x != ncclSuccess) r = x;
  }
  for (const auto& [set, device] : used) {
    OnDevice on(device);
    Status j = Join(set, g.streams);
    if (!j.ok() && r == ncclSuccess) r = ncclInternalError;
  }
  return r;
}

// Whether every communicator of `g` has left ncclInProgress; an error is set in `*err`.
bool GroupReady(const Group& g, ncclResult_t* err) {
  for (const Deferred& d : g.calls) {
    ncclResult_t state = ncclSuccess;
    if (JCN_REAL(AsyncFn, ncclCommGetAsyncError)(d.comm->comm, &state) != ncclSuccess) continue;
    if (state == ncclInProgress) return false;
    if (state != ncclSuccess) *err = state;
  }
  return true;
}

// Runs the held groups that are ready, in the order they were made; ncclSuccess or the
// first failure.
ncclResult_t RunHeld() {
  ncclResult_t r = ncclSuccess;
  std::lock_guard<std::mutex> lk(g_held_mu);
  auto& held = Held();
  while (!held.empty()) {
    ncclResult_t err = ncclSuccess;
    if (!GroupReady(held.front(), &err)) break;
    Group g = std::move(held.front());
    held.erase(held.begin());
    // A communicator whose group failed runs none of the group's taken calls.
    ncclResult_t x = err == ncclSuccess ? RunGroup(g, ncclSuccess) : err;
    if (r == ncclSuccess) r = x;
  }
  return r;
}

bool Holds(ncclComm_t comm) {
  std::lock_guard<std::mutex> lk(g_held_mu);
  for (const Group& g : Held())
    for (const Deferred& d : g.calls)
      if (d.comm->comm == comm) return true;
  return false;
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
        << " captured_calls=" << k.captured_calls << " forwarded_calls=" << k.fwd_calls
        << " forwarded_bytes=" << k.fwd_bytes << " forwarded_wire=" << k.fwd_wire << "\n";
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
  std::shared_ptr<const Policy> pol;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    pol = Pol();
  }
  o << "policy=" << (pol->source.empty() ? "-" : pol->source) << "\n";
  if (!pol->error.empty()) o << "policy_error=" << pol->error << "\n";
  o << "rules=" << pol->rules.size() << "\n";
  o << "active=" << (g_takeover_ok && !pol->rules.empty() ? 1 : 0) << "\n";
  return o.str();
}

void Say(const std::string& what) { std::fprintf(stderr, "jcoccl nccl: %s\n", what.c_str()); }

void LoadPolicy(const char* path) {
  Policy p = path != nullptr && *path ? ReadPolicy(path) : Policy();
  if (!p.error.empty()) Say(p.error + "; every call is forwarded uncompressed");
  std::lock_guard<std::mutex> lk(g_mu);
  Pol() = std::make_shared<const Policy>(std::move(p));
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
  // A nonblocking communicator's earlier group may still wait: it goes first.
  ncclResult_t h = RunHeld();
  if (h != ncclSuccess) return h;
  ncclResult_t r = JCN_REAL(GroupFn, ncclGroupStart)();
  if (r == ncclSuccess) ++g_group_depth;
  return r;
}
ncclResult_t GroupEnd() {
  ncclResult_t r = JCN_REAL(GroupFn, ncclGroupEnd)();
  if (g_group_depth == 0) return r;  // no group: the real NCCL's answer (ncclInvalidUsage)
  // NCCL closes the group even when it reports an error: so does the depth here.
  if (--g_group_depth > 0) return r;
  Group g = std::move(g_group);
  g_group = Group();
  if (g.calls.empty()) return r;
  if (r == ncclInProgress) {
    // Nonblocking communicators: nothing may be issued on them until they leave
    // ncclInProgress, so the taken calls wait for the caller's poll (or its next group).
    std::lock_guard<std::mutex> lk(g_held_mu);
    Held().push_back(std::move(g));
    return r;
  }
  if (r != ncclSuccess) {
    // The group failed: its taken calls are not run, and their communicators say so.
    for (const Deferred& d : g.calls)
      Failed(d.comm, r,
             std::string("jcoccl nccl: ncclGroupEnd failed (") + ErrorString(r) +
                 "); the calls taken over in the group were not run");
    return r;
  }
  return RunGroup(g, r);
}
// A simulated group's calls are not run (NCCL only estimates them): neither are the ones it
// queued.
ncclResult_t GroupSimulateEnd(ncclSimInfo_t* info) {
  ncclResult_t r = JCN_REAL(SimulateFn, ncclGroupSimulateEnd)(info);
  if (g_group_depth > 0 && --g_group_depth == 0) g_group = Group();
  return r;
}
ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  ncclResult_t r = JCN_REAL(AsyncFn, ncclCommGetAsyncError)(comm, err);
  if (r != ncclSuccess) return r;
  if (*err == ncclSuccess && Holds(comm)) {
    // The caller polls a nonblocking communicator after its group: run what waited for it.
    ncclResult_t h = RunHeld();
    if (h != ncclSuccess) *err = h;
    if (*err == ncclSuccess && Holds(comm)) *err = ncclInProgress;
  }
  if (*err != ncclSuccess) return r;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = Comms().find(comm);
  if (it != Comms().end()) *err = static_cast<ncclResult_t>(it->second->async.load());
  return r;
}
// Waits for a taken call in flight on `comm` in another thread (told to stop waiting on the
// communicator) before the real NCCL frees it.
void Quiesce(ncclComm_t comm) {
  Comm* c = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = Comms().find(comm);
    if (it != Comms().end()) c = it->second.get();
  }
  if (c == nullptr) return;
  c->aborting = true;
  std::lock_guard<std::mutex> wait(c->mu);
  // A held group on it will never run (its peers' groups fail as the communicator goes).
  std::lock_guard<std::mutex> lk(g_held_mu);
  auto& held = Held();
  held.erase(std::remove_if(held.begin(), held.end(),
                            [&](const Group& g) {
                              for (const Deferred& d : g.calls)
                                if (d.comm == c) return true;
                              return false;
                            }),
             held.end());
}
ncclResult_t CommDestroy(ncclComm_t comm) {
  Quiesce(comm);
  DropComm(comm);
  return JCN_REAL(CommFn, ncclCommDestroy)(comm);
}
ncclResult_t CommAbort(ncclComm_t comm) {
  Quiesce(comm);
  DropComm(comm);
  return JCN_REAL(CommFn, ncclCommAbort)(comm);
}

}  // namespace jcn

// The nccl* and pnccl* names call the functions above (never each other by name: with a real
// libnccl.so.2 loaded globally, such a call could bind to it). A call from inside the real
// NCCL (its own use of a public name, which binds here when this library is preloaded) goes
// straight back to the real function: it is none of the caller's calls.
#define JCN_DEFINE(ret, name, fn, params, args)                      \
  JCN_EXPORT ret name params {                                       \
    if (jcn::CalledFromReal(__builtin_return_address(0)))            \
      return reinterpret_cast<ret(*) params>(jcn_real_##name) args;  \
    return jcn::fn args;                                             \
  }                                                                  \
  JCN_EXPORT ret p##name params {                                    \
    if (jcn::CalledFromReal(__builtin_return_address(0)))            \
      return reinterpret_cast<ret(*) params>(jcn_real_p##name) args; \
    return jcn::fn args;                                             \
  }
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

// ---- the control API (jcoccl/_src/engine/nccl_interposer.py)
// -------------------------------------------- One "key=value" per line: real, error, version,
// policy, policy_error, rules, active.
JCN_EXPORT const char* jcoccl_nccl_status() { return jcn::Text(jcn::StatusText()); }
// One line per communicator and op that saw a call, then the forwarding reasons.
JCN_EXPORT const char* jcoccl_nccl_counters() { return jcn::Text(jcn::CountersText()); }
// Replaces the policy with a resolved policy file (null or "": none); the status tells how it went.
JCN_EXPORT void jcoccl_nccl_load_policy(const char* path) { jcn::LoadPolicy(path); }
// The real NCCL's function `name` (null if it lacks it): jcoccl's own NCCL transport
// (transport/nccl.cc) resolves its calls through this when the library answers for
// libnccl.so.2, so jcoccl's exact collectives are never taken over.
JCN_EXPORT void* jcoccl_nccl_real_symbol(const char* name) { return jcn::Real(name); }
// This thread's depth of ncclGroupStart calls not yet ended.
JCN_EXPORT int jcoccl_nccl_group_depth() { return jcn::g_group_depth; }
