"""``python -m jcoccl.bench collectives``: nccl-tests-style table of compressed collectives.

For each op, message size and compressor (plus the uncompressed lax op side by side):
time (median, us), algbw and busbw (GB/s, nccl-tests formulas), the wire-bytes ratio vs
the lax op (from the compiled HLO, :func:`jcoccl.wire_bytes`) and the max abs / max
relative error (max abs error / max |reference|) against the uncompressed result. ``--chunks`` compares slicing depths.

nccl-tests formulas (S = bytes of the op's buffer, t = time, n = ranks):
  algbw = S / t; busbw = algbw * 2(n-1)/n (all_reduce, S = message),
  * (n-1)/n (all_gather: S = gathered buffer; reduce_scatter: S = input buffer;
  all_to_all: S = buffer), * 1 (ppermute).

``--sizes`` are per-rank message sizes with units, as in every ``jcoccl.bench`` subcommand
(``256KiB``, ``4MiB``, ``1MB``; a plain integer is bytes). A message holds a whole number of
elements per rank: a size is rounded down to that (the ``bytes`` column shows what ran), and
one under ranks x element size is an error.

Runs on every device of the default backend; with no accelerator it asks XLA for 8 host
CPU devices (unless XLA_FLAGS already sets a count). With ``--processes N`` it starts N
processes (one device each, ``python -m jcoccl.launch``), joined by JAX's distributed
runtime, and with ``--link-rate`` they share one link of that rate (a tc-shaped loopback in
a private network namespace; needs root): the regime compression is for, ranks on different
hosts. Under a cluster launcher (the JAX_* variables, SLURM) it runs across the processes it
was started in. Configurations are timed in interleaved rounds (median per configuration),
and ``speedup`` is the lax op's time over the configuration's, from the same rounds.

Example:
  python -m jcoccl.bench collectives --sizes 256KiB,4MiB --compressors int8,int4 --json
  python -m jcoccl.bench collectives --processes 4 --link-rate 1gbit --sizes 16MiB \
      --ops all_reduce --compressors int8,int4 --algorithms one_shot,two_shot
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only affects the host platform: harmless where an accelerator is the default backend.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jcoccl._src.compressors import sources
from jcoccl.bench import _harness as H

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
NAME = "collectives"
HELP = "compressed vs lax collectives: time, algbw/busbw, wire bytes, error"
COLUMNS = [
  "op",
  "bytes",
  "dtype",
  "compressor",
  "algorithm",
  "chunks",
  "time_us",
  "algbw_GBps",
  "busbw_GBps",
  "speedup",
  "wire_ratio",
  "max_abs_err",
  "max_rel_err",
]
HEADERS = {
  "time_us": "time(us)",
  "algbw_GBps": "algbw",
  "busbw_GBps": "busbw",
  "speedup": "speedup",
  "wire_ratio": "wire",
  "max_abs_err": "max_abs",
  "max_rel_err": "max_rel",
}
FORMATS = {
  "bytes": "d",
  "chunks": "d",
  "time_us": ".1f",
  "algbw_GBps": ".3f",
  "busbw_GBps": ".3f",
  "speedup": ".2f",
  "wire_ratio": ".3f",
  "max_abs_err": ".2e",
  "max_rel_err": ".2e",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Registers the ``collectives`` subcommand."""
  p = subparsers.add_parser(
    NAME, help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_arguments(p)
  return p


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--sizes",
    type=H.size_list,
    default="256KiB,1MiB",
    help="per-rank message sizes, comma-separated; " + H.SIZE_HELP + " (default 256KiB,1MiB)",
  )
  p.add_argument(
    "--ops",
    default="all_reduce,all_gather,reduce_scatter",
    help=f"comma separated among {','.join(OPS)}",
  )
  p.add_argument(
    "--compressors",
    default="int8,int4",
    help="compressor specs (jcoccl.compressors.parse), comma separated; "
    "use ';' to separate specs that contain commas",
  )
  p.add_argument(
    "--algorithms",
    default="auto",
    help="all_reduce algorithms: auto,one_shot,two_shot (comma separated)",
  )
  p.add_argument("--chunks", default="1", help="chunk counts to compare, e.g. 1,4")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  p.add_argument("--iters", type=H.positive_int, default=5, help="timed runs (median reported)")
  p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
  p.add_argument(
    "--processes",
    type=int,
    default=0,
    help="run across this many processes on this machine (python -m jcoccl.launch)",
  )
  p.add_argument(
    "--link-rate",
    default=None,
    help="with --processes: the rate of the link they share, e.g. 1gbit, 10gbit",
  )
  sources.add_codec_flag(p)
  p.add_argument(
    "--fit-out",
    default=None,
    help="fit all_reduce(algorithm='auto')'s cost model to the one_shot/two_shot "
    "timings, print it with auto's choice per size, and write it to this "
    "JSON file (use it with JCOCCL_COST_MODEL=FILE)",
  )


