#!/usr/bin/env python3
"""GPU checks of jcoccl's fused engine (CUDA codecs + NCCL), run by tools/gpu_check.sh.

Subcommands:
  single   world size 1 through jax on the GPU: every fused op (jcoccl.init + backend="fused")
           against backend="xla", compared bit for bit.
  launch   starts --world worker processes on the one GPU, each with its own NCCL_HOSTID and
           NCCL_SOCKET_IFNAME=lo (so NCCL treats them as separate nodes and uses its socket
           transport over loopback); the ncclUniqueId travels through a file. Each worker
           checks every fused op against a reference computed independently with the jnp codec
           specification on the CPU, and the plain NCCL ops against numpy, then (with --bench)
           times compressed vs NCCL all_reduce / all_gather / reduce_scatter (nccl-tests
           algbw/busbw). If NCCL refuses (e.g. "Duplicate GPU detected"), that is printed
           clearly and the command exits 3.
  worker   one rank of `launch` (internal).
  report   merges the JSON files of a directory into summary.json and summary.txt.

`single`, `launch` and `worker` take --platform cpu: the CI dry run at world size 1, through
the same code except the device (jax's CPU device, the host transport instead of NCCL, the
C++ codecs instead of the CUDA ones). Every subcommand rewrites its JSON after each finished
case, so a run cut short by its time limit keeps what it finished, and ends with a one-line
`VERDICT ...`. `launch --dir` keeps the ranks' logs and JSON; `--deadline` kills unfinished
ranks early enough for the summary to be written; `--no-checks` times only.

The baseline ("nccl") is NCCL's own uncompressed collective on float32, as nccl-tests
times it: ncclAllReduce / ncclReduceScatter with ncclSum, ncclAllGather (the engine's
algo="plain" ops, one NCCL call each). speedup = t_nccl / t_compressed. The row
"engine_none" is jcoccl's engine with the identity codec, which takes the transport's own
collectives (cuda/engine/engine_impl.h, IdentityFastPath: ncclAllReduce / ncclReduceScatter
on float32, ncclAllGather, grouped send/recv): t_nccl / t_engine_none is the fused call's
overhead over NCCL's own (goal: >= 0.98).
Times are the mean of --iters back-to-back calls after two warm-up calls and a barrier.

Example:
  python tools/gpu_collectives.py single --out gpu_out/single.json
  python tools/gpu_collectives.py launch --world 2 --bench --out gpu_out/world2.json
  python tools/gpu_collectives.py single --platform cpu --out /tmp/single.json   # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nccl_env

PLATFORM = "cuda"  # the engine's platform (a worker with --platform cpu sets "cpu")
OPS = ("one_shot", "two_shot", "reduce_scatter", "all_gather", "all_to_all", "ppermute")


def _compressors() -> dict[str, Any]:
  from jcoccl import compressors as jc

  return {
    "int8": jc.int8(block_size=256),
    "int4_asym": jc.int4(block_size=128, symmetric=False),
    "fp8_e4m3": jc.fp8("e4m3", block_size=128),
    "hadamard_int4": jc.hadamard(jc.int4(block_size=128)),
    "cast_bf16": jc.cast("bfloat16"),
  }


def _bits_equal(a: Any, b: Any) -> bool:
  import numpy as np

  a, b = np.asarray(a), np.asarray(b)
  return (
    a.shape == b.shape
    and a.dtype == b.dtype
    and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))
  )


# ----------------------------------------------------------------------------------------
# single: world size 1 through the public API.


def _devices(platform: str) -> list:
  """The devices of --platform ("gpu" or "cpu")."""
  import jax

  return jax.devices("gpu" if platform == "gpu" else "cpu")


def _mesh(devices: list, names: tuple[str, ...]):
  """A mesh of size 1 with Auto axes: jax.make_mesh defaults to Explicit axes, under which
  shard_map rejects inputs whose sharding does not already match in_specs."""
  import jax
  from jax.sharding import AxisType

  return jax.make_mesh(
    (1,) * len(names), names, devices=devices[:1], axis_types=(AxisType.Auto,) * len(names)
  )


def _put(x, mesh, spec):
  """x placed with the sharding shard_map's in_specs expects."""
  import jax
  from jax.sharding import NamedSharding

  return jax.device_put(x, NamedSharding(mesh, spec))


