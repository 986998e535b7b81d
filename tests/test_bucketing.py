"""Leaf bucketing: the compressed leaves of one pytree call that share a wire format (codec,
algorithm, dtype, group, backend, slices) are packed into one row layout and travel as ONE
encode -> collective -> decode chain, bitwise equal per leaf to the leaf's call alone."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import P, bits, host_rand, mesh

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.compressors import layout
from jcoccl._src.engine import fused_comms
from jcoccl._src.native import _ffi
from jcoccl._src.ops import lowering, primitives

N = 4  # ranks of axis "d"
CODECS = {
  "int8": jc.int8(block_size=32),
  "int4": jc.int4(block_size=32, symmetric=False),
  "fp8": jc.fp8("e4m3", block_size=32),
  "hadamard": jc.hadamard(jc.int4(block_size=64)),
  "spike": jc.spike(jc.int4(block_size=32), k=2),
}
# Odd sizes (none a multiple of a block, one under a block), three dtypes: three groups.
SHAPES = ((N, 1), (N, 7, 5), (N, 130), (N, 3, 33), (N, 2, 50), (N, 97))
DTYPES = (jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32, jnp.float16, jnp.bfloat16)
GROUPS = len(set(DTYPES))
# op -> the call on a list of leaves (each [1, *rest] per rank; scatter/split on axis 1 of
# leaves whose second dimension is a multiple of N).
OPS = {
  "all_reduce": lambda v, **k: jcoccl.all_reduce(v, "d", algorithm="two_shot", **k),
  "reduce_scatter": lambda v, **k: jcoccl.reduce_scatter(
    v, "d", scatter_dimension=1, tiled=True, **k
  ),
  "all_gather": lambda v, **k: jcoccl.all_gather(v, "d", axis=1, tiled=True, **k),
  "all_to_all": lambda v, **k: jcoccl.all_to_all(v, "d", 1, 1, tiled=True, **k),
  "ppermute": lambda v, **k: jcoccl.ppermute(v, "d", [(i, (i + 1) % N) for i in range(N)], **k),
}
_M = {}


def _mesh():
  if "m" not in _M:
    _M["m"] = mesh((N,), ("d",))
  return _M["m"]


def _leaves(shapes=SHAPES, dtypes=DTYPES, seed=0):
  return [
    host_rand(s, d, seed=seed + i, scale=1 + i) for i, (s, d) in enumerate(zip(shapes, dtypes))
  ]


def _smap(body, n, check_vma=True):
  spec = P("d")
  return jax.shard_map(
    body, mesh=_mesh(), in_specs=(spec,) * n, out_specs=spec, check_vma=check_vma
  )


def _both(name, n, **kw):
  """(leaves) -> (the op on the list of leaves, the op on each leaf alone), in one program:
  each lone call is its own equation, so its own chain."""

  def body(*v):
    op = lambda t: OPS[name](t, **kw)
    lone = [op([x])[0] for x in v]
    return tuple(op(list(v))) + tuple(lone)

  return _smap(body, n)


def _assert_bitwise(got, n):
  for i in range(n):
    np.testing.assert_array_equal(bits(got[i]), bits(got[n + i]), err_msg=f"leaf {i}")


def _chains(f, *args, op="all_to_all"):
  """Collectives of one kind in the lowered program (StableHLO)."""
  return len(re.findall(rf"stablehlo\.{op}\b", jax.jit(f).lower(*args).as_text()))


@pytest.mark.parametrize("codec", list(CODECS))
def test_all_reduce_packed_bitwise_per_leaf(codec):
  xs = _leaves()
  got = jax.jit(_both("all_reduce", len(xs), compressor=CODECS[codec], min_bytes=0))(*xs)
  _assert_bitwise(got, len(xs))


@pytest.mark.parametrize("name", ["reduce_scatter", "all_gather", "all_to_all", "ppermute"])
def test_other_ops_packed_bitwise_per_leaf(name):
  """reduce_scatter and all_to_all pack per destination rank: each leaf's block j still
  lands on rank j."""
  shapes = ((N, 2 * N, 3), (N, N), (N, 3 * N, 11), (N, N, 2, 5))
  dtypes = (jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16)
  xs = _leaves(shapes, dtypes, seed=10)
  got = jax.jit(_both(name, len(xs), compressor=CODECS["int8"], min_bytes=0))(*xs)
  _assert_bitwise(got, len(xs))


def test_one_chain_per_group_in_the_lowered_program():
  """Six leaves in three dtypes: three all_to_all (two_shot's scatter) and three
  all_gather ops, where the leaves alone lower to six of each."""
  xs = _leaves()
  kw = dict(compressor=CODECS["int8"], min_bytes=0)
  tree = _smap(lambda *v: tuple(OPS["all_reduce"](list(v), **kw)), len(xs))
  alone = _smap(lambda *v: tuple(OPS["all_reduce"]([x], **kw)[0] for x in v), len(xs))
  for op in ("all_to_all", "all_gather"):
    assert _chains(tree, *xs, op=op) == GROUPS, op
    assert _chains(alone, *xs, op=op) == len(xs), op
  # Two algorithms in one call: one chain per (algorithm, dtype).
  one = jnp.float32
  xs2 = _leaves(((N, 40), (N, 41), (N, 42)), (one, one, one))
  two = lambda v: [
    jcoccl.all_reduce(v[:2], "d", algorithm="one_shot", **kw),
    jcoccl.all_reduce(v[2:], "d", algorithm="two_shot", **kw),
  ]
  f = _smap(lambda *v: tuple(a for part in two(list(v)) for a in part), 3)
  assert _chains(f, *xs2, op="all_to_all") == 1  # two_shot's
  assert _chains(f, *xs2, op="all_gather") == 2  # one_shot's and two_shot's


def test_reduce_scatter_one_chain_per_group():
  xs = _leaves(((N, N, 3), (N, 2 * N), (N, N, 9)), (jnp.float32,) * 3, seed=3)
  kw = dict(compressor=CODECS["int4"], min_bytes=0)
  f = _smap(lambda *v: tuple(OPS["reduce_scatter"](list(v), **kw)), 3)
  assert _chains(f, *xs) == 1


def test_grad_and_vmap_packed_bitwise_per_leaf():
  """The transpose (a compressed all_reduce without check_vma) and a vmapped call pack
  too, bitwise per leaf."""
  xs = _leaves(SHAPES[:4], DTYPES[:4], seed=20)
  kw = dict(compressor=CODECS["fp8"], min_bytes=0)
  f = lambda v: OPS["all_reduce"](v, **kw)
  loss = lambda v: sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in f(v))

  def body(*v):
    g = jax.grad(loss)(list(v))
    alone = [jax.grad(lambda u: loss([u]))(x) for x in v]
    return tuple(g) + tuple(alone)

  got = jax.jit(_smap(body, len(xs), check_vma=False))(*xs)
  _assert_bitwise(got, len(xs))

  def vbody(a, b):
    vm = jax.vmap(lambda p, q: tuple(f([p, q])), in_axes=(1, None), out_axes=(1, None))
    ya, yb = vm(a, b)
    za = jax.vmap(lambda p: f([p])[0], in_axes=1, out_axes=1)(a)
    return ya, yb, za, f([b])[0]

  a, b = host_rand((N, 3, 45), jnp.float32, seed=30), host_rand((N, 70), jnp.float32, seed=31)
  spec = P("d")
  sm = jax.shard_map(vbody, mesh=_mesh(), in_specs=(spec, spec), out_specs=spec)
  got = jax.jit(sm)(a, b)
  np.testing.assert_array_equal(bits(got[0]), bits(got[2]))
  np.testing.assert_array_equal(bits(got[1]), bits(got[3]))


def test_keyed_and_custom_codec_leaves_go_alone():
  """A PRNG key (random bits drawn by position in each leaf's own row) keeps one chain per
  leaf; so does a codec outside jcoccl's block-wise kinds (it may read a whole row)."""
  xs = _leaves(((N, 40), (N, 41)), (jnp.float32, jnp.float32))
  sr = jc.int8(block_size=32, rounding="stochastic")
  key = jax.random.key(0)
  call = lambda v, **k: tuple(jcoccl.all_reduce(list(v), "d", algorithm="one_shot", **k))
  f = _smap(lambda *v: call(v, compressor=sr, min_bytes=0, key=key), 2)
  assert _chains(f, *xs, op="all_gather") == 2
  g = _smap(lambda *v: call(v, compressor=CODECS["int8"], min_bytes=0), 2)
  assert _chains(g, *xs, op="all_gather") == 1  # without a key, packed

  class RowWide(jc.Compressor):  # a user's codec: its blocks are not known to be local
    granule = 1

  assert primitives.blockwise(CODECS["spike"]) and primitives.blockwise(jc.cast("bfloat16"))
  assert not primitives.blockwise(RowWide())
  assert not primitives.blockwise((CODECS["int8"], RowWide()))


def test_each_leaf_of_a_keyed_call_rounds_with_its_own_stream():
  """Leaf i of several rounds with fold_in(key, i): two equal leaves under one key round
  independently, each as a call of its own with that key would."""
  x = _leaves(((N, 64),), (jnp.float32,))[0]
  sr = jc.int8(block_size=32, rounding="stochastic")
  key = jax.random.key(3)
  kw = dict(compressor=sr, min_bytes=0, algorithm="one_shot")

  def body(v):
    a, b = jcoccl.all_reduce([v, v], "d", key=key, **kw)
    alone = [jcoccl.all_reduce(v, "d", key=jax.random.fold_in(key, i), **kw) for i in (0, 1)]
    return a, b, *alone

  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=(P("d"),) * 4))
  a, b, a1, b1 = (np.asarray(y) for y in f(x))
  assert not np.array_equal(a, b)
  assert np.array_equal(a, a1) and np.array_equal(b, b1)


