"""The alpha-beta-gamma cost model behind all_reduce(algorithm="auto"), its fit, and the
per (mesh axis, op) table that :func:`jcoccl.calibrate` measures.

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

Calibrated models (:func:`jcoccl.calibrate`, ``python -m jcoccl.bench calibrate``) also
hold the exact lax op's latency and bus bandwidth on their axis,

    T_exact = alpha_x + 2 (n-1)/n S / beta_x

and then ``algorithm="auto"`` chooses among one_shot and two_shot (and their chunked
variants, where the model says chunks overlap codec and link work: ``overlap`` > 0) by
predicted time, and ``algorithm="auto_exact"`` (``compressor="auto:<spec>"``, a policy's
``"auto:<spec>"``) among those and the exact op. A :class:`CostModels` table holds one model per
(mesh axis, op), saved to and read from JSON. Without a calibration (the default, or a model
without exact terms) auto keeps choosing between one_shot and two_shot as before and never
picks the exact op.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
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
    exact_alpha_s: latency of the exact lax op (None: not calibrated; auto never picks it).
    exact_beta_Bps: bus bandwidth of the exact lax op (bytes per second).
    overlap: in [0, 1], how much of the shorter of link and codec time a chunked call
      hides (0: chunks run one after another, as on XLA:CPU; auto then never chunks).
  """

  alpha_s: float
  beta_Bps: float
  gamma_Bps: float
  source: str = ""
  overhead_s: float = 0.0
  exact_alpha_s: float | None = None
  exact_beta_Bps: float | None = None
  overlap: float = 0.0

  def __post_init__(self):
    for name in ("alpha_s", "beta_Bps", "gamma_Bps"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and v > 0 and np.isfinite(v)):
        raise ValueError(f"CostModel.{name} must be a positive finite number, got {v!r}")
    v = self.overhead_s
    if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
      raise ValueError(f"CostModel.overhead_s must be a finite number >= 0, got {v!r}")
    if (self.exact_alpha_s is None) != (self.exact_beta_Bps is None):
      raise ValueError("CostModel.exact_alpha_s and exact_beta_Bps go together (both or none)")
    if self.exact_alpha_s is not None:
      for name in ("exact_alpha_s", "exact_beta_Bps"):
        v = getattr(self, name)
        if not (isinstance(v, (int, float)) and v > 0 and np.isfinite(v)):
          raise ValueError(f"CostModel.{name} must be a positive finite number, got {v!r}")
    if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
      raise ValueError(f"CostModel.overlap must be in [0, 1], got {self.overlap!r}")

  @property
  def calibrated(self) -> bool:
    """True when the model knows the exact op's cost (auto may then pick it)."""
    return self.exact_alpha_s is not None

  def cost(self, algorithm: str, nbytes: int, n: int, ratio: float = 1.0, chunks: int = 1) -> float:
    """Modelled seconds of an all_reduce (see the module docstring).

    Args:
      algorithm: "exact" (calibrated models only), "one_shot" or "two_shot".
      nbytes: message bytes S. n: ranks. ratio: payload / raw bytes r.
      chunks: slices k: k times the latency; ``overlap`` of the shorter of link and
        codec time hidden for all but one slice.

    Example:
      >>> m = CostModel(1e-4, 1e8, 1e9, exact_alpha_s=1e-4, exact_beta_Bps=1e8)
      >>> m.cost("exact", 1 << 20, 4) > m.cost("one_shot", 1 << 20, 4, 0.25)
      True
    """
    s = float(nbytes)
    if algorithm == "exact":
      if self.exact_alpha_s is None or self.exact_beta_Bps is None:
        raise ValueError(f"cost model {self.source!r} has no exact terms (not calibrated)")
      return self.exact_alpha_s + 2 * (n - 1) / n * s / self.exact_beta_Bps
    a, b, c = _terms(algorithm, s, n, float(ratio))
    link, codec = b / self.beta_Bps, c / self.gamma_Bps
    hidden = self.overlap * (1 - 1 / chunks) * min(link, codec)
    return self.overhead_s + chunks * a * self.alpha_s + link + codec - hidden

  def best(
    self, nbytes: int, n: int, ratio: float, candidates: Sequence[tuple[str, int]]
  ) -> tuple[str, int]:
    """The (algorithm, chunks) of ``candidates`` with the least modelled time; ties go to
    the earlier candidate. "exact" candidates count only on calibrated models."""
    usable = [c for c in candidates if c[0] != "exact" or self.calibrated]
    return min(usable, key=lambda c: self.cost(c[0], nbytes, n, ratio, c[1]))

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
_FIELDS = (
  "alpha_s",
  "beta_Bps",
  "gamma_Bps",
  "overhead_s",
  "exact_alpha_s",
  "exact_beta_Bps",
  "overlap",
)
ANY = "*"  # the axis or op an entry applies to when no entry names the call's own


