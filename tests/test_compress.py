"""jcoccl.compress: a program's lax collectives run as the jcoccl ops the policy names.

Each rewritten op equals the jcoccl op called by hand with the same arguments (bitwise) and
lax's within the compressor's documented bound; ops the policy does not name stay lax (their
equations remain in the jaxpr, their results bitwise); the rewrite composes with jit, grad,
vmap and with jit/scan/remat/cond/while inside the shard_map body; wire bytes drop by the
payload ratio; a data-parallel training step written with lax.pmean follows the hand-wired
models.parallel trainer's loss curve bitwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import F32_EPS, mesh
from jax import lax

import jcoccl
from jcoccl import compressors as jc
from jcoccl.policy import OPS, Policy

P = jax.P
C8 = jc.int8(block_size=64)
INT8_ALL = Policy.from_dict({"*": {**{op: C8 for op in OPS}, "min_bytes": 0}})
RING4 = [(i, (i + 1) % 4) for i in range(4)]


def _x(shape=(16, 256), seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _smap(body, m, in_specs, out_specs, check_vma=True):
  return jax.jit(
    jax.shard_map(body, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
  )


def _prims(f, *args) -> set:
  """Names of every primitive in f's jaxpr, sub-jaxprs included."""
  names = set()

  def walk(jaxpr):
    for e in jaxpr.eqns:
      names.add(e.primitive.name)
      for v in e.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(s, "jaxpr", s)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(f)(*args).jaxpr)
  return names


def _uniform_bound(c, x) -> float:
  """The compressor's bound for a block holding |x|'s global maximum: it bounds the error of
  every element however the op cuts x into blocks (the bound grows with a block's maximum)."""
  return float(np.max(np.asarray(c.error_bound(jnp.full((c.granule,), jnp.abs(x).max())))))


def _sum_bound(c, x, n) -> float:
  """n ranks' encode errors, plus n - 1 float32 roundings in each of decode_sum and lax's
  all-reduce of partial sums no larger than n (max|x| + bound)."""
  b = _uniform_bound(c, x)
  return n * b + 2 * (n - 1) * F32_EPS * n * (float(jnp.abs(x).max()) + b)


