#!/usr/bin/env python3
"""Does XLA hand an FFI handler its own communicator? (the FFI collectives extension)

Builds a probe handler (C++, against jaxlib's XLA FFI headers), registers it for the
prepare and execute stages on the given platform, and calls it inside shard_map over every
device. The handler looks up the collectives extension (XLA_FFI_InvokeContext_FindExtension,
id 129), requests a communicator for one replica group of every device in its prepare stage
and gets it when it executes; on a non-null handle it asks NCCL for the communicator's size
(ncclCommCount, looked up in the process). One JSON line per call, then a VERDICT.

  python tools/xla_comm_probe.py --platform cpu     # jaxlib 0.11.2: no extension on XLA:CPU
  python tools/xla_comm_probe.py --platform cuda    # the GPU question (tools/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_shim

_PROBE = r"""
#include <dlfcn.h>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/collectives_c_api.h"
static std::mutex mu;
static std::string log_text;
static void Log(const std::string& s) { std::lock_guard<std::mutex> lk(mu); log_text += s; }
static std::string Text(const XLA_FFI_Api* api, XLA_FFI_Error* e) {
  if (e == nullptr) return "ok";
  XLA_FFI_Error_GetDetails_Args d{XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE, nullptr, e,
                                  nullptr, XLA_FFI_Error_Code_OK};
  api->XLA_FFI_Error_GetDetails(&d);
  return std::string("error: ") + (d.message ? d.message : "?");
}
static int g_ndev = 1;
extern "C" __attribute__((visibility("default"))) void probe_set_devices(int n) { g_ndev = n; }
extern "C" __attribute__((visibility("default"))) const char* probe_log() {
  return log_text.c_str();
}
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* Probe(XLA_FFI_CallFrame* f) {
  if (f->extension_start != nullptr) {  // metadata query: the API version built against
    auto* m = reinterpret_cast<XLA_FFI_Metadata_Extension*>(f->extension_start);
    m->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    m->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    return nullptr;
  }
  const XLA_FFI_Api* api = f->api;
  std::string rec = "{\"stage\": " + std::to_string(int(f->stage));
  XLA_FFI_InvokeContext_FindExtension_Args a{
      XLA_FFI_InvokeContext_FindExtension_Args_STRUCT_SIZE, nullptr, f->ctx,
      XLA_FFI_Extension_Collectives, nullptr};
  std::string found = Text(api, api->XLA_FFI_InvokeContext_FindExtension(&a));
  auto* ext = reinterpret_cast<const XLA_FFI_Collectives_Extension*>(a.extension);
  rec += ", \"find\": \"" + found + "\", \"extension\": " + (ext ? "true" : "false");
  std::vector<int64_t> ids;
  for (int i = 0; i < g_ndev; ++i) ids.push_back(i);
  XLA_FFI_ReplicaGroup g{ids.data(), ids.size()};
  if (ext != nullptr && f->stage == XLA_FFI_ExecutionStage_PREPARE) {
    XLA_FFI_Communicator_Request_Args r{XLA_FFI_Communicator_Request_Args_STRUCT_SIZE, nullptr,
                                        XLA_FFI_GROUP_FLATTENED_ID, &g, 1, 0};
    rec += ", \"request\": \"" + Text(api, ext->request_communicator(ext, &r)) + "\"";
  } else if (ext != nullptr && f->stage == XLA_FFI_ExecutionStage_EXECUTE) {
    XLA_FFI_Communicator_Get_Args r{XLA_FFI_Communicator_Get_Args_STRUCT_SIZE, nullptr,
                                    XLA_FFI_GROUP_FLATTENED_ID, &g, 1, 0, nullptr};
    rec += ", \"get\": \"" + Text(api, ext->get_communicator(ext, &r)) + "\"";
    rec += std::string(", \"communicator\": ") + (r.communicator ? "true" : "false");
    using CountFn = int (*)(void*, int*);
    auto count = reinterpret_cast<CountFn>(dlsym(RTLD_DEFAULT, "ncclCommCount"));
    int n = -1;
    if (r.communicator != nullptr && count != nullptr && count(r.communicator, &n) == 0)
      rec += ", \"nccl_count\": " + std::to_string(n);
  }
  for (char& c : rec) if (c == '\n') c = ' ';
  Log(rec + "}\n");
  return nullptr;
}
"""


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--platform", choices=["cpu", "cuda"], default="cpu")
  p.add_argument("--out", type=Path, default=None, help="write the findings as JSON")
  args = p.parse_args(argv)
  if args.platform == "cpu":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp

  cxx = gpu_shim.compiler()
  if cxx is None:
    raise SystemExit("no C++ compiler (set CXX)")
  tmp = Path(tempfile.mkdtemp(prefix="xla_comm_probe_"))
  (tmp / "probe.cc").write_text(_PROBE)
  gpu_shim._compile(cxx, [str(tmp / "probe.cc")], [gpu_shim.xla_include()], tmp / "probe.so")
  lib = ctypes.CDLL(str(tmp / "probe.so"))
  lib.probe_log.restype = ctypes.c_char_p
  devs = jax.devices()
  lib.probe_set_devices(len(devs))
  fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(lib.Probe, ctypes.c_void_p).value
  )
  cap = jax.ffi.pycapsule(fn)
  plat = "CUDA" if args.platform == "cuda" else "cpu"
  jax.ffi.register_ffi_target(
    "jcoccl_xla_comm_probe", {"prepare": cap, "execute": cap}, platform=plat
  )
  mesh = jax.make_mesh((len(devs),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

  def body(v):
    return jax.ffi.ffi_call(
      "jcoccl_xla_comm_probe", jax.ShapeDtypeStruct(v.shape, v.dtype), has_side_effect=True
    )(v)

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"), check_vma=False)
  )
  x = jax.device_put(jnp.ones((len(devs), 4)), jax.NamedSharding(mesh, jax.P("x")))
  error = None
  try:
    jax.block_until_ready(f(x))
  except Exception as e:  # the probe reports, it does not judge
    error = str(e)[:500]
  calls = [json.loads(line) for line in lib.probe_log().decode().splitlines()]
  result = {
    "platform": args.platform,
    "jax": jax.__version__,
    "devices": len(devs),
    "calls": calls,
    "error": error,
    "stages_seen": sorted({c["stage"] for c in calls}),
    "extension": any(c["extension"] for c in calls),
    "communicator": any(c.get("communicator") for c in calls),
  }
  if args.out is not None:
    args.out.write_text(json.dumps(result, indent=1))
  print(json.dumps(result, indent=1))
  print(
    f"VERDICT xla_comm ({args.platform}): collectives extension "
    f"{'present' if result['extension'] else 'absent'}, communicator "
    f"{'returned' if result['communicator'] else 'not returned'}, stages {result['stages_seen']}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