@dataclasses.dataclass(frozen=True)
class CostModels:
  """Cost models per (mesh axis, op): what :func:`jcoccl.calibrate` installs.

  Attributes:
    entries: ``(axes, op, model)`` triples; ``axes`` is a mesh axis name, several joined by
      commas ("node,gpu"), or ``"*"``; ``op`` an op name or ``"*"``.
    source: where the table comes from.
    codecs: ``(spec, gamma_Bps)`` pairs: the measured throughput of codecs other than the
      one the entries were fitted with (a compressor's canonical spec string, e.g.
      ``"hadamard(int4)"``); :meth:`get` puts it in place of an entry's gamma for calls with
      that codec, so auto weighs a slow codec's time as it is.

  Example:
    >>> t = CostModels.of(CostModel(1e-4, 1e8, 1e9, "flat"))
    >>> t.get(("data",), "all_reduce").source
    'flat'
  """

  entries: tuple[tuple[str, str, CostModel], ...] = ()
  source: str = ""
  codecs: tuple[tuple[str, float], ...] = ()

  def __post_init__(self):
    for spec, gamma in self.codecs:
      ok = isinstance(gamma, (int, float)) and gamma > 0 and np.isfinite(gamma)
      if not isinstance(spec, str) or not ok:
        raise ValueError(
          f"CostModels.codecs must hold (spec string, positive finite gamma_Bps) pairs, "
          f"got {(spec, gamma)!r}"
        )

  @classmethod
  def of(cls, value: Any) -> CostModels:
    """A table from a CostModels, one CostModel (for every axis and op), or a path."""
    if isinstance(value, CostModels):
      return value
    if isinstance(value, CostModel):
      return cls(((ANY, ANY, value),), value.source)
    if isinstance(value, (str, os.PathLike)):
      return read(os.fspath(value))
    raise TypeError(
      f"cost_model must be a CostModel, a CostModels table, a JSON file path or None, "
      f"got {type(value).__name__}"
    )

  def name(self) -> str:
    """A short description (printed in primitive params)."""
    return self.source or f"{len(self.entries)} models"

  def get(self, axes: Sequence[str], op: str, codec: Any = None) -> CostModel | None:
    """The model of ``op`` over ``axes``: the entry for those axes, else (several axes)
    the entry of their slowest axis (least bandwidth), else a ``"*"`` entry, else None.
    With ``codec`` (a compressor or its spec string) measured in :attr:`codecs`, the
    model's gamma is that codec's."""
    model = self._entry(axes, op)
    gamma = dict(self.codecs).get(str(codec)) if codec is not None else None
    if model is None or gamma is None:
      return model
    return dataclasses.replace(model, gamma_Bps=gamma, source=f"{model.source}; {codec}")

  def _entry(self, axes: Sequence[str], op: str) -> CostModel | None:
    key = ",".join(axes)
    found = {(a, o): m for a, o, m in self.entries}
    for k in ((key, op), (key, ANY)):
      if k in found:
        return found[k]
    per_axis = [m for a in axes if (m := found.get((a, op)) or found.get((a, ANY)))]
    if len(axes) > 1 and len(per_axis) == len(axes):
      return min(per_axis, key=lambda m: m.beta_Bps)
    return found.get((ANY, op)) or found.get((ANY, ANY))

  def to_json(self) -> dict[str, Any]:
    """The table as a JSON object (what :func:`save` writes)."""
    models = []
    for axes, op, m in self.entries:
      d = {"axes": axes, "op": op, "source": m.source}
      d.update({f: getattr(m, f) for f in _FIELDS if getattr(m, f) is not None})
      models.append(d)
    out: dict[str, Any] = {"version": 2, "source": self.source, "models": models}
    if self.codecs:
      out["codecs"] = {spec: {"gamma_Bps": gamma} for spec, gamma in self.codecs}
    return out


