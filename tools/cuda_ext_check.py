#!/usr/bin/env python3
"""Checks of the CUDA extension's host side on the CPU (library: tools/cuda_ext.py).

Scenarios each check one host-side property of the CUDA engine, transport and handlers; a
mutant build with the matching seeded bug (cuda_ext.MUTATIONS) must fail it. `check` is
what tools/gpu_check.sh --cpu runs: op matrix cases against the CPU paths, every scenario
on the shipped sources, and every seeded bug caught (--quick: one scenario and its bug).

  python tools/cuda_ext_check.py scenario NAME [--mutate BUG]  # exit 1 when the check fails
  python tools/cuda_ext_check.py seeded NAME=BUG ...   # each without, then with its bug
  python tools/cuda_ext_check.py check [--quick] [--out F]     # everything, JSON + VERDICT
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_ext import (
  COLLECTIVES,
  KERNELS,
  MUTATIONS,
  CudaExt,
  build,
  use,
)


def _mesh(n: int) -> Any:
  import jax

  return jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])


def _data(mesh: Any, dtype: Any = "float32", rows: int = 8, cols: int = 64, seed: int = 0):
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((mesh.devices.size * rows, cols)).astype(np.float32)
  return jax.device_put(jnp.asarray(x, dtype), jax.NamedSharding(mesh, jax.P("x")))


def _run(mesh: Any, body, x):
  import jax

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
  return jax.block_until_ready(f(x))


def _collectives(x, comp, backend: str = "fused", chunks: int = 2):
  import jcoccl

  kw = dict(compressor=comp, backend=backend, chunks=chunks, min_bytes=0)
  return (
    jcoccl.all_reduce(x, "x", algorithm="one_shot", **kw),
    jcoccl.all_reduce(x, "x", algorithm="two_shot", **kw),
    jcoccl.all_gather(x, "x", axis=0, tiled=True, **kw),
  )


def _reference(mesh: Any, body, x):
  """``body`` run through jcoccl's CPU paths (host transport), outside any use()."""
  import jcoccl

  jcoccl.init(mesh)
  try:
    return _run(mesh, body, x)
  finally:
    jcoccl.shutdown()


def _same_bits(got, want, what: str) -> None:
  import numpy as np

  for i, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g), np.asarray(w)
    if g.shape != w.shape or g.view(np.uint8).tobytes() != w.view(np.uint8).tobytes():
      raise AssertionError(f"{what}: output {i} differs from the CPU path")


def _expect_error(fn, must: str, must_not: str) -> str:
  """Runs fn, which must raise an error that names ``must`` and not ``must_not``."""
  try:
    fn()
  except Exception as e:  # XlaRuntimeError / JaxRuntimeError
    text = str(e)
    if must_not in text:
      raise AssertionError(f"found {must_not!r} in: {text[-600:]}") from None
    if must not in text:
      raise AssertionError(f"expected {must!r} in: {text[-600:]}") from None
    return text
  raise AssertionError(f"expected an error naming {must!r}")


def scenario_stream_wait(ext: CudaExt) -> None:
  """Collectives stretched by the delay mode: decode must still wait for the payloads."""
  import jcoccl
  from jcoccl import compressors as jc

  mesh, comp = _mesh(4), jc.int8(block_size=32)
  x = _data(mesh)
  want = _reference(mesh, lambda v: _collectives(v, comp), x)
  with use(ext):
    jcoccl.init(mesh)
    ext.set_delay(COLLECTIVES, 20000)
    _same_bits(_run(mesh, lambda v: _collectives(v, comp), x), want, "delayed collectives")


def scenario_event_reuse(ext: CudaExt) -> None:
  """Every join of a lane into XLA's stream waits on the record it meant."""
  import jcoccl
  from jcoccl import compressors as jc

  mesh, comp = _mesh(2), jc.int4(block_size=32)
  x = _data(mesh)
  want = _reference(mesh, lambda v: _collectives(v, comp), x)
  with use(ext):
    jcoccl.init(mesh)
    _same_bits(_run(mesh, lambda v: _collectives(v, comp), x), want, "event reuse")


def scenario_join_on_error(ext: CudaExt) -> None:
  """A collective that fails after its first slice was queued still joins every lane."""
  import jcoccl
  from jcoccl import compressors as jc

  mesh, comp = _mesh(2), jc.int8(block_size=32)
  x = _data(mesh)
  with use(ext):
    jcoccl.init(mesh)
    ext.set_delay(KERNELS, 20000)
    ext.inject("ncclAllGather", 2)  # the first all-gather of each rank
    body = lambda v: jcoccl.all_reduce(
      v, "x", compressor=comp, backend="fused", chunks=2, min_bytes=0
    )
    _expect_error(lambda: _run(mesh, body, x), "ncclAllGather failed", "jcoccl shim found")