# One case per lax op on a ('data', 't') = (4, 2) mesh: (lax body, hand-wired jcoccl body,
# out_specs, error bound for the int8 policy).
OPS_CASES = {
  "psum": (
    lambda v: lax.psum(v, "data"),
    lambda v: jcoccl.all_reduce(v, "data", compressor=C8, min_bytes=0),
    P(None, "t"),
    lambda x: _sum_bound(C8, x, 4),
  ),
  "pmean": (
    lambda v: lax.pmean(v, "data"),
    lambda v: jcoccl.all_reduce(v, "data", compressor=C8, min_bytes=0) / 4,
    P(None, "t"),
    lambda x: _sum_bound(C8, x, 4) / 4,
  ),
  "all_gather": (
    lambda v: lax.all_gather(v, "data", axis=1, tiled=False),
    lambda v: jcoccl.all_gather(v, "data", axis=1, compressor=C8, min_bytes=0),
    P(("data", "t")),
    lambda x: _uniform_bound(C8, x),
  ),
  "all_gather_tiled": (
    lambda v: lax.all_gather(v, "t", axis=0, tiled=True),
    lambda v: jcoccl.all_gather(v, "t", axis=0, tiled=True, compressor=C8, min_bytes=0),
    P(("data", "t")),
    lambda x: _uniform_bound(C8, x),
  ),
  "psum_scatter": (
    lambda v: lax.psum_scatter(v, "data", scatter_dimension=1, tiled=True),
    lambda v: jcoccl.reduce_scatter(
      v, "data", scatter_dimension=1, tiled=True, compressor=C8, min_bytes=0
    ),
    P(None, ("data", "t")),
    lambda x: _sum_bound(C8, x, 4),
  ),
  "all_to_all": (
    lambda v: lax.all_to_all(v, "data", 1, 0, tiled=True),
    lambda v: jcoccl.all_to_all(v, "data", 1, 0, tiled=True, compressor=C8, min_bytes=0),
    P(("data", "t")),
    lambda x: _uniform_bound(C8, x),
  ),
  "ppermute": (
    lambda v: lax.ppermute(v, "data", RING4),
    lambda v: jcoccl.ppermute(v, "data", RING4, compressor=C8, min_bytes=0),
    P(("data", "t")),
    lambda x: _uniform_bound(C8, x),
  ),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("case", sorted(OPS_CASES))
def test_each_op_rewritten(case, check_vma):
  lax_body, hand_body, out_spec, bound = OPS_CASES[case]
  m = mesh((4, 2), ("data", "t"))
  x = _x()
  in_spec = P(("data", "t"))
  f = jax.shard_map(lax_body, mesh=m, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
  ref = jax.jit(f)(x)
  # Exact policy: nothing to rewrite, the program is f's, bitwise.
  exact = jax.jit(jcoccl.compress(f, Policy()))
  assert _prims(exact, x) == _prims(jax.jit(f), x)
  np.testing.assert_array_equal(exact(x), ref)
  # int8: the hand-wired jcoccl op's bits, within the compressor's bound of lax.
  got = jax.jit(jcoccl.compress(f, INT8_ALL))(x)
  hand = _smap(hand_body, m, in_spec, out_spec, check_vma)(x)
  np.testing.assert_array_equal(got, hand)
  err = float(jnp.abs(got - ref).max())
  assert 0 < err <= bound(x), (err, bound(x))


def test_ops_not_named_stay_lax():
  m = mesh((4, 2), ("data", "t"))

  def body(v):
    return (
      lax.psum(v, "data"),
      lax.all_gather(v, "t", tiled=True),
      lax.ppermute(v, "data", RING4),
      lax.psum(v, ("data", "t")),
    )

  f = _smap(body, m, P(("data", "t")), (P(None, "t"), P(("data", "t")), P(("data", "t")), P()))
  x = _x()
  g = jax.jit(jcoccl.compress(f, {"data": {"all_reduce": "int8", "min_bytes": 0}}))
  prims = _prims(g, x)
  # all_gather and ppermute are not named; psum over ('data', 't') has no compressor on 't'.
  assert {"all_gather", "ppermute", "psum_invariant"} <= prims
  ref, got = f(x), g(x)
  for i in (1, 2, 3):
    np.testing.assert_array_equal(got[i], ref[i])
  assert not np.array_equal(got[0], ref[0])  # the psum over 'data' alone is compressed
  hand = _smap(
    lambda v: jcoccl.all_reduce(v, "data", compressor="int8", min_bytes=0),
    m,
    P(("data", "t")),
    P(None, "t"),
  )(x)
  np.testing.assert_array_equal(got[0], hand)


def test_several_axes_need_one_compressor():
  m = mesh((4, 2), ("data", "t"))
  f = _smap(lambda v: lax.psum(v, ("data", "t")), m, P(("data", "t")), P())
  x = _x()
  same = {"*": {"all_reduce": C8, "min_bytes": 0}}
  got = jax.jit(jcoccl.compress(f, same))(x)
  hand = _smap(
    lambda v: jcoccl.all_reduce(v, ("data", "t"), compressor=C8, min_bytes=0),
    m,
    P(("data", "t")),
    P(),
  )(x)
  np.testing.assert_array_equal(got, hand)
  mixed = {"data": {"all_reduce": C8, "min_bytes": 0}, "t": {"all_reduce": "fp8"}}
  np.testing.assert_array_equal(jax.jit(jcoccl.compress(f, mixed))(x), f(x))


def test_integer_operands_stay_lax():
  m = mesh((8,), ("data",))
  f = _smap(
    lambda v, i: (lax.psum(v, "data"), lax.psum(i, "data")), m, (P("data"),) * 2, (P(), P())
  )
  x, i = _x((8, 128)), jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128)
  got = jax.jit(jcoccl.compress(f, INT8_ALL))(x, i)
  np.testing.assert_array_equal(got[1], f(x, i)[1])
  hand = _smap(
    lambda v: jcoccl.all_reduce(v, "data", compressor=C8, min_bytes=0), m, P("data"), P()
  )(x)
  np.testing.assert_array_equal(got[0], hand)


def _sum_sq(v, axis):
  return lax.psum(jnp.sum(v * v), axis)


def test_grad_jit_vmap():
  m = mesh((8,), ("data",))
  lax_f = jax.shard_map(
    lambda v: lax.psum(v * v, "data"), mesh=m, in_specs=P("data"), out_specs=P()
  )
  hand_f = jax.shard_map(
    lambda v: jcoccl.all_reduce(v * v, "data", compressor=C8, min_bytes=0),
    mesh=m,
    in_specs=P("data"),
    out_specs=P(),
  )
  g = jcoccl.compress(lax_f, INT8_ALL)
  x = _x((8, 256))
  loss = lambda f: lambda v: jnp.sum(jnp.sin(f(v)))
  np.testing.assert_array_equal(jax.jit(jax.grad(loss(g)))(x), jax.jit(jax.grad(loss(hand_f)))(x))
  np.testing.assert_array_equal(jax.grad(loss(g))(x), jax.jit(jax.grad(loss(hand_f)))(x))
  xs = jnp.stack([x, 2 * x, -x])
  np.testing.assert_array_equal(jax.jit(jax.vmap(g))(xs), jax.jit(jax.vmap(hand_f))(xs))
  # compress of a function that differentiates inside: the gradient's own psum is rewritten.
  inner = jax.shard_map(
    lambda v: lax.psum(jax.grad(lambda w: jnp.sum(jnp.sin(w)))(v), "data"),
    mesh=m,
    in_specs=P("data"),
    out_specs=P(),
  )
  hand_inner = jax.shard_map(
    lambda v: jcoccl.all_reduce(
      jax.grad(lambda w: jnp.sum(jnp.sin(w)))(v), "data", compressor=C8, min_bytes=0
    ),
    mesh=m,
    in_specs=P("data"),
    out_specs=P(),
  )
  np.testing.assert_array_equal(
    jax.jit(jcoccl.compress(inner, INT8_ALL))(x), jax.jit(hand_inner)(x)
  )


def _nested(allreduce, loop=True):
  """A body with the collective inside jit, scan, remat, cond and (``loop``) while_loop."""

  def body(v):
    a = jax.jit(lambda u: allreduce(u * 2.0))(v)
    c, ys = lax.scan(lambda c, u: (c + allreduce(u), allreduce(u) * 0.5), jnp.zeros_like(v[0]), v)
    r = jax.checkpoint(lambda u: jnp.sin(allreduce(jnp.cos(u))))(v)
    # The predicate is the same on every device (pmax): devices that took different
    # branches would each wait in a different collective, which XLA does not allow.
    k = lax.cond(
      lax.pmax(lax.stop_gradient(v[0, 0]), "data") > 0,
      lambda u: allreduce(u),
      lambda u: allreduce(-u),
      v,
    )
    w = (
      lax.while_loop(
        lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] + allreduce(s[1]) * 0.125), (0, v)
      )[1]
      if loop
      else v
    )
    return a + ys + r + k + w, c

  return body


