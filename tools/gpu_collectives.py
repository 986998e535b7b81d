#!/usr/bin/env python3
"""GPU checks of jcoccl's fused engine (CUDA codecs + NCCL), run by tools/gpu_check.sh.

Subcommands:
  single   world size 1 through jax on the GPU: every fused op (jcoccl.init + backend="fused")
           against backend="xla", compared bit for bit.
  launch   starts --world worker processes on the one GPU, each with its own NCCL_HOSTID and
           NCCL_SOCKET_IFNAME=lo (so NCCL treats them as separate nodes and uses its socket
           transport over loopback); the ncclUniqueId travels through a file. Each worker
           checks every fused op against a reference computed independently with the jnp codec
           specification on the CPU, then (with --bench) times compressed vs uncompressed
           all_reduce / all_gather / reduce_scatter (nccl-tests algbw/busbw). If NCCL refuses
           (e.g. "Duplicate GPU detected"), that is printed clearly and the command exits 3.
  worker   one rank of `launch` (internal).
  report   merges the JSON files of a directory into summary.json and summary.txt.

The uncompressed baseline is the same engine and NCCL transport with the identity codec
("none": raw bytes), all_reduce as two_shot (reduce-scatter + all-gather traffic, like
NCCL's ring), so the ratio isolates what compression buys.

Example:
  python tools/gpu_collectives.py single --out gpu_out/single.json
  python tools/gpu_collectives.py launch --world 2 --bench --out gpu_out/world2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

PLATFORM = "cuda"  # the engine's platform (tests may point the helpers at "cpu")
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
  return a.shape == b.shape and a.dtype == b.dtype and bool(
      np.array_equal(a.view(np.uint8), b.view(np.uint8)))


# ----------------------------------------------------------------------------------------
# single: world size 1 through the public API.

def cmd_single(args: argparse.Namespace) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jcoccl

  results = []
  gpus = jax.devices("gpu")
  mesh = jax.make_mesh((1,), ("x",), devices=gpus[:1])
  mesh2 = jax.make_mesh((1, 1), ("node", "gpu"), devices=gpus[:1])
  rng = np.random.default_rng(0)
  x_host = rng.standard_normal((8, 1000)).astype(np.float32)
  x_host[0, 3] = np.nan
  jcoccl.init(mesh)
  for name, comp in _compressors().items():
    for dtype in (jnp.float32, jnp.bfloat16):
      for backend_pair in [("xla", "fused")]:
        outs = {}
        for backend in backend_pair:
          kw = dict(compressor=comp, backend=backend, chunks=2, min_bytes=0)

          def body(v, kw=kw):
            return (jcoccl.all_reduce(v, "x", algorithm="one_shot", **kw),
                    jcoccl.all_reduce(v, "x", algorithm="two_shot", **kw),
                    jcoccl.reduce_scatter(v, "x", scatter_dimension=0, tiled=True, **kw),
                    jcoccl.all_gather(v, "x", axis=0, tiled=True, **kw),
                    jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw),
                    jcoccl.ppermute(v, "x", [(0, 0)], **kw))

          x = jax.device_put(jnp.asarray(x_host, dtype), gpus[0])
          f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
          try:
            outs[backend] = [np.asarray(o) for o in f(x)]
            if backend == "fused":
              text = f.lower(x).compile().as_text()
              outs["hlo_fused_calls"] = text.count("jcoccl_fused_")
          except Exception as e:  # report and continue with the other cases
            outs[backend] = f"{type(e).__name__}: {e}"
        for i, op in enumerate(OPS):
          ok = (not isinstance(outs["xla"], str) and not isinstance(outs["fused"], str)
                and _bits_equal(outs["xla"][i], outs["fused"][i]))
          err = outs["fused"] if isinstance(outs["fused"], str) else (
              outs["xla"] if isinstance(outs["xla"], str) else "")
          results.append(dict(op=op, compressor=name, dtype=jnp.dtype(dtype).name,
                              bit_identical=ok, error=err[:500]))
          print(f"single  {op:15s} {name:14s} {jnp.dtype(dtype).name:9s} "
                f"{'OK' if ok else 'MISMATCH ' + err[:200]}", flush=True)
  # Hierarchical over a (1, 1) mesh.
  jcoccl.init(mesh2)
  levels = (_compressors()["int4_asym"], _compressors()["int8"])
  outs = {}
  for backend in ("xla", "fused"):
    def hbody(v, backend=backend):
      return jcoccl.all_reduce(v, ("node", "gpu"), compressor=levels, algorithm="hierarchical",
                               backend=backend, chunks=2, min_bytes=0)
    f = jax.jit(jax.shard_map(hbody, mesh=mesh2, in_specs=jax.P(("node", "gpu")),
                              out_specs=jax.P(("node", "gpu"))))
    try:
      outs[backend] = np.asarray(f(jax.device_put(jnp.asarray(x_host), gpus[0])))
    except Exception as e:
      outs[backend] = f"{type(e).__name__}: {e}"
  ok = not isinstance(outs["xla"], str) and not isinstance(outs["fused"], str) and _bits_equal(
      outs["xla"], outs["fused"])
  results.append(dict(op="hierarchical", compressor="int4_asym/int8", dtype="float32",
                      bit_identical=ok))
  print(f"single  hierarchical    int4_asym/int8 float32   {'OK' if ok else 'MISMATCH'}")
  jcoccl.shutdown()
  bad = [r for r in results if not r["bit_identical"]]
  _write(args.out, dict(kind="single", results=results, mismatches=len(bad)))
  print(f"single: {len(results) - len(bad)}/{len(results)} bit-identical")
  return 1 if bad else 0


# ----------------------------------------------------------------------------------------
# worker: one rank of a multi-process NCCL group on the shared GPU.

def _inputs(rank: int, n: int, m: int, rows: int, dtype: Any) -> Any:
  import numpy as np
  import jax.numpy as jnp
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
    shards = jnp.stack([comp.decode_sum_encode(jnp.stack([e[r][j] for r in range(n)]), m, dtype,
                                               impl="jnp") for j in range(n)])
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
  """Engine input (k = 1) and output shape for ``op``."""
  if op in ("one_shot", "all_gather", "ppermute"):
    inp = x[:1].reshape(1, m)
  else:
    inp = x.reshape(1, n, m)
  out = {"one_shot": (1, m), "ppermute": (1, m), "reduce_scatter": (1, m),
         "all_gather": (1, n, m)}.get(op, (1, n, m))
  return inp, out


def _engine(op: str, x: Any, out_shape: tuple, cid: int, n: int, comp: Any, m: int,
            k: int = 1) -> Any:
  import numpy as np
  from jcoccl._src import fused
  name = op if op in ("reduce_scatter", "all_gather", "all_to_all", "ppermute") else "all_reduce"
  perm = None
  if op == "ppermute":
    perm = np.array([i + 1 if i + 1 < n else -1 for i in range(n)], np.int32)
  return fused.engine_call(name, op, x, out_shape, cid, n, comp, k, m, platform=PLATFORM,
                           perm=perm)


def _wait_file(path: str, timeout: float) -> bytes:
  t0 = time.time()
  while not os.path.exists(path):
    if time.time() - t0 > timeout:
      raise TimeoutError(f"no NCCL unique id at {path} after {timeout} s (rank 0 failed?)")
    time.sleep(0.05)
  time.sleep(0.05)
  with open(path, "rb") as f:
    return f.read()


def cmd_worker(args: argparse.Namespace) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jcoccl._src import _ffi

  me, n = args.rank, args.world
  report: dict[str, Any] = dict(kind="worker", rank=me, world=n, checks=[], bench=[])
  out_path = os.path.join(args.dir, f"rank{me}.json")
  mod = _ffi.native_module("cuda")
  if mod is None:
    report["error"] = f"jcoccl._cuda missing: {_ffi.native_import_error('cuda')}"
    _write(out_path, report)
    return 2
  report["nccl_version"] = mod.nccl_version()
  uid_path = os.path.join(args.dir, "nccl_uid")
  if me == 0:
    uid = mod.nccl_unique_id()
    with open(uid_path + ".tmp", "wb") as f:
      f.write(uid)
    os.replace(uid_path + ".tmp", uid_path)
  else:
    uid = _wait_file(uid_path, 60)
  cid = 1
  try:
    mod.nccl_comm_init(cid, uid, n, [(0, me)])
  except Exception as e:
    report["error"] = f"NCCL init refused: {e}"
    _write(out_path, report)
    print(f"[rank {me}] NCCL REFUSED the multi-process setup: {e}", flush=True)
    return 3
  gpu = jax.devices("gpu")[0]
  cpu = jax.devices("cpu")[0]
  m = 4096
  bad = 0
  for cname, comp in _compressors().items():
    for dtype in (jnp.float32, jnp.bfloat16):
      with jax.default_device(cpu):
        xs = [_inputs(r, n, m, n, dtype) for r in range(n)]
      for op in OPS:
        inp, oshape = _layout(op, xs[me], n, m)
        try:
          got = np.asarray(_engine(op, jax.device_put(inp, gpu), oshape, cid, n, comp, m))
          with jax.default_device(cpu):
            ref = np.asarray(_reference(op, comp, xs, me, n, m, dtype)).reshape(oshape)
          ok = _bits_equal(got, ref)
          err = ""
        except Exception as e:
          ok, err = False, f"{type(e).__name__}: {e}"[:500]
        bad += not ok
        report["checks"].append(dict(op=op, compressor=cname, dtype=jnp.dtype(dtype).name,
                                     bit_identical=ok, error=err))
        if me == 0 or not ok:
          print(f"[rank {me}/{n}] {op:15s} {cname:14s} {jnp.dtype(dtype).name:9s} "
                f"{'OK' if ok else 'MISMATCH ' + err}", flush=True)
  if args.bench:
    report["bench"] = _bench(cid, me, n, gpu, args.sizes_mib, args.iters)
  mod.fused_comm_destroy(cid)
  report["mismatches"] = bad
  _write(out_path, report)
  return 1 if bad else 0


def _bench(cid: int, me: int, n: int, gpu: Any, sizes_mib: list, iters: int) -> list:
  """Times compressed vs identity-codec collectives at each size (f32, bytes = buffer size)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jcoccl import compressors as jc

  codecs = {"none": jc.none(), "int8": jc.int8(block_size=256), "int4": jc.int4(block_size=128),
            "fp8": jc.fp8("e4m3", block_size=128)}
  ops = {"all_reduce": ("two_shot", 2.0 * (n - 1) / n),
         "all_gather": ("all_gather", (n - 1) / n),
         "reduce_scatter": ("reduce_scatter", (n - 1) / n)}
  rows = []
  for mib in sizes_mib:
    nbytes = int(mib * (1 << 20))
    total = nbytes // 4
    m = max(512, (total // n) // 512 * 512)  # per-rank row length, granule-aligned
    for opname, (algo, factor) in ops.items():
      times = {}
      for cname, comp in codecs.items():
        if algo == "all_gather":
          x = jnp.ones((1, m), jnp.float32)
          oshape = (1, n, m)
          buf = n * m * 4
        elif algo == "reduce_scatter":
          x = jnp.ones((1, n, m), jnp.float32)
          oshape = (1, m)
          buf = n * m * 4
        else:
          x = jnp.ones((1, n, m), jnp.float32)
          oshape = (1, n, m)
          buf = n * m * 4
        x = jax.device_put(x, gpu)
        comp_arg = None if cname == "none" else comp
        f = jax.jit(lambda v, comp_arg=comp_arg, algo=algo, oshape=oshape:
                    _engine(algo, v, oshape, cid, n, comp_arg, m))
        jax.block_until_ready(f(x))
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(iters):
          t0 = time.perf_counter()
          jax.block_until_ready(f(x))
          ts.append(time.perf_counter() - t0)
        t = float(np.median(ts))
        times[cname] = t
        algbw = buf / t / 1e9
        rows.append(dict(op=opname, bytes=buf, compressor=cname, time_us=t * 1e6,
                         algbw_GBps=algbw, busbw_GBps=algbw * factor,
                         speedup_vs_none=None))
      for r in rows[-len(codecs):]:
        r["speedup_vs_none"] = times["none"] / times[r["compressor"]]
      if me == 0:
        for r in rows[-len(codecs):]:
          print(f"[bench n={n}] {r['op']:14s} {r['bytes']:>12d} {r['compressor']:5s} "
                f"{r['time_us']:>11.1f} us  algbw {r['algbw_GBps']:7.3f}  busbw "
                f"{r['busbw_GBps']:7.3f} GB/s  x{r['speedup_vs_none']:.2f}", flush=True)
  return rows


# ----------------------------------------------------------------------------------------
# launch: the multi-process run.

def cmd_launch(args: argparse.Namespace) -> int:
  d = tempfile.mkdtemp(prefix=f"jcoccl_w{args.world}_")
  procs = []
  for r in range(args.world):
    env = dict(os.environ)
    env.update(NCCL_HOSTID=f"jcoccl-rank-{r}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", JCOCCL_TIMEOUT_S=str(args.timeout),
               NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--rank", str(r), "--world",
           str(args.world), "--dir", d, "--iters", str(args.iters), "--sizes-mib",
           *[str(s) for s in args.sizes_mib]] + (["--bench"] if args.bench else [])
    log = open(os.path.join(d, f"rank{r}.log"), "w")
    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  deadline = time.time() + args.timeout * 3
  rcs = []
  for p, log in procs:
    try:
      rcs.append(p.wait(timeout=max(1, deadline - time.time())))
    except subprocess.TimeoutExpired:
      p.kill()
      rcs.append("timeout")
    log.close()
  ranks = []
  for r in range(args.world):
    path = os.path.join(d, f"rank{r}.json")
    ranks.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "error": "no report"})
    tail = open(os.path.join(d, f"rank{r}.log")).read()[-3000:]
    ranks[-1]["log_tail"] = tail
    print(f"----- rank {r} (rc={rcs[r]}) log tail -----\n{tail}", flush=True)
  refused = any("refused" in str(x.get("error", "")).lower() or "Duplicate GPU" in x["log_tail"]
                for x in ranks)
  if refused:
    print(f"NCCL REFUSED {args.world} ranks on one GPU with distinct NCCL_HOSTID "
          "(see the log tails above)", flush=True)
  summary = dict(kind="launch", world=args.world, returncodes=[str(c) for c in rcs],
                 refused=refused, ranks=ranks,
                 bench=ranks[0].get("bench", []) if ranks else [],
                 mismatches=sum(int(x.get("mismatches", 0) or 0) for x in ranks))
  _write(args.out, summary)
  if refused:
    return 3
  return 0 if all(c == 0 for c in rcs) else 1