def _model_from(data: Mapping[str, Any], where: str) -> CostModel:
  missing = [k for k in ("alpha_s", "beta_Bps", "gamma_Bps") if k not in data]
  if missing:
    raise ValueError(f"{where} lacks {', '.join(missing)}")
  kw = {f: float(data[f]) for f in _FIELDS if data.get(f) is not None}
  try:
    return CostModel(source=str(data.get("source", where)), **kw)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None


def from_json(data: Any, where: str = "cost model") -> CostModels:
  """A table from :meth:`CostModels.to_json`'s object, or a single model's flat object
  (``{"alpha_s": ..., "beta_Bps": ..., "gamma_Bps": ...}``, what ``--fit-out`` writes)."""
  if not isinstance(data, Mapping):
    raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}")
  if "models" not in data:
    return CostModels.of(_model_from(data, where))
  entries = []
  for i, d in enumerate(data["models"]):
    at = f"{where} models[{i}]"
    if not isinstance(d, Mapping) or not isinstance(d.get("axes"), str):
      raise ValueError(f"{at} must be an object with axes, op and the model's constants")
    entries.append((d["axes"], str(d.get("op", ANY)), _model_from(d, at)))
  codecs = _codecs_from(data.get("codecs", {}), f"{where} codecs")
  try:  # CostModels checks each gamma is positive and finite
    return CostModels(tuple(entries), str(data.get("source", where)), codecs)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def _codecs_from(data: Any, where: str) -> tuple[tuple[str, float], ...]:
  """``{"spec": {"gamma_Bps": g}, ...}`` as CostModels.codecs pairs."""
  if not isinstance(data, Mapping):
    raise ValueError(f"{where} must be an object of spec: {{gamma_Bps: number}}")
  out = []
  for spec, d in data.items():
    g = d.get("gamma_Bps") if isinstance(d, Mapping) else None
    if isinstance(g, bool) or not isinstance(g, (int, float)):
      raise ValueError(f"{where}: {spec!r} needs a number gamma_Bps, got {d!r}")
    out.append((str(spec), float(g)))
  return tuple(out)


def read(path: str) -> CostModels:
  """The table in JSON file ``path`` (see :func:`from_json`); installs nothing.

  Raises:
    ValueError: the file is not such a table (the message names the file and key).
  """
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cost model file {path!r} cannot be read: {e}") from None
  return from_json(data, f"cost model file {path!r}")


def save(models: CostModels | CostModel, path: str) -> None:
  """Writes ``models`` to ``path`` as JSON (:func:`read` gives it back)."""
  with open(path, "w") as f:
    json.dump(CostModels.of(models).to_json(), f, indent=1)
    f.write("\n")


# A compressed algorithm replaces the exact op only when predicted this much faster: on
# shared machines repeated calibrations of one in-process axis spread by several times,
# and a wrong "compress" costs more than a wrong "exact" (it also adds error).
EXACT_MARGIN = 1.25


def choose_auto(
  model: CostModel,
  nbytes: int,
  n: int,
  ratio: float,
  chunks: int = 1,
  extra_s: float = 0.0,
  *,
  exact: bool = True,
) -> tuple[str, int]:
  """What auto runs under a calibrated ``model``: (algorithm, chunks) among one_shot,
  two_shot (n > 2) and, when ``chunks`` is 1, their 2- and 4-slice variants, by least
  modelled time (ties: fewer slices); with ``exact`` (``algorithm="auto_exact"``, a
  policy's ``"auto:<spec>"``) the exact op instead unless that is :data:`EXACT_MARGIN`
  times faster. ``extra_s`` is time a compressed call costs on top (error feedback's round
  trip) that the exact op does not.

  Example:
    >>> slow = CostModel(1e-4, 1.25e8, 2e9, exact_alpha_s=1e-4, exact_beta_Bps=1.25e8)
    >>> choose_auto(slow, 16 << 20, 2, 0.254)
    ('one_shot', 1)
  """
  algo, k = model.best(nbytes, n, ratio, _compressed(n, chunks))
  if exact and model.calibrated:
    t_exact = model.cost("exact", nbytes, n)
    if t_exact <= EXACT_MARGIN * (model.cost(algo, nbytes, n, ratio, k) + extra_s):
      return "exact", 1
  return algo, k


