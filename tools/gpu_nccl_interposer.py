#!/usr/bin/env python3
"""libjcoccl_nccl.so on a jit program that never imports jcoccl (tools/gpu_check.sh's
nccl_interposer step).

The program is docs/nccl.md's ``train.py``, read from the doc: a small MLP trained with GSPMD
data parallelism (jit with shardings: XLA inserts the gradient all-reduce and issues it
through NCCL), 2 processes as the doc launches them. It runs once plainly and once per XLA
mode under ``python -m jcoccl.nccl --policy P --report --``:
  - cmd_buffer_on: XLA's collectives recorded into CUDA graphs (command buffers);
  - cmd_buffer_off: no command buffers;
  - nonblocking: XLA's nonblocking NCCL communicators (and NCCL_COMM_BLOCKING=0).
The JSON reports per mode the bytes each rank handed to NCCL, compressed and forwarded (the
library's counters), step_time_ratio (median step time with the library / plain, steps
after the first) and loss_diff (|final loss - plain final loss|).

GPU: the 2 processes share the one GPU, each with its own NCCL_HOSTID and
NCCL_SOCKET_IFNAME=lo (as tools/gpu_collectives.py launch). CPU (--cpu, the dry run): the
same 2 processes with JAX_PLATFORMS=cpu (gloo carries the collectives; XLA:CPU does not use
NCCL, so no byte is taken over) and the interposer built against the NCCL emulation: the
doc's program and launch, the preload into JAX processes, the report and this script's JSON
are exercised.

  python tools/gpu_nccl_interposer.py --out nccl_interposer.json
  python tools/gpu_nccl_interposer.py --cpu --out nccl_interposer.json
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
DOC = ROOT / "docs" / "nccl.md"
# XLA's modes the library must serve: extra XLA_FLAGS and environment per mode.
MODES: dict[str, dict[str, str]] = {
  "cmd_buffer_on": {
    "XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,COLLECTIVES "
    "--xla_gpu_graph_min_graph_size=1"
  },
  "cmd_buffer_off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
  "nonblocking": {
    "XLA_FLAGS": "--xla_gpu_nccl_blocking_communicators=false --xla_gpu_nccl_async_execution=true",
    "NCCL_COMM_BLOCKING": "0",
  },
}


def doc_program(doc: Path = DOC) -> str:
  """docs/nccl.md's ``train.py``: the first python block after the line naming it."""
  text = doc.read_text()
  at = text.index("(`train.py`)")
  start = text.index("```python\n", at) + len("```python\n")
  return text[start : text.index("```", start)]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cpu_library() -> tuple[str, str]:
  sys.path.insert(0, str(ROOT / "cuda" / "nccl_interposer" / "test"))
  import emul_build

  b = emul_build.build()
  return str(b.interposer), str(b.emul)


