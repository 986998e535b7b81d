"""Limits that must fail cleanly or be clamped, never hang or overflow: the timeout
(jcoccl.config timeout_s / JCOCCL_TIMEOUT_S, the fused engine's wait for its peers) and ``chunks`` (slices per message)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src import _env
from jcoccl._src.compressors import layout as L
from jcoccl._src.engine import fused_comms, fused_ffi
from jcoccl._src.native import _ffi

needs_native = pytest.mark.skipif(
  _ffi.native_module("cpu") is None, reason="jcoccl._cpu (the fused engine) is not built"
)


@pytest.fixture(autouse=True)
def _clean():
  fused_comms.shutdown()
  yield
  fused_comms.shutdown()


def _mesh(n):
  return jax.make_mesh(
    (n,), ("x",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
  )


# ----------------------------------------------------------------------------------------
# JCOCCL_TIMEOUT_S.

_BAD_TIMEOUTS = [
  "abc",
  "0",
  "0.0",
  "-1",
  "-inf",
  "nan",
  "NaN",
  "5s",
  "0x10",
  "1e",
  " ",
  "1e-400",
  "1,5",
  "\u0661",
]
# (value, seconds): inf and huge values are clamped to 1e8 s, not overflowed.
_GOOD_TIMEOUTS = [
  ("", 300.0),
  ("300", 300.0),
  ("0.25", 0.25),
  (" 2.5 ", 2.5),
  ("+7", 7.0),
  ("1e3", 1000.0),
  (".5", 0.5),
  ("1e10", 1e8),
  ("1e400", 1e8),
  ("inf", 1e8),
  ("INF", 1e8),
  ("+Infinity", 1e8),
]


@pytest.fixture
def _env_defaults(monkeypatch):
  yield
  monkeypatch.delenv("JCOCCL_TIMEOUT_S", raising=False)
  jcoccl.set_config_defaults(reload=True)


@pytest.mark.parametrize("value", _BAD_TIMEOUTS, ids=repr)
def test_invalid_timeout_is_rejected_when_the_environment_is_read(
  monkeypatch, value, _env_defaults
):
  before = jcoccl.get_config()
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", value)
  msg = "JCOCCL_TIMEOUT_S must be a positive number of seconds"
  with pytest.raises(ValueError, match=msg):
    _env.seconds("JCOCCL_TIMEOUT_S", 300.0)
  with pytest.raises(ValueError, match=msg):
    jcoccl.set_config_defaults(reload=True)
  assert jcoccl.get_config() == before  # a failed reload changes nothing


@pytest.mark.parametrize("value,seconds", _GOOD_TIMEOUTS, ids=repr)
def test_valid_timeout_is_parsed_and_reaches_the_config(monkeypatch, value, seconds, _env_defaults):
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", value)
  assert _env.seconds("JCOCCL_TIMEOUT_S", 300.0) == seconds
  assert jcoccl.set_config_defaults(reload=True).timeout_s == seconds
  assert fused_ffi.timeout_seconds() == seconds


@needs_native
@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), -float("inf")])
def test_engine_refuses_the_timeouts_the_config_refuses(seconds):
  with pytest.raises(ValueError, match="timeout_s must be a positive number"):
    _ffi.native_module("cpu").fused_check_timeout(seconds)
  with (
    pytest.raises(ValueError, match="timeout_s must be a positive number"),
    jcoccl.config(timeout_s=seconds),
  ):
    pass


@needs_native
@pytest.mark.parametrize("seconds", [0.25, 300.0, 1e10, float("inf")])
def test_engine_keeps_the_timeout_the_config_gives(seconds):
  with jcoccl.config(timeout_s=seconds) as c:
    assert _ffi.native_module("cpu").fused_check_timeout(seconds) == c.timeout_s


def _exact(mesh, offset=0):
  """[4, 64] integers with 127 opening every 32-block: int8 with 32-blocks is exact on them."""
  x = (np.arange(4 * 64) % 200 - 100 + offset).astype(np.float32).reshape(4, 64)
  x[:, ::32] = 127.0
  return jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P("x")))


def _all_gather_program(mesh):
  body = lambda v: jcoccl.all_gather(
    v, "x", axis=0, tiled=True, backend="fused", compressor=jc.int8(block_size=32), min_bytes=0
  )
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))


@needs_native
@pytest.mark.parametrize("value", ["inf", "1e10", "1e300"])
def test_fused_call_succeeds_with_an_unlimited_timeout(monkeypatch, value):
  """Huge timeouts used to overflow the deadline, failing every call at once."""
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", value)
  mesh = _mesh(4)
  jcoccl.init(mesh)
  x = _exact(mesh)
  got = _all_gather_program(mesh)(x)
  np.testing.assert_array_equal(np.asarray(got)[:4], np.asarray(x))


@needs_native
def test_the_timeout_is_an_attribute_fixed_when_traced(monkeypatch):
  """The engine reads no environment variable: a compiled program keeps the timeout it was
  traced with (the environment is read once, so a later change does nothing), and a new
  config traces a program with the new attribute."""
  mesh = _mesh(4)
  jcoccl.init(mesh)
  f = _all_gather_program(mesh)
  jax.block_until_ready(f(_exact(mesh)))
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", "-1")
  x = _exact(mesh, 2)
  np.testing.assert_array_equal(np.asarray(f(x))[:4], np.asarray(x))
  assert re.search(r"timeout_s = 3\.0+e\+02 : f64", f.lower(x).as_text())
  with jcoccl.config(timeout_s=7.5):
    assert re.search(r"timeout_s = 7\.50*e\+00 : f64", f.lower(x).as_text())
    np.testing.assert_array_equal(np.asarray(f(x))[:4], np.asarray(x))


# ----------------------------------------------------------------------------------------
# chunks.


@pytest.mark.parametrize("unit", [1, 32, 256])
def test_slices_clamps_to_whole_units(unit):
  """Every slice holds at least one unit of the message, for every length and chunks."""
  for length in (1, unit - 1, unit, unit + 1, 7 * unit, 64 * unit, 64 * unit + 1):
    if length < 1:
      continue
    units = -(-length // unit)
    for chunks in (1, 2, 7, 64, 65, 10_000, 2**20):
      if min(chunks, units) > L.MAX_SLICES:
        with pytest.raises(ValueError, match=r"chunks=\d+ would cut .* at most 64"):
          L.slices(chunks, length, unit)
        continue
      k = L.slices(chunks, length, unit)
      assert k == min(chunks, units) and 1 <= k <= L.MAX_SLICES
      assert (k - 1) * unit < length  # the last slice holds real data


_OPS = ("one_shot", "two_shot", "reduce_scatter", "all_gather", "all_to_all", "ppermute")
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _program(mesh, op, chunks, backend, comp):
  kw = dict(compressor=comp, chunks=chunks, backend=backend, min_bytes=0)

  def body(v):  # v: [8, 128] float32 = 4 KiB per device
    if op in ("one_shot", "two_shot"):
      return jcoccl.all_reduce(v, "x", algorithm=op, **kw)
    if op == "reduce_scatter":
      return jcoccl.reduce_scatter(v, "x", scatter_dimension=0, tiled=True, **kw)
    if op == "all_gather":
      return jcoccl.all_gather(v, "x", axis=0, tiled=True, **kw)
    if op == "all_to_all":
      return jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw)
    return jcoccl.ppermute(v, "x", [(i, (i + 1) % 8) for i in range(8)], **kw)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))


def _slices_used(op, comp):
  """Slices a 4 KiB ([8, 128] float32) message is cut into with chunks=2**20."""
  g = comp.granule
  length, unit = {
    "one_shot": (1024, g),
    "two_shot": (1024, 8 * g),
    "reduce_scatter": (128, g),
    "all_to_all": (128, g),
  }.get(op, (1024, g))
  return -(-length // unit)


def _hlo_counts(text):
  lines = text.splitlines()
  counts = {
    op: sum(1 for l in lines if f" {op}(" in l or f" {op}-start(" in l) for op in _COLLECTIVES
  }
  counts["fused_k"] = sorted(int(k) for k in re.findall(r"\bk = (\d+) : i64", text))
  return counts


@pytest.mark.parametrize("backend", ["xla", "fused"])
@pytest.mark.parametrize("op", _OPS)
def test_huge_chunks_on_a_small_message_is_clamped(op, backend):
  """chunks=2**20 on a 4 KiB message: the program is the one of chunks = the granules the
  message holds, with the same bits (and chunks=1's bits: slices are cut at granules)."""
  if backend == "fused" and _ffi.native_module("cpu") is None:
    pytest.skip("jcoccl._cpu (the fused engine) is not built")
  comp = jc.int8(block_size=32)
  mesh = _mesh(8)
  if backend == "fused":
    jcoccl.init(mesh)
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (64, 128), jnp.float32),
    jax.NamedSharding(mesh, jax.P("x")),
  )
  k = _slices_used(op, comp)
  assert 1 < k <= L.MAX_SLICES
  # The compiled programs are also the ones run: a jit call would compile each again.
  huge = _program(mesh, op, 2**20, backend, comp).lower(x).compile()
  fit = _program(mesh, op, k, backend, comp).lower(x).compile()
  counts = _hlo_counts(huge.as_text())
  assert counts == _hlo_counts(fit.as_text())
  if backend == "fused":
    assert counts["fused_k"] == [k]
  else:
    assert sum(counts[c] for c in _COLLECTIVES) <= 2 * k
  got = np.asarray(huge(x))
  np.testing.assert_array_equal(got.view(np.uint32), np.asarray(fit(x)).view(np.uint32))
  np.testing.assert_array_equal(
    got.view(np.uint32), np.asarray(_program(mesh, op, 1, backend, comp)(x)).view(np.uint32)
  )


@pytest.mark.parametrize("op", _OPS)
def test_more_than_64_slices_is_rejected(op):
  """cast has a granule of 1: a 4 KiB message holds 1024 of them, so chunks=65 would
  really cut it into 65 slices (each one unrolled into the program)."""
  mesh = _mesh(8)
  x = jax.device_put(jnp.ones((64, 128), jnp.float32), jax.NamedSharding(mesh, jax.P("x")))
  with pytest.raises(ValueError, match=r"chunks=65 would cut .* into 65 slices; at most 64"):
    _program(mesh, op, 65, "xla", jc.cast("bfloat16")).trace(x)
  _program(mesh, op, 64, "xla", jc.cast("bfloat16")).trace(x)  # the limit itself traces
