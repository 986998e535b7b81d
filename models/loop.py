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
    par: the model on the mesh under the run's recipe (never replaced: ``--adapt`` steps
      under the layouts its controller picks, each a :class:`Program` of :func:`train`).
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


@dataclasses.dataclass
class Program:
  """One parallel layout's compiled programs: the train step (compiled at its first step)
  and the evaluation.

  Attributes:
    par: the model on the mesh under the codecs these programs use.
    step_fn: ``par``'s jitted train step (traced and compiled by :func:`_compile`).
    eval_fn: ``(params, x, y) -> loss`` through ``par``'s collectives.
    traced: the step as traced (the wire report reads its executable).
    run: the compiled step (None: not compiled yet).
  """

  par: Parallel3D
  step_fn: Any
  eval_fn: Any
  traced: Any = None
  run: Any = None

  @classmethod
  def of(cls, cfg: RunConfig, job: Job, par: Parallel3D) -> Program:
    """``par``'s programs, not compiled yet."""
    step_fn = par.train_step(job.tx, job.state.params, clip_norm=cfg.clip)
    return cls(par, step_fn, _eval_fn(par))


def _eval_fn(par: Parallel3D) -> Any:
  """``(params, x, y) -> loss`` through ``par``'s collectives, jitted."""
  return jax.jit(lambda p, x, y: par.loss_and_grads(p, x, y)[0])


class Twin:
  """The exact twin (``job.twin``): the exact policy trained on the run's batches from the
  same initial weights, its step compiled once, and the seconds of its steady steps."""

  def __init__(self, cfg: RunConfig, job: Job):
    assert job.twin is not None and job.exact is not None
    self.state, self.seconds = job.twin, 0.0
    self.step_fn: Any = job.exact.train_step(job.tx, job.twin.params, clip_norm=cfg.clip)
    self.traced: Any = None
    self.run: Any = None

  def compile(self, x: Any, y: Any) -> None:
    """Traces and compiles the twin's step once (the wire report reads it too)."""
    if self.run is None:
      s = self.state
      self.traced = self.step_fn.trace(s.params, s.opt_state, s.ef, x, y)
      self.run = self.traced.lower().compile()

  def step(self, x: Any, y: Any, timed: bool) -> float:
    """One step on the run's batch; its loss. ``timed``: its seconds count (steady steps)."""
    s, t0 = self.state, time.perf_counter()
    s.params, s.opt_state, s.ef, m = self.run(s.params, s.opt_state, s.ef, x, y)
    loss = float(m["loss"])
    self.seconds += (time.perf_counter() - t0) if timed else 0.0
    return loss


