// The NCCL call sequences XLA's GPU runtime issues, replayed on N ranks (threads, devices
// 0..N-1 of the host shim) against a libnccl.so.2: the NCCL emulation itself, or
// libjcoccl_nccl.so in front of it. tests/test_nccl_emul.py runs it both ways and compares.
//
// What XLA does (read in openxla/xla; facts only):
//   xla/backends/gpu/collectives/nccl_collectives.cc
//     AsNcclConfig: NCCL_CONFIG_INITIALIZER, then blocking = the config's
//       blocking_communicators (0 with nonblocking communicators), splitShare, maxCTAs;
//     CreateCommunicatorsWithCancel: one thread per local rank, each
//       ncclCommInitRankConfig(&comm, nranks, id, rank, &config), then PollUntilDone;
//     SplitCommunicatorsWithCancel: one thread per rank, each
//       ncclCommSplit(comm, color, key, &split, &config), then PollUntilDone.
//   xla/backends/gpu/collectives/nccl_communicator.cc
//     ToNcclDataType: S8 and every fp8 type -> ncclInt8, PRED/U8 -> ncclUint8, S32/U32/S64/U64
//       -> their own, F16 -> ncclFloat16, F32/C64 -> ncclFloat32, F64/C128 -> ncclFloat64,
//       BF16 -> ncclBfloat16, S16/U16 -> ncclFloat16 for data movement (a reduction of them
//       is refused; XLA promotes those to 32 bits);
//     ToNcclCount: a complex type's count doubles (C64 = float pairs);
//     GroupExecute (used by RunAllReduce in xla/backends/gpu/runtime/all_reduce_thunk.cc):
//       GroupStart, one Launch* per buffer (variadic ops: several calls in one group),
//       GroupEnd; GroupEnd polls the communicator (PollUntilDone) at the outermost level;
//     LaunchAllReduce / LaunchReduceScatter / LaunchAllGather / LaunchBroadcast / LaunchSend /
//       LaunchRecv: one call, then PollUntilDone when not inside a group;
//     LaunchAllToAll: ncclCommCount, then GroupStart, for each peer i ncclSend(send_i, i) and
//       ncclRecv(recv_i, i), GroupEnd;
//     LaunchCollectivePermute: nothing without a source or target; else GroupStart,
//       ncclRecv from the source (if any), ncclSend to each target, GroupEnd.
//   xla/backends/gpu/collectives/nccl_errors.h
//     XLA_NCCL_STATUS treats ncclInProgress as success; PollUntilDone calls
//     ncclCommGetAsyncError until it no longer says ncclInProgress.
//
//   xla_patterns LIBRARY NRANKS BLOCKING OUTDIR
// dlopens LIBRARY (by path), runs every pattern on every rank, writes each rank's input and
// output of each pattern to OUTDIR/<pattern>.d<device>.{in,out} and prints one line per
// pattern and rank: "<pattern> device <d> result <first NCCL error or 0>"; then the
// emulation's findings ("finding ...") and "done".
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "nccl.h"