def test_large_leaves_go_alone(monkeypatch):
  """A leaf of PACK_MAX_BYTES or more gets a chain of its own (packing would copy it in and
  out, more than the chain costs); the smaller ones still share one; bits as alone."""
  monkeypatch.setattr(lowering, "PACK_MAX_BYTES", 4 * 100)
  xs = _leaves(((N, 40), (N, 100), (N, 3, 7)), (jnp.float32,) * 3, seed=60)
  kw = dict(compressor=CODECS["int8"], min_bytes=0)
  f = _smap(lambda *v: tuple(OPS["all_reduce"](list(v), **kw)), 3)
  assert _chains(f, *xs) == 2
  got = jax.jit(_both("all_reduce", 3, **kw))(*xs)
  _assert_bitwise(got, 3)


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
def test_chains_of_short_leaves_send_short_blocks(algorithm, monkeypatch):
  """A chain whose leaves are all shorter than the codec's block (int8's 256, fp8's 128)
  sends blocks cut to its longest leaf (lowering.fitted): bitwise the result of the same
  values zero-padded to a whole block, NaN included, in fewer bytes, in as many chains. A
  chain that also holds a long leaf stays one chain (no collective is added)."""
  shapes = ((N, 50), (N, 64), (N, 100), (N, 700))
  dtypes = (jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32)
  xs = _leaves(shapes, dtypes, seed=70)
  xs[0][1, 7] = np.nan
  op = "all_to_all" if algorithm == "two_shot" else "all_gather"
  for codec in (jc.int8(), jc.fp8()):
    ar = lambda v: jcoccl.all_reduce(v, "d", compressor=codec, min_bytes=0, algorithm=algorithm)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, codec.granule - x.shape[1])))
    short = _smap(lambda *v: tuple(ar(list(v))), 3)
    padded = _smap(lambda *v: tuple(ar([pad(x)])[0] for x in v), 3)
    got, want = jax.jit(short)(*xs[:3]), jax.jit(padded)(*xs[:3])
    for i, (g, w) in enumerate(zip(got, want)):
      np.testing.assert_array_equal(bits(g), bits(w[:, : g.shape[1]]), err_msg=f"leaf {i}")
    assert np.isnan(np.asarray(got[0])[:, 7]).all()
    sent = lambda f: jcoccl.wire_bytes(jax.jit(f), *xs[:3], mesh=_mesh())["by_axis"]["d"]
    fitted = sent(short)
    with monkeypatch.context() as m:
      m.setattr(lowering, "fitted", lambda o, xs, key, lps: (lps, {}))
      assert fitted < sent(_smap(lambda *v: tuple(ar(list(v))), 3))  # a new trace
    assert _chains(short, *xs[:3], op=op) == 2  # one per dtype, as unfitted
    mixed = _smap(lambda *v: tuple(ar(list(v))), 2)  # 50 and 700 values: one chain
    got = jax.jit(mixed)(xs[0], xs[3])
    want = jax.jit(padded)(xs[0], xs[1], xs[2])[0]
    np.testing.assert_array_equal(bits(got[0]), bits(want[:, :50]))
    assert _chains(mixed, xs[0], xs[3], op=op) == 1


