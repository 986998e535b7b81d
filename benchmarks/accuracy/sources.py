"""Where compression error comes from: the loss each point costs when compressed alone.

  python -m benchmarks.accuracy.sources --models gpt,qwen --steps 100 \\
      --out benchmarks/results/2026-12-05-accuracy-sources

Trains, per model, the exact policy and one run per point of :data:`POINTS` (that point
compressed, every other collective exact; ``models.train --direction``), all from the same
weights on the same batches (one seed), and writes ``results.md`` / ``results.json``: each
point's final validation loss against exact's, its bytes, and, where ``<out>/probe-<model>/
probe.json`` exists (``python -m models.error_probe --out <out>/probe-<model>``), the error it
injects and its ratio to the gradient noise. A run whose summary.json exists with the same
command line is read back.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

# name -> (models.train flags, the probe's point, its codec's label)
POINTS = {
  "tensor.forward int3": (["--direction", "tensor.forward=hadamard(int3)"], "tensor.forward", 3),
  "tensor.backward int3": (
    ["--direction", "tensor.backward=hadamard(int3)"],
    "tensor.backward",
    3,
  ),
  "pipe.forward int2": (["--direction", "pipe.forward=hadamard(int2)"], "pipe.forward", 2),
  "pipe.backward int2": (["--direction", "pipe.backward=hadamard(int2)"], "pipe.backward", 2),
  "data int2 without error feedback": (["--direction", "data=hadamard(int2)"], "data", 2),
  "data int2 with error feedback": (
    ["--compress", "data.all_reduce=hadamard(int2)", "--compress", "data.error_feedback=true"]
    + ["--compress", "data.min_bytes=0"],
    "data",
    2,
  ),
}


def common(steps: int, seed: int) -> list[str]:
  """The flags every run shares (those of benchmarks.accuracy.run's study)."""
  return [
    "--steps", str(steps), "--eval-every", str(steps), "--ckpt-every", str(steps),
    "--mesh", "2,2,2", "--no-progress", "--no-calibrate", "--no-exact-twin", "--size", "small",
    "--eval-batches", "16", "--sample-tokens", "64", "--seed", str(seed),
  ]  # fmt: skip


def table(rows: list[dict]) -> str:
  """results.md's table."""
  head = (
    "| model | point | val loss | / exact | bytes / exact | injected error | "
    "gradient error (probe) | / noise |\n|---|---|---|---|---|---|---|---|"
  )
  lines = [head]
  for r in rows:
    f = lambda k, fmt, r=r: "" if r.get(k) is None else format(r[k], fmt)
    lines.append(
      f"| {r['model']} | {r['point']} | {r['val']:.4f} | {f('ratio', '.4f')} | "
      f"{f('bytes', '.3f')} | {f('injected', '.4f')} | {f('gradient', '.4f')} | "
      f"{f('noise_ratio', '.3f')} |"
    )
  return "\n".join(lines)


def probe_figures(out: pathlib.Path, model: str, point: str, bits: int) -> dict:
  """The probe's injected error of ``point`` at ``bits`` and its gradient error scaled from
  the reference bits by the injected error (sensitivity x injected), over the noise."""
  path = out / f"probe-{model}" / "probe.json"
  if not path.is_file():
    return {}
  p = json.loads(path.read_text())
  inj = p["injected"].get(point, {}).get(f"int{bits}")
  if inj is None:
    return {}
  grad = p["sensitivity"][point] * inj
  return {"injected": inj, "gradient": grad, "noise_ratio": grad / p["noise"]}


def main(argv: list[str] | None = None) -> list[dict]:
  from models.run_config import use_host_devices

  use_host_devices()
  from models.tune import cached_run  # after use_host_devices: it imports jax

  ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy.sources")
  ap.add_argument("--models", default="gpt,qwen")
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--points", default=",".join(POINTS), help="comma-separated names of POINTS")
  ap.add_argument("--out", required=True)
  a = ap.parse_args(argv)
  out = pathlib.Path(a.out)
  names = [n for n in a.points.split(",") if n]
  bad = [n for n in names if n not in POINTS]
  if bad:
    ap.error(f"unknown --points {bad}; accepted: {list(POINTS)}")
  rows = []
  for model in a.models.split(","):
    base = ["--model", model, *common(a.steps, a.seed)]
    ex = cached_run([*base, "--policy", "exact"], out / "runs" / f"{model}-exact-s{a.seed}")
    ex_bytes = ex["wire"]["total"]["uncompressed"]
    rows.append({"model": model, "point": "exact", "val": ex["val_loss_end"], "ratio": 1.0})
    for name in names:
      flags, point, bits = POINTS[name]
      slug = name.replace(" ", "-").replace(",", "")
      s = cached_run(
        [*base, "--policy", "exact", *flags], out / "runs" / f"{model}-{slug}-s{a.seed}"
      )
      rows.append(
        {
          "model": model,
          "point": name,
          "val": s["val_loss_end"],
          "ratio": s["val_loss_end"] / ex["val_loss_end"],
          "bytes": s["wire"]["total"]["compressed"] / ex_bytes if ex_bytes else None,
          **probe_figures(out, model, point, bits),
        }
      )
      print(table(rows), flush=True)
  cmd = "python -m benchmarks.accuracy.sources " + " ".join(argv or sys.argv[1:])
  (out / "results.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
  (out / "results.md").write_text(f"    {cmd}\n\n{table(rows)}\n")
  return rows


if __name__ == "__main__":
  main()