namespace {

struct Api {
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*InitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*Split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
  ncclResult_t (*GetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*Count)(ncclComm_t, int*);
  ncclResult_t (*Destroy)(ncclComm_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
};

template <class F>
bool Bind(void* h, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(h, name));
  if (*out == nullptr) std::printf("error missing %s\n", name);
  return *out != nullptr;
}

bool Load(void* h, Api* a) {
  return Bind(h, "ncclGetUniqueId", &a->GetUniqueId) &&
         Bind(h, "ncclCommInitRankConfig", &a->InitRankConfig) &&
         Bind(h, "ncclCommSplit", &a->Split) &&
         Bind(h, "ncclCommGetAsyncError", &a->GetAsyncError) &&
         Bind(h, "ncclCommCount", &a->Count) && Bind(h, "ncclCommDestroy", &a->Destroy) &&
         Bind(h, "ncclGroupStart", &a->GroupStart) && Bind(h, "ncclGroupEnd", &a->GroupEnd) &&
         Bind(h, "ncclAllReduce", &a->AllReduce) &&
         Bind(h, "ncclReduceScatter", &a->ReduceScatter) &&
         Bind(h, "ncclAllGather", &a->AllGather) && Bind(h, "ncclBroadcast", &a->Broadcast) &&
         Bind(h, "ncclSend", &a->Send) && Bind(h, "ncclRecv", &a->Recv);
}

Api g_api;
int g_nranks = 2;
int g_blocking = 1;
std::string g_out;
std::mutex g_print;

// The first failure of a sequence of calls (ncclInProgress counts as success, as in XLA).
struct Result {
  ncclResult_t r = ncclSuccess;
  void operator+=(ncclResult_t x) {
    if (r == ncclSuccess && x != ncclSuccess && x != ncclInProgress) r = x;
  }
};

// XLA's PollUntilDone: the communicator's state until it leaves ncclInProgress.
ncclResult_t Poll(ncclComm_t comm) {
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = g_api.GetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() > limit) return ncclInternalError;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

size_t Bytes(ncclDataType_t t) {
  // By ncclDataType_t: int8, uint8, int32, uint32, int64, uint64, float16, float32, float64,
  // bfloat16, float8e4m3, float8e5m2.
  static const size_t kBytes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
  return kBytes[t];
}

uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// `count` elements of type t for (pattern p, rank r): floats in [-4, 4), integers of every
// bit pattern (16-bit data every 7th element a NaN or Inf pattern of float16).
std::vector<uint8_t> Data(ncclDataType_t t, size_t count, int p, int r, bool s16) {
  std::vector<uint8_t> v(count * Bytes(t));
  for (size_t i = 0; i < count; ++i) {
    const uint32_t h = Hash(static_cast<uint32_t>(i * 7919 + p * 104729 + r * 1299709 + 1));
    const float f = (h % 65536) / 8192.0f - 4.0f;
    uint8_t* d = v.data() + i * Bytes(t);
    if (s16) {
      const uint16_t u = i % 7 == 3 ? static_cast<uint16_t>(0x7c00u | (h & 0x83ffu)) : h & 0xffff;
      std::memcpy(d, &u, 2);
    } else if (t == ncclFloat32) {
      std::memcpy(d, &f, 4);
    } else if (t == ncclFloat64) {
      const double x = f;
      std::memcpy(d, &x, 8);
    } else if (t == ncclBfloat16) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t b = static_cast<uint16_t>(u >> 16);  // exact: f has few bits
      std::memcpy(d, &b, 2);
    } else {
      std::memcpy(d, &h, Bytes(t));
    }
  }
  return v;
}

void Write(const std::string& name, int device, const char* ext, const std::vector<uint8_t>& v) {
  std::ofstream f(g_out + "/" + name + ".d" + std::to_string(device) + "." + ext, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size()));
}

struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t world = nullptr, comm = nullptr, pair = nullptr;
  int rank = 0;  // in `comm`
};

// One pattern: `issue` makes its NCCL calls; its input and output buffers are written out.
void Pattern(Rank& k, const std::string& name, std::vector<uint8_t> in, size_t out_bytes,
             const std::function<void(Result&, const uint8_t*, uint8_t*)>& issue) {
  std::vector<uint8_t> out(out_bytes, 0xee);
  Result res;
  issue(res, in.data(), out.data());
  cudaStreamSynchronize(k.stream);
  Write(name, k.device, "in", in);
  Write(name, k.device, "out", out);
  std::lock_guard<std::mutex> lk(g_print);
  std::printf("%s device %d result %d\n", name.c_str(), k.device, res.r);
}

// ncclGroupStart, the calls, ncclGroupEnd, then XLA's poll (GroupExecute).
void Grouped(Result& res, ncclComm_t comm, const std::function<void()>& calls) {
  res += g_api.GroupStart();
  calls();
  res += g_api.GroupEnd();
  res += Poll(comm);
}