JOINT = {
  **OPS,
  "all_reduce one_shot": lambda v, **k: jcoccl.all_reduce(v, "d", algorithm="one_shot", **k),
}
COLLECTIVE = {
  "all_reduce": "all_to_all",
  "reduce_scatter": "all_to_all",
  "ppermute": "collective_permute",
}


@pytest.mark.parametrize(
  "name,codec",
  [(name, "int8") for name in JOINT] + [("all_reduce", "fp8"), ("all_reduce one_shot", "fp8")],
)
def test_short_leaves_beside_long_ones_send_short_blocks_in_the_same_chain(
  name, codec, monkeypatch
):
  """In a chain that also holds long rows, the xla backend sends the short rows (a
  LayerNorm vector's) in fitted blocks of their own, their payload beside the long rows' in
  the same collective (lowering.fitted, rows.run_joint): every leaf bitwise as the unfitted
  chain, NaN included, the residuals too, in fewer bytes and as many collectives."""
  shapes = ((N, N, 16), (N, N, 300), (N, N, 12), (N, N, 3, 100), (N, N, 16), (N, N, 500))
  xs = _leaves(shapes, (jnp.float32,) * 4 + (jnp.bfloat16,) * 2, seed=90)
  xs[2][1, 0, 7] = np.nan
  kw = dict(compressor=jc.int8() if codec == "int8" else jc.fp8(), min_bytes=0)
  op = COLLECTIVE.get(name, "all_gather" if "one_shot" in name else name)
  fresh = lambda: _smap(lambda *v: tuple(JOINT[name](list(v), **kw)), len(xs))  # a new trace
  es = [jnp.asarray(host_rand(x.shape, jnp.float32, seed=9 + i)) for i, x in enumerate(xs)]

  def ef(*v):
    ys, rs = JOINT[name](list(v[: len(xs)]), residual=list(v[len(xs) :]), **kw)
    return tuple(ys) + tuple(rs)

  with_ef = name.startswith("all_reduce") or name == "reduce_scatter"
  ef_map = lambda: jax.shard_map(ef, mesh=_mesh(), in_specs=(P("d"),) * 12, out_specs=P("d"))
  run = lambda: jax.jit(fresh())(*xs) + (jax.jit(ef_map())(*xs, *es) if with_ef else ())
  sent = lambda: jcoccl.wire_bytes(jax.jit(fresh()), *xs, mesh=_mesh())["by_axis"]["d"]
  got, fitted, chains = run(), sent(), _chains(fresh(), *xs, op=op)
  monkeypatch.setattr(lowering, "fitted", lambda o, xs, key, lps: (lps, {}))
  assert fitted < sent()  # int8 reduce_scatter: 5,004 B against 7,020 B
  assert chains == _chains(fresh(), *xs, op=op) == 2  # one per dtype
  for i, (g, w) in enumerate(zip(got, run())):
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"output {i}")
  assert np.isnan(np.asarray(got[2])).any()