@pytest.mark.parametrize("check_vma", [True, False])
def test_nested_jit_scan_remat_cond_while(check_vma):
  m = mesh((8,), ("data",))
  x = _x((8 * 4, 128))
  f = _smap(_nested(lambda u: lax.psum(u, "data")), m, P("data"), (P("data"), P("data")), check_vma)
  hand = _smap(
    _nested(lambda u: jcoccl.all_reduce(u, "data", compressor=C8, min_bytes=0)),
    m,
    P("data"),
    (P("data"), P("data")),
    check_vma,
  )
  g = jax.jit(jcoccl.compress(f, INT8_ALL))
  assert not {"psum", "psum_invariant"} & _prims(g, x)
  assert {"scan", "while", "cond", "remat2"} <= _prims(g, x)
  assert _prims(g, x) == _prims(hand, x)
  for a, b in zip(g(x), hand(x)):
    np.testing.assert_array_equal(a, b)
  # Under grad too (jit, scan, remat and cond transposes; a while_loop has none).
  specs = (P("data"), (P("data"), P("data")), check_vma)
  f = _smap(_nested(lambda u: lax.psum(u, "data"), loop=False), m, *specs)
  hand = _smap(
    _nested(lambda u: jcoccl.all_reduce(u, "data", compressor=C8, min_bytes=0), loop=False),
    m,
    *specs,
  )
  loss = lambda h: lambda v: jnp.sum(h(v)[0]) + jnp.sum(h(v)[1])
  np.testing.assert_array_equal(
    jax.jit(jax.grad(loss(jcoccl.compress(f, INT8_ALL))))(x), jax.jit(jax.grad(loss(hand)))(x)
  )


