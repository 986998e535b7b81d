"""Where compression error comes from: per axis and direction, the relative error a codec
injects into a step's real traffic, the gradient error that follows, and the step's own
gradient noise.

Points (:data:`POINTS`): ``tensor.forward`` (the Megatron activation sums after each
row-parallel projection), ``tensor.backward`` (the activation-gradient sums before each
column-parallel one), ``pipe.forward`` / ``pipe.backward`` (GPipe's ppermute of activations and
of their cotangents) and ``data`` (the gradient sum). The probe runs the step through
:class:`models.directed.DirectedParallel` (a compressor per point) with a :class:`Tap`.

Three measurements, on the same parameters and batch:

* injected error: for every tensor/pipe/data collective of one step, ``||lossy - exact|| /
  ||exact||`` of the collective's output for each candidate codec (the step itself runs
  exact), summed over calls and devices: :class:`Tap`. Tensor points are also split per
  layer (global index: pipe stage x layers per stage + local index).
* gradient error: ``||g_point - g_exact|| / ||g_exact||`` of the step's summed gradient with
  one point compressed and every other exact (:func:`gradient_errors`).
* gradient noise: the sampling noise of the summed gradient estimated from the data shards,
  ``sqrt(n/(n-1) * sum_i ||g_i - mean||^2) / ||sum_i g_i||`` over the n data ranks (for n = 2,
  ``||g_1 - g_2|| / ||g_1 + g_2||``). A point whose gradient error is well below this noise
  changes the step less than drawing another batch would.

  python -m models.error_probe --model gpt --warm-steps 50 --out /tmp/probe

Example:
  >>> relative_error(jnp.array([4.0, 1.0, -3.0, 2.0]), "int2")   # sqrt(6 / 30)
  0.4472...
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl import compressors as jc
from models.collectives import is_stochastic
from models.directed import DirectedParallel
from models.directions import FAMILY, POINTS, check_directions, parse_codec
from models.parallel import Parallel3D


def relative_error(x: Any, codec: Any) -> float:
  """``||decode(encode(x)) - x|| / ||x||`` for one rank's message (0.0 for a zero ``x``).

  Args:
    x: an array.
    codec: a compressor or spec string (:func:`parse_codec`).

  Returns:
    The relative L2 error of the codec's round trip.

  Example:
    >>> relative_error(jnp.ones(256), "int8")
    0.0
  """
  c = parse_codec(codec)
  x = jnp.asarray(x, jnp.float32)
  if c is None:
    return 0.0
  err = c.decode(c.encode(x, impl="jnp"), impl="jnp") - x
  norm = float(jnp.linalg.norm(x))
  return float(jnp.linalg.norm(err)) / norm if norm else 0.0


class Tap:
  """Host-side sums of squared norms and errors, sent from inside the step by
  ``jax.debug.callback`` (per device and call), then summed over every process
  (:meth:`share`): each process receives its own devices' callbacks only, and every process
  must decide from the same, global, numbers.

  Args:
    codecs: ``{point: [(label, compressor), ...]}``: the codecs to measure at each point.

  ``sums[(point, layer)]`` is ``[||exact||^2, err_1^2, ..., err_k^2]`` (layer -1: all layers
  of the point); ``noise`` is ``[sum of the per-leaf variance of the gradient sum, ||sum||^2]``.
  """

  def __init__(self, codecs: Mapping[str, Sequence[tuple[str, Any]]]):
    self.codecs = {p: list(v) for p, v in codecs.items()}
    self.sums: dict[tuple[str, int], np.ndarray] = collections.defaultdict(lambda: 0.0)  # type: ignore[arg-type, return-value]
    self.noise = np.zeros(2)
    # The callbacks of the devices run on several threads at once: an unlocked
    # read-add-write of a sum can lose another device's term.
    self._lock = threading.Lock()

  def measure(self, point: str, exact: jax.Array, lossy: Any, layer: Any = None) -> None:
    """Emits ``||exact||^2`` and ``||lossy(c, key) - exact||^2`` for each codec ``c`` of
    ``point``; ``lossy(c, key)`` runs the collective with ``c`` (``key``: a PRNG key for a
    codec that rounds stochastically, else None); ``layer`` (traced int) tags tensor points."""
    e = exact.astype(jnp.float32)
    vals = [jnp.sum(e * e)]
    for i, (_, c) in enumerate(self.codecs.get(point, [])):
      # A measurement, not training: one fixed key per codec gives its error's size (the
      # ops fold in each rank's index themselves).
      key = jax.random.fold_in(jax.random.key(0), i) if is_stochastic(c) else None
      d = lossy(c, key).astype(jnp.float32) - e
      vals.append(jnp.sum(d * d))
    lay = jnp.int32(-1) if layer is None else layer
    jax.debug.callback(functools.partial(self._add, point), jnp.stack(vals), lay)

  def _add(self, point: str, vals: Any, layer: Any) -> None:
    v, layer = np.asarray(vals, np.float64), int(layer)
    with self._lock:
      self.sums[(point, -1)] = self.sums[(point, -1)] + v
      if layer >= 0:
        self.sums[(point, layer)] = self.sums[(point, layer)] + v

  def add_noise(self, var: jax.Array, norm2: jax.Array) -> None:
    jax.debug.callback(self._add_noise, jnp.stack([var, norm2]))

  def _add_noise(self, vals: Any) -> None:
    with self._lock:
      self.noise = self.noise + np.asarray(vals, np.float64)

  def share(self) -> None:
    """Replaces this process's sums by the sums over all processes, the same on every one
    (added in process order); nothing changes in a single-process run."""
    if jax.process_count() == 1:
      return
    mine = {
      "sums": [[p, layer, list(np.atleast_1d(v))] for (p, layer), v in self.sums.items()],
      "noise": list(self.noise),
    }
    self.sums.clear()
    self.noise = np.zeros(2)
    for part in gather_json(mine):
      for p, layer, v in part["sums"]:
        self.sums[(p, layer)] = self.sums[(p, layer)] + np.asarray(v, np.float64)
      self.noise = self.noise + np.asarray(part["noise"], np.float64)

  def noise_ratio(self) -> float:
    """The gradient noise relative to the gradient sum's norm."""
    return float(np.sqrt(max(self.noise[0], 0.0) / self.noise[1])) if self.noise[1] else 0.0

  def errors(self) -> dict[str, dict[str, float]]:
    """``{"point" or "point@layer": {label: relative error}}``."""
    out = {}
    for (point, layer), v in sorted(self.sums.items()):
      labels = [lab for lab, _ in self.codecs.get(point, [])]
      key = point if layer < 0 else f"{point}@{layer}"
      out[key] = {lab: float(np.sqrt(e / v[0])) if v[0] else 0.0 for lab, e in zip(labels, v[1:])}
    return out


