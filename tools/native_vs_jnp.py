"""Trains the same job with the native codecs and with their jnp specification, and compares
the two bit for bit after every step (docs/numerics.md).

  python tools/native_vs_jnp.py --steps 6 -- --size small --policy int8
  python tools/native_vs_jnp.py --steps 6 -- --size tiny --policy coccl --dtype bfloat16

Each side runs in its own process (``JCOCCL_DISABLE_NATIVE=1`` selects the jnp path, and it
is read once per process), builds the job of ``python -m models.train`` from the flags after
``--`` (``--steps`` is the tool's unless given there; always ``--no-calibrate``, so that both
make the same algorithm choices), and saves the parameters, optimizer state and
error-feedback residuals after each step. The report names, per step, the leaves whose bits
differ; exit status 1 if any do.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def worker(out: pathlib.Path, steps: int, argv: list[str]) -> None:
  """Runs ``steps`` train steps of the models.train job; writes state<k>.npz and names.txt."""
  sys.path.insert(0, str(ROOT))
  from models.run_config import use_host_devices

  use_host_devices()
  import jax

  from models import data, loop
  from models.cli import load_policy, parse_args
  from models.run_config import RunConfig
  from models.train import build_job

  # --steps first (the learning-rate schedule's length; the flags after -- may change it).
  flags = ["--steps", str(steps), *argv, "--out", str(out / "run"), "--no-calibrate"]
  args = parse_args([*flags, "--no-hlo-wire"])
  corpus = data.load_corpus(args.tokenizer, max_chars=args.max_chars)
  cfg = RunConfig.from_args(args)
  job = build_job(cfg, load_policy(args), corpus)
  st = job.state
  step_fn = job.par.train_step(job.tx, st.params, clip_norm=cfg.clip)
  tree = lambda: (st.params, st.opt_state, st.ef)
  paths = jax.tree_util.tree_flatten_with_path(tree())[0]
  (out / "names.txt").write_text("\n".join(jax.tree_util.keystr(p) for p, _ in paths))
  for step in range(steps):
    x, y = loop.batch_at(corpus, cfg, job.par, "train", step)
    st.params, st.opt_state, st.ef, m = step_fn(st.params, st.opt_state, st.ef, x, y)
    leaves = jax.tree.leaves(tree())
    np.savez(out / f"state{step + 1}.npz", *[np.asarray(a) for a in leaves])
    print(f"step {step + 1} loss {float(m['loss'])!r}", flush=True)


def differing(a: pathlib.Path, b: pathlib.Path, step: int, names: list[str]) -> list[str]:
  """``name (count/size)`` of each leaf whose bits differ between the two runs at ``step``."""
  za, zb = np.load(a / f"state{step}.npz"), np.load(b / f"state{step}.npz")
  bad = []
  for i, name in enumerate(names):
    x, y = za[f"arr_{i}"].reshape(-1), zb[f"arr_{i}"].reshape(-1)
    n = int((x.view(np.uint8) != y.view(np.uint8)).reshape(x.size, -1).any(1).sum())
    if n:
      bad.append(f"{name} ({n}/{x.size})")
  return bad


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=6, help="train steps to compare")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("train_args", nargs="*", help="models.train flags (after --)")
  args = p.parse_args()
  if args.worker:
    worker(pathlib.Path(args.worker), args.steps, args.train_args)
    return 0
  with tempfile.TemporaryDirectory(prefix="native_vs_jnp_") as tmp:
    runs = {}
    for side, disable in (("native", "0"), ("jnp", "1")):
      out = pathlib.Path(tmp) / side
      out.mkdir()
      env = {**os.environ, "JCOCCL_DISABLE_NATIVE": disable}
      cmd = [sys.executable, __file__, "--steps", str(args.steps), "--worker", str(out)]
      subprocess.run([*cmd, "--", *args.train_args], env=env, check=True)
      runs[side] = out
    names = (runs["native"] / "names.txt").read_text().splitlines()
    same = True
    for step in range(1, args.steps + 1):
      bad = differing(runs["native"], runs["jnp"], step, names)
      same = same and not bad
      more = " ..." if len(bad) > 4 else ""
      print(
        f"step {step}: "
        + (f"{len(bad)} leaves differ: " + ", ".join(bad[:4]) + more if bad else "bitwise equal")
      )
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