@pytest.mark.parametrize("name", ["reduce_scatter", "all_gather", "all_to_all", "ppermute"])
def test_other_ops_fitted_bitwise_as_unfitted(name, monkeypatch):
  """The other ops' chains of short leaves (rows of 1..24 values under int8's 256) send
  fitted blocks, with the bits of the unfitted lowering, in under a fifth of its bytes."""
  shapes = ((N, 2 * N, 3), (N, N), (N, 3 * N, 1))
  xs = _leaves(shapes, (jnp.float32, jnp.float32, jnp.bfloat16), seed=80)
  kw = dict(compressor=jc.int8(), min_bytes=0)
  fresh = lambda: jax.jit(_smap(lambda *v: tuple(OPS[name](list(v), **kw)), 3))  # a new trace
  sent = lambda: jcoccl.wire_bytes(fresh(), *xs, mesh=_mesh())["by_axis"]["d"]
  got, fitted = fresh()(*xs), sent()
  monkeypatch.setattr(lowering, "fitted", lambda o, xs, key, lps: (lps, {}))
  for i, (g, w) in enumerate(zip(got, fresh()(*xs))):
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"leaf {i}")
  assert fitted < sent() / 5  # 32-value blocks instead of 256


@pytest.mark.skipif(_ffi.native_module("cpu") is None, reason="jcoccl._cpu is not built")
def test_fused_backend_one_call_per_group():
  fused_comms.shutdown()
  jcoccl.init(_mesh())
  try:
    xs = _leaves(((N, 40), (N, 3, 7), (N, 65)), (jnp.float32,) * 3, seed=40)
    kw = dict(compressor=CODECS["int8"], min_bytes=0, backend="fused")
    got = jax.jit(_both("all_reduce", 3, **kw))(*xs)
    _assert_bitwise(got, 3)
    tree = _smap(lambda *v: tuple(OPS["all_reduce"](list(v), **kw)), 3)
    alone = _smap(lambda *v: tuple(OPS["all_reduce"]([x], **kw)[0] for x in v), 3)
    engine = lambda f: len(re.findall(r"jcoccl_fused_all_reduce", jax.jit(f).lower(*xs).as_text()))
    assert engine(tree) == 1
    assert engine(alone) == 3
  finally:
    fused_comms.shutdown()


