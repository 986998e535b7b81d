"""Payload all-gathers by all_to_all (used across CPU processes) give the same bits, types
and gradients as by XLA's all-gather (jcoccl.config(gather=...) selects, default
JCOCCL_GATHER; auto is XLA's all-gather)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import bits, mesh, rand

import jcoccl
from jcoccl._src.compressors import payloads

P = jax.P


def _run(method, body, x, m, out_specs, check_vma):
  f = jax.jit(
    jax.shard_map(body, mesh=m, in_specs=P(m.axis_names), out_specs=out_specs, check_vma=check_vma)
  )
  with jcoccl.config(gather=method):
    return f(x), f.lower(x).compile().as_text()


CASES = {
  "one_shot": (
    lambda v: jcoccl.all_reduce(
      v, ("a", "b"), compressor="int8", algorithm="one_shot", min_bytes=0
    ),
    P(),
  ),
  "two_shot": (
    lambda v: jcoccl.all_reduce(
      v, ("a", "b"), compressor="int4", algorithm="two_shot", min_bytes=0
    ),
    P(),
  ),
  "hierarchical": (
    lambda v: jcoccl.all_reduce(
      v, ("a", "b"), compressor=("int4", "int8"), algorithm="hierarchical", min_bytes=0
    ),
    P(),
  ),
  "all_gather": (
    lambda v: jcoccl.all_gather(v, "b", compressor="fp8", min_bytes=0, tiled=True),
    P(("a", "b")),
  ),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_all_to_all_gather_is_bitwise_the_all_gather(case, check_vma):
  body, out_specs = CASES[case]
  m = mesh((2, 4), ("a", "b"))
  x = rand((8, 1024), jnp.float32, seed=4)
  want, hlo_ag = _run("all_gather", body, x, m, out_specs, check_vma)
  got, hlo_a2a = _run("all_to_all", body, x, m, out_specs, check_vma)
  np.testing.assert_array_equal(bits(got), bits(want))
  assert "all-gather" in hlo_ag and "all-gather" not in hlo_a2a


def test_gradient_through_all_to_all_gather():
  m = mesh((4,), ("x",))
  x = rand((4, 512), jnp.float32, seed=2)

  def loss(v):
    y = jax.shard_map(
      lambda u: jcoccl.all_gather(u, "x", compressor="int8", min_bytes=0, tiled=True),
      mesh=m,
      in_specs=P("x"),
      out_specs=P("x"),
    )(v)
    return jnp.sum(y * y)

  grads, g = {}, jax.jit(jax.grad(loss))
  for method in ("all_gather", "all_to_all"):
    with jcoccl.config(gather=method):
      grads[method] = g(x)
  np.testing.assert_array_equal(bits(grads["all_to_all"]), bits(grads["all_gather"]))


def test_gather_method_choice(monkeypatch):
  monkeypatch.delenv("JCOCCL_GATHER", raising=False)
  jcoccl.set_config_defaults(reload=True)
  assert payloads.gather_method() == "all_gather"
  monkeypatch.setenv("JCOCCL_GATHER", "all_to_all")
  assert payloads.gather_method() == "all_gather"  # read once
  try:
    assert jcoccl.set_config_defaults(reload=True).gather == "all_to_all"
    assert payloads.gather_method() == "all_to_all"
    monkeypatch.setenv("JCOCCL_GATHER", "ring")
    with pytest.raises(ValueError, match="JCOCCL_GATHER must be one of"):
      jcoccl.set_config_defaults(reload=True)
  finally:
    monkeypatch.delenv("JCOCCL_GATHER")
    jcoccl.set_config_defaults(reload=True)
