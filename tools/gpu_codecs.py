#!/usr/bin/env python3
"""GPU check of the CUDA codecs: bit-exactness against the CPU specification, then throughput.

Run on a machine with a CUDA GPU after building jcoccl (tools/gpu_build.py, or
`pip install --no-build-isolation --no-deps -e .`):

  python tools/gpu_codecs.py --out gpu_codecs.json
  python tools/gpu_codecs.py --platform cpu --sizes-mib 1 --iters 1   # CI dry run, no GPU

(1) Every codec family x dtype: the native payloads, decodes, decode_sum and decode_sum_encode
    on the default backend are compared with the jnp specification run on the CPU, with the
    inputs passed as jit arguments (a closure would let XLA fold the conversions on the host
    at compile time). The reference is the CPU spec, not jnp on the GPU: XLA:GPU divides
    with div.full.f32 (not IEEE), the CUDA codecs with div.rn. Float fields compare NaN-equal
    (tools/gpu_compare.py: a NaN produced by a conversion is 0x7fff on the GPU). Data with
    subnormal runs is checked separately and its differences are reported, not failed:
    XLA:CPU flushes subnormals (DAZ/FTZ), the GPU kernels do not; tools/gpu_shim.py checks
    the kernels' IEEE subnormal arithmetic in CI. Exits 1 on any mismatch of the main data.
(2) encode/decode time for int8, int4, fp8, hadamard(int4) and spike(int4) against a
    device-to-device copy of the same bytes (cupy's copy timed with CUDA events when cupy is
    installed, and `x + 0` in a jit). GB/s counts bytes read + written; `vs_copy` = codec GB/s / copy GB/s.
    Two timings of each: the jitted call, wall clock over --iters calls (op `encode`, `decode`:
    what a jax program sees, XLA's allocator included), and the kernels alone with CUDA events
    (op `... [events]`: jcoccl_codec_time in cuda/gpu/codec_bench.cu, the median of --iters
    launches on buffers of its own), which also times decode_sum and decode_sum_encode of 2 rows.
(3) --prealloc-probe: the fp8 jitted encode/decode at 256 MiB and 1 GiB again in two child
    processes, with XLA_PYTHON_CLIENT_PREALLOCATE=true and =false (the H200 run's fp8 decode
    took 8-9 ms at 1 GiB against 0.4 ms at 256 MiB, with preallocation off).

The JSON file is rewritten after every case, so a run cut short keeps what it finished; the
last line printed for each part is a `VERDICT ...` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_compare as gc


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--out", default=None, help="write the results as JSON to this path")
  p.add_argument(
    "--platform",
    choices=("gpu", "cpu"),
    default="gpu",
    help="where the native codecs run (cpu: the CI dry run of this script)",
  )
  p.add_argument("--sizes-mib", default="256,1024", help="input sizes in MiB (comma separated)")
  p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
  p.add_argument("--skip-bench", action="store_true", help="only run the bit-exact checks")
  p.add_argument("--skip-check", action="store_true", help="only run the timings")
  p.add_argument("--only", default=None, help="check only the codecs whose name matches this regex")
  p.add_argument(
    "--bench-codecs", default=None, help="time only the codecs whose name matches this regex"
  )
  p.add_argument(
    "--no-events", action="store_true", help="skip the kernel timings with CUDA events"
  )
  p.add_argument(
    "--prealloc-probe",
    default=None,
    metavar="MIB",
    help="instead of the bench: fp8 at these sizes (comma separated) in two child processes, "
    "with XLA's preallocation on and off",
  )
  return p.parse_args()


class Results:
  """The script's JSON output, rewritten (atomically) whenever something is added."""

  def __init__(self, path: str | None, **head):
    self.path, self.data = path, dict(head)
    self.flush()

  def add(self, key: str, item) -> None:
    self.data.setdefault(key, []).append(item)
    self.flush()

  def set(self, **kv) -> None:
    self.data.update(kv)
    self.flush()

  def flush(self) -> None:
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path + ".tmp", "w") as f:
        json.dump(self.data, f, indent=1, default=str)
      os.replace(self.path + ".tmp", self.path)