void RunPatterns(Rank& k) {
  const int n = g_nranks, me = k.rank;
  const auto& A = g_api;
  cudaStream_t s = k.stream;
  ncclComm_t c = k.comm;
  int p = 0;
  // all-reduce, variadic (XLA's all-reduce combiner makes them): one group, one call per
  // buffer; two float32 buffers, and a float32 and a bfloat16 one.
  struct Part {
    size_t offset, count;  // bytes into the pattern's data, elements
    ncclDataType_t t;
  };
  struct Variadic {
    const char* name;
    size_t floats;  // the pattern's data, in float32 elements
    std::vector<Part> parts;
  };
  for (const Variadic& v :
       {Variadic{"all_reduce_f32_x2", 1300, {{0, 1000, ncclFloat32}, {4000, 300, ncclFloat32}}},
        Variadic{"all_reduce_f32_bf16", 600, {{0, 400, ncclFloat32}, {1600, 400, ncclBfloat16}}}}) {
    ++p;
    Pattern(k, v.name, Data(ncclFloat32, v.floats, p, me, false), v.floats * 4,
            [&](Result& r, const uint8_t* x, uint8_t* y) {
              Grouped(r, c, [&] {
                for (const Part& q : v.parts)
                  r += A.AllReduce(x + q.offset, y + q.offset, q.count, q.t, ncclSum, c, s);
              });
            });
  }
  struct Red {
    const char* name;
    ncclDataType_t t;
    ncclRedOp_t op;
    size_t count;
  };
  const Red reds[] = {{"all_reduce_bf16_sum", ncclBfloat16, ncclSum, 512},
                      {"all_reduce_s32_max", ncclInt32, ncclMax, 257},
                      {"all_reduce_f64_min", ncclFloat64, ncclMin, 100},
                      {"all_reduce_pred_max", ncclUint8, ncclMax, 99},
                      {"all_reduce_s8_sum", ncclInt8, ncclSum, 64},
                      {"all_reduce_f32_prod", ncclFloat32, ncclProd, 64},
                      // C64: float pairs, twice the count (ToNcclCount).
                      {"all_reduce_c64_sum", ncclFloat32, ncclSum, 2 * 128}};
  for (const Red& rd : reds) {
    ++p;
    Pattern(k, rd.name, Data(rd.t, rd.count, p, me, false), rd.count * Bytes(rd.t),
            [&](Result& r, const uint8_t* x, uint8_t* y) {
              Grouped(r, c, [&] { r += A.AllReduce(x, y, rd.count, rd.t, rd.op, c, s); });
            });
  }
  // all-gather of f32, and of S16 data sent as ncclFloat16.
  ++p;
  Pattern(k, "all_gather_f32", Data(ncclFloat32, 300, p, me, false), 300 * 4 * n,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            Grouped(r, c, [&] { r += A.AllGather(x, y, 300, ncclFloat32, c, s); });
          });
  ++p;
  Pattern(k, "all_gather_s16", Data(ncclFloat16, 256, p, me, true), 256 * 2 * n,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            Grouped(r, c, [&] { r += A.AllGather(x, y, 256, ncclFloat16, c, s); });
          });
  // reduce-scatter: count is per rank.
  for (ncclDataType_t t : {ncclFloat32, ncclBfloat16}) {
    ++p;
    const size_t per = 256;
    Pattern(k, t == ncclFloat32 ? "reduce_scatter_f32" : "reduce_scatter_bf16",
            Data(t, per * n, p, me, false), per * Bytes(t),
            [&](Result& r, const uint8_t* x, uint8_t* y) {
              Grouped(r, c, [&] { r += A.ReduceScatter(x, y, per, t, ncclSum, c, s); });
            });
  }
  // all-to-all as XLA issues it: grouped send and receive per peer.
  for (bool u16 : {false, true}) {
    ++p;
    const ncclDataType_t t = u16 ? ncclFloat16 : ncclFloat32;
    const size_t chunk = 64;
    Pattern(k, u16 ? "all_to_all_u16" : "all_to_all_f32", Data(t, chunk * n, p, me, u16),
            chunk * n * Bytes(t), [&](Result& r, const uint8_t* x, uint8_t* y) {
              int count = 0;
              r += A.Count(c, &count);
              Grouped(r, c, [&] {
                for (int i = 0; i < count; ++i) {
                  r += A.Send(x + i * chunk * Bytes(t), chunk, t, i, c, s);
                  r += A.Recv(y + i * chunk * Bytes(t), chunk, t, i, c, s);
                }
              });
            });
  }
  // collective-permute: a ring of S16 data as ncclFloat16 (receive first, as XLA does).
  ++p;
  Pattern(k, "collective_permute_s16", Data(ncclFloat16, 100, p, me, true), 100 * 2,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            Grouped(r, c, [&] {
              r += A.Recv(y, 100, ncclFloat16, (me + n - 1) % n, c, s);
              r += A.Send(x, 100, ncclFloat16, (me + 1) % n, c, s);
            });
          });
  // collective-permute with one pair (0 -> 1): the other ranks issue nothing.
  ++p;
  Pattern(k, "collective_permute_f32_pair", Data(ncclFloat32, 50, p, me, false), 50 * 4,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            if (me > 1) return;
            Grouped(r, c, [&] {
              if (me == 1) r += A.Recv(y, 50, ncclFloat32, 0, c, s);
              if (me == 0) r += A.Send(x, 50, ncclFloat32, 1, c, s);
            });
          });
  // send / recv thunks: single calls outside a group, each followed by the poll.
  ++p;
  Pattern(k, "send_recv_f32", Data(ncclFloat32, 77, p, me, false), 77 * 4,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            if (me == 0) r += A.Send(x, 77, ncclFloat32, n - 1, c, s);
            if (me == n - 1) r += A.Recv(y, 77, ncclFloat32, 0, c, s);
            if (me == 0 || me == n - 1) r += Poll(c);
          });
  ++p;
  Pattern(k, "broadcast_f32", Data(ncclFloat32, 128, p, me, false), 128 * 4,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            Grouped(r, c, [&] { r += A.Broadcast(x, y, 128, ncclFloat32, 0, c, s); });
          });
  // An all-reduce on the communicator split in pairs.
  ++p;
  Pattern(k, "pair_all_reduce_f32", Data(ncclFloat32, 1000, p, k.device, false), 1000 * 4,
          [&](Result& r, const uint8_t* x, uint8_t* y) {
            if (k.pair == nullptr) return;
            Grouped(r, k.pair,
                    [&] { r += A.AllReduce(x, y, 1000, ncclFloat32, ncclSum, k.pair, s); });
          });
}

