// Loads NCCL the way jax-cuda13-pjrt does, and checks that libjcoccl_nccl.so answers:
//   1. (mode "enable") dlopen the interposer by path, RTLD_LOCAL, as jcoccl.nccl.enable does
//      (mode "preload": LD_PRELOAD already loaded it, as python -m jcoccl.nccl does);
//   2. preload the real libnccl.so.2 by path with RTLD_GLOBAL (the plugin's __init__.py
//      preloads the nvidia-nccl wheel's copy);
//   3. dlopen("libnccl.so.2") by name and dlsym every name of `names` (the plugin's strings),
//      as xla_cuda_plugin.so does: each must resolve inside the interposer;
//   4. call through those pointers: ncclGetVersion is forwarded (the emulation's 99999), and a
//      2-rank ncclAllReduce and pncclAllReduce of float32 run (taken over if the policy says),
//      the first also inside ncclGroupStart / ncclGroupEnd, as XLA issues it.
// Prints one "key value" line per fact; the test reads them.
//
//   xla_load MODE INTERPOSER REAL NAMES_FILE
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "nccl.h"

namespace {

std::string Canonical(const char* p) {
  char buf[PATH_MAX];
  return realpath(p, buf) ? std::string(buf) : std::string(p);
}

using AllReduceFn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t);

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: xla_load enable|preload INTERPOSER REAL NAMES_FILE\n");
    return 2;
  }
  const std::string mode = argv[1], interposer = Canonical(argv[2]);
  if (mode == "enable" && dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::printf("error %s\n", dlerror());
    return 1;
  }
  if (dlopen(argv[3], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::printf("error %s\n", dlerror());
    return 1;
  }
  void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    std::printf("error %s\n", dlerror());
    return 1;
  }
  std::ifstream names(argv[4]);
  std::string name;
  int checked = 0;
  while (std::getline(names, name)) {
    if (name.empty() || name[0] == '#') continue;
    ++checked;
    void* f = dlsym(h, name.c_str());
    Dl_info info;
    if (f == nullptr) {
      std::printf("missing %s\n", name.c_str());
    } else if (dladdr(f, &info) == 0 || Canonical(info.dli_fname) != interposer) {
      std::printf("elsewhere %s %s\n", name.c_str(), info.dli_fname ? info.dli_fname : "?");
    }
  }
  std::printf("checked %d\n", checked);

  auto version = reinterpret_cast<ncclResult_t (*)(int*)>(dlsym(h, "pncclGetVersion"));
  int v = 0;
  if (version != nullptr) version(&v);
  std::printf("version %d\n", v);

  // Two ranks on devices 0 and 1, one stream each, as XLA gives every device its own.
  auto uid = reinterpret_cast<ncclResult_t (*)(ncclUniqueId*)>(dlsym(h, "ncclGetUniqueId"));
  auto init = reinterpret_cast<ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int)>(
      dlsym(h, "ncclCommInitRank"));
  auto group_start = reinterpret_cast<ncclResult_t (*)()>(dlsym(h, "ncclGroupStart"));
  auto group_end = reinterpret_cast<ncclResult_t (*)()>(dlsym(h, "ncclGroupEnd"));
  // The last as XLA issues it: ncclGroupStart, the collective, ncclGroupEnd (RunAllReduce).
  const char* fns[3] = {"ncclAllReduce", "pncclAllReduce", "grouped_ncclAllReduce"};
  if (!uid || !init || !group_start || !group_end) {
    std::printf("error entry points missing\n");
    return 1;
  }
  ncclUniqueId id;
  uid(&id);
  ncclComm_t comms[2];
  cudaStream_t streams[2];
  group_start();
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    init(&comms[r], 2, id, r);
    cudaStreamCreate(&streams[r]);
  }
  group_end();
  const size_t n = 1000;
  for (const char* fn_name : fns) {
    const bool grouped = std::strncmp(fn_name, "grouped_", 8) == 0;
    auto fn = reinterpret_cast<AllReduceFn>(dlsym(h, grouped ? fn_name + 8 : fn_name));
    std::vector<float> x[2], y[2];
    for (int r = 0; r < 2; ++r) {
      x[r].resize(n);
      y[r].assign(n, 0.0f);
      for (size_t i = 0; i < n; ++i) x[r][i] = std::sin(0.01f * i + r) * (r + 1);
    }
    ncclResult_t res[2];
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      if (grouped) group_start();
      res[r] = fn(x[r].data(), y[r].data(), n, ncclFloat32, ncclSum, comms[r], streams[r]);
      if (grouped && res[r] == ncclSuccess) res[r] = group_end();
    }
    for (int r = 0; r < 2; ++r) cudaStreamSynchronize(streams[r]);
    double err = 0;
    bool same = true;
    for (size_t i = 0; i < n; ++i) {
      err = std::fmax(err, std::fabs(y[0][i] - (x[0][i] + x[1][i])));
      same = same && std::memcmp(&y[0][i], &y[1][i], 4) == 0;
    }
    std::printf("%s result %d %d maxerr %g ranks_identical %d\n", fn_name, res[0], res[1], err,
                same ? 1 : 0);
  }
  auto counters = reinterpret_cast<const char* (*)()>(dlsym(h, "jcoccl_nccl_counters"));
  if (counters != nullptr) std::printf("%s", counters());
  std::fflush(stdout);
  return 0;
}
