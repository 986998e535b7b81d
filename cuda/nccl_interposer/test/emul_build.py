"""Build libjcoccl_nccl.so for the CPU: the interposer against the NCCL emulation and the
host shim, with g++ (no CUDA, no GPU), for tests/test_nccl_interposer.py.

Four products, cached under build/nccl_interposer/ by a hash of their inputs:
  libnccl_emul-<key>.so     the "real NCCL": cuda/emul/nccl_emul.h + test/emul_nccl.cc
  libjcoccl_nccl-<key>.so   the interposer (forward.cc, interposer.cc, the codec kernels of
                            cuda/gpu/codecs.cu run on the shim), SONAME libnccl.so.2
  xla_load-<key>            test/xla_load.cc: loads NCCL as XLA's plugin does
  xla_patterns-<key>        test/xla_patterns.cc: XLA's NCCL call sequences on N ranks
The mutant interposer (mutants=True) holds every MUTATIONS entry behind jcn_test_mutation,
and its generated API lacks one forwarded name; each must be caught by the tests.

  python cuda/nccl_interposer/test/emul_build.py      # build and print the paths
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_shim  # noqa: E402

CUDA = ROOT / "cuda"
HERE = CUDA / "nccl_interposer"
OUT = ROOT / "build" / "nccl_interposer"
# Default visibility: the shim's inline variables are shared between the libraries as unique
# symbols (its streams' Runtime, by every object of the process: streams.h FindRuntime).
FLAGS = [
  f
  for f in gpu_shim.FLAGS
  if f not in ("-O2", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
] + ["-O1", "-pthread"]
FLAGS = [f for f in FLAGS if f != "-shared"]

# The forwarded name whose trampoline the mutant's generated API drops (its pointer stays:
# the engine sends through it).
DROPPED = ("JCN_API(ncclSend, R)", "JCN_TAKEN(ncclSend)")
# (file, statement, replacement) edits of copies of the sources, each behind a switch.
MUTATIONS: dict[str, tuple[str, str, str]] = {
  # The lanes no longer wait for the caller's stream: the encode reads inputs not yet written.
  "no_fork_wait": (
    "interposer.cc",
    "for (int l = 0; l < 3 && s.ok(); ++l) s = Wait(set->fork, st, set->lane[l]);",
    "(void)st;",
  ),
  # A failed send returns from inside the engine's ncclGroupStart / ncclGroupEnd.
  "group_left_open": (
    "interposer.cc",
    "    // Closed on every path: a group left open would swallow the caller's next calls.",
    "    if (!st.ok()) return st;",
  ),
  # The seeded bugs below pass unnoticed by the lenient NCCL emulation (cdd5d83) and are
  # caught by the strict one (tests/test_nccl_emul.py).
  # Rank 1 forwards an all-reduce / reduce-scatter with one element more (a padded count).
  "count_padded_on_one_rank": (
    "interposer.cc",
    "  return reinterpret_cast<AllReduceFn>(fn)(a.send, a.recv, a.count, a.type, a.red, a.comm,\n"
    "                                           a.stream);",
    "  Comm* mc = CommOf(a.comm);\n"
    "  const size_t n = a.count + (mc != nullptr && mc->rank == 1 ? 1 : 0);\n"
    "  return reinterpret_cast<AllReduceFn>(fn)(a.send, a.recv, n, a.type, a.red, a.comm, a.stream);",
  ),
  # A nonblocking group's taken calls run at once, on communicators still in progress.
  "in_progress_comm_used": (
    "interposer.cc",
    "    Held().push_back(std::move(g));",
    "    const ncclResult_t x = RunGroup(g, ncclSuccess);\n    return x == ncclSuccess ? r : x;",
  ),
  # The lanes wait on the host for the previous call (a stream synchronize instead of an event
  # wait): right when eager, but a capture cannot hold a host wait and is invalidated.
  "host_wait_for_previous_call": (
    "interposer.cc",
    "  if (s.ok()) s = lanes.Handoff(je::kDecode, je::kEncode);",
    '  if (s.ok()) s = Cuda(cudaStreamSynchronize(set->lane[je::kDecode]), "synchronize");',
  ),
  # Unaligned inputs are no longer staged: the codec kernels' 16-byte loads are misaligned.
  "unaligned_input_not_staged": (
    "interposer.cc",
    "  z.plan.stage_in |= Misaligned(a.send);",
    "  (void)0;",
  ),
  # A nonblocking communicator's ncclInProgress is taken as done: the engine's next NCCL call
  # is issued on a communicator still in progress.
  "in_progress_taken_as_done": (
    "interposer.cc",
    "    // wait before it frees the communicator (CommAbort waits for c_->mu).",
    "    if (r == ncclInProgress) r = ncclSuccess;",
  ),
}
MUTATION_IDS = {name: i + 1 for i, name in enumerate(MUTATIONS)}


class Built(NamedTuple):
  emul: Path
  interposer: Path
  program: Path
  patterns: Path


def _run(cmd: list[str]) -> None:
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stderr[-6000:]}")


def _key(paths: list[Path], extra: str) -> str:
  h = hashlib.sha256(extra.encode())
  for p in sorted(paths):
    h.update(str(p.relative_to(ROOT)).encode())
    h.update(p.read_bytes())
  return h.hexdigest()[:16]


def _atomic(target: Path, build) -> Path:
  """Builds into a per-process temporary and renames: test workers may build at once."""
  if not target.exists():
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    build(tmp)
    tmp.replace(target)
  return target


def _mutated(text: str, mutants: bool) -> str:
  if not mutants:
    return text
  for name, (_, old, new) in MUTATIONS.items():
    if text.count(old) != 1:
      raise RuntimeError(f"mutation {name}: {old!r} must occur once in interposer.cc")
    text = text.replace(
      old, f"if (jcn_test_mutation == {MUTATION_IDS[name]}) {{\n{new}\n}} else {{\n{old}\n}}"
    )
  head = (
    'extern "C" __attribute__((visibility("default"))) int jcn_test_mutation;\n'
    "int jcn_test_mutation = 0;\n"
  )
  return head + text


def build(mutants: bool = False) -> Built:
  """Builds (or reuses) the emulated NCCL, the interposer and the loading test program.

  Args:
    mutants: build the interposer from copies holding the MUTATIONS (off until the
      jcn_test_mutation variable is set) and without the DROPPED forwarder.

  Returns:
    The four paths.

  Example:
    b = build(); subprocess.run([b.program, b.interposer, b.emul])
  """
  cxx = gpu_shim.compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX, or install g++ >= 12 or clang++ >= 15)")
  OUT.mkdir(parents=True, exist_ok=True)
  shim = sorted(gpu_shim.SHIM_DIR.glob("*"))
  emul_inputs = [*shim, *(CUDA / "emul").glob("*"), HERE / "test" / "emul_nccl.cc"]
  codec_inputs = [
    *shim,
    CUDA / "gpu" / "codecs.cu",
    *CUDA.glob("codecs/*.h"),
    gpu_shim.PUBLIC_INCLUDE / "jcoccl" / "codec_plugin.h",
  ]
  own = [HERE / "forward.cc", HERE / "interposer.cc", HERE / "interposer.h", HERE / "nccl_api.inc"]
  engine = [*CUDA.glob("engine/engine*.h"), CUDA / "transport" / "transport.h"]
  base_inc = [str(gpu_shim.SHIM_DIR), str(CUDA / "emul"), str(CUDA), str(gpu_shim.PUBLIC_INCLUDE)]

  k = _key(emul_inputs, f"{cxx} {FLAGS}")
  emul = _atomic(
    OUT / f"libnccl_emul-{k}.so",
    lambda t: _run(
      [
        cxx,
        *FLAGS,
        "-shared",
        *[f"-I{i}" for i in base_inc],
        str(HERE / "test" / "emul_nccl.cc"),
        "-Wl,-soname,libnccl.so.2",
        "-o",
        str(t),
      ]
    ),
  )

  k = _key(codec_inputs, f"{cxx} {FLAGS}")
  codecs_src = OUT / f"codecs-{k}.cc"
  if not codecs_src.exists():
    codecs_src.write_text(gpu_shim.translate((CUDA / "gpu" / "codecs.cu").read_text()))
  codecs_obj = _atomic(
    OUT / f"codecs-{k}.o",
    lambda t: _run(
      [cxx, *FLAGS, "-c", *[f"-I{i}" for i in base_inc], str(codecs_src), "-o", str(t)]
    ),
  )

  tag = "mutants" if mutants else "orig"
  k = _key(
    [*own, *codec_inputs, *engine, *(CUDA / "emul").glob("*")], f"{cxx} {FLAGS} {tag} {MUTATIONS}"
  )
  lib = OUT / f"libjcoccl_nccl-{tag}-{k}.so"
  if not lib.exists():
    src = OUT / f"src-{tag}-{k}" / "nccl_interposer"
    src.mkdir(parents=True, exist_ok=True)
    for p in own:
      text = p.read_text()
      if p.name == "interposer.cc":
        text = _mutated(text, mutants)
      if p.name == "nccl_api.inc" and mutants:
        text = text.replace(*DROPPED)
      (src / p.name).write_text(text)
    _atomic(
      lib,
      lambda t: _run(
        [
          cxx,
          *FLAGS,
          "-shared",
          "-DJCN_HOST_SHIM",
          f"-I{src.parent}",
          *[f"-I{i}" for i in base_inc],
          str(src / "forward.cc"),
          str(src / "interposer.cc"),
          str(codecs_obj),
          "-Wl,-soname,libnccl.so.2",
          "-Wl,-Bsymbolic",
          "-ldl",
          "-o",
          str(t),
        ]
      ),
    )

  prog_src = HERE / "test" / "xla_load.cc"
  k = _key([prog_src, *shim], f"{cxx} {FLAGS}")
  program = _atomic(
    OUT / f"xla_load-{k}",
    lambda t: _run(
      [cxx, *FLAGS, "-rdynamic", *[f"-I{i}" for i in base_inc], str(prog_src), "-ldl", "-o", str(t)]
    ),
  )
  pat_src = HERE / "test" / "xla_patterns.cc"
  k = _key([pat_src, *shim, CUDA / "emul" / "nccl.h"], f"{cxx} {FLAGS}")
  patterns = _atomic(
    OUT / f"xla_patterns-{k}",
    lambda t: _run(
      [cxx, *FLAGS, "-rdynamic", *[f"-I{i}" for i in base_inc], str(pat_src), "-ldl", "-o", str(t)]
    ),
  )
  return Built(emul, lib, program, patterns)


if __name__ == "__main__":
  b = build(mutants="--mutants" in sys.argv)
  print("\n".join(str(p) for p in b))
