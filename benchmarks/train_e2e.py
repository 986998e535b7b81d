"""End-to-end training across processes on a shaped link: exact vs the shipped policies.

    python benchmarks/train_e2e.py --link-rate 1gbit --link-rate 10gbit --repeats 2 \\
        --out benchmarks/results/<date>-cpu-train-e2e

For each link rate and repeat, it runs ``python -m models.train`` under
``python -m jcoccl.launch -n 2 --devices-per-process 4 --link-rate RATE`` once per policy,
the policies interleaved (exact, coccl, exact, coccl, ...) so that a shared machine's load
drifts over all of them alike; every run has the same seed, data and steps. A run's step
time is the median of its per-step times (metrics.jsonl ``step_s``) after the first
(compilation); a cell's is the median over repeats. Validation loss is the run's final one,
a cell's the median over repeats (these differ only where a run's start-up calibration had
auto pick differently: the same data and seed). ``--link-rate none`` runs unshaped
(loopback at memory speed): the exact step there is its compute, so the time it gains on a
slow link is its communication.

Writes ``results.json`` (every run) and ``README.md`` (the table, with commit, machine and
link settings) under ``--out``; prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The 'wide' preset with few tokens per step: 51 M parameters, so each process all-reduces
# 204 MB of float32 gradients over 'data' per step, for 32 tokens of compute. Gradient bytes
# grow with the parameters and compute with parameters x tokens, so the tokens per step set
# how communication-bound a step is; a CPU computes each token about a thousand times slower
# than a GPU, hence so few.
MODEL = [
  "--size",
  "wide",
  "--micro",
  "1",
  "--lr",
  "1e-3",
  "--warmup",
  "3",
  "--max-chars",
  "1000000",
  "--eval-batches",
  "4",
]
# The mesh axes of --mesh, in its order (models.sharding.make_mesh).
AXES = ("data", "tensor", "pipe")
# Environment variables that change what a run does or how fast: recorded with the results.
ENV_PREFIXES = ("JCOCCL_", "XLA_", "JAX_", "GLIBC_", "MALLOC_", "OMP_", "TF_CPP_", "NCCL_")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python benchmarks/train_e2e.py", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--link-rate",
    action="append",
    default=None,
    help="tc rate of the link between the processes (repeatable; 'none' = unshaped); default 1gbit",
  )
  p.add_argument(
    "--policy",
    action="append",
    default=None,
    help="policies to compare (repeatable; default exact and coccl)",
  )
  p.add_argument("--steps", type=int, default=10)
  p.add_argument(
    "--batch",
    type=int,
    default=2,
    help="sequences per step (default 2: a communication-bound step; more tokens per step "
    "make it compute-heavier)",
  )
  p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--devices-per-process", type=int, default=4)
  p.add_argument(
    "--mesh",
    default="2,4,1",
    help="data,tensor,pipe (default 2,4,1: data across the processes, tensor inside)",
  )
  p.add_argument("--out", default=None, help="directory for results.json and README.md")
  p.add_argument("--dry-run", action="store_true", help="print the commands only")
  args = p.parse_args(argv)
  args.link_rate = args.link_rate or ["1gbit"]
  args.policy = args.policy or ["exact", "coccl"]
  if args.steps < 3:
    p.error(f"--steps must be >= 3 (the first step compiles), got {args.steps}")
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")
  for flag in ("batch", "seq_len"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  return args


def model_args(args: argparse.Namespace) -> list[str]:
  """The model flags of every run: MODEL and the step's batch and sequence length."""
  return [*MODEL, "--batch", str(args.batch), "--seq-len", str(args.seq_len)]


def command(args: argparse.Namespace, rate: str, policy: str, out: pathlib.Path) -> list[str]:
  """The launcher command line of one run."""
  link = [] if rate == "none" else ["--link-rate", rate]
  return [
    sys.executable,
    "-m",
    "jcoccl.launch",
    "-n",
    str(args.processes),
    "--devices-per-process",
    str(args.devices_per_process),
    *link,
    "--",
    sys.executable,
    "-m",
    "models.train",
    *model_args(args),
    "--mesh",
    args.mesh,
    "--policy",
    policy,
    "--steps",
    str(args.steps),
    "--log-every",
    "1",
    "--eval-every",
    str(args.steps),
    "--ckpt-every",
    str(10 * args.steps),
    "--no-progress",
    "--no-hlo-wire",
    "--seed",
    "0",
    "--out",
    str(out),
  ]