def _specs(text: str) -> list[str]:
  sep = ";" if ";" in text else ","
  return [s.strip() for s in text.split(sep) if s.strip()]


def _programs(op: str, mesh: Mesh, n: int, kw: dict) -> tuple[Any, Any, float]:
  """(jcoccl program, lax program, nccl-tests busbw factor); input [n, m], one row a rank."""
  import jcoccl

  spec: dict[str, Any] = dict(mesh=mesh, in_specs=jax.P("r"), out_specs=jax.P("r"))
  perm = [(i, (i + 1) % n) for i in range(n)]
  bodies = {
    "all_reduce": (
      lambda v: jcoccl.all_reduce(v, "r", **kw),
      lambda v: lax.psum(v, "r"),
      2 * (n - 1) / n,
    ),
    "all_gather": (
      lambda v: jcoccl.all_gather(v, "r", tiled=True, **_nokw(kw)),
      lambda v: lax.all_gather(v, "r", tiled=True),
      (n - 1) / n,
    ),
    "reduce_scatter": (
      lambda v: jcoccl.reduce_scatter(v, "r", scatter_dimension=1, tiled=True, **_nokw(kw)),
      lambda v: lax.psum_scatter(v, "r", scatter_dimension=1, tiled=True),
      (n - 1) / n,
    ),
    "all_to_all": (
      lambda v: jcoccl.all_to_all(v, "r", 1, 1, tiled=True, **_nokw(kw)),
      lambda v: lax.all_to_all(v, "r", 1, 1, tiled=True),
      (n - 1) / n,
    ),
    "ppermute": (
      lambda v: jcoccl.ppermute(v, "r", perm, **_nokw(kw)),
      lambda v: lax.ppermute(v, "r", perm),
      1.0,
    ),
  }
  j, l, factor = bodies[op]
  return jax.jit(jax.shard_map(j, **spec)), jax.jit(jax.shard_map(l, **spec)), factor


def _nokw(kw: dict) -> dict:
  return {k: v for k, v in kw.items() if k != "algorithm"}


def _algbw_bytes(op: str, nbytes: int, n: int) -> int:
  """The S of nccl-tests for a per-rank message of ``nbytes``."""
  return nbytes * n if op == "all_gather" else nbytes


def _global_input(mesh: Mesh, n: int, m: int, dtype: Any) -> jax.Array:
  """[n, m] normal values, row r on rank r (built in place: works across processes)."""
  make = lambda: jax.random.normal(jax.random.key(0), (n, m), jnp.float32).astype(dtype)
  return jax.jit(make, out_shardings=NamedSharding(mesh, jax.P("r")))()