def cmd_single(args: argparse.Namespace) -> int:
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np

  import jcoccl

  results: list[dict] = []

  def record(row: dict) -> None:  # the JSON is rewritten after every case
    results.append(row)
    bad = sum(not r["bit_identical"] for r in results)
    _write(
      args.out,
      dict(kind="single", platform=args.platform, results=results, mismatches=bad, complete=False),
    )

  devs = _devices(args.platform)
  mesh = _mesh(devs, ("x",))
  mesh2 = _mesh(devs, ("node", "gpu"))
  rng = np.random.default_rng(0)
  x_host = rng.standard_normal((8, 1000)).astype(np.float32)
  x_host[0, 3] = np.nan
  comps = {
    k: v
    for k, v in _compressors().items()
    if not args.compressors or re.search(args.compressors, k)
  }
  jcoccl.init(mesh)
  for name, comp in comps.items():
    for dtype in (jnp.float32, jnp.bfloat16):
      outs = {}
      x = _put(jnp.asarray(x_host, dtype), mesh, jax.P("x"))
      for backend in ("xla", "fused"):
        kw = dict(compressor=comp, backend=backend, chunks=2, min_bytes=0)

        def body(v, kw=kw):
          return (
            jcoccl.all_reduce(v, "x", algorithm="one_shot", **kw),
            jcoccl.all_reduce(v, "x", algorithm="two_shot", **kw),
            jcoccl.reduce_scatter(v, "x", scatter_dimension=0, tiled=True, **kw),
            jcoccl.all_gather(v, "x", axis=0, tiled=True, **kw),
            jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw),
            jcoccl.ppermute(v, "x", [(0, 0)], **kw),
          )

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
        try:
          outs[backend] = [np.asarray(o) for o in f(x)]
          if backend == "fused":
            outs["hlo_fused_calls"] = f.lower(x).compile().as_text().count("jcoccl_fused_")
        except Exception as e:  # report and continue with the other cases
          outs[backend] = f"{type(e).__name__}: {e}"
      for i, op in enumerate(OPS):
        ok = (
          not isinstance(outs["xla"], str)
          and not isinstance(outs["fused"], str)
          and _bits_equal(outs["xla"][i], outs["fused"][i])
        )
        err = (
          outs["fused"]
          if isinstance(outs["fused"], str)
          else (outs["xla"] if isinstance(outs["xla"], str) else "")
        )
        record(
          dict(
            op=op,
            compressor=name,
            dtype=jnp.dtype(dtype).name,
            bit_identical=ok,
            fused_calls=outs.get("hlo_fused_calls"),
            error=err[:500],
          )
        )
        print(
          f"single  {op:15s} {name:14s} {jnp.dtype(dtype).name:9s} "
          f"{'OK' if ok else 'MISMATCH ' + err[:200]}",
          flush=True,
        )
  # Hierarchical over a (1, 1) mesh.
  jcoccl.init(mesh2)
  levels = (_compressors()["int4_asym"], _compressors()["int8"])
  spec2 = jax.P(("node", "gpu"))
  outs = {}
  for backend in ("xla", "fused"):

    def hbody(v, backend=backend):
      return jcoccl.all_reduce(
        v,
        ("node", "gpu"),
        compressor=levels,
        algorithm="hierarchical",
        backend=backend,
        chunks=2,
        min_bytes=0,
      )

    f = jax.jit(jax.shard_map(hbody, mesh=mesh2, in_specs=spec2, out_specs=spec2))
    try:
      outs[backend] = np.asarray(f(_put(jnp.asarray(x_host), mesh2, spec2)))
    except Exception as e:
      outs[backend] = f"{type(e).__name__}: {e}"
  ok = (
    not isinstance(outs["xla"], str)
    and not isinstance(outs["fused"], str)
    and _bits_equal(outs["xla"], outs["fused"])
  )
  err = next((o for o in outs.values() if isinstance(o, str)), "")
  record(
    dict(
      op="hierarchical",
      compressor="int4_asym/int8",
      dtype="float32",
      bit_identical=ok,
      error=err[:500],
    )
  )
  print(
    f"single  hierarchical    int4_asym/int8 float32   {'OK' if ok else 'MISMATCH ' + err[:200]}"
  )
  jcoccl.shutdown()
  bad = [r for r in results if not r["bit_identical"]]
  _write(
    args.out,
    dict(
      kind="single", platform=args.platform, results=results, mismatches=len(bad), complete=True
    ),
  )
  print(
    f"VERDICT single: {'PASS' if not bad else 'FAIL'} ({len(results) - len(bad)}/"
    f"{len(results)} bit-identical, fused vs xla at world 1)",
    flush=True,
  )
  return 1 if bad else 0


# ----------------------------------------------------------------------------------------
# worker: one rank of a multi-process NCCL group on the shared GPU.


