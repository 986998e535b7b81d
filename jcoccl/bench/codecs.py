"""``python -m jcoccl.bench codecs``: encode/decode throughput of each compressor.

Throughput is input bytes / median time (GB/s, 1e9 bytes) of a jitted ``encode_rows`` or
``decode_rows`` over one row of the given size, on the default device, per implementation
("jnp" = the specification, "native" = the C++/CUDA kernels, where available).

``--sizes`` takes sizes with units, as every ``jcoccl.bench`` subcommand (``4MiB``, ``64KiB``,
``1MB``; a plain integer is bytes). A row holds a whole number of the compressor's granules,
at least one: the size is rounded down to it (up for sizes under one granule), and the
``bytes`` column shows what was measured.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import layout, native, parse, sources, spec
from jcoccl.bench import _harness as H

DEFAULT_COMPRESSORS = "bf16,int8,int4,int4:asym,fp8,hadamard(int4),eb:abs=1e-3"
COLUMNS = [
  "compressor",
  "impl",
  "dtype",
  "bytes",
  "ratio",
  "enc_us",
  "enc_GB/s",
  "dec_us",
  "dec_GB/s",
  "max_rel_err",
]


def add_parser(subparsers: Any) -> None:
  """Registers the ``codecs`` subcommand."""
  p = subparsers.add_parser("codecs", help="encode/decode throughput per compressor")
  p.add_argument(
    "--sizes",
    type=H.size_list,
    default="1MiB,4MiB",
    help="input sizes per row, comma-separated; " + H.SIZE_HELP + " (default 1MiB,4MiB)",
  )
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  p.add_argument(
    "--compressors",
    default=DEFAULT_COMPRESSORS,
    help="compressor specs, comma-separated outside parentheses (see jcoccl.compressors.parse)",
  )
  p.add_argument(
    "--impl", default="jnp,native", help="implementations: jnp, native (comma-separated)"
  )
  p.add_argument("--iters", type=H.positive_int, default=5, help="timed runs (median reported)")
  p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
  sources.add_codec_flag(p)


def bench_one(c: Any, impl: str, dtype: Any, size: int, iters: int) -> dict[str, Any] | None:
  """One table row, or None where ``impl`` is not available for ``c``."""
  d = jnp.dtype(dtype)
  if impl == "native" and not (
    native.available(c, "encode", d) and native.available(c, "decode", d)
  ):
    return None
  n = layout.granule_rows(size, d.itemsize, c.granule)
  x = jax.random.normal(jax.random.key(0), (1, n), jnp.float32).astype(d)
  key = jax.random.key(1)
  enc = jax.jit(lambda v, k: c.encode_rows(v, key=k, impl=impl))
  dec = jax.jit(lambda b: c.decode_rows(b, n, d, impl=impl))
  buf = jax.block_until_ready(enc(x, key))
  t_enc = H.time_fn(enc, x, key, iters=iters)
  t_dec = H.time_fn(dec, buf, iters=iters)
  y = dec(buf)
  xf, yf = np.asarray(x, np.float32), np.asarray(y, np.float32)
  rel = float(np.max(np.abs(xf - yf)) / max(float(np.max(np.abs(xf))), 1e-30))
  nbytes = n * d.itemsize
  return {
    "compressor": str(c),
    "impl": impl,
    "dtype": d.name,
    "bytes": nbytes,
    "ratio": nbytes / buf.shape[1],
    "enc_us": t_enc * 1e6,
    "enc_GB/s": nbytes / t_enc / 1e9,
    "dec_us": t_dec * 1e6,
    "dec_GB/s": nbytes / t_dec / 1e9,
    "max_rel_err": rel,
  }


def run(args: argparse.Namespace) -> int:
  """Runs the codec benchmark; returns the process exit code."""
  sources.import_flagged(args)
  sizes = args.sizes
  comps = [parse(s) for s in spec.split(args.compressors)]
  impls = H.parse_list(args.impl, str, "--impl")
  for i in impls:
    if i not in ("jnp", "native"):
      raise ValueError(f"--impl: accepted values are jnp, native; got {i!r}")
  rows = []
  for c in comps:
    for impl in impls:
      for nbytes in sizes:
        r = bench_one(c, impl, args.dtype, nbytes, args.iters)
        if r is not None:
          rows.append(r)
  H.emit(
    rows, COLUMNS, as_json=args.json, title="codec throughput: GB/s = input bytes / median time"
  )
  return 0
