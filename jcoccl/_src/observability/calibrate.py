"""``jcoccl.calibrate(mesh)``: measures each mesh axis and the codec, installs cost models.

First the codec, on every device at once (no communication; devices that share cores
contend as they will in the collective): ``encode_rows`` then ``decode_rows`` of
``compressor`` on float32 messages of each size in ``sizes``, fitted to
``t = c + 2 S / gamma``. Then, per mesh axis of size > 1, with every process taking part:

  the exact lax op: ``lax.psum`` at each size, fitted to
    ``t = alpha_x + 2 (n-1)/n S / beta_x`` (the model's exact terms);
  the compressed algorithms: one_shot and (n > 2) two_shot all_reduce with ``compressor``
    at each size, fitted to the model's delta, alpha and beta with the codec's gamma fixed
    (:func:`jcoccl._src.base.cost_model.fit`).

Each timing is the fastest of ``iters`` runs after a warm-up (and compile): on a shared
machine other work only ever adds time, so the minimum is the steadiest estimate.

Under ``jax.distributed`` every process must call it with the same arguments; process 0's
timings are broadcast, so every process installs the same models and so traces the same
programs (a difference would deadlock their collectives).

Example:
  >>> models = jcoccl.calibrate(mesh)             # doctest: +SKIP
  >>> jcoccl.cost_model_choices(models, mesh)      # doctest: +SKIP
  {'data': {'64KiB': 'exact', '1MiB': 'exact', '16MiB': 'exact'}}
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from jcoccl._src.base import config as _config
from jcoccl._src.base import cost_model as cm
from jcoccl._src.compressors.compressor_args import compression_ratio, resolve_compressor
from jcoccl._src.ops.all_reduce import all_reduce as jcoccl_all_reduce

# The largest size must outlast a link's burst allowance (a token bucket lets the first few
# MB of a send through at full speed: 5 MB on the project's 10 Gbit/s shaped links); fitted
# to bursts alone, the exact op looked 2x faster than the link and auto kept it at 16 MiB.
DEFAULT_SIZES = (64 << 10, 1 << 20, 8 << 20)
ALGORITHMS = ("one_shot", "two_shot")
REPORT_SIZES = (64 << 10, 1 << 20, 16 << 20)


def calibrate(
  mesh: jax.sharding.Mesh,
  *,
  compressor: Any = "int8",
  axes: Sequence[str] | None = None,
  sizes: Sequence[int] = DEFAULT_SIZES,
  iters: int = 3,
  install: bool = True,
  codecs: Sequence[Any] = (),
) -> cm.CostModels:
  """Measures the mesh's axes and the codec; returns (and installs) a model per axis.

  Args:
    mesh: the mesh the program will run on (all processes' devices).
    compressor: the codec whose throughput is measured (spec string or Compressor).
    axes: the axes to measure (default: every axis of size > 1).
    sizes: message sizes in bytes per device (at least two distinct ones).
    iters: timed runs per measurement (the fastest counts).
    install: make the result the process default (``jcoccl.set_config_defaults``).
    codecs: other codecs the program uses (spec strings or Compressors): each one's
      throughput is measured too and kept in the table's ``codecs``, so auto weighs a call
      with that codec by its own speed (a Hadamard rotation costs more than int8).

  Returns:
    A :class:`jcoccl.CostModels` with one ``all_reduce`` entry per measured axis.

  Raises:
    ValueError: an unknown axis, fewer than two sizes, ``iters`` < 1, no compressor, or
      a ``codecs`` entry that is not a codec.

  Example:
    >>> models = jcoccl.calibrate(mesh, sizes=(1 << 16, 1 << 20))   # doctest: +SKIP
  """
  names = _axes(mesh, axes)
  sizes = sorted({int(s) for s in sizes})
  if len(sizes) < 2 or sizes[0] < 1024:
    raise ValueError(f"sizes must hold at least two distinct sizes >= 1024 bytes, got {sizes}")
  if not isinstance(iters, int) or iters < 1:
    raise ValueError(f"iters must be a positive int, got {iters!r}")
  comp = resolve_compressor(compressor)
  if comp is None:
    raise ValueError("compressor must be a lossy or lossless codec, not none")
  others = _other_codecs(codecs, comp)
  rows = [[_time_codec(mesh, c, s, iters) for s in sizes] for c in (comp, *others)]
  first = len(rows)
  for a in names:
    rows.append([_time_psum(mesh, a, s, iters) for s in sizes])
    for algo in ALGORITHMS:
      rows.append([_time_algorithm(mesh, a, comp, algo, s, iters) for s in sizes])
  # Every process installs process 0's numbers: the same models, so the same programs.
  times = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(rows)), np.float64)
  gammas = [1.0 / _line([2.0 * s for s in sizes], t)[1] for t in times[:first]]
  gamma = gammas[0]
  entries = []
  for i, a in enumerate(names):
    n, row = mesh.shape[a], first + i * (1 + len(ALGORITHMS))
    xa, xb = _line([2 * (n - 1) / n * s for s in sizes], times[row])
    samples = [
      dict(algorithm=algo, bytes=s, ranks=n, ratio=_ratio(comp, s), seconds=t)
      for j, algo in enumerate(ALGORITHMS)
      if algo == "one_shot" or n > 2
      for s, t in zip(sizes, times[row + 1 + j])
    ]
    src = f"calibrate: axis {a} (n={n}), {jax.process_count()} process(es), {jax.default_backend()}"
    model = cm.fit(samples, src, gamma_Bps=gamma)
    model = dataclasses.replace(model, exact_alpha_s=xa, exact_beta_Bps=1.0 / xb)
    entries.append((a, "all_reduce", model))
  measured = tuple((str(c), g) for c, g in zip(others, gammas[1:]))
  models = cm.CostModels(tuple(entries), f"calibrate({', '.join(names)}; {comp})", measured)
  if install:
    _config.set_defaults(cost_model=models)
  return models


def choices(
  models: cm.CostModels,
  mesh: jax.sharding.Mesh,
  compressor: Any = "int8",
  sizes: Sequence[int] = REPORT_SIZES,
  *,
  exact: bool | Mapping[str, bool] = True,
  times: bool = False,
) -> dict[str, dict[str, str]]:
  """What auto picks per axis and message size under ``models`` (float32 messages).

  Args:
    models: the calibrated table.
    mesh: the mesh it was measured on.
    compressor: the codec of every axis, or a mapping ``{axis: codec}`` (axes it leaves
      out use int8); a spec ``"auto:<spec>"`` makes the exact op a candidate on its axis.
    sizes: message sizes in bytes.
    exact: whether the exact op is a candidate (``algorithm="auto_exact"``, a policy's
      ``"auto:<spec>"``), for every axis or per axis (axes left out: True); False gives
      what plain ``algorithm="auto"`` runs with a named codec.
    times: follow each choice with the predicted time of every candidate compared
      (``"two_shot [exact 4.1 ms, one_shot 9.7 ms, two_shot 3.0 ms]"``; "exact" is listed
      for comparison even where it is no candidate).

  Returns:
    ``{axis: {"64KiB": "exact" | "one_shot" | "two_shot" | "one_shot/2" (chunks), ...}}``.

  Example:
    >>> choices(models, mesh, {"data": "auto:int8"}, times=True)  # doctest: +SKIP
    {'data': {'64KiB': 'exact [exact 0.2 ms, one_shot 1.1 ms, two_shot 1.9 ms]', ...}}
  """
  out: dict[str, dict[str, str]] = {}
  for a, op, entry in models.entries:
    if op not in ("all_reduce", cm.ANY) or a not in mesh.shape or not entry.calibrated:
      continue
    spec = compressor.get(a, "int8") if isinstance(compressor, Mapping) else compressor
    exact_ok = exact.get(a, True) if isinstance(exact, Mapping) else exact
    if isinstance(spec, str) and spec.strip().startswith("auto:"):
      spec, exact_ok = spec.strip()[len("auto:") :], True
    comp = resolve_compressor(spec)
    model = models.get((a,), "all_reduce", comp) or entry
    row = {}
    for s in sizes:
      ratio = comp.payload_nbytes(s // 4, jnp.float32) / s
      algo, k = cm.choose_auto(model, s, mesh.shape[a], ratio, exact=exact_ok)
      row[_size_name(s)] = algo if k == 1 else f"{algo}/{k}"
      if times:
        compared = cm.candidates(model, s, mesh.shape[a], ratio)
        row[_size_name(s)] += " [" + ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in compared) + "]"
    out[a] = row
  return out


def _other_codecs(codecs: Sequence[Any], comp: Any) -> list[Any]:
  """The distinct codecs of ``codecs`` other than ``comp``, resolved."""
  if isinstance(codecs, str):
    codecs = [codecs]
  out: dict[str, Any] = {}  # by canonical spec: each codec once
  for spec in codecs:
    c = resolve_compressor(spec, "codecs")
    if c is None:
      raise ValueError(f"codecs: {spec!r} is not a lossy or lossless codec")
    if str(c) != str(comp):
      out.setdefault(str(c), c)
  return list(out.values())


def _size_name(s: int) -> str:
  return f"{s >> 20}MiB" if s % (1 << 20) == 0 else f"{s >> 10}KiB"


def _axes(mesh: Any, axes: Sequence[str] | None) -> list[str]:
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axes is None:
    names = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  else:
    names = [axes] if isinstance(axes, str) else list(axes)
    bad = [a for a in names if a not in mesh.shape or mesh.shape[a] < 2]
    if bad:
      raise ValueError(f"axes {bad} are not mesh axes of size > 1; the mesh has {dict(mesh.shape)}")
  if not names:
    raise ValueError(f"the mesh has no axis of size > 1 to calibrate: {dict(mesh.shape)}")
  return names


def _line(x: Sequence[float], t: np.ndarray) -> tuple[float, float]:
  """(intercept, slope) of the least-squares line t = a + b x, both kept positive (a noisy
  measurement must not give a free or negative cost)."""
  b, a = np.polyfit(np.asarray(x, np.float64), np.asarray(t, np.float64), 1)
  slope = max(float(b), float(np.max(t)) / max(x) * 1e-3, 1e-15)
  return max(float(a), 1e-7), slope


def _seconds(fn: Callable[..., Any], arg: Any, iters: int) -> float:
  jax.block_until_ready(fn(arg))  # compile and warm up
  runs = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    runs.append(time.perf_counter() - t0)
  return min(runs)


def _on_mesh(mesh: Any, body: Callable, m: int, dtype: Any) -> tuple[Callable, Any]:
  """A jitted shard_map of ``body`` over every device (one row of ``m`` each) and its input."""
  spec = jax.P(tuple(mesh.axis_names))
  sharding = jax.NamedSharding(mesh, spec)
  shape = (mesh.devices.size, m)
  x = jax.make_array_from_callback(shape, sharding, lambda idx: np.ones(shape, dtype)[idx])
  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False),
  )
  return f, x


def _time_psum(mesh: Any, axis: str, nbytes: int, iters: int) -> float:
  f, x = _on_mesh(mesh, lambda v: lax.psum(v, axis), nbytes // 4, np.float32)
  return _seconds(f, x, iters)


def _time_algorithm(mesh: Any, axis: str, comp: Any, algo: str, nbytes: int, iters: int) -> float:
  if algo == "two_shot" and mesh.shape[axis] <= 2:
    return 0.0  # two_shot is one_shot's steps twice over on two ranks: not measured

  def body(v):
    return jcoccl_all_reduce(v, axis, compressor=comp, algorithm=algo, min_bytes=0)

  f, x = _on_mesh(mesh, body, nbytes // 4, np.float32)
  return _seconds(f, x, iters)


def _time_codec(mesh: Any, comp: Any, nbytes: int, iters: int) -> float:
  m = max(nbytes // 4 - nbytes // 4 % comp.granule, comp.granule)

  def body(v):
    return comp.decode_rows(comp.encode_rows(v), m, jnp.float32)

  f, x = _on_mesh(mesh, body, m, np.float32)
  return _seconds(f, x, iters)


def _ratio(comp: Any, nbytes: int) -> float:
  return compression_ratio(comp, nbytes // 4, jnp.float32)
