"""The alpha-beta-gamma cost model behind all_reduce(algorithm="auto"), and its fit.

    T_one = delta + alpha (n-1)  + (n-1) r S / beta     + (1 + n) S / gamma
    T_two = delta + 2 alpha (n-1) + 2 (n-1)/n r S / beta + (3 + 1/n) S / gamma

S = message bytes, r = payload/raw size ratio of the compressor, n = group size; alpha is
the latency of one collective step, beta the bandwidth one rank gets on the link, gamma the
codec throughput (input bytes per second), delta the fixed cost of a call whichever the
algorithm (it decides nothing, but without it the fit pushes that cost into alpha: across
4 CPU processes a ~9 ms call overhead read as 2.2 ms per step). one_shot moves (n-1) r S
bytes and quantizes once; two_shot moves 2(n-1)/n r S and quantizes twice.

The constants depend on the link and the backend, so they are measured, not assumed:
``python -m jcoccl.bench collectives --ops all_reduce --algorithms one_shot,two_shot
--sizes ... --fit-out model.json`` times both algorithms and fits them
(:func:`fit`); load the result with :func:`load` / ``JCOCCL_COST_MODEL=model.json``, or set
one with :func:`set_model`. Without one, the default for the platform is used
(:data:`DEFAULTS`; where each came from is in its ``source``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Constants of the all_reduce cost model.

  Attributes:
    alpha_s: seconds per collective step (latency).
    beta_Bps: link bytes per second available to one rank.
    gamma_Bps: codec input bytes per second.
    source: where the numbers come from (measurement, link, commit).
    overhead_s: seconds every call costs whatever the algorithm (delta; >= 0).
  """

  alpha_s: float
  beta_Bps: float
  gamma_Bps: float
  source: str = ""
  overhead_s: float = 0.0

  def __post_init__(self):
    for name in ("alpha_s", "beta_Bps", "gamma_Bps"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and v > 0 and np.isfinite(v)):
        raise ValueError(f"CostModel.{name} must be a positive finite number, got {v!r}")
    v = self.overhead_s
    if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
      raise ValueError(f"CostModel.overhead_s must be a finite number >= 0, got {v!r}")

  def cost(self, algorithm: str, nbytes: int, n: int, ratio: float) -> float:
    """Modelled seconds of a compressed all_reduce (see the module docstring)."""
    a, b, c = _terms(algorithm, float(nbytes), n, float(ratio))
    return self.overhead_s + a * self.alpha_s + b / self.beta_Bps + c / self.gamma_Bps

  def choose(self, nbytes: int, n: int, ratio: float) -> str:
    """The cheaper of one_shot and two_shot; ties (and n <= 2) go to one_shot."""
    if n <= 2:
      return "one_shot"
    one = self.cost("one_shot", nbytes, n, ratio)
    two = self.cost("two_shot", nbytes, n, ratio)
    return "two_shot" if two < one else "one_shot"


def _terms(algorithm: str, s: float, n: int, r: float) -> tuple[float, float, float]:
  """Coefficients of (alpha, 1/beta, 1/gamma) in the modelled time."""
  if algorithm == "one_shot":
    return (n - 1, (n - 1) * r * s, (1 + n) * s)
  if algorithm == "two_shot":
    return (2 * (n - 1), 2 * (n - 1) / n * r * s, (3 + 1 / n) * s)
  raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")


# Defaults by JAX platform. "cpu": two runs of `bench collectives --processes 4 --link-rate
# 10gbit --ops all_reduce --compressors int8 --algorithms one_shot,two_shot --sizes
# 256KiB,1MiB,2MiB,4MiB,8MiB,16MiB --iters 9 --fit-out` on an idle 2-core machine, fitted
# together (benchmarks/results/cost_model_cpu_4proc_10gbit.json). There the two algorithms'
# byte-proportional costs (link and codec) cannot be told apart, so the fit puts them all in
# gamma and leaves beta unbounded; it picks the faster algorithm at every measured size but
# 2 MiB, where the two are within the runs' spread. "gpu": a placeholder of the order of
# NVLink-class links until a GPU fit is recorded.
DEFAULTS: dict[str, CostModel] = {
  "cpu": CostModel(
    4.534e-4, 1e18, 2.681e9, "fit: 4 CPU processes, 10gbit loopback", overhead_s=9.112e-3
  ),
  "gpu": CostModel(5e-6, 25e9, 200e9, "placeholder (no GPU measurement yet)"),
}
_active: CostModel | None = None