def test_wire_bytes_ratio():
  n, size = 8, 8192
  m = mesh((n,), ("data",))
  f = _smap(lambda v: lax.psum(v, "data"), m, P("data"), P())
  pol = {"data": {"all_reduce": C8, "min_bytes": 0, "algorithm": "two_shot"}}
  x = _x((n * size,))
  wb = jcoccl.wire_bytes(jax.jit(jcoccl.compress(f, pol)), x, reference=f, mesh=m)
  # two_shot sends n - 1 of its n chunk payloads twice (all_to_all, all_gather) where
  # lax's all-reduce sends 2 (n - 1) / n of the float32 buffer.
  want = n * C8.payload_nbytes(size // n, jnp.float32) / (4 * size)
  assert wb["ratio"] == pytest.approx(want, rel=1e-12), (wb["ratio"], want)
  assert wb["ratio"] < 0.27


def test_errors():
  m = mesh((8,), ("data",))
  f = _smap(lambda v: lax.psum(v, "data"), m, P("data"), P())
  with pytest.raises(TypeError, match="f must be a callable"):
    jcoccl.compress(3, INT8_ALL)
  with pytest.raises(TypeError, match="policy must be"):
    jcoccl.compress(f, 3)
  with pytest.raises(ValueError, match="policy names axis 'tensor'.*its axes: data"):
    jcoccl.compress(f, {"tensor": {"all_reduce": "int8"}})(_x((8, 16)))
  with pytest.raises(ValueError, match=r"policy\['data'\]\['all_reduce'\]"):
    jcoccl.compress(f, {"data": {"all_reduce": "int9"}})
  with pytest.raises(
    ValueError, match=r"policy: data.ppermute = hadamard\(int3:stochastic\) rounds"
  ):
    jcoccl.compress(f, {"data": {"ppermute": "hadamard(int3:stochastic)"}})


def test_policy_file(tmp_path):
  m = mesh((8,), ("data",))
  f = _smap(lambda v: lax.psum(v, "data"), m, P("data"), P())
  path = tmp_path / "p.toml"
  path.write_text('[data]\nall_reduce = "int8"\nmin_bytes = 0\n')
  x = _x((8, 512))
  hand = _smap(
    lambda v: jcoccl.all_reduce(v, "data", compressor="int8", min_bytes=0), m, P("data"), P()
  )(x)
  np.testing.assert_array_equal(jax.jit(jcoccl.compress(f, str(path)))(x), hand)
  np.testing.assert_array_equal(jax.jit(jcoccl.compress(f, path))(x), hand)


def test_inside_shard_map_body():
  m = mesh((8,), ("data",))
  body = jcoccl.compress(lambda v: lax.psum(v, "data"), INT8_ALL)
  x = _x((8, 512))
  hand = _smap(
    lambda v: jcoccl.all_reduce(v, "data", compressor=C8, min_bytes=0), m, P("data"), P()
  )(x)
  np.testing.assert_array_equal(_smap(body, m, P("data"), P())(x), hand)


def _gpt_and_batches(steps, seed=0):
  from flax import nnx

  from models import gpt

  model = gpt.GPT(
    gpt.GPTConfig(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2), rngs=nnx.Rngs(0)
  )
  tok = np.random.default_rng(seed).integers(0, 32, (steps, 8, 9))
  return model, [(jnp.asarray(t[:, :-1], jnp.int32), jnp.asarray(t[:, 1:], jnp.int32)) for t in tok]


def lax_data_parallel_step(model, data_mesh, tx):
  """A data-parallel GPT step written with plain lax collectives (lax.pmean of the loss and
  gradients), on parameters in models.parallel's stacked layout."""
  import optax
  from flax import nnx

  from models.layers import cross_entropy
  from models.parallel import unstack_params

  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model))

  def loss_fn(params, tokens, targets):
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, unstack_params(params))
    return cross_entropy(nnx.merge(graphdef, state)(tokens), targets)

  def local(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    loss, grads = lax.pmean(loss, "data"), lax.pmean(grads, "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.shard_map(
    local,
    mesh=data_mesh,
    in_specs=(P(), P(), P("data"), P("data")),
    out_specs=(P(), P(), P()),
    check_vma=False,
  )


def test_training_step_matches_hand_wired_trainer():
  import optax

  from models.parallel import Parallel3D, make_mesh, stack_params

  model, batches = _gpt_and_batches(steps=3)
  # int8 gradients over 'data'; the scalar loss (4 bytes) stays under min_bytes, exact, as
  # the trainer keeps it.
  policy = Policy.from_dict({"data": {"all_reduce": "int8", "min_bytes": 256}})
  # SGD: the update is one multiply-subtract per element in both programs. (Adam's update
  # compiles to differently fused arithmetic in the two programs and drifts by float32 ulps
  # from the second step on, with the synced gradients of step one still bitwise equal.)
  tx = optax.sgd(0.5)
  # A copy: the trainer donates its parameters, which may share the model's buffers.
  mine = jax.tree.map(jnp.copy, stack_params(model))
  par = Parallel3D(model, make_mesh(8, 1, 1), policy)
  params = par.placement.shard(model)
  hand, opt = par.train_step(tx, params, clip_norm=None), par.init_opt(tx, params)
  step = jax.jit(jcoccl.compress(lax_data_parallel_step(model, mesh((8,), ("data",)), tx), policy))
  my_opt = tx.init(mine)
  for x, y in batches:
    params, opt, _, metrics = hand(params, opt, None, x, y)
    mine, my_opt, loss = step(mine, my_opt, x, y)
    # Same compressed ops (jcoccl.all_reduce, int8, the same bits per leaf) on the same gradients:
    # the same loss curve and parameters, bit for bit. Without the rewrite the exact lax
    # sum would part from the trainer's int8 sum at the first update.
    assert float(loss) == float(metrics["loss"])
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b)