def gather_json(obj: Any) -> list[Any]:
  """``obj`` (JSON-serialisable) of every process, in process order, on every process.

  Floats survive exactly (JSON writes their shortest round-trip repr). One gather of the
  sizes and one of the padded bytes (``multihost_utils.process_allgather``)."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils

  mine = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray(mine.size, np.int32)))
  sizes = sizes.reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[: mine.size] = mine
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(sizes.size, -1)
  return [json.loads(rows[i, : sizes[i]].tobytes().decode()) for i in range(sizes.size)]


def tree_rel(a: Any, b: Any) -> float:
  """``||a - b|| / ||b||`` over all leaves of two pytrees."""
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
  return float(np.sqrt(num / den)) if den else 0.0


def codec_ladder(bits: Sequence[int], family: str = FAMILY) -> list[tuple[str, Any]]:
  """``[(label, compressor)]`` for each bit width: ``family`` formatted with ``b``."""
  return [(f"int{b}", jc.parse(family.format(b=b))) for b in bits]


class Prober:
  """Measures a step's injected errors, gradient errors and gradient noise (see the module
  docstring), compiling each program once and reusing it for later parameters and batches.

  Args:
    model, mesh: the model and its ('data', 'tensor', 'pipe') mesh.
    bits: the candidate bit widths, ``family`` formatted with each.
    reference_bits: the width at which each point's gradient error is measured.
    points: the points measured (each costs a compiled program for its gradient error).
    n_micro, dtype: as Parallel3D.

  Example:
    >>> result = Prober(model, mesh).run(params, [(x, y)])
  """

  def __init__(
    self,
    model: Any,
    mesh: Any,
    *,
    bits: Sequence[int] = (2, 3, 4, 5, 6, 8),
    reference_bits: int = 4,
    family: str = FAMILY,
    points: Sequence[str] = POINTS,
    n_micro: int = 2,
    dtype: Any = jnp.float32,
  ):
    check_directions(dict.fromkeys(points))
    if reference_bits not in bits:
      raise ValueError(f"reference_bits {reference_bits} must be one of bits {list(bits)}")
    self.bits, self.reference_bits, self.family = list(bits), reference_bits, family
    self.points = tuple(points)
    self.tap = Tap({p: codec_ladder(bits, family) for p in self.points})
    make = lambda d=None, tap=None: DirectedParallel(
      model, mesh, None, directions=d, tap=tap, n_micro=n_micro, dtype=dtype
    )
    self._tapped = grads_fn(make(tap=self.tap))
    self._exact = grads_fn(make())
    ref = family.format(b=reference_bits)
    self._points = {p: grads_fn(make({p: ref})) for p in self.points}

  def injected(self, params: Any, batches: Sequence[tuple]) -> dict:
    """``{"noise": rel, "injected": {point[@layer]: {"intB": rel}}}`` over ``batches``."""
    self.tap.sums.clear()
    self.tap.noise = np.zeros(2)
    for x, y in batches:
      jax.block_until_ready(self._tapped(params, x, y))
    jax.effects_barrier()
    self.tap.share()
    return {"noise": self.tap.noise_ratio(), "injected": self.tap.errors()}

  def gradient(self, params: Any, batches: Sequence[tuple]) -> dict[str, float]:
    """``{point: ||g_point - g_exact|| / ||g_exact||}`` at the reference bits, mean over
    ``batches``."""
    errs = collections.defaultdict(list)
    for x, y in batches:
      g0 = self._exact(params, x, y)[1]
      for p, f in self._points.items():
        errs[p].append(tree_rel(f(params, x, y)[1], g0))
    return {p: float(np.mean(v)) for p, v in errs.items()}

  def run(self, params: Any, batches: Sequence[tuple], gradients: bool = True) -> dict:
    """The injected errors and noise, and (``gradients``) the gradient errors and each
    point's sensitivity: gradient error / injected error at the reference bits."""
    out = {
      **self.injected(params, batches),
      "bits": self.bits,
      "reference_bits": self.reference_bits,
      "family": self.family,
      "batches": len(batches),
    }
    if gradients:
      out["gradient"] = self.gradient(params, batches)
      lab = f"int{self.reference_bits}"
      inj = out["injected"]
      out["sensitivity"] = {
        p: out["gradient"][p] / inj[p][lab] if inj.get(p, {}).get(lab) else 0.0 for p in self.points
      }
    return out


