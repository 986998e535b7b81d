"""Stochastic rounding at every compressed point of the trainer (models.collectives' keys).

Every call that rounds stochastically draws a key of (seed, step, point, call, device): the
same step repeats bitwise, another step or seed rounds otherwise; a point's traffic is
unbiased over many keys and within its codec's bound. (A run with a stochastic direction
trains and resumes bitwise: tests/test_train.py's resume tests. The codecs themselves:
tests/test_compressors.py test_stochastic_rounding and the conformance check of
tests/test_custom_codec_check.py.)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jcoccl import compressors as jc
from jcoccl._src.compressors import native
from jcoccl.policy import Policy
from models.collectives import Collectives, TensorComm, step_key
from models.parallel import make_mesh
from models.recipe import Recipe

SR = "int4:block=32,stochastic"
# Every point of the step rounds stochastically.
POLICY = Policy.from_dict(
  {
    "tensor": {"all_reduce": SR, "min_bytes": 0},
    "pipe": {"ppermute": SR, "min_bytes": 0},
    "data": {"all_reduce": SR, "min_bytes": 0},
  }
)


def _points_program(coll, mesh):
  """grad of a loss through every point (tensor f/g, a pipe ppermute) and the data sum of
  the gradient, with the keys of ``step_key(seed, "train", step)`` (passed as its data) and
  the device's coordinates, as Parallel3D keys its step; every device's result."""

  def local(x, data):
    coords = {a: jax.lax.axis_index(a) for a in mesh.axis_names}
    with coll.keyed(jax.random.wrap_key_data(data), coords):
      comm = TensorComm(coll)

      def loss(v):
        h = comm.exit(comm.enter(v) * 1.5)
        h = coll.ppermute(h, "pipe", [(0, 1), (1, 0)])
        return jnp.sum(h * h)

      g = jax.grad(loss)(x[0, 0, 0])
      return coll.all_reduce(g, "data")[None, None, None]

  every = P("data", "tensor", "pipe")
  f = jax.shard_map(local, mesh=mesh, in_specs=(every, P()), out_specs=every, check_vma=False)
  return jax.jit(f)


def test_every_point_draws_keys_of_seed_and_step():
  """Each device's batch rows differ (x per data rank), its activations are replicated over
  'tensor': the data sum must come out bitwise the same on every 'tensor' and 'data' rank
  (ranks holding one value round it alike), as the parameters of a step must."""
  coll = Collectives(POLICY)
  drawn = []
  key = coll.key
  coll.key = lambda point, codec: drawn.append(point) or key(point, codec)  # which points drew
  run = _points_program(coll, make_mesh(2, 2, 2))
  rows = np.random.default_rng(0).standard_normal((2, 64))
  x = jnp.asarray(np.broadcast_to(rows[:, None, None], (2, 2, 2, 64)), jnp.float32)
  a, b, c, d = (
    np.asarray(run(x, jax.random.key_data(step_key(seed, "train", step))))
    for seed, step in ((5, 3), (5, 3), (5, 4), (6, 3))
  )
  np.testing.assert_array_equal(a, b)
  assert (a != c).mean() > 0.5 and (a != d).mean() > 0.5
  for stage in range(2):
    for out in a[:, :, stage].reshape(4, 64):
      np.testing.assert_array_equal(out, a[0, 0, stage])
  assert sorted(set(drawn)) == sorted(
    ["tensor.forward", "tensor.backward", "pipe.forward", "pipe.backward", "data.all_reduce"]
  )
  # A call outside a key stream cannot round stochastically: said, not a compile error.
  with pytest.raises(ValueError, match="tensor.forward = .* rounds stochastically"):
    Collectives(Policy.from_dict({"tensor": {"all_reduce": SR}})).draw(
      "tensor.forward", "tensor", "all_reduce"
    )


def test_a_point_is_unbiased_and_within_its_bound_over_many_keys():
  """pipe.forward's ppermute (one encode, one decode) of a fixed input over K keys: every
  draw within the codec's bound, the mean within 5 standard errors of the input (the
  rounding error of one element is at most the step s and its standard deviation at most
  s/2, so the mean's is at most s/(2 sqrt(K)); the bound is s plus float32 roundings)."""
  k = 256
  codec = jc.parse(SR)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("pipe",))
  coll = Collectives(Policy.from_dict({"pipe": {"ppermute": SR, "min_bytes": 0}}))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 96)), jnp.float32)

  def local(v, keys):
    def one(key):
      with coll.keyed(jax.random.fold_in(key, jax.lax.axis_index("pipe"))):
        return coll.ppermute(v[0], "pipe", [(0, 1), (1, 0)])

    return jax.lax.map(one, keys)[None]

  f = jax.shard_map(local, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P("pipe"))
  draws = np.asarray(jax.jit(f)(x, jax.random.split(jax.random.key(0), k)), np.float64)
  sent = np.asarray(x[::-1], np.float64)  # rank r receives rank 1 - r's row
  bound = np.stack([np.asarray(codec.error_bound(x[1])), np.asarray(codec.error_bound(x[0]))])
  err = np.abs(draws - sent[:, None, :])
  assert (err <= bound[:, None, :]).all()
  assert len({d.tobytes() for d in draws[0]}) == k  # every key rounds otherwise
  mean_err = np.abs(draws.mean(1) - sent)
  assert (mean_err <= 5 * bound / (2 * math.sqrt(k)) + 1e-7).all()


def test_a_policy_entry_may_round_stochastically():
  """The policy's entries take stochastic codecs, as ``[directions]`` and ``--direction``
  do; a malformed one is still an error at load."""
  r = Recipe.from_dict({"data": {"all_reduce": "hadamard(int4:stochastic)"}})
  assert r.policy.compressor("data", "all_reduce").stochastic
  assert Recipe.from_specs(["tensor.all_reduce=int8:stochastic"]).policy
  with pytest.raises(ValueError, match="stochastic"):
    Recipe.from_specs(["tensor.all_reduce=fp8:stochastic"])


@pytest.mark.parametrize("spec", ["int4:stochastic", "hadamard(int4:block=128,stochastic)"])
def test_native_matches_jnp_bitwise_for_the_trainers_stochastic_codecs(spec):
  """The codecs the trainer's stochastic points use, where a native decode kernel exists
  (a GPU; the encode of a stochastic codec always runs jnp): auto's encode and the native
  decode are bitwise jnp's."""
  c = jc.parse(spec)
  if not native.available(c, "decode", jnp.dtype(jnp.float32)):
    pytest.skip(f"no native decode of {spec} on {jax.default_backend()}")
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 512)), jnp.float32)
  key = jax.random.key(3)
  buf = c.encode_rows(x, key=key, impl="jnp")
  np.testing.assert_array_equal(np.asarray(c.encode_rows(x, key=key)), np.asarray(buf))
  got = c.decode_rows(buf, 512, jnp.float32, impl="native")
  want = c.decode_rows(buf, 512, jnp.float32, impl="jnp")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
