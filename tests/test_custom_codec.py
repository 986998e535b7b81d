"""A codec of a user's own, written in its own file with only the public API
(examples/custom_codecs/topk.py), runs wherever a built-in one does: the five ops and their
algorithms, grad/jvp/vmap, error feedback, jcoccl.compress, TOML policies, the training
command line and several processes.

The references are the codec's own row methods (its executable specification) arranged as
each algorithm is defined: one_shot = every rank's payload decoded and summed in rank order,
two_shot = that per destination slice, re-encoded and gathered, and so on. Results must
match them bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jcoccl
from examples.custom_codecs.topk import TopK
from jcoccl import compressors as jc

ROOT = Path(__file__).resolve().parents[1]
N_DEV = 4
P = jax.P


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _x(seed: int, n: int = N_DEV * 512) -> jax.Array:
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (N_DEV, n)) * jnp.exp(2 * jax.random.normal(k2, (N_DEV, n)))
  return x.astype(jnp.float32)


def _run(mesh, body, x, out_spec=None):
  f = jax.jit(
    jax.shard_map(
      lambda v: body(v[0])[None], mesh=mesh, in_specs=P("d"), out_specs=out_spec or P("d")
    )
  )
  return np.asarray(f(x))


def _rt(c, rows):
  """decode(encode(rows)), row by row: what a peer decodes from each row."""
  return c.decode_rows(c.encode_rows(rows), rows.shape[1], rows.dtype)


def _fold(c, rows):
  return c.decode_sum(c.encode_rows(rows), rows.shape[1], rows.dtype)


CODEC = TopK(k=16, block_size=128)


def test_custom_codec_is_a_spec_name_like_a_built_in():
  c = jc.parse("topk:k=16,block_size=128")
  assert c == CODEC and str(c) == "topk:k=16,block_size=128" and jc.parse(str(c)) == c
  assert str(TopK()) == "topk" and "topk" in jc.registered()
  assert CODEC.payload_nbytes(1000, jnp.float32) == 8 * 16 * 6  # 8 blocks of 128
  with pytest.raises(ValueError, match="k must be an int in 1..block_size"):
    jc.parse("topk:k=300,block_size=128")
  with pytest.raises(ValueError, match=r"'topk:kk=3'.*k=INT, block_size=INT"):
    jc.parse("topk:kk=3")


def test_custom_codec_runs_all_reduce_algorithms_bitwise(mesh):
  x = _x(0)
  want_one = np.asarray(_fold(CODEC, x))
  got = _run(
    mesh,
    lambda v: jcoccl.all_reduce(
      v, "d", compressor="topk:k=16,block_size=128", algorithm="one_shot", min_bytes=0
    ),
    x,
  )
  np.testing.assert_array_equal(got, np.broadcast_to(want_one, got.shape))
  # two_shot: slice j of every rank is reduced on rank j, re-encoded, gathered and decoded.
  m = x.shape[1] // N_DEV
  shards = [_fold(CODEC, x[:, j * m : (j + 1) * m]) for j in range(N_DEV)]
  want_two = np.concatenate([np.asarray(_rt(CODEC, s[None])[0]) for s in shards])
  got = _run(
    mesh,
    lambda v: jcoccl.all_reduce(v, "d", compressor=CODEC, algorithm="two_shot", min_bytes=0),
    x,
  )
  np.testing.assert_array_equal(got, np.broadcast_to(want_two, got.shape))


def test_custom_codec_runs_gather_scatter_all_to_all_ppermute_bitwise(mesh):
  x = _x(1)
  n, m = x.shape[1], x.shape[1] // N_DEV
  got = _run(mesh, lambda v: jcoccl.all_gather(v, "d", compressor=CODEC, min_bytes=0), x, P("d"))
  np.testing.assert_array_equal(got.reshape(N_DEV, N_DEV, n)[0], np.asarray(_rt(CODEC, x)))
  got = _run(
    mesh, lambda v: jcoccl.reduce_scatter(v, "d", tiled=True, compressor=CODEC, min_bytes=0), x
  )
  for j in range(N_DEV):
    np.testing.assert_array_equal(got[j], np.asarray(_fold(CODEC, x[:, j * m : (j + 1) * m])))
  got = _run(
    mesh, lambda v: jcoccl.all_to_all(v, "d", 0, 0, tiled=True, compressor=CODEC, min_bytes=0), x
  )
  for j in range(N_DEV):
    want = np.concatenate(
      [np.asarray(_rt(CODEC, x[i : i + 1, j * m : (j + 1) * m])[0]) for i in range(N_DEV)]
    )
    np.testing.assert_array_equal(got[j], want)
  perm = [(i, (i + 1) % N_DEV) for i in range(N_DEV)]
  got = _run(mesh, lambda v: jcoccl.ppermute(v, "d", perm, compressor=CODEC, min_bytes=0), x)
  np.testing.assert_array_equal(got, np.roll(np.asarray(_rt(CODEC, x)), 1, axis=0))


def test_custom_codec_hierarchical_within_its_bound():
  mesh2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = _x(2)
  f = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_reduce(
        v[0, 0], ("a", "b"), compressor=CODEC, algorithm="hierarchical", min_bytes=0
      )[None, None],
      mesh=mesh2,
      in_specs=P("a", "b"),
      out_specs=P("a", "b"),
    )
  )
  got = np.asarray(f(x.reshape(2, 2, -1))).reshape(N_DEV, -1)
  exact = np.asarray(x, np.float64).sum(0)
  # Every value is quantized by top-k at most at three levels; each loses at most the
  # magnitudes it drops, all bounded by the sum of |x| over the ranks.
  assert np.all(np.abs(got - exact) <= 3 * np.abs(np.asarray(x, np.float64)).sum(0) + 1e-6)
  assert np.all(got == got[0])


def test_custom_codec_backends_auto_falls_back_fused_names_the_kernels(mesh):
  x = _x(3)
  got = _run(
    mesh,
    lambda v: jcoccl.all_reduce(
      v, "d", compressor=CODEC, algorithm="one_shot", backend="auto", min_bytes=0
    ),
    x,
  )
  np.testing.assert_array_equal(got[0], np.asarray(_fold(CODEC, x)))
  jcoccl.init(mesh)
  try:
    with pytest.raises(
      ValueError, match=r"topk:k=16,block_size=128 has no native kernel.*load_plugin"
    ):
      _run(
        mesh, lambda v: jcoccl.all_reduce(v, "d", compressor=CODEC, backend="fused", min_bytes=0), x
      )
    # With the engine up, auto still runs the jnp codec through XLA's collectives.
    got = _run(
      mesh,
      lambda v: jcoccl.all_reduce(v, "d", compressor=CODEC, algorithm="one_shot", min_bytes=0),
      x,
    )
    np.testing.assert_array_equal(got[0], np.asarray(_fold(CODEC, x)))
  finally:
    jcoccl.shutdown()


def test_custom_codec_grad_jvp_and_vmap(mesh):
  x = _x(4)
  w = jax.random.normal(jax.random.key(9), x.shape[1:])

  def loss(v):
    return jnp.sum(
      jcoccl.all_reduce(v, "d", compressor=CODEC, algorithm="one_shot", min_bytes=0) * w
    )

  g = _run(mesh, jax.grad(loss), x)
  # As lax.psum's under check_vma: the device-invariant cotangent w passes unchanged.
  np.testing.assert_array_equal(g, np.broadcast_to(np.asarray(w), g.shape))
  # A varying cotangent goes through the dual collective with the same codec.
  gv = _run(
    mesh,
    jax.grad(
      lambda v: jnp.sum(
        jcoccl.all_reduce(v, "d", compressor=CODEC, algorithm="one_shot", min_bytes=0) * v
      )
    ),
    x,
  )
  assert np.isfinite(gv).all() and not np.array_equal(gv, np.asarray(x))
  t = _x(5)

  def jvp(v_and_t):
    v, tv = v_and_t[0], v_and_t[1]
    f = lambda a: jcoccl.all_reduce(a, "d", compressor=CODEC, algorithm="one_shot", min_bytes=0)
    return jnp.stack(jax.jvp(f, (v,), (tv,)))

  fj = jax.jit(
    jax.shard_map(
      lambda vt: jvp(vt[:, 0])[:, None], mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, "d")
    )
  )
  out = np.asarray(fj(jnp.stack([x, t])))
  np.testing.assert_array_equal(out[1, 0], np.asarray(_fold(CODEC, t)))
  # vmap: each batch element bitwise as on its own.
  xb = jnp.stack([x, _x(6)], axis=1)  # [dev, 2, n]
  fv = jax.jit(
    jax.shard_map(
      lambda v: jax.vmap(
        lambda a: jcoccl.all_reduce(a, "d", compressor=CODEC, algorithm="one_shot", min_bytes=0)
      )(v[0])[None],
      mesh=mesh,
      in_specs=P("d"),
      out_specs=P("d"),
    )
  )
  got = np.asarray(fv(xb))
  np.testing.assert_array_equal(got[0, 0], np.asarray(_fold(CODEC, x)))
  np.testing.assert_array_equal(got[0, 1], np.asarray(_fold(CODEC, xb[:, 1])))


def test_custom_codec_with_error_feedback_tracks_the_exact_sum(mesh):
  ef = jcoccl.error_feedback("topk:k=16,block_size=128")
  spec = P("d")

  def step(g, state):
    out, state = ef.all_reduce(g[0], state[0], "d", algorithm="one_shot", min_bytes=0)
    return out[None], state[None]

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
  state = jnp.zeros((N_DEV, 2048), jnp.float32)
  total, exact, first = 0.0, 0.0, None
  for s in range(30):
    g = jax.random.normal(jax.random.key(100 + s), (N_DEV, 2048))
    out, state = run(g, state)
    total, exact = total + np.asarray(out[0], np.float64), exact + np.asarray(g, np.float64).sum(0)
    first = np.abs(total - exact).max() if first is None else first
  # What is still unsent is exactly the residuals: the running sums differ by their sum.
  resid = np.asarray(state, np.float64).sum(0)
  np.testing.assert_allclose(total + resid, exact, atol=1e-3)
  assert np.linalg.norm(total - exact) < np.linalg.norm(exact)


def test_custom_codec_in_jcoccl_compress_and_policy(tmp_path, mesh):
  x = _x(7)

  def step(v):
    return lax.psum(v, "d")

  f = jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P())
  policy = {
    "d": {"all_reduce": "topk:k=16,block_size=128", "min_bytes": 0, "algorithm": "one_shot"}
  }
  got = np.asarray(jax.jit(jcoccl.compress(f, policy))(x.reshape(-1)))
  np.testing.assert_array_equal(got, np.asarray(_fold(CODEC, x)))
  toml = tmp_path / "p.toml"
  toml.write_text(
    textwrap.dedent(
      """
      [codecs]
      modules = ["examples.custom_codecs.topk"]
      [d]
      all_reduce = "topk:k=16,block_size=128"
      min_bytes = 0
      algorithm = "one_shot"
      """
    )
  )
  pol = jcoccl.Policy.from_toml(str(toml), axes=("d",))
  assert pol.compressor("d", "all_reduce") == CODEC
  got = np.asarray(jax.jit(jcoccl.compress(f, pol))(x.reshape(-1)))
  np.testing.assert_array_equal(got, np.asarray(_fold(CODEC, x)))
  bad = tmp_path / "bad.toml"
  bad.write_text('[codecs]\nmodules = ["no_such_codec_module"]\n')
  with pytest.raises(
    ValueError,
    match=r"bad.toml: \[codecs\] modules: cannot import codec module 'no_such_codec_module'",
  ):
    jcoccl.Policy.from_toml(str(bad))


def test_custom_codec_unknown_and_unregistered_errors_say_how_to_register():
  with pytest.raises(
    ValueError, match=r"unknown compressor 'nosuch'; registered: .*topk.*register\('name'\)"
  ):
    jcoccl.Policy.from_dict({"data": {"all_reduce": "nosuch"}})

  class Mine(jc.Compressor):
    granule = 1

    def row_nbytes(self, n, dtype):
      return 4 * n

    def encode_f32(self, x, key):
      return lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)

    def decode_f32(self, buf, n):
      return lax.bitcast_convert_type(buf.reshape(-1, n, 4), jnp.float32)

    lossless = True

  assert str(Mine()).endswith("Mine()")  # prints before it is registered
  with pytest.raises(
    TypeError,
    match=r"compressor: compressor class .*Mine is not registered: decorate it with @jcoccl.compressors.register\('mine'\)",
  ):
    jcoccl.all_reduce(jnp.ones(4), "d", compressor=Mine())
  with pytest.raises(TypeError, match="Broken does not implement row_nbytes, encode_f32"):
    jc.register("broken", type("Broken", (jc.Compressor,), {"granule": 1}))
  with pytest.raises(ValueError, match="spec name 'Bad-Name' must be lower case"):
    jc.register("Bad-Name", Mine)
  jc.register("mine_test", Mine)
  try:
    assert str(Mine()) == "mine_test" and jc.parse("mine_test") == Mine()
    Other = type("Other", (Mine,), {})
    with pytest.warns(UserWarning, match="'mine_test' built .*Mine; it now builds Other"):
      jc.register("mine_test", Other)
    assert type(jc.parse("mine_test")) is Other
  finally:
    jc.unregister("mine_test")
  assert "mine_test" not in jc.registered() and jc.parse("topk") == TopK()


@pytest.mark.slow
def test_custom_codec_trains_from_the_command_line(tmp_path):
  """models.train --codec MODULE --compress data.all_reduce=topk:... trains a tiny model for
  a few steps in a new process, its policy naming the codec, its gradients sent through it.
  The run calibrates at start, as users run it, with tests/mp_train_worker.py's crafted
  table under which the exact op wins on every axis (measuring would take 5 s of CPU and
  could go either way): a named codec is still used."""
  from models.configs.models import TINY_RUN

  run = [a for a in TINY_RUN if a != "--no-calibrate"]
  # mp_train_worker.py runs models.train.main with that stand-in calibration (99 0: no
  # slowed steps); it imports no codec module, so topk is registered by --codec alone.
  cmd = [sys.executable, str(ROOT / "tests" / "mp_train_worker.py"), "99", "0", *run,
         "--codec", "examples.custom_codecs.topk",
         "--compress", "data.all_reduce=topk:k=32", "--compress", "data.min_bytes=0",
         "--steps", "3", "--warmup", "1", "--eval-batches", "1", "--sample-tokens", "0",
         "--no-exact-twin", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
  env = {**os.environ, "JCOCCL_TEST_CALIBRATION": "exact"}
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "topk:k=32" in r.stdout, r.stdout
  assert re.search(r"^loss [\d.]+ -> [\d.]+ \(val [\d.]+\) over steps 0\.\.3", r.stdout, re.M)
  wire = json.loads((tmp_path / "run" / "summary.json").read_text())["wire"]["by_axis"]["data"]
  # The codec is named: it is used, not swapped for the exact op that the table favours
  # (topk:k=32 sends 0.19 of the raw bytes; exact would be ~1).
  assert 0 < wire["compressed"] < 0.5 * wire["uncompressed"], wire
  cal = json.loads((tmp_path / "run" / "calibration.json").read_text())
  assert cal["cost_model"]["source"] == "test: exact wins", cal


def test_custom_codec_module_that_does_not_import_is_a_flag_error(capsys):
  """In this process: the flag is checked by train.parse_args, before any work (the exit
  status of ``python -m models.train`` on a flag error is test_train's
  test_cli_errors_exit_2_without_traceback)."""
  from models import train

  with pytest.raises(SystemExit) as e:
    train.parse_args(["--codec", "no_such_module_x", "--steps", "1"])
  assert e.value.code == 2
  assert "--codec: cannot import codec module 'no_such_module_x'" in capsys.readouterr().err


_MP_WORKER = """
import jcoccl
assert jcoccl.distributed.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
import examples.custom_codecs.topk  # registers "topk" in this process
from jcoccl import compressors as jc
c = jc.parse("topk:k=16,block_size=128")
mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
n = jax.device_count()
x = np.asarray(jax.random.normal(jax.random.key(0), (n, 1024)), np.float32)
xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, jax.P("d")), lambda i: x[i])
for algo in ("one_shot", "two_shot"):
  f = jax.jit(jax.shard_map(lambda v: jcoccl.all_reduce(v[0], "d", compressor="topk:k=16,block_size=128",
              algorithm=algo, min_bytes=0)[None], mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d")))
  got = np.asarray(multihost_utils.process_allgather(f(xs), tiled=True))
  assert (got == got[0]).all(), algo
  if algo == "one_shot":
    want = np.asarray(c.decode_sum(c.encode_rows(jnp.asarray(x)), 1024, jnp.float32))
    assert (got[0] == want).all()
  print("ok", algo, jax.process_index(), flush=True)
"""


def test_custom_codec_across_processes():
  r = subprocess.run(
    [sys.executable, "-m", "jcoccl.launch", "-n", "2", "--devices-per-process", "2", "--",
     sys.executable, "-c", _MP_WORKER],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
  )  # fmt: skip
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert r.stdout.count("ok one_shot") == 2 and r.stdout.count("ok two_shot") == 2


def test_custom_codec_topk_passes_the_conformance_check():
  r = jc.check(TopK(k=4, block_size=64), dtypes=("float32", "bfloat16"), verbose=False)
  assert r, r.table()
  assert r.status("native_match") == {"SKIP"} and r.status("bound") == {"PASS"}


def test_custom_codec_decoder_is_total_and_keeps_nonfinite():
  c = TopK(k=4, block_size=32)
  x = jnp.zeros((1, 64)).at[0, 3].set(jnp.nan).at[0, 40].set(5.0)
  y = c.decode_rows(c.encode_rows(x), 64, jnp.float32)
  assert bool(jnp.all(jnp.isnan(y[0, :32]))) and float(y[0, 40]) == 5.0
  rng = np.random.default_rng(0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(20):
      buf = jnp.asarray(rng.integers(0, 256, (3, c.payload_nbytes(64, jnp.float32)), np.uint8))
      out = c.decode_rows(buf, 64, jnp.float32)
      assert out.shape == (3, 64) and out.dtype == jnp.float32


def _scaled_codec(scale: float) -> type:
  """A codec whose peers decode ``scale * x`` (float32 bytes of it): two scales are two
  codecs with plainly different outputs."""

  class Scaled(jc.Compressor):
    granule = 1

    def row_nbytes(self, n, dtype):
      return 4 * n

    def encode_f32(self, x, key):
      y = lax.bitcast_convert_type(x * np.float32(scale), jnp.uint8)
      return y.reshape(x.shape[0], -1)

    def decode_f32(self, buf, n):
      return lax.bitcast_convert_type(buf.reshape(buf.shape[0], n, 4), jnp.float32)

    def bound_f32(self, x):
      return jnp.full_like(x, jnp.inf)

  Scaled.__qualname__ = f"Scaled{scale:g}"
  return Scaled


def test_custom_codec_reregistered_name_serves_the_new_codec(mesh):
  """Register a name as A, run, register it again as B: B's output, from the program
  jitted with A too (its cache key held only the spec string); unregistered, it fails."""
  from jcoccl._src.ops import params

  x = _x(10, N_DEV * 64)
  body = lambda v: jcoccl.all_reduce(v, "d", compressor="rereg", algorithm="one_shot", min_bytes=0)
  f = jax.jit(
    jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  )
  a, b = _scaled_codec(1.0), _scaled_codec(2.0)
  jc.register("rereg", a)
  try:
    np.testing.assert_array_equal(np.asarray(f(x))[0], np.asarray(_fold(a(), x)))
    with pytest.warns(UserWarning, match="spec name 'rereg' built Scaled1; it now builds Scaled2"):
      jc.register("rereg", b)
    assert type(params.load("rereg")) is b
    want = np.asarray(_fold(b(), x))
    assert not np.array_equal(want, np.asarray(_fold(a(), x)))
    np.testing.assert_array_equal(np.asarray(f(x))[0], want)
    np.testing.assert_array_equal(_run(mesh, body, x)[0], want)
  finally:
    jc.unregister("rereg")
  with pytest.raises(ValueError, match="rereg"):
    f(x)


def _doc_blocks(lang: str) -> list[str]:
  text = (ROOT / "docs" / "custom_compressors.md").read_text()
  return [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith(lang + "\n")]


def test_custom_codec_doc_quickstart_runs(tmp_path, monkeypatch, mesh):
  """docs/custom_compressors.md's codec and policy file, as a user copies them."""
  code, toml = _doc_blocks("python")[0], _doc_blocks("toml")[0]
  assert len(code.splitlines()) < 50
  (tmp_path / "mycodecs.py").write_text(code)
  (tmp_path / "trunc16.toml").write_text(toml)
  # Not on sys.path, not the current directory: `modules` are found next to the TOML file.
  monkeypatch.delitem(sys.modules, "mycodecs", raising=False)
  try:
    pol = jcoccl.Policy.from_toml(str(tmp_path / "trunc16.toml"), axes=("data", "tensor", "pipe"))
    assert sys.modules["mycodecs"].__file__ == str(tmp_path / "mycodecs.py")
    assert str(tmp_path) not in sys.path
    c = pol.compressor("data", "all_reduce")
    assert str(c) == "trunc16" and type(c).__name__ == "Trunc16"
    x = jnp.concatenate([_x(8).reshape(-1)[:1000], jnp.float32([np.nan, np.inf, -np.inf, 0.0])])
    y = c.decode(c.encode(x))
    assert bool(jnp.all((jnp.abs(y - x) <= c.error_bound(x)) | ~jnp.isfinite(x)))
    assert bool(jnp.isnan(y[-4])) and float(y[-3]) == np.inf and float(y[-2]) == -np.inf
    got = _run(mesh, lambda v: jcoccl.all_reduce(v, "d", compressor="trunc16", min_bytes=0), _x(9))
    np.testing.assert_array_equal(got[0], np.asarray(_fold(c, _x(9))))
  finally:
    jc.unregister("trunc16")


def test_custom_codec_sources_one_lookup_rule(tmp_path, monkeypatch):
  """import_codecs (every tool's --codec, TOML modules/plugins): a .py file or a module name
  relative to the base directory, then sys.path; errors name the source and the fix."""
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "srcrule_a.py").write_text("import jcoccl\nLOADED = 1\n")
  (tmp_path / "srcrule_b.py").write_text("LOADED = 2\n")
  for m in ("srcrule_a", "srcrule_b"):
    monkeypatch.delitem(sys.modules, m, raising=False)
  got = jc.import_codecs("sub/srcrule_a.py", "srcrule_b", "json", base_dir=str(tmp_path))
  assert got == [str(tmp_path / "sub" / "srcrule_a.py"), "srcrule_b", "json"]
  assert sys.modules["srcrule_a"].LOADED == 1 and sys.modules["srcrule_b"].LOADED == 2
  assert jc.import_codecs(str(tmp_path / "sub" / "srcrule_a.py")) == got[:1]  # once per file
  monkeypatch.chdir(tmp_path / "sub")
  assert jc.import_codecs("srcrule_a.py") == got[:1]  # relative to the current directory
  with pytest.raises(ValueError, match=r"no codec module file at 'nope\.py'"):
    jc.import_codecs("nope.py")
  with pytest.raises(ValueError, match="cannot import codec module 'nope_mod_x'.*path of its .py"):
    jc.import_codecs("nope_mod_x")
  (tmp_path / "json.py").write_text("")
  with pytest.raises(ValueError, match="imported as module 'json'.*rename the file"):
    jc.import_codecs(str(tmp_path / "json.py"))