def set_model(model: CostModel | None) -> None:
  """Makes ``model`` the one algorithm="auto" uses (None: back to the platform default).

  It applies to programs traced afterwards (jit caches what it traced before).

  Example:
    >>> set_model(CostModel(1e-4, 1.2e8, 2e9, "my 1 Gbit/s cluster"))
    >>> set_model(None)
  """
  global _active
  if model is not None and not isinstance(model, CostModel):
    raise TypeError(f"model must be a CostModel or None, got {type(model).__name__}")
  _active = model


def load(path: str) -> CostModel:
  """Reads a model written by ``bench collectives --fit-out`` and makes it active.

  Raises:
    ValueError: the file is not such a model (the message names the file and key).
  """
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cost model file {path!r} cannot be read: {e}") from None
  missing = [k for k in ("alpha_s", "beta_Bps", "gamma_Bps") if k not in data]
  if missing:
    raise ValueError(f"cost model file {path!r} lacks {', '.join(missing)}")
  model = CostModel(
    float(data["alpha_s"]),
    float(data["beta_Bps"]),
    float(data["gamma_Bps"]),
    str(data.get("source", path)),
    float(data.get("overhead_s", 0.0)),
  )
  set_model(model)
  return model


def active(platform: str | None = None) -> CostModel:
  """The model in use: set or loaded (JCOCCL_COST_MODEL), else the platform's default."""
  if _active is None and os.environ.get("JCOCCL_COST_MODEL"):
    load(os.environ["JCOCCL_COST_MODEL"])
  if _active is not None:
    return _active
  if platform is None:
    import jax

    platform = jax.default_backend()
  return DEFAULTS["cpu" if platform == "cpu" else "gpu"]


def fit(samples: Iterable[Mapping[str, Any]], source: str = "") -> CostModel:
  """Least-squares constants from measured all_reduce times.

  Minimises the relative error sum_i ((T_model_i - t_i) / t_i)^2 over delta, alpha,
  1/beta, 1/gamma >= 0 (small and large messages count alike).

  Args:
    samples: dicts with ``algorithm`` ("one_shot"/"two_shot"), ``bytes`` (S), ``ranks``
      (n), ``ratio`` (r) and ``seconds`` (the measured median).
    source: description stored in the model.

  Returns:
    The fitted CostModel (a coefficient the data cannot see is set to a negligible cost).

  Raises:
    ValueError: fewer than 3 samples, or none with two or more ranks.

  Example:
    >>> m = CostModel(1e-4, 1e8, 1e9)
    >>> s = [dict(algorithm=a, bytes=b, ranks=4, ratio=0.25, seconds=m.cost(a, b, 4, 0.25))
    ...      for a in ("one_shot", "two_shot") for b in (1 << 16, 1 << 20, 1 << 24)]
    >>> round(fit(s).beta_Bps / 1e8, 6)
    1.0
  """
  rows, times = [], []
  for s in samples:
    if int(s["ranks"]) < 2:
      continue
    terms = _terms(s["algorithm"], float(s["bytes"]), int(s["ranks"]), float(s["ratio"]))
    rows.append((1.0, *terms))
    times.append(float(s["seconds"]))
  if len(rows) < 3:
    raise ValueError(
      f"fit needs at least 3 all_reduce timings on >= 2 ranks (one_shot and "
      f"two_shot at several sizes), got {len(rows)}"
    )
  a = np.asarray(rows) / np.asarray(times)[:, None]
  y = np.ones(len(times))
  # Non-negative least squares over 4 unknowns: the best unconstrained solution on each
  # subset of the columns that is feasible.
  best, best_res = np.zeros(4), np.inf
  for k in (1, 2, 3, 4):
    for cols in itertools.combinations(range(4), k):
      sub = a[:, cols] / a[:, cols].max(axis=0)
      coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
      if np.any(coef < 0):
        continue
      x = np.zeros(4)
      x[list(cols)] = coef / a[:, cols].max(axis=0)
      res = float(np.sum((a @ x - y) ** 2))
      if res < best_res:
        best, best_res = x, res
  tiny = 1e-30
  alpha = max(best[1], 1e-9)
  beta = 1.0 / max(best[2], tiny)
  gamma = 1.0 / max(best[3], tiny)
  return CostModel(
    float(alpha), float(min(beta, 1e18)), float(min(gamma, 1e18)), source, float(best[0])
  )
