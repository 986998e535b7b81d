"""Calibration at the start of a training run: ``jcoccl.calibrate`` on the run's mesh.

``python -m models.train`` measures each mesh axis and the codec first (a few seconds), so
that ``algorithm="auto"`` keeps the exact op where compression would cost time (inside a
process) and compresses where the link is slow (across hosts). ``--no-calibrate`` turns it
off (auto then chooses as without a calibration: compressed, one_shot or two_shot); a model
given with ``JCOCCL_COST_MODEL`` is used as it is.

Example:
  >>> p = argparse.ArgumentParser(); add_flag(p)          # doctest: +SKIP
  >>> start(mesh, p.parse_args([]).calibrate, print)      # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

import jcoccl

# Per device; a process sends its devices' messages together, so 4 MiB each outlasts a
# link's burst allowance (see jcoccl._src.calibrate.DEFAULT_SIZES) for 4 devices a process.
SIZES = (64 << 10, 1 << 20, 4 << 20)


def add_flag(p: argparse.ArgumentParser) -> None:
  """Adds ``--no-calibrate`` (``args.calibrate``, default True)."""
  p.add_argument(
    "--no-calibrate",
    dest="calibrate",
    action="store_false",
    help="skip measuring the mesh's links and codec at start (auto then compresses on "
    "every axis as without a calibration)",
  )


def auto_codecs(policy: jcoccl.Policy, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """``{axis: compressor}`` of the policy's all_reduce on each mesh axis of size > 1: the
  codecs whose throughput the calibration measures (auto weighs each axis by its own)."""
  out = {}
  for a in mesh.axis_names:
    c = policy.compressor(a, "all_reduce")
    if mesh.shape[a] > 1 and c is not None and not isinstance(c, tuple):
      out[a] = c
  return out


def start(
  mesh: jax.sharding.Mesh,
  enabled: bool,
  say: Callable[[str], None],
  codecs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Calibrates ``mesh`` unless disabled or a cost model is already installed.

  Args:
    mesh: the training mesh (every process calls this with the same one).
    enabled: ``args.calibrate``.
    say: prints a line (process 0's output).
    codecs: ``{axis: compressor}`` the run's all_reduce uses (:func:`auto_codecs`): their
      throughput is measured too, and the choices reported are those for these codecs.

  Returns:
    What was done, for the run's records: ``{"calibrated": bool, "seconds", "choices",
    "cost_model"}`` (the measured table, loadable with ``JCOCCL_COST_MODEL``), or
    ``{"calibrated": False, "why"}``.
  """
  if not enabled:
    return {"calibrated": False, "why": "--no-calibrate"}
  if jcoccl.get_config().cost_model is not None:
    return {"calibrated": False, "why": "cost model given (JCOCCL_COST_MODEL)"}
  if all(mesh.shape[a] < 2 for a in mesh.axis_names):
    return {"calibrated": False, "why": "no mesh axis of size > 1"}
  t0 = time.perf_counter()
  codecs = dict(codecs or {})
  models = jcoccl.calibrate(mesh, sizes=SIZES, iters=3, codecs=list(codecs.values()))
  took = time.perf_counter() - t0
  choices = jcoccl.cost_model_choices(models, mesh, codecs)
  say(f"calibrated in {took:.1f} s; all_reduce auto picks {choices}")
  return {
    "calibrated": True,
    "seconds": round(took, 2),
    "choices": choices,
    "cost_model": models.to_json(),
  }
