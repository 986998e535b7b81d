"""No trace-time state outside jit's key: each former piece of hidden state (the backend
registry that jcoccl.init changes, the mesh, native vs jnp, JCOCCL_DISABLE_NATIVE) either
makes a jitted function trace again or is refused with a clear error."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import mesh

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src import _compat
from jcoccl._src.base import config as config_mod
from jcoccl._src.engine import fused_comms

_INT8 = jc.int8(block_size=32)


@pytest.fixture(autouse=True)
def _clean():
  fused_comms.shutdown()
  jcoccl.set_config_defaults(reload=True)
  yield
  fused_comms.shutdown()
  jcoccl.set_config_defaults(reload=True)


def _gather(m, backend, traces):
  """A jitted shard_map whose body counts its traces and all-gathers with int8."""

  def body(v):
    traces.append(1)
    return jcoccl.all_gather(
      v, "x", axis=0, tiled=True, compressor=_INT8, backend=backend, min_bytes=0
    )

  return jax.jit(jax.shard_map(body, mesh=m, in_specs=jax.P("x"), out_specs=jax.P("x")))


def _x(m):
  """Integers with 127 opening every 32-block: int8 is exact on them."""
  x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64) % 255 - 127
  x[:, ::32] = 127
  return jax.device_put(jnp.asarray(x), jax.NamedSharding(m, jax.P("x")))


def _hlo(f, x, **lower) -> str:
  return f.trace(x).lower(**lower).as_text()


def test_init_and_shutdown_retrace_a_function_traced_before():
  """The backend registry (jcoccl.init / shutdown) is part of jit's key: a function traced
  before init runs the fused engine after it, and xla again after shutdown."""
  m = mesh((8,), ("x",))
  traces: list = []
  f, x = _gather(m, "auto", traces), _x(m)
  want = np.asarray(f(x))
  assert len(traces) == 1 and "jcoccl_fused_" not in _hlo(f, x)
  jcoccl.init(m)
  np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(traces) == 2 and "jcoccl_fused_" in _hlo(f, x)
  jcoccl.shutdown()
  np.testing.assert_array_equal(np.asarray(f(x)), want)
  assert len(traces) == 3 and "jcoccl_fused_" not in _hlo(f, x)


def test_explicit_fused_after_shutdown_is_refused():
  m = mesh((8,), ("x",))
  jcoccl.init(m)
  f, x = _gather(m, "fused", []), _x(m)
  f(x)
  jcoccl.shutdown()
  with pytest.raises(ValueError, match=r"call jcoccl\.init\(mesh\) first"):
    f(x)


def test_mesh_comes_from_jax_context_not_stack_frames():
  """The concrete mesh is what JAX's context holds: an eager shard_map's trace, jax.set_mesh,
  a collective's lowering. Under jit with an explicit mesh the devices are unknown until
  lowering (None at trace time), and a fused call is checked against them there: other
  devices than jcoccl.init's are refused when lowered."""
  assert "_getframe" not in inspect.getsource(_compat)
  m = mesh((8,), ("x",))
  seen: list = []

  def body(v):
    seen.append(_compat.shard_map_mesh())
    return v

  sm = jax.shard_map(body, mesh=m, in_specs=jax.P("x"), out_specs=jax.P("x"))
  x = _x(m)
  sm(x)  # eager
  jax.jit(sm).trace(x)
  with jax.set_mesh(m):
    jax.jit(sm).trace(x)
  assert seen == [m, None, m]

  reversed_mesh = jax.sharding.Mesh(np.array(m.devices.flat[::-1]), ("x",))
  jcoccl.init(m)
  f = _gather(reversed_mesh, "fused", [])
  lowered = f.trace(_x(reversed_mesh))  # names and sizes match: traced
  with pytest.raises(ValueError, match=r"not the mesh given to jcoccl\.init"):
    lowered.lower()


def test_native_kernels_follow_the_lowering_platform():
  """Native vs jnp is decided from the platform a collective is lowered for, not from
  jax.default_backend(): the same trace lowered for CPU calls the CPU kernels, lowered for
  CPU and CUDA at once (one program for both) it runs the jnp specification."""
  m = mesh((8,), ("x",))
  f, x = _gather(m, "xla", []), _x(m)
  assert "jcoccl_encode_rows" in _hlo(f, x, lowering_platforms=("cpu",))
  assert "jcoccl_encode_rows" not in _hlo(f, x, lowering_platforms=("cpu", "cuda"))


def test_native_setting_retraces_and_is_read_once(monkeypatch):
  """JCOCCL_DISABLE_NATIVE is read once into the config (native=False); changing the
  setting retraces a jitted function, which then runs the jnp specification (same bytes)."""
  m = mesh((8,), ("x",))
  traces: list = []
  f, x = _gather(m, "xla", traces), _x(m)
  want = np.asarray(f(x))
  assert "jcoccl_encode_rows" in _hlo(f, x)
  with jcoccl.config(native=False):
    np.testing.assert_array_equal(np.asarray(f(x)), want)
    assert len(traces) == 2 and "jcoccl_encode_rows" not in _hlo(f, x)
  monkeypatch.setenv("JCOCCL_DISABLE_NATIVE", "1")
  assert config_mod.current().native  # the environment was read before: unchanged
  jcoccl.set_config_defaults(reload=True)
  assert not config_mod.current().native
  assert "jcoccl_encode_rows" not in _hlo(f, x)
  with pytest.raises(RuntimeError, match=r"native=False"):
    jcoccl.init(m)
  monkeypatch.setenv("JCOCCL_DISABLE_NATIVE", "yes")
  with pytest.raises(ValueError, match="JCOCCL_DISABLE_NATIVE must be 0 or 1"):
    jcoccl.set_config_defaults(reload=True)
  with pytest.raises(ValueError, match="config native must be a bool"):
    jcoccl.config(native="no").__enter__()


def test_nccl_wait_was_removed_with_a_message_that_says_why(monkeypatch):
  """The GPU engine no longer waits on the host (its watchdog replaced nccl_wait): the setting
  raises TypeError saying so, the variable is ignored with a warning, and no fused call
  carries the attribute."""
  m = mesh((8,), ("x",))
  jcoccl.init(m)
  f, x = _gather(m, "fused", []), _x(m)
  assert "nccl_wait" not in _hlo(f, x)
  with pytest.raises(TypeError, match="nccl_wait was removed: .*watchdog"):
    jcoccl.config(nccl_wait=False).__enter__()
  monkeypatch.setenv("JCOCCL_NCCL_WAIT", "1")
  with pytest.warns(UserWarning, match="JCOCCL_NCCL_WAIT is ignored"):
    jcoccl.set_config_defaults(reload=True)