def _inputs(rank: int, n: int, m: int, rows: int, dtype: Any) -> Any:
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(1000 + rank)
  x = rng.standard_normal((rows, m)).astype(np.float32)
  x[rng.random(x.shape) < 0.01] *= 200.0
  return jnp.asarray(x, dtype)


def _reference(op: str, comp: Any, xs: list, me: int, n: int, m: int, dtype: Any) -> Any:
  """The expected output of rank ``me`` from the jnp specification (on the CPU)."""
  import jax.numpy as jnp

  enc = lambda v: comp.encode_rows(v, impl="jnp")
  if op == "one_shot":
    got = jnp.concatenate([enc(x[:1]) for x in xs])
    return comp.decode_sum(got, m, dtype, impl="jnp")[None]
  if op == "two_shot":
    e = [enc(x) for x in xs]
    shards = jnp.stack(
      [
        comp.decode_sum_encode(jnp.stack([e[r][j] for r in range(n)]), m, dtype, impl="jnp")
        for j in range(n)
      ]
    )
    return comp.decode_rows(shards, m, dtype, impl="jnp")[None]
  if op == "reduce_scatter":
    got = jnp.stack([enc(x)[me] for x in xs])
    return comp.decode_sum(got, m, dtype, impl="jnp")[None]
  if op == "all_gather":
    got = jnp.concatenate([enc(x[:1]) for x in xs])
    return comp.decode_rows(got, m, dtype, impl="jnp")[None]
  if op == "all_to_all":
    got = jnp.stack([enc(x)[me] for x in xs])
    return comp.decode_rows(got, m, dtype, impl="jnp")[None]
  if op == "ppermute":
    if me == 0:
      return jnp.zeros((1, m), dtype)
    return comp.decode_rows(enc(xs[me - 1][:1]), m, dtype, impl="jnp")
  raise ValueError(op)


def _layout(op: str, x: Any, n: int, m: int) -> tuple[Any, tuple]:
  """Engine input (k = 1) and output shape for ``op``, as jcoccl's fused backend lays
  them out (:func:`jcoccl._src.engine.fused_ops.engine_shapes`); ``x`` is a rank's ``[n, m]``."""
  from jcoccl._src.engine.fused_ops import engine_shapes

  ishape, oshape = engine_shapes(op, 1, n, m)
  return (x[:1] if len(ishape) == 2 else x).reshape(ishape), oshape


def _engine(
  op: str, x: Any, out_shape: tuple, cid: int, n: int, comp: Any, m: int, k: int = 1
) -> Any:
  """One engine call; ``op`` is an engine algorithm or "plain_<collective>" (NCCL's own)."""
  import numpy as np

  from jcoccl import native as engine

  if op.startswith("plain_"):
    return engine.engine_call(
      op[len("plain_") :], "plain", x, out_shape, cid, n, None, k, m, platform=PLATFORM
    )
  name = op if op in ("reduce_scatter", "all_gather", "all_to_all", "ppermute") else "all_reduce"
  perm = None
  if op == "ppermute":
    perm = np.array([i + 1 if i + 1 < n else -1 for i in range(n)], np.int32)
  return engine.engine_call(
    name, op, x, out_shape, cid, n, comp, k, m, platform=PLATFORM, perm=perm
  )


def _wait_file(path: str, timeout: float) -> bytes:
  t0 = time.time()
  while not os.path.exists(path):
    if time.time() - t0 > timeout:
      raise TimeoutError(f"no NCCL unique id at {path} after {timeout} s (rank 0 failed?)")
    time.sleep(0.05)
  time.sleep(0.05)
  with open(path, "rb") as f:
    return f.read()


def _comm_init_nccl(args: argparse.Namespace, me: int, n: int, cid: int) -> str | None:
  """NCCL communicator of the launch's ranks; the ncclUniqueId travels through a file.
  Returns an error message, or None."""
  from jcoccl import native

  mod = native.module("cuda")
  if mod is None:
    return f"jcoccl._cuda missing: {native.import_error('cuda')}"
  uid_path = os.path.join(args.dir, "nccl_uid")
  if me == 0:
    uid = mod.nccl_unique_id()
    with open(uid_path + ".tmp", "wb") as f:
      f.write(uid)
    os.replace(uid_path + ".tmp", uid_path)
  else:
    uid = _wait_file(uid_path, 60)
  try:
    mod.nccl_comm_init(cid, uid, n, [(0, me)])
  except Exception as e:
    print(f"[rank {me}] NCCL REFUSED the multi-process setup: {e}", flush=True)
    return f"NCCL init refused: {e}"
  return None