def scenario_workspace(ext: CudaExt) -> None:
  """The engine writes only inside the workspace Python sized for it (a bfloat16 cast of
  64 float32 values on 4 ranks: the gathered payloads end on the 256-byte arena alignment,
  so no padding hides a short workspace; the identity codec needs no workspace at all)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jcoccl
  from jcoccl import compressors as jc
  from jcoccl._src.engine import fused_comms, fused_ffi

  mesh, n, m = _mesh(4), 4, 64
  x = _data(mesh, rows=1, cols=m)
  with use(ext):
    jcoccl.init(mesh)
    cid = fused_comms._state.comms[("x",)]

    def body(v):
      out = fused_ffi.engine_call(
        "all_gather",
        "all_gather",
        v,
        (1, n, m),
        cid,
        n,
        jc.cast(jnp.bfloat16),
        1,
        m,
        platform="cpu",
      )
      return out.reshape(1, n * m)

    f = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"), check_vma=False)
    )
    got = np.asarray(jax.block_until_ready(f(x)))
  rounded = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  want = np.tile(rounded.reshape(1, n * m), (n, 1))
  if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
    raise AssertionError("bfloat16-cast all_gather differs from the rounded input")


def scenario_group(ext: CudaExt) -> None:
  """A send that fails inside a group still closes the group; the next call works."""
  import jcoccl
  from jcoccl import compressors as jc

  mesh, comp = _mesh(4), jc.int8(block_size=32)
  x = _data(mesh)
  perm = [(i, (i + 1) % 4) for i in range(4)]
  body = lambda v: (jcoccl.ppermute(v, "x", perm, compressor=comp, backend="fused", min_bytes=0),)
  want = _reference(mesh, body, x)
  with use(ext):
    jcoccl.init(mesh)
    ext.inject("ncclSend", 4)
    _expect_error(lambda: _run(mesh, body, x), "ncclSend failed", "group left open")
    _same_bits(_run(mesh, body, x), want, "ppermute after a failed one")


def _identity_ops(n: int, k: int, m: int, cid: int, v):
  """The identity codec's engine calls (NCCL's own collectives) on one rank's (k, n, m)."""
  import numpy as np

  from jcoccl._src.engine import fused_ffi

  def call(op, algo, x, shape, perm=None):
    return fused_ffi.engine_call(op, algo, x, shape, cid, n, None, k, m, platform="cpu", perm=perm)

  ring = np.array([(i + 1) % n if i < n - 1 else -1 for i in range(n)], np.int32)
  return (
    call("all_reduce", "one_shot", v[:, 0], (k, m)),
    call("all_reduce", "two_shot", v, (k, n, m)),
    call("reduce_scatter", "reduce_scatter", v, (k, m)),
    call("all_gather", "all_gather", v[:, 0], (k, n, m)),
    call("all_to_all", "all_to_all", v, (k, n, m)),
    call("ppermute", "ppermute", v[:, 0], (k, m), perm=ring),
  )


def _identity_want(xs, n: int):
  """numpy's answers for _identity_ops: float32 sums folded in rank order."""
  import numpy as np

  def fold(parts):
    acc = parts[0].copy()
    for p in parts[1:]:
      acc = acc + p
    return acc

  want = []
  for me in range(n):
    want.append(
      (
        fold([x[:, 0] for x in xs]),
        fold(list(xs)),
        fold([x[:, me] for x in xs]),
        np.stack([x[:, 0] for x in xs], axis=1),
        np.stack([x[:, me] for x in xs], axis=1),
        xs[me - 1][:, 0] if me > 0 else np.zeros_like(xs[0][:, 0]),
      )
    )
  return [np.concatenate([w[i] for w in want]) for i in range(6)]


# How long the return gate waits for a fused handler to return before it reports the
# handler and releases its work. A mutant run shortens it: there a handler that waits for
# its collective never returns by itself, so any limit finds it, and a short one sooner.
GATE_TIMEOUT_MS = 3000


