#!/usr/bin/env python3
"""Build and drive the test-only CUDA extension: jcoccl's GPU host code on the CPU.

cuda/gpu/*.cu (codec kernels, FFI handlers, fused engine), cuda/transport/nccl.cc and the
engine are compiled unchanged, as one C++ translation unit (cuda/emul/cuda_ext.cc), against
the host shim (cuda/hostshim/: kernels on fibers, streams with worker threads, events) and
an NCCL emulation over threads (cuda/emul/nccl_emul.h), to which the transport's
dlopen("libnccl.so.2") is redirected (a real NCCL in the same process is never used).

:class:`CudaExt` loads the library and registers its handlers as XLA:CPU FFI targets (each
behind the adaptor of cuda/emul/xla_adaptor.h) under "cudaext_" + the CUDA target name;
:func:`use` points jcoccl at them: backend "xla" then runs the CUDA codec handlers, and
backend "fused" runs the CUDA fused engine over emulated NCCL communicators.

  python tools/cuda_ext.py build [--mutants]    # build (cached in build/cuda_ext)

tools/cuda_ext_check.py runs the scenarios, the seeded bugs and the CI check over it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_shim

ROOT = gpu_shim.ROOT
CUDA = ROOT / "cuda"
EMUL = CUDA / "emul"
PREFIX = "cudaext_"

# Deliberate host-side defects, each a (file, statement, replacement) edit of a copy of the
# sources; the mutant library holds them all behind jce_set_mutation. Each must be caught.
_JOIN = """  for (int l = 0; l < 3; ++l) {
    Status j = StreamWait(ds, l, ds->s[l], xla);
    if (s.ok()) s = j;
  }"""
MUTATIONS: dict[str, tuple[str, str, str]] = {
  # The comm -> decode handoff is dropped: decode reads payloads before they arrive.
  "no_stream_wait": (
    "cuda/gpu/fused.cu",
    "if (from == to) return Status::Ok();",
    "if (from == to || to == kDecode) return Status::Ok();",
  ),
  # One event serves every lane's join and is recorded again before XLA's stream waits.
  "event_reuse": (
    "cuda/gpu/fused.cu",
    _JOIN,
    """  for (int l = 0; l < 3; ++l) (void)cudaEventRecord(ds->ev[0], ds->s[l]);
  {
    Status j = Cuda(cudaStreamWaitEvent(xla, ds->ev[0], 0), "stream wait");
    if (s.ok()) s = j;
  }""",
  ),
  # The lanes are joined into XLA's stream only when the collective succeeded.
  "no_join_on_error": (
    "cuda/gpu/fused.cu",
    _JOIN,
    """  for (int l = 0; l < 3 && s.ok(); ++l) {
    Status j2 = StreamWait(ds, l, ds->s[l], xla);
    if (s.ok()) s = j2;
  }""",
  ),
  # The workspace is sized one byte short (and the engine's check uses the same size).
  "workspace_short": (
    "cuda/engine/engine_impl.h",
    "return r.arena.used();",
    "return r.arena.used() - 1;",
  ),
  # The handler waits on the host until its collective has finished (what it did before
  # the watchdog): the return gate's held NCCL work then outlives the handler's call.
  "host_wait": (
    "cuda/gpu/fused.cu",
    "if (s.ok()) s = w;",
    'if (s.ok()) s = w;\n    if (s.ok()) s = Cuda(cudaStreamSynchronize(xla), "synchronize");',
  ),
  # A failed send returns from inside ncclGroupStart / ncclGroupEnd.
  "group_unbalanced": (
    "cuda/transport/nccl.cc",
    'if (st.ok() && src >= 0) st = Check(api->Recv(recv, bytes, ncclUint8, src, comm_, s), "ncclRecv");',
    'if (st.ok() && src >= 0) st = Check(api->Recv(recv, bytes, ncclUint8, src, comm_, s), "ncclRecv");'
    " if (!st.ok()) return st;",
  ),
}
MUTATION_IDS = {name: i + 1 for i, name in enumerate(MUTATIONS)}
FLAGS = [f for f in gpu_shim.FLAGS if f != "-O2"] + ["-O1", "-pthread"]


def _sources() -> dict[str, Path]:
  return {
    "cuda/gpu/codecs.cu": CUDA / "gpu" / "codecs.cu",
    "cuda/gpu/fused.cu": CUDA / "gpu" / "fused.cu",
    "cuda/transport/nccl.cc": CUDA / "transport" / "nccl.cc",
    "cuda/engine/engine.h": CUDA / "engine" / "engine.h",
    "cuda/engine/engine_impl.h": CUDA / "engine" / "engine_impl.h",
  }


def _switched(text: dict[str, str]) -> dict[str, str]:
  """Every mutation behind `if (g_mutation == id)`, in copies of the sources."""
  for name, (path, old, new) in MUTATIONS.items():
    if text[path].count(old) != 1:
      raise RuntimeError(f"mutation {name}: {old!r} must occur once in {path}")
    text[path] = text[path].replace(
      old,
      f"if (::jcoccl_shim::g_mutation == {MUTATION_IDS[name]}) {{\n{new}\n}} else {{\n{old}\n}}",
    )
  return text


def _compile(cxx: str, sources: list[str], includes: list[str], out: Path, defines: list[str]):
  cmd = [
    cxx,
    *FLAGS,
    *[f"-I{i}" for i in includes],
    *[f"-D{d}" for d in defines],
    *sources,
    "-o",
    str(out),
  ]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stderr[-6000:]}")


def build(out_dir: Path | None = None, mutants: bool = False) -> Path:
  """Builds (or reuses) the test-only CUDA extension.

  Args:
    out_dir: cache directory (default build/cuda_ext); rebuilt only when an input changed.
    mutants: build from copies holding every MUTATIONS entry (off until jce_set_mutation).
  Returns:
    The library's path.

  Example:
    lib = build()
  """
  cxx = gpu_shim.compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX, or install g++ >= 12 or clang++ >= 15)")
  out_dir = (out_dir or ROOT / "build" / "cuda_ext").resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  inputs = sorted(
    {
      *CUDA.glob("codecs/*.h"),
      *CUDA.glob("engine/*.h"),
      *CUDA.glob("transport/*"),
      *CUDA.glob("gpu/*"),
      *gpu_shim.SHIM_DIR.glob("*"),
      *EMUL.glob("*"),
      CUDA / "registry.h",
      gpu_shim.PUBLIC_INCLUDE / "jcoccl" / "codec_plugin.h",
    }
  )
  tag = "mutants" if mutants else "orig"
  key = gpu_shim._digest(inputs, f"{cxx} {FLAGS} {tag} {sorted(MUTATIONS.items())}")
  lib = out_dir / f"libcudaext-{tag}-{key}.so"
  if lib.exists():
    return lib
  src = out_dir / f"src-{tag}-{key}"
  (src / "engine").mkdir(parents=True, exist_ok=True)
  text = {k: p.read_text() for k, p in _sources().items()}
  if mutants:
    text = _switched(text)
  paths = {
    "cuda/gpu/codecs.cu": src / "gpu_codecs_shim.cc",
    "cuda/gpu/fused.cu": src / "gpu_fused.cc",
    "cuda/transport/nccl.cc": src / "transport_nccl.cc",
    # Found before cuda/engine/ by "engine/engine.h" (src is first on the include path).
    "cuda/engine/engine.h": src / "engine" / "engine.h",
    "cuda/engine/engine_impl.h": src / "engine" / "engine_impl.h",
  }
  text["cuda/gpu/codecs.cu"] = gpu_shim.translate(text["cuda/gpu/codecs.cu"])
  for k, p in paths.items():
    p.write_text(text[k])
  tmp = lib.with_suffix(f".{os.getpid()}.tmp")
  _compile(
    cxx,
    [str(EMUL / "cuda_ext.cc")],
    [
      str(src),
      str(gpu_shim.SHIM_DIR),
      str(EMUL),
      str(CUDA),
      str(gpu_shim.PUBLIC_INCLUDE),
      gpu_shim.xla_include(),
    ],
    tmp,
    [
      f'JCOCCL_EXT_CODECS="{paths["cuda/gpu/codecs.cu"]}"',
      f'JCOCCL_EXT_FUSED="{paths["cuda/gpu/fused.cu"]}"',
      f'JCOCCL_EXT_NCCL="{paths["cuda/transport/nccl.cc"]}"',
    ],
  )
  tmp.replace(lib)  # a per-process temporary: test workers may build at once
  return lib


# ---- the library -----------------------------------------------------------------------------

# jcoccl_shim::WorkKind bits (cuda/hostshim/cuda_runtime.h), for set_delay.
KERNELS, COPIES, COLLECTIVES, XLA_INPUTS = 1, 2, 4, 8


class CudaExt:
  """The loaded test-only extension: jcoccl._cuda's functions, over ctypes, plus the controls.

  Example:
    ext = CudaExt(build()); ext.register()
  """

  def __init__(self, path: Path):
    self.lib = ctypes.CDLL(str(path))
    c, i32, i64, vp = ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    ip = ctypes.POINTER(ctypes.c_int)
    lib = self.lib
    lib.jce_handlers.argtypes = [ctypes.POINTER(c), ctypes.POINTER(vp), i32]
    lib.jce_set_delay.argtypes = [ctypes.c_uint, i32]
    lib.jce_set_mutation.argtypes = [i32]
    lib.jce_nccl_inject.argtypes = [c, i32]
    lib.jce_nccl_unique_id.argtypes = [ctypes.c_char_p]
    lib.jce_nccl_unique_id.restype = c
    lib.jce_nccl_comm_init.argtypes = [i64, c, i32, i32, ip, ip]
    lib.jce_nccl_comm_init.restype = c
    lib.jce_comm_destroy.argtypes = [i64]
    lib.jce_workspace_bytes.argtypes = [i32, i64, i64, i32, i32, c, c, i32]
    lib.jce_workspace_bytes.restype = i64
    lib.jce_findings.restype = c
    lib.jce_nccl_gate.argtypes = [i32, i32]
    lib.jce_set_capturing.argtypes = [i32, i32]
    self.registered = False

  def handlers(self) -> dict[str, int]:
    """CUDA target name -> address of its adaptor entry point."""
    n = self.lib.jce_handlers(None, None, 0)
    names = (ctypes.c_char_p * n)()
    fns = (ctypes.c_void_p * n)()
    self.lib.jce_handlers(names, fns, n)
    return {names[i].decode(): int(fns[i]) for i in range(n)}

  def register(self) -> None:
    """Registers every handler as an XLA:CPU FFI target named PREFIX + its CUDA name."""
    import jax

    if self.registered:
      return
    proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    for name, addr in self.handlers().items():
      jax.ffi.register_ffi_target(PREFIX + name, jax.ffi.pycapsule(proto(addr)), platform="cpu")
    self.registered = True

  # -- as jcoccl._cuda
  def nccl_unique_id(self) -> bytes:
    buf = ctypes.create_string_buffer(128)
    err = self.lib.jce_nccl_unique_id(buf)
    if err is not None:
      raise RuntimeError(err.decode())
    return buf.raw

  def nccl_comm_init(self, comm: int, uid: bytes, nranks: int, members: list) -> None:
    n = len(members)
    devs = (ctypes.c_int * n)(*[d for d, _ in members])
    ranks = (ctypes.c_int * n)(*[r for _, r in members])
    err = self.lib.jce_nccl_comm_init(comm, uid, nranks, n, devs, ranks)
    if err is not None:
      raise RuntimeError(err.decode())

  def fused_comm_destroy(self, comm: int) -> int:
    return int(self.lib.jce_comm_destroy(comm))

  def fused_workspace_bytes(self, op, k, m, size, outer_size, codec, outer, dtype) -> int:
    from jcoccl._src.compressors import native

    # The descriptors in their C form, the text that codecs/descriptor.h SpecFromText reads.
    c, oc = (native.codec_text(d or native.identity_attrs()).encode() for d in (codec, outer))
    got = int(self.lib.jce_workspace_bytes(op, k, m, size, outer_size, c, oc, dtype))
    if got < 0:
      raise ValueError(f"jce_workspace_bytes: no codec in {c!r} or {oc!r}")
    return got

  # -- controls
  def set_delay(self, kinds: int, us: int) -> None:
    """Queued work of ``kinds`` (KERNELS | COPIES | COLLECTIVES | XLA_INPUTS) sleeps ``us``."""
    self.lib.jce_set_delay(kinds, us)

  def set_mutation(self, name: str | None) -> None:
    self.lib.jce_set_mutation(MUTATION_IDS[name] if name else 0)

  def inject(self, op: str, count: int) -> None:
    """The next ``count`` calls of NCCL entry point ``op`` (e.g. "ncclSend") fail."""
    if not self.lib.jce_nccl_inject(op.encode(), count):
      raise ValueError(f"op must be an emulated NCCL entry point, got {op!r}")

  def gate(self, on: bool, timeout_ms: int = 3000) -> int:
    """Return gate of the NCCL emulation: while on, NCCL work a fused handler queues runs
    only once that handler has returned (a handler still in its call after ``timeout_ms``
    is reported as a finding). Returns how many operations passed it since last set."""
    return int(self.lib.jce_nccl_gate(int(on), timeout_ms))

  def set_capturing(self, device: int, on: bool) -> None:
    """XLA's stream of ``device`` reports a CUDA graph capture under way (or not)."""
    self.lib.jce_set_capturing(device, int(on))

  def nccl_version(self) -> int:
    return int(self.lib.jce_nccl_version())

  def findings(self) -> list[str]:
    return [f for f in self.lib.jce_findings().decode().split("\n") if f]


