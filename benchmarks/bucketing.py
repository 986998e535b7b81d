"""Leaf bucketing on CPU: a gradient-like pytree's compressed all_reduce against one leaf of
the same total size, the same leaves one chain each (what every call lowered to before
bucketing), and lax.psum of the leaves; all in one process, interleaved.

200 float32 leaves of 1-3000 values (seeded), 8 host CPU devices, int8 two_shot on the xla
backend, chunks=1, min_bytes=0 (every leaf compressed). Each variant's first call (trace,
compile, run) is timed once; then ``--repeats`` rounds call every variant once each, in
turn, so that load on a shared machine falls on all of them alike. Prints medians, the
min-max spread, the seconds of tracing and lowering, and the collectives each lowered
program holds. "no collective" (each leaf doubled) is the floor of any program with this
many inputs and outputs; "pack+unpack only" is the bucketed call without codec or
collective (the row built and cut back out, as jcoccl packs it: on CPU one
``jcoccl_pack_rows`` and one ``jcoccl_unpack_rows`` call). The ", 1 output" pair consumes
the results inside the program with one concatenate, so each program returns one array:
the collective's cost apart from returning 200 arrays from a jitted function ("vs one
leaf" of that pair: against "one leaf, 1 output"). The last line subtracts, round by round,
each program's no-collective twin ("no collective", "one leaf, no collective"): what the
all_reduce itself costs once the program's arrays in and out are paid.

  python benchmarks/bucketing.py [--leaves 200] [--repeats 9] [--seed 0] [--json out.json]

Not part of the test suite (tests/test_bucketing.py checks the behaviour, not the time).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jcoccl
from jcoccl._src.compressors import layout as L

P = jax.P
KW = dict(compressor="int8", algorithm="two_shot", backend="xla", min_bytes=0)


def sizes(leaves: int, seed: int) -> list[int]:
  """The leaves' sizes: uniform in 1..3000."""
  return [int(s) for s in np.random.default_rng(seed).integers(1, 3001, leaves)]


def variants(mesh: jax.sharding.Mesh) -> dict[str, Callable]:
  """name -> jitted program over a list of leaves (each [8, size], split over "d")."""

  def smap(body: Callable) -> Callable:
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

  return {
    "bucketed": smap(lambda v: jcoccl.all_reduce(v, "d", **KW)),
    "per-leaf chains": smap(lambda v: [jcoccl.all_reduce(x, "d", **KW) for x in v]),
    "one leaf": smap(lambda v: jcoccl.all_reduce(v, "d", **KW)),
    "lax.psum": smap(lambda v: lax.psum(v, "d")),
    "no collective": smap(lambda v: [2 * x for x in v]),
    "one leaf, no collective": smap(lambda v: [2 * x for x in v]),
    "pack+unpack only": smap(lambda v: L.unpack_parts(L.pack_parts(v, *_packing(v)), _spans(v))),
    "bucketed, 1 output": smap(lambda v: _flat(jcoccl.all_reduce(v, "d", **KW))),
    "one leaf, 1 output": smap(lambda v: _flat(jcoccl.all_reduce(v, "d", **KW))),
  }


def _flat(ys: list) -> jax.Array:
  """The results consumed inside the program by one op (as a flat optimizer update would),
  so that the program returns one array instead of one per leaf."""
  return jnp.concatenate([y.reshape(-1) for y in ys])


def _spans(v: list) -> list:
  """Each leaf's place in a row packed as the bucketed int8 call packs it (blocks of 256)."""
  return [L.Span(1, x.shape[-1], L.padded_len(x.shape[-1], 256)) for x in v]


def _packing(v: list) -> tuple[list, int]:
  spans = _spans(v)
  return spans, sum(s.padded for s in spans)


def collectives(f: Callable, args: list) -> tuple[dict[str, int], float]:
  """The collectives in the lowered program, and the seconds tracing and lowering took."""
  t = time.perf_counter()
  text = f.lower(args).as_text()
  took = time.perf_counter() - t
  ops = ("all_to_all", "all_gather", "all_reduce")
  return {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ops}, took


def timed(f: Callable, args: list) -> float:
  t = time.perf_counter()
  jax.block_until_ready(f(args))
  return time.perf_counter() - t


