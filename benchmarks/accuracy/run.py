"""Accuracy study: validation loss against bytes on the wire, per model, policy and seed.

  python -m benchmarks.accuracy.run                       # GPT + Qwen small, 5 policies, 3 seeds
  python -m benchmarks.accuracy.run --policies exact,int8 --seeds 1 --steps 100
  python benchmarks/accuracy/run.py --tiny --out /tmp/acc # seconds: a smoke run

Trains every (model, policy, seed) with ``models.train.main`` in this process, on the same
data, steps and mesh (the same seed gives every policy the same initial weights and batches),
and reads what each run reports: its final validation loss and its bytes on the wire per
step and device by mesh axis (summary.json "wire", measured on the compiled train step).
Writes into ``--out`` (default benchmarks/results/<date>-accuracy/): ``results.md`` (the
table and one text sample per model and policy), ``results.json`` (every run and the
table), ``val_loss_vs_bytes.png`` (one point per policy and seed, one panel per model) and
``runs/<model>-<policy>-s<seed>/`` (each run's outputs and log). A run whose summary.json is
already there with the same settings is read, not trained again, so an interrupted study
continues where it stopped. A policy named in ``--policies`` whose TOML file does not exist
is skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make models/ importable
  sys.path.insert(0, str(ROOT))

from models import train  # noqa: E402  (train.main asks for 8 host CPU devices)
from models.configs.models import TINY_RUN  # noqa: E402

PROG = "python -m benchmarks.accuracy.run"
MODELS = ("gpt", "qwen")
DEFAULT_POLICIES = "exact,int8,coccl,zeropp,lean"
# The study's fixed training settings (the defaults of models.train unless named here):
# validation only at the end, on 16 batches (16 x 16 x 64 = 16k tokens; the default 4 would
# leave a seed-to-seed sampling spread of the same order as the differences measured).
STUDY = ["--eval-batches", "16", "--sample-tokens", "64"]
# --tiny: seconds of compute per run, for tests and trying the command.
TINY = [
  *TINY_RUN,
  "--warmup",
  "2",
  "--eval-batches",
  "2",
  "--sample-tokens",
  "16",
]
COLUMNS = ("data", "tensor", "pipe", "other")
DEFAULT_STEPS = 200
DTYPES = ("float32", "bfloat16")
# Run directories and labels: float32 keeps the names of studies before --dtypes.
DTYPE_TAG = {"float32": "", "bfloat16": "-bf16"}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  p.add_argument("--models", default="gpt,qwen", help="comma-separated: gpt, qwen")
  p.add_argument(
    "--policies",
    default=DEFAULT_POLICIES,
    help="comma-separated names under models/configs or TOML paths; a missing "
    f"one is skipped (default {DEFAULT_POLICIES})",
  )
  p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per model and policy")
  p.add_argument(
    "--dtypes",
    default="float32",
    help="comma-separated compute dtypes (models.train --dtype): float32, bfloat16; each "
    "runs every policy, and each row is compared with its own dtype's exact run and with "
    "float32's (default float32)",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help=f"train steps per run (default {DEFAULT_STEPS}; 4 with --tiny)",
  )
  p.add_argument("--size", default="small", help="model preset (models/configs/models.py)")
  p.add_argument(
    "--tiny",
    action="store_true",
    help="tiny budget: tiny models, short sequences, 4 steps unless --steps",
  )
  p.add_argument(
    "--out", default=None, help="output directory (default benchmarks/results/<date>-accuracy)"
  )
  p.add_argument(
    "--train-arg",
    action="append",
    default=[],
    metavar="ARG",
    help="extra models.train argument, e.g. --train-arg=--lr=1e-3 (repeatable)",
  )
  return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags; policies are resolved (missing ones noted, not fatal)."""
  p = build_parser()
  args = p.parse_args(argv)
  args.models = [m.strip() for m in args.models.split(",") if m.strip()]
  bad = [m for m in args.models if m not in MODELS]
  if bad or not args.models:
    p.error(f"--models must be a comma-separated subset of {MODELS}, got {bad or args.models}")
  args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  bad = [d for d in args.dtypes if d not in DTYPES]
  if bad or not args.dtypes:
    p.error(f"--dtypes must be a comma-separated subset of {DTYPES}, got {bad or args.dtypes}")
  if args.seeds < 1:
    p.error(f"--seeds must be >= 1, got {args.seeds}")
  if args.steps is None:
    args.steps = 4 if args.tiny else DEFAULT_STEPS
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  names = [n.strip() for n in args.policies.split(",") if n.strip()]
  if not names:
    p.error("--policies must name at least one policy")
  args.policy_paths, args.skipped = {}, {}
  for name in dict.fromkeys(names):
    label = pathlib.Path(name).stem  # a TOML path is labelled by its file name
    try:
      args.policy_paths[label] = train.policy_path(name)
    except ValueError:
      args.skipped[label] = (
        f"policy {name!r} skipped: no file {name} nor models/configs/{name}.toml (yet)"
      )
  if not args.policy_paths:
    p.error(f"none of --policies {args.policies} exists: {'; '.join(args.skipped.values())}")
  args.out = pathlib.Path(
    args.out or ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-accuracy"
  )
  return args