def grads_fn(par: Parallel3D) -> Any:
  """A jitted ``(params, tokens, targets) -> (loss, grads)`` of ``par`` compiled once (each
  call of ``Parallel3D.loss_and_grads`` traces anew)."""
  from jax.sharding import PartitionSpec as P

  batch = par.placement.batch_spec()
  # A stochastic point draws its keys from a "probe" stream (step 0), as training would.
  keys = (lambda: par._keys("probe", 0)) if par.stochastic else (lambda: None)
  f = par.placement.shard_map(
    lambda *a: par._local_loss_and_grads(*a, keys=keys())[:2],
    (par.specs, batch, batch),
    (P(), par.specs),
  )
  return jax.jit(f)


def probe(model: Any, mesh: Any, params: Any, batches: Sequence[tuple], **kw: Any) -> dict:
  """:meth:`Prober.run` once (``kw``: Prober's)."""
  return Prober(model, mesh, **kw).run(params, batches)


def warm_start(train_argv: list[str], warm_steps: int) -> tuple[Any, Any, Any, Any, Any]:
  """Trains the exact policy ``warm_steps`` steps (models.train's flags in ``train_argv``);
  returns (cfg, model, mesh, params, corpus) to probe from."""
  from models import cli, data, loop, parallel
  from models.run_config import RunConfig, build_model

  args = cli.parse_args(train_argv)
  corpus = data.load_corpus(args.tokenizer, max_chars=args.max_chars)
  cfg = RunConfig.from_args(args)
  model = build_model(cfg, corpus.vocab_size)
  mesh = parallel.make_mesh(*cfg.mesh_shape)
  par = Parallel3D(model, mesh, None, n_micro=cfg.micro, dtype=cfg.dtype)
  tx = loop.make_optimizer(cfg)
  params = par.placement.shard(model)
  opt, ef = par.init_opt(tx, params), par.grad_sync.init_ef(params)
  step = par.train_step(tx, params, clip_norm=cfg.clip)
  for s in range(warm_steps):
    x, y = loop.batch_at(corpus, cfg, par, "train", s)
    params, opt, ef, _ = step(params, opt, ef, x, y)
  return cfg, model, mesh, params, corpus


