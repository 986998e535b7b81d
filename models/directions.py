"""The traffic points a policy can compress per direction (``--direction``, ``--adapt``):
their names, their codec specs and the ``--adapt*`` flags.

A leaf module of models/: the flag parsing (models.cli) reads it, and the error probe
(models.error_probe) and the adaptive controller (models.adaptive) build on it.

Example:
  >>> check_directions({"pipe.backward": "exact"})
  {'pipe.backward': None}
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

POINTS = ("tensor.forward", "tensor.backward", "pipe.forward", "pipe.backward", "data")
DIRECTED = POINTS[:4]
EXACT_NAMES = ("none", "exact")


def parse_codec(spec: Any) -> Any:
  """A jcoccl compressor from a spec string (``"hadamard(int4)"``), None for ``"none"`` or
  ``"exact"`` (the exact collective), a compressor object unchanged."""
  # jcoccl (and jax) are imported here, not at the top: models.tune reads FAMILY before
  # models.run_config.use_host_devices has set up the devices.
  from jcoccl import compressors as jc

  if spec is None or (isinstance(spec, str) and spec.strip().lower() in EXACT_NAMES):
    return None
  return jc.parse(spec) if isinstance(spec, str) else spec


def check_directions(directions: Mapping[str, Any], allowed: Sequence[str] = POINTS) -> dict:
  """``{point: compressor or None}`` from ``{point: spec}``.

  Raises:
    ValueError: a point not in ``allowed`` or a codec spec jcoccl does not parse.
  """
  out = {}
  for point, spec in directions.items():
    if point not in allowed:
      raise ValueError(f"unknown point {point!r}; accepted: {', '.join(allowed)}")
    try:
      out[point] = parse_codec(spec)
    except ValueError as e:
      raise ValueError(f"{point}={spec}: {e}") from None
  return out


DEFAULT_BITS = (3, 4, 5, 6, 8)
FAMILY = "hadamard(int{b})"
# --adapt-rounding stochastic: the same codecs rounding stochastically (unbiased), keyed per
# call as every stochastic point of the trainer is (models.collectives.Keys).
STOCHASTIC_FAMILY = "hadamard(int{b}:stochastic)"
ROUNDINGS = {"nearest": FAMILY, "stochastic": STOCHASTIC_FAMILY}
# Lowering a point's bits needs its predicted error under this fraction of its share.
HYSTERESIS = 0.7


def parse_bits(flag: str, text: str) -> tuple[int, ...]:
  """The sorted distinct bit widths of a ``"3,4,8"`` flag value (``hadamard(int<b>)`` takes
  2 to 8).

  Raises:
    ValueError: not comma-separated integers, or one outside 2..8, naming ``flag``.

  Example:
    >>> parse_bits("--adapt-bits", "8,3,4,3")
    (3, 4, 8)
  """
  try:
    bits = tuple(sorted({int(b) for b in text.split(",")}))
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated integers, got {text}") from None
  if not bits or not set(bits) <= {2, 3, 4, 5, 6, 7, 8}:
    raise ValueError(f"{flag} must be among 2..8, got {text}")
  return bits


def add_flags(p: argparse.ArgumentParser) -> None:
  """The ``--adapt*`` flags of ``python -m models.train``."""
  p.add_argument(
    "--adapt",
    type=float,
    default=None,
    metavar="BUDGET",
    help="adaptive bits per axis and direction: keep the predicted gradient error under "
    "BUDGET x the gradient noise (e.g. 0.5; models.adaptive, docs/tuning.md)",
  )
  p.add_argument("--adapt-every", type=int, default=25, help="steps between adaptive probes")
  p.add_argument(
    "--adapt-bits", default=",".join(map(str, DEFAULT_BITS)), help="the ladder of bit widths"
  )
  p.add_argument(
    "--adapt-max-programs", type=int, default=4, help="most compiled train steps (bit sets)"
  )
  p.add_argument(
    "--adapt-rounding",
    choices=tuple(ROUNDINGS),
    default="nearest",
    help="how the adapted points' codecs round: nearest, or stochastic (unbiased: a run "
    "cannot learn its quantizer's rounding)",
  )
  p.add_argument(
    "--adapt-points",
    default=",".join(DIRECTED),
    help="the points adapted (others keep the policy's codecs; data: its error feedback "
    "is not modelled, so it is not adapted unless named)",
  )


def check_flags(args: argparse.Namespace) -> None:
  """Checks the ``--adapt*`` flags; sets ``args.adapt_config`` (None without ``--adapt``).

  Raises:
    ValueError: a bad value, naming the flag and what is accepted.
  """
  args.adapt_config = None
  if getattr(args, "adapt", None) is None:
    return
  if not (math.isfinite(args.adapt) and args.adapt > 0):
    raise ValueError(f"--adapt must be a number > 0, got {args.adapt}")
  if args.adapt_every < 1:
    raise ValueError(f"--adapt-every must be >= 1, got {args.adapt_every}")
  if args.adapt_max_programs < 1:
    raise ValueError(f"--adapt-max-programs must be >= 1, got {args.adapt_max_programs}")
  bits = parse_bits("--adapt-bits", args.adapt_bits)
  points = tuple(p.strip() for p in args.adapt_points.split(","))
  bad = [p for p in points if p not in POINTS]
  if bad:
    raise ValueError(f"--adapt-points: unknown {bad}; accepted: {', '.join(POINTS)}")
  if args.direction and set(args.directions) & set(points):
    raise ValueError("--direction names a point that --adapt-points adapts; drop one of them")
  rounding = getattr(args, "adapt_rounding", "nearest")
  if rounding not in ROUNDINGS:
    raise ValueError(f"--adapt-rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
  args.adapt_config = AdaptConfig(
    args.adapt, args.adapt_every, bits, args.adapt_max_programs, points, rounding
  )


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
  """The controller's settings (the ``--adapt*`` flags)."""

  budget: float
  every: int = 25
  bits: tuple[int, ...] = DEFAULT_BITS
  max_programs: int = 4
  points: tuple[str, ...] = DIRECTED
  rounding: str = "nearest"

  @property
  def family(self) -> str:
    """The codec spec with ``{b}`` for bits that the adapted points use and the probe measures."""
    return ROUNDINGS[self.rounding]

  @property
  def reference_bits(self) -> int:
    return self.bits[len(self.bits) // 2]