def common_argv(args: argparse.Namespace) -> list[str]:
  """The models.train arguments that every run of the study shares."""
  sizing = TINY if args.tiny else ["--size", args.size] + STUDY
  return (
    [
      "--steps",
      str(args.steps),
      "--eval-every",
      str(args.steps),
      "--ckpt-every",
      str(args.steps),
      "--mesh",
      "2,2,2",
      "--no-progress",
      # The study compares policies' bytes and losses: auto must not turn them off.
      "--no-calibrate",
      # The study trains exact as a policy of its own (and its seeds): no twin per run.
      "--no-exact-twin",
    ]
    + sizing
    + list(args.train_arg)
  )


def train_argv(
  args: argparse.Namespace,
  model: str,
  policy: str,
  seed: int,
  out: pathlib.Path,
  dtype: str = "float32",
) -> list[str]:
  """The models.train command line of one run."""
  extra = [] if dtype == "float32" else ["--dtype", dtype]
  return (
    [
      "--model",
      model,
      "--policy",
      str(args.policy_paths[policy]),
      "--seed",
      str(seed),
      "--out",
      str(out),
    ]
    + common_argv(args)
    + extra
  )


def run_one(
  args: argparse.Namespace, model: str, policy: str, seed: int, dtype: str = "float32"
) -> dict:
  """Trains one run (or reads it back if it finished with the same command line)."""
  out = args.out / "runs" / f"{model}-{policy}{DTYPE_TAG[dtype]}-s{seed}"
  argv = train_argv(args, model, policy, seed, out, dtype)
  done = out / "summary.json"
  cmd_file = out / "argv.json"
  if done.is_file() and cmd_file.is_file() and json.loads(cmd_file.read_text()) == argv:
    summary, wall, cpu, reused = json.loads(done.read_text()), None, None, True
  else:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd_file.write_text(json.dumps(argv))
    t0, c0 = time.perf_counter(), _cpu_s()
    try:
      with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        summary = train.main(argv)
    except Exception as e:
      raise RuntimeError(
        f"the {model} {policy} seed {seed} run failed ({type(e).__name__}: "
        f"{e}); its log: {out / 'train.log'}"
      ) from e
    wall, cpu, reused = time.perf_counter() - t0, _cpu_s() - c0, False
  wire = summary["wire"]
  if not wire.get("source"):
    raise RuntimeError(f"{out}: the run reports no bytes on the wire")
  by_axis = columns({k: v["compressed"] for k, v in wire["by_axis"].items()})
  return {
    "model": model,
    "policy": policy,
    "dtype": dtype,
    "seed": seed,
    "val_loss": summary["val_loss_end"],
    # The same weights through exact collectives (models.train's summary; None: a run
    # from before it reported one).
    "val_loss_exact_collectives": summary.get("val_loss_exact_collectives"),
    "loss_end": summary["loss_end"],
    "bytes_by_axis": by_axis,
    "wire_by_axis": {k: v["compressed"] for k, v in wire["by_axis"].items()},
    "bytes": wire["total"]["compressed"],
    "exact_bytes": wire["total"]["uncompressed"],
    "tokens_per_s": summary["tokens_per_s"],
    "wall_s": wall,
    "cpu_s": cpu,
    "reused": reused,
    "sample": summary.get("sample"),
    "dir": str(out),
  }


def columns(by_axis: dict[str, float]) -> dict[str, float]:
  """The table's columns from models.train's by-axis bytes: 'data' is the whole data level
  (ZeRO++ splits it into 'node' and 'data' axes), 'tensor', 'pipe', and 'other' for groups
  over several of these or none ("?")."""
  out = dict.fromkeys(COLUMNS, 0.0)
  for key, value in by_axis.items():
    names = set(key.split(","))
    col = "data" if names <= {"data", "node"} else key if key in ("tensor", "pipe") else "other"
    out[col] += value
  return out


def _cpu_s() -> float:
  """CPU seconds of this process, all threads (user + system): on an idle machine the wall
  time of a run lies between this over the core count and this."""
  import resource

  u = resource.getrusage(resource.RUSAGE_SELF)
  return u.ru_utime + u.ru_stime


def _spread(values: list[float]) -> float:
  return statistics.stdev(values) if len(values) > 1 else 0.0


