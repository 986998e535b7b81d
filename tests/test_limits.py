"""Limits that must fail cleanly or be clamped, never hang or overflow: JCOCCL_TIMEOUT_S
(the fused engine's wait for its peers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src import _ffi
from jcoccl._src import fused

needs_native = pytest.mark.skipif(
    _ffi.native_module("cpu") is None, reason="jcoccl._cpu (the fused engine) is not built")


@pytest.fixture(autouse=True)
def _clean():
  fused.shutdown()
  yield
  fused.shutdown()


def _mesh(n):
  return jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


# ----------------------------------------------------------------------------------------
# JCOCCL_TIMEOUT_S.

_BAD_TIMEOUTS = ["abc", "0", "0.0", "-1", "-inf", "nan", "NaN", "5s", "0x10", "1e", " ",
                 "1e-400", "1,5", "\u0661"]
# (value, seconds): inf and huge values are clamped to 1e8 s, not overflowed.
_GOOD_TIMEOUTS = [("", 300.0), ("300", 300.0), ("0.25", 0.25), (" 2.5 ", 2.5), ("+7", 7.0),
                  ("1e3", 1000.0), (".5", 0.5), ("1e10", 1e8), ("1e400", 1e8), ("inf", 1e8),
                  ("INF", 1e8), ("+Infinity", 1e8)]


@needs_native
@pytest.mark.parametrize("value", _BAD_TIMEOUTS, ids=repr)
def test_invalid_timeout_is_rejected_by_python_and_engine(monkeypatch, value):
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", value)
  msg = "JCOCCL_TIMEOUT_S must be a positive number of seconds"
  with pytest.raises(ValueError, match=msg):
    fused.timeout_seconds()
  with pytest.raises(ValueError, match=msg):
    _ffi.native_module("cpu").fused_timeout_s()
  with pytest.raises(ValueError, match=msg):
    jcoccl.init(_mesh(2))
  assert not fused.is_initialized()


@needs_native
@pytest.mark.parametrize("value,seconds", _GOOD_TIMEOUTS, ids=repr)
def test_valid_timeout_is_parsed_alike_by_python_and_engine(monkeypatch, value, seconds):
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", value)
  assert fused.timeout_seconds() == seconds
  assert _ffi.native_module("cpu").fused_timeout_s() == seconds


def _exact(mesh, offset=0):
  """[4, 64] integers with 127 opening every 32-block: int8 with 32-blocks is exact on them."""
  x = (np.arange(4 * 64) % 200 - 100 + offset).astype(np.float32).reshape(4, 64)
  x[:, ::32] = 127.0
  return jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P("x")))


def _all_gather_program(mesh):
  body = lambda v: jcoccl.all_gather(v, "x", axis=0, tiled=True, backend="fused",
                                     compressor=jc.int8(block_size=32), min_bytes=0)
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
def test_timeout_made_invalid_after_compiling_fails_the_call(monkeypatch):
  """The engine reads the variable at every call: an invalid value set after compiling
  fails every rank alike before any of them waits (no hang, no silent 300 s)."""
  mesh = _mesh(4)
  jcoccl.init(mesh)
  f = _all_gather_program(mesh)
  jax.block_until_ready(f(_exact(mesh)))
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", "-1")
  with pytest.raises(Exception, match="JCOCCL_TIMEOUT_S must be a positive number"):
    jax.block_until_ready(f(_exact(mesh, 1)))
  monkeypatch.setenv("JCOCCL_TIMEOUT_S", "30")
  x = _exact(mesh, 2)
  np.testing.assert_array_equal(np.asarray(f(x))[:4], np.asarray(x))
