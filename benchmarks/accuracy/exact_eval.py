"""Validation loss of finished runs, through their own collectives and through exact ones.

  python -m benchmarks.accuracy.exact_eval RUN_DIR [RUN_DIR ...] [--out table.md]

A compressed run's validation loss (summary.json ``val_loss_end``) is measured with the
run's own policy, so its tensor and pipe activations pass the lossy codecs in evaluation too.
A model trained with compression is usually served without it. This restores each run's
final checkpoint (a copy of the run directory, in a temporary directory: the run itself is
not touched) with the flags in its argv.json and evaluates the same parameters on the same
validation batches twice: with the run's policy (reproducing ``val_loss_end``, checked) and
with the exact policy. An adaptive run (``--adapt``) is evaluated with the bits its
controller held at the end.

A policy file named in argv.json by a path that no longer exists (a run from another
clone) is looked up under this repository by its path from ``models/`` or ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make models/ importable
  sys.path.insert(0, str(ROOT))

from models import loop, train  # noqa: E402
from models.run_config import use_host_devices  # noqa: E402


def local_path(path: str) -> str:
  """``path`` if it exists, else the same file under this repository (from its last
  ``models/`` or ``benchmarks/`` part), else ``path`` unchanged (the parser then says so)."""
  p = pathlib.Path(path)
  if p.exists():
    return path
  parts = p.parts
  for i in range(len(parts) - 1, -1, -1):
    if parts[i] in ("models", "benchmarks") and (ROOT.joinpath(*parts[i:])).exists():
      return str(ROOT.joinpath(*parts[i:]))
  return path


def evaluate_run(run: pathlib.Path) -> dict:
  """The run's final parameters evaluated with its policy and with the exact one.

  Args:
    run: a models.train output directory with argv.json, summary.json and ckpt/.

  Returns:
    ``{"run", "step", "val_loss", "val_loss_exact_collectives", "summary_val_loss"}``.

  Raises:
    RuntimeError: the own-policy loss does not reproduce summary.json's ``val_loss_end``.
  """
  import jax

  argv = json.loads((run / "argv.json").read_text())
  summary = json.loads((run / "summary.json").read_text())
  with tempfile.TemporaryDirectory() as tmp:
    copy = pathlib.Path(tmp) / run.name
    shutil.copytree(run, copy)
    i = argv.index("--out")
    # Without --no-hlo-wire the job holds the exact-policy Parallel3D evaluated below.
    argv = [a for a in [*argv[:i], "--out", str(copy), *argv[i + 2 :]] if a != "--no-hlo-wire"]
    argv.append("--resume")
    if "--policy" in argv:
      j = argv.index("--policy") + 1
      argv[j] = local_path(argv[j])
    cfg, job = train.prepare(argv)
    own = loop.evaluate(cfg, job, jax.jit(lambda p, x, y: job.par.loss_and_grads(p, x, y)[0]))
    exact = job.exact
    assert exact is not None  # built by train.build_job without --no-hlo-wire
    ex = loop.evaluate(cfg, job, jax.jit(lambda p, x, y: exact.loss_and_grads(p, x, y)[0]))
  want = summary.get("val_loss_end")
  if want is not None and abs(own - want) > 1e-6 * abs(want):
    raise RuntimeError(f"{run}: own-policy loss {own} does not reproduce val_loss_end {want}")
  return {
    "run": str(run),
    "step": job.state.step,
    "val_loss": own,
    "val_loss_exact_collectives": ex,
    "summary_val_loss": want,
  }


def main(argv: list[str] | None = None) -> list[dict]:
  """``python -m benchmarks.accuracy.exact_eval``; returns one row per run."""
  use_host_devices()
  ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy.exact_eval")
  ap.add_argument("runs", nargs="+", type=pathlib.Path, help="models.train output directories")
  ap.add_argument("--out", type=pathlib.Path, default=None, help="also write a markdown table")
  a = ap.parse_args(argv)
  missing = [str(r) for r in a.runs if not (r / "argv.json").is_file()]
  if missing:
    ap.error(f"not a models.train run directory (no argv.json): {', '.join(missing)}")
  rows = []
  for r in a.runs:
    rows.append(evaluate_run(r))
    print(json.dumps(rows[-1]), flush=True)
  lines = [
    "| run | step | val loss (own policy) | val loss (exact collectives) |",
    "|---|---|---|---|",
  ]
  lines += [
    f"| {pathlib.Path(r['run']).name} | {r['step']} | {r['val_loss']:.4f} | "
    f"{r['val_loss_exact_collectives']:.4f} |"
    for r in rows
  ]
  if a.out is not None:
    a.out.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return rows


if __name__ == "__main__":
  main()