def test_large_packs_pad_each_leaf_with_the_same_bits(monkeypatch):
  """Without the native pack (off CPU), above layout.GATHER_MAX elements the row is built by
  a pad per leaf, not one gather (whose index is a program constant): the same row, so the
  same bits."""
  monkeypatch.setattr(layout, "native_packing", lambda: False)
  monkeypatch.setattr(layout, "GATHER_MAX", 0)
  xs = _leaves(((N, 2 * N, 3), (N, N, 7), (N, 3 * N)), (jnp.float32,) * 3, seed=50)
  for name in ("all_reduce", "reduce_scatter"):
    got = jax.jit(_both(name, 3, compressor=CODECS["int4"], min_bytes=0))(*xs)
    _assert_bitwise(got, 3)


@pytest.mark.skipif(_ffi.native_module("cpu") is None, reason="jcoccl._cpu is not built")
@pytest.mark.parametrize("gather_max", [layout.GATHER_MAX, 0])
def test_native_pack_and_unpack_equal_the_xla_ops(monkeypatch, gather_max):
  """jcoccl_pack_rows / jcoccl_unpack_rows (one call each on CPU) against the XLA-op paths
  (one gather, or a pad per leaf): the same row, zeros in every gap, the same leaves back;
  a vmap batch (count 2), a leaf of whole blocks, two leading rows, three dtypes."""
  spans = [layout.Span(1, 5, 8), layout.Span(2, 3, 4), layout.Span(1, 8, 8), layout.Span(1, 1, 4)]
  width = sum(s.count * s.padded for s in spans) + 4
  rng = np.random.default_rng(0)

  def pack_unpack(parts):
    """(row, leaves back) by one jitted program (not every op compiled alone), traced anew
    (layout's switches are read at trace time); and the program's text."""

    def f(ps):
      row = layout.pack_parts(ps, spans, width)
      return row, layout.unpack_parts(row, spans)

    lowered = jax.jit(f).lower(parts)
    return lowered.compile()(parts), lowered.as_text()

  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    parts = [jnp.asarray(rng.standard_normal((2, s.count * s.length)) + 1, dtype) for s in spans]
    assert layout.native_packing()
    (row, back), text = pack_unpack(parts)
    assert "jcoccl_pack_rows" in text and "jcoccl_unpack_rows" in text
    with monkeypatch.context() as m:
      m.setattr(layout, "native_packing", lambda: False)
      m.setattr(layout, "GATHER_MAX", gather_max)
      (want, want_back), text = pack_unpack(parts)
    assert "jcoccl_pack_rows" not in text and "jcoccl_unpack_rows" not in text
    np.testing.assert_array_equal(bits(row), bits(want))
    assert int(np.sum(np.asarray(row, np.float32) == 0)) == 2 * (3 + 2 * 1 + 3 + 4)  # gaps, tail
    for got, w, p in zip(back, want_back, parts):
      np.testing.assert_array_equal(bits(got), bits(w))
      np.testing.assert_array_equal(bits(got), bits(p))