def _comm_init_host(args: argparse.Namespace, me: int, n: int, cid: int) -> str | None:
  """The CPU dry run's communicator: the in-process host transport (world size 1 only)."""
  import jax

  from jcoccl import native

  if n != 1:
    return "--platform cpu runs at world size 1 only (the host transport is in-process)"
  mod = native.module("cpu")
  if mod is None:
    return f"jcoccl._cpu missing: {native.import_error('cpu')}"
  native.register("cpu")
  mod.fused_host_comm_create(cid, [jax.devices("cpu")[0].id])
  return None


def cmd_worker(args: argparse.Namespace) -> int:
  global PLATFORM
  import jax

  from jcoccl import native

  me, n = args.rank, args.world
  report: dict[str, Any] = dict(
    kind="worker", rank=me, world=n, platform=args.platform, checks=[], bench=[], done=False
  )
  out_path = os.path.join(args.dir, f"rank{me}.json")
  PLATFORM = "cuda" if args.platform == "gpu" else "cpu"
  cid = 1 if args.platform == "gpu" else (1 << 50) + 12
  init = _comm_init_nccl if args.platform == "gpu" else _comm_init_host
  err = init(args, me, n, cid)
  if err is not None:
    report["error"] = err
    _write(out_path, report)
    return 3 if "refused" in err else 2
  if args.platform == "gpu":
    report["nccl_version"] = native.module("cuda").nccl_version()
  dev = _devices(args.platform)[0]
  cpu = jax.devices("cpu")[0]
  progress = lambda: _write(out_path, report)  # every finished check or timing is kept
  try:
    if not args.no_checks:
      _checks(cid, me, n, dev, cpu, report["checks"], progress, args.compressors)
      _plain_checks(cid, me, n, dev, cpu, report["checks"], progress)
    if args.bench:
      _bench(cid, me, n, dev, args.sizes_mib, args.iters, report["bench"], progress)
  finally:
    native.module(PLATFORM).fused_comm_destroy(cid)
  bad = sum(not c["ok"] for c in report["checks"])
  report.update(mismatches=bad, done=True)
  _write(out_path, report)
  return 1 if bad else 0


def _checks(
  cid: int,
  me: int,
  n: int,
  dev: Any,
  cpu: Any,
  out: list | None = None,
  progress=lambda: None,
  only: str | None = None,
) -> list:
  """Every compressed engine op on ``dev`` against the jnp specification, bit for bit (the
  compressors whose names match the regex ``only``, all by default). Results are appended to
  ``out`` (returned), calling ``progress()`` after each."""
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np

  m = 4096
  out = [] if out is None else out
  comps = {k: c for k, c in _compressors().items() if only is None or re.search(only, k)}
  for cname, comp in comps.items():
    for dtype in (jnp.float32, jnp.bfloat16):
      with jax.default_device(cpu):
        xs = [_inputs(r, n, m, n, dtype) for r in range(n)]
      for op in OPS:
        inp, oshape = _layout(op, xs[me], n, m)
        try:
          got = np.asarray(_engine(op, jax.device_put(inp, dev), oshape, cid, n, comp, m))
          with jax.default_device(cpu):
            ref = np.asarray(_reference(op, comp, xs, me, n, m, dtype)).reshape(oshape)
          ok = _bits_equal(got, ref)
          err = ""
        except Exception as e:
          ok, err = False, f"{type(e).__name__}: {e}"[:500]
        out.append(
          dict(
            op=op, compressor=cname, dtype=jnp.dtype(dtype).name, bit_identical=ok, ok=ok, error=err
          )
        )
        progress()
        if me == 0 or not ok:
          print(
            f"[rank {me}/{n}] {op:15s} {cname:14s} {jnp.dtype(dtype).name:9s} "
            f"{'OK' if ok else 'MISMATCH ' + err}",
            flush=True,
          )
  return out


def _fold_bound(n: int) -> float:
  """Two float32 summation orders of n terms differ by at most 2 gamma_{n-1} sum|x_r|
  (gamma_j = j u / (1 - j u), u = eps32 / 2): NCCL's order vs the rank-order fold."""
  import numpy as np

  u = float(np.finfo(np.float32).eps) / 2
  return 2 * (n - 1) * u / (1 - (n - 1) * u)


