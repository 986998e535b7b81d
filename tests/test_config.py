"""jcoccl.config: settings captured when a program is traced, part of jit's cache key, and
environment variables read once."""

import re

import jax
import jax.numpy as jnp
import pytest
from collectives_util import mesh

import jcoccl
from jcoccl._src.base import config as config_mod


@pytest.fixture(autouse=True)
def _defaults():
  jcoccl.set_config_defaults(reload=True)
  yield
  jcoccl.set_config_defaults(reload=True)


def _counted_all_reduce(traces):
  m = mesh((4,), ("x",))

  def body(v):
    traces.append(1)
    return jcoccl.all_reduce(v, "x", compressor="int8")

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=jax.P("x"), out_specs=jax.P("x")))
  return f, jnp.ones((4, 1024), jnp.float32)  # 4 KiB per device: under the 4 MiB default


def _uses_u8_collective(f, x) -> bool:
  return bool(re.search(r"u8\[[^\]]*\][^\n]*all-gather", f.lower(x).compile().as_text()))


def test_changing_the_config_under_jit_recompiles_never_stale():
  traces = []
  f, x = _counted_all_reduce(traces)
  assert not _uses_u8_collective(f, x)  # exact: under min_bytes
  with jcoccl.config(min_bytes=0):
    assert _uses_u8_collective(f, x)  # a new trace, compressed
    jax.block_until_ready(f(x))
  assert not _uses_u8_collective(f, x)  # back outside: the exact program again
  assert len(traces) == 2
  jcoccl.set_config_defaults(min_bytes=0)
  assert _uses_u8_collective(f, x)  # changed defaults: the compressed program
  # ... whose config equals the block's: jit's cache has it, no third trace.
  assert len(traces) == 2


def test_the_config_is_a_primitive_param():
  m = mesh((4,), ("x",))
  g = jax.shard_map(
    lambda v: jcoccl.all_reduce(v, "x", compressor="int8"),
    mesh=m,
    in_specs=jax.P("x"),
    out_specs=jax.P("x"),
  )
  x = jnp.ones((4, 1024), jnp.float32)
  with jcoccl.config(min_bytes=0, gather="all_to_all") as c:
    text = str(jax.make_jaxpr(g)(x))
  assert "jcoccl_all_reduce" in text
  assert str(c) in text and "gather=all_to_all" in text


def test_lowering_uses_the_captured_gather_not_the_current_one():
  m = mesh((4,), ("x",))
  f = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_reduce(v, "x", compressor="int8", min_bytes=0, algorithm="one_shot"),
      mesh=m,
      in_specs=jax.P("x"),
      out_specs=jax.P("x"),
    )
  )
  x = jnp.ones((4, 1024), jnp.float32)
  with jcoccl.config(gather="all_to_all"):
    traced = f.trace(x)
  hlo_a2a = traced.lower().compile().as_text()  # lowered outside the block
  hlo_ag = f.lower(x).compile().as_text()
  assert "all-to-all" in hlo_a2a and "all-gather" not in hlo_a2a
  assert "all-gather" in hlo_ag and "all-to-all" not in hlo_ag


def test_environment_is_read_once(monkeypatch):
  monkeypatch.setenv("JCOCCL_MIN_BYTES", "123")
  assert jcoccl.get_config().min_bytes == config_mod.BUILTIN_MIN_BYTES  # read before
  assert jcoccl.set_config_defaults(reload=True).min_bytes == 123
  monkeypatch.setenv("JCOCCL_MIN_BYTES", "-1")
  assert jcoccl.default_min_bytes() == 123
  with pytest.raises(ValueError, match="JCOCCL_MIN_BYTES must be an integer >= 0"):
    jcoccl.set_config_defaults(reload=True)


@pytest.mark.parametrize(
  "name,value,message",
  [
    ("JCOCCL_GATHER", "ring", "JCOCCL_GATHER must be one of"),
    ("JCOCCL_TIMEOUT_S", "0", "JCOCCL_TIMEOUT_S must be a positive number"),
    ("JCOCCL_COST_MODEL", "/nonexistent.json", "cannot be read"),
  ],
)
def test_bad_environment_names_the_variable(monkeypatch, name, value, message):
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    config_mod.from_environment()


@pytest.mark.parametrize(
  "kw,err,message",
  [
    (dict(min_bytes=-1), ValueError, "min_bytes must be a non-negative int"),
    (dict(gather="ring"), ValueError, "gather must be one of"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a positive number"),
    (dict(cost_model=3), TypeError, "cost_model must be a CostModel"),
    (dict(threshold=1), TypeError, r"unknown settings \['threshold'\]"),
  ],
)
def test_bad_settings_are_named(kw, err, message):
  with pytest.raises(err, match=message), jcoccl.config(**kw):
    pass


def test_timeout_is_clamped_and_nested_blocks_restore():
  with jcoccl.config(timeout_s=float("inf")) as outer:
    assert outer.timeout_s == 1e8
    with jcoccl.config(timeout_s=2.5):
      assert jcoccl.get_config().timeout_s == 2.5
    assert jcoccl.get_config() is outer
  assert jcoccl.get_config().timeout_s == 300.0


def test_first_program_of_a_process_traces_once():
  # The defaults enter jit's key. Were they filled in while the first program traced, its
  # second call would miss the cache and trace (and compile) again: a fresh process shows it.
  import subprocess
  import sys

  script = (
    "import jax, jax.numpy as jnp, jcoccl\n"
    "n = []\n"
    "def f(x):\n"
    "  n.append(1)\n"
    "  return x * jcoccl.get_config().timeout_s\n"
    "g = jax.jit(f)\n"
    "g(jnp.ones(2)); g(jnp.ones(2))\n"
    "print(len(n))\n"
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == "1"
