"""AD, vmap, scan, check_vma=False and error feedback for the compressed collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import LOSSY, P, bits, eb, f64, mesh, rand
from jax import lax
from jax.test_util import check_grads

import jcoccl

M = None


def _m():
  global M
  if M is None:
    M = mesh((2, 4), ("a", "b"))
  return M


def _loss(body, check_vma=True):
  def loss(x):
    out = jax.shard_map(
      body, mesh=_m(), in_specs=P(("a", "b")), out_specs=P(("a", "b")), check_vma=check_vma
    )(x)
    return jnp.sum(jnp.sin(out))

  return loss


PERM = [(0, 1), (1, 2), (2, 3), (3, 0)]
OPS = {
  "all_reduce": (lambda v, **k: jcoccl.all_reduce(v, "b", **k) * v, lambda v: lax.psum(v, "b") * v),
  "all_gather": (
    lambda v, **k: jcoccl.all_gather(v, "b", axis=1, tiled=True, **k),
    lambda v: lax.all_gather(v, "b", axis=1, tiled=True),
  ),
  "reduce_scatter": (
    lambda v, **k: jcoccl.reduce_scatter(v, "b", scatter_dimension=1, tiled=True, **k),
    lambda v: lax.psum_scatter(v, "b", scatter_dimension=1, tiled=True),
  ),
  "all_to_all": (
    lambda v, **k: jcoccl.all_to_all(v, "b", 1, 0, tiled=True, **k),
    lambda v: lax.all_to_all(v, "b", 1, 0, tiled=True),
  ),
  "ppermute": (
    lambda v, **k: jcoccl.ppermute(v, "b", PERM, **k),
    lambda v: lax.ppermute(v, "b", PERM),
  ),
}


@pytest.mark.parametrize("op", list(OPS))
def test_exact_grads_match_lax(op):
  j, l = OPS[op]
  x = rand((8, 8, 64), jnp.float32, seed=1)
  g1 = jax.jit(jax.grad(_loss(lambda v: j(v, compressor=None))))(x)
  g2 = jax.jit(jax.grad(_loss(l)))(x)
  np.testing.assert_array_equal(bits(g1), bits(g2))
  check_grads(
    _loss(lambda v: j(v, compressor="none")), (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2
  )


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("check_vma", [True, False])
def test_compressed_grads_close_to_lax(op, check_vma):
  j, l = OPS[op]
  x = rand((8, 8, 64), jnp.float32, seed=2)
  c = LOSSY["bf16"]
  g1 = jax.jit(jax.grad(_loss(lambda v: j(v, compressor=c, min_bytes=0), check_vma)))(x)
  g2 = jax.jit(jax.grad(_loss(l, check_vma)))(x)
  gx = jax.jit(
    jax.grad(_loss(lambda v: j(v, compressor=c, grad_compressor=None, min_bytes=0), check_vma))
  )(x)
  # bf16 forward (and backward) perturb each value by <= 2^-8 relative; through sin and the
  # sums of at most 4 ranks that stays within a few 2^-8 of the gradient magnitudes.
  scale = 4 * np.abs(f64(x)).max() + 4
  assert np.abs(f64(g1) - f64(g2)).max() <= 8 * 2.0**-8 * scale
  assert np.abs(f64(gx) - f64(g2)).max() <= 8 * 2.0**-8 * scale
  assert not np.array_equal(bits(g1), bits(g2)) or op == "all_reduce"


def test_all_gather_grad_uses_compressed_reduce_scatter():
  c = LOSSY["int8"]
  x = rand((8, 8, 64), jnp.float32, seed=3)
  j = OPS["all_gather"][0]
  fn = jax.jit(jax.grad(_loss(lambda v: j(v, compressor=c, min_bytes=0))))
  hlo = fn.lower(x).compile().as_text()
  assert "all-to-all" in hlo and "reduce-scatter" not in hlo
  fn_exact = jax.jit(
    jax.grad(_loss(lambda v: j(v, compressor=c, grad_compressor=None, min_bytes=0)))
  )
  assert "reduce-scatter" in fn_exact.lower(x).compile().as_text()


def test_vmap_and_scan():
  c = LOSSY["int8"]
  m = _m()
  x = rand((8, 3, 128), jnp.float32, seed=4)

  def body(v):  # v: [1, 3, 128]
    per = jax.vmap(lambda r: jcoccl.all_reduce(r, "b", compressor=c, min_bytes=0))(v[0])

    def step(carry, r):
      return carry + jcoccl.all_reduce(r, "b", compressor=c, min_bytes=0), None

    acc, _ = lax.scan(step, jnp.zeros_like(v[0, 0]), v[0])
    return per[None], acc[None]

  f = jax.jit(
    jax.shard_map(body, mesh=m, in_specs=P(("a", "b")), out_specs=(P(("a", "b")), P(("a", "b"))))
  )
  per, acc = f(x)
  direct = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_reduce(v, "b", compressor=c, min_bytes=0),
      mesh=m,
      in_specs=P(("a", "b")),
      out_specs=P(("a", "b")),
    )
  )
  rows = [direct(x[:, i : i + 1])[:, 0] for i in range(3)]
  for i in range(3):
    np.testing.assert_array_equal(bits(per[:, i]), bits(rows[i]))
  np.testing.assert_allclose(f64(acc), f64(sum(rows)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["all_reduce", "reduce_scatter"])
def test_error_feedback_tracks_exact_sum(which):
  c = LOSSY["int4a"]
  m = mesh((4,), ("x",))
  steps = 24
  xs = rand((steps, 4, 512), jnp.float32, seed=5) + 0.3
  ef = jcoccl.error_feedback(c)

  def body(seq):  # seq: [steps, 1, 512] local
    seq = seq[:, 0]
    state = ef.init(seq[0])
    if which == "all_reduce":
      plain = lambda g: jcoccl.all_reduce(g, "x", compressor=c, algorithm="one_shot", min_bytes=0)
      fed = lambda g, s: ef.all_reduce(g, s, "x", algorithm="one_shot", min_bytes=0)
    else:
      plain = lambda g: jcoccl.reduce_scatter(g, "x", tiled=True, compressor=c, min_bytes=0)
      fed = lambda g, s: ef.reduce_scatter(g, s, "x", tiled=True, min_bytes=0)

    def step(carry, g):
      acc_p, acc_f, s = carry
      out_f, s = fed(g, s)
      return (acc_p + plain(g), acc_f + out_f, s), None

    z = plain(seq[0]) * 0
    (acc_p, acc_f, _), _ = lax.scan(step, (z, z, state), seq)
    return acc_p[None], acc_f[None]

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(None, "x"), out_specs=(P("x"), P("x"))))
  acc_p, acc_f = f(xs)
  exact = f64(xs).sum(axis=(0, 1))  # [512]
  if which == "reduce_scatter":
    exact = exact.reshape(4, 128)
  else:
    exact = np.broadcast_to(exact, (4, 512))
  acc_p, acc_f = f64(acc_p).reshape(exact.shape), f64(acc_f).reshape(exact.shape)
  err_plain = np.abs(acc_p - exact).mean()
  err_fed = np.abs(acc_f - exact).mean()
  assert err_fed < 0.35 * err_plain, (err_fed, err_plain)
  # With feedback the accumulated error stays within one step's bound (the residuals).
  one_step = sum(eb(c, xs[-1, r]).mean() for r in range(4))
  assert err_fed <= 2 * one_step


@pytest.mark.parametrize("which", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_feedback_recovers_after_a_nonfinite_step(which, bad):
  """One rank's NaN/Inf gradient makes that step's output non-finite (as the exact op's is)
  but leaves no non-finite residual: the next finite steps give finite results, and a
  residual restored non-finite (a poisoned checkpoint) is dropped as well."""
  c = LOSSY["int8"]
  m = mesh((4,), ("x",))
  ef = jcoccl.error_feedback(c)
  xs = rand((3, 4, 512), jnp.float32, seed=6)
  xs = xs.at[0, 2, 77].set(bad)

  def body(seq, state):
    outs = []
    s = state[0]
    for t in range(seq.shape[0]):
      g = seq[t, 0]
      if which == "all_reduce":
        out, s = ef.all_reduce(g, s, "x", algorithm="two_shot", min_bytes=0)
      else:
        out, s = ef.reduce_scatter(g, s, "x", tiled=True, min_bytes=0)
      outs.append(out)
    return jnp.stack(outs)[None], s[None]

  f = jax.jit(
    jax.shard_map(body, mesh=m, in_specs=(P(None, "x"), P("x")), out_specs=(P("x"), P("x")))
  )
  outs, state = f(xs, jnp.zeros((4, 512), jnp.float32))
  outs = np.asarray(outs)
  assert not np.isfinite(outs[:, 0]).all()  # the bad step is visible, as with lax
  assert np.isfinite(outs[:, 1:]).all() and np.isfinite(np.asarray(state)).all()
  poisoned = jnp.zeros((4, 512), jnp.float32).at[1, 5].set(np.nan)
  outs, state = f(xs[1:], poisoned)
  assert np.isfinite(np.asarray(outs)).all() and np.isfinite(np.asarray(state)).all()


def test_stochastic_codec_under_grad_and_jvp_uses_the_calls_key():
  """The derivative's collective rounds with the call's key folded (rules.derivative_key):
  jax.grad and jax.jvp work with the one key the caller passed, repeat for that key and
  differ for another."""
  x = rand((8, 8, 64), jnp.float32, seed=4)
  j, l = OPS["all_gather"]
  specs = (P(("a", "b")), P())
  f = jax.shard_map(
    lambda v, k: j(v, compressor="int8:stochastic", min_bytes=0, key=k),
    mesh=_m(),
    in_specs=specs,
    out_specs=P(("a", "b")),
  )
  grad = jax.jit(jax.grad(lambda v, k: jnp.sum(jnp.sin(f(v, k)))))
  g0, g0b, g1 = (f64(grad(x, jax.random.key(s))) for s in (0, 0, 1))
  exact = f64(jax.jit(jax.grad(_loss(l)))(x))
  assert np.array_equal(g0, g0b) and not np.array_equal(g0, g1)
  # int8 stochastic moves a value by less than one step (its block's max / 127): the
  # forward's gathered x by <= max|x| / 127, so each cos(out) by as much, and each of the
  # 4 ranks' cotangents (|cos| <= 1) by <= 1 / 127 more in the backward reduce_scatter.
  bound = 4 * (np.abs(f64(x)).max() + 1) / 127
  assert np.abs(g0 - exact).max() <= bound
  jvp = jax.jit(lambda v, k: jax.jvp(lambda u: f(u, k), (v,), (jnp.ones_like(v),))[1])
  assert np.abs(f64(jvp(x, jax.random.key(0))) - 1).max() <= 1 / 127
