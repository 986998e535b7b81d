"""An adaptive compression policy: bits per axis and direction that follow the gradient noise.

Every ``--adapt-every`` steps (at the step boundary, before the step runs) the controller
probes the current parameters on the step's batch (``models.error_probe``): the injected
error of every codec of its ladder at every point, and the gradient noise across the data
shards. The gradient error a point would cause is predicted as its sensitivity (gradient
error / injected error, measured once at the first probe, at the ladder's middle rung) times
its injected error. Each point then takes the fewest bits whose predicted gradient error is
at most ``budget / sqrt(number of points) x noise``, so that the points' errors, added in
quadrature, stay under ``budget x noise``.

Recompilations are bounded: each distinct bit assignment is one compiled train step, kept
for reuse; once ``--adapt-max-programs`` exist, a new assignment is replaced by the cheapest
compiled one with at least its bits on every point, or the current one is kept. Every change
is a ``{"step", "adapt": {...}}`` record in metrics.jsonl and in the state saved with each
checkpoint (``state_dict``), so ``--resume`` continues with the same bits, history and
sensitivities.

  python -m models.train --adapt 0.5 --adapt-every 25 --adapt-bits 3,4,5,6,8

Example:
  >>> a = Adaptive(AdaptConfig(budget=0.5))
  >>> a.choose({"tensor.forward": {"int3": 0.3, "int4": 0.15}}, {"tensor.forward": 0.2}, 0.4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from models.directions import (
  HYSTERESIS,
  AdaptConfig,
)


class Adaptive:
  """The controller's state and decisions (no JAX here: :func:`probe_fn` measures).

  Attributes:
    bits: ``{point: bits}`` now.
    sensitivity: ``{point: gradient error / injected error}`` (measured at the first probe).
    changes: every decision that changed the bits: ``{"step", "bits", "from", "ratio",
      "noise", "reason"}``.
    programs: the bit sets compiled so far (each a tuple in ``config.points`` order).
  """

  def __init__(self, config: AdaptConfig):
    self.config = config
    self.bits = {p: max(config.bits) for p in config.points}
    self.sensitivity: dict[str, float] = {}
    self.changes: list[dict] = []
    self.programs: list[tuple[int, ...]] = []
    self.steps_at: dict[str, int] = {}  # str(bit tuple) -> steps trained with it
    self.program_bytes: dict[str, float] = {}  # str(bit tuple) -> wire bytes per step

  # -- what the run compiles ---------------------------------------------------------------
  def key(self, bits: Mapping[str, int] | None = None) -> tuple[int, ...]:
    b = self.bits if bits is None else bits
    return tuple(b[p] for p in self.config.points)

  def directions(self, bits: Mapping[str, int] | None = None) -> dict[str, str]:
    """``{point: codec spec}`` for ``bits`` (default: now), for DirectedParallel."""
    b = self.bits if bits is None else bits
    return {p: self.config.family.format(b=b[p]) for p in self.config.points}

  def due(self, step: int) -> bool:
    return step % self.config.every == 0

  def count_step(self) -> None:
    k = str(self.key())
    self.steps_at[k] = self.steps_at.get(k, 0) + 1

  def mean_bytes(self) -> float | None:
    """Wire bytes per step and device, averaged over the steps trained (None: unmeasured)."""
    n = sum(self.steps_at.values())
    if not n or any(k not in self.program_bytes for k in self.steps_at):
      return None
    return sum(self.program_bytes[k] * c for k, c in self.steps_at.items()) / n

  # -- the decision ------------------------------------------------------------------------
  def choose(
    self,
    injected: Mapping[str, Mapping[str, float]],
    sensitivity: Mapping[str, float],
    noise: float,
  ) -> dict[str, int]:
    """The fewest bits per point whose predicted gradient error (sensitivity x injected)
    is at most ``budget / sqrt(points) x noise``; the most bits where none is. Going below
    the current bits needs :data:`HYSTERESIS` x that share, so that a point does not flap
    between two widths on the probe's own noise."""
    share = self.config.budget / math.sqrt(len(self.config.points)) * noise
    out = {}
    for p in self.config.points:
      errs, s = injected.get(p, {}), sensitivity.get(p, 1.0)
      # The first decision starts from nothing: no hysteresis.
      now = self.bits[p] if self.changes else min(self.config.bits)
      ok = [
        b
        for b in self.config.bits
        if s * errs.get(f"int{b}", math.inf) <= (share if b >= now else HYSTERESIS * share)
      ]
      out[p] = min(ok) if ok else max(self.config.bits)
    return out

  def bounded(self, want: dict[str, int]) -> tuple[dict[str, int], str]:
    """``want`` if compiled or compilable under ``max_programs``; else the compiled set with
    at least ``want``'s bits everywhere and the fewest total bits; else the current bits."""
    k = self.key(want)
    if k in self.programs or len(self.programs) < self.config.max_programs:
      return want, "chosen"
    safe = [q for q in self.programs if all(a >= b for a, b in zip(q, k))]
    if safe:
      best = min(safe, key=sum)
      return dict(zip(self.config.points, best)), f"nearest compiled (wanted {list(k)})"
    return dict(self.bits), f"kept: program limit {self.config.max_programs} (wanted {list(k)})"

  def update(self, step: int, measured: dict) -> dict | None:
    """Applies one probe's ``measured`` (``models.error_probe.probe``'s keys ``injected``,
    ``noise`` and, at the first probe, ``sensitivity``); returns the change record or None."""
    if not self.sensitivity:
      self.sensitivity = dict(measured["sensitivity"])
    noise = float(measured["noise"])
    want, reason = self.bounded(self.choose(measured["injected"], self.sensitivity, noise))
    pred = {
      p: self.sensitivity.get(p, 1.0)
      * measured["injected"].get(p, {}).get(f"int{want[p]}", math.nan)
      / noise
      for p in self.config.points
    }
    if self.key(want) not in self.programs:
      self.programs.append(self.key(want))
    if want == self.bits and self.changes:
      return None
    rec = {
      "step": step,
      "bits": dict(want),
      "from": dict(self.bits),
      "ratio": {p: round(v, 4) for p, v in pred.items()},
      "noise": round(noise, 5),
      "reason": reason,
    }
    self.bits = dict(want)
    self.changes.append(rec)
    return rec

  # -- checkpoint ---------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """Plain JSON, saved with each checkpoint (``models.checkpoint.save``)."""
    return {
      "config": dataclasses.asdict(self.config),
      "bits": self.bits,
      "sensitivity": self.sensitivity,
      "changes": self.changes,
      "programs": [list(k) for k in self.programs],
      "steps_at": self.steps_at,
      "program_bytes": self.program_bytes,
    }

  def load(self, saved: Mapping[str, Any]) -> None:
    """Continues from a checkpoint's :meth:`state_dict` (its bits, history, sensitivities).

    Raises:
      ValueError: the saved controller adapted other points.
    """
    pts = tuple(saved["config"]["points"])
    if pts != self.config.points:
      raise ValueError(
        f"the checkpoint adapted {pts}, this run --adapt-points {self.config.points}"
      )
    rounding = saved["config"].get("rounding", "nearest")  # older checkpoints: nearest
    if rounding != self.config.rounding:
      raise ValueError(
        f"the checkpoint adapted with --adapt-rounding {rounding}, this run "
        f"--adapt-rounding {self.config.rounding}"
      )
    self.bits = {p: int(saved["bits"][p]) for p in pts}
    self.sensitivity = {p: float(v) for p, v in saved["sensitivity"].items()}
    self.changes = list(saved["changes"])
    self.programs = [tuple(k) for k in saved["programs"]]
    self.steps_at = dict(saved.get("steps_at", {}))
    self.program_bytes = dict(saved.get("program_bytes", {}))


def probe_fn(model: Any, mesh: Any, cfg: Any, config: AdaptConfig) -> Callable:
  """``measure(params, x, y, first) -> probe result`` on the run's mesh: the ladder's
  injected errors at every point and the noise; ``first`` adds the sensitivities (one
  gradient per point at the reference bits). Each program compiles at its first use."""
  from models.error_probe import Prober

  prober = Prober(
    model,
    mesh,
    bits=config.bits,
    reference_bits=config.reference_bits,
    family=config.family,
    points=config.points,
    n_micro=cfg.micro,
    dtype=cfg.dtype,
  )
  return lambda params, x, y, first: prober.run(params, [(x, y)], gradients=first)