def _exact(runs: list[dict], model: str, dtype: str) -> tuple[float | None, float | None]:
  """(mean val loss, mean bytes) of the model's exact runs in ``dtype`` (None: not run)."""
  rs = [
    r
    for r in runs
    if (r["model"], r["policy"], r.get("dtype", "float32")) == (model, "exact", dtype)
  ]
  if not rs:
    return None, None
  return statistics.mean(r["val_loss"] for r in rs), statistics.mean(r["bytes"] for r in rs)


def table(runs: list[dict]) -> list[dict]:
  """One row per (model, dtype, policy): val loss mean and spread over seeds, bytes per step
  by axis, and the ratios to the same model's exact runs in the same dtype (bytes: to the
  exact policy's measured bytes when it is in the study, else to the run's own uncompressed
  reference compile), and to its float32 exact runs (``*_f32``) when those are in the study."""
  rows = []
  keys = dict.fromkeys((r["model"], r.get("dtype", "float32")) for r in runs)
  for model, dtype in keys:
    mine = [r for r in runs if (r["model"], r.get("dtype", "float32")) == (model, dtype)]
    exact_val, exact_bytes = _exact(runs, model, dtype)
    f32_val, f32_bytes = _exact(runs, model, "float32")
    for policy in dict.fromkeys(r["policy"] for r in mine):
      rs = [r for r in mine if r["policy"] == policy]
      vals = [r["val_loss"] for r in rs]
      total = statistics.mean(r["bytes"] for r in rs)
      ref = exact_bytes or statistics.mean(r["exact_bytes"] for r in rs)
      mean = statistics.mean(vals)
      through = [r.get("val_loss_exact_collectives") for r in rs]
      through_mean = None if None in through else statistics.mean(through)
      rows.append(
        {
          "model": model,
          "policy": policy,
          "dtype": dtype,
          "seeds": len(rs),
          "val_loss_mean": mean,
          "val_loss_std": _spread(vals),
          "val_loss_min": min(vals),
          "val_loss_max": max(vals),
          "bytes_by_axis": {a: statistics.mean(r["bytes_by_axis"][a] for r in rs) for a in COLUMNS},
          "bytes": total,
          "byte_ratio": total / ref if ref else math.nan,
          "byte_ratio_to": "exact policy" if exact_bytes else "uncompressed reference compile",
          "val_ratio": mean / exact_val if exact_val else None,
          # The trained weights through exact collectives: what they give served
          # uncompressed (a goal holds only when both measures are within it).
          "val_loss_exact_collectives_mean": through_mean,
          "val_loss_exact_collectives_min": None if through_mean is None else min(through),
          "val_loss_exact_collectives_max": None if through_mean is None else max(through),
          "val_ratio_exact_collectives": (
            through_mean / exact_val if exact_val and through_mean is not None else None
          ),
          "byte_ratio_f32": total / f32_bytes if f32_bytes else None,
          "val_ratio_f32": mean / f32_val if f32_val else None,
          "sample": next((r["sample"] for r in rs if r["seed"] == 0), rs[0]["sample"]),
        }
      )
  return rows