def scenario_no_host_wait(ext: CudaExt) -> None:
  """Every fused handler returns before its NCCL work runs: the emulation's return gate holds
  that work until the handler has returned (a handler that waits for its collective is
  reported). int8 collectives stay bit-identical to the CPU path, and the identity codec's
  (NCCL's own all_reduce, reduce_scatter, all_gather, send/recv) to numpy."""
  import jax
  import numpy as np

  import jcoccl
  from jcoccl import compressors as jc
  from jcoccl._src.engine import fused_comms

  n, k, m = 4, 2, 64
  mesh, comp = _mesh(n), jc.int8(block_size=32)
  x = _data(mesh, seed=3)
  rng = np.random.default_rng(3)
  xs = [rng.standard_normal((k, n, m)).astype(np.float32) for _ in range(n)]
  y = jax.device_put(np.concatenate(xs), jax.NamedSharding(mesh, jax.P("x")))
  kw = dict(compressor=comp, backend="fused", chunks=2, min_bytes=0)

  def coded(v):
    return (
      *_collectives(v, comp),
      jcoccl.reduce_scatter(v, "x", scatter_dimension=0, tiled=True, **kw),
      jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw),
      jcoccl.ppermute(v, "x", [(0, 1), (1, 2)], **kw),
    )

  want = _reference(mesh, coded, x)
  with use(ext):
    jcoccl.init(mesh)
    cid = fused_comms._state.comms[("x",)]
    spec = jax.P("x")
    ident = jax.jit(
      jax.shard_map(
        lambda v: _identity_ops(n, k, m, cid, v),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
      )
    )
    ext.gate(True, GATE_TIMEOUT_MS)
    got = _run(mesh, coded, x)
    got_identity = jax.block_until_ready(ident(y))
    gated = ext.gate(False)
  _same_bits(got, want, "gated collectives")
  _same_bits(got_identity, _identity_want(xs, n), "gated identity collectives")
  if gated == 0:
    raise AssertionError("no NCCL work passed the return gate: the check proved nothing")


SCENARIOS = {
  "stream_wait": scenario_stream_wait,
  "event_reuse": scenario_event_reuse,
  "join_on_error": scenario_join_on_error,
  "workspace": scenario_workspace,
  "group": scenario_group,
  "no_host_wait": scenario_no_host_wait,
}


def _matrix_case(ext: CudaExt, backend: str, comp: Any, n: int) -> bool:
  """Every algorithm of the five ops on n ranks through the CUDA extension == CPU path."""
  import jax

  import jcoccl

  mesh = _mesh(n)
  x = _data(mesh, seed=n)

  def body(v):
    kw = dict(compressor=comp, backend=backend, chunks=2, min_bytes=0)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return (
      *_collectives(v, comp, backend),
      jcoccl.reduce_scatter(v, "x", scatter_dimension=0, tiled=True, **kw),
      jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw),
      jcoccl.ppermute(v, "x", perm, **kw),
    )

  if backend == "fused":
    want = _reference(mesh, body, x)
  else:
    want = jax.block_until_ready(_run(mesh, body, x))
  with use(ext):
    if backend == "fused":
      jcoccl.init(mesh)
    try:
      _same_bits(_run(mesh, body, x), want, backend)
    except AssertionError:
      return False
  return True


def check(out: Path | None, quick: bool) -> int:
  """The CI check (tools/gpu_check.sh --cpu): op matrix cases, every scenario on the shipped
  sources, and every seeded bug caught; writes JSON to ``out`` and prints a VERDICT line."""
  import json
  import threading
  import time

  from jcoccl import compressors as jc

  t0 = time.perf_counter()
  mutant: dict[str, Any] = {}
  th = threading.Thread(target=lambda: mutant.update(lib=build(mutants=True)))
  th.start()
  ext = CudaExt(build())
  comps = {"int8": jc.int8(block_size=32), "fp8": jc.fp8("e4m3", block_size=32)}
  if not quick:
    comps.update(
      int4=jc.int4(block_size=32),
      eb=jc.error_bounded(1e-2, block_size=32),
      hadamard=jc.hadamard(jc.int4(block_size=32)),
    )
  cases = {
    f"{b}/{c}": _matrix_case(ext, b, comp, 4) for c, comp in comps.items() for b in ("xla", "fused")
  }
  pairs = {
    "stream_wait": "no_stream_wait",
    "event_reuse": "event_reuse",
    "join_on_error": "no_join_on_error",
    "workspace": "workspace_short",
    "group": "group_unbalanced",
    "no_host_wait": "host_wait",
  }
  if quick:  # the plumbing; tests/test_cuda_ext.py runs every scenario and seeded bug
    pairs = {"workspace": pairs["workspace"]}
  scenarios = {}
  for name, fn in SCENARIOS.items():
    if name not in pairs:
      continue
    try:
      fn(ext)
      scenarios[name] = True
    except Exception:
      scenarios[name] = False
  th.join()
  caught = {}
  for scenario, mutation in pairs.items():
    r = subprocess.run(
      [sys.executable, __file__, "scenario", scenario, "--mutate", mutation],
      capture_output=True,
      text=True,
      timeout=300,
    )
    caught[mutation] = r.returncode == 1 and f"CAUGHT {scenario}" in r.stdout
  ok = all(cases.values()) and all(scenarios.values()) and all(caught.values())
  result = {
    "cases": cases,
    "scenarios": scenarios,
    "mutations_caught": caught,
    "mismatches": [k for k, v in cases.items() if not v],
    "ok": ok,
    "seconds": round(time.perf_counter() - t0, 1),
  }
  if out is not None:
    out.write_text(json.dumps(result, indent=1))
  print(json.dumps(result, indent=1))
  print(
    f"VERDICT cuda_ext: {sum(cases.values())}/{len(cases)} matrix cases bit-identical, "
    f"{sum(scenarios.values())}/{len(scenarios)} scenarios hold, "
    f"{sum(caught.values())}/{len(caught)} seeded bugs caught"
  )
  return 0 if ok else 1