def _host(x: jax.Array) -> np.ndarray:
  """The whole of a global array on this host (gathered from the other processes)."""
  if x.is_fully_addressable:
    return np.asarray(x, np.float64)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Runs the sweep; returns one dict per table row."""
  import jcoccl

  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("r",))
  dtype = jnp.dtype(args.dtype)
  rows = []
  ops = H.parse_list(args.ops, str, "--ops")
  for op in ops:
    if op not in OPS:
      raise ValueError(f"--ops: unknown op {op!r}; accepted: {', '.join(OPS)}")
  chunk_counts = H.parse_list(args.chunks, int, "--chunks")
  if min(chunk_counts) < 1:
    raise ValueError(f"--chunks: counts must be >= 1, got {args.chunks!r}")
  for nbytes in args.sizes:
    if nbytes < n * dtype.itemsize:
      raise ValueError(
        f"--sizes: {nbytes} B is under one {dtype.name} element per rank "
        f"({n} ranks x {dtype.itemsize} B = {n * dtype.itemsize} B)"
      )
  for op in ops:
    for nbytes in args.sizes:
      m = nbytes // dtype.itemsize // n * n  # divisible by n for scatter ops
      x = _global_input(mesh, n, m, dtype)
      _, lfn, factor = _programs(op, mesh, n, {"compressor": None})
      ref = _host(lfn(x))
      configs = [("lax", "-", 1, lfn)]
      algos = _specs(args.algorithms) if op == "all_reduce" else ["one_shot"]
      for spec in _specs(args.compressors):
        for algo in algos:
          for chunks in chunk_counts:
            kw = {"compressor": spec, "algorithm": algo, "chunks": chunks, "min_bytes": 0}
            fn, _, _ = _programs(op, mesh, n, kw)
            configs.append((spec, algo, chunks, fn))
      times = H.time_interleaved([fn for *_, fn in configs], x, warmup=1, iters=args.iters)
      for (spec, algo, chunks, fn), t in zip(configs, times):
        err = np.abs(_host(fn(x)) - ref)
        wb = jcoccl.wire_bytes(fn, x, reference=lfn)
        s = _algbw_bytes(op, m * dtype.itemsize, n)
        algbw = s / t / 1e9
        rows.append(
          {
            "op": op,
            "ranks": n,
            "bytes": m * dtype.itemsize,
            "dtype": dtype.name,
            "compressor": spec,
            "algorithm": algo,
            "chunks": chunks,
            "time_us": t * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * factor,
            "speedup": times[0] / t,
            "wire_ratio": wb.get("ratio", float("nan")),
            "payload_ratio": _payload_ratio(spec, m, dtype),
            "max_abs_err": float(err.max()),
            "max_rel_err": float(err.max() / max(np.abs(ref).max(), 1e-30)),
            "platform": devices[0].platform,
            "processes": jax.process_count(),
            "link": os.environ.get(
              "JCOCCL_LINK", "unshaped" if jax.process_count() > 1 else "in-process"
            ),
          }
        )
  return rows


def _payload_ratio(spec: str, m: int, dtype: Any) -> float:
  """Payload bytes / raw bytes of the compressor on an m-element message (1 for lax)."""
  if spec == "lax":
    return 1.0
  from jcoccl import compressors as jc
  from jcoccl._src.compressors.compressor_args import compression_ratio

  return compression_ratio(jc.parse(spec), m, dtype)


def _relaunch(args: argparse.Namespace, argv: list[str]) -> int:
  """Runs this subcommand again as ``args.processes`` processes (jcoccl.launch)."""
  from jcoccl import launch

  drop = {"--processes", "--link-rate"}  # --fit-out stays: process 0 writes it
  rest, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a in drop:
      skip = True
      continue
    if a.split("=", 1)[0] in drop:
      continue
    rest.append(a)
  cmd = [sys.executable, "-m", "jcoccl.bench", NAME, *rest]
  return launch.run(cmd, args.processes, devices=1, link_rate=args.link_rate)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
  """Runs the subcommand; prints a table or (``--json``) a JSON list.

  With ``--processes`` (and not already one of several processes) it starts that many
  processes running the same subcommand and returns their launcher's exit status.
  """
  from jcoccl import distributed, launch

  sources.import_flagged(args)
  if args.link_rate is not None:
    if not args.processes:
      raise ValueError("--link-rate shapes the link between processes: give --processes too")
    launch.rate_bits(args.link_rate)
  if args.processes < 0:
    raise ValueError(f"--processes must be >= 1, got {args.processes}")
  if args.processes and distributed.environment() is None:
    return _relaunch(args, sys.argv[2:] if argv is None else argv)
  distributed.initialize()
  rows = bench(args)
  if jax.process_index() != 0:
    return 0
  n, platform = (rows[0]["ranks"], rows[0]["platform"]) if rows else (0, "?")
  link = rows[0]["link"] if rows else ""
  H.emit(
    rows,
    COLUMNS,
    as_json=args.json,
    headers=HEADERS,
    formats=FORMATS,
    title=f"jcoccl collectives: {n} ranks on {platform}, {jax.process_count()} "
    f"process(es), link {link} (algbw/busbw in GB/s; speedup = lax time / time; "
    f"wire = bytes sent / lax's, from compiled HLO)",
  )
  if args.fit_out:
    fit_and_report(rows, args.fit_out, out=sys.stderr if args.json else sys.stdout)
  return 0


def fit_and_report(rows: list[dict[str, Any]], path: str, out: Any = sys.stdout) -> Any:
  """Fits the all_reduce cost model to ``rows``, writes it to ``path`` as JSON and prints,
  per message size, the measured fastest algorithm next to the fitted model's choice.

  Returns:
    The fitted :class:`jcoccl.CostModel`.
  """
  import json

  from jcoccl._src.base import cost_model

  samples = [
    dict(r, ratio=r["payload_ratio"], seconds=r["time_us"] * 1e-6)
    for r in rows
    if r["op"] == "all_reduce" and r["algorithm"] in ("one_shot", "two_shot") and r["chunks"] == 1
  ]
  platform, link = (rows[0]["platform"], rows[0]["link"]) if rows else ("?", "?")
  source = (
    f"fit: {rows[0]['processes'] if rows else '?'} {platform} processes, link {link}, "
    f"{len(samples)} timings"
  )
  model = cost_model.fit(samples, source)
  with open(path, "w") as f:
    json.dump(
      dict(
        dataclasses.asdict(model),
        platform=platform,
        link=link,
        ranks=sorted({s["ranks"] for s in samples}),
      ),
      f,
      indent=1,
    )
  print(
    f"# cost model ({source}): overhead {model.overhead_s * 1e6:.1f} us, "
    f"alpha {model.alpha_s * 1e6:.1f} us, beta "
    f"{model.beta_Bps / 1e9:.3f} GB/s, gamma {model.gamma_Bps / 1e9:.3f} GB/s -> {path}",
    file=out,
  )
  print("#  compressor     bytes  fastest measured  auto (fitted)", file=out)
  by_case: dict[tuple, dict[str, float]] = {}
  for s in samples:
    by_case.setdefault((s["compressor"], s["bytes"], s["ranks"], s["ratio"]), {})[
      s["algorithm"]
    ] = s["seconds"]
  for (comp, nbytes, n, ratio), t in sorted(by_case.items(), key=lambda kv: kv[0][:2]):
    fastest = min(t, key=lambda algo: t[algo])
    chosen = model.choose(nbytes, n, ratio)
    print(f"   {comp:>10}  {nbytes:>9d}  {fastest:>16}  {chosen:>13}", file=out)
  return model


def main(argv: list[str] | None = None) -> int:
  """``python -m jcoccl.bench.collectives``: the subcommand on its own; exit status 2 on bad
  arguments."""
  p = argparse.ArgumentParser(
    prog="python -m jcoccl.bench.collectives",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_arguments(p)
  argv = sys.argv[1:] if argv is None else argv
  try:
    return run(p.parse_args(argv), argv)
  except ValueError as e:
    p.error(str(e))
    return 2


if __name__ == "__main__":
  sys.exit(main())
