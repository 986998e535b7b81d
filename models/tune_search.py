"""The tuner's search (``python -m models.tune``): candidates (bits per axis, and the
rounding of their activations), their score from the probe, the Pareto frontier of score
against predicted cost, and the bisection along it. Pure Python: nothing here imports jax.

Example:
  >>> best, tried = search(cands, lambda c: c.score < 0.3, max_runs=5)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from models.directions import FAMILY, STOCHASTIC_FAMILY

# The axes whose activations round stochastically in a candidate's twin ('data' keeps
# round-to-nearest: its error feedback carries what rounding loses).
ACTIVATION_AXES = ("tensor", "pipe")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """Bits per searched axis (``(("tensor", 4), ("pipe", 3))``, 'data' last when searched),
  its score and predicted cost; ``stochastic``: the activation axes round stochastically."""

  bits: tuple[tuple[str, int], ...]
  score: float
  cost: float
  stochastic: bool = False

  @property
  def name(self) -> str:
    mark = lambda a: "s" if self.stochastic and a in ACTIVATION_AXES else ""
    return "-".join(f"{a[0]}{b}{mark(a)}" for a, b in self.bits)

  def twin(self) -> Candidate:
    """The same bits and bytes with the activations rounding stochastically (unbiased: a
    model cannot learn its rounding; noisier per element than round-to-nearest)."""
    return dataclasses.replace(self, stochastic=True)

  def spec(self, axis: str) -> str:
    """The codec spec of ``axis`` (one of the candidate's axes)."""
    family = STOCHASTIC_FAMILY if self.stochastic and axis in ACTIVATION_AXES else FAMILY
    return family.format(b=dict(self.bits)[axis])


def frontier(cands: Sequence[Candidate]) -> list[Candidate]:
  """The candidates not dominated in (cost, score), cheapest first: along it the cost rises
  and the score falls."""
  out: list[Candidate] = []
  for c in sorted(cands, key=lambda c: (c.cost, c.score)):
    if not out or c.score < out[-1].score:
      out.append(c)
  return out


def search(
  cands: Sequence[Candidate],
  passes: Callable[[Candidate], bool],
  max_runs: int,
  roundings: Sequence[str] = ("nearest",),
) -> tuple[Candidate | None, list[tuple[Candidate, bool]]]:
  """Bisection on the frontier for the cheapest candidate that ``passes``.

  Assumes that passing is monotone along the frontier (a lower score passes whenever a
  higher one does). Starts at the middle of the frontier. With "stochastic" in
  ``roundings``, a frontier point that fails is tried again as its :meth:`Candidate.twin`
  (the same bytes, the activations rounding stochastically) before the search moves to
  dearer points: the probe scores rounding by its error per step, which cannot tell
  whether unbiased rounding trains better, so that is measured.

  Args:
    cands: every candidate.
    passes: measures one candidate (a short run); True when it meets the budget.
    max_runs: the most calls of ``passes``.
    roundings: "nearest" and optionally "stochastic" (the twins).

  Returns:
    (the cheapest candidate measured to pass or None, [(candidate, passed)] in order).

  Example:
    >>> best, tried = search(cands, lambda c: c.score < 0.3, max_runs=5)
  """
  front = frontier(cands)
  lo, hi = 0, len(front) - 1  # the answer lies in front[lo..hi] (hi: the least score)
  best, tried = None, []
  while lo <= hi and len(tried) < max_runs:
    mid = (lo + hi) // 2
    ok, c = passes(front[mid]), front[mid]
    tried.append((c, ok))
    if not ok and "stochastic" in roundings and len(tried) < max_runs:
      c = c.twin()
      ok = passes(c)
      tried.append((c, ok))
    if ok:
      best, hi = c, mid - 1
    else:
      lo = mid + 1
  return best, tried


def score(
  bits: Mapping[str, int],
  injected: Mapping[str, Mapping[str, float]],
  sensitivity: Mapping[str, float],
  noise: float,
) -> float:
  """Predicted gradient error over the noise: the points of each axis (``tensor.forward``,
  ...) at that axis's bits, sensitivity x injected error, added in quadrature."""
  total = 0.0
  for point, s in sensitivity.items():
    axis = point.split(".")[0]
    if axis in bits:
      total += (s * injected[point][f"int{bits[axis]}"]) ** 2
  return math.sqrt(total) / noise if noise else math.inf


def candidates(
  probe: Mapping[str, Any],
  costs: Mapping[str, Mapping[int, float]],
  bits: Mapping[str, Sequence[int]],
) -> list[Candidate]:
  """Every combination of the axes' bits (``{"tensor": [3, 4], "pipe": [4], ...}``), with
  its score and the sum of its axes' costs."""
  out = []
  axes = list(bits)
  for combo in itertools.product(*(bits[a] for a in axes)):
    b = dict(zip(axes, combo))
    s = score(b, probe["injected"], probe["sensitivity"], probe["noise"])
    out.append(Candidate(tuple(b.items()), s, sum(costs[a][b[a]] for a in axes)))
  return out