class _SizingModule:
  """jcoccl._cpu with the workspace sized by the CUDA extension's engine, as on a GPU."""

  def __init__(self, cpu: Any, ext: CudaExt):
    self._cpu, self._ext = cpu, ext

  def fused_workspace_bytes(self, *args) -> int:
    return self._ext.fused_workspace_bytes(*args)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._cpu, name)


@contextlib.contextmanager
def use(ext: CudaExt) -> Iterator[CudaExt]:
  """Within the block jcoccl runs on CPU devices through the CUDA extension: backend "xla"
  calls the CUDA codec handlers, and jcoccl.init creates emulated NCCL communicators that
  backend "fused" runs the CUDA fused engine over. Call jcoccl.init inside the block.

  Example:
    with use(ext):
      jcoccl.init(mesh); y = program(x); jcoccl.shutdown()
  """
  from jcoccl._src.compressors import native
  from jcoccl._src.engine import fused_comms, fused_ffi
  from jcoccl._src.native import _ffi

  ext.register()
  saved = (
    dict(native._TARGETS),
    dict(fused_ffi._TARGET),
    _ffi.has_target,
    _ffi.require_module,
    fused_comms._create_host,
    fused_comms._destroy,
  )
  require, has = _ffi.require_module, _ffi.has_target
  native._TARGETS.update({k: PREFIX + v for k, v in saved[0].items()})
  fused_ffi._TARGET.update({k: PREFIX + v for k, v in saved[1].items()})
  _ffi.has_target = lambda name, platform: name.startswith(PREFIX) or has(name, platform)
  _ffi.require_module = lambda p: ext if p == "cuda" else _SizingModule(require(p), ext)
  fused_comms._create_host = lambda cid, groups: fused_comms._create_nccl(cid, groups, 0)
  fused_comms._destroy = lambda platform, cid: ext.fused_comm_destroy(cid)
  try:
    yield ext
  finally:
    fused_comms.shutdown()
    native._TARGETS.clear()
    native._TARGETS.update(saved[0])
    fused_ffi._TARGET.clear()
    fused_ffi._TARGET.update(saved[1])
    _ffi.has_target, _ffi.require_module = saved[2], saved[3]
    fused_comms._create_host, fused_comms._destroy = saved[4], saved[5]
    ext.set_delay(0, 0)
    ext.gate(False)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  b = sub.add_parser("build", help="build the library (the mutant one with --mutants)")
  b.add_argument("--mutants", action="store_true")
  args = p.parse_args(argv)
  print(build(mutants=args.mutants))
  return 0


if __name__ == "__main__":
  sys.exit(main())