def seeded(pairs: list[tuple[str, str]]) -> int:
  """Each (scenario, seeded bug) in this one process on the mutant build: the scenario must
  hold with the bug switched off, then fail with it on (the run before shows that what an
  earlier bug left behind is not what fails it). Prints CAUGHT, MISSED or CLEAN FAILED per
  scenario; returns 1 unless every bug is caught."""
  global GATE_TIMEOUT_MS
  ext = CudaExt(build(mutants=True))
  ok = True
  for name, bug in pairs:
    for mutation in (None, bug):
      ext.set_mutation(mutation)
      GATE_TIMEOUT_MS = 3000 if mutation is None else 300
      try:
        SCENARIOS[name](ext)
        error = None
      except Exception as e:  # a failed check, or the shim's finding as a runtime error
        error = f"{type(e).__name__}: {str(e)[-800:]}"
      finally:
        ext.set_mutation(None)
        GATE_TIMEOUT_MS = 3000
      if mutation is None and error is not None:
        print(f"CLEAN FAILED {name}: {error}")
        ok = False
        break
      if mutation is not None:
        print(f"CAUGHT {name}: {error}" if error else f"MISSED {name} ({bug})")
        ok = ok and error is not None
  return 0 if ok else 1


def _pair(text: str) -> tuple[str, str]:
  name, _, bug = text.partition("=")
  if name not in SCENARIOS or bug not in MUTATIONS:
    raise argparse.ArgumentTypeError(
      f"expected SCENARIO=BUG with SCENARIO in {sorted(SCENARIOS)} and BUG in "
      f"{sorted(MUTATIONS)}, got {text!r}"
    )
  return name, bug


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("scenario", help="run one scenario; exit 1 when its check fails")
  s.add_argument("name", choices=sorted(SCENARIOS))
  s.add_argument("--mutate", choices=sorted(MUTATIONS), default=None)
  b = sub.add_parser(
    "seeded", help="scenarios without, then with their seeded bugs, in one process (mutant build)"
  )
  b.add_argument("pairs", nargs="+", type=_pair, metavar="SCENARIO=BUG")
  c = sub.add_parser("check", help="matrix cases, scenarios and seeded bugs (CI's dry run)")
  c.add_argument("--out", type=Path, default=None, help="write the results as JSON")
  c.add_argument(
    "--quick", action="store_true", help="two codecs instead of five, one seeded bug of six"
  )
  args = p.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # A rank that fails leaves its peers waiting: let them give up soon.
  os.environ.setdefault("JCOCCL_TIMEOUT_S", "10")
  if args.cmd == "check":
    return check(args.out, args.quick)
  if args.cmd == "seeded":
    return seeded(args.pairs)
  global GATE_TIMEOUT_MS
  ext = CudaExt(build(mutants=args.mutate is not None))
  ext.set_mutation(args.mutate)
  if args.mutate is not None:
    GATE_TIMEOUT_MS = 300
  try:
    SCENARIOS[args.name](ext)
  except Exception as e:  # a failed check, or the shim's finding as a runtime error
    print(f"CAUGHT {args.name}: {type(e).__name__}: {str(e)[-800:]}")
    return 1
  print(f"OK {args.name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