def table(result: dict) -> str:
  """The probe's result as markdown: per point and bit width the injected error, the
  gradient error at the reference bits and its ratio to the gradient noise."""
  noise, lab = result["noise"], f"int{result['reference_bits']}"
  labs = [f"int{b}" for b in result["bits"]]
  lines = [
    f"gradient noise (relative to the gradient sum): {noise:.4f}",
    "",
    "| point | "
    + " | ".join(f"injected {x}" for x in labs)
    + f" | gradient error ({lab}) | / noise |",
    "|---|" + "---|" * (len(labs) + 2),
  ]
  for key, errs in result["injected"].items():
    point = key.split("@")[0]
    g = result["gradient"].get(key)
    if g is None and "@" in key:
      g_txt, ratio = "", ""
    else:
      g_txt, ratio = f"{g:.4f}", f"{g / noise:.3f}" if noise else ""
    lines.append(
      f"| {key} | " + " | ".join(f"{errs[x]:.4f}" for x in labs) + f" | {g_txt} | {ratio} |"
    )
    del point
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  """``python -m models.error_probe``: warm up exact, probe, write probe.json and probe.md."""
  from models.run_config import use_host_devices

  use_host_devices()
  p = argparse.ArgumentParser(
    prog="python -m models.error_probe", description=__doc__.split("\n")[0]
  )
  p.add_argument("--model", default="gpt")
  p.add_argument("--size", default="small")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--warm-steps", type=int, default=50, help="exact steps before probing")
  p.add_argument("--batches", type=int, default=2, help="train batches probed (after warm-up)")
  p.add_argument("--bits", default="2,3,4,5,6,8")
  p.add_argument("--reference-bits", type=int, default=4)
  p.add_argument("--family", default=FAMILY, help="codec spec with {b} for bits")
  p.add_argument("--train-arg", action="append", default=[], help="extra models.train flag")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  bits = [int(b) for b in a.bits.split(",")]
  if a.reference_bits not in bits:
    p.error(f"--reference-bits {a.reference_bits} must be one of --bits {a.bits}")
  train_argv = ["--model", a.model, "--size", a.size, "--seed", str(a.seed), "--mesh", "2,2,2"]
  train_argv += ["--steps", str(a.warm_steps + a.batches), "--out", a.out, *a.train_arg]
  from models import loop

  cfg, model, mesh, params, corpus = warm_start(train_argv, a.warm_steps)
  par = Parallel3D(model, mesh, None, n_micro=cfg.micro, dtype=cfg.dtype)
  batches = [loop.batch_at(corpus, cfg, par, "train", a.warm_steps + i) for i in range(a.batches)]
  result = probe(
    model,
    mesh,
    params,
    batches,
    bits=bits,
    reference_bits=a.reference_bits,
    family=a.family,
    n_micro=cfg.micro,
    dtype=cfg.dtype,
  )
  result["command"] = "python -m models.error_probe " + " ".join(argv or sys.argv[1:])
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "probe.json").write_text(json.dumps(result, indent=1))
  (out / "probe.md").write_text(table(result) + "\n")
  print(table(result))
  return result


if __name__ == "__main__":
  main()
