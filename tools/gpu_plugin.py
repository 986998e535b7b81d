#!/usr/bin/env python3
"""The example codec plugin (examples/custom_codecs/sign) on a device: build it with CMake
against this installation (with its CUDA kernels on a GPU), load it, and compare its four
row operations, run natively on the default backend, with the jnp specification run on the
CPU, bit for bit (XLA:GPU's division is not IEEE, so jnp on the GPU is no reference).

  python tools/gpu_plugin.py --out plugin.json              # on the GPU machine
  python tools/gpu_plugin.py --platform cpu --out plugin.json   # CPU dry run
  python tools/gpu_plugin.py --platform cpu --quick             # one block size and dtype

The last line printed is `VERDICT plugin: PASS|FAIL (...)`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_codecs" / "sign"
OPS = ("encode", "decode_rows", "decode_sum", "decode_sum_encode")


def build(build_dir: Path, cuda: bool) -> Path:
  """Configures and builds the example as its README says; returns the library."""
  import jcoccl

  for cmd in (
    ["cmake", "-S", str(EXAMPLE), "-B", str(build_dir), f"-Djcoccl_DIR={jcoccl.get_cmake_dir()}",
     "-DCMAKE_BUILD_TYPE=Release", f"-DSIGN_CUDA={'ON' if cuda else 'OFF'}"],
    ["cmake", "--build", str(build_dir)],
  ):  # fmt: skip
    subprocess.run(cmd, check=True)
  return build_dir / "libjcoccl_sign.so"


def compare(block: int, dtype: str, rows: int, n: int) -> tuple[list[str], list[str]]:
  """Runs the row ops natively and as jnp on the CPU; (every case, the cases that differ)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import sign_codec

  c = sign_codec.SignCompressor(block=block)
  rng = np.random.default_rng(block)
  x = rng.standard_normal((rows, n)).astype(np.float32)
  x[0, 3], x[-1, -1] = np.nan, np.inf
  x = np.asarray(jnp.asarray(x, dtype))
  cpu = jax.devices("cpu")[0]

  def run(impl: str, op: str, arg: np.ndarray) -> np.ndarray:
    if op == "encode":
      fn = lambda a: c.encode_rows(a, impl=impl)
    else:
      fn = lambda a: getattr(c, op)(a, n, dtype, impl=impl)
    if impl == "jnp":
      with jax.default_device(cpu):
        return np.asarray(jax.jit(fn)(jax.device_put(arg, cpu)))
    return np.asarray(jax.jit(fn)(arg))

  cases, bad = [], []
  buf = run("jnp", "encode", x)
  for op in OPS:
    arg = x if op == "encode" else buf
    a, b = run("native", op, arg), run("jnp", op, arg)
    cases.append(f"sign1 block={block} {dtype} {op}")
    if a.view(np.uint8).tobytes() != b.view(np.uint8).tobytes():
      bad.append(cases[-1])
  return cases, bad


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
  ap.add_argument("--build-dir", default=str(ROOT / "build" / "gpu_plugin"))
  ap.add_argument("--out", default=None)
  ap.add_argument(
    "--quick",
    action="store_true",
    help="one block size and dtype (CI's dry run; tests/test_plugin.py compares them all)",
  )
  args = ap.parse_args(argv)
  t0 = time.time()
  result: dict = {"platform": args.platform}
  try:
    lib = build(Path(args.build_dir), cuda=args.platform == "gpu")
    sys.path.insert(0, str(EXAMPLE))
    import jax
    import sign_codec

    import jcoccl.compressors as jc

    plugin = jc.load_plugin(lib, spec=sign_codec.SignCompressor)
    result.update(backend=jax.default_backend(), has_cuda=plugin.has_cuda)
    cases, bad = [], []
    for block in (32,) if args.quick else (32, 1024):
      for dtype in ("float32",) if args.quick else ("float32", "bfloat16", "float16"):
        c, b = compare(block, dtype, rows=4, n=1 << 16)
        cases, bad = cases + c, bad + b
    result.update(cases=cases, mismatches=bad)
    verdict = "PASS" if not bad else "FAIL"
  except Exception as e:  # the verdict line must come whatever failed
    result["error"] = f"{type(e).__name__}: {e}"
    verdict = "FAIL"
  result["seconds"] = round(time.time() - t0, 1)
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
  print(json.dumps(result))
  print(f"VERDICT plugin: {verdict} ({len(result.get('cases', []))} cases, "
        f"{len(result.get('mismatches', []))} mismatches{', ' + result['error'] if 'error' in result else ''})")  # fmt: skip
  return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
  sys.exit(main())