void RankMain(int device, const ncclUniqueId& id) {
  Rank k;
  k.device = device;
  cudaSetDevice(device);
  cudaStreamCreate(&k.stream);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = g_blocking;
  cfg.splitShare = 0;
  Result r;
  r += g_api.InitRankConfig(&k.world, g_nranks, id, device, &cfg);
  if (r.r == ncclSuccess) r += Poll(k.world);
  // XLA's clique communicators come from splits of a parent: one with every rank in reverse
  // order (so the clique's rank differs from the device), one in pairs.
  if (r.r == ncclSuccess) r += g_api.Split(k.world, 0, g_nranks - 1 - device, &k.comm, &cfg);
  if (r.r == ncclSuccess) r += Poll(k.comm);
  const int color = g_nranks % 2 == 0 || device < g_nranks - 1 ? device / 2 : NCCL_SPLIT_NOCOLOR;
  if (r.r == ncclSuccess) r += g_api.Split(k.world, color, device, &k.pair, &cfg);
  if (r.r == ncclSuccess && k.pair != nullptr) r += Poll(k.pair);
  {
    std::lock_guard<std::mutex> lk(g_print);
    std::printf("init device %d result %d\n", device, r.r);
  }
  if (r.r != ncclSuccess) return;
  k.rank = g_nranks - 1 - device;
  RunPatterns(k);
  cudaStreamSynchronize(k.stream);
  if (k.pair != nullptr) g_api.Destroy(k.pair);
  g_api.Destroy(k.comm);
  g_api.Destroy(k.world);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: xla_patterns LIBRARY NRANKS BLOCKING OUTDIR\n");
    return 2;
  }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    std::printf("error %s\n", dlerror());
    return 1;
  }
  if (!Load(h, &g_api)) return 1;
  g_nranks = std::atoi(argv[2]);
  g_blocking = std::atoi(argv[3]);
  g_out = argv[4];
  if (g_nranks < 2 || g_nranks > 8) {
    std::printf("error NRANKS must be 2..8\n");
    return 2;
  }
  ncclUniqueId id;
  if (g_api.GetUniqueId(&id) != ncclSuccess) return 1;
  std::vector<std::thread> ranks;
  for (int d = 0; d < g_nranks; ++d) ranks.emplace_back(RankMain, d, std::cref(id));
  for (std::thread& t : ranks) t.join();
  // The emulation's findings: the real library behind the interposer, or LIBRARY itself.
  const char* real = std::getenv("JCOCCL_NCCL_REAL");
  void* emul = real != nullptr ? dlopen(real, RTLD_NOW | RTLD_NOLOAD) : nullptr;
  auto findings = reinterpret_cast<const char* (*)()>(dlsym(emul ? emul : h, "emul_findings"));
  if (findings != nullptr) {
    std::string text = findings();
    size_t at = 0;
    for (size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
      std::printf("finding %s\n", text.substr(at, nl - at).c_str());
  }
  std::printf("done\n");
  std::fflush(stdout);
  return 0;
}