def train(cfg: RunConfig, job: Job) -> dict:
  """Trains from ``job.state.step`` to ``cfg.steps``; returns the summary (:func:`finish`).

  Each step's loss, gradient norm, learning rate and time go to metrics.jsonl every
  ``cfg.log_every`` steps (and at the first step and every validation); the first step
  also writes the wire record. Checkpoints every ``cfg.ckpt_every`` steps and at the end.
  ``job.par`` stays the run's first layout; ``--adapt`` steps under the layouts its
  controller picks (:func:`_adapted`).

  SIGINT or SIGTERM during the steps (``models.interrupt``) stops after the current step
  with a checkpoint of it and a line naming the step and the resume command.

  Raises:
    FloatingPointError: the loss is not finite.
    models.interrupt.Interrupted: stopped by a signal (a SystemExit of status 130 or 143).
  """
  state, start_step = job.state, job.state.step
  prog = Program.of(cfg, job, job.par)
  # The exact policy's evaluation: the twin's validation, and the run's final weights
  # through exact collectives (one program for both).
  exact_eval = None if job.exact is None else _eval_fn(job.exact)
  twin = Twin(cfg, job) if job.twin is not None and job.exact is not None else None
  _announce(cfg, job)
  # The progress bar appears once the first step is compiled: what is printed before it
  # (the calibration's prediction) never shares its line. Later lines go through its write.
  bar: Any = None

  def write(text: str) -> None:
    if lead():
      (print if bar is None else bar.write)(text)

  wire, t_steady, n_steady, lr, auto = None, 0.0, 0, lr_schedule(cfg), None
  programs: dict = {}  # --adapt: each bit set's Program, compiled
  with open(job.metrics_path if lead() else os.devnull, "a") as log, interrupt.Stop() as stop:
    for step in range(start_step, cfg.steps):
      x, y = batch_at(job.corpus, cfg, job.par, "train", step)
      if job.adapt is not None:
        prog = _adapted(cfg, job, prog, programs, step, (x, y), log, write)
      # The step number keys stochastic rounding (Parallel3D.train_step); a step with no
      # stochastic codec is traced without it, as it always was.
      at = (np.int32(step),) if prog.par.stochastic else ()
      if prog.run is None:
        auto = _compile(job, prog, (x, y, *at), write)
        if job.adapt is not None:
          programs[job.adapt.key()] = prog
        if twin is not None:
          twin.compile(x, y)
      if bar is None:
        bar = _progress_bar(cfg, start_step)
      t0 = time.perf_counter()
      state.params, state.opt_state, state.ef, m = prog.run(
        state.params, state.opt_state, state.ef, x, y, *at
      )
      loss = float(m["loss"])
      dt = time.perf_counter() - t0
      exact_loss = None if twin is None else twin.step(x, y, timed=wire is not None)
      if wire is None:
        wire = _wire(cfg, job, prog, x, twin)
        log.write(json.dumps({"step": step + 1, "wire": wire}) + "\n")
      else:
        t_steady, n_steady = t_steady + dt, n_steady + 1
      state.step = step + 1
      rec: dict[str, Any] = {
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
        _validate(cfg, job, rec, prog.eval_fn, exact_eval if twin is not None else None)
      if state.step % cfg.log_every == 0 or "val_loss" in rec or step == start_step:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        job.records.append(rec)
      bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
      bar.update(1)
      if job.adapt is not None:
        job.adapt.count_step()
      _checkpoint(cfg, job, stop, log, bar)
  if bar is not None:
    bar.close()
  if state.step > start_step and exact_eval is not None:
    job.val_loss_exact_collectives = _exact_collectives_loss(cfg, job, exact_eval)
  tps = cfg.batch * cfg.seq_len * n_steady / t_steady if n_steady else None
  if twin is not None and n_steady:
    job.twin_tokens_per_s = cfg.batch * cfg.seq_len * n_steady / twin.seconds
  return finish(cfg, job, wire or NO_WIRE, tps, start_step, auto)


def _adapted(
  cfg: RunConfig,
  job: Job,
  prog: Program,
  programs: dict,
  step: int,
  batch: tuple,
  log: Any,
  write: Callable[[str], Any],
) -> Program:
  """The programs of this step under ``--adapt``: ``prog`` unless the controller changed
  the bits here (:func:`_adapt`); then those of the new bit set, reused where compiled
  before (``programs``: bit set -> Program), else new (compiled at the step)."""
  if not _adapt(job, step, batch[0], batch[1], log, write):
    return prog
  if job.adapt.key() in programs:
    return programs[job.adapt.key()]
  assert job.make_par is not None
  return Program.of(cfg, job, job.make_par(job.adapt.directions()))


def _compile(job: Job, prog: Program, args: tuple, write: Callable[[str], Any]) -> dict:
  """Traces and compiles ``prog``'s step on the step's arguments (after the state); returns
  the cost model's verdict on its compressed all_reduce calls. Under ``--adapt`` the
  controller records the program's bytes on the wire."""
  state, par = job.state, prog.par
  prog.traced = prog.step_fn.trace(state.params, state.opt_state, state.ef, *args)
  auto = _auto_verdict(job, par, jcoccl.explain(prog.traced), write)
  prog.run = prog.traced.lower().compile()
  if job.adapt is not None:
    total = jcoccl.wire_bytes(prog.traced, mesh=par.mesh, program="compiled")["total"]
    job.adapt.program_bytes[str(job.adapt.key())] = float(total)
  return auto


def _wire(cfg: RunConfig, job: Job, prog: Program, x: Any, twin: Twin | None) -> dict:
  """The first step's wire record: bytes on the wire of the run's step and the exact one
  (:func:`models.metrics.wire_report`), or why none were measured."""
  if job.exact is None:
    return NO_WIRE
  ref = None if twin is None else twin.traced
  return wire_report(prog.par, job.exact, job.tx, prog.traced, job.state, x, cfg.clip, ref)


def _validate(cfg: RunConfig, job: Job, rec: dict, eval_fn: Any, twin_eval: Any) -> None:
  """Adds the validation loss to the step's record ``rec``, and the twin's (through
  ``twin_eval``: the exact policy's evaluation) where there is a twin."""
  rec["val_loss"] = evaluate(cfg, job, eval_fn)
  if twin_eval is not None:
    assert job.twin is not None
    rec["exact_val_loss"] = evaluate(cfg, job, twin_eval, job.twin.params)


def _exact_collectives_loss(cfg: RunConfig, job: Job, exact_eval: Any) -> float | None:
  """The final weights' validation loss through exact collectives (summary.json
  "val_loss_exact_collectives")."""
  own = job.records[-1].get("val_loss") if job.records else None
  # An exact run's own collectives are the exact ones: nothing to measure again.
  exact_run = job.par is job.exact and job.adapt is None
  return own if exact_run else evaluate(cfg, job, exact_eval)


def _checkpoint(cfg: RunConfig, job: Job, stop: Any, log: Any, bar: Any) -> None:
  """After a step: a checkpoint every ``cfg.ckpt_every`` steps and at the last; on an
  agreed SIGINT or SIGTERM (``stop``), one of this step (if not just saved), the resume
  line, and :class:`models.interrupt.Interrupted`."""
  step = job.state.step
  saved = step % cfg.ckpt_every == 0 or step == cfg.steps
  if saved:
    _save(job)
  signum = stop.agreed()
  if signum is not None and step < cfg.steps:
    if not saved:
      _save(job)
    log.flush()
    bar.close()
    say(interrupt.message(signum, step, cfg.steps, str(cfg.out / "ckpt"), job.argv))
    raise interrupt.Interrupted(128 + signum)


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
  family = job.adapt.config.family
  write(
    f"adapt at step {step}: bits {rec['bits']} of {family} ({rec['reason']}; noise {rec['noise']})"
  )
  return job.adapt.key() != before or len(job.adapt.changes) == 1


def _auto_verdict(job: Job, par: Parallel3D, rows: list, write: Callable[[str], Any] = say) -> dict:
  """Prints (with ``write``: process 0) and returns what the run's cost model predicts for
  the compressed all_reduce calls of the step ``par`` just traced (``rows``: its
  ``jcoccl.explain`` records; ``models.calibration.verdict``)."""
  ef = tuple(par.grad_sync.ef_levels()) if par.grad_sync.uses_error_feedback() else ()
  v = calibration.verdict(job.calibration, rows, job.recipe.policy, par.mesh, ef)
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