def markdown(rows: list[dict], meta: dict) -> str:
  lines = [
    "# Accuracy study: validation loss vs bytes on the wire",
    "",
    f"`{meta['command']}`",
    "",
    f"{meta['steps']} steps per run, seeds {meta['seeds']}, mesh data x tensor x pipe = "
    f"2x2x2, models.train arguments: `{' '.join(meta['train_args'])}`. "
    f"Bytes per step and device, by mesh axis, as models.train measures them on the "
    f"compiled step; val loss = final validation loss (mean ± sample standard deviation "
    f"over seeds, [min, max]); the data column is the whole data level (ZeRO++ splits "
    f"it into node and data axes), other = groups over several axes. Ratios are to the "
    f"exact policy of the same model and dtype, and (f32 columns) to its float32 exact "
    f"policy; bfloat16 bytes are counted at bfloat16 width, as NCCL sends them "
    f"(models.train's wire report: XLA:CPU widens bfloat16 collectives to float32). "
    f"Commit {meta['commit']}, {meta['date']}, total wall time {meta['wall_s']:.0f} s.",
    "",
  ]
  if meta["skipped"]:
    lines += [f"- {why}" for why in meta["skipped"]] + [""]
  lines += [
    "| model | dtype | policy | seeds | val loss | val / exact | val loss, exact collectives "
    "| its val / exact | data kB | tensor kB | pipe kB | other kB | total kB | bytes / exact "
    "| val / f32 exact | bytes / f32 exact |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    ax = r["bytes_by_axis"]
    val_ratio, val_f32, bytes_f32, through_ratio = (
      "n/a" if r.get(k) is None else f"{r[k]:.{d}f}"
      for k, d in (
        ("val_ratio", 4),
        ("val_ratio_f32", 4),
        ("byte_ratio_f32", 3),
        ("val_ratio_exact_collectives", 4),
      )
    )
    through = (
      "n/a"
      if r.get("val_loss_exact_collectives_mean") is None
      else f"{r['val_loss_exact_collectives_mean']:.4f} "
      f"[{r['val_loss_exact_collectives_min']:.4f}, {r['val_loss_exact_collectives_max']:.4f}]"
    )
    lines.append(
      f"| {r['model']} | {r['dtype']} | {r['policy']} | {r['seeds']} | "
      f"{r['val_loss_mean']:.4f} ± "
      f"{r['val_loss_std']:.4f} [{r['val_loss_min']:.4f}, {r['val_loss_max']:.4f}] | "
      f"{val_ratio} | {through} | {through_ratio} | {ax['data'] / 1e3:.1f} | {ax['tensor'] / 1e3:.1f} | "
      f"{ax['pipe'] / 1e3:.1f} | {ax['other'] / 1e3:.1f} | {r['bytes'] / 1e3:.1f} | "
      f"{r['byte_ratio']:.3f} | {val_f32} | {bytes_f32} |"
    )
  lines += [
    "",
    f"## Samples (run seed 0; the prompt, then {train.SAMPLE_TEMPERATURE} "
    f"temperature sampling with seed {train.SAMPLE_SEED})",
    "",
  ]
  for r in rows:
    if r["sample"]:
      label = f"{r['model']} / {r['policy']}{DTYPE_TAG[r['dtype']]}"
      lines += [f"**{label}**", "", "```", r["sample"].rstrip(), "```", ""]
  return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: pathlib.Path) -> None:
  """Validation loss against bytes per step: a panel per model, a marker per policy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(r["model"] for r in runs))
  label = lambda r: r["policy"] + DTYPE_TAG[r.get("dtype", "float32")]
  policies = list(dict.fromkeys(label(r) for r in runs))
  markers = "osD^v<>PX*"
  fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
  for ax, model in zip(axes[0], models):
    for i, policy in enumerate(policies):
      rs = [r for r in runs if r["model"] == model and label(r) == policy]
      ax.scatter(
        [r["bytes"] / 1e3 for r in rs],
        [r["val_loss"] for r in rs],
        marker=markers[i % len(markers)],
        label=policy,
        alpha=0.8,
      )
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
      val, _ = _exact(runs, model, dtype)
      if val is not None:  # the baselines: a line at each dtype's exact loss
        ax.axhline(val, color="gray", ls=style, lw=0.8, label=f"exact {dtype} (mean)")
    ax.set_xscale("log")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(model)
    ax.set_xlabel("bytes on the wire per step and device (kB, log)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _commit() -> str:
  import subprocess

  try:
    return subprocess.run(
      ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main(argv: list[str] | None = None) -> dict:
  """Runs the study; returns what results.json holds."""
  args = parse_args(argv)
  for why in args.skipped.values():
    print(why, file=sys.stderr)
  args.out.mkdir(parents=True, exist_ok=True)
  t0, runs = time.perf_counter(), []
  jobs = [
    (m, p, s, d)
    for d in args.dtypes
    for m in args.models
    for s in range(args.seeds)
    for p in args.policy_paths
  ]
  for k, (model, policy, seed, dtype) in enumerate(jobs):
    r = run_one(args, model, policy, seed, dtype)
    runs.append(r)
    how = "reused" if r["reused"] else f"{r['wall_s']:.0f} s"
    print(
      f"[{k + 1}/{len(jobs)}] {model} {policy}{DTYPE_TAG[dtype]} seed {seed}: "
      f"val {r['val_loss']:.4f}, "
      f"{r['bytes'] / 1e3:.1f} kB/step ({how})",
      flush=True,
    )
  rows = table(runs)
  meta = {
    "command": " ".join([PROG] + list(argv if argv is not None else sys.argv[1:])),
    "steps": args.steps,
    "seeds": list(range(args.seeds)),
    "dtypes": args.dtypes,
    "models": args.models,
    "policies": {p: str(path) for p, path in args.policy_paths.items()},
    "skipped": list(args.skipped.values()),
    "train_args": common_argv(args),
    "commit": _commit(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "wall_s": time.perf_counter() - t0,
  }
  result = {"meta": meta, "table": rows, "runs": runs}
  (args.out / "results.json").write_text(json.dumps(result, indent=1))
  (args.out / "results.md").write_text(markdown(rows, meta))
  plot(runs, args.out / "val_loss_vs_bytes.png")
  print(markdown(rows, meta).split("\n## Samples")[0])
  print(f"written: {args.out}/results.md, results.json, val_loss_vs_bytes.png, runs/")
  return result


if __name__ == "__main__":
  main()
