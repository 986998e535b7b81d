"""Step time of examples/gspmd at a 1 Gbit/s link: the original program against jcoccl int8
two_shot + error feedback, pure data parallel and HSDP, interleaved, with the spread.

Each run is 2 processes x 4 CPU devices under ``jcoccl.launch --link-rate 1gbit`` (a fresh
network namespace whose loopback tc shapes to 1 Gbit/s, deleted afterwards; needs root, as
DESIGN.md describes). Pure data parallel: mesh data 4 x model 2, the data axis crossing the
link. HSDP: mesh replica 2 x fsdp 2 x model 2 (``--replicas 2``), the kernels sharded over
fsdp inside a process, the replica axis crossing the link. The four programs run in turn,
``--repeats`` times, so that a slow spell of the machine falls on all of them; each run's
step time is the median of its steps after the first ``--warmup``.

A benchmark, not a test: run it alone on an otherwise idle machine (several minutes)::

    python -m benchmarks.gspmd_step --out OUT_DIR [--repeats 3 --steps 25]
        [--d-model 256 --n-layers 4 --batch 32 --seq-len 64]

The size flags pass to the example: a small batch and a wide model make the step
bound by the link rather than by these CPUs' compute.

It writes each run's JSON (the example's ``--json``) under OUT_DIR and prints a table:
per layout, the original's and int8 + EF's seconds per step (median over repeats, min-max)
and their ratio (median, min-max over repeats).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Sequence

LAYOUTS = {"dp": [], "hsdp": ["--replicas", "2"]}
PROGRAMS = {"orig": [], "int8ef": ["--compressor", "int8", "--ef"]}
SIZE = ("d_model", "n_layers", "batch", "seq_len")  # the example's model and batch flags


def command(
  layout: str, program: str, steps: int, out: pathlib.Path, size: Sequence[str] = ()
) -> list[str]:
  """One run: 2 processes x 4 devices at 1 Gbit/s, the example at ``size`` (its flags)."""
  py = sys.executable
  return [
    *(py, "-m", "jcoccl.launch", "-n", "2", "--devices-per-process", "4"),
    *("--link-rate", "1gbit", "--"),
    *(py, "-m", "examples.gspmd.train", "--steps", str(steps), *size),
    *("--json", str(out)),
    *LAYOUTS[layout],
    *PROGRAMS[program],
  ]


def step_s(path: pathlib.Path, warmup: int) -> float:
  """A run's seconds per step: the median after the warm-up steps."""
  return statistics.median(json.loads(path.read_text())["step_s"][warmup:])


def table(out: pathlib.Path, repeats: int, warmup: int) -> list[str]:
  """The summary lines from the runs' JSON files under ``out``."""
  lines = ["| layout | original s/step (min-max) | int8 + EF s/step (min-max) | ratio (min-max) |"]
  lines.append("|---|---|---|---|")
  for layout in LAYOUTS:
    runs = {
      p: [step_s(out / f"{layout}-{p}-{r}.json", warmup) for r in range(1, repeats + 1)]
      for p in PROGRAMS
    }
    ratios = [i / o for o, i in zip(runs["orig"], runs["int8ef"])]
    cell = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
    lines.append(f"| {layout} | {cell(runs['orig'])} | {cell(runs['int8ef'])} | {cell(ratios)} |")
  return lines


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", required=True, help="folder for the runs' JSON files")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--steps", type=int, default=25)
  ap.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation)")
  ap.add_argument("--summary-only", action="store_true", help="only print the table")
  ap.add_argument("--d-model", type=int, default=256)
  ap.add_argument("--n-layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
  ap.add_argument("--seq-len", type=int, default=64)
  args = ap.parse_args(argv)
  size = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SIZE]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if not args.summary_only:
    for r in range(1, args.repeats + 1):
      for layout in LAYOUTS:
        for program in PROGRAMS:
          path = out / f"{layout}-{program}-{r}.json"
          subprocess.run(command(layout, program, args.steps, path, size), check=True)
  print("\n".join(table(out, args.repeats, args.warmup)))


if __name__ == "__main__":
  main()