def _plain_checks(
  cid: int, me: int, n: int, dev: Any, cpu: Any, out: list | None = None, progress=lambda: None
) -> list:
  """NCCL's plain ops on ``dev`` against numpy: all_gather bit for bit; all_reduce and
  reduce_scatter within float32 summation rounding of the rank-order fold (NCCL sums in
  its own order). The all_reduce digest lets `launch` compare the ranks' bits."""
  import hashlib

  import jax
  import jax.numpy as jnp
  import numpy as np

  m = 4096
  with jax.default_device(cpu):
    xs = [np.asarray(_inputs(r, n, m, n, jnp.float32)) for r in range(n)]  # [n, m] each
  x64 = np.stack(xs).astype(np.float64)
  fold = xs[0].copy()
  for r in range(1, n):
    fold = fold + xs[r]
  bound = _fold_bound(n) * np.abs(x64).sum(axis=0)
  cases = {
    "plain_all_reduce": (
      xs[me].reshape(1, n * m),
      (1, n * m),
      n * m,
      fold.reshape(1, n * m),
      bound.reshape(1, n * m),
    ),
    "plain_reduce_scatter": (xs[me].reshape(1, n, m), (1, m), m, fold[me][None], bound[me][None]),
    "plain_all_gather": (xs[me][:1], (1, n, m), m, np.stack([x[0] for x in xs])[None], None),
  }
  out = [] if out is None else out
  for op, (inp, oshape, mm, want, tol) in cases.items():
    digest = ""
    try:
      got = np.asarray(_engine(op, jax.device_put(jnp.asarray(inp), dev), oshape, cid, n, None, mm))
      digest = hashlib.sha256(got.tobytes()).hexdigest()
      if tol is None:
        ok, err = _bits_equal(got, want), ""
      else:
        excess = np.abs(got.astype(np.float64) - want) - tol
        ok = got.shape == want.shape and bool(np.all(excess <= 0))
        err = "" if ok else f"max error over the bound: {float(np.max(excess)):.3g}"
    except Exception as e:
      ok, err = False, f"{type(e).__name__}: {e}"[:500]
    out.append(dict(op=op, compressor="nccl", dtype="float32", ok=ok, error=err, digest=digest))
    progress()
    if me == 0 or not ok:
      print(
        f"[rank {me}/{n}] {op:22s} nccl      float32   {'OK' if ok else 'MISMATCH ' + err}",
        flush=True,
      )
  # Raw bytes: the 2-byte dtype moves exactly as well.
  with jax.default_device(cpu):
    hs = [_inputs(r, n, m, 1, jnp.bfloat16) for r in range(n)]
  try:
    got = np.asarray(
      _engine("plain_all_gather", jax.device_put(hs[me], dev), (1, n, m), cid, n, None, m)
    )
    ok, err = _bits_equal(got, np.stack([np.asarray(h)[0] for h in hs])[None]), ""
  except Exception as e:
    ok, err = False, f"{type(e).__name__}: {e}"[:500]
  out.append(dict(op="plain_all_gather", compressor="nccl", dtype="bfloat16", ok=ok, error=err))
  progress()
  return out


def _bench_cases(n: int) -> dict:
  """op -> (nccl-tests bus factor, [(label, engine algo, compressor or None)])."""
  from jcoccl import compressors as jc

  comps = {
    "int8": jc.int8(block_size=256),
    "int4": jc.int4(block_size=128),
    "fp8": jc.fp8("e4m3", block_size=128),
  }
  rows = lambda algo: (
    [("nccl", "plain_" + op_of[algo], None), ("engine_none", algo, None)]
    + [(c, algo, comp) for c, comp in comps.items()]
  )
  op_of = {"two_shot": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}
  ar = rows("two_shot") + [("int8/one_shot", "one_shot", comps["int8"])]
  return {
    "all_reduce": (2.0 * (n - 1) / n, ar),
    "all_gather": ((n - 1) / n, rows("all_gather")),
    "reduce_scatter": ((n - 1) / n, rows("reduce_scatter")),
  }


def _bench_layout(algo: str, n: int, m: int) -> tuple[tuple, tuple, int]:
  """(input shape, output shape, engine row length) for one timed call of n*m float32: an
  all_reduce (NCCL's plain one too) is one row of n*m, the others n rows of m."""
  from jcoccl._src.engine.fused_ops import engine_shapes

  base = algo.removeprefix("plain_")
  engine, mm = ("one_shot", n * m) if base in ("all_reduce", "one_shot") else (base, m)
  return (*engine_shapes(engine, 1, n, mm), mm)