# ----------------------------------------------------------------------------------------
# report.

def cmd_report(args: argparse.Namespace) -> int:
  parts = {}
  for name in sorted(os.listdir(args.dir)):
    if name.endswith(".json") and name != "summary.json":
      try:
        parts[name] = json.load(open(os.path.join(args.dir, name)))
      except (OSError, json.JSONDecodeError) as e:
        parts[name] = {"error": str(e)}
  _write(os.path.join(args.dir, "summary.json"), parts)
  lines = ["# jcoccl GPU check summary", ""]
  for name, p in parts.items():
    if p.get("kind") == "single":
      lines.append(f"{name}: world 1 fused vs xla: {len(p['results']) - p['mismatches']}/"
                   f"{len(p['results'])} bit-identical")
    elif p.get("kind") == "launch":
      lines.append(f"{name}: world {p['world']}: refused={p['refused']} "
                   f"returncodes={p['returncodes']} mismatches={p['mismatches']}")
      if p.get("bench"):
        lines.append(f"  {'op':14s} {'bytes':>12s} {'codec':5s} {'time(us)':>11s} "
                     f"{'algbw':>8s} {'busbw':>8s} {'speedup':>8s}")
        for r in p["bench"]:
          lines.append(f"  {r['op']:14s} {r['bytes']:>12d} {r['compressor']:5s} "
                       f"{r['time_us']:>11.1f} {r['algbw_GBps']:>8.3f} {r['busbw_GBps']:>8.3f} "
                       f"{r['speedup_vs_none']:>8.2f}")
    else:
      lines.append(f"{name}: {json.dumps(p)[:300]}")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(args.dir, "summary.txt"), "w") as f:
    f.write(text)
  print(text)
  return 0


def _write(path: str, obj: Any) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("single", help="world size 1: fused vs xla backend, bit for bit")
  s.add_argument("--out", default="gpu_out/single.json")
  for name in ("launch", "worker"):
    w = sub.add_parser(name, help="multi-process NCCL run" if name == "launch" else "one rank")
    w.add_argument("--world", type=int, default=2)
    w.add_argument("--bench", action="store_true", help="also time compressed vs uncompressed")
    w.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    w.add_argument("--iters", type=int, default=5)
    if name == "launch":
      w.add_argument("--out", default="gpu_out/world.json")
      w.add_argument("--timeout", type=float, default=60.0,
                     help="JCOCCL_TIMEOUT_S for the workers (the launch waits 3x this)")
    else:
      w.add_argument("--rank", type=int, required=True)
      w.add_argument("--dir", required=True)
  r = sub.add_parser("report", help="merge the JSON files of a directory")
  r.add_argument("--dir", default="gpu_out")
  args = p.parse_args(argv)
  return {"single": cmd_single, "launch": cmd_launch, "worker": cmd_worker,
          "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
  sys.exit(main())
