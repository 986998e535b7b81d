"""Train GPT-2 or Qwen2 on Shakespeare, 3D-parallel over jcoccl's compressed collectives.

  python -m models.train                                  # small GPT, 8 CPU devices 2x2x2
  python -m models.train --model qwen --mesh 4,2,1 --policy models/configs/int8.toml
  python -m models.train --compress data.all_reduce=int4 --compress data.min_bytes=0
  python -m models.train --zero                           # ZeRO: sharded AdamW state over 'data'
  python -m models.train --zero --policy zeropp           # ZeRO++: int8 weights, int4 grads, nodes
  python -m models.train --resume                         # continue runs/<name>

Every flag and the policy are checked before anything is loaded or compiled: a bad flag exits
with ``error: --flag ...`` (status 2), a bad policy file names its table and key.

Writes runs/<name>/: metrics.jsonl (one JSON object per logged step and per validation, and
one "wire" record), loss.png, summary.json, config.json (the flags that rebuild the model, for
``python -m models.sample``), calibration.json (the cost model the run trained under:
measured at start, given, or none, and why; each checkpoint holds it too, and ``--resume``
reuses it unless ``--recalibrate``) and orbax checkpoints under ckpt/; the final loss line is
followed by a short sample of the trained model (fixed prompt, seed and temperature). ``--resume``
continues from the newest checkpoint that restores; damaged newer ones are named, skipped and
moved to ckpt-skipped/, and a torn last line of metrics.jsonl is dropped. Bytes on the
wire per step and device, by mesh axis, are measured on the compiled train step with
``jcoccl.wire_bytes(..., mesh=mesh)``, next to the same step compiled with the exact policy
(summary.json "wire", with its "source"); ``--no-hlo-wire`` skips them. That exact
step also trains alongside, from the same weights on the same batches (the exact twin,
summary.json "exact_twin"), so the run prints what compression cost in validation loss and
tokens/s (``--no-exact-twin`` skips it; a resumed run has none). Before the first step the
run prints what its cost model predicts for the step's compressed all_reduce arrays
(summary.json "auto", ``models.calibration.verdict``). Without an accelerator and
without XLA_FLAGS, :func:`main` asks XLA for 8 host CPU devices before jax starts.

The jobs live in their own modules: ``models.cli`` (flags and their checks),
``models.run_config`` (the checked flags as a ``RunConfig``, shared with ``models.sample``),
``models.checkpoint``, ``models.metrics`` (wire report, records, plot) and ``models.loop``
(the steps); this module builds a run from them and keeps their public names.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import NoReturn

import jax

import jcoccl
from models import calibration, data, loop, parallel
from models.adaptive import Adaptive, probe_fn
from models.checkpoint import State, checkpointer, restore, saved_adaptive, saved_calibration
from models.cli import PROG, check_corpus, load_policy, parse_args
from models.directed import DirectedParallel
from models.directions import AdaptConfig
from models.metrics import lead, read_records, say, start_metrics
from models.recipe import Recipe
from models.run_config import (
  CONFIGS,
  RunConfig,
  SetupError,
  build_model,
  checkpoint_steps,
  policy_path,
  use_host_devices,
  write_config,
)

# The names that callers (tests, benchmarks/) use from models.train.
batch_at = loop.batch_at
SAMPLE_TEMPERATURE, SAMPLE_SEED = loop.SAMPLE_TEMPERATURE, loop.SAMPLE_SEED

__all__ = [
  "CONFIGS",
  "PROG",
  "SAMPLE_SEED",
  "SAMPLE_TEMPERATURE",
  "SetupError",
  "batch_at",
  "build_model",
  "checkpoint_steps",
  "cli",
  "data",
  "load_policy",
  "main",
  "parse_args",
  "policy_path",
  "prepare",
  "read_records",
  "run_directions",
]


def main(argv: list[str] | None = None) -> dict:
  """Runs training; returns the summary dict (also written to summary.json).

  Without an accelerator and without XLA_FLAGS, asks XLA for 8 host CPU devices first
  (``models.run_config.use_host_devices``). Flags are checked next (a bad one exits with status 2),
  then the policy (SetupError naming the file and key), before the corpus is loaded or
  anything compiled.

  Under ``python -m jcoccl.launch`` or a cluster launcher (see
  :func:`jcoccl.distributed.initialize`) every process runs this same function: they join
  one runtime, share one mesh ('data' across processes) and checkpoint together; process 0
  writes metrics.jsonl, loss.png and summary.json.

  Example:
    >>> summary = main(["--size", "tiny", "--steps", "20", "--out", "/tmp/run"])
  """
  use_host_devices()
  multi = jcoccl.distributed.initialize()
  cfg, job = prepare(argv)
  job.argv = argv
  try:
    summary = loop.train(cfg, job)
  except jax.errors.JaxRuntimeError as e:
    if not multi:
      raise
    _lost_peer(e)
  # Ends the manager's background threads with the run (a process may run several, as the
  # tests do). Only after a run that ended well: after a lost peer it could wait on it.
  job.mngr.close()
  return summary


def prepare(argv: list[str] | None) -> tuple[RunConfig, loop.Job]:
  """The checked flags and the job they describe (:func:`build_job`), nothing trained:
  what :func:`main` trains, and what ``benchmarks.accuracy.exact_eval`` restores with
  ``--resume``.

  Raises:
    SystemExit: a bad flag (status 2). SetupError: a bad policy or checkpoint.
  """
  args = parse_args(argv)
  recipe = load_policy(args)
  corpus = data.load_corpus(args.tokenizer, max_chars=args.max_chars)
  check_corpus(args, corpus)
  cfg = RunConfig.from_args(args)
  job = build_job(
    cfg, recipe, corpus, getattr(args, "directions", None), getattr(args, "adapt_config", None)
  )
  return cfg, job


def build_job(
  cfg: RunConfig,
  recipe: Recipe,
  corpus: data.Corpus,
  directions: dict | None = None,
  adapt: AdaptConfig | None = None,
) -> loop.Job:
  """The model on the mesh, its optimizer and state (restored with ``--resume``), the
  exact-policy twin for the wire report, config.json and the metrics kept so far.

  ``directions`` (``--direction``, over the policy file's ``[directions]``) and ``adapt``
  (``--adapt``) give points their own codecs
  (``models.directed.DirectedParallel``); the adaptive controller continues from the
  restored checkpoint's state.

  Raises:
    SetupError: no checkpoint restores, or ``--steps`` is below the restored step.
  """
  model = build_model(cfg, corpus.vocab_size)
  mesh = parallel.make_mesh(*cfg.mesh_shape)
  directions = run_directions(recipe, directions)
  controller = Adaptive(adapt) if adapt is not None else None

  def make(d: dict) -> parallel.Parallel3D:
    kw = dict(n_micro=cfg.micro, dtype=cfg.dtype, seed=cfg.seed)
    if not d:
      return parallel.Parallel3D(model, mesh, recipe, **kw)
    return DirectedParallel(model, mesh, recipe, directions=d, **kw)

  par = make({**directions, **(controller.directions() if controller else {})})
  tx = loop.make_optimizer(cfg)
  params = par.placement.shard(model)
  state = State(params, par.init_opt(tx, params), par.grad_sync.init_ef(params))
  # The uncompressed reference for the wire-bytes report: same model, mesh, dtype and ZeRO
  # mode (the same optimizer-state layout and node split), exact policy; the run itself
  # when its recipe is that one.
  ref = Recipe(zero=True, nodes=recipe.nodes) if recipe.zero else Recipe()
  exact = None
  if not cfg.no_hlo_wire:
    exact = (
      par
      if recipe == ref and type(par) is parallel.Parallel3D
      else parallel.Parallel3D(model, mesh, ref, n_micro=cfg.micro, dtype=cfg.dtype)
    )
  cfg.out.mkdir(parents=True, exist_ok=True)
  if lead():
    write_config(cfg)
  mngr = checkpointer(cfg.out)
  metrics_path = cfg.out / "metrics.jsonl"
  saved = None
  if cfg.resume:
    state = restore(mngr, state, cfg.out)
    if state.step > cfg.steps:
      raise SetupError(
        f"--steps {cfg.steps} is below step {state.step} of the checkpoint "
        f"to resume; pass --steps {state.step} or more"
      )
    saved = calibration.share(_saved_calibration(mngr, state.step, cfg) if lead() else None)
    if controller is not None:
      kept = saved_adaptive(mngr, state.step)
      if kept is None:
        raise SetupError(f"--adapt: the checkpoint at step {state.step} holds no adaptive state")
      controller.load(kept)
      par = make({**directions, **controller.directions()})
  # After the restore: a resumed run installs the cost model its checkpoint was trained
  # under, so that auto makes the same choices as before (the programs are traced later).
  how = calibration.mode(cfg.calibrate, cfg.resume, cfg.recalibrate)
  codecs = calibration.auto_codecs(recipe.policy, mesh)
  calibrated = calibration.start(mesh, how, say, codecs, saved)
  if how == "reuse" and saved is not None:
    calibrated["reused_from_step"] = state.step
  if lead():
    (cfg.out / "calibration.json").write_text(json.dumps(calibrated, indent=1))
  records = start_metrics(metrics_path, state.step if cfg.resume else None)
  twin = None
  if cfg.exact_twin and exact is not None and exact is not par and not cfg.resume:
    # Its own buffers: each train step donates the arrays it is given.
    same = jax.tree.map(lambda a: a.copy(), params)
    twin = State(same, exact.init_opt(tx, same), exact.grad_sync.init_ef(same))
  job = loop.Job(
    par, exact, tx, state, corpus, recipe, mngr, records, metrics_path, calibrated, twin
  )
  if controller is not None:
    job.adapt = controller
    job.make_par = lambda d: make({**directions, **d})
    job.adapt_probe = probe_fn(model, mesh, cfg, controller.config)
  return job


def run_directions(recipe: Recipe, flags: dict | None) -> dict:
  """The points given their own codecs: the policy file's ``[directions]``, then
  ``--direction`` (``flags``), which wins.

  Example:
    >>> run_directions(Recipe(directions={"tensor.backward": "int4"}), {"pipe.forward": "int8"})
    {'tensor.backward': 'int4', 'pipe.forward': 'int8'}
  """
  return {**recipe.directions, **dict(flags or {})}


def _saved_calibration(mngr, step: int, cfg: RunConfig) -> dict | None:
  """The calibration record of the checkpoint at ``step``; for checkpoints saved without
  one, the run's calibration.json (what the run measured at its start)."""
  rec = saved_calibration(mngr, step)
  if rec is not None:
    return rec
  try:
    rec = json.loads((cfg.out / "calibration.json").read_text())
  except (OSError, ValueError):
    return None
  return rec if isinstance(rec, dict) and "calibrated" in rec else None


_PEER_LOST = re.compile(
  r"gloo|connection reset|connection closed|heartbeat|another task|"
  r"unavailable|socket closed|broken pipe",
  re.IGNORECASE,
)


def _lost_peer(e: Exception) -> NoReturn:
  """Ends this process at once after a collective failed in a multi-process run.

  A process that died leaves the others' next collective failing ("Gloo ... Connection
  reset by peer"); one clear line and ``os._exit`` avoid the traceback and the coordination
  service's abort at interpreter exit. Checkpoints on disk stay valid for ``--resume``.
  """
  first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
  who = (
    "a peer process failed"
    if _PEER_LOST.search(str(e))
    else (f"process {jax.process_index()} failed")
  )
  sys.stdout.flush()
  print(f"models.train: {who}: {first}; resume with --resume", file=sys.stderr, flush=True)
  os._exit(1)


def cli(argv: list[str] | None = None) -> int:
  """``python -m models.train``: :func:`main`, with a SetupError reported like a bad flag
  (``error: ...``, exit status 2, no traceback)."""
  try:
    main(argv)
  except SetupError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    # Ctrl-C outside the steps (set-up, compiling before the loop, the final sample): the
    # steps' own handler (models.interrupt) saves; here there is nothing new to save.
    print(
      "\nmodels.train: interrupted outside the training steps; nothing saved (the "
      "checkpoints on disk are as they were)",
      file=sys.stderr,
    )
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(cli())
