#!/usr/bin/env python3
"""GPU check of the CUDA codecs: bit-exactness against the jnp specification, then throughput.

Run on a machine with a CUDA GPU after building jcoccl (tools/dev_build.sh, or
`pip install --no-build-isolation --no-deps -e .`):

  python tools/gpu_codecs.py --out gpu_codecs.json

(1) Every codec family x dtype: the CUDA payloads, decodes, decode_sum and decode_sum_encode
    are compared bit for bit with impl="jnp" on the same GPU. Exits 1 on any mismatch.
(2) encode/decode time for int8, int4, fp8 and hadamard(int4) at 256 MiB and 1 GiB of
    float32 input, against a device-to-device copy of the same input (x + 0 in a jit).
    GB/s counts bytes read + written; `vs_copy` = codec GB/s / copy GB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=None, help="write the results as JSON to this path")
  p.add_argument("--sizes-mib", default="256,1024", help="input sizes in MiB (comma separated)")
  p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
  p.add_argument("--skip-bench", action="store_true", help="only run the bit-exact checks")
  return p.parse_args()


def _codecs(jc, jnp):
  return [
      jc.cast(jnp.bfloat16), jc.cast(jnp.float16), jc.none(),
      jc.int8(block_size=32), jc.int8(block_size=256), jc.int8(block_size=4096),
      jc.int8(block_size=64, symmetric=False), jc.int4(block_size=128),
      jc.int4(block_size=32, symmetric=False), jc.int2(block_size=256),
      jc.int2(block_size=64, symmetric=False),
      jc.fp8("e4m3", block_size=32), jc.fp8("e4m3", block_size=512), jc.fp8("e5m2", block_size=128),
      jc.hadamard(jc.int4(block_size=128), size=256), jc.hadamard(jc.int8(block_size=64), size=4096),
      jc.hadamard(jc.fp8("e4m3", block_size=128), size=64),
      jc.error_bounded(1e-2, block_size=64), jc.error_bounded(1e-4, block_size=1024),
  ]


def _bits(a):
  import numpy as np
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _data(rows: int, n: int, seed: int):
  import numpy as np
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, n)).astype(np.float32) * np.float32(3.0)
  x[rng.random((rows, n)) < 0.01] *= np.float32(1e4)
  runs = x.reshape(rows, n // 32, 32)
  kind = rng.integers(0, 8, size=runs.shape[:2])
  runs[kind == 0] = 0.0
  runs[kind == 1] = 1.25
  runs[kind == 2] *= np.float32(1e-39)
  runs[kind == 5] = -0.0
  runs[kind == 6] *= np.float32(1e-3)
  runs[0, 1, 5] = np.nan
  runs[1, 2, 7] = -np.inf
  return x


def check(jax, jnp, jc) -> list[str]:
  """Bit-exact comparison of every CUDA codec with the jnp spec; returns mismatch messages."""
  import numpy as np
  from jcoccl._src.compressors import native
  bad = []
  for c in _codecs(jc, jnp):
    n = max(c.granule, 512) * 2
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      if not all(native.available(c, op, dtype)
                 for op in ("encode", "decode", "decode_sum", "decode_sum_encode")):
        bad.append(f"{c} {jnp.dtype(dtype).name}: no CUDA kernel available")
        continue
      x = jnp.asarray(_data(8, n, seed=n)).astype(dtype)

      def ops(impl, buf_ref, x=x, c=c, n=n, dtype=dtype):
        buf = c.encode_rows(x, impl=impl)
        return (buf, c.decode_rows(buf_ref, n, dtype, impl=impl),
                c.decode_sum(buf_ref[:5], n, dtype, impl=impl),
                c.decode_sum_encode(buf_ref, n, dtype, impl=impl))

      ref = jax.jit(lambda: ops("jnp", c.encode_rows(x, impl="jnp")))()
      got = jax.jit(lambda b: ops("native", b))(ref[0])
      for what, a, b in zip(("encode", "decode", "decode_sum", "decode_sum_encode"), ref, got):
        ba, bb = _bits(a), _bits(b)
        if ba.shape != bb.shape or (ba != bb).any():
          idx = np.argwhere(ba != bb) if ba.shape == bb.shape else []
          bad.append(f"{c} {jnp.dtype(dtype).name} {what}: {len(idx)} mismatching elements, "
                     f"first {idx[:3].tolist() if len(idx) else 'shape ' + str((ba.shape, bb.shape))}")
  return bad


def _time(fn, *args, iters: int) -> float:
  out = fn(*args)
  out.block_until_ready() if hasattr(out, "block_until_ready") else None
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax_ready(out)
  return (time.perf_counter() - t0) / iters


def jax_ready(out) -> None:
  import jax
  jax.block_until_ready(out)


def bench(jax, jnp, jc, sizes_mib: list[int], iters: int) -> list[dict]:
  rows = []
  for mib in sizes_mib:
    n_total = mib * 2**20 // 4
    ncols = 2**20
    x = jax.random.normal(jax.random.key(0), (n_total // ncols, ncols), jnp.float32)
    copy = jax.jit(lambda v: v + 0.0)
    t_copy = _time(copy, x, iters=iters)
    copy_gbs = 2 * x.nbytes / t_copy / 1e9
    rows.append({"codec": "copy", "mib": mib, "op": "copy", "ms": t_copy * 1e3, "gbs": copy_gbs})
    print(f"{mib:5d} MiB copy                      {t_copy*1e3:8.3f} ms {copy_gbs:8.1f} GB/s")
    for c in (jc.int8(block_size=256), jc.int4(block_size=256), jc.fp8("e4m3", block_size=128),
              jc.hadamard(jc.int4(block_size=128), size=256)):
      enc = jax.jit(lambda v, c=c: c.encode_rows(v, impl="native"))
      buf = enc(x)
      dec = jax.jit(lambda b, c=c: c.decode_rows(b, ncols, jnp.float32, impl="native"))
      for op, fn, arg, moved in (("encode", enc, x, x.nbytes + buf.nbytes),
                                 ("decode", dec, buf, x.nbytes + buf.nbytes)):
        t = _time(fn, arg, iters=iters)
        gbs = moved / t / 1e9
        rows.append({"codec": str(c), "mib": mib, "op": op, "ms": t * 1e3, "gbs": gbs,
                     "vs_copy": gbs / copy_gbs})
        print(f"{mib:5d} MiB {str(c):28s} {op:6s} {t*1e3:8.3f} ms {gbs:8.1f} GB/s "
              f"({100 * gbs / copy_gbs:5.1f}% of copy)")
      del buf
    del x
  return rows


def main() -> int:
  args = _parse()
  import jax
  import jax.numpy as jnp
  from jcoccl import compressors as jc
  from jcoccl._src import _ffi
  if jax.default_backend() != "gpu":
    print(f"no GPU backend (default backend {jax.default_backend()!r}); nothing to check")
    return 2
  if not _ffi.register("cuda"):
    print(f"jcoccl._cuda missing: {_ffi.native_import_error('cuda')}")
    return 2
  t0 = time.perf_counter()
  bad = check(jax, jnp, jc)
  print(f"bit-exact check: {len(bad)} mismatches ({time.perf_counter() - t0:.1f} s)")
  for m in bad:
    print("  MISMATCH", m)
  results = {"device": str(jax.devices()[0]), "mismatches": bad, "bench": []}
  if not args.skip_bench:
    results["bench"] = bench(jax, jnp, jc, [int(s) for s in args.sizes_mib.split(",")], args.iters)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