def _codecs(jc, jnp):
  return [
    jc.cast(jnp.bfloat16),
    jc.cast(jnp.float16),
    jc.none(),
    jc.int8(block_size=32),
    jc.int8(block_size=256),
    jc.int8(block_size=4096),
    jc.int8(block_size=64, symmetric=False),
    jc.int4(block_size=128),
    jc.int4(block_size=32, symmetric=False),
    jc.int2(block_size=256),
    jc.int2(block_size=64, symmetric=False),
    jc.fp8("e4m3", block_size=32),
    jc.fp8("e4m3", block_size=512),
    jc.fp8("e5m2", block_size=128),
    jc.hadamard(jc.int4(block_size=128), size=256),
    jc.hadamard(jc.int8(block_size=64), size=4096),
    jc.hadamard(jc.fp8("e4m3", block_size=128), size=64),
    jc.error_bounded(1e-2, block_size=64),
    jc.error_bounded(1e-4, block_size=1024),
    jc.spike(jc.int4(block_size=128), k=2),
    jc.spike(jc.int3(block_size=64, symmetric=False), k=5),
    jc.spike(jc.fp8("e4m3", block_size=64), k=3),
    jc.spike(jc.error_bounded(1e-2, block_size=32), k=4),
  ]


def _data(rows: int, n: int, seed: int, subnormal: bool = False):
  """Mixed test rows; subnormal=False scales the "tiny" runs to 1e-30 instead of 1e-39."""
  import numpy as np

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, n)).astype(np.float32) * np.float32(3.0)
  x[rng.random((rows, n)) < 0.01] *= np.float32(1e4)
  runs = x.reshape(rows, n // 32, 32)
  kind = rng.integers(0, 8, size=runs.shape[:2])
  runs[kind == 0] = 0.0
  runs[kind == 1] = 1.25
  runs[kind == 2] *= np.float32(1e-39) if subnormal else np.float32(1e-30)
  runs[kind == 5] = -0.0
  runs[kind == 6] *= np.float32(1e-3)
  runs[0, 1, 5] = np.nan
  runs[1, 2, 7] = -np.inf
  return x


def _layout(c, dtype, n: int) -> gc.Layout:
  import jax.numpy as jnp

  from jcoccl import native

  a = native.codec_attrs(c)
  d = {
    jnp.dtype(jnp.float32): gc.F32,
    jnp.dtype(jnp.bfloat16): gc.BF16,
    jnp.dtype(jnp.float16): gc.F16,
  }[jnp.dtype(dtype)]
  return gc.Layout(int(a["kind"]), int(a["block"]), int(a["cast_dtype"]), int(a["hadamard"]), d, n)


def _ref_ops(c, n: int, dtype):
  """jit of x -> the jnp spec's (encode, decode, decode_sum, decode_sum_encode), each decode
  reading the spec's own payload."""
  import jax

  def ops(x):
    buf = c.encode_rows(x, impl="jnp")
    return (
      buf,
      c.decode_rows(buf, n, dtype, impl="jnp"),
      c.decode_sum(buf[:5], n, dtype, impl="jnp"),
      c.decode_sum_encode(buf, n, dtype, impl="jnp"),
    )

  return jax.jit(ops)


def _native_ops(c, n: int, dtype):
  """jit of (x, reference payload) -> the native (encode, decode, decode_sum, dse)."""
  import jax

  def ops(x, buf_ref):
    return (
      c.encode_rows(x, impl="native"),
      c.decode_rows(buf_ref, n, dtype, impl="native"),
      c.decode_sum(buf_ref[:5], n, dtype, impl="native"),
      c.decode_sum_encode(buf_ref, n, dtype, impl="native"),
    )

  return jax.jit(ops)


def check_case(jax, jnp, c, dtype) -> tuple[list[str], list[str]]:
  """One codec and dtype: native on the default device vs the jnp spec on the CPU, on the
  main data and on data with subnormal runs (the same compiled functions for both).

  Returns:
    (mismatches on the main data, differences on the subnormal data); empty when
    bit-identical up to NaN payloads.
  """
  import numpy as np

  n = max(c.granule, 512) * 2
  cpu, dev = jax.devices("cpu")[0], jax.devices()[0]
  ref_fn, native_fn = _ref_ops(c, n, dtype), _native_ops(c, n, dtype)
  lay = _layout(c, dtype, n)
  found = []
  for subnormal in (False, True):
    x_host = np.asarray(jnp.asarray(_data(8, n, seed=n, subnormal=subnormal)).astype(dtype))
    # Inputs are arguments, never closed over: XLA would fold a constant's conversions
    # at compile time on the host, with other subnormal and NaN results than at run time.
    ref = [np.asarray(r) for r in ref_fn(jax.device_put(x_host, cpu))]
    got = native_fn(jax.device_put(x_host, dev), jax.device_put(ref[0], dev))
    bad = []
    for what, a, b in zip(("encode", "decode", "decode_sum", "decode_sum_encode"), ref, got):
      b = np.asarray(b)
      if a.shape != b.shape:
        bad.append(f"{c} {jnp.dtype(dtype).name} {what}: shapes {a.shape} vs {b.shape}")
        continue
      payload = what in ("encode", "decode_sum_encode")
      m = gc.payload_mismatch(lay, a, b) if payload else gc.float_mismatch(a, b, lay.dtype)
      if m.any():
        bad.append(f"{c} {jnp.dtype(dtype).name} {what}: {gc.describe(m)}")
    found.append(bad)
  return found[0], found[1]


def check(
  jax, jnp, jc, results: Results | None = None, only: str | None = None
) -> tuple[list[str], list[str]]:
  """Every codec x dtype (names matching the regex `only`); returns (mismatches,
  differences on the subnormal data)."""
  import re

  from jcoccl import native

  bad, sub = [], []
  for c in _codecs(jc, jnp):
    if only and not re.search(only, str(c)):
      continue
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      name = f"{c} {jnp.dtype(dtype).name}"
      if not all(
        native.available(c, op, dtype)
        for op in ("encode", "decode", "decode_sum", "decode_sum_encode")
      ):
        m, s = [f"{name}: no native kernel available"], []
      else:
        try:
          m, s = check_case(jax, jnp, c, dtype)
        except Exception as e:  # recorded; the other cases still run
          m, s = [f"{name}: {type(e).__name__}: {str(e)[:300]}"], []
      bad += m
      sub += s
      print(
        f"codecs  {name:58s} {'OK' if not m else 'MISMATCH ' + m[0]}"
        f"{'' if not s else f' (subnormal data: {len(s)} differences)'}",
        flush=True,
      )
      if results is not None:
        results.add(
          "cases",
          dict(codec=str(c), dtype=jnp.dtype(dtype).name, mismatches=m, subnormal_differences=s),
        )
  return bad, sub


def _time(fn, *args, iters: int) -> float:
  import jax

  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def _cupy_copy_gbs(nbytes: int, iters: int) -> float | None:
  """Device-to-device copy bandwidth (read + write) measured by cupy with CUDA events: the
  physical limit codec throughput is judged against. None without cupy or a GPU."""
  try:
    import cupy as cp

    src = cp.zeros(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    dst[...] = src
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
      dst[...] = src
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop) / iters
    return 2 * nbytes / (ms * 1e-3) / 1e9
  except Exception:  # no cupy, no GPU, or a cupy/driver mismatch: the jax copy stands
    return None


# The kernel timings' operations: (name, jcoccl_codec_time op code, payload rows per output).
EVENT_OPS = (("encode", 0, 1), ("decode", 1, 1), ("decode_sum", 2, 2), ("decode_sum_encode", 3, 2))


def event_timer():
  """jcoccl_codec_time (cuda/gpu/codec_bench.cu) from jcoccl._cuda through ctypes, or None.

  Returns None where the CUDA extension is missing or lacks the symbol (the CPU dry run).

  Example:
    t = event_timer(); ms = kernel_ms(t, native.codec_attrs(jc.int8()), "decode", 256, 2**20, 5)
  """
  import ctypes

  from jcoccl import native

  m = native.module("cuda")
  if m is None:
    return None
  try:
    fn = ctypes.CDLL(m.__file__).jcoccl_codec_time
  except (OSError, AttributeError):
    return None
  c = ctypes
  fn.restype = c.c_int
  fn.argtypes = [c.c_char_p, c.c_int32, c.c_int64, c.c_int64, c.c_int32, c.c_int32, c.c_void_p]
  return fn


def kernel_ms(timer, attrs: dict, op: str, rows: int, n: int, iters: int) -> list[float]:
  """Device times (ms) of `iters` launches of one codec op on float32 rows x n, CUDA events.

  Args:
    timer: event_timer()'s function.
    attrs: the codec's FFI attributes (jcoccl.native.codec_attrs).
    op: a name of EVENT_OPS; decode_sum and decode_sum_encode read 2 payload rows per output.
    rows, n: the float32 rows (rows x n values in, or out).
    iters: timed launches (after one untimed).

  Returns:
    The launches' times in milliseconds.
  """
  import numpy as np

  from jcoccl import native

  code, nrows = {name: (c, k) for name, c, k in EVENT_OPS}[op]
  ms = np.zeros(iters, np.float32)
  # The descriptor's C form: its text, read by codecs/descriptor.h SpecFromText.
  spec = native.codec_text(attrs).encode()
  rc = timer(spec, code, rows, n, nrows, iters, ms.ctypes.data)
  if rc != 0:
    raise RuntimeError(f"jcoccl_codec_time({op}) failed: cudaError_t {rc}")
  return [float(v) for v in ms]


def event_bytes(op: str, rows: int, n: int, p: int) -> int:
  """Bytes an op reads + writes on float32 rows x n with p-byte payloads (EVENT_OPS)."""
  x, pay = 4 * rows * n, rows * p
  return {"encode": x + pay, "decode": x + pay, "decode_sum": 2 * pay + x}.get(op, 3 * pay)


def bench_codecs(jc, pattern: str | None = None) -> list:
  """The timed codecs, those whose name matches `pattern` (a regex) when given."""
  import re

  cs = [
    jc.int8(block_size=256),
    jc.int4(block_size=256),
    jc.fp8("e4m3", block_size=128),
    jc.hadamard(jc.int4(block_size=128), size=256),
    jc.spike(jc.int4(block_size=128), k=2),
  ]
  return [c for c in cs if pattern is None or re.search(pattern, str(c))]


def bench(
  jax,
  jnp,
  jc,
  sizes_mib: list[float],
  iters: int,
  results: Results | None = None,
  codecs: str | None = None,
  events: bool = True,
) -> list[dict]:
  """Codec encode/decode throughput against the device copy bandwidth, per size.

  Args:
    jax, jnp, jc: the modules (jcoccl.compressors as jc).
    sizes_mib: float32 input sizes.
    iters: timed calls (launches) per measurement.
    results: where each row is added as it is measured.
    codecs: a regex over the codec names to time (bench_codecs); all when None.
    events: also time the kernels alone with CUDA events (GPU only).

  Returns:
    The rows: {"codec", "mib", "op", "gbs", "vs_copy", ...}.
  """
  from jcoccl import native

  rows = []
  timer = event_timer() if events and jax.default_backend() == "gpu" else None

  def add(row: dict) -> None:
    rows.append(row)
    if results is not None:
      results.add("bench", row)

  for mib in sizes_mib:
    n_total = int(mib * 2**20) // 4
    ncols = min(2**20, n_total)
    x = jax.random.normal(jax.random.key(0), (n_total // ncols, ncols), jnp.float32)
    t_copy = _time(jax.jit(lambda v: v + 0.0), x, iters=iters)
    copy_gbs = 2 * x.nbytes / t_copy / 1e9
    add({"codec": "copy", "mib": mib, "op": "copy(jax)", "ms": t_copy * 1e3, "gbs": copy_gbs})
    cupy_gbs = _cupy_copy_gbs(x.nbytes, iters) if jax.default_backend() == "gpu" else None
    if cupy_gbs is not None:
      add({"codec": "copy", "mib": mib, "op": "copy(cupy, CUDA events)", "gbs": cupy_gbs})
      copy_gbs = max(copy_gbs, cupy_gbs)
    print(
      f"{mib:7.2f} MiB copy                      {t_copy * 1e3:8.3f} ms {copy_gbs:8.1f} GB/s"
      f"{'' if cupy_gbs is None else f' (cupy {cupy_gbs:.1f})'}",
      flush=True,
    )
    for c in bench_codecs(jc, codecs):
      enc = jax.jit(lambda v, c=c: c.encode_rows(v, impl="native"))
      buf = enc(x)
      dec = jax.jit(lambda b, c=c, n=ncols: c.decode_rows(b, n, jnp.float32, impl="native"))
      for op, fn, arg, moved in (
        ("encode", enc, x, x.nbytes + buf.nbytes),
        ("decode", dec, buf, x.nbytes + buf.nbytes),
      ):
        t = _time(fn, arg, iters=iters)
        gbs = moved / t / 1e9
        add(
          {
            "codec": str(c),
            "mib": mib,
            "op": op,
            "ms": t * 1e3,
            "gbs": gbs,
            "vs_copy": gbs / copy_gbs,
          }
        )
        print(
          f"{mib:7.2f} MiB {c!s:28s} {op:6s} {t * 1e3:8.3f} ms {gbs:8.1f} GB/s "
          f"({100 * gbs / copy_gbs:5.1f}% of copy)",
          flush=True,
        )
      if timer is not None:
        for op, _, _ in EVENT_OPS:
          ms = kernel_ms(timer, native.codec_attrs(c), op, x.shape[0], ncols, iters)
          t = statistics.median(ms) * 1e-3
          gbs = event_bytes(op, x.shape[0], ncols, buf.shape[1]) / t / 1e9
          row = {"codec": str(c), "mib": mib, "op": f"{op} [events]", "ms": t * 1e3}
          add({**row, "ms_min": min(ms), "ms_max": max(ms), "gbs": gbs, "vs_copy": gbs / copy_gbs})
          print(
            f"{mib:7.2f} MiB {c!s:28s} {op + ' [events]':26s} {t * 1e3:8.3f} ms "
            f"[{min(ms):.3f}, {max(ms):.3f}] {gbs:8.1f} GB/s ({100 * gbs / copy_gbs:5.1f}% of copy)",
            flush=True,
          )
      del buf
    del x
  return rows


def prealloc_probe(
  sizes_mib: str, iters: int, platform: str, results: Results | None = None
) -> list[dict]:
  """fp8's jitted encode/decode in child processes with XLA's preallocation on, then off.

  XLA_PYTHON_CLIENT_PREALLOCATE must be set before the backend starts, hence the children;
  each runs this script's bench for fp8 alone at `sizes_mib`. Rows come back with the setting
  in their op ("decode (XLA_PYTHON_CLIENT_PREALLOCATE=true)").
  """
  import subprocess
  import tempfile

  rows = []
  for pre in ("true", "false"):
    with tempfile.TemporaryDirectory() as d:
      out = os.path.join(d, "probe.json")
      cmd = [sys.executable, os.path.abspath(__file__), "--skip-check", "--no-events"]
      cmd += ["--bench-codecs", "^fp8", "--sizes-mib", sizes_mib, "--iters", str(iters)]
      cmd += ["--out", out, "--platform", platform]
      env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": pre}
      r = subprocess.run(cmd, env=env, capture_output=True, text=True)
      if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"prealloc probe ({pre}) failed: {r.stdout[-1000:]}{r.stderr[-2000:]}")
      with open(out) as f:
        child = json.load(f)["bench"]
    for row in child:
      if row["codec"] == "copy":
        continue
      row = {**row, "op": f"{row['op']} (XLA_PYTHON_CLIENT_PREALLOCATE={pre})"}
      rows.append(row)
      if results is not None:
        results.add("bench", row)
      print(f"{row['mib']:7.2f} MiB {row['codec']:28s} {row['op']:48s} {row['ms']:8.3f} ms")
  return rows


def main() -> int:
  args = _parse()
  import jax
  import jax.numpy as jnp

  from jcoccl import compressors as jc
  from jcoccl import native

  if jax.default_backend() != args.platform:
    print(
      f"VERDICT codecs: SKIPPED (default backend {jax.default_backend()!r}, "
      f"--platform {args.platform})"
    )
    return 2
  module = "cuda" if args.platform == "gpu" else "cpu"
  if not native.register(module):
    print(f"VERDICT codecs: FAIL (jcoccl._{module} missing: {native.import_error(module)})")
    return 2
  results = Results(args.out, device=str(jax.devices()[0]), mismatches=None, bench=[])
  bad = []
  if not args.skip_check:
    t0 = time.perf_counter()
    bad, sub = check(jax, jnp, jc, results, args.only)
    dt = time.perf_counter() - t0
    results.set(mismatches=bad, subnormal_differences=sub, check_s=dt)
    print(
      f"VERDICT codecs: {'PASS' if not bad else 'FAIL'} ({len(bad)} mismatches, "
      f"{len(sub)} subnormal-data differences, {dt:.1f} s)",
      flush=True,
    )
  if not args.skip_bench:
    if args.prealloc_probe:  # the timings run in the child processes alone
      rows = prealloc_probe(args.prealloc_probe, args.iters, args.platform, results)
    else:
      sizes = [float(s) for s in args.sizes_mib.split(",")]
      rows = bench(jax, jnp, jc, sizes, args.iters, results, args.bench_codecs, not args.no_events)
    print(f"VERDICT codec-bench: {len(rows)} rows", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