def _compressed(n: int, chunks: int) -> list[tuple[str, int]]:
  """The compressed (algorithm, chunks) candidates of auto."""
  algos = ("one_shot",) if n <= 2 else ("one_shot", "two_shot")
  ks = (1, 2, 4) if chunks == 1 else (chunks,)
  return [(a, k) for a in algos for k in ks]


def candidates(
  model: CostModel, nbytes: int, n: int, ratio: float, chunks: int = 1, extra_s: float = 0.0
) -> tuple[tuple[str, float], ...]:
  """The modelled seconds of what :func:`choose_auto` compares, as ``(name, seconds)``
  pairs: "exact" (calibrated models only), then each compressed candidate ("two_shot/2":
  two slices), ``extra_s`` included. Chunked variants are listed only where ``overlap``
  lets them differ from one slice.

  Example:
    >>> m = CostModel(1e-4, 1.25e8, 2e9, exact_alpha_s=1e-4, exact_beta_Bps=1.25e8)
    >>> [name for name, _ in candidates(m, 1 << 20, 4, 0.254)]
    ['exact', 'one_shot', 'two_shot']
  """
  out = []
  if model.calibrated:
    out.append(("exact", model.cost("exact", nbytes, n)))
  for a, k in _compressed(n, chunks):
    if k > 1 and model.overlap == 0 and chunks == 1:
      continue  # never better than one slice: not a real candidate
    name = a if k == 1 else f"{a}/{k}"
    out.append((name, model.cost(a, nbytes, n, ratio, k) + extra_s))
  return tuple(out)


def fit(
  samples: Iterable[Mapping[str, Any]], source: str = "", gamma_Bps: float | None = None
) -> CostModel:
  """Least-squares constants from measured all_reduce times.

  Minimises the relative error sum_i ((T_model_i - t_i) / t_i)^2 over delta, alpha,
  1/beta, 1/gamma >= 0 (small and large messages count alike).

  Args:
    samples: dicts with ``algorithm`` ("one_shot"/"two_shot"), ``bytes`` (S), ``ranks``
      (n), ``ratio`` (r) and ``seconds`` (the measured median).
    source: description stored in the model.
    gamma_Bps: the codec throughput, when measured on its own (:func:`jcoccl.calibrate`):
      then only delta, alpha and beta are fitted (link and codec bytes both grow with S,
      so one algorithm's timings alone cannot tell them apart).

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
  need = 3 if gamma_Bps is None else 2  # a measured gamma leaves delta, alpha and beta
  if len(rows) < need:
    raise ValueError(
      f"fit needs at least {need} all_reduce timings on >= 2 ranks (one_shot and "
      f"two_shot at several sizes), got {len(rows)}"
    )
  a = np.asarray(rows) / np.asarray(times)[:, None]
  y = np.ones(len(times))
  free = 4
  if gamma_Bps is not None:
    y = y - a[:, 3] / gamma_Bps  # the measured codec time, taken out
    free = 3
  # Non-negative least squares over the free unknowns: the best unconstrained solution on
  # each subset of the columns that is feasible.
  best, best_res = np.zeros(4), np.inf
  for k in range(1, free + 1):
    for cols in itertools.combinations(range(free), k):
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
  gamma = 1.0 / max(best[3], tiny) if gamma_Bps is None else gamma_Bps
  return CostModel(
    float(alpha), float(min(beta, 1e18)), float(min(gamma, 1e18)), source, float(best[0])
  )