def own_time(times: dict[str, list[float]]) -> dict[str, float]:
  """The collective's time apart from the program's arrays in and out: per round, the
  bucketed call minus "no collective" (the same 200 arrays in and out, each doubled), and one
  leaf minus "one leaf, no collective"; rounds are interleaved, so both differences of a round
  saw the same load."""
  leaves = [b - f for b, f in zip(times["bucketed"], times["no collective"])]
  one = [b - f for b, f in zip(times["one leaf"], times["one leaf, no collective"])]
  ratios = [x / y for x, y in zip(leaves, one) if y > 0]
  return dict(
    leaves_ms=1e3 * statistics.median(leaves),
    one_leaf_ms=1e3 * statistics.median(one),
    ratio=statistics.median(leaves) / statistics.median(one),
    ratio_min=min(ratios),
    ratio_max=max(ratios),
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--leaves", type=int, default=200)
  ap.add_argument("--repeats", type=int, default=9)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", help="write the figures here too")
  a = ap.parse_args()
  mesh = jax.make_mesh((8,), ("d",))
  shard = jax.NamedSharding(mesh, P("d"))
  sz = sizes(a.leaves, a.seed)
  keys = jax.random.split(jax.random.key(a.seed), len(sz))
  tree = [jax.device_put(jax.random.normal(k, (8, s)), shard) for k, s in zip(keys, sz)]
  one = [jax.device_put(jax.random.normal(keys[0], (8, sum(sz))), shard)]
  fs = variants(mesh)
  args = {name: one if name.startswith("one leaf") else tree for name in fs}
  print(f"{len(sz)} float32 leaves, {sum(sz)} values in all (sizes {min(sz)}-{max(sz)}), ", end="")
  print(f"8 CPU devices, jax {jax.__version__}, {KW}")
  # The first jcoccl program of a process compiles twice (its second call re-traces: the
  # codec registry's generation moves on first use); a small one takes that here.
  warm = variants(mesh)["one leaf"]
  small = [jax.device_put(jnp.ones((8, 256)), shard)]
  warm_s = [timed(warm, small) for _ in range(3)]
  first = {name: timed(f, args[name]) for name, f in fs.items()}
  second = {name: timed(f, args[name]) for name, f in fs.items()}
  fresh = variants(mesh)  # new jit objects: their lowering is not cached yet
  ops = {name: collectives(f, args[name]) for name, f in fresh.items()}
  times: dict[str, list[float]] = {name: [] for name in fs}
  for _ in range(a.repeats):
    for name, f in fs.items():
      times[name].append(timed(f, args[name]))
  baseline = {"": statistics.median(times["one leaf"])}
  baseline[", 1 output"] = statistics.median(times["one leaf, 1 output"])
  rows = {}
  print(
    f"{'variant':18s} {'first call s':>12s} {'trace+lower s':>13s} {'median ms':>10s} "
    f"{'min-max ms':>17s} {'vs one leaf':>11s}  collectives in the program"
  )
  for name in fs:
    t = times[name]
    med = statistics.median(t)
    base = baseline[", 1 output" if name.endswith(", 1 output") else ""]  # its own kind of one leaf
    rows[name] = dict(
      first_call_s=first[name],
      second_call_s=second[name],
      trace_lower_s=ops[name][1],
      median_ms=1e3 * med,
      min_ms=1e3 * min(t),
      max_ms=1e3 * max(t),
      vs_one_leaf=med / base,
      collectives=ops[name][0],
    )
    print(
      f"{name:18s} {first[name]:12.2f} {ops[name][1]:13.2f} {1e3 * med:10.1f} "
      f"{1e3 * min(t):8.1f}-{1e3 * max(t):8.1f} {med / base:10.2f}x  {ops[name][0]}"
    )
  own = own_time(times)
  print(
    f"the all_reduce's own time (each round: the program minus the same program doubling its "
    f"leaves instead; median): {len(sz)} leaves {own['leaves_ms']:.1f} ms, one leaf "
    f"{own['one_leaf_ms']:.1f} ms, {own['ratio']:.2f}x (per-round ratios {own['ratio_min']:.2f}-"
    f"{own['ratio_max']:.2f}x)"
  )
  if a.json:
    with open(a.json, "w") as fh:
      out = dict(sizes=sz, repeats=a.repeats, kw=KW, warmup_s=warm_s, results=rows, own=own)
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