def run_one(args: argparse.Namespace, rate: str, policy: str, work: pathlib.Path) -> dict:
  """Runs one training; returns its step times, final validation loss and wall time."""
  out = work / f"{rate}-{pathlib.Path(policy).stem}"
  shutil.rmtree(out, ignore_errors=True)
  load = os.getloadavg()
  t0 = time.perf_counter()
  r = subprocess.run(command(args, rate, policy, out), cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if r.returncode:
    raise RuntimeError(f"{rate} {policy} failed ({r.returncode}):\n{r.stdout[-3000:]}")
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step_s"] for r in recs if "step_s" in r]
  val = [r["val_loss"] for r in recs if "val_loss" in r]
  return {
    "link_rate": rate,
    "policy": policy,
    "step_s": steps,
    "median_step_s": statistics.median(steps[1:]),
    "val_loss": val[-1],
    "wall_s": wall,
    "load_avg_before": load,
    "calibration": _calibration(out, args.mesh),
  }


def _calibration(out: pathlib.Path, mesh: str) -> dict:
  """What the run's start-up calibration measured and what auto picks under it.

  models.train writes the measured table (calibration.json ``cost_model``) and, in
  summary.json ``auto``, each axis's compressed all_reduce: its codec, whether the policy
  lets auto run the exact op (``opted_in``: an ``"auto:<spec>"`` entry) and what the table
  predicts for the step's own arrays (kept here as ``predicted``). ``choices`` is
  :func:`jcoccl.cost_model_choices` of that table for those axes and codecs; {} where the
  run compresses no all_reduce.
  """
  path = out / "calibration.json"
  if not path.exists():
    return {"calibrated": False, "why": "no calibration.json"}
  rec = json.loads(path.read_text())
  got = {k: rec[k] for k in ("calibrated", "seconds", "why") if k in rec}
  summary = out / "summary.json"
  auto = (json.loads(summary.read_text()).get("auto") or {}) if summary.exists() else {}
  if auto:
    got["predicted"] = auto
  if rec.get("cost_model"):
    got["choices"] = choices(rec["cost_model"], mesh, auto)
  return got


def choices(table: dict, mesh: str, auto: dict) -> dict:
  """What auto picks per axis and message size under the saved cost model ``table``, for
  the axes in ``auto`` (summary.json's: codec, opted_in), as the run itself would choose:
  the exact op is a candidate only where the policy opted in."""
  import jax

  import jcoccl
  from models.calibration import load_table

  if not auto:
    return {}
  models = load_table(table)
  sizes = tuple(int(n) for n in mesh.split(","))
  abstract = jax.sharding.AbstractMesh(sizes, AXES[: len(sizes)])
  codecs = {a: r["codec"] for a, r in auto.items()}
  exact = {a: bool(r.get("opted_in")) for a, r in auto.items()}
  picks = jcoccl.cost_model_choices(models, abstract, codecs, exact=exact)
  return {a: v for a, v in picks.items() if a in auto}


def table(runs: list[dict], policies: list[str], rates: list[str]) -> str:
  """Markdown: per link rate and policy, the median step time over repeats with its range,
  the speedup over exact (of the medians, and the range of each repeat's own ratio), and the
  final validation loss against exact's."""
  lines = [
    "| link | policy | step s, median (range) | speedup vs exact (per-repeat range) "
    "| final val loss | vs exact |",
    "|---|---|---|---|---|---|",
  ]
  for rate in rates:
    mine = {p: [r for r in runs if r["link_rate"] == rate and r["policy"] == p] for p in policies}
    ref = {r["repeat"]: r["median_step_s"] for r in mine.get("exact", [])}
    t0 = statistics.median(ref.values()) if ref else float("nan")
    v0 = statistics.median(r["val_loss"] for r in mine["exact"]) if ref else float("nan")
    for pol in policies:
      steps = [r["median_step_s"] for r in mine[pol]]
      t, v = statistics.median(steps), statistics.median(r["val_loss"] for r in mine[pol])
      ratios = [ref[r["repeat"]] / r["median_step_s"] for r in mine[pol] if r["repeat"] in ref]
      spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
      lines.append(
        f"| {rate} | {pol} | {t:.2f} ({min(steps):.2f}-{max(steps):.2f}) | {t0 / t:.2f}x "
        f"({spread}) | {v:.4f} | {100 * (v - v0) / v0:+.2f}% |"
      )
  return "\n".join(lines)


def _read(path: str) -> str | None:
  p = pathlib.Path(path)
  return p.read_text().strip() if p.exists() else None


def _version(pkg: str) -> str | None:
  try:
    return importlib.metadata.version(pkg)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment() -> dict:
  """What besides the code can move a step time: package versions, the kernel's huge-page
  settings, glibc, and the environment variables the runs inherit (the launcher adds
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where it is unset)."""
  return {
    "jax": _version("jax"),
    "jaxlib": _version("jaxlib"),
    "glibc": " ".join(platform.libc_ver()),
    "kernel": platform.release(),
    "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
    "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
  }


def machine() -> dict:
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
  cpu = next(
    (l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), platform.processor()
  )
  return {
    "commit": commit,
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "cpu": cpu,
    "cores": os.cpu_count(),
    "load_avg_at_start": os.getloadavg(),
    "python": platform.python_version(),
    **environment(),
  }


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.dry_run:
    for rate in args.link_rate:
      for pol in args.policy:
        print(" ".join(command(args, rate, pol, pathlib.Path("OUT"))))
    return
  info, runs = machine(), []
  with tempfile.TemporaryDirectory(prefix="jcoccl-e2e-") as tmp:
    for rep in range(args.repeats):
      for rate in args.link_rate:
        for pol in args.policy:
          run = run_one(args, rate, pol, pathlib.Path(tmp))
          run["repeat"] = rep
          runs.append(run)
          print(
            f"repeat {rep} link {rate} {pol}: median step {run['median_step_s']:.2f} s, "
            f"val loss {run['val_loss']:.4f} ({run['wall_s']:.0f} s)",
            flush=True,
          )
  text = table(runs, args.policy, args.link_rate)
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {
      "processes": args.processes,
      "devices_per_process": args.devices_per_process,
      "mesh": args.mesh,
      "steps": args.steps,
      "repeats": args.repeats,
      "model_args": model_args(args),
      "link_rates": args.link_rate,
      "batch": args.batch,
      "seq_len": args.seq_len,
    }
    (out / "results.json").write_text(json.dumps({**info, **setup, "runs": runs}, indent=1))
    (out / "README.md").write_text(report(info, setup, text, runs))


def report(info: dict, setup: dict, text: str, runs: list[dict]) -> str:
  """README.md of a results directory: the set-up, the table, each run's calibration."""
  thp = info["thp_enabled"] or "unknown"
  env = ", ".join(f"{k}={v}" for k, v in info["env"].items()) or "none set"
  picks = sorted(
    {(r["link_rate"], r["policy"], json.dumps(r["calibration"].get("choices"))) for r in runs}
  )
  return (
    f"# End-to-end training across processes ({info['date'][:10]})\n\n"
    f"jcoccl commit {info['commit']}; {info['cpu']}, {info['cores']} cores (load "
    f"average at start {info['load_avg_at_start'][0]:.1f}); Python {info['python']}, "
    f"jax {info['jax']}, jaxlib {info['jaxlib']}, {info['glibc']}, kernel "
    f"{info['kernel']}, transparent huge pages `{thp}`; environment: {env}.\n"
    f"{setup['processes']} processes x {setup['devices_per_process']} host CPU devices "
    f"(`python -m jcoccl.launch --link-rate RATE`: one tc token-bucket link shared by "
    f"all traffic between the processes), mesh data,tensor,pipe = {setup['mesh']}; "
    f"`python -m models.train {' '.join(setup['model_args'])}`, {setup['steps']} steps, "
    f"seed 0, {setup['repeats']} interleaved repeats; step time = median over repeats "
    f"of each run's median step after the first; ranges are over repeats.\n\n{text}\n\n"
    "What each run's start-up calibration had auto pick for its compressed all_reduce "
    "(per axis and message size; the exact op a candidate only under an 'auto:<spec>' "
    "entry; results.json has every run, with the prediction for the step's own arrays):\n\n"
    + "\n".join(f"- {rate} {pol}: {_picks(c)}" for rate, pol, c in picks)
    + "\n"
  )


def _picks(choices: str) -> str:
  """One run's ``choices`` (JSON) as the README lists it."""
  if choices == "{}":
    return "no compressed all_reduce (nothing for auto to pick)"
  return "no calibrated cost model" if choices == "null" else choices


if __name__ == "__main__":
  main()