def _bench(
  cid: int,
  me: int,
  n: int,
  dev: Any,
  sizes_mib: list,
  iters: int,
  rows: list | None = None,
  progress=lambda: None,
) -> list:
  """Times compressed collectives against NCCL's at each size (float32; bytes = the full
  buffer as nccl-tests counts it: count * 4 for all_reduce, the gathered / scattered buffer
  for all_gather / reduce_scatter)."""
  import jax
  import jax.numpy as jnp

  barrier_in = jax.device_put(jnp.zeros((1, 1), jnp.float32), dev)
  barrier = jax.jit(lambda v: _engine("plain_all_reduce", v, (1, 1), cid, n, None, 1))
  rows = [] if rows is None else rows
  for mib in sizes_mib:
    total = int(mib * (1 << 20)) // 4
    m = max(512, (total // n) // 512 * 512)  # per-rank row length, granule-aligned
    buf = n * m * 4
    for opname, (factor, cases) in _bench_cases(n).items():
      times = {}
      for label, algo, comp in cases:
        ishape, oshape, mm = _bench_layout(algo, n, m)
        x = jax.device_put(jax.random.normal(jax.random.key(me), ishape, jnp.float32), dev)
        f = jax.jit(
          lambda v, algo=algo, oshape=oshape, comp=comp, mm=mm: _engine(
            algo, v, oshape, cid, n, comp, mm
          )
        )
        jax.block_until_ready(f(x))
        jax.block_until_ready(f(x))
        jax.block_until_ready(barrier(barrier_in))  # every rank starts the clock together
        t0 = time.perf_counter()
        outs = [f(x) for _ in range(max(1, iters))]
        jax.block_until_ready(outs)
        t = (time.perf_counter() - t0) / max(1, iters)
        times[label] = t
        algbw = buf / t / 1e9
        rows.append(
          dict(
            op=opname,
            bytes=buf,
            compressor=label,
            algo=algo,
            time_us=t * 1e6,
            algbw_GBps=algbw,
            busbw_GBps=algbw * factor,
            speedup_vs_nccl=None,
          )
        )
      for r in rows[-len(cases) :]:
        r["speedup_vs_nccl"] = times["nccl"] / times[r["compressor"]]
      progress()
      if me == 0:
        for r in rows[-len(cases) :]:
          print(
            f"[bench n={n}] {r['op']:14s} {r['bytes']:>12d} {r['compressor']:13s} "
            f"{r['time_us']:>11.1f} us  algbw {r['algbw_GBps']:7.3f}  busbw "
            f"{r['busbw_GBps']:7.3f} GB/s  x{r['speedup_vs_nccl']:.2f} vs nccl",
            flush=True,
          )
  return rows


# ----------------------------------------------------------------------------------------
# launch: the multi-process run.


def _worker_cmd(args: argparse.Namespace, d: str, r: int) -> list[str]:
  return (
    [
      sys.executable,
      os.path.abspath(__file__),
      "worker",
      "--rank",
      str(r),
      "--world",
      str(args.world),
      "--dir",
      d,
      "--platform",
      args.platform,
      "--iters",
      str(args.iters),
      "--sizes-mib",
      *[str(s) for s in args.sizes_mib],
    ]
    + (["--bench"] if args.bench else [])
    + (["--no-checks"] if args.no_checks else [])
    + (["--compressors", args.compressors] if args.compressors else [])
  )


def cmd_launch(args: argparse.Namespace) -> int:
  d = args.dir or tempfile.mkdtemp(prefix=f"jcoccl_w{args.world}_")
  os.makedirs(d, exist_ok=True)
  for name in os.listdir(d):  # a previous run's files must not be mistaken for this one's
    if name.startswith(("rank", "nccl_uid")):
      os.remove(os.path.join(d, name))
  procs = []
  for r in range(args.world):
    env = dict(os.environ)
    env.update(
      nccl_env.rank_env(r),
      JCOCCL_TIMEOUT_S=str(args.timeout),
      NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"),
    )
    log = open(os.path.join(d, f"rank{r}.log"), "w")  # noqa: SIM115 (closed after the rank exits)
    procs.append(
      (
        subprocess.Popen(_worker_cmd(args, d, r), env=env, stdout=log, stderr=subprocess.STDOUT),
        log,
      )
    )
  # The launch's own deadline comes before the caller's step limit, so that the summary of
  # whatever the ranks finished is always written.
  deadline = time.time() + (args.deadline if args.deadline else args.timeout * 3)
  rcs = []
  for p, log in procs:
    try:
      rcs.append(p.wait(timeout=max(1, deadline - time.time())))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
      rcs.append("timeout")
    log.close()
  ranks = []
  for r in range(args.world):
    path = os.path.join(d, f"rank{r}.json")
    try:
      with open(path) as f:
        ranks.append(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
      ranks.append({"rank": r, "error": f"no report ({e})"})
    with open(os.path.join(d, f"rank{r}.log")) as f:
      tail = f.read()[-3000:]
    ranks[-1]["log_tail"] = tail
    print(f"----- rank {r} (rc={rcs[r]}) log tail -----\n{tail}", flush=True)
  refused = any(
    "refused" in str(x.get("error", "")).lower() or "Duplicate GPU" in x["log_tail"] for x in ranks
  )
  if refused:
    print(
      f"NCCL REFUSED {args.world} ranks on one GPU with distinct NCCL_HOSTID "
      "(see the log tails above)",
      flush=True,
    )
  # NCCL's all_reduce usually hands every rank the same bits (ring/tree broadcast the reduced
  # chunks); recorded for information, not counted as a mismatch.
  digests = {
    c.get("digest") for x in ranks for c in x.get("checks", []) if c.get("op") == "plain_all_reduce"
  }
  same = len(digests) == 1 and "" not in digests and None not in digests
  print(f"plain NCCL all_reduce bits identical on every rank: {same}", flush=True)
  failed = sum(not c.get("ok") for x in ranks for c in x.get("checks", []))
  checks = sum(len(x.get("checks", [])) for x in ranks)
  summary = dict(
    kind="launch",
    world=args.world,
    platform=args.platform,
    returncodes=[str(c) for c in rcs],
    refused=refused,
    plain_all_reduce_same_bits_on_all_ranks=same,
    ranks=ranks,
    bench=ranks[0].get("bench", []) if ranks else [],
    mismatches=failed,
    checks=checks,
    complete=all(x.get("done") for x in ranks),
  )
  _write(args.out, summary)
  ok = not refused and all(c == 0 for c in rcs)
  print(
    f"VERDICT world{args.world}: {'PASS' if ok else 'REFUSED' if refused else 'FAIL'} "
    f"({checks - failed}/{checks} checks OK, {len(summary['bench'])} bench rows, "
    f"returncodes {summary['returncodes']})",
    flush=True,
  )
  if refused:
    return 3
  return 0 if ok else 1


# ----------------------------------------------------------------------------------------
# report.


def cmd_report(args: argparse.Namespace) -> int:
  parts = {}
  for name in sorted(os.listdir(args.dir)):
    if name.endswith(".json") and name != "summary.json":
      try:
        with open(os.path.join(args.dir, name)) as f:
          parts[name] = json.load(f)
      except (OSError, json.JSONDecodeError) as e:
        parts[name] = {"error": str(e)}
  spread = _spread(parts)
  _write(os.path.join(args.dir, "summary.json"), {**parts, "spread": spread})
  lines = ["# jcoccl GPU check summary", ""]
  for name, p in parts.items():
    if p.get("kind") == "single":
      lines.append(
        f"{name}: world 1 fused vs xla: {len(p['results']) - p['mismatches']}/"
        f"{len(p['results'])} bit-identical"
        f"{'' if p.get('complete', True) else ' (incomplete: cut short)'}"
      )
    elif p.get("kind") == "launch":
      lines.append(
        f"{name}: world {p['world']}: refused={p['refused']} "
        f"returncodes={p['returncodes']} mismatches={p['mismatches']} "
        "nccl all_reduce same bits on all ranks="
        f"{p.get('plain_all_reduce_same_bits_on_all_ranks')}"
      )
      if p.get("bench"):
        lines.append(
          "  baseline nccl = ncclAllReduce/ncclReduceScatter (f32 sum), ncclAllGather;"
          " speedup = t_nccl / t; engine_none = engine + identity codec"
        )
        lines.append(
          f"  {'op':14s} {'bytes':>12s} {'codec':13s} {'time(us)':>11s} "
          f"{'algbw':>8s} {'busbw':>8s} {'speedup':>8s}"
        )
        for r in p["bench"]:
          lines.append(
            f"  {r['op']:14s} {r['bytes']:>12d} {r['compressor']:13s} "
            f"{r['time_us']:>11.1f} {r['algbw_GBps']:>8.3f} {r['busbw_GBps']:>8.3f} "
            f"{r['speedup_vs_nccl']:>8.2f}"
          )
    elif "cases" in p or isinstance(p.get("mismatches"), list):  # tools/gpu_codecs.py
      bad = p.get("mismatches")
      lines.append(
        f"{name}: codecs vs CPU spec: "
        f"{'incomplete' if bad is None else f'{len(bad)} mismatches'}, "
        f"{len(p.get('cases', []))} cases, "
        f"{len(p.get('subnormal_differences') or [])} subnormal-data differences"
      )
      for r in p.get("bench", []):
        lines.append(
          f"  {r['mib']:>8} MiB {r['codec']:36s} {r['op']:24s} {r['gbs']:8.1f} GB/s"
          + (f" ({100 * r['vs_copy']:.0f}% of copy)" if "vs_copy" in r else "")
        )
    else:
      lines.append(f"{name}: {json.dumps(p)[:300]}")
  lines += _spread_lines(spread)
  text = "\n".join(lines) + "\n"
  with open(os.path.join(args.dir, "summary.txt"), "w") as f:
    f.write(text)
  print(text)
  return 0


def _spread(parts: dict) -> dict:
  """Median, min and max of every timing over the rounds that measured it.

  A timing is a collective (world, op, bytes, codec: time and speedup over NCCL) or a codec
  (MiB, codec, op: GB/s); the rounds are the JSON files that hold it (bench2_r1.json, ...).
  """
  coll: dict[str, dict[str, list]] = {}
  codec: dict[str, list] = {}
  for p in parts.values():
    for r in p.get("bench", []) if isinstance(p, dict) else []:
      if p.get("kind") == "launch":
        key = f"world {p['world']} {r['op']} {r['bytes']} {r['compressor']}"
        d = coll.setdefault(key, {"time_us": [], "speedup_vs_nccl": []})
        d["time_us"].append(r["time_us"])
        d["speedup_vs_nccl"].append(r["speedup_vs_nccl"])
      elif "gbs" in r:
        codec.setdefault(f"{r['mib']} MiB {r['codec']} {r['op']}", []).append(r["gbs"])

  def stats(v: list) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": len(v)}

  return {
    "collectives": {k: {m: stats(v) for m, v in d.items()} for k, d in coll.items()},
    "codecs_gbs": {k: stats(v) for k, v in codec.items()},
  }


def _spread_lines(spread: dict) -> list[str]:
  """summary.txt's table of medians and [min, max] over rounds (timings seen twice or more)."""
  coll = {k: d for k, d in spread["collectives"].items() if d["time_us"]["rounds"] > 1}
  codec = {k: d for k, d in spread["codecs_gbs"].items() if d["rounds"] > 1}
  if not coll and not codec:
    return []
  lines = ["", "# medians over rounds [min, max]"]
  for k, d in coll.items():
    t, s = d["time_us"], d["speedup_vs_nccl"]
    lines.append(
      f"  {k:48s} {t['median']:>10.1f} us [{t['min']:.1f}, {t['max']:.1f}]  "
      f"speedup {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]  ({t['rounds']} rounds)"
    )
  for k, d in codec.items():
    lines.append(
      f"  {k:48s} {d['median']:>8.1f} GB/s [{d['min']:.1f}, {d['max']:.1f}]  ({d['rounds']} rounds)"
    )
  return lines


def _write(path: str, obj: Any) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("single", help="world size 1: fused vs xla backend, bit for bit")
  s.add_argument("--out", default="gpu_out/single.json")
  s.add_argument(
    "--platform",
    choices=("gpu", "cpu"),
    default="gpu",
    help="cpu: the CI dry run (host transport instead of NCCL)",
  )
  s.add_argument("--compressors", default=None, help="regex: only these compressors")
  for name in ("launch", "worker"):
    w = sub.add_parser(name, help="multi-process NCCL run" if name == "launch" else "one rank")
    w.add_argument("--world", type=int, default=2)
    w.add_argument(
      "--platform",
      choices=("gpu", "cpu"),
      default="gpu",
      help="cpu: the CI dry run at --world 1 (host transport)",
    )
    w.add_argument("--bench", action="store_true", help="also time compressed vs NCCL")
    w.add_argument("--no-checks", action="store_true", help="skip the correctness checks")
    w.add_argument("--compressors", default=None, help="regex: only these compressors' checks")
    w.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    w.add_argument("--iters", type=int, default=5)
    if name == "launch":
      w.add_argument("--out", default="gpu_out/world.json")
      w.add_argument(
        "--dir",
        default=None,
        help="directory for the ranks' logs and JSON (default: a new temp dir)",
      )
      w.add_argument("--timeout", type=float, default=60.0, help="JCOCCL_TIMEOUT_S for the workers")
      w.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds after which unfinished ranks are killed and the summary "
        "written (default: 3 x --timeout)",
      )
    else:
      w.add_argument("--rank", type=int, required=True)
      w.add_argument("--dir", required=True)
  r = sub.add_parser("report", help="merge the JSON files of a directory")
  r.add_argument("--dir", default="gpu_out")
  args = p.parse_args(argv)
  return {
    "single": cmd_single,
    "launch": cmd_launch,
    "worker": cmd_worker,
    "report": cmd_report,
  }[args.cmd](args)


if __name__ == "__main__":
  sys.exit(main())