def test_training_switches_refused_and_keyword_arguments(tmp_path):
  m = mesh((8,), ("data",))
  sm = _smap(lambda v, w: lax.psum(v * w, "data"), m, (P("data"), P("data")), P())
  f = lambda v, *, w: sm(v, w)
  pol = {"data": {"all_reduce": C8, "min_bytes": 0}}
  # models/' training switches are no jcoccl.Policy settings: refused from a mapping and a
  # file alike, with a pointer to models.recipe.
  with pytest.raises(
    ValueError,
    match=r"\['error_feedback'\]: error_feedback is a training "
    r"option of models/ \(models.recipe.Recipe",
  ):
    jcoccl.compress(f, {"data": {**pol["data"], "error_feedback": True}})
  toml = tmp_path / "p.toml"
  toml.write_text('[data]\nall_reduce = "int8"\nzero = true\n')
  with pytest.raises(ValueError, match=r"p.toml: \[data\] zero: zero is a training option"):
    jcoccl.compress(f, toml)
  g = jcoccl.compress(f, pol)
  x = _x((8, 512))
  hand = _smap(
    lambda v, w: jcoccl.all_reduce(v * w, "data", compressor=C8, min_bytes=0),
    m,
    (P("data"), P("data")),
    P(),
  )(x, 2 * x)
  np.testing.assert_array_equal(jax.jit(g)(x, w=2 * x), hand)


def test_custom_derivative_functions_stay_lax():
  m = mesh((8,), ("data",))

  @jax.custom_vjp
  def summed(v):
    return lax.psum(v, "data")

  summed.defvjp(lambda v: (summed(v), None), lambda _, g: (g,))
  f = _smap(lambda v: (summed(v), lax.psum(v, "data")), m, P("data"), (P(), P()), check_vma=False)
  x = _x((8, 512))
  got, ref = jax.jit(jcoccl.compress(f, INT8_ALL))(x), f(x)
  np.testing.assert_array_equal(got[0], ref[0])  # inside custom_vjp: lax, bitwise
  assert not np.array_equal(got[1], ref[1])  # outside: compressed
