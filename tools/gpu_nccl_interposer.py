#!/usr/bin/env python3
"""libjcoccl_nccl.so on a jit program that never imports jcoccl (tools/gpu_check.sh's
nccl_interposer step).

The worker trains a small MLP with GSPMD data parallelism (jit with shardings: XLA inserts
the gradient all-reduce and issues it through NCCL). The same run goes twice, with and
without ``python -m jcoccl.nccl --policy P --report --``, and the JSON reports:
  - bytes: what each rank handed to NCCL, compressed and forwarded (the library's counters);
  - step_time_ratio: median step time with the interposer / without (steps after the first);
  - loss_diff: |final loss with - without|, and both loss curves.

GPU: 2 processes on the one GPU, each with its own NCCL_HOSTID and NCCL_SOCKET_IFNAME=lo (as
tools/gpu_collectives.py launch), jax.distributed on localhost. CPU (--platform cpu, the dry
run): one process with 2 host devices (XLA:CPU does not use NCCL, so no byte is taken over),
with the interposer built against the NCCL emulation preloaded: the launcher, the preload
into a JAX process, the report and this script's JSON are exercised.

  python tools/gpu_nccl_interposer.py --out nccl_interposer.json
  python tools/gpu_nccl_interposer.py --platform cpu --out nccl_interposer.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nccl_env  # noqa: E402

POLICY = '["*"]\nall_reduce = "int8"\nmin_bytes = 0\n'


def worker(args: argparse.Namespace) -> int:
  """The training program: plain JAX, no jcoccl."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  if args.world > 1:
    jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{args.port}",
      num_processes=args.world,
      process_id=args.rank,
      local_device_ids=[0],
    )
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  rep = jax.NamedSharding(mesh, jax.P())
  row = jax.NamedSharding(mesh, jax.P("data"))
  rng = np.random.default_rng(0)
  d, h = args.width, 2 * args.width
  params = {
    "w1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
    "w2": (rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32),
  }
  params = jax.tree.map(
    lambda a: jax.make_array_from_callback(a.shape, rep, lambda i: a[i]), params
  )
  xs = rng.standard_normal((args.batch, d)).astype(np.float32)
  ys = np.tanh(xs @ rng.standard_normal((d, d)).astype(np.float32) / np.sqrt(d))
  x = jax.make_array_from_callback(xs.shape, row, lambda i: xs[i])
  y = jax.make_array_from_callback(ys.shape, row, lambda i: ys[i])

  def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  @jax.jit
  def step(p, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)  # GSPMD all-reduces g over 'data'
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), loss

  losses, times = [], []
  for _ in range(args.steps):
    t = time.perf_counter()
    params, loss = step(params, x, y)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - t)
  print("RESULT " + json.dumps({"rank": args.rank, "losses": losses, "times": times}), flush=True)
  return 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cpu_library() -> tuple[str, str]:
  sys.path.insert(0, str(ROOT / "cuda" / "nccl_interposer" / "test"))
  import emul_build

  b = emul_build.build()
  return str(b.interposer), str(b.emul)


def _run(args: argparse.Namespace, compressed: bool, d: Path) -> dict:
  world = 1 if args.platform == "cpu" else 2
  port = _free_port()
  policy = d / "policy.toml"
  policy.write_text(POLICY)
  prefix: list[str] = []
  if compressed:
    prefix = [sys.executable, "-m", "jcoccl.nccl", "--policy", str(policy), "--report"]
    if args.library:
      prefix += ["--library", args.library]
    if args.real:
      prefix += ["--real", args.real]
    prefix.append("--")
  procs = []
  for r in range(world):
    env = dict(os.environ)
    env.update(nccl_env.rank_env(r))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if args.platform == "cpu":
      env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [*prefix, sys.executable, __file__, "worker", "--rank", str(r), "--world", str(world),
           "--port", str(port), "--steps", str(args.steps), "--width", str(args.width),
           "--batch", str(args.batch)]  # fmt: skip
    log = open(d / f"{'jcoccl' if compressed else 'plain'}_rank{r}.log", "w")  # noqa: SIM115
    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  deadline = time.monotonic() + args.timeout
  for p, log in procs:
    try:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
    log.close()
  out: dict = {"ranks": [], "wire": {"taken": 0, "forwarded": 0}, "taken_calls": 0}
  for r in range(world):
    text = (d / f"{'jcoccl' if compressed else 'plain'}_rank{r}.log").read_text()
    for line in text.splitlines():
      if line.startswith("RESULT "):
        out["ranks"].append(json.loads(line[7:]))
      if line.startswith("comm=") and "op=" in line:
        f = dict(w.split("=", 1) for w in line.split())
        out["wire"]["taken"] += int(f["taken_wire"])
        out["wire"]["forwarded"] += int(f["forwarded_wire"])
        out["taken_calls"] += int(f["taken_calls"])
    out["report"] = out.get("report", False) or "jcoccl nccl report" in text
  out["complete"] = len(out["ranks"]) == world and all(p.returncode == 0 for p, _ in procs)
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd")
  w = sub.add_parser("worker", help="one rank of the training program (internal)")
  for name, default in (("rank", 0), ("world", 1), ("port", 0), ("steps", 20), ("width", 256),
                        ("batch", 64)):  # fmt: skip
    w.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--out", default="nccl_interposer.json")
  p.add_argument("--dir", default=None, help="logs (default: a temporary directory)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--width", type=int, default=1024, help="MLP width (gradients 4 x width^2 x 4 B)")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--timeout", type=float, default=80.0, help="seconds per run")
  p.add_argument("--library", default=os.environ.get("JCOCCL_NCCL_INTERPOSER"))
  p.add_argument("--real", default=None)
  args = p.parse_args(argv)
  if args.cmd == "worker":
    return worker(args)
  if args.platform == "cpu":
    args.library, args.real = _cpu_library()
    args.steps, args.width, args.batch = min(args.steps, 4), min(args.width, 64), 16
  d = Path(args.dir or tempfile.mkdtemp(prefix="jcoccl_nccl_"))
  d.mkdir(parents=True, exist_ok=True)
  plain = _run(args, False, d)
  comp = _run(args, True, d)
  res: dict = {"platform": args.platform, "plain": plain, "jcoccl": comp, "policy": POLICY}
  ok = plain["complete"] and comp["complete"] and comp["report"]
  if ok:
    med = [statistics.median(r["ranks"][0]["times"][1:] or r["ranks"][0]["times"])
           for r in (plain, comp)]  # fmt: skip
    res["step_time_ratio"] = med[1] / med[0]
    res["loss_diff"] = abs(comp["ranks"][0]["losses"][-1] - plain["ranks"][0]["losses"][-1])
    res["bytes"] = comp["wire"]
    # On a GPU the gradient all-reduce must have been taken over, at int8's ~1/4 of the bytes.
    if args.platform == "gpu":
      ok = comp["taken_calls"] > 0 and comp["wire"]["taken"] > 0
  res["ok"] = bool(ok)
  Path(args.out).write_text(json.dumps(res, indent=1))
  print(
    f"VERDICT nccl_interposer {'ok' if ok else 'FAILED'}: taken calls {comp['taken_calls']}, "
    f"wire bytes {comp['wire']}, step time ratio {res.get('step_time_ratio', float('nan')):.3f}, "
    f"loss diff {res.get('loss_diff', float('nan')):.3g} (logs in {d})"
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
