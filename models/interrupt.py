"""Ctrl-C (SIGINT) and SIGTERM during training: finish the step, save, say how to resume.

A cluster sends SIGTERM before it preempts a job, and a user presses Ctrl-C; either way the
steps since the last checkpoint would be lost. While :class:`Stop` is installed (the training
loop of ``models.loop``), the first signal only asks the loop to stop after the step it is
in: the loop then saves an atomic checkpoint of that step (parameters, optimizer state,
error-feedback residuals, the adaptive controller's state and the calibration, as every
checkpoint holds them), prints one line with the step and the command that resumes, and
exits with status 128 + the signal (130 for SIGINT, 143 for SIGTERM) without a traceback.
A second signal ends the process at once, saving nothing more (the newest checkpoint on
disk stays valid: orbax writes each one to a temporary directory and renames it).

Across processes (``jax.distributed``) every process must save the same step together, so
the processes agree after each step whether any of them was signalled
(:meth:`Stop.agreed`).

Example:
  >>> with Stop() as stop:            # doctest: +SKIP
  ...   for step in steps:
  ...     run(step)
  ...     if stop.agreed():
  ...       save(); raise stop.exit(step)
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from types import FrameType

import jax
import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(SystemExit):
  """The run stopped on a signal after saving: exits with status 128 + the signal, which
  Python does without a traceback (a SystemExit)."""


class Stop:
  """SIGINT/SIGTERM handlers that turn the first signal into a request to stop after the
  current step, and end the process on the second.

  Attributes:
    signum: the first signal received (None: none yet).
  """

  def __init__(self) -> None:
    self.signum: int | None = None
    self._old: dict[int, object] = {}

  def __enter__(self) -> Stop:
    for s in SIGNALS:
      self._old[s] = signal.signal(s, self._on_signal)
    return self

  def __exit__(self, *exc: object) -> None:
    for s, handler in self._old.items():
      signal.signal(s, handler)  # type: ignore[arg-type]
    self._old.clear()

  def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    # On a terminal, off the progress bar's line (and the "^C" it echoed); a log gets no
    # empty line.
    nl = "\n" if sys.stderr.isatty() else ""
    if self.signum is not None:
      # os.write: no buffered stream is touched inside a handler that ends the process.
      os.write(
        2,
        f"{nl}models.train: {name} again: stopping now without saving the current step\n".encode(),
      )
      os._exit(128 + signum)
    self.signum = signum
    os.write(
      2,
      f"{nl}models.train: {name}: saving a checkpoint after the current step "
      f"({name} again stops at once without it)\n".encode(),
    )

  def agreed(self) -> int | None:
    """The signal to stop on, the same on every process: this process's, else the first
    another process received (None: carry on). One tiny gather across processes per call
    in a multi-process run, so that every process leaves the loop after the same step."""
    if jax.process_count() == 1:
      return self.signum
    from jax.experimental import multihost_utils

    mine = np.asarray(self.signum or 0, np.int32)
    got = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    return next((int(s) for s in got if s), None)


def resume_command(argv: list[str] | None) -> str:
  """The command that continues a run started with the flags ``argv`` (None: this
  process's command line), with ``--resume`` added once."""
  args = list(sys.argv[1:] if argv is None else argv)
  if "--resume" not in args:
    args.append("--resume")
  return shlex.join(["python", "-m", "models.train", *args])


def message(signum: int, step: int, total: int, ckpt: str, argv: list[str] | None) -> str:
  """The line a stopped run prints: the signal, the step saved and how to resume."""
  name = signal.Signals(signum).name
  again = resume_command(argv)
  if jax.process_count() > 1:
    again = f"start every process again with {again}"
  return (
    f"models.train: stopped by {name} at step {step} of {total}; checkpoint saved in {ckpt}; "
    f"resume with: {again}"
  )