def _run(args: argparse.Namespace, mode: str | None, d: Path) -> dict:
  """One launch of the doc's program on 2 processes, plainly (mode None) or compressed in
  XLA mode ``mode``: what each rank printed and the library's counters."""
  world, port, name = 2, _free_port(), mode or "plain"
  policy = d / "policy.toml"
  policy.write_text(POLICY)
  program = d / "train.py"
  program.write_text(doc_program())
  prefix: list[str] = []
  if mode is not None:
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
    env.update(RANK=str(r), WORLD_SIZE=str(world), COORDINATOR=f"127.0.0.1:{port}")
    env.update(STEPS=str(args.steps), WIDTH=str(args.width))
    extra = dict(MODES.get(mode or "", {}))
    flags = (env.get("XLA_FLAGS", ""), extra.pop("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    env.update(extra)
    if args.platform == "cpu":
      env["JAX_PLATFORMS"] = "cpu"
    log = open(d / f"{name}_rank{r}.log", "w")  # noqa: SIM115
    cmd = [*prefix, sys.executable, str(program)]
    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  deadline = time.monotonic() + args.timeout
  for p, log in procs:
    try:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
    log.close()
  out: dict = {"ranks": [], "wire": {"taken": 0, "forwarded": 0}, "taken_calls": 0}
  out["captured_calls"] = 0
  for r in range(world):
    text = (d / f"{name}_rank{r}.log").read_text()
    losses, times = [], []
    for line in text.splitlines():
      w = line.split()
      if len(w) == 6 and w[0] == "step" and w[2] == "loss" and w[4] == "seconds":
        losses.append(float(w[3]))
        times.append(float(w[5]))
      if line.startswith("comm=") and "op=" in line:
        f = dict(x.split("=", 1) for x in w)
        out["wire"]["taken"] += int(f["taken_wire"])
        out["wire"]["forwarded"] += int(f["forwarded_wire"])
        out["taken_calls"] += int(f["taken_calls"])
        out["captured_calls"] += int(f.get("captured_calls", 0))
    if len(losses) == args.steps:
      out["ranks"].append({"rank": r, "losses": losses, "times": times})
    out["report"] = out.get("report", False) or "jcoccl nccl report" in text
  out["complete"] = len(out["ranks"]) == world and all(p.returncode == 0 for p, _ in procs)
  return out


def _median_time(run: dict) -> float:
  t = run["ranks"][0]["times"]
  return statistics.median(t[1:] or t)


def _mode(args: argparse.Namespace, plain: dict, mode: str, d: Path) -> dict:
  """The compressed run in ``mode``, compared with the plain one."""
  comp = _run(args, mode, d)
  good = plain["complete"] and comp["complete"] and comp["report"]
  if good:
    comp["step_time_ratio"] = _median_time(comp) / _median_time(plain)
    comp["loss_diff"] = abs(comp["ranks"][0]["losses"][-1] - plain["ranks"][0]["losses"][-1])
    # On a GPU the gradient all-reduce must have been taken over, at int8's ~1/4 of the bytes.
    if args.platform == "gpu":
      good = comp["taken_calls"] > 0 and comp["wire"]["taken"] > 0
  comp["ok"] = bool(good)
  print(
    f"mode {mode}: {'ok' if good else 'FAILED'}, taken calls {comp['taken_calls']} "
    f"(captured {comp['captured_calls']}), wire bytes {comp['wire']}, step time ratio "
    f"{comp.get('step_time_ratio', float('nan')):.3f}, loss diff "
    f"{comp.get('loss_diff', float('nan')):.3g}",
    flush=True,
  )
  return comp


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--cpu", action="store_true", help="the CPU dry run (same as --platform cpu)")
  p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
  p.add_argument("--out", default="nccl_interposer.json")
  p.add_argument("--dir", default=None, help="logs (default: a temporary directory)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--width", type=int, default=1024, help="MLP width (gradients 4 x width^2 x 4 B)")
  p.add_argument("--timeout", type=float, default=60.0, help="seconds per run")
  p.add_argument("--library", default=os.environ.get("JCOCCL_NCCL_INTERPOSER"))
  p.add_argument("--real", default=None)
  args = p.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  if unknown := [m for m in modes if m not in MODES]:
    p.error(f"--modes: unknown {unknown}; accepted: {list(MODES)}")
  if args.cpu:
    args.platform = "cpu"
  if args.platform == "cpu":
    args.library, args.real = _cpu_library()
    args.steps, args.width = min(args.steps, 3), min(args.width, 64)
  d = Path(args.dir or tempfile.mkdtemp(prefix="jcoccl_nccl_"))
  d.mkdir(parents=True, exist_ok=True)
  plain = _run(args, None, d)
  res: dict = {"platform": args.platform, "plain": plain, "policy": POLICY, "modes": {}}
  for mode in modes:
    res["modes"][mode] = _mode(args, plain, mode, d)
  ok = plain["complete"] and all(m["ok"] for m in res["modes"].values())
  res["ok"] = bool(ok)
  Path(args.out).write_text(json.dumps(res, indent=1))
  print(f"VERDICT nccl_interposer {'ok' if ok else 'FAILED'}: modes {modes} (logs in {d})")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
