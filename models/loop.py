"""The training loop of ``python -m models.train``: batches, steps, evaluation, records,
checkpoints, and the end-of-run summary with a short sample.

:func:`train` takes the run's :class:`models.run_config.RunConfig` and the :class:`Job` that
``models.train.main`` built from it (model, mesh, optimizer, state, corpus, checkpoints).

Example:
  >>> summary = train(cfg, Job(par, None, make_optimizer(cfg), state, corpus, recipe, mngr,
  ...                          [], cfg.out / "metrics.jsonl"))
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import jcoccl
from models import calibration, data, interrupt, sample
from models.checkpoint import State, save
from models.metrics import NO_WIRE, lead, machine, plot, print_summary, say, wire_report
from models.parallel import Parallel3D
from models.recipe import Recipe
from models.run_config import RunConfig, build_model

# The end-of-run sample: a fixed prompt, seed and temperature, so that runs under different
# policies can be read side by side (greedy decoding of small char models mostly loops).
SAMPLE_TEMPERATURE, SAMPLE_SEED = 0.8, 0


@dataclasses.dataclass
class Job:
  """What a run builds before its first step.

  Attributes:
    par: the model on the mesh under the run's recipe.
    exact: the same model and mesh under the exact policy, for the wire report (None: not
      measured, ``--no-hlo-wire``).
    tx: the optimizer (:func:`make_optimizer`).
    state: parameters, optimizer state, error-feedback residuals and step; updated in place.
    corpus: the tokenized text.
    recipe: the policy and training switches (printed at the start).
    mngr: the checkpoint manager (``models.checkpoint.checkpointer``).
    records: the metrics records so far (process 0; appended to).
    metrics_path: metrics.jsonl.
    calibration: the cost model's record (``models.calibration.start``), saved with each
      checkpoint.
    twin: the state of the exact twin, which trains ``exact`` on the same batches from the
      same initial weights, for the loss and speed compression costs (None: no twin).
  """

  par: Parallel3D
  exact: Parallel3D | None
  tx: optax.GradientTransformation
  state: State
  corpus: data.Corpus
  recipe: Recipe
  mngr: Any
  records: list[dict]
  metrics_path: pathlib.Path
  calibration: dict = dataclasses.field(default_factory=dict)
  twin: State | None = None
  twin_tokens_per_s: float | None = None
  # --adapt (models.adaptive): the controller, make_par(directions) -> Parallel3D, and
  # adapt_probe(params, x, y, first) -> the probe's measurements.
  adapt: Any = None
  make_par: Callable[[dict], Parallel3D] | None = None
  adapt_probe: Callable[..., dict] | None = None
  # The command line's flags (None: sys.argv[1:]), for the resume command a signal prints.
  argv: list[str] | None = None
  # The final weights' validation loss through exact collectives (summary.json
  # "val_loss_exact_collectives"): what they give when served uncompressed.
  val_loss_exact_collectives: float | None = None


def lr_schedule(cfg: Any) -> optax.Schedule:
  """Linear warmup from lr/warmup (so the first step already moves) to lr, then cosine to 10%."""
  warmup = min(cfg.warmup, max(cfg.steps - 1, 1))
  return optax.warmup_cosine_decay_schedule(
    cfg.lr / max(warmup, 1), cfg.lr, warmup, max(cfg.steps, 2), end_value=cfg.lr * 0.1
  )


def make_optimizer(cfg: Any) -> optax.GradientTransformation:
  """AdamW over :func:`lr_schedule` (clipping is done globally, in parallel)."""
  return optax.adamw(lr_schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)


def batch_at(
  corpus: data.Corpus, cfg: Any, par: Parallel3D, split: str, step: int, i: int = 0
) -> tuple[jax.Array, ...]:
  """The global batch for (split, step), placed on ``par``'s batch sharding.

  A function of the seed only, so a resumed run sees the same, and so does a run over any
  number of processes: each draws the whole batch's window starts (cheap) and reads the
  token windows of its own rows only.
  """
  rng = np.random.default_rng([cfg.seed, step, i, 0 if split == "train" else 1])
  starts = corpus.starts(rng, split, batch=cfg.batch, seq_len=cfg.seq_len)
  return par.placement.make_batch(
    cfg.batch, lambda rows: corpus.windows(split, starts[rows], cfg.seq_len)
  )


def evaluate(cfg: Any, job: Job, eval_fn: Any, params: Any = None) -> float:
  """The mean validation loss of ``params`` (default: the run's) over ``cfg.eval_batches``
  batches drawn for this step."""
  params = job.state.params if params is None else params
  losses = []
  for i in range(cfg.eval_batches):
    x, y = batch_at(job.corpus, cfg, job.par, "val", job.state.step, i)
    losses.append(float(eval_fn(params, x, y)))
  return float(np.mean(losses))


def train(cfg: RunConfig, job: Job) -> dict:
  """Trains from ``job.state.step`` to ``cfg.steps``; returns the summary (:func:`finish`).

  Each step's loss, gradient norm, learning rate and time go to metrics.jsonl every
  ``cfg.log_every`` steps (and at the first step and every validation); the first step
  also writes the wire record. Checkpoints every ``cfg.ckpt_every`` steps and at the end.

  SIGINT or SIGTERM during the steps (``models.interrupt``) stops after the current step
  with a checkpoint of it and a line naming the step and the resume command.

  Raises:
    FloatingPointError: the loss is not finite.
    models.interrupt.Interrupted: stopped by a signal (a SystemExit of status 130 or 143).
  """
  state, par = job.state, job.par
  step_fn = par.train_step(job.tx, state.params, clip_norm=cfg.clip)
  eval_fn = jax.jit(lambda p, x, y: par.loss_and_grads(p, x, y)[0])
  twin, exact = job.twin, job.exact
  # The exact policy's evaluation: the twin's validation, and the run's final weights
  # through exact collectives (one program for both).
  exact_eval = None if exact is None else jax.jit(lambda p, x, y: exact.loss_and_grads(p, x, y)[0])
  if twin is not None and exact is not None:
    exact_step = exact.train_step(job.tx, twin.params, clip_norm=cfg.clip)
  start_step = state.step
  _announce(cfg, job)
  # The progress bar appears once the first step is compiled: what is printed before it
  # (the calibration's prediction) never shares its line. Later lines go through its write.
  bar: Any = None

  def write(text: str) -> None:
    if lead():
      (print if bar is None else bar.write)(text)

  wire, t_steady, n_steady, lr = None, 0.0, 0, lr_schedule(cfg)
  # The step is traced and compiled once, here: the wire report reads that executable.
  traced = run = auto = ref_traced = ref_run = None
  t_twin = 0.0
  programs: dict = {}  # --adapt: each bit set's (Parallel3D, compiled step)
  with open(job.metrics_path if lead() else os.devnull, "a") as log, interrupt.Stop() as stop:
    for step in range(start_step, cfg.steps):
      x, y = batch_at(job.corpus, cfg, par, "train", step)
      if job.adapt is not None and _adapt(job, step, x, y, log, write):
        key = job.adapt.key()
        if key in programs:
          par, run = programs[key]
        else:
          assert job.make_par is not None
          par, run = job.make_par(job.adapt.directions()), None
          step_fn = par.train_step(job.tx, state.params, clip_norm=cfg.clip)
        job.par = par
        eval_fn = jax.jit(lambda p, x, y, par=par: par.loss_and_grads(p, x, y)[0])
      # The step number keys stochastic rounding (Parallel3D.train_step); a step with no
      # stochastic codec is traced without it, as it always was.
      at = (np.int32(step),) if par.stochastic else ()
      if run is None:
        first = len(par.coll.log)
        traced = step_fn.trace(state.params, state.opt_state, state.ef, x, y, *at)
        auto = _auto_verdict(job, par.coll.log[first:], write)
        run = traced.lower().compile()
        if job.adapt is not None:
          programs[job.adapt.key()] = (par, run)
          total = jcoccl.wire_bytes(traced, mesh=par.mesh, program="compiled")["total"]
          job.adapt.program_bytes[str(job.adapt.key())] = float(total)
        if twin is not None and ref_run is None:
          ref_traced = exact_step.trace(twin.params, twin.opt_state, twin.ef, x, y)
          ref_run = ref_traced.lower().compile()
      if bar is None:
        bar = _progress_bar(cfg, start_step)
      t0 = time.perf_counter()
      state.params, state.opt_state, state.ef, m = run(
        state.params, state.opt_state, state.ef, x, y, *at
      )
      loss = float(m["loss"])
      dt = time.perf_counter() - t0
      if twin is not None:
        t1 = time.perf_counter()
        twin.params, twin.opt_state, twin.ef, mx = ref_run(
          twin.params, twin.opt_state, twin.ef, x, y
        )
        exact_loss = float(mx["loss"])
        t_twin += (time.perf_counter() - t1) if wire is not None else 0.0
      if wire is None:
        wire = (
          NO_WIRE
          if job.exact is None
          else wire_report(par, job.exact, job.tx, traced, state, x, cfg.clip, ref_traced)
        )
        log.write(json.dumps({"step": step + 1, "wire": wire}) + "\n")
      else:
        t_steady, n_steady = t_steady + dt, n_steady + 1
      state.step = step + 1
      rec = {
        "step": state.step,
        "loss": loss,
        "grad_norm": float(m["grad_norm"]),
        "lr": float(lr(step)),
        "step_s": dt,
      }
      if twin is not None:
        rec["exact_loss"] = exact_loss
      if not np.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {state.step}")
      if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
        rec["val_loss"] = evaluate(cfg, job, eval_fn)
        if twin is not None:
          rec["exact_val_loss"] = evaluate(cfg, job, exact_eval, twin.params)
      if state.step % cfg.log_every == 0 or "val_loss" in rec or step == start_step:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        job.records.append(rec)
      bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
      bar.update(1)
      if job.adapt is not None:
        job.adapt.count_step()
      saved = state.step % cfg.ckpt_every == 0 or state.step == cfg.steps
      if saved:
        _save(job)
      signum = stop.agreed()
      if signum is not None and state.step < cfg.steps:
        if not saved:
          _save(job)
        log.flush()
        bar.close()
        say(interrupt.message(signum, state.step, cfg.steps, str(cfg.out / "ckpt"), job.argv))
        raise interrupt.Interrupted(128 + signum)
  if bar is not None:
    bar.close()
  if state.step > start_step and exact_eval is not None:
    own = job.records[-1].get("val_loss") if job.records else None
    # An exact run's own collectives are the exact ones: nothing to measure again.
    exact_run = job.par is exact and job.adapt is None
    job.val_loss_exact_collectives = own if exact_run else evaluate(cfg, job, exact_eval)
  tps = cfg.batch * cfg.seq_len * n_steady / t_steady if n_steady else None
  if twin is not None and n_steady:
    job.twin_tokens_per_s = cfg.batch * cfg.seq_len * n_steady / t_twin
  return finish(cfg, job, wire or NO_WIRE, tps, start_step, auto)


def _progress_bar(cfg: RunConfig, start_step: int) -> Any:
  """The steps' progress bar on process 0's terminal; none with --no-progress or when stderr
  is not a terminal (a log file would hold every redraw of the bar)."""
  from tqdm import tqdm

  shown = lead() and not cfg.no_progress and sys.stderr.isatty()
  return tqdm(initial=start_step, total=cfg.steps, disable=not shown, desc="train")


def _save(job: Job) -> None:
  """A checkpoint of the run's state with its calibration and adaptive state."""
  save(job.mngr, job.state, job.calibration or None, job.adapt and job.adapt.state_dict())


def _adapt(job: Job, step: int, x: Any, y: Any, log: Any, write: Callable[[str], Any]) -> bool:
  """At an ``--adapt-every`` boundary: probes the current parameters on this step's batch,
  lets the controller decide, logs a change (metrics.jsonl ``{"step", "adapt"}`` and a
  line); True when the bits changed (or were first set)."""
  if not job.adapt.due(step) or job.adapt_probe is None:
    return False
  measured = job.adapt_probe(job.state.params, x, y, not job.adapt.sensitivity)
  before = job.adapt.key()
  rec = job.adapt.update(step, measured)
  if rec is None:
    return False
  log.write(json.dumps({"step": step, "adapt": rec}) + "\n")
  log.flush()
  write(f"adapt at step {step}: bits {rec['bits']} ({rec['reason']}; noise {rec['noise']})")
  return job.adapt.key() != before or len(job.adapt.changes) == 1


def _auto_verdict(job: Job, log: list, write: Callable[[str], Any] = say) -> dict:
  """Prints (with ``write``: process 0) and returns what the run's cost model predicts for
  the compressed all_reduce calls of the step just traced (``models.calibration.verdict``)."""
  ef = tuple(job.par.grad_sync.ef_levels()) if job.par.grad_sync.uses_error_feedback() else ()
  v = calibration.verdict(job.calibration, log, job.recipe.policy, job.par.mesh, ef)
  write("\n".join(calibration.verdict_lines(v, job.calibration)))
  return v


def _announce(cfg: RunConfig, job: Job) -> None:
  n_params = sum(a.size for a in jax.tree.leaves(job.state.params))
  say(
    f"{cfg.model}-{cfg.size}: {n_params / 1e6:.2f}M params, vocab {job.corpus.vocab_size} "
    f"({cfg.tokenizer}), mesh data x tensor x pipe = {cfg.mesh} over "
    f"{jax.process_count()} process(es), policy:\n  " + job.recipe.describe().replace("\n", "\n  ")
  )


def _twin_summary(job: Job) -> dict | None:
  """The exact twin's last train and validation losses and its speed (None: no twin)."""
  if job.twin is None:
    return None
  losses = [r["exact_loss"] for r in job.records if "exact_loss" in r]
  vals = [r["exact_val_loss"] for r in job.records if "exact_val_loss" in r]
  return {
    "loss_end": losses[-1] if losses else None,
    "val_loss_end": vals[-1] if vals else None,
    "tokens_per_s": job.twin_tokens_per_s,
  }


def final_sample(cfg: Any, params: dict, corpus: data.Corpus) -> str:
  """A short continuation of a fixed prompt by the trained parameters (one device, fixed
  seed and temperature :data:`SAMPLE_TEMPERATURE`)."""
  try:
    prompt = corpus.encode(sample.DEFAULT_PROMPT)
  except ValueError:  # a --max-chars corpus too short to hold the prompt's characters
    prompt = corpus.val[:8]
  model = build_model(cfg, corpus.vocab_size)
  fwd = sample.single_device_forward(model, sample.host_params(params), cfg.dtype)
  s = sample.generate(
    fwd,
    prompt,
    length=cfg.sample_tokens,
    context=cfg.seq_len,
    temperature=SAMPLE_TEMPERATURE,
    seed=SAMPLE_SEED,
  )
  return corpus.decode(prompt) + corpus.decode(s.tokens)


def finish(
  cfg: RunConfig,
  job: Job,
  wire: dict,
  tps: float | None,
  start_step: int,
  auto: dict | None = None,
) -> dict:
  """The run's summary: process 0 also draws loss.png, adds the sample, writes summary.json
  and prints the end-of-run lines; the other processes return the shared numbers only.
  ``auto``: what the cost model predicts for the step's messages (summary "auto")."""
  state, resumed_from = job.state, start_step if cfg.resume else None
  if not lead():
    return {"steps": state.step, "resumed_from": resumed_from, "wire": wire, "tokens_per_s": tps}
  plot(job.records, cfg.out / "loss.png")
  losses = [r["loss"] for r in job.records if "loss" in r]
  vals = [r["val_loss"] for r in job.records if "val_loss" in r]
  summary = {
    "steps": state.step,
    "resumed_from": resumed_from,
    "loss_start": losses[0] if losses else None,
    "loss_end": losses[-1] if losses else None,
    "val_loss_end": vals[-1] if vals else None,
    "val_loss_exact_collectives": job.val_loss_exact_collectives,
    "tokens_per_s": tps,
    "wire": wire,
    "auto": auto or {},
    "exact_twin": _twin_summary(job),
    "sample": None,
    "machine": machine(),
  }
  if job.adapt is not None:
    summary["adaptive"] = {**job.adapt.state_dict(), "mean_bytes": job.adapt.mean_bytes()}
  if cfg.sample_tokens and state.step > start_step:
    summary["sample"] = final_sample(cfg, state.params, job.corpus)
  (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
  print_summary(cfg, summary, start_step, (SAMPLE_TEMPERATURE, SAMPLE_SEED))
  return summary
