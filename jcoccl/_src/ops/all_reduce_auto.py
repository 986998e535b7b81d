"""all_reduce's ``algorithm="auto"`` (and ``"auto_exact"``): the decision for one leaf,
with the predicted seconds of each candidate and the sentence that says why.

Without a calibration auto chooses one_shot or two_shot by message size (the platform's
default model) and never sends more bytes than the exact op; with one
(:func:`jcoccl.calibrate`) it takes the least predicted time among the compressed
algorithms, their chunked variants and hierarchical, and under ``"auto_exact"`` the exact
op too (:mod:`jcoccl._src.base.cost_model`).

Example:
  >>> one_shot_within_exact_bytes(8, 1.016 / 4), one_shot_within_exact_bytes(4, 0.254)
  (False, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jcoccl._src.base import cost_model
from jcoccl._src.base.axes import group_size
from jcoccl._src.compressors.compressor_args import compression_ratio
from jcoccl._src.ops import auto_model

AUTO = ("auto", "auto_exact")  # the algorithms that are decided per call


@dataclasses.dataclass(frozen=True)
class Decision:
  """What ``algorithm="auto"`` (or ``"auto_exact"``) decided for one all_reduce leaf.

  Attributes:
    compressor: the compressor that runs (None: the exact lax op; a pair: hierarchical).
    algorithm: "exact", "one_shot", "two_shot" or "hierarchical".
    chunks: slices.
    requested: the algorithm asked for ("auto", "auto_exact", or a pinned one).
    predicted_s: (candidate, modelled seconds) pairs auto compared, e.g.
      ``(("exact", 1.2e-3), ("one_shot", 2.0e-3), ("two_shot/2", 1.1e-3))``; a
      compressed candidate's time includes extra codec passes (error feedback's); "exact"
      is listed even where it is not a candidate (``requested="auto"``), for comparison.
    source: the cost model's source ("" for a pinned algorithm).
    calibrated: the cost model knows the exact op's cost (:func:`jcoccl.calibrate`).
    why: one sentence: why this candidate.
  """

  compressor: Any
  algorithm: str
  chunks: int
  requested: str
  predicted_s: tuple[tuple[str, float], ...] = ()
  source: str = ""
  calibrated: bool = False
  why: str = ""

  @property
  def auto(self) -> bool:
    """Whether auto decided (the algorithm was not pinned by the caller)."""
    return self.requested in AUTO


def decision(
  comp: Any,
  algorithm: str,
  axes: tuple,
  x: jax.Array,
  chunks: int,
  *,
  flat: bool = False,
  codec_passes: int = 0,
) -> Decision:
  """What a call of ``x`` over ``axes`` runs: ``algorithm="auto"``/``"auto_exact"``
  resolved, with the times behind it (``comp`` is a Compressor or a per-level pair).

  With a calibrated cost model for ``axes`` (:func:`jcoccl.calibrate`), auto takes the
  least predicted time among one_shot, two_shot, hierarchical (several axes, each
  calibrated; not when ``flat``) and, when ``chunks`` is 1, their chunked variants;
  "auto_exact" adds the exact lax op (compressor None, algorithm "exact"), which a
  compressed one must beat by :data:`jcoccl._src.base.cost_model.EXACT_MARGIN`. The codec's own
  measured throughput counts where the calibration has it, and ``codec_passes`` more
  passes of it over the message (error feedback's encode and decode of its residual) are
  charged to compression only. Otherwise it is :func:`choose`, as without calibration.

  Example:
    >>> decision(jcoccl.compressors.int8(), "auto", ("x",), x, 1).algorithm  # doctest: +SKIP
    'two_shot'
  """
  nbytes = x.size * x.dtype.itemsize
  if algorithm not in AUTO or isinstance(comp, tuple):
    algo = choose(comp, algorithm, axes, nbytes, x.size, x.dtype)
    why = "pinned by the caller" if algorithm not in AUTO else "a per-level compressor"
    return Decision(comp, algo, chunks, algorithm, why=why)
  model = auto_model.active(axes=axes, op="all_reduce", codec=comp)
  n = group_size(axes)
  ratio = compression_ratio(comp, x.size, x.dtype)
  if not model.calibrated:
    return _uncalibrated(comp, algorithm, model, nbytes, n, ratio, chunks)
  extra = codec_passes * nbytes / model.gamma_Bps
  exact_ok = algorithm == "auto_exact"
  algo, k = cost_model.choose_auto(model, nbytes, n, ratio, chunks, extra, exact=exact_ok)
  times = cost_model.candidates(model, nbytes, n, ratio, chunks, extra)
  if algo == "exact":  # compression must win by the same margin as in choose_auto
    best = model.cost(algo, nbytes, n, ratio, k) / cost_model.EXACT_MARGIN
  else:
    best = model.cost(algo, nbytes, n, ratio, k) + extra
  hier = _hierarchical_cost(axes, nbytes, ratio, comp) if not flat and len(axes) > 1 else math.inf
  if hier < math.inf:
    times = times + (("hierarchical", hier),)

  def made(c: Any, a: str, slices: int, why: str) -> Decision:
    return Decision(c, a, slices, algorithm, times, model.source, True, why)

  if hier < best:
    return made((comp, comp), "hierarchical", chunks, "least predicted time")
  if algo == "exact":
    why = f"the exact op is predicted {cost_model.EXACT_MARGIN:g}x faster or more (opted in)"
    return made(None, "exact", 1, why)
  why = "least predicted time among the compressed algorithms"
  if exact_ok:
    why += f"; the exact op is not {cost_model.EXACT_MARGIN:g}x faster"
  return made(comp, algo, k, why)


# Without any cost model (the platform's default), auto picks by message size as NCCL picks
# its algorithm and protocol: one_shot (n-1 steps) where a message is latency-bound,
# two_shot (2(n-1) steps, 2/n of one_shot's bytes per rank beyond) where it is
# bandwidth-bound. one_shot's extra (n-1)(1-2/n) r S bytes outlast two_shot's extra n-1
# steps above S = n alpha beta / ((n-2) r): 246 KB for int8 (r = 0.254) on 4 ranks at
# alpha = 50 us per step and beta = 1.25 GB/s (10 Gbit/s); less on slower links and more
# ranks. A calibration (jcoccl.calibrate) or a cost model of one's own decides instead.
TWO_SHOT_MIN_BYTES = 256 << 10


def _uncalibrated(
  comp: Any, algorithm: str, model: Any, nbytes: int, n: int, ratio: float, chunks: int
) -> Decision:
  """auto under a model without the exact op's cost: one_shot or two_shot, and never more
  bytes than the exact op (its times are the platform's guess, its bytes are certain).
  The platform's default model decides by size (:data:`TWO_SHOT_MIN_BYTES`); a model the
  caller set (without exact terms) by its predicted times."""
  times = tuple((a, model.cost(a, nbytes, n, ratio)) for a in ("one_shot", "two_shot"))
  if any(model is m for m in cost_model.DEFAULTS.values()):
    algo = "two_shot" if n > 2 and nbytes >= TWO_SHOT_MIN_BYTES else "one_shot"
    why = (
      f"message size (no cost model): one_shot under {TWO_SHOT_MIN_BYTES} bytes or on 2 "
      "ranks (latency-bound), two_shot from there (bandwidth-bound)"
    )
  else:
    algo = model.choose(nbytes, n, ratio)
    why = "least predicted time (cost model not calibrated: the exact op is no candidate)"
  if algo == "one_shot" and not one_shot_within_exact_bytes(n, ratio):
    algo = "two_shot"
    why = (
      f"one_shot would send (n-1) r = {(n - 1) * ratio:.3g}x the message, more than "
      f"lax.psum's 2(n-1)/n = {2 * (n - 1) / n:.3g}x; without a calibration auto never "
      "sends more bytes than the exact op"
    )
  return Decision(comp, algo, chunks, algorithm, times, model.source, False, why)


def one_shot_within_exact_bytes(n: int, ratio: float) -> bool:
  """Whether one_shot's bytes per device, (n-1) r S, are at most a ring lax.psum's,
  2(n-1)/n S: r <= 2/n (always on two ranks for r <= 1).

  Example:
    >>> one_shot_within_exact_bytes(8, 1.016 / 4), one_shot_within_exact_bytes(4, 0.254)
    (False, True)
  """
  return n <= 1 or (n - 1) * ratio <= 2 * (n - 1) / n


def _hierarchical_cost(axes: tuple, nbytes: int, ratio: float, comp: Any) -> float:
  """Modelled seconds of hierarchical over (outer..., inner): the inner reduce_scatter and
  all_gather (a two_shot's steps) plus a one_shot of the shard over the outer axes; inf
  without calibrated models of both levels."""
  outer, inner = axes[:-1], axes[-1:]
  m_in = auto_model.active(axes=inner, op="all_reduce", codec=comp)
  m_out = auto_model.active(axes=outer, op="all_reduce", codec=comp)
  if not (m_in.calibrated and m_out.calibrated):
    return math.inf
  n_in, n_out = group_size(inner), group_size(outer)
  t_in = m_in.cost("two_shot", nbytes, n_in, ratio) if n_in > 1 else 0.0
  return t_in + m_out.cost("one_shot", nbytes // max(n_in, 1), n_out, ratio)


def choose(comp: Any, algorithm: str, axes: tuple, nbytes: int, size: int, dtype: Any) -> str:
  """The algorithm that runs without a calibration (algorithm="auto": one_shot or
  two_shot by the cost model, within the exact op's bytes; hierarchical for a per-level
  compressor)."""
  if algorithm not in AUTO:
    return algorithm
  if isinstance(comp, tuple):
    return "hierarchical"
  n, ratio = group_size(axes), compression_ratio(comp, size, dtype)
  return _uncalibrated(comp, algorithm, auto_model.active(), nbytes, n, ratio, 1).algorithm
